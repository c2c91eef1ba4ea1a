"""Which delta a file gets by default (``--delta auto``): fixed blocks, or content-defined chunks.

The block delta is right for files changed in place (disk images, databases) and costs one
hash pass; the chunked delta (:mod:`pdiffcopy.engine.chunkdelta`) finds bytes that moved
(archives, dumps, logs with data inserted or removed) but writes a whole new copy of the
file. A small sample estimates what each would send, and the chunks are chosen only where
the bytes they would find moved save more than that new copy costs (docs/design.rst,
"Choosing the delta")::

    sizes comparable? --no--> blocks
      -> hash windows spread over both files at the same offsets, in the refinement's pieces
         (the windows start off the block grid: a change at every block's start is not
         sampled more than one anywhere else)
         the pieces that differ are what the blocks would send; less than a new copy costs --> blocks
      -> cut the windows that differ into content-defined chunks, the target's widened
         around them, and look each source chunk up in the target's:
           at the same offset: in place (the blocks keep it too); elsewhere: moved; not found: sent
         the chunks' sends plus the new copy less than the blocks' sends --> chunks, else blocks

The sample reads a few MiB at most, so a file the block delta suits pays next to nothing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import List, Sequence, Tuple

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import ByteRange, split_digests
from pdiffcopy.core.byteranges import merge_ranges
from pdiffcopy.core.hashing import digest_size
from pdiffcopy.core.records import dataclass
from pdiffcopy.core.refine import DEFAULT_PIECE_SIZE, DENSE_SHARE
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.errors import Unsupported

#: Below this ratio of the smaller size to the larger, the files are not two versions of one
#: another that a shift explains: most of the larger one would be sent by either delta.
COMPARABLE_SIZE_RATIO = 0.5

#: Windows sampled, one in each of as many equal strata of the bytes both files have: enough
#: that a change covering a share of the file is seen in about that share of them.
SAMPLE_WINDOWS = 32
#: Bytes of each window: 2 MiB sampled a side, under 1 % of a 256 MiB file's hash pass.
SAMPLE_WINDOW_BYTES = 64 * 1024
#: The windows are compared in the block delta's refinement pieces: what differs at this
#: size is what the block delta sends, a database page rewritten in place costs its own
#: bytes and not the 64 KiB window around it.
SAMPLE_PIECE_BYTES = DEFAULT_PIECE_SIZE
#: Where in its stratum each window starts: the fractional parts of multiples of the golden
#: ratio, spread evenly and never in step with a block size, so that a change at a fixed
#: place of every block (a header at each boundary) is sampled as often as it is there.
GOLDEN_FRACTION = 0.6180339887498949

#: Most windows cut into chunks (those that differ in place, evenly picked): over a hundred
#: chunks counted, enough to tell moved data from new data, and 5 MiB of the target cut.
CUT_WINDOWS = 8
#: Average chunk of the sample: 16 chunks a window, of which the first and the last are not
#: counted (a window starts and ends where the content says nothing).
SAMPLE_AVERAGE = 4 * 1024
#: Slack around a source window where its bytes may have moved to in the target, beyond the
#: size difference (data moved without the size changing: a bounded guess, not a search).
SAMPLE_SLACK = 256 * 1024

#: What the chunked delta's new copy of the file costs, as a share of the file's size in bytes
#: sent: it copies every byte the target keeps into a new temporary and reads the result back,
#: where the blocks write only what they send. On one machine that copy costs more than the
#: blocks sending the whole file; over a link a sent byte costs far more than a copied one.
#: Half: a file mostly moved goes by chunks (what crosses a link stays near rsync's), one half
#: or less moved, or changed in place at any density, by blocks (docs/design.rst).
NEW_COPY_SHARE = 0.5


@dataclass(frozen=True)
class Choice:
    """The delta a file gets, and why (the ``-v`` line)."""

    delta: str  # "blocks" or "chunks"
    reason: str


@dataclass(frozen=True)
class Estimate:
    """What the sample says of the bytes both files have, each a share of the sampled bytes."""

    #: What the block delta sends (its refinement's pieces that differ; a dense block whole).
    blocks: float
    #: What the chunked delta sends: the sample's chunks found nowhere in the target.
    chunks: float
    #: What the chunks find at another offset of the target: data that moved.
    moved: float


def sample_offsets(common_size: int, windows: int = SAMPLE_WINDOWS, window: int = SAMPLE_WINDOW_BYTES,
                   piece: int = SAMPLE_PIECE_BYTES) -> List[int]:
    """Where the ``windows`` sampled windows of ``window`` bytes start, piece-aligned, in order.

    One window in each of ``windows`` equal strata of ``common_size`` bytes, at a place in its
    stratum that no block grid predicts (:data:`GOLDEN_FRACTION`). Too small for that many
    whole windows: none.
    """
    stratum = common_size // windows // piece * piece if windows else 0
    if stratum < window:
        return []
    room = stratum - window
    offsets = []
    for index in range(windows):
        into = int(((index + 1) * GOLDEN_FRACTION) % 1.0 * room) // piece * piece
        offsets.append(index * stratum + into)
    return offsets


def target_window(offset: int, length: int, shift: int, target_size: int) -> ByteRange:
    """The range of the target a source window at ``offset`` may have moved into."""
    start = max(0, offset - abs(shift) - SAMPLE_SLACK)
    end = min(target_size, offset + length + abs(shift) + SAMPLE_SLACK)
    return start, max(0, end - start)


def blocks_share(differing_pieces: Sequence[int], pieces_per_window: int) -> float:
    """The share of the sampled bytes the block delta sends, from each window's differing pieces.

    A window whose pieces differ beyond the refinement's :data:`DENSE_SHARE` counts whole, as
    the refinement moves such a block whole.
    """
    total = len(differing_pieces) * pieces_per_window
    if not total:
        return 0.0
    sent = sum(pieces_per_window if count > DENSE_SHARE * pieces_per_window else count
               for count in differing_pieces)
    return sent / total


def classify(source_chunks: Sequence[cdc.Chunk], target_chunks: Sequence[cdc.Chunk],
             windows: Sequence[ByteRange]) -> Tuple[int, int, int]:
    """(in place, moved, not found): bytes of the windows' chunks, the first and last of each left out.

    A chunk the target holds at the same offset is in place, as the block delta finds it; one
    the target holds elsewhere moved; one it holds nowhere must be sent.
    """
    where = cdc.index(target_chunks)
    at = {(chunk.offset, chunk.digest, chunk.length) for chunk in target_chunks}
    in_place = moved = missing = 0
    for start, length in windows:
        inside = [chunk for chunk in source_chunks if start <= chunk.offset < start + length]
        for chunk in inside[1:-1]:
            if (chunk.offset, chunk.digest, chunk.length) in at:
                in_place += chunk.length
            elif (chunk.digest, chunk.length) in where:
                moved += chunk.length
            else:
                missing += chunk.length
    return in_place, moved, missing


def choose(source: FileEndpoint, target: FileEndpoint, source_size: int, target_size: int,
           method: str) -> Choice:
    """The delta for an existing target of ``target_size`` bytes: see the module's docstring.

    Fails only as the block delta's own reads would (a file gone, a server gone); a side that
    cannot cut chunks (an older server) gets the block delta.
    """
    smaller, larger = sorted((source_size, target_size))
    if smaller < COMPARABLE_SIZE_RATIO * larger:
        return Choice("blocks", f"sizes not comparable ({source_size} and {target_size} bytes)")
    if not (source.hashes_pieces_cheaply() and target.hashes_pieces_cheaply()):
        # A pdiffcopy 1.0.1 server: a sample would cost a whole-file pass, and it cannot cut chunks.
        return Choice("blocks", "an older server cannot sample or cut chunks")
    offsets = sample_offsets(smaller)
    if not offsets:
        return Choice("blocks", "too small to sample")
    windows = [(offset, SAMPLE_WINDOW_BYTES) for offset in offsets]
    ours = source.submit_hashes(windows, SAMPLE_PIECE_BYTES, method)
    theirs = target.submit_hashes(windows, SAMPLE_PIECE_BYTES, method)
    size = digest_size(method)
    ours_digests = split_digests(ours.result(), size)
    theirs_digests = split_digests(theirs.result(), size)
    per_window = SAMPLE_WINDOW_BYTES // SAMPLE_PIECE_BYTES
    differing = [sum(ours_digests[index] != theirs_digests[index]
                     for index in range(window * per_window, (window + 1) * per_window))
                 for window in range(len(windows))]
    in_place_sends = blocks_share(differing, per_window)
    # Bytes only the larger source has are sent by either delta; a new copy is a cost of its own.
    grown = max(0, source_size - target_size)
    blocks_bytes = in_place_sends * smaller + grown
    new_copy = NEW_COPY_SHARE * source_size
    said = f"{in_place_sends:.0%} of sampled bytes differ in place"
    if not any(differing):
        return Choice("blocks", "every sampled piece matches in place")
    if blocks_bytes <= new_copy + grown:
        return Choice("blocks", f"{said}: fewer than a new copy costs")
    try:
        estimate = _cut_sample(source, target, source_size, target_size, windows, differing,
                               in_place_sends)
    except Unsupported:
        return Choice("blocks", f"{said} and a side cannot cut chunks")
    chunks_bytes = estimate.chunks * smaller + grown + new_copy
    said += f", {estimate.moved:.0%} of sampled bytes moved"
    if estimate.moved > 0 and chunks_bytes < blocks_bytes:
        return Choice("chunks", said)
    return Choice("blocks", f"{said}: the chunks would not send less" if estimate.moved
                  else f"{said}: other data")


def _cut_sample(source: FileEndpoint, target: FileEndpoint, source_size: int, target_size: int,
                windows: Sequence[ByteRange], differing: Sequence[int], blocks: float) -> Estimate:
    """The estimate from cutting up to :data:`CUT_WINDOWS` of the windows that differ in place.

    :raises Unsupported: When a side cannot cut chunks.
    """
    changed = [window for window, count in zip(windows, differing) if count]
    picked = [changed[index * len(changed) // CUT_WINDOWS] for index in range(CUT_WINDOWS)] \
        if len(changed) > CUT_WINDOWS else changed
    picked = sorted(set(picked))
    shift = source_size - target_size
    around = merge_ranges(window for window in (target_window(offset, length, shift, target_size)
                                                for offset, length in picked) if window[1])
    # Both sides cut at once, each where its file is.
    with ThreadPoolExecutor(1, thread_name_prefix="sample") as pool:
        cutting = pool.submit(target.cut_chunks, around, SAMPLE_AVERAGE)
        source_chunks = source.cut_chunks(picked, SAMPLE_AVERAGE)
        target_chunks = cutting.result()
    in_place, moved, missing = classify(source_chunks, target_chunks, picked)
    counted = in_place + moved + missing
    # The windows that differ are this share of the sample; the ones that match are in place.
    differ_share = len(changed) / len(windows)
    if not counted:
        return Estimate(blocks, differ_share, 0.0)
    return Estimate(blocks, differ_share * missing / counted, differ_share * moved / counted)


__all__ = ["COMPARABLE_SIZE_RATIO", "Choice", "Estimate", "NEW_COPY_SHARE", "blocks_share", "choose",
           "classify", "sample_offsets", "target_window"]

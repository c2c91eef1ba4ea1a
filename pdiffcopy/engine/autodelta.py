"""Which delta a file gets by default (``--delta auto``): fixed blocks, or content-defined chunks.

The block delta is right for files changed in place (disk images, databases) and costs one
hash pass; the chunked delta (:mod:`pdiffcopy.engine.chunkdelta`) finds bytes that moved
(archives, dumps, logs with data inserted or removed) but writes a whole new temporary. Two
small samples decide, before anything is sent (docs/design.rst, "Choosing the delta")::

    sizes comparable? --no--> blocks
      -> hash a few small pieces spread over both files at the same offsets
         nearly all match --> blocks (the data is where it was)
      -> cut a window of the source at a piece that did not match, and a wider window of the
         target around it, into content-defined chunks
         most of the source's chunks found in the target --> chunks (the data moved)
         else --> blocks (other data: the chunks would find nothing either)

Both samples read a few MiB at most, so a file the block delta suits pays next to nothing.
"""

from __future__ import annotations

from pdiffcopy.core.records import dataclass
from typing import List, Sequence, Tuple

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import ByteRange, split_digests
from pdiffcopy.core.byteranges import merge_ranges
from pdiffcopy.core.hashing import digest_size
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.errors import Unsupported

#: Below this ratio of the smaller size to the larger, the files are not two versions of one
#: another that a shift explains: most of the larger one would be sent by either delta.
COMPARABLE_SIZE_RATIO = 0.5

#: Pieces hashed at the same offsets of both files, spread evenly: enough that a change
#: covering half the file is seen as such (each piece is 1/32 of the answer), few enough
#: that the sample costs nothing measurable beside the block delta's own pass.
SAMPLE_PIECES = 32
#: Bytes of each sampled piece: 64 KiB is 1/16 of a default block, so the whole sample is
#: 2 MiB a side, under 1 % of a 256 MiB file's hash pass.
SAMPLE_PIECE_BYTES = 64 * 1024
#: At or above this fraction of sampled pieces matching in place (28 of 32), the block delta is
#: chosen without cutting anything: sparse edits match 97 %, appended data 100 %. Below it the
#: chunk sample decides (10 ms): 10 % dense edits (85 to 95 % here) find nothing moved and keep
#: the blocks, an insertion half-way through (50 %) finds its second half moved.
BLOCKS_MATCH_ENOUGH = 0.875

#: Windows of the source cut into chunks, at pieces that did not match: two, far apart, so
#: that one local rewrite does not decide for a whole file.
SAMPLE_WINDOWS = 2
#: Bytes of each source window: 64 chunks of :data:`SAMPLE_AVERAGE`, so the two windows'
#: edge chunks (which cannot match: a window starts where the content says nothing) weigh 3 %.
SAMPLE_WINDOW_BYTES = 1024 * 1024
#: Average chunk of the sample: finer than the delta's, for more chunks in a small window.
SAMPLE_AVERAGE = 16 * 1024
#: Slack around a source window where its bytes may have moved to in the target, beyond the
#: size difference (data moved without the size changing: a bounded guess, not a search).
SAMPLE_SLACK = 256 * 1024
#: At or above this fraction of the source windows' bytes found among the target's chunks,
#: the data moved and the chunked delta is chosen: shifted data finds 90 to 100 %, unrelated
#: data 0 % (measured in docs/design.rst).
CHUNKS_FOUND_ENOUGH = 0.5


@dataclass(frozen=True)
class Choice:
    """The delta a file gets, and why (the ``-v`` line)."""

    delta: str  # "blocks" or "chunks"
    reason: str


def sample_offsets(common_size: int, pieces: int = SAMPLE_PIECES, piece: int = SAMPLE_PIECE_BYTES) -> List[int]:
    """Offsets of up to ``pieces`` whole pieces spread evenly over ``common_size`` bytes, piece-aligned."""
    count = common_size // piece
    if count <= 0:
        return []
    if count <= pieces:
        return [index * piece for index in range(count)]
    return sorted({(index * count // pieces) * piece for index in range(pieces)})


def target_window(offset: int, length: int, shift: int, target_size: int) -> ByteRange:
    """The range of the target a source window at ``offset`` may have moved into."""
    start = max(0, offset - abs(shift) - SAMPLE_SLACK)
    end = min(target_size, offset + length + abs(shift) + SAMPLE_SLACK)
    return start, max(0, end - start)


def found_fraction(source_chunks: Sequence[cdc.Chunk], target_chunks: Sequence[cdc.Chunk]) -> float:
    """The fraction of the source chunks' bytes that the target's chunks hold too."""
    where = cdc.index(target_chunks)
    total = sum(chunk.length for chunk in source_chunks)
    found = sum(chunk.length for chunk in source_chunks if (chunk.digest, chunk.length) in where)
    return found / total if total else 0.0


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
    if len(offsets) < SAMPLE_PIECES:
        return Choice("blocks", "too small to sample")
    ranges = [(offset, SAMPLE_PIECE_BYTES) for offset in offsets]
    ours = source.submit_hashes(ranges, SAMPLE_PIECE_BYTES, method)
    theirs = target.submit_hashes(ranges, SAMPLE_PIECE_BYTES, method)
    size = digest_size(method)
    pairs = zip(split_digests(ours.result(), size), split_digests(theirs.result(), size))
    differing = [offset for offset, (one, other) in zip(offsets, pairs) if one != other]
    matching = 1 - len(differing) / len(offsets)
    if matching >= BLOCKS_MATCH_ENOUGH:
        return Choice("blocks", f"{matching:.0%} of sampled blocks match in place")
    windows = _windows(differing, source_size)
    shift = source_size - target_size
    try:
        source_chunks = source.cut_chunks(windows, SAMPLE_AVERAGE)
        target_chunks = target.cut_chunks(
            merge_ranges(window for window in (target_window(offset, length, shift, target_size)
                                               for offset, length in windows) if window[1]),
            SAMPLE_AVERAGE)
    except Unsupported:
        return Choice("blocks", f"{matching:.0%} of sampled blocks match in place and a side cannot cut chunks")
    found = found_fraction(source_chunks, target_chunks)
    if found >= CHUNKS_FOUND_ENOUGH:
        return Choice("chunks", f"{matching:.0%} of sampled blocks match in place, "
                                f"{found:.0%} of sampled chunks found moved")
    return Choice("blocks", f"{matching:.0%} of sampled blocks match in place, "
                            f"{found:.0%} of sampled chunks found moved: other data")


def _windows(differing: Sequence[int], source_size: int) -> List[ByteRange]:
    """Up to :data:`SAMPLE_WINDOWS` source windows at differing pieces, far apart, not overlapping."""
    picks = [differing[index * len(differing) // SAMPLE_WINDOWS] for index in range(SAMPLE_WINDOWS)]
    windows: List[Tuple[int, int]] = []
    for offset in sorted(set(picks)):
        start = max(offset, windows[-1][0] + windows[-1][1]) if windows else offset
        length = min(SAMPLE_WINDOW_BYTES, source_size - start)
        if length > 0:
            windows.append((start, length))
    return windows


__all__ = ["BLOCKS_MATCH_ENOUGH", "CHUNKS_FOUND_ENOUGH", "COMPARABLE_SIZE_RATIO", "Choice", "choose",
           "found_fraction", "sample_offsets", "target_window"]

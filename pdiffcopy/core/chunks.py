"""Content-defined chunks: the plan of the shift-tolerant delta.

Fixed blocks find a change only where it sits; a byte inserted near the start of a file shifts
every block after it, and a fixed-block delta then resends the whole file. Content-defined
chunking (FastCDC, through the well-kept Cython binding ``pyfastcdc``) cuts where the content
says, so after an insertion the cuts fall on the same bytes again one chunk later. Both sides
cut their file, the side that writes learns which of the source's chunks its old copy already
holds (at any offset), and only the others cross the link.

Everything here works on bytes in memory (a mapped file is fine); reading and sending are the
engine's and the transport's.
"""

from __future__ import annotations

import math
import struct
from pdiffcopy.core.records import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple, Union

import xxhash

from pdiffcopy.errors import UsageError

#: Average chunk size of the first pass over files up to 512 MiB (larger ones:
#: :func:`coarse_average`). The whole file's chunk list crosses the link, 12 bytes a chunk,
#: and a change costs about one and a half chunks for the finer pass to cut again, so for a
#: file of S bytes and a few edits the best average is near sqrt(8 * S).
DEFAULT_AVERAGE = 64 * 1024
#: Average chunk size of the last, finest pass over what the passes before found no match for.
#: An insertion costs about one and a half chunks of the pass that finds it: 256-byte chunks
#: make that about 400 bytes. Their list (12 bytes per 256) covers only what the 2 KiB pass
#: left around each change, never the whole file. Measured on 1 GiB with 63 one-byte
#: insertions (passes of 16 KiB and 2 KiB before it): 1 KiB chunks sent 92 KiB of data,
#: 512 bytes 53 KiB, 256 bytes 30 KiB, each for a last list of 2 to 8 KiB.
FINE_AVERAGE = 256
#: Each refining pass cuts chunks this many times smaller than the pass before, down to
#: :data:`FINE_AVERAGE`. A pass's list covers what the pass before left unmatched, about one
#: and a half of its chunks a change, so it costs 12 x 1.5 x this factor bytes a change: going
#: from 128 KiB straight to 1 KiB chunks listed 128 x 18 bytes a change (123 KB for 1 GiB with
#: 63 one-byte insertions), through 16 KiB and 2 KiB 3 x 8 x 18 (about 25 KB), for a round trip
#: a pass.
REFINE_FACTOR = 8
#: A send (or an unused range of the old target) this many chunks of the pass that left it long
#: found nothing at all of the other file inside it: most likely data only one side has. Passes
#: finer than :data:`LISTED_EVERYWHERE_AVERAGE` leave such ranges out: their lists cost more
#: than 1 % of what they cover (12 bytes per 256 is 4.7 %), so new data pays for lists of
#: 16 KiB and 2 KiB chunks (0.7 %, less than the 1 KiB pass before them cost) and not for one
#: of 256-byte chunks.
NEW_DATA_CHUNKS = 16
#: Passes of at least this average cut every range left unmatched, short or long: edits a few
#: KiB apart leave long ranges that chunks of 1 or 2 KiB still find most of.
LISTED_EVERYWHERE_AVERAGE = 1024
#: The averages a chunk list may be asked for: pyfastcdc's bounds (its minimum, a quarter of the
#: average, must be at least 64 bytes; its maximum, four times, at most 16 MiB).
MIN_AVERAGE = 256
MAX_AVERAGE = 4 * 1024 * 1024
#: FastCDC's bounds around the average, as its paper and borg use them (a quarter, four times).
MIN_FACTOR, MAX_FACTOR = 4, 4
#: Bytes of a chunk's digest on the wire. 64 bits of xxh3: a false match between two chunks
#: is unlikely (2**-64 a pair) and not silent: the whole-file verification catches it.
DIGEST_BYTES = 8
_ENTRY = struct.Struct("<I8s")


@dataclass(frozen=True)
class Chunk:
    """A cut of a file: where it starts, how long it is, the digest of its bytes."""

    offset: int
    length: int
    digest: bytes


@dataclass(frozen=True)
class Copy:
    """Source bytes [source_offset, +length) are already in the old target at target_offset."""

    source_offset: int
    target_offset: int
    length: int


@dataclass(frozen=True)
class Send:
    """Source bytes [source_offset, +length) must cross the link."""

    source_offset: int
    length: int


Step = Union[Copy, Send]


def cut(data: "bytes | memoryview", offset: int = 0, average: int = DEFAULT_AVERAGE) -> List[Chunk]:
    """The content-defined chunks of `data`, whose first byte is at `offset` of its file."""
    from pyfastcdc import FastCDC  # imported here: only the shift-tolerant mode needs it

    chunker = FastCDC(avg_size=average, min_size=average // MIN_FACTOR, max_size=average * MAX_FACTOR)
    view = memoryview(data)
    return [Chunk(offset + piece.offset, piece.length,
                  xxhash.xxh3_64_digest(view[piece.offset:piece.offset + piece.length]))
            for piece in chunker.cut_buf(view)]


def coarse_average(size: int) -> int:
    """The first pass's average chunk size for a file of ``size`` bytes.

    The power of two nearest sqrt(8 * size), but not below :data:`DEFAULT_AVERAGE`: 64 KiB up
    to 512 MiB, 128 KiB for 1 GiB, 256 KiB for 4 GiB. The list of a 1 GiB file then costs
    79 KiB instead of 157; what a change costs is cut again by the finer pass. Both sides
    must cut with the same average: the caller computes it once for both.
    """
    if size <= 0:
        return DEFAULT_AVERAGE
    nearest = 1 << int(math.log2(8 * size) / 2 + 0.5)  # (halves round up: 1 GiB gets 128 KiB)
    return max(DEFAULT_AVERAGE, min(MAX_AVERAGE, nearest))


def refining_averages(coarse: int) -> List[int]:
    """The averages of the passes after a first pass of ``coarse``: :data:`REFINE_FACTOR` times
    smaller each, the last :data:`FINE_AVERAGE` (after 128 KiB: 16 KiB, 2 KiB, 256 bytes)."""
    averages: List[int] = []
    average = coarse
    while average > FINE_AVERAGE:
        average = max(FINE_AVERAGE, average // REFINE_FACTOR)
        averages.append(average)
    return averages


def check_average(average: int) -> int:
    """``average`` if a chunk list may be cut with it.

    :raises UsageError: For an average outside :data:`MIN_AVERAGE` to :data:`MAX_AVERAGE`.
    """
    if isinstance(average, bool) or not isinstance(average, int) or not MIN_AVERAGE <= average <= MAX_AVERAGE:
        raise UsageError(f"Invalid chunk average: {average!r} (expected {MIN_AVERAGE} to {MAX_AVERAGE} bytes)")
    return average


def encode(chunks: Sequence[Chunk]) -> bytes:
    """The chunks on the wire: length and digest each; offsets follow from the lengths."""
    return b"".join(_ENTRY.pack(chunk.length, chunk.digest) for chunk in chunks)


def decode(payload: bytes, offset: int = 0) -> List[Chunk]:
    """The inverse of :func:`encode`, for chunks that start at `offset`."""
    if len(payload) % _ENTRY.size:
        raise ValueError("Chunk list of %d bytes is not a whole number of %d-byte entries"
                         % (len(payload), _ENTRY.size))
    chunks = []
    for length, digest in _ENTRY.iter_unpack(payload):
        if length == 0:
            raise ValueError("Chunk list holds an empty chunk")
        chunks.append(Chunk(offset, length, digest))
        offset += length
    return chunks


def decode_ranges(payload: bytes, ranges: Sequence[Tuple[int, int]]) -> List[Chunk]:
    """The chunks of several ranges, their lists concatenated in the ranges' order.

    :raises ValueError: When the lengths do not add up to exactly each range.
    """
    entries = decode(payload)
    chunks: List[Chunk] = []
    position = 0
    for offset, length in ranges:
        end, here = offset + length, offset
        while here < end:
            if position >= len(entries):
                raise ValueError("Chunk list ends before the ranges do")
            entry = entries[position]
            position += 1
            chunks.append(Chunk(here, entry.length, entry.digest))
            here += entry.length
        if here != end:
            raise ValueError(f"Chunk list does not end at the end of the range {offset}+{length}")
    if position != len(entries):
        raise ValueError("Chunk list holds more chunks than the ranges")
    return chunks


def index(chunks: Iterable[Chunk]) -> Dict[tuple, int]:
    """Where each (digest, length) of the old target's chunks sits (the first such chunk)."""
    where: Dict[tuple, int] = {}
    for chunk in chunks:
        where.setdefault((chunk.digest, chunk.length), chunk.offset)
    return where


def plan(source: Iterable[Chunk], target_index: Dict[tuple, int]) -> List[Step]:
    """The steps that build the source from the old target plus sent bytes, adjacent ones merged."""
    steps: List[Step] = []
    for chunk in source:
        found = target_index.get((chunk.digest, chunk.length))
        last = steps[-1] if steps else None
        if found is None:
            if isinstance(last, Send) and last.source_offset + last.length == chunk.offset:
                steps[-1] = Send(last.source_offset, last.length + chunk.length)
            else:
                steps.append(Send(chunk.offset, chunk.length))
        elif (isinstance(last, Copy) and last.source_offset + last.length == chunk.offset
              and last.target_offset + last.length == found):
            steps[-1] = Copy(last.source_offset, last.target_offset, last.length + chunk.length)
        else:
            steps.append(Copy(chunk.offset, found, chunk.length))
    return steps


def target_gaps(steps: Iterable[Step], target_size: int) -> List[Tuple[int, int]]:
    """The ranges of the old target no copy uses: where the finer pass looks for matches."""
    used = sorted((step.target_offset, step.length) for step in steps if isinstance(step, Copy))
    gaps: List[Tuple[int, int]] = []
    position = 0
    for offset, length in used:
        if offset > position:
            gaps.append((position, offset - position))
        position = max(position, offset + length)
    if position < target_size:
        gaps.append((position, target_size - position))
    return gaps


def sends(steps: Iterable[Step]) -> List[Tuple[int, int]]:
    """The source ranges the steps send, as (offset, length)."""
    return [(step.source_offset, step.length) for step in steps if isinstance(step, Send)]


def refine(steps: Sequence[Step], finer: Sequence[Step]) -> List[Step]:
    """The coarse ``steps`` with each of their sends replaced by the ``finer`` steps inside it.

    ``finer`` covers exactly the coarse sends it has chunks of (a plan of their finer chunks;
    a send without any stays a send); neighbours that
    continue each other are merged as :func:`plan` merges them.
    """
    by_offset = sorted(finer, key=lambda step: step.source_offset)
    merged: List[Step] = []
    position = 0
    for step in steps:
        if isinstance(step, Send):
            end = step.source_offset + step.length
            inside = []
            while position < len(by_offset) and by_offset[position].source_offset < end:
                inside.append(by_offset[position])
                position += 1
            if not inside:
                inside = [step]  # a send the finer pass left out (new data): sent as it is
            elif sum(piece.length for piece in inside) != step.length:
                raise ValueError(f"The finer steps do not cover the send at {step.source_offset}")
        else:
            inside = [step]
        for piece in inside:
            _append(merged, piece)
    return merged


def merged(steps: Iterable[Step]) -> List[Step]:
    """``steps`` (in source order) with neighbours that continue each other merged, as :func:`plan` merges them."""
    result: List[Step] = []
    for step in steps:
        _append(result, step)
    return result


def _append(steps: List[Step], step: Step) -> None:
    """Add ``step``, merged into the last one when it continues it."""
    last = steps[-1] if steps else None
    if isinstance(step, Send) and isinstance(last, Send) and last.source_offset + last.length == step.source_offset:
        steps[-1] = Send(last.source_offset, last.length + step.length)
    elif (isinstance(step, Copy) and isinstance(last, Copy) and last.source_offset + last.length == step.source_offset
          and last.target_offset + last.length == step.target_offset):
        steps[-1] = Copy(last.source_offset, last.target_offset, last.length + step.length)
    else:
        steps.append(step)


def bytes_to_send(steps: Iterable[Step]) -> int:
    """How many source bytes the steps send over the link."""
    return sum(step.length for step in steps if isinstance(step, Send))

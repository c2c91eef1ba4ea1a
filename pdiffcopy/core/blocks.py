"""The pure core: block plans, segments and the delta between two hash lists.

Nothing here opens a file or a connection. A file of ``size`` bytes is cut
into fixed-size blocks; blocks are grouped into *segments*, the unit of work
that one hashing process or one HTTP request handles. Comparing the source's
and the target's digests of a segment yields the byte ranges to transfer.

Why fixed-size blocks and not rsync's rolling checksum: the files pdiffcopy
is built for (database files, VM images) change in place, so data never
shifts; fixed blocks let both sides hash in parallel at disk speed and need
no rolling search.
"""

from __future__ import annotations

import re
from pdiffcopy.core.records import dataclass
from typing import Iterable, Iterator, List, Sequence, Tuple

from pdiffcopy.errors import UsageError

#: Default block size. Measured on the 1 GiB benchmark (docs/benchmarks.rst):
#: 1 MiB keeps per-block overhead (hash calls, digests, range headers) well
#: under 1 % of the time while a 10 % scattered change still moves only the
#: blocks it touches; rsync and the original pdiffcopy users know it too.
DEFAULT_BLOCK_SIZE = 1024 * 1024

#: Smallest block size accepted: below 1 KiB the digests and range headers
#: outweigh the data they describe.
MIN_BLOCK_SIZE = 1024

#: Largest block size accepted: every hashing process and transfer holds one
#: block buffer, so an absurd value would exhaust memory.
MAX_BLOCK_SIZE = 256 * 1024 * 1024

#: Target size of a segment, the unit of parallel work. 64 MiB gives a 1 GiB
#: file 16 segments, enough to keep every core busy and to start transfers
#: while hashing goes on, and few enough that per-request overhead is small.
DEFAULT_SEGMENT_SIZE = 64 * 1024 * 1024

#: A byte range: (offset, length).
ByteRange = Tuple[int, int]


#: Whole numbers of bytes, K, M, G or T (1024-based, with or without "iB"), as parse_size reads them.
_PLAIN_SIZE = re.compile(r"([0-9]+) *([KMGT])?(?:iB)?", re.IGNORECASE)


def parse_block_size(value: "int | str") -> int:
    """Parse a block size such as ``5K``, ``1MiB`` or ``4M`` into bytes.

    K, M and G are 1024-based, as in dd and rsync (``5K`` is 5120 bytes);
    explicit ``KB``/``MB`` are 1000-based.

    :param value: An integer number of bytes or a size expression.
    :returns: The block size in bytes.
    :raises UsageError: For zero, negative, unparseable or absurd sizes.
    """
    if isinstance(value, bool):
        raise UsageError(f"Invalid block size: {value!r}")
    plain = None if isinstance(value, int) else _PLAIN_SIZE.fullmatch(str(value).strip())
    if isinstance(value, int):
        size = value
    elif plain:  # the usual spellings (the default "1MiB"), without importing humanfriendly
        number, unit = plain.groups()
        size = int(number) * 1024 ** (" KMGT".index(unit.upper()) if unit else 0)
    else:
        from humanfriendly import InvalidSize, parse_size

        text = str(value).strip()
        try:
            # humanfriendly reads "5K" as 5000 unless told binary=True; a
            # trailing "B" ("5KB") keeps its decimal meaning on purpose.
            binary = not text.upper().endswith(("KB", "MB", "GB", "TB"))
            if re.fullmatch(r"[0-9]*\.[0-9]*", text):
                raise ValueError("a fraction of a byte")  # humanfriendly would round it down
            parsed = parse_size(text, binary=binary)
            if parsed != int(parsed):
                raise ValueError("not a whole number of bytes")
            size = int(parsed)
        except (InvalidSize, ValueError):
            raise UsageError(f"Invalid block size: {value!r} (expected e.g. 64K, 1MiB, 4M)") from None
    if size < MIN_BLOCK_SIZE or size > MAX_BLOCK_SIZE:
        raise UsageError(
            f"Invalid block size: {value!r} (must be between "
            f"{MIN_BLOCK_SIZE} bytes and {MAX_BLOCK_SIZE // (1024 * 1024)} MiB)"
        )
    return int(size)


@dataclass(frozen=True)
class Segment:
    """A run of whole blocks of a file, hashed and transferred as one unit."""

    #: Position of the segment in the plan (0-based).
    index: int
    #: Byte offset of the first block; always a multiple of the block size.
    offset: int
    #: Length in bytes; a multiple of the block size except for the last segment.
    length: int
    #: Number of the first block in the file.
    first_block: int
    #: Number of blocks in the segment.
    block_count: int


@dataclass(frozen=True)
class BlockPlan:
    """How a file of a given size is cut into blocks and segments."""

    size: int
    block_size: int
    segment_size: int = DEFAULT_SEGMENT_SIZE

    def __post_init__(self) -> None:
        if self.size < 0:
            raise UsageError(f"Invalid file size: {self.size}")
        if self.block_size <= 0:
            raise UsageError(f"Invalid block size: {self.block_size}")

    @property
    def block_count(self) -> int:
        """Number of blocks; the last one may be partial."""
        return -(-self.size // self.block_size)

    @property
    def blocks_per_segment(self) -> int:
        """Whole blocks per segment (at least one)."""
        return max(1, self.segment_size // self.block_size)

    def block_range(self, block: int) -> ByteRange:
        """The (offset, length) of block number ``block``."""
        offset = block * self.block_size
        return offset, min(self.block_size, self.size - offset)

    @property
    def segment_count(self) -> int:
        """Number of segments (none for an empty file)."""
        return -(-self.block_count // self.blocks_per_segment)

    def segment(self, index: int) -> Segment:
        """Segment number ``index`` (0-based, below :attr:`segment_count`)."""
        per_segment = self.blocks_per_segment
        first = index * per_segment
        count = min(per_segment, self.block_count - first)
        offset = first * self.block_size
        return Segment(index, offset, min(count * self.block_size, self.size - offset), first, count)

    def segments(self) -> List[Segment]:
        """Every segment of the file, in order (none for an empty file)."""
        return list(self.segment_sequence())

    def segment_sequence(self) -> "SegmentSequence":
        """Every segment of the file, in order, each made when asked for: a huge sparse file's
        hundreds of thousands of segments are never all held at once."""
        return SegmentSequence(self)


class SegmentSequence(Sequence[Segment]):
    """The segments of a :class:`BlockPlan` as a read-only sequence that makes each one on demand."""

    def __init__(self, plan: BlockPlan) -> None:
        self.plan = plan

    def __len__(self) -> int:
        return self.plan.segment_count

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self.plan.segment(i) for i in range(*index.indices(len(self)))]
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError("segment index out of range")
        return self.plan.segment(index)

    def __iter__(self) -> Iterator[Segment]:
        return (self.plan.segment(index) for index in range(len(self)))


def split_digests(digests: bytes, digest_size: int) -> List[bytes]:
    """Cut a concatenation of fixed-size digests into a list.

    :raises ValueError: When the length is not a multiple of ``digest_size``.
    """
    if digest_size <= 0 or len(digests) % digest_size:
        raise ValueError(f"{len(digests)} bytes of digests is not a multiple of {digest_size}")
    return [digests[i : i + digest_size] for i in range(0, len(digests), digest_size)]


def differing_digests(ours: bytes, theirs: bytes, digest_size: int) -> Iterator[int]:
    """The positions of the digests that differ between two concatenations of as many
    fixed-size digests (equal ones, most often, cost one comparison: no digest is cut out)."""
    if ours == theirs:
        return
    first, second = memoryview(ours), memoryview(theirs)
    for position, start in enumerate(range(0, len(ours), digest_size)):
        if first[start : start + digest_size] != second[start : start + digest_size]:
            yield position


def changed_blocks(
    segment: Segment, source_digests: "Sequence[bytes] | bytes", target_digests: "Sequence[bytes] | bytes | None",
    digest_size: int = 0,
) -> List[int]:
    """The block numbers of ``segment`` whose digests differ.

    :param segment: The segment both digest lists describe.
    :param source_digests: One digest per block of the segment (or, with ``digest_size``,
                           their concatenation).
    :param target_digests: The target's digests of the same blocks, or
                           :data:`None` when the target has no data there.
    :param digest_size: The size of one digest when both are concatenations.
    :returns: Absolute block numbers, ascending.
    """
    if digest_size:
        if len(source_digests) != segment.block_count * digest_size:
            raise ValueError("source digest count does not match the segment")
        if target_digests is None:
            return list(range(segment.first_block, segment.first_block + segment.block_count))
        if len(target_digests) != len(source_digests):
            raise ValueError("target digest count does not match the segment")
        return [segment.first_block + position for position in
                differing_digests(source_digests, target_digests, digest_size)]  # type: ignore[arg-type]
    if len(source_digests) != segment.block_count:
        raise ValueError("source digest count does not match the segment")
    if target_digests is None:
        return list(range(segment.first_block, segment.first_block + segment.block_count))
    if len(target_digests) != segment.block_count:
        raise ValueError("target digest count does not match the segment")
    return [
        segment.first_block + i
        for i, (ours, theirs) in enumerate(zip(source_digests, target_digests))
        if ours != theirs
    ]


def coalesce(plan: BlockPlan, blocks: Iterable[int], max_length: int) -> List[ByteRange]:
    """Merge adjacent block numbers into byte ranges of at most ``max_length``.

    Fewer, larger ranges mean fewer range headers, system calls and requests.

    :param plan: The plan the block numbers belong to.
    :param blocks: Block numbers in ascending order.
    :param max_length: Upper bound of a range's length (at least one block).
    :returns: (offset, length) pairs in ascending order, covering exactly the blocks.
    """
    ranges: List[ByteRange] = []
    for block in blocks:
        offset, length = plan.block_range(block)
        if ranges:
            last_offset, last_length = ranges[-1]
            if last_offset + last_length == offset and last_length + length <= max_length:
                ranges[-1] = (last_offset, last_length + length)
                continue
        ranges.append((offset, length))
    return ranges


#: Most ranges one request names. A ``Range`` header of 200 ranges stays
#: under 8 KiB, the header size gunicorn accepts by default.
MAX_RANGES_PER_REQUEST = 200


def batch_ranges(ranges: Iterable[ByteRange], max_bytes: int,
                 max_count: int = MAX_RANGES_PER_REQUEST) -> Iterator[List[ByteRange]]:
    """Group ranges into batches of at most ``max_bytes`` and ``max_count`` ranges.

    Each batch travels as one request. A range longer than ``max_bytes``
    travels alone.
    """
    batch: List[ByteRange] = []
    total = 0
    for offset, length in ranges:
        if batch and (total + length > max_bytes or len(batch) >= max_count):
            yield batch
            batch, total = [], 0
        batch.append((offset, length))
        total += length
    if batch:
        yield batch


def split_ranges(ranges: Iterable[ByteRange], max_length: int) -> List[ByteRange]:
    """Cut ranges longer than ``max_length`` into consecutive pieces of at most that length."""
    pieces: List[ByteRange] = []
    for offset, length in ranges:
        while length > 0:
            piece = min(length, max_length)
            pieces.append((offset, piece))
            offset += piece
            length -= piece
    return pieces


@dataclass(frozen=True)
class Similarity:
    """How much of a target already matches its source.

    ``changed_bytes`` are the bytes the delta that ran sent (with a dry run: would send), so
    the index means the same whichever delta ran.
    """

    total_blocks: int
    changed_blocks: int
    total_bytes: int
    changed_bytes: int

    @property
    def index(self) -> float:
        """The similarity index: the share of the source's bytes that did not have to be sent, 0..100."""
        if self.total_bytes == 0:
            return 100.0
        return 100.0 * (self.total_bytes - self.changed_bytes) / self.total_bytes


def tree_digest_input(size: int, block_size: int, method: str, digests: Iterable[bytes]) -> bytes:
    """The bytes a whole-file digest is computed over.

    The whole-file digest is a hash over the file's parameters and every
    block digest in order (a one-level hash tree), so both sides can compute
    it from the block digests they already have instead of reading the file
    once more.
    """
    return tree_digest_header(size, block_size, method) + b"".join(digests)


def tree_digest_header(size: int, block_size: int, method: str) -> bytes:
    """What the whole-file digest's input starts with (:func:`tree_digest_input`): the block digests
    follow in order, so the digest can be folded a segment at a time."""
    return f"pdiffcopy-tree:{method}:{block_size}:{size}:".encode()

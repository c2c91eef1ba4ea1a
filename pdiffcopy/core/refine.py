"""Sub-block refinement: which small pieces of the changed blocks really differ (pure, no I/O).

The block comparison finds the blocks (1 MiB by default) whose digests differ.
A database page rewritten in place changes a few bytes of such a block; moving
the whole block moves a thousand times what changed. So the changed ranges
are hashed again on both sides, in pieces of :data:`DEFAULT_PIECE_SIZE`, and
only the pieces whose digests differ move. The engine
(:mod:`pdiffcopy.engine.segments`) does the hashing; this module says which
pieces move, how they are merged into ranges, and when refining stops paying.
"""

from __future__ import annotations

from pdiffcopy.core.records import dataclass
from typing import List, Sequence

from pdiffcopy.core.blocks import MIN_BLOCK_SIZE, ByteRange, parse_block_size, split_digests, split_ranges
from pdiffcopy.errors import UsageError

#: Default piece size. Measured on 256 MiB over a 200 Mbit link (docs/benchmarks.rst):
#: with 16 bytes changed in 10 % of the 1 MiB blocks, a changed block costs one piece
#: plus its piece digests (16 bytes per piece with xxh3_128): 4 KiB pieces move 8 KiB
#: per changed block, 16 KiB pieces 17 KiB, 1 KiB pieces 17 KiB (the digests win).
DEFAULT_PIECE_SIZE = 4 * 1024

#: Bytes of changed blocks refined (in one step) before the engine judges whether refining
#: pays. 2 MiB is one hash request per side and 8 KiB of piece digests; 8 MiB (four
#: steps) made a 1 GiB file with 10 % of its blocks rewritten 11 % slower on loopback
#: (benchmarks/remote_delta.py), where refining a dense rewrite is pure cost.
REFINE_PROBE_BYTES = 2 * 1024 * 1024

#: Refining stops paying when the pieces that still differ are more than this share
#: of the bytes refined (a block rewritten almost everywhere: a dense change).
#: The same share decides, range by range, to move a changed range whole.
DENSE_SHARE = 0.75

#: Pieces whose gap is at most this many bytes are moved as one range: a part of
#: a multipart body costs about 100 bytes of headers and a Range header entry 20.
PART_OVERHEAD_BYTES = 128


def check_piece_size(value: "int | str", block_size: int) -> int:
    """Parse ``--piece-size`` (``4K``, ``16KiB``, ``0`` for off) for blocks of ``block_size``.

    :returns: The piece size in bytes, or 0 (refinement off).
    :raises UsageError: For a size that is not 0 and does not cut a block into
                        several whole pieces of at least 1 KiB.
    """
    if isinstance(value, str) and value.strip() == "0":
        return 0
    if value == 0 and not isinstance(value, bool):
        return 0
    try:
        size = parse_block_size(value)
    except UsageError:
        raise UsageError(f"Invalid piece size: {value!r} (expected 0 for off, or e.g. 4K, 16KiB; "
                         f"at least {MIN_BLOCK_SIZE} bytes)") from None
    if size >= block_size or block_size % size:
        raise UsageError(f"Invalid piece size: {value!r} (must divide the block size, {block_size} "
                         f"bytes, into several pieces; or 0 for off)")
    return size


def resolve_piece_size(value: "int | str | None", block_size: int) -> int:
    """The piece size of a sync's options: ``value`` checked (:func:`check_piece_size`), or for None
    the default where it divides ``block_size`` (else 0: a small ``-b`` alone turns refinement off).
    """
    if value is None:
        return usable_piece_size(block_size, DEFAULT_PIECE_SIZE)
    return check_piece_size(value, block_size)


def usable_piece_size(block_size: int, piece_size: int) -> int:
    """The piece size refinement uses with ``block_size`` blocks: ``piece_size``, or 0 (off).

    Off when ``piece_size`` is 0 or does not cut a block into several whole
    pieces: the piece hashes must start where the changed blocks start.
    """
    if piece_size < MIN_BLOCK_SIZE or piece_size >= block_size or block_size % piece_size:
        return 0
    return piece_size


def differing_pieces(ranges: Sequence[ByteRange], piece_size: int, source_digests: bytes,
                     target_digests: bytes, digest_size: int, max_length: int) -> List[ByteRange]:
    """The pieces of ``ranges`` whose digests differ, range by range, merged into ranges to move.

    :param ranges: Changed ranges, each starting at a multiple of ``piece_size``,
                   in ascending order and disjoint.
    :param source_digests: One digest per piece of every range, in order (the
                           last piece of a range may be short), as both sides
                           hash them with ``block_size=piece_size``.
    :param target_digests: The target's digests of the same pieces.
    :param max_length: Longest range merging may make (a transfer request's).
    :returns: Byte ranges in ascending order; a range whose differing pieces
              cover more than :data:`DENSE_SHARE` of it is returned whole.
    :raises ValueError: When a digest list does not match the pieces.
    """
    ours = split_digests(source_digests, digest_size)
    theirs = split_digests(target_digests, digest_size)
    result: List[ByteRange] = []
    position = 0
    for offset, length in ranges:
        pieces = split_ranges([(offset, length)], piece_size)
        if position + len(pieces) > len(ours) or len(ours) != len(theirs):
            raise ValueError("piece digests do not match the ranges")
        differ = [piece for index, piece in enumerate(pieces, position) if ours[index] != theirs[index]]
        position += len(pieces)
        if sum(piece_length for _, piece_length in differ) > DENSE_SHARE * length:
            differ = [(offset, length)]  # nearly all of it: one range, not many parts
        result.extend(differ)
    if position != len(ours):
        raise ValueError("piece digests do not match the ranges")
    return merge_close(result, PART_OVERHEAD_BYTES, max_length)


def merge_close(ranges: Sequence[ByteRange], max_gap: int, max_length: int) -> List[ByteRange]:
    """Merge ascending ranges whose gap is at most ``max_gap`` bytes (moving the gap is cheaper).

    A merged range is at most ``max_length`` long (ranges longer already stay as they are).
    """
    merged: List[ByteRange] = []
    for offset, length in ranges:
        if merged:
            last_offset, last_length = merged[-1]
            if offset - (last_offset + last_length) <= max_gap and offset + length - last_offset <= max_length:
                merged[-1] = (last_offset, max(last_length, offset + length - last_offset))
                continue
        merged.append((offset, length))
    return merged


@dataclass
class RefineTally:
    """What refinement of one file (or one segment of a tree's big file) has achieved so far.

    Once :data:`REFINE_PROBE_BYTES` were refined, refining goes on only while
    the pieces that still moved stay within :data:`DENSE_SHARE` of those bytes.
    """

    #: Bytes of changed ranges refined.
    refined: int = 0
    #: Bytes of those that moved anyway (their pieces differed).
    moved: int = 0
    #: Bytes of changed ranges moved whole because refining had stopped paying.
    skipped: int = 0

    def probing(self) -> bool:
        """Whether fewer than :data:`REFINE_PROBE_BYTES` were refined: whether it pays is not known yet."""
        return self.refined < REFINE_PROBE_BYTES

    def pays(self) -> bool:
        """Whether the next changed ranges are worth refining."""
        return self.probing() or self.moved <= DENSE_SHARE * self.refined

    def add(self, refined: int, moved: int) -> None:
        self.refined += refined
        self.moved += moved


__all__ = ["DEFAULT_PIECE_SIZE", "DENSE_SHARE", "PART_OVERHEAD_BYTES", "REFINE_PROBE_BYTES", "RefineTally",
           "check_piece_size", "differing_pieces", "merge_close", "resolve_piece_size", "usable_piece_size"]

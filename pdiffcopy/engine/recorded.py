"""The target's digests as the last sync left them: a sync that need not read its target.

A device target costs as much to read as the source. When the caller keeps a record of
the block digests the last sync left in the target (``--digest-file``), and that record
still stands for the target (the caller checks its identity: a device's write counters,
a file's inode and times), the recorded digests are the target's digests: the target is
read only where this sync writes it (the read-back the verification needs). With the
ranges of the source that changed since the source the record was made from
(``--changed-since``: a thin pool's own map of what differs between two snapshots), only
those are read from the source too; every other block is taken as equal on both sides.

The engine sees the record only through :class:`DigestRecord` (the caller's adapter, in
:mod:`pdiffcopy.local.digestfile`, keeps the file); the rules of its use are
:func:`choose_use` and docs/design.rst, "What is verified and what is trusted".
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence

from pdiffcopy.core.blocks import BlockPlan, ByteRange, Segment, split_digests
from pdiffcopy.core.hashing import digest_size
from pdiffcopy.errors import Conflict, UsageError

if TYPE_CHECKING:
    from pdiffcopy.engine.segments import SegmentSteps

#: How a sync uses a record (:func:`choose_use`).
TRUST = "trust"  # the recorded digests stand for the target: it is not read
REBUILD = "rebuild"  # the target is read whole (no record yet, or --verify-whole); the record is written after


class DigestRecord(ABC):
    """The block digests of a target as the last sync left it, and what they were taken from.

    :attr:`location` names the record in messages.
    """

    location: str

    @abstractmethod
    def exists(self) -> bool:
        """Whether there is a record (a first sync has none: it reads the target and makes one)."""

    @abstractmethod
    def mismatch(self, size: int, block_size: int, method: str) -> Optional[str]:
        """Why the record does not stand for the target as it is now (one line, without the remedy),
        or None when it does: the same target, not written since, the same block size, method and
        source size, and (with changed ranges) made from the snapshot they are counted from."""

    @abstractmethod
    def digests(self, first_block: int, count: int) -> bytes:
        """The recorded digests of ``count`` blocks from ``first_block``, concatenated."""

    @abstractmethod
    def changed_ranges(self) -> Optional[Sequence[ByteRange]]:
        """The ranges of the source that may differ from what the record was made from (sorted,
        disjoint), or None when any may (no ``--changed-since``)."""

    @abstractmethod
    def save(self, size: int, block_size: int, method: str, digests: Iterable[bytes]) -> None:
        """Record ``digests`` as the target's, and the target as it is now (after the sync's
        writes and flush), replacing the old record in one step."""


def choose_use(record: DigestRecord, size: int, block_size: int, method: str, verify_whole: bool,
               dry_run: bool) -> "tuple[str, Optional[str]]":
    """How a sync uses ``record``: (:data:`TRUST` or :data:`REBUILD`, why a record there did not match).

    :raises UsageError: For changed ranges without a record to count them from.
    :raises Conflict: For a record that no longer stands for the target, unless ``verify_whole``
                      (which reads the whole target and so needs no trust).
    """
    changed = record.changed_ranges() is not None
    if verify_whole:
        return REBUILD, record.mismatch(size, block_size, method) if record.exists() else None
    if not record.exists():
        if changed:
            raise UsageError(f"--changed-since needs the digest record of the last sync, and {record.location} "
                             f"does not exist; run once without --changed-since to make it")
        return REBUILD, None
    reason = record.mismatch(size, block_size, method)
    if reason is not None:
        whole = "the whole target" + ("" if not changed else " and source")
        raise Conflict(f"{reason}; nothing was {'compared' if dry_run else 'written'}: run once with "
                       f"--verify-whole to compare {whole} and make the record again")
    return TRUST, None


def recorded_futures(record: DigestRecord, segments: Sequence[Segment]) -> "Dict[int, Future[bytes]]":
    """The target's digests of every segment, from the record, as done futures (nothing is read)."""
    futures: "Dict[int, Future[bytes]]" = {}
    for segment in segments:
        done: "Future[bytes]" = Future()
        done.set_result(record.digests(segment.first_block, segment.block_count))
        futures[segment.index] = done
    return futures


def trusted_futures(record: DigestRecord, steps: "SegmentSteps", plan: BlockPlan, segments: Sequence[Segment],
                    method: str) -> "tuple[Dict[int, Future[bytes]], Dict[int, Future[bytes]], int]":
    """The digests of both sides by segment from a trusted record: the target's all recorded (nothing
    read), the source's hashed, or with changed ranges (``--changed-since``) hashed only where they say.

    :returns: The source's futures, the target's, and the bytes of the source hashed.
    """
    target_futures = recorded_futures(record, segments)
    changed = record.changed_ranges()
    if changed is None:
        return steps.hash_segments(steps.source, segments, method), target_futures, plan.size
    source_futures: "Dict[int, Future[bytes]]" = {}
    hashed = 0
    for segment in segments:
        blocks = changed_blocks_of(segment, plan.block_size, changed)
        hashed += sum(min(plan.block_size, plan.size - block * plan.block_size) for block in blocks)
        source_futures[segment.index] = partly_hashed(
            segment, blocks, plan.block_size, plan.size, method, target_futures[segment.index].result(),
            lambda ranges: steps.hash(steps.source, ranges, method))
    return source_futures, target_futures, hashed


def changed_blocks_of(segment: Segment, block_size: int, changed: Sequence[ByteRange]) -> List[int]:
    """The blocks of ``segment`` that ``changed`` (sorted, disjoint ranges) touches."""
    starts = [offset for offset, _ in changed]
    end = segment.offset + segment.length
    position = max(0, bisect.bisect_right(starts, segment.offset) - 1)
    blocks: List[int] = []
    last = segment.first_block + segment.block_count
    while position < len(changed) and changed[position][0] < end:
        offset, length = changed[position]
        first = max(offset, segment.offset) // block_size
        stop = min(-(-(offset + length) // block_size), last)
        if blocks and first <= blocks[-1]:
            first = blocks[-1] + 1  # ranges that share a block count it once
        blocks.extend(range(first, stop))
        position += 1
    return blocks


def partly_hashed(segment: Segment, blocks: List[int], block_size: int, size: int, method: str,
                  recorded: bytes, hash_ranges: "Callable[[List[ByteRange]], Future[bytes]]") -> "Future[bytes]":
    """The source's digests of ``segment``: hashed for ``blocks`` (what changed), the record's for the rest.

    :param hash_ranges: Starts hashing block-aligned ranges of the source.
    """
    result: "Future[bytes]" = Future()
    if not blocks:
        result.set_result(recorded)
        return result
    ranges: List[ByteRange] = []
    for block in blocks:
        offset = block * block_size
        length = min(block_size, size - offset)
        if ranges and ranges[-1][0] + ranges[-1][1] == offset:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
        else:
            ranges.append((offset, length))
    width = digest_size(method)

    def merge(hashed: "Future[bytes]") -> None:
        error = hashed.exception()
        if error is not None:
            result.set_exception(error)
            return
        digests = split_digests(recorded, width)
        for block, digest in zip(blocks, split_digests(hashed.result(), width)):
            digests[block - segment.first_block] = digest
        result.set_result(b"".join(digests))

    hash_ranges(ranges).add_done_callback(merge)
    return result


class RecordedDigests(Sequence[bytes]):
    """The target's digests as a list the verification slices, read from the record by the slice:
    a record of millions of blocks is not held twice (the source's digests are held already)."""

    def __init__(self, record: DigestRecord, count: int, width: int) -> None:
        self.record, self.count, self.width = record, count, width

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.count)
            if step != 1:
                raise ValueError("recorded digests are read in runs")
            return split_digests(self.record.digests(start, max(0, stop - start)), self.width) if stop > start else []
        if not -self.count <= index < self.count:
            raise IndexError(index)
        return self.record.digests(index % self.count, 1)


def count_differences(record: DigestRecord, segment: Segment, read: Sequence[bytes]) -> int:
    """How many blocks of ``segment`` hashed from the target differ from the record's digests."""
    width = len(read[0]) if read else 1
    recorded = split_digests(record.digests(segment.first_block, segment.block_count), width)
    return sum(1 for ours, theirs in zip(read, recorded) if ours != theirs)


__all__ = ["REBUILD", "TRUST", "DigestRecord", "RecordedDigests", "changed_blocks_of", "choose_use",
           "count_differences", "partly_hashed", "recorded_futures", "trusted_futures"]

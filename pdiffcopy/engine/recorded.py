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
import collections
import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import BlockPlan, ByteRange, Segment, split_digests
from pdiffcopy.core.hashing import digest_size
from pdiffcopy.errors import Conflict, UsageError

logger = logging.getLogger(__name__)

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


#: Segments whose source hashing (of the blocks changed ranges touch) starts before their turn.
CHANGED_LOOKAHEAD_SEGMENTS = 16

DigestStream = Iterator[Tuple[Segment, bytes]]


def recorded_stream(record: DigestRecord, segments: Iterable[Segment]) -> DigestStream:
    """The target's digests of every segment, from the record, in order (nothing is read)."""
    for segment in segments:
        yield segment, record.digests(segment.first_block, segment.block_count)


def trusted_streams(record: DigestRecord, steps: "SegmentSteps", plan: BlockPlan, segments: Sequence[Segment],
                    method: str) -> "Tuple[Iterable[Tuple[Segment, bytes]], DigestStream, int]":
    """The digests of both sides by segment from a trusted record: the target's all recorded (nothing
    read), the source's hashed, or with changed ranges (``--changed-since``) hashed only where they say.

    :returns: The source's digest stream, the target's, and the bytes of the source hashed.
    """
    target_stream = recorded_stream(record, segments)
    changed = record.changed_ranges()
    if changed is None:
        return steps.digest_stream(steps.source, segments, method), target_stream, plan.size
    touched = [(segment, changed_blocks_of(segment, plan.block_size, changed)) for segment in segments]
    hashed = sum(min(plan.block_size, plan.size - block * plan.block_size)
                 for _, blocks in touched for block in blocks)

    def start(segment: Segment, blocks: List[int]) -> "Tuple[Segment, Future[bytes]]":
        return segment, partly_hashed(
            segment, blocks, plan.block_size, plan.size, method,
            record.digests(segment.first_block, segment.block_count),
            lambda ranges: steps.hash(steps.source, ranges, method))

    def source_stream() -> DigestStream:
        waiting = collections.deque(start(*item) for item in touched[:CHANGED_LOOKAHEAD_SEGMENTS])
        following = iter(touched[CHANGED_LOOKAHEAD_SEGMENTS:])
        while waiting:
            segment, future = waiting.popleft()
            item = next(following, None)
            if item is not None:
                waiting.append(start(*item))
            yield segment, future.result()

    return source_stream(), target_stream, hashed


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


class RecordedSegments:
    """The target's digests of every segment as the verification reads them, one segment at a time
    from the record: a record of millions of blocks is never held in memory."""

    def __init__(self, record: DigestRecord, segments: Sequence[Segment]) -> None:
        self.record, self.segments = record, segments

    def __iter__(self) -> Iterator[bytes]:
        return (digests for _, digests in recorded_stream(self.record, self.segments))


def count_differences(record: DigestRecord, segment: Segment, read: Sequence[bytes]) -> int:
    """How many blocks of ``segment`` hashed from the target differ from the record's digests."""
    width = len(read[0]) if read else 1
    recorded = split_digests(record.digests(segment.first_block, segment.block_count), width)
    return sum(1 for ours, theirs in zip(read, recorded) if ours != theirs)


def tell_what_the_check_found(record: DigestRecord, location: str, differences: int,
                              mismatch: Optional[str]) -> None:
    """After a sync that checked the record against the target (:data:`REBUILD`): say what it found."""
    if differences:
        logger.warning("%d block(s) of %s differed from the digest record %s although nothing showed "
                       "that the target was written (a write below the device, or damage); they were "
                       "synced again", differences, location, record.location)
    elif mismatch is not None:
        logger.info("%s; made it again from the whole target", mismatch)


__all__ = ["REBUILD", "TRUST", "DigestRecord", "RecordedSegments", "changed_blocks_of", "choose_use",
           "count_differences", "partly_hashed", "recorded_stream", "tell_what_the_check_found",
           "trusted_streams"]

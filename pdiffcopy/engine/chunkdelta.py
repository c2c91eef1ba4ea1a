"""The shift-tolerant delta (``--delta chunks``): content-defined chunks instead of fixed blocks.

A fixed-block delta compares the blocks at the same offsets; a byte inserted near the
start of a file shifts every block after it, and everything is resent. Here both sides
cut their file where its content says (:mod:`pdiffcopy.core.chunks`), so the cuts after
an insertion fall on the same bytes again, wherever they moved to. The steps::

    cut both files (64 KiB chunks, each side on its own machine) -> plan: copy or send
      -> cut what found no match again, finer (2 KiB) -> refine the plan
      -> a NEW temporary of the target: copies from the old target on the target's side,
         the rest sent from the source (compressed and rate limited like any transfer)
      -> verify every block against the source's strong digests -> atomic rename

The engine is written once for local, pull and push syncs and for a tree's big files: it
sees only the :class:`~pdiffcopy.engine.endpoints.FileEndpoint` operations
:meth:`~pdiffcopy.engine.endpoints.FileEndpoint.cut_chunks` and
:meth:`~pdiffcopy.engine.endpoints.FileEndpoint.copy_within`, which a local file, a remote
file and the server's views implement.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import BlockPlan, batch_ranges, split_ranges
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.engine.segments import (
    TRANSFER_REQUEST_BYTES,
    SegmentSteps,
    move_ranges,
    prepare_work,
    punch_holes_of,
    source_data_bytes,
)
from pdiffcopy.errors import Unsupported

#: Most bytes one copy request copies on the target's side: the server copies them inside
#: the kernel (a GiB in about a second here), so a request stays well inside the timeout.
COPY_REQUEST_BYTES = 1024 * 1024 * 1024

#: Most moves one copy request names (12 to 40 bytes of JSON each: a body under 1 MiB).
COPY_REQUEST_MOVES = 16384


def plan_delta(source: FileEndpoint, target: FileEndpoint, source_size: int, target_size: int) -> List[cdc.Step]:
    """The steps that build the source from the old target: copies, and sends from the source.

    Two passes: 64 KiB chunks over both whole files, then 2 KiB chunks over what the first
    pass left (the source's sends against the target's unused ranges). Each side cuts its
    own file, both at once.

    :raises Unsupported: When a side cannot be cut where it is (an older server).
    """
    coarse_source, coarse_target = _both(
        lambda: source.cut_chunks([(0, source_size)] if source_size else [], cdc.DEFAULT_AVERAGE),
        lambda: target.cut_chunks([(0, target_size)] if target_size else [], cdc.DEFAULT_AVERAGE))
    steps = cdc.plan(coarse_source, cdc.index(coarse_target))
    sends = cdc.sends(steps)
    gaps = cdc.target_gaps(steps, target_size)
    if not sends or not gaps or len(sends) == len(steps):
        # Nothing to find, nowhere to find it, or nothing in common at all (another file).
        return steps
    fine_source, fine_target = _both(lambda: source.cut_chunks(sends, cdc.FINE_AVERAGE),
                                     lambda: target.cut_chunks(gaps, cdc.FINE_AVERAGE))
    return cdc.refine(steps, cdc.plan(fine_source, cdc.index(fine_target)))


def _both(first: Callable, second: Callable):
    """Run two calls at once (each side's cutting runs where its file is); return both results."""
    with ThreadPoolExecutor(1, thread_name_prefix="cut") as pool:
        other = pool.submit(second)
        return first(), other.result()


def build(source: FileEndpoint, target: FileEndpoint, work: FileEndpoint, steps: Sequence[cdc.Step],
          pool: ThreadPoolExecutor, on_moved: Optional[Callable[[int], None]] = None) -> int:
    """Write the steps into ``work`` (prepared to the source's size); return the bytes sent.

    Copies run on the target's side (:meth:`FileEndpoint.copy_within`), sends go through the
    usual transfer (:func:`~pdiffcopy.engine.segments.move_ranges`), all in ``pool``.

    :raises Unsupported: When ``work`` cannot copy from ``target`` on their side.
    """
    copies = [step for step in steps if isinstance(step, cdc.Copy)]
    if not work.can_copy_within(target):
        raise Unsupported(f"Cannot copy from {target.location} to its temporary on its side")
    pending: List[Future] = []
    batch: List[cdc.Copy] = []
    total = 0
    for copy in copies:
        if batch and (total + copy.length > COPY_REQUEST_BYTES or len(batch) >= COPY_REQUEST_MOVES):
            pending.append(pool.submit(work.copy_within, target, batch))
            batch, total = [], 0
        batch.append(copy)
        total += copy.length
    if batch or not pending:
        # At least one request, if empty: it gives the new file the old one's mode too.
        pending.append(pool.submit(work.copy_within, target, batch))
    sends = split_ranges(cdc.sends(steps), TRANSFER_REQUEST_BYTES)
    # A new temporary: the source's holes among the sends are holes there already.
    moves = [pool.submit(move_ranges, source, work, ranges, on_moved, True)
             for ranges in batch_ranges(sends, TRANSFER_REQUEST_BYTES)]
    for future in pending:
        future.result()
    sent = sum(future.result() for future in moves)
    # Copies of the old target's zeros (a kernel copy fills holes) become the source's holes again.
    size = max((step.source_offset + step.length for step in steps), default=0)
    punch_holes_of(source, work, 0, size)
    return sent


class Verification:
    """The check of a new version against the source, its source half started early.

    Made before the build, the source's digests are computed while the new version is
    written (on the source's side, which the build barely uses); :meth:`check` then hashes
    only the new version.
    """

    def __init__(self, source: FileEndpoint, size: int, block_size: int, method: str, location: str,
                 on_hashed: Optional[Callable[[int], None]] = None) -> None:
        self._steps = SegmentSteps(source, None, BlockPlan(size, block_size), method, location, on_hashed=on_hashed)
        self._ours = self._steps.hash_source_strongly()

    def check(self, work: FileEndpoint) -> str:
        """Check every block of ``work`` against the source's digest under ``method`` (a strong one).

        :returns: The whole-file digest, as hex.
        :raises VerificationFailed: When a block differs (a false chunk match, a source that changed).
        """
        self._steps.work = work
        return self._steps.verify_all(self._ours)

    def cancel(self) -> None:
        """Stop the source's hashing that has not started (the build failed)."""
        for future in self._ours.values():
            future.cancel()


def verify(source: FileEndpoint, work: FileEndpoint, size: int, block_size: int, method: str,
           location: str, on_hashed: Optional[Callable[[int], None]] = None) -> str:
    """Check every block of ``work`` against the source's digest under ``method`` (a strong one).

    Both sides hash every segment at once, each where its file is; only the digests cross.

    :param on_hashed: Called with byte counts as segments are hashed (progress).

    :returns: The whole-file digest, as hex.
    :raises VerificationFailed: When a block differs (a false chunk match, a source that changed).
    """
    return Verification(source, size, block_size, method, location, on_hashed).check(work)


def sync_file(source: FileEndpoint, target: FileEndpoint, work: FileEndpoint, source_size: int,
              target_size: int, block_size: int, method: str, concurrency: int, location: str) -> int:
    """One whole file, start to end (a tree's worker): plan, build ``work``, verify; return bytes sent.

    ``work`` is a new, empty temporary of ``target``; the caller flushes and renames it.
    """
    steps = plan_delta(source, target, source_size, target_size)
    prepare_work(work, source_size, source_data_bytes(source, source_size))
    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="transfer") as pool:
        sent = build(source, target, work, steps, pool)
    verify(source, work, source_size, block_size, method, location)
    return sent


__all__ = ["COPY_REQUEST_BYTES", "COPY_REQUEST_MOVES", "Verification", "build",
           "plan_delta", "sync_file", "verify"]

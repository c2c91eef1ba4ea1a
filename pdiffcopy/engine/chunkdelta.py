"""The shift-tolerant delta (``--delta chunks``): content-defined chunks instead of fixed blocks.

A fixed-block delta compares the blocks at the same offsets; a byte inserted near the
start of a file shifts every block after it, and everything is resent. Here both sides
cut their file where its content says (:mod:`pdiffcopy.core.chunks`), so the cuts after
an insertion fall on the same bytes again, wherever they moved to. The steps::

    cut both files (64 KiB chunks, more over 512 MiB; each side on its own machine) -> plan: copy or send
      -> cut what found no match again, 8 times finer, down to 256 bytes -> refine the plan each time
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

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import BlockPlan, batch_ranges, split_ranges
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.engine.segments import (
    TRANSFER_REQUEST_BYTES,
    SegmentSteps,
    move_ranges,
    punch_holes_of,
    source_data_bytes,
)
from pdiffcopy.engine.workfile import prepare_work
from pdiffcopy.errors import StorageError, Unsupported

#: Most bytes one copy request copies on the target's side: the server copies them inside
#: the kernel (a GiB in about a second here), so a request stays well inside the timeout.
COPY_REQUEST_BYTES = 1024 * 1024 * 1024

#: Most moves one copy request names (12 to 40 bytes of JSON each: a body under 1 MiB).
COPY_REQUEST_MOVES = 16384

#: Bytes of a file cut per request when the coarse pass is cut a piece at a time (so that the
#: copies it finds start while both sides still cut): 8 requests a side for 256 MiB, each a few
#: ms of overhead beside the 25 ms its cutting takes.
CUT_PIECE_BYTES = 32 * 1024 * 1024

#: Copies found early are sent to the target's side once this many bytes of them wait: a
#: copy request per piece or two, not one per chunk.
EARLY_COPY_BATCH_BYTES = 8 * 1024 * 1024


def plan_delta(source: FileEndpoint, target: FileEndpoint, source_size: int, target_size: int,
               early: "Optional[EarlyCopies]" = None) -> List[cdc.Step]:
    """The steps that build the source from the old target: copies, and sends from the source.

    A first pass of 64 KiB chunks (more for files over 512 MiB: :func:`cdc.coarse_average`)
    over both whole files, then passes of chunks 8 times smaller each, down to 256 bytes
    (:func:`cdc.refining_averages`), over what the pass before left (the source's sends
    against the target's unused ranges): each list covers only what is still unmatched, and
    the passes under 1 KiB not a long range that found nothing (new or removed data: ``_short``).
    Each side cuts its own file, both at once.

    :param early: Given, the first pass is cut a piece at a time and the copies it finds go
                  to ``early`` as soon as both sides' chunks are in, while the rest is cut.
                  The steps are the same either way.
    :raises Unsupported: When a side cannot be cut where it is (an older server).
    """
    average = cdc.coarse_average(max(source_size, target_size))
    if early is None:
        coarse_source, coarse_target = _both(
            lambda: source.cut_chunks([(0, source_size)] if source_size else [], average),
            lambda: target.cut_chunks([(0, target_size)] if target_size else [], average))
        steps = cdc.plan(coarse_source, cdc.index(coarse_target))
    else:
        steps = _plan_while_cutting(source, target, source_size, target_size, average, early)
    if len(cdc.sends(steps)) == len(steps):
        return steps  # nothing in common at all (another file): no finer pass finds more
    previous = average
    for finer in cdc.refining_averages(average):
        sends = cdc.sends(steps)
        gaps = cdc.target_gaps(steps, target_size)
        if finer < cdc.LISTED_EVERYWHERE_AVERAGE:
            sends, gaps = _short(sends, previous), _short(gaps, previous)
        previous = finer
        if not sends or not gaps:
            break  # nothing left to find, or nowhere left to find it
        fine_source, fine_target = _both(partial(source.cut_chunks, sends, finer),
                                         partial(target.cut_chunks, gaps, finer))
        steps = cdc.refine(steps, cdc.plan(fine_source, cdc.index(fine_target)))
    return steps


def _short(ranges: List[Tuple[int, int]], average: int) -> List[Tuple[int, int]]:
    """The ranges a pass of ``average`` chunks left shorter than ``cdc.NEW_DATA_CHUNKS`` of them.

    A longer one found nothing inside it: data only one side has (new in the source, gone from
    the target), which finer chunks will not find either.
    """
    return [(offset, length) for offset, length in ranges if length < cdc.NEW_DATA_CHUNKS * average]


def cut_pieces(endpoint: FileEndpoint, size: int, average: int,
               piece: Optional[int] = None) -> Iterator[List[cdc.Chunk]]:
    """The content-defined chunks of a whole file, a request of about ``piece`` bytes at a time.

    The same chunks as one cut of the whole file: a chunk's end depends only on its own bytes
    (FastCDC starts its rolling hash afresh at every cut), so each piece after the first starts
    where the last chunk that the content ended did; the last chunk of a piece ends where the
    piece was cut off, and is cut again as the start of the next one.
    """
    # More than one whole chunk in every piece (a chunk is at most MAX_FACTOR averages).
    piece = max(CUT_PIECE_BYTES if piece is None else piece, 4 * cdc.MAX_FACTOR * average)
    start = 0
    while start < size:
        end = min(size, start + piece)
        chunks = endpoint.cut_chunks([(start, end - start)], average)
        if end < size:
            chunks.pop()
        if not chunks:
            raise StorageError(f"Cannot cut {endpoint.location}: no whole chunk in {piece} bytes at {start}")
        yield chunks
        start = chunks[-1].offset + chunks[-1].length


def _plan_while_cutting(source: FileEndpoint, target: FileEndpoint, source_size: int, target_size: int,
                        average: int, early: "EarlyCopies") -> List[cdc.Step]:
    """The first pass's steps, both files cut a piece at a time at once; copies go to ``early`` as found.

    A source chunk is looked up when it arrives and again after each piece of the target, so
    each copy is found as soon as both sides have cut that far. Target chunks arrive in their
    order, so the first one with a digest is the one :func:`cdc.index` would give: the steps
    equal those of the two whole lists.
    """
    arrivals: "queue.Queue[Tuple[str, object]]" = queue.Queue()
    stop = threading.Event()

    def produce(side: str, endpoint: FileEndpoint, size: int) -> None:
        try:
            for chunks in cut_pieces(endpoint, size, average):
                arrivals.put((side, chunks))
                if stop.is_set():
                    return
            arrivals.put((side, None))
        except BaseException as error:  # handed to the planning thread, which raises it
            arrivals.put((side, error))

    where: Dict[tuple, int] = {}
    source_chunks: List[cdc.Chunk] = []
    unfound: List[cdc.Chunk] = []
    with ThreadPoolExecutor(2, thread_name_prefix="cut") as pool:
        pool.submit(produce, "source", source, source_size)
        pool.submit(produce, "target", target, target_size)
        try:
            cutting = {"source", "target"}
            while cutting:
                side, item = arrivals.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    cutting.discard(side)
                    continue
                assert isinstance(item, list)
                if side == "target":
                    for chunk in item:
                        where.setdefault((chunk.digest, chunk.length), chunk.offset)
                    looked_up, unfound = unfound, []
                else:
                    source_chunks += item
                    looked_up = item
                found: List[cdc.Step] = []
                for chunk in looked_up:
                    offset = where.get((chunk.digest, chunk.length))
                    if offset is None:
                        unfound.append(chunk)
                    else:
                        found.append(cdc.Copy(chunk.offset, offset, chunk.length))
                if found:
                    found.sort(key=lambda step: step.source_offset)
                    early.add([step for step in cdc.merged(found) if isinstance(step, cdc.Copy)])
        finally:
            stop.set()
    return cdc.plan(source_chunks, where)


def _both(first: Callable, second: Callable):
    """Run two calls at once (each side's cutting runs where its file is); return both results."""
    with ThreadPoolExecutor(1, thread_name_prefix="cut") as pool:
        other = pool.submit(second)
        return first(), other.result()


class EarlyCopies:
    """The first pass's copies, started on the target's side while both files are still cut.

    The copies of an insertion near the start are known long before the cutting ends; made
    then, the kernel copies and their write-back overlap the cutting instead of following it.
    Until a copy moves data (or the sizes differ), copies wait: a file whose every chunk is in
    place needs no new version at all.
    """

    def __init__(self, target: FileEndpoint, work: FileEndpoint, pool: ThreadPoolExecutor,
                 same_size: bool) -> None:
        if not work.can_copy_within(target):
            raise Unsupported(f"Cannot copy from {target.location} to its temporary on its side")
        self.target = target
        self.work = work
        self.pool = pool
        self.moving = not same_size
        self.waiting: List[cdc.Copy] = []
        #: The copies started, in the order found.
        self.started: List[cdc.Copy] = []
        self.futures: List[Future] = []

    def add(self, copies: Sequence[cdc.Copy]) -> None:
        """Copies the plan will hold: started once enough of them wait."""
        self.waiting.extend(copies)
        if not self.moving:
            self.moving = any(copy.source_offset != copy.target_offset for copy in copies)
        if self.moving and sum(copy.length for copy in self.waiting) >= EARLY_COPY_BATCH_BYTES:
            self.started.extend(self.waiting)
            self.futures.extend(_submit_copies(self.pool, self.work, self.target, self.waiting))
            self.waiting = []

    def wait(self) -> None:
        """Wait for the copies started; raise the first failure."""
        for future in self.futures:
            future.result()

    def cancel(self) -> None:
        """Stop the copies that have not started (the sync failed)."""
        for future in self.futures:
            future.cancel()


def _submit_copies(pool: ThreadPoolExecutor, work: FileEndpoint, target: FileEndpoint,
                   copies: Sequence[cdc.Copy]) -> List[Future]:
    """Copy requests for ``copies``, within the bounds of one request each (at least one request)."""
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
    return pending


def not_copied(copies: Sequence[cdc.Copy], started: Sequence[cdc.Copy]) -> List[cdc.Copy]:
    """The parts of ``copies`` (a plan's, by source offset) that none of ``started`` covers.

    Each started copy lies within one of ``copies`` (the plan merged it into a longer one,
    or refined only the sends around it), at the same distance between source and target.
    """
    done = sorted((copy.source_offset, copy.source_offset + copy.length) for copy in started)
    left: List[cdc.Copy] = []
    position = 0
    for copy in copies:
        start, end = copy.source_offset, copy.source_offset + copy.length
        shift = copy.target_offset - copy.source_offset
        here = start
        while position < len(done) and done[position][0] < end:
            done_start, done_end = done[position]
            if done_start < here or done_end > end:
                raise ValueError(f"A copy started early at {done_start} is not within the plan's copies")
            if done_start > here:
                left.append(cdc.Copy(here, here + shift, done_start - here))
            here = done_end
            position += 1
        if here < end:
            left.append(cdc.Copy(here, here + shift, end - here))
    if position != len(done):
        raise ValueError("A copy started early is not among the plan's copies")
    return left


def build(source: FileEndpoint, target: FileEndpoint, work: FileEndpoint, steps: Sequence[cdc.Step],
          pool: ThreadPoolExecutor, on_moved: Optional[Callable[[int], None]] = None,
          early: Optional[EarlyCopies] = None) -> int:
    """Write the steps into ``work`` (prepared to the source's size); return the bytes sent.

    Copies run on the target's side (:meth:`FileEndpoint.copy_within`), sends go through the
    usual transfer (:func:`~pdiffcopy.engine.segments.move_ranges`), all in ``pool``. The
    copies ``early`` started while planning are not made again.

    :raises Unsupported: When ``work`` cannot copy from ``target`` on their side.
    """
    copies = [step for step in steps if isinstance(step, cdc.Copy)]
    if not work.can_copy_within(target):
        raise Unsupported(f"Cannot copy from {target.location} to its temporary on its side")
    if early is not None and early.started:
        copies = not_copied(copies, early.started)
    pending: List[Future] = list(early.futures) if early is not None else []
    if copies or not pending:
        pending += _submit_copies(pool, work, target, copies)
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


__all__ = ["COPY_REQUEST_BYTES", "COPY_REQUEST_MOVES", "CUT_PIECE_BYTES", "EarlyCopies", "Verification",
           "build", "cut_pieces", "not_copied", "plan_delta", "sync_file", "verify"]

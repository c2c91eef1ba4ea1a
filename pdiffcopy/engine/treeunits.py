"""What a tree sync's queue holds and how a worker runs it: units, big files, the counters.

A unit is a batch of small files (copied whole), a byte range of a big new
file, one segment of a big changed file (through the segment engine), a big
file by content-defined chunks, or a batch of links, metadata fixes or
deletions. :class:`UnitWorker` runs the units one worker takes, in a forked
process or (a small job) in the sync's own; :mod:`pdiffcopy.engine.treerunner`
builds the queue and starts the workers.
"""

from __future__ import annotations

from pdiffcopy.core.records import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import BlockPlan
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.errors import Conflict, PdiffcopyError
from pdiffcopy.core.hashing import verify_method
from pdiffcopy.engine.segments import check_size, source_unchanged, sync_segment
from pdiffcopy.engine.workfile import WorkFile
from pdiffcopy.engine.treeendpoints import (
    DELETE,
    METADATA,
    MKNOD,
    SYMLINK,
    Failure,
    Operation,
    TreeEndpoint,
)
from pdiffcopy.engine.forkshared import shared_ints
from pdiffcopy.core.treestops import NOT_ATTEMPTED, stop_cause
from pdiffcopy.engine.workers import Stop
from pdiffcopy.core.treeplan import (
    Difference,
    Entry,
    FileAction,
    REASON_SHARED,
)


@dataclass
class TreeResult:
    """What a tree sync did (or, dry run, would do)."""

    source: str
    target: str
    files_copied: int = 0
    bytes_moved: int = 0
    directories_made: int = 0
    deleted: int = 0
    unchanged: int = 0
    metadata_fixed: int = 0
    nodes_made: int = 0  # devices, fifos and sockets made (-D)
    linked: int = 0  # names made (or made again) another name of their hard-link group's file (-H)
    #: Entries whose change was never tried: the sync stopped first (see :attr:`stopped`).
    not_synced: int = 0
    #: Why the sync stopped before the end (the target full or read-only: a
    #: :func:`~pdiffcopy.core.treestops.stop_cause`), or "": it ran to the end.
    stopped: str = ""
    #: Units of work that failed as a whole (a lost connection, a worker that died): what
    #: they did is not known, so the sync did not finish, whatever the counts say.
    unfinished: int = 0
    #: Deletions --max-delete left undone (rsync's exit status 25).
    deletions_skipped: int = 0
    failures: List[Failure] = field(default_factory=list)
    differences: List[Difference] = field(default_factory=list)
    skipped: List[Entry] = field(default_factory=list)
    dry_run: bool = False
    seconds: float = 0.0


def combined(results: Sequence[TreeResult]) -> TreeResult:
    """One result for several syncs into one target (--files-from's roots, several sources):
    their counts added, their lists joined, the first stop."""
    first = results[0]
    total = TreeResult(first.source, first.target, dry_run=first.dry_run)
    for result in results:
        for name in ("files_copied", "bytes_moved", "directories_made", "deleted", "unchanged",
                     "metadata_fixed", "nodes_made", "linked", "not_synced", "unfinished", "deletions_skipped",
                     "seconds"):
            setattr(total, name, getattr(total, name) + getattr(result, name))
        for name in ("failures", "differences", "skipped"):
            getattr(total, name).extend(getattr(result, name))
        total.stopped = total.stopped or result.stopped
    return total


class TreeProgress:
    """Counters for the progress display: per worker slots in shared memory."""

    def __init__(self, workers: int) -> None:
        self.slots = shared_ints(2 * max(1, workers) + 2)
        self.moved_slots = shared_ints(max(1, workers) + 1)
        self.files_total = 0
        self.bytes_total = 0
        self.phase = "listing"

    def add(self, slot: int, files: int, size: int, moved: Optional[int] = None) -> None:
        """Count ``files`` and ``size`` bytes done, of which ``moved`` (default: all) were moved."""
        self.slots[2 * slot] += files
        self.slots[2 * slot + 1] += size
        self.moved_slots[slot] += size if moved is None else moved

    @property
    def bytes_moved(self) -> int:
        """Bytes written to the target so far: a changed big file's unchanged blocks are not."""
        return sum(self.moved_slots)

    @property
    def files_done(self) -> int:
        return sum(self.slots[0::2])

    @property
    def bytes_done(self) -> int:
        return sum(self.slots[1::2])


class Unit(NamedTuple):
    """One piece of work of the queue."""

    weight: int  # bytes it moves (or would at most): the queue runs heaviest first
    kind: str  # "files", "range", "delta", "chunks", "links", "nodes", "metadata", "delete"
    items: tuple


@dataclass
class BigFile:
    """A file moved in several units (its segments); the unit finishing last completes it."""

    action: FileAction
    plan: BlockPlan
    source: FileEndpoint
    #: What its segments are written into (:mod:`pdiffcopy.engine.workfile`).
    workfile: WorkFile
    parts: int

    @property
    def work(self) -> FileEndpoint:
        return self.workfile.endpoint

    @property
    def target(self) -> FileEndpoint:
        return self.workfile.target

    @property
    def partial(self) -> bool:
        return self.workfile.partial

    def give_up(self, announce: bool = True) -> None:
        """After a failure: keep a partial file, remove a temporary, or end the in-place lease."""
        self.workfile.give_up(self.action.path, announce)


def traffic(*trees: TreeEndpoint) -> Tuple[int, int]:
    """Bytes this process sent and received on the wire for ``trees`` (a local tree's are none)."""
    sent, received = zip(*(tree.traffic() for tree in trees))
    return sum(sent), sum(received)


class UnitWorker:
    """What one worker does with the units it takes."""

    def __init__(self, runner, slot: int, parts_left, parts_failed) -> None:
        self.runner = runner
        self.slot = slot
        self.parts_left = parts_left
        self.parts_failed = parts_failed
        self.failures: List[Failure] = []
        self.counts: Dict[str, int] = {"files": 0, "bytes": 0, "deleted": 0, "metadata": 0, "nodes": 0,
                                       "unchanged": 0, "not_synced": 0, "stopped": 0, "unfinished": 0}
        #: What runs each kind of unit (Unit.kind).
        self._runs: Dict[str, Callable[[Unit], None]] = {
            "files": self._run_files, "range": self._run_range, "delta": self._run_delta,
            "chunks": self._run_chunks,
            "links": self._run_links, "nodes": self._run_nodes, "metadata": self._run_metadata,
            "delete": self._run_delete}

    def run(self, unit: Unit) -> None:
        if Stop.requested:
            raise KeyboardInterrupt
        known = len(self.failures)
        try:
            self._runs[unit.kind](unit)
        except PdiffcopyError as error:
            self.failures.append(("", str(error)))
            self._count("unfinished")
        if stops(self.failures[known:]):
            self.counts["stopped"] = 1  # every further write would fail the same way

    @property
    def stopped(self) -> bool:
        return bool(self.counts["stopped"])

    def _count(self, key: str, value: int = 1) -> None:
        self.counts[key] += value

    def _tried(self, failures: List[Failure]) -> List[Failure]:
        """``failures`` less the entries not tried (:data:`NOT_ATTEMPTED`), which are counted not synced."""
        tried = [failure for failure in failures if failure[1] != NOT_ATTEMPTED]
        self._count("not_synced", len(failures) - len(tried))
        return tried

    # -- small files -------------------------------------------------------

    def _run_files(self, unit: Unit) -> None:
        """A batch of small files: new ones, rewritten ones, and ones to compare first."""
        actions: Sequence[FileAction] = unit.items
        fresh = {a.path for a in actions if a.target is None}
        # A dense old version of a sparse file is written again, holes and all, whatever its bytes.
        # So is one whose target file has other names that must not change with it.
        # And (--backup) every file replaced: its old version, kept, must not change with it.
        compare = set() if self.runner.options.backup else \
            {a.path for a in actions if a.target is not None and a.reason != REASON_SHARED
             and a.target.size == a.source.size and not (a.source.sparse and not a.target.sparse)}
        source, target = self.runner.source, self.runner.target
        if target.can_copy_files_from(source):
            self._copy_locally(source, target, [a.source for a in actions], fresh, compare)
        else:
            self._transfer(source, target, [a.source for a in actions], fresh, compare)
        self.runner.progress.add(self.slot, len(actions), unit.weight)

    def _copy_locally(self, source, target, entries: List[Entry], fresh: set, compare: set) -> None:
        """Between local trees the kernel copies; files to compare are read on both sides first."""
        stopped = False
        for check, new in ((False, True), (False, False), (True, False)):
            group = [e for e in entries if (e.path in compare) == check and (e.path in fresh) == new]
            if not group:
                continue
            if stopped:  # the group before met a full or read-only target
                self._count("not_synced", len(group))
                continue
            failures, moved, count = target.copy_files_from(source, group, self.runner.meta,
                                                            compare=check, fresh=new)
            self._count("files", count)
            self._count("bytes", moved)
            self._count("unchanged", len(group) - count - len(failures))
            self.failures += self._tried(failures)
            stopped = stops(failures)

    def _transfer(self, source, target, entries: List[Entry], fresh: set, compare: set) -> None:
        """Through a server: one request reads the batch, one (or two) write it."""
        meta = self.runner.meta
        to_write: List[Tuple[Entry, bytes]] = []
        stopped = False
        for entry, data, error in source.read_files(entries):  # read to its end: a stream
            if stopped:
                self._count("not_synced")
            elif data is None:
                self.failures.append((entry.path, error))
            elif entry.path in compare and target.same_content(entry, data):
                # Pulled and already right: only its metadata (its time, say) differs.
                failures = target.apply([Operation(METADATA, entry)], meta)
                if failures:
                    self.failures += self._tried(failures)
                    stopped = stops(failures)
                else:
                    self._count("unchanged")
            else:
                to_write.append((entry, data))
        failures = []
        for new in (True, False):
            batch = [(e, d) for e, d in to_write if (e.path in fresh) == new]
            if not batch:
                continue
            if stopped:
                failures += [(e.path, NOT_ATTEMPTED) for e, _ in batch]
                continue
            written = target.write_files(batch, meta, fresh=new)
            failures += written
            stopped = stops(written)
        failed = {path for path, _ in failures}
        self.failures += self._tried(failures)
        done = [(e, d) for e, d in to_write if e.path not in failed]
        self._count("files", len(done))
        self._count("bytes", sum(len(d) for _, d in done))

    def _run_links(self, unit: Unit) -> None:
        self.failures += self._tried(self.runner.target.apply([Operation(SYMLINK, e) for e in unit.items],
                                                              self.runner.meta))

    def _run_nodes(self, unit: Unit) -> None:
        failures = self.runner.target.apply([Operation(MKNOD, e) for e in unit.items], self.runner.meta)
        self.failures += self._tried(failures)
        self._count("nodes", len(unit.items) - len(failures))

    def _run_metadata(self, unit: Unit) -> None:
        failures = self.runner.target.apply([Operation(METADATA, e) for e in unit.items],
                                            self.runner.meta)
        self.failures += self._tried(failures)
        self._count("metadata", len(unit.items) - len(failures))

    def _run_delete(self, unit: Unit) -> None:
        failures = self.runner.target.apply([Operation(DELETE, e) for e in unit.items],
                                            self.runner.meta)
        self.failures += self._tried(failures)
        self._count("deleted", len(unit.items) - len(failures))
        self.runner.progress.add(self.slot, len(unit.items), 0)

    # -- big files ---------------------------------------------------------

    def _run_range(self, unit: Unit) -> None:
        """A segment of a big new file: copied whole, then read back."""
        self._run_segment(unit, compare=False)

    def _run_delta(self, unit: Unit) -> None:
        """A segment of a big changed file: its changed blocks moved, then read back."""
        self._run_segment(unit, compare=True)

    def _run_chunks(self, unit: Unit) -> None:
        """A big changed file by content-defined chunks (pdiffcopy.engine.chunkdelta), whole, verified."""
        index, _ = unit.items
        big = self.runner.big[index]
        options = self.runner.options

        def move() -> int:
            assert big.action.target is not None, "only files with an old version are queued so"
            from pdiffcopy.engine import chunkdelta

            return chunkdelta.sync_file(big.source, big.target, big.work, big.action.source.size,
                                        big.action.target.size, options.block_size,
                                        verify_method(options.hash_method), options.concurrency, big.action.path)

        self._run_part(unit, index, move)

    def _run_segment(self, unit: Unit, compare: bool) -> None:
        index, segment_index = unit.items
        big = self.runner.big[index]
        options = self.runner.options

        def move() -> int:
            if not big.plan.segment_count:
                return 0
            # Only this segment is made: a list of every segment per unit grew with the square of the size.
            return sync_segment(big.source, big.work, big.plan, big.plan.segment(segment_index), options.hash_method,
                                big.action.path, compare, options.piece_size, punch_stale=big.action.source.sparse)

        self._run_part(unit, index, move)

    def _run_part(self, unit: Unit, index: int, move: Callable[[], int]) -> None:
        """Run one part of big file ``index`` (``move`` returns the bytes it moved), and count it done."""
        moved = 0
        try:
            moved = move()
            self._count("bytes", moved)
        except PdiffcopyError as error:
            self._part_failed(index, str(error))
        self.runner.progress.add(self.slot, 0, unit.weight, moved)
        self._part_done(index)

    def _part_failed(self, index: int, message: str) -> None:
        with self.parts_failed.get_lock():
            if not self.parts_failed[index]:
                self.failures.append((self.runner.big[index].action.path, message))
            self.parts_failed[index] = 1

    def _part_done(self, index: int) -> None:
        with self.parts_left.get_lock():
            self.parts_left[index] -= 1
            last = self.parts_left[index] == 0
        if last:
            self._finish(index)

    def _finish(self, index: int) -> None:
        """The last part of a big file is done: flush, check the source, rename, set metadata."""
        big = self.runner.big[index]
        entry = big.action.source
        try:
            if self.parts_failed[index]:
                raise _AlreadyReported()
            big.work.flush()
            check_size(big.work, entry.size, entry.path)
            if not source_unchanged(big.source, entry.size, entry.mtime_ns):
                raise Conflict("changed while copying")
            big.workfile.finish()
            self.failures += self.runner.target.apply([Operation(METADATA, entry)],
                                                      self.runner.meta)
            self._count("files")
            big.work.close()
        except _AlreadyReported:
            big.give_up()
        except PdiffcopyError as error:
            self.failures.append((entry.path, str(error)))
            big.give_up()


def stops(failures: List[Failure]) -> bool:
    """Whether one of ``failures`` says that the target takes no more writes (full, read-only)."""
    return any(stop_cause(message)[0] for _, message in failures)


class _AlreadyReported(Exception):
    pass


__all__ = ["BigFile", "TreeProgress", "TreeResult", "Unit", "UnitWorker", "combined", "stops", "traffic"]

"""Runs a tree sync's plan: the steps in order here, the queue of units in worker processes.

Workers are forked processes, not threads: per-file work is a dozen system
calls and the Python around them, which threads would serialise on the GIL
(measured: 2 threads copied 10,000 small files slower than 1, 2 processes
1.8x faster). They take unit numbers from one shared counter; the plan
itself is inherited through the fork, never pickled.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from typing import Dict, List, Optional

from pdiffcopy.core.blocks import DEFAULT_SEGMENT_SIZE, BlockPlan, Segment
from pdiffcopy.engine.options import TreeOptions
from pdiffcopy.engine.forkshared import SharedInts
from pdiffcopy.errors import PdiffcopyError, StorageError
from pdiffcopy.engine.segments import TRANSFER_REQUEST_BYTES, source_data_bytes
from pdiffcopy.engine.workfile import open_work
from pdiffcopy.engine.treeendpoints import (
    BACKUP,
    COPIED_FROM_ALTERNATE,
    DELETE,
    LINKED_FROM_ALTERNATE,
    MATCHED_IN_ALTERNATE,
    METADATA,
    MKDIR,
    MKPATH,
    REMOVE,
    REMOVED_FOR_ALTERNATE,
    Failure,
    Operation,
    TreeEndpoint,
)
from pdiffcopy.engine.workers import (
    STOP_SIGNALS,
    Worker,
    WorkerFailed,
    WorkerStart,
    request_stop,
    stop_requests,
    stop_workers,
)
from pdiffcopy.core.treeplan import (
    DIR,
    FILE,
    REASON_NEW,
    Entry,
    FileAction,
    LinkAction,
    TreePlan,
    is_under,
)
from pdiffcopy.core.treestops import NOT_ATTEMPTED, stop_cause
from pdiffcopy.engine.treeunits import BigFile, TreeProgress, TreeResult, Unit, UnitWorker, traffic

logger = logging.getLogger(__name__)

#: A file at least this big, with an older version in the target, goes
#: through the block engine; smaller ones are cheaper to copy whole.
DELTA_MIN_SIZE = 8 * 1024 * 1024

#: A new file at least this big is copied in ranges of this size by several workers.
RANGE_SIZE = DEFAULT_SEGMENT_SIZE

#: A batch of small files: at most this many, or this many bytes (one request
#: each way for remote trees: big enough to hide the round trip; the same
#: bound as one transfer of a big file's ranges).
BATCH_FILES = 256
BATCH_BYTES = TRANSFER_REQUEST_BYTES

#: Deletions and metadata changes per batch.
BATCH_OPERATIONS = 512

#: Units below this total are run in this process: forking costs more than it saves.
INLINE_BYTES = 4 * 1024 * 1024
INLINE_FILES = 64



def log_phase(started: float, message: str, *args) -> None:
    logger.debug("%.3f s: " + message, time.monotonic() - started, *args)


class Runner:
    """Runs one plan: the sequential steps here, the queue in worker processes."""

    def __init__(self, source: TreeEndpoint, target: TreeEndpoint, options: TreeOptions,
                 plan: TreePlan, progress: TreeProgress, result: TreeResult,
                 on_worker_start: Optional[WorkerStart] = None) -> None:
        self.source = source
        self.on_worker_start = on_worker_start
        self.target = target
        self.options = options
        self.plan = plan
        self.progress = progress
        self.result = result
        self.meta = options.metadata
        self.big: List[BigFile] = []
        self.units: List[Unit] = []
        self.source_root: Optional[Entry] = None
        self.started = time.monotonic()
        self.announced: set = set()
        #: Directories that could not be made, shared by the runners of one sync's pieces.
        self.failed_directories: set = set()
        #: The plan's directory fixes are only those to apply (a streamed plan's: see core.treestream).
        self.fixes_filtered = False
        self._workers: List[Worker] = []  # started by start(), collected by finish()
        #: Per big file: parts left to do, and whether one failed (shared with forked workers).
        self._parts: Optional[tuple] = None
        #: The first unit no worker took because the sync stopped (else the number of units).
        self._first_skipped: Optional[SharedInts] = None

    # -- sequential steps --------------------------------------------------

    def run(self, target_missing: bool) -> None:
        """All of the plan, in order."""
        self.start(target_missing)
        self.finish()

    def start(self, target_missing: bool) -> None:
        """Make the directories and start the queue: in forked workers, :meth:`finish` waits for them.

        Between the two the caller may plan what comes next (a streamed plan's
        next piece) while the workers copy.
        """
        plan = self.plan
        progress = self.progress
        progress.phase = "preparing"
        if target_missing:
            making = MKPATH if self.options.mkpath else MKDIR
            failures = self.target.apply([Operation(making, Entry("", DIR, 0, 0, 0o40755))], self.meta)
            if failures:
                raise StorageError(f"Cannot create {self.target.location}: {failures[0][1]}")
        if self.options.backup and not target_missing and not self.result.stopped:
            self._back_up()
        operations = [Operation(REMOVE, entry) for entry in plan.removals] + \
            [Operation(MKDIR, entry) for entry in plan.directories]
        failed_directories = self.failed_directories
        if self.result.stopped:  # by an earlier piece: nothing of this one is tried
            self.result.not_synced += len(plan.directories)
            made: set = set()
        else:
            made = self._apply(operations)
        failed_directories |= made
        self.result.directories_made += len(plan.directories) - len(made)
        log_phase(self.started, "made %d directories", self.result.directories_made)
        if self.result.stopped:
            self.result.not_synced += len(plan.files) + len(plan.symlinks) + len(plan.nodes) + len(plan.metadata) + \
                len([e for e in plan.deletions if e.kind != DIR])
            return
        if self.options.alternate_dirs and plan.files:
            self._take_from_alternates(failed_directories)
        self._build_units(failed_directories)
        log_phase(self.started, "queued %d units", len(self.units))
        progress.files_total += len(plan.files)
        progress.bytes_total += plan.bytes_to_copy
        progress.phase = "copying"
        try:
            self._start_units()
        except BaseException:
            self._give_up_big_files()
            raise

    def finish(self) -> None:
        """Wait for the queue :meth:`start` started, then link, delete directories and fix their metadata."""
        plan = self.plan
        progress = self.progress
        failed_directories = self.failed_directories
        try:
            self._wait_for_workers()
        except BaseException:
            self._give_up_big_files()
            raise
        self._count_skipped()
        for big in self.big:
            big.work.close()  # forked workers ended the leases; our copies of them go too
        log_phase(self.started, "ran the queue")
        progress.phase = "finishing"
        if self.result.stopped:
            # Nothing more is tried; directories keep the permissions they were made with
            # until a run that finishes sets theirs.
            self.result.not_synced += len(plan.links) + len([e for e in plan.deletions if e.kind == DIR])
            return
        self._link(plan.links, failed_directories)
        directories = self._deletable([e for e in plan.deletions if e.kind == DIR])
        self.result.deleted += len(directories) - len(self._apply(
            [Operation(DELETE, entry) for entry in directories]))
        self._apply([Operation(METADATA, fix.source) for fix in self._directory_fixes()]
                    + self._root_fix())
        log_phase(self.started, "deleted and set directory metadata")

    def abandon(self) -> None:
        """Stop the workers :meth:`start` started (the sync fails or is interrupted before :meth:`finish`)."""
        try:
            stop_workers([worker.pid for worker in self._workers])
            self._workers = []
        finally:
            self._give_up_big_files()

    def _give_up_big_files(self) -> None:
        for big in self.big:  # the ones a worker did not finish (renamed or removed)
            big.give_up(announce=False)  # some may be done: not named one by one
        if any(big.partial for big in self.big):
            logger.warning("Kept the partial files of the big files not done; run again with "
                           "--partial (-P) to resume")

    def delete_everything(self, remove_root: bool) -> None:
        files = [e for e in self.plan.deletions if e.kind != DIR]
        directories = self._deletable([e for e in self.plan.deletions if e.kind == DIR])
        self.progress.files_total = len(files)
        self.progress.phase = "deleting"
        self.units = [Unit(0, "delete", tuple(files[i:i + BATCH_OPERATIONS]))
                      for i in range(0, len(files), BATCH_OPERATIONS)]
        self._start_units()
        self._wait_for_workers()
        failed = self._apply([Operation(DELETE, entry) for entry in directories])
        self.result.deleted += len(directories) - len(failed)
        if remove_root and not self.result.failures:
            self._apply([Operation(DELETE, Entry("", DIR, 0, 0, 0o40755))])

    def _link(self, links: List[LinkAction], failed_directories: set) -> None:
        """Link the other names of hard-link groups (-H), now that every group's file is in place.

        After the queue, whichever worker wrote a group's file; a name whose
        group's file (or own directory) failed is a failure of its own, not a
        link to an old file.
        """
        if not links:
            return
        failed = {path for path, _ in self.result.failures} | failed_directories
        operations = []
        for link in links:
            if link.leader in failed:
                self.result.failures.append((link.path, f"not linked: {link.leader!r} was not copied"))
            elif failed_directories and is_under(link.source.parent, failed_directories):
                self.result.failures.append((link.path, "its directory could not be made"))
            else:
                operations.append(link.operation())
        self.result.linked += len(operations) - len(self._apply(operations))
        log_phase(self.started, "linked %d name(s)", self.result.linked)

    def _deletable(self, directories: List[Entry]) -> List[Entry]:
        """The directories to delete, less those holding what the listings could not list.

        Such a directory cannot be emptied: trying would add a "Directory not
        empty" failure for it and each of its parents to the one that says why.
        """
        holding = set()
        for path, _ in self.result.failures:
            while path and path not in holding:
                holding.add(path)
                path = path.rpartition("/")[0]
        return [entry for entry in directories if entry.path not in holding]

    def _apply(self, operations: List[Operation]) -> set:
        """Apply operations in batches, in order, until the target stops taking them; return the
        paths that failed or were not tried."""
        failed: List[Failure] = []
        for start in range(0, len(operations), BATCH_OPERATIONS * 8):
            batch = operations[start:start + BATCH_OPERATIONS * 8]
            if self.result.stopped:
                failed += [(operation.entry.path, NOT_ATTEMPTED) for operation in batch]
                continue
            answered = self.target.apply(batch, self.meta)
            failed += answered
            self._note_stop(answered)
        tried = [failure for failure in failed if failure[1] != NOT_ATTEMPTED]
        self.result.not_synced += len(failed) - len(tried)
        self.result.failures += tried
        return {path for path, _ in failed}

    def _note_stop(self, failures: List[Failure]) -> None:
        """Keep the first failure that says the target takes no more writes as the reason the sync stops."""
        if not self.result.stopped:
            for _, message in failures:
                cause = stop_cause(message)[0]
                if cause:
                    self.result.stopped = cause
                    return

    def _count_skipped(self) -> None:
        """After the queue: what it never ran because the sync stopped is not synced; a big file left
        with parts to do is given up (one of its parts failed, or none had a chance to)."""
        first = self._first_skipped.value if self._first_skipped is not None else len(self.units)
        for unit in self.units[first:]:
            if unit.kind in ("files", "links", "nodes", "metadata", "delete"):
                self.result.not_synced += len(unit.items)
        if self._parts is None:
            return
        parts_left, parts_failed = self._parts
        for index, big in enumerate(self.big):
            if parts_left[index] > 0:
                big.give_up()
                if not parts_failed[index]:
                    self.result.not_synced += 1

    def _root_fix(self) -> List[Operation]:
        """The target root's own permissions (and time, owner), as rsync -a sets them.

        Not for a server's root directory, which the server keeps as it is.
        """
        root = self.source_root
        if root is None or not self.target.may_change_root():
            return []
        return [Operation(METADATA, root._replace(path=""))]

    def _directory_fixes(self):
        """Directory metadata, deepest first: with -t every directory whose contents changed too."""
        if self.fixes_filtered:
            yield from self.plan.directory_metadata
            return
        touched = set()
        if self.options.times:
            changed_paths = [a.path for a in self.plan.files] + \
                [e.path for e, _ in self.plan.symlinks + self.plan.nodes] + [e.path for e in self.plan.deletions] + \
                [link.path for link in self.plan.links] + \
                [e.path for e in self.plan.directories] + [e.path for e in self.plan.removals]
            touched = {path.rpartition("/")[0] for path in changed_paths}
        for fix in self.plan.directory_metadata:
            if fix.changes or fix.source.path in touched:
                yield fix

    # -- the queue ---------------------------------------------------------

    def _build_units(self, failed_directories: set) -> None:
        small: List[FileAction] = []
        for action in self.plan.files:
            if failed_directories and is_under(action.source.parent, failed_directories):
                self.result.failures.append((action.path, "its directory could not be made"))
                continue
            size = action.source.size
            if size >= DELTA_MIN_SIZE and action.reason != REASON_NEW and not self.options.whole_file:
                if action.target is not None and action.target.size and self._wants_chunks(action):
                    self._add_chunked(action)
                else:
                    self._add_big(action, delta=True)
            elif size >= RANGE_SIZE and not (action.source.sparse and self._copies_locally):
                self._add_big(action, delta=False)
            elif size >= RANGE_SIZE:  # copied whole, hole by hole, as one unit
                self.units.append(Unit(size, "files", (action,)))
            else:
                small.append(action)
        # Batches keep path order (neighbours share directories); the queue then
        # runs them by weight.
        small.sort(key=lambda a: a.path)
        batch: List[FileAction] = []
        weight = 0
        for action in small:
            batch.append(action)
            weight += action.source.size
            if len(batch) >= BATCH_FILES or weight >= BATCH_BYTES:
                self.units.append(Unit(weight, "files", tuple(batch)))
                batch, weight = [], 0
        if batch:
            self.units.append(Unit(weight, "files", tuple(batch)))
        links = [entry for entry, _ in self.plan.symlinks]
        for start in range(0, len(links), BATCH_OPERATIONS):
            self.units.append(Unit(0, "links", tuple(links[start:start + BATCH_OPERATIONS])))
        nodes = [entry for entry, _ in self.plan.nodes]
        for start in range(0, len(nodes), BATCH_OPERATIONS):
            self.units.append(Unit(0, "nodes", tuple(nodes[start:start + BATCH_OPERATIONS])))
        fixes = [fix.source for fix in self.plan.metadata]
        for start in range(0, len(fixes), BATCH_OPERATIONS):
            self.units.append(Unit(0, "metadata", tuple(fixes[start:start + BATCH_OPERATIONS])))
        files = [e for e in self.plan.deletions if e.kind != DIR]
        for start in range(0, len(files), BATCH_OPERATIONS):
            self.units.append(Unit(0, "delete", tuple(files[start:start + BATCH_OPERATIONS])))
        self.units.sort(key=lambda unit: unit.weight, reverse=True)

    def _back_up(self) -> None:
        """--backup: keep what this piece replaces or deletes (but directories) before it changes.

        A path whose old version could not be kept is not changed: it fails instead.
        """
        plan, options = self.plan, self.options
        replaced = [a.target for a in plan.files] + [current for _, current in plan.symlinks + plan.nodes] + \
            [link.target for link in plan.links] + plan.removals + plan.deletions
        kept = [Operation(BACKUP, Entry(entry.path, FILE, 0, 0, 0o100600, target=options.backup_path(entry.path)))
                for entry in replaced if entry is not None and entry.kind != DIR]
        failures = self.target.apply(kept, self.meta)
        if not failures:
            return
        self.result.failures += [(path, f"not changed: its old version could not be kept ({message})")
                                 for path, message in failures]
        failed = {path for path, _ in failures}
        plan.files = [a for a in plan.files if a.path not in failed]
        plan.symlinks = [pair for pair in plan.symlinks if pair[0].path not in failed]
        plan.nodes = [pair for pair in plan.nodes if pair[0].path not in failed]
        plan.links = [link for link in plan.links if link.path not in failed]
        plan.removals = [entry for entry in plan.removals if entry.path not in failed]
        plan.deletions = [entry for entry in plan.deletions if entry.path not in failed]

    def _take_from_alternates(self, failed_directories: set) -> None:
        """--link-dest, --copy-dest, --compare-dest: the files their directories have as the source has
        them are taken from there (by the target, on its side) before the queue copies the rest."""
        plan, options, result = self.plan, self.options, self.result
        candidates = [action for action in plan.files
                      if not (failed_directories and is_under(action.source.parent, failed_directories))]
        taken, copied_bytes, failures = self.target.take_from_alternates(
            [action.source for action in candidates], {a.path for a in candidates if a.target is not None},
            options.alternate_dirs, options.alternate_use, self.meta)
        result.failures += failures
        if not taken and not failures:
            return
        done = set(taken) | {path for path, _ in failures}
        for action in plan.files:
            how = taken.get(action.path)
            if how == LINKED_FROM_ALTERNATE:
                result.linked += 1
            elif how == COPIED_FROM_ALTERNATE:
                result.files_copied += 1
            elif how == REMOVED_FOR_ALTERNATE:
                result.deleted += 1
            elif how == MATCHED_IN_ALTERNATE:
                result.unchanged += 1
        result.bytes_moved += copied_bytes
        plan.files = [action for action in plan.files if action.path not in done]
        log_phase(self.started, "took %d files from the alternate directories", len(taken))

    @property
    def _copies_locally(self) -> bool:
        """Whether files go from the source tree to the target by the kernel (whole, holes kept)."""
        return self.target.can_copy_files_from(self.source)

    def _add_big(self, action: FileAction, delta: bool) -> None:
        """Prepare a big file (temporary, size) and queue its parts."""
        try:
            source = self.source.file_endpoint(action.path)
            target = self.target.file_endpoint(action.path)
            # A target with other names gets a new file: written in place it would change
            # the other names too (and a server refuses that).
            temporary = not delta or self.options.atomic or self.options.backup or \
                (action.target is not None and action.target.nlink > 1)
            # In place, nobody else may write it until its last part is checked, or the blocks
            # it leaves alone could change unseen. A partial file is leased from the start (its
            # segments are read back by several workers as they finish): a killed push's next
            # run may wait for it.
            workfile = open_work(target, in_place=not temporary, partial=temporary and self.options.partial,
                                 clone=delta)
            delta = delta or workfile.resumed  # what a killed run left is compared, not copied again
            big = BigFile(action, BlockPlan(0, self.options.block_size), source, workfile, 1)
            try:
                workfile.prepare(action.source.size,
                                 source_data_bytes(source, action.source.size) if action.source.sparse else None,
                                 self.options.sparse)
            except BaseException:
                big.give_up()
                raise
        except PdiffcopyError as error:
            self.result.failures.append((action.path, str(error)))
            return
        index = len(self.big)
        # A changed file goes by segments of the block engine; a new one by
        # segments of RANGE_SIZE, copied whole and read back.
        plan = BlockPlan(action.source.size, self.options.block_size,
                         *(() if delta else (max(RANGE_SIZE, self.options.block_size),)))
        segments = plan.segments()
        self.big.append(BigFile(action, plan, source, workfile, len(segments) or 1))
        for segment in segments or [Segment(0, 0, 0, 0, 0)]:
            self.units.append(Unit(segment.length, "delta" if delta else "range", (index, segment.index)))

    def _wants_chunks(self, action: FileAction) -> bool:
        """Whether a big changed file goes by chunks: ``--delta chunks``, or auto's choice (said with -v).

        Not without room beside it for the new copy the chunks write (the blocks update in place).
        """
        if self.options.delta == "blocks":
            return False
        assert action.target is not None, "only a file with an old version is asked about"
        try:
            source = self.source.file_endpoint(action.path)
            target = self.target.file_endpoint(action.path)
            try:
                if self.options.delta == "auto":
                    from pdiffcopy.engine import autodelta

                    choice = autodelta.choose(source, target, action.source.size, action.target.size,
                                              self.options.hash_method)
                    logger.debug("%s: %s delta (%s)", action.path, choice.delta, choice.reason)
                    if choice.delta != "chunks":
                        return False
                free = target.free_space()
            finally:
                source.close()
                target.close()
        except PdiffcopyError:
            return False  # the block delta meets the same error and reports it for this file
        if free is not None and free < action.source.size:
            logger.warning("Not enough free space beside %s for a new copy (%d bytes needed, %d free); "
                           "comparing fixed blocks instead", action.path, action.source.size, free)
            return False
        return True

    def _add_chunked(self, action: FileAction) -> None:
        """Queue a big changed file for the shift-tolerant delta: one unit, into a new temporary."""
        try:
            source = self.source.file_endpoint(action.path)
            target = self.target.file_endpoint(action.path)
            workfile = open_work(target, in_place=False)
        except PdiffcopyError as error:
            self.result.failures.append((action.path, str(error)))
            return
        index = len(self.big)
        self.big.append(BigFile(action, BlockPlan(action.source.size, self.options.block_size), source,
                                workfile, 1))
        self.units.append(Unit(action.source.size, "chunks", (index, 0)))

    def _start_units(self) -> None:
        """Run the queue here when it is small; otherwise start the workers that run it."""
        if not self.units:
            return
        small_job = sum(u.weight for u in self.units) < INLINE_BYTES and \
            sum(len(u.items) for u in self.units if u.kind != "range" and u.kind != "delta") < INLINE_FILES
        workers = min(self.options.concurrency, len(self.units))
        self._parts = self._part_counters()
        self._first_skipped = SharedInts([len(self.units)])
        if workers <= 1 or small_job:
            state = UnitWorker(self, 0, *self._parts)
            with stop_requests():
                for index in range(len(self.units)):
                    if state.stopped:
                        self._first_skipped.value = index
                        break
                    state.run(self.units[index])
            self._collect(state.failures, state.counts)
            return
        self._start_forked(workers)

    def _part_counters(self):
        """Per big file: parts left to do, and whether one failed (shared by forked workers)."""
        return SharedInts([b.parts for b in self.big] or [0]), SharedInts([0] * (len(self.big) or 1))

    def _start_forked(self, workers: int) -> None:
        next_unit = SharedInts([0])
        assert self._parts is not None and self._first_skipped is not None, "set by _start_units"
        parts_left, parts_failed = self._parts
        first_skipped = self._first_skipped

        def work(slot: int) -> tuple:
            # The parent killed outright: stop at once (on_worker_start). What the worker was
            # writing stays as a temporary, which later runs sweep. Ctrl-C or a stop from the
            # parent: unwind after the unit in hand, so the file being written loses its
            # temporary instead of leaving it behind.
            for signum in STOP_SIGNALS:
                signal.signal(signum, request_stop)
            for tree in (self.source, self.target):
                tree.enter_worker()
            state = UnitWorker(self, slot, parts_left, parts_failed)
            while True:
                with next_unit.get_lock():
                    index = next_unit.value
                    next_unit.value += 1
                if index >= len(self.units):
                    break
                state.run(self.units[index])
                if state.stopped:  # no worker takes another unit
                    with next_unit.get_lock():
                        first_skipped.value = min(first_skipped.value, next_unit.value)
                        next_unit.value = len(self.units)
            state.counts["wire_sent"], state.counts["wire_received"] = traffic(self.source, self.target)
            return state.failures, state.counts, self.target.take_notices()

        try:
            for slot in range(workers):
                self._workers.append(Worker(functools.partial(work, slot), self.on_worker_start))
        except BaseException:
            stop_workers([worker.pid for worker in self._workers])
            self._workers = []
            raise

    def _wait_for_workers(self) -> None:
        """Collect what the forked workers did (none: the queue ran here, or was empty)."""
        waiting = self._workers
        self._workers = []
        try:
            while waiting:
                try:
                    failures, counts, notices = waiting[0].answer()
                except WorkerFailed:
                    self.result.failures.append(("", "a worker process died; run again to finish"))
                    self.result.unfinished += 1
                    continue
                finally:
                    waiting.pop(0)  # answered or dead: reaped
                self._collect(failures, counts)
                self.announce(notices)
        except BaseException:
            stop_workers([worker.pid for worker in waiting])
            raise

    def announce(self, notices: List[str]) -> None:
        """Say what the target could not keep (attributes, say), each kind once however many workers met it."""
        for notice in notices:
            if notice not in self.announced:
                self.announced.add(notice)
                logger.warning("%s: %s", self.target.location, notice)

    def _collect(self, failures: List[Failure], counts: Dict[str, int]) -> None:
        self._note_stop(failures)
        self.result.failures += failures
        self.result.not_synced += counts.get("not_synced", 0)
        self.result.unfinished += counts.get("unfinished", 0)
        self.result.files_copied += counts.get("files", 0)
        self.result.bytes_moved += counts.get("bytes", 0)
        self.result.deleted += counts.get("deleted", 0)
        self.result.nodes_made += counts.get("nodes", 0)
        self.result.metadata_fixed += counts.get("metadata", 0)
        self.result.unchanged += counts.get("unchanged", 0)
        for tree in (self.source, self.target):  # a worker's bytes on the wire, counted here
            tree.add_traffic(counts.get("wire_sent", 0), counts.get("wire_received", 0))


__all__ = ["Runner", "log_phase"]

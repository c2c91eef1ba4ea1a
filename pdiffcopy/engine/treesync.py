"""Tree sync: bring a target directory tree to the state of a source tree.

The steps::

    list both trees (at once) -> plan (pdiffcopy.core.treeplan) -> make room and directories
      -> one queue of work, largest first, run by -c worker processes
      -> delete extraneous directories, deepest first -> directory metadata, deepest first

The queue holds three kinds of unit: a batch of small files, copied whole
(a kernel copy between local trees, one request each way otherwise); a
byte range of a big new file; and one segment of a big changed file, which
goes through the block engine (hash both sides, move the changed blocks,
read them back). A huge file is many units, so it never serialises the
run, and thousands of small files share the workers with it.

Workers are forked processes, not threads: per-file work is a dozen system
calls and the Python around them, which threads would serialise on the GIL
(measured: 2 threads copied 10,000 small files slower than 1, 2 processes
1.8x faster). They take unit numbers from one shared counter; the plan
itself is inherited through the fork, never pickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import DEFAULT_SEGMENT_SIZE, BlockPlan, Segment
from pdiffcopy.core.compression import check_mode
from pdiffcopy.engine import chunked
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.errors import Conflict, FileMissing, PdiffcopyError, StorageError, UsageError
from pdiffcopy.core.hashing import verify_method
from pdiffcopy.core.refine import resolve_piece_size
from pdiffcopy.core.ratelimit import bandwidth_limit
from pdiffcopy.engine.segments import (
    TRANSFER_REQUEST_BYTES,
    FileOptions,
    check_size,
    give_up,
    open_partial,
    prepare_work,
    source_data_bytes,
    source_unchanged,
    sync_segment,
)
from pdiffcopy.engine.treeendpoints import (
    DELETE,
    METADATA,
    MKDIR,
    REMOVE,
    SYMLINK,
    Failure,
    Listing,
    MetadataOptions,
    Operation,
    TreeEndpoint,
)
from pdiffcopy.engine.workers import die_with_parent
from pdiffcopy.core.treeplan import (
    DIR,
    REASON_NEW,
    Difference,
    Entry,
    FileAction,
    LinkAction,
    PathFilter,
    PlanOptions,
    TreePlan,
    describe_plan,
    is_under,
    plan_tree,
)

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


@dataclass(frozen=True)
class TreeOptions(FileOptions):
    """Everything a tree sync can be asked to do differently: a file's options, and these.

    Of the file options, ``cache`` is not used: big members go by ranges, never by a whole-file copy.
    """

    times: bool = False
    owner: bool = False
    checksum: bool = False
    delete: bool = False
    force: bool = False
    fsync: bool = False
    xattrs: bool = False  # -X: extended attributes
    acls: bool = False  # -A: POSIX ACLs
    numeric_ids: bool = False  # ACL entries by number between hosts, not by name
    hard_links: bool = False  # -H: names sharing a file in the source share one in the target
    includes: Tuple[str, ...] = ()
    excludes: Tuple[str, ...] = ()
    rules: Tuple[Tuple[str, str], ...] = ()  # rsync's (+/-, glob) in command-line order
    files_from: Optional[Tuple[str, ...]] = None  # --files-from's paths (None: every path)

    @property
    def metadata(self) -> MetadataOptions:
        return MetadataOptions(times=self.times, owner=self.owner, fsync=self.fsync, xattrs=self.xattrs,
                               acls=self.acls, numeric_ids=self.numeric_ids)


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
    linked: int = 0  # names made (or made again) another name of their hard-link group's file (-H)
    failures: List[Failure] = field(default_factory=list)
    differences: List[Difference] = field(default_factory=list)
    skipped: List[Entry] = field(default_factory=list)
    dry_run: bool = False
    seconds: float = 0.0


class TreeProgress:
    """Counters for the progress display: per worker slots in shared memory."""

    def __init__(self, workers: int) -> None:
        self.slots = multiprocessing.RawArray("q", 2 * max(1, workers) + 2)
        self.moved_slots = multiprocessing.RawArray("q", max(1, workers) + 1)
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
    kind: str  # "files", "range", "delta", "chunks", "links", "metadata", "delete"
    items: tuple


@dataclass
class _BigFile:
    """A file moved in several units (its segments); the unit finishing last completes it."""

    action: FileAction
    plan: BlockPlan
    source: FileEndpoint
    work: FileEndpoint  # the target itself, or a temporary sibling
    target: FileEndpoint
    temporary: bool
    parts: int
    #: Whether ``work`` is a --partial file (a temporary kept when the sync fails).
    partial: bool = False

    def give_up(self, announce: bool = True) -> None:
        """After a failure: keep a partial file, remove a temporary, or end the in-place lease."""
        give_up(self.work, self.action.path, self.partial, self.temporary, announce)


# -- the entry points ------------------------------------------------------


def sync_tree(source: TreeEndpoint, target: TreeEndpoint, options: TreeOptions,
              progress: Optional[TreeProgress] = None,
              report_line: Optional[Callable[[str], None]] = None) -> TreeResult:
    """Make the tree ``target`` hold what the tree ``source`` holds.

    :param report_line: Called with each line of a dry run's or diff's listing.
    :raises PdiffcopyError: When the job cannot start (a missing source,
            --delete with an empty source); failures of single files are
            collected in :attr:`TreeResult.failures` instead.
    """
    with _no_garbage_collection():
        return _sync_tree(source, target, options, progress, report_line)


@contextlib.contextmanager
def _no_garbage_collection():
    """The cyclic garbage collector off while a tree sync runs.

    Listings of 64,000 entries are hundreds of thousands of objects, and
    every collection walks them all, for nothing: a tree sync makes no
    cycles worth collecting. It took 0.3-0.5 s of a 1.4 s no-change sync.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _sync_tree(source: TreeEndpoint, target: TreeEndpoint, options: TreeOptions,
               progress: Optional[TreeProgress],
               report_line: Optional[Callable[[str], None]]) -> TreeResult:
    started = time.monotonic()
    # Checked once, before anything moves; the workers read the size in bytes.
    options = dataclasses.replace(options, piece_size=resolve_piece_size(options.piece_size, options.block_size))
    progress = progress or TreeProgress(options.concurrency)
    path_filter = _filter(options)
    # Checked here too for a caller of the engine; the endpoints were built with them (api.sync_tree).
    bandwidth_limit(options.bwlimit)
    chunked.check_delta(options.delta)
    check_mode(options.compress)
    if not options.dry_run:
        # Its listing removes what killed runs left (a server sweeps its root at start).
        target.sweep_while_listing()
    if options.metadata.attributes:
        for tree in (source, target):
            tree.list_attributes(options.metadata)
    source_listing, target_listing = _list_both(source, target)
    _log_phase(started, "listed %d source and %d target entries", len(source_listing.entries),
               len(target_listing.entries))
    if source_listing.root is None:
        raise FileMissing(f"Source does not exist: {source.location}")
    if source_listing.root.kind != DIR:
        raise UsageError(f"Source is not a directory: {source.location}")
    if target_listing.root is not None and target_listing.root.kind != DIR:
        raise UsageError(f"Target exists and is not a directory: {target.location}")
    plan = plan_tree(source_listing.entries,
                     target_listing.entries if target_listing.root is not None else None,
                     PlanOptions(checksum=options.checksum, times=options.times,
                                 owner=options.owner, delete=options.delete,
                                 attributes=options.metadata.attributes,
                                 hard_links=options.hard_links), path_filter)
    _log_phase(started, "planned %d file(s) to copy or check", len(plan.files))
    result = TreeResult(source.location, target.location, dry_run=options.dry_run,
                        failures=list(source_listing.failures) + list(target_listing.failures),
                        unchanged=plan.unchanged, skipped=plan.specials)
    if options.delete and plan.deletions and not options.force and not path_filter.apply(
            source_listing.entries):
        raise UsageError(f"Refusing to delete everything in {target.location}: the source "
                         f"{source.location} has nothing to sync (use --force to do it anyway)")
    if plan.deletions and source_listing.failures:
        # What the source could not list looks deleted: deleting it would lose data.
        logger.warning("Not deleting anything: %d part(s) of the source could not be listed",
                       len(source_listing.failures))
        plan.extraneous, plan.deletions = plan.deletions, []
    _warn_about(plan)
    if options.dry_run:
        result.differences = describe_plan(plan, _compare_contents(source, target, plan, options))
        for line in result.differences:
            if report_line:
                report_line(line.render())
        result.seconds = time.monotonic() - started
        return result
    runner = _Runner(source, target, options, plan, progress, result)
    runner.source_root = source_listing.root
    try:
        runner.run(target_listing.root is None)
    finally:
        runner.announce(target.take_notices())
    result.seconds = time.monotonic() - started
    return result


def remove_tree(tree: TreeEndpoint, options: TreeOptions, progress: Optional[TreeProgress] = None,
                report_line: Optional[Callable[[str], None]] = None) -> TreeResult:
    """Delete a tree in parallel: files first (all workers), then directories deepest first.

    With includes or excludes only the selected entries go, and the
    directories that end up empty; without, the root goes too.
    """
    with _no_garbage_collection():
        return _remove_tree(tree, options, progress, report_line)


def _remove_tree(tree: TreeEndpoint, options: TreeOptions, progress: Optional[TreeProgress],
                 report_line: Optional[Callable[[str], None]]) -> TreeResult:
    started = time.monotonic()
    progress = progress or TreeProgress(options.concurrency)
    path_filter = _filter(options)
    listing = tree.list()
    if listing.root is None:
        raise FileMissing(f"Nothing to remove: {tree.location} does not exist")
    result = TreeResult(tree.location, tree.location, dry_run=options.dry_run,
                        failures=list(listing.failures))
    plan = plan_tree([], listing.entries, PlanOptions(delete=True), path_filter)
    if options.dry_run:
        for entry in plan.deletions:
            result.differences.append(Difference("delete", entry.kind, entry.path))
            if report_line:
                report_line(result.differences[-1].render())
        result.seconds = time.monotonic() - started
        return result
    runner = _Runner(tree, tree, options, plan, progress, result)
    try:
        runner.delete_everything(remove_root=not path_filter.active and not listing.failures
                                 and listing.root.kind == DIR)
    finally:
        runner.announce(tree.take_notices())
    result.seconds = time.monotonic() - started
    return result


def _log_phase(started: float, message: str, *args) -> None:
    logger.debug("%.3f s: " + message, time.monotonic() - started, *args)


def _filter(options: TreeOptions) -> PathFilter:
    try:
        return PathFilter(options.includes, options.excludes, options.rules, options.files_from)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _list_both(source: TreeEndpoint, target: TreeEndpoint) -> Tuple[Listing, Listing]:
    """List both trees at the same time.

    A remote tree is listed by its server while this process walks the
    local one (a thread waits for the answer). Two local trees are walked by
    two processes: the walk is mostly Python, which two threads would run
    one at a time (64,000 entries: 0.38 s each; the child's list costs
    ~0.1 s to pickle and 0.03 s to read back).
    """
    if source.walks_here() and target.walks_here():
        receive = _list_in_child(target)
        try:
            source_listing = source.list()
        except BaseException:
            try:
                receive()  # reap the child
            except BaseException:
                pass
            raise
        return source_listing, receive()
    listed: List[Listing] = []
    errors: List[BaseException] = []

    def list_target() -> None:
        try:
            listed.append(target.list())
        except BaseException as error:  # handed to the caller below
            errors.append(error)

    thread = threading.Thread(target=list_target, name="list-target")
    thread.start()
    try:
        source_listing = source.list()
    finally:
        thread.join()
    if errors:
        raise errors[0]
    return source_listing, listed[0]


def _list_in_child(tree: TreeEndpoint) -> Callable[[], Listing]:
    """Start listing ``tree`` in a forked process; return the function that collects it."""
    reader, writer = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            die_with_parent(parent)
            os.close(reader)
            try:
                listing = tree.list()
                answer: tuple = ("ok", listing.root and tuple(listing.root),
                                 [tuple(e) for e in listing.entries], listing.failures, tree.traffic())
            except BaseException as error:
                answer = ("error", error)
            with os.fdopen(writer, "wb") as stream:
                pickle.dump(answer, stream, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(writer)

    def receive() -> Listing:
        try:
            with os.fdopen(reader, "rb") as stream:
                data = stream.read()
        finally:
            os.waitpid(pid, 0)
        if not data:
            raise StorageError(f"Listing {tree.location} failed: the listing process died")
        answer = pickle.loads(data)
        if answer[0] == "error":
            raise answer[1]
        _, root, entries, failures, child_wire = answer
        tree.add_traffic(*child_wire)  # the child's bytes on the wire are this sync's too
        new = tuple.__new__  # Entry._make, without a Python call per entry
        return Listing(new(Entry, root) if root else None, [new(Entry, e) for e in entries], failures)

    return receive


def _warn_about(plan: TreePlan) -> None:
    if plan.specials:
        names = ", ".join(e.path for e in plan.specials[:5])
        more = f" and {len(plan.specials) - 5} more" if len(plan.specials) > 5 else ""
        logger.warning("Skipped %d special file(s) (fifos, sockets, devices): %s%s",
                       len(plan.specials), names, more)
    if plan.hard_links:
        logger.warning("Copied %d hard-linked file(s) as separate files (hard links are kept "
                       "with -H/--hard-links)", len(plan.hard_links))


def _compare_contents(source: TreeEndpoint, target: TreeEndpoint, plan: TreePlan,
                      options: TreeOptions) -> Dict[str, bool]:
    """For a dry run: which same-size files really differ (by their block digests)."""
    method = verify_method(options.hash_method)
    differs: Dict[str, bool] = {}
    for action in plan.files:
        if action.reason == REASON_NEW or action.target is None or \
                action.source.size != action.target.size:
            continue
        try:
            ranges = [(0, action.source.size)] if action.source.size else []
            ours = source.file_endpoint(action.path).hash_ranges(ranges, options.block_size, method)
            theirs = target.file_endpoint(action.path).hash_ranges(ranges, options.block_size, method)
            differs[action.path] = ours != theirs
        except PdiffcopyError:
            continue  # unknown: listed without "content"
    return differs


# -- running a plan --------------------------------------------------------


class _Runner:
    """Runs one plan: the sequential steps here, the queue in worker processes."""

    def __init__(self, source: TreeEndpoint, target: TreeEndpoint, options: TreeOptions,
                 plan: TreePlan, progress: TreeProgress, result: TreeResult) -> None:
        self.source = source
        self.target = target
        self.options = options
        self.plan = plan
        self.progress = progress
        self.result = result
        self.meta = options.metadata
        self.big: List[_BigFile] = []
        self.units: List[Unit] = []
        self.source_root: Optional[Entry] = None
        self.started = time.monotonic()
        self.announced: set = set()

    # -- sequential steps --------------------------------------------------

    def run(self, target_missing: bool) -> None:
        plan = self.plan
        progress = self.progress
        progress.phase = "preparing"
        if target_missing:
            failures = self.target.apply([Operation(MKDIR, Entry("", DIR, 0, 0, 0o40755))], self.meta)
            if failures:
                raise StorageError(f"Cannot create {self.target.location}: {failures[0][1]}")
        operations = [Operation(REMOVE, entry) for entry in plan.removals] + \
            [Operation(MKDIR, entry) for entry in plan.directories]
        failed_directories = self._apply(operations)
        self.result.directories_made = len(plan.directories) - len(failed_directories)
        _log_phase(self.started, "made %d directories", self.result.directories_made)
        self._build_units(failed_directories)
        _log_phase(self.started, "queued %d units", len(self.units))
        progress.files_total = len(plan.files)
        progress.bytes_total = plan.bytes_to_copy
        progress.phase = "copying"
        try:
            self._run_units()
        except BaseException:
            for big in self.big:  # the ones a worker did not finish (renamed or removed)
                big.give_up(announce=False)  # some may be done: not named one by one
            if any(big.partial for big in self.big):
                logger.warning("Kept the partial files of the big files not done; run again with "
                               "--partial (-P) to resume")
            raise
        for big in self.big:
            big.work.close()  # forked workers ended the leases; our copies of them go too
        _log_phase(self.started, "ran the queue")
        progress.phase = "finishing"
        self._link(plan.links, failed_directories)
        directories = self._deletable([e for e in plan.deletions if e.kind == DIR])
        self.result.deleted += len(directories) - len(self._apply(
            [Operation(DELETE, entry) for entry in directories]))
        self._apply([Operation(METADATA, fix.source) for fix in self._directory_fixes()]
                    + self._root_fix())
        _log_phase(self.started, "deleted and set directory metadata")

    def delete_everything(self, remove_root: bool) -> None:
        files = [e for e in self.plan.deletions if e.kind != DIR]
        directories = self._deletable([e for e in self.plan.deletions if e.kind == DIR])
        self.progress.files_total = len(files)
        self.progress.phase = "deleting"
        self.units = [Unit(0, "delete", tuple(files[i:i + BATCH_OPERATIONS]))
                      for i in range(0, len(files), BATCH_OPERATIONS)]
        self._run_units()
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
        _log_phase(self.started, "linked %d name(s)", self.result.linked)

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
        """Apply operations in batches, in order; return the paths that failed."""
        failed: List[Failure] = []
        for start in range(0, len(operations), BATCH_OPERATIONS * 8):
            failed += self.target.apply(operations[start:start + BATCH_OPERATIONS * 8], self.meta)
        self.result.failures += failed
        return {path for path, _ in failed}

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
        touched = set()
        if self.options.times:
            changed_paths = [a.path for a in self.plan.files] + \
                [e.path for e, _ in self.plan.symlinks] + [e.path for e in self.plan.deletions] + \
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
                if self.options.delta == "chunks" and action.target is not None and action.target.size:
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
        fixes = [fix.source for fix in self.plan.metadata]
        for start in range(0, len(fixes), BATCH_OPERATIONS):
            self.units.append(Unit(0, "metadata", tuple(fixes[start:start + BATCH_OPERATIONS])))
        files = [e for e in self.plan.deletions if e.kind != DIR]
        for start in range(0, len(files), BATCH_OPERATIONS):
            self.units.append(Unit(0, "delete", tuple(files[start:start + BATCH_OPERATIONS])))
        self.units.sort(key=lambda unit: unit.weight, reverse=True)

    @property
    def _copies_locally(self) -> bool:
        """Whether files go from the source tree to the target by the kernel (whole, holes kept)."""
        return self.target.can_copy_files_from(self.source)

    def _add_big(self, action: FileAction, delta: bool) -> None:
        """Prepare a big file (temporary, size) and queue its parts."""
        try:
            source = self.source.file_endpoint(action.path)
            target = self.target.file_endpoint(action.path)
            # A target with other names gets a new file (-H): written in place it would
            # change names outside its group too (and a server refuses that).
            temporary = not delta or self.options.atomic or \
                (self.options.hard_links and action.target is not None and action.target.nlink > 1)
            partial = False
            if not temporary:
                # Updated in place: nobody else may write it until its last part is
                # checked, or the blocks it leaves alone could change unseen.
                target.take_lease()
            if temporary and self.options.partial:
                # Leased from the start (its segments are read back by several
                # workers as they finish): a killed push's next run may wait for it.
                work, resumed, partial = open_partial(target, clone=delta)
                delta = delta or resumed  # what a killed run left is compared, not copied again
            else:
                work = target.create_temporary(clone=delta) if temporary else target
            if self.options.sparse:
                work.write_sparse(True)
            big = _BigFile(action, BlockPlan(0, self.options.block_size), source, work, target, temporary, 1,
                           partial)
            try:
                prepare_work(work, action.source.size,
                             source_data_bytes(source, action.source.size) if action.source.sparse else None)
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
        self.big.append(_BigFile(action, plan, source, work, target, temporary, len(segments) or 1, partial))
        for segment in segments or [Segment(0, 0, 0, 0, 0)]:
            self.units.append(Unit(segment.length, "delta" if delta else "range", (index, segment.index)))

    def _add_chunked(self, action: FileAction) -> None:
        """Queue a big changed file for the shift-tolerant delta: one unit, into a new temporary."""
        try:
            source = self.source.file_endpoint(action.path)
            target = self.target.file_endpoint(action.path)
            work = target.create_temporary(clone=False)
        except PdiffcopyError as error:
            self.result.failures.append((action.path, str(error)))
            return
        index = len(self.big)
        self.big.append(_BigFile(action, BlockPlan(action.source.size, self.options.block_size), source, work,
                                 target, True, 1))
        self.units.append(Unit(action.source.size, "chunks", (index, 0)))

    def _run_units(self) -> None:
        if not self.units:
            return
        small_job = sum(u.weight for u in self.units) < INLINE_BYTES and \
            sum(len(u.items) for u in self.units if u.kind != "range" and u.kind != "delta") < INLINE_FILES
        workers = min(self.options.concurrency, len(self.units))
        if workers <= 1 or small_job:
            state = _WorkerState(self, 0, *self._part_counters())
            previous = {signum: signal.signal(signum, _request_stop) for signum in _STOP_SIGNALS} \
                if threading.current_thread() is threading.main_thread() else {}
            try:
                for index in range(len(self.units)):
                    if state.full:
                        break
                    state.run(self.units[index])
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
                _Stop.requested = False
            self._collect(state.failures, state.counts)
            return
        self._run_forked(workers)

    def _part_counters(self):
        """Per big file: parts left to do, and whether one failed (shared by forked workers)."""
        context = multiprocessing.get_context("fork")
        return (context.Array("i", [b.parts for b in self.big] or [0]),
                context.Array("i", [0] * (len(self.big) or 1)))

    def _run_forked(self, workers: int) -> None:
        context = multiprocessing.get_context("fork")
        next_unit = context.Value("q", 0)
        parts_left, parts_failed = self._part_counters()
        processes = []
        parent = os.getpid()
        for slot in range(workers):
            reader, writer = os.pipe()
            pid = os.fork()
            if pid == 0:  # the worker
                os.close(reader)
                code = 0
                try:
                    # The parent killed outright: stop at once (SIGKILL). What the
                    # worker was writing stays as a temporary, which later runs sweep.
                    die_with_parent(parent)
                    # Ctrl-C or a stop from the parent: unwind, so the file being
                    # written loses its temporary instead of leaving it behind.
                    for signum in _STOP_SIGNALS:
                        signal.signal(signum, _request_stop)
                    for tree in (self.source, self.target):
                        tree.enter_worker()
                    state = _WorkerState(self, slot, parts_left, parts_failed)
                    while True:
                        with next_unit.get_lock():
                            index = next_unit.value
                            next_unit.value += 1
                        if index >= len(self.units):
                            break
                        state.run(self.units[index])
                        if state.full:  # no worker takes another unit
                            with next_unit.get_lock():
                                next_unit.value = len(self.units)
                    state.counts["wire_sent"], state.counts["wire_received"] = _traffic(self.source, self.target)
                    with os.fdopen(writer, "wb") as stream:
                        pickle.dump((state.failures, state.counts, self.target.take_notices()), stream)
                except BaseException:  # never run the parent's code in a child
                    code = 1
                finally:
                    os._exit(code)
            os.close(writer)
            processes.append((pid, reader))
        try:
            for pid, reader in processes:
                with os.fdopen(reader, "rb") as stream:
                    data = stream.read()
                _, status = os.waitpid(pid, 0)
                if data:
                    failures, counts, notices = pickle.loads(data)
                    self._collect(failures, counts)
                    self.announce(notices)
                elif status:
                    self.result.failures.append(("", "a worker process died; run again to finish"))
        except BaseException:
            _stop_workers([pid for pid, _ in processes])
            raise

    def announce(self, notices: List[str]) -> None:
        """Say what the target could not keep (attributes, say), each kind once however many workers met it."""
        for notice in notices:
            if notice not in self.announced:
                self.announced.add(notice)
                logger.warning("%s: %s", self.target.location, notice)

    def _collect(self, failures: List[Failure], counts: Dict[str, int]) -> None:
        if counts.get("full") and not any(path == "" and message.startswith(_FULL_STOP)
                                          for path, message in self.result.failures):
            self.result.failures.append(("", f"{_FULL_STOP}; free some space and run again"))
        self.result.failures += failures
        self.result.files_copied += counts.get("files", 0)
        self.result.bytes_moved += counts.get("bytes", 0)
        self.result.deleted += counts.get("deleted", 0)
        self.result.metadata_fixed += counts.get("metadata", 0)
        self.result.unchanged += counts.get("unchanged", 0)
        for tree in (self.source, self.target):  # a worker's bytes on the wire, counted here
            tree.add_traffic(counts.get("wire_sent", 0), counts.get("wire_received", 0))


def _traffic(*trees: TreeEndpoint) -> Tuple[int, int]:
    """Bytes this process sent and received on the wire for ``trees`` (a local tree's are none)."""
    sent, received = zip(*(tree.traffic() for tree in trees))
    return sum(sent), sum(received)


class _WorkerState:
    """What one worker does with the units it takes."""

    def __init__(self, runner: _Runner, slot: int, parts_left, parts_failed) -> None:
        self.runner = runner
        self.slot = slot
        self.parts_left = parts_left
        self.parts_failed = parts_failed
        self.failures: List[Failure] = []
        self.counts: Dict[str, int] = {"files": 0, "bytes": 0, "deleted": 0, "metadata": 0,
                                       "unchanged": 0, "full": 0}
        #: What runs each kind of unit (Unit.kind).
        self._runs: Dict[str, Callable[[Unit], None]] = {
            "files": self._run_files, "range": self._run_range, "delta": self._run_delta,
            "chunks": self._run_chunks,
            "links": self._run_links, "metadata": self._run_metadata, "delete": self._run_delete}

    def run(self, unit: Unit) -> None:
        if _Stop.requested:
            raise KeyboardInterrupt
        known = len(self.failures)
        try:
            self._runs[unit.kind](unit)
        except PdiffcopyError as error:
            self.failures.append(("", str(error)))
        if any(full in message for _, message in self.failures[known:] for full in _NO_SPACE):
            self.counts["full"] = 1  # every further write would fail the same way

    @property
    def full(self) -> bool:
        return bool(self.counts["full"])

    def _count(self, key: str, value: int = 1) -> None:
        self.counts[key] += value

    # -- small files -------------------------------------------------------

    def _run_files(self, unit: Unit) -> None:
        """A batch of small files: new ones, rewritten ones, and ones to compare first."""
        actions: Sequence[FileAction] = unit.items
        fresh = {a.path for a in actions if a.target is None}
        compare = {a.path for a in actions if a.target is not None
                   and a.target.size == a.source.size}
        source, target = self.runner.source, self.runner.target
        if target.can_copy_files_from(source):
            self._copy_locally(source, target, [a.source for a in actions], fresh, compare)
        else:
            self._transfer(source, target, [a.source for a in actions], fresh, compare)
        self.runner.progress.add(self.slot, len(actions), unit.weight)

    def _copy_locally(self, source, target, entries: List[Entry], fresh: set, compare: set) -> None:
        """Between local trees the kernel copies; files to compare are read on both sides first."""
        for check, new in ((False, True), (False, False), (True, False)):
            group = [e for e in entries if (e.path in compare) == check and (e.path in fresh) == new]
            if not group:
                continue
            failures, moved, count = target.copy_files_from(source, group, self.runner.meta,
                                                            compare=check, fresh=new)
            self.failures += failures
            self._count("files", count)
            self._count("bytes", moved)
            self._count("unchanged", len(group) - count - len(failures))

    def _transfer(self, source, target, entries: List[Entry], fresh: set, compare: set) -> None:
        """Through a server: one request reads the batch, one (or two) write it."""
        meta = self.runner.meta
        to_write: List[Tuple[Entry, bytes]] = []
        for entry, data, error in source.read_files(entries):
            if data is None:
                self.failures.append((entry.path, error))
            elif entry.path in compare and target.same_content(entry, data):
                # Pulled and already right: only its metadata (its time, say) differs.
                self.failures += target.apply([Operation(METADATA, entry)], meta)
                self._count("unchanged")
            else:
                to_write.append((entry, data))
        failures: List[Failure] = []
        for new in (True, False):
            batch = [(e, d) for e, d in to_write if (e.path in fresh) == new]
            if batch:
                failures += target.write_files(batch, meta, fresh=new)
        failed = {path for path, _ in failures}
        self.failures += failures
        done = [(e, d) for e, d in to_write if e.path not in failed]
        self._count("files", len(done))
        self._count("bytes", sum(len(d) for _, d in done))

    def _run_links(self, unit: Unit) -> None:
        self.failures += self.runner.target.apply([Operation(SYMLINK, e) for e in unit.items],
                                                  self.runner.meta)

    def _run_metadata(self, unit: Unit) -> None:
        failures = self.runner.target.apply([Operation(METADATA, e) for e in unit.items],
                                            self.runner.meta)
        self.failures += failures
        self._count("metadata", len(unit.items) - len(failures))

    def _run_delete(self, unit: Unit) -> None:
        failures = self.runner.target.apply([Operation(DELETE, e) for e in unit.items],
                                            self.runner.meta)
        self.failures += failures
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
        """A big changed file by content-defined chunks (pdiffcopy.engine.chunked), whole, verified."""
        index, _ = unit.items
        big = self.runner.big[index]
        moved = 0
        try:
            assert big.action.target is not None, "only files with an old version are queued so"
            moved = chunked.sync_file(big.source, big.target, big.work, big.action.source.size,
                                      big.action.target.size, self.runner.options.block_size,
                                      verify_method(self.runner.options.hash_method),
                                      self.runner.options.concurrency, big.action.path)
            self._count("bytes", moved)
        except PdiffcopyError as error:
            self._part_failed(index, str(error))
        self.runner.progress.add(self.slot, 0, unit.weight, moved)
        self._part_done(index)

    def _run_segment(self, unit: Unit, compare: bool) -> None:
        index, segment_index = unit.items
        big = self.runner.big[index]
        moved = 0
        try:
            segments = big.plan.segments()
            if segments:
                options = self.runner.options
                moved = sync_segment(big.source, big.work, big.plan, segments[segment_index],
                                     options.hash_method, big.action.path, compare,
                                     options.piece_size)
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
            if big.temporary:
                if big.partial:
                    big.work.end_lease()  # fails if it lapsed and somebody else wrote meanwhile
                big.work.replace(big.target)
            else:
                big.work.end_lease()  # fails if it lapsed and somebody else wrote meanwhile
            self.failures += self.runner.target.apply([Operation(METADATA, entry)],
                                                      self.runner.meta)
            self._count("files")
            big.work.close()
        except _AlreadyReported:
            big.give_up()
        except PdiffcopyError as error:
            self.failures.append((entry.path, str(error)))
            big.give_up()


#: Seconds stopped workers get to finish their unit before they are killed.
STOP_GRACE_SECONDS = 10.0


def _stop_workers(pids: List[int]) -> None:
    """Ask every worker to stop after its unit (Ctrl-C may not have reached them), then wait."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    waiting = set(pids)
    while waiting:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG if time.monotonic() < deadline else 0)
            except ChildProcessError:
                done = pid
            if done:
                waiting.discard(pid)
        if waiting and time.monotonic() >= deadline:
            for pid in waiting:
                os.kill(pid, signal.SIGKILL)
        if waiting:
            time.sleep(0.01)


#: Signals after which the workers stop after the unit in hand: Ctrl-C, and
#: what the command line treats like it (cli.CLEAN_UP_SIGNALS).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stop:
    """Set by Ctrl-C or SIGTERM while the queue runs: stop after the unit in hand."""

    requested = False


def _request_stop(signum, frame) -> None:
    # No exception here: raised in the middle of a file it would leave a
    # partial file or a temporary behind. Units are small (a batch of small
    # files, 64 MiB of a big one), so the stop comes within a fraction of a second.
    _Stop.requested = True


#: How a full target file system shows in a failure, and what the run then says.
_NO_SPACE = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
_FULL_STOP = "The target file system is full: stopped"


class _AlreadyReported(Exception):
    pass


__all__ = ["TreeOptions", "TreeProgress", "TreeResult", "remove_tree", "sync_tree"]

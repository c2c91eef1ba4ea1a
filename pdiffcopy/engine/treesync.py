"""Tree sync: bring a target directory tree to the state of a source tree.

The steps::

    walk both trees (at once), each directory's entries sorted by name
      -> plan as both listings come, in pieces (pdiffcopy.core.treestream)
      -> per piece: make room and directories; one queue of work, largest first,
         run by -c worker processes; links; the fixes of the directories left behind
      -> last piece: delete extraneous entries (once both walks ended), directory metadata

The queue holds three kinds of unit: a batch of small files, copied whole
(a kernel copy between local trees, one request each way otherwise); a
byte range of a big new file; and one segment of a big changed file, which
goes through the block engine (hash both sides, move the changed blocks,
read them back). A huge file is many units, so it never serialises the
run, and thousands of small files share the workers with it. A piece holds
at most :data:`~pdiffcopy.core.treestream.PIECE_ACTIONS` actions, so a sync holds
about the same memory for a million files as for twenty thousand, and copying
starts before the walks end: the next piece is planned while the workers copy
the one before it (:meth:`Runner.start`, then :meth:`Runner.finish`).

The listings are :mod:`~pdiffcopy.engine.treelisting`'s, the units and their
counters :mod:`~pdiffcopy.engine.treeunits`' and the run of the queue in forked
workers :mod:`~pdiffcopy.engine.treerunner`'s; this module holds the entry
points and the dry run.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
from typing import Callable, Dict, Iterator, List, Optional, Set

from pdiffcopy.engine.options import TreeOptions
from pdiffcopy.errors import FileMissing, NotAFile, PdiffcopyError, UsageError
from pdiffcopy.core.hashing import verify_method
from pdiffcopy.core.treeplan import (
    DIR,
    SYMLINK,
    REASON_NEW,
    Difference,
    Entry,
    PathFilter,
    PlanOptions,
    TreePlan,
    describe_plan,
    plan_tree,
    printable,
    root_fix,
    transfer_listing,
)
from pdiffcopy.core import records
from pdiffcopy.core.filters import glob_escape
from pdiffcopy.core.itemize import itemized_lines
from pdiffcopy.core.treestream import StreamPlanner
from pdiffcopy.core.entries import BLOCK_DEVICE, CHAR_DEVICE, node_type
from pdiffcopy.core.treestops import NODES_DEVICES, NODES_SPECIALS, NOT_KEPT_OWNER, NOT_KEPT_XATTRS
from pdiffcopy.core.xattrs import PRIVILEGED_PREFIXES
from pdiffcopy.engine.segments import hash_both
from pdiffcopy.engine.treeendpoints import MATCHED_IN_ALTERNATE, Failure, ListingStream, TreeEndpoint
from pdiffcopy.engine.treelisting import stream_both
from pdiffcopy.engine.treerunner import Runner, log_phase
from pdiffcopy.engine.treeunits import TreeProgress, TreeResult
from pdiffcopy.engine.workers import WorkerStart

logger = logging.getLogger(__name__)


# -- the entry points ------------------------------------------------------


def run_tree_sync(source: TreeEndpoint, target: TreeEndpoint, options: TreeOptions,
              progress: Optional[TreeProgress] = None,
              report_line: Optional[Callable[[str], None]] = None,
              on_worker_start: Optional[WorkerStart] = None,
              transfer_line: Optional[Callable[[str], None]] = None,
              itemize_line: Optional[Callable[[str], None]] = None) -> TreeResult:
    """Make the tree ``target`` hold what the tree ``source`` holds.

    :param report_line: Called with each line of a dry run's or diff's listing.
    :param transfer_line: Called with each path a sync changes as it starts on it
                          (:func:`~pdiffcopy.core.treeplan.transfer_listing`: rsync's ``-v``).
    :param itemize_line: Called with each change in rsync's ``-i`` code as the sync starts on it
                         (:func:`~pdiffcopy.core.itemize.itemized_lines`); in a dry run, instead of
                         ``report_line``.
    :param on_worker_start: What each forked worker does first, given this process's id:
                            :func:`pdiffcopy.api.sync_tree` passes
                            ``pdiffcopy.local.processes.die_with_parent``.
    :raises PdiffcopyError: When the job cannot start (a missing source,
            --delete with an empty source); failures of single files are
            collected in :attr:`TreeResult.failures` instead.
    """
    with _no_garbage_collection():
        return _sync_tree(source, target, options, progress, report_line, on_worker_start, transfer_line,
                          itemize_line)


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
               report_line: Optional[Callable[[str], None]],
               on_worker_start: Optional[WorkerStart],
               transfer_line: Optional[Callable[[str], None]] = None,
               itemize_line: Optional[Callable[[str], None]] = None) -> TreeResult:
    started = time.monotonic()
    progress = progress or TreeProgress(options.concurrency)
    path_filter = _filter(options)
    if path_filter.files_from is not None:  # only what is on the way to a listed path, or below one
        for tree in (source, target):
            tree.walk_only(path_filter.listed)
    if options.alternate_dirs and not target.takes_from_alternates():
        raise UsageError(f"--{options.alternate_use}-dest: {target.location} does not take files from "
                         f"other directories")
    if not options.dry_run:
        # Its listing removes what killed runs left (a server sweeps its root at start).
        target.sweep_while_listing()
        target.expect_writes(options.asked_writes)
    if options.metadata.attributes:
        for tree in (source, target):
            tree.list_attributes(options.metadata)
    if options.copy_devices and not source.list_devices_as_files():
        logger.warning("%s: --copy-devices reads the block devices of a local source only: these are "
                       "devices here (made as nodes with -D, skipped otherwise)", source.location)
    source_stream, target_stream = stream_both(source, target, on_worker_start)
    try:
        return _sync_streams(source, target, options, progress, report_line, on_worker_start, path_filter,
                             source_stream, target_stream, started, transfer_line, itemize_line)
    finally:
        source_stream.close()
        target_stream.close()


def _sync_streams(source: TreeEndpoint, target: TreeEndpoint, options: TreeOptions, progress: TreeProgress,
                  report_line: Optional[Callable[[str], None]], on_worker_start: Optional[WorkerStart],
                  path_filter: PathFilter, source_stream: ListingStream, target_stream: ListingStream,
                  started: float, transfer_line: Optional[Callable[[str], None]] = None,
                  itemize_line: Optional[Callable[[str], None]] = None) -> TreeResult:
    """Plan and run the sync a piece at a time, as the two listings come (core.treestream)."""
    if source_stream.root is None:
        raise FileMissing(f"Source does not exist: {source.location}")
    if source_stream.root.kind != DIR:
        raise NotAFile(f"Source is not a directory: {source.location}")
    target_missing = target_stream.root is None
    if not target_missing and target_stream.root.kind != DIR:
        raise NotAFile(f"Target exists and is not a directory: {target.location}")
    source_failures: List[Failure] = []
    target_failures: List[Failure] = []
    # What the target said it will not set is no change: setting it would change nothing.
    not_kept = target.not_kept()
    makes = target.makes_nodes()
    privileged_kept = NOT_KEPT_XATTRS not in not_kept or not options.metadata.attributes
    stripped: List[str] = []  # the first source entry whose privileged attributes were left out
    planner = StreamPlanner(PlanOptions(checksum=options.checksum, times=options.times,
                                        owner=options.owner and NOT_KEPT_OWNER not in not_kept,
                                        delete=options.delete,
                                        attributes=options.metadata.attributes,
                                        hard_links=options.hard_links,
                                        devices=options.devices and NODES_DEVICES in makes,
                                        specials=options.specials and NODES_SPECIALS in makes,
                                        symlinks=options.symlinks, update=options.update,
                                        existing=options.existing, ignore_existing=options.ignore_existing,
                                        size_only=options.size_only, ignore_times=options.ignore_times,
                                        modify_window=options.modify_window, max_size=options.max_size,
                                        min_size=options.min_size), path_filter)
    pieces = planner.plan(_entries(source_stream, source_failures, privileged_kept, stripped),
                          None if target_missing else _entries(target_stream, target_failures, privileged_kept))
    result = TreeResult(source.location, target.location, dry_run=options.dry_run)
    whole = TreePlan() if options.dry_run else None  # a dry run lists every difference in path order
    failed_directories: Set[str] = set()
    hard_links: List[Entry] = []  # -H not given: the first few names copied as separate files
    hard_link_count = 0
    announced: set = set()  # what the target could not keep, said once for all pieces
    target_made = not target_missing
    running: Optional[Runner] = None  # the piece whose queue the workers run while the next is planned
    try:
        for piece in pieces:
            log_phase(started, "planned %d source entries", planner.wanted)
            if running is not None:
                running, finishing = None, running
                _finish(finishing, target)
            result.unchanged += piece.unchanged
            result.skipped += piece.specials
            hard_link_count += len(piece.hard_links)
            hard_links += piece.hard_links[:5 - len(hard_links)]
            if planner.finished:
                log_phase(started, "listed and planned %d source entries", planner.wanted)
                # A --files-from path the source does not have fails as one it could not list would.
                source_failures += [(path, "No such file or directory (listed in --files-from)")
                                    for path in path_filter.missing()]
                result.failures += source_failures + target_failures
                _check_deletions(piece, source, target, options, planner, source_failures, result)
                _warn_about(result.skipped, hard_links, hard_link_count, options, target)
                if stripped:
                    logger.warning("%s: security.* and trusted.* attributes are not kept: it does not set "
                                   "them for this client", target.location)
            if whole is not None:
                _add_piece(whole, piece)
                continue
            if piece.empty and not planner.finished:
                continue
            if transfer_line is not None:
                for line in transfer_listing(piece):
                    transfer_line(line)
            if itemize_line is not None:
                shown = piece
                if planner.finished and not target_missing and target.may_change_root():
                    fix = root_fix(source_stream.root, target_stream.root, planner.options)
                    if fix is not None:  # (set by the runner, as the last step: said here)
                        shown = records.replace(piece, directory_metadata=piece.directory_metadata + [fix])
                for line in itemized_lines(shown, planner.options, sent=not target.walks_here(),
                                           root_made=not target_made):
                    itemize_line(line)
            runner = Runner(source, target, options, piece, progress, result, on_worker_start)
            runner.failed_directories = failed_directories
            runner.announced = announced
            runner.fixes_filtered = True
            if planner.finished:
                runner.source_root = source_stream.root
            try:
                runner.start(not target_made)
            except BaseException:
                runner.announce(target.take_notices())
                raise
            running = runner
            target_made = True
        if running is not None:
            running, finishing = None, running
            _finish(finishing, target)
    except Exception:
        if running is not None:  # what the workers do is sound: finished, then the error
            _finish(running, target)
        raise
    except BaseException:
        if running is not None:  # interrupted: the workers stop after the unit in hand
            running.abandon()
        raise
    finally:
        pieces.close()
    if whole is not None:
        if options.alternate_dirs and whole.files:
            _drop_matched_in_alternates(whole, target, options)
        if not target_missing and target.may_change_root():
            fix = root_fix(source_stream.root, target_stream.root, planner.options)
            if fix is not None:
                whole.directory_metadata.append(fix)
        result.differences = describe_plan(whole, _compare_contents(source, target, whole, options))
        if itemize_line is not None:
            for text in itemized_lines(whole, planner.options, sent=not target.walks_here(), root_made=target_missing):
                itemize_line(text)
        else:
            for line in result.differences:
                if report_line:
                    report_line(line.render())
    result.seconds = time.monotonic() - started
    return result


def _drop_matched_in_alternates(plan: TreePlan, target: TreeEndpoint, options: TreeOptions) -> None:
    """A dry run's files that --compare-dest's directories have as the source has them: no change."""
    taken, _, _ = target.take_from_alternates([action.source for action in plan.files],
                                              {a.path for a in plan.files if a.target is not None},
                                              options.alternate_dirs, options.alternate_use, options.metadata,
                                              dry_run=True)
    plan.files = [action for action in plan.files if taken.get(action.path) != MATCHED_IN_ALTERNATE]


def _finish(runner: Runner, target: TreeEndpoint) -> None:
    try:
        runner.finish()
    finally:
        runner.announce(target.take_notices())


def _entries(stream: ListingStream, failures: List[Failure], privileged: bool = True,
             stripped: Optional[List[str]] = None) -> Iterator[Entry]:
    """A listing's entries one by one; what it could not list goes to ``failures`` as it comes.

    :param privileged: Whether the entries keep their security.* and trusted.* attributes; without,
                       the path of the first entry that had some is added to ``stripped``.
    """
    def batches() -> Iterator[List[Entry]]:
        for found, failed in stream.batches:
            failures.extend(failed)
            yield found

    entries = itertools.chain.from_iterable(batches())
    return entries if privileged else _without_privileged(entries, stripped)


def _without_privileged(entries: Iterator[Entry], stripped: Optional[List[str]]) -> Iterator[Entry]:
    for entry in entries:
        if entry.xattrs:
            kept = tuple(pair for pair in entry.xattrs if not pair[0].startswith(PRIVILEGED_PREFIXES))
            if len(kept) != len(entry.xattrs):
                if stripped is not None and not stripped:
                    stripped.append(entry.path)
                entry = entry._replace(xattrs=kept)
        yield entry


def _check_deletions(plan: TreePlan, source: TreeEndpoint, target: TreeEndpoint, options: TreeOptions,
                     planner: StreamPlanner, source_failures: List[Failure], result: TreeResult) -> None:
    """The last piece's deletions, once both walks are done: refused, or left, when they would lose data."""
    if options.delete and plan.deletions and not options.force and not planner.wanted:
        raise UsageError(f"Refusing to delete everything in {target.location}: the source "
                         f"{source.location} has nothing to sync (use --force to do it anyway)")
    if plan.deletions and source_failures:
        # What the source could not list looks deleted: deleting it would lose data.
        logger.warning("Not deleting anything: %d part(s) of the source could not be listed",
                       len(source_failures))
        plan.extraneous, plan.deletions = plan.deletions, []
    if options.max_delete is not None and len(plan.deletions) > options.max_delete:
        kept = plan.deletions[options.max_delete:]  # files first, then directories deepest first
        plan.deletions = plan.deletions[:options.max_delete]
        if any(entry.kind == DIR for entry in kept):  # a directory whose files stay cannot go either
            kept_paths = {entry.path for entry in kept}
            plan.deletions = [entry for entry in plan.deletions if entry.kind != DIR or not any(
                path.startswith(entry.path + "/") for path in kept_paths)]
        plan.extraneous += kept
        result.deletions_skipped += len(kept)


def _add_piece(whole: TreePlan, piece: TreePlan) -> None:
    for name in ("directories", "files", "symlinks", "nodes", "metadata", "directory_metadata", "removals",
                 "deletions", "extraneous", "specials", "hard_links", "links", "blocked"):
        getattr(whole, name).extend(getattr(piece, name))
    whole.unchanged += piece.unchanged


def remove_tree(tree: TreeEndpoint, options: TreeOptions, progress: Optional[TreeProgress] = None,
                report_line: Optional[Callable[[str], None]] = None,
                on_worker_start: Optional[WorkerStart] = None) -> TreeResult:
    """Delete a tree in parallel: files first (all workers), then directories deepest first.

    With includes or excludes only the selected entries go, and the
    directories that end up empty; without, the root goes too.
    """
    with _no_garbage_collection():
        return _remove_tree(tree, options, progress, report_line, on_worker_start)


def _remove_tree(tree: TreeEndpoint, options: TreeOptions, progress: Optional[TreeProgress],
                 report_line: Optional[Callable[[str], None]],
                 on_worker_start: Optional[WorkerStart]) -> TreeResult:
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
    runner = Runner(tree, tree, options, plan, progress, result, on_worker_start)
    try:
        runner.delete_everything(remove_root=not path_filter.active and not listing.failures
                                 and listing.root.kind == DIR)
    finally:
        runner.announce(tree.take_notices())
    result.seconds = time.monotonic() - started
    return result


def _filter(options: TreeOptions) -> PathFilter:
    try:
        # --backup beside the files: --delete never deletes a backup (rsync's "P *~").
        protected = ["*" + glob_escape(options.backup_suffix)] if options.backup and not options.backup_dir else []
        return PathFilter(options.includes, options.excludes, options.rules, options.files_from, protected,
                          delete_excluded=options.delete_excluded, prune_empty=options.prune_empty_dirs)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _warn_about(specials: List[Entry], hard_links: List[Entry], hard_link_count: int,
                options: TreeOptions, target: TreeEndpoint) -> None:
    """Say which devices, fifos and sockets were skipped and why (a line per reason), and the hard links."""
    reasons: Dict[str, List[Entry]] = {}
    for entry in specials:
        reasons.setdefault(_skip_reason(entry, options, target), []).append(entry)
    for reason, skipped in reasons.items():
        names = ", ".join(printable(e.path) for e in skipped[:5])
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        logger.warning("Skipped %d %s: %s%s", len(skipped), reason, names, more)
    if hard_link_count:
        logger.warning("Copied %d hard-linked file(s) as separate files (hard links are kept "
                       "with -H/--hard-links)", hard_link_count)


def _skip_reason(entry: Entry, options: TreeOptions, target: TreeEndpoint) -> str:
    """Why a sync with ``options`` skipped the device, fifo, socket or symlink ``entry`` (what the warning says)."""
    if entry.kind == SYMLINK:
        return "symlink(s): -r without --links (or -a) leaves them out, as rsync's does"
    kind = node_type(entry.mode)
    makes = target.makes_nodes()
    if kind in (CHAR_DEVICE, BLOCK_DEVICE) and options.devices:
        if NODES_DEVICES in makes:
            return "device node(s): the source's server does not send their numbers (an older version)"
        if target.walks_here():
            return "device node(s): making them needs root"
        if not makes:
            return "device node(s): the target's server is an older version, which makes none"
        return ("device node(s): the target's server does not make them (it does as root, for clients "
                "it trusts: --trust-clients)")
    if kind == CHAR_DEVICE and options.copy_devices:
        return "character device(s): --copy-devices reads block devices only (a character device has no size)"
    if kind == BLOCK_DEVICE and options.copy_devices:
        return "block device(s): --copy-devices reads the devices of a local source only"
    if kind and options.specials and NODES_SPECIALS not in makes:
        return "fifo(s) or socket(s): the target's server is an older version, which makes none"
    return "special file(s) (fifos, sockets, devices; -D keeps them)"


def _compare_contents(source: TreeEndpoint, target: TreeEndpoint, plan: TreePlan,
                      options: TreeOptions) -> Dict[str, bool]:
    """For a dry run: which same-size files really differ (by their block digests)."""
    method = verify_method(options.hash_method)
    differs: Dict[str, bool] = {}
    for action in plan.files:
        if action.reason == REASON_NEW or action.target is None or \
                action.source.size != action.target.size:
            continue
        ranges = [(0, action.source.size)] if action.source.size else []
        try:
            with contextlib.ExitStack() as opened:
                ours, theirs = (opened.enter_context(contextlib.closing(tree.file_endpoint(action.path)))
                                for tree in (source, target))
                # Both sides at once (a server's while this process hashes its own), as a sync's segments.
                source_digests, target_digests = hash_both(ours, ranges, theirs, ranges, options.block_size,
                                                           method)
            differs[action.path] = source_digests != target_digests
        except PdiffcopyError:
            continue  # unknown: listed without "content"
    return differs


__all__ = ["TreeOptions", "TreeProgress", "TreeResult", "remove_tree", "run_tree_sync"]

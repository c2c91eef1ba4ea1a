"""The command line's tree half: a tree sync and ``--remove``, run and reported.

:mod:`pdiffcopy.cli.command` parses the options and asks :func:`pdiffcopy.api.resolve_locations`
what SOURCE and TARGET are; a directory SOURCE comes here, a file SOURCE stays with the
single-file sync.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Callable, Optional

from pdiffcopy.core.locations import is_url
from pdiffcopy.errors import DeletionsStopped, PartialTransfer, PdiffcopyError, UsageError, VanishedFiles
from pdiffcopy.core.treeplan import printable
from pdiffcopy.core.treestops import VANISHED, stop_cause

logger = logging.getLogger("pdiffcopy")

#: Failures listed one per line before the rest are counted only.
MAX_FAILURES_LISTED = 50


def keeps_owner(args: argparse.Namespace) -> bool:
    """Whether -o (or -a) keeps user and group: as root only, with a warning otherwise."""
    owner = args.owner or args.archive
    if owner and os.geteuid() != 0:
        logger.warning("Not running as root: user and group are not kept (-o)")
        owner = False
    return owner


def file_metadata(args: argparse.Namespace) -> dict:
    """The metadata a single file keeps (:func:`pdiffcopy.api.sync`'s arguments): a tree's, and with
    -a the permissions and a symlink as a symlink, which a tree always keeps."""
    return dict(perms=args.archive, links=args.archive, times=args.times or args.archive,
                owner=keeps_owner(args), xattrs=args.xattrs, acls=args.acls, numeric_ids=args.numeric_ids)


def tree_options(args: argparse.Namespace):
    """The command line's tree options; :class:`~pdiffcopy.engine.options.TreeOptions` checks them."""
    from pdiffcopy.core.hashing import DEFAULT_HASH_METHOD
    from pdiffcopy.api import TreeOptions

    owner = keeps_owner(args)
    return TreeOptions(
        times=args.times or args.archive, owner=owner, checksum=args.checksum,
        delete=args.delete or args.delete_excluded, force=args.force, delete_excluded=args.delete_excluded,
        max_delete=args.max_delete, prune_empty_dirs=args.prune_empty_dirs, hard_links=args.hard_links,
        symlinks=not args.recursive or args.links or args.archive,
        update=args.update, existing=args.existing, ignore_existing=args.ignore_existing,
        size_only=args.size_only, ignore_times=args.ignore_times, modify_window=args.modify_window,
        max_size=args.max_size, min_size=args.min_size,
        dry_run=args.dry_run or args.diff,
        devices=args.devices or args.devices_and_specials or args.archive,
        specials=args.specials or args.devices_and_specials or args.archive, copy_devices=args.copy_devices,
        whole_file=args.whole_file, atomic=args.atomic, fsync=args.fsync,
        xattrs=args.xattrs, acls=args.acls, numeric_ids=args.numeric_ids,
        block_size=args.block_size, piece_size=args.piece_size,
        hash_method=args.hash_method or DEFAULT_HASH_METHOD,
        concurrency=args.concurrency, includes=tuple(args.include),
        excludes=tuple(args.exclude), rules=tuple(args.rules),
        files_from=None if args.files_from is None else tuple(args.files_from), bwlimit=args.bwlimit,
        compress=args.compress, partial=args.partial, delta=args.delta, sparse=args.sparse, mkpath=args.mkpath,
        alternate_dirs=tuple(directory for _, directory in args.alternate_dirs),
        alternate_use=args.alternate_dirs[0][0] if args.alternate_dirs else "",
        backup=args.backup or bool(args.backup_dir), backup_dir=args.backup_dir, suffix=args.suffix)


def run_tree(source: str, target: str, args: argparse.Namespace, token: Optional[str],
             shown: Callable[[str], str] = lambda location: location) -> int:
    """Sync a tree and report; exit status 23 when some paths failed.

    :param shown: What a location is called in the report (``HOST:PATH`` for the forwarded URL).
    """
    from pdiffcopy.api import sync_tree
    from pdiffcopy.api import TreeProgress, wire_totals

    if args.benchmark:
        raise UsageError("--benchmark works on a file, not on a directory")

    options = tree_options(args)
    progress = TreeProgress(options.concurrency)
    started, wire_before = time.monotonic(), wire_totals()
    events, changes = args.events, []
    itemized = args.itemize_changes and events is None  # (in place of -v's names, as rsync's -vi)
    listed = changes.append if events is not None else \
        _print if args.verbose and not options.dry_run and not itemized else None
    with _display(progress, args):
        result = sync_tree(source, target, options, token=token, timeout=args.timeout, ca_file=args.ca_file,
                           progress=progress, report_line=_listing(args), transfer_line=listed,
                           itemize_line=_print if itemized else None)
    if events is not None:
        _count_tree(events, result, changes)
        if args.json:
            return _finish(result, f"{result.files_copied} file(s) copied, {result.unchanged} unchanged")
    if options.dry_run:
        if not args.diff:
            _summarise_dry_run(result)
        return _finish(result)
    # A stop, or work lost as a whole, says what it did in its last line.
    if logger.isEnabledFor(logging.INFO) and not result.stopped and not result.unfinished:
        from pdiffcopy.cli.humanize import format_size, format_timespan

        logger.info("Synchronised %s to %s: %d file(s) copied (%s moved), %d director%s made, %s%s"
                    "%d deleted, %d unchanged, in %s", shown(source), shown(target), result.files_copied,
                    format_size(result.bytes_moved, binary=True), result.directories_made,
                    "y" if result.directories_made == 1 else "ies",
                    f"{result.linked} hard link(s) made, " if options.hard_links or result.linked else "",
                    f"{result.nodes_made} special file(s) made, " if result.nodes_made else "",
                    result.deleted, result.unchanged, format_timespan(result.seconds))
    from pdiffcopy.cli.reports import print_stats, wants_stats

    if wants_stats(args):
        print_stats(result.bytes_moved, result.files_copied, time.monotonic() - started,
                    remote=is_url(source) or is_url(target), wire_before=wire_before)
    return _finish(result, f"{result.files_copied} file(s) copied, {result.unchanged} unchanged")


def run_remove(args: argparse.Namespace, token: Optional[str]) -> int:
    """``--remove PATH...``: delete trees (or single files) in parallel."""
    from pdiffcopy.api import TreeProgress, remove

    if not args.paths:
        raise UsageError("--remove needs at least one PATH")
    options = tree_options(args)
    status = 0
    for location in args.paths:
        progress = TreeProgress(options.concurrency)
        with _display(progress, args):
            result = remove(location, options, token=token, timeout=args.timeout, ca_file=args.ca_file,
                            progress=progress, report_line=_print)
        if result.deleted and not args.dry_run:
            logger.info("Removed %d entries of %s", result.deleted, location)
        try:
            _finish(result, f"{result.deleted} deleted")
        except PdiffcopyError as error:
            logger.error("%s", error)
            status = max(status, error.exit_code)
    return status


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")


def _listing(args: argparse.Namespace) -> Callable[[str], None]:
    """Where a dry run's or a diff's lines go: stdout, or (``--json``) ``listing`` events."""
    if args.json and args.events is not None:
        return lambda line: args.events.emit("listing", line=line)
    return _print


def _count_tree(events, result, changes) -> None:
    """A tree's ``file`` events (what it changed, but for the paths that failed) and counts."""
    failed = {path for path, _ in result.failures}
    if not result.dry_run:
        for item in changes:
            if item.path not in failed:
                events.file(item.path, item.change, **({"to": item.detail} if item.detail else {}))
    events.count(bytes_moved=result.bytes_moved, files_copied=result.files_copied, unchanged=result.unchanged,
                 deleted=result.deleted, directories_made=result.directories_made, linked=result.linked,
                 nodes_made=result.nodes_made, failures=len(result.failures), not_synced=result.not_synced)


def _summarise_dry_run(result) -> None:
    counts: dict = {}
    for difference in result.differences:
        counts[difference.change] = counts.get(difference.change, 0) + 1
    parts = [f"{count} {change}" for change, count in sorted(counts.items())]
    _print(f"Dry run: {', '.join(parts) or 'nothing to do'}; {result.unchanged} unchanged; "
           f"nothing was changed")


def _finish(result, done: str = "") -> int:
    """Exit status 0, or list the failures and raise :class:`PartialTransfer` (one line) for the rest.

    :param done: What the sync did, for the line of a sync that stopped (``"40 file(s) copied,
                 10 unchanged"``).
    """
    if not result.failures and not result.stopped:
        if result.deletions_skipped:
            raise DeletionsStopped(f"Deletions stopped by --max-delete: {result.deletions_skipped} left undone; "
                                   f"everything else was synced")
        return 0
    listed = [(path, message) for path, message in result.failures
              if not (result.stopped and stop_cause(message)[0])]  # those the last line counts
    for path, message in listed[:MAX_FAILURES_LISTED]:
        logger.error("%s: %s", printable(path) if path else printable(result.target), message)
    if len(listed) > MAX_FAILURES_LISTED:
        logger.error("... and %d more", len(listed) - MAX_FAILURES_LISTED)
    if result.stopped:
        failed = sum(1 for path, _ in result.failures if path)
        errors = sorted({stop_cause(message)[1] for _, message in result.failures} - {""})
        advice = "run again once it is writable" if "read-only" in result.stopped else \
            "free some space and run again"
        why = f" ({', '.join(errors)})" if errors else ""
        raise PartialTransfer(f"{printable(result.target)}: {result.stopped}: stopped; "
                              f"{done + ', ' if done else ''}{failed} path(s) failed{why}, "
                              f"{result.not_synced} not synced; {advice}")
    if result.unfinished:
        raise PartialTransfer(f"{printable(result.target)}: the sync did not finish ({result.unfinished} "
                              f"batch(es) of work failed as a whole); {done + ', ' if done else ''}"
                              f"{len(result.failures)} failure(s); run again to finish")
    if all(message == VANISHED for _, message in result.failures):
        raise VanishedFiles(f"{len(result.failures)} file(s) vanished from the source during the sync; "
                            f"everything else was synced")
    raise PartialTransfer(f"{len(result.failures)} path(s) failed; everything else was synced; "
                          f"run again once they are fixed")


class _display:
    """The tree progress line (see :func:`pdiffcopy.cli.reports.show_progress`; never with -n or --diff)."""

    def __init__(self, progress, args: argparse.Namespace) -> None:
        self.display = None
        from pdiffcopy.cli.reports import show_progress

        if args.json and args.events is not None:
            self.display = args.events.progress(progress)
        elif show_progress(args) and not (args.dry_run or args.diff):
            from pdiffcopy.cli.progress import TreeProgressDisplay

            self.display = TreeProgressDisplay(progress, keep_last=args.progress)

    def __enter__(self):
        if self.display is not None:
            self.display.__enter__()
        return self

    def __exit__(self, *exc_info):
        if self.display is not None:
            self.display.__exit__(*exc_info)
        return False

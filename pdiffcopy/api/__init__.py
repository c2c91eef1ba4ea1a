"""The library's face: paths and URLs in, endpoints built, the engine run.

The engine (:mod:`pdiffcopy.engine.filejob`, :mod:`pdiffcopy.engine.treesync`) works on
endpoints and never builds one: this module turns a path into a local
endpoint and an ``http(s)://`` URL into a remote one, and hands both over
(dependency inversion, see docs/design.rst); a ``[USER@]HOST:PATH`` becomes
the URL of a server started on HOST over ssh (:func:`reached_over_ssh`). It
is also where the rule that holds for every caller lives: at most one side
may be remote.

A token is what the caller passes: the library never reads ``$PDIFFCOPY_TOKEN``
or a token file (the command line does, see :mod:`pdiffcopy.cli.command`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

from pdiffcopy.core.blocks import DEFAULT_BLOCK_SIZE
from pdiffcopy.core.filters import files_from_roots
from pdiffcopy.core.locations import is_url, join_location, parent_location, quote_path
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.errors import FileMissing, PdiffcopyError, UsageError
from pdiffcopy.core.hashing import DEFAULT_HASH_METHOD
from pdiffcopy.engine.options import DEFAULT_DELTA, FileOptions, TreeOptions, file_options
from pdiffcopy.api.endpoints import bwlimit_bucket, check_locations, file_endpoint, tree_endpoint, wire_settings
from pdiffcopy.api.locations import LocationProbes, check_not_nested, remove, resolve_locations
from pdiffcopy.api.ssh import (PREHASH_MIN_BYTES, over_ssh, prehash_local_files, prehashed_file, reached_over_ssh,
                               reached_over_ssh_together, reached_with_local_hashing)

if TYPE_CHECKING:
    from pdiffcopy.engine.filejob import Progress, SyncResult
    from pdiffcopy.engine.onefile import KeptMetadata
    from pdiffcopy.engine.treesync import TreeProgress, TreeResult
    from pdiffcopy.local.thindelta import ThinPools

Call = TypeVar("Call", bound=Callable)


def _one_sync(function: Call) -> Call:
    """A sync from start to end: the servers' transfer logs are told when it is over
    (:func:`pdiffcopy.transport.syncs.one_sync`)."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        from pdiffcopy.transport.syncs import one_sync

        with one_sync():
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]


@_one_sync
def sync(source: "str | FileEndpoint", target: "str | FileEndpoint", *, block_size: "int | str" = DEFAULT_BLOCK_SIZE,
         hash_method: str = DEFAULT_HASH_METHOD, whole_file: bool = False,
         concurrency: Optional[int] = None, dry_run: bool = False, atomic: bool = False,
         token: Optional[str] = None, timeout: Optional[float] = None,
         ca_file: Optional[str] = None, cache: str = "auto",
         progress: Optional[Progress] = None, bwlimit: "int | str | None" = None,
         compress: "str | int" = "auto", piece_size: "int | str | None" = None,
         partial: bool = False, delta: str = DEFAULT_DELTA, sparse: bool = False,
         rsh: Optional[str] = None, remote_pdiffcopy: Optional[str] = None, direct: bool = False,
         direct_port: Optional[int] = None, perms: bool = False, times: bool = False, owner: bool = False,
         links: bool = False, xattrs: bool = False, acls: bool = False, numeric_ids: bool = False,
         mkpath: bool = False, digest_file: Optional[str] = None, changed_since: Optional[str] = None,
         verify_whole: bool = False, thin_pools: "Optional[ThinPools]" = None) -> SyncResult:
    """Bring ``target`` to exactly the bytes and size of ``source``.

    One of ``source`` and ``target`` may be a URL (``http://HOST:PORT/path``) of
    a file on a pdiffcopy server, or rsync's ``[USER@]HOST:PATH``, for which ssh
    starts pdiffcopy on HOST for the length of the sync: a remote source pulls,
    a remote target pushes.

    :param source: Path or URL of the file with the wanted bytes, or an endpoint made by
                   :func:`file_endpoint` (the sync then owns it and closes it): a URL probed
                   once, by its caller, is not probed again.
    :param target: Path or URL of the file to update (created if missing), or an endpoint.
    :param block_size: Block size in bytes, or an expression like ``"1MiB"``.
    :param hash_method: Block hash (any :mod:`hashlib` name, ``xxh3_128``, ``blake3``...).
    :param whole_file: Skip the comparison and copy every block.
    :param concurrency: Hashing processes and connections (default: CPU count).
                        A whole-file copy between local files hashes in one
                        thread beside the copy, which is faster than more.
    :param dry_run: Only compare and report the similarity; change nothing.
    :param atomic: Write a temporary sibling and rename it over the target at the end.
    :param token: Shared secret for the server (None: send none; the library
                  does not read ``$PDIFFCOPY_TOKEN``, the command line does).
    :param timeout: Seconds any network call may wait (default 60).
    :param ca_file: CA bundle to verify an ``https://`` server with.
    :param cache: For whole-file copies between local files: ``"drop"`` keeps
                  both files out of the page cache (fastest for big files),
                  ``"keep"`` leaves the cache alone, ``"auto"`` chooses by size.
                  A block device drops what it reads and writes unless ``"keep"``;
                  ``"direct"`` reads and writes it around the cache (``O_DIRECT``).
    :param progress: Counters to update, for a progress display.
    :param bwlimit: Most bytes per second on the network, both directions together, as an
                    int or in rsync's ``--bwlimit`` syntax (``"50M"``; a bare number is KiB/s);
                    None or 0: no limit. A sync between local files ignores it.
    :param compress: zstd on the wire: ``"always"`` (``-z``), ``"never"``, ``"auto"``: when
                     the data shrinks and the link, not the CPU, is the bottleneck, or a
                     level from 1 to 19: always, at that level (``--compress-level``).
    :param piece_size: Changed blocks are hashed again in pieces of this size (bytes or ``"4K"``)
                       and only the pieces that differ move; 0: off. It must divide the block
                       size; None: 4 KiB where it does (docs/design.rst, sub-block refinement).
    :param partial: Write a new (or ``atomic``) target into a hidden partial file
                    (``.NAME.pdiffcopy-partial``) that an interrupted sync keeps and the
                    next sync with ``partial`` resumes, moving only what it lacks.
    :param delta: How changes are found: ``"auto"`` (the default) chooses per file, from a small
                  sample of both files, between the two others (docs/design.rst, "Choosing the
                  delta"); ``"blocks"`` compares fixed blocks in place (files
                  changed in place: disk images, databases); ``"chunks"`` cuts both files into
                  content-defined chunks and finds bytes that moved (inserted or removed data:
                  archives, logs, dumps), writing a new temporary of the target.
    :param sparse: Also turn runs of zeros (whole file system blocks) in the data written into
                   holes (rsync's ``-S``). The source's own holes stay holes either way: they
                   are never read nor sent, and are punched in the target.
    :param rsh: For a ``HOST:PATH``: the ssh command, as rsync's ``-e`` (default ``ssh``).
    :param remote_pdiffcopy: For a ``HOST:PATH``: the command that runs pdiffcopy on HOST, as
                             rsync's ``--rsync-path`` (default ``pdiffcopy``, then ``python3 -m pdiffcopy``).
    :param direct: For a ``HOST:PATH``: ssh only starts the server; the data goes over TLS straight
                   to HOST (at ``direct_port``, default a free one), verified against a one-time
                   certificate whose fingerprint came over ssh.
    :param perms: Give the target the source's permissions, set-id bits too (the command line's
                  ``-a``). Without it a new target gets the source's mode less the umask of the
                  side that makes it, and an existing one keeps its own (rsync's rule).
    :param times: Give the target the source's modification time (``-t``, part of ``-a``).
    :param owner: Give the target the source's user and group (``-o``, part of ``-a``; as root,
                  and on a server only with ``--trust-clients``).
    :param links: Make a symlink source a symlink to the same place, moving no data (part of
                  ``-a``); without it the link is followed.
    :param xattrs: Keep the source's extended attributes (``-X``), as a tree sync keeps them.
    :param acls: Keep the source's POSIX ACLs (``-A``).
    :param numeric_ids: The users and groups of ACLs by number between hosts, not by name.
    :param mkpath: Make the missing directories of the target's path first (rsync's ``--mkpath``);
                   without it the directory the target goes in must exist.
    :param digest_file: A file that keeps the target's block digests as this sync leaves them
                        (``--digest-file``, docs/devices.rst): where it still stands for the target
                        (the same target, not written since), the next sync reads the target only
                        where it writes. Made by the first sync; a record that no longer stands is
                        refused. The target must be local.
    :param changed_since: The older thin snapshot (a path) of the source's origin that the last
                          sync with ``digest_file`` copied from: only the ranges the pool says
                          differ between the two are read from the source (``--changed-since``).
    :param verify_whole: With ``digest_file``: read the whole target anyway, report the blocks that
                         differ from the record (and sync them), and make the record again.
    :param thin_pools: Where thin volumes are found (:class:`~pdiffcopy.local.thindelta.ThinPools`);
                       default: the live device-mapper pools (LVM's).
    :returns: A :class:`~pdiffcopy.engine.filejob.SyncResult`.
    :raises PdiffcopyError: On any failure; the target is then not reported as synced (a
                            :class:`~pdiffcopy.errors.PartialTransfer` when its data is, and
                            its metadata could not be set).
    """
    from pdiffcopy.engine.onefile import KeptMetadata
    from pdiffcopy.engine.treeendpoints import MetadataOptions

    keep = KeptMetadata(MetadataOptions(times=times, owner=owner, xattrs=xattrs, acls=acls,
                                        numeric_ids=numeric_ids), permissions=perms, links=links)
    try:
        options = file_options(block_size=block_size, hash_method=hash_method, whole_file=whole_file,
                               concurrency=concurrency, dry_run=dry_run, atomic=atomic, cache=cache,
                               bwlimit=bwlimit, compress=compress, piece_size=piece_size,
                               partial=partial, delta=delta, sparse=sparse, verify_whole=verify_whole)
        options = check_record_options(options, digest_file, changed_since, delta)
        if digest_file is not None and keep.wanted:
            raise UsageError("-a, -t, -o, -X and -A cannot be used with --digest-file: what they set after the "
                             "sync would change the target the record describes")
    except BaseException:
        _close_given(source, target)
        raise
    recording = dict(digest_file=digest_file, changed_since=changed_since, thin_pools=thin_pools)
    if any(over_ssh(location) for location in (source, target)):
        with reached_with_local_hashing(source, target, options, hash_target=digest_file is None, rsh=rsh,
                                        remote_pdiffcopy=remote_pdiffcopy, timeout=timeout, direct=direct,
                                        direct_port=direct_port) as (source, target, session, prehashed):
            source, target = (prehashed.pop(location, location) if isinstance(location, str) else location
                              for location in (source, target))
            return _sync_with(source, target, options, session.token, timeout, session.ca_file or ca_file,
                              progress, keep, mkpath, **recording)
    return _sync_with(source, target, options, token, timeout, ca_file, progress, keep, mkpath, **recording)


def check_record_options(options: FileOptions, digest_file: Optional[str], changed_since: Optional[str],
                         delta: str) -> FileOptions:
    """The options of a sync with a digest record, checked: what a record cannot go with is refused.

    A record describes the target a sync updates in place, block by block: no new version beside it
    (``--atomic``, ``--partial``, the chunked delta, which writes one), and digests strong enough to
    verify with (the target's blocks left alone are verified by their recorded digests).

    :raises UsageError: Naming the option.
    """
    from pdiffcopy.core import records
    from pdiffcopy.core.hashing import verify_method

    if digest_file is None:
        for given, name in ((changed_since is not None, "--changed-since"), (options.verify_whole, "--verify-whole")):
            if given:
                raise UsageError(f"{name} needs --digest-file: it works on the record of the last sync")
        return options
    for given, name in ((options.atomic, "--atomic"), (options.partial, "--partial"),
                        (delta == "chunks", "--delta chunks")):
        if given:
            raise UsageError(f"{name} cannot be used with --digest-file: the record describes a target "
                             f"updated in place")
    if verify_method(options.hash_method) != options.hash_method:
        raise UsageError(f"--digest-file needs a hash method strong enough to verify with, and "
                         f"{options.hash_method} is not (the default {DEFAULT_HASH_METHOD} is)")
    return records.replace(options, delta="blocks")


def digest_record(digest_file: str, source: str, target: str, changed_since: Optional[str],
                  thin_pools: "Optional[ThinPools]"):
    """The :class:`~pdiffcopy.local.digestfile.DigestFile` of a sync into the local ``target``:
    with ``changed_since``, the ranges its thin pool says changed; else what the source is (a thin
    volume's origin, kept for the next ``--changed-since``).

    :raises UsageError: For a remote target, or a ``changed_since`` with a source that is no local thin volume.
    """
    import logging

    from pdiffcopy.local.digestfile import DigestFile
    from pdiffcopy.local.thindelta import LvmThinPools

    if is_url(target):
        raise UsageError("--digest-file needs a local TARGET: the record is checked against the target's own "
                         "write counters, on this machine")
    pools = thin_pools if thin_pools is not None else LvmThinPools()
    if changed_since is not None:
        if is_url(source):
            raise UsageError("--changed-since needs a local SOURCE: a thin volume of a pool on this machine")
        changes = pools.changed_since(changed_since, source)
        return DigestFile(digest_file, target, changes, changes.new_origin)
    origin = None
    if not is_url(source):
        try:
            volume = pools.volume(source)
            origin = volume.origin() if volume is not None else None
        except PdiffcopyError as error:  # the sync still works: only a later --changed-since cannot
            logging.getLogger(__name__).warning("Cannot tell which thin volume %s is (%s): the digest record "
                                                "cannot serve a later --changed-since", source, error)
    return DigestFile(digest_file, target, None, origin)


def _close_given(*locations: "str | FileEndpoint") -> None:
    for location in locations:
        if isinstance(location, FileEndpoint):
            location.close()


def _sync_with(source: "str | FileEndpoint", target: "str | FileEndpoint", options: FileOptions,
               token: Optional[str], timeout: Optional[float], ca_file: Optional[str],
               progress: Optional[Progress], keep: "KeptMetadata", mkpath: bool = False,
               digest_file: Optional[str] = None, changed_since: Optional[str] = None,
               thin_pools: "Optional[ThinPools]" = None) -> SyncResult:
    """:func:`sync` once its options are checked and a ``HOST:PATH`` is a URL: the endpoints, then the engine."""
    made = []
    record = None
    try:
        check_locations(_location(source), _location(target))
        if digest_file is not None:
            record = digest_record(digest_file, _location(source), _location(target), changed_since, thin_pools)
        # Endpoints before the engine: a bad path or URL fails before any process starts. The
        # wire's limit and compression are the remote endpoint's (the engine never sees them):
        # one bucket for every connection and thread of the sync. An endpoint given (the command
        # line's probe) was made with the same settings (:func:`wire_settings`).
        wire = wire_settings(token=token, concurrency=options.concurrency, timeout=timeout, ca_file=ca_file,
                             bwlimit=options.bwlimit, compress=options.compress)
        for location in (source, target):
            if not isinstance(location, FileEndpoint):
                made.append(file_endpoint(location, **wire))
    except BaseException:
        _close_given(source, target)
        for endpoint in made:
            endpoint.close()
        raise
    try:
        return _sync_endpoints(source, target, made, options, token, timeout, ca_file, progress, keep, mkpath,
                               record)
    finally:
        if record is not None:
            record.close()


def _sync_endpoints(source, target, made, options: FileOptions, token: Optional[str], timeout: Optional[float],
                    ca_file: Optional[str], progress: Optional[Progress], keep: "KeptMetadata", mkpath: bool,
                    record) -> SyncResult:
    """The rest of :func:`_sync_with`, once the endpoints are made: the engine, its errors said with their remedy."""
    from pdiffcopy.engine.filejob import SOURCE_MISSING, run_sync  # (not at import: ssh starts first)

    source_endpoint = source if isinstance(source, FileEndpoint) else made.pop(0)
    target_endpoint = target if isinstance(target, FileEndpoint) else made.pop(0)
    wire = dict(token=token, timeout=timeout, ca_file=ca_file)
    directory = _parent_and_name(target_endpoint.location)[0]
    if mkpath and not options.dry_run:
        try:
            make_directory(directory, parents=True, **wire)
        except BaseException:
            _close_given(source_endpoint, target_endpoint)
            raise
    try:
        if not keep.wanted or _either_is_a_device(source_endpoint, target_endpoint):
            return run_sync(source_endpoint, target_endpoint, options, progress, record)
        return _sync_as_tree_of_one(source_endpoint, target_endpoint, options, progress, keep, wire, record)
    except FileMissing as error:
        # Said with its remedy, when that is what went wrong (looked at only then: it costs a request).
        if not options.dry_run and not str(error).startswith(SOURCE_MISSING) and not _is_directory(directory, wire):
            raise FileMissing(f"The directory {directory} of the target does not exist "
                              f"(--mkpath makes it)") from None
        raise


def _either_is_a_device(source: FileEndpoint, target: FileEndpoint) -> bool:
    """Whether a side is a block device, whose metadata (``-a``, ``-t``, ``-o``, ``-X``, ``-A``) is
    its node's, never the sync's: then only the bytes are synced, and a warning says so."""
    for endpoint in (source, target):
        info = endpoint.stat()  # (a remote one: one request, only when metadata is asked for)
        if info is not None and info.kind == "device":
            import logging

            logging.getLogger(__name__).warning(
                "%s is a block device: its bytes are synced, not its metadata (its node's own)", endpoint.location)
            return True
    return False


def make_directory(location: str, *, parents: bool = False, token: Optional[str] = None,
                   timeout: Optional[float] = None, ca_file: Optional[str] = None) -> None:
    """Make the directory at a path or URL, as rsync makes a target directory: one that is there is
    fine; its parent must exist, unless ``parents`` (``--mkpath``) makes the missing ones too.

    :raises StorageError: When it cannot be made (a missing parent says ``--mkpath``).
    """
    from pdiffcopy.core.treeplan import DIR, MKDIR, MKPATH, Entry, Operation
    from pdiffcopy.engine.treeendpoints import MetadataOptions
    from pdiffcopy.errors import StorageError

    tree = tree_endpoint(location, token=token, timeout=timeout, ca_file=ca_file)
    try:
        failures = tree.apply([Operation(MKPATH if parents else MKDIR, Entry("", DIR, 0, 0, 0o40755))],
                              MetadataOptions())
    finally:
        tree.close()
    if failures:
        raise StorageError(f"Cannot create the directory {location}: {failures[0][1]}")


def _is_directory(location: str, wire: dict) -> bool:
    """Whether a path or URL names a directory (a server's root is one); False when that cannot be told."""
    if not is_url(location):
        import os

        return os.path.isdir(location)
    from pdiffcopy.transport.urls import split_server_url

    if not split_server_url(location)[1].strip("/"):
        return True
    try:
        endpoint = file_endpoint(location, **wire)
        try:
            info = endpoint.stat()
        finally:
            endpoint.close()
    except PdiffcopyError:
        return False
    return info is not None and info.kind == "directory"


def _sync_as_tree_of_one(source: FileEndpoint, target: FileEndpoint, options: FileOptions,
                         progress: Optional[Progress], keep: "KeptMetadata", wire: dict, record=None) -> SyncResult:
    """A file sync that keeps metadata (``-a``, ``-t``, ``-o``, ``-X``, ``-A``): the file is a tree of one
    (:mod:`pdiffcopy.engine.onefile`) whose entry is read before the data sync and set after it."""
    import time

    from pdiffcopy.core.treeplan import SYMLINK
    from pdiffcopy.engine import onefile
    from pdiffcopy.engine.filejob import SyncResult, run_sync
    from pdiffcopy.errors import Conflict

    trees: list = []

    def tree_at(location: str):
        trees.append(tree_endpoint(location, **wire))
        return trees[-1]

    started = time.monotonic()
    try:
        try:
            entry = onefile.source_entry(tree_at(source.location), keep)
            if entry.kind == SYMLINK:
                if not options.dry_run:
                    parent, name = _parent_and_name(target.location)
                    onefile.make_symlink(tree_at(parent), name, entry, keep, target.location)
                return SyncResult(source.location, target.location, 0, options.block_size, options.hash_method,
                                  0, 0, 0, 100.0, options.dry_run, False, "", time.monotonic() - started,
                                  entry.mtime_ns, symlink=entry.target)
        except BaseException:
            _close_given(source, target)
            raise
        result = run_sync(source, target, options, progress, record)
        if result.dry_run:
            return result
        if (result.size, result.source_mtime_ns) != (entry.size, entry.mtime_ns):
            raise Conflict(f"Source changed during the sync: {source.location}; run again")
        current = None if keep.permissions else tree_at(target.location).list().root
        parent, name = _parent_and_name(target.location)
        onefile.set_metadata(tree_at(parent), name, entry, keep, target.location, current)
        return result
    finally:
        for tree in trees:
            tree.close()


def _parent_and_name(location: str) -> "tuple[str, str]":
    """The directory holding a file's path or URL (as a path or URL), and the file's name in it."""
    if is_url(location):
        from pdiffcopy.transport.urls import split_server_url

        base, path = split_server_url(location)
        parent, _, name = path.rstrip("/").rpartition("/")
        return f"{base}/{quote_path(parent)}", name
    import os

    parent, name = os.path.split(location)
    return parent or ".", name


def _location(location: "str | FileEndpoint") -> str:
    return location.location if isinstance(location, FileEndpoint) else location


@_one_sync
def sync_tree(source: str, target: str, options: "Optional[TreeOptions]" = None, *,
              token: Optional[str] = None, timeout: Optional[float] = None, ca_file: Optional[str] = None,
              progress: "Optional[TreeProgress]" = None,
              report_line: Optional[Callable[[str], None]] = None, rsh: Optional[str] = None,
              remote_pdiffcopy: Optional[str] = None, direct: bool = False, direct_port: Optional[int] = None,
              transfer_line: Optional[Callable[[str], None]] = None,
              itemize_line: Optional[Callable[[str], None]] = None, **fields) -> "TreeResult":
    """Make the directory tree ``target`` hold what the tree ``source`` holds.

    The locations are taken as given: ``source`` is the directory whose
    contents are synced into ``target`` (the command line's rsync rule for a
    trailing slash is the command line's, see :mod:`pdiffcopy.cli.treecli`).

    :param options: A :class:`~pdiffcopy.engine.options.TreeOptions`; ``fields``
                    (``delete=True``, ``xattrs=True``, ``acls=True``, ``concurrency=4``...)
                    replace some of its values.
    :param token: The server's shared secret, as for :func:`sync`.
    :param report_line: Called with each line of a dry run's listing.
    :param transfer_line: Called with each path the sync changes, as rsync's ``-v`` lists them.
    :param itemize_line: Called with each change in rsync's ``-i`` code (a dry run's too).
    :param rsh: For a ``HOST:PATH`` side: the ssh command, as for :func:`sync`.
    :param remote_pdiffcopy: For a ``HOST:PATH`` side: the remote program, as for :func:`sync`.
    :param direct: For a ``HOST:PATH`` side: TLS straight to HOST, as for :func:`sync`.
    :returns: A :class:`~pdiffcopy.engine.treesync.TreeResult`; failures of single
              files are in its ``failures``.
    :raises PdiffcopyError: When the sync cannot start.
    """
    if over_ssh(source) or over_ssh(target):
        with reached_over_ssh(source, target, rsh=rsh, remote_pdiffcopy=remote_pdiffcopy, timeout=timeout,
                              direct=direct, direct_port=direct_port) as (source, target, session):
            return sync_tree(source, target, options, token=session.token, timeout=timeout,
                             ca_file=session.ca_file or ca_file,
                             progress=progress, report_line=report_line, transfer_line=transfer_line,
                             itemize_line=itemize_line, **fields)
    from pdiffcopy.core import records
    from pdiffcopy.engine.treesync import run_tree_sync as run_tree
    from pdiffcopy.local.processes import die_with_parent

    options = records.replace(options or TreeOptions(), **fields)  # (checked, as TreeOptions are)
    check_locations(source, target)
    if options.files_from is not None:
        roots = files_from_roots(options.files_from)
        if set(roots) != {""}:  # rsync's "from/./dir": from/dir synced as dir, one sync per directory
            from pdiffcopy.engine.treeunits import combined

            return combined([sync_tree(join_location(source, head) + "/" if head else source, target,
                                       records.replace(options, files_from=paths), token=token,
                                       timeout=timeout, ca_file=ca_file, progress=progress,
                                       report_line=report_line, transfer_line=transfer_line,
                                       itemize_line=itemize_line)
                             for head, paths in roots.items()])
    # In shared memory and made before any worker forks: one limit for all of them.
    bucket = bwlimit_bucket(options.bwlimit, shared=True)
    trees = []
    try:
        for location in (source, target):
            trees.append(tree_endpoint(location, token=token, concurrency=options.concurrency,
                                       timeout=timeout, ca_file=ca_file, rate_limit=bucket,
                                       compress=options.compress))
        return run_tree(trees[0], trees[1], options, progress, report_line=report_line,
                        on_worker_start=die_with_parent, transfer_line=transfer_line,
                        itemize_line=itemize_line)
    finally:
        for tree in trees:
            tree.close()


#: What a front end (the command line) uses of the layers below, by name here: (module, name),
#: imported when first asked for, so that a command that only prints its help imports none of it.
_FOR_FRONT_ENDS = {
    "Progress": ("pdiffcopy.engine.filejob", "Progress"),
    "TreeProgress": ("pdiffcopy.engine.treesync", "TreeProgress"),
    "wire_totals": ("pdiffcopy.transport.counters", "totals"),  # bytes sent and received so far
    "raise_open_file_limit": ("pdiffcopy.local.descriptors", "raise_open_file_limit"),
    "replace_atomically": ("pdiffcopy.local.descriptors", "replace_atomically"),  # the one atomic replace
    "looks_like_regex": ("pdiffcopy.transport.sshlaunch", "looks_like_regex"),
    # --client-cert: the one certificate every TLS connection of this process presents
    "use_client_certificate": ("pdiffcopy.transport.httpclient", "use_client_certificate"),
}


def __getattr__(name: str):
    if name in _FOR_FRONT_ENDS:
        import importlib

        module, attribute = _FOR_FRONT_ENDS[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_HASH_METHOD", "LocationProbes", "PREHASH_MIN_BYTES", "Progress", "TreeOptions", "TreeProgress",
           "bwlimit_bucket", "check_locations", "check_not_nested", "file_endpoint", "file_options",
           "looks_like_regex", "make_directory", "parent_location", "prehash_local_files", "prehashed_file",
           "raise_open_file_limit", "reached_over_ssh", "reached_over_ssh_together", "reached_with_local_hashing",
           "remove", "replace_atomically",
           "resolve_locations",
           "sync", "sync_tree", "tree_endpoint", "wire_totals"]

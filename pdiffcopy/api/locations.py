"""What SOURCE and TARGET are once looked at: a file or a tree, and where each goes; and removing one.

:mod:`pdiffcopy.core.locations` says what a name means without looking; this module
looks, once per location (:class:`LocationProbes`: a URL's endpoint made here is the one
the file sync then uses), and applies the rules a user of rsync and cp expects
(:func:`resolve_locations`). :func:`remove` is ``--remove``: a tree or a single file
deleted in parallel, locally or on a server.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

from pdiffcopy.api.endpoints import file_endpoint, tree_endpoint, wire_settings
from pdiffcopy.core.filters import normalise_listed
from pdiffcopy.core.locations import is_url, join_location, last_name, tree_locations
from pdiffcopy.errors import FileMissing, NotAFile, UsageError

if TYPE_CHECKING:
    from pdiffcopy.engine.options import TreeOptions
    from pdiffcopy.engine.treesync import TreeProgress, TreeResult


class LocationProbes:
    """The remote files SOURCE and TARGET were looked at through, kept for the file sync.

    A URL is resolved once: its endpoint (a 1.0.1 server found out on the way) is made here,
    with the sync's connections and settings, and handed to :func:`pdiffcopy.api.sync`
    (:meth:`take`) instead of another being made and probed there. What is not taken is
    closed at the end of the ``with`` block.

    :param wire: The sync's connection settings for :func:`pdiffcopy.api.file_endpoint`
                 (``token``, ``concurrency``, ``timeout``, ``ca_file``, ``bwlimit``, ``compress``).
    """

    def __init__(self, **wire) -> None:
        self.wire = wire
        self.endpoints: dict = {}
        #: What :meth:`kind` found, by location.
        self.kinds: dict = {}

    def kind(self, location: str) -> Optional[str]:
        """"file", "directory", "other" or None (missing), following a symlink at the top; asked once."""
        if location not in self.kinds:
            self.kinds[location] = self._kind(location)
        return self.kinds[location]

    def _kind(self, location: str) -> Optional[str]:
        if is_url(location):
            from pdiffcopy.engine.options import check_concurrency
            from pdiffcopy.transport.urls import split_server_url

            if not split_server_url(location)[1].strip("/"):  # (which also checks the URL)
                return "directory"  # the server's root
            # Made as api.sync would make it (its --bwlimit and -z too): the file sync takes it.
            wire = {"bwlimit": None, "compress": "auto", **self.wire}
            wire["concurrency"] = check_concurrency(wire.get("concurrency"))
            endpoint = self.endpoints.get(location) or file_endpoint(location.rstrip("/"), **wire_settings(**wire))
            try:
                info = endpoint.stat()
            except BaseException:
                endpoint.close()
                raise
            if location.endswith("/"):
                endpoint.close()  # not the name a file sync would open
            else:
                self.endpoints[location] = endpoint
            return info.kind if info is not None else None
        if os.path.isdir(location):
            return "directory"
        if os.path.lexists(location):  # a dangling symlink too: -a makes it a symlink
            return "file"
        return None

    def take(self, location: str):
        """The endpoint made for ``location`` (the caller closes it now), else ``location`` itself."""
        return self.endpoints.pop(location, location)

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()
        self.endpoints.clear()

    def __enter__(self) -> "LocationProbes":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def resolve_locations(source: str, target: str, probes: LocationProbes, delete: bool = False,
                      files_from: Optional[Sequence[str]] = None) -> Tuple[str, str, bool]:
    """What to sync to what: ``(source, target, is_tree)``.

    A directory SOURCE is a tree (rsync's trailing-slash rule decides where it goes:
    :func:`~pdiffcopy.core.locations.tree_locations`); a file SOURCE with an existing
    directory TARGET goes into it, as with cp; anything else is the single-file sync.

    :param delete: ``--delete`` was given: a missing SOURCE is refused here (it would delete all).
    :param files_from: The paths a tree sync takes (--files-from, -R): a TARGET inside the SOURCE
                       directory is refused only when inside one of them.
    """
    if is_url(source) and is_url(target):
        return source, target, False  # the single-file sync says why not
    source_kind = probes.kind(source)
    if source_kind == "directory":
        target_kind = probes.kind(target)
        if target_kind is not None and target_kind != "directory":
            raise NotAFile(f"Cannot sync the directory {source} onto {target}: it is not a directory")
        source_tree, target_tree = tree_locations(source, target)
        for taken in [""] if files_from is None else map(normalise_listed, files_from):
            check_not_nested(join_location(source_tree, taken) if taken else source_tree, target_tree)
        return source_tree, target_tree, True
    if source_kind is None and (source.endswith("/") or delete or target.endswith("/")
                                or probes.kind(target) == "directory"):
        raise FileMissing(f"Source does not exist: {source}")
    if source_kind is not None and (probes.kind(target) == "directory" or target.endswith("/")):
        return source, join_location(target, last_name(source)), False
    return source, target, False


def check_not_nested(source: str, target: str) -> None:
    """Refuse a local target inside its local source (it would copy itself forever)."""
    if is_url(source) or is_url(target):
        return
    source_real = os.path.realpath(source)
    target_real = os.path.realpath(target)
    if target_real == source_real or target_real.startswith(source_real.rstrip("/") + "/"):
        raise UsageError(f"The target {target} is inside the source {source}")


def remove(location: str, options: "TreeOptions", *, token: Optional[str] = None,
           timeout: Optional[float] = None, ca_file: Optional[str] = None,
           progress: "Optional[TreeProgress]" = None,
           report_line: Optional[Callable[[str], None]] = None) -> "TreeResult":
    """Delete the tree or file at ``location`` (a path or a URL), a tree's entries in parallel.

    With ``options.dry_run`` nothing is deleted: ``report_line`` gets each line rsync's
    ``--dry-run`` would list.

    :returns: A :class:`~pdiffcopy.engine.treesync.TreeResult` (``deleted``, ``failures``).
    :raises FileMissing: When nothing is at ``location``.
    """
    from pdiffcopy.core.treeplan import FILE, Entry
    from pdiffcopy.engine.treeendpoints import DELETE, Operation
    from pdiffcopy.engine.treesync import TreeProgress, TreeResult, remove_tree
    from pdiffcopy.local.processes import die_with_parent

    wire = dict(token=token, concurrency=options.concurrency, timeout=timeout, ca_file=ca_file)
    with LocationProbes(**wire) as probes:
        kind = probes.kind(location)
    if kind is None:
        raise FileMissing(f"Nothing to remove: {location} does not exist")
    result = TreeResult(location, location)
    if kind != "directory":
        parent, _, name = location.rstrip("/").rpartition("/")
        if options.dry_run:
            if report_line is not None:
                report_line(f"{'delete':<10} {FILE:<7} {location}")
            return result
        tree = tree_endpoint(parent or ".", **wire)
        try:
            result.failures = tree.apply([Operation(DELETE, Entry(name, FILE, 0, 0, 0))], options.metadata)
        finally:
            tree.close()
        return result
    tree = tree_endpoint(location, **wire)
    try:
        return remove_tree(tree, options, progress or TreeProgress(options.concurrency), report_line=report_line,
                           on_worker_start=die_with_parent)
    finally:
        tree.close()


__all__ = ["LocationProbes", "check_not_nested", "remove", "resolve_locations"]

"""One interface for a directory tree, wherever it is.

A tree sync talks to its source and target trees through :class:`TreeEndpoint`,
as a file sync talks to its files through
:class:`~pdiffcopy.engine.endpoints.FileEndpoint`: :class:`~pdiffcopy.local.localtree.LocalTree`
works on a local directory, :class:`~pdiffcopy.transport.remotetree.RemoteTree` on a
directory behind a pdiffcopy server (which runs a ``LocalTree`` for it).

Small files move whole, many per call (:meth:`TreeEndpoint.read_files`,
:meth:`TreeEndpoint.write_files`), so 60,000 files are not 60,000 requests;
big ones go through :meth:`TreeEndpoint.file_endpoint` and the block engine.
Every call that changes many things reports the ones that failed and goes
on with the rest: one unreadable file never stops a tree sync.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pdiffcopy.core.records import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from pdiffcopy.engine.capabilities import Capability, check_declared
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.errors import Unsupported
# The operations are the tree plan's vocabulary (core); named here too, for the engine's callers.
from pdiffcopy.core.treeplan import (  # noqa: F401
    BACKUP,
    DELETE,
    LINK,
    METADATA,
    MKDIR,
    MKNOD,
    MKPATH,
    OPERATIONS,
    REMOVE,
    SYMLINK,
    Entry,
    Failure,
    Operation,
)
from pdiffcopy.core.xattrs import selects

@dataclass(frozen=True)
class MetadataOptions:
    """Which metadata besides permissions (always kept) a write or an operation sets."""

    times: bool = False
    owner: bool = False
    #: Flush each file written, and the directory holding it, before reporting
    #: success (rsync's --fsync): what was reported copied survives a crash.
    fsync: bool = False
    #: -X: extended attributes (user.*, security.*, trusted.*); -A: the two POSIX ACL attributes.
    xattrs: bool = False
    acls: bool = False
    #: ACL entries by user and group number, not by name (--numeric-ids).
    numeric_ids: bool = False
    #: Whether -X covers security.* and trusted.* (a server takes them from trusted clients only).
    privileged_xattrs: bool = True
    #: -S: runs of zeros (whole blocks) in the files written whole become holes, as rsync's -S.
    sparse: bool = False

    @property
    def attributes(self) -> bool:
        """Whether any extended attributes (ACLs included) are listed and kept."""
        return self.xattrs or self.acls

    def wants_attribute(self, name: str) -> bool:
        """Whether the attribute ``name`` is listed and kept (:func:`pdiffcopy.core.xattrs.selects`)."""
        return selects(name, self.xattrs, self.acls, self.privileged_xattrs)


@dataclass
class Listing:
    """A tree's root entry (``None`` when missing), everything below it, and what could not be listed."""

    root: Optional[Entry]
    entries: List[Entry]
    failures: List[Failure]


@dataclass
class ListingStream:
    """A tree's root entry, and the rest of its listing as an iterator of (entries, failures) batches.

    ``ordered``: the entries come in :func:`~pdiffcopy.core.treeplan.walk_order`, so that a plan
    can merge two trees' as they come; otherwise in no particular order. ``close`` ends an
    iteration stopped early.
    """

    root: Optional[Entry]
    batches: Iterator[Tuple[List[Entry], List[Failure]]]
    ordered: bool
    close: Callable[[], None]


# -- capabilities: each operation's contract, and (its body) what a tree without it gives


class WalkedHere(Capability):
    """A tree on this machine: walked and written by this process and its forked workers."""

    def walks_here(self) -> bool:
        """Whether :meth:`TreeEndpoint.list` walks a file system in this process (then a forked
        child can walk it beside another tree's walk). Without it: no, a server lists it."""
        return False

    def enter_worker(self) -> None:
        """Prepare a forked worker process of the sync for this tree. Without it: nothing to prepare."""

    def sweep_while_listing(self) -> None:
        """Have :meth:`TreeEndpoint.list` also remove the temporaries that killed runs left.

        Without it: nothing, a server sweeps its own root when it starts."""

    def same_content(self, entry: Entry, data: bytes) -> bool:
        """Whether this tree's file at ``entry.path`` holds exactly ``data``; False when it cannot
        tell cheaply (always, without it)."""
        return False

    def walk_only(self, descend: Callable[[str], bool]) -> None:
        """Have :meth:`TreeEndpoint.list` enter only the subdirectories whose paths ``descend``
        takes (--files-from, -R: the walk need not read what no listed path is below). Without it:
        nothing, a server walks all of the tree (the filters then leave out what is not taken)."""

    def list_devices_as_files(self) -> bool:
        """Have :meth:`TreeEndpoint.list` describe each block device as a regular file of the device's
        size, and :meth:`TreeEndpoint.read_files` and :meth:`TreeEndpoint.file_endpoint` read its
        contents (``--copy-devices``); True. Without it: False, devices are listed as what they are."""
        return False


class TreeCopies(Capability):
    """Files copied from another tree without passing through this process (two local trees: the kernel copies)."""

    def can_copy_files_from(self, other: "TreeEndpoint") -> bool:
        """Whether :meth:`copy_files_from` can take files from ``other``. Without it: never."""
        return False

    def copy_files_from(self, other: "TreeEndpoint", entries: Iterable[Entry], options: MetadataOptions,
                        compare: bool = False, fresh: bool = False) -> Tuple[List[Failure], int, int]:
        """Copy files of ``other`` into this tree directly: (failures, bytes moved, files copied).

        :raises Unsupported: Unless :meth:`can_copy_files_from` says yes (always, without it).
        """
        raise Unsupported(f"Cannot copy files from {other.location} into {self.location} directly")


class ServedTree(Capability):
    """A tree behind a server: its traffic counted across forked workers, its root the server's own."""

    def traffic(self) -> "Tuple[int, int]":
        """Bytes this process has sent and received on the wire for trees of this kind.

        A forked worker hands its figures to the parent, which counts them with :meth:`add_traffic`.
        Without it: (0, 0), nothing on a wire.
        """
        return (0, 0)

    def add_traffic(self, sent: int, received: int) -> None:
        """Count bytes a forked worker of this process moved on the wire (see :meth:`traffic`).

        Without it: nothing to count."""

    def expect_writes(self, asked: Tuple[str, ...]) -> None:
        """Say, before the listing, what the sync will ask of this target (``TreeOptions.asked_writes``),
        so that a server whose export refuses some of it refuses the sync before it copies.

        Without it: nothing, a local tree refuses nothing."""

    def may_change_root(self) -> bool:
        """Whether a sync may set the root directory's own permissions and times (not a server's root).

        Without it: yes."""
        return True


class KeptAttributes(Capability):
    """Extended attributes and ACLs listed and kept (-X, -A), and what could not be kept said once."""

    def list_attributes(self, options: MetadataOptions) -> None:
        """Have :meth:`TreeEndpoint.list` give each entry the extended attributes and ACLs ``options``
        ask for. Without it: none are listed."""

    def take_notices(self) -> List[str]:
        """What this tree could not keep since the last call (one line per kind), to be said once.

        Without it: none."""
        return []

    def not_kept(self) -> FrozenSet[str]:
        """What this tree has said, once its listing has begun, that it will not set of what a sync
        sends: ``"owner"`` (user and group), ``"xattrs"`` (security.* and trusted.* attributes).

        A sync does not count such differences as changes: setting them would change nothing.
        Without it: nothing, the tree keeps what it is sent.
        """
        return frozenset()

    def makes_nodes(self) -> FrozenSet[str]:
        """The nodes this tree makes, once its listing has begun (``-D``): ``"devices"`` (character
        and block devices, as root) and ``"specials"`` (fifos, unix sockets). A sync skips the
        others with a warning. Without it: none."""
        return frozenset()


#: What :meth:`Alternates.take_from_alternates` did with a file: hard linked it from a
#: directory, copied it from one, or found it there and left it out of the tree (removing the
#: tree's own, other, version: rsync's --compare-dest).
LINKED_FROM_ALTERNATE, COPIED_FROM_ALTERNATE, MATCHED_IN_ALTERNATE, REMOVED_FOR_ALTERNATE = \
    "linked", "copied", "matched", "removed"
TAKEN_FROM_ALTERNATES = (LINKED_FROM_ALTERNATE, COPIED_FROM_ALTERNATE, MATCHED_IN_ALTERNATE, REMOVED_FOR_ALTERNATE)


class Alternates(Capability):
    """Files taken from other directories on the tree's side: rsync's --link-dest, --copy-dest and --compare-dest."""

    def takes_from_alternates(self) -> bool:
        """Whether :meth:`take_from_alternates` works here. Without it: no."""
        return False

    def take_from_alternates(self, entries: Sequence[Entry], existing: Set[str], directories: Sequence[str],
                             use: str, options: MetadataOptions, dry_run: bool = False
                             ) -> Tuple[Dict[str, str], int, List[Failure]]:
        """Take the files ``entries`` describe from ``directories`` (relative to the tree's root), tried in order.

        A file a directory holds exactly as its entry says (regular, of its size and
        time, and of its permissions, owner and attributes as far as ``options`` keep
        them) is linked from it (``use`` "link"), copied from it ("copy"), or left out
        ("compare": a version this tree has, listed in ``existing``, is removed). Failing
        that, the first file that differs only in those attributes is copied and given
        the entry's. The others are left to the sync.

        :param dry_run: Say what would be done, and do nothing.
        :returns: By path, what was done (:data:`LINKED_FROM_ALTERNATE`...); the bytes copied; the failures.
        :raises Unsupported: Unless :meth:`takes_from_alternates` (always, without it).
        """
        raise Unsupported(f"{self.location} does not take files from other directories")


class TreeEndpoint(WalkedHere, TreeCopies, ServedTree, KeptAttributes, Alternates, ABC):
    """A directory tree that can be listed, read and changed in batches; what only some trees can do
    comes in capabilities (:mod:`pdiffcopy.engine.capabilities`), named in :attr:`capabilities`."""

    #: The path or URL the user gave, for messages.
    location: str
    #: The capabilities this kind implements (the others are their fallbacks).
    capabilities: Tuple[type, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        check_declared(cls, TREE_CAPABILITIES)

    @abstractmethod
    def list(self) -> Listing:
        """Everything below the root, recursively; symlinks are listed, never followed."""

    def stream(self) -> ListingStream:
        """What :meth:`list` gives, handed on as it is found where the tree can (this fallback lists it whole)."""
        listing = self.list()
        return ListingStream(listing.root, iter([(listing.entries, listing.failures)]), False, lambda: None)

    def describe_root_link(self) -> None:
        """Have :meth:`list` describe a root that is a symlink as the link itself (a single file's
        source under ``-a`` is a tree of one), not what it points at. By default it is followed."""

    @abstractmethod
    def read_files(self, entries: Sequence[Entry]) -> Iterator[Tuple[Entry, Optional[bytes], str]]:
        """Yield ``(entry, content, "")`` per file, or ``(entry, None, why)`` when it cannot be read.

        A file whose size is no longer the listed one is a failure ("changed
        while copying"): the listing's size is what the plan promised.
        """

    @abstractmethod
    def write_files(self, files: Iterable[Tuple[Entry, bytes]], options: MetadataOptions,
                    fresh: bool = False) -> List[Failure]:
        """Write each file whole under its path, with its permissions (and times, owner).

        Each file replaces the old one complete or not at all (a temporary
        sibling renamed into place); a sparse entry is written with holes.
        With ``fresh`` the files are new (nothing had their names when the
        tree was listed): each is created under its name, exclusively, and
        removed again if writing it fails, which saves the rename; a name
        that exists after all gets the temporary and rename.
        """

    @abstractmethod
    def apply(self, operations: Sequence[Operation], options: MetadataOptions) -> List[Failure]:
        """Run the operations in order; a failed one is reported and the rest still run."""

    @abstractmethod
    def file_endpoint(self, path: str) -> FileEndpoint:
        """The file at ``path`` below the root, for the block engine (big files)."""

    def close(self) -> None:
        """Release connections and descriptors."""


#: Every capability interface of a tree, for the contract suite.
TREE_CAPABILITIES = (WalkedHere, TreeCopies, ServedTree, KeptAttributes, Alternates)


__all__ = ["BACKUP", "COPIED_FROM_ALTERNATE", "DELETE", "LINK", "LINKED_FROM_ALTERNATE", "MATCHED_IN_ALTERNATE",
           "METADATA", "MKDIR", "MKNOD", "MKPATH", "REMOVE", "REMOVED_FOR_ALTERNATE", "SYMLINK",
           "TAKEN_FROM_ALTERNATES", "TREE_CAPABILITIES",
           "Alternates", "Failure",
           "KeptAttributes", "Listing", "ListingStream", "MetadataOptions", "Operation", "ServedTree", "TreeCopies",
           "TreeEndpoint", "WalkedHere"]

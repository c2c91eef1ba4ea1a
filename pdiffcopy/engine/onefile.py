"""A single file is a tree of one for its metadata: what ``-a``, ``-t``, ``-o``, ``-X`` and ``-A`` keep.

The file job (:mod:`pdiffcopy.engine.filejob`) moves a file's bytes; what else of the
file is kept goes the way a tree sync's does, through the same tree endpoints and the
same operations:

1. the source's entry is the root of the tree of one at the source (the file itself,
   with its attributes and ACLs as ``-X`` and ``-A`` ask, and, with ``-a``, a symlink
   described as the link, not followed);
2. a symlink source under ``-a`` becomes a symlink: the ``symlink`` operation a tree
   sync sends the directory that holds it, and no data moves;
3. once the data is synced and verified, the ``metadata`` operation sets the
   target's permissions, times, owner, attributes and ACLs, as for a tree's big file.

Without ``-a`` the permissions are not set here: a new copy got the source's mode
less the umask when it was made, an existing one keeps its own (rsync's rule), and
the operation, when ``-t``, ``-o``, ``-X`` or ``-A`` asks for one, carries the mode
the target has.

The caller (:mod:`pdiffcopy.api`) makes the tree endpoints; this module never does.
"""

from __future__ import annotations

import logging
from typing import Optional

from pdiffcopy.core.records import dataclass
from pdiffcopy.core.treeplan import SYMLINK as SYMLINK_KIND
from pdiffcopy.engine.filejob import SOURCE_MISSING
from pdiffcopy.engine.treeendpoints import METADATA, SYMLINK, Entry, MetadataOptions, Operation, TreeEndpoint
from pdiffcopy.errors import FileMissing, PartialTransfer, StorageError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeptMetadata:
    """What a file sync keeps of its source besides the bytes.

    ``options`` are a tree's metadata options (times, owner, attributes, ACLs); the two
    others are what a tree always keeps and a single file keeps with ``-a`` only.
    """

    options: MetadataOptions = MetadataOptions()
    #: Set the source's permissions (set-id bits included) on the target, new or not.
    permissions: bool = False
    #: A symlink source is made a symlink, not followed.
    links: bool = False

    @property
    def wanted(self) -> bool:
        """Whether anything is set beyond what the data sync gives the target."""
        options = self.options
        return self.permissions or self.links or options.times or options.owner or options.attributes


def source_entry(source: TreeEndpoint, keep: KeptMetadata) -> Entry:
    """The entry of the tree of one at the source: the file (or, with ``keep.links``, the symlink) itself.

    :raises FileMissing: When there is nothing there.
    """
    if keep.options.attributes:
        source.list_attributes(keep.options)
    if keep.links:
        source.describe_root_link()
    root = source.list().root
    if root is None:
        raise FileMissing(f"{SOURCE_MISSING}: {source.location}")
    return root


def make_symlink(parent: TreeEndpoint, name: str, link: Entry, keep: KeptMetadata, shown: str) -> None:
    """Make ``name`` in the tree ``parent`` the symlink ``link`` describes (replacing a file of that name).

    :param shown: The target's location, for messages.
    :raises PartialTransfer: When it could not be made.
    """
    assert link.kind == SYMLINK_KIND, "only a symlink is made a symlink"
    _apply(parent, Operation(SYMLINK, link._replace(path=name)), keep, shown, made=False)


def set_metadata(parent: TreeEndpoint, name: str, source: Entry, keep: KeptMetadata, shown: str,
                 current: Optional[Entry] = None) -> None:
    """Give the file ``name`` of the tree ``parent`` the source's metadata that ``keep`` asks for.

    :param current: The target's own entry (its tree of one): without ``keep.permissions``
                    its mode is kept. Needed then.
    :raises PartialTransfer: When it could not be set (the data is synced).
    """
    entry = source._replace(path=name)
    if not keep.permissions:
        if current is None:
            raise StorageError(f"{shown} is missing after the sync")
        entry = entry._replace(mode=(source.mode & ~0o7777) | current.permissions)
    _apply(parent, Operation(METADATA, entry), keep, shown, made=True)


def _apply(parent: TreeEndpoint, operation: Operation, keep: KeptMetadata, shown: str, made: bool) -> None:
    failures = parent.apply([operation], keep.options)
    for notice in parent.take_notices():
        logger.warning("%s", notice)
    if failures:
        message = failures[0][1]
        if made:
            raise PartialTransfer(f"{shown}: its data is synced, but its metadata could not be set: {message}")
        raise StorageError(f"Cannot make the symlink {shown}: {message}")


__all__ = ["KeptMetadata", "make_symlink", "set_metadata", "source_entry"]

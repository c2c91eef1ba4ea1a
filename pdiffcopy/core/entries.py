"""The entries of a tree listing: one per file, directory, symlink or special file, as lstat saw it.

Pure. :mod:`pdiffcopy.core.treeplan` plans with them (and names them for its users),
:mod:`pdiffcopy.core.filters` selects them.
"""

from __future__ import annotations

import base64
import os
import stat
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

FILE = "file"
DIR = "dir"
SYMLINK = "symlink"
OTHER = "other"  # fifos, sockets, devices: made as nodes with -D, skipped otherwise

#: The node types of :data:`OTHER` entries (:func:`node_type`): character and block devices
#: (``--devices``), fifos and unix sockets (``--specials``).
CHAR_DEVICE = "char device"
BLOCK_DEVICE = "block device"
FIFO = "fifo"
SOCKET = "socket"
_NODE_TYPES = {stat.S_IFCHR: CHAR_DEVICE, stat.S_IFBLK: BLOCK_DEVICE, stat.S_IFIFO: FIFO,
               stat.S_IFSOCK: SOCKET}
#: The device numbers of a device entry travel in its ``target`` (``"MAJOR:MINOR"``, as
#: /sys/dev names devices): an older peer, which skips such entries, takes any target.
_MAX_DEVICE_NUMBER = 2 ** 32 - 1


def kind_of(mode: int) -> str:
    """The :data:`FILE` / :data:`DIR` / :data:`SYMLINK` / :data:`OTHER` kind of an ``st_mode``."""
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISDIR(mode):
        return DIR
    if stat.S_ISLNK(mode):
        return SYMLINK
    return OTHER


def node_type(mode: int) -> str:
    """:data:`CHAR_DEVICE`, :data:`BLOCK_DEVICE`, :data:`FIFO` or :data:`SOCKET` for such an
    ``st_mode``; ``""`` for anything else."""
    return _NODE_TYPES.get(stat.S_IFMT(mode), "")


def is_device(mode: int) -> bool:
    """Whether ``mode`` is a character or block device's."""
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def device_target(rdev: int) -> str:
    """The ``target`` of a device entry: its ``st_rdev`` as ``"MAJOR:MINOR"``."""
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def device_numbers(target: str) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a device entry's ``target``; None when it says none (an older
    peer's listing) or is not such numbers."""
    major, colon, minor = target.partition(":")
    if not (colon and major.isdigit() and minor.isdigit() and major.isascii() and minor.isascii()):
        return None
    numbers = int(major), int(minor)
    return numbers if max(numbers) <= _MAX_DEVICE_NUMBER else None


#: One int object per distinct ``st_mode`` (bounded: modes are few in practice):
#: a listing's entries share them instead of holding a 28-byte int each.
_SHARED_MODES: Dict[int, int] = {}
_MAX_SHARED_MODES = 4096


def shared_mode(mode: int) -> int:
    """``mode`` itself, or an equal int object already held by other entries."""
    shared = _SHARED_MODES.get(mode)
    if shared is not None:
        return shared
    if len(_SHARED_MODES) < _MAX_SHARED_MODES:
        _SHARED_MODES[mode] = mode
    return mode


#: The shared int equal to a mode, or None: :func:`shared_mode`'s common case as one C call,
#: for the loops that make an entry per file (``known_mode(m) or shared_mode(m)``).
known_mode = _SHARED_MODES.get


class Entry(NamedTuple):
    """One thing below a tree's root, as ``lstat`` saw it (symlinks are never followed).

    ``path`` is relative to the root, ``/``-separated, without a leading or
    trailing slash; names that are not UTF-8 keep their bytes as
    surrogate escapes (:func:`os.fsdecode`).
    """

    path: str
    kind: str
    size: int
    mtime_ns: int
    mode: int  # the whole st_mode; permissions are mode & 0o7777
    uid: int = 0
    gid: int = 0
    target: str = ""  # what a symlink points at; a device's numbers, "MAJOR:MINOR"
    nlink: int = 1
    sparse: bool = False  # fewer blocks allocated than the size needs
    #: Shared by the names of one hard-linked file in one listing (-H/--hard-links); "" otherwise.
    link: str = ""
    #: Extended attributes and ACLs (-X/-A): sorted (name, value) pairs; empty when not asked for.
    xattrs: Tuple[Tuple[str, bytes], ...] = ()

    # A named tuple, not a dataclass: a listing makes 60,000 of them and a
    # tuple is built several times faster.

    @property
    def permissions(self) -> int:
        return stat.S_IMODE(self.mode)

    @property
    def parent(self) -> str:
        return self.path.rpartition("/")[0]

    @property
    def depth(self) -> int:
        return self.path.count("/")

    def to_wire(self) -> list:
        """A compact JSON-ready form (the listing of 60,000 files stays small).

        Ten values; twelve when the entry has a link group or attributes: then the
        link and the attributes as ``[name, base64 value]`` pairs.
        """
        plain = [*self[:9], int(self.sparse)]
        if not self.link and not self.xattrs:
            return plain
        return [*plain, self.link, [[name, base64.b64encode(value).decode("ascii")] for name, value in self.xattrs]]

    @classmethod
    def from_wire(cls, value: Sequence) -> "Entry":
        path, kind, size, mtime_ns, mode, uid, gid, target, nlink, sparse = value[:10]
        link, xattrs = (value[10], value[11]) if len(value) > 10 else ("", ())
        if kind not in (FILE, DIR, SYMLINK, OTHER):
            raise ValueError(f"unknown entry kind {kind!r}")
        return cls(str(path), kind, int(size), int(mtime_ns), int(mode), int(uid), int(gid),
                   str(target), int(nlink), bool(sparse), str(link),
                   tuple((str(name), base64.b64decode(data, validate=True)) for name, data in xattrs))


__all__ = ["BLOCK_DEVICE", "CHAR_DEVICE", "DIR", "FIFO", "FILE", "OTHER", "SOCKET", "SYMLINK", "Entry",
           "device_numbers", "device_target", "is_device", "kind_of", "known_mode", "node_type", "shared_mode"]

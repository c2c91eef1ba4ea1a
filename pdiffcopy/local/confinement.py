"""Confinement: resolve paths beneath a root directory, and nowhere else.

The server never builds a path string and opens it. It opens the root once
and resolves every request's path relative to it with ``openat2(2)`` and
``RESOLVE_BENEATH``, so the kernel refuses ``..``, absolute paths and any
symlink that would lead out, at the moment of opening: there is no window
between a check and the open for a swapped-in symlink to exploit. Symlinks
that stay inside the root work.

Where ``openat2`` is missing (Linux < 5.6, other systems), or the fast paths
are turned off (:func:`~pdiffcopy.local.descriptors.fast_paths_enabled`), the fallback
walks the path one component at a time with ``O_NOFOLLOW``: stricter (it
refuses every symlink) but equally safe.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from typing import Optional, Tuple

from pdiffcopy.errors import AccessDenied, BadRequest, FileMissing, NotAFile, storage_error
from pdiffcopy.local import libc
from pdiffcopy.local.descriptors import fast_paths_enabled
from pdiffcopy.core.protocol import MAX_PATH_LENGTH, RESERVED_NAME


#: Flags of every open of a file that must turn out to be a regular one. A
#: FIFO opened for reading without them blocks the thread until a writer
#: comes (forever, for a planted one), and a terminal could become the
#: process's controlling terminal; with them the open returns at once and
#: the type check refuses what is not a regular file before any read.
PROBING_FLAGS = os.O_NONBLOCK | os.O_NOCTTY

_SYS_OPENAT2 = 437  # the same number on every Linux architecture
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08


@functools.lru_cache(maxsize=None)
def _open_how() -> type:
    """openat2's ``struct open_how`` (made on first use: ctypes is not imported by runs that never need it)."""
    import ctypes

    class _OpenHow(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

    return _OpenHow


_have_openat2: Optional[bool] = None


def _openat2(dir_fd: int, path: str, flags: int, mode: int) -> int:
    syscall = libc.function("syscall")
    if syscall is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), path)
    import ctypes

    how = _open_how()(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = syscall(_SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd < 0:
        raise libc.last_error(path)
    return fd


def _walk_nofollow(dir_fd: int, path: str, flags: int, mode: int) -> int:
    """Open ``path`` below ``dir_fd`` one component at a time, through no symlink at all.

    A symlink on the way, or as the last name unless ``flags`` has
    ``O_NOFOLLOW`` (then the link itself is what is asked for, as with
    ``openat2``), is refused with :class:`AccessDenied`, as ``openat2``
    refuses one that leads out.
    """
    parts = path.split("/")
    current = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            try:
                following = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                    dir_fd=current)
            except NotADirectoryError:
                _refuse_symlink(current, part, path)
                raise
            os.close(current)
            current = following
        try:
            fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=current)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                _refuse_symlink(current, parts[-1], path)
            raise
        if not flags & os.O_NOFOLLOW and flags & os.O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):
            os.close(fd)  # O_PATH | O_NOFOLLOW opens the link itself, which was not asked for
            _refuse_symlink(current, parts[-1], path)
        return fd
    finally:
        os.close(current)


def _refuse_symlink(dir_fd: int, name: str, path: str) -> None:
    """Raise :class:`AccessDenied` when ``name`` in ``dir_fd`` is a symlink (the walk follows none)."""
    try:
        link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return
    if link:
        raise AccessDenied(f"Path through a symlink (not followed without openat2): {path[:200]!r}")


def describe_kind(mode: int) -> str:
    """What a file of this mode is, for messages ("a FIFO")."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular(fd: int, what: str, flags: int = 0) -> os.stat_result:
    """Insist that ``fd`` (opened with :data:`PROBING_FLAGS`) is a regular file, and make it blocking.

    :param flags: The flags the caller asked for: ``O_NONBLOCK`` among them is kept.
    :returns: The file's ``fstat``.
    :raises NotAFile: (After closing ``fd``) for FIFOs, devices, sockets, directories.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotAFile(f"Not a regular file: {what} is {describe_kind(info.st_mode)}")
    if not flags & os.O_NONBLOCK:
        os.set_blocking(fd, True)  # no effect on a local file system; a FUSE one may honour it
    return info


def has_other_names(info: os.stat_result) -> bool:
    """Whether a change of this file in place shows under other names too (hard links).

    A directory's link count counts its subdirectories, not other names.
    """
    return info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode)


def link_group(info: os.stat_result) -> str:
    """A file's :attr:`~pdiffcopy.core.treeplan.Entry.link`: its device and inode when it has
    other names, else ""."""
    # Listed always (a few linked files cost a string each): -H needs it on both sides, and
    # the target's groups are how a sync sees names that are already linked.
    return f"{info.st_dev:x}:{info.st_ino:x}" if has_other_names(info) else ""


def refuse_hard_links(info: os.stat_result, path: str, allowed: bool) -> None:
    """Refuse to change a file with several hard links in place, unless the operator allows it.

    Every name of such a file shows the change, and the other names may be
    outside the root (a link planted by a local user) or other versions of
    the data (a hard-linked backup snapshot). Replacing it through a
    temporary and a rename (``--atomic``) changes only this name.
    """
    if has_other_names(info) and not allowed:
        raise AccessDenied(f"Refusing to change {path} in place: it has {info.st_nlink} hard links "
                           f"and all of them would change (sync with --atomic to replace it instead)")


def open_regular_path(path: str, flags: int, mode: int = 0o666) -> int:
    """Open a file the user named (symlinks followed), insisting that it is a regular file.

    Devices are refused before they are opened (a ``stat`` first: opening
    some has effects), FIFOs without blocking (see :data:`PROBING_FLAGS`).

    :raises PdiffcopyError: :class:`NotAFile` for anything else, or what the file system said.
    """
    try:
        info = os.stat(path)
    except OSError as error:
        if not (error.errno == errno.ENOENT and flags & os.O_CREAT):
            raise storage_error(error, f"open {path}") from None
    else:
        if not stat.S_ISREG(info.st_mode):
            raise NotAFile(f"Not a regular file: {path} is {describe_kind(info.st_mode)}")
    try:
        fd = os.open(path, flags | PROBING_FLAGS | os.O_CLOEXEC, mode)
    except OSError as error:
        raise storage_error(error, f"open {path}") from None
    check_regular(fd, path, flags)
    return fd


def clean_relative_path(path: str, reserve: bool = True) -> str:
    """Check a request's path and return it relative to the root.

    :param path: The URL path after percent-decoding and after the slash that
                 starts every URL path; a further leading ``/`` is absolute.
    :returns: The normalised relative path, ``""`` for the root itself.
    :raises AccessDenied: For ``..`` components, absolute escapes and the reserved name.
    :raises BadRequest: For NUL bytes and overlong paths.
    """
    if "\x00" in path:
        raise BadRequest("Invalid path: it contains a NUL byte")
    if len(os.fsencode(path)) > MAX_PATH_LENGTH:
        raise BadRequest("Invalid path: too long")
    if path.startswith("/"):
        raise AccessDenied(f"Path outside the root: {path[:200]!r}")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise AccessDenied(f"Path outside the root: {path[:200]!r}")
    if reserve and parts and parts[0] == RESERVED_NAME:
        raise AccessDenied(f"Path reserved for the server: {path[:200]!r}")
    return "/".join(parts)


class Root:
    """A directory the server is confined to."""

    def __init__(self, directory: str, reserve: bool = True) -> None:
        """:param reserve: Refuse :data:`RESERVED_NAME` at the top (the server's API lives there);
                        a local tree has no API and copies such a name like any other."""
        self.directory = os.path.abspath(directory)
        self.reserve = reserve
        self._fd: Optional[int] = None
        self._pid: Optional[int] = None

    @property
    def fd(self) -> int:
        """A descriptor of the root, opened once per process."""
        if self._fd is None or self._pid != os.getpid():
            try:
                self._fd = os.open(self.directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as error:
                raise storage_error(error, f"open the root directory {self.directory}") from None
            self._pid = os.getpid()
        return self._fd

    def open(self, path: str, flags: int, mode: int = 0o666) -> int:
        """Open ``path`` (relative to the root) without leaving the root.

        :returns: A file descriptor; the caller closes it.
        :raises PdiffcopyError: :class:`AccessDenied` for escapes, else what the file system said.
        """
        relative = clean_relative_path(path, self.reserve) or "."
        global _have_openat2
        try:
            if _have_openat2 is not False and fast_paths_enabled():
                try:
                    return _openat2(self.fd, relative, flags, mode)
                except OSError as error:
                    if error.errno != errno.ENOSYS:
                        raise
                    _have_openat2 = False
            return _walk_nofollow(self.fd, relative, flags, mode)
        except OSError as error:
            if error.errno in (errno.EXDEV, errno.ELOOP):
                raise AccessDenied(f"Path outside the root: {path[:200]!r}") from None
            if error.errno == errno.ENAMETOOLONG:
                raise BadRequest("Invalid path: a name is too long") from None
            raise storage_error(error, f"open {relative}") from None

    def open_regular(self, path: str, flags: int, mode: int = 0o666, follow: bool = True) -> int:
        """Open ``path`` beneath the root and insist that it is a regular file.

        The kind is looked at first through an ``O_PATH`` descriptor, which
        opens nothing: a FIFO or a device is refused without being opened.
        The real open then uses :data:`PROBING_FLAGS` and checks again, so a
        special file swapped in between is never read and never blocks.

        :param follow: Follow a symlink in the last component (if it stays in
                       the root). A tree member is opened without: a symlink
                       there is not the file that was listed.
        :raises PdiffcopyError: :class:`NotAFile` for anything but a regular
                file, :class:`AccessDenied` for escapes, else what the file system said.
        """
        nofollow = 0 if follow else os.O_NOFOLLOW
        try:
            probe = self.open(path, os.O_PATH | nofollow)
        except FileMissing:
            if not flags & os.O_CREAT:
                raise
        else:
            try:
                info = os.fstat(probe)
            finally:
                os.close(probe)
            if not stat.S_ISREG(info.st_mode):
                raise NotAFile(f"Not a regular file: {path} is {describe_kind(info.st_mode)}")
        fd = self.open(path, flags | nofollow | PROBING_FLAGS, mode)
        check_regular(fd, path, flags)
        return fd

    def open_parent(self, path: str) -> Tuple[int, str]:
        """Open the directory that holds ``path``; return its descriptor and the last name.

        Renames and unlinks work on (directory descriptor, name) pairs so that
        the final component is never followed.

        :raises AccessDenied: When ``path`` is the root itself or leads out.
        """
        relative = clean_relative_path(path, self.reserve)
        if not relative:
            raise AccessDenied("The root directory itself cannot be changed")
        parent, _, name = relative.rpartition("/")
        return self.open(parent or ".", os.O_PATH | os.O_DIRECTORY), name

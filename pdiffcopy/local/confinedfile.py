"""A local file confined beneath a root directory: a tree's member, a file a server serves.

Every open goes through :class:`~pdiffcopy.local.confinement.Root` (``openat2`` with
``RESOLVE_BENEATH``, ``O_NOFOLLOW`` on the last name), and its temporary is made, renamed and
removed through a descriptor of its directory, so a directory swapped for a symlink after
the tree was listed can never lead a read or a write out of it. The server's file views
open every file they serve this way (with ``follow``: a symlink that stays in the root is
served). Only regular files are opened (FIFOs and devices are refused, never waited on).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import AccessDenied, Conflict, FileMissing, PdiffcopyError, storage_error
from pdiffcopy.local.confinement import Root, clean_relative_path
from pdiffcopy.local.sweep import sweep_stale_temporaries
from pdiffcopy.local.filehash import cut_open, hash_region
from pdiffcopy.local.localfile import LocalFile

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future


class ConfinedFile(LocalFile):
    """The file at ``relative`` beneath ``root``, a :class:`LocalFile` opened only beneath it.

    :param root: The directory the file must stay in (a tree's root, a server's).
    :param relative: The file's path relative to ``root``.
    :param follow: Follow a symlink in the last name if it stays beneath the
                   root (a server's files); a tree's member is opened without.
    :param name: What messages call the file (default: its full path; a
                 server names the path its client asked for, not its root).
    """

    def __init__(self, root: Root, relative: str, pool: "Optional[Executor]" = None, follow: bool = False,
                 name: Optional[str] = None) -> None:
        super().__init__(name if name is not None else os.path.join(root.directory, relative), pool)
        self._root, self._relative, self._follow = root, relative, follow

    def _open(self, flags: int, mode: int = 0o666) -> int:
        return self._root.open_regular(self._relative, flags, mode, follow=self._follow)

    def open_writer(self) -> "tuple[int, bool]":
        try:
            return self._open(os.O_WRONLY | os.O_CREAT | os.O_EXCL), True
        except Conflict:  # it exists: update it in place
            return self._open(os.O_WRONLY), False

    def status(self) -> os.stat_result:
        fd = self._root.open(self._relative, os.O_PATH | (0 if self._follow else os.O_NOFOLLOW))
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _name_status(self) -> os.stat_result:
        return self.status()  # a sibling is never followed

    def free_space(self) -> Optional[int]:
        try:
            directory, _ = self._directory_and_name()
        except PdiffcopyError:
            return None  # the root itself, or a directory gone: the sync says so where it matters
        try:
            stats = os.fstatvfs(directory)
        except OSError:
            return None
        finally:
            os.close(directory)
        return stats.f_bavail * stats.f_frsize

    def _directory_and_name(self) -> "tuple[Optional[int], str]":
        """A descriptor of the file's directory (``O_RDONLY``: it can be flushed) and its name.

        :raises AccessDenied: For the root itself, which has no name to rename or remove.
        """
        relative = clean_relative_path(self._relative, self._root.reserve)
        if not relative:
            raise AccessDenied("The root directory itself cannot be changed")
        parent, _, name = relative.rpartition("/")
        return self._root.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY), name

    def sweep_temporaries(self) -> int:
        directory, _ = self._directory_and_name()
        try:
            return sweep_stale_temporaries(f"/proc/self/fd/{directory}")
        finally:
            os.close(directory)

    def _flush_directory(self) -> None:
        directory, _ = self._directory_and_name()
        assert directory is not None
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def exists(self) -> bool:
        try:
            os.close(self._root.open(self._relative, os.O_PATH | os.O_NOFOLLOW))
        except FileMissing:
            return False
        return True

    def _submit_hashes(self, pool: "Executor", ranges: List[ByteRange], block_size: int, method: str
                       ) -> "Future[bytes]":
        return pool.submit(_hash_below, self._root.directory, self._relative, ranges, block_size, method)

    def _submit_cut(self, pool: "Executor", ranges: List[ByteRange], average: int) -> "Future[List[cdc.Chunk]]":
        return pool.submit(_cut_below, self._root.directory, self._relative, ranges, average)

    def _sibling(self, naming: Callable[[str], str],
                 relative: Optional[str] = None) -> "tuple[LocalFile, Optional[str]]":
        display: Optional[str] = relative
        if relative is None:
            head, sibling_name = self._relative.rpartition("/")[0], naming(os.path.basename(self.path))
            relative = f"{head}/{sibling_name}" if head else sibling_name
        sibling = ConfinedFile(self._root, relative, self.pool, name=display)
        sibling.temporary = True
        return sibling, display


#: The roots a hashing process has opened, by directory (one descriptor each, kept).
_roots: "dict[str, Root]" = {}


def _cut_below(directory: str, relative: str, ranges: Sequence[ByteRange], average: int) -> "List[cdc.Chunk]":
    """:func:`cut_ranges` of a file confined beneath ``directory`` (run in a hashing process)."""
    root = _roots.get(directory)
    if root is None:
        root = _roots[directory] = Root(directory, reserve=False)
    fd = root.open_regular(relative, os.O_RDONLY, follow=False)
    try:
        return cut_open(fd, ranges, average, relative)
    finally:
        os.close(fd)


def _hash_below(directory: str, relative: str, ranges: Sequence[ByteRange], block_size: int,
                method: str) -> bytes:
    """:func:`hash_file_ranges` for a file confined beneath ``directory`` (run in a hashing process)."""
    root = _roots.get(directory)
    if root is None:
        root = _roots[directory] = Root(directory, reserve=False)
    fd = root.open_regular(relative, os.O_RDONLY, follow=False)
    try:
        return b"".join(hash_region(fd, offset, length, block_size, method) for offset, length in ranges)
    except OSError as error:
        raise storage_error(error, f"read {relative}") from None
    finally:
        os.close(fd)


__all__ = ["ConfinedFile"]

"""Low-level operations on open files, shared by the client and the server.

Everything here works on file descriptors, so the server can apply it to
descriptors it opened safely beneath its root, and the client to its own.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets

from typing import Iterable, Iterator, Tuple

from pdiffcopy.blocks import ByteRange

#: Bytes moved per read or write system call. BENCHMARKING.md: writes into
#: new files of 128 KiB to 1 MiB are several times faster here than 4 MiB ones.
TRANSFER_CHUNK_SIZE = 1024 * 1024

#: The FICLONE ioctl (linux/fs.h): make the target share the source's extents.
FICLONE = 0x40049409

_TEMPORARY_NAME = re.compile(r"^\..+\.pdiffcopy-[0-9a-f]{12}$", re.DOTALL)


def temporary_name(name: str) -> str:
    """A hidden sibling name for writing ``name`` atomically (``.name.pdiffcopy-xxxx``)."""
    return f".{name}.pdiffcopy-{secrets.token_hex(6)}"


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` (a last path component) is one :func:`temporary_name` makes."""
    return bool(_TEMPORARY_NAME.match(name))


def read_chunks(fd: int, ranges: Iterable[ByteRange],
                chunk_size: int = TRANSFER_CHUNK_SIZE) -> Iterator[Tuple[int, memoryview]]:
    """Read ranges of a file as (offset, chunk) pairs.

    The chunks are views of one reused buffer: consume each before asking for
    the next.

    :raises OSError: When reading fails.
    :raises EOFError: When the file is shorter than a range (it shrank).
    """
    buffer = bytearray(chunk_size)
    view = memoryview(buffer)
    for offset, length in ranges:
        position, end = offset, offset + length
        while position < end:
            got = os.preadv(fd, [view[: min(chunk_size, end - position)]], position)
            if got <= 0:
                raise EOFError(f"file ended at {position} bytes, before {end}")
            yield position, view[:got]
            position += got


def write_all(fd: int, data: "bytes | memoryview", offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` may write less than asked)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def resize(fd: int, size: int) -> None:
    """Make an open file exactly ``size`` bytes long.

    Growth is reserved with ``posix_fallocate`` where the file system can, so
    a full disk fails now, with nothing written, instead of half-way through.

    :raises OSError: For ENOSPC and other failures.
    """
    current = os.fstat(fd).st_size
    if size > current:
        try:
            os.posix_fallocate(fd, current, size - current)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)


def clone_or_copy(source_fd: int, target_fd: int) -> str:
    """Fill an empty file with another's data, the cheapest way the kernel allows.

    A reflink (FICLONE) shares extents and costs milliseconds; otherwise
    ``copy_file_range`` copies inside the kernel; a read/write loop is the
    last resort.

    :returns: The method used: ``"reflink"``, ``"copy_file_range"`` or ``"read/write"``.
    :raises OSError: When copying fails.
    """
    size = os.fstat(source_fd).st_size
    try:
        fcntl.ioctl(target_fd, FICLONE, source_fd)
        return "reflink"
    except OSError:
        pass  # EXDEV, EOPNOTSUPP, EINVAL...: not the same reflink-capable file system
    copied = 0
    if hasattr(os, "copy_file_range"):
        try:
            while copied < size:
                count = os.copy_file_range(source_fd, target_fd, size - copied, copied, copied)
                if count == 0:
                    break
                copied += count
            if copied >= size:
                return "copy_file_range"
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    for position, chunk in read_chunks(source_fd, [(copied, size - copied)]):
        write_all(target_fd, chunk, position)
    return "read/write"


def copy_range(source_fd: int, target_fd: int, offset: int, length: int) -> None:
    """Copy bytes between the same offsets of two files, inside the kernel where it can.

    ``copy_file_range`` moves the data without passing it through user space
    (and lets file systems share blocks); a read/write loop takes over where
    the kernel refuses.

    :raises OSError: When copying fails.
    :raises EOFError: When the source is shorter than the range.
    """
    end = offset + length
    position = offset
    if hasattr(os, "copy_file_range"):
        try:
            while position < end:
                count = os.copy_file_range(source_fd, target_fd, end - position, position, position)
                if count == 0:
                    raise EOFError(f"file ended at {position} bytes, before {end}")
                position += count
            return
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    for chunk_offset, chunk in read_chunks(source_fd, [(position, end - position)]):
        write_all(target_fd, chunk, chunk_offset)


def fsync_directory(path: str) -> None:
    """Flush a directory's entries (after a create or rename) to disk."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_space(fd: int) -> int:
    """Bytes available to unprivileged users on the file system of ``fd``."""
    stats = os.fstatvfs(fd)
    return stats.f_bavail * stats.f_frsize


def etag(stat: os.stat_result) -> str:
    """An entity tag that changes whenever the file's identity, size or mtime does."""
    return f'"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}"'


__all__ = [
    "TRANSFER_CHUNK_SIZE", "temporary_name", "is_temporary_name", "read_chunks", "write_all",
    "resize", "clone_or_copy", "copy_range", "fsync_directory", "free_space", "etag",
]

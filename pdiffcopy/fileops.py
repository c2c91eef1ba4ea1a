"""Low-level operations on open files, shared by the client, the server and fastcopy.

Everything here works on file descriptors, so the server can apply it to
descriptors it opened safely beneath its root, and the client to its own.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from typing import Callable, Iterable, Iterator, Tuple

from pdiffcopy.blocks import ByteRange

#: Bytes moved per read or write system call. BENCHMARKING.md: writes into
#: new files of 128 KiB to 1 MiB are several times faster here than 4 MiB ones.
TRANSFER_CHUNK_SIZE = 1024 * 1024

#: The FICLONE ioctl (linux/fs.h): make the target share the source's extents.
FICLONE = 0x40049409

# sync_file_range(2) flags (linux/fs.h). Python's os module has no binding.
SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4

#: errno values with which the kernel says "not this way, try another": the file
#: systems differ (EXDEV), the file system or kernel lacks the operation
#: (EOPNOTSUPP, ENOSYS, ENOTTY), or refuses these particular files (EINVAL);
#: ENOTSOCK is sendfile on systems where it only writes to sockets.
REFUSALS = frozenset({
    errno.EXDEV, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP),
    errno.EINVAL, errno.ENOSYS, errno.ENOTTY, errno.ENOTSOCK,
})

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

    Growth beyond the free space is refused up front (also where the file
    system cannot reserve space, and so that a bogus size cannot make a huge
    sparse file), then reserved with :func:`reserve`: a full disk fails now,
    with nothing written, instead of half-way through.

    :raises OSError: ENOSPC when the growth does not fit, and other failures.
    """
    current = os.fstat(fd).st_size
    if size > current:
        if size - current > free_space(fd):
            raise OSError(errno.ENOSPC, f"No space left on device ({size - current} more bytes needed)")
        reserve(fd, current, size - current)
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)


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
            if error.errno not in REFUSALS:
                raise
    for chunk_offset, chunk in read_chunks(source_fd, [(position, end - position)]):
        write_all(target_fd, chunk, chunk_offset)


class _Libc:
    """The few libc functions Python's os module lacks, loaded on first use."""

    _loaded = False
    sync_file_range: Callable[..., int] | None = None
    fallocate: Callable[..., int] | None = None

    @classmethod
    def load(cls) -> type[_Libc]:
        if not cls._loaded:
            cls._loaded = True
            try:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                for name in ("sync_file_range", "fallocate"):
                    function = getattr(libc, name, None)
                    if function is not None:
                        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_uint] if name == "sync_file_range" else \
                            [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
                        function.restype = ctypes.c_int
                        setattr(cls, name, function)
            except (ImportError, OSError):
                pass  # no ctypes or no libc: the callers have fallbacks
        return cls


def _call_libc(function: Callable[..., int], *args: int) -> None:
    import ctypes

    if function(*args) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a just-written range to disk, without waiting for it.

    A sync that fsyncs at the end then finds little left to write: the disk
    works while the transfer goes on instead of after it. Advisory: a file
    system that refuses it (or a system without sync_file_range) is simply
    left to write back later.
    """
    function = _Libc.load().sync_file_range
    if function is not None and length > 0:
        function(fd, offset, length, SYNC_FILE_RANGE_WRITE)


def reserve(fd: int, offset: int, length: int) -> None:
    """Reserve disk space for a range of a file before writing it.

    This calls ``fallocate(2)`` directly rather than ``posix_fallocate``:
    where the file system cannot allocate (NFS before 4.2, older CIFS), glibc's
    ``posix_fallocate`` falls back to writing a byte into every block, which
    would cost more than the copy (and defeat a server-side copy).

    :param fd: A file open for writing.
    :param offset: Where the range starts.
    :param length: How long it is; the file grows to at least ``offset + length``.
    :raises OSError: ENOSPC when the space is not there; refusals are ignored.
    """
    if length <= 0:
        return
    function = _Libc.load().fallocate
    try:
        if function is not None:
            _call_libc(function, fd, 0, offset, length)
        elif hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, offset, length)
    except OSError as error:
        if error.errno not in REFUSALS:
            raise


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
    "resize", "reserve", "start_writeback", "copy_range", "fsync_directory", "free_space", "etag",
]

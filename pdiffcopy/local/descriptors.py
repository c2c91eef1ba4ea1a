"""Low-level operations on open files, shared by the client, the server and fastcopy.

Everything here works on file descriptors, so the server can apply it to
descriptors it opened safely beneath its root, and the client to its own.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from typing import Iterable, Iterator, List, Optional, Tuple

from pdiffcopy.local import libc
from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.datamap import zero_runs
from pdiffcopy.local.devices import descriptor_size
# The temporary-name scheme and the transfer chunk are the protocol's (the client names
# the server's temporaries); they are imported here for this module's many users.
from pdiffcopy.core.protocol import (  # noqa: F401
    TRANSFER_CHUNK_SIZE,
    is_partial_name,
    is_temporary_name,
    partial_name,
    temporary_name,
    unique_suffix,
)

logger = logging.getLogger(__name__)

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

#: Environment variable that, set to a non-empty value other than ``0``, turns
#: off every fast path (see :func:`fast_paths_enabled`): for users who hit a
#: kernel or file system bug in one, and for tests of the plain paths.
NO_FASTPATH_VARIABLE = "PDIFFCOPY_NO_FASTPATH"


#: The kill switch as this process found it: read once, when this module is first imported (the
#: small files of a tree ask for every file), and inherited by forked workers with the rest of
#: their parent's memory, so a process and its workers never disagree.
_FAST_PATHS = os.environ.get(NO_FASTPATH_VARIABLE, "") in ("", "0")


def fast_paths_enabled() -> bool:
    """Whether the fast paths may be used; the one place :data:`NO_FASTPATH_VARIABLE` is judged.

    Every fast path asks here first and takes its plain way when told no:
    ``copy_file_range``, ``sendfile`` and ``FICLONE`` copy by reading and
    writing, ``openat2`` confinement walks the path one ``O_NOFOLLOW``
    component at a time (just as safe, stricter: it refuses every symlink),
    and the advisory ``posix_fadvise`` and ``sync_file_range`` are left out.
    The environment is read once per process (see :data:`_FAST_PATHS`).
    """
    return _FAST_PATHS


def read_chunks(fd: int, ranges: Iterable[ByteRange], chunk_size: int = TRANSFER_CHUNK_SIZE,
                copies: bool = False) -> "Iterator[Tuple[int, bytes | memoryview]]":
    """Read ranges of a file as (offset, chunk) pairs.

    The chunks are views of one reused buffer (consume each before asking for
    the next), or with ``copies`` new ``bytes`` each (for a caller that keeps
    them, as a response body's consumer may).

    :raises OSError: When reading fails.
    :raises EOFError: When the file is shorter than a range (it shrank).
    """
    view = None if copies else memoryview(bytearray(chunk_size))
    for offset, length in ranges:
        position, end = offset, offset + length
        while position < end:
            wanted = min(chunk_size, end - position)
            if view is None:
                chunk: "bytes | memoryview" = os.pread(fd, wanted, position)
            else:
                chunk = view[: os.preadv(fd, [view[:wanted]], position)]
            if not chunk:
                raise EOFError(f"file ended at {position} bytes, before {end}")
            yield position, chunk
            position += len(chunk)


def write_all(fd: int, data: "bytes | memoryview", offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` may write less than asked)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def resize(fd: int, size: int, data_bytes: Optional[int] = None) -> None:
    """Make an open file exactly ``size`` bytes long.

    Growth beyond the free space is refused up front (also where the file
    system cannot reserve space, and so that a bogus size cannot make a huge
    sparse file), then reserved with :func:`reserve`: a full disk fails now,
    with nothing written, instead of half-way through.

    :param data_bytes: The file grows by a hole: its source has holes, and only this much
                       data will be written. The growth is not reserved, and only as
                       much of it as this is checked against the free space.
    :raises OSError: ENOSPC when the growth does not fit, and other failures.
    """
    current = descriptor_size(fd)
    if size > current and data_bytes is not None:
        needed = min(size - current, data_bytes)
        if needed > free_space(fd):
            raise OSError(errno.ENOSPC, f"No space left on device ({needed} more bytes of data needed)")
    elif size > current:
        if size - current > free_space(fd):
            raise OSError(errno.ENOSPC, f"No space left on device ({size - current} more bytes needed)")
        reserve(fd, current, size - current)
    if descriptor_size(fd) != size:
        os.ftruncate(fd, size)


def copy_range(source_fd: int, target_fd: int, offset: int, length: int) -> None:
    """Copy bytes between the same offsets of two files, inside the kernel where it can.

    ``copy_file_range`` moves the data without passing it through user space
    (and lets file systems share blocks); a read/write loop takes over where
    the kernel refuses.

    :raises OSError: When copying fails.
    :raises EOFError: When the source is shorter than the range.
    """
    copied = copy_available(source_fd, target_fd, offset, length)
    if copied < length:
        raise EOFError(f"file ended at {offset + copied} bytes, before {offset + length}")


#: errno values after which ``copy_file_range`` gives way to reading and
#: writing: :data:`REFUSALS`, and what it refuses that ``pwrite`` may not
#: (EPERM, EBADF: an immutable or append-only file; ETXTBSY: a swap file),
#: so that the plain write says what is really wrong, if anything.
KERNEL_COPY_REFUSALS = REFUSALS | {errno.EPERM, errno.EBADF, errno.ETXTBSY}


def copy_available(source_fd: int, target_fd: int, offset: int, length: int,
                   probe_last_byte: bool = False, target_offset: Optional[int] = None) -> int:
    """Copy up to ``length`` bytes between the same offsets of two files; the one copy loop.

    ``copy_file_range`` first (unless :func:`fast_paths_enabled` says no),
    then a read/write loop where the kernel refuses or copies nothing.

    :param probe_last_byte: The last byte asked is only there to tell a file
                            that grew: a copy ending one byte short is the
                            end, with no ``fstat`` to check (a tree's small files).
    :param target_offset: Where the bytes go in the target (default: ``offset``, the same place).
    :returns: How many bytes the source had there (less than ``length`` at its end).
    :raises OSError: When copying fails.
    """
    end = offset + length
    position = offset
    shift = (offset if target_offset is None else target_offset) - offset
    kernel = fast_paths_enabled() and hasattr(os, "copy_file_range")
    while position < end:
        if kernel:
            try:
                copied = os.copy_file_range(source_fd, target_fd, end - position, position, position + shift)
            except OSError as error:
                if error.errno not in KERNEL_COPY_REFUSALS:
                    raise
                kernel = False
                continue
            if copied == 0:
                if position == offset:  # some file systems copy nothing: read and write
                    kernel = False
                    continue
                break
            if copied < end - position:  # short: the end of the file (small files: one call)
                position += copied
                if (probe_last_byte and position >= end - 1) or descriptor_size(source_fd) <= position:
                    break
                continue
        else:
            data = os.pread(source_fd, min(TRANSFER_CHUNK_SIZE, end - position), position)
            if not data:
                break
            write_all(target_fd, data, position + shift)
            copied = len(data)
        position += copied
    return position - offset


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a just-written range to disk, without waiting for it.

    A sync that fsyncs at the end then finds little left to write: the disk
    works while the transfer goes on instead of after it. Advisory: a file
    system that refuses it (or a system without sync_file_range) is simply
    left to write back later.
    """
    function = libc.sync_file_range()
    if function is not None and length > 0 and fast_paths_enabled():
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
    function = libc.fallocate()
    try:
        if function is not None:
            libc.call(function, fd, 0, offset, length)
        elif hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, offset, length)
    except OSError as error:
        if error.errno not in REFUSALS:
            raise


#: fallocate(2) modes (linux/falloc.h): free a range's blocks, keeping the file's size.
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def data_extents(fd: int, offset: int, length: int, limit: Optional[int] = None) -> "list[ByteRange]":
    """The extents of ``[offset, offset + length)`` of an open file that hold data (SEEK_DATA/SEEK_HOLE).

    Holes are never read to find them: one pair of seeks per extent. Where the file system
    (or the kernel) cannot tell, or with the fast paths off, everything is data.

    :param limit: Stop after this many extents (a server's answer is bounded).
    """
    end = min(offset + length, descriptor_size(fd))
    if end <= offset:
        return []
    if not (fast_paths_enabled() and hasattr(os, "SEEK_DATA")):
        return [(offset, end - offset)]
    extents = []
    position = offset
    while position < end:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:
                break  # no data after position: the rest is a hole
            if error.errno in REFUSALS:
                return [(offset, end - offset)]
            raise
        if start >= end:
            break
        stop = min(os.lseek(fd, start, os.SEEK_HOLE), end)
        extents.append((start, stop - start))
        position = stop
        if limit is not None and len(extents) >= limit:
            break
    return extents


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free the blocks of a range of an open file (it then reads as zeros); keep its size.

    :returns: False where the file system cannot punch (the caller writes zeros instead).
    :raises OSError: For other failures.
    """
    if length <= 0:
        return True
    function = libc.fallocate()
    if function is None or not fast_paths_enabled():
        return False
    try:
        libc.call(function, fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
    except OSError as error:
        if error.errno in REFUSALS:
            return False
        raise
    return True


def write_zeros(fd: int, offset: int, length: int) -> None:
    """Write ``length`` zero bytes at ``offset`` (where a hole cannot be punched)."""
    zeros = bytes(min(length, TRANSFER_CHUNK_SIZE))
    end = offset + length
    while offset < end:
        count = min(len(zeros), end - offset)
        write_all(fd, memoryview(zeros)[:count], offset)
        offset += count


#: The devices this process already warned about for holes written as zeros: one warning each.
_ZEROS_WARNED: set = set()


def punch_ranges(fd: int, ranges: Iterable[ByteRange], where: str, zeros: bool = True) -> bool:
    """Punch holes into ``ranges`` of an open file, or write zeros where its file system cannot.

    The first file system that cannot punch gets one warning per process.

    :param zeros: False: the ranges hold zeros already; where the file system cannot punch,
                  stop there (no zeros written, no warning).
    :returns: Whether every range became a hole (False: zeros were written somewhere, or,
              without ``zeros``, a range was left as it was).
    :raises OSError: When punching or writing fails otherwise.
    """
    punched = True
    for offset, length in ranges:
        if not punch_hole(fd, offset, length):
            if not zeros:
                return False
            write_zeros(fd, offset, length)
            punched = False
    if not punched:
        device = os.fstat(fd).st_dev
        if device not in _ZEROS_WARNED:
            _ZEROS_WARNED.add(device)
            logger.warning("The file system of %s cannot punch holes; the source's holes are written "
                           "there as zeros", where)
    return punched


def write_around_zeros(fd: int, data: "bytes | memoryview", offset: int, unit: int) -> Tuple[List[ByteRange], int]:
    """Write ``data`` at ``offset`` but its runs of whole ``unit``-aligned zero units (left as they
    are: holes in a new file); return those runs and the bytes written."""
    view = memoryview(data).cast("B")
    runs = zero_runs(view, offset, unit)
    position, written = offset, 0
    for start, length in runs + [(offset + len(view), 0)]:
        if start > position:
            write_all(fd, view[position - offset : start - offset], position)
            written += start - position
        position = start + length
    return runs, written


def write_sparse(fd: int, data: "bytes | memoryview", offset: int, unit: int, where: str) -> None:
    """Write ``data`` at ``offset``, but punch its runs of whole ``unit``-aligned zero units (``--sparse``)."""
    runs, _ = write_around_zeros(fd, data, offset, unit)
    punch_ranges(fd, runs, where)


#: Open descriptors a client run may use: tree walks hold one per directory
#: level (a path of 4,096 bytes can name 2,048 levels) beside connections and
#: files. The usual soft limit of 1,024 exists for select(2), which nothing here uses.
OPEN_FILES_WANTED = 65536


def raise_open_file_limit(wanted: int = OPEN_FILES_WANTED) -> None:
    """Raise the soft limit of open descriptors towards ``wanted``, within the hard limit.

    Advisory: where the limit cannot be read or raised, it stays, and a walk
    too deep for it fails per entry ("Too many open files").
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, OSError, ValueError):
        pass


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: The process umask, read once, at import: reading it means setting it, and
#: a thread creating a file meanwhile would get the wrong mode, so never per file.
_umask = _read_umask()


def process_umask() -> int:
    """The umask new files get (read at import; :func:`clear_umask` changes it)."""
    return _umask


def clear_umask() -> None:
    """Create files with exactly the permissions asked for (in forked tree workers)."""
    global _umask
    os.umask(0)
    _umask = 0


def fsync_directory(path: str, dir_fd: Optional[int] = None) -> None:
    """Flush a directory's entries (after a create or rename) to disk.

    :param dir_fd: A descriptor (``O_PATH`` will do) that ``path`` is relative to.
    """
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(source: str, target: str, source_dir: Optional[int] = None,
                       target_dir: Optional[int] = None, flush: bool = True) -> None:
    """Rename ``source`` over ``target`` in one step; the one atomic replace of every writer.

    Readers see the old file or the new one, never a mix. With descriptors
    the names are last components in those directories, so that no symlink
    on the way is followed; without, they are paths.

    :param flush: Flush the target's directory afterwards, so that the new
                  name survives a crash (a tree flushes its directories once
                  per batch instead).
    :raises OSError: When the rename or the flush fails.
    """
    os.replace(source, target, src_dir_fd=source_dir, dst_dir_fd=target_dir)
    if flush:
        if target_dir is None:
            fsync_directory(os.path.dirname(target))
        else:
            fsync_directory(".", dir_fd=target_dir)


#: Files from this size on are closed by :func:`close_soon` when replaced; smaller ones free in
#: microseconds, less than handing their descriptor over costs.
CLOSE_SOON_BYTES = 16 * 1024 * 1024

_closing: "Optional[queue.SimpleQueue[int]]" = None
_closing_lock = threading.Lock()


def _forget_closer() -> None:
    """In a forked child: the parent's closer thread is not there (the child starts its own)."""
    global _closing, _closing_lock
    _closing, _closing_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_closer)


def close_soon(fd: int) -> None:
    """Close ``fd`` on a background thread, the caller's to forget at once.

    For the last descriptor of a file just replaced: that close frees the old version's
    blocks, which on some file systems waits on the device (ext4 mounted with ``discard``
    here: 75 ms for 256 MiB), and the rename is done and durable without it. A server
    answers at once; the freeing goes on beside its next requests.
    """
    global _closing
    with _closing_lock:
        if _closing is None:
            _closing = queue.SimpleQueue()
            threading.Thread(target=_close_queued, args=(_closing,), name="closer", daemon=True).start()
    _closing.put(fd)


def _close_queued(fds: "queue.SimpleQueue[int]") -> None:
    while True:
        try:
            os.close(fds.get())
        except OSError:
            pass


def free_space(fd: int) -> int:
    """Bytes available to unprivileged users on the file system of ``fd``."""
    stats = os.fstatvfs(fd)
    return stats.f_bavail * stats.f_frsize


def etag(stat: os.stat_result) -> str:
    """An entity tag that changes whenever the file's identity, size or mtime does."""
    return f'"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}"'


__all__ = [
    "TRANSFER_CHUNK_SIZE", "NO_FASTPATH_VARIABLE", "fast_paths_enabled", "temporary_name", "is_temporary_name",
    "partial_name", "is_partial_name", "raise_open_file_limit", "read_chunks", "write_all",
    "resize", "reserve", "start_writeback", "copy_range", "copy_available", "process_umask", "clear_umask",
    "fsync_directory", "replace_atomically", "free_space", "etag",
]

"""Whole-file local copies: the fastest way the kernel offers, cache-friendly and atomic.

:func:`copy_file` copies one file to another path on this machine. It writes a
hidden temporary sibling of the target and renames it over the target only
after every byte is in place and flushed, so an interrupted copy never leaves a
truncated or mixed file under the target's name. :func:`copy_into` is the
engine underneath, for callers that open and name their files themselves (the
delta sync's ``--atomic`` mode starts its temporary file with it, as a clone
where the file system can).

The engine tries four methods, cheapest first, and falls through when the
kernel refuses one:

1. ``reflink``: the FICLONE ioctl makes the target share the source's extents
   (btrfs, XFS, bcachefs, ...): no data moves, milliseconds for any size.
2. ``copy_file_range``: the kernel copies without the data passing through
   user space; NFS 4.2 and CIFS turn it into a server-side copy, XFS and btrfs
   into a clone.
3. ``sendfile``: an in-kernel copy that also works between file systems, where
   ``copy_file_range`` answers EXDEV.
4. ``readwrite``: a reader thread fills a few buffers from a bounded pool and
   the calling thread writes them, so reading and writing overlap instead of
   taking turns. It works on anything that can be read and written.

A refusal (EXDEV, EOPNOTSUPP, EINVAL, ENOSYS, ENOTTY, or a first call that
copies nothing) is remembered per pair of devices for the life of the process,
so each pair pays for a refused method once. The environment variable
:data:`METHOD_VARIABLE` skips methods (``PDIFFCOPY_COPY_METHOD=readwrite`` is
the plain path), and :data:`NO_FASTPATH_VARIABLE` is a shorthand for that.

Page cache management (``cache="drop"``) follows fastsync's recipe, measured
in ``benchmarks/copy_bench.py``: ``posix_fadvise(SEQUENTIAL)`` on the source,
the target's space reserved with ``fallocate`` before the first write, and a
rolling window: when a window of the target is written its writeback starts
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``), the previous window's writeback
is waited for, and both files' pages behind the heads are dropped
(``POSIX_FADV_DONTNEED``). The kernel then never gathers gigabytes of dirty
pages, and a big copy leaves the page cache as it found it. ``cache="keep"``
leaves the page cache alone, as ``cp`` does, which is faster for files that
are read again soon.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import stat as stat_module
import threading
import time
from pdiffcopy.core.records import dataclass
from typing import Callable

from pdiffcopy.errors import (
    Conflict,
    NotAFile,
    UsageError,
    storage_error,
)
from pdiffcopy.local import libc
from pdiffcopy.local.writerlocks import create_held
from pdiffcopy.local.descriptors import (
    FICLONE,
    NO_FASTPATH_VARIABLE,
    REFUSALS,
    SYNC_FILE_RANGE_WAIT_AFTER,
    SYNC_FILE_RANGE_WAIT_BEFORE,
    SYNC_FILE_RANGE_WRITE,
    TRANSFER_CHUNK_SIZE,
    fast_paths_enabled,
    replace_atomically,
    reserve,
    temporary_name,
)

#: The copy methods, in the order they are tried (cheapest first).
METHODS: tuple[str, ...] = ("reflink", "copy_file_range", "sendfile", "readwrite")

#: Environment variable naming the first method to try; the ones before it are
#: skipped. For tests, and for users who hit a kernel or file system bug in a
#: fast path (``readwrite`` is the plain path).
METHOD_VARIABLE = "PDIFFCOPY_COPY_METHOD"

#: The page cache policies :func:`copy_file` and :func:`copy_into` accept:
#: ``drop`` and ``keep`` (see the module's docstring), and ``auto``, which
#: picks one by the file's size (see :func:`resolve_cache`).
CACHE_MODES: tuple[str, ...] = ("auto", "drop", "keep", "direct")

#: Default page cache policy: dropping pays for big cold copies and costs warm
#: small ones, so the size decides (figures: docs/benchmarks.rst, "Local copies").
DEFAULT_CACHE = "auto"

#: The threshold's fallback when /proc/sys/vm cannot be read: the kernel's
#: default dirty_background_ratio (10 %) of a 16 GiB machine.
FALLBACK_DROP_THRESHOLD = 1600 * 1024 * 1024

#: Files from this size on get their space reserved (``fallocate``) before the
#: copy (and a full disk fails before anything is written): ext4 then allocates
#: the extent once instead of block by block, which pays from about this size
#: on (figures: docs/benchmarks.rst, "Local copies").
RESERVE_MIN_SIZE = 512 * 1024

#: Bytes per ``copy_file_range`` or ``sendfile`` call. The kernel copies as fast
#: in 8 MiB steps as in one call for the whole file, and the steps are where
#: progress is reported, the cache window moves and Ctrl-C gets through.
KERNEL_COPY_STEP = 8 * 1024 * 1024

#: Bytes per buffer of the read/write pipeline: writes into new files are
#: several times faster in calls of 128 KiB to 1 MiB than in 4 MiB ones
#: (docs/benchmarks.rst, "Local copies").
PIPELINE_BLOCK_SIZE = TRANSFER_CHUNK_SIZE

#: Buffers in flight between the reader thread and the writer. fastsync found
#: that four 1 MiB blocks keep both disks busy once the page cache is managed;
#: more only costs memory.
PIPELINE_DEPTH = 4

#: Bytes per step of the rolling cache window. At most two windows of the target
#: are dirty or under writeback at any time, so this bounds the dirty pages a
#: copy makes (64 MiB, the dirty peak of the issue's reference pipeline) while
#: giving the disk large sequential writes.
CACHE_WINDOW = 32 * 1024 * 1024

#: A progress callback: called with the number of bytes just copied.
ProgressCallback = Callable[[int], None]

#: A step callback: called after each step of a copy with the offset up to which
#: the target now holds the source's bytes, and the method that copied them.
StepCallback = Callable[[int, str], None]


@dataclass
class CopyReport:
    """What :func:`copy_file` did."""

    #: The source path.
    source: str
    #: The target path.
    target: str
    #: Bytes copied (the source's size).
    size: int
    #: The method that copied the data, one of :data:`METHODS`.
    method: str
    #: The page cache policy used: ``"drop"`` or ``"keep"``.
    cache: str
    #: Wall-clock seconds, including the final flush and rename.
    seconds: float

    @property
    def cloned(self) -> bool:
        """Whether the target shares the source's extents (no data was copied)."""
        return self.method == "reflink"


class _Refused(Exception):
    """A copy method was refused by the kernel; the next one continues at ``position``."""

    def __init__(self, method: str, position: int, reason: str, remember: bool) -> None:
        super().__init__(f"{method} refused at {position}: {reason}")
        self.method = method
        self.position = position
        self.reason = reason
        # Only a refusal on the first call says something about the file systems;
        # one half-way through is about that moment and is not remembered.
        self.remember = remember


# --------------------------------------------------------------------------- detection

# Methods the kernel refused, per (source device, target device), for the life of
# the process: each pair of file systems pays for a refused method once.
_refusals: dict[tuple[int, int], set[str]] = {}
_refusals_lock = threading.Lock()


def refused_methods(source_device: int, target_device: int) -> set[str]:
    """The methods refused so far between two devices (``st_dev`` values).

    :param source_device: ``st_dev`` of the source file.
    :param target_device: ``st_dev`` of the target file.
    :returns: A copy of the set of refused method names.
    """
    with _refusals_lock:
        return set(_refusals.get((source_device, target_device), ()))


def forget_refusals() -> None:
    """Forget every refusal remembered so far (for tests, or after a remount)."""
    with _refusals_lock:
        _refusals.clear()


def _remember_refusal(devices: tuple[int, int], method: str) -> None:
    with _refusals_lock:
        _refusals.setdefault(devices, set()).add(method)


def drop_threshold() -> int:
    """The size from which ``cache="auto"`` drops the page cache.

    It is the kernel's background writeback threshold. A smaller copy stays
    in memory without the kernel even starting writeback, so keeping the cache
    is cheap; a bigger one runs into the kernel's dirty page throttling and
    evicts other programs' cache, which is where dropping pays.

    :returns: Bytes: ``vm.dirty_background_bytes``, or ``vm.dirty_background_ratio``
              percent of the machine's memory.
    """
    global _drop_threshold
    if _drop_threshold is None:
        try:
            with open("/proc/sys/vm/dirty_background_bytes") as handle:
                threshold = int(handle.read())
            if threshold == 0:
                with open("/proc/sys/vm/dirty_background_ratio") as handle:
                    ratio = int(handle.read())
                memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                threshold = memory * ratio // 100
        except (OSError, ValueError):
            threshold = FALLBACK_DROP_THRESHOLD
        _drop_threshold = threshold
    return _drop_threshold


_drop_threshold: int | None = None


def resolve_cache(cache: str, size: int) -> str:
    """Turn a page cache policy into ``"drop"`` or ``"keep"`` for a file of ``size`` bytes.

    :param cache: One of :data:`CACHE_MODES`.
    :param size: The file's size in bytes.
    :returns: ``"drop"`` or ``"keep"``; ``"auto"`` drops from :func:`drop_threshold` on.
    :raises UsageError: For an unknown policy.
    """
    if cache not in CACHE_MODES:
        raise UsageError(f"Unknown cache mode {cache!r}: choose one of {', '.join(CACHE_MODES)}")
    if cache == "auto":
        return "drop" if size >= drop_threshold() else "keep"
    return "drop" if cache == "direct" else cache  # (direct I/O is for block devices)


def first_method(method: str | None = None) -> str:
    """The first copy method to try: an explicit choice, the environment's, or reflink.

    :param method: One of :data:`METHODS`, or ``None`` for the environment's choice.
    :returns: One of :data:`METHODS`.
    :raises UsageError: When the method or the environment variable names no method.
    """
    if method is None:
        if not fast_paths_enabled():
            return "readwrite"
        method = os.environ.get(METHOD_VARIABLE) or METHODS[0]
        where = f"{METHOD_VARIABLE}={method}"
    else:
        where = f"method={method!r}"
    if method not in METHODS:
        raise UsageError(f"Unknown copy method {where}: choose one of {', '.join(METHODS)}")
    return method


# --------------------------------------------------------------------------- system calls

def _advise(fd: int, offset: int, length: int, advice: int) -> None:
    # Advice is only a hint: a file system that ignores or rejects it copies
    # correctly anyway, so failures are deliberately ignored.
    if not fast_paths_enabled():
        return
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except (OSError, AttributeError):
        pass


class _CacheWindow:
    """Rolling page cache management for one copy (see the module's docstring).

    The copy reports how far it has read and written; this class starts
    writeback of each finished window of the target, waits for the window
    before it, and drops both files' pages behind the heads.
    """

    def __init__(self, source_fd: int, target_fd: int, drop: bool, writeback: bool = False) -> None:
        self.source_fd = source_fd
        self.target_fd = target_fd
        self.drop = drop
        self.writeback = writeback or drop
        self.read_dropped = 0  # source pages below this offset were dropped
        self.write_started = 0  # target writeback was started below this offset
        self.write_dropped = 0  # target pages below this offset were written and dropped
        self._sync_file_range = libc.sync_file_range() \
            if self.writeback and fast_paths_enabled() else None

    def begin(self, position: int, size: int) -> None:
        """Advise the kernel before the copy: a sequential read of the source."""
        self.read_dropped = self.write_started = self.write_dropped = position
        _advise(self.source_fd, position, size - position, os.POSIX_FADV_SEQUENTIAL)

    def read(self, position: int) -> None:
        """Everything of the source below ``position`` has been read."""
        if self.drop and position - self.read_dropped >= CACHE_WINDOW:
            _advise(self.source_fd, self.read_dropped, position - self.read_dropped,
                    os.POSIX_FADV_DONTNEED)
            self.read_dropped = position

    def written(self, position: int) -> None:
        """Everything of the target below ``position`` has been written."""
        if not self.writeback or position - self.write_started < CACHE_WINDOW:
            return
        # Start writeback of the window just written, without waiting for it...
        self._sync(self.write_started, position - self.write_started, SYNC_FILE_RANGE_WRITE)
        if not self.drop:
            self.write_started = position
            return
        # ...then wait for the previous one, which has been on its way to the
        # disk while this window was copied, and drop its now clean pages.
        if self.write_started > self.write_dropped:
            self._settle(self.write_dropped, self.write_started)
        self.write_started = position

    def finish(self, position: int) -> None:
        """The copy is complete up to ``position``: write back and drop what is left."""
        if not self.drop:
            if self.writeback and position > self.write_started:
                # The last, partial window: the caller's fsync then only waits.
                self._sync(self.write_started, position - self.write_started, SYNC_FILE_RANGE_WRITE)
                self.write_started = position
            return
        self._settle(self.write_dropped, position)
        _advise(self.source_fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _settle(self, start: int, end: int) -> None:
        # Wait until [start, end) is on disk, then drop its pages (DONTNEED
        # skips dirty pages, so the wait comes first).
        if end > start:
            self._sync(start, end - start, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE
                       | SYNC_FILE_RANGE_WAIT_AFTER)
            _advise(self.target_fd, start, end - start, os.POSIX_FADV_DONTNEED)
            self.write_dropped = end

    def _sync(self, offset: int, length: int, flags: int) -> None:
        if self._sync_file_range is not None:
            try:
                libc.call(self._sync_file_range, self.target_fd, offset, length, flags)
                return
            except OSError as error:
                if error.errno not in REFUSALS and error.errno != errno.ESPIPE:
                    raise  # EIO, ENOSPC: the data did not reach the disk
                self._sync_file_range = None  # e.g. not supported here: use fdatasync
        if flags & SYNC_FILE_RANGE_WAIT_AFTER:
            # Without sync_file_range the nearest equivalent is flushing the whole
            # file; only the last two windows are dirty, so it costs the same.
            os.fdatasync(self.target_fd)


# --------------------------------------------------------------------------- the methods

def _copy_reflink(source_fd: int, target_fd: int, position: int, size: int,
                  window: _CacheWindow, progress: ProgressCallback | None) -> int:
    if position != 0 or os.fstat(source_fd).st_size != size:
        # FICLONE clones the whole file; a partial copy is for the other methods.
        raise _Refused("reflink", position, "not a whole-file copy", remember=False)
    try:
        fcntl.ioctl(target_fd, FICLONE, source_fd)
    except OSError as error:
        if error.errno in REFUSALS:
            raise _Refused("reflink", position, error.strerror or str(error), True) from None
        raise
    if progress is not None:
        progress(size)
    return size


def _copy_in_kernel(method: str, source_fd: int, target_fd: int, position: int, size: int,
                    window: _CacheWindow, progress: ProgressCallback | None) -> int:
    """``copy_file_range`` or ``sendfile`` from ``position`` up to ``size`` in steps."""
    started = position
    if method == "sendfile":
        os.lseek(target_fd, position, os.SEEK_SET)  # sendfile writes at the file position
    while position < size:
        count = min(KERNEL_COPY_STEP, size - position)
        try:
            if method == "copy_file_range":
                copied = os.copy_file_range(source_fd, target_fd, count, position, position)
            else:
                copied = os.sendfile(target_fd, source_fd, position, count)
        except OSError as error:
            if error.errno in REFUSALS:
                raise _Refused(method, position, error.strerror or str(error),
                               remember=position == started) from None
            raise
        if copied == 0:
            if position == started and os.fstat(source_fd).st_size > position:
                # Some file systems answer a copy they cannot do with 0 bytes.
                raise _Refused(method, position, "copied nothing", remember=True)
            return position  # end of file: the source shrank
        position += copied
        window.read(position)
        window.written(position)
        if progress is not None:
            progress(copied)
    return position


def _copy_pipelined(source_fd: int, target_fd: int, position: int, size: int,
                    window: _CacheWindow, progress: ProgressCallback | None) -> int:
    """Read in a thread, write in this one, through :data:`PIPELINE_DEPTH` buffers."""
    free: queue.Queue[bytearray | None] = queue.Queue()
    for _ in range(PIPELINE_DEPTH):
        free.put(bytearray(PIPELINE_BLOCK_SIZE))
    # Filled buffers as (offset, buffer, length); None at the end, or the reader's exception.
    filled: queue.Queue[tuple[int, bytearray, int] | BaseException | None] = queue.Queue()
    stop = threading.Event()
    start = position

    def read() -> None:
        offset = start
        try:
            while offset < size and not stop.is_set():
                buffer = free.get()
                if buffer is None:
                    break  # the writer gave up
                view = memoryview(buffer)[: min(PIPELINE_BLOCK_SIZE, size - offset)]
                count = os.preadv(source_fd, [view], offset)
                if count == 0:
                    break  # end of file: the source shrank
                filled.put((offset, buffer, count))
                offset += count
                window.read(offset)
            filled.put(None)
        except BaseException as error:  # noqa: BLE001 (handed to the writer, which raises it)
            filled.put(error)

    reader = threading.Thread(target=read, name="pdiffcopy-reader", daemon=True)
    reader.start()
    try:
        while True:
            item = filled.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            offset, buffer, count = item
            view = memoryview(buffer)[:count]
            while view:
                written = os.pwrite(target_fd, view, offset)
                view = view[written:]
                offset += written
            free.put(buffer)
            position = offset
            window.written(position)
            if progress is not None:
                progress(count)
    finally:
        stop.set()
        free.put(None)  # wakes a reader waiting for a buffer
        reader.join()
    return position


_COPIERS = {
    "reflink": _copy_reflink,
    "copy_file_range": lambda *args: _copy_in_kernel("copy_file_range", *args),
    "sendfile": lambda *args: _copy_in_kernel("sendfile", *args),
    "readwrite": _copy_pipelined,
}


# --------------------------------------------------------------------------- public API

def copy_into(source_fd: int, target_fd: int, size: int, *, cache: str = DEFAULT_CACHE,
              durable: bool = False, progress: ProgressCallback | None = None,
              method: str | None = None, detect_changes: bool = True,
              on_step: StepCallback | None = None, source_stat: os.stat_result | None = None,
              target_device: int | None = None) -> str:
    """Copy the first ``size`` bytes of one open file to the same offsets of another.

    Methods are tried in the order of :data:`METHODS`, starting at ``method``
    (or what the environment asks for, see :func:`first_method`), each taking
    over where the one before it was refused. The target should be empty (a
    new or truncated file): a reflink replaces its contents, the other methods
    write over ``[0, size)`` and leave anything beyond. Nothing is flushed:
    the caller fsyncs if it wants durability (with ``cache="drop"`` the data
    has already been written back, so that fsync is quick).

    :param source_fd: The source, open for reading.
    :param target_fd: The target, open for writing (not in append mode).
    :param size: Bytes to copy: the source's size, as the caller saw it.
    :param cache: ``"drop"`` to write back as it goes and leave neither file in
                  the page cache, ``"keep"`` to leave the page cache alone,
                  ``"auto"`` to choose by size (see :func:`resolve_cache`).
    :param durable: Whether the caller will fsync the target afterwards. If so,
                    writeback of each window starts early even when the cache
                    is kept, so that the fsync finds little left to write.
    :param progress: Called with the number of bytes copied at each step.
    :param method: The first method to try (default: from the environment, or reflink).
    :param detect_changes: Raise :class:`~pdiffcopy.errors.Conflict` when the
                           source changes size or modification time during the
                           copy. When false, a source that shrank ends the copy
                           early and the target is cut to what was copied.
    :param on_step: Called after each step with the offset up to which the
                    target holds the source's bytes and the method that copied
                    them (the sync hashes each finished segment of the target
                    while the next one is copied; a ``"reflink"`` step is the
                    whole file, sharing the source's extents).
    :param source_stat: ``os.fstat(source_fd)``, and
    :param target_device: ``os.fstat(target_fd).st_dev``, for callers that asked
                          already (each saves a system call, which shows on
                          small files); looked up when not given.
    :returns: The name of the method that copied the data (the last one tried).
    :raises Conflict: When the source changed during the copy (see ``detect_changes``).
    :raises UsageError: For an unknown ``cache`` or ``method``.
    :raises OSError: When reading or writing fails (ENOSPC, EIO, ...).
    """
    start = first_method(method)
    before = os.fstat(source_fd) if source_stat is None else source_stat
    devices = (before.st_dev, os.fstat(target_fd).st_dev if target_device is None else target_device)
    # Read without the lock (and without refused_methods' copy): a refusal
    # remembered by another thread meanwhile only costs that thread's retry.
    refused = _refusals.get(devices, ())
    drop = resolve_cache(cache, size) == "drop"
    # Starting writeback early pays only when the caller flushes at the end
    # anyway (docs/benchmarks.rst, "Local copies").
    window = _CacheWindow(source_fd, target_fd, drop=drop, writeback=durable)
    position = 0
    reserved = False
    used = start
    for used in METHODS[METHODS.index(start):]:
        if used in refused and used != "readwrite":
            continue
        if used != "reflink" and not reserved:
            if size >= RESERVE_MIN_SIZE:
                # Reserve the space before the first byte: a full disk fails
                # here, with nothing written, instead of half-way through.
                reserve(target_fd, position, size - position)
            window.begin(position, size)
            reserved = True
        report = progress if on_step is None else _stepper(progress, on_step, used, position)
        try:
            position = _COPIERS[used](source_fd, target_fd, position, size, window, report)
            break
        except _Refused as refusal:
            position = refusal.position
            if refusal.remember:
                _remember_refusal(devices, used)
    if used != "reflink":
        window.finish(position)
    if detect_changes:
        after = os.fstat(source_fd)
        if position < size or after.st_size != size:
            raise Conflict(f"The source changed size during the copy: "
                           f"{size} bytes at the start, {after.st_size} at the end")
        if after.st_mtime_ns != before.st_mtime_ns:
            raise Conflict("The source was modified during the copy")
    elif position < size:
        os.ftruncate(target_fd, position)
    return used


def _stepper(progress: ProgressCallback | None, on_step: StepCallback, method: str,
             position: int) -> ProgressCallback:
    """A progress callback for one method that also reports how far the copy has come."""
    reached = position

    def report(count: int) -> None:
        nonlocal reached
        reached += count
        if progress is not None:
            progress(count)
        on_step(reached, method)

    return report


def copy_file(source_path: str, target_path: str, *, cache: str = DEFAULT_CACHE,
              progress: ProgressCallback | None = None, method: str | None = None,
              fsync: bool = True) -> CopyReport:
    """Copy a file to a new or existing path, atomically.

    The data goes to a hidden temporary file next to the target (see
    :func:`~pdiffcopy.core.protocol.temporary_name`), which is flushed and then
    renamed over the target. Until that rename the target is untouched; on
    any failure, Ctrl-C included, the temporary file is removed. (Only a
    process killed outright, with SIGKILL or a power cut, leaves it behind.)

    A new target gets the source's permission bits less the umask, as with
    ``cp``; an existing target keeps its own. A symbolic link as target is
    replaced by the file, as rsync does, rather than written through.

    :param source_path: The file to copy.
    :param target_path: Where the copy goes (a file path, not a directory).
    :param cache: The page cache policy, see :func:`copy_into`.
    :param progress: Called with the number of bytes copied at each step.
    :param method: The first copy method to try, see :func:`first_method`.
    :param fsync: Flush the data and the directory before returning (the
                  default). Without it the copy is still atomic for other
                  processes but not across a crash.
    :returns: A :class:`CopyReport`.
    :raises UsageError: When source and target are the same file, or for a bad option.
    :raises NotAFile: When the source is not a regular file or the target is a directory.
    :raises FileMissing: When the source or the target's directory does not exist.
    :raises Conflict: When the source changes during the copy.
    :raises StorageError: When reading or writing fails, e.g. no space left.
    :raises AccessDenied: When permissions forbid it.
    """
    started = time.monotonic()
    source_fd = _open_source(source_path)
    try:
        return _copy_to_temporary(source_fd, source_path, target_path, cache, progress,
                                  method, fsync, started)
    finally:
        os.close(source_fd)


def _open_source(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise storage_error(error, f"open {path}") from None
    if not stat_module.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotAFile(f"Not a regular file: {path}")
    return fd


def _copy_to_temporary(source_fd: int, source_path: str, target_path: str, cache: str,
                       progress: ProgressCallback | None, method: str | None,
                       fsync: bool, started: float) -> CopyReport:
    source = os.fstat(source_fd)
    try:
        target: os.stat_result | None = os.stat(target_path)
    except FileNotFoundError:
        target = None
    except OSError as error:
        raise storage_error(error, f"access {target_path}") from None
    if target is not None:
        if stat_module.S_ISDIR(target.st_mode):
            raise NotAFile(f"The target is a directory: {target_path}")
        if os.path.samestat(source, target):
            raise UsageError(f"Source and target are the same file: {source_path}")
    directory, name = os.path.split(target_path)
    temporary = os.path.join(directory, temporary_name(name))
    # A new target gets the source's permissions less the umask (the kernel
    # applies it at creation); an existing one keeps its own, set at the end.
    create_mode = stat_module.S_IMODE(source.st_mode) & 0o777 if target is None else 0o600
    try:
        target_fd = create_held(temporary, create_mode)
    except OSError as error:
        raise storage_error(error, f"create a temporary file in {directory or '.'}") from None
    try:
        used = copy_into(source_fd, target_fd, source.st_size, cache=cache, durable=fsync,
                         progress=progress, method=method)
        if target is not None and stat_module.S_ISREG(target.st_mode):
            os.fchmod(target_fd, stat_module.S_IMODE(target.st_mode))
        if fsync:
            os.fsync(target_fd)
        os.close(target_fd)
        target_fd = -1
        replace_atomically(temporary, target_path, flush=fsync)
    except BaseException as error:
        # Anything, Ctrl-C included, leaves the target as it was and no temporary file.
        if target_fd >= 0:
            os.close(target_fd)
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass  # already renamed over the target: the copy is complete
        if isinstance(error, OSError):
            raise storage_error(error, f"copy {source_path} to {target_path}") from None
        if isinstance(error, Conflict):
            raise Conflict(f"Cannot copy {source_path}: {error}") from None
        raise
    return CopyReport(source=source_path, target=target_path, size=source.st_size, method=used,
                      cache=resolve_cache(cache, source.st_size),
                      seconds=time.monotonic() - started)


__all__ = [
    "CACHE_MODES",
    "DEFAULT_CACHE",
    "METHODS",
    "METHOD_VARIABLE",
    "NO_FASTPATH_VARIABLE",
    "CopyReport",
    "copy_file",
    "copy_into",
    "drop_threshold",
    "first_method",
    "forget_refusals",
    "refused_methods",
    "reserve",
    "resolve_cache",
]

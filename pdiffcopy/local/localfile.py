"""A file on this machine, as a :class:`~pdiffcopy.engine.endpoints.FileEndpoint`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import stat as stat_module
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, List, Optional, Sequence

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.datamap import MAX_DATA_MAP_EXTENTS
from pdiffcopy.engine.endpoints import (
    Chunk,
    ContentChunks,
    FileEndpoint,
    FileInfo,
    HashingHere,
    Holes,
    KernelCopies,
    Leases,
    PartialFiles,
)
from pdiffcopy.errors import (
    Conflict,
    FileMissing,
    NotAFile,
    Locked,
    PdiffcopyError,
    StorageError,
    storage_error,
)
from pdiffcopy.local.descriptors import (
    CLOSE_SOON_BYTES,
    TRANSFER_CHUNK_SIZE,
    close_soon,
    copy_available,
    copy_range,
    data_extents,
    etag,
    free_space,
    fsync_directory,
    partial_name,
    process_umask,
    punch_ranges,
    read_chunks,
    replace_atomically,
    resize,
    start_writeback,
    temporary_name,
    write_all,
    write_sparse,
)
from pdiffcopy.local.filehash import cut_open, cut_path, hash_file_ranges, hash_region
from pdiffcopy.local.sweep import sweep_stale_temporaries
from pdiffcopy.engine.interrupts import let_through
from pdiffcopy.local import writerlocks
from pdiffcopy.core.protocol import is_temporary_name
from pdiffcopy.local.confinement import has_other_names, open_regular_path
from pdiffcopy.local.processes import die_with_parent

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future, ProcessPoolExecutor

    from pdiffcopy.local.prehash import Prehash


def _ready() -> bool:
    return True


def _load_chunker() -> None:
    """Import the chunker (8 ms, most of it pyfastcdc's typing imports) before the first cut needs it."""
    import pyfastcdc  # noqa: F401


def _start_worker(parent_pid: int, inherited: "Sequence[int]" = ()) -> None:
    # Ctrl-C reaches the whole process group: the parent handles it and stops
    # the pool; a worker printing its own KeyboardInterrupt traceback would
    # only bury the one-line message.
    # SIGTERM and SIGHUP too: the parent cleans up and shuts the pool down.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    # A parent killed outright must not leave its hashing processes behind.
    die_with_parent(parent_pid)
    for fd in inherited:  # the parent's pipes that must close when the parent closes them
        try:
            os.close(fd)
        except OSError:
            pass


def start_hash_pool(concurrency: int, close_in_workers: "Sequence[int]" = ()) -> "ProcessPoolExecutor":
    """Start the processes that hash local files.

    The processes are forked now, before the sync starts any thread, because
    forking a process with running threads can deadlock the child. ``fork``
    (not spawn) keeps start-up to milliseconds.

    :param close_in_workers: Descriptors the workers close as they start (a pipe whose end
                             tells another process something: ssh's stdin).
    """
    import multiprocessing  # here: whole-file copies hash in threads and never need it
    from concurrent.futures import ProcessPoolExecutor

    context: "multiprocessing.context.BaseContext"
    try:
        context = multiprocessing.get_context("fork")
    except ValueError:  # no fork on this platform
        context = multiprocessing.get_context()
    pool = ProcessPoolExecutor(max_workers=concurrency, mp_context=context,
                               initializer=_start_worker, initargs=(os.getpid(), tuple(close_in_workers)))
    # With fork, the first submit starts every worker at once.
    pool.submit(_ready).result()
    return pool


class LocalFile(FileEndpoint):
    """A regular file on a local file system.

    ``LocalFile(path)`` is a file the user named: its path is resolved as
    given, symlinks included. :class:`~pdiffcopy.local.confinedfile.ConfinedFile` is a file
    confined beneath a directory (a tree's member): every open goes through
    :class:`~pdiffcopy.local.confinement.Root` (``openat2`` with ``RESOLVE_BENEATH``,
    ``O_NOFOLLOW`` on the last name), and its temporary is made, renamed and
    removed through a descriptor of its directory, so a directory swapped
    for a symlink after the tree was listed can never lead a read or a write
    out of the tree. The server's file views open every file they serve
    this way too (with ``follow``: a symlink that stays in the root is
    served). Either way only regular files are opened for reading or
    writing (FIFOs and devices are refused, never waited on).
    """

    capabilities = (HashingHere, KernelCopies, Holes, ContentChunks, PartialFiles, Leases)

    #: A block device (:class:`~pdiffcopy.local.localdevice.LocalDevice`): no kernel file copies.
    is_device = False

    def __init__(self, path: str, pool: "Optional[Executor]" = None,
                 temporary: bool = False) -> None:
        self.location = path
        self.path = path
        self.pool = pool
        self.temporary = temporary
        self._read_fd: Optional[int] = None
        self._write_fd: Optional[int] = None
        self._created = False
        self._closed = False
        #: A descriptor holding an flock on the file while we update it in place.
        self._lease_fd: Optional[int] = None
        #: A temporary's: a descriptor holding its writer lock (local/writerlocks.py).
        self._hold_fd: Optional[int] = None
        #: Drop what hashing reads from the page cache (set for --cache drop copies).
        self.drop_cache = False
        #: How the last copy into a temporary was made (:meth:`create_temporary`'s clone).
        self.clone_method = ""
        #: Turn runs of zeros in what is written into holes (``--sparse``).
        self.sparse_zeros = False
        #: Digests made before the sync asked (:meth:`start_prehash`), with the pool making them.
        self.prehash: "Optional[Prehash]" = None
        #: The mode of the files made for this one that are not clones of it (:meth:`use_mode`).
        self._copies_mode: Optional[int] = None

    # -- opening -----------------------------------------------------------

    def _open(self, flags: int, mode: int = 0o666) -> int:
        """Open the file, a regular one only."""
        return open_regular_path(self.path, flags, mode)

    def open_descriptor(self, flags: int) -> int:
        """A new descriptor of the file (a regular one only, beneath the root if any); the caller closes it.

        :raises PdiffcopyError: :class:`~pdiffcopy.errors.NotAFile` for FIFOs, devices
                and the like, :class:`~pdiffcopy.errors.AccessDenied` for escapes.
        """
        return self._open(flags)

    def open_writer(self) -> "tuple[int, bool]":
        """A new descriptor for writing, the file created if missing; and whether it was."""
        created = not os.path.lexists(self.path)
        return self._open(os.O_WRONLY | os.O_CREAT), created

    def status(self) -> os.stat_result:
        """The file's ``stat`` (whatever kind it is), symlinks followed (a confined file's as it says).

        :raises PdiffcopyError: :class:`~pdiffcopy.errors.FileMissing` when there is none.
        """
        try:
            return os.stat(self.path)
        except OSError as error:
            raise storage_error(error, f"access {self.path}") from None

    def _name_status(self) -> os.stat_result:
        """The ``lstat`` of the file's name (a symlink is not followed)."""
        try:
            return os.lstat(self.path)
        except OSError as error:
            raise storage_error(error, f"open {self.path}") from None

    def flush_directory(self) -> None:
        """Flush the directory holding the file, so that its name survives a crash."""
        try:
            self._flush_directory()
        except OSError as error:
            raise storage_error(error, f"flush the directory of {self.path}") from None

    def _flush_directory(self) -> None:
        fsync_directory(os.path.dirname(self.path))

    def exists(self) -> bool:
        return os.path.lexists(self.path)

    def free_space(self) -> Optional[int]:
        try:
            stats = os.statvfs(os.path.dirname(os.path.abspath(self.path)))
        except OSError:
            return None  # the sync itself then says what is wrong with the directory
        return stats.f_bavail * stats.f_frsize

    def stat(self) -> Optional[FileInfo]:
        try:
            info = self.status()
        except FileMissing:
            return None
        kind = "file" if stat_module.S_ISREG(info.st_mode) else (
            "directory" if stat_module.S_ISDIR(info.st_mode) else "other")
        return FileInfo(kind, info.st_size, info.st_mtime_ns, etag(info), stat_module.S_IMODE(info.st_mode))

    def submit_hashes(self, ranges: Sequence[ByteRange], block_size: int, method: str
                      ) -> "Future[bytes]":
        if self.prehash is not None and self.pool is not None:
            pool = self.pool
            made = self.prehash.take(ranges, block_size, method,
                                     lambda: self._submit_hashes(pool, list(ranges), block_size, method))
            if made is not None:
                return made
        if self.pool is None:
            # No pool given (a tree's worker, a caller of its own): hashed
            # here, the future already done.
            from concurrent.futures import Future

            done: "Future[bytes]" = Future()
            try:
                done.set_result(self.hash_ranges(ranges, block_size, method))
            except PdiffcopyError as error:
                done.set_exception(error)
            return done
        return self._submit_hashes(self.pool, list(ranges), block_size, method)

    def _submit_hashes(self, pool: "Executor", ranges: List[ByteRange], block_size: int, method: str
                       ) -> "Future[bytes]":
        return pool.submit(hash_file_ranges, self.path, ranges, block_size, method, self.drop_cache)

    def _submit_cut(self, pool: "Executor", ranges: List[ByteRange], average: int) -> "Future[List[cdc.Chunk]]":
        return pool.submit(cut_path, self.path, ranges, average)

    def hash_ranges(self, ranges: Sequence[ByteRange], block_size: int, method: str) -> bytes:
        """The block digests of some ranges, hashed in this thread from the open file."""
        fd = self._reader()
        try:
            return b"".join(hash_region(fd, offset, length, block_size, method)
                            for offset, length in ranges)
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None

    def hashes_here(self) -> bool:
        return True

    def use_hash_pool(self, pool: "Executor") -> None:
        self.pool = pool

    def start_hash_pool(self, concurrency: int, cuts_likely: bool = False) -> "ProcessPoolExecutor":
        if self.prehash is not None:
            pool = self.prehash.hand_over_pool(concurrency)  # already running, and busy for this sync
            if pool is not None:
                return pool  # type: ignore[return-value]
        pool = start_hash_pool(concurrency)
        if cuts_likely:
            for _ in range(concurrency):  # (not waited for: a process that gets two loads once)
                pool.submit(_load_chunker)
        return pool

    def start_prehash(self, ranges: List[ByteRange], block_size: int, method: str, concurrency: int,
                      close_in_workers: Sequence[int] = ()) -> bool:
        """Start hashing ``ranges`` (each one request, as the engine asks) before the sync asks.

        For the wait on an ssh login: the sync's pool is started now, and its first
        :meth:`submit_hashes` of exactly these ranges, block size and method gets these digests
        if the file has not changed since (:mod:`pdiffcopy.local.prehash`).

        :param close_in_workers: For :func:`start_hash_pool`.
        :returns: False when the file cannot be opened as a regular file (the sync then says why).
        """
        from pdiffcopy.local.prehash import start_prehash

        self.prehash = start_prehash(self.path, ranges, block_size, method, concurrency,
                                     lambda count: start_hash_pool(count, close_in_workers))
        return self.prehash is not None

    def cache_mode(self, cache: str, size: int) -> str:
        from pdiffcopy.local.fastcopy import resolve_cache  # as copy_all_from imports fastcopy: when needed

        return resolve_cache(cache, size)

    def keep_out_of_cache(self) -> None:
        self.drop_cache = True

    def use_cache(self, cache: str) -> None:
        pass  # a file's cache policy is its whole-file copy's (cache_mode); a device's is its own

    def can_copy_from(self, other: FileEndpoint) -> bool:
        return isinstance(other, LocalFile) and not other.is_device

    def is_same_file(self, other: FileEndpoint) -> bool:
        if not isinstance(other, LocalFile):
            return False
        try:
            return os.path.samefile(self.path, other.path)
        except OSError:
            return False

    def check_readable(self) -> None:
        fd = self._reader()
        # A /proc or /sys file says it has 0 bytes and makes its content up on
        # each read: copied by its size it would arrive empty and "verified".
        # Refused rather than read to the end: the block plan, the verification
        # and a server all need a size that holds, and such content changes.
        try:
            generated = os.fstat(fd).st_size == 0 and os.pread(fd, 1, 0) != b""
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None
        if generated:
            raise NotAFile(f"Cannot sync {self.path}: it says it has 0 bytes but has content "
                           f"(a /proc or /sys file?); copy it with cat")

    def _reader(self) -> int:
        if self._read_fd is None:
            self._read_fd = self._open(os.O_RDONLY)
            self._hold(self._read_fd)
        return self._read_fd

    def read_descriptor(self) -> int:
        """The descriptor the file is read through (opened on first use; :meth:`close` closes it)."""
        return self._reader()

    def write_in_place(self) -> int:
        """Open the file, which must exist, for writing in place; the descriptor its writes
        go through (:meth:`close` closes it)."""
        if self._write_fd is None:
            self._write_fd = self._open(os.O_WRONLY)
            self._hold(self._write_fd)
        return self._write_fd

    def _writer(self) -> int:
        if self._closed:
            raise StorageError(f"Cannot write {self.path}: the sync was stopped")
        for _ in range(writerlocks.CREATE_ATTEMPTS):
            if self._write_fd is not None:
                break
            self._write_fd, self._created = self.open_writer()
            if not self._hold(self._write_fd) and self._created:
                os.close(self._write_fd)  # a sweep removed it before we held it: make it again
                self._write_fd = None
        else:
            raise StorageError(f"Cannot create {self.path}: it was removed each time it was made")
        return self._write_fd

    def held_writer(self) -> "tuple[int, bool]":
        """The endpoint's descriptor for writing, the file created if missing; and whether it was.

        A temporary's writer lock is held from the moment it is made (a sweep between
        its making and its first write would remove it under its writer); the endpoint
        owns the descriptor and the lock, and :meth:`close` hands the lock to the
        process's keeper, if any.
        """
        return self._writer(), bool(self._created)

    def _hold(self, fd: int) -> bool:
        """Hold a temporary's writer lock (local/writerlocks.py) through a descriptor of its own.

        :returns: Whether the file still has its name (False: a sweep removed it before it was held).
        """
        if self._hold_fd is not None or not is_temporary_name(os.path.basename(self.path)):
            return True
        try:
            self._hold_fd = writerlocks.hold_descriptor(fd)
            if self._hold_fd is None or writerlocks.still_named(self._hold_fd):
                return True
        except OSError as error:
            raise storage_error(error, f"lock {self.path}") from None
        # A sweep removed it before it was held: that lock is of no file, and the file made
        # again must get its own (a lock left here once let the next one go unheld, and swept).
        os.close(self._hold_fd)
        self._hold_fd = None
        return False

    def _end_hold(self, renamed_or_removed: bool) -> None:
        """Drop the writer lock, or hand it to the process's keeper (a server keeps it for its client)."""
        fd, self._hold_fd = self._hold_fd, None
        if fd is None:
            return
        keeper = writerlocks.KEEPER
        if keeper is not None and not renamed_or_removed:
            keeper.keep(fd, writerlocks.request_connection())
            return
        if keeper is not None:
            keeper.release(fd)
        os.close(fd)

    def prepare(self, size: int) -> None:
        self._resize(size, None)

    def prepare_sparse(self, size: int, data_bytes: int) -> None:
        self._resize(size, data_bytes)

    def _resize(self, size: int, data_bytes: Optional[int]) -> None:
        fd = self._writer()
        try:
            resize(fd, size, data_bytes)
        except OSError as error:
            raise storage_error(error, f"resize {self.path}") from None

    def data_map(self, offset: int, length: int) -> List[ByteRange]:
        try:
            return data_extents(self._reader(), offset, length, limit=MAX_DATA_MAP_EXTENTS)
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None

    def punch_ranges(self, ranges: Sequence[ByteRange], write_zeros: bool = True) -> int:
        holes = self.punch_holes(ranges, write_zeros)
        return sum(length for _, length in ranges) if holes or write_zeros else 0

    def punch_holes(self, ranges: Sequence[ByteRange], write_zeros: bool = True) -> bool:
        """:meth:`punch_ranges`, saying whether every range became a hole (False: zeros were
        written somewhere, or, without ``write_zeros``, a range was left as it was)."""
        fd = self._writer()
        try:
            return punch_ranges(fd, ranges, self.path, zeros=write_zeros)
        except OSError as error:
            raise storage_error(error, f"write {self.path}") from None

    def write_sparse(self, enabled: bool) -> None:
        self.sparse_zeros = enabled

    def _write_chunk(self, fd: int, data: "bytes | memoryview", offset: int) -> None:
        if self.sparse_zeros:
            write_sparse(fd, data, offset, os.fstat(fd).st_blksize, self.path)
        else:
            write_all(fd, data, offset)

    def read_ranges(self, ranges: Iterable[ByteRange]) -> Iterator[Chunk]:
        return self._read(ranges, TRANSFER_CHUNK_SIZE, copies=False)

    def read_copies(self, ranges: Iterable[ByteRange], chunk_size: int = TRANSFER_CHUNK_SIZE) -> Iterator[Chunk]:
        """:meth:`read_ranges`, each chunk new ``bytes`` (a response body's consumer may keep them)."""
        return self._read(ranges, chunk_size, copies=True)

    def _read(self, ranges: Iterable[ByteRange], chunk_size: int, copies: bool) -> Iterator[Chunk]:
        fd = self._reader()
        try:
            yield from read_chunks(fd, ranges, chunk_size, copies)
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None
        except EOFError:
            raise StorageError(f"Cannot read {self.path}: it became shorter during the sync") from None

    def write_ranges(self, ranges: Iterable[ByteRange], chunks: Iterator[Chunk]) -> int:
        fd = self._writer()
        written = 0
        # Only the writes are this file's errors: the chunks' source (a request body, a
        # connection) raises its own, a client's timeout included.
        for offset, data in chunks:
            try:
                self._write_chunk(fd, data, offset)
            except OSError as error:
                raise storage_error(error, f"write {self.path}") from None
            written += len(data)
        for offset, length in ranges:
            start_writeback(fd, offset, length)  # the final fsync then has little left
        return written

    def copy_ranges_from(self, source: FileEndpoint, ranges: Iterable[ByteRange]) -> int:
        """Copy ranges of another local file into this one inside the kernel."""
        assert isinstance(source, LocalFile), "the engine asks can_copy_from first"
        if self.sparse_zeros:  # the kernel's copy cannot look for zeros
            ranges = list(ranges)
            return self.write_ranges(ranges, source.read_ranges(ranges))
        source_fd, target_fd = source._reader(), self._writer()
        written = 0
        for offset, length in ranges:
            try:
                copy_range(source_fd, target_fd, offset, length)
            except OSError as error:
                raise storage_error(error, f"copy {source.path} to {self.path}") from None
            except EOFError:
                raise StorageError(f"Cannot read {source.path}: it became shorter during the sync") from None
            start_writeback(target_fd, offset, length)
            written += length
        return written

    def cut_chunks(self, ranges: Sequence[ByteRange], average: int) -> "List[cdc.Chunk]":
        """The content-defined chunks of ``ranges``: in a hashing process when there is a pool.

        Cutting holds the GIL: two local files cut in two threads of one process take twice as
        long as one, in two processes as long as one.
        """
        if self.pool is not None and ranges:
            return self._submit_cut(self.pool, list(ranges), average).result()
        return cut_open(self._reader(), ranges, average, self.path)

    def can_copy_within(self, origin: FileEndpoint) -> bool:
        return isinstance(origin, LocalFile)

    def copy_within(self, origin: FileEndpoint, moves: Sequence[cdc.Copy]) -> int:
        """Copy ranges of another local file (the old target) to other offsets of this one, in the kernel.

        This file takes the other's mode too (even with no moves), as a clone of it would.
        """
        assert isinstance(origin, LocalFile), "the engine asks can_copy_within first"
        origin_fd, fd = origin._reader(), self._writer()
        try:
            # The new version keeps the old one's mode, as a clone of it would.
            os.fchmod(fd, stat_module.S_IMODE(os.fstat(origin_fd).st_mode))
        except OSError as error:
            raise storage_error(error, f"set the mode of {self.path}") from None
        written = 0
        for move in moves:
            try:
                copied = copy_available(origin_fd, fd, move.target_offset, move.length,
                                        target_offset=move.source_offset)
            except OSError as error:
                raise storage_error(error, f"copy {origin.path} to {self.path}") from None
            if copied < move.length:
                raise Conflict(f"{origin.path} became shorter during the sync; run again")
            start_writeback(fd, move.source_offset, move.length)
            written += move.length
        return written

    def copy_all_from(self, source: FileEndpoint, size: int, cache: str, progress=None,
                      on_step=None) -> str:
        """Copy the whole of another local file into this one, the fastest way there is.

        ``progress`` and ``on_step`` are passed to :func:`pdiffcopy.local.fastcopy.copy_into`.
        """
        assert isinstance(source, LocalFile), "the engine asks can_copy_from first"
        from pdiffcopy.local.fastcopy import copy_into

        try:
            return copy_into(source._reader(), self._writer(), size, cache=cache, durable=True,
                             progress=progress, on_step=on_step)
        except OSError as error:
            raise storage_error(error, f"copy {source.path} to {self.path}") from None

    def flush(self) -> None:
        try:
            os.fsync(self._writer())
            # A temporary file's name needs no flush: replace() renames it and
            # then flushes the directory, which makes the final name durable.
        except OSError as error:
            raise storage_error(error, f"flush {self.path}") from None
        if self._created and not self.temporary:
            self.flush_directory()

    def take_lease(self) -> None:
        # An flock: other pdiffcopy runs (and anything else that asks for
        # one) are kept out; writers that do not ask are not, as ever locally.
        fd = self._open(os.O_RDONLY)
        try:
            _lock_or_refuse(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        self._lease_fd = fd

    def leases_stop_other_writers(self) -> bool:
        return False  # an advisory lock: a writer that does not ask for it is not stopped

    def end_lease(self) -> None:
        fd, self._lease_fd = self._lease_fd, None
        if fd is not None:
            os.close(fd)

    def use_mode(self, mode: int, new: bool) -> None:
        self._copies_mode = mode & 0o777 & ~process_umask() if new else stat_module.S_IMODE(mode)

    def create_temporary(self, clone: bool, relative: Optional[str] = None) -> "LocalFile":
        """A new temporary sibling (named by :func:`~pdiffcopy.core.protocol.temporary_name`); a copy with ``clone``.

        :param relative: For a confined file: the temporary's path beneath the
                         root instead (a server's client names it).
        """
        temporary, fd = self._create_sibling(temporary_name, relative)
        self._fill(temporary, fd, clone)
        return temporary

    def open_partial(self, clone: bool) -> "tuple[LocalFile, bool]":
        """The ``--partial`` sibling (:func:`~pdiffcopy.core.protocol.partial_name`): the one a
        killed run left, or a new one (a copy with ``clone``); and whether it was there.

        :raises PdiffcopyError: :class:`~pdiffcopy.errors.NotAFile` when the name is taken by
                something else than a regular file (a symlink is never followed).
        """
        try:
            partial, fd = self._create_sibling(partial_name)
        except Conflict:
            partial = self._sibling(partial_name)[0]
            try:
                info = partial._name_status()
            except PdiffcopyError as error:
                raise error from None  # not the Conflict that led here
            # Checked by name here, and opened by name later: a race only someone who
            # can write the target's directory can run, and they could replace the target.
            if not stat_module.S_ISREG(info.st_mode):
                raise NotAFile(f"Cannot resume into {partial.path}: it is not a regular file; remove it") from None
            if has_other_names(info):  # writing it would change another file too
                raise NotAFile(f"Cannot resume into {partial.path}: it has other hard links; remove it") from None
            return partial, True
        self._fill(partial, fd, clone)
        return partial, False

    def _sibling(self, naming: Callable[[str], str],
                 relative: Optional[str] = None) -> "tuple[LocalFile, Optional[str]]":
        """The endpoint of a hidden sibling named by ``naming`` (or at ``relative`` beneath the root)."""
        parent, name = os.path.split(self.path)
        return LocalFile(os.path.join(parent, naming(name)), self.pool, temporary=True), None

    def _directory_and_name(self) -> "tuple[Optional[int], str]":
        """A descriptor of the directory to make, rename or remove the file in (None: the
        working directory's paths), and the file's name there; the caller closes the descriptor."""
        return None, self.path

    def _create_sibling(self, naming: Callable[[str], str], relative: Optional[str] = None) -> "tuple[LocalFile, int]":
        """Create the sibling :meth:`_sibling` names, exclusively (:class:`Conflict` when it exists)."""
        sibling, _ = self._sibling(naming, relative)
        # A confined one is made, renamed and removed by name in its directory, the
        # directory opened beneath the root each time (not held open: a tree sync
        # prepares every big file's temporary up front).
        directory, name = sibling._directory_and_name()
        try:
            fd = writerlocks.create_held(name, 0o600, dir_fd=directory)
            sibling._hold_fd = os.dup(fd)  # the same open file description: it holds the lock too
        except OSError as error:
            where = os.path.dirname(sibling.path) or "."
            raise storage_error(error, f"create a temporary file in {where}") from None
        finally:
            if directory is not None:
                os.close(directory)
        return sibling, fd

    def _fill(self, temporary: "LocalFile", fd: int, clone: bool) -> None:
        """Give a new sibling this file's data (with ``clone``) and mode; remove it on failure."""
        temporary._write_fd = fd
        try:
            # A copy may take long: Ctrl-C acts at once, the except below cleaning up.
            with let_through():
                source = self._reader() if clone else None
                if source is not None:
                    if os.fstat(source).st_size > free_space(fd):
                        raise StorageError(f"Cannot copy {self.path}: not enough free space")
                    from pdiffcopy.local.fastcopy import copy_into

                    # A reflink where the file system can (milliseconds, no new
                    # blocks), else the fastest copy the kernel offers.
                    temporary.clone_method = copy_into(source, fd, os.fstat(source).st_size, cache="keep")
            # The final file gets the old file's mode, else the one the sync gave (use_mode),
            # else the usual default.
            if source is not None:
                mode = stat_module.S_IMODE(os.fstat(source).st_mode)
            elif self._copies_mode is not None:
                mode = self._copies_mode
            else:
                mode = 0o666 & ~process_umask()
            os.fchmod(fd, mode)
        except OSError as error:
            temporary.remove_temporary()
            raise storage_error(error, f"copy {self.path} to a temporary file") from None
        except BaseException:  # PdiffcopyError, KeyboardInterrupt: leave nothing behind
            temporary.remove_temporary()
            raise

    def sweep_temporaries(self) -> int:
        return sweep_stale_temporaries(os.path.dirname(self.path) or ".")

    def replace(self, other: FileEndpoint) -> None:
        assert isinstance(other, LocalFile)
        try:
            # Not over a file another pdiffcopy is updating in place.
            held: Optional[int] = other._open(os.O_RDONLY)
        except (OSError, PdiffcopyError):
            held = None  # missing, not a regular file, unreadable: there is no lock to respect
        try:
            if held is not None:
                _lock_or_refuse(held, other.path)
            source_directory, source_name = self._directory_and_name()
            try:
                directory, name = other._directory_and_name()
                try:
                    replace_atomically(source_name, name, source_directory, directory)
                finally:
                    if directory is not None:
                        os.close(directory)
            finally:
                if source_directory is not None:
                    os.close(source_directory)
        except BaseException as error:
            if held is not None:
                os.close(held)
            if isinstance(error, OSError):
                raise storage_error(error, f"rename {self.path} to {other.path}") from None
            raise
        if held is not None:
            other._close_replaced(held)
        self._end_hold(renamed_or_removed=True)

    def _close_replaced(self, held: int) -> None:
        """Close ``held`` and this file's read descriptor, now that a new version has its name.

        The last of them frees the old version's blocks: a big one's off the caller's way.
        """
        fds = [held] if self._read_fd is None else [held, self._read_fd]
        self._read_fd = None
        try:
            close = close_soon if os.fstat(held).st_size >= CLOSE_SOON_BYTES else os.close
        except OSError:
            close = os.close
        for fd in fds:
            with contextlib.suppress(OSError):
                close(fd)

    def remove_temporary(self) -> None:
        self.close()
        self._closed = True
        try:
            self.unlink()
        except PdiffcopyError:
            pass  # already gone (renamed): nothing to clean up

    def unlink(self) -> None:
        """Remove the file's name (beneath the root, never following the last name).

        :raises PdiffcopyError: :class:`~pdiffcopy.errors.FileMissing` when it is gone, and the like.
        """
        try:
            directory, name = self._directory_and_name()
            try:
                os.unlink(name, dir_fd=directory)
            finally:
                if directory is not None:
                    os.close(directory)
        except OSError as error:
            raise storage_error(error, f"remove {self.path}") from None
        self._end_hold(renamed_or_removed=True)

    def close(self) -> None:
        self._end_hold(renamed_or_removed=False)
        if self.prehash is not None:
            self.prehash.close()
        for name in ("_read_fd", "_write_fd", "_lease_fd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                try:
                    os.close(fd)
                except OSError:
                    pass


def _lock_or_refuse(fd: int, path: str) -> None:
    """Take an exclusive flock on ``fd`` at once, or say who is in the way."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise Locked(f"{path} is being written by another pdiffcopy; try again when it is done") \
                from None
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise storage_error(error, f"lock {path}") from None
        # A file system without locks (some network mounts): nothing to respect.

"""A local block device as a sync's source or target: a file of fixed size, written in place.

It is a :class:`~pdiffcopy.local.localfile.LocalFile` in all that reads and writes by
positions, and differs where a file's name or size would change: it is never
resized, truncated, renamed over or unlinked (no temporary, no ``--partial`` file:
the engine writes it in place, under an exclusive claim that the kernel also refuses
while the device is mounted), its size is the device's, it has no mtime that tells a
change (its write counters do: :func:`~pdiffcopy.local.devices.identity`), and its zeros
are written, or with ``-S`` discarded, by the device's own operations. What it reads
and writes it keeps out of the page cache: that cache belongs to the host's running VMs
(dropped after use, or with ``--cache direct`` never put there: :mod:`pdiffcopy.local.directio`).
Where its kind knows which of its blocks hold data (:mod:`~pdiffcopy.local.devicemaps`: a loop
device, an LVM thin volume), the rest are its holes: never read, hashed as zeros.
"""

from __future__ import annotations

import os
import stat as stat_module
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Iterable, Iterator, List, Optional, Sequence

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.datamap import MAX_DATA_MAP_EXTENTS, zero_runs
from pdiffcopy.engine.endpoints import Chunk, FileEndpoint, FileInfo
from pdiffcopy.errors import FileMissing, NotAFile, StorageError, Unsupported, storage_error
from pdiffcopy.local import devices, directio
from pdiffcopy.local.devicemaps import DeviceMap, device_map, write_back
from pdiffcopy.local.descriptors import fast_paths_enabled, write_all, write_zeros
from pdiffcopy.local.filehash import cut_ranges, hash_file_ranges, hash_region, hole_blocks
from pdiffcopy.local.localfile import LocalFile

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from pdiffcopy.core import chunks as cdc


class LocalDevice(LocalFile):
    """The block device at ``path`` (``/dev/vg/vm1``, ``/dev/loop0``; symlinks followed)."""

    is_device = True

    def __init__(self, path: str, pool: "Optional[Executor]" = None) -> None:
        super().__init__(path, pool)
        self.drop_cache = True
        #: The device's data map, found on first use (None: not asked yet; False: it has none).
        self._device_map: "Optional[DeviceMap | bool]" = None
        #: Whether it was opened for writing: then only a map asked afresh each time is used.
        self._written = False
        self._map_lock = threading.Lock()  # the transfer threads ask at once: one reading of a pool's map
        #: Read and write around the page cache (``O_DIRECT``: ``--cache direct``).
        self.direct_io = False
        self._direct_read_fd: Optional[int] = None
        self._direct_writer: Optional[directio.DirectWriter] = None
        self._direct_lock = threading.Lock()
        #: Ranges written whose pages are dropped from the cache once written back (one call later).
        self._written_behind: List[ByteRange] = []

    def use_cache(self, cache: str) -> None:
        """The page cache policy of ``--cache``: ``keep`` leaves what was read and written in the
        cache, ``direct`` bypasses it, anything else drops it after use."""
        self.drop_cache = cache != "keep"
        self.direct_io = cache == "direct" and directio.available()

    # -- opening -------------------------------------------------------------

    def _open(self, flags: int, mode: int = 0o666) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            with self._map_lock:
                self._written = True
                if isinstance(self._device_map, DeviceMap) and not self._device_map.live:
                    self._device_map.close()  # a map read once is not the device's once it is written
                    self._device_map = False
        return devices.open_device(self.path, flags & ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL))

    def open_writer(self) -> "tuple[int, bool]":
        return self._open(os.O_WRONLY), False

    def stat(self) -> Optional[FileInfo]:
        try:
            info = self.status()
        except FileMissing:
            return None
        if not stat_module.S_ISBLK(info.st_mode):
            return super().stat()  # replaced by something else since it was chosen: the engine refuses it
        fd = self._reader()
        try:
            if fast_paths_enabled():
                write_back(fd)  # what waits in its page cache is written now, not later as a "change"
            size, tag = devices.device_size(fd), devices.identity(fd)
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None
        return FileInfo("device", size, info.st_mtime_ns, tag, stat_module.S_IMODE(info.st_mode))

    def free_space(self) -> Optional[int]:
        return None  # nothing beside it is ever made

    def check_readable(self) -> None:
        self._reader()

    def is_same_file(self, other: FileEndpoint) -> bool:
        if not isinstance(other, LocalFile):
            return False
        try:
            mine, theirs = os.stat(self.path), os.stat(other.path)
        except OSError:
            return False
        return stat_module.S_ISBLK(theirs.st_mode) and mine.st_rdev == theirs.st_rdev

    # -- its data map ------------------------------------------------------------

    def device_map(self) -> Optional[DeviceMap]:
        """The device's data map, asked of its providers once (None: it has none, all is data)."""
        with self._map_lock:
            if self._device_map is None:
                self._device_map = self._find_map() or False
            return self._device_map or None

    def _find_map(self) -> Optional[DeviceMap]:
        try:
            found = device_map(self._reader(), live_only=self._written)
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None
        if found is not None and self._written and not found.live:
            found.close()
            return None
        if found is not None and fast_paths_enabled():
            try:
                # No readahead: it would read the holes after each extent (the reads ask ahead themselves).
                os.posix_fadvise(self._reader(), 0, 0, os.POSIX_FADV_RANDOM)
            except OSError:
                pass  # advisory only
        return found

    def data_map(self, offset: int, length: int) -> List[ByteRange]:
        known = self.device_map()
        if known is None:
            return super().data_map(offset, length)  # (the kernel says: all data)
        try:
            return known.extents(offset, length, MAX_DATA_MAP_EXTENTS)
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None

    def _range_extents(self, ranges: Sequence[ByteRange]) -> Optional[List[List[ByteRange]]]:
        """Each range's data extents from the device's map (all of them), or None without a map."""
        known = self.device_map()
        if known is None:
            return None
        try:
            return [known.extents(offset, length) for offset, length in ranges]
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None

    def _asked_ahead(self, ranges: Iterable[ByteRange]) -> Iterator[ByteRange]:
        """``ranges`` in pieces of :data:`READ_AHEAD_BYTES`, each asked for before the one before it is read:
        the readahead a device with a map goes without, over its data only."""
        fd = self._reader()
        pieces = (piece for offset, length in ranges for piece in _pieces(offset, length, READ_AHEAD_BYTES))
        current = next(pieces, None)
        if current is not None:
            _will_need(fd, current)
        for following in pieces:
            _will_need(fd, following)
            yield current
            current = following
        if current is not None:
            yield current

    # -- hashing -------------------------------------------------------------

    def _submit_hashes(self, pool: "Executor", ranges: List[ByteRange], block_size: int, method: str
                       ) -> "Future[bytes]":
        # The map is read here, once: a hashing process gets its ranges' extents with them.
        return pool.submit(hash_file_ranges, self.path, ranges, block_size, method, self.drop_cache, True,
                           self._range_extents(ranges), self.direct_io)

    def hash_ranges(self, ranges: Sequence[ByteRange], block_size: int, method: str) -> bytes:
        """The block digests of some ranges, hashed in this thread (a refinement's small pieces),
        read around the page cache or dropped from it as the sync's policy says; holes not read."""
        extents = self._range_extents(ranges)
        fd = self._reader()
        try:
            if self.direct_io:
                size, unit = devices.device_size(fd), devices.sector_size(fd)
                return b"".join(directio.hash_region_direct(
                    self._direct_reader(), fd, size, unit, offset, length, block_size, method,
                    hole_blocks(fd, offset, max(0, min(offset + length, size) - offset), block_size,
                                None if extents is None else extents[index]))
                    for index, (offset, length) in enumerate(ranges))
            digests = []
            for index, (offset, length) in enumerate(ranges):
                digests.append(hash_region(fd, offset, length, block_size, method,
                                           None if extents is None else extents[index]))
                if self.drop_cache and fast_paths_enabled():
                    directio.drop_pages(fd, offset, length)
            return b"".join(digests)
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None

    def _submit_cut(self, pool: "Executor", ranges: List[ByteRange], average: int) -> "Future[List[cdc.Chunk]]":
        return pool.submit(_cut_device, self.path, ranges, average, self.drop_cache)

    def cache_mode(self, cache: str, size: int) -> str:
        return "keep" if cache == "keep" else "drop"

    # -- reading -------------------------------------------------------------

    def _read(self, ranges: Iterable[ByteRange], chunk_size: int, copies: bool) -> Iterator[Chunk]:
        if not self.direct_io:
            if self.device_map() is not None:
                ranges = self._asked_ahead(ranges)  # (its readahead is off: it would read the holes)
            for offset, length in ranges:  # each range dropped once sent: the cache stays as it was
                yield from super()._read([(offset, length)], chunk_size, copies)
                if self.drop_cache and fast_paths_enabled():
                    directio.drop_pages(self._reader(), offset, length)
            return
        fd = self._reader()
        try:
            yield from directio.read_chunks_direct(self._direct_reader(), fd, devices.device_size(fd),
                                                   devices.sector_size(fd), ranges, chunk_size, copies)
        except OSError as error:
            raise storage_error(error, f"read {self.path}") from None
        except EOFError:
            raise StorageError(f"Cannot read {self.path}: it became shorter during the sync") from None

    def _direct_reader(self) -> int:
        with self._direct_lock:
            if self._direct_read_fd is None:
                self._direct_read_fd = devices.open_device(self.path, os.O_RDONLY | directio.O_DIRECT)
            return self._direct_read_fd

    def can_copy_from(self, other: FileEndpoint) -> bool:
        return False  # the kernel's copies between files: the transfer threads' reads and writes here

    def can_copy_within(self, origin: FileEndpoint) -> bool:
        return False  # a new version is never built beside a device: it is updated in place

    # -- writing in place ------------------------------------------------------

    def _resize(self, size: int, data_bytes: Optional[int]) -> None:
        """A device keeps its size: the engine checked that the source fits (a longer tail stays as it was)."""
        capacity = devices.device_size(self._writer())
        if size > capacity:
            raise StorageError(f"Cannot write {size} bytes to {self.path}: the device holds only {capacity}")

    def punch_ranges(self, ranges: Sequence[ByteRange], write_zeros: bool = True) -> int:
        """Make ``ranges`` zeros: with ``-S`` discarded (a thin volume keeps its blocks free), else
        written where they are not zeros already (``write_zeros``). Returns the bytes made zeros."""
        fd = self._writer()
        done = 0
        try:
            for offset, length in ranges:
                if self.sparse_zeros and fast_paths_enabled() and devices.discard_zeros(fd, offset, length):
                    done += length
                elif write_zeros:
                    _zero(fd, offset, length)
                    done += length
                else:
                    return done  # zeros already, and the device cannot unmap: leave them
        except OSError as error:
            raise storage_error(error, f"write {self.path}") from None
        return done

    def punch_holes(self, ranges: Sequence[ByteRange], write_zeros: bool = True) -> bool:
        ranges = list(ranges)
        return self.punch_ranges(ranges, write_zeros) == sum(length for _, length in ranges)

    def write_ranges(self, ranges: Iterable[ByteRange], chunks: Iterator[Chunk]) -> int:
        ranges = list(ranges)
        written = super().write_ranges(ranges, chunks)
        if self.drop_cache and not self.direct_io and fast_paths_enabled():
            # The previous call's pages are written back by now (their write-back started
            # then): dropped, the cache holds about one call's writes per transfer thread.
            with self._direct_lock:
                behind, self._written_behind = self._written_behind, ranges
            fd = self._writer()
            for offset, length in behind:
                directio.drop_pages(fd, offset, length)
        return written

    def _write_all(self, fd: int, data: "bytes | memoryview", offset: int) -> None:
        if self.direct_io:
            self._direct(fd).write(data, offset)
        else:
            write_all(fd, data, offset)

    def _direct(self, fd: int) -> directio.DirectWriter:
        with self._direct_lock:
            if self._direct_writer is None:
                self._direct_writer = directio.DirectWriter(
                    devices.open_device(self.path, os.O_WRONLY | directio.O_DIRECT), fd)
            return self._direct_writer

    def _write_chunk(self, fd: int, data: "bytes | memoryview", offset: int) -> None:
        if not self.sparse_zeros:
            self._write_all(fd, data, offset)
            return
        view = memoryview(data).cast("B")
        position = offset
        for start, length in zero_runs(view, offset, 4096) + [(offset + len(view), 0)]:
            if start > position:
                self._write_all(fd, view[position - offset : start - offset], position)
            if length and not (fast_paths_enabled() and devices.discard_zeros(fd, start, length)):
                _zero(fd, start, length)  # the old bytes there are anything
            position = start + length

    def flush(self) -> None:
        fd = self._writer()
        try:
            os.fsync(fd)
            if self.drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written through: not the VMs' cache
        except OSError as error:
            raise storage_error(error, f"flush {self.path}") from None

    def take_lease(self) -> None:
        # The kernel's exclusive claim: refused while the device is mounted or another writer holds it.
        self._lease_fd = devices.claim(self.path)

    def use_mode(self, mode: int, new: bool) -> None:
        pass  # a device node's mode is its own, never the source's

    # -- what a device never does ----------------------------------------------

    def create_temporary(self, clone: bool, relative: Optional[str] = None) -> "LocalFile":
        raise Unsupported(f"{self.path} is a block device: it is updated in place, never replaced")

    def open_partial(self, clone: bool) -> "tuple[LocalFile, bool]":
        raise Unsupported(f"{self.path} is a block device: it is updated in place, never replaced")

    def sweep_temporaries(self) -> int:
        return 0

    def replace(self, other: FileEndpoint) -> None:
        raise NotAFile(f"Cannot replace {getattr(other, 'location', other)} by a block device")

    def remove_temporary(self) -> None:
        self.close()

    def close(self) -> None:
        if isinstance(self._device_map, DeviceMap):
            self._device_map.close()
        self._device_map = None  # (it holds the read descriptor's device: asked again after a reopen)
        if self.drop_cache and self._read_fd is not None and fast_paths_enabled():
            # The readahead of concurrent readers lands past the ranges each one drops: what
            # is left of the device in the cache goes at the end.
            try:
                os.posix_fadvise(self._read_fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass  # advisory only
        super().close()
        with self._direct_lock:
            direct_fds = [self._direct_read_fd,
                          self._direct_writer.direct_fd if self._direct_writer is not None else None]
            self._direct_read_fd = self._direct_writer = None
        for fd in direct_fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def unlink(self) -> None:
        raise NotAFile(f"Cannot remove {self.path}: it is a block device")


#: How far ahead of its reads a device with a data map asks for its data (its readahead is off):
#: a few transfer chunks, so that the device works while the last one is sent or written.
READ_AHEAD_BYTES = 4 * 1024 * 1024


def _pieces(offset: int, length: int, size: int) -> Iterator[ByteRange]:
    for start in range(offset, offset + length, size):
        yield start, min(size, offset + length - start)


def _will_need(fd: int, piece: ByteRange) -> None:
    try:
        os.posix_fadvise(fd, piece[0], piece[1], os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # advisory only


def _zero(fd: int, offset: int, length: int) -> None:
    """Zeros over a range of a device: by its own operation, else written."""
    if not (fast_paths_enabled() and devices.zero_range(fd, offset, length)):
        write_zeros(fd, offset, length)


def _cut_device(path: str, ranges: Sequence[ByteRange], average: int, drop_cache: bool = True
                ) -> "List[cdc.Chunk]":
    """The content-defined chunks of ranges of a device (run in a hashing process), dropped from
    the cache afterwards with ``drop_cache`` (the chunker reads a mapping: no direct I/O)."""
    fd = devices.open_device(path, os.O_RDONLY)
    try:
        chunks = cut_ranges(fd, ranges, average)
        if drop_cache and fast_paths_enabled():
            for offset, length in ranges:
                directio.drop_pages(fd, offset, length)
        return chunks
    except OSError as error:
        raise storage_error(error, f"read {path}") from None
    finally:
        os.close(fd)


def endpoint_for(path: str) -> LocalFile:
    """The local endpoint of ``path``: a :class:`LocalDevice` where it names a block device."""
    return LocalDevice(path) if devices.is_block_device(path) else LocalFile(path)


__all__ = ["LocalDevice", "endpoint_for"]

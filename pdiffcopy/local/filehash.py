"""Hashing the blocks of files on this machine: mapped from the page cache, or read.

The hash methods themselves, and what a digest is, are :mod:`pdiffcopy.core.hashing`
(no I/O); this module applies them to open files and paths.
"""

from __future__ import annotations

import mmap
import os
from typing import Iterator, List, Optional, Sequence, Tuple

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import StorageError, storage_error
from pdiffcopy.local.descriptors import data_extents, fast_paths_enabled, read_chunks
from pdiffcopy.core.hashing import READ_CHUNK_SIZE, finish, new_hasher, zero_digest
from pdiffcopy.local.devices import descriptor_size


#: A region up to this size is asked for whole (``POSIX_FADV_WILLNEED``) before it is mapped:
#: from a cold cache its page faults would otherwise read it a few pages at a time, each a wait
#: on the disk (the delta's sample of small windows, the refinement of a lone changed block).
#: Longer regions are read in order, where the kernel's readahead grows on its own.
PREFETCH_MAX_BYTES = 2 * 1024 * 1024


def hash_region(fd: int, offset: int, length: int, block_size: int, method: str,
                extents: Optional[Sequence[ByteRange]] = None) -> bytes:
    """Hash consecutive blocks of an open file.

    Blocks the file does not (fully) have are hashed as far as the data
    goes: a block past the end hashes the empty string, so it can never match
    a source block that has data. Blocks wholly in holes are never read.

    :param fd: A file descriptor open for reading.
    :param offset: Where the first block starts (a multiple of ``block_size``).
    :param length: How many bytes the blocks cover.
    :param block_size: The block size in bytes.
    :param method: The hash method.
    :param extents: The data extents of the region where they are known (a block device's map,
                    :mod:`~pdiffcopy.local.devicemaps`); else the file's own (``SEEK_DATA``).
    :returns: The concatenated digests, one per block.
    :raises OSError: When reading fails.
    """
    available = max(0, min(offset + length, descriptor_size(fd)) - offset)
    device_map = extents is not None
    if extents is None:
        extents = data_extents(fd, offset, available)
        _prefetch(fd, offset, available)  # a file's holes cost no reads
    try:
        data = _map(fd, offset, available, sequential=not device_map)
    except (OSError, ValueError):
        data = None  # not mappable (a pipe, some FUSE file systems): read instead
    if data is None:
        return _hash_region_read(fd, offset, length, block_size, method)
    view, mapping = data
    try:
        digests = []
        # Blocks wholly in a hole are never read: their digest is that of zeros. A run of
        # them costs one cached digest, repeated (a 1 TiB hole: no Python work per block).
        holes = iter(hole_blocks(fd, offset, available, block_size, extents))
        hole_first, hole_end = next(holes, (-1, -1))
        pieces = _DevicePieces(fd, offset, available, block_size, extents) if device_map else None
        block, count = 0, -(-length // block_size)
        while block < count:
            if block == hole_first:
                digests.append(zero_digest(method, block_size) * (hole_end - hole_first))
                block = hole_end
                hole_first, hole_end = next(holes, (-1, -1))
                continue
            start = block * block_size
            hasher = new_hasher(method)
            if pieces is None:
                hasher.update(view[start : min(start + block_size, available)])
            else:
                pieces.hash_block(hasher, view, block)
            digests.append(finish(hasher, method))
            block += 1
        return b"".join(digests)
    finally:
        view.release()
        if mapping is not None:
            mapping.close()


#: How far ahead of the block it hashes a device with a map asks for its data at least (its own
#: readahead is off, as it would read the holes): a refinement's 4 KiB pieces are then asked for
#: 256 at a time, not one (1 GiB, 10 % of its blocks changed: 0.02 s to refine, not 0.6 s).
DEVICE_READ_AHEAD_BYTES = 1024 * 1024


class _DevicePieces:
    """The data and hole pieces of a device's blocks, from its map: the holes are hashed as zeros
    and never read (a device reads them: no file system skips them), and the data of the next
    blocks are asked for ahead (``POSIX_FADV_WILLNEED``: the mapping itself reads no further)."""

    def __init__(self, fd: int, offset: int, available: int, block_size: int, extents: Sequence[ByteRange]) -> None:
        self.fd, self.offset, self.available, self.block_size = fd, offset, available, block_size
        # Relative to the region, clipped to it, in order.
        self.extents = [(max(start, offset) - offset, min(start + size, offset + available) - offset)
                        for start, size in extents if start < offset + available and start + size > offset]
        self.index = 0
        self.fetched = 0  # the bytes of the region before this one were asked for
        self.zeros = memoryview(bytes(min(block_size, READ_CHUNK_SIZE)))

    def _pieces(self, block: int) -> List[Tuple[int, int]]:
        """The data of ``block`` as (start, stop) within the region."""
        start, stop = block * self.block_size, min((block + 1) * self.block_size, self.available)
        while self.index < len(self.extents) and self.extents[self.index][1] <= start:
            self.index += 1
        found, index = [], self.index
        while index < len(self.extents) and self.extents[index][0] < stop:
            found.append((max(self.extents[index][0], start), min(self.extents[index][1], stop)))
            index += 1
        return found

    def _fetch(self, stop: int) -> None:
        """Ask for the data of the region up to byte ``stop`` that was not asked for yet."""
        stop = min(stop, self.available)
        if stop <= self.fetched:
            return
        for start, end in self.extents[self.index:]:
            if start >= stop:
                break
            start, end = max(start, self.fetched), min(end, stop)
            if end > start:
                _prefetch(self.fd, self.offset + start, end - start, limit=None)
        self.fetched = stop

    def hash_block(self, hasher, view: memoryview, block: int) -> None:
        # The next block asked for, or more of the small blocks (a refinement's pieces), in steps
        # of a quarter of that: few calls, and the device never idle.
        ahead = max(self.block_size, DEVICE_READ_AHEAD_BYTES)
        if (block + 1) * self.block_size + ahead - ahead // 4 > self.fetched:
            self._fetch((block + 1) * self.block_size + ahead)
        position = block * self.block_size
        for start, stop in self._pieces(block) + [(min(position + self.block_size, self.available),) * 2]:
            while position < start:  # a hole in a block that has data
                count = min(len(self.zeros), start - position)
                hasher.update(self.zeros[:count])
                position += count
            if stop > start:
                hasher.update(view[start:stop])
            position = max(position, stop)


def hole_blocks(fd: int, offset: int, available: int, block_size: int,
                extents: Optional[Sequence[ByteRange]] = None) -> List[Tuple[int, int]]:
    """The runs of whole blocks of ``[offset, offset + available)`` that lie in holes: (first, end) block numbers.

    Only full blocks count: the last, short block of a file is read (it is small).

    :param extents: The region's data extents where they are known, else the file's (``SEEK_DATA``).
    """
    if extents is None:
        extents = data_extents(fd, offset, available)
    runs: List[Tuple[int, int]] = []
    position = offset
    for start, length in list(extents) + [(offset + available, 0)]:
        first = -(-(position - offset) // block_size)
        end = (start - offset) // block_size
        if end > first:
            runs.append((first, end))
        position = start + length
    return runs


def _prefetch(fd: int, offset: int, length: int, limit: Optional[int] = PREFETCH_MAX_BYTES) -> None:
    """Ask for a short region in one read ahead of its use (:data:`PREFETCH_MAX_BYTES`, or ``limit``)."""
    if 0 < length and (limit is None or length <= limit) and fast_paths_enabled():
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # advisory only


def _map(fd: int, offset: int, length: int, sequential: bool = True):
    """Map ``length`` bytes at ``offset`` read-only; return (view, mapping).

    Read ahead as it is read in order (``sequential``), else only what is touched: a device
    whose holes are known asks for its data itself, and readahead would read its holes.

    Hashing straight from the page cache through a mapping skips the copy a
    read makes: 1 GiB hashes in 0.11 s instead of 0.18 s here (xxh3_128).
    """
    if length == 0:
        return memoryview(b""), None
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, length + offset - aligned, mmap.MAP_SHARED, mmap.PROT_READ,
                        offset=aligned)
    try:
        mapping.madvise(mmap.MADV_SEQUENTIAL if sequential else mmap.MADV_RANDOM)
    except (AttributeError, OSError):
        pass  # advisory only
    view = memoryview(mapping)[offset - aligned :]
    return view, mapping


def _hash_region_read(fd: int, offset: int, length: int, block_size: int, method: str) -> bytes:
    """:func:`hash_region` with reads into a buffer, for files that cannot be mapped."""
    digests = []
    chunk = min(block_size, READ_CHUNK_SIZE)
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    end = offset + length
    position = offset
    while position < end:
        block_end = min(position + block_size, end)
        hasher = new_hasher(method)
        while position < block_end:
            got = os.preadv(fd, [view[: min(chunk, block_end - position)]], position)
            if got <= 0:
                position = block_end  # end of file: the rest of the block is missing
                break
            hasher.update(view[:got])
            position += got
        digests.append(finish(hasher, method))
    return b"".join(digests)


#: How much of a file a content-defined cut maps at a time: about this many chunks, but at
#: most :data:`CUT_WINDOW_BYTES`. The last chunk of a window may be cut short by the window's
#: end, so it is cut again from the start of the next one: the chunks are those of the whole
#: range at once, whatever the window (a chunk is at most four times the average).
CUT_WINDOW_CHUNKS = 1024
CUT_WINDOW_BYTES = 64 * 1024 * 1024


def cut_region(fd: int, offset: int, length: int, average: int) -> Iterator[List[cdc.Chunk]]:
    """The content-defined chunks of ``[offset, offset + length)`` of an open file, a window at a time.

    The chunker and the chunk digests read the mapped page cache: no copy into a buffer
    (a read-fed stream copies every byte once more: 256 MiB cut in 0.158 s instead of 0.130).

    :raises EOFError: When the file ends before the range does (it became shorter).
    :raises OSError: When reading fails.
    """
    end = offset + length
    position = offset
    window = min(CUT_WINDOW_BYTES, CUT_WINDOW_CHUNKS * average)
    while position < end:
        span = min(window, end - position)
        if descriptor_size(fd) < position + span:
            raise EOFError(f"file ended before {position + span} bytes")
        last = position + span == end
        _prefetch(fd, position, span)
        try:
            view, mapping = _map(fd, position, span)
        except (OSError, ValueError):  # not mappable (a pipe, some FUSE file systems): read instead
            view = memoryview(b"".join(chunk for _, chunk in read_chunks(fd, [(position, span)], copies=True)))
            mapping = None
        try:
            chunks = cdc.cut(view, position, average)
        finally:
            view.release()
            if mapping is not None:
                mapping.close()
        if not last and len(chunks) > 1:
            chunks.pop()
        position = chunks[-1].offset + chunks[-1].length
        yield chunks


def cut_path(path: str, ranges: Sequence[ByteRange], average: int) -> "List[cdc.Chunk]":
    """:func:`cut_ranges` of the file at ``path`` (run in a hashing process)."""
    from pdiffcopy.local.confinement import open_regular_path  # (a FIFO is refused, never waited on)

    fd = open_regular_path(path, os.O_RDONLY)
    try:
        return cut_open(fd, ranges, average, path)
    finally:
        os.close(fd)


def cut_open(fd: int, ranges: Sequence[ByteRange], average: int, name: str) -> "List[cdc.Chunk]":
    """:func:`cut_ranges` of an open file, its errors one line naming it ``name``."""
    try:
        return cut_ranges(fd, ranges, average)
    except OSError as error:
        raise storage_error(error, f"read {name}") from None
    except EOFError:
        raise StorageError(f"Cannot read {name}: it became shorter during the sync") from None


def cut_ranges(fd: int, ranges: Sequence[ByteRange], average: int) -> "List[cdc.Chunk]":
    """The content-defined chunks of ``ranges`` of the open file ``fd``, in order.

    :raises OSError: When reading fails.
    :raises EOFError: When the file is shorter than a range.
    """
    return [chunk for offset, length in ranges
            for window in cut_region(fd, offset, length, average) for chunk in window]


def hash_file_ranges(path: str, ranges: Sequence[ByteRange], block_size: int, method: str,
                     drop_cache: bool = False, device: bool = False,
                     extents: Optional[Sequence[Sequence[ByteRange]]] = None, direct: bool = False) -> bytes:
    """Hash the blocks of some block-aligned ranges of the file at ``path``.

    This is the unit of work of a hashing process: it opens the file itself,
    so only the path, not a file descriptor, crosses the process boundary.
    With ``drop_cache`` the pages read are dropped from the page cache
    afterwards, for copies that must not flush the cache. With ``device``, ``path``
    names a block device (anything else is refused); ``extents`` are then each range's
    data extents, from the device's map (read once by its endpoint, not in every hashing
    process: :mod:`~pdiffcopy.local.devicemaps`), or None where it has none (all data);
    with ``direct`` too, it is read around the page cache (``O_DIRECT``,
    :mod:`pdiffcopy.local.directio`) into aligned buffers.

    :returns: The concatenated digests of every block of every range, in order.
    :raises PdiffcopyError: When the file cannot be opened or read.
    """
    if device:  # (a block device: :mod:`pdiffcopy.local.devices`)
        from pdiffcopy.local.devices import open_device as opener
    else:
        from pdiffcopy.local.confinement import open_regular_path as opener  # (a FIFO is refused, never waited on)

    if device and direct:
        return _hash_device_direct(path, ranges, block_size, method, extents)
    fd = opener(path, os.O_RDONLY)
    if device and drop_cache:
        ranges, extents = _split_for_dropping(ranges, block_size, extents)
    try:
        digests = []
        for index, (offset, length) in enumerate(ranges):
            digests.append(hash_region(fd, offset, length, block_size, method,
                                       None if extents is None else extents[index]))
            if drop_cache and fast_paths_enabled():
                if device:  # (its last page may be short: dropped too)
                    from pdiffcopy.local.directio import drop_pages

                    drop_pages(fd, offset, length)
                else:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        return b"".join(digests)
    except OSError as error:
        raise storage_error(error, f"read {path}") from None
    finally:
        os.close(fd)


#: A device's pages are dropped from the cache after about this many bytes are hashed (not
#: only at the end of a segment): the host's cache lends the sync little more than this.
DROP_SPAN_BYTES = 8 * 1024 * 1024


def _split_for_dropping(ranges: Sequence[ByteRange], block_size: int,
                        extents: Optional[Sequence[Sequence[ByteRange]]] = None
                        ) -> "Tuple[List[ByteRange], Optional[List[List[ByteRange]]]]":
    """``ranges`` cut into pieces of about :data:`DROP_SPAN_BYTES`, whole blocks each, with each
    piece's share of the ranges' ``extents`` (if known)."""
    span = max(block_size, DROP_SPAN_BYTES - DROP_SPAN_BYTES % block_size)
    pieces: List[ByteRange] = []
    shares: List[List[ByteRange]] = []
    for index, (offset, length) in enumerate(ranges):
        for start in range(offset, offset + length, span):
            piece = (start, min(span, offset + length - start))
            pieces.append(piece)
            if extents is not None:
                end = piece[0] + piece[1]
                shares.append([(max(first, start), min(first + size, end) - max(first, start))
                               for first, size in extents[index] if first < end and first + size > start])
    return pieces, (shares if extents is not None else None)


def _hash_device_direct(path: str, ranges: Sequence[ByteRange], block_size: int, method: str,
                        extents: Optional[Sequence[Sequence[ByteRange]]] = None) -> bytes:
    """:func:`hash_file_ranges` of a block device with ``O_DIRECT`` (its holes, if known, not read)."""
    from pdiffcopy.local import directio
    from pdiffcopy.local.devices import open_device, sector_size

    fd = open_device(path, os.O_RDONLY)
    direct_fd = -1
    try:
        direct_fd = open_device(path, os.O_RDONLY | directio.O_DIRECT)
        size, unit = descriptor_size(fd), sector_size(fd)
        return b"".join(
            directio.hash_region_direct(direct_fd, fd, size, unit, offset, length, block_size, method,
                                        hole_blocks(fd, offset, max(0, min(offset + length, size) - offset),
                                                    block_size, None if extents is None else extents[index]))
            for index, (offset, length) in enumerate(ranges))
    except OSError as error:
        raise storage_error(error, f"read {path}") from None
    finally:
        if direct_fd >= 0:
            os.close(direct_fd)
        os.close(fd)

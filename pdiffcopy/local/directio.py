"""Reading and writing a block device around the page cache (``O_DIRECT``: ``--cache direct``).

Direct I/O moves data between the device and this process's memory with no copy in the page
cache, so a sync of a big volume leaves the host's cache (its running VMs') as it was, and
nothing has to be dropped afterwards. The kernel wants offsets, lengths and buffer addresses
that are multiples of the device's logical sector size: the buffers here are anonymous
mappings (page-aligned), and what a range has beyond its aligned part goes through an
ordinary descriptor, then is dropped from the cache.

Writes go direct only for whole memory pages inside the written range; a page a write only
partly covers is written through the cache. A page written through the cache is written
back whole: were a direct write to reach part of it meanwhile, the write-back would put
the page's older bytes over it. Pages that two writes share are partial for both, so no
page is ever written both ways.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Iterable, Iterator, List, Tuple

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.hashing import finish, new_hasher, zero_digest
from pdiffcopy.local.descriptors import write_all

#: What one direct read or write moves at most (the buffer's size, past the alignment's slack).
DIRECT_CHUNK_BYTES = 4 * 1024 * 1024

O_DIRECT = getattr(os, "O_DIRECT", 0)


def available() -> bool:
    """Whether this system has ``O_DIRECT`` (Linux)."""
    return O_DIRECT != 0


def drop_pages(fd: int, offset: int, length: int) -> None:
    """Drop the pages holding ``[offset, offset + length)`` from the page cache, the partial
    ones at its edges too (``POSIX_FADV_DONTNEED`` keeps a page the range only partly covers:
    a device's last, short page would stay)."""
    if length <= 0:
        return
    page = mmap.PAGESIZE
    start = offset - offset % page
    end = -(-(offset + length) // page) * page
    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


class AlignedBuffer:
    """Page-aligned memory for direct I/O of up to ``size`` bytes at any sector-aligned offset."""

    def __init__(self, size: int, unit: int) -> None:
        self.unit = unit
        span = size + 2 * max(unit, mmap.PAGESIZE)
        self._mapping = mmap.mmap(-1, -(-span // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.view = memoryview(self._mapping)

    def close(self) -> None:
        try:
            self.view.release()
            self._mapping.close()
        except BufferError:
            pass  # a caller's view of the last chunk is still alive: unmapped when it goes


def read_into(direct_fd: int, buffered_fd: int, size: int, buffer: AlignedBuffer, offset: int,
              length: int) -> memoryview:
    """The bytes ``[offset, offset + length)`` of a device of ``size`` bytes, read around the cache.

    The sector-aligned span holding them is read direct into ``buffer``; a tail past the
    device's last whole sector (a size that is not a multiple of it) is read through
    ``buffered_fd`` and dropped from the cache again.

    :returns: A view of ``buffer`` (valid until its next use), shorter at the device's end.
    :raises OSError: When reading fails.
    """
    unit = buffer.unit
    end = min(offset + length, size)
    if end <= offset:
        return buffer.view[:0]
    start = offset - offset % unit
    direct_end = min(-(-end // unit) * unit, size - size % unit)
    position = start
    while position < direct_end:
        got = os.preadv(direct_fd, [buffer.view[position - start : direct_end - start]], position)
        if got <= 0:
            raise OSError(5, f"short direct read at {position}")
        position += got
    if end > position:  # the unaligned tail of the device
        tail = os.pread(buffered_fd, end - position, position)
        buffer.view[position - start : position - start + len(tail)] = tail
        drop_pages(buffered_fd, position, end - position)
        position += len(tail)
    return buffer.view[offset - start : min(end, position) - start]


def read_chunks_direct(direct_fd: int, buffered_fd: int, size: int, unit: int, ranges: Iterable[ByteRange],
                       chunk_size: int, copies: bool) -> "Iterator[Tuple[int, bytes | memoryview]]":
    """:func:`~pdiffcopy.local.descriptors.read_chunks` of a device, around the page cache.

    :raises EOFError: When a range goes past the device's end.
    """
    buffer = AlignedBuffer(chunk_size, unit)
    try:
        for offset, length in ranges:
            position, end = offset, offset + length
            while position < end:
                chunk = read_into(direct_fd, buffered_fd, size, buffer, position, min(chunk_size, end - position))
                if not chunk:
                    raise EOFError(f"device ended at {position} bytes, before {end}")
                yield position, (bytes(chunk) if copies else chunk)
                position += len(chunk)
    finally:
        buffer.close()


def hash_region_direct(direct_fd: int, buffered_fd: int, size: int, unit: int, offset: int, length: int,
                       block_size: int, method: str, holes: "List[Tuple[int, int]]") -> bytes:
    """:func:`~pdiffcopy.local.filehash.hash_region` of a device, read around the page cache.

    Blocks smaller than :data:`DIRECT_CHUNK_BYTES` are read many at a time (a refinement's small
    pieces: a direct read has no readahead to gather them), bigger ones a chunk at a time.

    :param holes: The runs of whole blocks that are holes (first, end): their digest is that
                  of zeros, never read.
    """
    per_read = max(1, DIRECT_CHUNK_BYTES // block_size)
    buffer = AlignedBuffer(block_size * per_read if per_read > 1 else DIRECT_CHUNK_BYTES, unit)
    end = offset + length
    try:
        digests: List[bytes] = []
        runs = iter(holes)
        hole_first, hole_end = next(runs, (-1, -1))
        block, count = 0, -(-length // block_size)
        while block < count:
            if block == hole_first:
                digests.append(zero_digest(method, block_size) * (hole_end - hole_first))
                block = hole_end
                hole_first, hole_end = next(runs, (-1, -1))
                continue
            last = min(count, block + per_read, hole_first if hole_first > block else count)
            start = offset + block * block_size
            if per_read > 1:  # whole blocks in one read (shorter at the device's end)
                data = read_into(direct_fd, buffered_fd, size, buffer, start,
                                 min(end, offset + last * block_size) - start)
                for index in range(last - block):
                    hasher = new_hasher(method)
                    hasher.update(data[index * block_size : (index + 1) * block_size])
                    digests.append(finish(hasher, method))
                block = last
                continue
            position, block_end = start, min(start + block_size, end, size)
            hasher = new_hasher(method)
            while position < block_end:
                data = read_into(direct_fd, buffered_fd, size, buffer, position,
                                 min(DIRECT_CHUNK_BYTES, block_end - position))
                if not data:
                    break
                hasher.update(data)
                position += len(data)
            digests.append(finish(hasher, method))
            block += 1
        return b"".join(digests)
    finally:
        buffer.close()


class DirectWriter:
    """Writes to a device: whole pages direct, the partial pages at a write's edges through the cache.

    One buffer per thread: the transfer threads write concurrently.
    """

    def __init__(self, direct_fd: int, buffered_fd: int) -> None:
        self.direct_fd = direct_fd
        self.buffered_fd = buffered_fd
        self._local = threading.local()

    def _buffer(self) -> AlignedBuffer:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = AlignedBuffer(DIRECT_CHUNK_BYTES, mmap.PAGESIZE)
        return buffer

    def write(self, data: "bytes | memoryview", offset: int) -> None:
        view = memoryview(data).cast("B")
        end = offset + len(view)
        page = mmap.PAGESIZE
        first = -(-offset // page) * page
        last = end - end % page
        if last <= first:
            write_all(self.buffered_fd, view, offset)
            return
        if first > offset:
            write_all(self.buffered_fd, view[: first - offset], offset)
        buffer = self._buffer()
        position = first
        while position < last:
            length = min(DIRECT_CHUNK_BYTES, last - position)
            buffer.view[:length] = view[position - offset : position - offset + length]
            written = 0
            while written < length:
                done = os.pwritev(self.direct_fd, [buffer.view[written:length]], position + written)
                if done <= 0:
                    raise OSError(5, f"short direct write at {position + written}")
                written += done
            position += length
        if end > last:
            write_all(self.buffered_fd, view[last - offset :], last)


__all__ = ["AlignedBuffer", "DIRECT_CHUNK_BYTES", "DirectWriter", "O_DIRECT", "available", "drop_pages",
           "hash_region_direct", "read_chunks_direct", "read_into"]

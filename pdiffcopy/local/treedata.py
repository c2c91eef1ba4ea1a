"""The bytes of a tree's files that are copied whole: read in one go, written in one go,
holes kept (a sparse file's, and with ``-S`` its runs of zeros), and a file that changed
while it was copied told apart (:class:`TreeFailure`). The loops are
:mod:`~pdiffcopy.local.descriptors`'; what is a tree's own is the checking.
"""

from __future__ import annotations

import os

from pdiffcopy.core.entries import Entry
from pdiffcopy.errors import PdiffcopyError
from pdiffcopy.local.descriptors import (
    TRANSFER_CHUNK_SIZE,
    copy_available,
    data_extents,
    read_chunks,
    write_all,
    write_around_zeros,
)


class TreeFailure(PdiffcopyError):
    """One path of a batch could not be handled; the batch goes on."""


def read_exactly(fd: int, size: int, strict: bool = True) -> bytes:
    """All of a file that must be ``size`` bytes long (strict: no more, no less)."""
    data = os.read(fd, size + 1) if size < TRANSFER_CHUNK_SIZE else _read_all(fd, size + 1)
    if len(data) != size:
        if strict:
            raise TreeFailure(f"changed while copying ({len(data)} bytes, expected {size})")
        return b""
    return data


def _read_all(fd: int, limit: int) -> bytes:
    pieces = []
    total = 0
    while total < limit:
        piece = os.read(fd, min(TRANSFER_CHUNK_SIZE, limit - total))
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
    return b"".join(pieces)


#: Granularity of holes kept in files written from memory (sparse ones, and all with -S): the
#: block of most file systems; a smaller run of zeros would only be written as zeros anyway.
_HOLE_BLOCK = 4096


def write_data(fd: int, entry: Entry, data: bytes, zeros_to_holes: bool = False) -> None:
    """Write a new file's ``data``; a sparse entry's (or with ``zeros_to_holes``, any) zero blocks stay holes."""
    if len(data) != entry.size:
        raise TreeFailure(f"got {len(data)} bytes, expected {entry.size}")
    if entry.sparse or zeros_to_holes:
        _write_sparse(fd, data, 0)
        os.ftruncate(fd, len(data))
        return
    write_all(fd, data, 0)


def _write_sparse(fd: int, data: "bytes | memoryview", offset: int) -> int:
    """Write ``data`` at ``offset`` of a new file but its runs of whole zero blocks, which stay holes;
    return the bytes written."""
    return write_around_zeros(fd, data, offset, _HOLE_BLOCK)[1]


def copy_data(source_fd: int, target_fd: int, entry: Entry, zeros_to_holes: bool = False) -> int:
    """Copy a whole file of ``entry.size`` bytes, keeping holes of a sparse one; return the bytes written.

    One byte more than the size is asked for: getting it means the file grew.

    :param zeros_to_holes: -S: the runs of zero blocks in the data become holes too (read and
                           written here, not copied by the kernel, which would write them).
    """
    if zeros_to_holes:
        written = _copy_zeros_as_holes(source_fd, target_fd, entry)
        copied = entry.size + len(os.pread(source_fd, 1, entry.size))
    elif entry.sparse:
        written = _copy_sparse(source_fd, target_fd, entry.size)
        copied = entry.size + len(os.pread(source_fd, 1, entry.size))
    else:
        copied = written = copy_available(source_fd, target_fd, 0, entry.size + 1, probe_last_byte=True)
    if copied != entry.size:
        raise TreeFailure(f"changed while copying ({'longer' if copied > entry.size else 'shorter'} "
                          f"than {entry.size} bytes)")
    return written


def _copy_zeros_as_holes(source_fd: int, target_fd: int, entry: Entry) -> int:
    """Copy a file's data (a sparse one's extents) into a new file, leaving its zero blocks holes;
    return the bytes written."""
    extents = data_extents(source_fd, 0, entry.size) if entry.sparse else [(0, entry.size)]
    written = 0
    try:
        for position, chunk in read_chunks(source_fd, extents, TRANSFER_CHUNK_SIZE, copies=False):
            written += _write_sparse(target_fd, chunk, position)
    except EOFError:
        raise TreeFailure(f"changed while copying (shorter than {entry.size} bytes)") from None
    os.ftruncate(target_fd, entry.size)
    return written


def _copy_sparse(source_fd: int, target_fd: int, size: int) -> int:
    """Copy a sparse file's data extents into a new file; return the bytes copied."""
    written = 0
    for start, length in data_extents(source_fd, 0, size):
        if copy_available(source_fd, target_fd, start, length) < length:
            raise TreeFailure(f"changed while copying (shorter than {size} bytes)")
        written += length
    os.ftruncate(target_fd, size)
    return written


__all__ = ["TreeFailure", "copy_data", "read_exactly", "write_data"]

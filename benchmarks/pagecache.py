"""How much of a file or block device is in the page cache (``mincore``), and dropping it.

``fincore`` from util-linux sizes its mapping by ``st_size``, which is 0 for a block device: it
reports nothing for ``/dev/loopN``. Here the mapping is as long as the device
(``BLKGETSIZE64``) and ``mincore`` tells which of its pages are resident. Used by
``device_bench.py`` and by ``tests/test_device_direct.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import stat
import struct
import sys

BLKGETSIZE64 = 0x80081272
BLKFLSBUF = 0x1261

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MAP_FAILED = ctypes.c_void_p(-1).value

#: Pages asked about per mincore call (a mapping of this many pages at a time: 8 TiB costs no memory).
WINDOW_PAGES = 1 << 18


def size_of(fd: int) -> int:
    info = os.fstat(fd)
    if stat.S_ISBLK(info.st_mode):
        return struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
    return info.st_size


def resident_bytes(path: str) -> int:
    """The bytes of ``path`` (a file or a block device) now in the page cache."""
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        size = size_of(fd)
        resident = 0
        window = WINDOW_PAGES * page
        vector = (ctypes.c_ubyte * WINDOW_PAGES)()
        for offset in range(0, size, window):
            length = min(window, size - offset)
            address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if address in (None, MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                if _libc.mincore(address, length, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                pages = -(-length // page)
                resident += sum(1 for index in range(pages) if vector[index] & 1)
            finally:
                _libc.munmap(address, length)
        return resident * page
    finally:
        os.close(fd)


def drop(path: str, write_back: bool = True) -> None:
    """Drop ``path``'s clean pages from the page cache (written back first unless ``write_back`` is
    False); a device's buffers too. A device's fsync counts as a write in its ``stat`` (a flush of no
    sectors): a digest record made before it would see the device as written since."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if write_back:
            os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if stat.S_ISBLK(os.fstat(fd).st_mode):
            try:
                fcntl.ioctl(fd, BLKFLSBUF)
            except OSError:
                pass
    finally:
        os.close(fd)


if __name__ == "__main__":  # python3 benchmarks/pagecache.py PATH...: what is cached of each
    for name in sys.argv[1:]:
        print(f"{resident_bytes(name):>14} {name}")

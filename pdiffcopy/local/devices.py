"""Block devices: their size, their exclusive claim, their zeroing and discard, their I/O counters.

A block device (an LVM volume, a loop device, a zvol, an iSCSI LUN) is synced as a file of
fixed size: its ``st_size`` is 0, so its size comes from ``BLKGETSIZE64``; it is never
truncated, renamed or unlinked; its zeros are written, or discarded with ``-S``, by the
device's own operations (``fallocate`` on a block device is the kernel's interface to
``REQ_OP_WRITE_ZEROES`` and discard). Linux only: elsewhere nothing here is a device.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import NamedTuple, Optional

from pdiffcopy.errors import NotAFile, PdiffcopyError, storage_error
from pdiffcopy.local import libc

#: ``_IOR(0x12, 114, size_t)``: the device's size in bytes.
BLKGETSIZE64 = 0x80081272
#: ``_IO(0x12, 104)``: the logical sector size (O_DIRECT's alignment).
BLKSSZGET = 0x1268
#: ``_IO(0x12, 127)``: zero a range, by the device's own command where it has one.
BLKZEROOUT = 0x127F

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

#: What fallocate or an ioctl says when a device cannot do the operation.
_CANNOT = frozenset({errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EINVAL,
                     errno.ENOSYS, errno.ENOTTY, errno.ENODEV})


def is_block_device(path: str) -> bool:
    """Whether ``path`` (symlinks followed) names a block device."""
    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False


def is_device_descriptor(fd: int) -> bool:
    return stat.S_ISBLK(os.fstat(fd).st_mode)


def device_size(fd: int) -> int:
    """The size in bytes of the block device open as ``fd``."""
    import fcntl
    import struct

    return struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]


def descriptor_size(fd: int) -> int:
    """The size of an open file, or of an open block device (whose ``st_size`` is 0)."""
    info = os.fstat(fd)
    return device_size(fd) if stat.S_ISBLK(info.st_mode) else info.st_size


def sector_size(fd: int) -> int:
    """The device's logical sector size: what O_DIRECT aligns offsets, lengths and buffers to."""
    import fcntl
    import struct

    try:
        return struct.unpack("i", fcntl.ioctl(fd, BLKSSZGET, b"\0" * 4))[0]
    except OSError:
        return 512


def open_device(path: str, flags: int) -> int:
    """Open the block device ``path`` (a symlink to one, as ``/dev/vg/lv`` is, followed).

    :raises PdiffcopyError: :class:`NotAFile` for anything but a block device (a character
            device is never opened: some have effects on open), or what the kernel said.
    """
    try:
        info = os.stat(path)
    except OSError as error:
        raise storage_error(error, f"open {path}") from None
    if not stat.S_ISBLK(info.st_mode):
        raise NotAFile(f"Not a block device: {path}")
    try:
        fd = os.open(path, flags | os.O_CLOEXEC)
    except OSError as error:
        raise _device_error(error, path) from None
    if not stat.S_ISBLK(os.fstat(fd).st_mode):  # replaced between the stat and the open
        os.close(fd)
        raise NotAFile(f"Not a block device: {path}")
    return fd


def claim(path: str) -> int:
    """An exclusive claim on the device (``O_EXCL``), held while the descriptor is open.

    The kernel refuses it while the device is mounted, used by device-mapper or md, or claimed
    by another program (another pdiffcopy writing it, a VM started with ``locking``): writing
    a device something else uses would corrupt it. Other descriptors, exclusive or not, still
    read and write it; only a second claim is refused, even in this process.
    """
    return open_device(path, os.O_RDONLY | os.O_EXCL)


def _device_error(error: OSError, path: str) -> PdiffcopyError:
    if error.errno == errno.EBUSY:
        from pdiffcopy.errors import Locked

        return Locked(f"Cannot write {path}: the device is in use (mounted, part of a volume, "
                      f"or claimed by another program)")
    return storage_error(error, f"open {path}")


def _fallocate(fd: int, mode: int, offset: int, length: int) -> bool:
    """``fallocate`` on the device; False where it cannot do this ``mode``."""
    function = libc.fallocate()
    if function is None:
        return False
    try:
        libc.call(function, fd, mode, offset, length)
    except OSError as error:
        if error.errno in _CANNOT:
            return False
        raise
    return True


def discard_zeros(fd: int, offset: int, length: int) -> bool:
    """Make ``[offset, offset + length)`` read as zeros by unmapping it (``-S``: a thin volume
    gives its blocks back, a loop device punches its backing file).

    :returns: False where the device cannot unmap with zeros guaranteed (then write zeros).
    """
    return length <= 0 or _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)


def zero_range(fd: int, offset: int, length: int) -> bool:
    """Write zeros over a range by the device's own operation (``REQ_OP_WRITE_ZEROES``);
    False where it has none (then write them)."""
    if length <= 0 or _fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, offset, length):
        return True
    import fcntl
    import struct

    try:
        fcntl.ioctl(fd, BLKZEROOUT, struct.pack("QQ", offset, length))
    except OSError as error:
        if error.errno not in _CANNOT:
            raise
        return False
    return True


class Counters(NamedTuple):
    """A device's I/O counters since boot (``/sys/dev/block/MAJ:MIN/stat``)."""

    sectors_read: int
    writes: int
    sectors_written: int

    @property
    def bytes_read(self) -> int:
        return self.sectors_read * 512


def counters(rdev: int) -> Optional[Counters]:
    """The I/O counters of the device ``rdev`` (``st_rdev``); None where sysfs does not say."""
    try:
        with open(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/stat") as handle:
            fields = handle.read().split()
        return Counters(int(fields[2]), int(fields[4]), int(fields[6]))
    except (OSError, IndexError, ValueError):
        return None


def identity(fd: int) -> str:
    """An entity tag of the device that changes when anything writes it (its write counters),
    or when it is another device or resized: a device has no mtime to tell."""
    rdev = os.fstat(fd).st_rdev
    seen = counters(rdev)
    # Sectors, not requests: a flush (fsync) is a write request of no sector, and changes nothing.
    written = f"{seen.sectors_written:x}" if seen is not None else "?"
    return f'"dev{os.major(rdev)}:{os.minor(rdev)}-{device_size(fd):x}-{written}"'


__all__ = ["BLKGETSIZE64", "Counters", "claim", "counters", "descriptor_size", "device_size", "discard_zeros",
           "identity", "is_block_device", "is_device_descriptor", "open_device", "sector_size", "zero_range"]

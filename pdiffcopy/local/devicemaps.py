"""Devices that know their holes: the data map of a block device, one provider per kind.

A file says where its holes are (``SEEK_DATA``/``SEEK_HOLE``: :func:`~pdiffcopy.local.descriptors.data_extents`);
a block device does not (the kernel answers "all data"), but many know it all the same: a loop
device over a sparse image (its backing file's map, shifted by its offset), an LVM thin volume
(its pool's mappings). Where a device's kind is known, its unmapped ranges are the holes of a
sparse file: never read, hashed as zeros, discarded on a target with ``-S``.

The interface is :class:`DeviceMap` (its :meth:`~DeviceMap.extents` give the same shape as
``data_extents``), and :func:`device_map` asks each provider of :data:`PROVIDERS` in turn. A
provider is a function ``(fd, info) -> Optional[DeviceMap]`` given the open device and its
``fstat``: it answers None for a device that is not its kind, or whose map it cannot trust
(then everything is data: never a wrong hole). A new kind (a zvol, a Ceph RBD image's
``rbd diff``) is one more such function, appended to :data:`PROVIDERS`.
"""

from __future__ import annotations

import bisect
import logging
import os
import stat
import struct
from array import array
from typing import Callable, Iterable, List, Optional, Sequence

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import PdiffcopyError
from pdiffcopy.local import libc, thinpool
from pdiffcopy.local.descriptors import (
    SYNC_FILE_RANGE_WAIT_AFTER,
    SYNC_FILE_RANGE_WAIT_BEFORE,
    SYNC_FILE_RANGE_WRITE,
    REFUSALS,
    data_extents,
    fast_paths_enabled,
)
from pdiffcopy.local.devices import device_size

logger = logging.getLogger(__name__)


class DeviceMap:
    """Which ranges of one block device hold data: the rest read as zeros and need never be read."""

    #: What kind of map this is (``loop``, ``thin``), for logs and reports.
    kind = "?"
    #: Whether each answer is asked of the device afresh (a loop device's backing file), so that
    #: it follows writes; a map read once (a thin pool's snapshot) holds for a device nobody writes.
    live = True

    def extents(self, offset: int, length: int, limit: Optional[int] = None) -> List[ByteRange]:
        """The extents of ``[offset, offset + length)`` (within the device) that hold data, in order.

        :param limit: Stop after this many extents (the caller asks again from the last one's end).
        """
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the map holds open."""


#: ``(fd, os.fstat(fd)) -> Optional[DeviceMap]``; a provider whose maps are read once says so
#: with an attribute ``live = False`` (then it is not asked for a device being written).
Provider = Callable[[int, os.stat_result], Optional[DeviceMap]]


def device_map(fd: int, live_only: bool = False) -> Optional[DeviceMap]:
    """The data map of the block device open as ``fd``, from the first provider that knows it; else None.

    None also with the fast paths off (:func:`~pdiffcopy.local.descriptors.fast_paths_enabled`):
    then a device is all data, as it is without a provider.

    :param live_only: Only maps asked afresh each time (a device being written): the providers
                      whose maps are read once (their ``live`` attribute False) are not asked.
    """
    info = os.fstat(fd)
    if not stat.S_ISBLK(info.st_mode) or not fast_paths_enabled():
        return None
    for provider in PROVIDERS:
        if live_only and not getattr(provider, "live", True):
            continue
        found = provider(fd, info)
        if found is not None:
            logger.debug("%s map of device %d:%d", found.kind, os.major(info.st_rdev), os.minor(info.st_rdev))
            return found
    return None


def write_back(fd: int) -> None:
    """Write what waits in the device's page cache to the device, and wait for it.

    Without a flush of the device's own cache (``fsync`` would add one, which its write
    counters count as a write: :func:`~pdiffcopy.local.devices.identity` would see a change).
    """
    function = libc.sync_file_range()
    if function is not None:
        try:
            libc.call(function, fd, 0, 0,
                      SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER)
            return
        except OSError as error:
            if error.errno not in REFUSALS:
                raise
    os.fsync(fd)


def _clip(extents: Sequence[ByteRange], offset: int, end: int) -> List[ByteRange]:
    clipped = []
    for start, length in extents:
        start, stop = max(start, offset), min(start + length, end)
        if stop > start:
            clipped.append((start, stop - start))
    return clipped


# -- loop devices ----------------------------------------------------------------

#: ``LOOP_GET_STATUS64`` (linux/loop.h): the backing file's device and inode, the offset and size limit.
LOOP_GET_STATUS64 = 0x4C05
#: ``struct loop_info64``: lo_device, lo_inode, lo_rdevice, lo_offset, lo_sizelimit (u64);
#: lo_number, lo_encrypt_type, lo_encrypt_key_size, lo_flags (u32); names and key (64+64+32); lo_init (2 u64).
_LOOP_INFO64 = struct.Struct("=5Q4I64s64s32s2Q")


class LoopStatus:
    """A loop device's binding, as the kernel states it (``LOOP_GET_STATUS64``)."""

    def __init__(self, fd: int) -> None:
        import fcntl

        fields = _LOOP_INFO64.unpack(fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_LOOP_INFO64.size)))
        self.backing_device, self.backing_inode = fields[0], fields[1]
        self.offset, self.size_limit, self.encrypt_type = fields[3], fields[4], fields[6]

    def key(self) -> tuple:
        return self.backing_device, self.backing_inode, self.offset, self.size_limit


class LoopMap(DeviceMap):
    """A loop device's map: its backing file's data map (``SEEK_DATA``), shifted by the loop's offset."""

    kind = "loop"

    def __init__(self, fd: int, backing_fd: int, status: LoopStatus) -> None:
        self._fd, self._backing_fd, self._status = fd, backing_fd, status
        self._size = device_size(fd)

    def extents(self, offset: int, length: int, limit: Optional[int] = None) -> List[ByteRange]:
        end = min(offset + length, self._size)
        if end <= offset:
            return []
        if not self._still_bound():
            return [(offset, end - offset)]  # bound to another file since: its map is not this one's
        # What was written to the device and is still in its page cache is not in the file yet:
        # the file's map would call it a hole.
        write_back(self._fd)
        shift = self._status.offset
        extents = data_extents(self._backing_fd, offset + shift, end - offset, limit)
        return _clip([(start - shift, size) for start, size in extents], offset, end)

    def _still_bound(self) -> bool:
        try:
            return LoopStatus(self._fd).key() == self._status.key()
        except OSError:
            return False

    def close(self) -> None:
        if self._backing_fd >= 0:
            os.close(self._backing_fd)
            self._backing_fd = -1


def loop_map(fd: int, info: os.stat_result) -> Optional[DeviceMap]:
    """The :class:`LoopMap` of a loop device; None for another device, or a backing file deleted or
    replaced (its inode is not the one the loop device reads: then its map would be another file's)."""
    sysfs = f"/sys/dev/block/{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}/loop"
    try:
        with open(f"{sysfs}/backing_file") as handle:
            backing = handle.read().rstrip("\n")
    except OSError:
        return None  # not a loop device (or a partition of one, or an unbound one)
    if not backing or backing.endswith(" (deleted)"):
        return None
    try:
        status = LoopStatus(fd)
    except OSError:
        return None
    if status.encrypt_type:
        return None  # what the device reads is not the file's bytes
    try:
        backing_fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None  # gone, or in another mount namespace
    seen = os.fstat(backing_fd)
    same = (os.major(seen.st_dev), os.minor(seen.st_dev), seen.st_ino) == (
        os.major(status.backing_device), os.minor(status.backing_device), status.backing_inode)
    if not same or not (stat.S_ISREG(seen.st_mode) or stat.S_ISBLK(seen.st_mode)):
        os.close(backing_fd)
        return None
    return LoopMap(fd, backing_fd, status)


# -- LVM thin volumes ----------------------------------------------------------------


class ExtentList(DeviceMap):
    """A map held as sorted, disjoint extents (16 bytes each): read once, asked many times."""

    live = False

    def __init__(self, kind: str, extents: Iterable[ByteRange], size: int) -> None:
        self.kind = kind
        self._starts, self._ends = array("q"), array("q")
        for start, length in extents:  # (a stream: never a list of millions of tuples)
            stop = min(start + length, size)
            if stop > start:
                self._starts.append(start)
                self._ends.append(stop)
        self._size = size

    def extents(self, offset: int, length: int, limit: Optional[int] = None) -> List[ByteRange]:
        end = min(offset + length, self._size)
        found: List[ByteRange] = []
        index = bisect.bisect_right(self._ends, offset)
        while index < len(self._starts) and self._starts[index] < end:
            start, stop = max(self._starts[index], offset), min(self._ends[index], end)
            found.append((start, stop - start))
            index += 1
            if limit is not None and len(found) >= limit:
                break
        return found


def thin_metadata_map(metadata: str, device_id: int, size: int, snapshot: bool = False) -> ExtentList:
    """The map of thin device ``device_id`` of size ``size`` from the pool metadata ``metadata``
    (a device, or a file as ``thin_restore`` makes), read once with ``thin_dump``, as a stream.

    :raises PdiffcopyError: When the tool fails or the pool has no such device.
    """
    with thinpool.dump_mappings(metadata, device_id, snapshot) as (superblock, mappings):
        block = superblock.block_bytes
        return ExtentList("thin", ((first * block, count * block)
                                   for first, count in thinpool.mapped_block_runs(mappings)), size)


def thin_map(fd: int, info: os.stat_result) -> Optional[DeviceMap]:
    """The map of an LVM thin volume, read from its live pool through a metadata snapshot.

    None for a device that is not one, a thin snapshot of an external origin (its unmapped
    blocks read the origin's bytes, not zeros), or where the pool cannot be read (a metadata
    snapshot held by another reader, the tools missing): said once in the log, all data then.
    """
    if thinpool.dm_attribute(info.st_rdev, "uuid") is None:
        return None  # not device-mapper: not even dmsetup is asked
    try:
        found = thinpool.thin_target_of(info.st_rdev)
        if found is None:
            return None
        thin, pool_name, pool = found
        if thin.external_origin is not None:
            return None
        size = device_size(fd)
        write_back(fd)  # what waits in the page cache has no blocks in the pool yet
        with thinpool.reserved_metadata_snapshot(pool_name):
            return thin_metadata_map(thinpool.dm_device_path(pool.metadata), thin.device_id, size, snapshot=True)
    except (PdiffcopyError, OSError) as error:
        logger.warning("Reading the whole device: its thin pool's map is not readable (%s)", error)
        return None


thin_map.live = False  # type: ignore[attr-defined]

#: The providers :func:`device_map` asks, in order: each answers for its own kind of device only.
PROVIDERS: List[Provider] = [loop_map, thin_map]


def device_extents(fd: int, offset: int, length: int) -> List[ByteRange]:
    """The data extents of ``[offset, offset + length)`` of an open device (its map's), or of a file.

    A device without a map is all data. Once per call: for many calls, keep :func:`device_map`'s map.
    """
    found = device_map(fd)
    if found is None:
        return data_extents(fd, offset, length)
    try:
        return found.extents(offset, length)
    finally:
        found.close()


__all__ = ["DeviceMap", "ExtentList", "LoopMap", "PROVIDERS", "Provider", "device_extents", "device_map",
           "loop_map", "thin_map", "thin_metadata_map", "write_back"]

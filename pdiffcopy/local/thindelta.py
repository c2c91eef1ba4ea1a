"""What changed between two thin snapshots, from the pool's own map (``--changed-since``).

Two thin volumes of one pool that map a block to the same data block hold the same bytes
there: the pool shares blocks copy-on-write and gives a written block a new place. So
``thin_delta`` (thin-provisioning-tools), which compares two volumes' mappings in the
pool's metadata, lists a superset of the ranges whose bytes differ: a nightly sync of a
1 TiB volume with 2 GiB changed reads and moves about 2 GiB.

Two parts, kept apart because only the second can run on a machine without device-mapper:

- finding a volume's pool, thin id and metadata (:class:`LvmThinPools`: sysfs and ``dmsetup``,
  and a metadata snapshot reserved while ``thin_delta`` reads the live pool's metadata);
- running ``thin_delta`` and ``thin_dump`` on a metadata device or file and reading their
  answers (:func:`run_thin_delta`, :func:`creation_time`, on the runners and the streamed XML
  of :mod:`pdiffcopy.local.thinpool`), which :class:`MetadataFilePool` uses directly on a file
  (``thin_restore`` builds one from XML).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pdiffcopy.core.records import dataclass
from typing import Dict, List, Optional

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import NotAFile, StorageError, UsageError
from pdiffcopy.local import thinpool

#: The elements of thin_delta's answer that are ranges whose bytes may differ.
DIFFERING = ("different", "left_only", "right_only")


@dataclass(frozen=True)
class ThinVolume:
    """A thin volume: its pool (a name that identifies it), its id in the pool and its metadata."""

    path: str
    pool: str
    thin_id: int
    #: The pool's metadata: a device (a live pool, read through a reserved snapshot) or a file.
    metadata: str
    #: The pool's time when the volume was made (thin_ls CREATE_TIME): ids are reused once freed.
    created: int

    def origin(self) -> dict:
        """What a digest record keeps of the source it was made from."""
        return {"kind": "thin", "pool": self.pool, "thin_id": self.thin_id, "created": self.created,
                "name": self.path}


@dataclass(frozen=True)
class ChangedSince:
    """The ranges of a thin source that may differ from an older snapshot of the same origin."""

    old_name: str
    old_origin: dict
    new_origin: dict
    ranges: List[ByteRange]


def run_thin_delta(metadata: str, old_id: int, new_id: int, metadata_snap: bool = False) -> List[ByteRange]:
    """The byte ranges where thin volume ``new_id`` may differ from ``old_id``, sorted and merged.

    ``thin_delta``'s runs (:func:`~pdiffcopy.local.thinpool.iter_delta`, in the pool's blocks)
    that are ``different``, ``left_only`` (unmapped now: zeros) or ``right_only``; ``same`` runs
    are the blocks both map to one data block.

    :param metadata: The pool's metadata device, or a file of metadata.
    :param metadata_snap: Read the metadata snapshot the pool holds (a live pool's metadata
                          changes while it is read; :meth:`LvmThinPools.changed_ranges` reserves one).
    :raises StorageError: When thin_delta fails (one line: what it said).
    """
    ranges: List[ByteRange] = []
    with thinpool.iter_delta(metadata, old_id, new_id, metadata_snap) as (superblock, runs):
        block = superblock.block_bytes
        for run in runs:
            if run.kind in DIFFERING and run.length:
                offset, length = run.begin * block, run.length * block
                if ranges and ranges[-1][0] + ranges[-1][1] == offset:
                    ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
                else:
                    ranges.append((offset, length))
    return ranges


def creation_time(metadata: str, thin_id: int, metadata_snap: bool = False) -> int:
    """The pool's time when thin volume ``thin_id`` was made: a freed id is given again, at a later time.

    :raises StorageError: When the pool has no such volume.
    """
    device = thinpool.thin_devices(metadata, metadata_snap).get(thin_id)
    if device is None:
        raise StorageError(f"The pool metadata {metadata} has no thin volume {thin_id}")
    return device.creation_time


class ThinPools(ABC):
    """Finds the thin volumes of paths, and what changed between two of one pool."""

    @abstractmethod
    def volume(self, path: str) -> Optional[ThinVolume]:
        """The thin volume at ``path``, or None when it is not one."""

    @abstractmethod
    def changed_ranges(self, old: ThinVolume, new: ThinVolume) -> List[ByteRange]:
        """Where ``new`` may differ from ``old`` (both of one pool)."""

    def changed_since(self, old_path: str, new_path: str) -> ChangedSince:
        """:class:`ChangedSince` of the source ``new_path`` from the snapshot ``old_path``.

        :raises UsageError: When either is not a thin volume, or they are of different pools.
        """
        new = self.volume(new_path)
        if new is None:
            raise NotAFile(f"--changed-since needs a thin volume as the source, and {new_path} is not one")
        old = self.volume(old_path)
        if old is None:
            raise NotAFile(f"--changed-since {old_path}: not a thin volume")
        if old.pool != new.pool:
            raise UsageError(f"--changed-since {old_path}: not in the thin pool of {new_path}")
        return ChangedSince(old_path, old.origin(), new.origin(), self.changed_ranges(old, new))


class MetadataFilePool(ThinPools):
    """A pool's metadata in a file (``thin_restore``'s, or a copy of a stopped pool's), and the paths
    that stand for its volumes: ``{path: thin id}``."""

    def __init__(self, metadata: str, volumes: Dict[str, int]) -> None:
        self.metadata = metadata
        self.volumes = dict(volumes)

    def volume(self, path: str) -> Optional[ThinVolume]:
        if path not in self.volumes:
            return None
        thin_id = self.volumes[path]
        return ThinVolume(path, f"file:{os.path.abspath(self.metadata)}", thin_id, self.metadata,
                          creation_time(self.metadata, thin_id))

    def changed_ranges(self, old: ThinVolume, new: ThinVolume) -> List[ByteRange]:
        return run_thin_delta(self.metadata, old.thin_id, new.thin_id)


class LvmThinPools(ThinPools):
    """Live device-mapper thin pools (LVM's): a volume's table names its pool and id, the pool's
    table its metadata device (:func:`~pdiffcopy.local.thinpool.thin_target_of`); the metadata is
    read through a metadata snapshot reserved for it."""

    def volume(self, path: str) -> Optional[ThinVolume]:
        try:
            rdev = os.stat(path).st_rdev
        except OSError:
            return None
        found = thinpool.thin_target_of(rdev)
        if found is None:
            return None
        thin, pool_name, pool = found
        metadata = thinpool.dm_device_path(pool.metadata)
        with thinpool.reserved_metadata_snapshot(pool_name):
            created = creation_time(metadata, thin.device_id, metadata_snap=True)
        return ThinVolume(path, f"dm:{pool_name}", thin.device_id, metadata, created)

    def changed_ranges(self, old: ThinVolume, new: ThinVolume) -> List[ByteRange]:
        with thinpool.reserved_metadata_snapshot(new.pool.partition(":")[2]):
            return run_thin_delta(new.metadata, old.thin_id, new.thin_id, metadata_snap=True)


__all__ = ["ChangedSince", "LvmThinPools", "MetadataFilePool", "ThinPools", "ThinVolume", "creation_time",
           "run_thin_delta"]

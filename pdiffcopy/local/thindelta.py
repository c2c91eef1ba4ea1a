"""What changed between two thin snapshots, from the pool's own map (``--changed-since``).

Two thin volumes of one pool that map a block to the same data block hold the same bytes
there: the pool shares blocks copy-on-write and gives a written block a new place. So
``thin_delta`` (thin-provisioning-tools), which compares two volumes' mappings in the
pool's metadata, lists a superset of the ranges whose bytes differ: a nightly sync of a
1 TiB volume with 2 GiB changed reads and moves about 2 GiB.

Two parts, kept apart because only the second can run on a machine without device-mapper:

- finding a volume's pool, thin id and metadata (:class:`LvmThinPools`: ``dmsetup``, and a
  metadata snapshot reserved while ``thin_delta`` reads the live pool's metadata);
- running ``thin_delta`` and ``thin_ls`` on a metadata device or file and reading their
  answers (:func:`run_thin_delta`, :func:`parse_thin_delta`, :func:`creation_times`), which
  :class:`MetadataFilePool` uses directly on a file (``thin_restore`` builds one from XML).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree
from abc import ABC, abstractmethod
from pdiffcopy.core.records import dataclass
from typing import IO, Dict, List, Optional, Tuple

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import NotAFile, StorageError, UsageError

#: The elements of thin_delta's answer that are ranges whose bytes may differ.
DIFFERING = ("different", "left_only", "right_only")
#: The pool's block size is counted in sectors of this many bytes.
SECTOR_BYTES = 512


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


def parse_thin_delta(stream: IO[bytes]) -> List[ByteRange]:
    """The byte ranges ``thin_delta``'s XML (read from ``stream``) says differ, sorted and merged.

    Its ranges are in the pool's blocks (``data_block_size`` sectors, on the ``superblock``);
    ``different``, ``left_only`` and ``right_only`` differ, ``same`` does not. Both its short
    form (attributes) and ``--verbose`` (``range`` children) are read.

    :raises StorageError: For an answer that is not thin_delta's.
    """
    block_bytes = 0
    ranges: List[ByteRange] = []
    inside: Optional[str] = None
    try:
        for event, element in ElementTree.iterparse(stream, events=("start", "end")):
            if event == "start":
                if element.tag == "superblock":
                    block_bytes = int(element.get("data_block_size", "0")) * SECTOR_BYTES
                elif element.tag in DIFFERING + ("same",):
                    inside = element.tag
                    if element.get("begin") is not None and inside in DIFFERING:
                        ranges.append(_range(element, block_bytes))
                elif element.tag == "range" and inside in DIFFERING:
                    ranges.append(_range(element, block_bytes))
                continue
            if element.tag in DIFFERING + ("same",):
                inside = None
            element.clear()
    except (ElementTree.ParseError, ValueError) as error:
        raise StorageError(f"thin_delta's answer cannot be read: {error}") from None
    if not block_bytes:
        raise StorageError("thin_delta's answer has no pool block size")
    return _merged(ranges)


def _range(element, block_bytes: int) -> ByteRange:
    if not block_bytes:
        raise ValueError("a range before the pool's block size")
    return int(element.get("begin")) * block_bytes, int(element.get("length")) * block_bytes


def _merged(ranges: List[ByteRange]) -> List[ByteRange]:
    merged: List[ByteRange] = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            end = max(merged[-1][0] + merged[-1][1], offset + length)
            merged[-1] = (merged[-1][0], end - merged[-1][0])
        elif length:
            merged.append((offset, length))
    return merged


def _tool(name: str) -> str:
    found = shutil.which(name) or next((f"{d}/{name}" for d in ("/usr/sbin", "/sbin")
                                        if os.access(f"{d}/{name}", os.X_OK)), None)
    if found is None:
        raise UsageError(f"--changed-since needs {name} (thin-provisioning-tools), which is not installed")
    return found


def _failed(name: str, done: "subprocess.CompletedProcess") -> StorageError:
    said = (done.stderr or b"").decode(errors="replace").strip().splitlines()
    return StorageError(f"{name} failed: {said[0] if said else f'exit status {done.returncode}'}")


def run_thin_delta(metadata: str, old_id: int, new_id: int, metadata_snap: bool = False) -> List[ByteRange]:
    """The byte ranges where thin volume ``new_id`` may differ from ``old_id`` (:func:`parse_thin_delta`).

    :param metadata: The pool's metadata device, or a file of metadata.
    :param metadata_snap: Read the metadata snapshot the pool holds (a live pool's metadata
                          changes while it is read; :meth:`LvmThinPools.changed_ranges` reserves one).
    """
    command = [_tool("thin_delta"), "--snap1", str(old_id), "--snap2", str(new_id)]
    command += ["--metadata-snap"] if metadata_snap else []
    with subprocess.Popen(command + [metadata], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            ranges = parse_thin_delta(process.stdout)
        except StorageError:
            process.wait()
            error = process.stderr.read()
            if process.returncode:
                raise _failed("thin_delta", subprocess.CompletedProcess(command, process.returncode,
                                                                      b"", error)) from None
            raise
        error = process.stderr.read()
    if process.returncode:
        raise _failed("thin_delta", subprocess.CompletedProcess(command, process.returncode, b"", error))
    return ranges


def creation_times(metadata: str, metadata_snap: bool = False) -> Dict[int, int]:
    """Each thin id of the pool and the pool's time when it was made (``thin_ls``)."""
    command = [_tool("thin_ls"), "--no-headers", "--format", "DEV,CREATE_TIME"]
    command += ["--metadata-snap"] if metadata_snap else []
    done = subprocess.run(command + [metadata], capture_output=True)
    if done.returncode:
        raise _failed("thin_ls", done)
    times: Dict[int, int] = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            times[int(fields[0])] = int(fields[1])
    return times


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
        created = creation_times(self.metadata).get(thin_id)
        if created is None:
            raise StorageError(f"The pool metadata {self.metadata} has no thin volume {thin_id}")
        return ThinVolume(path, f"file:{os.path.abspath(self.metadata)}", thin_id, self.metadata, created)

    def changed_ranges(self, old: ThinVolume, new: ThinVolume) -> List[ByteRange]:
        return run_thin_delta(self.metadata, old.thin_id, new.thin_id)


class LvmThinPools(ThinPools):
    """Live device-mapper thin pools (LVM's): a volume's table names its pool and id, the pool's
    table its metadata device; ``thin_delta`` reads a metadata snapshot reserved for it."""

    def _table(self, name: str) -> List[str]:
        done = subprocess.run([_tool("dmsetup"), "table", name], capture_output=True)
        if done.returncode:
            raise _failed("dmsetup", done)
        return done.stdout.decode().split()

    @staticmethod
    def _dm_name(rdev: str) -> Optional[str]:
        try:
            with open(f"/sys/dev/block/{rdev}/dm/name") as handle:
                return handle.read().strip()
        except OSError:
            return None

    def _pool(self, path: str) -> Optional[Tuple[str, int, str]]:
        """(the pool's device-mapper name, the volume's thin id, the metadata device) of ``path``."""
        try:
            rdev = os.stat(path).st_rdev
        except OSError:
            return None
        name = self._dm_name(f"{os.major(rdev)}:{os.minor(rdev)}")
        if name is None:
            return None
        table = self._table(name)  # "0 LENGTH thin POOL_MAJ:MIN THIN_ID [EXTERNAL_ORIGIN]"
        if len(table) < 5 or table[2] != "thin":
            return None
        pool = self._dm_name(table[3])
        if pool is None:
            return None
        pool_table = self._table(pool)  # "0 LENGTH thin-pool META_MAJ:MIN DATA_MAJ:MIN BLOCK ..."
        if len(pool_table) < 4 or pool_table[2] != "thin-pool":
            return None
        return pool, int(table[4]), f"/dev/block/{pool_table[3]}"

    def volume(self, path: str) -> Optional[ThinVolume]:
        found = self._pool(path)
        if found is None:
            return None
        pool, thin_id, metadata = found
        with self._metadata_snapshot(pool):
            created = creation_times(metadata, metadata_snap=True).get(thin_id, -1)
        return ThinVolume(path, f"dm:{pool}", thin_id, metadata, created)

    def changed_ranges(self, old: ThinVolume, new: ThinVolume) -> List[ByteRange]:
        pool = new.pool.partition(":")[2]
        with self._metadata_snapshot(pool):
            return run_thin_delta(new.metadata, old.thin_id, new.thin_id, metadata_snap=True)

    def _metadata_snapshot(self, pool: str):
        return _MetadataSnapshot(_tool("dmsetup"), pool)


class _MetadataSnapshot:
    """A metadata snapshot of a live pool, reserved for as long as the ``with`` block runs."""

    def __init__(self, dmsetup: str, pool: str) -> None:
        self.dmsetup, self.pool = dmsetup, pool

    def _message(self, text: str) -> "subprocess.CompletedProcess":
        return subprocess.run([self.dmsetup, "message", self.pool, "0", text], capture_output=True)

    def __enter__(self) -> "_MetadataSnapshot":
        done = self._message("reserve_metadata_snap")
        if done.returncode:
            raise _failed("dmsetup message reserve_metadata_snap", done)
        return self

    def __exit__(self, *exc) -> None:
        self._message("release_metadata_snap")


__all__ = ["ChangedSince", "LvmThinPools", "MetadataFilePool", "ThinPools", "ThinVolume", "creation_times",
           "parse_thin_delta", "run_thin_delta"]

"""LVM thin pools: their metadata read with thin-provisioning-tools, and their devices found in device-mapper.

A thin pool maps each thin device's blocks (its *origin* blocks, of the pool's data block
size) to blocks of the pool's data device; a block that is not mapped reads as zeros. The
map is the pool's metadata, read here by running the tools that own its format
(``thin_dump``, ``thin_ls``, ``thin_delta``) on a metadata device or file, and parsing
their XML as a stream (:func:`iter_xml`): a pool of millions of mappings is never held
whole. On a live pool the metadata changes under a reader, so it is read through a
*metadata snapshot* (:func:`reserved_metadata_snapshot`, the tools' ``-m``).

The device-mapper side (which pool and thin device id a ``/dev/vg/lv`` is) comes from
sysfs and ``dmsetup table`` (:func:`thin_target_of`); it needs the kernel's device-mapper.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ElementTree
from typing import IO, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import StorageError

#: A sector, the unit of the pool's data block size (``data_block_size``) and of dm tables.
SECTOR_BYTES = 512

#: What a failed tool's error says of its standard error, at most.
TOOL_ERROR_CHARACTERS = 300


class Superblock(NamedTuple):
    """A pool's metadata superblock, as ``thin_dump`` and ``thin_delta`` give it."""

    #: The pool's block size in sectors: a thin device is mapped in blocks of this size.
    data_block_size: int
    nr_data_blocks: int
    transaction: int
    time: int

    @property
    def block_bytes(self) -> int:
        return self.data_block_size * SECTOR_BYTES

    @classmethod
    def from_attributes(cls, attributes: Dict[str, str]) -> "Superblock":
        return cls(int(attributes["data_block_size"]), int(attributes.get("nr_data_blocks", 0)),
                   int(attributes.get("transaction", 0)), int(attributes.get("time", 0)))


class ThinDevice(NamedTuple):
    """A thin device of a pool, as the metadata lists it (``<device>``)."""

    device_id: int
    mapped_blocks: int
    transaction: int
    creation_time: int
    snap_time: int


class Mapping(NamedTuple):
    """A run of a thin device's blocks mapped to consecutive data blocks (a single mapping has length 1)."""

    origin_block: int
    data_block: int
    length: int
    time: int


class DeltaRange(NamedTuple):
    """A run of blocks in ``thin_delta``'s answer: ``kind`` is ``different``, ``left_only``,
    ``right_only`` or ``same``, ``begin`` and ``length`` in blocks."""

    kind: str
    begin: int
    length: int


# -- running the tools ---------------------------------------------------------


def tool_path(name: str) -> str:
    """The path of one of thin-provisioning-tools' programs.

    :raises StorageError: Where it is not installed (a one-line error naming the package).
    """
    found = shutil.which(name) or next((f"{directory}/{name}" for directory in ("/usr/sbin", "/sbin")
                                        if os.access(f"{directory}/{name}", os.X_OK)), None)
    if found is None:
        raise StorageError(f"Cannot read a thin pool's map: {name} is not installed (thin-provisioning-tools)")
    return found


@contextlib.contextmanager
def run_tool(arguments: Sequence[str]) -> Iterator[IO[bytes]]:
    """Run a thin tool; yield its standard output, to read as a stream.

    Its standard error goes to a temporary file (a pipe that nobody reads could fill and
    stop it). Leaving the block waits for it.

    :raises StorageError: When it cannot start, or exits with a failure: one line with its error.
    """
    command = [tool_path(arguments[0]), *arguments[1:]]
    with tempfile.TemporaryFile() as errors:
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
        except OSError as error:
            raise StorageError(f"Cannot run {arguments[0]}: {error.strerror or error}") from None
        assert process.stdout is not None
        try:
            yield process.stdout
        except StorageError:
            # A dump that ends in the middle is malformed: say why the tool stopped, if it failed.
            process.stdout.close()
            status = process.wait()
            if status > 0:
                raise _tool_failed(arguments, status, errors) from None
            raise
        except BaseException:
            process.stdout.close()  # the reader gave up: a tool still writing stops on the closed pipe
            process.wait()
            raise
        process.stdout.close()
        status = process.wait()
        if status != 0:
            raise _tool_failed(arguments, status, errors)


def _tool_failed(arguments: Sequence[str], status: int, errors: IO[bytes]) -> StorageError:
    errors.seek(0)
    said = " ".join(errors.read().decode(errors="replace").split())[:TOOL_ERROR_CHARACTERS]
    return StorageError(f"{arguments[0]} {' '.join(arguments[1:])} failed: {said or f'exit status {status}'}")


def iter_xml(stream: IO[bytes], tags: Optional[Sequence[str]] = None) -> Iterator[Tuple[str, Dict[str, str]]]:
    """The elements of a tool's XML as (tag, attributes), in document order, as they are read.

    Each is given when it starts (its attributes are complete then) and dropped from the tree
    when it ends: memory stays that of the elements open at once, whatever the size.

    :param tags: Only these tags (all where None).
    :raises StorageError: When the XML is malformed (a tool that died in the middle).
    """
    wanted = None if tags is None else frozenset(tags)
    open_elements: List[ElementTree.Element] = []
    try:
        for event, element in ElementTree.iterparse(stream, events=("start", "end")):
            if event == "start":
                open_elements.append(element)
                if wanted is None or element.tag in wanted:
                    yield element.tag, dict(element.attrib)
            else:
                open_elements.pop()
                if open_elements:
                    open_elements[-1].remove(element)  # its earlier siblings are gone: found at once
    except ElementTree.ParseError as error:
        raise StorageError(f"Cannot read a thin pool's map: malformed metadata dump ({error})") from None


def _source(metadata: str, snapshot: bool) -> List[str]:
    return ["-m", metadata] if snapshot else [metadata]


# -- reading the metadata --------------------------------------------------------


def read_superblock(metadata: str, snapshot: bool = False) -> Superblock:
    """The superblock of the pool metadata ``metadata`` (a device or a file).

    :param snapshot: Read its metadata snapshot (a live pool's: :func:`reserved_metadata_snapshot`).
    """
    with run_tool(["thin_dump", "--skip-mappings", *_source(metadata, snapshot)]) as output:
        for _, attributes in iter_xml(output, ("superblock",)):
            superblock = Superblock.from_attributes(attributes)
            output.read()  # the rest (its devices): let the tool finish
            return superblock
    raise StorageError(f"Cannot read a thin pool's map: no superblock in {metadata}")


def thin_devices(metadata: str, snapshot: bool = False) -> Dict[int, ThinDevice]:
    """The thin devices of the pool metadata ``metadata``, by device id (no mappings read)."""
    found: Dict[int, ThinDevice] = {}
    with run_tool(["thin_dump", "--skip-mappings", *_source(metadata, snapshot)]) as output:
        for _, attributes in iter_xml(output, ("device",)):
            device = ThinDevice(int(attributes["dev_id"]), int(attributes.get("mapped_blocks", 0)),
                                int(attributes.get("transaction", 0)), int(attributes.get("creation_time", 0)),
                                int(attributes.get("snap_time", 0)))
            found[device.device_id] = device
    return found


def mapped_bytes(metadata: str, snapshot: bool = False) -> Dict[int, int]:
    """The bytes each thin device of the pool has mapped, by device id (``thin_ls``: no XML, fast)."""
    found: Dict[int, int] = {}
    with run_tool(["thin_ls", "--no-headers", "-o", "DEV,MAPPED_BYTES", *_source(metadata, snapshot)]) as output:
        for line in output:
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
                found[int(fields[0])] = int(fields[1])
    return found


@contextlib.contextmanager
def dump_mappings(metadata: str, device_id: int, snapshot: bool = False
                  ) -> Iterator[Tuple[Superblock, Iterator[Mapping]]]:
    """The superblock and the mappings of thin device ``device_id``, in order of origin block, as read.

    A stream from ``thin_dump --dev-id``: iterate the mappings inside the block.

    :raises StorageError: When the tool fails, or the pool has no such device.
    """
    with run_tool(["thin_dump", "--format", "xml", "--dev-id", str(device_id), *_source(metadata, snapshot)]) as output:
        elements = iter_xml(output, ("superblock", "device", "single_mapping", "range_mapping"))
        tag, attributes = next(elements, ("", {}))
        if tag != "superblock":
            raise StorageError(f"Cannot read a thin pool's map: no superblock in {metadata}")
        superblock = Superblock.from_attributes(attributes)
        seen = [False]

        def mappings() -> Iterator[Mapping]:
            for tag, attributes in elements:
                if tag == "device":
                    seen[0] = int(attributes["dev_id"]) == device_id
                elif not seen[0]:
                    continue
                elif tag == "single_mapping":
                    yield Mapping(int(attributes["origin_block"]), int(attributes["data_block"]), 1,
                                  int(attributes.get("time", 0)))
                else:
                    yield Mapping(int(attributes["origin_begin"]), int(attributes["data_begin"]),
                                  int(attributes["length"]), int(attributes.get("time", 0)))

        stream = mappings()
        first = next(stream, None)
        if first is None and not seen[0]:
            raise StorageError(f"Cannot read a thin pool's map: {metadata} has no thin device {device_id}")

        def all_mappings() -> Iterator[Mapping]:
            if first is not None:
                yield first
            yield from stream

        yield superblock, all_mappings()
        for _ in elements:
            pass  # the rest, so that the tool ends


def mapped_block_runs(mappings: Iterator[Mapping]) -> Iterator[Tuple[int, int]]:
    """Runs of consecutive mapped origin blocks as (first block, count), wherever their data blocks lie."""
    first, end = -1, -1
    for mapping in mappings:
        if mapping.origin_block == end:
            end += mapping.length
            continue
        if end > first:
            yield first, end - first
        first, end = mapping.origin_block, mapping.origin_block + mapping.length
    if end > first:
        yield first, end - first


def mapped_extents(metadata: str, device_id: int, snapshot: bool = False) -> Tuple[int, List[ByteRange]]:
    """The pool's block size and the byte extents thin device ``device_id`` has mapped (its data), merged.

    Everything else of the device reads as zeros: its holes.
    """
    with dump_mappings(metadata, device_id, snapshot) as (superblock, mappings):
        size = superblock.block_bytes
        return size, [(first * size, count * size) for first, count in mapped_block_runs(mappings)]


@contextlib.contextmanager
def iter_delta(metadata: str, left: int, right: int, snapshot: bool = False
               ) -> Iterator[Tuple[Superblock, Iterator[DeltaRange]]]:
    """``thin_delta`` of thin devices ``left`` and ``right``: the superblock, then its runs of blocks.

    A context manager like :func:`dump_mappings`. ``different`` runs are mapped in both and
    differ; ``left_only`` ones are mapped in ``left`` only (holes in ``right``); ``right_only``
    ones in ``right`` only. Unchanged blocks are not listed.
    """
    with run_tool(["thin_delta", "--snap1", str(left), "--snap2", str(right), *_source(metadata, snapshot)]) as output:
        elements = iter_xml(output, ("superblock", "same", "different", "left_only", "right_only"))
        tag, attributes = next(elements, ("", {}))
        if tag != "superblock":
            raise StorageError(f"Cannot read a thin pool's delta: no superblock from {metadata}")

        def ranges() -> Iterator[DeltaRange]:
            for kind, found in elements:
                yield DeltaRange(kind, int(found["begin"]), int(found["length"]))

        yield Superblock.from_attributes(attributes), ranges()
        for _ in elements:
            pass


# -- device-mapper: which pool, which thin device ------------------------------


class ThinTarget(NamedTuple):
    """A thin device's dm table (``thin <pool dev> <dev id> [<external origin dev>]``)."""

    pool: str
    device_id: int
    #: A device whose bytes unmapped blocks read (a thin snapshot of something outside the pool):
    #: then unmapped blocks are not zeros.
    external_origin: Optional[str]


class PoolTarget(NamedTuple):
    """A thin pool's dm table (``thin-pool <metadata dev> <data dev> <data block size> ...``)."""

    metadata: str
    data: str
    data_block_size: int


def parse_thin_table(table: str) -> Optional[ThinTarget]:
    """The thin target of a dm table (``dmsetup table`` of one device), None if it is not one thin target."""
    lines = [line.split() for line in table.splitlines() if line.strip()]
    if len(lines) != 1 or len(lines[0]) < 5 or lines[0][2] != "thin" or not lines[0][4].isdigit():
        return None
    fields = lines[0]
    return ThinTarget(fields[3], int(fields[4]), fields[5] if len(fields) > 5 else None)


def parse_pool_table(table: str) -> Optional[PoolTarget]:
    """The thin-pool target of a dm table, None if it is not one thin-pool target."""
    lines = [line.split() for line in table.splitlines() if line.strip()]
    if len(lines) != 1 or len(lines[0]) < 6 or lines[0][2] != "thin-pool" or not lines[0][5].isdigit():
        return None
    fields = lines[0]
    return PoolTarget(fields[3], fields[4], int(fields[5]))


def dm_attribute(rdev: int, name: str) -> Optional[str]:
    """``/sys/dev/block/MAJ:MIN/dm/<name>`` of a device (``name``, ``uuid``); None where it is not a dm device."""
    try:
        with open(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/dm/{name}") as handle:
            return handle.read().strip()
    except OSError:
        return None


def dm_name_of(device: str) -> Optional[str]:
    """The dm name of a device given as ``MAJ:MIN`` (as tables name them) or a path; None if not dm."""
    if ":" in device and device.replace(":", "").isdigit():
        major, minor = device.split(":")
        return dm_attribute(os.makedev(int(major), int(minor)), "name")
    try:
        return dm_attribute(os.stat(device).st_rdev, "name")
    except OSError:
        return None


def dm_table(name: str) -> str:
    """``dmsetup table NAME``.

    :raises StorageError: When dmsetup fails (no device-mapper, no such device).
    """
    return _dmsetup(["table", name])


def _dmsetup(arguments: Sequence[str]) -> str:
    dmsetup = shutil.which("dmsetup") or "/sbin/dmsetup"
    try:
        done = subprocess.run([dmsetup, *arguments], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as error:
        raise StorageError(f"Cannot run dmsetup: {error.strerror or error}") from None
    if done.returncode:
        said = " ".join(done.stderr.split())[:TOOL_ERROR_CHARACTERS]
        raise StorageError(f"dmsetup {' '.join(arguments)} failed: {said or f'exit status {done.returncode}'}")
    return done.stdout


def thin_target_of(rdev: int) -> Optional[Tuple[ThinTarget, str, PoolTarget]]:
    """Where the dm device ``rdev`` is an LVM thin volume: its thin target, its pool's dm name and table.

    None where it is not (not dm, not LVM's, not one thin target, a pool that is not one thin-pool).

    :raises StorageError: When dmsetup fails on a device that sysfs says is dm.
    """
    uuid = dm_attribute(rdev, "uuid")
    name = dm_attribute(rdev, "name")
    if not uuid or not uuid.startswith("LVM-") or not name:
        return None
    thin = parse_thin_table(dm_table(name))
    if thin is None:
        return None
    pool_name = dm_name_of(thin.pool)
    if pool_name is None:
        return None
    pool = parse_pool_table(dm_table(pool_name))
    return None if pool is None else (thin, pool_name, pool)


@contextlib.contextmanager
def reserved_metadata_snapshot(pool_name: str) -> Iterator[None]:
    """Hold a metadata snapshot of the live pool ``pool_name`` (read it with ``snapshot=True``).

    The pool keeps a frozen copy of its map until it is released (at the end of the block,
    whatever happens): what the thin devices had mapped when it was taken. A pool holds one
    at a time: if another reader holds one, this fails rather than read theirs.

    :raises StorageError: When the pool refuses (one is held already) or dmsetup fails.
    """
    _dmsetup(["message", pool_name, "0", "reserve_metadata_snap"])
    try:
        yield
    finally:
        _dmsetup(["message", pool_name, "0", "release_metadata_snap"])


def dm_device_path(device: str) -> str:
    """A path to open the dm device ``MAJ:MIN`` (a table's name for it) by."""
    name = dm_name_of(device)
    return f"/dev/mapper/{name}" if name else f"/dev/block/{device}"


__all__ = ["DeltaRange", "Mapping", "PoolTarget", "SECTOR_BYTES", "Superblock", "ThinDevice", "ThinTarget",
           "dm_attribute", "dm_device_path", "dm_name_of", "dm_table", "dump_mappings", "iter_delta", "iter_xml",
           "mapped_block_runs", "mapped_bytes", "mapped_extents", "parse_pool_table", "parse_thin_table",
           "read_superblock", "reserved_metadata_snapshot", "run_tool", "thin_devices", "thin_target_of",
           "tool_path"]

"""Devices that know their holes (issue 37): the data map of a block device, by provider.

The thin pool's map is read by the real thin-provisioning-tools from real pool metadata,
made here with ``thin_restore`` from XML (no device-mapper on the test machine); loop
devices are synced end to end over sparse files (the ``loop_devices`` fixture)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tracemalloc

import pytest

from conftest import random_bytes, run_cli
from pdiffcopy.errors import StorageError
from pdiffcopy.local import devicemaps, devices, thinpool
from pdiffcopy.local.descriptors import data_extents

MiB = 1024 * 1024

needs_thin_tools = pytest.mark.skipif(not all(shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin:/bin")
                                              for tool in ("thin_restore", "thin_dump", "thin_ls", "thin_delta")),
                                      reason="thin-provisioning-tools is not installed")

#: Two thin devices of a pool of 64 KiB blocks (128 sectors): single and range mappings,
#: adjacent ones among them (origin 100 and 101, data blocks apart).
POOL_XML = """\
<superblock uuid="" time="1" transaction="2" flags="0" version="2" data_block_size="128" nr_data_blocks="4096">
  <device dev_id="1" mapped_blocks="9" transaction="0" creation_time="0" snap_time="1">
    <single_mapping origin_block="0" data_block="10" time="0"/>
    <range_mapping origin_begin="5" data_begin="20" length="4" time="0"/>
    <single_mapping origin_block="9" data_block="400" time="0"/>
    <single_mapping origin_block="100" data_block="30" time="1"/>
    <single_mapping origin_block="101" data_block="77" time="1"/>
    <single_mapping origin_block="16383" data_block="78" time="1"/>
  </device>
  <device dev_id="7" mapped_blocks="3" transaction="1" creation_time="1" snap_time="1">
    <range_mapping origin_begin="0" data_begin="40" length="3" time="1"/>
  </device>
</superblock>
"""

BLOCK = 128 * 512


def restore(tmp_path, xml: str, name: str = "meta.bin"):
    """Real pool metadata (a file) made by thin_restore from ``xml``."""
    source, metadata = tmp_path / f"{name}.xml", tmp_path / name
    source.write_text(xml)
    with open(metadata, "wb") as handle:
        handle.truncate(8 * MiB)
    done = subprocess.run(["thin_restore", "-i", str(source), "-o", str(metadata)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return str(metadata)


@needs_thin_tools
def test_the_thin_map_on_real_metadata_is_the_xml_mappings_in_bytes(tmp_path):
    metadata = restore(tmp_path, POOL_XML)
    block, extents = thinpool.mapped_extents(metadata, 1)
    assert block == BLOCK
    # Adjacent origin blocks merge whatever their data blocks: 5..9 and 100..101.
    assert extents == [(0, BLOCK), (5 * BLOCK, 5 * BLOCK), (100 * BLOCK, 2 * BLOCK), (16383 * BLOCK, BLOCK)]
    assert thinpool.mapped_extents(metadata, 7) == (BLOCK, [(0, 3 * BLOCK)])
    with thinpool.dump_mappings(metadata, 1) as (superblock, mappings):
        assert superblock == thinpool.Superblock(128, 4096, 2, 1)
        found = [(m.origin_block, m.length) for m in mappings]
    assert sum(length for _, length in found) == 9
    assert thinpool.mapped_bytes(metadata) == {1: 9 * BLOCK, 7: 3 * BLOCK}
    assert sorted(thinpool.thin_devices(metadata)) == [1, 7]


@needs_thin_tools
def test_a_pool_of_many_mappings_is_read_as_a_stream(tmp_path):
    count = 20000  # every other block mapped: nothing merges
    mappings = "".join(f'<single_mapping origin_block="{2 * n}" data_block="{n}" time="0"/>\n' for n in range(count))
    metadata = restore(tmp_path, f'<superblock uuid="" time="0" transaction="1" flags="0" version="2" '
                                 f'data_block_size="128" nr_data_blocks="{count}">\n'
                                 f'<device dev_id="3" mapped_blocks="{count}" transaction="0" creation_time="0" '
                                 f'snap_time="0">\n{mappings}</device>\n</superblock>\n')
    block, extents = thinpool.mapped_extents(metadata, 3)
    assert extents == [(2 * n * BLOCK, BLOCK) for n in range(count)]


def test_the_xml_parser_keeps_only_the_open_elements():
    body = "".join(f'<single_mapping origin_block="{n}" data_block="{n}" time="0"/>' for n in range(200000))
    stream = io.BytesIO(f'<superblock data_block_size="128"><device dev_id="1">{body}</device></superblock>'.encode())
    tracemalloc.start()
    try:
        seen = sum(1 for tag, _ in thinpool.iter_xml(stream) if tag == "single_mapping")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == 200000
    assert peak < 8 * MiB, peak  # the elements are dropped as they end (the whole tree: tens of MiB)


@needs_thin_tools
def test_the_thin_delta_of_two_devices(tmp_path):
    metadata = restore(tmp_path, POOL_XML)
    with thinpool.iter_delta(metadata, 1, 7) as (superblock, ranges):
        found = list(ranges)
    assert superblock.block_bytes == BLOCK
    assert ("different", 0, 1) in found and ("right_only", 1, 2) in found and ("left_only", 5, 5) in found


@needs_thin_tools
@pytest.mark.parametrize("case", ["no such device", "no metadata snapshot", "no such file", "not metadata"])
def test_the_thin_tools_failures_are_one_line_errors(tmp_path, case):
    metadata = restore(tmp_path, POOL_XML)
    if case == "not metadata":
        metadata = str(tmp_path / "junk")
        with open(metadata, "wb") as handle:
            handle.write(b"\x01" * MiB)
    with pytest.raises(StorageError) as raised:
        if case == "no such device":
            thinpool.mapped_extents(metadata, 2)
        elif case == "no metadata snapshot":
            thinpool.mapped_extents(metadata, 1, snapshot=True)
        else:
            thinpool.mapped_extents(metadata if case == "not metadata" else str(tmp_path / "missing"), 1)
    message = str(raised.value)
    assert "\n" not in message and message, message
    assert {"no such device": "no thin device 2", "no metadata snapshot": "metadata snap",
            "no such file": "Couldn't stat", "not metadata": "thin_dump"}[case] in message, message


def test_dm_tables_of_thin_volumes_and_pools():
    # As the kernel's thin-provisioning.rst writes them, and dmsetup prints them.
    assert thinpool.parse_thin_table("0 2097152 thin 253:2 1\n") == thinpool.ThinTarget("253:2", 1, None)
    assert thinpool.parse_thin_table("0 2097152 thin 253:2 13 253:5") == thinpool.ThinTarget("253:2", 13, "253:5")
    assert thinpool.parse_thin_table("0 2097152 linear 8:16 2048") is None
    assert thinpool.parse_thin_table("0 10 thin 253:2 1\n10 10 thin 253:2 2") is None  # two targets
    assert thinpool.parse_pool_table("0 20971520 thin-pool 253:0 253:1 128 32768 1 skip_block_zeroing") == \
        thinpool.PoolTarget("253:0", "253:1", 128)
    assert thinpool.parse_pool_table("0 2097152 thin 253:2 1") is None


# -- loop devices, end to end -------------------------------------------------------

#: Where the sparse images below hold data: (offset, length).
PIECES = [(0, 64 * 1024), (3 * MiB, MiB), (17 * MiB + 4096, 5000), (40 * MiB, 2 * MiB), (63 * MiB, MiB)]


def sparse_image(path, size: int, pieces=PIECES, seed: int = 40):
    with open(path, "wb") as handle:
        handle.truncate(size)
        for index, (offset, length) in enumerate(pieces):
            handle.seek(offset)
            handle.write(random_bytes(length, seed=seed + index))
    return path


def file_map(path, offset: int = 0, length: int = None):
    fd = os.open(path, os.O_RDONLY)
    try:
        return data_extents(fd, offset, os.fstat(fd).st_size - offset if length is None else length)
    finally:
        os.close(fd)


def device_map_of(device: str, offset: int = 0, length: int = 1 << 62):
    fd = os.open(device, os.O_RDONLY)
    try:
        found = devicemaps.device_map(fd)
        if found is None:
            return None
        try:
            return found.extents(offset, length)
        finally:
            found.close()
    finally:
        os.close(fd)


def loop_with(loop_devices, backing, *options: str) -> str:
    done = subprocess.run(["losetup", "--find", "--show", *options, str(backing)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot make a loop device: {done.stderr.strip()}")
    loop_devices.made.append(done.stdout.strip())
    return done.stdout.strip()


def allocated(path) -> int:
    os.sync()
    return os.stat(path).st_blocks * 512


def bytes_read(device: str) -> int:
    seen = devices.counters(os.stat(device).st_rdev)
    assert seen is not None
    return seen.bytes_read


def test_a_loop_devices_map_is_its_backing_files_map(loop_devices, tmp_path):
    backing = sparse_image(tmp_path / "image", 64 * MiB)
    device = loop_devices.over(backing)
    assert device_map_of(device) == file_map(backing)
    assert len(file_map(backing)) == len(PIECES)  # (the file system keeps the holes)
    # A part of it, cut at both ends.
    window = (3 * MiB + 100, 14 * MiB + 4100)
    assert device_map_of(device, *window) == file_map(backing, *window)
    assert device_map_of(device, *window)[0] == (3 * MiB + 100, MiB - 100)
    assert device_map_of(device, 5 * MiB, 4096) == []


def test_a_loop_device_at_an_offset_of_its_file_shifts_the_map(loop_devices, tmp_path):
    backing = sparse_image(tmp_path / "image", 64 * MiB)
    device = loop_with(loop_devices, backing, "--offset", str(3 * MiB), "--sizelimit", str(38 * MiB))
    expected = [(start - 3 * MiB, length) for start, length in file_map(backing, 3 * MiB, 38 * MiB)]
    assert device_map_of(device) == expected
    assert expected[0] == (0, MiB) and expected[-1] == (37 * MiB, MiB) and len(expected) == 3  # cut at its end
    with open(device, "rb") as handle:
        handle.seek(14 * MiB + 4096)
        assert handle.read(5000) == random_bytes(5000, seed=42)


def test_what_waits_in_a_loop_devices_page_cache_is_data(loop_devices, tmp_path):
    """Written to the device and not yet to its file: the file's map alone would call it a hole."""
    backing = sparse_image(tmp_path / "image", 64 * MiB)
    device = loop_devices.over(backing)
    news = random_bytes(MiB, seed=50)
    fd = os.open(device, os.O_WRONLY)
    try:
        # No fsync, and held open (the last close of a device writes its page cache back).
        os.pwrite(fd, news, 30 * MiB)
        assert (30 * MiB, MiB) in device_map_of(device)
        copy = tmp_path / "copy.img"
        done = run_cli(device, str(copy))
        assert done.returncode == 0, done.stderr
    finally:
        os.close(fd)
    with open(copy, "rb") as handle:
        handle.seek(30 * MiB)
        assert handle.read(MiB) == news


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_loop_device_whose_file_is_gone_has_no_map_and_still_syncs(loop_devices, tmp_path, how):
    backing = sparse_image(tmp_path / "image", 64 * MiB)
    expected = backing.read_bytes()
    device = loop_devices.over(backing)
    backing.unlink()
    if how == "replaced":
        backing.write_bytes(bytes(64 * MiB))  # a new file at its name: not what the device reads
    assert device_map_of(device) is None
    copy = tmp_path / "copy.img"
    before = bytes_read(device)
    done = run_cli(device, str(copy))
    assert done.returncode == 0, done.stderr
    assert copy.read_bytes() == expected
    assert bytes_read(device) - before >= 64 * MiB  # all data: read whole


GiB = 1024 * MiB


def test_a_sparse_loop_device_syncs_reading_only_its_data(loop_devices, tmp_path):
    """1 GiB holding a few MiB: a sync to a file and to another device (-S) reads about those MiB."""
    pieces = PIECES + [(700 * MiB, 3 * MiB), (GiB - MiB, MiB)]
    backing = sparse_image(tmp_path / "source.img", GiB, pieces)
    mapped = sum(length for _, length in file_map(backing))
    assert mapped < 12 * MiB
    source = loop_devices.over(backing)
    from pdiffcopy.engine.segments import source_data_bytes
    from pdiffcopy.local.localdevice import LocalDevice

    endpoint = LocalDevice(source)
    try:
        assert endpoint.data_map(0, GiB) == file_map(backing)
        assert source_data_bytes(endpoint, GiB) == mapped  # (what a new file target is checked to hold)
    finally:
        endpoint.close()
    # Each extent is read twice at most: hashed, then moved (what hashing read is dropped from
    # the page cache meanwhile: the cache is the host's VMs'); its holes never.
    read_at_most = 2 * mapped + MiB
    slack = MiB

    copy = tmp_path / "copy.img"
    before = bytes_read(source)
    done = run_cli("--stats", source, str(copy))
    assert done.returncode == 0, done.stderr
    assert bytes_read(source) - before <= read_at_most, done.stderr
    assert subprocess.run(["cmp", source, str(copy)]).returncode == 0
    assert allocated(copy) <= mapped + slack  # its holes are holes of the copy

    # To a device over old data, with -S: the source's holes are discarded there.
    target_backing = tmp_path / "target.img"
    with open(target_backing, "wb") as handle:
        handle.truncate(GiB)
        handle.write(random_bytes(64 * MiB, seed=60))
        handle.seek(700 * MiB)
        handle.write(random_bytes(8 * MiB, seed=61))
    target = loop_devices.over(target_backing)
    before = bytes_read(source)
    done = run_cli("-S", source, target)
    assert done.returncode == 0, done.stderr
    assert bytes_read(source) - before <= read_at_most, done.stderr
    assert subprocess.run(["cmp", source, target]).returncode == 0
    assert allocated(target_backing) <= mapped + slack
    # Again, nothing changed: the target's own holes are not read either.
    before = bytes_read(target)
    done = run_cli("--stats", "-S", source, target)
    assert done.returncode == 0, done.stderr
    assert bytes_read(target) - before <= read_at_most
    assert "0 of 1024 blocks differed" in done.stderr, done.stderr


# -- the thin provider on real metadata ------------------------------------------------


@needs_thin_tools
def test_the_thin_provider_gives_exactly_the_pools_mappings(tmp_path):
    metadata = restore(tmp_path, POOL_XML)
    size = 16384 * BLOCK  # 1 GiB
    found = devicemaps.thin_metadata_map(metadata, 1, size)
    assert not found.live
    assert found.extents(0, size) == [(0, BLOCK), (5 * BLOCK, 5 * BLOCK), (100 * BLOCK, 2 * BLOCK),
                                      (16383 * BLOCK, BLOCK)]
    assert found.extents(6 * BLOCK + 1, 50 * BLOCK) == [(6 * BLOCK + 1, 4 * BLOCK - 1)]
    assert found.extents(0, size, limit=2) == [(0, BLOCK), (5 * BLOCK, 5 * BLOCK)]
    assert found.extents(11 * BLOCK, 89 * BLOCK) == []
    # A device shorter than its mappings (shrunk): only what lies within it.
    assert devicemaps.thin_metadata_map(metadata, 1, 101 * BLOCK).extents(0, size) == [
        (0, BLOCK), (5 * BLOCK, 5 * BLOCK), (100 * BLOCK, BLOCK)]


@pytest.mark.parametrize("block_size", [4096, 64 * 1024, MiB])
def test_hashing_with_a_known_map_gives_the_digests_of_the_bytes(tmp_path, block_size):
    """Blocks partly hole are hashed as their data and zeros: the same digests as reading them."""
    from pdiffcopy.local.filehash import hash_region

    image = sparse_image(tmp_path / "image", 64 * MiB + 1000)
    with open(image, "r+b") as handle:
        handle.seek(64 * MiB)
        handle.write(b"tail" * 250)  # a short last block
    fd = os.open(image, os.O_RDONLY)
    try:
        extents = data_extents(fd, 0, 64 * MiB + 1000)
        for offset, length in [(0, 64 * MiB + 1000), (3 * block_size, 20 * MiB), (17 * MiB, block_size)]:
            within = [(max(s, offset), min(s + n, offset + length) - max(s, offset)) for s, n in extents
                      if s < offset + length and s + n > offset]
            assert hash_region(fd, offset, length, block_size, "sha256", within) == \
                hash_region(fd, offset, length, block_size, "sha256")
    finally:
        os.close(fd)


def read_requests(device: str) -> int:
    """The read requests the device has completed since boot (``/sys/block/*/stat``, its first field)."""
    with open(f"/sys/dev/block/{os.major(os.stat(device).st_rdev)}:{os.minor(os.stat(device).st_rdev)}/stat") as handle:
        return int(handle.read().split()[0])


def test_a_refined_block_of_a_device_with_a_map_is_read_in_few_requests(loop_devices, tmp_path):
    """The refinement hashes a changed 1 MiB block in 4 KiB pieces; a device with a map has its
    readahead off, so the pieces must be asked for together, not one request each (256)."""
    from pdiffcopy.local.localdevice import LocalDevice

    image = tmp_path / "image"
    image.write_bytes(random_bytes(8 * MiB, seed=70))
    device = loop_devices.over(image)
    endpoint = LocalDevice(device)
    try:
        assert endpoint.device_map() is not None  # (a loop device: its file's map)
        fd = os.open(device, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # nothing of it cached
        finally:
            os.close(fd)
        before = read_requests(device)
        digests = endpoint.hash_ranges([(3 * MiB, MiB)], 4096, "sha256")
        requests = read_requests(device) - before
    finally:
        endpoint.close()
    assert digests == b"".join(hashlib.sha256(image.read_bytes()[offset:offset + 4096]).digest()
                               for offset in range(3 * MiB, 4 * MiB, 4096))
    assert 0 < requests <= 32, requests


# -- a map read once (the thin provider's) in a real sync --------------------------------

#: Thin device 1's mappings in a 16 MiB device of 64 KiB blocks.
SMALL_POOL_XML = """\
<superblock uuid="" time="0" transaction="1" flags="0" version="2" data_block_size="128" nr_data_blocks="256">
  <device dev_id="1" mapped_blocks="8" transaction="0" creation_time="0" snap_time="0">
    <single_mapping origin_block="0" data_block="3" time="0"/>
    <range_mapping origin_begin="5" data_begin="10" length="5" time="0"/>
    <range_mapping origin_begin="100" data_begin="20" length="2" time="0"/>
  </device>
</superblock>
"""
SMALL_MAPPED = [(0, BLOCK), (5 * BLOCK, 5 * BLOCK), (100 * BLOCK, 2 * BLOCK)]


@pytest.fixture
def thin_mapped_devices(monkeypatch, tmp_path):
    """Make the thin provider answer, from real restored metadata, for the loop devices in the set it yields."""
    metadata = restore(tmp_path, SMALL_POOL_XML)
    mapped = set()

    def thin_for_these(fd, info):
        if info.st_rdev not in mapped:
            return None
        return devicemaps.thin_metadata_map(metadata, 1, devices.device_size(fd))

    monkeypatch.setattr(devicemaps, "PROVIDERS", [thin_for_these] + devicemaps.PROVIDERS)
    return mapped


@needs_thin_tools
def test_a_device_with_a_thin_map_syncs_reading_only_its_mappings(loop_devices, tmp_path, thin_mapped_devices):
    from pdiffcopy import api

    # A dense image (no holes for the loop provider to see): its data where the pool maps, zeros elsewhere.
    image = bytearray(16 * MiB)
    for index, (start, length) in enumerate(SMALL_MAPPED):
        image[start : start + length] = random_bytes(length, seed=70 + index)
    source, _ = loop_devices.new("thin.img", 16 * MiB, bytes(image))
    thin_mapped_devices.add(os.stat(source).st_rdev)
    copy = tmp_path / "copy.img"
    before = bytes_read(source)
    api.sync(source, str(copy), block_size="64 KiB")
    mapped = sum(length for _, length in SMALL_MAPPED)
    assert bytes_read(source) - before <= 2 * mapped + MiB
    assert copy.read_bytes() == bytes(image)
    assert allocated(copy) <= mapped + MiB


@needs_thin_tools
def test_a_map_read_once_is_not_trusted_after_the_device_is_written(loop_devices, tmp_path, thin_mapped_devices):
    """A thin target is written outside its old mappings: its read-back must read them."""
    from pdiffcopy import api

    data = bytearray(16 * MiB)
    data[50 * BLOCK : 52 * BLOCK] = random_bytes(2 * BLOCK, seed=80)  # unmapped in the target's pool
    data[5 * BLOCK : 6 * BLOCK] = random_bytes(BLOCK, seed=81)
    source = tmp_path / "source.img"
    source.write_bytes(bytes(data))
    target, _ = loop_devices.new("target.img", 16 * MiB)
    thin_mapped_devices.add(os.stat(target).st_rdev)
    api.sync(str(source), target, block_size="64 KiB")
    with open(target, "rb") as handle:
        assert handle.read() == bytes(data)

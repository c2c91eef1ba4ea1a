"""``--changed-since``: only the ranges a thin pool says differ between two snapshots are read and moved.

This machine has loop devices but no device-mapper: the pool's part runs the real
``thin_delta`` and ``thin_ls`` on real pool metadata (a file ``thin_restore`` builds from XML),
and the sync runs end to end on loop devices that stand for the two snapshots
(:class:`~pdiffcopy.local.thindelta.MetadataFilePool` maps their paths to the metadata's ids).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import device_bytes, random_bytes, run_cli, write_through_device
from pdiffcopy import api
from pdiffcopy.errors import Conflict, UsageError
from pdiffcopy.local import devices
from pdiffcopy.local.thindelta import MetadataFilePool, run_thin_delta

MiB = 1024 * 1024
KiB = 1024
SIZE = 16 * MiB
#: The pool's block: 128 sectors.
THIN_BLOCK = 64 * KiB

#: Snapshot 1 maps all 256 blocks; snapshot 2 (made later) has block 80 and blocks 176 to 191
#: written (new data blocks) and block 250 discarded.
METADATA_XML = """\
<superblock uuid="" time="2" transaction="3" version="2" data_block_size="128" nr_data_blocks="1024">
  <device dev_id="1" mapped_blocks="256" transaction="0" creation_time="0" snap_time="1">
    <range_mapping origin_begin="0" data_begin="0" length="256" time="0"/>
  </device>
  <device dev_id="2" mapped_blocks="255" transaction="1" creation_time="1" snap_time="1">
    <range_mapping origin_begin="0" data_begin="0" length="80" time="0"/>
    <single_mapping origin_block="80" data_block="300" time="1"/>
    <range_mapping origin_begin="81" data_begin="81" length="95" time="0"/>
    <range_mapping origin_begin="176" data_begin="400" length="16" time="1"/>
    <range_mapping origin_begin="192" data_begin="192" length="58" time="0"/>
    <range_mapping origin_begin="251" data_begin="251" length="5" time="0"/>
  </device>
</superblock>
"""
DIFFERING = [(80 * THIN_BLOCK, THIN_BLOCK), (176 * THIN_BLOCK, 16 * THIN_BLOCK), (250 * THIN_BLOCK, THIN_BLOCK)]


@pytest.fixture
def metadata(tmp_path) -> str:
    if not shutil.which("thin_restore"):
        pytest.skip("thin-provisioning-tools are not installed")
    xml = tmp_path / "pool.xml"
    xml.write_text(METADATA_XML)
    path = tmp_path / "pool.meta"
    with open(path, "wb") as handle:
        handle.truncate(8 * MiB)
    subprocess.run(["thin_restore", "-i", str(xml), "-o", str(path)], check=True, capture_output=True)
    return str(path)


def sectors_read(device: str) -> int:
    return devices.counters(os.stat(device).st_rdev).sectors_read






def test_thin_delta_on_restored_metadata_gives_exactly_the_differing_ranges(metadata):
    assert run_thin_delta(metadata, 1, 2) == DIFFERING
    assert run_thin_delta(metadata, 2, 1) == DIFFERING  # left and right swapped
    assert run_thin_delta(metadata, 1, 1) == []


def test_thin_delta_errors_are_one_line(metadata):
    from pdiffcopy.errors import StorageError

    with pytest.raises(StorageError, match="thin_delta .*failed: .*snap2"):
        run_thin_delta(metadata, 1, 9)


@pytest.fixture
def snapshots(loop_devices, metadata):
    """Loop devices with the two snapshots' bytes, a target, and the pool that knows them."""
    old_data = random_bytes(SIZE, seed=51)
    new_data = bytearray(old_data)
    new_data[80 * THIN_BLOCK : 81 * THIN_BLOCK] = random_bytes(THIN_BLOCK, seed=52)
    new_data[176 * THIN_BLOCK : 192 * THIN_BLOCK] = random_bytes(16 * THIN_BLOCK, seed=53)
    new_data[250 * THIN_BLOCK : 251 * THIN_BLOCK] = bytes(THIN_BLOCK)
    old, _ = loop_devices.new("snap1.img", SIZE, old_data)
    new, _ = loop_devices.new("snap2.img", SIZE, bytes(new_data))
    target, _ = loop_devices.new("target.img", SIZE, random_bytes(SIZE, seed=54))
    return old, new, target, MetadataFilePool(metadata, {old: 1, new: 2})


def test_only_the_changed_ranges_are_read_and_moved(snapshots, tmp_path):
    old, new, target, pool = snapshots
    record = str(tmp_path / "target.digests")
    api.sync(old, target, digest_file=record, thin_pools=pool)
    assert device_bytes(target, SIZE) == device_bytes(old, SIZE)
    source_before, target_before = sectors_read(new), sectors_read(target)
    result = api.sync(new, target, digest_file=record, changed_since=old, thin_pools=pool)
    # The 1 MiB blocks the three ranges touch (5, 11 and 15): hashed, and moved.
    assert (result.changed_blocks, result.bytes_moved) == (3, 3 * MiB)
    assert (sectors_read(new) - source_before) * 512 <= 6 * MiB
    assert (sectors_read(target) - target_before) * 512 <= 3 * MiB
    assert device_bytes(target, SIZE) == device_bytes(new, SIZE)


def test_what_the_pool_calls_the_same_is_trusted_until_verify_whole(snapshots, tmp_path):
    """A loop device is no thin volume: a change the pool does not list shows what is trusted."""
    old, new, target, pool = snapshots
    record = str(tmp_path / "target.digests")
    api.sync(old, target, digest_file=record, thin_pools=pool)
    write_through_device(new, 2 * MiB, random_bytes(4 * KiB, seed=55))
    api.sync(new, target, digest_file=record, changed_since=old, thin_pools=pool)
    assert device_bytes(target, SIZE) != device_bytes(new, SIZE)
    result = api.sync(new, target, digest_file=record, verify_whole=True, thin_pools=pool)
    assert result.changed_blocks == 1
    assert device_bytes(target, SIZE) == device_bytes(new, SIZE)


def test_changed_since_without_a_record_of_that_snapshot_is_refused(snapshots, tmp_path):
    old, new, target, pool = snapshots
    record = str(tmp_path / "target.digests")
    before = device_bytes(target, SIZE)
    with pytest.raises(UsageError, match="needs the digest record of the last sync"):
        api.sync(new, target, digest_file=record, changed_since=old, thin_pools=pool)
    api.sync(old, target, digest_file=record, thin_pools=MetadataFilePool(pool.metadata, {}))  # not known as thin
    before = device_bytes(target, SIZE)
    with pytest.raises(Conflict, match="was not made from .*snapshot --changed-since counts"):
        api.sync(new, target, digest_file=record, changed_since=old, thin_pools=pool)
    assert device_bytes(target, SIZE) == before


def test_a_source_that_is_no_thin_volume_is_refused_in_one_line(snapshots, tmp_path):
    old, new, target, _ = snapshots  # loop devices: no device-mapper thin volume
    done = run_cli("--digest-file", str(tmp_path / "digests"), "--changed-since", old, new, target)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "needs a thin volume as the source" in lines[0]

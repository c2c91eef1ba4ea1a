"""Devices that know their holes (issue 37): the data map of a block device, by provider.

The thin pool's map is read by the real thin-provisioning-tools from real pool metadata,
made here with ``thin_restore`` from XML (no device-mapper on the test machine); loop
devices are synced end to end over sparse files (the ``loop_devices`` fixture)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tracemalloc

import pytest

from pdiffcopy.errors import StorageError
from pdiffcopy.local import thinpool

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

"""The default delta (``--delta auto``): each file gets the delta its changes call for.

Data shifted by an insertion or a deletion goes by content-defined chunks and sends a few KiB;
data changed in place, and data that shares nothing with the old target, go by fixed blocks as
before. The chunked delta's new copy of the target needs room: without it the blocks do.
Everything runs against the real server and real files; each case checks the target ends
byte-identical and how much crossed.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from conftest import mutate, random_bytes, run_cli
from pdiffcopy import sync, sync_tree
from test_chunked import arrange, inserted, leftovers

MIB = 1024 * 1024
SIZE = 12 * MIB
OLD = random_bytes(SIZE, seed=41)

#: (name, new source, most bytes the default may send): data shifted by a few bytes.
SHIFTED = [
    ("insert-near-start", inserted(OLD, [5000], 100)),
    ("insert-every-4mib", inserted(OLD, range(4 * MIB, SIZE, 4 * MIB), 1)),
    ("delete-near-start", OLD[:5000] + OLD[5100:]),
]


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
@pytest.mark.parametrize("name,source_data", SHIFTED, ids=[case[0] for case in SHIFTED])
def test_the_default_sends_little_for_shifted_data(server, tmp_path, unique, direction, name, source_data):
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, OLD)
    result = sync(source, target, concurrency=2)
    assert path.read_bytes() == source_data
    assert result.verified
    # Fixed blocks would resend everything after the first change: nearly all 12 MiB.
    assert result.bytes_moved < SIZE // 100
    assert leftovers(path) == []


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_unrelated_data_of_the_same_size_goes_by_blocks(server, tmp_path, unique, direction):
    source_data = random_bytes(SIZE, seed=42)
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, OLD)
    done = run_cli("-vv", "--stats", source, target)
    assert done.returncode == 0, done.stderr
    assert path.read_bytes() == source_data
    assert re.search(r": blocks delta \(0% of sampled blocks match in place, 0% of sampled chunks "
                     r"found moved: other data\)", done.stderr), done.stderr
    assert f"moved {SIZE} bytes" in done.stdout


def test_data_changed_in_place_goes_by_blocks(tmp_path):
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    source_data = mutate(OLD, range(0, SIZE, 3 * MIB))
    source.write_bytes(source_data)
    target.write_bytes(OLD)
    done = run_cli("-vv", "--stats", str(source), str(target))
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == source_data
    assert "target.img: blocks delta (" in done.stderr and "match in place)" in done.stderr
    moved = int(re.search(r"moved (\d+) bytes", done.stdout).group(1))
    assert 0 < moved <= 4 * 4096  # four 7-byte edits, one 4 KiB piece each


def test_the_verbose_line_says_chunks_and_why(tmp_path):
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    source.write_bytes(SHIFTED[0][1])
    target.write_bytes(OLD)
    done = run_cli("-vv", str(source), str(target))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if " delta (" in line]
    assert len(lines) == 1, done.stderr
    assert re.search(r"target\.img: chunks delta \(\d+% of sampled blocks match in place, "
                     r"\d+% of sampled chunks found moved\)$", lines[0]), lines[0]


def test_delta_blocks_still_resends_after_an_insertion(server, tmp_path, unique):
    source_data = SHIFTED[0][1]
    source, target, path = arrange("pull", server, tmp_path, unique, source_data, OLD)
    done = run_cli("-vv", "--stats", "--delta", "blocks", source, target)
    assert done.returncode == 0, done.stderr
    assert path.read_bytes() == source_data
    assert "target.img: blocks delta (--delta blocks)" in done.stderr
    moved = int(re.search(r"moved (\d+) bytes", done.stdout).group(1))
    assert moved > SIZE - MIB


def test_trees_choose_per_big_file(ends):
    shifted = inserted(OLD, [5000], 100)
    in_place = mutate(OLD, [MIB])
    for side in (ends.source, ends.target):
        side.mkdir(parents=True, exist_ok=True)
    (ends.source / "shifted.img").write_bytes(shifted)
    (ends.target / "shifted.img").write_bytes(OLD)
    (ends.source / "edited.img").write_bytes(in_place)
    (ends.target / "edited.img").write_bytes(OLD)
    result = sync_tree(ends.source_arg(), ends.target_arg, concurrency=2)
    assert result.failures == []
    assert (ends.target / "shifted.img").read_bytes() == shifted
    assert (ends.target / "edited.img").read_bytes() == in_place
    # Both by blocks: about 12 MiB; the shifted one by chunks: a few KiB.
    assert result.bytes_moved < 128 * 1024


# -- the room for a new copy ---------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MiB tmpfs: room for one 12 MiB file, not two. Skipped unless it can be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("delta", ["auto", "chunks"])
def test_without_room_for_a_new_copy_the_blocks_update_in_place(tmp_path, small_disk, delta):
    source, target = tmp_path / "source.img", small_disk / "target.img"
    source_data = SHIFTED[0][1]
    source.write_bytes(source_data)
    target.write_bytes(OLD)
    done = run_cli("--delta", delta, "--stats", str(source), str(target))
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == source_data
    warnings = [line for line in done.stderr.splitlines() if "Not enough free space" in line]
    assert len(warnings) == 1, done.stderr
    assert "comparing fixed blocks instead" in warnings[0]
    assert "Traceback" not in done.stderr
    assert leftovers(target) == []


@pytest.mark.parametrize("delta", ["auto", "chunks"])
def test_a_tree_without_room_for_a_new_copy_updates_in_place(tmp_path, small_disk, delta):
    source, target = tmp_path / "src", small_disk / "dst"
    source.mkdir()
    target.mkdir()
    (source / "big.img").write_bytes(SHIFTED[0][1])
    (target / "big.img").write_bytes(OLD)
    done = run_cli("--delta", delta, f"{source}/", str(target))
    assert done.returncode == 0, done.stderr
    assert (target / "big.img").read_bytes() == SHIFTED[0][1]
    assert done.stderr.count("Not enough free space") == 1, done.stderr
    assert leftovers(target / "big.img") == []


def test_a_push_without_room_on_the_server_falls_back_too(server, tmp_path, unique):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = server.root / unique.replace(".img", "")
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        source = tmp_path / "source.img"
        source_data = SHIFTED[0][1]
        source.write_bytes(source_data)
        (mount / "target.img").write_bytes(OLD)
        done = run_cli("--delta", "chunks", str(source), server.url(f"{mount.name}/target.img"))
        assert done.returncode == 0, done.stderr
        assert (mount / "target.img").read_bytes() == source_data
        assert done.stderr.count("Not enough free space") == 1, done.stderr
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


# -- the rule's pieces ---------------------------------------------------------


def test_sample_offsets_spread_over_the_file_and_stay_inside():
    from pdiffcopy.engine import autodelta

    piece = autodelta.SAMPLE_PIECE_BYTES
    offsets = autodelta.sample_offsets(SIZE)
    assert len(offsets) == autodelta.SAMPLE_PIECES
    assert offsets[0] == 0 and offsets[-1] >= SIZE * 3 // 4
    assert all(offset % piece == 0 and offset + piece <= SIZE for offset in offsets)
    assert autodelta.sample_offsets(piece - 1) == []
    assert autodelta.sample_offsets(3 * piece) == [0, piece, 2 * piece]

"""The default delta (``--delta auto``): each file gets the delta its changes call for.

Data shifted by an insertion or a deletion goes by content-defined chunks and sends a few KiB;
data changed in place, and data that shares nothing with the old target, go by fixed blocks as
before. The chunked delta's new copy of the target needs room: without it the blocks do.
Everything runs against the real server and real files; each case checks the target ends
byte-identical and how much crossed.
"""

from __future__ import annotations

import functools
import os
import random
import re
import subprocess

import pytest

from conftest import mutate, pdiffcopy_command, random_bytes, run_cli
from pdiffcopy import sync, sync_tree
from test_chunked import arrange, inserted, leftovers
from test_kill_switch_and_confinement import needs_strace

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
    assert re.search(r": blocks delta \(100% of sampled bytes differ in place, 0% of sampled bytes "
                     r"moved: other data\)", done.stderr), done.stderr
    assert f"moved {SIZE} bytes" in done.stdout


def test_data_changed_in_place_goes_by_blocks(tmp_path):
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    source_data = mutate(OLD, range(0, SIZE, 3 * MIB))
    source.write_bytes(source_data)
    target.write_bytes(OLD)
    done = run_cli("-vv", "--stats", str(source), str(target))
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == source_data
    assert "target.img: blocks delta (" in done.stderr and "in place" in done.stderr
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
    assert re.search(r"target\.img: chunks delta \(\d+% of sampled bytes differ in place, "
                     r"\d+% of sampled bytes moved\)$", lines[0]), lines[0]


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


def test_sample_windows_spread_over_the_file_off_the_block_grid():
    from pdiffcopy.engine import autodelta

    window, piece = autodelta.SAMPLE_WINDOW_BYTES, autodelta.SAMPLE_PIECE_BYTES
    windows = autodelta.SAMPLE_WINDOWS
    offsets = autodelta.sample_offsets(SIZE - 100)
    assert len(offsets) == windows and offsets == sorted(offsets)
    assert offsets[0] < SIZE // windows and offsets[-1] >= SIZE * (windows - 1) // windows - piece
    assert all(offset % piece == 0 and offset + window <= SIZE - 100 for offset in offsets)
    assert all(later - earlier >= window for earlier, later in zip(offsets, offsets[1:]))
    # Where each window starts in its 1 MiB block: many different places, not the block's start.
    in_block = [offset % MIB for offset in autodelta.sample_offsets(1024 * MIB)]
    assert len(set(in_block)) >= windows * 3 // 4 and in_block.count(0) <= 1
    assert autodelta.sample_offsets(windows * window - 1) == []


# -- in-place writes at any density, wherever they land in a block ---------------

#: 64 MiB: the old sample's pieces fall every 2 MiB, and so hit every 10th MiB's header.
IN_PLACE_SIZE = 64 * MIB


@functools.lru_cache(maxsize=1)
def in_place_old() -> bytes:
    return random_bytes(IN_PLACE_SIZE, seed=43)


def rewritten_pages(page: int, share: float, seed: int = 44):
    """A change: ``share`` of the ``page``-byte pages, at random page offsets, rewritten in place."""
    def change(data: bytes) -> bytes:
        rng = random.Random(seed)
        pages = len(data) // page
        buffer = bytearray(data)
        for index in rng.sample(range(pages), max(1, round(pages * share))):
            buffer[index * page:(index + 1) * page] = rng.randbytes(page)
        return bytes(buffer)
    return change


def rewritten_at(start: int, step: int, length: int, seed: int = 45):
    """A change: ``length`` random bytes rewritten in place at ``start`` and every ``step`` bytes after."""
    def change(data: bytes) -> bytes:
        rng = random.Random(seed)
        buffer = bytearray(data)
        for position in range(start, len(data), step):
            buffer[position:position + length] = rng.randbytes(length)
        return bytes(buffer)
    return change


#: (name, change): every change a rewrite in place, nothing moved.
IN_PLACE = [
    ("16k-pages-1pct", rewritten_pages(16 * 1024, 0.01)),
    ("16k-pages-10pct", rewritten_pages(16 * 1024, 0.10)),
    ("8k-pages-1pct", rewritten_pages(8 * 1024, 0.01)),
    ("8k-pages-10pct", rewritten_pages(8 * 1024, 0.10)),
    ("4k-at-every-10th-mib", rewritten_at(0, 10 * MIB, 4096)),
    ("4k-at-every-block", rewritten_at(0, MIB, 4096)),
    ("4k-inside-every-block", rewritten_at(333 * 1024 + 17, MIB, 4096)),
]

#: (name, change): data moved.
MOVED = [
    ("insert-near-start", lambda data: inserted(data, [5000], 100)),
    ("insert-every-16mib", lambda data: inserted(data, range(16 * MIB, len(data), 16 * MIB), 1)),
    ("delete-near-start", lambda data: data[:5000] + data[5100:]),
    ("insert-a-page-near-start", lambda data: inserted(data, [16 * 1024], 16 * 1024)),
]


def chosen(done: subprocess.CompletedProcess) -> str:
    """The ``-v`` line that says which delta the file got."""
    lines = [line for line in done.stderr.splitlines() if " delta (" in line]
    assert len(lines) == 1, done.stderr
    return lines[0]


def moved_by(done: subprocess.CompletedProcess) -> int:
    return int(re.search(r"moved (\d+) bytes", done.stdout).group(1))


@pytest.mark.parametrize("direction", ["local", "pull"])
@pytest.mark.parametrize("name,change", IN_PLACE, ids=[case[0] for case in IN_PLACE])
def test_writes_in_place_choose_blocks(server, tmp_path, unique, direction, name, change):
    old = in_place_old()
    source_data = change(old)
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, old)
    done = run_cli("-vv", "--stats", source, target)
    assert done.returncode == 0, done.stderr
    assert path.read_bytes() == source_data
    assert ": blocks delta (" in chosen(done), chosen(done)
    # What changed, at the refinement's 4 KiB pieces, and not much more.
    changed = sum(source_data[offset:offset + 4096] != old[offset:offset + 4096]
                  for offset in range(0, IN_PLACE_SIZE, 4096)) * 4096
    assert changed <= moved_by(done) <= 1.25 * changed + 4096


@pytest.mark.parametrize("direction", ["local", "pull"])
@pytest.mark.parametrize("name,change", MOVED, ids=[case[0] for case in MOVED])
def test_moved_data_still_chooses_chunks_and_says_how_much_moved(server, tmp_path, unique, direction, name,
                                                                  change):
    old = in_place_old()
    source_data = change(old)
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, old)
    done = run_cli("-vv", "--stats", source, target)
    assert done.returncode == 0, done.stderr
    assert path.read_bytes() == source_data
    line = chosen(done)
    assert ": chunks delta (" in line, line
    moved_share = int(re.search(r"(\d+)% of sampled bytes moved", line).group(1))
    assert moved_share >= 50, line
    assert moved_by(done) < IN_PLACE_SIZE // 1000


def similarity_of(done: subprocess.CompletedProcess) -> float:
    return float(re.search(r"similarity ([\d.]+)%", done.stderr).group(1))


@pytest.mark.parametrize("name,change", [IN_PLACE[1], IN_PLACE[4]], ids=[IN_PLACE[1][0], IN_PLACE[4][0]])
def test_the_similarity_means_the_same_whatever_delta_ran(tmp_path, name, change):
    old = in_place_old()
    source_data = change(old)
    similarities = {}
    for delta in ("blocks", "chunks"):
        source, target = tmp_path / f"source-{delta}.img", tmp_path / f"target-{delta}.img"
        source.write_bytes(source_data)
        target.write_bytes(old)
        done = run_cli("-vv", "--stats", "--delta", delta, str(source), str(target))
        assert done.returncode == 0, done.stderr
        similarities[delta] = similarity_of(done)
        # The share of the source's bytes that did not have to be sent.
        expected = 100 * (IN_PLACE_SIZE - moved_by(done)) / IN_PLACE_SIZE
        assert similarities[delta] == pytest.approx(expected, abs=0.01)
    # Both near the share of the file that did not change, not one of them the share of whole
    # blocks left alone.
    unchanged = 100 * sum(source_data[offset:offset + 4096] == old[offset:offset + 4096]
                          for offset in range(0, IN_PLACE_SIZE, 4096)) * 4096 / IN_PLACE_SIZE
    assert all(abs(similarity - unchanged) < 2.5 for similarity in similarities.values()), similarities


@needs_strace
def test_the_sample_asks_for_each_window_in_one_read(tmp_path):
    """From a cold cache, a window read by its page faults waits on the disk a few pages at a time."""
    old = in_place_old()
    source, target, trace = tmp_path / "source.img", tmp_path / "target.img", tmp_path / "trace"
    source.write_bytes(IN_PLACE[1][1](old))
    target.write_bytes(old)
    done = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=fadvise64",
                           *pdiffcopy_command("-vv", str(source), str(target))], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert ": blocks delta (" in chosen(done), chosen(done)
    from pdiffcopy.engine import autodelta

    # (No closing parenthesis: under strace -f a call another process interrupts ends "<unfinished ...>".)
    asked = re.findall(r"fadvise64\(\d+, (\d+), (\d+), POSIX_FADV_WILLNEED", trace.read_text())
    windows = {(str(offset), str(autodelta.SAMPLE_WINDOW_BYTES)) for offset in autodelta.sample_offsets(IN_PLACE_SIZE)}
    # Each window, once in the source and once in the target.
    assert sum(call in windows for call in asked) == 2 * len(windows), asked[:10]

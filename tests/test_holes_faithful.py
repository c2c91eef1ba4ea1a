"""The target ends as the source, holes included (issue 38).

A dense target whose bytes already equal a sparse source's gets the source's holes
punched, though nothing moves; so does one that differs elsewhere. And ``-S`` turns a
tree's small files' runs of zeros into holes as it does a single file's. Every test
checks ``st_blocks`` on disk, locally, pulled and pushed through the real server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import random_bytes
from pdiffcopy import sync
from pdiffcopy.api import sync_tree
from test_holes import BLOCK, MIB, UNIT, allocated, assert_same_allocation, block_of, ends, make_sparse

#: A sparse image: 12 MiB of data in 40 MiB, holes at the start, between and at the end.
SIZE = 40 * MIB
EXTENTS = [(4 * MIB, 4 * MIB), (16 * MIB + UNIT, 6 * MIB), (30 * MIB, 2 * MIB)]

DIRECTIONS = ("local", "pull", "push")

#: The file sync's ways of writing an existing target.
MODES = {"in-place": {}, "atomic": {"atomic": True}, "partial": {"atomic": True, "partial": True},
         "whole-file": {"whole_file": True}, "chunks": {"delta": "chunks"}}


@pytest.fixture(params=DIRECTIONS)
def direction(request):
    return request.param


@pytest.fixture
def files(direction, request, tmp_path, unique):
    server = request.getfixturevalue("server") if direction != "local" else None
    return ends(direction, server, tmp_path, unique)


def write_dense(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.sync()
    assert allocated(path) >= len(data), "the target must start dense"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_equal_dense_target_gets_the_sources_holes_and_nothing_moves(files, mode):
    source, target, source_arg, target_arg = files
    expected = make_sparse(source, SIZE, EXTENTS)
    write_dense(target, expected)  # its zeros are data: the bytes are equal, the allocation is not
    result = sync(source_arg, target_arg, block_size=BLOCK, concurrency=2, **MODES[mode])
    assert result.verified
    assert target.read_bytes() == expected
    if mode != "whole-file":
        assert result.bytes_moved == 0
    assert_same_allocation(target, source, EXTENTS)


@pytest.mark.parametrize("mode", ["in-place", "atomic", "chunks"])
def test_a_differing_dense_target_gets_the_sources_holes(files, mode):
    source, target, source_arg, target_arg = files
    expected = make_sparse(source, SIZE, EXTENTS)
    old = bytearray(expected)
    old[5 * MIB:5 * MIB + UNIT] = random_bytes(UNIT, seed=11)  # one change inside the data
    write_dense(target, bytes(old))
    result = sync(source_arg, target_arg, block_size=BLOCK, concurrency=2, **MODES[mode])
    assert result.verified
    assert target.read_bytes() == expected
    assert 0 < result.bytes_moved <= BLOCK
    assert_same_allocation(target, source, EXTENTS)


def test_an_equal_dense_target_with_the_same_holes_already_is_left_alone(files):
    # The source's holes are holes in the target too: nothing to punch, nothing moves.
    source, target, source_arg, target_arg = files
    expected = make_sparse(source, SIZE, EXTENTS)
    sync(source_arg, target_arg, block_size=BLOCK, concurrency=2)
    before = allocated(target)
    result = sync(source_arg, target_arg, block_size=BLOCK, concurrency=2)
    assert result.bytes_moved == 0 and target.read_bytes() == expected
    assert allocated(target) == before


def tree_ends(direction, request, tmp_path, unique):
    """(source dir, target dir, SOURCE, TARGET) of a tree sync in ``direction``."""
    server = request.getfixturevalue("server") if direction != "local" else None
    name = unique.replace(".img", "")
    source_dir = server.root / name if direction == "pull" else tmp_path / "src"
    target_dir = server.root / name if direction == "push" else tmp_path / "dst"
    source_dir.mkdir(parents=True)
    target_dir.mkdir(parents=True)
    source_arg = f"{server.url(name)}/" if direction == "pull" else f"{source_dir}/"
    target_arg = f"{server.url(name)}/" if direction == "push" else str(target_dir)
    return source_dir, target_dir, source_arg, target_arg


def test_a_trees_equal_dense_files_get_the_sources_holes(direction, request, tmp_path, unique):
    source_dir, target_dir, source_arg, target_arg = tree_ends(direction, request, tmp_path, unique)
    # A big file (the block delta) and a small one (copied whole), equal but dense in the target,
    # with another time: both are looked at, neither needs a byte.
    small_extents = [(UNIT, UNIT)]
    layouts = {"disk.img": (SIZE, EXTENTS), "small.img": (2 * MIB, small_extents)}
    for name, (size, extents) in layouts.items():
        write_dense(target_dir / name, make_sparse(source_dir / name, size, extents))
        os.utime(target_dir / name, ns=(10**18, 10**18))
    result = sync_tree(source_arg, target_arg, concurrency=2, times=True)
    assert not result.failures
    for name, (_, extents) in layouts.items():
        assert (target_dir / name).read_bytes() == (source_dir / name).read_bytes()
        assert_same_allocation(target_dir / name, source_dir / name, extents)


# -- -S for a tree's small files (item 3) ----------------------------------


def zero_runs_file() -> bytes:
    """Data and runs of zeros: 1 MiB of data, 3 MiB of zeros, 64 KiB of data, 2 MiB of zeros, 5 bytes."""
    return random_bytes(MIB, seed=21) + bytes(3 * MIB) + random_bytes(UNIT, seed=22) + bytes(2 * MIB) + b"12345"


def rsync_allocation(source_dir: Path, tmp_path: Path, name: str) -> "int | None":
    """What ``rsync -S`` allocates for ``name`` of ``source_dir``, or None without rsync."""
    if shutil.which("rsync") is None:
        return None
    copy = tmp_path / "rsync-copy"
    subprocess.run(["rsync", "-a", "-S", f"{source_dir}/", f"{copy}/"], check=True)
    return allocated(copy / name)


def test_sparse_option_makes_holes_of_a_trees_small_files(direction, request, tmp_path, unique):
    source_dir, target_dir, source_arg, target_arg = tree_ends(direction, request, tmp_path, unique)
    files = {"zeros.img": bytes(8 * MIB), "mixed.img": zero_runs_file(), "sub/tiny": bytes(3 * UNIT)}
    (source_dir / "sub").mkdir()
    for name, data in files.items():
        (source_dir / name).write_bytes(data)  # dense: the zeros are data
    result = sync_tree(source_arg, target_arg, concurrency=2, sparse=True)
    assert not result.failures and result.files_copied == len(files)
    unit = block_of(target_dir / "zeros.img")
    for name, data in files.items():
        assert (target_dir / name).read_bytes() == data
    assert allocated(target_dir / "zeros.img") == 0
    assert allocated(target_dir / "sub" / "tiny") == 0
    mixed_data = MIB + UNIT + unit  # the data, and the block the 5 bytes at the end share
    assert allocated(target_dir / "mixed.img") <= mixed_data
    if direction == "local":
        by_rsync = rsync_allocation(source_dir, tmp_path, "mixed.img")
        if by_rsync is not None:
            assert allocated(target_dir / "mixed.img") <= by_rsync
            assert rsync_allocation(source_dir, tmp_path, "zeros.img") == 0


def test_without_sparse_option_a_trees_small_zero_files_stay_dense(direction, request, tmp_path, unique):
    source_dir, target_dir, source_arg, target_arg = tree_ends(direction, request, tmp_path, unique)
    (source_dir / "zeros.img").write_bytes(bytes(8 * MIB))
    result = sync_tree(source_arg, target_arg, concurrency=2)
    assert not result.failures
    assert (target_dir / "zeros.img").read_bytes() == bytes(8 * MIB)
    assert allocated(target_dir / "zeros.img") >= 8 * MIB


def test_sparse_option_makes_holes_of_a_trees_rewritten_small_file(direction, request, tmp_path, unique):
    source_dir, target_dir, source_arg, target_arg = tree_ends(direction, request, tmp_path, unique)
    data = zero_runs_file()
    (source_dir / "mixed.img").write_bytes(data)
    write_dense(target_dir / "mixed.img", random_bytes(len(data), seed=5))  # same size, other bytes
    os.utime(target_dir / "mixed.img", ns=(10**18, 10**18))
    result = sync_tree(source_arg, target_arg, concurrency=2, sparse=True)
    assert not result.failures and result.files_copied == 1
    assert (target_dir / "mixed.img").read_bytes() == data
    assert allocated(target_dir / "mixed.img") <= MIB + UNIT + block_of(target_dir / "mixed.img")


def test_overlaps_are_what_both_range_lists_cover():
    import random

    from pdiffcopy.core.datamap import overlaps

    def ranges(rng):
        found, position = [], 0
        for _ in range(rng.randrange(6)):
            position += rng.randrange(4)
            length = rng.randrange(1, 6)
            found.append((position, length))
            position += length
        return found

    def covered(found):
        return {byte for offset, length in found for byte in range(offset, offset + length)}

    rng = random.Random(38)
    for _ in range(2000):
        first, second = ranges(rng), ranges(rng)
        both = list(overlaps(first, second))
        assert covered(both) == covered(first) & covered(second)
        assert all(a[0] + a[1] <= b[0] for a, b in zip(both, both[1:]))  # sorted, disjoint


def test_a_local_trees_files_copied_whole_count_the_data_written_not_the_holes(tmp_path):
    source_dir, target_dir = tmp_path / "src", tmp_path / "dst"
    source_dir.mkdir()
    # Big and sparse: copied whole between local trees, extent by extent; small and dense under -S.
    make_sparse(source_dir / "disk.img", 80 * MIB, [(MIB, MIB), (70 * MIB, 2 * MIB)])
    (source_dir / "zeros.img").write_bytes(bytes(8 * MIB))
    (source_dir / "mixed.img").write_bytes(zero_runs_file())
    result = sync_tree(f"{source_dir}/", str(target_dir), concurrency=2, sparse=True)
    assert not result.failures and result.files_copied == 3
    assert result.bytes_moved == 3 * MIB + (MIB + UNIT + 5)  # the data; 80 MiB + 16 MiB before
    for name in ("disk.img", "zeros.img", "mixed.img"):
        assert (target_dir / name).read_bytes() == (source_dir / name).read_bytes()


@pytest.fixture
def own_zero_warnings(monkeypatch):
    """This test's own set of devices warned about (a later ramfs mount may get the same number)."""
    from pdiffcopy.local import descriptors

    monkeypatch.setattr(descriptors, "_ZEROS_WARNED", set())


@pytest.mark.parametrize("where", ["local", "push"])
def test_a_target_that_cannot_punch_is_not_rewritten_with_zeros(ramfs, tmp_path, caplog, where,
                                                                 own_zero_warnings):
    import logging

    from conftest import start_server

    source = tmp_path / "source.img"
    expected = make_sparse(source, SIZE, EXTENTS)
    (ramfs / "target.img").write_bytes(expected)  # ramfs: dense, and it cannot punch
    server = start_server(ramfs, tmp_path / "server.log") if where == "push" else None
    try:
        target_arg = server.url("target.img") if server else str(ramfs / "target.img")
        with caplog.at_level(logging.WARNING):
            result = sync(str(source), target_arg, block_size=BLOCK, concurrency=2)
    finally:
        if server:
            server.stop()
    assert result.verified and result.bytes_moved == 0
    assert (ramfs / "target.img").read_bytes() == expected
    # Its zeros are zeros already: none written again, so nothing to warn about.
    assert not [r for r in caplog.records if "cannot punch holes" in r.getMessage()]


def test_a_whole_file_copy_in_place_onto_a_target_that_cannot_punch_still_zeroes_the_holes(ramfs, tmp_path,
                                                                                            own_zero_warnings):
    # The old bytes at the source's holes are not zeros here: where punching fails, zeros are written.
    source = tmp_path / "source.img"
    expected = make_sparse(source, SIZE, EXTENTS)
    (ramfs / "target.img").write_bytes(random_bytes(SIZE, seed=9))
    result = sync(str(source), str(ramfs / "target.img"), block_size=BLOCK, concurrency=2, whole_file=True)
    assert result.verified
    assert (ramfs / "target.img").read_bytes() == expected

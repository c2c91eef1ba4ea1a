"""Holes stay holes (issue 19): sparse files synced locally, pulled and pushed through the real server.

Every test checks the bytes and the allocation (``st_blocks``) of the target on disk, and
what moved: a source's holes are never read nor sent, only punched.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import http_get, random_bytes
from pdiffcopy import sync
from pdiffcopy.api import sync_tree

KIB = 1024
MIB = 1024 * KIB
#: Holes and extents fall on this: larger than any file system block here.
UNIT = 64 * KIB
BLOCK = 256 * KIB

#: Layouts of a sparse source: (size, data extents).
LAYOUTS = {
    "hole-at-start": (4 * MIB, [(3 * MIB, MIB)]),
    "hole-in-middle": (4 * MIB, [(0, MIB), (3 * MIB, MIB)]),
    "hole-at-end": (4 * MIB, [(0, MIB + 3 * UNIT)]),
    "scattered": (6 * MIB + 5000, [(UNIT, UNIT), (2 * MIB + 3 * UNIT, 5 * UNIT), (6 * MIB, 5000)]),
    "all-hole": (3 * MIB, []),
    "empty": (0, []),
}

DIRECTIONS = ("local", "pull", "push")


def make_sparse(path: Path, size: int, extents, seed: int = 1) -> bytes:
    """A file of ``size`` bytes with data only in ``extents``; return its bytes."""
    expected = bytearray(size)
    with open(path, "wb") as handle:
        handle.truncate(size)
        for offset, length in extents:
            data = random_bytes(length, seed=seed + offset)
            handle.seek(offset)
            handle.write(data)
            expected[offset:offset + length] = data
    return bytes(expected)


def data_bytes(extents) -> int:
    return sum(length for _, length in extents)


def allocated(path: Path) -> int:
    os.sync()  # delayed allocation: count what the file system really holds
    return os.stat(path).st_blocks * 512


def block_of(path: Path) -> int:
    return os.statvfs(path.parent).f_bsize


def assert_same_allocation(target: Path, source: Path, extents) -> None:
    """The target holds as much as the source, within one file system block per extent."""
    tolerance = block_of(target) * (len(extents) + 1)
    assert abs(allocated(target) - allocated(source)) <= tolerance, (allocated(target), allocated(source))


def ends(direction: str, server, tmp_path: Path, unique: str):
    """(source path, target path, SOURCE argument, TARGET argument) of a sync in ``direction``."""
    local_source, local_target = tmp_path / "source.img", tmp_path / "target.img"
    if direction == "local":
        return local_source, local_target, str(local_source), str(local_target)
    remote = server.root / unique
    if direction == "pull":
        return remote, local_target, server.url(unique), str(local_target)
    return local_source, remote, str(local_source), server.url(unique)


@pytest.fixture(params=DIRECTIONS)
def direction(request):
    return request.param


@pytest.fixture
def files(direction, request, tmp_path, unique):
    server = request.getfixturevalue("server") if direction != "local" else None
    return ends(direction, server, tmp_path, unique)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_new_target_gets_only_the_data(files, layout):
    source, target, source_arg, target_arg = files
    size, extents = LAYOUTS[layout]
    expected = make_sparse(source, size, extents)
    result = sync(source_arg, target_arg, block_size=BLOCK, concurrency=2)
    assert target.read_bytes() == expected
    assert result.verified
    assert result.bytes_moved == data_bytes(extents)
    assert_same_allocation(target, source, extents)


@pytest.mark.parametrize("mode", ["in-place", "atomic", "partial", "whole-file", "chunks"])
def test_an_existing_dense_target_has_the_sources_holes_punched(files, mode):
    source, target, source_arg, target_arg = files
    size, extents = LAYOUTS["scattered"]
    expected = make_sparse(source, size, extents)
    old = bytearray(random_bytes(size, seed=7))
    for offset, length in extents:  # the data is right already: only the holes differ
        old[offset:offset + length] = expected[offset:offset + length]
    target.write_bytes(bytes(old))
    options = {"in-place": {}, "atomic": {"atomic": True}, "partial": {"atomic": True, "partial": True},
               "whole-file": {"whole_file": True}, "chunks": {"delta": "chunks"}}[mode]
    result = sync(source_arg, target_arg, block_size=BLOCK, concurrency=2, **options)
    assert target.read_bytes() == expected
    assert result.verified
    if mode in ("in-place", "atomic", "partial"):
        # Holes are punched, not sent; at most the data sharing a changed block with a hole
        # moves (two 64 KiB pieces here) when refinement finds the change too dense to pay.
        assert result.bytes_moved <= 2 * UNIT
    else:
        assert result.bytes_moved <= data_bytes(extents)
    assert_same_allocation(target, source, extents)


def test_a_dense_target_that_holds_the_same_zeros_is_not_rewritten_but_punched(files):
    source, target, source_arg, target_arg = files
    size, extents = LAYOUTS["hole-in-middle"]
    expected = make_sparse(source, size, extents)
    target.write_bytes(expected)  # dense: its zeros are data
    result = sync(source_arg, target_arg, block_size=BLOCK, concurrency=2)
    assert result.bytes_moved == 0
    assert result.changed_blocks == 0 and result.similarity == 100.0
    assert target.read_bytes() == expected
    assert_same_allocation(target, source, extents)  # nothing written; the source's hole punched


def test_changed_data_moves_and_new_holes_are_punched(files):
    source, target, source_arg, target_arg = files
    size = 4 * MIB
    make_sparse(source, size, [(0, MIB), (2 * MIB, MIB)])
    sync(source_arg, target_arg, block_size=BLOCK, concurrency=2)
    # The source loses its second extent and gets a new one in its hole.
    expected = make_sparse(source, size, [(0, MIB), (3 * MIB + UNIT, UNIT)], seed=1)
    before = allocated(target)
    result = sync(source_arg, target_arg, block_size=BLOCK, concurrency=2)
    assert target.read_bytes() == expected
    assert result.bytes_moved <= BLOCK  # the new extent's block, not the punched megabyte
    assert allocated(target) <= before - MIB + BLOCK
    assert_same_allocation(target, source, [(0, MIB), (3 * MIB + UNIT, UNIT)])


def test_sparse_option_turns_zero_runs_into_holes(files):
    source, target, source_arg, target_arg = files
    data = random_bytes(MIB, seed=3) + bytes(2 * MIB) + random_bytes(MIB, seed=4)
    source.write_bytes(data)  # dense: its zeros are data
    result = sync(source_arg, target_arg, block_size=BLOCK, concurrency=2, sparse=True)
    assert target.read_bytes() == data
    assert result.verified
    assert allocated(target) <= 2 * MIB + 2 * block_of(target)


def test_without_sparse_option_zeros_in_data_stay_data(files):
    source, target, source_arg, target_arg = files
    data = random_bytes(MIB, seed=3) + bytes(2 * MIB) + random_bytes(MIB, seed=4)
    source.write_bytes(data)
    sync(source_arg, target_arg, block_size=BLOCK, concurrency=2)
    assert target.read_bytes() == data
    assert allocated(target) >= 4 * MIB


def hash_requests(server) -> float:
    """How many hash requests the server has answered so far (its metrics)."""
    _, _, body = http_get(f"{server.base}/.pdiffcopy/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith('pdiffcopy_requests_total{endpoint="hashes"'))


def data_map_requests(server) -> float:
    """How many data map requests the server has answered so far (its metrics)."""
    _, _, body = http_get(f"{server.base}/.pdiffcopy/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith('pdiffcopy_requests_total{endpoint="data_map"'))


def test_a_dense_source_is_asked_for_its_data_map_once(server, tmp_path, unique):
    # All data: the one answer that says so is enough; asking again before hashing
    # would cost a round trip on every pull (a no-change pull is a few of them).
    data = random_bytes(3 * MIB + 5, seed=7)
    (server.root / unique).write_bytes(data)
    target = tmp_path / "target"
    target.write_bytes(data[:MIB] + bytes(2 * MIB + 5))
    before = data_map_requests(server)
    result = sync(f"{server.base}/{unique}", str(target), block_size=BLOCK, concurrency=2)
    assert result.verified and target.read_bytes() == data
    assert data_map_requests(server) - before == 1


def test_a_big_sparse_file_moves_only_its_data(files, direction, request):
    source, target, source_arg, target_arg = files
    size = 64 * 1024 * MIB  # 64 GiB, 3 MiB of data: holes are neither read, hashed by reading, nor sent
    extents = [(0, MIB), (20 * 1024 * MIB, MIB), (size - MIB, MIB)]
    with open(source, "wb") as handle:
        handle.truncate(size)
        for offset, length in extents:
            handle.seek(offset)
            handle.write(random_bytes(length, seed=offset))
    server = request.getfixturevalue("server") if direction != "local" else None
    before = hash_requests(server) if server else 0
    result = sync(source_arg, target_arg, concurrency=2)
    assert result.verified and result.bytes_moved == data_bytes(extents)
    if server:
        # The server hashes the segments with data (source or read-back), not 1,024 of holes:
        # the client knows the others are zeros from the data map.
        assert hash_requests(server) - before <= 3 * len(extents), hash_requests(server) - before
    assert os.stat(target).st_size == size
    assert_same_allocation(target, source, extents)
    # Again, unchanged: nothing moves.
    again = sync(source_arg, target_arg, concurrency=2)
    assert again.bytes_moved == 0
    for offset, length in extents:
        with open(target, "rb") as handle:
            handle.seek(offset)
            assert handle.read(length) == random_bytes(length, seed=offset)


def test_tree_big_files_keep_holes_both_ways(direction, request, tmp_path, unique):
    server = request.getfixturevalue("server") if direction != "local" else None
    name = unique.replace(".img", "")
    source_dir = server.root / name if direction == "pull" else tmp_path / "src"
    target_dir = server.root / name if direction == "push" else tmp_path / "dst"
    source_dir.mkdir(parents=True)
    # Big enough to go by ranges when new (treerunner.RANGE_SIZE), by the block delta when changed.
    size, extents = 80 * MIB, [(MIB, MIB), (70 * MIB, 2 * MIB)]
    expected = make_sparse(source_dir / "disk.img", size, extents)
    source_arg = f"{server.url(name)}/" if direction == "pull" else f"{source_dir}/"
    target_arg = f"{server.url(name)}/" if direction == "push" else str(target_dir)
    result = sync_tree(source_arg, target_arg, concurrency=2)
    assert not result.failures
    assert (target_dir / "disk.img").read_bytes() == expected
    assert_same_allocation(target_dir / "disk.img", source_dir / "disk.img", extents)
    # The source loses an extent and gains one: the tree's block delta punches and moves.
    subprocess.run(["fallocate", "--punch-hole", "--offset", str(70 * MIB), "--length", str(2 * MIB),
                    str(source_dir / "disk.img")], check=True)
    with open(source_dir / "disk.img", "r+b") as handle:
        handle.seek(40 * MIB)
        handle.write(random_bytes(UNIT, seed=40))
    result = sync_tree(source_arg, target_arg, concurrency=2)
    assert not result.failures and result.files_copied == 1
    assert result.bytes_moved <= BLOCK * 4  # the new extent's block, not the punched 2 MiB
    assert (target_dir / "disk.img").read_bytes() == (source_dir / "disk.img").read_bytes()
    assert_same_allocation(target_dir / "disk.img", source_dir / "disk.img", [(MIB, MIB), (40 * MIB, UNIT)])


@pytest.mark.parametrize("resync", [False, True], ids=["new", "unchanged"])
def test_holes_are_never_read_from_the_source(tmp_path, resync):
    """A 16 GiB file of 2 MiB: after the sync, the page cache holds its data, not 16 GiB of zeros read."""
    if not shutil.which("fincore"):
        pytest.skip("needs fincore (util-linux)")
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    size = 16 * 1024 * MIB
    with open(source, "wb") as handle:
        handle.truncate(size)
        for offset in (0, 8 * 1024 * MIB):
            handle.seek(offset)
            handle.write(random_bytes(MIB, seed=offset))
    if resync:
        sync(str(source), str(target), concurrency=1)
    fd = os.open(source, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # nothing of it cached before the sync
    finally:
        os.close(fd)
    result = sync(str(source), str(target), concurrency=1)
    assert result.bytes_moved == (0 if resync else 2 * MIB)
    cached = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(source)],
                            check=True, capture_output=True, text=True).stdout
    # The data and the kernel's read-ahead after it (a few MiB per extent), not 16 GiB of holes.
    assert int(cached.strip()) <= 64 * MIB, cached



def test_a_file_system_that_cannot_punch_gets_zeros_and_one_warning(ramfs, tmp_path, caplog):
    source, target = tmp_path / "source.img", ramfs / "target.img"
    size, extents = LAYOUTS["scattered"]
    expected = make_sparse(source, size, extents)
    target.write_bytes(random_bytes(size, seed=9))  # old data in the source's holes: they must be zeroed
    with caplog.at_level(logging.WARNING):
        result = sync(str(source), str(target), block_size=BLOCK, concurrency=2)
    assert result.verified
    assert target.read_bytes() == expected
    warnings = [r for r in caplog.records if "cannot punch holes" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_a_source_whose_holes_change_during_the_sync_is_caught(tmp_path, monkeypatch):
    from pdiffcopy.errors import Conflict
    from pdiffcopy.local.localfile import LocalFile

    source, target = tmp_path / "source.img", tmp_path / "target.img"
    size, extents = LAYOUTS["hole-in-middle"]
    make_sparse(source, size, extents)
    asked = LocalFile.data_map

    def punched_meanwhile(self, offset, length):
        if self.path == str(source) and not getattr(punched_meanwhile, "done", False):
            punched_meanwhile.done = True  # another writer punches a hole into the source's data
            subprocess.run(["fallocate", "--punch-hole", "--offset", "0", "--length", str(UNIT), str(source)],
                           check=True)
        return asked(self, offset, length)

    monkeypatch.setattr(LocalFile, "data_map", punched_meanwhile)
    with pytest.raises(Conflict, match="changed during the sync"):
        sync(str(source), str(target), block_size=BLOCK, concurrency=2)
    assert not target.exists()  # a new target is written under a temporary name, never half-done


# -- the pure parts (pdiffcopy.core.datamap) -------------------------------------------------


def test_split_by_data_cuts_ranges_into_data_and_holes():
    from pdiffcopy.core.datamap import split_by_data

    extents = [(10, 10), (30, 5), (100, 50)]
    data, holes = split_by_data([(0, 25), (28, 10), (40, 20), (90, 100)], extents)
    assert data == [(10, 10), (30, 5), (100, 50)]
    assert holes == [(0, 10), (20, 5), (28, 2), (35, 3), (40, 20), (90, 10), (150, 40)]
    assert split_by_data([(0, 8)], []) == ([], [(0, 8)])
    assert split_by_data([(0, 8)], [(0, 8)]) == ([(0, 8)], [])
    assert split_by_data([], extents) == ([], [])


def test_zero_runs_are_whole_units_and_the_zero_edges_of_partly_covered_ones():
    from pdiffcopy.core.datamap import zero_runs

    unit = 8
    data = b"x" + bytes(7) + bytes(16) + b"y" * 8 + bytes(3)
    # At offset 0: the first unit has data, the next two are zeros, one more data, then a zero tail.
    assert zero_runs(data, 0, unit) == [(8, 16), (32, 3)]
    # At offset 5: a zero head (5..8) and tail (16..22) are edges of partly covered units;
    # the zeros at 13..16 share a unit with data and stay data.
    assert zero_runs(bytes(3) + b"z" * 5 + bytes(9), 5, unit) == [(5, 3), (16, 6)]
    assert zero_runs(b"", 0, unit) == []


def test_a_server_that_cannot_punch_writes_zeros_and_the_client_warns_once(ramfs, tmp_path, caplog):
    from conftest import start_server

    source = tmp_path / "source.img"
    size, extents = LAYOUTS["scattered"]
    expected = make_sparse(source, size, extents)
    (ramfs / "target.img").write_bytes(random_bytes(size, seed=9))
    server = start_server(ramfs, tmp_path / "server.log")
    try:
        with caplog.at_level(logging.WARNING):
            result = sync(str(source), server.url("target.img"), block_size=BLOCK, concurrency=2)
    finally:
        server.stop()
    assert result.verified
    assert (ramfs / "target.img").read_bytes() == expected
    warnings = [r for r in caplog.records if "cannot punch holes" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_tree_sparse_option_turns_zero_runs_of_big_files_into_holes(direction, request, tmp_path, unique):
    server = request.getfixturevalue("server") if direction != "local" else None
    name = unique.replace(".img", "")
    source_dir = server.root / name if direction == "pull" else tmp_path / "src"
    target_dir = server.root / name if direction == "push" else tmp_path / "dst"
    source_dir.mkdir(parents=True)
    data = random_bytes(MIB, seed=5) + bytes(70 * MIB) + random_bytes(MIB, seed=6)  # dense: zeros as data
    (source_dir / "disk.img").write_bytes(data)
    source_arg = f"{server.url(name)}/" if direction == "pull" else f"{source_dir}/"
    target_arg = f"{server.url(name)}/" if direction == "push" else str(target_dir)
    result = sync_tree(source_arg, target_arg, concurrency=2, sparse=True)
    assert not result.failures
    assert (target_dir / "disk.img").read_bytes() == data
    assert allocated(target_dir / "disk.img") <= 2 * MIB + 2 * block_of(target_dir / "disk.img")

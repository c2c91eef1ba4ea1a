"""Digests made ahead of the sync's request (while ssh logs in): used only when they still describe the file."""

from __future__ import annotations

import os

import pytest

from conftest import random_bytes
from pdiffcopy.api import PREHASH_MIN_BYTES, prehashed_file
from pdiffcopy.engine.options import file_options
from pdiffcopy.local.filehash import hash_file_ranges
from pdiffcopy.local.localfile import LocalFile

BLOCK = 64 * 1024
METHOD = "xxh3_128"
RANGES = [(0, 8 * BLOCK), (8 * BLOCK, 8 * BLOCK)]


@pytest.fixture
def prehashing(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(random_bytes(16 * BLOCK, seed=5))
    endpoint = LocalFile(str(path))
    assert endpoint.start_prehash(RANGES, BLOCK, METHOD, concurrency=2)
    # The sync takes the pool over, as _SyncJob does.
    endpoint.use_hash_pool(endpoint.start_hash_pool(2))
    yield endpoint
    endpoint.close()
    endpoint.pool.shutdown()


def wait_for_prehash(endpoint: LocalFile) -> None:
    for future in list(endpoint.prehash._entries.values()):
        future.result()


def test_the_syncs_requests_get_the_digests_made_ahead(prehashing):
    pool = prehashing.pool
    assert pool is not None and prehashing.prehash.pool is None  # the pool that made them is the sync's now
    for one in RANGES:
        assert prehashing.submit_hashes([one], BLOCK, METHOD).result() == \
            hash_file_ranges(prehashing.path, [one], BLOCK, METHOD)
    assert (prehashing.prehash.used, prehashing.prehash.rejected) == (2, 0)


def test_a_file_changed_after_it_was_hashed_is_hashed_again(prehashing):
    wait_for_prehash(prehashing)
    with open(prehashing.path, "r+b") as handle:  # the same size, other bytes
        handle.seek(3)
        handle.write(b"changed")
    got = prehashing.submit_hashes([RANGES[0]], BLOCK, METHOD).result()
    assert got == hash_file_ranges(prehashing.path, [RANGES[0]], BLOCK, METHOD)
    assert (prehashing.prehash.used, prehashing.prehash.rejected) == (0, 1)


def test_a_file_replaced_by_another_of_the_same_size_and_time_is_hashed_again(prehashing, tmp_path):
    wait_for_prehash(prehashing)
    other = tmp_path / "other"
    other.write_bytes(random_bytes(16 * BLOCK, seed=6))
    info = os.stat(prehashing.path)
    os.utime(other, ns=(info.st_atime_ns, info.st_mtime_ns))
    os.replace(other, prehashing.path)  # another inode
    got = prehashing.submit_hashes([RANGES[1]], BLOCK, METHOD).result()
    assert got == hash_file_ranges(prehashing.path, [RANGES[1]], BLOCK, METHOD)
    assert prehashing.prehash.rejected == 1


def test_the_digests_are_keyed_by_block_size_and_method(prehashing):
    smaller = prehashing.submit_hashes([RANGES[0]], BLOCK // 2, METHOD).result()
    assert smaller == hash_file_ranges(prehashing.path, [RANGES[0]], BLOCK // 2, METHOD)
    other_method = prehashing.submit_hashes([RANGES[0]], BLOCK, "sha256").result()
    assert other_method == hash_file_ranges(prehashing.path, [RANGES[0]], BLOCK, "sha256")
    assert prehashing.prehash.used == 0
    # The sync hashes this file with another method: what was made ahead is dropped, not kept.
    assert not prehashing.prehash._entries


@pytest.mark.parametrize("option, is_target", [
    (dict(whole_file=True), False), (dict(delta="chunks"), False), (dict(atomic=True), True),
    (dict(partial=True), True)])
def test_nothing_is_hashed_ahead_where_the_sync_would_not_use_it(tmp_path, option, is_target):
    path = tmp_path / "big"
    with open(path, "wb") as handle:
        handle.truncate(PREHASH_MIN_BYTES)
    assert prehashed_file(str(path), file_options(**option), is_target) is None
    made = prehashed_file(str(path), file_options(), is_target)
    assert made is not None
    made.close()
    (tmp_path / "small").write_bytes(b"x" * 1000)
    assert prehashed_file(str(tmp_path / "small"), file_options(), is_target) is None

"""Sub-block refinement: changed blocks are hashed again in small pieces and only the pieces that differ move.

The pure part (pdiffcopy/core/refine.py) is checked without I/O; the syncs run
for real, locally and through the session's server in both directions, for
single files and for a tree's big file.
"""

from __future__ import annotations

import logging
import random

import pytest

from pdiffcopy import sync
from pdiffcopy.core.blocks import split_ranges
from pdiffcopy.core.refine import (
    DEFAULT_PIECE_SIZE,
    REFINE_PROBE_BYTES,
    RefineTally,
    check_piece_size,
    differing_pieces,
    merge_close,
    resolve_piece_size,
    usable_piece_size,
)
from pdiffcopy.errors import UsageError

from conftest import TreeEnds, random_bytes, run_cli
from test_stats import stats

MiB = 1024 * 1024
KiB = 1024
PIECE = DEFAULT_PIECE_SIZE

# -- the pure part ----------------------------------------------------------------------


def digests_for(ranges, piece_size, differing):
    """Fake digests of the pieces of ``ranges``: the pieces starting at ``differing`` offsets differ."""
    ours, theirs = [], []
    for offset, _length in split_ranges(ranges, piece_size):
        ours.append(offset.to_bytes(8, "big"))
        theirs.append(offset.to_bytes(8, "big") if offset not in differing else b"\xff" * 8)
    return b"".join(ours), b"".join(theirs)


def test_only_the_differing_pieces_move_and_neighbours_merge():
    ranges = [(0, 64 * KiB), (1 * MiB, 64 * KiB + 100)]  # the second ends short (the file's end)
    differ = {4 * KiB, 8 * KiB, 40 * KiB, 1 * MiB + 64 * KiB}
    ours, theirs = digests_for(ranges, 4 * KiB, differ)
    pieces = differing_pieces(ranges, 4 * KiB, ours, theirs, 8, 16 * MiB)
    assert pieces == [(4 * KiB, 8 * KiB), (40 * KiB, 4 * KiB), (1 * MiB + 64 * KiB, 100)]


def test_a_range_changed_almost_everywhere_moves_whole():
    ranges = [(0, 64 * KiB), (128 * KiB, 64 * KiB)]
    # Every other piece of the first range (50 %: refined), 13 of 16 of the second (81 %: whole).
    differ = {o for o in range(0, 64 * KiB, 8 * KiB)} | {128 * KiB + o for o in range(0, 52 * KiB, 4 * KiB)}
    ours, theirs = digests_for(ranges, 4 * KiB, differ)
    pieces = differing_pieces(ranges, 4 * KiB, ours, theirs, 8, 16 * MiB)
    assert pieces == [(o, 4 * KiB) for o in range(0, 64 * KiB, 8 * KiB)] + [(128 * KiB, 64 * KiB)]


def test_digests_that_do_not_match_the_pieces_are_refused():
    ours, theirs = digests_for([(0, 16 * KiB)], 4 * KiB, set())
    with pytest.raises(ValueError):
        differing_pieces([(0, 20 * KiB)], 4 * KiB, ours, theirs, 8, 16 * MiB)
    with pytest.raises(ValueError):
        differing_pieces([(0, 8 * KiB)], 4 * KiB, ours, theirs, 8, 16 * MiB)


def test_merge_close_bridges_small_gaps_up_to_a_length():
    assert merge_close([(0, 10), (50, 10), (1000, 10)], 100, 1 << 20) == [(0, 60), (1000, 10)]
    assert merge_close([(0, 10), (10, 10), (20, 10)], 0, 20) == [(0, 20), (20, 10)]
    assert merge_close([], 100, 100) == []


def test_piece_sizes_must_divide_the_block_size():
    assert check_piece_size("4K", MiB) == 4096
    assert check_piece_size("0", MiB) == check_piece_size(0, MiB) == 0
    for bad in ("3000", "1M", "2M", "512", "abc", "-4K"):
        with pytest.raises(UsageError, match="piece size"):
            check_piece_size(bad, MiB)
    assert resolve_piece_size(None, MiB) == DEFAULT_PIECE_SIZE
    assert resolve_piece_size(None, 5000) == 0  # the default does not divide: off, no error
    assert resolve_piece_size(None, 4096) == 0  # a block no bigger than a piece: nothing to refine
    assert usable_piece_size(MiB, 0) == 0 and usable_piece_size(6 * KiB, 3 * KiB) == 3 * KiB


def test_the_tally_stops_refining_a_dense_change_after_the_probe():
    tally = RefineTally()
    tally.add(REFINE_PROBE_BYTES // 2, REFINE_PROBE_BYTES // 2)
    assert tally.pays()  # too early to judge
    tally.add(REFINE_PROBE_BYTES // 2, REFINE_PROBE_BYTES // 2)
    assert not tally.pays()
    sparse = RefineTally()
    sparse.add(4 * REFINE_PROBE_BYTES, REFINE_PROBE_BYTES)
    assert sparse.pays()


# -- single files: local, pull, push ----------------------------------------------------

#: Offsets of the 16-byte changes: inside three different 1 MiB blocks, inside one piece each.
SPARSE_CHANGES = (100, 3 * MiB + 5000, 6 * MiB + 123 * KiB + 7)


def edited(data: bytes, offsets, length: int = 16, seed: int = 3) -> bytes:
    rng = random.Random(seed)
    buffer = bytearray(data)
    for offset in offsets:
        buffer[offset:offset + length] = rng.randbytes(min(length, len(buffer) - offset))
    return bytes(buffer)


def places(direction, tmp_path, server, unique):
    """(source path, target path, source argument, target argument) for one direction."""
    if direction == "local":
        return tmp_path / "source", tmp_path / "target", str(tmp_path / "source"), str(tmp_path / "target")
    if direction == "pull":
        return server.root / unique, tmp_path / "target", server.url(unique), str(tmp_path / "target")
    return tmp_path / "source", server.root / unique, str(tmp_path / "source"), server.url(unique)


@pytest.fixture(params=["local", "pull", "push"])
def direction(request):
    return request.param


def test_a_sparse_edit_moves_only_the_changed_pieces(direction, tmp_path, server, unique):
    old = random_bytes(8 * MiB, seed=11)
    new = edited(old, SPARSE_CHANGES)
    source, target, source_arg, target_arg = places(direction, tmp_path, server, unique)
    source.write_bytes(new)
    target.write_bytes(old)
    result = sync(source_arg, target_arg, concurrency=2)
    assert target.read_bytes() == new
    assert result.verified and result.changed_blocks == 3
    assert result.bytes_moved == 3 * PIECE  # was 3 MiB: three whole blocks


def test_piece_size_zero_moves_whole_blocks_again(direction, tmp_path, server, unique):
    old = random_bytes(8 * MiB, seed=12)
    new = edited(old, SPARSE_CHANGES)
    source, target, source_arg, target_arg = places(direction, tmp_path, server, unique)
    source.write_bytes(new)
    target.write_bytes(old)
    result = sync(source_arg, target_arg, piece_size=0)
    assert target.read_bytes() == new
    assert result.changed_blocks == 3 and result.bytes_moved == 3 * MiB


@pytest.mark.parametrize("method", ["xxh3_64", "xxh3_128"])
def test_pieces_at_the_end_of_a_file_that_grew_or_shrank(direction, tmp_path, server, unique, method):
    # The file's end falls inside a piece; the target is a byte longer or shorter, and
    # xxh3_64 is too weak to verify with (every block is hashed again with xxh3_128).
    size = 5 * MiB + 1234
    new = edited(random_bytes(size, seed=13), [size - 20, 2 * MiB + 10])
    source, target, source_arg, target_arg = places(direction, tmp_path, server, unique)
    source.write_bytes(new)
    for old in (random_bytes(size, seed=13)[:size - 1], random_bytes(size, seed=13) + b"x"):
        target.write_bytes(old)
        result = sync(source_arg, target_arg, hash_method=method, piece_size="4K")
        assert target.read_bytes() == new
        assert result.verified and result.changed_blocks == 2
        assert result.bytes_moved == PIECE + 1234  # a whole piece and the short last one


def test_a_dense_rewrite_turns_refinement_off(tmp_path, caplog):
    old = random_bytes(48 * MiB, seed=14)
    buffer = bytearray(old)
    buffer[8 * MiB:40 * MiB] = random_bytes(32 * MiB, seed=15)  # every byte of 32 blocks
    (tmp_path / "source").write_bytes(bytes(buffer))
    (tmp_path / "target").write_bytes(old)
    caplog.set_level(logging.DEBUG, logger="pdiffcopy")
    result = sync(str(tmp_path / "source"), str(tmp_path / "target"), concurrency=1)
    assert (tmp_path / "target").read_bytes() == bytes(buffer)
    assert result.bytes_moved == 32 * MiB
    stopped = [r.getMessage() for r in caplog.records if "stopped paying" in r.getMessage()]
    # Refined until the probe (one step of 2 MiB) had all moved, the other 30 MiB moved whole:
    # a dense rewrite costs one small probe (an 8 MiB one cost 11 % of a 10 % delta on loopback).
    assert REFINE_PROBE_BYTES <= 2 * MiB
    assert len(stopped) == 1 and f"{32 * MiB - REFINE_PROBE_BYTES} bytes taken as whole blocks" in stopped[0], \
        stopped


def test_a_sparse_edit_keeps_refining(tmp_path, caplog):
    old = random_bytes(24 * MiB, seed=16)
    new = edited(old, [block * MiB + 77 for block in range(0, 24, 2)])  # every other block
    (tmp_path / "source").write_bytes(new)
    (tmp_path / "target").write_bytes(old)
    caplog.set_level(logging.DEBUG, logger="pdiffcopy")
    result = sync(str(tmp_path / "source"), str(tmp_path / "target"), concurrency=1)
    assert (tmp_path / "target").read_bytes() == new
    assert result.bytes_moved == 12 * PIECE
    assert not [r for r in caplog.records if "stopped paying" in r.getMessage()]


def test_the_wire_carries_the_pieces_not_the_blocks(tmp_path, server, unique):
    old = random_bytes(8 * MiB, seed=17)
    new = edited(old, SPARSE_CHANGES)
    (server.root / unique).write_bytes(new)
    (tmp_path / "target").write_bytes(old)
    pulled = stats(run_cli("--no-progress", "--stats", server.url(unique), str(tmp_path / "target")))
    assert int(pulled["moved"]) == 3 * PIECE
    # Three pieces, the block and piece digests and HTTP's headers: far below one block.
    assert int(pulled["received"]) < 3 * PIECE + 64 * KiB, pulled
    (tmp_path / "target").write_bytes(old)
    (server.root / unique).write_bytes(old)
    (tmp_path / "source").write_bytes(new)
    pushed = stats(run_cli("--no-progress", "--stats", str(tmp_path / "source"), server.url(unique)))
    assert int(pushed["moved"]) == 3 * PIECE
    assert int(pushed["sent"]) < 3 * PIECE + 64 * KiB, pushed
    assert (server.root / unique).read_bytes() == new


@pytest.mark.parametrize("value", ["3000", "1M", "abc"])
def test_a_bad_piece_size_is_one_line_and_the_usage_status(tmp_path, value):
    (tmp_path / "a").write_bytes(b"x" * 1000)
    completed = run_cli("--piece-size", value, str(tmp_path / "a"), str(tmp_path / "b"))
    assert completed.returncode == 1
    assert "Invalid piece size" in completed.stderr and "Traceback" not in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


# -- a tree's big file ------------------------------------------------------------------


def test_a_trees_big_file_moves_only_the_changed_pieces(ends: TreeEnds):
    from pdiffcopy.engine.treesync import TreeOptions, run_tree_sync

    ends.source.mkdir(parents=True)
    old = random_bytes(16 * MiB, seed=18)
    (ends.source / "big.db").write_bytes(old)
    (ends.source / "small").write_bytes(b"s" * 100)

    def run(**options):
        trees = ends.trees()
        try:
            return run_tree_sync(*trees, TreeOptions(concurrency=2, times=True, **options))
        finally:
            for tree in trees:
                tree.close()

    first = run()
    assert not first.failures and first.bytes_moved == len(old) + 100
    new = edited(old, [MiB + 5, 9 * MiB + 4 * KiB + 1, 15 * MiB + 100])
    (ends.source / "big.db").write_bytes(new)
    second = run()
    assert not second.failures
    assert (ends.target / "big.db").read_bytes() == new
    assert second.bytes_moved == 3 * PIECE  # was 3 MiB
    newer = edited(new, [2 * MiB], seed=4)
    (ends.source / "big.db").write_bytes(newer)
    third = run(piece_size=0)
    assert not third.failures and third.bytes_moved == MiB
    assert (ends.target / "big.db").read_bytes() == newer


def test_a_bad_piece_size_for_a_tree_is_refused_before_anything_moves(tmp_path):
    from pdiffcopy.api import sync_tree

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"a" * 1000)
    completed = run_cli("--piece-size", "3000", f"{tmp_path / 'src'}/", str(tmp_path / "dst"))
    assert completed.returncode == 1 and "Invalid piece size" in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1 and "Traceback" not in completed.stderr
    with pytest.raises(UsageError, match="Invalid piece size"):
        sync_tree(f"{tmp_path / 'src'}/", str(tmp_path / "dst"), piece_size="1M")  # the block size itself
    assert not (tmp_path / "dst").exists()
    done = sync_tree(f"{tmp_path / 'src'}/", str(tmp_path / "dst"), piece_size="8K")
    assert not done.failures and (tmp_path / "dst" / "a").read_bytes() == b"a" * 1000


# -- a pdiffcopy 1.0.1 server -----------------------------------------------------------

from test_compat_101 import original_server  # noqa: E402,F401  (the fixture: the real 1.0.1 server)


def test_no_refinement_with_a_101_server(original_server, tmp_path):  # noqa: F811
    # 1.0.1 hashes only whole files (4 KiB pieces: a hash list of the whole file) or, in
    # methods it lacks, not at all (the blocks would be read to hash them here): whole blocks move.
    old = random_bytes(4 * MiB, seed=19)
    new = edited(old, [100, 2 * MiB + 5000])
    (tmp_path / "source").write_bytes(new)
    (tmp_path / "target").write_bytes(old)
    for method in ("sha1", "xxh3_128"):
        (tmp_path / "target").write_bytes(old)
        pulled = stats(run_cli("-m", method, "-b", "64K", "--stats", f"{original_server}{tmp_path}/source",
                               str(tmp_path / "target"), timeout=60))
        assert int(pulled["moved"]) == 2 * 64 * KiB
        assert (tmp_path / "target").read_bytes() == new
    (tmp_path / "target").write_bytes(old)
    pushed = stats(run_cli("-m", "sha1", "-b", "64K", "--stats", str(tmp_path / "source"),
                           f"{original_server}{tmp_path}/target", timeout=60))
    assert int(pushed["moved"]) == 2 * 64 * KiB
    assert (tmp_path / "target").read_bytes() == new


def test_ranges_moved_whole_stay_as_they_came():
    """Ranges that refinement leaves whole (it stopped paying) go to the transfer as they came.

    They came back cut into probe- and step-sized parts: a 16 MiB transfer became a
    multipart one of eight ranges, and a 100 % changed 1 GiB push 7 % slower.
    """
    from pdiffcopy.core.refine import RefineTally
    from pdiffcopy.engine.segments import refine_ranges

    tally = RefineTally()
    tally.add(REFINE_PROBE_BYTES, REFINE_PROBE_BYTES)  # the probe moved everything: a dense change
    assert not tally.pays()
    assert refine_ranges(None, None, [(0, 16 * MiB), (20 * MiB, 5 * MiB)], 4096, "xxh3_128", tally) == \
        [(0, 16 * MiB), (20 * MiB, 5 * MiB)]


# -- refinement does not wait behind the whole segments --------------------------------


def test_piece_hashes_are_not_queued_behind_the_segments(server, unique):
    """A refinement step's hash request goes out while earlier segment hashes still wait.

    Refinement runs while later segments are still being hashed; in the segments'
    queue, no piece could move before the last segment was hashed (on the sparse 1 GiB
    pull on the shaped link, 0.1 s of round trips one after the other at the end).
    """
    from pdiffcopy.transport.remote import RemoteFile

    segment = 8 * MiB
    (server.root / unique).write_bytes(random_bytes(4 * segment))
    remote = RemoteFile(server.url(unique), concurrency=1)  # one thread: the segments queue up
    try:
        # sha3_512 hashes slowly (~0.2 s per 8 MiB segment here): the last segment still
        # waits in the queue when a quick request sent after it is already answered.
        queued = [remote.submit_hashes([(index * segment, segment)], 64 * KiB, "sha3_512")
                  for index in range(4)]
        first = remote.submit_hashes_first([(0, 64 * KiB)], PIECE, "sha3_512")
        assert len(first.result(timeout=30)) == 16 * 64  # 16 pieces, 64 bytes each
        assert not queued[-1].done(), "the piece hashes waited for every segment"
        assert all(len(future.result(timeout=60)) == segment // (64 * KiB) * 64 for future in queued)
    finally:
        remote.close()

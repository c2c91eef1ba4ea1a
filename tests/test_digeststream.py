"""A file's digests a segment at a time (engine/digeststream.py): the same answers as the per-block lists.

The whole-file digest folded segment by segment must be the digest of tree_digest_input; the
packed comparison must find the blocks the per-block one finds; the verification counts the
blocks that differ as check_blocks does; a run of equal segments is kept once.
"""

from __future__ import annotations

import random
from concurrent.futures import Future

import pytest

from pdiffcopy.core.blocks import BlockPlan, changed_blocks, split_digests, tree_digest_input
from pdiffcopy.core.hashing import digest_bytes, digest_size
from pdiffcopy.engine.digeststream import Lookahead, SegmentDigests, StreamingVerification
from pdiffcopy.engine.segments import check_blocks
from pdiffcopy.errors import VerificationFailed


def test_the_segment_sequence_is_the_list_of_segments():
    for size in (0, 1, 4096, 10 * 4096 + 5, 64 * 4096, 65 * 4096):
        plan = BlockPlan(size, 4096, segment_size=8 * 4096)
        sequence = plan.segment_sequence()
        assert list(sequence) == plan.segments()
        assert len(sequence) == len(plan.segments())
        assert [sequence[i] for i in range(-len(sequence), len(sequence))] == plan.segments() * 2
        with pytest.raises(IndexError):
            sequence[len(sequence)]


def test_packed_digests_find_the_blocks_the_lists_find():
    rng = random.Random(7)
    plan = BlockPlan(20 * 4096 + 100, 4096, segment_size=8 * 4096)
    width = 16
    for segment in plan.segments():
        ours = rng.randbytes(width * segment.block_count)
        theirs = bytearray(ours)
        for block in rng.sample(range(segment.block_count), rng.randrange(segment.block_count + 1)):
            theirs[block * width] ^= 1
        expected = changed_blocks(segment, split_digests(ours, width), split_digests(bytes(theirs), width))
        assert changed_blocks(segment, ours, bytes(theirs), width) == expected
        assert changed_blocks(segment, ours, None, width) == list(range(segment.first_block,
                                                                         segment.first_block + segment.block_count))


@pytest.mark.parametrize("method", ["xxh3_128", "sha256", "blake2b"])
def test_the_folded_whole_file_digest_is_the_tree_digest(method):
    rng = random.Random(method)
    width = digest_size(method)
    segments = [rng.randbytes(width * 8) for _ in range(5)] + [bytes(width * 3)]
    verification = StreamingVerification(123456, 4096, method, "target")
    for digests in segments:
        verification.add(digests, digests)
    every = [digest for digests in segments for digest in split_digests(digests, width)]
    assert verification.digest() == digest_bytes(method, tree_digest_input(123456, 4096, method, every)).hex()


def test_the_verification_counts_the_blocks_that_differ_as_check_blocks_does():
    width = 16
    ours = [bytes([n]) * width for n in range(12)]
    theirs = list(ours)
    theirs[3] = b"x" * width
    theirs[9] = b"y" * width
    verification = StreamingVerification(12 * 4096, 4096, "xxh3_128", "target")
    verification.add(b"".join(ours[:6]), b"".join(theirs[:6]))
    verification.add(b"".join(ours[6:]), b"".join(theirs[6:]), unknown=1)  # one block never read back
    theirs[7] = b""
    with pytest.raises(VerificationFailed) as expected:
        check_blocks(ours, theirs, "target")
    with pytest.raises(VerificationFailed) as folded:
        verification.digest()
    assert str(folded.value) == str(expected.value) == \
        "Verification failed: 3 block(s) of target differ from the source after the sync"


def test_a_run_of_equal_segments_is_kept_once():
    kept = SegmentDigests()
    hole = bytes(64)
    for digests in [b"a" * 64, hole, bytes(64), hole, b"b" * 64, b"b" * 64]:
        kept.append(digests)
    assert len(kept.runs) == 3
    assert list(kept) == [b"a" * 64, hole, hole, hole, b"b" * 64, b"b" * 64]


def test_the_lookahead_starts_a_bounded_window_and_keeps_the_order():
    started = []

    def starts():
        for index in range(50):
            started.append(index)
            if index % 3:
                yield index, bytes([index])  # known at once (a hole)
            else:
                future: "Future[bytes]" = Future()
                future.set_result(b"f")
                yield index, future

    stream = Lookahead.started(starts(), window=4)
    assert started == list(range(10))  # four futures (0, 3, 6, 9) and what lies between
    read = []
    for index, digests in stream:
        read.append((index, digests))
        assert len(started) - len(read) <= 4 * 3  # four futures and the holes between: never further ahead
    assert [index for index, _ in read] == list(range(50))
    assert all(digests == (bytes([index]) if index % 3 else b"f") for index, digests in read)

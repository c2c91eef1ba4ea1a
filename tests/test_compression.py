"""zstd frames on the wire: damage is caught, never written; the adaptive policy's decisions."""

import os

import pytest

from pdiffcopy.core import compression
from pdiffcopy.core.compression import CompressionError
from pdiffcopy.transport.compressionpolicy import AdaptivePolicy

pytest.importorskip("zstandard")

TEXT = b"".join(b"line %d of a log that repeats itself a lot\n" % (i % 97) for i in range(20000))


def test_a_frame_round_trips():
    frame = compression.compress(TEXT)
    assert len(frame) < len(TEXT) / 4
    assert compression.decompress(frame, len(TEXT)) == TEXT


def test_a_truncated_frame_is_an_error():
    frame = compression.compress(TEXT)
    with pytest.raises(CompressionError, match="Damaged"):
        compression.decompress(frame[: len(frame) // 2], len(TEXT))


def test_a_corrupted_frame_is_an_error():
    frame = bytearray(compression.compress(TEXT))
    frame[len(frame) // 2] ^= 0xFF
    with pytest.raises(CompressionError):
        compression.decompress(bytes(frame), len(TEXT))


def test_a_wrong_length_is_an_error():
    frame = compression.compress(TEXT)
    with pytest.raises(CompressionError, match="announces"):
        compression.decompress(frame, len(TEXT) + 1)


class Clock:
    def __init__(self, step):
        self.now, self.step = 0.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def test_no_compression_before_anything_is_known():
    assert not AdaptivePolicy(cores=2).compress()


def test_compressible_data_on_a_slow_link_is_compressed():
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))  # TEXT (858 KB) a millisecond: fast
    policy.sample(TEXT)
    policy.link_observed(25_000_000, 1.0)  # 200 Mbit
    assert policy.compress()


def test_random_data_is_never_compressed():
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))
    policy.sample(os.urandom(1 << 20))
    policy.link_observed(25_000_000, 1.0)
    assert not policy.compress()


def test_a_link_faster_than_the_compressors_is_left_plain():
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))  # 858 MB/s a core
    policy.sample(TEXT)
    policy.link_observed(3_000_000_000, 1.0)  # loopback: 3 GB/s
    assert not policy.compress()


# -- the level, chosen from the link and the compressor's speed -------------------

MB = 1_000_000


def test_a_slow_link_gets_the_densest_level_that_outruns_it():
    measured = {1: (3.85, 330 * MB), 3: (4.10, 250 * MB), 5: (4.23, 137 * MB), 6: (4.33, 89 * MB),
                9: (4.44, 58 * MB), 19: (5.22, 2.8 * MB)}
    assert compression.CPU_MARGIN == 2
    # 200 Mbit, two cores: level 5 moves min(2 * 137 / 2, 4.23 * 25) = 106 MB/s of file bytes,
    # level 6 only what its CPU allows (89), level 3 what the link allows (102).
    assert compression.choose_level(measured, cores=2, link_rate=25 * MB) == 5
    # With a margin of 1.5, level 6 would win: min(2 * 89 / 1.5, 4.33 * 25) = 108.
    assert compression.choose_level(measured, cores=2, link_rate=25 * MB, margin=1.5) == 6
    # 10 Mbit: level 9 still outruns the link; 19 would need 2 * 5.22 * 1.25 = 13 MB/s of CPU.
    assert compression.choose_level(measured, cores=2, link_rate=1.25 * MB) == 9
    # 1 Mbit: even level 19 does.
    assert compression.choose_level(measured, cores=2, link_rate=0.125 * MB) == 19
    # One core halves what the CPU can give: a lower level on the same link.
    assert compression.choose_level(measured, cores=1, link_rate=25 * MB) == 3


def test_a_link_faster_than_the_fastest_level_gets_no_compression():
    measured = {1: (3.85, 330 * MB), 6: (4.33, 89 * MB)}
    assert compression.choose_level(measured, cores=2, link_rate=400 * MB) is None
    # Half the fastest level's speed on two cores: level 1, which loses least to the CPU.
    assert compression.choose_level(measured, cores=2, link_rate=300 * MB) == 1


def test_data_that_barely_shrinks_gets_no_compression_at_any_level():
    measured = {1: (1.05, 900 * MB), 19: (1.3, 900 * MB)}
    assert compression.choose_level(measured, cores=2, link_rate=MB) is None


def test_nothing_measured_or_no_link_gets_no_compression():
    assert compression.choose_level({}, cores=2, link_rate=MB) is None
    assert compression.choose_level({1: (4.0, 300 * MB)}, cores=2, link_rate=0) is None


def test_a_tie_goes_to_the_level_with_fewer_bytes():
    # Both move what the CPU gives (30 / 2 = 15 MB/s, under 3 and 4 times 5): the same
    # speed, and the higher ratio puts fewer bytes on the wire.
    measured = {1: (3.0, 30 * MB), 3: (4.0, 30 * MB)}
    assert compression.choose_level(measured, cores=1, link_rate=5 * MB) == 3


def test_a_denser_level_that_compresses_worse_is_not_taken():
    # Measured, not assumed: on some data a higher level shrinks it less.
    measured = {1: (4.0, 300 * MB), 6: (3.8, 100 * MB)}
    assert compression.choose_level(measured, cores=2, link_rate=MB) == 1


def test_the_policy_times_the_levels_only_while_they_outrun_the_link():
    # Every timing takes 1 ms: the sample (TEXT, 0.8 MB) at 840 MB/s a core at every level.
    slow = AdaptivePolicy(cores=2, clock=Clock(0.001))
    slow.sample(TEXT)
    assert list(slow.measured) == [1]  # the sample alone times only the fastest level
    slow.link_observed(100_000, 1.0)  # 0.8 Mbit: every level outruns it
    assert list(slow.measured) == [1]
    level = slow.level()
    assert sorted(slow.measured) == sorted(compression.LEVELS)
    assert slow.measured[level][0] == max(ratio for ratio, _ in slow.measured.values())
    # 100 MB/s: level 1 (840 MB/s of CPU for ratio * 100 MB/s) no longer outruns the link but
    # still beats it plain: compressed at level 1, and no slower level is timed.
    fast = AdaptivePolicy(cores=2, clock=Clock(0.001))
    fast.sample(TEXT)
    fast.link_observed(100 * MB, 1.0)
    assert fast.level() == 1
    assert list(fast.measured) == [1]


def test_the_policy_times_no_other_level_for_random_data():
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))
    policy.sample(os.urandom(1 << 20))
    policy.link_observed(MB, 1.0)
    assert policy.level() is None
    assert list(policy.measured) == [1]


def test_a_level_asked_for_is_read_and_bounded():
    assert compression.accepted_frames_level(None) is None
    assert compression.accepted_frames_level("application/octet-stream") is None
    assert compression.accepted_frames_level(compression.FRAMES_TYPE) == compression.LEVEL
    assert compression.accepted_frames_level(compression.frames_accept(6)) == 6
    assert compression.accepted_frames_level(f"text/plain, {compression.FRAMES_TYPE};level=\"9\"") == 9
    assert compression.accepted_frames_level(f"{compression.FRAMES_TYPE}; level=99") == compression.MAX_LEVEL
    assert compression.accepted_frames_level(f"{compression.FRAMES_TYPE}; level=-3") == 1
    assert compression.accepted_frames_level(f"{compression.FRAMES_TYPE}; level=fast") == compression.LEVEL
    assert compression.asked_level(None) == compression.LEVEL
    assert compression.asked_level("12") == 12


@pytest.mark.parametrize("level", [1, 6, 19])
def test_frames_at_any_level_decode_and_their_damage_is_caught(level):
    import io

    data = TEXT[: 3 * compression.FRAME_BYTES // 2]
    body = b"".join(compression.frame(offset, data[offset:offset + length], level)
                    for offset, length in compression.pieces([(0, len(data))]))
    assert b"".join(piece for _, piece, _ in compression.read_frames(io.BytesIO(body).read)) == data
    for damaged in (body[:-7], body[:20] + bytes([body[20] ^ 0xFF]) + body[21:]):
        with pytest.raises(CompressionError):
            list(compression.read_frames(io.BytesIO(damaged).read))


def test_ranges_split_after_a_count_of_bytes():
    assert compression.split_after([(0, 10), (20, 10)], 15) == ([(0, 10), (20, 5)], [(25, 5)])
    assert compression.split_after([(0, 10)], 10) == ([(0, 10)], [])
    assert compression.split_after([(0, 10)], 30) == ([(0, 10)], [])
    assert compression.split_after([(5, 10), (40, 1)], 0) == ([], [(5, 10), (40, 1)])


def test_the_link_starves_when_compressing_outlasts_the_other_transfers_sending():
    assert compression.starved(compress_seconds=0.3, send_seconds=0.2, transfers=2)
    assert not compression.starved(compress_seconds=0.3, send_seconds=0.4, transfers=2)
    # Three in flight: two send while one compresses.
    assert not compression.starved(compress_seconds=0.3, send_seconds=0.2, transfers=3)
    assert compression.starved(compress_seconds=0.3, send_seconds=0.2, transfers=1)


def test_a_level_that_starved_the_link_is_not_chosen_again():
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))
    policy.sample(TEXT)
    policy.link_observed(100_000, 1.0)
    chosen = policy.level()
    assert chosen == max(compression.LEVELS, key=lambda level: (policy.measured[level][0], level))
    policy.compressed(chosen, compress_seconds=0.5, send_seconds=0.1)
    lowered = policy.level()
    assert lowered is not None and lowered < chosen
    # The link kept up at the lower level: it stays, and is never raised back.
    policy.compressed(lowered, compress_seconds=0.1, send_seconds=0.5)
    assert policy.level() == lowered
    # Starved at level 1 too: compressing still pays by the measurements, so level 1 stays.
    for _ in compression.LEVELS:
        policy.compressed(policy.level(), compress_seconds=0.5, send_seconds=0.1)
    assert policy.level() == 1


def test_a_link_seen_faster_than_probed_lowers_the_level():
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))
    policy.sample(TEXT)
    policy.link_observed(100_000, 1.0)
    slow = policy.level()
    policy.link_at_least(50_000)  # slower than probed: the probe stands
    assert policy.link_rate == 100_000 and policy.level() == slow
    policy.link_at_least(100 * MB)  # the compressed transfers together moved this much
    assert policy.link_rate == 100 * MB
    assert policy.level() < slow

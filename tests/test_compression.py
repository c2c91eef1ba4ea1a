"""zstd frames on the wire: damage is caught, never written; the adaptive policy's decisions."""

import os

import pytest

from pdiffcopy.core import compression
from pdiffcopy.core.compression import AdaptivePolicy, CompressionError

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
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))  # 256 KiB a millisecond: fast compressor
    policy.sample(TEXT)
    policy.link_observed(25_000_000, 1.0)  # 200 Mbit
    assert policy.compress()


def test_random_data_is_never_compressed():
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))
    policy.sample(os.urandom(1 << 20))
    policy.link_observed(25_000_000, 1.0)
    assert not policy.compress()


def test_a_link_faster_than_the_compressors_is_left_plain():
    policy = AdaptivePolicy(cores=2, clock=Clock(0.001))  # 262 MB/s a core
    policy.sample(TEXT)
    policy.link_observed(3_000_000_000, 1.0)  # loopback: 3 GB/s
    assert not policy.compress()

"""The bandwidth limiter's arithmetic, with a simulated clock (no timing of the machine)."""

import threading

import pytest

from pdiffcopy.core.ratelimit import TokenBucket, parse_rate
from pdiffcopy.engine.forkshared import Throttle


class FakeClock:
    """A clock that only moves when somebody sleeps: the limiter's waits are its whole time."""

    def __init__(self):
        self.now = 1000.0
        self.lock = threading.Lock()

    def time(self):
        return self.now

    def sleep(self, seconds):
        assert seconds >= 0
        with self.lock:
            self.now += seconds


@pytest.mark.parametrize("text, expected", [
    ("50M", 50 * 2**20), ("50m", 50 * 2**20), ("100", 100 * 1024), ("1.5MB", 1_500_000), ("2G", 2 * 2**30),
    ("512b", 512), ("10KiB", 10240), ("10KB", 10000), (" 7k ", 7168),
])
def test_rates_in_rsync_syntax(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text", ["0", "0.0", "0M"])
def test_zero_means_no_limit(text):
    assert parse_rate(text) is None


@pytest.mark.parametrize("text", ["", "fast", "10X", "-5M", "1e3", "100b", "M"])
def test_bad_rates_are_refused_with_the_syntax(text):
    with pytest.raises(ValueError, match="Invalid rate"):
        parse_rate(text)


@pytest.mark.parametrize("chunk", [4096, 1 << 20, 3 << 20])
def test_average_rate_holds_for_any_chunk_size(chunk):
    clock = FakeClock()
    rate = 50 * 2**20
    bucket = Throttle(rate, clock=clock.time, sleep=clock.sleep)
    started = clock.now
    total = 0
    for _ in range(200):
        bucket.take(chunk)
        total += chunk
    elapsed = clock.now - started
    # The initial burst is the only allowance above the rate.
    assert (total - bucket.burst) / rate <= elapsed * 1.0001
    assert elapsed <= total / rate * 1.0001


def test_idle_time_does_not_bank_more_than_the_burst():
    clock = FakeClock()
    bucket = Throttle(10_000_000, burst=1_000_000, clock=clock.time, sleep=clock.sleep)
    clock.now += 3600  # an hour idle
    assert bucket.take(1_000_000) == 0
    assert bucket.take(1_000_000) == pytest.approx(0.1)


def test_concurrent_callers_queue_behind_each_others_debt():
    # Two transfers take at the same instant: the second waits for the first's bytes too.
    waits = []
    bucket = Throttle(1_000_000, burst=100_000, clock=lambda: 0.0, sleep=waits.append)
    bucket.take(100_000)
    bucket.take(500_000)
    bucket.take(500_000)
    assert waits == [pytest.approx(0.5), pytest.approx(1.0)]


def test_the_bucket_itself_only_says_how_long_to_wait():
    """core/ does no I/O: the bucket returns the wait for the times it is given, and never sleeps."""
    bucket = TokenBucket(1_000_000, now=100.0, burst=100_000)
    assert bucket.take(100_000, now=100.0) == 0
    assert bucket.take(300_000, now=100.0) == pytest.approx(0.3)
    assert bucket.take(100_000, now=100.4) == pytest.approx(0.0)  # the debt paid off meanwhile

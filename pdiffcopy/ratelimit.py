"""A bandwidth limit: rsync's ``--bwlimit`` syntax and a token bucket shared by threads.

Pure arithmetic with an injectable clock, so the limit is tested without timing the machine;
the transport and the server call :meth:`TokenBucket.take` before each chunk they send or
after each chunk they receive.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Callable, Optional

#: rsync's multipliers: a bare number is KiB; K/M/G (and KiB/MiB/GiB) are powers of 1024,
#: KB/MB/GB powers of 1000; B means bytes.
_UNITS = {
    "": 1024, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)

#: The bucket holds this many seconds of the rate: enough for one chunk of a transfer to go
#: at once, small enough that the average over a second stays at the limit.
BURST_SECONDS = 0.1
#: ...but never less than one chunk of the transfers (1 MiB), or a chunk would wait forever.
MIN_BURST = 1024 * 1024


def parse_rate(text: str) -> Optional[int]:
    """rsync's ``--bwlimit=RATE`` in bytes per second; 0 means no limit (None).

    >>> parse_rate("50M"), parse_rate("100"), parse_rate("1.5MB"), parse_rate("0")
    (52428800, 102400, 1500000, None)
    """
    match = _RATE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"Invalid rate {text!r}: expected a number with an optional unit "
                         f"such as 500K, 50M or 1.5MB (a bare number is KiB per second, as in rsync)")
    rate = int(float(match.group(1)) * _UNITS[unit])
    if rate == 0 and float(match.group(1)) == 0:
        return None
    if rate < 512:
        raise ValueError(f"Invalid rate {text!r}: below 512 bytes per second")
    return rate


class TokenBucket:
    """At most `rate` bytes per second on average, shared by every thread that takes from it.

    A caller that takes more than the bucket holds goes into debt and sleeps it off, so a
    large chunk is never split and never waits forever; the average still holds.
    """

    def __init__(self, rate: int, burst: Optional[int] = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = burst if burst is not None else max(MIN_BURST, int(rate * BURST_SECONDS))
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(self.burst)
        self._updated = clock()

    def take(self, count: int) -> float:
        """Account for `count` bytes; sleep until the average allows them. Returns the wait."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
            self._updated = now
            self._tokens -= count
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait

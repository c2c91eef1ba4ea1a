"""A bandwidth limit: rsync's ``--bwlimit`` syntax and a token bucket shared by threads.

Pure arithmetic on the times it is given, so the limit is tested without timing the machine;
the transport and the server take from a :class:`pdiffcopy.engine.forkshared.Throttle` (this
bucket, a clock, a lock and a sleep) before each chunk they send or after each they receive.
"""

from __future__ import annotations

import re
from typing import MutableSequence, Optional

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

#: The lowest ``--bwlimit`` a client may ask for: twice the rate below which a pdiffcopy server
#: ends a connection as a stalled peer (``guard.MIN_RATE``, 16 KiB/s), so that a limited client,
#: which moves a chunk and then waits, always stays well above it.
MIN_CLIENT_RATE = 32 * 1024


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


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*([+-]1)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """rsync's ``--max-size``/``--min-size`` SIZE in bytes: a bare number is bytes, the units as
    :func:`parse_rate`'s, and a ``+1`` or ``-1`` after them adds or takes one byte.

    >>> parse_size("1999"), parse_size("1.5K"), parse_size("1KB+1"), parse_size("2M-1")
    (1999, 1536, 1001, 2097151)
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"Invalid size {text!r}: expected a number with an optional unit such as 500K, "
                         f"50M or 1.5MB, and +1 or -1 (a bare number is bytes, as in rsync)")
    return max(0, int(float(match.group(1)) * (_UNITS[unit] if unit else 1)) + int(match.group(3) or 0))


def bandwidth_limit(value: "int | str | None", what: str = "--bwlimit") -> Optional[int]:
    """A client's limit in bytes per second from rsync's syntax or an int; None for no limit.

    :raises UsageError: For a value :func:`parse_rate` refuses, or one below :data:`MIN_CLIENT_RATE`.
    """
    from pdiffcopy.errors import UsageError

    if value is None or isinstance(value, bool):
        return None
    try:
        rate = parse_rate(value) if isinstance(value, str) else (int(value) or None)
    except ValueError as error:
        raise UsageError(f"{what}: {error}") from None
    if rate is not None and rate < MIN_CLIENT_RATE:
        raise UsageError(f"{what}: {value!r} is below {MIN_CLIENT_RATE // 1024}K, the least a pdiffcopy "
                         f"server waits for (it ends connections slower than half of that)")
    return rate


class TokenBucket:
    """At most ``rate`` bytes per second on average: how long each taker must wait (it does not wait here).

    A caller that takes more than the bucket holds goes into debt and waits it off, so a
    large chunk is never split and never waits forever; the average still holds. Pure
    arithmetic on the times it is given (h11's way): the waiting, the clock, the lock and
    the memory that processes share are :class:`pdiffcopy.engine.forkshared.Throttle`'s.

    :param state: Where its two numbers live (tokens, time of the last take): a list by
                  default, or memory that forked processes share.
    """

    def __init__(self, rate: int, now: float, burst: Optional[int] = None,
                 state: "Optional[MutableSequence[float]]" = None) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = burst if burst is not None else max(MIN_BURST, int(rate * BURST_SECONDS))
        self._state: MutableSequence[float] = state if state is not None else [0.0, 0.0]
        self._state[0] = float(self.burst)
        self._state[1] = now

    def take(self, count: int, now: float) -> float:
        """Account for ``count`` bytes at time ``now``; return the seconds to wait before moving them.

        Not thread-safe: callers that share a bucket take under one lock.
        """
        state = self._state
        tokens = min(self.burst, state[0] + (now - state[1]) * self.rate) - count
        state[0], state[1] = tokens, now
        return -tokens / self.rate if tokens < 0 else 0.0

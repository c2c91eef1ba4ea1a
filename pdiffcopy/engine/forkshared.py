"""Numbers that forked workers and their parent share, with a lock: without :mod:`multiprocessing`.

A tree run's queue needs a few shared counters (the next unit, each big file's
parts left and failed, the progress figures); a ``--bwlimit`` or a server's
``--max-rate`` one token bucket for every process (:class:`Throttle`). :mod:`multiprocessing`'s
``Value`` and ``Array`` cost a run about 13 ms before its first unit: its
import (with socket and pickle), a heap file in /dev/shm (statfs, mkstemp,
unlink) and its semaphores. Anonymous shared memory and a pipe do the same
for forked processes at once.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Callable, Iterable, Optional

from pdiffcopy.core.ratelimit import TokenBucket


def shared_ints(count: int) -> memoryview:
    """``count`` 64-bit integers, zero, that processes forked from now on share with this one."""
    return memoryview(mmap.mmap(-1, 8 * max(1, count))).cast("q")


def shared_floats(count: int) -> memoryview:
    """``count`` doubles, zero, that processes forked from now on share with this one."""
    return memoryview(mmap.mmap(-1, 8 * max(1, count))).cast("d")


class PipeLock:
    """A lock between this process and those it forks: a pipe holding one byte, held by whoever read it.

    As with a semaphore, a process killed while holding it leaves it held.
    """

    _read = _write = -1

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.write(self._write, b"\0")

    def __enter__(self) -> "PipeLock":
        os.read(self._read, 1)  # blocks while another process holds it
        return self

    def __exit__(self, *exc_info) -> None:
        os.write(self._write, b"\0")

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1

    def __del__(self) -> None:
        if self._write >= 0:
            self.close()


class SharedInts:
    """Shared integers with one lock, used as ``multiprocessing.Array("q", ...)`` is (``value``: the first)."""

    def __init__(self, values: Iterable[int]) -> None:
        values = list(values)
        self._ints = shared_ints(len(values))
        for index, value in enumerate(values):
            self._ints[index] = value
        self._lock = PipeLock()

    def get_lock(self) -> PipeLock:
        return self._lock

    def __getitem__(self, index: int) -> int:
        return self._ints[index]

    def __setitem__(self, index: int, value: int) -> None:
        self._ints[index] = value

    def __len__(self) -> int:
        return len(self._ints)

    @property
    def value(self) -> int:
        return self._ints[0]

    @value.setter
    def value(self, value: int) -> None:
        self._ints[0] = value


class Throttle:
    """A :class:`~pdiffcopy.core.ratelimit.TokenBucket` that threads, or with ``shared`` processes
    forked after it was made (gunicorn's workers, a tree sync's), take from: each waits off its debt.

    ``time.monotonic`` is the same clock in every process of the machine.
    """

    def __init__(self, rate: int, burst: Optional[int] = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, shared: bool = False) -> None:
        self._clock, self._sleep = clock, sleep
        self._lock = PipeLock() if shared else threading.Lock()
        self.bucket = TokenBucket(rate, clock(), burst, shared_floats(2) if shared else None)
        self.rate, self.burst = self.bucket.rate, self.bucket.burst

    def take(self, count: int) -> float:
        """Account for ``count`` bytes; sleep until the average allows them. Returns the wait."""
        with self._lock:
            wait = self.bucket.take(count, self._clock())
        if wait > 0:
            self._sleep(wait)
        return wait


__all__ = ["PipeLock", "SharedInts", "Throttle", "shared_floats", "shared_ints"]

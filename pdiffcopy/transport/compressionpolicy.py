"""Whether a sync's transfers cross the wire compressed, and at which level (``-z``, ``--compress-level``, ``auto``).

The frames themselves and the rules are :mod:`pdiffcopy.core.compression`'s; this is the state
one remote file or tree keeps of them: the mode asked for, what its transfers measured, and the
levels timed on this machine (:class:`AdaptivePolicy`: a clock of its own, so not in ``core/``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Dict, Optional, Sequence
from urllib.parse import urlsplit

from pdiffcopy.core import compression
from pdiffcopy.core.addresses import is_loopback
from pdiffcopy.core.compression import (
    LEVELS,
    SAMPLE_BYTES,
    choose_level,
    compress,
    level_compressor,
    Measurement,
    outruns,
    starved,
)

logger = logging.getLogger(__name__)


#: While the adaptive policy cannot decide yet, a transfer sends only this much plain first, as a
#: probe of the link and a sample of the data, and the rest as the policy then says: one frame's
#: worth. Whole 16 MiB requests as probes sent the first 28 MiB of a 256 MiB text file plain on a
#: 200 Mbit link (87 MiB on the wire where rsync -z sent 60).
PROBE_BYTES = compression.FRAME_BYTES


#: The least a compressed request carries for its times to judge the level (:meth:`Compression.compressed`):
#: a 1 MiB tail took 18 ms to compress at level 6 and 8 ms to send, which is no sign of a starved link.
JUDGED_BYTES = 4 * compression.FRAME_BYTES


#: ``scheme://host:port`` of loopback addresses with a real link behind them: the near ends
#: of the ssh tunnels of ``HOST:PATH`` arguments whose HOST is another machine. (Module
#: state: the tree's worker processes are forked once the tunnel exists.)
_TUNNELS: set = set()


def note_tunnel(base: str, *, open: bool = True) -> None:
    """Say that the loopback ``base`` leads to another host (``open=False``: no more)."""
    parts = urlsplit(base)
    key = f"{parts.scheme}://{parts.netloc}"
    if open:
        _TUNNELS.add(key)
    else:
        _TUNNELS.discard(key)


def _tunnelled(base: str) -> bool:
    parts = urlsplit(base)
    return f"{parts.scheme}://{parts.netloc}" in _TUNNELS


class AdaptivePolicy:
    """Decide per stream whether compressing pays, and at which level, from what the stream shows.

    The transport reports how fast bytes cross the link (:meth:`link_observed`) and hands over
    a sample of the data (:meth:`sample`); :meth:`compress` and :meth:`level` are the answer.
    Until both are known it answers no: a transfer starts plain, as on loopback it should stay.
    The levels are timed on the sample lazily, from the fastest up, and only until one no
    longer outruns the link: the slower ones could not do better, and a fast link never pays
    for timing level 19.
    """

    def __init__(self, cores: int, clock=time.perf_counter, levels: Sequence[int] = LEVELS) -> None:
        self.cores = max(1, cores)
        self._clock = clock
        self._levels = tuple(sorted(levels))
        self._sample: Optional[bytes] = None
        #: Each level timed so far: (ratio, raw bytes per second on one core).
        self.measured: Dict[int, Measurement] = {}
        self.link_rate: Optional[float] = None
        #: The highest level still allowed: lowered below each level that starved the link.
        self.ceiling: Optional[int] = None
        self._lock = threading.Lock()

    @property
    def ratio(self) -> Optional[float]:
        """The fastest level's ratio on the sample (None before a sample)."""
        first = self.measured.get(self._levels[0])
        return first[0] if first else None

    @property
    def compress_rate(self) -> Optional[float]:
        """The fastest level's speed on one core (None before a sample)."""
        first = self.measured.get(self._levels[0])
        return first[1] if first else None

    def sample(self, data: "bytes | memoryview") -> None:
        """Keep a sample once, and time the fastest level on it."""
        if self._sample is not None or not data:
            return
        with self._lock:
            if self._sample is None:
                self._sample = bytes(memoryview(data)[:SAMPLE_BYTES])
                self._measure(self._levels[0])

    def _measure(self, level: int) -> Measurement:
        assert self._sample is not None
        # The import and the compressor's context are made first: timed with the sample, they
        # made one core look 20 times slower than it is (18 MB/s here) and kept -z off. The
        # better of two runs: a context's first run also allocates its tables (each level's
        # first run here was 3 to 5 times slower than its second), and one run is at the
        # mercy of the scheduler on a busy machine.
        level_compressor(level)
        seconds = float("inf")
        for _ in range(2):
            started = self._clock()
            compressed = len(compress(self._sample, level))
            seconds = min(seconds, max(self._clock() - started, 1e-6))
        measurement = self.measured[level] = (len(self._sample) / max(compressed, 1), len(self._sample) / seconds)
        return measurement

    def link_observed(self, count: int, seconds: float) -> None:
        """Plain bytes took `seconds` to cross the link (keeps a moving average)."""
        if seconds <= 0 or count <= 0:
            return
        rate = count / seconds
        with self._lock:
            self.link_rate = rate if self.link_rate is None else 0.7 * self.link_rate + 0.3 * rate

    def link_at_least(self, rate: float) -> None:
        """The link carried ``rate`` bytes a second (compressed transfers, together): a short
        plain probe may have seen it slower than it is, never faster."""
        with self._lock:
            if self.link_rate is not None and rate > self.link_rate:
                self.link_rate = rate

    def compress(self) -> bool:
        """Whether the rest of the stream should be compressed."""
        return self.level() is not None

    def level(self) -> Optional[int]:
        """The level to compress the rest of the stream at; None: do not compress."""
        if self._sample is None or self.link_rate is None:
            return None
        with self._lock:
            fastest = self._levels[0]
            if choose_level({fastest: self.measured[fastest]}, self.cores, self.link_rate) is None:
                return None  # random data or a fast link: no other level is timed
            for level in self._levels:
                measurement = self.measured.get(level) or self._measure(level)
                if not outruns(measurement, self.cores, self.link_rate):
                    break
            allowed = {level: measured for level, measured in self.measured.items()
                       if self.ceiling is None or level <= self.ceiling}
            return choose_level(allowed, self.cores, self.link_rate)

    def compressed(self, level: int, compress_seconds: float, send_seconds: float) -> None:
        """A transfer compressed at ``level`` took these times to compress and to send: when
        compressing starved the link (:func:`starved`), the next lower level is the most from
        now on. Never raised again: a choice that flips back and forth costs more than a level."""
        if not starved(compress_seconds, send_seconds, self.cores):
            return
        with self._lock:
            lower = [candidate for candidate in self._levels if candidate < level]
            if lower and (self.ceiling is None or lower[-1] < self.ceiling):
                self.ceiling = lower[-1]


class Compression:
    """Whether a stream's ranges cross the wire compressed, and at which level: the mode asked
    for, and for ``auto`` the :class:`AdaptivePolicy` fed with what
    the stream's plain transfers showed.

    Shared by a file, its temporary, and the files of one tree, so what one measured serves all.
    ``cores``: how many compress at once, the sending side's cores or the transfers in flight,
    whichever is fewer (each transfer compresses its own frames, in its own thread on the
    client or its own request's thread on the server).

    :param measure_loopback: Let the policy decide on a loopback address too. By default a
                             loopback server stays plain (no link to spare: compressing only
                             costs CPU); the near end of a tunnel (``ssh -L``) is loopback with
                             a real link behind it, which a library caller can say here.
    :param policy: Another :class:`AdaptivePolicy` (one with a
                   clock of its own, say).
    """

    def __init__(self, mode: "str | int" = "auto", base: str = "", measure_loopback: bool = False,
                 cores: Optional[int] = None, policy: Optional[AdaptivePolicy] = None) -> None:
        self.mode = compression.check_mode(mode)
        self.base = base
        self.policy = policy or AdaptivePolicy(cores or os.cpu_count() or 1)
        self.measure_loopback = measure_loopback
        self._loopback = (is_loopback(urlsplit(base).hostname or "") and not measure_loopback
                          and not _tunnelled(base))
        #: Held by the one transfer probing the link, so that it has the link to itself (two at
        #: once would each see half the rate) and the others wait for its verdict.
        self.probe_lock = threading.Lock()
        # The compressed bytes all transfers moved, since the first began: what the link carried.
        self._moved_lock = threading.Lock()
        self._moved_since: Optional[float] = None
        self._moved = 0

    @property
    def judges_the_link(self) -> bool:
        """Whether ``auto`` decides by what the link shows (False: a loopback server stays plain)."""
        return not self._loopback

    def now(self) -> bool:
        """Whether the next request should compress."""
        return self.level() is not None

    def level(self) -> Optional[int]:
        """The level the next request should compress at; None: send it plain."""
        if type(self.mode) is int:  # --compress-level
            return self.mode
        if self.mode != "auto":
            return compression.LEVEL if self.mode == "always" else None
        return None if self._loopback else self.policy.level()

    def learning(self) -> bool:
        """Whether plain transfers should still be measured and sampled."""
        return self.mode == "auto" and not self._loopback and not self.policy.compress()

    def probing(self) -> bool:
        """Whether the policy still lacks the link's rate or a sample: a transfer then probes first."""
        return self.learning() and (self.policy.link_rate is None or self.policy.ratio is None)

    def compressed(self, level: int, count: int, compress_seconds: float, send_seconds: float) -> None:
        """A request of ``count`` bytes compressed at ``level`` here took these times to compress
        and to send. A small one is not judged: its sending is mostly the request's round trip."""
        if self.mode == "auto" and count >= JUDGED_BYTES:  # -z keeps its level
            self.policy.compressed(level, compress_seconds, send_seconds)
            logger.debug("Compression: level %d took %.3f s to compress and %.3f s to send: level %s next",
                         level, compress_seconds, send_seconds, self.policy.level())

    def compressed_started(self, started: float) -> None:
        """A compressed transfer began (``time.perf_counter()``)."""
        with self._moved_lock:
            if self._moved_since is None:
                self._moved_since = started

    def compressed_moved(self, count: int) -> None:
        """A compressed transfer put ``count`` bytes on the wire: all of them together, over the
        time since the first began, are a rate the link reached."""
        if self.mode != "auto":
            return
        with self._moved_lock:
            self._moved += count
            if self._moved_since is None:
                return
            seconds = time.perf_counter() - self._moved_since
            moved = self._moved
        if seconds > 0:
            self.policy.link_at_least(moved / seconds)

    def observed(self, count: int, seconds: float, sample: Optional[bytes]) -> None:
        if sample:
            self.policy.sample(sample)
        self.policy.link_observed(count, seconds)
        logger.debug("Compression: ratio %s, one core %s B/s, link %s B/s: level %s", self.policy.ratio,
                     self.policy.compress_rate, self.policy.link_rate, self.policy.level())


def compressing_cores(concurrency: int) -> int:
    """How many compress at once: one per transfer in flight (each in its own thread), at
    most one per core."""
    return max(1, min(os.cpu_count() or 1, concurrency))


__all__ = ["JUDGED_BYTES", "PROBE_BYTES", "AdaptivePolicy", "Compression", "compressing_cores"]

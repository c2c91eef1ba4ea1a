"""Whether a sync's transfers cross the wire compressed, and at which level (``-z``, ``--compress-level``, ``auto``).

The frames themselves and the adaptive rule are :mod:`pdiffcopy.core.compression`'s; this is the
state one remote file or tree keeps of them: the mode asked for and what its transfers measured.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional
from urllib.parse import urlsplit

from pdiffcopy.core import compression
from pdiffcopy.core.addresses import is_loopback
from pdiffcopy.core.compression import AdaptivePolicy

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


class Compression:
    """Whether a stream's ranges cross the wire compressed, and at which level: the mode asked
    for, and for ``auto`` the :class:`~pdiffcopy.core.compression.AdaptivePolicy` fed with what
    the stream's plain transfers showed.

    Shared by a file, its temporary, and the files of one tree, so what one measured serves all.
    ``cores``: how many compress at once, the sending side's cores or the transfers in flight,
    whichever is fewer (each transfer compresses its own frames, in its own thread on the
    client or its own request's thread on the server).

    :param measure_loopback: Let the policy decide on a loopback address too. By default a
                             loopback server stays plain (no link to spare: compressing only
                             costs CPU); the near end of a tunnel (``ssh -L``) is loopback with
                             a real link behind it, which a library caller can say here.
    :param policy: Another :class:`~pdiffcopy.core.compression.AdaptivePolicy` (one with a
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


__all__ = ["JUDGED_BYTES", "PROBE_BYTES", "Compression", "compressing_cores"]

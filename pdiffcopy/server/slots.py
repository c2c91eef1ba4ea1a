"""Fair slots: a bounded number of concurrent jobs, shared fairly between clients.

The server hashes in the request's thread, and hashing is CPU bound, so a
worker process runs at most a few hash requests at once
(``server.MAX_CONCURRENT_HASHES``). A plain semaphore let one client that
keeps many hash requests in flight hold every slot, and every other client's
requests were refused with 503 until their retries ran out. :class:`FairSlots`
gives each client (a key: the client's address) at most a share of the slots
while other clients want some too, and lets a lone client use them all.

The state is per process: gunicorn's worker processes each have their own
slots, so a client holds at most its share of each process's slots.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Dict, Hashable


class FairSlots:
    """At most ``slots`` jobs at once, shared fairly between clients.

    While other clients want slots too, a client holds at most ``share`` of
    them, and its requests beyond that are refused at once (waiting would only
    hold a request thread). Another client "wants slots" when it holds or waits
    for one, or asked for one in the last ``contention_seconds`` (so a client
    waiting out a Retry-After still counts). A lone client may hold all but one
    slot: the one left free lets a newcomer start at once, and from then on the
    lone client is held to its share.
    """

    def __init__(self, slots: int, share: int, contention_seconds: float) -> None:
        self.slots = slots
        self.share = share
        self.contention_seconds = contention_seconds
        self._condition = threading.Condition()
        self._held: Counter = Counter()
        self._waiting: Counter = Counter()
        self._last_seen: Dict[Hashable, float] = {}

    def acquire(self, client: Hashable, timeout: float) -> bool:
        """Take a slot for ``client``, waiting up to ``timeout`` seconds; whether one was taken."""
        deadline = time.monotonic() + timeout
        with self._condition:
            self._seen(client)
            self._waiting[client] += 1
            try:
                while True:
                    contended = self._contended(client)
                    held = self._held[client]
                    limit = self.share if contended else max(1, self.slots - 1)
                    if held < limit and sum(self._held.values()) < self.slots:
                        self._held[client] += 1
                        return True
                    if contended and held >= self.share:
                        return False
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._condition.wait(remaining)
            finally:
                self._waiting[client] -= 1
                if not self._waiting[client]:
                    del self._waiting[client]

    def release(self, client: Hashable) -> None:
        """Give back a slot ``client`` took."""
        with self._condition:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]
            self._condition.notify_all()

    def held(self, client: Hashable) -> int:
        """How many slots ``client`` holds now."""
        with self._condition:
            return self._held[client]

    def _contended(self, client: Hashable) -> bool:
        """Whether another client than ``client`` wants slots (see the class)."""
        now = time.monotonic()
        return any(other != client and (self._held[other] or self._waiting[other]
                                        or now - seen < self.contention_seconds)
                   for other, seen in self._last_seen.items())

    def _seen(self, client: Hashable) -> None:
        now = time.monotonic()
        self._last_seen[client] = now
        if len(self._last_seen) > 2 * self.slots + 16:  # forget clients gone quiet
            for other, seen in list(self._last_seen.items()):
                if now - seen >= self.contention_seconds and not self._held[other] \
                        and not self._waiting[other]:
                    del self._last_seen[other]


__all__ = ["FairSlots"]

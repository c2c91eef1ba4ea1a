"""The sync this process runs, as servers' transfer logs know it (``pdiffcopy.server.audit``).

Every request of a sync carries its id (:data:`~pdiffcopy.core.protocol.SYNC_HEADER`),
whatever clients and connections the sync opens (its child processes' too), and at its end
each server that keeps a transfer log is told it is over (:func:`one_sync`). Light on
purpose: a local sync enters it too, and imports nothing of HTTP for it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Dict, Iterator


class CurrentSync:
    """The id of the sync in progress, and the servers to tell when it is over."""

    def __init__(self) -> None:
        self.id = os.urandom(16).hex()
        self.depth = 0
        self._lock = threading.Lock()
        self._say_over: Dict[str, Callable[[bool], None]] = {}

    def logged_by(self, server: str, say_over: Callable[[bool], None]) -> None:
        """A server answered that it logs this sync: ``say_over(failed)`` tells it the end."""
        if server not in self._say_over:
            with self._lock:
                self._say_over.setdefault(server, say_over)

    def end(self, failed: bool) -> None:
        """Tell each server that logs the sync that it is over, and start the next one."""
        with self._lock:
            endings, self._say_over = list(self._say_over.values()), {}
        for say_over in endings:
            say_over(failed)
        self.id = os.urandom(16).hex()


current_sync = CurrentSync()


@contextlib.contextmanager
def one_sync() -> Iterator[None]:
    """Run one sync (a file's, a tree's): at its end, the servers' transfer logs are told it is
    over, and whether it failed (an error or a Ctrl-C going up). Nested: the outermost counts."""
    owner = os.getpid()
    current_sync.depth += 1
    failed = True
    try:
        yield
        failed = False
    finally:
        current_sync.depth -= 1
        if current_sync.depth == 0 and os.getpid() == owner:
            current_sync.end(failed)


__all__ = ["CurrentSync", "current_sync", "one_sync"]

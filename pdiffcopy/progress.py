"""A one-line progress display on a terminal: bytes hashed and moved, rate and ETA."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional, TextIO

from pdiffcopy.pipeline import Progress

#: Seconds between redraws: often enough to look alive, rarely enough to cost nothing.
REFRESH_SECONDS = 0.25


class ProgressDisplay:
    """Redraws one status line on ``stream`` from a thread, until stopped."""

    def __init__(self, progress: Progress, stream: Optional[TextIO] = None) -> None:
        self.progress = progress
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._width = 0

    def __enter__(self) -> "ProgressDisplay":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            line = self.render()
            padding = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * padding)
            self.stream.flush()
            self._width = len(line)

    def render(self) -> str:
        """The status line for the counters as they are now."""
        from humanfriendly import format_size, format_timespan

        p = self.progress
        elapsed = max(time.monotonic() - self.started, 1e-6)
        done = p.hashed + p.moved
        total = p.hash_total + p.move_total
        rate = done / elapsed
        parts = [f"{p.phase}:",
                 f"hashed {format_size(p.hashed, binary=True)} of {format_size(p.hash_total, binary=True)},",
                 f"moved {format_size(p.moved, binary=True)} of {format_size(p.move_total, binary=True)},",
                 f"{format_size(rate, binary=True)}/s"]
        if rate > 0 and total > done:
            parts.append(f"ETA {format_timespan((total - done) / rate, max_units=2)}")
        return " ".join(parts)


class TreeProgressDisplay(ProgressDisplay):
    """The status line of a tree sync: files and bytes done of the totals, rate, ETA."""

    def render(self) -> str:
        from humanfriendly import format_size, format_timespan

        p: Any = self.progress  # a TreeProgress
        elapsed = max(time.monotonic() - self.started, 1e-6)
        done = p.bytes_done
        rate = done / elapsed
        parts = [f"{p.phase}:", f"{p.files_done} of {p.files_total} files,",
                 f"{format_size(done, binary=True)} of {format_size(p.bytes_total, binary=True)},",
                 f"{format_size(rate, binary=True)}/s"]
        if rate > 0 and p.bytes_total > done:
            parts.append(f"ETA {format_timespan((p.bytes_total - done) / rate, max_units=2)}")
        return " ".join(parts)

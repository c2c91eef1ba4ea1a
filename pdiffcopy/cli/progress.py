"""A one-line progress display on a terminal: bytes moved, rate, ETA, and bytes hashed.

The rate counts bytes moved (sent, received or written), never bytes hashed:
hashing a mostly equal file runs at disk speed and would promise an ETA the
transfer cannot keep. It is measured over the last few seconds, so it follows
the link rather than the average since the start. The line never reaches the
terminal's last column, which would wrap it and scroll on every redraw.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, List, Optional, TextIO, Tuple

if TYPE_CHECKING:
    from pdiffcopy.api import Progress

#: Seconds between redraws: often enough to look alive, rarely enough to cost nothing.
REFRESH_SECONDS = 0.25

#: Seconds of history the rate is measured over: long enough to smooth the
#: bursts of a block pipeline, short enough to follow a link that slows down.
RATE_WINDOW_SECONDS = 5.0

#: The width assumed when the terminal's cannot be read (a pipe, a file).
FALLBACK_COLUMNS = 80


def _size(count: float) -> str:
    from pdiffcopy.cli.humanize import format_size

    return format_size(count, binary=True)


class ProgressDisplay:
    """Redraws one status line on ``stream`` from a thread, until stopped.

    :param progress: The counters to show (only read here).
    :param stream: Where to draw (default stderr).
    :param clock: Seconds as a float, monotonic (a test passes a fake one).
    :param keep_last: Leave the last line on screen when done (``--progress``, as rsync does)
                      instead of erasing it.
    """

    def __init__(self, progress: Any, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic, keep_last: bool = False) -> None:
        self.progress = progress
        self.stream = stream or sys.stderr
        self.clock = clock
        self.keep_last = keep_last
        self.started = clock()
        self._moved_rate = _Rate(clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._width = 0

    def __enter__(self) -> "ProgressDisplay":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        if self.keep_last and exc_info[0] is None:
            self.draw()
            self.stream.write("\n")
        elif self._width:
            self.stream.write("\r" + " " * self._width + "\r")
        self.stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            self.draw()

    def draw(self) -> None:
        """Redraw the line, blanking what is left of a longer previous one."""
        line = self.render()
        padding = max(0, min(self._width, self.columns() - 1) - len(line))
        self.stream.write("\r" + line + " " * padding)
        self.stream.flush()
        self._width = len(line)

    @staticmethod
    def columns() -> int:
        """The terminal's width now (it may have been resized), or $COLUMNS, or 80."""
        return shutil.get_terminal_size((FALLBACK_COLUMNS, 24)).columns

    def parts(self) -> List[str]:
        """The pieces of the line, most important first."""
        p: Progress = self.progress
        rate = self._moved_rate.update(p.moved)
        parts = [f"{p.phase}:", f"moved {_size(p.moved)} of {_size(p.move_total)},",
                 f"{_size(round(rate))}/s" if rate is not None else "-/s"]
        if rate and p.move_total > p.moved:
            parts.append(f"ETA {_eta(int((p.move_total - p.moved) / rate))}")
        parts.append(f"(hashed {_size(p.hashed)} of {_size(p.hash_total)})")
        return parts

    def render(self) -> str:
        """The status line for the counters as they are now, at most the terminal's width - 1."""
        return fit(self.parts(), self.columns() - 1)


class TreeProgressDisplay(ProgressDisplay):
    """The status line of a tree sync: bytes and files done of the totals, rate, ETA.

    The bytes done are those of the files done (copied, or checked by the
    block delta), which is what the total counts, and the ETA follows them;
    the rate is that of the bytes moved, as for a file: a big file whose
    blocks are mostly equal is done at hashing speed but moves little.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._done_rate = _Rate(self.clock)

    def parts(self) -> List[str]:
        p: Any = self.progress  # a TreeProgress
        done = p.bytes_done
        rate = self._moved_rate.update(p.bytes_moved)
        done_rate = self._done_rate.update(done)
        parts = [f"{p.phase}:", f"{_size(done)} of {_size(p.bytes_total)},",
                 f"{_size(round(rate))}/s" if rate is not None else "-/s"]
        if done_rate and p.bytes_total > done:
            parts.append(f"ETA {_eta(int((p.bytes_total - done) / done_rate))}")
        parts.append(f"({p.files_done} of {p.files_total} files)")
        return parts


class _Rate:
    """A counter's growth per second over the last :data:`RATE_WINDOW_SECONDS`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.samples: Deque[Tuple[float, int]] = deque([(clock(), 0)])

    def update(self, value: int) -> Optional[float]:
        """Record ``value`` now; its rate, or None while it is still 0."""
        now = self.clock()
        self.samples.append((now, value))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW_SECONDS:
            self.samples.popleft()
        then, before = self.samples[0]
        if value <= 0 or now <= then:
            return None
        return (value - before) / (now - then)


def _eta(seconds: int) -> str:
    """A short ETA: 0:42, 12:05, 3:02:10 (rsync's form; humanfriendly's words take a third of a line)."""
    hours, rest = divmod(max(0, seconds), 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def fit(parts: List[str], width: int) -> str:
    """Join ``parts`` with spaces, dropping the least important (last) ones that do not fit ``width``."""
    line = ""
    for part in parts:
        candidate = f"{line} {part}" if line else part
        if len(candidate) > width:
            break
        line = candidate
    return line or parts[0][:max(0, width)]

"""What a sync did, for scripts: ``--json`` (events as JSON lines on stdout) and ``--metrics-file``.

``--json`` prints one JSON object per line, each with an ``"event"``: ``started``,
``progress`` (at most once a second), ``file`` (one per file, directory, link or
deletion done), and last ``finished`` or ``failed``, which carry ``"exit_status"`` and
the summary's counts. The human lines are off (summary, ``--stats``, progress line);
warnings and errors still go to stderr. README.rst lists the fields ("For scripts"),
versioned by ``"schema"`` in ``started``.

``--metrics-file PATH`` writes the summary as Prometheus text (node_exporter's textfile
collector) when the command ends, whatever its end: replaced atomically, never half-written.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Dict, Optional, TextIO

#: The version of the events' fields: a field removed or changed in meaning raises it.
SCHEMA = 1

#: Seconds between two ``progress`` events, at least.
PROGRESS_SECONDS = 1.0

#: The metrics of ``--metrics-file``: name, type, help, and the count it shows.
METRICS = (
    ("pdiffcopy_last_run_exit_status", "The exit status of the last run (0: success)", "exit_status"),
    ("pdiffcopy_last_run_timestamp_seconds", "When the last run ended, in seconds since the epoch", "ended"),
    ("pdiffcopy_last_run_duration_seconds", "How long the last run took", "seconds"),
    ("pdiffcopy_last_run_bytes_moved", "Bytes the last run moved into the target", "bytes_moved"),
    ("pdiffcopy_last_run_files_copied", "Files the last run copied or updated", "files_copied"),
    ("pdiffcopy_last_run_files_unchanged", "Files the last run found unchanged", "unchanged"),
    ("pdiffcopy_last_run_deleted", "Entries the last run deleted", "deleted"),
    ("pdiffcopy_last_run_failures", "Paths the last run could not sync", "failures"),
)


class Events:
    """The events of one command run, and the counts its summary ends with.

    :param stream: Where the JSON lines go (stdout), or None: only counted (``--metrics-file``).
    """

    def __init__(self, stream: Optional[TextIO], clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.clock = clock
        self.started_at = clock()
        self.counts: Dict[str, Any] = {}
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        if self.stream is None:
            return
        line = json.dumps({"event": event, **fields}, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def started(self, source: str, target: str, dry_run: bool) -> None:
        from pdiffcopy._version import __version__

        self.emit("started", schema=SCHEMA, version=__version__, source=source, target=target, dry_run=dry_run,
                  time=round(time.time(), 3))

    def file(self, path: str, change: str, **fields: Any) -> None:
        self.emit("file", path=path, change=change, **fields)

    def count(self, **counts: Any) -> None:
        self.counts.update(counts)

    def finished(self) -> None:
        self.emit("finished", exit_status=0, seconds=self.seconds(), **self.counts)

    def failed(self, status: int, error: str) -> None:
        self.emit("failed", exit_status=status, error=error, seconds=self.seconds(), **self.counts)

    def seconds(self) -> float:
        return round(self.clock() - self.started_at, 3)

    def progress(self, counters: Any) -> "ProgressEvents":
        """A ``progress`` event a second while the block runs, from a sync's counters."""
        return ProgressEvents(self, counters)

    def write_metrics(self, path: str, status: int) -> None:
        """The summary as Prometheus text in ``path``: a temporary beside it, renamed over it.

        :raises OSError: When it cannot be written (the caller says so in one line).
        """
        values = dict(self.counts, exit_status=status, ended=round(time.time(), 3), seconds=self.seconds())
        lines = []
        for name, about, key in METRICS:
            if values.get(key) is not None:
                lines += [f"# HELP {name} {about}.", f"# TYPE {name} gauge", f"{name} {values[key]}"]
        from pdiffcopy.api import replace_atomically

        directory, base = os.path.split(os.path.abspath(path))
        temporary = os.path.join(directory, f".{base}.{os.getpid()}.tmp")
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
            os.chmod(temporary, 0o644)  # read by node_exporter, which runs as another user
            replace_atomically(temporary, path)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise


class ProgressEvents:
    """Emits the counters of a sync (:class:`~pdiffcopy.engine.filejob.Progress` or its tree's) from a thread."""

    FIELDS = {"moved": "bytes_moved", "move_total": "bytes_to_move", "hashed": "bytes_hashed",
              "hash_total": "bytes_to_hash", "files_done": "files_done", "files_total": "files_total",
              "bytes_done": "bytes_done", "bytes_total": "bytes_total", "bytes_moved": "bytes_moved"}

    def __init__(self, events: Events, counters: Any) -> None:
        self.events = events
        self.counters = counters
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress-events", daemon=True)

    def __enter__(self) -> "ProgressEvents":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(PROGRESS_SECONDS):
            fields = {"phase": getattr(self.counters, "phase", "")}
            for attribute, name in self.FIELDS.items():
                value = getattr(self.counters, attribute, None)
                if isinstance(value, int):
                    fields[name] = value
            self.events.emit("progress", seconds=self.events.seconds(), **fields)


__all__ = ["Events", "METRICS", "PROGRESS_SECONDS", "ProgressEvents", "SCHEMA"]

"""Prometheus metrics of the server, added up over gunicorn's worker processes.

gunicorn serves with several worker processes, each with its own memory, so
a counter kept in one would show only the requests that process happened to
answer. prometheus-client's multiprocess mode keeps every process's values
in small memory-mapped files of one directory, and a scrape (answered by
any worker) adds up the files of all of them. The directory is made by the
server's main process before gunicorn forks (:func:`make_directory`), lives
in memory where possible (``/dev/shm``, like the write leases), is removed
when the main process exits, and the directories of servers that were
killed are removed by the next server, as the leases' are.

Labels take few values, whatever the clients send: the endpoint is the name
of the Flask view that answered (``read_file``, ``hashes``...; ``unmatched``
when no route matched), never the path asked for, and the status is an HTTP
status code.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Iterable, Iterator, Optional, Tuple, TypeVar

from pdiffcopy.server.leasetable import _memory_directory, _sweep

#: The directory's name starts with this and the server's pid, so that the
#: next server can remove the directory of one that was killed.
DIRECTORY_PREFIX = "pdiffcopy-metrics-"

#: The variable prometheus-client reads to find the directory of the
#: per-process files (it must be set before it creates the first metric).
DIRECTORY_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

#: Bytes served between two updates of the served-bytes counter: a scrape sees
#: a long transfer grow, and a tree's small files do not cost an update each.
SERVED_COUNT_BYTES = 1024 * 1024

#: Where the metrics are, behind the token like every endpoint but health.
METRICS_PATH = "/.pdiffcopy/metrics"

#: Prometheus's default ``metrics_path``, answered on ``--metrics-listen`` only
#: (on the main address it names a file).
SCRAPE_PATH = "/metrics"

#: The endpoint label of a request no route matched (an unknown method, say).
UNMATCHED = "unmatched"

T = TypeVar("T")


def make_directory() -> str:
    """Make the directory of the per-process metric files, before gunicorn forks.

    Also sets :data:`DIRECTORY_VARIABLE` to it (prometheus-client reads it
    when it is imported and whenever a process writes its first value) and
    removes it when this process exits; the workers inherit both.

    :returns: The directory.
    """
    owner = os.getpid()
    parent = _memory_directory() or tempfile.gettempdir()
    _sweep(parent, DIRECTORY_PREFIX)
    directory = tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{owner}-", dir=parent)

    def remove() -> None:  # in the server's main process only, not in a worker
        if os.getpid() == owner:
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)
    os.environ[DIRECTORY_VARIABLE] = directory
    return directory


class ServerMetrics:
    """The server's counters and gauges, and their exposition.

    :param directory: The directory of :func:`make_directory` when the server
                      runs in several processes; None for the values of this
                      process only (an application built for tests).
    """

    def __init__(self, directory: Optional[str] = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, values

        if directory and not getattr(values.ValueClass, "_multiprocess", False):
            # prometheus-client chooses its value class when it is imported,
            # and it was imported before the variable was set (the command
            # line checks that it is installed): choose the file-backed one.
            values.ValueClass = values.MultiProcessValue()
        self.directory = directory
        self.registry = CollectorRegistry(auto_describe=True)
        # The export label: a config file's export by name; "" the --root shorthand's and the
        # server's own requests (Prometheus reads an empty label as none).
        self.requests = Counter("pdiffcopy_requests", "Requests answered, by endpoint (the view), status and export",
                                ["endpoint", "status", "export"], registry=self.registry)
        self.bytes_served = Counter("pdiffcopy_served_bytes", "File bytes sent to clients (GET, tree reads)",
                                    ["export"], registry=self.registry)
        self.bytes_received = Counter("pdiffcopy_received_bytes",
                                      "File bytes received from clients and written (PATCH, tree writes)",
                                      ["export"], registry=self.registry)
        self.bytes_compared = Counter("pdiffcopy_compared_bytes",
                                      "File bytes hashed to compare them with a client's (hashes, chunks)",
                                      ["export"], registry=self.registry)
        self.compressed_bytes = Counter("pdiffcopy_compressed_bytes",
                                        "File bytes that crossed the wire zstd-compressed, by direction "
                                        "(sent: GET answers; received: PATCH bodies)",
                                        ["direction", "export"], registry=self.registry)
        # livesum: the running jobs of the live workers; a worker that died
        # (its file removed by worker_exited) runs none.
        self.hash_jobs = Gauge("pdiffcopy_hash_jobs_running", "Hash requests being computed now",
                               registry=self.registry, multiprocess_mode="livesum")
        self.busy = Counter("pdiffcopy_busy_refusals",
                            "Requests refused with 503 because the server was busy (Retry-After)",
                            registry=self.registry)

    def count_request(self, endpoint: str, status: int, export: str = "") -> None:
        """Count one answered request; a 503 is also counted as a refusal."""
        self.requests.labels(endpoint=endpoint, status=str(status), export=export).inc()
        if status == 503:
            self.busy.inc()

    def of_request(self, export: str, tally: "RequestTally") -> "RequestMetrics":
        """The metrics as one request of ``export`` counts them, its bytes added to ``tally`` too."""
        return RequestMetrics(self, export, tally)

    @staticmethod
    def counted(chunks: Iterable[T], counter, size=len) -> Iterator[T]:
        """``chunks`` as they are, adding ``size(chunk)`` to ``counter`` as they pass.

        Counted every :data:`SERVED_COUNT_BYTES` or so, so a long transfer
        shows up while it runs; not chunk by chunk, which for a tree's
        small files (one chunk each) cost a lock and a getpid per file.
        """
        uncounted = 0
        try:
            for chunk in chunks:
                uncounted += size(chunk)
                if uncounted >= SERVED_COUNT_BYTES:
                    counter.inc(uncounted)
                    uncounted = 0
                yield chunk
        finally:
            if uncounted:
                counter.inc(uncounted)

    def render(self) -> Tuple[bytes, str]:
        """The text exposition of every metric (of all worker processes) and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        registry = self.registry
        if self.directory:
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=self.directory)
        return generate_latest(registry), CONTENT_TYPE_LATEST

    def worker_exited(self, pid: int) -> None:
        """Forget the live gauges of a worker process that exited (gunicorn's ``child_exit``)."""
        if self.directory:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.directory)


class RequestTally:
    """The file bytes one request moved and compared (its transfer's line in the audit log)."""

    __slots__ = ("sent", "received", "compared")

    def __init__(self) -> None:
        self.sent = self.received = self.compared = 0


class _Tallying:
    """A counter of one export that also adds to a request's tally."""

    __slots__ = ("_counter", "_tally", "_field")

    def __init__(self, counter, tally: RequestTally, field: str) -> None:
        self._counter, self._tally, self._field = counter, tally, field

    def inc(self, amount: float = 1) -> None:
        self._counter.inc(amount)
        setattr(self._tally, self._field, getattr(self._tally, self._field) + int(amount))


class _OfExport:
    """A labelled counter with the export's label already given (``.labels(direction)``)."""

    __slots__ = ("_counter", "_export")

    def __init__(self, counter, export: str) -> None:
        self._counter, self._export = counter, export

    def labels(self, direction: str):
        return self._counter.labels(direction=direction, export=self._export)


class RequestMetrics:
    """The server's metrics as one request counts them: labelled by its export, its bytes
    added to its :class:`RequestTally`. The views hand it where they handed the metrics."""

    def __init__(self, metrics: ServerMetrics, export: str, tally: RequestTally) -> None:
        self.tally = tally
        self.bytes_served = _Tallying(metrics.bytes_served.labels(export=export), tally, "sent")
        self.bytes_received = _Tallying(metrics.bytes_received.labels(export=export), tally, "received")
        self.bytes_compared = _Tallying(metrics.bytes_compared.labels(export=export), tally, "compared")
        self.compressed_bytes = _OfExport(metrics.compressed_bytes, export)

    counted = staticmethod(ServerMetrics.counted)

    def served(self, chunks: Iterable[T], size=len) -> Iterator[T]:
        """``chunks`` as they are, counting ``size(chunk)`` bytes served as they go out (:meth:`counted`)."""
        return self.counted(chunks, self.bytes_served, size)


__all__ = ["METRICS_PATH", "RequestMetrics", "RequestTally", "SCRAPE_PATH", "ServerMetrics", "make_directory"]

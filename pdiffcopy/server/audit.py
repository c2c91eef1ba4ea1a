"""The transfer log: one line per transfer, for an operator to audit who moved what.

A transfer is one client's sync of one file, or of one tree, through one export: the
requests that name its path (a tree's requests name the tree's top; a big file of a tree
that goes by delta is a transfer of its own). Its line says the export, the token's name,
the client's address, the path, the direction, the file bytes moved and compared (hashed
to compare), the result and the seconds it took, in the server's log (a JSON object with
``--log-format json``).

The requests of one sync reach several worker processes, so each transfer's counts live
in a small file of a directory of the server's own (beside the write leases), changed
under ``flock``. A client says which sync a request belongs to
(:data:`~pdiffcopy.core.protocol.SYNC_HEADER`, a random id per sync) and when it is over
(``POST /.pdiffcopy/done``, :func:`pdiffcopy.transport.syncs.one_sync`): its lines are
written a moment later, once the answers still being closed have added their bytes. A
transfer whose client never says (killed, curl, older clients) is written once it has been
quiet for :data:`QUIET_SECONDS`, or when the server stops.

Results: ``ok`` (every request succeeded, and the client ended the sync), ``failed`` (a
request was refused or failed, its status given; or the client said its sync failed),
``unfinished`` (the client went quiet, or the server stopped, before it said the sync was over).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from typing import Any, Dict, Iterator, Optional

from pdiffcopy.core.protocol import SYNC_HEADER
from pdiffcopy.server.metrics import RequestTally

#: The logger of the transfer lines (the server's log, one line each).
logger = logging.getLogger("pdiffcopy.audit")

#: Seconds without a request after which a transfer whose client did not end it is logged.
QUIET_SECONDS = 30

#: Seconds a transfer its client ended stays open for the answers still being closed.
ENDED_QUIET_SECONDS = 1

#: How often each worker process looks for the transfers that are over.
SWEEP_EVERY_SECONDS = 1

#: The statuses that are part of a sync that works: a push's target that is not there yet.
EXPECTED_STATUSES = frozenset({404})

#: Longest sync id a client may send (longer ones are cut: they only name a file here).
MAX_SYNC_ID = 64


#: What a sync id may be: it is echoed in a header, so nothing a header could not hold.
SYNC_ID_PATTERN = re.compile(r"[0-9A-Za-z_-]{1,%d}" % MAX_SYNC_ID)


def sync_of_request() -> str:
    """The sync the current request says it belongs to, or "" (none, or not a sync id)."""
    from flask import request

    sync = request.headers.get(SYNC_HEADER, "")
    return sync if SYNC_ID_PATTERN.fullmatch(sync) else ""


def transfer_key(sync_id: str, token_digest: Optional[str], address: str) -> str:
    """The first half of a transfer's file name: its client's sync, token and address (a
    client can end only its own transfers)."""
    return _digest(f"{sync_id[:MAX_SYNC_ID]}\0{token_digest or ''}\0{address}")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class TransferLog:
    """The transfers in progress of one server: a directory of small JSON files."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._sweeper_pid: Optional[int] = None
        self._sweeper_lock = threading.Lock()

    def add(self, sync: str, export: str, token: Optional[str], address: str, path: str, writes: bool,
            tally: RequestTally, status: int) -> None:
        """Add one answered request to its transfer (made by the first)."""
        self._start_sweeper()
        name = f"{sync}-{_digest(f'{export}/{path}')}"
        with self._locked(name, create=True) as (fd, record):
            now = time.time()
            if not record:
                record = {"export": export, "token": token or "-", "client": address, "path": path,
                          "direction": "pull", "sent": 0, "received": 0, "compared": 0, "requests": 0,
                          "status": None, "started": now}
            if writes:
                record["direction"] = "push"
            record["sent"] += tally.sent
            record["received"] += tally.received
            record["compared"] += tally.compared
            record["requests"] += 1
            record["last"] = now
            if status >= 400 and status not in EXPECTED_STATUSES and record["status"] is None:
                record["status"] = status
            _rewrite(fd, record)

    def end(self, sync: str, failed: bool = False) -> int:
        """Mark every transfer of one client's sync as ended (it said it is over): each is
        logged once it has been quiet for :data:`ENDED_QUIET_SECONDS`, so that an answer
        still being closed on another connection adds its bytes first. How many there were."""
        ended = 0
        for name in self._names():
            if name.startswith(f"{sync}-"):
                with self._locked(name, create=False) as (fd, record):
                    if record:
                        record["ended"] = True
                        record["client_failed"] = failed
                        _rewrite(fd, record)
                        ended += 1
        return ended

    def finish_quiet(self, now: Optional[float] = None) -> int:
        """Log the transfers that are over: ended and quiet for a moment, or quiet for long."""
        finished = 0
        now = time.time() if now is None else now
        for name in self._names():
            try:
                changed = os.stat(os.path.join(self.directory, name)).st_mtime
            except FileNotFoundError:
                continue
            if changed < now - ENDED_QUIET_SECONDS:
                finished += self._finish(name, now)
        return finished

    def finish_all(self) -> None:
        """Log every transfer left (the server stops): unfinished unless its client ended it."""
        self.finish_quiet(now=float("inf"))

    def _finish(self, name: str, now: float) -> int:
        with self._locked(name, create=False) as (_, record):
            if not record:
                return 0  # (logged by another process)
            quiet = now - record.get("last", 0)
            if quiet < (ENDED_QUIET_SECONDS if record.get("ended") else QUIET_SECONDS):
                return 0
            os.unlink(os.path.join(self.directory, name))
        failed = record["status"] is not None or record.get("client_failed")
        result = "failed" if failed else "ok" if record.get("ended") else "unfinished"
        log_transfer(record, result)
        return 1

    def _names(self) -> Iterator[str]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:  # (the server is stopping)
            return iter(())
        return iter([name for name in names if not name.startswith(".")])

    @contextlib.contextmanager
    def _locked(self, name: str, create: bool) -> Iterator[tuple]:
        """The transfer's file, locked, and its record ({} when new or already finished)."""
        path = os.path.join(self.directory, name)
        while True:
            try:
                fd = os.open(path, (os.O_RDWR | os.O_CREAT if create else os.O_RDWR) | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                yield None, {}
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    same = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:  # finished and removed while this waited: a new one, or nothing
                    if not create:
                        yield None, {}
                        return
                    continue
                data = os.pread(fd, 1 << 16, 0)
                yield fd, json.loads(data) if data else {}
                return
            finally:
                os.close(fd)

    def _start_sweeper(self) -> None:
        """One thread per worker process logs the quiet transfers (the first request starts it)."""
        if self._sweeper_pid == os.getpid():
            return
        with self._sweeper_lock:
            if self._sweeper_pid == os.getpid():
                return
            self._sweeper_pid = os.getpid()
            threading.Thread(target=self._sweep_forever, name="pdiffcopy-transfer-log", daemon=True).start()

    def _sweep_forever(self) -> None:
        while True:
            time.sleep(SWEEP_EVERY_SECONDS)
            try:
                self.finish_quiet()
            except OSError as error:
                if error.errno != errno.ENOENT:
                    logger.warning("Cannot log the quiet transfers: %s", error.strerror or error)


def _rewrite(fd: int, record: Dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def log_transfer(record: Dict[str, Any], result: str) -> None:
    """Write a transfer's line: text ``key=value`` pairs, or the fields of a JSON line."""
    fields = {
        "export": record["export"] or "/", "token": record["token"], "client": record["client"],
        "path": record["path"] or ".", "direction": record["direction"],
        "moved_bytes": record["sent"] + record["received"], "compared_bytes": record["compared"],
        "result": result, "status": record["status"],
        "started": datetime.datetime.fromtimestamp(record["started"], datetime.timezone.utc).isoformat(
            timespec="milliseconds").replace("+00:00", "Z"),
        "seconds": round(max(0.0, record.get("last", record["started"]) - record["started"]), 3),
        "requests": record["requests"],
    }
    text = " ".join(f"{key}={_shown(value)}" for key, value in fields.items() if value is not None)
    logger.info("Transfer %s", text, extra={"transfer": fields})


def _shown(value: Any) -> str:
    """A value of a text line: a path with spaces or quotes in JSON's quotes, so it stays one field."""
    text = str(value)
    if not text or any(character.isspace() or character in "\"=\\" or not character.isprintable()
                       for character in text):
        return json.dumps(text)
    return text


def make_transfer_directory(parent: str) -> str:
    directory = os.path.join(parent, "transfers")
    os.makedirs(directory, 0o700, exist_ok=True)
    return directory


__all__ = ["QUIET_SECONDS", "TransferLog", "log_transfer", "make_transfer_directory", "transfer_key"]

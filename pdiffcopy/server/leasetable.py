"""Write leases: one client at a time may update a file on the server in place.

A sync that updates a file in place hashes it first and afterwards reads
back only the blocks it wrote; the blocks it left alone it trusts from its
first hashes. A second writer in between (another sync, a plain ``PATCH``)
would leave a mix that both report as verified. So a client takes a lease
on the file before it hashes it, sends the lease's id with every request
(header ``X-Pdiffcopy-Lease``) and ends it last; while a lease is held,
writes from anybody else are refused with 423 Locked.

The server runs several worker processes, so a lease lives in a small file
of a directory made before they fork, named after the file's device and
inode (the file, not its name), and is read and changed under ``flock``.
A lease also records the connections its holder asked on (the latest few)
and how many of its writes are running: once the client has closed all of
those connections (the kernel closes a killed client's at once) and none of
its writes is left, the lease has lapsed, and the next run takes it at once.
Where the server cannot tell (no connection known, behind a proxy), a lease
that no request renewed for :data:`LEASE_SECONDS` lapses, so a killed client
blocks nobody for long, and a refusal says how long is left. A lapsed lease
is not simply taken back: when anybody else wrote in between, the holder's
next request (its end included) fails with 412, so a sync never reports
success over somebody else's writes.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import math
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from typing import Callable, Iterator, List, Optional, Set

from pdiffcopy.errors import Conflict, Locked

#: The lease directory's name starts with this and the server's pid, so that
#: the next server can remove the directory of one that was killed.
DIRECTORY_PREFIX = "pdiffcopy-leases-"


#: Seconds a lease lives after the holder's last request. A sync talks to
#: its target all the time (hashes per 64 MiB segment, then writes, then
#: the read-back), so a minute of silence means the client is gone; a
#: killed client then keeps others out for at most that long.
LEASE_SECONDS = 60

#: Reads of the host's TCP table a holder's connections must all be missing from before it is
#: taken for gone: the kernel lists the table a page at a time and resumes by position, so one
#: read while other connections come and go (a busy host's TIME-WAIT ones expire all the time)
#: can skip a connection that stays open; two in a row do not.
TABLE_READS = 2

#: Seconds a request waits for the lease file's lock before it is refused.
#: The lock is held for a read and a write of a few bytes, except by writes
#: without a lease, which hold it shared while their body arrives: a lease
#: cannot be taken while such a write is in flight.
LOCK_WAIT_SECONDS = 2.0

#: How often a waiting request tries the lock again.
LOCK_POLL_SECONDS = 0.01

#: Every lease file holds one record of this many bytes (JSON padded with
#: spaces; all spaces: no lease), rewritten in place. Never truncated: on
#: ext4 a file truncated to zero is written out when closed (auto_da_alloc),
#: which made every leased request 5 to 10 ms slower here.
RECORD_BYTES = 1024

#: Connections of its holder a lease remembers, the latest ones (a client asks on one
#: per worker thread, and reuses them): the lease lapses when none of them is open.
HOLDER_CONNECTIONS = 16

#: Seconds a client taking a lease waits for the writes of a holder whose connections are
#: gone to end (each notices its closed connection at its next read): a rerun right
#: after a kill is not refused for a write still failing.
DEAD_HOLDER_WAIT_SECONDS = 2.0


class LeaseTable:
    """The lease table of one server: a directory of small lock files."""

    def __init__(self, directory: Optional[str] = None) -> None:
        if directory is None:
            owner = os.getpid()
            parent = _memory_directory() or tempfile.gettempdir()
            _sweep(parent)
            directory = tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{owner}-", dir=parent)

            def remove() -> None:  # in the server's main process only, not in a worker
                if os.getpid() == owner:
                    shutil.rmtree(directory, ignore_errors=True)

            atexit.register(remove)
        self.directory = directory
        #: The connection the current request came on, as text, or None when unknown (the server's).
        self.request_connection: Callable[[], Optional[str]] = lambda: None
        #: This host's open connections as text (None: cannot tell): a holder none of whose
        #: connections is open is gone. None: only the lease's time says.
        self.open_connections: Optional[Callable[[], Optional[Set[str]]]] = None

    @contextlib.contextmanager
    def _locked(self, info: os.stat_result, mode: int) -> Iterator[int]:
        """The lease file of ``info``'s file, open and locked (``LOCK_EX`` or ``LOCK_SH``).

        An empty lease file is removed by whoever holds it exclusively last
        (:meth:`_tidy`), so that a server running for months does not keep a
        file per file ever written; a lock taken on a file just removed is
        therefore taken again on the new one.
        """
        name = os.path.join(self.directory, lease_name(info))
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, mode | fcntl.LOCK_NB)
                        break
                    except OSError as error:
                        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or \
                                time.monotonic() >= deadline:
                            raise Locked("The file is being written by another client; try again "
                                         "later") from None
                        time.sleep(LOCK_POLL_SECONDS)
                try:
                    current = os.stat(name).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    current = False
                if current:
                    try:
                        yield fd
                    finally:
                        self._tidy(fd, name)
                    return
            finally:
                os.close(fd)  # releases the flock

    def _tidy(self, fd: int, name: str) -> None:
        """Remove the lease file if it holds no lease and nobody else has it locked."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # from shared: others may hold it
        except OSError:
            return  # the last of them tidies
        if not self._read(fd):
            with contextlib.suppress(OSError):
                os.unlink(name)

    @staticmethod
    def _read(fd: int) -> dict:
        data = os.pread(fd, RECORD_BYTES, 0).strip()
        try:
            record = json.loads(data) if data else {}
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    @staticmethod
    def _write(fd: int, record: dict) -> None:
        data = json.dumps(record).encode() if record else b""
        while len(data) > RECORD_BYTES and record.get("connections"):
            record = {**record, "connections": record["connections"][1:]}  # the oldest go first
            data = json.dumps(record).encode()
        os.pwrite(fd, data.ljust(RECORD_BYTES), 0)

    def _live(self, record: dict) -> bool:
        """Whether ``record`` is a lease still held: renewed lately, and its holder not known to be gone."""
        return self._renewed(record) and not self._holder_gone(record)

    @staticmethod
    def _renewed(record: dict) -> bool:
        return bool(record.get("id")) and float(record.get("expires", 0)) > time.monotonic()

    def _holder_gone(self, record: dict, still_writing: bool = False) -> bool:
        """Whether none of the connections the holder asked on is open, and (unless ``still_writing``
        is asked about) none of its writes runs. False where that cannot be told."""
        connections = record.get("connections")
        if not connections or self.open_connections is None or (record.get("writes", 0) and not still_writing):
            return False
        for _ in range(TABLE_READS):  # (one read of the kernel's table can skip an open connection)
            open_now = self.open_connections()
            if open_now is None or set(connections) & open_now:
                return False
        return True

    def _refusal(self, record: dict, path: str) -> Locked:
        left = math.ceil(max(0.0, float(record.get("expires", 0)) - time.monotonic()))
        how = "when that client's connections close, or " if record.get("connections") else ""
        return Locked(f"{path} is being written by another client; its write lease ends {how}within "
                      f"{left} s unless renewed: try again then")

    def _holding(self, record: dict, lease: str, writes: int = 0) -> dict:
        """The holder's record renewed, with the current request's connection (the latest last)."""
        connections: List[str] = [c for c in record.get("connections", []) if isinstance(c, str)] \
            if record.get("id") == lease else []
        here = self.request_connection()
        if here is not None:
            connections = [c for c in connections if c != here][-(HOLDER_CONNECTIONS - 1):] + [here]
        written = {"id": lease, "expires": time.monotonic() + LEASE_SECONDS, "connections": connections}
        running = int(record.get("writes", 0)) + writes if record.get("id") == lease else max(0, writes)
        if running > 0:
            written["writes"] = running
        return written

    def acquire(self, info: os.stat_result, path: str) -> str:
        """Take the lease on the file ``info`` describes; return its id.

        A holder whose connections are all closed is gone: its lease is taken over once
        its last write ends (waited for up to :data:`DEAD_HOLDER_WAIT_SECONDS`).

        :raises Locked: When somebody else holds a live lease on it (saying how long it may last).
        """
        deadline = time.monotonic() + DEAD_HOLDER_WAIT_SECONDS
        while True:
            with self._locked(info, fcntl.LOCK_EX) as fd:
                record = self._read(fd)
                if not self._live(record):
                    lease = secrets.token_hex(16)
                    self._write(fd, self._holding({}, lease))
                    return lease
                if not self._holder_gone(record, still_writing=True) or time.monotonic() >= deadline:
                    raise self._refusal(record, path)
            time.sleep(LOCK_POLL_SECONDS * 5)  # a write of a gone holder is failing: it ends soon

    def release(self, info: os.stat_result, lease: str, path: str) -> None:
        """End a lease; fail when it is no longer the holder's (somebody else wrote meanwhile)."""
        with self._locked(info, fcntl.LOCK_EX) as fd:
            self._check_holder(self._read(fd), lease, path)
            self._write(fd, {})

    def renew(self, info: os.stat_result, lease: str, path: str) -> None:
        """A leased read: the lease must still be the holder's; it is renewed (and its connection noted)."""
        with self._locked(info, fcntl.LOCK_EX) as fd:
            record = self._read(fd)
            self._check_holder(record, lease, path)
            self._write(fd, self._holding(record, lease))

    @contextlib.contextmanager
    def writing(self, info: os.stat_result, lease: Optional[str], path: str) -> Iterator[None]:
        """Run a write (or a leased read) to the file ``info`` describes, if the lease allows it.

        With ``lease``: it must still be the live holder's; it is renewed, and
        counted as running until it ends (a holder with a write running is not
        gone, whatever its connections). Without: refused while somebody holds
        a live lease; a lapsed one is dropped (its holder must learn that
        somebody else wrote), and the lock is held shared until the write is done.
        """
        if lease:
            with self._locked(info, fcntl.LOCK_EX) as fd:
                record = self._read(fd)
                self._check_holder(record, lease, path)
                self._write(fd, self._holding(record, lease, writes=1))
            try:
                yield
            finally:
                # Not counted down (the lock kept for too long): the lease then lapses by its time only.
                with contextlib.suppress(Locked), self._locked(info, fcntl.LOCK_EX) as fd:
                    record = self._read(fd)
                    if record.get("id") == lease:  # else taken over: not ours to count
                        self._write(fd, {**record, "writes": max(0, int(record.get("writes", 0)) - 1)})
            return
        # Shared first: writes without a lease run side by side, however slow
        # their bodies (a push's connections on a slow link each take seconds);
        # nobody can take a lease while one is held, so the record cannot change.
        with self._locked(info, fcntl.LOCK_SH) as fd:
            record = self._read(fd)
            if self._live(record):
                raise self._refusal(record, path)
            if not record:
                yield
                return
        # A lapsed lease is on record: drop it, which takes the lock exclusively.
        with self._locked(info, fcntl.LOCK_EX) as fd:
            record = self._read(fd)
            if self._live(record):
                raise self._refusal(record, path)
            if record:
                self._write(fd, {})
            # Shared from here on: other writes without a lease may run at
            # once, but nobody can take a lease before this write is done.
            # flock converts by unlocking first, so a lease may have been
            # taken in that instant: look again, now that nobody can.
            fcntl.flock(fd, fcntl.LOCK_SH)
            record = self._read(fd)
            if self._live(record):
                raise self._refusal(record, path)
            yield

    @staticmethod
    def _check_holder(record: dict, lease: str, path: str) -> None:
        if record.get("id") != lease:
            raise Conflict(f"Lost the write lease on {path}: it lapsed and another client wrote to "
                           f"the file (or it was replaced); run again")


def lease_name(info: os.stat_result) -> str:
    """The lease file of a file: its device and inode; a block device's by its device number,
    so that two nodes of one device (an export's symlink, a node made elsewhere) share it."""
    if stat.S_ISBLK(info.st_mode):
        return f"rdev-{info.st_rdev:x}"
    return f"{info.st_dev}-{info.st_ino}"


def _sweep(parent: str, prefix: str = DIRECTORY_PREFIX) -> None:
    """Remove the lease (or other ``prefix``) directories of servers that are gone (killed before they could)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = re.fullmatch(re.escape(prefix) + r"([0-9]+)-[^/]+", name)
        if not match:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except (OSError, OverflowError):
            pass  # alive (another user's: EPERM), or not a pid at all


def _memory_directory() -> Optional[str]:
    """A directory in memory for the lease files, or None for the usual temporary directory.

    Every write request opens (and often creates and removes) a lease file:
    on tmpfs that takes about 0.1 ms, on this machine's ext4 /tmp 0.3 to
    1.8 ms. systemd's ``RuntimeDirectory=`` first, then ``/dev/shm``.
    """
    for candidate in (os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0], "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    return None


__all__ = ["DEAD_HOLDER_WAIT_SECONDS", "HOLDER_CONNECTIONS", "LEASE_SECONDS", "LeaseTable", "lease_name"]

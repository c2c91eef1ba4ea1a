"""Writer locks: a temporary file is alive exactly as long as its writer holds a lock on it.

Every writer of a pdiffcopy temporary (:func:`~pdiffcopy.core.protocol.temporary_name`,
:func:`~pdiffcopy.core.protocol.partial_name`) holds a shared open file description
lock (``F_OFD_SETLK``, ``F_RDLCK``, the whole file) on it while it writes. The kernel
drops the lock when the last descriptor of that open file description closes, which
a killed process's do too, so a sweep that can take the lock exclusively knows the
writer is gone (:func:`probe_writer`), whatever the file's age or its name's process id.

These are byte-range (``fcntl``) locks, not ``flock``: the in-place leases are
``flock`` locks on the target (local/localfile.py), and a writer's lock that outlives
the rename of its temporary over the target for a moment must not be mistaken for one.

Creating and locking are two steps; a sweep may remove the file in between. So a
writer looks at the file's link count once it holds the lock (:func:`create_held`):
zero means swept, and it creates the file again. A sweep, for its part, removes a
file only while it holds the exclusive lock, which no writer can then hold.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from typing import Callable, Dict, Optional, Set, Tuple

#: ``struct flock`` (fcntl.h) on Linux: l_type, l_whence, l_start, l_len, l_pid, padding.
_FLOCK = struct.Struct("@hhqqi4x")

#: errno values with which a file system says it cannot lock (some network file systems):
#: there the sweeps fall back to the age rules (local/sweep.py ``is_stale_temporary``).
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP),
                      errno.EINVAL, errno.ENOSYS})

#: errno values that mean another open file description holds a conflicting lock.
_HELD = frozenset({errno.EAGAIN, errno.EACCES})

#: Seconds a writer waits for a sweep that holds its new file's lock (for a few
#: system calls) before it gives up.
WRITER_WAIT_SECONDS = 5.0

#: Attempts at creating a temporary that a sweep removes each time before the writer locks it.
CREATE_ATTEMPTS = 5


def _lock(fd: int, kind: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))


def lock_shared(fd: int) -> bool:
    """Hold the writer's shared lock on the open file ``fd`` (open for reading).

    :returns: False where the file system cannot lock.
    :raises OSError: EAGAIN when a sweep kept the lock for :data:`WRITER_WAIT_SECONDS`.
    """
    deadline = time.monotonic() + WRITER_WAIT_SECONDS
    while True:
        try:
            _lock(fd, fcntl.F_RDLCK)
            return True
        except OSError as error:
            if error.errno in NO_LOCKS:
                return False
            if error.errno not in _HELD or time.monotonic() >= deadline:
                raise
            time.sleep(0.001)  # a sweep is looking at it: for a few system calls


def hold_descriptor(fd: int) -> Optional[int]:
    """A new descriptor holding the writer's lock on the file ``fd`` is open on; the caller closes it.

    The lock is on a descriptor of its own, so that it lasts while the file's other
    descriptors come and go. None where the file system cannot lock.
    """
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY:
        held = os.dup(fd)  # the same open file description: locked through either
    else:
        held = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if lock_shared(held):
            return held
    except BaseException:
        os.close(held)
        raise
    os.close(held)
    return None


def create_held(name: str, mode: int, dir_fd: Optional[int] = None) -> int:
    """Create the file ``name`` exclusively (``O_RDWR``, never through a symlink) and hold its writer's lock.

    The returned descriptor holds the lock until it (and its duplicates) is closed.

    :raises OSError: As ``open`` does (EEXIST when the name is taken).
    """
    for _ in range(CREATE_ATTEMPTS):
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=dir_fd)
        try:
            if not lock_shared(fd) or os.fstat(fd).st_nlink > 0:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # a sweep removed it before we held it: make it again
    raise OSError(errno.EAGAIN, f"{name} was removed each time it was made")


def still_named(fd: int) -> bool:
    """Whether the file ``fd`` is open on still has a name (a sweep did not remove it before it was held)."""
    return os.fstat(fd).st_nlink > 0


#: What :func:`probe_writer` finds.
HELD, FREE, UNKNOWN = "held", "free", "unknown"


def probe_writer(name: str, dir_fd: Optional[int], info: os.stat_result) -> "Tuple[str, Optional[int]]":
    """Whether the writer of the temporary ``name`` (``lstat`` result ``info``) is alive.

    :returns: :data:`HELD` (a writer holds its lock, or the name now means
              another file: leave it), :data:`FREE` with a descriptor that holds the
              exclusive lock (no writer can take it while the caller removes the
              file; the caller closes it), or :data:`UNKNOWN` where the lock cannot
              tell (the file system cannot lock, the file cannot be opened for writing).
    """
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return HELD, None  # gone: nothing to do
    except OSError:
        return UNKNOWN, None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            os.close(fd)
            return HELD, None
        _lock(fd, fcntl.F_WRLCK)
    except OSError as error:
        os.close(fd)
        return (HELD if error.errno in _HELD else UNKNOWN), None
    return FREE, fd


class HoldKeeper:
    """Writer locks a process keeps between requests: the server's, for its clients' temporaries.

    A push writes its temporaries on the server in many requests, which the
    server's worker processes share out. Each worker that serves a request on
    a temporary keeps a lock on it afterwards (:meth:`keep`), until the client
    is gone: no request on it for ``idle_seconds`` (the lease's lapse), or
    every connection that asked is closed (``alive`` says), or the file has no
    name any more. A daemon thread looks every ``tick`` seconds.
    """

    def __init__(self, idle_seconds: float, tick: float = 0.2) -> None:
        self.idle_seconds = idle_seconds
        self.tick = tick
        self._lock = threading.Lock()
        #: (device, inode) -> [descriptor, last use (monotonic), the connections that asked]
        self._holds: Dict[Tuple[int, int], list] = {}
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        #: The set of connections still open (None when it cannot tell), read once a tick;
        #: None: connections are not judged.
        self.open_connections: Optional[Callable[[], Optional[Set[object]]]] = None

    def keep(self, fd: int, connection: Optional[object] = None) -> None:
        """Keep the lock ``fd`` holds (the keeper closes it), or renew the one already kept on its file."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's thread and holds are not ours
                self._holds, self._thread, self._pid = {}, None, os.getpid()
            held = self._holds.get(key)
            if held is None:
                self._holds[key] = held = [fd, time.monotonic(), set()]
            else:
                os.close(fd)
                held[1] = time.monotonic()
            if connection is not None:
                held[2].add(connection)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="writer-locks", daemon=True)
                self._thread.start()

    def release(self, fd: int) -> None:
        """Stop keeping the lock on the file ``fd`` is open on (it was renamed or removed)."""
        info = os.fstat(fd)
        with self._lock:
            held = self._holds.pop((info.st_dev, info.st_ino), None)
        if held is not None:
            os.close(held[0])

    def __len__(self) -> int:
        return len(self._holds)

    def expire(self) -> None:
        """Close the locks of clients that are gone, and of files that have no name any more."""
        now = time.monotonic()
        with self._lock:
            holds = list(self._holds.items())
        judged = self.open_connections is not None and any(held[2] for _, held in holds)
        still_open = self.open_connections() if judged else None  # one read for every hold
        if still_open is not None and any(held[2] and not held[2] & still_open for _, held in holds):
            # Looked again before a client is taken for gone: the kernel lists the table a page at
            # a time, and one read while others come and go can skip a connection that stays open.
            again = self.open_connections()
            still_open = None if again is None else still_open | again
        for key, (fd, used, connections) in holds:
            try:
                named = os.fstat(fd).st_nlink > 0
            except OSError:
                named = False
            gone = not named or now - used >= self.idle_seconds or (
                bool(connections) and still_open is not None and not connections & still_open)
            if gone:
                with self._lock:
                    if self._holds.get(key, [None])[0] == fd:
                        del self._holds[key]
                        os.close(fd)

    def _run(self) -> None:
        wake = threading.Event()  # never set: a pause that no patch of time.sleep reaches
        while True:
            wake.wait(self.tick)
            try:
                self.expire()
            except Exception:  # housekeeping: never let it end the thread
                pass


#: The keeper of this process's writer locks between requests (a server worker's), or None:
#: a temporary's lock then ends when its endpoint is closed.
KEEPER: Optional[HoldKeeper] = None

_request = threading.local()


def set_request_connection(connection: Optional[object]) -> None:
    """Say which client connection this thread's request came on (the keeper's :meth:`HoldKeeper.keep` records it)."""
    _request.connection = connection


def request_connection() -> Optional[object]:
    """The connection this thread's request came on (:func:`set_request_connection`), if said."""
    return getattr(_request, "connection", None)


__all__ = ["FREE", "HELD", "HoldKeeper", "NO_LOCKS", "UNKNOWN", "create_held", "hold_descriptor",
           "lock_shared", "probe_writer", "request_connection",
           "set_request_connection", "still_named"]

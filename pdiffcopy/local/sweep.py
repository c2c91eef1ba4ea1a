"""The sweep of temporaries that killed runs left: by their writer locks, else by their age.

A temporary whose writer holds its lock (:mod:`~pdiffcopy.local.writerlocks`) is never
touched; one whose lock the sweep can take is abandoned. Where locks cannot tell (a file
system without them, a symlink, another name of a file), the temporary's age and the
process its name carries decide.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Optional

from pdiffcopy.core.protocol import _TEMPORARY_NAME, is_partial_name, is_temporary_name
from pdiffcopy.local import writerlocks

#: A temporary file untouched for this long is left over from a run that
#: ended without cleaning up (killed, crashed, the host rebooted), whoever
#: made it: no sync leaves its temporary unwritten for a day. A ``--partial``
#: file waits this long for the run that resumes it.
STALE_TEMPORARY_SECONDS = 24 * 3600

#: A temporary whose maker (the process id in its name) is no longer alive on
#: this host is swept once it has been untouched for this long: long enough
#: that one written from another host (a shared file system, a push whose
#: client named it) and still in use would have been written to meanwhile.
ORPHAN_TEMPORARY_SECONDS = 15 * 60

#: Entries the server's start-up sweep looks at, at most: a root of millions
#: of files must not delay the start by minutes; the rest waits for the next start.
SWEEP_MAX_ENTRIES = 1_000_000

#: Seconds the server's start-up sweep may take, at most (same reason).
SWEEP_MAX_SECONDS = 10.0


def is_stale_temporary(name: str, info: os.stat_result, now: Optional[float] = None,
                       by_process: bool = True) -> bool:
    """Whether the temporary file ``name`` (with ``lstat`` result ``info``) is left over, by its age.

    The rule where writer locks cannot tell (:func:`remove_if_abandoned`).
    Stale means untouched for :data:`STALE_TEMPORARY_SECONDS`, or (with
    ``by_process``) for :data:`ORPHAN_TEMPORARY_SECONDS` when the process that named it is dead.
    A partial file (:func:`~pdiffcopy.core.protocol.partial_name`) names no
    process: it is kept for the next run to resume until it is untouched for
    :data:`STALE_TEMPORARY_SECONDS`.
    Directories are never stale temporaries (no pdiffcopy temporary is one).
    """
    match = _TEMPORARY_NAME.match(name)
    partial = match is None and is_partial_name(name)
    if (match is None and not partial) or stat.S_ISDIR(info.st_mode):
        return False
    age = (time.time() if now is None else now) - info.st_mtime
    if age >= STALE_TEMPORARY_SECONDS:
        return True
    return (by_process and match is not None and age >= ORPHAN_TEMPORARY_SECONDS
            and not _is_alive(int(match.group(1), 16) >> 24))


def _is_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (possibly another user's)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it exists, it is someone else's
    return True


def remove_if_abandoned(name: str, info: os.stat_result, dir_fd: Optional[int],
                        now: Optional[float] = None) -> bool:
    """Remove the temporary ``name`` (``lstat`` result ``info``) in ``dir_fd`` if its writer is gone.

    A temporary whose writer holds its lock (:mod:`~pdiffcopy.local.writerlocks`) is
    never touched. One whose lock this process can take is removed at once, while
    holding it, whatever its age; but a partial file is kept for the next run to
    resume until it is stale (:func:`is_stale_temporary`). Where the lock cannot tell
    (a file system without locks, a symlink, another name of a file, as a tree's
    hard links are made), the age rules of :func:`is_stale_temporary` decide.

    :returns: Whether it was removed.
    :raises OSError: When removing it fails.
    """
    if not is_temporary_name(name) or stat.S_ISDIR(info.st_mode):
        return False
    lockable = stat.S_ISREG(info.st_mode) and info.st_nlink == 1
    state, held = writerlocks.probe_writer(name, dir_fd, info) if lockable else (writerlocks.UNKNOWN, None)
    if state == writerlocks.HELD:
        return False
    try:
        if state == writerlocks.FREE and not is_partial_name(name):
            abandoned = True
        else:
            abandoned = is_stale_temporary(name, info, now, by_process=state == writerlocks.UNKNOWN)
        if abandoned:
            os.unlink(name, dir_fd=dir_fd)
        return abandoned
    finally:
        if held is not None:
            os.close(held)


def sweep_stale_temporaries(directory: str, recursive: bool = False,
                            max_entries: int = SWEEP_MAX_ENTRIES,
                            max_seconds: float = SWEEP_MAX_SECONDS) -> int:
    """Remove the abandoned temporary files (:func:`remove_if_abandoned`) in ``directory``.

    Iterative, by directory descriptors, never following a symlink; bounded
    by ``max_entries`` and ``max_seconds``. Failures are ignored: the sweep
    is housekeeping and must never stop a sync or the server's start.

    :returns: How many files were removed.
    """
    removed = seen = 0
    deadline = time.monotonic() + max_seconds
    now = time.time()
    try:
        top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    pending = [top]
    try:
        while pending:
            fd = pending.pop()
            try:
                with os.scandir(fd) as scanner:
                    for item in scanner:
                        seen += 1
                        if seen > max_entries or (seen % 1024 == 0 and time.monotonic() > deadline):
                            return removed
                        try:
                            if item.name.startswith(".") and is_temporary_name(item.name):
                                if remove_if_abandoned(item.name, item.stat(follow_symlinks=False), fd, now):
                                    removed += 1
                            elif recursive and item.is_dir(follow_symlinks=False):
                                pending.append(os.open(item.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                                       | os.O_CLOEXEC, dir_fd=fd))
                        except OSError:
                            continue  # gone meanwhile, or not ours to remove
            except OSError:
                pass  # an unreadable directory: nothing to sweep there
            finally:
                os.close(fd)
    finally:
        for fd in pending:
            os.close(fd)
    return removed


__all__ = ["ORPHAN_TEMPORARY_SECONDS", "STALE_TEMPORARY_SECONDS", "SWEEP_MAX_ENTRIES", "SWEEP_MAX_SECONDS",
           "is_stale_temporary", "remove_if_abandoned", "sweep_stale_temporaries"]

"""This machine's processes: what a forked worker does first.

The engine forks its workers (tree units, listings; :mod:`pdiffcopy.engine.workers`)
and the local hash pool forks its own; a worker must never outlive the sync
that forked it. The platform call that sees to it lives here, beside the other
calls into libc; the api hands it to the engine (which imports nothing of local/).
"""

from __future__ import annotations

import functools
import os
import signal

from pdiffcopy.local import libc

#: prctl(2) option (linux/prctl.h): the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


@functools.lru_cache(maxsize=None)
def _prctl():
    """prctl(2), or None; looked up once, in the parent before its first fork (below), so that
    every worker has it at once: a run that forks nothing never imports ctypes."""
    try:
        import ctypes
    except ImportError:
        return None
    return libc.function("prctl", ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


os.register_at_fork(before=_prctl)


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """In a forked worker: get ``signum`` as soon as the parent process dies.

    A client killed outright (SIGKILL, or a signal it cannot clean up after)
    would otherwise leave its hashing and tree workers running on, adopted by
    init. ``prctl(PR_SET_PDEATHSIG)`` makes the kernel send the signal; the
    check of ``getppid`` afterwards covers a parent that died before the call.
    Without prctl (not Linux, no ctypes) nothing is set.

    :param parent_pid: The parent's process id, read before the fork.
    """
    prctl = _prctl()
    if prctl is not None:  # else (no libc, no prctl): only the check below
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)

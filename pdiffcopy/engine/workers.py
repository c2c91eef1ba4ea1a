"""The engine's worker processes: forked, answering through a pipe, stopped by a signal.

A tree sync forks its workers (the units of its queue, the listing of a
second local tree): per-file work is Python that threads would run one at a
time. Each worker inherits what it needs through the fork and hands back
one pickled answer through a pipe when it is done.

A worker must never outlive the sync that forked it: the caller passes the
platform's way to see to that as ``on_start`` (``pdiffcopy.local.processes.die_with_parent``,
which :mod:`pdiffcopy.api` hands in: the engine imports nothing of local/).

Ctrl-C, SIGTERM and SIGHUP do not raise in a worker (nor in a sync running
its units inline): they set :attr:`Stop.requested`, and the unit in hand
finishes first, so that no file is left half-written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import BinaryIO, Callable, Iterator, List, Optional, Tuple

from pdiffcopy.engine.interrupts import STOP_SIGNALS  # after which the workers stop after the unit in hand

#: What a forked worker does first, given its parent's process id (read before the fork).
WorkerStart = Callable[[int], None]


#: Seconds workers asked to stop (SIGTERM) get to finish their unit before they are killed.
STOP_GRACE_SECONDS = 10.0


class WorkerFailed(Exception):
    """A worker gave no answer: its task raised :attr:`error`, or (None) the process died."""

    def __init__(self, pid: int, error: Optional[BaseException]) -> None:
        super().__init__(f"worker process {pid} " + (f"failed: {error!r}" if error is not None else "died"))
        self.error = error


class Stop:
    """Set by Ctrl-C or SIGTERM while the queue runs: stop after the unit in hand."""

    requested = False


def request_stop(signum, frame) -> None:
    # No exception here: raised in the middle of a file it would leave a
    # partial file or a temporary behind. Units are small (a batch of small
    # files, 64 MiB of a big one), so the stop comes within a fraction of a second.
    Stop.requested = True


@contextlib.contextmanager
def stop_requests() -> Iterator[None]:
    """Stop signals set :attr:`Stop.requested` in this process while the block runs (from the main thread)."""
    previous = {signum: signal.signal(signum, request_stop) for signum in STOP_SIGNALS} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        Stop.requested = False


def fork_child(run: Callable[[BinaryIO], None], on_start: Optional[WorkerStart] = None) -> "Tuple[int, int]":
    """Fork a process that runs ``run`` with the writing end of a pipe, then exits; (its pid, the reading end).

    The one fork of the engine's processes: the child never returns into the parent's code,
    whatever ``run`` does (it exits 1 if ``run`` raised). Its messages are :func:`send`'s.
    """
    import pickle  # noqa: F401  (here, before the fork: once; a run that forks nothing never loads it)

    reader, writer = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(reader)
            if on_start is not None:
                on_start(parent)
            with os.fdopen(writer, "wb") as stream:
                run(stream)
        except BaseException:  # never run the parent's code in a child
            code = 1
        finally:
            os._exit(code)
    os.close(writer)
    return pid, reader


def send(stream: BinaryIO, message: object) -> None:
    """Send one message to the parent (pickled: a child's answers are Python objects)."""
    import pickle

    pickle.dump(message, stream, protocol=pickle.HIGHEST_PROTOCOL)


def receive(stream: BinaryIO) -> object:
    """The next message a child sent; EOFError when it sent no more (it ended, or died).

    :raises EOFError: Also for a message cut short by the child's death.
    """
    import pickle

    try:
        return pickle.load(stream)
    except pickle.UnpicklingError:
        raise EOFError("a message cut short") from None


class Worker:
    """A forked process running one task; :meth:`answer` collects what it returned."""

    def __init__(self, task: Callable[[], object], on_start: Optional[WorkerStart] = None) -> None:
        def run(stream: BinaryIO) -> None:
            try:
                answer: tuple = ("ok", task())
            except BaseException as error:  # handed to the parent, which raises it
                answer = ("error", error)
            send(stream, answer)

        self.pid, self._reader = fork_child(run, on_start)

    def answer(self) -> object:
        """Wait for the worker; return what its task returned.

        :raises WorkerFailed: When its task raised, or it died without an answer.
        """
        try:
            with os.fdopen(self._reader, "rb") as stream:
                try:
                    kind, value = receive(stream)  # type: ignore[misc]
                except EOFError:
                    kind, value = "died", None
        finally:
            os.waitpid(self.pid, 0)
        if kind == "died":
            raise WorkerFailed(self.pid, None)
        if kind == "error":
            raise WorkerFailed(self.pid, value)
        return value


def stop_workers(pids: List[int]) -> None:
    """Ask every worker to stop after its unit (Ctrl-C may not have reached them), then wait."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    waiting = set(pids)
    while waiting:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG if time.monotonic() < deadline else 0)
            except ChildProcessError:
                done = pid
            if done:
                waiting.discard(pid)
        if waiting and time.monotonic() >= deadline:
            for pid in waiting:
                os.kill(pid, signal.SIGKILL)
        if waiting:
            time.sleep(0.01)


__all__ = ["STOP_SIGNALS", "Stop", "Worker", "WorkerFailed", "WorkerStart", "fork_child", "receive", "request_stop",
           "send", "stop_requests",
           "stop_workers"]

"""The serve-over-ssh mode: the server a client starts on another host through ssh.

``pdiffcopy --serve-over-ssh`` is what the client runs on HOST for a
``HOST:PATH`` argument (:mod:`pdiffcopy.transport.sshlaunch`). It serves "/"
as the ssh user, on a Unix socket of mode 0600 in a private 0700 directory,
with a fresh random token, and hands the socket's path and the token over in
one JSON line on stdout (ssh's channel): neither ever appears on a command
line. It lives exactly as long as the ssh session: when its stdin closes
(the client closed it, or died and ssh or sshd with it) it stops and removes
its directory. docs/protocol.rst, "Serving over ssh", describes the hand-over.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import threading
from typing import Optional

from pdiffcopy import __version__
from pdiffcopy.core.sshform import handshake_line

#: Seconds the workers get to finish their requests once the session ended: the client
#: that sent them is gone.
SHUTDOWN_GRACE_SECONDS = 1

#: Longest directory that leaves room for "/socket" in a Unix socket's path (108 bytes on Linux).
MAX_SOCKET_DIRECTORY_LENGTH = 100


def serve_over_ssh(*, workers: Optional[int] = None, log_level: str = "warning") -> None:
    """Serve "/" until stdin closes, then stop and remove the socket and its directory."""
    from pdiffcopy.server.service import ServerOptions, run_server

    home = os.path.expanduser("~")
    try:
        os.chdir(home)
    except OSError:
        pass
    token = secrets.token_urlsafe(32)
    owner = os.getpid()
    directory = tempfile.mkdtemp(prefix="pdiffcopy-serve-")  # mode 0700
    if len(os.fsencode(directory)) > MAX_SOCKET_DIRECTORY_LENGTH:  # a long $TMPDIR
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="pdiffcopy-serve-", dir="/tmp")
    temporaries = TemporaryLog(os.path.join(directory, "temporaries"))
    socket_path = os.path.join(directory, "socket")
    # The hand-over goes out on the real stdout; everything after it (gunicorn's and the
    # workers' output) goes to stderr, so that no stray line lands in the channel.
    handover = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def when_ready(arbiter) -> None:
        # A SIGHUP (a terminal's hang-up) ends the session as stdin's end does; gunicorn
        # would reload. The arbiter runs the handler named after the signal.
        arbiter.handle_hup = arbiter.handle_int
        os.write(handover, (handshake_line(version=__version__, socket=socket_path, token=token,
                                           home=home) + "\n").encode("utf-8"))
        os.close(handover)
        threading.Thread(target=_stop_at_end_of_input, args=(os.getpid(),), daemon=True,
                         name="stdin-watch").start()

    try:
        run_server(ServerOptions(root="/", token=token, workers=workers, trust_clients=True,
                                 unix_socket=socket_path, when_ready=when_ready, log_level=log_level,
                                 graceful_timeout=SHUTDOWN_GRACE_SECONDS, wrap_app=temporaries.wrap))
    finally:
        if os.getpid() == owner:  # not in a worker, which unwinds through here when it exits
            temporaries.remove_left()
            shutil.rmtree(directory, ignore_errors=True)


class TemporaryLog:
    """The temporary files this server's one client worked on, to remove those its end left behind.

    A sync renames or deletes its temporaries; a client killed mid-push cannot. This server
    lives for one client only, so a temporary of its requests still there when it stops
    belongs to a sync that will never finish (a --partial file is kept: it is meant to last).
    The workers append each name they see once to a file; the server reads it as it stops.
    """

    def __init__(self, log: str) -> None:
        self.log = log
        self._seen: set = set()

    def wrap(self, app):
        def recording(environ, start_response):
            # Only requests that make or write a temporary: a GET of some other sync's
            # temporary (named by hand) must not have it removed.
            if environ.get("REQUEST_METHOD") in ("POST", "PATCH", "PUT"):
                self._record(environ.get("PATH_INFO", ""))
            return app(environ, start_response)

        return recording

    def _record(self, request_path: str) -> None:
        from pdiffcopy.core.protocol import RESERVED_NAME, is_partial_name, is_temporary_name

        name = request_path.rsplit("/", 1)[-1]
        if not name.startswith(".") or not is_temporary_name(name) or is_partial_name(name):
            return
        if request_path.startswith(f"/{RESERVED_NAME}/"):  # /.pdiffcopy/VERB/PATH
            request_path = "/" + request_path.split("/", 3)[3]
        if request_path in self._seen:
            return
        self._seen.add(request_path)
        # (WSGI gives the path as latin-1 text of the request's bytes)
        line = request_path.encode("latin-1", "replace") + b"\n"
        descriptor = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(descriptor, line)
        finally:
            os.close(descriptor)

    def remove_left(self) -> None:
        """Remove the temporaries named in the log that are still there (never following a symlink)."""
        try:
            with open(self.log, "rb") as handle:
                paths = set(handle.read().splitlines())
        except OSError:
            return
        for path in paths:
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass


def _stop_at_end_of_input(arbiter_pid: int) -> None:
    """Read stdin to its end (the ssh session's end), then stop the server as Ctrl-C does."""
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    # The client ended the session: the stop's own chatter (a worker still starting that
    # gunicorn kills, an ERROR) would reach a client that is reading ssh's last words.
    logging.getLogger("gunicorn.error").setLevel(logging.CRITICAL)
    os.kill(arbiter_pid, signal.SIGINT)


__all__ = ["serve_over_ssh"]

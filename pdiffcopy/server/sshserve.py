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
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
from typing import Optional

from pdiffcopy._version import __version__
from pdiffcopy.core.sshform import handshake_line

#: Seconds the workers get to finish their requests once the session ended: the client
#: that sent them is gone.
SHUTDOWN_GRACE_SECONDS = 1

#: Longest path a Unix socket can be bound at (108 bytes on Linux, the last a NUL).
MAX_SOCKET_PATH_BYTES = 107

#: Characters of the random part tempfile.mkdtemp appends to the prefix.
_MKDTEMP_RANDOM = 8

#: A server's directory (socket and temporaries log): the prefix, its process id, a random part.
DIRECTORY_PREFIX = "pdiffcopy-serve-"

#: The file in that directory naming the temporaries its client's pushes made.
TEMPORARIES_LOG = "temporaries"

#: Connections the socket queues until the workers accept: a client's whole first burst.
HANDOVER_BACKLOG = 256


def serve_over_ssh(*, workers: Optional[int] = None, log_level: str = "warning",
                   direct_port: Optional[int] = None, device: Optional[str] = None) -> None:
    """Serve "/" until stdin closes, then stop and remove the socket and its directory.

    :param direct_port: ``--direct``: listen with TLS at this port (0: a free one) on the
                        address the ssh connection came in on, instead of on the Unix socket.
    :param device: The path the client named (as typed): if it is a block device, it is served
                   as one under its own path, with this user's rights; every other device node
                   below "/" stays refused (:func:`pdiffcopy.server.exports.ssh_export`).

    The socket is bound and handed over before the server's modules (Flask, gunicorn) are
    imported: the client sets up its forwarding and starts its own work meanwhile, and its
    first requests wait in the socket's backlog until the workers accept them.
    """
    home = os.path.expanduser("~")
    try:
        os.chdir(home)
    except OSError:
        pass
    token = secrets.token_urlsafe(32)
    owner = os.getpid()
    parent = tempfile.gettempdir()
    socket_path_bytes = len(os.path.join(os.fsencode(parent), f"{DIRECTORY_PREFIX}{owner}-".encode())) \
        + _MKDTEMP_RANDOM + len(b"/socket")
    if socket_path_bytes > MAX_SOCKET_PATH_BYTES:  # a long $TMPDIR
        parent = "/tmp"
    sweep_dead_servers(parent)
    directory = tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{owner}-", dir=parent)  # mode 0700
    temporaries = TemporaryLog(os.path.join(directory, TEMPORARIES_LOG))
    socket_path = os.path.join(directory, "socket")
    certificate = key = None
    try:
        if direct_port is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            os.fchmod(listener.fileno(), 0o600)  # (the directory is 0700 already)
            listener.bind(socket_path)
            os.chmod(socket_path, 0o600)
            where = dict(socket=socket_path)
        else:
            certificate, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
            fingerprint = make_certificate(certificate, key)
            listener = _direct_listener(direct_port)
            address, port = listener.getsockname()[:2]
            where = dict(address=address, port=port, fingerprint=fingerprint)
        listener.listen(HANDOVER_BACKLOG)
        # The hand-over goes out on the real stdout; everything after it (gunicorn's and the
        # workers' output) goes to stderr, so that no stray line lands in the channel.
        os.write(1, (handshake_line(version=__version__, token=token, home=home, **where)
                     + "\n").encode("utf-8"))
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        from pdiffcopy.server.exports import ssh_export
        from pdiffcopy.server.service import ServerOptions, run_server

        named = ssh_export(device, home) if device is not None else None

        _send_small_answers_in_one_write()

        def when_ready(arbiter) -> None:
            # A SIGHUP (a terminal's hang-up) ends the session as stdin's end does; gunicorn
            # would reload. The arbiter runs the handler named after the signal.
            arbiter.handle_hup = arbiter.handle_int
            threading.Thread(target=_stop_at_end_of_input, args=(os.getpid(),), daemon=True,
                             name="stdin-watch").start()

        run_server(ServerOptions(root="/", token=token, workers=workers, trust_clients=True,
                                 unix_socket=socket_path if direct_port is None else None,
                                 listen_descriptor=listener.fileno(), certfile=certificate, keyfile=key,
                                 when_ready=when_ready, log_level=log_level,
                                 graceful_timeout=SHUTDOWN_GRACE_SECONDS, wrap_app=temporaries.wrap,
                                 exports=[named] if named is not None else []))
    finally:
        if os.getpid() == owner:  # not in a worker, which unwinds through here when it exits
            temporaries.remove_left()
            shutil.rmtree(directory, ignore_errors=True)


#: An answer's first body write up to this size goes out with its headers in one write.
COALESCED_BODY_BYTES = 64 * 1024


def _send_small_answers_in_one_write() -> None:
    """Make gunicorn write an answer's headers together with its first piece of body.

    gunicorn writes them apart. Through ssh, sshd often reads the two writes apart and
    sends two packets; sshd sets no TCP_NODELAY without a tty, so the second (small) one
    waits for the client's delayed ACK of the first: about 40 ms for one small request in
    four. One write makes one packet. (Set in this process before gunicorn forks.)
    """
    from gunicorn.http import wsgi

    class CoalescingResponse(wsgi.Response):  # type: ignore[name-defined,misc]
        def write(self, arg):
            if self.headers_sent or not isinstance(arg, bytes) or len(arg) > COALESCED_BODY_BYTES:
                return super().write(arg)
            gathered = _GatheringSocket(self.sock)
            self.sock = gathered
            try:
                super().write(arg)  # the headers and the body, framed as gunicorn frames them
            finally:
                self.sock = gathered.socket
            if gathered.parts:
                self.sock.sendall(b"".join(gathered.parts))

    wsgi.Response = CoalescingResponse


class _GatheringSocket:
    """Stands in for an answer's socket during one write: keeps what is sent, to send it at once."""

    def __init__(self, socket_) -> None:
        self.socket = socket_
        self.parts: list = []

    def sendall(self, data, *_) -> None:
        self.parts.append(bytes(data))

    def __getattr__(self, name):
        return getattr(self.socket, name)


def make_certificate(certificate: str, key: str) -> str:
    """Write a one-time self-signed certificate and its key (mode 0600); the certificate's SHA-256.

    With the ``openssl`` command: the ``cryptography`` package is not among pdiffcopy's
    dependencies (nor in most system Pythons), while openssl is on every host with OpenSSH.
    The client pins the certificate by this fingerprint, which reached it over ssh.

    :raises PdiffcopyError: When openssl is missing or fails.
    """
    import hashlib
    import ssl
    import subprocess

    from pdiffcopy.errors import PdiffcopyError

    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
               "-nodes", "-days", "2", "-subj", "/CN=pdiffcopy-direct", "-keyout", key, "-out", certificate]
    # (In the server's 0700 directory: the key is private before it is made 0600.)
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except OSError as error:
        raise PdiffcopyError(f"--direct needs the openssl command on this host: {error.strerror}") from None
    if done.returncode == 0:
        os.chmod(key, 0o600)
    if done.returncode != 0:
        raise PdiffcopyError(f"openssl cannot make --direct's certificate: {' '.join(done.stderr.split())[-300:]}")
    with open(certificate, encoding="ascii") as handle:
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(handle.read())).hexdigest()


def _direct_listener(port: int) -> socket.socket:
    """A TCP socket bound to the address this ssh session came in on ($SSH_CONNECTION's third field)."""
    from pdiffcopy.errors import PdiffcopyError

    fields = os.environ.get("SSH_CONNECTION", "").split()
    if len(fields) != 4:
        raise PdiffcopyError("--direct: $SSH_CONNECTION is not set: not started through ssh?")
    address = fields[2]
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Inherited by the accepted connections (gunicorn sets it only on sockets it binds).
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        listener.bind((address, port))
    except OSError as error:
        listener.close()
        raise PdiffcopyError(f"--direct: cannot listen on {address} port {port}: {error.strerror}") from None
    return listener


def sweep_dead_servers(parent: str) -> None:
    """Remove what serve-over-ssh servers killed before their own clean-up (SIGKILL) left in ``parent``.

    Each server's directory is named after its process id; one whose process is gone is
    removed, with the temporaries of its client's unfinished pushes that its log names. (The
    servers' /dev/shm metrics and lease directories are swept the same way as they start.)
    """
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = re.fullmatch(re.escape(DIRECTORY_PREFIX) + r"([0-9]+)-[^/]+", name)
        if not match:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):
            continue  # alive (another user's: EPERM), or not a process id
        directory = os.path.join(parent, name)
        TemporaryLog(os.path.join(directory, TEMPORARIES_LOG)).remove_left()
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


__all__ = ["serve_over_ssh", "sweep_dead_servers"]

"""Reaching ``[USER@]HOST:PATH``: start a pdiffcopy server on HOST through ssh and forward to it.

The system's OpenSSH client (``ssh``, or rsync's ``-e/--rsh COMMAND``) runs
``pdiffcopy --serve-over-ssh`` on HOST (:mod:`pdiffcopy.server.sshserve`) as
the ssh user; ``~/.ssh/config``, agents, ProxyJump and known_hosts work as
they do for rsync. That ssh process is the session's master
(``ControlMaster``; ssh makes its control socket mode 0600 and removes it when it exits): the
server's one hand-over line comes back on its stdout, and a local loopback
port is then forwarded to the server's Unix socket over the same connection
(``ssh -O forward``: no second login). The sync's parallel HTTP connections
go to that port, with the token from the hand-over.

A loopback port rather than a local Unix socket: the HTTP client, the tree
workers and a later ``--direct`` (TLS straight to HOST) all speak TCP to a
host and port, unchanged; the token keeps other local users out, as it does
for any server.

The session ends when :meth:`SshSession.close` closes ssh's stdin: the server
sees the end of its input and stops. A client killed in any way closes that
pipe too (the kernel does), so the server never outlives its client.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import select
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, List, Optional

from pdiffcopy._version import __version__
from pdiffcopy.core.addresses import is_loopback
from pdiffcopy.core.sshform import (
    DIRECT_OPTION,
    HANDSHAKE_MARK,
    PINNED_CERTIFICATE_PREFIX,
    SERVE_DEVICE_OPTION,
    SERVE_OPTION,
    SSH_PROTOCOL_VERSION,
    SshLocation,
    read_handshake,
)
from pdiffcopy.errors import RemoteProgramMissing, RemoteProtocolError, SshFailed, SshStartFailed, UsageError
from pdiffcopy.core.locations import quote_path

logger = logging.getLogger(__name__)

#: The ssh client run when no ``-e/--rsh`` is given.
DEFAULT_RSH = "ssh"

#: ssh connections that carry the sync's data. One: the session's own connection, through
#: which the port is forwarded. More (``ssh -N -L`` beside it, each its own sshd process)
#: are for links faster than one sshd moves, once measured (issue 21).
SSH_DATA_CONNECTIONS = 1

#: Seconds to wait for the remote server's hand-over when the sync gives no --timeout.
DEFAULT_START_TIMEOUT = 60.0

#: Seconds the ssh client gets to end after its stdin closed before it is killed.
CLOSE_TIMEOUT = 5.0

#: Longest control socket path ssh can bind (a Unix socket's 108 bytes, less ssh's
#: temporary suffix while it binds).
MAX_CONTROL_PATH_LENGTH = 80

#: Seconds --direct waits for a TCP connection to the remote server before it gives up.
DIRECT_CONNECT_TIMEOUT = 10.0

#: Local ports tried for the forwarding (another process may take a free one first).
FORWARD_ATTEMPTS = 3



def install_advice() -> str:
    """What to do when the other host lacks this version of pdiffcopy, with what serving needs.

    Not ``pip install pdiffcopy``: PyPI's is 1.0.1, which cannot serve over ssh, and without
    the server extra no version can. The version is pinned (pip then refuses rather than
    installing another), and the source this one was installed from is named when pip
    recorded one (a checkout, a wheel), since a version not yet on PyPI comes from there.
    """
    source = _installed_from()
    where = f" (this one was installed from {source})" if source else ""
    return (f"install pdiffcopy {__version__} there with its server extra, in a venv whose bin/ is on the "
            f"PATH of non-interactive ssh sessions: python3 -m pip install 'SOURCE[server]' from the checkout "
            f"or wheel of this version{where}, or 'pdiffcopy[server]=={__version__}' from an index that has it "
            f"(PyPI's plain pdiffcopy is 1.0.1, which cannot serve over ssh); or name it with "
            f"--remote-pdiffcopy PATH")


def _installed_from() -> Optional[str]:
    """Where pip installed this pdiffcopy from (its PEP 610 ``direct_url.json``), if not an index."""
    import json
    from importlib import metadata

    try:
        recorded = metadata.distribution("pdiffcopy").read_text("direct_url.json")
        url = json.loads(recorded or "null")["url"] if recorded else None
    except (metadata.PackageNotFoundError, ValueError, KeyError, TypeError, OSError):
        return None
    if isinstance(url, str) and url.startswith("file://"):
        from urllib.parse import unquote, urlsplit

        return unquote(urlsplit(url).path)
    return url if isinstance(url, str) else None


#: The remote command when no --remote-pdiffcopy is given: ``pdiffcopy`` on the remote PATH,
#: else the module under python3. Run by sh, whatever the login shell is.
_DEFAULT_REMOTE_SCRIPT = ("if command -v pdiffcopy >/dev/null 2>&1; then exec pdiffcopy {args}; fi; "
                          "if python3 -c 'import pdiffcopy' >/dev/null 2>&1; "
                          "then exec python3 -m pdiffcopy {args}; fi; "
                          "echo 'pdiffcopy: command not found' >&2; exit 127")


def rsh_command(rsh: Optional[str]) -> List[str]:
    """``-e/--rsh COMMAND`` split as rsync splits it (shell words), checked to be runnable.

    :raises UsageError: For an empty or unbalanced COMMAND, or a program not found; a value that
                        looks like a regular expression is told about ``--exclude-regex``.
    """
    text = DEFAULT_RSH if rsh is None else rsh
    hint = (" (-e is --rsh, the ssh command, as in rsync; the regex filter is --exclude-regex)"
            if rsh is not None and looks_like_regex(rsh) else "")
    try:
        argv = shlex.split(text)
    except ValueError as error:
        raise UsageError(f"Cannot split -e/--rsh {text!r}: {error}{hint}") from None
    if not argv:
        raise UsageError(f"-e/--rsh is empty{hint}")
    if shutil.which(argv[0]) is None:
        raise UsageError(f"-e/--rsh: {argv[0]} not found{hint}" if rsh is not None else
                         "ssh not found: install the OpenSSH client (or name one with -e/--rsh)")
    return argv


def looks_like_regex(text: str) -> bool:
    """Whether an ``-e`` value reads as a regular expression (pdiffcopy 1.x's ``-e``) rather than a command."""
    first = text.strip().split(" ", 1)[0]
    return any(mark in first for mark in ("\\", "^", "$", "|", "(", "[", "*", "+", "?", "{"))


def remote_command(remote_program: Optional[str], verbose: bool = False,
                   direct_port: Optional[int] = None, quiet: bool = False, device: Optional[str] = None) -> str:
    """The command line ssh runs on the host (its login shell reads it, as rsync's does).

    :param verbose: The remote server logs its requests (the client's ``-vv``).
    :param direct_port: For ``--direct``: the port the server listens on (0: any free one).
    :param quiet: The remote server logs only its errors (the client's ``-q``).
    :param device: The PATH of the ``HOST:PATH``, as typed: the server serves it as a block
                   device if it is one (and no other device).
    """
    args = SERVE_OPTION + (" -v" if verbose else " -q" if quiet else "") + \
        (f" {DIRECT_OPTION} {int(direct_port)}" if direct_port is not None else "") + \
        (f" {SERVE_DEVICE_OPTION}={shlex.quote(device)}" if device else "")
    if remote_program:
        return f"{remote_program} {args}"  # as given: rsync's --rsync-path may be "sudo rsync"
    return "sh -c " + shlex.quote(_DEFAULT_REMOTE_SCRIPT.format(args=args))


class SshSession:
    """A pdiffcopy server on another host, started over ssh and reached through a forwarded port.

    :param location: The ``[USER@]HOST:PATH`` argument.
    :param rsh: ``-e/--rsh COMMAND`` (None: ``ssh``).
    :param remote_program: ``--remote-pdiffcopy`` (None: ``pdiffcopy``, then ``python3 -m pdiffcopy``).
    :param timeout: Seconds to wait for the server's hand-over.
    :param while_waiting: Called with the session once ssh runs, before the hand-over is awaited:
                          work that overlaps the login and the remote start (the caller's imports,
                          the local file's hashing: processes it forks close
                          :meth:`ssh_descriptors`).
    :param direct: ``--direct``: ssh only starts the server; the data goes over TLS straight
                   to the address the ssh connection reached, at ``direct_port`` (None or 0:
                   a free port), verified against the one-time certificate's fingerprint that
                   came over ssh (:attr:`ca_file`).
    """

    def __init__(self, location: SshLocation, *, rsh: Optional[str] = None,
                 remote_program: Optional[str] = None, timeout: Optional[float] = None,
                 verbose: bool = False, while_waiting: Optional[Callable[["SshSession"], None]] = None,
                 direct: bool = False, direct_port: Optional[int] = None, quiet: bool = False) -> None:
        self.location = location
        self.direct_port = (direct_port or 0) if direct or direct_port is not None else None
        #: What the sync's HTTP client verifies the server with: None over the ssh tunnel
        #: (plain HTTP to a loopback port), the pinned certificate for ``--direct``.
        self.ca_file: Optional[str] = None
        self.while_waiting = while_waiting
        self.rsh = rsh_command(rsh)
        self.remote_program = remote_program
        self.timeout = timeout or DEFAULT_START_TIMEOUT
        self.verbose = verbose
        self.quiet = quiet
        self.process: Optional[subprocess.Popen] = None
        self.control: Optional[str] = None
        self.token: Optional[str] = None
        self.home = "/"
        self.base: Optional[str] = None
        self._errors: List[str] = []
        self._handed_over = threading.Event()
        self._stderr_done = threading.Event()

    @property
    def url(self) -> str:
        """The URL of the location's PATH on the forwarded server (a relative PATH from the remote home)."""
        assert self.base is not None, "start() first"
        return self.base + quote_path(self.location.absolute_path(self.home))

    def url_of(self, location) -> str:
        """The URL of another :class:`~pdiffcopy.core.sshform.SshLocation` on this session's host."""
        assert self.base is not None, "start() first"
        return self.base + quote_path(location.absolute_path(self.home))

    def shown(self, location: str) -> str:
        """``location`` as the user named it: the ``[USER@]HOST:PATH`` typed for the session's own
        URL and what is below it, ``[USER@]HOST:/ABSOLUTE`` for another URL of its server."""
        if self.base is None or not location.startswith(self.base + "/"):
            return location
        from pdiffcopy.transport.urls import split_server_url

        try:
            path = split_server_url(location)[1]
        except UsageError:  # (not a file's URL: a query, say)
            return location
        own = self.location.absolute_path(self.home).strip("/")
        typed = self.location.typed
        if path.rstrip("/") == own:
            return typed + ("/" if path.endswith("/") and not typed.endswith(("/", ":")) else "")
        if path.startswith(own + "/") or not own:
            below = path[len(own):].lstrip("/")
            return typed + ("" if typed.endswith(("/", ":")) else "/") + below
        return SshLocation(self.location.user, self.location.host, "/" + path).typed

    def shown_message(self, message: str) -> str:
        """A message with this session's forwarded URLs named as the user named them."""
        if self.base is None:
            return message
        message = message.replace(f"Server {self.base}", f"{self.location.destination} (over ssh)")
        # A URL ends at a space; the punctuation before that (``URL: reason``) is the sentence's.
        message = re.sub(re.escape(self.base) + r"(/\S*?)([:;,.)]*)(?=\s|$)",
                         lambda found: self.shown(self.base + found.group(1)) + found.group(2), message)
        return message.replace(self.base, f"{self.location.destination} (over ssh)")

    def start(self) -> "SshSession":
        """Log in, start the remote server, read its hand-over and forward a local port to it.

        :raises SshFailed: With ssh's own message when it cannot connect or log in.
        :raises RemoteProgramMissing: When HOST has no pdiffcopy.
        :raises RemoteProtocolError: When the remote speaks another protocol version.
        :raises SshStartFailed: When the remote says nothing.
        """
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        # ssh binds it (refusing a name that exists) and removes it when it exits, also
        # when this process was killed: a directory of ours would outlive a SIGKILL.
        name = f"pdiffcopy-ssh-{secrets.token_hex(8)}.control"
        control = os.path.join(tempfile.gettempdir(), name)
        if len(os.fsencode(control)) > MAX_CONTROL_PATH_LENGTH:  # a long $TMPDIR
            control = os.path.join("/tmp", name)
        self.control = control
        argv = [*self.rsh, "-o", "ControlMaster=yes", "-o", f"ControlPath={control}",
                "-o", "ControlPersist=no", "--", self.location.destination,
                remote_command(self.remote_program, self.verbose, self.direct_port, self.quiet,
                               device=self.location.path)]
        logger.debug("Starting the remote server: %s", shlex.join(argv))
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
        threading.Thread(target=self._relay_stderr, name="ssh-stderr", daemon=True).start()
        if self.while_waiting is not None:
            self.while_waiting(self)
        fields = self._read_handover()
        self._handed_over.set()
        self._check_version(fields)
        self.token = str(fields["token"])
        self.home = str(fields.get("home") or "/")
        if self.direct_port is None:
            self.base = self._forward(control, str(fields["socket"]))
            if not is_loopback(self.location.host):
                from pdiffcopy.transport.compressionpolicy import note_tunnel  # (after ssh started)

                # The forwarded port is loopback, the link behind it is not: let --compress
                # auto judge it, as it does a URL's (a loopback server stays plain).
                note_tunnel(self.base)
        else:
            self.base = self._reach_directly(str(fields["address"]), int(fields["port"]))
            self.ca_file = PINNED_CERTIFICATE_PREFIX + str(fields["fingerprint"])

    def ssh_descriptors(self) -> List[int]:
        """The descriptors of this process's pipes to ssh.

        A process forked while the session runs must close them: while one holds ssh's stdin
        open, closing it here does not end the session.
        """
        process = self.process
        if process is None:
            return []
        return [stream.fileno() for stream in (process.stdin, process.stdout, process.stderr)
                if stream is not None and not stream.closed]

    def _read_handover(self) -> dict:
        """The remote server's hand-over line, skipping whatever a login script printed first."""
        assert self.process is not None and self.process.stdout is not None
        stream = self.process.stdout.fileno()
        deadline = time.monotonic() + self.timeout
        pending = b""
        while True:
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                fields = read_handshake(line.decode("utf-8", "replace"))
                if fields is not None:
                    return fields
            left = deadline - time.monotonic()
            ready = select.select([stream], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                raise SshStartFailed(f"{self.location.host}: no answer from the remote pdiffcopy within "
                                     f"{self.timeout:g} s")
            data = os.read(stream, 65536)
            if not data:
                self._raise_start_failure()
            pending += data

    def _raise_start_failure(self):
        """Say why ssh ended before the hand-over: ssh's message, a missing pdiffcopy, or the remote's."""
        assert self.process is not None
        try:
            status = self.process.wait(CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            status = None
        self._stderr_done.wait(CLOSE_TIMEOUT)
        message = " ".join(self._errors[-3:]) or f"ssh exited with status {status}"
        host = self.location.host
        if status == 255:
            raise SshFailed(f"ssh {self.location.destination}: {message}")
        if status == 127 or "No module named pdiffcopy" in message:
            raise RemoteProgramMissing(f"pdiffcopy not found on {host} ({message}): {install_advice()}")
        # argparse's words, and 1.0.1's ("Error: option --serve-over-ssh not recognized").
        if "unrecognized arguments: " + SERVE_OPTION in message or f"option {SERVE_OPTION} not recognized" in message \
                or "unrecognized arguments: " + SERVE_DEVICE_OPTION in message:
            raise RemoteProtocolError(f"{host}: the remote pdiffcopy is too old to serve over ssh ({message}): "
                                      f"{install_advice()}")
        raise SshStartFailed(f"{host}: the remote pdiffcopy did not start: {message}")

    def _check_version(self, fields: dict) -> None:
        theirs = fields.get(HANDSHAKE_MARK)
        if theirs != SSH_PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"{self.location.host} runs pdiffcopy {fields.get('version', '?')}, whose serve-over-ssh "
                f"protocol is version {theirs}; this pdiffcopy {__version__} speaks version "
                f"{SSH_PROTOCOL_VERSION}: install the same version on both hosts")
        expected = {"token": str, "socket": str} if self.direct_port is None else \
            {"token": str, "address": str, "port": int, "fingerprint": str}
        for name, kind in expected.items():
            if not isinstance(fields.get(name), kind) or not fields[name]:
                raise SshStartFailed(f"{self.location.host}: the remote pdiffcopy's hand-over lacks its {name}")

    def _reach_directly(self, address: str, port: int) -> str:
        """The base URL of a --direct server, once a TCP connection to it succeeded.

        No quiet fall-back to the ssh path: --direct was asked for (to pass by sshd's
        throughput), and a firewall in the way is worth knowing about.
        """
        try:
            with socket.create_connection((address, port), timeout=min(self.timeout, DIRECT_CONNECT_TIMEOUT)):
                pass
        except OSError as error:
            reason = error.strerror or str(error) or type(error).__name__
            raise SshStartFailed(f"--direct: cannot reach {self.location.host}'s pdiffcopy at {address} port "
                              f"{port} ({reason}): a firewall between the hosts? Without --direct the "
                              f"data goes through ssh") from None
        return f"https://[{address}]:{port}" if ":" in address else f"https://{address}:{port}"

    def _forward(self, control: str, remote_socket: str) -> str:
        """Forward a free local loopback port to the remote socket through the session; its base URL."""
        failure = ""
        for _ in range(FORWARD_ATTEMPTS):
            port = _free_port()
            forward = [*self.rsh, "-o", f"ControlPath={control}", "-O", "forward",
                       "-L", f"127.0.0.1:{port}:{remote_socket}", "--", self.location.destination]
            done = subprocess.run(forward, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=self.timeout)
            if done.returncode == 0:
                return f"http://127.0.0.1:{port}"
            failure = " ".join(done.stderr.split()) or f"status {done.returncode}"
            if self.process is not None and self.process.poll() is not None:
                break
        raise SshFailed(f"ssh {self.location.destination}: cannot forward a port to the remote "
                        f"pdiffcopy: {failure}")

    def _relay_stderr(self) -> None:
        """Keep ssh's and the remote's messages for an error until the hand-over; pass them on after."""
        assert self.process is not None and self.process.stderr is not None
        try:
            for raw in self.process.stderr:
                line = raw.decode("utf-8", "replace").rstrip()
                if not line:
                    continue
                if self._handed_over.is_set():
                    sys.stderr.write(f"{self.location.host}: {line}\n")
                else:
                    self._errors.append(line)
        except (OSError, ValueError):
            pass
        finally:
            self._stderr_done.set()

    def close(self, wait: bool = True) -> None:
        """End the session: the remote server stops at the end of its input, and ssh with it.

        :param wait: Wait (up to :data:`CLOSE_TIMEOUT`) for ssh to exit, that is for the remote
                     server to stop; without it ssh ends on its own a moment after this process
                     (the sync is complete: only the remote clean-up is left).
        """
        if self.base is not None and not is_loopback(self.location.host):
            from pdiffcopy.transport.compressionpolicy import note_tunnel

            note_tunnel(self.base, open=False)
        process, self.process = self.process, None
        if process is not None:
            try:
                if process.stdin is not None:
                    process.stdin.close()
            except OSError:
                pass
            if wait:
                try:
                    process.wait(CLOSE_TIMEOUT)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if wait and self.control:  # (ssh removes it as it exits; not when it was killed)
            try:
                os.unlink(self.control)
            except OSError:
                pass

    def __enter__(self) -> "SshSession":
        return self.start()

    def __exit__(self, kind, *_) -> None:
        # After a sync, nothing is left to wait for; after a failure, ssh's last words are.
        self.close(wait=kind is not None)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


__all__ = ["DEFAULT_RSH", "SSH_DATA_CONNECTIONS", "SshSession", "install_advice", "looks_like_regex",
           "remote_command",
           "rsh_command"]

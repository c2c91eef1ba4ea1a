"""The HTTP client of a pdiffcopy server: keep-alive connections, retries, one-line errors.

HTTP/1.1 on the standard library's :mod:`http.client` rather than requests:
importing requests costs about 100 ms here, a third of the time a whole 1 GiB
no-change sync may take, and the sync needs none of its extras. Every call has
a timeout; every failure becomes a one-line :class:`~pdiffcopy.errors.PdiffcopyError`.
``--bwlimit`` is applied here, to every request and answer body, so that it
meters all a sync moves (hashes and listings too, not only the data).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import re
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Type
from urllib.parse import urlsplit

from pdiffcopy.core.addresses import is_loopback
from pdiffcopy.core.compression import FRAMES_TYPE
from pdiffcopy.core.protocol import RULES_HEADER, SYNC_HEADER
from pdiffcopy.engine.forkshared import Throttle
from pdiffcopy.core.sshform import PINNED_CERTIFICATE_PREFIX
from pdiffcopy.errors import (
    AccessDenied,
    AuthenticationFailed,
    Conflict,
    FileMissing,
    Locked,
    NotAFile,
    PdiffcopyError,
    RemoteDataError,
    RemoteError,
    RemoteProtocolError,
    RemoteTimeout,
    ServerBusy,
    ServerFailed,
    StorageError,
    UsageError,
)
from pdiffcopy.transport import counters
from pdiffcopy.transport.syncs import current_sync

logger = logging.getLogger(__name__)

#: Seconds to wait for the server to answer or to send more data. Hashing a
#: 64 MiB segment takes well under a second even with slow hashes on slow
#: disks; a minute of silence means the server is gone.
DEFAULT_TIMEOUT = 60.0

#: Seconds to wait for a connection to open.
CONNECT_TIMEOUT = 10.0

#: Times a request refused with 503 (a busy server) is sent again before the
#: sync gives up. Each wait is the server's Retry-After stretched by
#: :data:`BUSY_BACKOFF` per retry (up to :data:`MAX_RETRY_AFTER_SECONDS`):
#: with the server's Retry-After of a second, the first retries come within
#: a second or two, and all of them span about three minutes. A burst of
#: another client's hash requests (which once failed a sync after 55 s of
#: 503s) slows a sync down; a server that stays overloaded still ends it
#: with a clear error.
MAX_BUSY_RETRIES = 25

#: How much longer each wait for a busy server is than the one before.
BUSY_BACKOFF = 1.25

#: Longest Retry-After honoured, in seconds, so a bogus header cannot stall
#: a sync for hours.
MAX_RETRY_AFTER_SECONDS = 10.0

#: A connection idle for longer is replaced before a request with a body is
#: sent on it: the server closes idle connections after 30 s, and a streamed
#: body cannot be sent a second time.
MAX_IDLE_SECONDS = 20.0

#: The request that tells a pdiffcopy 1.0.1 server from anything else. 1.0.1
#: has no ``/.pdiffcopy/`` API (it answers every request of ours with Flask's
#: HTML 404 page, also ``GET /``, so a file that exists looked missing), but it
#: answers ``GET /info?filename=PATH`` with ``{"size": N}`` for any existing
#: absolute path, and ``/`` always exists. Sent only after an error answer
#: that is not our JSON, so syncs with a current server never pay for it.
LEGACY_PROBE = "/info?filename=%2F"

#: Where a client says its sync is over, for the server's transfer log.
DONE_PATH = "/.pdiffcopy/done"

#: Seconds the client waits for the server to take note that a sync is over: the sync's
#: outcome is known already, so a server that stopped answering costs little.
DONE_TIMEOUT = 5.0

#: What a user told of a 1.0.1 server can do (docs/migration.rst says more).
LEGACY_ADVICE = ("it speaks an older API, with which only single files sync (without a token); "
                 "upgrade pdiffcopy on that host, see docs/migration.rst")

_STATUS_ERRORS: Dict[int, Type[PdiffcopyError]] = {
    400: RemoteProtocolError, 401: AuthenticationFailed, 403: AccessDenied, 404: FileMissing,
    409: NotAFile, 412: Conflict, 416: RemoteProtocolError, 423: Locked, 503: ServerBusy, 507: StorageError,
}


class Response:
    """An answer: status, headers, and the body as a stream or as bytes."""

    def __init__(self, raw: http.client.HTTPResponse, connection: "Connection",
                 rate_limit: Optional[Throttle] = None) -> None:
        #: The body, read through the bandwidth limit when there is one: every reader of an
        #: answer (ranges, multipart parts, tree batches, listings) reads it here.
        self.raw: Any = raw if rate_limit is None else _LimitedStream(raw, rate_limit)
        self.status = raw.status
        self.reason = raw.reason
        self.headers = raw.headers
        self._connection = connection

    def read(self) -> bytes:
        """The whole body."""
        try:
            return self.raw.read()
        finally:
            self.close()

    def json(self):
        """The body parsed as JSON."""
        return json.loads(self.read().decode("utf-8"))

    def close(self) -> None:
        """Finish with the body; a connection with unread data cannot be reused."""
        if not self.raw.isclosed():
            self._connection.close()


class Connection:
    """One keep-alive HTTP connection, used by one thread at a time."""

    def __init__(self, base: str, timeout: float, ca_file: Optional[str]) -> None:
        parts = urlsplit(base)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.timeout = timeout
        self.ca_file = ca_file
        self.http: Optional[http.client.HTTPConnection] = None
        self.last_used = 0.0

    def open(self) -> http.client.HTTPConnection:
        if self.http is None:
            if self.tls:
                import ssl  # only for https: it takes a while to import

                if self.ca_file and self.ca_file.startswith(PINNED_CERTIFICATE_PREFIX):
                    return self._open_pinned(ssl)
                try:
                    context = ssl.create_default_context(cafile=self.ca_file)
                except (ssl.SSLError, OSError) as error:
                    reason = _tls_reason(error) if isinstance(error, ssl.SSLError) else \
                        (error.strerror or _reason(error))
                    raise UsageError(f"Cannot use the CA file {self.ca_file}: {reason}") from None
                if _client_certificate is not None:
                    context.load_cert_chain(*_client_certificate)
                connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                    self.host, self.port, timeout=CONNECT_TIMEOUT, context=context)
            else:
                connection = http.client.HTTPConnection(self.host, self.port, timeout=CONNECT_TIMEOUT)
            self._connected(connection)
        assert self.http is not None
        return self.http

    def _connected(self, connection: http.client.HTTPConnection) -> None:
        connection.connect()
        connection.sock.settimeout(self.timeout)
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        counters.track(connection.sock)
        self.http = connection

    def _open_pinned(self, ssl) -> http.client.HTTPConnection:
        """TLS to a server whose one certificate is known by its SHA-256 (``--direct``'s hand-over).

        The certificate is self-signed and made for this one session, so no CA vouches
        for it: its fingerprint, which came over ssh, is the check.
        """
        import hashlib
        import hmac

        assert self.ca_file is not None
        expected = self.ca_file[len(PINNED_CERTIFICATE_PREFIX):].lower()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # (the fingerprint below is the verification)
        connection = http.client.HTTPSConnection(self.host, self.port, timeout=CONNECT_TIMEOUT, context=context)
        self._connected(connection)
        certificate = connection.sock.getpeercert(binary_form=True) or b""
        if not hmac.compare_digest(hashlib.sha256(certificate).hexdigest(), expected):
            self.close()
            raise RemoteError(f"{self.host}:{self.port}: the server's TLS certificate is not the one its "
                              f"ssh hand-over named: refused (someone else answers on that address?)")
        assert self.http is not None
        return self.http

    def __del__(self) -> None:  # never closed: its bytes on the wire still count
        http_connection = getattr(self, "http", None)
        if http_connection is not None and http_connection.sock is not None:
            counters.untrack(http_connection.sock)

    def close(self) -> None:
        if self.http is not None:
            if self.http.sock is not None:
                counters.untrack(self.http.sock)  # its figures, before the kernel forgets them
            self.http.close()
            self.http = None


class _LimitedStream:
    """An answer's body whose reads take their bytes from a :class:`Throttle` (``--bwlimit``).

    Taken after each read, so a read that overdraws the bucket waits before the next one: the
    kernel's receive buffer then fills and TCP slows the sender down to the limit.
    """

    def __init__(self, raw: http.client.HTTPResponse, bucket: Throttle) -> None:
        self._raw = raw
        self._bucket = bucket

    def _took(self, data):
        if data:
            self._bucket.take(len(data))
        return data

    def read(self, *args) -> bytes:
        return self._took(self._raw.read(*args))

    def read1(self, *args) -> bytes:
        return self._took(self._raw.read1(*args))

    def readline(self, *args) -> bytes:
        return self._took(self._raw.readline(*args))

    def readinto(self, buffer) -> int:
        count = self._raw.readinto(buffer)
        if count:
            self._bucket.take(count)
        return count

    def __getattr__(self, name: str):  # isclosed, close, fileno...: the answer's own
        return getattr(self._raw, name)


def _limited_body(body, bucket: Throttle):
    """A request body whose chunks take their bytes from ``bucket`` before they are sent."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        bucket.take(len(body))
        return body
    if isinstance(body, str) or hasattr(body, "read"):
        return body  # not sent by pdiffcopy itself
    return _limited_chunks(body, bucket)


def _limited_chunks(chunks, bucket: Throttle):
    for chunk in chunks:
        bucket.take(len(chunk))
        yield chunk


class _Warned:
    """Whether this process has warned about a token sent in the clear (once per run is enough)."""

    plain_token = False


def warn_about_plain_token(base: str) -> None:
    """Warn, once per process, when the token is about to cross a network unencrypted.

    Plain ``http://`` to a loopback address never leaves the host; to any
    other host, anyone on the path can read the token and then read and
    write the whole server root with it.
    """
    parts = urlsplit(base)
    if _Warned.plain_token or parts.scheme != "http" or is_loopback(parts.hostname or ""):
        return
    _Warned.plain_token = True
    logger.warning("Sending the token to %s over plain http: anyone on the network can read it "
                   "(use https://, or a tunnel)", base)




class HttpClient:
    """The connections to one server and the requests sent on them, with every failure one line.

    Each thread gets its own keep-alive connection, and so does each process:
    a connection opened before a fork stays the parent's, never shared with
    a child (whose first request opens its own). :meth:`dedicated` lends a
    connection that belongs to no thread, for an answer streamed at the
    caller's pace.
    """

    def __init__(self, base: str, token: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT,
                 ca_file: Optional[str] = None, rate_limit: Optional[Throttle] = None) -> None:
        self.base = base
        self.token = token
        self.timeout = timeout
        self.ca_file = ca_file
        #: The bandwidth limit (``--bwlimit``) every request and answer body of this client takes
        #: its bytes from: one bucket for the whole sync, shared with its other clients.
        self.rate_limit = rate_limit
        if token:
            warn_about_plain_token(base)
        #: Whether the server takes compressed PATCH bodies (its ``Accept-Patch`` says so).
        self.patch_frames = False
        #: The rules this client's sync started under (the server's first ``RULES_HEADER``),
        #: sent with every later request: a reload of the server does not change them midway.
        self.rules_ticket: Optional[str] = None
        self._local = threading.local()
        self._forget_connections()

    def _forget_connections(self) -> None:
        """Start a fresh set of connections (in a new process: the parent's are not ours)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()  # one held at the fork would stay held in the child
        self._connections: List[Connection] = []
        self._idle: List[Connection] = []  # dedicated connections free for reuse

    def _register(self, connection: Connection) -> Connection:
        if self._pid != os.getpid():
            self._forget_connections()
        with self._lock:
            self._connections.append(connection)
        return connection

    def connection(self) -> Connection:
        """This thread's connection, in this process."""
        pid = os.getpid()
        connection = getattr(self._local, "connection", None)
        if connection is None or getattr(self._local, "pid", None) != pid:
            connection = self._register(Connection(self.base, self.timeout, self.ca_file))
            self._local.connection = connection
            self._local.pid = pid
        return connection

    def dedicated(self) -> Connection:
        """A connection for one streamed answer; give it back with :meth:`release`."""
        if self._pid == os.getpid():
            with self._lock:
                if self._idle:
                    return self._idle.pop()
        return self._register(Connection(self.base, self.timeout, self.ca_file))

    def release(self, connection: Connection) -> None:
        """Take back a :meth:`dedicated` connection (closed ones are dropped: their answer was cut)."""
        if connection.http is not None and self._pid == os.getpid():
            with self._lock:
                self._idle.append(connection)

    def request(self, method: str, target: str, expected=(200,), headers=None, body=None,
                replayable: bool = True, connection: Optional[Connection] = None) -> Response:
        """Send one request and return the answer; every failure becomes a one-line error.

        A request that fails because the server closed an idle keep-alive
        connection is sent once more on a new connection, unless its body is a
        stream (``replayable=False``). A request the server refuses as too busy
        (503 with ``Retry-After``) is sent again after that many seconds, up to
        :data:`MAX_BUSY_RETRIES` times, unless its body is a stream.

        :param connection: The connection to use (from :meth:`dedicated`);
                           this thread's by default.
        """
        all_headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if self.rules_ticket:
            all_headers[RULES_HEADER] = self.rules_ticket
        all_headers[SYNC_HEADER] = current_sync.id
        all_headers.update(headers or {})
        for retry in range(MAX_BUSY_RETRIES + 1):
            response = self._send(method, target, all_headers, body, replayable,
                                  connection or self.connection())
            delay = _retry_after(response.headers.get("Retry-After"))
            if response.status != 503 or delay is None or 503 in expected or not replayable:
                break  # a 503 without Retry-After (maintenance, a proxy) fails at once
            if retry == MAX_BUSY_RETRIES:
                error = self.error(response, target)
                raise ServerBusy(f"{error} (still busy after {MAX_BUSY_RETRIES} retries)") from None
            try:
                response.read()  # the small JSON body: the connection stays usable
            except (OSError, http.client.HTTPException):
                pass
            # Longer each time, up to the cap, and up to half again as long:
            # clients refused together do not all come back together.
            delay = min(delay * BUSY_BACKOFF ** retry, MAX_RETRY_AFTER_SECONDS) * random.uniform(1.0, 1.5)
            logger.debug("Server %s is busy; retrying %s %s in %.1f s", self.base, method,
                         target, delay)
            time.sleep(delay)
        if response.status not in expected:
            raise self.error(response, target)
        return response

    def _send(self, method: str, target: str, all_headers: Dict[str, str], body,
              replayable: bool, connection: Connection) -> Response:
        """Send one request on ``connection`` and return the answer, whatever it is."""
        if not replayable and time.monotonic() - connection.last_used > MAX_IDLE_SECONDS:
            connection.close()
        if self.rate_limit is not None and body is not None:
            body = _limited_body(body, self.rate_limit)
        for attempt in (1, 2):
            reused = connection.http is not None
            connected = False
            try:
                http_connection = connection.open()
                connected = True
                http_connection.request(method, target, body=body, headers=all_headers)
                raw = http_connection.getresponse()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as error:
                connection.close()
                if attempt == 2 or not reused or not replayable:
                    raise self.lost(error) from None
            except BaseException as error:
                connection.close()
                if isinstance(error, (OSError, http.client.HTTPException)):
                    # Connected: the timeout was the server's silence, not the connect.
                    raise self._transport_error(error, connected) from None
                raise
        connection.last_used = time.monotonic()
        accepted = raw.headers.get("Accept-Patch")
        if accepted is not None:
            self.patch_frames = FRAMES_TYPE in accepted
        if self.rules_ticket is None:
            self.rules_ticket = raw.headers.get(RULES_HEADER)
        if raw.headers.get(SYNC_HEADER) == current_sync.id:
            current_sync.logged_by(self.base, self._say_sync_is_over)
        return Response(raw, connection, self.rate_limit)

    def _transport_error(self, error: BaseException, connected: bool) -> PdiffcopyError:
        if isinstance(error, socket.timeout) or isinstance(error, TimeoutError):
            if not connected:
                return RemoteTimeout(f"Cannot connect to {self.base}: timed out")
            return RemoteTimeout(f"The server at {self.base} did not answer within {self.timeout:g} seconds")
        if isinstance(error, socket.gaierror):
            return RemoteError(f"Cannot find the server {self.base}: {error.strerror}")
        if type(error).__name__.startswith("SSL") or "CERTIFICATE" in str(error).upper():
            return RemoteError(f"TLS error talking to {self.base}: {_reason(error)}")
        if isinstance(error, ConnectionRefusedError):
            return RemoteError(f"Cannot connect to the server at {self.base}: connection refused")
        if not isinstance(error, OSError):  # an answer that is not HTTP
            return RemoteDataError(f"Cannot talk to the server at {self.base}: {_reason(error)}")
        return RemoteError(f"Cannot talk to the server at {self.base}: {_reason(error)}")

    def lost(self, error: BaseException) -> RemoteError:
        """The one-line error for a connection that failed while an answer was being read."""
        return RemoteError(f"Lost the connection to {self.base}: {_reason(error)}")

    def malformed(self, detail: str = "is it pdiffcopy?") -> RemoteDataError:
        """The one-line error for an answer that is not what the protocol says."""
        separator = "; " if detail == "is it pdiffcopy?" else ": "
        return RemoteDataError(f"Server {self.base} sent a malformed answer{separator}{detail}")

    def body(self, response: Response) -> bytes:
        """The whole body of an answer; a connection lost meanwhile is a one-line error."""
        try:
            return response.read()
        except (OSError, http.client.HTTPException) as error:
            raise self.lost(error) from None

    def json(self, response: Response) -> Any:
        """The body of an answer parsed as JSON; anything else is a one-line error."""
        data = self.body(response)
        try:
            return json.loads(data.decode("utf-8"))
        except ValueError:
            raise self.malformed() from None

    def legacy_server(self) -> Optional[RemoteError]:
        """The error naming a pdiffcopy 1.0.1 server when the server is one (see :data:`LEGACY_PROBE`).

        Called after an error answer that is not ours; returns ``None`` when
        the probe shows anything else (a proxy's page, another web server).
        """
        try:
            response = self._send("GET", LEGACY_PROBE, {}, None, True, self.connection())
            data = response.json() if response.status == 200 else None
        except (PdiffcopyError, ValueError, OSError, http.client.HTTPException):
            return None
        if isinstance(data, dict) and set(data) == {"size"} and isinstance(data["size"], int):
            return RemoteProtocolError(f"{self.base}: this is a pdiffcopy 1.0.1 server; {LEGACY_ADVICE}")
        return None

    def error(self, response: Response, target: Optional[str] = None) -> PdiffcopyError:
        """The exception for an error answer: its class from the status, the server's message.

        :param target: The request's target: where the server's message names the file by its
                       path below the server's root, the file is named by its URL instead (the
                       name the user gave, not one relative to a root they may never have seen).
        """
        try:
            message = response.json()["error"]
        except (ValueError, KeyError, TypeError, OSError, http.client.HTTPException):
            message = f"HTTP {response.status} {response.reason}"
            # Not our JSON: 1.0.1 knows none of our requests (404) or methods (405).
            legacy = self.legacy_server() if response.status in (404, 405) else None
            if legacy is not None:
                return legacy
        finally:
            response.close()
        kind = _STATUS_ERRORS.get(response.status, ServerFailed)
        # The server's words, on one line and bounded: a hostile server must
        # not be able to forge further log lines.
        message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))[:500]
        path = _request_path(target)
        if path:
            from pdiffcopy.core.locations import quote_path

            # The path as a word of the message: after a space, before a space or punctuation.
            pattern = r"(?:(?<=\s)|^)" + re.escape(path) + r"(?=[\s:;,)]|$)"
            named = re.sub(pattern, lambda _: f"{self.base}/{quote_path(path)}", message)
            if named != message:
                return kind(named)  # the URL says whose file it is
        return kind(f"Server {self.base}: {message}")

    def _say_sync_is_over(self, failed: bool) -> None:
        """Tell the server's transfer log that this process's sync is over (best effort)."""
        connection = Connection(self.base, DONE_TIMEOUT, self.ca_file)
        try:
            self.request("POST", f"{DONE_PATH}?result={'failed' if failed else 'ok'}", expected=(200, 404),
                         connection=connection)
        except PdiffcopyError as error:  # (the sync's outcome is known already: this is the server's log)
            logger.debug("Could not tell %s the sync is over: %s", self.base, error)
        finally:
            connection.close()

    def close(self) -> None:
        """Close every connection of this process (other threads' too)."""
        if self._pid != os.getpid():
            self._forget_connections()
            return
        with self._lock:
            for connection in self._connections:
                connection.close()
            self._connections.clear()
            self._idle.clear()


#: The certificate (and key) every TLS connection presents (``--client-cert``), if any.
_client_certificate: Optional[tuple] = None


def use_client_certificate(certificate: str, key: Optional[str] = None) -> None:
    """Present ``certificate`` (PEM; its key in it, or in ``key``) on every TLS connection from
    now on, to servers that verify clients: one identity per process, as an ssh key is.

    :raises UsageError: When the files cannot be read or the key is not the certificate's.
    """
    global _client_certificate
    import ssl

    try:
        ssl.create_default_context().load_cert_chain(certificate, key)
    except ssl.SSLError as error:
        raise UsageError(f"--client-cert {certificate}: cannot use it ({_tls_reason(error)}); is the key "
                         f"in it, or given with --client-key?") from None
    except OSError as error:
        raise UsageError(f"Cannot read --client-cert {certificate}"
                         f"{f' or --client-key {key}' if key else ''}: {error.strerror or error}") from None
    _client_certificate = (certificate, key)


def _request_path(target: Optional[str]) -> Optional[str]:
    """The file path (below the server's root) a request's target names, or None.

    ``/.pdiffcopy/ENDPOINT/PATH?QUERY`` (our API) and ``/PATH`` (a plain read) name ``PATH``.
    """
    if not target:
        return None
    from urllib.parse import unquote_to_bytes

    path = os.fsdecode(unquote_to_bytes(target.partition("?")[0])).lstrip("/")
    if path.startswith(".pdiffcopy/"):
        path = path.split("/", 2)[2] if path.count("/") >= 2 else ""
    return path.rstrip("/") or None


def media_type(response: Response) -> str:
    """An answer's Content-Type without its parameters, in lower case."""
    return (response.headers.get("Content-Type") or "").split(";")[0].strip().lower()


def is_json(response: Response) -> bool:
    """Whether an answer says its body is JSON (every answer of our server, errors included)."""
    return media_type(response) == "application/json"


def _retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds to wait from a ``Retry-After`` header, bounded; None without a usable one.

    Only the delay-seconds form is read: pdiffcopy sends it, and an HTTP date
    would depend on two clocks agreeing.
    """
    text = (value or "").strip()
    if not re.fullmatch(r"[0-9]{1,10}", text):
        return None
    return min(float(text), MAX_RETRY_AFTER_SECONDS)


#: What a user is told when the server went away inside an answer (killed,
#: restarted, a proxy's timeout): http.client says ``IncompleteRead(...)``.
SERVER_CLOSED = "the server closed the connection mid-transfer"


def _reason(error: BaseException) -> str:
    """A short, specific reason for a transport error."""
    if type(error).__name__.startswith("SSL"):
        return _tls_reason(error)
    if isinstance(error, http.client.IncompleteRead):
        return SERVER_CLOSED
    if isinstance(error, http.client.RemoteDisconnected):
        return "the server closed the connection without answering"
    text = str(error)
    for marker in ("Connection refused", "Name or service not known", "No route to host",
                   "Connection reset by peer", "Remote end closed connection", "timed out",
                   "certificate verify failed", "Temporary failure in name resolution"):
        if marker in text:
            return marker[0].lower() + marker[1:]
    return text.splitlines()[0][:200] if text else type(error).__name__


#: OpenSSL's decoration of its messages: "[SSL: CODE] " before, " (_ssl.c:1006)" after.
_TLS_DECORATION = re.compile(r"^\[[A-Z0-9_]+: [A-Z0-9_]+\] |\s*\(_ssl\.c:\d+\)$")


def _tls_reason(error: BaseException) -> str:
    """What a TLS error says, whole but undecorated: "certificate verify failed: self-signed certificate".

    The part after the colon is the reason an operator acts on (a self-signed
    or expired certificate, a host name it is not valid for, a plain-http
    server on the port); the generic start alone would hide it.
    """
    text = _TLS_DECORATION.sub("", str(error).splitlines()[0] if str(error) else "").strip()
    detail = getattr(error, "verify_message", None)
    if detail and detail not in text:
        text = f"{text}: {detail}"
    return text[:300] or type(error).__name__


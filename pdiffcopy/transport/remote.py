"""A file behind a pdiffcopy server, as a :class:`~pdiffcopy.engine.endpoints.FileEndpoint`.

The transport: HTTP/1.1 with keep-alive connections (one per thread, reused),
ranged GETs to read, ranged PATCHes to write, and the ``/.pdiffcopy/``
endpoints for hashes, resizing, flushing and atomic renames. Every call has a
timeout; every failure becomes a one-line :class:`~pdiffcopy.errors.PdiffcopyError`.

It is written on the standard library's :mod:`http.client` rather than
requests: importing requests costs about 100 ms here, a third of the time a
whole 1 GiB no-change sync may take, and the sync needs none of its extras.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import re
import socket
import struct
import threading
import time
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Type
from urllib.parse import quote, unquote_to_bytes, urlencode, urlsplit

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core import compression
from pdiffcopy.transport import counters
from pdiffcopy.core.addresses import is_loopback
from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.datamap import MAX_DATA_MAP_EXTENTS
from pdiffcopy.core.byteranges import (
    boundary_of,
    closing_delimiter,
    format_content_range,
    format_range_header,
    merge_ranges,
    multipart_content_type,
    multipart_length,
    new_boundary,
    overlapping,
    parse_content_range,
    part_header,
    read_parts,
)
from pdiffcopy.core.compression import FRAMES_TYPE, AdaptivePolicy, CompressionError
from pdiffcopy.engine.endpoints import Chunk, FileEndpoint, FileInfo
from pdiffcopy.errors import (
    AccessDenied,
    AuthenticationFailed,
    BadRequest,
    Conflict,
    FileMissing,
    Locked,
    NotAFile,
    PdiffcopyError,
    RemoteError,
    RemoteProtocolError,
    ServerBusy,
    StorageError,
    UsageError,
)
from pdiffcopy.core.hashing import digest_count, digest_size
from pdiffcopy.core.protocol import (
    LEASE_HEADER,
    NO_FOLLOW_HEADER,
    TRANSFER_CHUNK_SIZE,
    partial_name,
    temporary_name,
)
from pdiffcopy.core.ratelimit import TokenBucket

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

#: What a user told of a 1.0.1 server can do (docs/migration.rst says more).
LEGACY_ADVICE = ("it speaks an older API, with which only single files sync (without a token); "
                 "upgrade pdiffcopy on that host, see docs/migration.rst")

_STATUS_ERRORS: Dict[int, Type[PdiffcopyError]] = {
    400: RemoteProtocolError, 401: AuthenticationFailed, 403: AccessDenied, 404: FileMissing,
    409: NotAFile, 412: Conflict, 416: RemoteProtocolError, 423: Locked, 503: ServerBusy, 507: StorageError,
}

#: The binary entries of the shift-tolerant delta's requests (docs/protocol.rst): a range of
#: a chunk list request (offset, length) and a move of a copy request (from, to, length).
_CHUNK_RANGE = struct.Struct("<QQ")
_COPY_MOVE = struct.Struct("<QQQ")
#: Most ranges one chunk list request names: the server's bound (server.app.MAX_CHUNK_RANGES).
MAX_CHUNK_RANGES = 65536
#: Most ranges one punch request names: the server's bound (server.app.MAX_PUNCH_RANGES).
MAX_PUNCH_RANGES = 65536

logger = logging.getLogger(__name__)


def split_server_url(url: str) -> Tuple[str, str]:
    """Split a URL on a pdiffcopy server into (base URL, path relative to the server's root).

    The path is percent-decoded to bytes and then to ``str`` as file names
    are (:func:`os.fsdecode`), so a name that is not UTF-8 keeps its bytes;
    it has no leading slash and may be empty (the root) or end with one.

    :raises UsageError: For a URL that does not point at a server.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise UsageError(f"Invalid URL {url!r}: {error}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise UsageError(f"Unsupported URL {url!r}: expected http://HOST:PORT/path or https://...")
    if not parts.hostname:
        raise UsageError(f"Invalid URL {url!r}: expected http://HOST:PORT/path")
    if parts.query or parts.fragment:
        raise UsageError(f"Invalid URL {url!r}: a query or fragment is not a file name")
    path = os.fsdecode(unquote_to_bytes(parts.path)).lstrip("/")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    base = f"{parts.scheme.lower()}://{host}" + (f":{port}" if port else "")
    return base, path


def parse_url(url: str) -> Tuple[str, str]:
    """Split a file URL into (base URL, path relative to the server's root).

    :raises UsageError: For a URL that does not name a file on a server.
    """
    base, path = split_server_url(url)
    if not path or path.endswith("/"):
        raise UsageError(f"Invalid URL {url!r}: it names no file (expected http://HOST:PORT/path)")
    return base, path


def quote_path(path: str) -> str:
    """``path`` percent-encoded for a URL, byte for byte (the inverse of :func:`split_server_url`)."""
    return quote(os.fsencode(path), safe="/")


class _Response:
    """An answer: status, headers, and the body as a stream or as bytes."""

    def __init__(self, raw: http.client.HTTPResponse, connection: "_Connection",
                 rate_limit: Optional[TokenBucket] = None) -> None:
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


class _Connection:
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

                try:
                    context = ssl.create_default_context(cafile=self.ca_file)
                except (ssl.SSLError, OSError) as error:
                    reason = _tls_reason(error) if isinstance(error, ssl.SSLError) else \
                        (error.strerror or _reason(error))
                    raise UsageError(f"Cannot use the CA file {self.ca_file}: {reason}") from None
                connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                    self.host, self.port, timeout=CONNECT_TIMEOUT, context=context)
            else:
                connection = http.client.HTTPConnection(self.host, self.port, timeout=CONNECT_TIMEOUT)
            connection.connect()
            connection.sock.settimeout(self.timeout)
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            counters.track(connection.sock)
            self.http = connection
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


class _RangesBody:
    """A PATCH body streaming ranges of a source: raw for one range, multipart for several.

    Its length is known, so it travels with a Content-Length, not chunked.
    """

    def __init__(self, ranges: List[ByteRange], chunks: Iterator[Chunk]) -> None:
        self.ranges = ranges
        self.chunks = chunks
        self.multipart = len(ranges) > 1
        #: Fresh per request, so that no data can contain it (see new_boundary).
        self.boundary = new_boundary()
        self.length = multipart_length(ranges, None, self.boundary) if self.multipart else ranges[0][1]

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for offset, length in self.ranges:
            if self.multipart:
                yield part_header(offset, length, None, self.boundary)
            remaining = length
            while remaining > 0:
                try:
                    _, data = next(self.chunks)
                except StopIteration:
                    raise StorageError("The source ended before the data to send did") from None
                remaining -= len(data)
                yield data
        if self.multipart:
            yield closing_delimiter(self.boundary)


class _LimitedStream:
    """An answer's body whose reads take their bytes from a :class:`TokenBucket` (``--bwlimit``).

    Taken after each read, so a read that overdraws the bucket waits before the next one: the
    kernel's receive buffer then fills and TCP slows the sender down to the limit.
    """

    def __init__(self, raw: http.client.HTTPResponse, bucket: TokenBucket) -> None:
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


def _limited_body(body, bucket: TokenBucket):
    """A request body whose chunks take their bytes from ``bucket`` before they are sent."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        bucket.take(len(body))
        return body
    if isinstance(body, str) or hasattr(body, "read"):
        return body  # not sent by pdiffcopy itself
    return _limited_chunks(body, bucket)


def _limited_chunks(chunks, bucket: TokenBucket):
    for chunk in chunks:
        bucket.take(len(chunk))
        yield chunk


#: While the adaptive policy cannot decide yet, a transfer sends only this much plain first, as a
#: probe of the link and a sample of the data, and the rest as the policy then says: one frame's
#: worth. Whole 16 MiB requests as probes sent the first 28 MiB of a 256 MiB text file plain on a
#: 200 Mbit link (87 MiB on the wire where rsync -z sent 60).
PROBE_BYTES = compression.FRAME_BYTES


#: The least a compressed request carries for its times to judge the level (:meth:`Compression.compressed`):
#: a 1 MiB tail took 18 ms to compress at level 6 and 8 ms to send, which is no sign of a starved link.
JUDGED_BYTES = 4 * compression.FRAME_BYTES


class Compression:
    """Whether a stream's ranges cross the wire compressed, and at which level: the mode asked
    for, and for ``auto`` the :class:`~pdiffcopy.core.compression.AdaptivePolicy` fed with what
    the stream's plain transfers showed.

    Shared by a file, its temporary, and the files of one tree, so what one measured serves all.
    ``cores``: how many compress at once, the sending side's cores or the transfers in flight,
    whichever is fewer (each transfer compresses its own frames, in its own thread on the
    client or its own request's thread on the server).

    :param measure_loopback: Let the policy decide on a loopback address too. By default a
                             loopback server stays plain (no link to spare: compressing only
                             costs CPU); the near end of a tunnel (``ssh -L``) is loopback with
                             a real link behind it, which a library caller can say here.
    :param policy: Another :class:`~pdiffcopy.core.compression.AdaptivePolicy` (one with a
                   clock of its own, say).
    """

    def __init__(self, mode: "str | int" = "auto", base: str = "", measure_loopback: bool = False,
                 cores: Optional[int] = None, policy: Optional[AdaptivePolicy] = None) -> None:
        self.mode = compression.check_mode(mode)
        self.base = base
        self.policy = policy or AdaptivePolicy(cores or os.cpu_count() or 1)
        self.measure_loopback = measure_loopback
        self._loopback = is_loopback(urlsplit(base).hostname or "") and not measure_loopback
        #: Held by the one transfer probing the link, so that it has the link to itself (two at
        #: once would each see half the rate) and the others wait for its verdict.
        self.probe_lock = threading.Lock()
        # The compressed bytes all transfers moved, since the first began: what the link carried.
        self._moved_lock = threading.Lock()
        self._moved_since: Optional[float] = None
        self._moved = 0

    def with_mode(self, mode: "str | int", concurrency: int) -> "Compression":
        """This one for the same mode (it keeps what it measured, or the policy given), else a new one."""
        if mode == self.mode:
            return self
        return Compression(mode, self.base, self.measure_loopback, cores=compressing_cores(concurrency))

    def now(self) -> bool:
        """Whether the next request should compress."""
        return self.level() is not None

    def level(self) -> Optional[int]:
        """The level the next request should compress at; None: send it plain."""
        if type(self.mode) is int:  # --compress-level
            return self.mode
        if self.mode != "auto":
            return compression.LEVEL if self.mode == "always" else None
        return None if self._loopback else self.policy.level()

    def learning(self) -> bool:
        """Whether plain transfers should still be measured and sampled."""
        return self.mode == "auto" and not self._loopback and not self.policy.compress()

    def probing(self) -> bool:
        """Whether the policy still lacks the link's rate or a sample: a transfer then probes first."""
        return self.learning() and (self.policy.link_rate is None or self.policy.ratio is None)

    def compressed(self, level: int, count: int, compress_seconds: float, send_seconds: float) -> None:
        """A request of ``count`` bytes compressed at ``level`` here took these times to compress
        and to send. A small one is not judged: its sending is mostly the request's round trip."""
        if self.mode == "auto" and count >= JUDGED_BYTES:  # -z keeps its level
            self.policy.compressed(level, compress_seconds, send_seconds)
            logger.debug("Compression: level %d took %.3f s to compress and %.3f s to send: level %s next",
                         level, compress_seconds, send_seconds, self.policy.level())

    def compressed_started(self, started: float) -> None:
        """A compressed transfer began (``time.perf_counter()``)."""
        with self._moved_lock:
            if self._moved_since is None:
                self._moved_since = started

    def compressed_moved(self, count: int) -> None:
        """A compressed transfer put ``count`` bytes on the wire: all of them together, over the
        time since the first began, are a rate the link reached."""
        if self.mode != "auto":
            return
        with self._moved_lock:
            self._moved += count
            if self._moved_since is None:
                return
            seconds = time.perf_counter() - self._moved_since
            moved = self._moved
        if seconds > 0:
            self.policy.link_at_least(moved / seconds)

    def observed(self, count: int, seconds: float, sample: Optional[bytes]) -> None:
        if sample:
            self.policy.sample(sample)
        self.policy.link_observed(count, seconds)
        logger.debug("Compression: ratio %s, one core %s B/s, link %s B/s: level %s", self.policy.ratio,
                     self.policy.compress_rate, self.policy.link_rate, self.policy.level())


def compressing_cores(concurrency: int) -> int:
    """How many compress at once: one per transfer in flight (each in its own thread), at
    most one per core."""
    return max(1, min(os.cpu_count() or 1, concurrency))


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
                 ca_file: Optional[str] = None, rate_limit: Optional[TokenBucket] = None) -> None:
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
        self._local = threading.local()
        self._forget_connections()

    def _forget_connections(self) -> None:
        """Start a fresh set of connections (in a new process: the parent's are not ours)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()  # one held at the fork would stay held in the child
        self._connections: List[_Connection] = []
        self._idle: List[_Connection] = []  # dedicated connections free for reuse

    def _register(self, connection: _Connection) -> _Connection:
        if self._pid != os.getpid():
            self._forget_connections()
        with self._lock:
            self._connections.append(connection)
        return connection

    def connection(self) -> _Connection:
        """This thread's connection, in this process."""
        pid = os.getpid()
        connection = getattr(self._local, "connection", None)
        if connection is None or getattr(self._local, "pid", None) != pid:
            connection = self._register(_Connection(self.base, self.timeout, self.ca_file))
            self._local.connection = connection
            self._local.pid = pid
        return connection

    def dedicated(self) -> _Connection:
        """A connection for one streamed answer; give it back with :meth:`release`."""
        if self._pid == os.getpid():
            with self._lock:
                if self._idle:
                    return self._idle.pop()
        return self._register(_Connection(self.base, self.timeout, self.ca_file))

    def release(self, connection: _Connection) -> None:
        """Take back a :meth:`dedicated` connection (closed ones are dropped: their answer was cut)."""
        if connection.http is not None and self._pid == os.getpid():
            with self._lock:
                self._idle.append(connection)

    def request(self, method: str, target: str, expected=(200,), headers=None, body=None,
                replayable: bool = True, connection: Optional[_Connection] = None) -> _Response:
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
        all_headers.update(headers or {})
        for retry in range(MAX_BUSY_RETRIES + 1):
            response = self._send(method, target, all_headers, body, replayable,
                                  connection or self.connection())
            delay = _retry_after(response.headers.get("Retry-After"))
            if response.status != 503 or delay is None or 503 in expected or not replayable:
                break  # a 503 without Retry-After (maintenance, a proxy) fails at once
            if retry == MAX_BUSY_RETRIES:
                error = self.error(response)
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
            raise self.error(response)
        return response

    def _send(self, method: str, target: str, all_headers: Dict[str, str], body,
              replayable: bool, connection: _Connection) -> _Response:
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
        return _Response(raw, connection, self.rate_limit)

    def _transport_error(self, error: BaseException, connected: bool) -> PdiffcopyError:
        if isinstance(error, socket.timeout) or isinstance(error, TimeoutError):
            if not connected:
                return RemoteError(f"Cannot connect to {self.base}: timed out")
            return RemoteError(f"The server at {self.base} did not answer within {self.timeout:g} seconds")
        if isinstance(error, socket.gaierror):
            return RemoteError(f"Cannot find the server {self.base}: {error.strerror}")
        if type(error).__name__.startswith("SSL") or "CERTIFICATE" in str(error).upper():
            return RemoteError(f"TLS error talking to {self.base}: {_reason(error)}")
        if isinstance(error, ConnectionRefusedError):
            return RemoteError(f"Cannot connect to the server at {self.base}: connection refused")
        return RemoteError(f"Cannot talk to the server at {self.base}: {_reason(error)}")

    def lost(self, error: BaseException) -> RemoteError:
        """The one-line error for a connection that failed while an answer was being read."""
        return RemoteError(f"Lost the connection to {self.base}: {_reason(error)}")

    def malformed(self, detail: str = "is it pdiffcopy?") -> RemoteError:
        """The one-line error for an answer that is not what the protocol says."""
        separator = "; " if detail == "is it pdiffcopy?" else ": "
        return RemoteError(f"Server {self.base} sent a malformed answer{separator}{detail}")

    def body(self, response: _Response) -> bytes:
        """The whole body of an answer; a connection lost meanwhile is a one-line error."""
        try:
            return response.read()
        except (OSError, http.client.HTTPException) as error:
            raise self.lost(error) from None

    def json(self, response: _Response) -> Any:
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
            return RemoteError(f"{self.base}: this is a pdiffcopy 1.0.1 server; {LEGACY_ADVICE}")
        return None

    def error(self, response: _Response) -> PdiffcopyError:
        """The exception for an error answer: its class from the status, the server's message."""
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
        kind = _STATUS_ERRORS.get(response.status, RemoteError)
        # The server's words, on one line and bounded: a hostile server must
        # not be able to forge further log lines.
        message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))[:500]
        return kind(f"Server {self.base}: {message}")

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


class RemoteFile(FileEndpoint):
    """A file on a pdiffcopy server, named by its URL.

    With ``follow=False`` (a tree's member) every request asks the server not
    to follow a symlink in the last name (:data:`~pdiffcopy.core.protocol.NO_FOLLOW_HEADER`):
    such a file is refused with :class:`~pdiffcopy.errors.NotAFile`, as a
    local tree's member is.
    """

    is_remote = True

    def __init__(self, url: str, token: Optional[str] = None, concurrency: int = 4,
                 timeout: float = DEFAULT_TIMEOUT, ca_file: Optional[str] = None,
                 _base_path: Optional[tuple] = None, rate_limit: Optional[TokenBucket] = None,
                 follow: bool = True, compress: "str | Compression" = "auto") -> None:
        self.location = url
        self.follow = follow
        self.base, self.path = _base_path or parse_url(url)
        self.token = token
        self.timeout = timeout
        self.ca_file = ca_file
        self.concurrency = concurrency
        self.client = HttpClient(self.base, token, timeout, ca_file, rate_limit)
        self._hash_pool: Optional[ThreadPoolExecutor] = None
        #: Threads of :meth:`submit_hashes_first`: a queue of their own.
        self._first_hash_pool: Optional[ThreadPoolExecutor] = None
        self._etag: Optional[str] = None
        #: The id of our write lease on the file, sent with every request while held.
        self._lease: Optional[str] = None
        self.compression = compress if isinstance(compress, Compression) else Compression(
            compress, self.base, cores=compressing_cores(concurrency))
        #: The answer of the stat :meth:`on_legacy_server` sent, for the next :meth:`stat` (at most one).
        self._first_stat: List["Optional[FileInfo] | PdiffcopyError"] = []
        #: Whether this file's server already said it wrote zeros for holes (warned once).
        self._warned_zeros = False
        #: ``--sparse``: the server punches the runs of zeros in what we write (a PATCH parameter).
        self._sparse_writes = False

    # -- transport -------------------------------------------------------

    def _target(self, endpoint: Optional[str] = None, path: Optional[str] = None,
                params: Optional[dict] = None) -> str:
        quoted = quote_path(path if path is not None else self.path)
        target = f"/.pdiffcopy/{endpoint}/{quoted}" if endpoint else f"/{quoted}"
        return f"{target}?{urlencode(params)}" if params else target

    def request(self, method: str, target: str, expected=(200,), headers=None, body=None,
                replayable: bool = True) -> _Response:
        """Send one request (see :meth:`HttpClient.request`)."""
        if self._lease:
            headers = {**(headers or {}), LEASE_HEADER: self._lease}
        if not self.follow:
            headers = {**(headers or {}), NO_FOLLOW_HEADER: "1"}
        return self.client.request(method, target, expected, headers, body, replayable)

    def _body(self, response: _Response) -> bytes:
        return self.client.body(response)

    def _conditions(self) -> Dict[str, str]:
        return {"If-Match": self._etag} if self._etag else {}

    # -- FileEndpoint ----------------------------------------------------

    def pin(self, info: FileInfo) -> None:
        self._etag = info.etag

    def limit_rate(self, bucket: Optional[TokenBucket]) -> None:
        self.client.rate_limit = bucket

    def compress_with(self, mode: "str | int") -> None:
        self.compression = self.compression.with_mode(mode, self.concurrency)

    def stat(self) -> Optional[FileInfo]:
        answer = self._first_stat.pop() if self._first_stat else self._ask_stat()
        if isinstance(answer, PdiffcopyError):
            raise answer  # a 1.0.1 server: a file of it is a LegacyRemoteFile (see on_legacy_server)
        return answer

    def exists(self) -> bool:
        return self.stat() is not None  # the server's answer: a dangling symlink there is missing

    def _ask_stat(self) -> "Optional[FileInfo] | RemoteError":
        """The file's stat (None: missing), or the error naming a pdiffcopy 1.0.1 server."""
        response = self.request("GET", self._target("stat"), expected=(200, 404))
        if response.status == 404:
            response.close()
            if not _is_json(response):  # our server's 404 is JSON; 1.0.1's is an HTML page
                legacy = self.client.legacy_server()
                if legacy is not None:
                    return legacy
            return None
        try:
            data = response.json()
            return FileInfo(str(data["type"]), int(data["size"]), int(data["mtime_ns"]),
                            str(data["etag"]))
        except (ValueError, KeyError, TypeError, OSError, http.client.HTTPException):
            raise self.client.malformed() from None

    def on_legacy_server(self) -> bool:
        """Whether the file's server is pdiffcopy 1.0.1 (see :data:`LEGACY_PROBE`), asked with the file's stat.

        The answer, or the error, of that stat is kept for the next :meth:`stat`: a sync with a
        current server sends no request more for this question, and fails where it always did.
        """
        try:
            answer = self._ask_stat()
        except PdiffcopyError as error:
            self._first_stat = [error]
            return False
        if isinstance(answer, RemoteError):
            return True
        self._first_stat = [answer]
        return False

    def submit_hashes(self, ranges: Sequence[ByteRange], block_size: int, method: str
                      ) -> "Future[bytes]":
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hash")
        return self._hash_pool.submit(self._hashes, list(ranges), block_size, method)

    def submit_hashes_first(self, ranges: Sequence[ByteRange], block_size: int, method: str
                            ) -> "Future[bytes]":
        if self._first_hash_pool is None:
            self._first_hash_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hash-first")
        return self._first_hash_pool.submit(self._hashes, list(ranges), block_size, method)

    def _hashes(self, ranges: List[ByteRange], block_size: int, method: str) -> bytes:
        """One hash request: one range in the query, several in a Range header."""
        params: dict = {"method": method, "block_size": block_size}
        headers = self._conditions()
        if len(ranges) == 1:
            params.update(offset=ranges[0][0], length=ranges[0][1])
        else:
            headers = {**headers, "Range": format_range_header(ranges)}
        response = self.request("GET", self._target("hashes", params=params), headers=headers)
        digests = self._body(response)
        expected = digest_count(ranges, block_size)
        if len(digests) != expected * digest_size(method):
            raise RemoteError(f"Server {self.base} sent {len(digests)} bytes of digests for "
                              f"{expected} blocks")
        return digests

    def _call(self, method: str, endpoint: str, path: Optional[str] = None,
              params: Optional[dict] = None, expected=(200,)) -> None:
        """A control request whose answer we only need to be a success."""
        response = self.request(method, self._target(endpoint, path, params), expected=expected)
        self._body(response)

    def prepare(self, size: int) -> None:
        self._call("POST", "resize", params={"size": size})

    def prepare_sparse(self, size: int, data_bytes: int) -> None:
        self._call("POST", "resize", params={"size": size, "data": data_bytes})

    def data_map(self, offset: int, length: int) -> List[ByteRange]:
        """One answer of the server's data map (at most MAX_DATA_MAP_EXTENTS extents)."""
        if length <= 0:
            return []
        response = self.request("GET", self._target("datamap", params={"offset": offset, "length": length}),
                                headers=self._conditions())
        body = self._body(response)
        if len(body) % _CHUNK_RANGE.size or len(body) // _CHUNK_RANGE.size > MAX_DATA_MAP_EXTENTS:
            raise self.client.malformed("its data map is not a list of extents")
        extents = list(_CHUNK_RANGE.iter_unpack(body))
        if any(start < offset or start + size > offset + length or size == 0 for start, size in extents) or \
                any(a[0] + a[1] > b[0] for a, b in zip(extents, extents[1:])):
            raise self.client.malformed("its data map has extents outside the range asked, or out of order")
        return extents

    def write_sparse(self, enabled: bool) -> None:
        self._sparse_writes = enabled

    def punch_ranges(self, ranges: Sequence[ByteRange]) -> int:
        """The server punches the holes (or writes zeros where its file system cannot), in pages."""
        ranges = list(ranges)
        for start in range(0, len(ranges), MAX_PUNCH_RANGES):
            asked = ranges[start:start + MAX_PUNCH_RANGES]
            body = b"".join(_CHUNK_RANGE.pack(offset, length) for offset, length in asked)
            response = self.request("POST", self._target("punch"), body=body, headers={
                "Content-Length": str(len(body)), "Content-Type": "application/octet-stream"})
            answer = self.client.json(response)
            if isinstance(answer, dict) and answer.get("holes") is False and not self._warned_zeros:
                self._warned_zeros = True
                logger.warning("The file system of %s cannot punch holes; the source's holes are written "
                               "there as zeros", self.location)
        return sum(length for _, length in ranges)

    def read_ranges(self, ranges: Iterable[ByteRange]) -> Iterator[Chunk]:
        ranges = list(ranges)
        if self.compression.probing():
            probe, ranges = compression.split_after(ranges, PROBE_BYTES)
            with self.compression.probe_lock:
                # Read whole before it is handed on: the lock is not held while the caller writes.
                chunks = [(offset, bytes(data)) for offset, data in self._read_ranges(probe)]
            for offset, data in chunks:
                yield offset, memoryview(data)
            if not ranges:
                return
        yield from self._read_ranges(ranges)

    def _read_ranges(self, ranges: List[ByteRange]) -> Iterator[Chunk]:
        headers = {"Range": format_range_header(ranges), **self._conditions()}
        level = self.compression.level()
        if level is not None:
            headers["Accept"] = compression.frames_accept(level)
        learning = self.compression.learning()
        started = time.perf_counter()
        response = self.request("GET", self._target(), expected=(206,), headers=headers)
        if _media_type(response) == FRAMES_TYPE:
            self.compression.compressed_started(started)
            yield from self._read_frames(response, ranges)
            return
        sample: Optional[bytes] = None
        with self._reading(response):
            stream = response.raw
            # The server merges ranges that touch (byteranges.parse_range_header);
            # an older one sends them as asked. Either is fine, as long as
            # every byte asked for comes once.
            merged = merge_ranges(ranges)
            allowed = set(ranges) | set(merged)
            boundary = boundary_of(response.headers.get("Content-Type", ""))
            if boundary is None:
                offset, length, _ = parse_content_range(response.headers.get("Content-Range", ""))
                if [(offset, length)] != merged:
                    raise RemoteError(f"Server {self.base} sent other ranges than asked")
                for chunk in _read_exactly(stream, offset, length, self.base):
                    if learning and sample is None:
                        sample = bytes(chunk[1][:compression.SAMPLE_BYTES])
                    yield chunk
                if learning:
                    self.compression.observed(length, time.perf_counter() - started, sample)
                return
            received: List[ByteRange] = []
            for offset, length, _ in read_parts(stream, boundary, max_parts=len(ranges)):
                if (offset, length) not in allowed:
                    raise RemoteError(f"Server {self.base} sent a range that was not asked for")
                received.append((offset, length))
                for chunk in _read_exactly(stream, offset, length, self.base):
                    if learning and sample is None:
                        sample = bytes(chunk[1][:compression.SAMPLE_BYTES])
                    yield chunk
            if merge_ranges(received) != merged or overlapping(received):
                raise RemoteError(f"Server {self.base} left out ranges that were asked for")
            stream.read()  # the closing delimiter, so the connection can be reused
            if learning:
                self.compression.observed(sum(length for _, length in received), time.perf_counter() - started,
                                          sample)

    def _read_frames(self, response: _Response, ranges: List[ByteRange]) -> Iterator[Chunk]:
        """The chunks of an answer of compressed pieces: exactly the pieces of the ranges asked for, in order."""
        with self._reading(response):
            expected = compression.pieces(merge_ranges(ranges))
            moved = 0
            for offset, data, wire_length in compression.read_frames(response.raw.read):
                if (offset, len(data)) != next(expected, None):
                    raise RemoteError(f"Server {self.base} sent a range that was not asked for")
                moved += wire_length
                yield offset, memoryview(data)
            self.compression.compressed_moved(moved)
            if next(expected, None) is not None:
                raise RemoteError(f"Server {self.base} left out ranges that were asked for")

    @contextmanager
    def _reading(self, response: _Response) -> Iterator[None]:
        """Read the body of ``response`` inside: a failure becomes one line, and the answer is closed after.

        One place for what can go wrong in a body of ranges, plain or compressed: a malformed
        answer, damaged frames, or the connection lost midway.
        """
        try:
            yield
        except BadRequest as error:
            raise self.client.malformed(str(error)) from None
        except CompressionError as error:  # (a ValueError: before the clause below)
            raise RemoteError(f"Server {self.base} sent damaged data: {error}") from None
        except (OSError, ValueError, http.client.HTTPException) as error:
            raise self.client.lost(error) from None
        finally:
            response.close()

    def write_ranges(self, ranges: Iterable[ByteRange], chunks: Iterator[Chunk]) -> int:
        ranges = list(ranges)
        written = 0
        if self.compression.probing() and self.client.patch_frames:
            probe, ranges = compression.split_after(ranges, PROBE_BYTES)
            chunks = _Cuttable(chunks)
            with self.compression.probe_lock:
                written += self._write_ranges(probe, chunks.take(sum(length for _, length in probe)))
            if not ranges:
                return written
        return written + self._write_ranges(ranges, chunks)

    def _write_ranges(self, ranges: List[ByteRange], chunks: Iterator[Chunk]) -> int:
        level = self.compression.level()
        if level is not None and self.client.patch_frames:
            started = time.perf_counter()
            body = _framed_body(ranges, chunks, level)
            compressed = time.perf_counter()
            self.compression.compressed_started(compressed)
            response = self.request("PATCH", self._patch_target(), headers={
                "Content-Length": str(len(body)), "Content-Type": FRAMES_TYPE}, body=body, replayable=False)
            self._body(response)
            self.compression.compressed_moved(len(body))
            # Built whole, then sent: the two times say whether the CPU or the link held it up.
            self.compression.compressed(level, sum(length for _, length in ranges), compressed - started,
                                        time.perf_counter() - compressed)
            return sum(length for _, length in ranges)
        learning = self.compression.learning()
        if learning:
            chunks = _sampled(chunks, self.compression)
        started = time.perf_counter()
        body = _RangesBody(ranges, chunks)
        headers = {"Content-Length": str(len(body))}
        if body.multipart:
            headers["Content-Type"] = multipart_content_type(body.boundary)
        else:
            headers["Content-Type"] = "application/octet-stream"
            headers["Content-Range"] = format_content_range(ranges[0][0], ranges[0][1], None)
        response = self.request("PATCH", self._patch_target(), headers=headers, body=body,
                                replayable=False)
        self._body(response)
        if learning:
            self.compression.observed(len(body), time.perf_counter() - started, None)
        return sum(length for _, length in ranges)

    def _patch_target(self) -> str:
        return self._target(params={"sparse": 1}) if self._sparse_writes else self._target()

    def cut_chunks(self, ranges: Sequence[ByteRange], average: int) -> "List[cdc.Chunk]":
        """The server cuts its file (on its cores) and sends the list: 12 bytes a chunk."""
        chunks: "List[cdc.Chunk]" = []
        ranges = list(ranges)
        for start in range(0, len(ranges), MAX_CHUNK_RANGES):
            asked = ranges[start:start + MAX_CHUNK_RANGES]
            body = b"".join(_CHUNK_RANGE.pack(offset, length) for offset, length in asked)
            response = self.request("POST", self._target("chunks", params={"average": average}),
                                    headers={**self._conditions(), "Content-Length": str(len(body)),
                                             "Content-Type": "application/octet-stream"}, body=body)
            try:
                chunks += cdc.decode_ranges(self._body(response), asked)
            except ValueError as error:
                raise self.client.malformed(f"its chunk list does not fit the ranges asked ({error})") from None
        return chunks

    def can_copy_within(self, origin: FileEndpoint) -> bool:
        return isinstance(origin, RemoteFile) and origin.base == self.base

    def copy_within(self, origin: FileEndpoint, moves: "Sequence[cdc.Copy]") -> int:
        """The server copies ranges of ``origin`` into this (temporary) file: nothing crosses but the list."""
        assert isinstance(origin, RemoteFile) and origin.base == self.base, "the engine asks can_copy_within"
        body = b"".join(_COPY_MOVE.pack(move.target_offset, move.source_offset, move.length) for move in moves)
        response = self.request("POST", self._target("copy-ranges", params={"from": os.fsencode(origin.path)}),
                                headers={"Content-Length": str(len(body)), "Content-Type": "application/octet-stream"},
                                body=body)
        self._body(response)
        return sum(move.length for move in moves)

    def flush(self) -> None:
        self._call("POST", "fsync")

    def take_lease(self) -> None:
        response = self.request("POST", self._target("lease"))
        try:
            lease = self.client.json(response)["lease"]
        except (KeyError, TypeError):
            raise self.client.malformed() from None
        if not isinstance(lease, str) or not lease.isalnum():
            raise self.client.malformed()
        self._lease = lease

    def leases_stop_other_writers(self) -> bool:
        return True

    def end_lease(self) -> None:
        if self._lease:
            try:
                self._call("DELETE", "lease")
            finally:
                self._lease = None

    def create_temporary(self, clone: bool) -> "RemoteFile":
        temporary = self._sibling(temporary_name, self.follow)
        try:
            self._fill(temporary, clone)
        except BaseException:
            # Interrupted while the server made it (Ctrl-C, SIGTERM): the caller never gets
            # the endpoint to clean up, so the temporary is removed here.
            temporary.remove_temporary()
            temporary.close()
            raise
        return temporary

    def open_partial(self, clone: bool) -> "tuple[RemoteFile, bool]":
        # The client names it, as it names every temporary of a push: the server keeps
        # it when the client goes away, and the next push to the same path finds it.
        partial = self._sibling(partial_name, follow=False)
        info = partial.stat()
        if info is not None:
            if info.kind != "file":
                partial.close()
                raise NotAFile(f"Cannot resume into the partial file {partial.path} of {self.location}: it "
                               f"is not a regular file; remove it")
            return partial, True
        self._fill(partial, clone)  # kept if interrupted here: it is the next run's to resume
        return partial, False

    def _sibling(self, naming: Callable[[str], str], follow: bool) -> "RemoteFile":
        """The hidden sibling on the server that ``naming`` names (a temporary, a partial file)."""
        directory, _, name = self.path.rpartition("/")
        path = f"{directory}/{naming(name)}" if directory else naming(name)
        return RemoteFile(self.location, self.token, self.concurrency, self.timeout,
                          self.ca_file, _base_path=(self.base, path), rate_limit=self.client.rate_limit,
                          follow=follow, compress=self.compression)

    def _fill(self, sibling: "RemoteFile", clone: bool) -> None:
        """Make a new sibling on the server: a clone of this file, or empty."""
        if clone:
            self._call("POST", "clone", sibling.path, params={"from": self.path})
        else:
            # Made now, empty, as a local temporary is: a missing directory or a
            # full disk fails here (one round trip) rather than at the first write.
            sibling.prepare(0)

    def replace(self, other: FileEndpoint) -> None:
        assert isinstance(other, RemoteFile)
        # The name's bytes, not its characters: it may not be UTF-8.
        self._call("POST", "rename", params={"to": os.fsencode(other.path)})

    def remove_temporary(self) -> None:
        try:
            self._call("DELETE", "temporary", expected=(200, 404))
        except PdiffcopyError:
            pass  # best effort while already failing

    def close(self) -> None:
        for pool in (self._hash_pool, self._first_hash_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _read_exactly(stream: http.client.HTTPResponse, offset: int, length: int, base: str) -> Iterator[Chunk]:
    buffer = bytearray(min(TRANSFER_CHUNK_SIZE, max(length, 1)))
    view = memoryview(buffer)
    position, end = offset, offset + length
    while position < end:
        got = stream.readinto(view[: min(len(buffer), end - position)])
        if not got:
            raise RemoteError(f"Lost the connection to {base}: {SERVER_CLOSED}")
        yield position, view[:got]
        position += got


def _media_type(response: _Response) -> str:
    return (response.headers.get("Content-Type") or "").split(";")[0].strip().lower()


class _Cuttable:
    """Chunks handed out a number of bytes at a time: a chunk that crosses the count is cut
    there and its rest handed out next."""

    def __init__(self, chunks: Iterator[Chunk]) -> None:
        self._chunks = chunks
        self._pending: Optional[Chunk] = None

    def take(self, count: int) -> Iterator[Chunk]:
        """The next ``count`` bytes' chunks (fewer if the chunks end first)."""
        while count > 0:
            try:
                offset, data = next(self)
            except StopIteration:
                return
            if len(data) > count:
                view = memoryview(data)
                self._pending = (offset + count, view[count:])
                data = view[:count]
            count -= len(data)
            yield offset, data

    def __iter__(self) -> "_Cuttable":
        return self

    def __next__(self) -> Chunk:
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            return chunk
        return next(self._chunks)


def _framed_body(ranges: List[ByteRange], chunks: Iterator[Chunk], level: int = compression.LEVEL) -> bytes:
    """A compressed PATCH body: the ranges' bytes cut in pieces, each a header and a zstd frame.

    Built whole, as its length must be sent first; a request carries one transfer batch, and
    compressed it is smaller still.
    """
    parts: List[bytes] = []
    pending = bytearray()
    for offset, length in compression.pieces(ranges):
        while len(pending) < length:
            try:
                _, data = next(chunks)
            except StopIteration:
                raise StorageError("The source ended before the data to send did") from None
            pending += data
        parts.append(compression.frame(offset, pending[:length], level))
        del pending[:length]
    return b"".join(parts)


def _sampled(chunks: Iterator[Chunk], state: Compression) -> Iterator[Chunk]:
    """``chunks``, the first one also handed to the adaptive policy as a sample."""
    first = True
    for offset, data in chunks:
        if first:
            state.observed(0, 0.0, bytes(data[:compression.SAMPLE_BYTES]))
            first = False
        yield offset, data


def _is_json(response: _Response) -> bool:
    """Whether an answer says its body is JSON (every answer of our server, errors included)."""
    return (response.headers.get("Content-Type") or "").split(";")[0].strip().lower() == "application/json"


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

"""A gunicorn worker that slow, silent and half-open connections cannot stop.

gunicorn's threaded worker (``gthread``) gives every connection a request
thread as soon as its first byte arrives, and that thread then waits without
a time limit for the rest of the request line and headers, for a body and for
a client to read the answer. On 127.0.0.1 with 2 workers x 8 threads, 16
connections that each sent one byte stopped the server, 128 silent ones
stalled it for 40 s, 16 slow readers of a ranged GET held every thread for
days, and 20 one-byte TLS handshakes stopped an HTTPS server.

:class:`GuardedThreadWorker` changes three things and keeps the rest of
gunicorn's worker:

1. **Nothing waits for a request in a thread.** The worker's event loop
   (which already accepts connections and watches kept-alive ones) also does
   the TLS handshake and collects the request line and headers, without
   blocking, and hands a connection to a request thread only when its headers
   are complete. A connection that has not got that far within
   :data:`HEADER_TIMEOUT` seconds is closed; waiting ones cost a socket and a
   few bytes, not a thread.
2. **A slow peer cannot hold a request thread for long.** Every read of a
   body and every write of an answer is paced: the peer gets
   :data:`STALL_GRACE` seconds of waiting plus one second per
   :data:`MIN_RATE` bytes moved, counted over the time the thread actually
   waits on this socket (time the server itself spends, hashing or writing to
   disk, never counts against the client); bytes sent count only once the
   peer acknowledged them, and what the kernel queues beyond the peer's
   window is capped (:data:`UNSENT_LIMIT`). Past its allowance the
   connection is reset.
3. **Plenty of request threads** (:data:`REQUEST_THREADS`): a thread only
   is busy only with a request whose headers are complete, and a request
   whose client turns slow is ended by the pacing, so one per connection
   costs little memory and no CPU. The number of concurrent hash jobs is limited
   elsewhere (``server.MAX_CONCURRENT_HASHES``), not by the thread count.

The limits can be lowered for tests with the environment variables
``PDIFFCOPY_HEADER_TIMEOUT``, ``PDIFFCOPY_STALL_GRACE`` and
``PDIFFCOPY_MIN_RATE`` (bytes per second), read when a worker starts.
"""

from __future__ import annotations

import errno
import fcntl
import os
import selectors
import socket
import ssl
import struct
import termios
import time
from collections import deque
from functools import partial
from typing import Deque, Optional

from gunicorn import http, sock as gsock, util
from gunicorn.workers.gthread import TConn, ThreadWorker

#: Seconds from a connection's acceptance (or from the first byte of a
#: kept-alive connection's next request) to the end of its headers, TLS
#: handshake included. Real clients send a request in one packet; 10 s
#: leaves room for a slow network and still frees a held socket soon.
HEADER_TIMEOUT = 10.0

#: Seconds a request thread may wait on a silent peer before any data moves,
#: in addition to the time :data:`MIN_RATE` allows. Long enough for a client
#: that pauses to read its own disk or hash, short against an attacker.
STALL_GRACE = 30.0

#: Bytes per second a peer must at least sustain, averaged over the time a
#: thread waits for it, when sending a body or reading an answer. 16 KiB/s is
#: far below any link a storage host syncs over (a 1 Mbit/s line moves
#: 122 KiB/s) and makes an attacker pay bandwidth for every thread it holds.
MIN_RATE = 16 * 1024

#: Request threads per worker process. A thread runs only a request whose
#: headers are complete; 1,024 per worker lets 1,000 slow uploaders in a
#: worker hold a thread each while others are still served, and idle threads
#: cost only their stacks' touched pages.
REQUEST_THREADS = 1024

#: Connections one worker process keeps open at most (the rest wait in the
#: listen backlog). Each costs a file descriptor and, while its headers are
#: incomplete, only a buffer; :func:`pdiffcopy.local.descriptors.raise_open_file_limit`
#: makes room for them.
MAX_CONNECTIONS = 4096

#: Bytes of an answer the kernel may queue for a peer beyond what the peer's
#: receive window lets it send (TCP_NOTSENT_LOWAT). Without it each slow
#: reader pinned up to 4 MiB of kernel memory (1,000 of them pushed the
#: whole machine's TCP into memory pressure, slowing every connection);
#: data already on its way is not limited, so fast clients keep their speed.
UNSENT_LIMIT = 256 * 1024

#: Bytes of request line and headers collected in the event loop before a
#: request is handed to a thread anyway (whose reads are then paced), where
#: gunicorn's own limits (4 KiB line, 100 fields of 8 KiB) refuse an
#: oversized one with a 4xx. Real requests of pdiffcopy clients have well
#: under 1 KiB; 64 KiB bounds what a waiting connection costs to 64 KiB.
MAX_HEADER_BYTES = 64 * 1024

#: Bytes read per non-blocking receive while collecting headers.
HEADER_CHUNK = 16 * 1024


#: Seconds a worker lets a new connection wait before it accepts it, per
#: connection it already has in hand (a request running, or headers being
#: read), when the server has other workers; at most
#: :data:`MAX_ACCEPT_DELAY`. gunicorn's workers share one listening socket
#: and the kernel wakes them in a fixed order, so a tree sync's few long
#: requests (a listing, one stream per client worker, often opened at the
#: same moment) piled onto one worker and shared its interpreter lock while
#: another idled. A worker with nothing in hand accepts at once, the least
#: busy of the others first.
ACCEPT_DELAY_PER_CONNECTION = 0.003
MAX_ACCEPT_DELAY = 0.012

#: Linux's option number, for Pythons whose socket module lacks the name.
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def _limit(name: str, default: float) -> float:
    """A limit from the environment (for tests), else its default."""
    value = os.environ.get(name)
    try:
        return float(value) if value else default
    except ValueError:
        return default


class SlowPeer(TimeoutError):
    """A peer sent or read too slowly (an ``OSError``, as gunicorn expects of a socket)."""


class _Paced:
    """Socket methods that time out by the pacing rule once :meth:`pace` was called.

    Mixed into ``socket.socket`` and ``ssl.SSLSocket``: gunicorn, Flask and
    :mod:`pdiffcopy.server.bodyreader` all read and write through these methods.
    """

    _grace = STALL_GRACE
    _rate = float(MIN_RATE)
    _paced = False
    _waited = 0.0
    _moved = 0

    def pace(self, grace: float, rate: float) -> None:
        """Start a new request's allowance: ``grace`` seconds plus ``1/rate`` s per byte."""
        self._grace, self._rate = grace, rate
        self._paced, self._waited, self._moved = True, 0.0, 0

    def unpace(self) -> None:
        """Back to plain (non-blocking) use by the event loop."""
        self._paced = False

    def _allowance(self, held: int = 0) -> float:
        left = self._grace + (self._moved - held) / self._rate - self._waited
        if left <= 0:
            raise SlowPeer(f"the peer moved {self._moved - held} bytes in {self._waited:.1f} s of waiting")
        return left

    def _unacknowledged(self) -> int:
        """Bytes written to this socket that the peer has not acknowledged yet (Linux; else 0).

        They earn a slow reader no time: otherwise the megabytes the kernel
        buffers at the start would buy it minutes.
        """
        try:
            answer = fcntl.ioctl(self.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")  # type: ignore[attr-defined]
            return max(0, struct.unpack("i", answer)[0])
        except (OSError, AttributeError, ValueError):
            return 0

    def _timed(self, call, size_of_result, *args, held: int = 0):
        started = time.monotonic()
        self.settimeout(self._allowance(held))  # type: ignore[attr-defined]
        try:
            result = call(*args)
        except (socket.timeout, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            self._waited += time.monotonic() - started
            raise SlowPeer(f"the peer moved {self._moved} bytes in {self._waited:.1f} s of waiting") from None
        self._waited += time.monotonic() - started
        self._moved += size_of_result(result)
        return result

    def recv(self, *args):
        if not self._paced:
            return super().recv(*args)  # type: ignore[misc]
        return self._timed(super().recv, len, *args)  # type: ignore[misc]

    def recv_into(self, *args):
        if not self._paced:
            return super().recv_into(*args)  # type: ignore[misc]
        return self._timed(super().recv_into, int, *args)  # type: ignore[misc]

    def sendall(self, data, *args):
        if not self._paced:
            return super().sendall(data, *args)  # type: ignore[misc]
        view = memoryview(data).cast("B")
        sent = 0
        while sent < len(view):
            # send(), not sendall(): the allowance is checked between pieces,
            # so a reader draining 1 byte a second cannot stretch one call.
            sent += self._timed(super().send, int, view[sent:], *args,  # type: ignore[misc]
                                held=self._unacknowledged())

    def sendfile(self, file, offset=0, count=None):
        if not self._paced:
            return super().sendfile(file, offset, count)  # type: ignore[misc]
        # socket.sendfile applies the socket's timeout to each wait: a stall
        # limit (pdiffcopy's own answers use sendall).
        self.settimeout(self._allowance(self._unacknowledged()))  # type: ignore[attr-defined]
        return super().sendfile(file, offset, count)  # type: ignore[misc]


class PacedSocket(_Paced, socket.socket):
    """A TCP connection whose blocking reads and writes are paced."""


class PacedSSLSocket(_Paced, ssl.SSLSocket):
    """A TLS connection whose blocking reads and writes are paced."""


class _Waiting:
    """A connection in the event loop, in its handshake or headers."""

    def __init__(self, conn: TConn, deadline: float, handshake: bool) -> None:
        self.conn = conn
        self.deadline = deadline
        self.handshake = handshake
        self.data = bytearray()
        self.closed = False


class GuardedThreadWorker(ThreadWorker):
    """gunicorn's threaded worker with handshakes and headers in the event loop and paced I/O."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = _limit("PDIFFCOPY_HEADER_TIMEOUT", HEADER_TIMEOUT)
        self.stall_grace = _limit("PDIFFCOPY_STALL_GRACE", STALL_GRACE)
        self.min_rate = _limit("PDIFFCOPY_MIN_RATE", MIN_RATE)
        # Sorted by deadline: every entry gets the same timeout when added.
        self.waiting: Deque[_Waiting] = deque()
        self.ssl_context: Optional[ssl.SSLContext] = None
        self.running_requests = 0  # requests in the request threads (changed by the event loop only)
        self.accept_after: Optional[float] = None  # a busy worker's pause in accepting ends then

    def init_process(self) -> None:
        if self.cfg.is_ssl:
            self.ssl_context = gsock.ssl_context(self.cfg)
            self.ssl_context.sslsocket_class = PacedSSLSocket
        super().init_process()

    # -- the event loop's part: accept, handshake, headers -----------------

    def set_accept_enabled(self, enabled: bool) -> None:
        if enabled and self.accept_after is not None:
            return  # paused: the event loop resumes accepting at accept_after
        super().set_accept_enabled(enabled)

    def accept(self, listener) -> None:
        in_hand = self.running_requests + len(self.waiting)
        if in_hand and self.cfg.workers > 1:
            # Leave the connection to a less busy worker for a moment (ACCEPT_DELAY_PER_CONNECTION).
            delay = min(ACCEPT_DELAY_PER_CONNECTION * in_hand, MAX_ACCEPT_DELAY)
            self.accept_after = time.monotonic() + delay
            super().set_accept_enabled(False)
            return
        self._accept(listener)

    def _resume_accepting(self) -> None:
        """After a pause: take every connection no idle worker took, then accept as usual again.

        Every one, not one: when all workers are busy, the pause must not
        become a limit on the rate of new connections.
        """
        self.accept_after = None
        for listener in self.sockets:
            while self.nr_conns < self.worker_connections and self._accept(listener):
                pass
        super().set_accept_enabled(self.nr_conns < self.worker_connections)

    def _accept(self, listener) -> bool:
        """Accept one connection; whether there was one."""
        try:
            client, address = listener.accept()
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return error.errno == errno.ECONNABORTED  # that one is gone; others may wait
        self.nr_conns += 1
        paced = PacedSocket(client.family, client.type, client.proto, fileno=client.detach())
        try:
            paced.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, UNSENT_LIMIT)
        except OSError:  # not Linux, or not TCP (a Unix socket): only memory is at stake
            pass
        conn = TConn(self.cfg, paced, address, listener.getsockname())  # non-blocking
        handshake = False
        if self.ssl_context is not None:
            try:
                conn.sock = self.ssl_context.wrap_socket(
                    paced, server_side=True, do_handshake_on_connect=False,
                    suppress_ragged_eofs=self.cfg.suppress_ragged_eofs)
            except OSError:
                self._close(conn)
                return True
            handshake = True
        self._wait(conn, handshake)
        return True

    def on_client_socket_readable(self, conn, client) -> None:
        # A kept-alive connection's next request: collect its headers here too.
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._wait(conn, False)

    def _wait(self, conn: TConn, handshake: bool) -> None:
        conn.sock.unpace()
        conn.sock.setblocking(False)
        entry = _Waiting(conn, time.monotonic() + self.header_timeout, handshake)
        self.waiting.append(entry)
        events = selectors.EVENT_READ
        self.poller.register(conn.sock, events, partial(self._on_waiting_event, entry))
        self._on_waiting_event(entry, conn.sock)  # the bytes may be there already

    def _on_waiting_event(self, entry: _Waiting, _fileobj) -> None:
        if entry.closed:
            return
        conn = entry.conn
        try:
            if entry.handshake:
                try:
                    conn.sock.do_handshake()
                except ssl.SSLWantReadError:
                    self.poller.modify(conn.sock, selectors.EVENT_READ,
                                       partial(self._on_waiting_event, entry))
                    return
                except ssl.SSLWantWriteError:
                    self.poller.modify(conn.sock, selectors.EVENT_WRITE,
                                       partial(self._on_waiting_event, entry))
                    return
                entry.handshake = False
                self.poller.modify(conn.sock, selectors.EVENT_READ,
                                   partial(self._on_waiting_event, entry))
            while True:
                try:
                    data = conn.sock.recv(min(HEADER_CHUNK, MAX_HEADER_BYTES - len(entry.data)))
                except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    return
                if not data:
                    self._drop(entry)
                    return
                entry.data += data
                if b"\r\n\r\n" in entry.data or b"\n\n" in entry.data \
                        or len(entry.data) >= MAX_HEADER_BYTES or not _may_start_a_request(entry.data):
                    self._dispatch(entry)
                    return
        except (OSError, ValueError):  # reset, TLS garbage: nothing to answer
            self._drop(entry)

    def _dispatch(self, entry: _Waiting) -> None:
        """Headers complete: give the connection (and the bytes read) to a request thread."""
        entry.closed = True
        self.waiting.remove(entry)
        self.poller.unregister(entry.conn.sock)
        conn = entry.conn
        if conn.parser is None:
            conn.parser = http.get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader.unread(bytes(entry.data))
        conn.initialized = True
        conn.data_ready = True
        self.enqueue_req(conn)

    def _drop(self, entry: _Waiting) -> None:
        if entry.closed:
            return
        entry.closed = True
        try:
            self.waiting.remove(entry)
        except ValueError:
            pass
        try:
            self.poller.unregister(entry.conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self._close(entry.conn)

    def _close(self, conn: TConn) -> None:
        self.nr_conns -= 1
        conn.close()

    def murder_waiting(self) -> None:
        """Close the connections whose handshake or headers are overdue."""
        now = time.monotonic()
        while self.waiting and self.waiting[0].deadline <= now:
            self._drop(self.waiting[0])

    def wait_for_and_dispatch_events(self, timeout):
        if self.waiting:
            timeout = max(0.0, min(timeout, self.waiting[0].deadline - time.monotonic()))
        if self.accept_after is not None:
            timeout = max(0.0, min(timeout, self.accept_after - time.monotonic()))
        super().wait_for_and_dispatch_events(timeout)
        self.murder_waiting()
        if self.accept_after is not None and time.monotonic() >= self.accept_after and self.alive:
            self._resume_accepting()

    def enqueue_req(self, conn) -> None:
        self.running_requests += 1
        super().enqueue_req(conn)

    def finish_request(self, conn, fs) -> None:
        self.running_requests -= 1
        if getattr(conn, "closed_in_thread", False):
            self.nr_conns -= 1
            return
        if isinstance(conn.sock, _Paced):
            conn.sock.unpace()
        super().finish_request(conn, fs)

    # -- a request thread's part --------------------------------------------

    def handle(self, conn):
        # Headers normally arrive complete; a pipelined request handed over
        # with part of them still gets no more than the header timeout.
        conn.sock.pace(self.header_timeout, self.min_rate)
        keep = super().handle(conn)
        if not keep:
            # gunicorn would close in its event loop, and its graceful close
            # waits up to 2 s for the peer's FIN there: a peer that never
            # sends one would stall every other connection. Here it costs
            # this thread only, and a slow peer is cut off at once.
            conn.sock.unpace()
            if getattr(conn, "slow", False):
                # Reset, not FIN: the kernel drops what the peer did not read
                # instead of keeping megabytes per connection for it (and a
                # slow reader cannot keep that memory in use).
                try:
                    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
                util.close(conn.sock)
            else:
                util.close_graceful(conn.sock)
            conn.closed_in_thread = True
        return keep

    def handle_request(self, req, conn):
        conn.sock.pace(self.stall_grace, self.min_rate)
        try:
            return super().handle_request(req, conn)
        except SlowPeer as error:
            self.log.info("Closed a slow connection from %s: %s", _address(conn.client), error)
            conn.slow = True
            return False


def _may_start_a_request(data: "bytes | bytearray") -> bool:
    """Whether ``data`` can begin an HTTP/1 request: a method (letters), perhaps after empty lines.

    Anything else (a TLS ClientHello sent to a plain HTTP port starts with
    0x16) goes to gunicorn's parser at once, whose ``400`` tells the client
    what it met (its TLS library says "wrong version number"), instead of
    waiting for the header deadline.
    """
    first = data.lstrip(b"\r\n")[:1]
    return not first or first.isalpha()


def _address(client) -> str:
    if isinstance(client, tuple) and client:
        return str(client[0])
    return str(client)

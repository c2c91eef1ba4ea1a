"""Reading a PATCH body fast: straight from gunicorn's socket when it is safe to.

gunicorn hands a request body to the application through several buffers,
each of which copies the data (six copies of every byte here); receiving a
1 GiB push cost the server about 0.9 s of CPU that way. When the body has a
known length and gunicorn has not started reading it, :func:`open_body`
takes over: it collects the few bytes gunicorn already holds and reads the
rest from the socket itself, into one reused buffer. Anything unexpected
(another server, another gunicorn version, a chunked body) falls back to the
WSGI input stream, which is always correct, only slower.

``PDIFFCOPY_DIRECT_BODY=0`` in the server's environment forces the fallback.
"""

from __future__ import annotations

import os
import socket
from typing import Any, NoReturn, Optional

from pdiffcopy.errors import BadRequest, ClientTooSlow

#: Seconds a client may leave the server waiting for more of a request body;
#: a stalled client releases its worker thread after this long. Under
#: pdiffcopy's own gunicorn worker the socket's pacing (pdiffcopy/server/guard.py,
#: a minimum rate) applies instead, which also ends a trickle.
BODY_TIMEOUT = 60.0

#: Bytes received per system call.
RECEIVE_CHUNK = 1024 * 1024


class BodyReader:
    """A request body with ``readline``, ``read`` and ``readinto``, over some raw source."""

    def __init__(self, length: Optional[int]) -> None:
        #: Bytes of the body not yet handed out (None: unknown, read to the end).
        self.remaining = length
        self._buffer = bytearray()

    def _raw_read(self, size: int) -> bytes:
        raise NotImplementedError

    def _raw_readinto(self, view: memoryview) -> int:
        data = self._raw_read(len(view))
        view[: len(data)] = data
        return len(data)

    def _limit(self, size: int) -> int:
        return size if self.remaining is None else min(size, self.remaining)

    def _consumed(self, count: int) -> None:
        if self.remaining is not None:
            self.remaining -= count

    def _not_received(self) -> int:
        """How much the raw source may still be asked for (never past the body's end)."""
        if self.remaining is None:
            return RECEIVE_CHUNK
        return self.remaining - len(self._buffer)

    def readline(self, limit: int) -> bytes:
        """One line (with its newline) of at most ``limit`` bytes."""
        while b"\n" not in self._buffer and len(self._buffer) < limit:
            wanted = min(RECEIVE_CHUNK, self._not_received())
            data = self._raw_read(wanted) if wanted > 0 else b""
            if not data:
                break
            self._buffer += data
        end = self._buffer.find(b"\n", 0, limit)
        end = limit if end < 0 else end + 1
        line = bytes(self._buffer[:end])
        del self._buffer[:end]
        self._consumed(len(line))
        return line

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` with the next bytes of the body; 0 at its end."""
        if self._buffer:
            count = min(len(view), len(self._buffer))
            view[:count] = self._buffer[:count]
            del self._buffer[:count]
            self._consumed(count)
            return count
        wanted = self._limit(len(view))
        if wanted <= 0:
            return 0
        count = self._raw_readinto(view[:wanted])
        self._consumed(count)
        return count

    def finish(self) -> None:
        """Called when the application is done with the body."""


class SocketBody(BodyReader):
    """The rest of a body of known length, read from the connection's socket."""

    def __init__(self, sock: socket.socket, prefix: bytes, length: int, on_failure) -> None:
        super().__init__(length)
        self._sock = sock
        self._buffer = bytearray(prefix)
        self._on_failure = on_failure
        self._timeout = sock.gettimeout()
        sock.settimeout(BODY_TIMEOUT)

    def _raw_read(self, size: int) -> bytes:
        try:
            return self._sock.recv(min(size, RECEIVE_CHUNK))
        except OSError as error:
            self._failed(error)

    def _raw_readinto(self, view: memoryview) -> int:
        try:
            return self._sock.recv_into(view)
        except OSError as error:
            self._failed(error)

    def _failed(self, error: OSError) -> NoReturn:
        self._on_failure()
        if isinstance(error, TimeoutError):
            raise ClientTooSlow(f"The request body came too slowly: {error}") from None
        raise BadRequest(f"The request body could not be read: {error}") from None

    def finish(self) -> None:
        self._sock.settimeout(self._timeout)
        if self.remaining:
            # The body was not read to its end: the next request's start is
            # unknown, so the connection must not be reused.
            self._on_failure()


class StreamBody(BodyReader):
    """A body read through the WSGI input stream (any server)."""

    def __init__(self, stream, length: Optional[int]) -> None:
        super().__init__(length)
        self._stream = stream

    def _raw_read(self, size: int) -> bytes:
        return self._stream.read(size)


def open_body(environ: dict, content_length: Optional[int]) -> BodyReader:
    """The fastest safe reader of this request's body."""
    direct = _take_over_gunicorn_body(environ, content_length)
    if direct is not None:
        return direct
    return StreamBody(environ["wsgi.input"], content_length)


def _take_over_gunicorn_body(environ: dict, content_length: Optional[int]) -> Optional[SocketBody]:
    if os.environ.get("PDIFFCOPY_DIRECT_BODY", "1") == "0" or not content_length:
        return None
    body: Any = environ.get("wsgi.input")
    sock = environ.get("gunicorn.socket")
    reader: Any = getattr(body, "reader", None)
    unreader: Any = getattr(reader, "unreader", None)
    body_buffer = getattr(body, "buf", None)
    if (sock is None or type(reader).__name__ != "LengthReader"
            or getattr(reader, "length", None) != content_length
            or not hasattr(unreader, "take_buffered") or not hasattr(unreader, "unread")
            or body_buffer is None or body_buffer.tell() != 0):
        return None
    held = unreader.take_buffered()
    if len(held) > content_length:
        # Bytes of a pipelined next request: give them back to gunicorn.
        unreader.unread(held[content_length:])
        held = held[:content_length]
    reader.length = 0  # gunicorn must not try to read (or drain) this body itself

    def mark_failed() -> None:
        if hasattr(body, "failed"):
            body.failed = True

    return SocketBody(sock, held, content_length, mark_failed)

"""Bytes on the wire: what this process's HTTP connections sent and received, as the kernel counts them.

The transport registers each socket it opens and reports it before closing
it; the figures are the kernel's TCP counters (``TCP_INFO``), so they hold
what HTTP's headers, multipart framing and TLS add to the data, and nothing
is counted twice by the layers above. A forked process starts from zero (its
parent's sockets are not its own): a tree sync's workers send their figures
back with their results. Where ``TCP_INFO`` lacks the counters (not Linux,
Linux before 4.2) the figures stay 0 and the stats line says nothing of the wire.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
from typing import TYPE_CHECKING, Tuple

if TYPE_CHECKING:
    import socket

#: Where ``tcpi_bytes_acked`` and ``tcpi_bytes_received`` (two u64, Linux 4.1
#: and 4.2) sit in Linux's ``struct tcp_info``, and the length that holds them.
_TCP_INFO_OFFSET = 120
_TCP_INFO_LENGTH = _TCP_INFO_OFFSET + 16
_COUNTERS = struct.Struct("=QQ")

_lock = threading.Lock()
_closed = [0, 0]  # sent, received by the sockets of this process already closed
_live: "weakref.WeakSet[socket.socket]" = weakref.WeakSet()


def _counters(sock: socket.socket) -> Tuple[int, int]:
    """(bytes sent and acknowledged, bytes received) of a TCP socket, or (0, 0) if unknown."""
    import socket  # (only once there is a socket: a local run never loads it)

    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return 0, 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_LENGTH)
    except (OSError, ValueError):  # closed already, or not TCP: nothing to count
        return 0, 0
    if len(info) < _TCP_INFO_LENGTH:
        return 0, 0
    sent, received = _COUNTERS.unpack_from(info, _TCP_INFO_OFFSET)
    return int(sent), int(received)


def track(sock: socket.socket) -> None:
    """Count ``sock``'s traffic from now on (call it once the connection is made)."""
    with _lock:
        _live.add(sock)


def untrack(sock: socket.socket) -> None:
    """Keep ``sock``'s figures before it is closed."""
    sent, received = _counters(sock)
    with _lock:
        if sock in _live:
            _live.discard(sock)
            _closed[0] += sent
            _closed[1] += received


def add(sent: int, received: int) -> None:
    """Count a child process's figures as this process's (it sends them back with its results)."""
    with _lock:
        _closed[0] += sent
        _closed[1] += received


def totals() -> Tuple[int, int]:
    """(bytes sent, bytes received) by this process's connections so far, open and closed."""
    with _lock:
        sent, received = _closed
        live = list(_live)
    for sock in live:
        more_sent, more_received = _counters(sock)
        sent += more_sent
        received += more_received
    return sent, received


def _forget() -> None:
    global _lock, _live
    _lock = threading.Lock()  # one held at the fork would stay held in the child
    _closed[:] = [0, 0]
    _live = weakref.WeakSet()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


__all__ = ["add", "totals", "track", "untrack"]

"""Which local user is on the other end of a connection, from the kernel's socket tables.

A TCP connection between two sockets of one host leaves both sockets in the
kernel's tables, each with the uid that created it. The server asks for the
peer's socket by its four addresses: first through sock_diag (one netlink
request, an exact lookup), else in /proc/net/tcp and tcp6 (a scan). A Unix
socket's peer is known from SO_PEERCRED.

A socket whose process closed it (an orphan, or a connection in TIME-WAIT)
has no owner any more: the kernel reports it with uid 0 and inode 0, so a
socket without an inode names nobody; otherwise closing a connection right
after sending a request would pass for root.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from typing import Optional, Tuple

#: <linux/netlink.h>, <linux/sock_diag.h>, <linux/inet_diag.h>.
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
ALL_STATES = 0xFFFFFFFF

_NLMSGHDR = struct.Struct("=IHHII")
#: inet_diag_req_v2 without its socket id: family, protocol, extensions, pad, states.
_REQUEST = struct.Struct("=BBBxI")
#: inet_diag_sockid: ports and addresses in network order, then interface and cookie.
_SOCKET_ID = struct.Struct("!HH16s16s")
_SOCKET_ID_TAIL = struct.Struct("=III")
#: inet_diag_msg after its socket id: expires, rqueue, wqueue, uid, inode.
_MESSAGE_HEAD = struct.Struct("=BBBB")
_MESSAGE_TAIL = struct.Struct("=IIIII")

#: Seconds a netlink answer may take: the kernel answers at once.
NETLINK_TIMEOUT = 1.0


def peer_uid(connection: socket.socket) -> Optional[int]:
    """The uid of the process that holds the other end of ``connection``.

    :returns: None when the peer is not on this host (nor in this network
              namespace), has closed its end, or the kernel cannot be asked.
    """
    if connection.family == socket.AF_UNIX:
        credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", credentials)[1]
    if connection.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        local, peer = connection.getsockname(), connection.getpeername()
    except OSError:
        return None
    family, local, peer = _unmapped(connection.family, local, peer)
    try:
        return peer_uid_from_netlink(local, peer, family)
    except OSError:
        return peer_uid_from_proc(local, peer, family)


def _unmapped(family: int, local: tuple, peer: tuple) -> Tuple[int, tuple, tuple]:
    """A dual-stack socket's ``::ffff:127.0.0.1`` peer is an IPv4 socket in the tables."""
    if family == socket.AF_INET6:
        local_address, peer_address = ipaddress.IPv6Address(local[0]), ipaddress.IPv6Address(peer[0])
        if local_address.ipv4_mapped and peer_address.ipv4_mapped:
            return (socket.AF_INET, (str(local_address.ipv4_mapped), local[1]),
                    (str(peer_address.ipv4_mapped), peer[1]))
    return family, local, peer


def _packed(family: int, host: str) -> bytes:
    return socket.inet_pton(family, host.partition("%")[0])


def peer_uid_from_netlink(local: tuple, peer: tuple, family: int) -> Optional[int]:
    """Ask sock_diag for the socket bound to ``peer`` and connected to ``local``.

    :raises OSError: When netlink cannot be used here (the caller falls back to /proc).
    """
    socket_id = (_SOCKET_ID.pack(peer[1], local[1], _packed(family, peer[0]).ljust(16, b"\0"),
                                 _packed(family, local[0]).ljust(16, b"\0"))
                 + _SOCKET_ID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, ALL_STATES) + socket_id
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as channel:
        channel.settimeout(NETLINK_TIMEOUT)
        channel.sendto(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
                       + body, (0, 0))
        answer = channel.recv(65536)
    length, kind, _flags, _sequence, _port = _NLMSGHDR.unpack_from(answer)
    if kind == NLMSG_ERROR:
        error = -struct.unpack_from("=i", answer, _NLMSGHDR.size)[0]
        if error in (0, 2):  # ENOENT: no such socket here
            return None
        raise OSError(error, os.strerror(error))
    offset = _NLMSGHDR.size + _MESSAGE_HEAD.size + _SOCKET_ID.size + _SOCKET_ID_TAIL.size
    if length < offset + _MESSAGE_TAIL.size:
        raise OSError("a short sock_diag answer")
    _expires, _rqueue, _wqueue, uid, inode = _MESSAGE_TAIL.unpack_from(answer, offset)
    return uid if inode else None


def peer_uid_from_proc(local: tuple, peer: tuple, family: int) -> Optional[int]:
    """The same question as :func:`peer_uid_from_netlink`, by scanning /proc/net/tcp or tcp6."""
    from pdiffcopy.local import tcptable

    # The peer's socket is the row whose local end is our peer address.
    wanted = tuple((ipaddress.ip_address(host.partition("%")[0]), port) for host, port, *_ in (peer, local))
    table = tcptable.TABLES[1] if family == socket.AF_INET6 else tcptable.TABLES[0]
    try:
        for row in tcptable.rows([table]):
            if (row.local, row.remote) == wanted:
                return row.uid if row.inode else None
    except (OSError, ValueError):
        return None
    return None
    return None

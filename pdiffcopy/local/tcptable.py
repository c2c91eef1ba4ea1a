"""This host's TCP connections as the kernel lists them in ``/proc/net/tcp`` and ``tcp6``.

The one reader of those tables: the server's lookup of who holds the other end of a
connection (:mod:`pdiffcopy.local.peers`, where sock_diag cannot answer) and its watch of
which clients are still connected (:mod:`pdiffcopy.server.holds`).
"""

from __future__ import annotations

import ipaddress
from typing import Iterator, NamedTuple, Sequence, Tuple

#: An address and port; the address an :mod:`ipaddress` object.
Endpoint = Tuple[object, int]

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


class Row(NamedTuple):
    """One connection of the table."""

    local: Endpoint
    remote: Endpoint
    #: The connection's state as the table writes it, in hex (``"01"``: established).
    state: str
    uid: int
    #: The socket's inode: 0 once no process holds it (orphaned, TIME-WAIT).
    inode: int


def rows(tables: Sequence[str] = TABLES) -> Iterator[Row]:
    """Every connection of ``tables`` (a missing table, as ``tcp6`` without IPv6, has none).

    :raises OSError: When a table exists but cannot be read.
    """
    for name in tables:
        try:
            table = open(name, encoding="ascii")
        except FileNotFoundError:
            continue
        with table:
            next(table, None)
            for line in table:
                fields = line.split()
                if len(fields) > 9:
                    yield Row(endpoint(fields[1]), endpoint(fields[2]), fields[3], int(fields[7]), int(fields[9]))


def endpoint(text: str) -> Endpoint:
    """An address and port as the table writes them: the address in 32-bit host-order words, then the port."""
    address, _, port = text.partition(":")
    raw = bytes.fromhex(address)
    packed = b"".join(raw[index:index + 4][::-1] for index in range(0, len(raw), 4))
    return ipaddress.ip_address(packed), int(port, 16)


__all__ = ["Endpoint", "Row", "TABLES", "endpoint", "rows"]

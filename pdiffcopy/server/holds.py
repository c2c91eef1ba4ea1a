"""The server holds its clients' temporaries' writer locks between their requests.

A push writes its temporary on the server in many requests, which gunicorn's
worker processes share out, and none of them is the writer for long. So every
worker that serves a request on a temporary keeps a writer lock on it afterwards
(:class:`~pdiffcopy.local.writerlocks.HoldKeeper`) until the client is gone: every
connection on which it asked is closed (the kernel closes a killed client's at
once), or it sent nothing for the lease's :data:`~pdiffcopy.server.leasetable.LEASE_SECONDS`,
or the temporary has no name any more. A sweep (a push's, a tree push's listing,
the next server's start) then finds the lock free and removes the temporary.

The write leases (:mod:`pdiffcopy.server.leasetable`) follow the same connections: a lease
whose holder closed every connection it asked on, and has no write running, has lapsed
(:func:`watch_leases`).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Optional, Set, Tuple

from flask import Flask, Response, request

from pdiffcopy.core.protocol import is_temporary_name
from pdiffcopy.errors import PdiffcopyError
from pdiffcopy.local import tcptable, writerlocks
from pdiffcopy.server.leasetable import LEASE_SECONDS, LeaseTable
from pdiffcopy.server.requests import served

#: How often a worker looks whether the clients whose temporaries it holds are still connected:
#: a killed client's temporary is free for the next run's sweep this soon.
HOLD_TICK_SECONDS = 0.05

#: ``/proc/net/tcp`` state of an established connection (include/net/tcp_states.h).
_ESTABLISHED = "01"

#: States of a connection this side closed first (FIN_WAIT1, FIN_WAIT2, TIME_WAIT, CLOSING): the
#: server ended an idle keep-alive connection, not the client. A client that was killed closed
#: its connections itself (CLOSE_WAIT, LAST_ACK, then nothing).
_CLOSED_HERE = frozenset({"04", "05", "06", "0B"})

Connection = Tuple[tcptable.Endpoint, tcptable.Endpoint]


def install(app: Flask) -> None:
    """Keep the temporaries' writer locks in every worker of ``app`` (made before the fork)."""
    keeper = writerlocks.HoldKeeper(LEASE_SECONDS, tick=HOLD_TICK_SECONDS)
    keeper.open_connections = open_connections
    writerlocks.KEEPER = keeper

    @app.before_request
    def note_connection() -> None:
        writerlocks.set_request_connection(connection_of(request.environ))

    @app.after_request
    def keep_temporary_held(response: Response) -> Response:
        path = (request.view_args or {}).get("path")
        if path and response.status_code < 400 and is_temporary_name(path.rstrip("/").rpartition("/")[2]):
            hold(path, keeper)
        return response

    @app.teardown_request
    def forget_connection(_error: Optional[BaseException]) -> None:
        writerlocks.set_request_connection(None)


def watch_leases(leases: LeaseTable) -> None:
    """Let ``leases`` see its holders' connections: a lease ends once the client closed them all.

    A connection the server closed (an idle keep-alive one) still counts: its client may
    be alive, hashing its own side, and would ask again on a new one.
    """
    leases.request_connection = lambda: connection_text(writerlocks.request_connection())

    def open_now() -> Optional[Set[str]]:
        try:
            found = connections_in({_ESTABLISHED} | _CLOSED_HERE)
        except OSError:
            return None
        return {text for text in map(connection_text, found) if text is not None}

    leases.open_connections = open_now


def connection_text(connection: Optional[Connection]) -> Optional[str]:
    """A connection as a lease records it: ``server address, port > client address, port``."""
    if connection is None:
        return None
    (here, here_port), (there, there_port) = connection
    return f"{here},{here_port}>{there},{there_port}"


def hold(path: str, keeper: writerlocks.HoldKeeper) -> None:
    """Keep (or renew) a writer lock on the temporary ``path`` for the requesting client."""
    try:
        fd = served(path, follow=False).open_descriptor(os.O_RDONLY | os.O_NONBLOCK)
    except (PdiffcopyError, OSError):
        return  # renamed or removed by this request: nothing to hold
    try:
        held = writerlocks.hold_descriptor(fd)
    except OSError:
        held = None
    finally:
        os.close(fd)
    if held is not None:
        keeper.keep(held, writerlocks.request_connection())


def connection_of(environ: dict) -> Optional[Connection]:
    """The request's TCP connection as (server address, client address), or None when unknown."""
    sock = environ.get("gunicorn.socket")
    try:
        here, there = sock.getsockname(), sock.getpeername()  # type: ignore[union-attr]
        return (ipaddress.ip_address(here[0]), here[1]), (ipaddress.ip_address(there[0]), there[1])
    except (AttributeError, OSError, ValueError, IndexError, TypeError):
        return None


def open_connections() -> Optional[Set[Connection]]:
    """This host's established TCP connections, or None when it cannot tell (the lease's time decides)."""
    try:
        return established_connections()
    except OSError:
        return None


def established_connections() -> Set[Connection]:
    """This host's established TCP connections, from ``/proc/net/tcp`` and ``tcp6``."""
    return connections_in({_ESTABLISHED})


def connections_in(states: "Set[str] | frozenset") -> Set[Connection]:
    """This host's TCP connections in ``states`` (``/proc/net/tcp``'s hex codes), from ``tcp`` and ``tcp6``."""
    return {(row.local, row.remote) for row in tcptable.rows() if row.state in states}


__all__ = ["HOLD_TICK_SECONDS", "connection_of", "connection_text", "connections_in", "established_connections",
           "install", "open_connections", "watch_leases"]

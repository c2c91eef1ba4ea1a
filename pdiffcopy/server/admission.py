"""Who may do what: every request is admitted to one export, or to none, before any view runs.

A request that names a path (the files' and trees' endpoints) is admitted to the export
the path names (:meth:`~pdiffcopy.server.exports.ExportTable.locate`), in this order:

1. the client's address must be in the export's ``allow`` networks (else 403);
2. its token, or its client certificate (``--client-ca``), must be one the export lists
   (401 without one or with an unknown one, 403 with another export's); an export without
   tokens or certificates serves the server's own user and root on its host, or anyone
   with ``--insecure``;
3. a view that writes (any but :data:`READING_VIEWS`) is refused on a read-only export (403);
4. the export's ``max_connections`` requests may run at once, over every worker (503).

The exports are those of the generation the request is admitted under
(:mod:`~pdiffcopy.server.generations`: its sync's ticket, or the one in force). The views
then reach only that export's files (:func:`~pdiffcopy.server.requests.located`). The
server's own requests (its version, metrics, API document, index, a sync's end) need a
token or certificate of any export, or the owner where an export needs neither.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Callable, Optional

from flask import Response, g, request
from werkzeug.wsgi import ClosingIterator

from pdiffcopy.core.protocol import RULES_HEADER, TOKEN_VARIABLE
from pdiffcopy.engine.forkshared import SharedInts
from pdiffcopy.errors import AccessDenied, AuthenticationFailed, FileMissing, ForeignUser, ServerBusy
from pdiffcopy.local.peers import peer_uid
from pdiffcopy.server.exports import Export, ExportTable
from pdiffcopy.server.generations import ExportGenerations

#: The views that only read what an export holds. Every other view of the files and the
#: trees counts as a write (a new one too, until it is listed here): refused on a read-only
#: export before it runs.
READING_VIEWS = frozenset({
    "files.stat_file", "files.hashes", "files.chunks_of_file", "files.read_file", "files.data_map",
    "trees.tree_list", "trees.tree_read",
})

#: The views of the blueprints that name a path: admitted to the export the path names.
PATH_BLUEPRINTS = ("files", "trees")

#: Seconds a client refused for an export's ``max_connections`` waits before asking again.
BUSY_RETRY_SECONDS = 1


def _user_name(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:
        return f"uid {uid}"


class Admission:
    """The checks of one application (made before gunicorn forks: the counts are shared)."""

    def __init__(self, generations: ExportGenerations, owner_uid: int) -> None:
        self.generations = generations
        self.owner_uid = owner_uid
        self.owner = _user_name(owner_uid)
        #: Requests in progress per export (by its slot), over all worker processes.
        self.in_progress = SharedInts([0] * generations.slot_count)
        #: The peer's uid, looked up once per connection (a kept-alive one keeps its socket).
        self._peer_uids: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        #: The client certificate's SHA-256 ("" for none), looked at once per connection.
        self._certificates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def admit(self) -> None:
        """Admit the current request (setting ``g.export``, ``g.exports`` and ``g.token_name``) or raise."""
        digest, certificate = self._digest(), self._certificate()
        #: Who the client is: its token, else its certificate (a ticket and a transfer are its own).
        g.identity = digest or (f"certificate {certificate}" if certificate else None)
        generation, table = self.generations.admitting(request.headers.get(RULES_HEADER), g.identity,
                                                       request.remote_addr or "")
        g.rules_generation = generation
        g.exports = table
        g.token_digest, g.certificate = digest, certificate
        g.token_name = table.token_names.get(digest) if digest else None
        if g.token_name is None and certificate:
            g.token_name = table.certificate_names.get(certificate)
        g.export = None
        if request.blueprint not in PATH_BLUEPRINTS:
            self._admit_to_server(table, digest, certificate)
            return
        path = (request.view_args or {}).get("path", "")
        export, _ = table.locate(path)
        if export is None:
            self._admit_to_server(table, digest, certificate)
            name = path.partition("/")[0]
            raise FileMissing(f"No export named {name!r} on this server" if name else
                              "Name an export: this server's URLs are http://HOST:PORT/EXPORT/PATH")
        self._admit_to_export(table, export, digest, certificate)
        g.export = export  # (from here on a refusal is the transfer's: the transfer log says so)
        if export.rules.read_only and request.endpoint not in READING_VIEWS:
            export.refuse_writes()
        self._count_in(export)

    def _digest(self) -> Optional[str]:
        """The hex SHA-256 of the request's bearer token, if it sent one.

        Looked up among the tokens' hashes: the time a lookup takes depends on the hash,
        which says nothing about the token a guess is near.
        """
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # the scheme in any case (RFC 9110, section 11.1)
            return None
        supplied = credentials.lstrip(" ").encode("latin-1", "replace")
        return hashlib.sha256(supplied).hexdigest() if supplied else None

    def ticket(self, response: Response) -> Response:
        """Name the rules the request was admitted under, for the rest of its sync (a reloadable server's)."""
        generation = g.get("rules_generation")
        if generation is not None and self.generations.reloadable:
            response.headers[RULES_HEADER] = self.generations.ticket(generation, g.identity,
                                                                     request.remote_addr or "")
        return response

    def _admit_to_export(self, table: ExportTable, export: Export, digest: Optional[str],
                         certificate: Optional[str]) -> None:
        if not export.rules.allows_address(request.remote_addr or ""):
            raise AccessDenied(f"Clients at {request.remote_addr} may not use {export.shown}")
        if export.digests or export.certificates:
            if digest in export.digests:
                return
            if certificate in export.certificates:
                g.token_name = table.certificate_names[certificate]
                return
            if digest is not None and digest in table.token_names:
                raise AccessDenied(f"The token {table.token_names[digest]!r} does not open {export.shown}")
            if digest is None and certificate in table.certificate_names:
                raise AccessDenied(f"The certificate {table.certificate_names[certificate]!r} does not open "
                                   f"{export.shown}")
            raise AuthenticationFailed("Missing or wrong token (send Authorization: Bearer ...)")
        if export.owner_only:
            self._check_peer_is_the_owner(table)

    def _admit_to_server(self, table: ExportTable, digest: Optional[str], certificate: Optional[str]) -> None:
        """The server's own requests: any export's token or certificate, or what an export without one allows."""
        if digest is not None and digest in table.token_names or certificate in table.certificate_names:
            return
        if table.any_open_to_anyone:
            return
        if table.any_owner_only and (digest is None or not table.token_names):
            self._check_peer_is_the_owner(table)
            return
        raise AuthenticationFailed("Missing or wrong token (send Authorization: Bearer ...)")

    def _certificate(self) -> Optional[str]:
        """The hex SHA-256 of the client's certificate (verified against ``--client-ca`` in the
        handshake), if it sent one; looked at once per connection."""
        connection = request.environ.get("gunicorn.socket")
        if connection is None or not hasattr(connection, "getpeercert"):
            return None
        known = self._certificates.get(connection)
        if known is None:
            try:
                certificate = connection.getpeercert(binary_form=True)
            except (ValueError, OSError):
                certificate = None
            known = hashlib.sha256(certificate).hexdigest() if certificate else ""
            self._certificates[connection] = known
        return known or None

    def _check_peer_is_the_owner(self, table: ExportTable) -> None:
        connection = request.environ.get("gunicorn.socket")
        uid = None
        if connection is not None:
            uid = self._peer_uids.get(connection)
            if uid is None:
                uid = peer_uid(connection)
                if uid is not None:
                    self._peer_uids[connection] = uid
        if uid not in (self.owner_uid, 0):
            if table.token_names or table.certificate_names:
                raise AuthenticationFailed("Missing or wrong token (send Authorization: Bearer ...)")
            share = (f"starting it with ${TOKEN_VARIABLE} set" if table.default is not None
                     else "listing tokens in its exports")
            raise ForeignUser(f"This server has no token, so it serves only its own user ({self.owner}) "
                              f"and root on its host; its owner can share it by {share}")

    def _count_in(self, export: Export) -> None:
        limit = export.rules.max_connections
        if limit is None:
            return
        with self.in_progress.get_lock():
            running = self.in_progress[export.index]
            if running >= limit:
                raise ServerBusy(f"Busy: {export.shown} serves at most {limit} requests at once; "
                                 f"try again later", BUSY_RETRY_SECONDS)
            self.in_progress[export.index] = running + 1
        g.counted_in = export

    def count_out_when_sent(self, response: Response) -> Response:
        """Count the request out of its export once its answer is sent (or abandoned)."""
        export = g.pop("counted_in", None)
        if export is None:
            return response
        return when_sent(response, lambda: self._count_out(export))

    def count_out_now(self) -> None:
        """Count out a request that ends without an answer to wait for."""
        export = g.pop("counted_in", None)
        if export is not None:
            self._count_out(export)

    def _count_out(self, export: Export) -> None:
        with self.in_progress.get_lock():
            self.in_progress[export.index] -= 1


def when_sent(response: Response, callback: Callable[[], None]) -> Response:
    """Call ``callback`` once the answer is sent, or abandoned by its client."""
    if response.direct_passthrough:  # (Werkzeug hands such a body to the server bare: no close of its own)
        response.response = ClosingIterator(response.response, callback)
    else:
        response.call_on_close(callback)
    return response


__all__ = ["Admission", "when_sent", "PATH_BLUEPRINTS", "READING_VIEWS"]

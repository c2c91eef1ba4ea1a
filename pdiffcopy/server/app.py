"""The HTTP server: a Flask application built by :func:`create_app`.

Views are thin: they parse and validate the request, call the core and the
file operations, and leave errors to one handler that maps every
:class:`~pdiffcopy.errors.PdiffcopyError` to its HTTP status and a JSON
body. The protocol is documented in docs/protocol.rst.

Files are served at their own URL (``GET /a/b.img`` with ``Range`` answers
206, so curl works); the operations a sync needs live under the reserved
prefix ``/.pdiffcopy/``. The views live in blueprints of their own: the
files (:mod:`~pdiffcopy.server.files`), the trees (:mod:`~pdiffcopy.server.treeserver`)
and 1.0.1's API (:mod:`~pdiffcopy.server.legacyapi`); this module holds what
every request goes through (the token, the metrics, the log, the error handler).
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Tuple

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException, NotFound

from pdiffcopy._version import __version__
from pdiffcopy.core.compression import FRAMES_TYPE
from pdiffcopy.errors import (
    AuthenticationFailed,
    BadRequest,
    PdiffcopyError,
    RangeNotSatisfiable,
    ServerBusy,
    storage_error,
)
from pdiffcopy.core.protocol import SYNC_HEADER, written_name
from pdiffcopy.server.admission import READING_VIEWS, Admission, when_sent
from pdiffcopy.server.audit import sync_of_request, transfer_key
from pdiffcopy.server.context import API_PREFIX, ServerConfig, ServerState, export_label, request_metrics
from pdiffcopy.server import holds
from pdiffcopy.server.files import files
from pdiffcopy.server.legacyapi import LEGACY_PARAMETER, is_legacy_request, legacy
from pdiffcopy.server.metrics import METRICS_PATH, SCRAPE_PATH, UNMATCHED
from pdiffcopy.server.openapi import DOCUMENT_PATH, render_document
from pdiffcopy.server.requests import AnyPathConverter, one_line, undecoded_path
from pdiffcopy.server.treeserver import trees

logger = logging.getLogger(__name__)

#: What a PATCH body may be (sent as ``Accept-Patch`` with a stat answer): one raw range,
#: several as multipart/byteranges, or compressed pieces (docs/protocol.rst).
PATCH_TYPES = f"application/octet-stream, multipart/byteranges, {FRAMES_TYPE}"

#: Liveness: the one request answered without the token (a probe has none),
#: and it says nothing but that the server answers.
HEALTH_PATH = f"{API_PREFIX}/health"


def create_app(config: ServerConfig) -> Flask:
    """Build the Flask application serving ``config.root``.

    :param config: The root directory and the optional shared secret.
    :returns: A WSGI application.
    """
    # No static folder: Flask would route /static/... to its own (empty)
    # folder, hiding every file below a directory called static in the root.
    app = Flask("pdiffcopy", static_folder=None)
    # No redirects for doubled slashes, and every path reaches its view:
    # "//etc/passwd" is refused there as absolute (see AnyPathConverter).
    app.url_map.merge_slashes = False
    app.url_map.strict_slashes = False
    app.url_map.converters["path"] = AnyPathConverter
    # Made here, before gunicorn forks its workers (preload_app): the leases, the metrics
    # and the rate limit are shared by every worker, the hash slots copied into each.
    state = ServerState.start(config)
    state.install(app)
    holds.install(app)
    holds.watch_leases(state.leases)
    document = render_document()
    admission = Admission(state.generations, config.owner_uid)

    def metrics_answer() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, content_type=content_type)

    @app.before_request
    def authenticate() -> Optional[Response]:
        g.started = time.monotonic()
        if config.metrics_port is not None and request.environ.get("SERVER_PORT") == str(config.metrics_port):
            # The --metrics-listen address: the metrics without the token, nothing else.
            g.endpoint_label = "metrics"
            if request.path not in (SCRAPE_PATH, METRICS_PATH) or request.method not in ("GET", "HEAD"):
                raise NotFound(f"This address answers only GET {SCRAPE_PATH} (the metrics)")
            return metrics_answer()
        if request.path == HEALTH_PATH:
            return None
        admission.admit()
        return None

    @app.url_value_preprocessor
    def keep_path_bytes(endpoint: Optional[str], values: Optional[dict]) -> None:
        if values and "\ufffd" in values.get("path", ""):
            values["path"] = undecoded_path(values["path"])

    @app.after_request
    def count_request(response: Response) -> Response:
        # The view's name, never the path: a label's values must stay few.
        # Without the blueprint's name: the labels stay what they were before the blueprints.
        endpoint = g.get("endpoint_label") or (request.url_rule.endpoint.rpartition(".")[2]
                                               if request.url_rule else UNMATCHED)
        state.metrics.count_request(endpoint, response.status_code, export_label() if "exports" in g else "")
        return response

    @app.after_request
    def count_out(response: Response) -> Response:
        return admission.count_out_when_sent(response)

    @app.after_request
    def name_the_rules(response: Response) -> Response:
        return admission.ticket(response)

    @app.after_request
    def log_the_transfer(response: Response) -> Response:
        sync = sync_of_request()
        if sync:
            # Whatever the request: the client learns that this server keeps a transfer log,
            # and tells it when its sync is over (its lines come at once).
            response.headers[SYNC_HEADER] = sync
        export = g.get("export")
        if export is None:
            return response  # (refused before it reached an export, or the server's own)
        address = request.remote_addr or ""
        key = transfer_key(sync, g.get("identity"), address)
        path, writes = _transfer_of_request()
        tally, status, token = request_metrics().tally, response.status_code, g.get("token_name")
        return when_sent(response, lambda: state.transfers.add(key, export.name, token, address, path, writes,
                                                               tally, status))

    @app.post(f"{API_PREFIX}/done")
    def sync_done():
        """A client's sync is over: the lines of its transfers go to the log."""
        sync = sync_of_request()
        if not sync:
            raise BadRequest(f"Name the sync that is over ({SYNC_HEADER}: up to 64 letters, digits, - and _)")
        outcome = request.args.get("result", "ok")
        if outcome not in ("ok", "failed"):
            raise BadRequest(f"result must be ok or failed, not {one_line(outcome)[:40]!r}")
        ended = state.transfers.end(transfer_key(sync, g.get("identity"), request.remote_addr or ""),
                                    failed=outcome == "failed")
        return jsonify(ended=ended)

    @app.teardown_request
    def count_out_unanswered(_error: Optional[BaseException]) -> None:
        admission.count_out_now()  # (none left once an answer was made: count_out took it)

    @app.after_request
    def accept_patch(response: Response) -> Response:
        if request.path.startswith(API_PREFIX + "/"):
            # RFC 5789: the bodies a PATCH may have; a client sends compressed ranges only when listed.
            response.headers["Accept-Patch"] = PATCH_TYPES
        return response

    @app.after_request
    def log_request(response: Response) -> Response:
        if request.path == HEALTH_PATH and response.status_code == 200:
            return response  # a probe every few seconds would bury the requests that matter
        elapsed = time.monotonic() - g.get("started", time.monotonic())
        logger.info("%s %s %s %s (%.1f ms)", request.remote_addr, request.method,
                    one_line(request.full_path.rstrip("?")), response.status_code, elapsed * 1000)
        return response

    @app.errorhandler(Exception)
    def handle_error(error: Exception):
        if isinstance(error, PdiffcopyError):
            status, message = error.http_status, str(error)
        elif isinstance(error, HTTPException):
            status, message = error.code or 500, error.description or error.name
        elif isinstance(error, TimeoutError):  # the client's socket (guard.SlowPeer), not storage
            status, message = 408, f"The client was too slow: {error}"
        elif isinstance(error, OSError):
            mapped = storage_error(error, "complete the request")
            status, message = mapped.http_status, str(mapped)
        else:
            logger.exception("Unexpected error handling %s %s", request.method,
                             one_line(request.path))
            status, message = 500, "Internal server error"
        response = jsonify(error=one_line(message), status=status)
        response.status_code = status
        if isinstance(error, AuthenticationFailed):
            response.headers["WWW-Authenticate"] = 'Bearer realm="pdiffcopy"'
        if isinstance(error, ServerBusy):
            response.headers["Retry-After"] = str(error.retry_after)
        if isinstance(error, RangeNotSatisfiable) and error.size is not None:
            response.headers["Content-Range"] = f"bytes */{error.size}"
        return response

    @app.get(HEALTH_PATH)
    def health():
        """Liveness for probes and load balancers: without the token, and nothing about files."""
        return jsonify(status="ok")

    @app.get(f"{API_PREFIX}/version")
    def version():
        """Who we are and which hash methods we offer."""
        return jsonify(version=__version__, methods=list(config.hash_methods))

    @app.get(METRICS_PATH, endpoint="metrics")  # the label of scrapes on either address
    def metrics_text():
        """Prometheus metrics of all worker processes (behind the token, like every request)."""
        return metrics_answer()

    @app.get(DOCUMENT_PATH)
    def openapi():
        """The OpenAPI document of this API (behind the token, like every request)."""
        return Response(document, mimetype="application/json")

    @app.route("/", methods=["GET", "HEAD"])
    def index():
        """Who we are, and with ``--config`` the exports this client may open (rsync lists its modules)."""
        if g.exports.default is not None:
            return jsonify(server="pdiffcopy", version=__version__)
        return jsonify(server="pdiffcopy", version=__version__,
                       exports=g.exports.opened_by(g.token_digest, g.certificate, request.remote_addr or ""))

    app.register_blueprint(files)
    app.register_blueprint(trees)
    # Last: its hooks run after the token check (1.0.1 requests need the token too).
    app.register_blueprint(legacy)
    return app


def _transfer_of_request() -> Tuple[str, bool]:
    """The path of the current request's transfer within its export, and whether it writes."""
    if is_legacy_request():
        return request.args.get(LEGACY_PARAMETER, ""), request.method == "POST"
    path = g.exports.locate((request.view_args or {}).get("path", ""))[1]
    # One transfer per file, whether a request names it, its temporary or ./it/.
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if parts:
        parts[-1] = written_name(parts[-1])
    return "/".join(parts), request.endpoint not in READING_VIEWS

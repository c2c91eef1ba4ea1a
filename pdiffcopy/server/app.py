"""The HTTP server: a Flask application built by :func:`create_app`.

Views are thin: they parse and validate the request, call the core and the
file operations, and leave errors to one handler that maps every
:class:`~pdiffcopy.errors.PdiffcopyError` to its HTTP status and a JSON
body. The protocol is documented in docs/protocol.rst.

Files are served at their own URL (``GET /a/b.img`` with ``Range`` answers
206, so curl works); the operations a sync needs live under the reserved
prefix ``/.pdiffcopy/``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import stat as stat_module
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple
from urllib.parse import parse_qs

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException, NotFound
from werkzeug.http import unquote_etag
from werkzeug.routing import PathConverter

from pdiffcopy import __version__
from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, ByteRange
from pdiffcopy.core.datamap import MAX_DATA_MAP_EXTENTS
from pdiffcopy.server.bodyreader import BodyReader, open_body
from pdiffcopy.core.byteranges import (
    boundary_of,
    closing_delimiter,
    is_bytes_range,
    multipart_content_type,
    MAX_MULTIPART_OVERHEAD,
    multipart_length,
    new_boundary,
    overlapping,
    parse_content_range,
    parse_explicit_ranges,
    parse_range_header,
    part_header,
    read_parts,
    format_content_range,
)
from pdiffcopy.core.compression import (
    ENCODING,
    FRAMES_TYPE,
    CompressionError,
    accepted_frames_level,
    accepts_zstd,
    frame,
    pieces,
    read_frames,
    stream_compressor,
)
from pdiffcopy.errors import (
    AccessDenied,
    AuthenticationFailed,
    BadRequest,
    Conflict,
    FileMissing,
    PayloadTooLarge,
    PdiffcopyError,
    RangeNotSatisfiable,
    ServerBusy,
    UsageError,
    storage_error,
)
from pdiffcopy.local.fileops import (
    TRANSFER_CHUNK_SIZE,
    RangeReader,
    copy_available,
    data_extents,
    etag,
    is_temporary_name,
    punch_ranges,
    resize,
    start_writeback,
    write_all,
    write_sparse,
)
from pdiffcopy.local.filehash import hash_region
from pdiffcopy.core.hashing import accepted_methods, digest_size, validate_method
from pdiffcopy.local.leases import LEASE_SECONDS, Leases
from pdiffcopy.server.legacyapi import add_legacy_api
from pdiffcopy.server.metrics import METRICS_PATH, SCRAPE_PATH, UNMATCHED, ServerMetrics
from pdiffcopy.server.openapi import DOCUMENT_PATH, render_document
from pdiffcopy.local.file import LocalFile
from pdiffcopy.local.paths import Root, refuse_hard_links
from pdiffcopy.core.protocol import LEASE_HEADER, NO_FOLLOW_HEADER
from pdiffcopy.core.ratelimit import TokenBucket
from pdiffcopy.server.slots import FairSlots
from pdiffcopy.server.treeserver import add_tree_routes

logger = logging.getLogger(__name__)

#: Largest region one hash request may cover. A client asks per segment
#: (64 MiB by default); 1 GiB leaves room for large blocks and still bounds
#: the work one request can demand.
MAX_HASH_REQUEST_BYTES = 1024 * 1024 * 1024

#: Most blocks one hash request may cover (bounds the answer's size).
MAX_HASH_REQUEST_BLOCKS = 1024 * 1024

#: What a PATCH body may be (sent as ``Accept-Patch`` with a stat answer): one raw range,
#: several as multipart/byteranges, or compressed pieces (docs/protocol.rst).
PATCH_TYPES = f"application/octet-stream, multipart/byteranges, {FRAMES_TYPE}"

#: Largest file a resize may create: beyond what any disk holds, so a bogus
#: size is refused even before the free space check.
MAX_FILE_SIZE = 1 << 50

#: Most ranges one chunk list request may name (16 bytes each in its body): the finer pass
#: of a sync asks for the ranges the first pass left unmatched, fewer than this for any
#: file edited in places rather than rewritten.
MAX_CHUNK_RANGES = 65536

#: A range of a chunk list request: offset and length, little-endian.
CHUNK_RANGE_ENTRY = struct.Struct("<QQ")

#: An extent of a data map answer, and a range of a punch request: offset and length, little-endian.
EXTENT_ENTRY = CHUNK_RANGE_ENTRY

#: Most ranges one punch request may name (16 bytes each in its body).
MAX_PUNCH_RANGES = 65536

#: Chunks encoded per write of a chunk list answer (12 KiB): streamed, not held whole.
CHUNKS_PER_WRITE = 1024

#: Most moves one copy request may name (24 bytes each in its body), and most bytes it may
#: copy: a client sends at most engine.chunkdelta's COPY_REQUEST_MOVES and COPY_REQUEST_BYTES.
MAX_COPY_MOVES = 16384
MAX_COPY_REQUEST_BYTES = 1024 * 1024 * 1024

#: A move of a copy request: from offset, to offset, length, little-endian.
COPY_MOVE_ENTRY = struct.Struct("<QQQ")

#: The prefix of the server's own endpoints.
API_PREFIX = "/.pdiffcopy"

#: Liveness: the one request answered without the token (a probe has none),
#: and it says nothing but that the server answers.
HEALTH_PATH = f"{API_PREFIX}/health"

#: Requests per worker process that do work at once: the hash jobs are
#: bounded by half of it (:data:`MAX_CONCURRENT_HASHES`). Transfers wait on
#: the network and hashing releases the GIL, so a few per process keep a
#: client's hashing and transfer connections (and other clients') all served.
#: The request threads themselves are many more (``guard.REQUEST_THREADS``),
#: so that slow clients holding some cannot starve the others.
THREADS_PER_WORKER = 8

#: Hash requests one worker process runs at once. Half its request threads:
#: hashing is CPU and disk bound, so more of it at once would not finish
#: sooner, and the other half stays free for the reads, writes and control
#: requests of the syncs in progress (a sync that has hashed must be able to
#: transfer, or a crowd of new syncs would starve it).
MAX_CONCURRENT_HASHES = max(1, THREADS_PER_WORKER // 2)

#: Seconds a hash request waits for one of those slots before it is refused
#: with 503. Hashing a 64 MiB segment from the page cache takes tens of
#: milliseconds, so an ordinary burst (one client's first requests) is
#: absorbed, while a crowd is told to come back instead of queueing.
HASH_SLOT_WAIT_SECONDS = 0.5

#: The Retry-After of a 503, in seconds: long enough for a few segments to
#: be hashed, short enough that a refused client loses little time.
HASH_RETRY_AFTER_SECONDS = 1

#: Hash slots of a worker process one client address may hold while other
#: clients want some too: half, so a client keeping many hash requests in
#: flight (slow methods, 1 KiB blocks) leaves the other half to everybody else.
#: Per process: with W worker processes a client holds at most W times this.
MAX_HASHES_PER_CLIENT = max(1, MAX_CONCURRENT_HASHES // 2)

#: Seconds a client counts as wanting hash slots after its last hash request:
#: a few times the Retry-After, so a refused client waiting to ask again
#: still holds the others to their share.
HASH_CONTENTION_SECONDS = 5 * HASH_RETRY_AFTER_SECONDS


class AnyPathConverter(PathConverter):
    """Werkzeug's ``path`` converter, but matching any first character and newlines.

    The stock one wants a first character other than ``/`` and no newline
    after it, so ``/.pdiffcopy/resize//x`` or a name with a newline fell
    through to other rules (405, a generic 404, or the reserved-name 403).
    Matching everything lets one function, :func:`pdiffcopy.local.paths.clean_relative_path`,
    judge every path, with a message that names the problem.
    """

    regex = r"[\s\S]+?"
    part_isolating = False  # it matches slashes (Werkzeug guesses from a literal "/")


@dataclass
class ServerConfig:
    """What the application needs to know."""

    root: str
    token: Optional[str] = None
    #: The hash methods accepted (:func:`~pdiffcopy.core.hashing.accepted_methods`).
    hash_methods: Tuple[str, ...] = field(default_factory=accepted_methods)
    #: Clients may set owners and setuid/setgid bits (``--trust-clients``).
    trust_clients: bool = False
    #: Clients may change files with several hard links in place (``--write-hard-links``).
    write_hard_links: bool = False
    #: Where the write leases live (default: a new temporary directory, made
    #: before gunicorn forks its workers, so that they all share it).
    lease_directory: Optional[str] = None
    #: The directory of the metrics of all worker processes
    #: (:func:`pdiffcopy.server.metrics.make_directory`); None: this process's only.
    metrics_directory: Optional[str] = None
    #: The port of ``--metrics-listen``: requests arriving there get the
    #: metrics without the token, and nothing else.
    metrics_port: Optional[int] = None
    #: Serve the API of pdiffcopy 1.0.1's clients (``--legacy-api``); else refuse it with a hint.
    legacy_api: bool = False
    #: ``--max-rate``: most bytes per second of file data served and received, for all
    #: clients and worker processes together (None: no limit).
    max_rate: Optional[int] = None


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
    root = Root(config.root)
    expected = config.token.encode() if config.token else None
    # Per worker process: gunicorn forks after create_app (preload_app), and
    # every child gets its own copy, with all its slots free.
    hash_slots = FairSlots(MAX_CONCURRENT_HASHES, MAX_HASHES_PER_CLIENT, HASH_CONTENTION_SECONDS)
    # Shared by every worker process: made here, before gunicorn forks them.
    leases = Leases(config.lease_directory)
    metrics = ServerMetrics(config.metrics_directory)
    # In shared memory, made before gunicorn forks: one cap for every worker process (a
    # bucket per worker would let N workers move N times the rate).
    rate_limit = TokenBucket(config.max_rate, shared=True) if config.max_rate else None
    app.extensions["pdiffcopy.server.metrics"] = metrics  # for gunicorn's child_exit hook (service.py)

    def lease_of_request() -> Optional[str]:
        return request.headers.get(LEASE_HEADER) or None

    def renew(info: os.stat_result, path: str) -> None:
        """A leased read or flush: the lease must still be the client's; it is renewed."""
        lease = lease_of_request()
        if lease:
            with leases.writing(info, lease, path):
                pass
    document = render_document()

    def metrics_answer() -> Response:
        body, content_type = metrics.render()
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
        if expected is None or request.path == HEALTH_PATH:
            return None
        # "Bearer TOKEN", the scheme in any case (RFC 9110, section 11.1).
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        supplied = credentials.lstrip(" ").encode("latin-1", "replace")
        # Constant-time comparison: the time to refuse says nothing about the
        # token. Both checks run always, so neither shortens the other.
        token_matches = hmac.compare_digest(supplied, expected)
        scheme_matches = scheme.lower() == "bearer"
        if not (token_matches and scheme_matches):
            raise AuthenticationFailed("Missing or wrong token (send Authorization: Bearer ...)")
        return None

    @app.url_value_preprocessor
    def keep_path_bytes(endpoint: Optional[str], values: Optional[dict]) -> None:
        if values and "\ufffd" in values.get("path", ""):
            values["path"] = undecoded_path(values["path"])

    @app.after_request
    def count_request(response: Response) -> Response:
        # The view's name, never the path: a label's values must stay few.
        endpoint = g.get("endpoint_label") or (request.url_rule.endpoint if request.url_rule else UNMATCHED)
        metrics.count_request(endpoint, response.status_code)
        return response

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

    @app.get(f"{API_PREFIX}/stat/<path:path>")
    def stat_file(path: str):
        """Size, mtime and type of a file, or 404."""
        return jsonify(describe(served(root, path).status()))

    @app.get(f"{API_PREFIX}/hashes/<path:path>")
    def hashes(path: str):
        """The digests of the blocks of one range (offset, length) or of several (Range header)."""
        method = validate_method(request.args.get("method", ""))
        if method not in config.hash_methods:
            raise BadRequest(f"This server does not accept the hash method {method!r} (it accepts "
                             f"{', '.join(config.hash_methods)}); choose one with -m")
        block_size = int_arg("block_size", MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)
        fd = served(root, path).open_descriptor(os.O_RDONLY)
        try:
            info = os.fstat(fd)
            check_preconditions(info)
            renew(info, path)
            ranges = hash_ranges(block_size, info.st_size)
            # Checked before taking a slot: a bad request is refused at once.
            client = request.remote_addr or ""
            if not hash_slots.acquire(client, timeout=HASH_SLOT_WAIT_SECONDS):
                raise ServerBusy(f"Busy: {MAX_CONCURRENT_HASHES} hash requests are running "
                                 f"(at most {MAX_HASHES_PER_CLIENT} per client while others wait); "
                                 f"retry in {HASH_RETRY_AFTER_SECONDS} s", HASH_RETRY_AFTER_SECONDS)
            metrics.hash_jobs.inc()
            try:
                digests = b"".join(hash_region(fd, offset, length, block_size, method)
                                   for offset, length in ranges)
            except OSError as error:
                raise storage_error(error, f"read {path}") from None
            finally:
                metrics.hash_jobs.dec()
                hash_slots.release(client)
        finally:
            os.close(fd)
        response = Response(digests, mimetype="application/octet-stream")
        response.headers["X-Digest-Size"] = str(digest_size(method))
        response.headers["ETag"] = etag(info)
        return response

    @app.post(f"{API_PREFIX}/chunks/<path:path>")
    def chunks_of_file(path: str):
        """The content-defined chunks of the file, or of the ranges in the body (``--delta chunks``).

        Cut here, on the server's cores, and streamed as they are cut: 12 bytes a chunk
        (its length and an 8-byte digest; offsets follow from the lengths).
        """
        try:
            average = cdc.check_average(int_arg("average", 0, cdc.MAX_AVERAGE))
        except UsageError as error:
            raise BadRequest(str(error)) from None
        asked = binary_body(CHUNK_RANGE_ENTRY.size, MAX_CHUNK_RANGES)
        fd = served(root, path).open_descriptor(os.O_RDONLY)
        try:
            info = os.fstat(fd)
            check_preconditions(info)
            renew(info, path)
            ranges = [(offset, length) for offset, length in CHUNK_RANGE_ENTRY.iter_unpack(asked)] \
                if asked else ([(0, info.st_size)] if info.st_size else [])
            check_disjoint(ranges, info.st_size, ordered=True)
            client = request.remote_addr or ""
            # Cutting is CPU and disk work, as hashing is: it takes one of the same slots.
            if not hash_slots.acquire(client, timeout=HASH_SLOT_WAIT_SECONDS):
                raise ServerBusy(f"Busy: {MAX_CONCURRENT_HASHES} hash requests are running; "
                                 f"retry in {HASH_RETRY_AFTER_SECONDS} s", HASH_RETRY_AFTER_SECONDS)
        except BaseException:
            os.close(fd)
            raise
        metrics.hash_jobs.inc()

        def finished() -> None:
            # On the response's close, which the server calls whether or not the body was sent.
            os.close(fd)
            metrics.hash_jobs.dec()
            hash_slots.release(client)

        # Not direct_passthrough: Werkzeug then hands the bare generator to the server and
        # never calls the response's close.
        response = Response(_chunks_body(fd, ranges, average, path), mimetype="application/octet-stream")
        response.call_on_close(finished)
        response.headers["ETag"] = etag(info)
        return response

    @app.post(f"{API_PREFIX}/copy-ranges/<path:path>")
    def copy_ranges(path: str):
        """Copy ranges of the file ``from`` to other offsets of the temporary file ``path``.

        The temporary takes the mode of ``from`` (even with no moves), as a clone of it would.

        The shift-tolerant delta builds a new temporary of a target from the old target's
        bytes that the source still has (wherever they moved) and the bytes it sends.
        """
        require_temporary(path)
        origin_path = path_arg("from")
        moves = [(offset, to, length) for offset, to, length
                 in COPY_MOVE_ENTRY.iter_unpack(binary_body(COPY_MOVE_ENTRY.size, MAX_COPY_MOVES))]
        origin_fd = served(root, origin_path).open_descriptor(os.O_RDONLY)
        try:
            fd = served(root, path, follow=False).open_descriptor(os.O_WRONLY)
            try:
                info, origin = os.fstat(fd), os.fstat(origin_fd)
                refuse_hard_links(info, path, config.write_hard_links)
                # Read from anywhere in the old file (twice, even); written once each, inside the file.
                check_disjoint([(offset, length) for offset, _, length in moves], origin.st_size, ordered=False,
                               overlap=True)
                # The ranges written must not overlap (nor leave the file: writes never grow it).
                check_disjoint([(to, length) for _, to, length in moves], info.st_size, ordered=False)
                if sum(length for _, _, length in moves) > MAX_COPY_REQUEST_BYTES:
                    raise PayloadTooLarge(f"At most {MAX_COPY_REQUEST_BYTES} bytes per copy request")
                with leases.writing(info, lease_of_request(), path):
                    # The new version keeps the old one's mode, as a clone of it would.
                    os.fchmod(fd, stat_module.S_IMODE(origin.st_mode))
                    for offset, to, length in moves:
                        try:
                            copied = copy_available(origin_fd, fd, offset, length, target_offset=to)
                        except OSError as error:
                            raise storage_error(error, f"copy {origin_path} to {path}") from None
                        if copied < length:
                            raise Conflict(f"{origin_path} became shorter during the copy")
                        start_writeback(fd, to, length)
            finally:
                os.close(fd)
        finally:
            os.close(origin_fd)
        return jsonify(copied=sum(length for _, _, length in moves))

    @app.route("/<path:path>", methods=["GET", "HEAD"])
    def read_file(path: str):
        """The file's bytes: all of them, one range (206), or several (multipart/byteranges)."""
        fd = served(root, path).open_descriptor(os.O_RDONLY)
        try:
            info = os.fstat(fd)
            check_preconditions(info)
            return ranged_response(fd, info, metrics, rate_limit)
        except BaseException:
            os.close(fd)
            raise

    @app.route("/<path:path>", methods=["PATCH"])
    def write_ranges(path: str):
        """Write byte ranges into an existing file, in place."""
        fd = served(root, path).open_descriptor(os.O_WRONLY)
        try:
            info = os.fstat(fd)
            check_preconditions(info)
            refuse_hard_links(info, path, config.write_hard_links)
            with leases.writing(info, lease_of_request(), path):
                written = receive_ranges(fd, info.st_size, path, metrics, rate_limit,
                                         sparse=request.args.get("sparse") == "1")
        finally:
            os.close(fd)
        return jsonify(written=written)

    @app.get(f"{API_PREFIX}/datamap/<path:path>")
    def data_map(path: str):
        """Where the range ``offset``/``length`` of the file holds data: its extents, the rest are holes.

        At most MAX_DATA_MAP_EXTENTS extents (16 bytes each); an answer that long may have
        more after its last extent: ask again from there.
        """
        offset = int_arg("offset", 0, MAX_FILE_SIZE)
        length = int_arg("length", 0, MAX_FILE_SIZE)
        fd = served(root, path).open_descriptor(os.O_RDONLY)
        try:
            info = os.fstat(fd)
            check_preconditions(info)
            renew(info, path)
            try:
                extents = data_extents(fd, offset, length, limit=MAX_DATA_MAP_EXTENTS)
            except OSError as error:
                raise storage_error(error, f"read {path}") from None
        finally:
            os.close(fd)
        response = Response(b"".join(EXTENT_ENTRY.pack(start, size) for start, size in extents),
                            mimetype="application/octet-stream")
        response.headers["ETag"] = etag(info)
        return response

    @app.post(f"{API_PREFIX}/punch/<path:path>")
    def punch_file(path: str):
        """Make the ranges in the body holes (zeros where the file system cannot), in place.

        A write: refused like a PATCH while another client holds the lease, or when If-Match fails.
        """
        ranges = [(offset, length) for offset, length
                  in EXTENT_ENTRY.iter_unpack(binary_body(EXTENT_ENTRY.size, MAX_PUNCH_RANGES))]
        fd = served(root, path).open_descriptor(os.O_WRONLY)
        try:
            info = os.fstat(fd)
            check_preconditions(info)
            refuse_hard_links(info, path, config.write_hard_links)
            check_disjoint(ranges, info.st_size, ordered=True)
            with leases.writing(info, lease_of_request(), path):
                try:
                    holes = punch_ranges(fd, ranges, path)
                except OSError as error:
                    raise storage_error(error, f"write {path}") from None
        finally:
            os.close(fd)
        return jsonify(punched=sum(length for _, length in ranges), holes=holes)

    @app.post(f"{API_PREFIX}/resize/<path:path>")
    def resize_file(path: str):
        """Create the file if missing and make it exactly ``size`` bytes long."""
        size = int_arg("size", 0, MAX_FILE_SIZE)
        # Grown by a hole (the source is sparse): only this much data will be written.
        data_bytes = int_arg("data", 0, MAX_FILE_SIZE) if "data" in request.args else None
        file = served(root, path)
        fd, created = file.open_writer()
        try:
            if not created:
                refuse_hard_links(os.fstat(fd), path, config.write_hard_links)
            with leases.writing(os.fstat(fd), None if created else lease_of_request(), path):
                try:
                    resize(fd, size, data_bytes)
                except OSError as error:
                    raise storage_error(error, f"resize {path}") from None
            return jsonify(describe(os.fstat(fd)))
        except BaseException:
            if created:  # a refused resize leaves no new empty file behind
                with contextlib.suppress(PdiffcopyError):
                    file.unlink()
            raise
        finally:
            os.close(fd)

    @app.post(f"{API_PREFIX}/fsync/<path:path>")
    def fsync_file(path: str):
        """Flush the file's data and its directory entry to disk."""
        file = served(root, path)
        fd = file.open_descriptor(os.O_RDONLY)
        try:
            renew(os.fstat(fd), path)
            try:
                os.fsync(fd)
            except OSError as error:
                raise storage_error(error, f"flush {path}") from None
        finally:
            os.close(fd)
        file.flush_directory()
        return jsonify(flushed=True)

    @app.post(f"{API_PREFIX}/clone/<path:path>")
    def clone_file(path: str):
        """Create the temporary file ``path`` as a copy of ``from`` (reflink where possible)."""
        require_temporary(path)
        origin = served(root, path_arg("from"))
        try:
            temporary = origin.create_temporary(clone=True, relative=path)
            temporary.close()
        finally:
            origin.close()
        return jsonify(method=temporary.clone_method)

    @app.post(f"{API_PREFIX}/rename/<path:path>")
    def rename_file(path: str):
        """Atomically replace ``to`` with the temporary file ``path``."""
        require_temporary(path)
        destination = path_arg("to")
        temporary, target = served(root, path), served(root, destination, follow=False)
        try:
            replaced: Optional[os.stat_result] = target.status()  # the name itself, not where it leads
        except FileMissing:
            replaced = None
        # Replacing a file counts as writing it: not while another client holds its lease.
        with leases.writing(replaced, lease_of_request(), destination) if replaced \
                else contextlib.nullcontext():
            temporary.replace(target)
        return jsonify(renamed=True)

    @app.post(f"{API_PREFIX}/lease/<path:path>")
    def take_lease(path: str):
        """Take the write lease on a file: until it ends, nobody else may write it."""
        fd = served(root, path).open_descriptor(os.O_RDONLY)
        try:
            lease = leases.acquire(os.fstat(fd), path)
        finally:
            os.close(fd)
        return jsonify(lease=lease, seconds=LEASE_SECONDS)

    @app.delete(f"{API_PREFIX}/lease/<path:path>")
    def end_lease(path: str):
        """End a write lease; 412 when it lapsed and somebody else wrote meanwhile."""
        lease = lease_of_request()
        if not lease:
            raise BadRequest(f"Missing header: {LEASE_HEADER}")
        fd = served(root, path).open_descriptor(os.O_RDONLY)
        try:
            leases.release(os.fstat(fd), lease, path)
        finally:
            os.close(fd)
        return jsonify(released=True)

    @app.delete(f"{API_PREFIX}/temporary/<path:path>")
    def delete_temporary(path: str):
        """Remove a temporary file left by an aborted atomic sync."""
        require_temporary(path)
        served(root, path, follow=False).unlink()
        return jsonify(removed=True)

    @app.route("/", methods=["GET", "HEAD"])
    def index():
        return jsonify(server="pdiffcopy", version=__version__)

    add_tree_routes(app, root, trust_clients=config.trust_clients,
                    write_hard_links=config.write_hard_links, metrics=metrics, rate_limit=rate_limit)
    add_legacy_api(app, root, leases, hash_slots, enabled=config.legacy_api, hash_methods=config.hash_methods,
                   write_hard_links=config.write_hard_links)
    return app


def undecoded_path(value: str) -> str:
    """A route's ``path`` with the bytes of the URL that are not UTF-8 kept as they are.

    Werkzeug decodes the URL path as UTF-8 and turns the bytes it cannot
    decode into U+FFFD, so a file named ``b"a\\xff"`` (``/a%FF``) would be
    looked for as ``"a\\ufffd"``, another name. The WSGI ``PATH_INFO`` still
    has the bytes (as latin-1); decoded as file names are (:func:`os.fsdecode`),
    they give the name back. The route's literal prefix is ASCII, so the value
    is what follows that prefix in the undecoded path.
    """
    decoded = request.path
    try:
        undecoded = "/" + os.fsdecode(request.environ.get("PATH_INFO", "").encode("latin-1")).lstrip("/")
    except UnicodeError:
        return value
    prefix = decoded[: len(decoded) - len(value)]
    if not decoded.endswith(value) or not undecoded.startswith(prefix):
        return value  # not the shape Werkzeug gives: keep its reading
    return undecoded[len(prefix):]


def one_line(text: str) -> str:
    """``text`` with every control character escaped, so that it stays one line.

    Error messages and log lines quote paths, and a path may hold a newline
    (``%0A`` in a URL): unescaped, it would split a client's one-line error
    and let a request forge lines in the server's log.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def describe(info: os.stat_result) -> dict:
    """The JSON description of a file."""
    kind = "file" if stat_module.S_ISREG(info.st_mode) else (
        "directory" if stat_module.S_ISDIR(info.st_mode) else "other")
    return {"type": kind, "size": info.st_size, "mtime_ns": info.st_mtime_ns,
            "mode": stat_module.S_IMODE(info.st_mode), "etag": etag(info)}


def int_arg(name: str, minimum: int, maximum: int) -> int:
    """A required integer query parameter within bounds."""
    value = request.args.get(name)
    if value is None:
        raise BadRequest(f"Missing parameter: {name}")
    if not re.fullmatch(r"[0-9]{1,20}", value):  # not isdigit(): it accepts "²"
        raise BadRequest(f"Parameter {name} must be a non-negative integer")
    number = int(value)
    if not minimum <= number <= maximum:
        raise BadRequest(f"Parameter {name} must be between {minimum} and {maximum}")
    return number


def path_arg(name: str) -> str:
    """A required query parameter naming a file (checked like any path when opened).

    Decoded from the raw query string as file names are (bytes that are not
    UTF-8 kept as surrogate escapes), not by Werkzeug, which replaces them.
    """
    raw = request.environ.get("QUERY_STRING", "")
    values = parse_qs(raw, encoding="utf-8", errors="surrogateescape").get(name) or [""]
    value = values[0]
    if not value:
        raise BadRequest(f"Missing parameter: {name}")
    return value


def hash_ranges(block_size: int, size: int) -> List[ByteRange]:
    """The block-aligned ranges a hash request asks for, checked against its bounds.

    One range comes as ``offset`` and ``length`` parameters; several as a
    ``Range: bytes=...`` header (used to read back scattered written blocks).
    Ranges may reach past the end of the file (blocks the file lacks hash
    what there is of them) but may not start past it.
    """
    header = request.headers.get("Range")
    if header is not None:
        ranges = [(offset, length) for offset, length in
                  parse_explicit_ranges(header)]
    else:
        ranges = [(int_arg("offset", 0, MAX_FILE_SIZE), int_arg("length", 0, MAX_HASH_REQUEST_BYTES))]
    if overlapping(ranges):
        # Each range's blocks are hashed and answered, so overlapping ranges
        # would hash the same bytes again and again (a client never asks that).
        raise BadRequest("Hash ranges must not overlap")
    total = 0
    for offset, length in ranges:
        if offset % block_size:
            raise BadRequest("Every range must start at a multiple of block_size")
        if offset > size:
            raise RangeNotSatisfiable(f"offset {offset} is past the end of the file", size)
        total += length
    if total > MAX_HASH_REQUEST_BYTES:
        raise BadRequest(f"At most {MAX_HASH_REQUEST_BYTES} bytes per hash request")
    if sum(-(-length // block_size) for _, length in ranges) > MAX_HASH_REQUEST_BLOCKS:
        raise BadRequest(f"At most {MAX_HASH_REQUEST_BLOCKS} blocks per hash request")
    return ranges


def binary_body(entry_size: int, max_entries: int) -> bytes:
    """A request body of fixed-size binary entries, read whole; checked before it is read.

    :raises PayloadTooLarge: For more than ``max_entries`` entries.
    :raises BadRequest: For a body that is not whole entries, or ends early.
    """
    length = request.content_length or 0
    if length > entry_size * max_entries:
        raise PayloadTooLarge(f"The request body has {length} bytes; at most {max_entries} entries "
                              f"of {entry_size} bytes are allowed")
    if length % entry_size:
        raise BadRequest(f"The request body is not a whole number of {entry_size}-byte entries")
    if not length:
        return b""
    body = open_body(request.environ, length)
    buffer = bytearray(length)
    view, got = memoryview(buffer), 0
    try:
        while got < length:
            count = body.readinto(view[got:])
            if not count:
                raise BadRequest("The request body ended early")
            got += count
    finally:
        body.finish()
    return bytes(buffer)


def check_disjoint(ranges: List[ByteRange], size: int, ordered: bool, overlap: bool = False) -> None:
    """Refuse empty ranges, ranges past the end of a file of ``size`` bytes, and overlapping ones.

    :param ordered: The ranges must also come in ascending order (a chunk list follows their order).
    :param overlap: Overlapping ranges are fine (ranges read, not written).
    """
    for offset, length in ranges:
        if length == 0:
            raise BadRequest("Empty range")
        if offset + length > size:
            raise RangeNotSatisfiable(f"Range {offset}+{length} is past the end of the file ({size} bytes)", size)
    in_order = sorted(ranges)
    if ordered and in_order != ranges:
        raise BadRequest("The ranges must come in ascending order")
    if not overlap and any(a[0] + a[1] > b[0] for a, b in zip(in_order, in_order[1:])):
        raise BadRequest("The ranges overlap")


def _chunks_body(fd: int, ranges: List[ByteRange], average: int, path: str) -> Iterator[bytes]:
    """The chunk list of ``ranges`` of ``fd``, sent as it is cut (the caller closes ``fd``)."""
    pending: List[cdc.Chunk] = []
    try:
        for offset, length in ranges:
            for chunk in cdc.cut_stream(RangeReader(fd, offset, length), offset, average):
                pending.append(chunk)
                if len(pending) >= CHUNKS_PER_WRITE:
                    yield cdc.encode(pending)
                    pending = []
    except (OSError, EOFError) as error:
        # Mid-answer nothing can be said any more: the client sees a short list and refuses it.
        logger.warning("Cutting %s failed: %s", one_line(path), error)
        return
    if pending:
        yield cdc.encode(pending)


def served(root: Root, path: str, follow: bool = True) -> LocalFile:
    """The file a request names, confined beneath the root (:meth:`LocalFile.below`).

    Every view reaches its files this way: only regular files are opened
    (FIFOs and devices are refused with 409 without being opened or waited
    on), nothing outside the root, and a symlink in the last name only when
    it stays inside (``follow``), and never when the request says
    :data:`~pdiffcopy.core.protocol.NO_FOLLOW_HEADER` (a tree's member, which is
    a file only if it is one). Messages name the path the client sent.
    """
    value = request.headers.get(NO_FOLLOW_HEADER, "0")
    if value not in ("0", "1"):
        raise BadRequest(f"Header {NO_FOLLOW_HEADER} must be 0 or 1")
    return LocalFile.below(root, path, follow=follow and value == "0", name=path)


def require_temporary(path: str) -> None:
    """Refuse to let the atomic-write endpoints touch anything but temporary files."""
    if not is_temporary_name(path.rstrip("/").rpartition("/")[2]):
        raise AccessDenied(f"Not a pdiffcopy temporary file: {path}")


def check_preconditions(info: os.stat_result) -> None:
    """Honour ``If-Match``: the client's idea of the file must still be true."""
    wanted = request.headers.get("If-Match")
    if wanted and wanted.strip() != "*" and etag(info) not in [t.strip() for t in wanted.split(",")]:
        raise Conflict("The file changed since the sync started (ETag mismatch)")


def not_modified(info: os.stat_result) -> bool:
    """Whether a GET or HEAD may be answered 304 Not Modified (RFC 9110, section 13.2.2).

    ``If-None-Match`` (a weak comparison, ``*`` matching any file) takes
    precedence; only without it does ``If-Modified-Since`` count, compared
    with the whole seconds that ``Last-Modified`` shows. A date that cannot
    be parsed is ignored, as the RFC says.
    """
    if "If-None-Match" in request.headers:
        return request.if_none_match.contains_weak(unquote_etag(etag(info))[0])
    since = request.if_modified_since
    return since is not None and int(info.st_mtime) <= since.timestamp()


def ranged_response(fd: int, info: os.stat_result, metrics: Optional[ServerMetrics] = None,
                    rate_limit: Optional[TokenBucket] = None) -> Response:
    """Answer a GET or HEAD for an open file, honouring ``Range``. Takes ownership of ``fd``.

    The file bytes sent are counted in ``metrics`` and taken from ``rate_limit`` (``--max-rate``).
    """
    size = info.st_size
    headers = {"Accept-Ranges": "bytes", "ETag": etag(info),
               "Last-Modified": time.strftime("%a, %d %b %Y %H:%M:%S GMT",
                                              time.gmtime(info.st_mtime))}
    if not_modified(info):
        os.close(fd)
        return Response(status=304, headers=headers)
    header = request.headers.get("Range")
    if header and not is_bytes_range(header):
        header = None  # a unit we do not know is ignored: the whole file (RFC 9110, section 14.2)
    ranges: List[ByteRange] = [(0, size)]
    status = 200
    boundary = new_boundary()
    if header and (not request.headers.get("If-Range")
                   or request.headers.get("If-Range") == headers["ETag"]):
        ranges = parse_range_header(header, size)
        status = 206
        if len(ranges) > 1:
            answer = multipart_length(ranges, size, boundary)
            if answer > sum(length for _, length in ranges) + MAX_MULTIPART_OVERHEAD:
                # Many tiny ranges, whose part headers would outweigh their
                # data: a broken client or an attack (RFC 9110, 14.2 lets a
                # server ignore or refuse them). The whole file when it is no
                # larger than that answer, a refusal otherwise.
                if size > answer:
                    raise RangeNotSatisfiable(
                        f"Too many small ranges: their part headers would exceed "
                        f"{MAX_MULTIPART_OVERHEAD} bytes; ask for fewer, larger ranges", size)
                ranges, status = [(0, size)], 200
    if request.method == "HEAD":
        os.close(fd)
        response = Response(b"", status=200, headers=headers, mimetype="application/octet-stream")
        # Set after construction: an empty body would otherwise announce 0 bytes.
        response.headers["Content-Length"] = str(size)
        return response
    level = accepted_frames_level(request.headers.get("Accept"))
    if status == 206 and level is not None:
        # Our client asked for compressed ranges, at the level it chose from the link it measured:
        # compressed here, in this request's thread, so the client's connections compress on as
        # many of the server's cores. Chunked: the compressed length is known only once sent.
        headers["Vary"] = "Accept"
        return Response(_frames_body(fd, ranges, metrics, rate_limit, level), status=206, headers=headers,
                        content_type=FRAMES_TYPE, direct_passthrough=True)
    if status == 200:
        headers["Vary"] = "Accept-Encoding"
        if accepts_zstd(request.headers.get("Accept-Encoding")):
            # RFC 9110 content coding of the whole file; another representation, so another ETag.
            # Ranges are never coded: a range of a coded representation is a range of the
            # compressed bytes, which plain clients would take for file bytes.
            headers["ETag"] = headers["ETag"][:-1] + '-zstd"'
            headers["Content-Encoding"] = ENCODING
            return Response(_coded_body(fd, size, metrics, rate_limit), status=200, headers=headers,
                            mimetype="application/octet-stream", direct_passthrough=True)
    if len(ranges) == 1:
        offset, length = ranges[0]
        if status == 206:
            headers["Content-Range"] = format_content_range(offset, length, size)
        headers["Content-Length"] = str(length)
        return Response(_file_body(fd, ranges, None, metrics=metrics, rate_limit=rate_limit),
                        status=status, headers=headers,
                        mimetype="application/octet-stream", direct_passthrough=True)
    headers["Content-Length"] = str(multipart_length(ranges, size, boundary))
    return Response(_file_body(fd, ranges, size, boundary, metrics, rate_limit), status=206, headers=headers,
                    content_type=multipart_content_type(boundary), direct_passthrough=True)


def _file_body(fd: int, ranges: List[ByteRange], multipart_size: Optional[int],
               boundary: str = "", metrics: Optional[ServerMetrics] = None,
               rate_limit: Optional[TokenBucket] = None) -> Iterator[bytes]:
    """The body of a GET: the ranges' bytes, as multipart parts (delimited by ``boundary``)
    when ``multipart_size`` is set.

    Plain reads, not sendfile(2): on loopback here a pread-and-send loop ran
    at 2.3 GB/s and sendfile at 1.5 GB/s. Closes ``fd`` when done.
    """
    try:
        for offset, length in ranges:
            if multipart_size is not None:
                yield part_header(offset, length, multipart_size, boundary)
            position, end = offset, offset + length
            while position < end:
                data = os.pread(fd, min(TRANSFER_CHUNK_SIZE, end - position), position)
                if not data:
                    return  # the file shrank: the client sees a short body and fails
                position += len(data)
                if metrics is not None:
                    metrics.bytes_served.inc(len(data))
                if rate_limit is not None:
                    rate_limit.take(len(data))
                yield data
        if multipart_size is not None:
            yield closing_delimiter(boundary)
    finally:
        os.close(fd)


def _frames_body(fd: int, ranges: List[ByteRange], metrics: Optional[ServerMetrics],
                 rate_limit: Optional[TokenBucket], level: int) -> Iterator[bytes]:
    """The body of a GET for compressed ranges: a header and a zstd frame per piece, compressed
    at ``level``. Closes ``fd``."""
    try:
        for offset, length in pieces(ranges):
            data = os.pread(fd, length, offset)
            if len(data) != length:
                return  # the file shrank: the client sees a short body and fails
            framed = frame(offset, data, level)
            if metrics is not None:
                metrics.bytes_served.inc(length)
                metrics.compressed_bytes.labels("sent").inc(length)
            if rate_limit is not None:
                rate_limit.take(len(framed))  # --max-rate limits the network, so the bytes sent
            yield framed
    finally:
        os.close(fd)


def _coded_body(fd: int, size: int, metrics: Optional[ServerMetrics],
                rate_limit: Optional[TokenBucket]) -> Iterator[bytes]:
    """The whole file as one zstd stream (``Content-Encoding: zstd``). Closes ``fd``."""
    try:
        compressor = stream_compressor()
        position = 0
        while position < size:
            data = os.pread(fd, min(TRANSFER_CHUNK_SIZE, size - position), position)
            if not data:
                break
            position += len(data)
            if metrics is not None:
                metrics.bytes_served.inc(len(data))
                metrics.compressed_bytes.labels("sent").inc(len(data))
            out = compressor.compress(data)
            if out:
                if rate_limit is not None:
                    rate_limit.take(len(out))
                yield out
        yield compressor.flush()
    finally:
        os.close(fd)


def receive_ranges(fd: int, size: int, path: str, metrics: Optional[ServerMetrics] = None,
                   rate_limit: Optional[TokenBucket] = None, sparse: bool = False) -> int:
    """Write the ranges of a PATCH body into ``fd``; return the bytes written.

    Every range must lie inside the file as it is: writes never grow a file
    (a resize does that, bounded by free space), so a bogus offset cannot
    create a huge sparse file.

    :param sparse: Punch the runs of whole zero blocks instead of writing them (``--sparse``).
    """
    if sparse:
        unit = os.fstat(fd).st_blksize

        def write(data, offset: int) -> None:
            write_sparse(fd, data, offset, unit, path)
    else:
        def write(data, offset: int) -> None:
            write_all(fd, data, offset)

    if (request.content_type or "").split(";")[0].strip().lower() == FRAMES_TYPE:
        return _receive_frames(fd, write, size, path, metrics, rate_limit)
    boundary = boundary_of(request.content_type or "")
    single = None
    if boundary is None:
        single = parse_content_range(request.headers.get("Content-Range", ""))
        if request.content_length is not None and request.content_length != single[1]:
            raise BadRequest("Content-Length does not match Content-Range")
    body = open_body(request.environ, request.content_length)
    buffer = memoryview(bytearray(TRANSFER_CHUNK_SIZE))
    try:
        if boundary is None:
            assert single is not None  # parsed above
            return _receive_range(body, buffer, fd, write, single[0], single[1], size, path, metrics,
                                  rate_limit)
        written = 0
        for offset, length, _ in read_parts(body, boundary):
            written += _receive_range(body, buffer, fd, write, offset, length, size, path, metrics, rate_limit)
        return written
    finally:
        body.finish()


def _receive_frames(fd: int, write: Callable[..., None], size: int, path: str, metrics: Optional[ServerMetrics],
                    rate_limit: Optional[TokenBucket]) -> int:
    """Write the pieces of a compressed PATCH body; each is decompressed and checked before it is written."""
    body = open_body(request.environ, request.content_length)
    written = 0
    try:
        try:
            for offset, data, wire_length in read_frames(lambda count: _read_some(body, count)):
                if offset + len(data) > size:
                    raise RangeNotSatisfiable(f"Range {offset}+{len(data)} is outside the file ({size} bytes)",
                                              size)
                try:
                    write(data, offset)
                except OSError as error:
                    raise storage_error(error, f"write {path}") from None
                written += len(data)
                if metrics is not None:
                    metrics.bytes_received.inc(len(data))
                    metrics.compressed_bytes.labels("received").inc(len(data))
                if rate_limit is not None:
                    rate_limit.take(wire_length)
                start_writeback(fd, offset, len(data))
        except CompressionError as error:
            raise BadRequest(str(error)) from None
        return written
    finally:
        body.finish()


def _read_some(body: BodyReader, count: int) -> bytes:
    buffer = bytearray(count)
    got = body.readinto(memoryview(buffer))
    return bytes(buffer[:got])


def _receive_range(body: BodyReader, buffer: memoryview, fd: int, write: Callable[..., None], offset: int,
                   length: int,
                   size: int, path: str, metrics: Optional[ServerMetrics] = None,
                   rate_limit: Optional[TokenBucket] = None) -> int:
    if offset + length > size:
        raise RangeNotSatisfiable(f"Range {offset}+{length} is outside the file ({size} bytes)", size)
    position, end = offset, offset + length
    while position < end:
        got = body.readinto(buffer[: min(len(buffer), end - position)])
        if not got:
            raise BadRequest("The request body ended before the range did")
        try:
            write(buffer[:got], position)
        except OSError as error:
            raise storage_error(error, f"write {path}") from None
        position += got
        if metrics is not None:
            metrics.bytes_received.inc(got)
        if rate_limit is not None:
            rate_limit.take(got)  # after the read: the wait holds back the next one, and TCP the client
    # Start writing the range to disk now: the client's fsync request at the
    # end then finds little left to write.
    start_writeback(fd, offset, length)
    return length


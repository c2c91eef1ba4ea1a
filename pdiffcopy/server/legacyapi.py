"""The API of pdiffcopy 1.0.1, for its clients during an upgrade (``--legacy-api``).

A fleet upgrades one host at a time, so for a while 1.0.1 clients ask new
servers. Their requests carry the file in a query string, as an absolute
path of the server's file system:

* ``GET /info?filename=F``: ``{"size": N}``, or 404 when the file is missing;
* ``GET /hashes?filename=F&block_size=B&method=M&concurrency=C``: one line
  ``OFFSET<TAB>HEXDIGEST`` per block, as text;
* ``GET /blocks?filename=F&offset=O&size=S``: the bytes;
* ``POST /blocks?filename=F&offset=O``: the body written at ``O``;
* ``POST /resize?filename=F&size=N``: the file created or resized.

The new server serves files at their own URL, so without care ``GET
/blocks?filename=...`` was answered with the bytes of a file called
``blocks`` below the root, and the old client stored them as if they were
the file it asked for. The blueprint :data:`legacy` recognises these requests by
their path and their ``filename`` parameter (a plain ``GET /blocks`` is
still that file) and either refuses them with a 400 that says what to do,
or, with ``--legacy-api``, serves them with the new server's own confined
file code: paths below ``--root`` only, the token, write leases, and the
same refusals (FIFOs, devices, hard links, growth by writes).

1.0.1 named files by absolute path. A name inside the root is taken as the
path below it; anything else absolute is refused (403), and a relative name
is below the root.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Iterator, List, Optional

from flask import Blueprint, Response, g, jsonify, request
from werkzeug.wsgi import ClosingIterator

from pdiffcopy._version import __version__
from pdiffcopy.core.blocks import DEFAULT_SEGMENT_SIZE, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from pdiffcopy.core.hashing import digest_size, validate_method
from pdiffcopy.errors import AccessDenied, BadRequest, ServerBusy, StorageError, storage_error
from pdiffcopy.local.confinement import refuse_hard_links
from pdiffcopy.local.filehash import hash_region
from pdiffcopy.server.bodyreader import open_body
from pdiffcopy.server.context import HASH_RETRY_AFTER_SECONDS, HASH_SLOT_WAIT_SECONDS, request_metrics, server_state
from pdiffcopy.server.files import resize_file
from pdiffcopy.server.requests import MAX_FILE_SIZE, int_arg, path_arg, served
from pdiffcopy.server.streaming import body_chunks, check_inside

#: The paths and methods of 1.0.1's requests (HEAD as GET: Flask answers both).
LEGACY_ENDPOINTS = {
    ("/info", "GET"), ("/info", "HEAD"),
    ("/hashes", "GET"), ("/hashes", "HEAD"),
    ("/blocks", "GET"), ("/blocks", "HEAD"), ("/blocks", "POST"),
    ("/resize", "POST"),
}

#: The query parameter every 1.0.1 request has, and no plain file request does.
LEGACY_PARAMETER = "filename"

#: The answer to a 1.0.1 request when the legacy API is off: what the user can do.
REFUSAL = (f"This is a pdiffcopy {__version__} server, which pdiffcopy 1.0.1 clients cannot use: upgrade the "
           f"client, or start the server with --legacy-api")

#: 1.0.1's client shows only the status line of an error (requests' ``raise_for_status``),
#: so its reason phrase carries the message too, cut to this many characters.
MAX_REASON_CHARS = 200

#: The reason phrase of a 401 to a 1.0.1 request when the legacy API is on: that
#: client has no way to send a token. (When it is off, the 401 says :data:`REFUSAL`.)
TOKEN_REASON = "This server requires a token, which pdiffcopy 1.0.1 clients cannot send: upgrade the client"

#: The hash method 1.0.1 used when none was given (its client always sends one).
LEGACY_DEFAULT_METHOD = "sha1"

#: The block size 1.0.1 used when none was given (its default, 1 MiB).
LEGACY_DEFAULT_BLOCK_SIZE = 1024 * 1024

#: Bytes hashed between two writes of a 1.0.1 hash answer. 1.0.1 asks for
#: every block of the file in one request, so the answer is streamed, a
#: region at a time: the memory it takes stays small for any file size.
LEGACY_HASH_REGION_BYTES = DEFAULT_SEGMENT_SIZE


def legacy_relative_path(filename: str, root_directory: str) -> str:
    """The path below the root that a 1.0.1 ``filename`` means.

    :param filename: Absolute (1.0.1's form: a path of the server's file
                     system) or relative to the root.
    :param root_directory: The server's root, absolute.
    :returns: The path relative to the root (checked again when opened).
    :raises AccessDenied: For an absolute path outside the root.
    """
    if not filename.startswith("/"):
        return filename
    for directory in dict.fromkeys((root_directory, os.path.realpath(root_directory))):
        base = directory.rstrip("/") + "/"
        if filename == directory or filename.startswith(base):
            return filename[len(base):].lstrip("/")
    raise AccessDenied(f"Path outside the root: {filename[:200]!r} (this server serves the files "
                       f"below {root_directory})")


def is_legacy_request() -> bool:
    """Whether the request being handled has the shape of one of 1.0.1's."""
    return (request.path, request.method) in LEGACY_ENDPOINTS and LEGACY_PARAMETER in request.args


def status_reason(message: str) -> str:
    """``message`` fit for an HTTP reason phrase: printable ASCII, one line, bounded."""
    text = message.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if " " <= c <= "~" else " " for c in text)
    return text[:MAX_REASON_CHARS]


#: The 1.0.1 API, with no routes of its own: its requests look like files' (``GET /blocks?filename=``),
#: so it recognises them before routing, and refuses them when ``--legacy-api`` is off.
legacy = Blueprint("legacy", __name__)


def _info(path: str) -> Response:
    fd = served(path).open_descriptor(os.O_RDONLY)
    try:
        return jsonify(size=os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _hashes(path: str) -> Response:
    state = server_state()
    hash_methods = state.config.hash_methods
    method = validate_method(request.args.get("method") or LEGACY_DEFAULT_METHOD)
    if method not in hash_methods:
        raise BadRequest(f"This server does not accept the hash method {method!r} (it accepts "
                         f"{', '.join(hash_methods)}); choose one with -m")
    block_size = (int_arg("block_size", MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)
                  if "block_size" in request.args else LEGACY_DEFAULT_BLOCK_SIZE)
    # 1.0.1's concurrency parameter is ignored: hash slots are the server's to share.
    fd = served(path).open_descriptor(os.O_RDONLY)
    client = request.remote_addr or ""
    if not state.hash_slots.acquire(client, timeout=HASH_SLOT_WAIT_SECONDS):
        os.close(fd)
        raise ServerBusy("Busy: too many hash requests are running; retry later", HASH_RETRY_AFTER_SECONDS)
    state.metrics.hash_jobs.inc()
    size = os.fstat(fd).st_size
    region = max(block_size, LEGACY_HASH_REGION_BYTES // block_size * block_size)
    width = digest_size(method)

    def lines() -> Iterator[bytes]:
        for offset in range(0, size, region):
            try:
                digests = hash_region(fd, offset, min(region, size - offset), block_size, method)
            except OSError as error:
                raise storage_error(error, f"read {path}") from None
            yield "".join(f"{offset + index * block_size}\t{digests[start:start + width].hex()}\n"
                          for index, start in enumerate(range(0, len(digests), width))).encode("ascii")

    released: List[bool] = []

    def release() -> None:  # called once the answer is sent, or abandoned
        if not released:
            released.append(True)
            state.metrics.hash_jobs.dec()
            state.hash_slots.release(client)
            os.close(fd)

    return Response(ClosingIterator(lines(), [release]), mimetype="text/plain")


def _read_block(path: str) -> Response:
    offset = int_arg("offset", 0, MAX_FILE_SIZE)
    wanted = int_arg("size", 0, MAX_FILE_SIZE)
    file = served(path)
    try:
        # Short at the end, as 1.0.1 read.
        length = max(0, min(wanted, os.fstat(file.read_descriptor()).st_size - offset))
    except BaseException:
        file.close()
        raise

    def chunks() -> Iterator[bytes]:
        try:
            for _, data in file.read_copies([(offset, length)] if length else []):
                yield data
        except StorageError:
            return  # the file shrank: the client sees a short body

    response = Response(ClosingIterator(request_metrics().served(chunks()), [file.close]),
                        mimetype="application/octet-stream", direct_passthrough=True)
    response.headers["Content-Length"] = str(length)
    return response


def _write_block(path: str) -> Response:
    state = server_state()
    offset = int_arg("offset", 0, MAX_FILE_SIZE)
    length = request.content_length
    if length is None:
        raise BadRequest("Missing Content-Length")
    file = served(path)
    try:
        info = os.fstat(file.write_in_place())
        refuse_hard_links(info, path, state.config.write_hard_links)
        with state.leases.writing(info, None, path):
            # Writes never grow a file (1.0.1's client resizes first): a resize
            # checks the free space, a write far out would make a huge sparse file.
            check_inside(offset, length, os.fstat(file.write_in_place()).st_size)
            body = open_body(request.environ, length)
            try:
                file.write_ranges([(offset, length)], body_chunks(
                    body, offset, length, "The request body ended before its Content-Length"))
            finally:
                body.finish()
            request_metrics().bytes_received.inc(length)
    finally:
        file.close()
    return jsonify(written=length)


def _resize(path: str) -> Response:
    return resize_file(path=path)  # the new API's resize, parameters and all


_VIEWS: Dict[str, Callable[[str], Response]] = {
    "GET /info": _info, "GET /hashes": _hashes, "GET /blocks": _read_block,
    "POST /blocks": _write_block, "POST /resize": _resize,
}


@legacy.before_app_request
def legacy_request() -> Optional[Response]:
    """Serve a 1.0.1 request, or refuse it. Registered after the server's token check,
    which 1.0.1 requests need like any other."""
    if not is_legacy_request():
        return None  # a file of that name, or anything else: the ordinary routes
    state = server_state()
    if not state.config.legacy_api:
        raise BadRequest(REFUSAL)
    shorthand = g.exports.default
    # (--config refuses --legacy-api: 1.0.1 names files by their path on the host, not by export)
    if shorthand is None or shorthand.root is None:
        raise BadRequest(REFUSAL)
    path = legacy_relative_path(path_arg(LEGACY_PARAMETER), shorthand.root.directory)
    g.export = shorthand  # admitted to the server's (its routes are not the files'), so to its one root
    method = "GET" if request.method == "HEAD" else request.method
    return _VIEWS[f"{method} {request.path}"](path)


@legacy.after_app_request
def legacy_answer(response: Response) -> Response:
    """Label the request for the metrics, and put an error's message in the status line,
    the one part of an error 1.0.1's client shows.

    Registered after the server's own hooks, so it runs before them (Flask runs them in
    reverse), for refusals and 401s too: the metrics show whether 1.0.1 clients still come.
    """
    if not is_legacy_request():
        return response
    g.endpoint_label = "legacy" + request.path.replace("/", "_")  # legacy_blocks, legacy_info...
    if response.status_code < 400:
        return response
    if response.status_code == 401:  # the token is checked first: say what helps
        message = TOKEN_REASON if server_state().config.legacy_api else REFUSAL
    else:
        body = response.get_json(silent=True) if response.is_json else None
        message = body.get("error", "") if isinstance(body, dict) else ""
    if message:
        response.status = f"{response.status_code} {status_reason(message)}"
    return response

"""The server's API as an OpenAPI 3 document.

:func:`build_document` returns the description of every endpoint of
:mod:`pdiffcopy.server.app`: its paths, parameters, request bodies, answers
(with the JSON error body every failure has) and the bearer token. The
server answers ``GET /.pdiffcopy/openapi.json`` with it, and
``docs/openapi.json`` is a copy written by ``docs/write_openapi.py``.
tests/test_openapi.py fails when the document and the application's routes
drift apart, or when the copy in docs/ is stale; tests/test_fuzz.py feeds
requests generated from it to a running server.

The document is plain data built by pure functions: no I/O, no Flask.
Prose lives in docs/protocol.rst; the descriptions here are one sentence
each and point there.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Optional

from pdiffcopy import errors
from pdiffcopy._version import __version__
from pdiffcopy.core.blocks import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from pdiffcopy.core.datamap import MAX_DATA_MAP_EXTENTS
from pdiffcopy.server.metrics import METRICS_PATH
from pdiffcopy.core.protocol import NO_FOLLOW_HEADER, SYNC_HEADER
from pdiffcopy.core.treestops import NODES_DEVICES, NODES_SPECIALS
from pdiffcopy.engine.treeendpoints import OPERATIONS
from pdiffcopy.core.packedlisting import PACKED_LISTING_TYPE
from pdiffcopy.core.treewire import (
    MAX_BATCH_FILES,
    MAX_BATCH_OPERATIONS,
    NODES_HEADER,
    NOT_KEPT_HEADER,
    NOT_KEPT_OWNER,
    NOT_KEPT_XATTRS,
    TREE_ORDER_HEADER,
    TREE_ORDER_WALK,
)

#: The OpenAPI version written. 3.0 rather than 3.1: more tools read it
#: (schemathesis, Swagger UI, code generators), and nothing here needs 3.1.
OPENAPI_VERSION = "3.0.3"

#: Where the server serves the document: under the reserved prefix, so it
#: can never hide a file called ``openapi.json`` at the top of the root.
DOCUMENT_PATH = "/.pdiffcopy/openapi.json"

#: What the HTTP layer answers by itself, and what the API adds to an error's own sentence.
_FRAMEWORK_STATUSES = {
    405: "The endpoint does not support this method",
    414: "The request line is too long (from the HTTP layer)",
    431: "The headers are too many or too long (from the HTTP layer)",
}
_ALSO = {
    400: ", or malformed HTTP",
    413: ": 64 MiB of JSON, 65,536 ranges of a chunk list, 16,384 moves or 1 GiB of a copy",
}


def _error_statuses() -> Dict[int, str]:
    """Every status the server answers an error with, and its sentence: from the error kinds of
    pdiffcopy/errors.py that say what they are served as, plus the HTTP layer's own."""
    kinds: List[type] = []
    pending: List[type] = [errors.PdiffcopyError]
    while pending:
        kind = pending.pop(0)
        kinds.append(kind)
        pending += kind.__subclasses__()
    statuses: Dict[int, str] = dict(_FRAMEWORK_STATUSES)
    for kind in kinds:
        if vars(kind).get("served_as"):
            statuses[kind.http_status] = f"{kind.served_as} ({kind.__name__}){_ALSO.get(kind.http_status, '')}"
    return dict(sorted(statuses.items()))


#: The status code of every kind of error and the sentence describing it.
ERROR_STATUSES: Dict[int, str] = _error_statuses()

#: Errors every request can meet: malformed HTTP, a missing token, a request
#: line or headers beyond the HTTP layer's limits.
_ANY_ERRORS = (400, 401, 414, 431)

#: Errors any request on a path can meet besides: a bad path, a missing
#: file, something other than a file on the way, a failing disk.
_PATH_ERRORS = _ANY_ERRORS + (403, 404, 409, 507)

_JSON = "application/json"
_BYTES = "application/octet-stream"
_MULTIPART = "multipart/byteranges"

_INTEGER = {"type": "integer", "minimum": 0, "maximum": 2 ** 63 - 1}

#: An entry of a tree: a JSON array (OpenAPI 3.0 cannot type its positions).
_ENTRY: Dict[str, Any] = {
    "type": "array", "minItems": 10, "maxItems": 12,
    "items": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "array"}]},
    "description": "[path, kind, size, mtime_ns, mode, uid, gid, target, nlink, sparse] or "
                   "[..., sparse, link, xattrs]: path "
                   "relative to the tree, kind file, dir, symlink or other, the whole st_mode, "
                   "a symlink's target (a device's numbers, MAJOR:MINOR), sparse 0 or 1, link a "
                   "name shared by the hard links of one "
                   "file (-H), xattrs [name, base64 value] pairs (-X, -A; sorted by name). The "
                   "value of system.posix_acl_access and system.posix_acl_default is not the "
                   "kernel's binary but a portable text, one line per ACL entry, "
                   "TAG:NAME:ID:PERMS (user, group, mask or other; NAME and ID empty but for "
                   "named users and groups, NAME empty when unknown or with numeric_ids; PERMS "
                   "rwx with -), e.g. user:::rw-\\nuser:daemon:1:r--\\ngroup:::r--\\n"
                   "mask:::r--\\nother:::---\\n: the applying side maps NAME to its own number "
                   "and keeps ID when it does not know the name",
    "example": ["db/small.txt", "file", 6, 1795369760261932937, 33188, 0, 0, "", 1, 0],
}

_FAILURE_LIST: Dict[str, Any] = {
    "type": "array", "description": "[path, message] per entry that failed",
    "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "string"}},
}


def _flag(name: str, description: str) -> Dict[str, Any]:
    """A query parameter that is 0 (the default) or 1."""
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": "string", "enum": ["0", "1"]}}


def _ref(kind: str, name: str) -> Dict[str, str]:
    return {"$ref": f"#/components/{kind}/{name}"}


def _json_answer(description: str, schema: str) -> Dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": _ref("schemas", schema)}}}


def _errors(*statuses: int) -> Dict[str, Any]:
    return {str(status): _ref("responses", f"Error{status}") for status in sorted(statuses)}


def _operation(operation_id: str, summary: str, answers: Dict[str, Any], errors=_ANY_ERRORS,
               parameters: Optional[List[Dict[str, Any]]] = None,
               body: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    operation: Dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "description": f"{summary}. See docs/protocol.rst for the details.",
        "parameters": parameters or [],
        # A request with a body can be cut off for sending it too slowly.
        "responses": {**answers, **_errors(*errors, *((408,) if body is not None else ()))},
    }
    if body is not None:
        operation["requestBody"] = body
    return operation


def _head_of(get: Dict[str, Any], operation_id: str, summary: str) -> Dict[str, Any]:
    """The HEAD twin of a GET operation: the same answers, without bodies."""
    head = copy.deepcopy(get)
    head["operationId"] = operation_id
    head["summary"] = summary
    head["description"] = f"{summary}: the answer of GET without its body."
    for status, answer in head["responses"].items():
        if "$ref" in answer:
            answer = head["responses"][status] = copy.deepcopy(
                _error_response(int(status)))
        answer.pop("content", None)
    return head


def _query(name: str, description: str, schema: Dict[str, Any], required: bool = True,
           example: Any = None) -> Dict[str, Any]:
    parameter = {"name": name, "in": "query", "required": required, "description": description,
                 "schema": schema}
    if example is not None:
        parameter["example"] = example
    return parameter


def _error_response(status: int) -> Dict[str, Any]:
    response: Dict[str, Any] = {
        "description": ERROR_STATUSES[status],
        "content": {_JSON: {"schema": _ref("schemas", "Error")}},
    }
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {
            "description": 'Always Bearer realm="pdiffcopy"', "schema": {"type": "string"}}}
    if status == 416:
        response["headers"] = {"Content-Range": {
            "description": "bytes */SIZE: the file's current size (RFC 9110, section 15.5.17)",
            "schema": {"type": "string"}, "example": "bytes */3000000"}}
    if status == 503:
        response["headers"] = {"Retry-After": {
            "description": "Seconds to wait before asking again", "required": True,
            "schema": {"type": "integer", "minimum": 0}}}
    return response


def _components() -> Dict[str, Any]:
    string = {"type": "string"}
    schemas = {
        "Error": {
            "type": "object",
            "description": "The body of every error answer: a one-line message and the status.",
            "required": ["error", "status"],
            "properties": {"error": {"type": "string", "minLength": 1},
                           "status": {"type": "integer", "minimum": 400, "maximum": 599}},
        },
        "Health": {
            "type": "object", "required": ["status"],
            "properties": {"status": {"type": "string", "enum": ["ok"]}},
        },
        "ServerInfo": {
            "type": "object", "required": ["server", "version"],
            "properties": {"server": {"type": "string", "enum": ["pdiffcopy"]}, "version": string},
        },
        "Version": {
            "type": "object", "required": ["version", "methods"],
            "properties": {"version": string,
                           "methods": {"type": "array", "items": string,
                                       "description": "Hash methods the server accepts "
                                                      "(--hash-methods), sorted by name"}},
        },
        "FileDescription": {
            "type": "object", "required": ["type", "size", "mtime_ns", "mode", "etag"],
            "properties": {
                "type": {"type": "string", "enum": ["file", "device", "directory", "other"],
                         "description": "device: a block device the server exports (--device), a file "
                                        "of fixed size whose etag changes with its write counters; a "
                                        "device node below the root is other, and never served"},
                "size": {**_INTEGER, "description": "Size in bytes"},
                "mtime_ns": {"type": "integer",
                             "description": "Modification time, nanoseconds since the epoch"},
                "mode": {"type": "integer", "minimum": 0, "maximum": 4095,
                         "description": "Permission bits (420 is 0644)"},
                "etag": {"type": "string", "description": "The ETag, as in ETag headers"},
                "free": {**_INTEGER, "description": "Bytes free for a new file in the file's directory "
                                                    "(stat only; absent where unknown and from older servers)"},
            },
        },
        "Written": {"type": "object", "required": ["written"],
                    "properties": {"written": _INTEGER}},
        "Punched": {"type": "object", "required": ["punched", "holes"],
                    "properties": {"punched": _INTEGER,
                                   "holes": {"type": "boolean",
                                             "description": "False: the file system cannot punch, and "
                                                            "zeros were written instead"}}},
        "Flushed": {"type": "object", "required": ["flushed"],
                    "properties": {"flushed": {"type": "boolean", "enum": [True]}}},
        "Cloned": {"type": "object", "required": ["method"],
                   "properties": {"method": {"type": "string",
                                             "enum": ["reflink", "copy_file_range",
                                                      "sendfile", "readwrite"]}}},
        "Copied": {"type": "object", "required": ["copied"],
                   "properties": {"copied": _INTEGER}},
        "Renamed": {"type": "object", "required": ["renamed"],
                    "properties": {"renamed": {"type": "boolean", "enum": [True]}}},
        "Leased": {"type": "object", "required": ["lease", "seconds"],
                   "properties": {"lease": {"type": "string", "pattern": "^[0-9a-f]{32}$",
                                            "description": "The id to send as X-Pdiffcopy-Lease"},
                                  "seconds": {"type": "integer", "minimum": 1,
                                              "description": "How long it lives after each "
                                                             "request that sends it"}}},
        "Released": {"type": "object", "required": ["released"],
                     "properties": {"released": {"type": "boolean", "enum": [True]}}},
        "Removed": {"type": "object", "required": ["removed"],
                    "properties": {"removed": {"type": "boolean", "enum": [True]}}},
        "Ended": {"type": "object", "required": ["ended"],
                  "properties": {"ended": {**_INTEGER, "description": "How many transfers of the sync it ended"}}},
        "Swept": {"type": "object", "required": ["removed"],
                  "properties": {"removed": {**_INTEGER, "description": "How many temporaries were removed"}}},
        "OpenAPI": {"type": "object", "required": ["openapi", "info", "paths"],
                    "description": "This document."},
        "Entry": _ENTRY,
        "AlternatesAnswer": {
            "type": "object", "required": ["taken", "copied_bytes", "failures"],
            "properties": {
                "taken": {"type": "object", "additionalProperties": {
                    "type": "string", "enum": ["linked", "copied", "matched", "removed"]}},
                "copied_bytes": {"type": "integer", "minimum": 0},
                "failures": _FAILURE_LIST,
            },
        },
        "Failures": {
            "type": "object", "required": ["failures"],
            "properties": {
                "failures": _FAILURE_LIST,
                "ignored": {"type": "array", "items": {"type": "string"},
                            "description": "What the server did not do because it does not trust "
                                           "its clients with it (owners, setuid/setgid bits, "
                                           "security.* and trusted.* attributes) or because its "
                                           "file system cannot (attributes it does not support); "
                                           "absent when nothing was ignored."},
            },
        },
        "Listing": {
            "type": "object", "required": ["root", "entries", "failures", "complete"],
            "description": "Streamed in this key order while the tree is walked; a walk that "
                           "fails midway ends the text with \"error\" and no closing brace",
            "properties": {
                "root": {**_ENTRY, "nullable": True,
                         "description": "The tree's directory itself (path \"\"), null when missing"},
                "entries": {"type": "array", "items": _ref("schemas", "Entry"),
                            "description": "Everything below it, recursively, in the order the "
                                           "Pdiffcopy-Tree-Order header says"},
                "failures": _FAILURE_LIST,
                "complete": {"type": "boolean", "enum": [True],
                             "description": "Last: the listing is whole"},
            },
        },
        "ReadRequest": {
            "type": "object", "required": ["entries"],
            "properties": {"entries": {
                "type": "array", "maxItems": MAX_BATCH_FILES, "items": _ref("schemas", "Entry"),
                "description": "Regular files from a listing, each at most 64 MiB, at most "
                               "256 MiB in all"}},
        },
        "ApplyRequest": {
            "type": "object", "required": ["operations"],
            "properties": {"operations": {
                "type": "array", "maxItems": MAX_BATCH_OPERATIONS,
                "items": {"type": "array", "minItems": 2, "maxItems": 2,
                          "items": {"anyOf": [{"type": "string", "enum": list(OPERATIONS)},
                                              _ref("schemas", "Entry")]},
                          "description": "[operation, entry]: mkdir, symlink, metadata, delete, "
                                         "remove, link (the entry, a file, becomes another "
                                         "name of the regular file at its target, a path in "
                                         "the same tree; a target leading out gets 403, one "
                                         "through a symlink is that operation's failure) or "
                                         "mknod (a device of the numbers in its target, a fifo "
                                         "or a socket, of the entry's mode: devices as root, "
                                         "for trusted clients only)"}}},
        },
    }
    parameters = {
        "Path": {
            "name": "path", "in": "path", "required": True,
            "description": "A file's path relative to the server's root, percent-encoded "
                           "(slashes may stay). NUL bytes and over 4,096 bytes get 400; "
                           "'..', a leading .pdiffcopy and symlinks out of the root get 403.",
            "schema": {"type": "string", "minLength": 1}, "example": "db/big.ibd",
        },
        "TemporaryPath": {
            "name": "path", "in": "path", "required": True,
            "description": "A pdiffcopy temporary file: the last component is "
                           ".NAME.pdiffcopy- and 12 lowercase hex digits, or the partial file "
                           "of --partial, .NAME.pdiffcopy-partial; any other name gets 403.",
            "schema": {"type": "string", "minLength": 1},
            "example": "db/.big.ibd.pdiffcopy-1a2b3c4d5e6f",
        },
        "TreePath": {
            "name": "path", "in": "path", "required": True,
            "description": "A directory's path relative to the server's root, percent-encoded "
                           "(slashes may stay); the variant without it is the root itself. "
                           "Checked like a file's path: '..' and symlinks out of the root get "
                           "403.",
            "schema": {"type": "string", "minLength": 1}, "example": "db",
        },
        "Packed": _flag("packed", "1: the file records' headers packed where they can be (docs/protocol.rst, "
                                  "The batch stream); 0 (the default): JSON headers"),
        "Sweep": _flag("sweep", "1: remove the temporaries of writers that are gone (their writer locks "
                                "are free) as the tree is listed, as a push's target does; 0 (the default): "
                                "do not"),
        "Times": _flag("times", "1: set modification times from the entries; 0 (the default): do not"),
        "Owner": _flag("owner", "1: set user and group from the entries (when the server runs as "
                                "root); 0 (the default): do not"),
        "Fsync": _flag("fsync", "1: flush every file written and every directory that got a new "
                                "name to disk before answering; 0 (the default): leave them to the "
                                "kernel's writeback"),
        "Xattrs": _flag("xattrs", "1 (-X): list, or set and remove, the user.*, security.* and trusted.* "
                                  "extended attributes of the entries (security.* and trusted.* are set "
                                  "and removed only by a server started with --trust-clients); 0 (the "
                                  "default): neither listed nor touched"),
        "Acls": _flag("acls", "1 (-A): list, or set and remove, the POSIX ACLs (system.posix_acl_access, "
                              "system.posix_acl_default) of the entries, in the portable text of an "
                              "Entry; 0 (the default): neither listed nor touched"),
        "NumericIds": _flag("numeric_ids", "1 (--numeric-ids): ACL entries name users and groups by number only "
                                           "(listed without names, applied by ID); 0 (the default): by name, the "
                                           "number kept for names the host does not know"),
        "Sparse": _flag("sparse", "1 (-S): runs of zeros (whole 4 KiB blocks) in the files written become "
                                  "holes; 0 (the default): only the holes of entries marked sparse do"),
        "Fresh": _flag("fresh", "1: the files are new; each is created under its name exclusively "
                                "(no temporary and rename) and removed if writing it fails; a name "
                                "that exists gets the temporary and rename after all. 0 (the "
                                "default): every file goes through a temporary"),
        "Lease": {
            "name": "X-Pdiffcopy-Lease", "in": "header", "required": False,
            "description": "The id of the client's write lease on the file (POST "
                           "/.pdiffcopy/lease): renews it; 412 when it lapsed and somebody else "
                           "wrote. Without it, writes are refused with 423 while another client "
                           "holds a lease.",
            "schema": string,
        },
        "Sync": {
            "name": SYNC_HEADER, "in": "header", "required": True,
            "description": "The client's sync: a random id sent with its every request (the server "
                           "echoes it), which the server's transfer log groups requests by.",
            "schema": string,
            "example": "5f0c3a9e1b7d4c2a8e6f0b1d3c5a7e9f",
        },
        "NoFollow": {
            "name": NO_FOLLOW_HEADER, "in": "header", "required": False,
            "description": "1: a symlink in the file's last name is not followed (a stat "
                           "describes the link, type other; anything else answers 409), as a "
                           "tree's member is opened; 0 or absent: followed when it stays beneath "
                           "the root.",
            "schema": {"type": "string", "enum": ["0", "1"]},
        },
        "IfMatch": {
            "name": "If-Match", "in": "header", "required": False,
            "description": "ETags the file must still have (or *); otherwise 412.",
            "schema": string,
        },
    }
    responses = {f"Error{status}": _error_response(status) for status in ERROR_STATUSES}
    return {
        "schemas": schemas,
        "parameters": parameters,
        "responses": responses,
        "securitySchemes": {"bearerAuth": {
            "type": "http", "scheme": "bearer",
            "description": "The shared secret ($PDIFFCOPY_TOKEN or --token-file). Required on "
                           "every request, this document included, when the server has one; "
                           "a server without one accepts every request.",
        }},
    }


def _paths() -> Dict[str, Dict[str, Any]]:
    path, temporary, if_match = (_ref("parameters", "Path"), _ref("parameters", "TemporaryPath"),
                                 _ref("parameters", "IfMatch"))
    lease, no_follow = _ref("parameters", "Lease"), _ref("parameters", "NoFollow")
    file_headers = {
        "ETag": {"description": "The file's ETag", "schema": {"type": "string"}},
        "Accept-Ranges": {"description": "Always bytes", "schema": {"type": "string"}},
    }
    index = _operation("serverInfo", "Tell a client that this is a pdiffcopy server",
                       {"200": _json_answer("Who we are", "ServerInfo")})
    health = _operation("health", "Liveness, answered without the token and saying nothing about files",
                        {"200": _json_answer("The server answers", "Health")}, errors=(400, 414, 431))
    health["security"] = []  # the one operation a probe without the token may call
    version = _operation("version", "The server's version and the hash methods it accepts",
                         {"200": _json_answer("Version and methods", "Version")})
    document = _operation("openapi", "This OpenAPI document",
                          {"200": _json_answer("The document", "OpenAPI")})
    metrics = _operation(
        "metrics", "Prometheus metrics, added up over the worker processes",
        {"200": {"description": "The text exposition format: requests by endpoint and status, file "
                                "bytes served and received, hash jobs running, 503 refusals",
                 "content": {"text/plain": {"schema": {"type": "string"},
                                            "example": "pdiffcopy_served_bytes_total 1.048576e+06\n"}}}})
    done = _operation("syncDone", "Say that a sync is over: the transfer log writes its transfers' lines",
                      {"200": _json_answer("Ended", "Ended")},
                      parameters=[_ref("parameters", "Sync"),
                                  _query("result", "The sync's outcome as the client saw it",
                                         {"type": "string", "enum": ["ok", "failed"]}, required=False)])
    stat = _operation("stat", "Describe a file: type, size, mtime, mode and ETag",
                      {"200": _json_answer("The description", "FileDescription")},
                      errors=_PATH_ERRORS, parameters=[path, no_follow])
    hashes = _operation(
        "hashes", "The digests of the blocks of block-aligned ranges of a file",
        {"200": {
            "description": "One digest per block of every range, concatenated in the order asked",
            "headers": {
                "X-Digest-Size": {"description": "Bytes per digest", "required": True,
                                  "schema": {"type": "integer", "minimum": 1}},
                "ETag": file_headers["ETag"],
            },
            "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}}},
        }},
        errors=_PATH_ERRORS + (412, 416, 503),
        parameters=[
            path,
            _query("method", "A hash method from GET /.pdiffcopy/version",
                   {"type": "string", "minLength": 1}, example="xxh3_128"),
            _query("block_size", "The block size in bytes",
                   {"type": "integer", "minimum": MIN_BLOCK_SIZE, "maximum": MAX_BLOCK_SIZE},
                   example=1048576),
            _query("offset", "Where the one range starts, a multiple of block_size "
                             "(required without Range)", _INTEGER, required=False, example=0),
            _query("length", "How many bytes the range covers, at most 1 GiB "
                             "(required without Range)", _INTEGER, required=False,
                   example=3000000),
            {"name": "Range", "in": "header", "required": False,
             "description": "Several ranges instead of offset and length: "
                            "bytes=FIRST-LAST,... (both ends given, at most 4,096, none overlapping)",
             "schema": {"type": "string"}, "example": "bytes=0-1048575,2097152-3145727"},
            if_match, lease, no_follow,
        ])
    read = _operation(
        "read", "The file's bytes: all of them, one range or several",
        {"200": {"description": "The whole file (also for many tiny ranges whose part headers "
                                "would outweigh it)", "headers": file_headers,
                 "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}}}},
         "206": {"description": "One range (with Content-Range), or several as "
                                "multipart/byteranges (overlapping or touching ranges merged, "
                                "ascending)", "headers": file_headers,
                 "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}},
                             _MULTIPART: {"schema": {"type": "string", "format": "binary"}}}},
         "304": {"description": "Not modified: If-None-Match holds the file's ETag (or *), or, "
                                "without If-None-Match, If-Modified-Since is not older than "
                                "Last-Modified; no body", "headers": file_headers}},
        errors=_PATH_ERRORS + (412, 416),
        parameters=[
            path,
            {"name": "Range", "in": "header", "required": False,
             "description": "bytes=FIRST-LAST, FIRST- or -N, comma-separated (at most 4,096; "
                            "overlapping or touching ones are merged); a Range in another unit "
                            "is ignored (RFC 9110, section 14.2)",
             "schema": {"type": "string"}, "example": "bytes=0-1048575"},
            {"name": "If-Range", "in": "header", "required": False,
             "description": "An ETag: when it is not the file's, Range is ignored",
             "schema": {"type": "string"}},
            if_match,
            {"name": "If-None-Match", "in": "header", "required": False,
             "description": "ETags (or *): 304 when one of them is the file's (weak comparison)",
             "schema": {"type": "string"}},
            {"name": "If-Modified-Since", "in": "header", "required": False,
             "description": "An HTTP date: 304 when the file is not newer (ignored with "
                            "If-None-Match, or when it is not a valid date)",
             "schema": {"type": "string"}, "example": "Sun, 22 Nov 2026 17:49:20 GMT"},
            no_follow,
        ])
    head = _head_of(read, "readHeaders", "The headers of a download")
    head["responses"].pop("206")
    head["responses"].pop("416")
    head["description"] = ("The headers of a download, without its body; Range is ignored and "
                           "the status is 200.")
    write = _operation(
        "write", "Write byte ranges into an existing file, in place (403 for a file with several "
                 "hard links, unless the server runs with --write-hard-links)",
        {"200": _json_answer("The bytes written", "Written")},
        errors=_PATH_ERRORS + (412, 416, 423),
        parameters=[
            path,
            {"name": "Content-Range", "in": "header", "required": False,
             "description": "bytes FIRST-LAST/SIZE (SIZE may be *): where a one-range body "
                            "goes; required unless the body is multipart/byteranges",
             "schema": {"type": "string"}, "example": "bytes 0-4/*"},
            _query("sparse", "1: punch the runs of zeros (whole file system blocks) in the bytes "
                             "instead of writing them (--sparse)", {"type": "integer", "enum": [0, 1]},
                   required=False, example=1),
            if_match, lease, no_follow,
        ],
        body={"required": True,
              "description": "One range's bytes (Content-Length must match Content-Range), or "
                             "several as multipart/byteranges (each part with Content-Range)",
              "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}},
                          _MULTIPART: {"schema": {"type": "string", "format": "binary"}}}})
    resize = _operation(
        "resize", "Create the file if missing and make it exactly size bytes long (403 for an "
                  "existing file with several hard links, unless --write-hard-links). A block device "
                  "keeps its size: a size it holds changes nothing, a larger one is 416",
        {"200": _json_answer("The new description", "FileDescription")},
        errors=_PATH_ERRORS + (412, 416, 423),
        parameters=[path, _query("size", "The new size in bytes",
                                 {"type": "integer", "minimum": 0, "maximum": 2 ** 50},
                                 example=4096),
                    _query("data", "Grow by a hole: the source is sparse and only this many bytes of data "
                                   "will be written; the growth is not reserved, and only this much of "
                                   "it is checked against the free space",
                           {"type": "integer", "minimum": 0, "maximum": 2 ** 50}, required=False,
                           example=12582912),
                    _query("mode", "The permission bits of a file this request makes (an existing file "
                                   "keeps its own): the mode a new copy gets; without it, 0666 less the "
                                   "server's umask",
                           {"type": "integer", "minimum": 0, "maximum": 0o777}, required=False, example=0o600),
                    _flag("umask", "1: take the server's umask from mode (the source's mode of a new "
                                   "target: never more than it); 0 (the default): mode as it is (the old "
                                   "target's, for a copy that replaces it)"),
                    lease, no_follow])
    data_map = _operation(
        "dataMap", "Where a range of a file holds data (SEEK_DATA/SEEK_HOLE); the rest are holes, "
                   "which read as zeros",
        {"200": {
            "description": "The data extents inside the range, in order, 16 bytes each: offset and "
                           "length (uint64, little-endian); none for a range that is all hole. At most "
                           f"{MAX_DATA_MAP_EXTENTS:,} extents: an answer that long may have more after "
                           "its last extent, asked for from there. A file system that cannot tell "
                           "answers the whole range as data",
            "headers": {"ETag": file_headers["ETag"]},
            "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}}},
        }},
        errors=_PATH_ERRORS + (412,),
        parameters=[path,
                    _query("offset", "Where the range starts", _INTEGER, example=0),
                    _query("length", "How many bytes it covers (clipped to the file)", _INTEGER,
                           example=1099511627776),
                    if_match, no_follow])
    punch = _operation(
        "punch", "Make ranges of a file holes (fallocate PUNCH_HOLE, keeping the size), or write zeros "
                 "where the file system cannot; a write like PATCH (403 for a file with several hard "
                 "links, unless --write-hard-links)",
        {"200": _json_answer("The bytes punched, and whether they all became holes", "Punched")},
        errors=_PATH_ERRORS + (412, 413, 416, 423),
        parameters=[path, if_match, lease, no_follow,
                    _query("zeros", "0: the ranges hold zeros already; where the file system cannot punch, "
                                    "leave them as they are (the answer says holes false). 1 (the default): "
                                    "write zeros there", {"type": "integer", "enum": [0, 1]}, required=False),
                    _flag("sparse", "1 (-S): on a block device, discard the ranges (zeros guaranteed) "
                                    "rather than zero them with the device's own command")],
        body={"required": True,
              "description": "The ranges, 16 bytes each: offset and length (uint64, little-endian), "
                             "ascending, none empty, overlapping or past the end; at most 65,536",
              "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}}}})
    fsync = _operation("fsync", "Flush the file's data and its directory entry to disk",
                       {"200": _json_answer("Flushed", "Flushed")},
                       errors=_PATH_ERRORS + (412,), parameters=[path, lease, no_follow])
    take_lease = _operation(
        "takeLease", "Take the write lease on a file: nobody else may write it until it ends",
        {"200": _json_answer("The lease", "Leased")},
        errors=_PATH_ERRORS + (423,), parameters=[path, no_follow])
    end_lease = _operation(
        "endLease", "End a write lease (412 when it lapsed and somebody else wrote meanwhile)",
        {"200": _json_answer("Ended", "Released")},
        errors=_PATH_ERRORS + (412, 423), parameters=[path, lease, no_follow])
    clone = _operation(
        "clone", "Create a temporary file as a copy of another (reflink where possible)",
        {"200": _json_answer("How it was copied", "Cloned")},
        errors=_PATH_ERRORS + (412,),
        parameters=[temporary, _query("from", "The file to copy", {"type": "string"},
                                      example="db/big.ibd"), no_follow])
    chunks = _operation(
        "chunks", "The content-defined chunks of a file or of some of its ranges (--delta chunks)",
        {"200": {
            "description": "12 bytes per chunk, in order: its length (uint32, little-endian) and the first "
                           "8 bytes of its xxh3_64 digest; a chunk starts where the one before ended, "
                           "the first of each range at the range's offset. Streamed while the file is "
                           "cut: a list that ends early means the server failed mid-answer",
            "headers": {"ETag": file_headers["ETag"]},
            "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}}},
        }},
        errors=_PATH_ERRORS + (412, 413, 416, 503),
        parameters=[
            path,
            _query("average", "The average chunk size in bytes (FastCDC; its minimum is a quarter, its "
                              "maximum four times)", {"type": "integer", "minimum": 256, "maximum": 4194304},
                   example=65536),
            if_match, lease, no_follow,
        ],
        body={"required": False,
              "description": "The ranges to cut, 16 bytes each: offset and length (uint64, little-endian), "
                             "ascending, none empty, overlapping or past the end; at most 65,536. "
                             "Empty: the whole file",
              "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}}}})
    copy_ranges = _operation(
        "copyRanges", "Copy ranges of a file to other offsets of a temporary file, which takes the "
                      "file's mode (--delta chunks)",
        {"200": _json_answer("The bytes copied", "Copied")},
        errors=_PATH_ERRORS + (412, 413, 416, 423),
        parameters=[temporary, _query("from", "The file to copy from (the old target)", {"type": "string"},
                                      example="db/dump.sql"), lease, no_follow],
        body={"required": True,
              "description": "The moves, 24 bytes each: from offset, to offset and length (uint64, "
                             "little-endian). Read anywhere inside the file copied from; written inside "
                             "the temporary (a copy never grows it: resize it first), no two writes "
                             "overlapping, none empty; at most 16,384 moves and 1 GiB",
              "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}}}})
    rename = _operation(
        "rename", "Atomically replace another file with a temporary file",
        {"200": _json_answer("Renamed", "Renamed")},
        errors=_PATH_ERRORS + (412, 423),
        parameters=[temporary, _query("to", "The path the file gets", {"type": "string"},
                                      example="db/big.ibd"), lease, no_follow])
    remove = _operation("removeTemporary", "Remove a temporary file left by an aborted sync",
                        {"200": _json_answer("Removed", "Removed")},
                        errors=_PATH_ERRORS, parameters=[temporary])
    sweep = _operation("sweep", "Remove the temporaries beside a file whose writers are gone (their "
                                "writer locks are free); a partial file only once a day old",
                       {"200": _json_answer("Swept", "Swept")}, errors=_PATH_ERRORS, parameters=[path])
    return {
        "/": {"get": index, "head": _head_of(index, "serverInfoHeaders", "Server headers")},
        "/.pdiffcopy/health": {
            "get": health, "head": _head_of(health, "healthHeaders", "Health headers")},
        "/.pdiffcopy/version": {
            "get": version, "head": _head_of(version, "versionHeaders", "Version headers")},
        DOCUMENT_PATH: {
            "get": document, "head": _head_of(document, "openapiHeaders", "Document headers")},
        METRICS_PATH: {
            "get": metrics, "head": _head_of(metrics, "metricsHeaders", "Metrics headers")},
        "/.pdiffcopy/done": {"post": done},
        "/.pdiffcopy/stat/{path}": {
            "get": stat, "head": _head_of(stat, "statHeaders", "Stat headers")},
        "/.pdiffcopy/hashes/{path}": {
            "get": hashes, "head": _head_of(hashes, "hashesHeaders", "Hash headers")},
        "/{path}": {"get": read, "head": head, "patch": write},
        "/.pdiffcopy/resize/{path}": {"post": resize},
        "/.pdiffcopy/datamap/{path}": {
            "get": data_map, "head": _head_of(data_map, "dataMapHeaders", "Data map headers")},
        "/.pdiffcopy/punch/{path}": {"post": punch},
        "/.pdiffcopy/fsync/{path}": {"post": fsync},
        "/.pdiffcopy/clone/{path}": {"post": clone},
        "/.pdiffcopy/chunks/{path}": {"post": chunks},
        "/.pdiffcopy/copy-ranges/{path}": {"post": copy_ranges},
        "/.pdiffcopy/rename/{path}": {"post": rename},
        "/.pdiffcopy/lease/{path}": {"post": take_lease, "delete": end_lease},
        "/.pdiffcopy/temporary/{path}": {"delete": remove},
        "/.pdiffcopy/sweep/{path}": {"post": sweep},
        **_tree_paths(),
    }


def _tree_paths() -> Dict[str, Dict[str, Any]]:
    """The tree endpoints, each for a directory below the root and for the root itself."""
    tree = _ref("parameters", "TreePath")
    attributes = [_ref("parameters", "Xattrs"), _ref("parameters", "Acls"), _ref("parameters", "NumericIds")]
    flags = [_ref("parameters", "Times"), _ref("parameters", "Owner"), _ref("parameters", "Fsync"), *attributes]
    binary = {"schema": {"type": "string", "format": "binary"}}
    paths: Dict[str, Dict[str, Any]] = {}
    for suffix, parameters, name in (("/{path}", [tree], ""), ("/", [], "Root")):
        listing = _operation(
            f"treeList{name}", "List a directory tree recursively (symlinks listed, not followed)",
            {"200": {"description": "The listing: JSON, or packed (docs/protocol.rst, The packed listing) "
                                    "for a client whose Accept names that type", "content": {
                _JSON: {"schema": _ref("schemas", "Listing")}, PACKED_LISTING_TYPE: binary}, "headers": {
                TREE_ORDER_HEADER: {
                "description": f"{TREE_ORDER_WALK!r}: the entries come in walk order (each directory's "
                               "entries sorted by name, the directories depth first, a directory's "
                               "subdirectories by name); absent: in no particular order",
                "schema": {"type": "string", "enum": [TREE_ORDER_WALK]}},
                NOT_KEPT_HEADER: {
                "description": f"What the server does not set of what clients send, comma-separated: "
                               f"{NOT_KEPT_OWNER!r} (user and group), {NOT_KEPT_XATTRS!r} (security.* and "
                               f"trusted.* attributes); absent: it sets them all (a trusted client of a "
                               f"server running as root)",
                "schema": {"type": "string"}},
                NODES_HEADER: {
                "description": f"The nodes the server makes (mknod), comma-separated: {NODES_DEVICES!r} "
                               f"(character and block devices: a server running as root, for clients it "
                               f"trusts) and {NODES_SPECIALS!r} (fifos and unix sockets); absent: none "
                               f"(an older server)",
                "schema": {"type": "string"}}}}},
            errors=_PATH_ERRORS, parameters=list(parameters) + attributes + [
                _ref("parameters", "Sweep"),
                _flag("root_link", "1: a root that is a symlink is listed as the symlink (a single file "
                                   "pulled with -a); 0 (the default): it is followed")])
        read = _operation(
            f"treeRead{name}", "Read the listed files of a tree, whole, as a batch stream",
            {"200": {"description": "The files in the order asked, as a batch stream (records "
                                    "of a JSON header, the data and its xxh3_64 digest)",
                     "content": {_BYTES: binary}}},
            errors=_PATH_ERRORS + (413,), parameters=list(parameters) + [_ref("parameters", "Packed")],
            body={"required": True, "description": "The files to read (at most 64 MiB of JSON, "
                                                   "read item by item; or packed, as a packed listing's "
                                                   "batches and end marker, with a Content-Length)",
                  "content": {_JSON: {"schema": _ref("schemas", "ReadRequest")},
                              PACKED_LISTING_TYPE: binary}})
        write = _operation(
            f"treeWrite{name}", "Write whole files into a tree, each complete or not at all",
            {"200": _json_answer("The files that could not be written", "Failures")},
            errors=_PATH_ERRORS, parameters=list(parameters) + flags + [_ref("parameters", "Sparse"),
                                                                         _ref("parameters", "Fresh")],
            body={"required": True, "description": "The files, as a batch stream (at most "
                                                   "10,000 files and 256 MiB; headers JSON or, from a "
                                                   "client that got a packed listing, packed)",
                  "content": {_BYTES: binary}})
        apply = _operation(
            f"treeApply{name}", "Make directories, symlinks and hard links, set metadata, delete entries",
            {"200": _json_answer("The operations that failed", "Failures")},
            errors=_PATH_ERRORS + (413,), parameters=list(parameters) + flags,
            body={"required": True, "description": "The operations, run in order (at most 64 MiB "
                                                   "of JSON, read item by item)",
                  "content": {_JSON: {"schema": _ref("schemas", "ApplyRequest")}}})
        alternates = _operation(
            f"treeAlternates{name}", "Take files from other directories of the export (rsync's --link-dest, "
                                     "--copy-dest, --compare-dest)",
            {"200": _json_answer("By path, what was done (linked, copied, matched, removed); the bytes "
                                 "copied; the failures", "AlternatesAnswer")},
            errors=_PATH_ERRORS + (413,), parameters=list(parameters) + flags + [
                {"name": "use", "in": "query", "required": True,
                 "schema": {"type": "string", "enum": ["link", "copy", "compare"]}},
                {"name": "dir", "in": "query", "required": True, "description": "A directory relative to the "
                 "tree, beneath the export's root (1 to 20, tried in order)",
                 "schema": {"type": "array", "items": {"type": "string"}}, "explode": True},
                {"name": "dry_run", "in": "query", "schema": {"type": "integer", "enum": [0, 1]},
                 "description": "1: say what would be done, do nothing"}],
            body={"required": True, "description": "The files, as [entry, exists] pairs (at most 20,000)",
                  "content": {_JSON: {"schema": {"type": "object", "required": ["entries"], "properties": {
                      "entries": {"type": "array", "items": {"type": "array"}}}}}}})
        paths[f"/.pdiffcopy/tree{suffix}"] = {
            "get": listing,
            "head": _head_of(listing, f"treeListHeaders{name}", "Listing headers")}
        paths[f"/.pdiffcopy/tree-read{suffix}"] = {"post": read}
        paths[f"/.pdiffcopy/tree-write{suffix}"] = {"post": write}
        paths[f"/.pdiffcopy/tree-apply{suffix}"] = {"post": apply}
        paths[f"/.pdiffcopy/tree-alternates{suffix}"] = {"post": alternates}
    return paths


def build_document() -> Dict[str, Any]:
    """The OpenAPI 3 document of the server's API.

    :returns: The document as plain JSON-compatible data (a new copy each call).
    """
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "pdiffcopy server",
            "version": __version__,
            "description": "Ranged reads and writes of the files below the server's root, "
                           "block hashes, and the few operations a delta sync needs. Every "
                           "error answer is a JSON object {error, status}. The prose "
                           "description is docs/protocol.rst.",
            "license": {"name": "MIT"},
        },
        "security": [{"bearerAuth": []}],
        "paths": _paths(),
        "components": _components(),
    }


def render_document() -> str:
    """The document as the JSON text served and kept in docs/openapi.json."""
    return json.dumps(build_document(), indent=2) + "\n"


if __name__ == "__main__":
    print(render_document(), end="")

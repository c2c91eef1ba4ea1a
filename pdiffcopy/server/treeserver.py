"""The server's tree endpoints: list, read, write and change a directory tree in batches.

:data:`trees`, a blueprint, holds four endpoints of the application of
:mod:`pdiffcopy.server.app`, each for the tree at ``{path}`` below the server's
root (or the root itself, without ``{path}``):

* ``GET /.pdiffcopy/tree/{path}``: the listing, as compact JSON;
* ``POST /.pdiffcopy/tree-read/{path}``: files, whole, as a :mod:`~pdiffcopy.core.treewire` stream;
* ``POST /.pdiffcopy/tree-write/{path}``: a treewire stream in, files written;
* ``POST /.pdiffcopy/tree-apply/{path}``: directories, symlinks, metadata, deletions;
* ``POST /.pdiffcopy/tree-alternates/{path}``: files taken from other directories (--link-dest...).

The work is done by a :class:`~pdiffcopy.local.localtree.LocalTree` confined
beneath the server's :class:`~pdiffcopy.local.confinement.Root`; the views check what
the client sent (entries, operations, bounds) before it reaches it, so a
malformed request is a 400 (a path leading out a 403), never a 500. The
token check and the JSON error answers are the application's (server.py).
docs/protocol.rst, section Trees, describes the endpoints and the format.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
import stat
from typing import AbstractSet, Any, Callable, Iterator, List, Optional, Sequence, Set, Tuple

from flask import Blueprint, Response, g, request

from pdiffcopy.core import compression
from pdiffcopy.server.bodyreader import open_body
from pdiffcopy.errors import (
    AccessDenied,
    BadRequest,
    FileMissing,
    NotAFile,
    PayloadTooLarge,
    PdiffcopyError,
    StorageError,
    storage_error,
)
from pdiffcopy.core.jsonstream import JsonStream
from pdiffcopy.core import packedlisting
from pdiffcopy.local.localtree import LocalTree
from pdiffcopy.local.treewalk import Directories
from pdiffcopy.server.context import request_metrics, server_state
from pdiffcopy.server.requests import export_root, located
from pdiffcopy.local.confinement import Root, clean_relative_path
from pdiffcopy.core.protocol import MAX_PATH_LENGTH, RESERVED_NAME
from pdiffcopy.engine.forkshared import Throttle
from pdiffcopy.engine.options import ALTERNATE_USES, MAX_ALTERNATE_DIRS
from pdiffcopy.core.exportconfig import REFUSABLE
from pdiffcopy.engine.treeendpoints import DELETE, LINK, METADATA, MKNOD, REMOVE, Failure, MetadataOptions, Operation
from pdiffcopy.core.treeplan import DIR, FILE, Entry
from pdiffcopy.core.xattrs import PRIVILEGED_PREFIXES
from pdiffcopy.core.treestops import NODES_DEVICES, NODES_SPECIALS
from pdiffcopy.core.treewire import (
    MAX_BATCH_BYTES,
    MAX_BATCH_FILES,
    MAX_BATCH_OPERATIONS,
    MAX_FILE_BYTES,
    MAX_JSON_BODY_BYTES,
    MAX_JSON_ITEM_CHARS,
    NODES_HEADER,
    NOT_KEPT_HEADER,
    NOT_KEPT_OWNER,
    NOT_KEPT_XATTRS,
    PACKED_RECORDS_PARAMETER,
    TREE_ORDER_HEADER,
    TREE_ORDER_WALK,
    TreeWireError,
    decode_files,
    encode_files,
    parse_entry,
    parse_operation,
)

#: The prefix of the server's own endpoints (server.API_PREFIX).
PREFIX = f"/{RESERVED_NAME}"

#: Bytes of listing text gathered before they are sent: large enough that a
#: listing of 200,000 entries goes out in a few hundred writes, small enough
#: that a worker holds little of it (the whole text of such a listing is
#: about 30 MB, and its objects took 128 MiB).
LISTING_PIECE_BYTES = 256 * 1024

_COMPACT = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))

logger = logging.getLogger(__name__)


#: Permission bits a client may set only on a server that trusts it
#: (``--trust-clients``): a set-user-ID or set-group-ID program made by a
#: client would run with the identity of its owner (root, for a root server)
#: for anyone on the server who runs it. A directory's set-group-ID bit only
#: passes its group on to new files and stays.
SET_ID_BITS = stat.S_ISUID | stat.S_ISGID


def _limited(records: Iterator[Tuple[Entry, Optional[bytes], str]], bucket: Throttle
             ) -> Iterator[Tuple[Entry, Optional[bytes], str]]:
    """``records`` as they are, each file's bytes taken from ``bucket`` before it goes out."""
    for record in records:
        bucket.take(len(record[1] or b""))
        yield record


class _Policy:
    """What a server takes out of its clients' requests: what it does not trust them with (see
    SET_ID_BITS), and, not running as root, the owners and attributes it could not set anyway."""

    def __init__(self, trust_clients: bool) -> None:
        self.trust_clients = trust_clients
        #: Why owners and security.*/trusted.* attributes are not kept ("" when they are).
        self.why_not = "" if trust_clients and os.geteuid() == 0 else ("-user" if trust_clients else "-untrusted")

    def not_kept(self) -> Tuple[str, ...]:
        """What the listing says is not kept (:data:`~pdiffcopy.core.treewire.NOT_KEPT_HEADER`)."""
        return (NOT_KEPT_OWNER, NOT_KEPT_XATTRS) if self.why_not else ()

    def nodes(self) -> Tuple[str, ...]:
        """What the listing says the server makes (:data:`~pdiffcopy.core.treewire.NODES_HEADER`):
        fifos and sockets for anyone, device nodes for the clients it trusts, as root only (a
        device node is a door to the device for every local user it lets in)."""
        return (NODES_SPECIALS,) if self.why_not else (NODES_DEVICES, NODES_SPECIALS)

    def options(self, options: MetadataOptions) -> Tuple[MetadataOptions, Set[str]]:
        """The options to apply, and a set that collects what was ignored."""
        ignored: Set[str] = set()
        if not self.why_not:
            return options, ignored
        if options.owner:
            ignored.add("owner" + self.why_not)
        # security.* and trusted.* of the server's files are neither set nor removed.
        return dataclasses.replace(options, owner=False, privileged_xattrs=False), ignored

    def entry(self, entry: Entry, ignored: Set[str]) -> Entry:
        """The entry with the set-id bits and attributes the client may not set taken out."""
        if self.why_not and entry.xattrs:
            kept = tuple(pair for pair in entry.xattrs if not pair[0].startswith(PRIVILEGED_PREFIXES))
            if len(kept) != len(entry.xattrs):
                ignored.add("xattrs" + self.why_not)
                entry = entry._replace(xattrs=kept)
        if self.trust_clients or not entry.mode & SET_ID_BITS:
            return entry
        bits = stat.S_ISUID if entry.kind == DIR else SET_ID_BITS
        if not entry.mode & bits:
            return entry
        ignored.add("setid")
        return entry._replace(mode=entry.mode & ~bits)


#: The answer's words for what a server ignored, and why (the client shows them once).
IGNORED_MESSAGES = {
    "owner-untrusted": "owners are not kept: the server does not trust clients with them (--trust-clients)",
    "owner-user": "owners are not kept: the server does not run as root",
    "setid": "setuid/setgid bits are not kept: the server does not trust clients with them "
             "(--trust-clients)",
    "xattrs-untrusted": "security.* and trusted.* attributes are not kept: the server does not trust "
                        "clients with them (--trust-clients)",
    "xattrs-user": "security.* and trusted.* attributes are not kept: the server does not run as root",
}


def storage_failures(view: Callable) -> Callable:
    """Answer a tree's failure that names no status of its own as a storage failure (507).

    Such an error (``LocalTree``'s ``TreeFailure``) means the file system
    failed; the default 500 would say that the server is broken.
    """

    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        try:
            return view(*args, **kwargs)
        except PdiffcopyError as error:
            if error.http_status == 500:
                raise StorageError(str(error)) from None
            raise

    return wrapper


def open_tree(path: str) -> LocalTree:
    """The tree at a request's path, confined beneath its export's directory; the caller closes it."""
    root, relative = export_root(path)
    relative = clean_relative_path(relative)
    check_confined(root, relative)
    tree = LocalTree.below(root, relative)
    tree.write_hard_links = server_state().config.write_hard_links
    tree.entries_from_client = True
    return tree


#: What an export's ``refuse`` names of a tree's operations and metadata flags.
REFUSED_OPERATIONS = {DELETE: "delete", LINK: "hard-links", MKNOD: "devices"}
REFUSED_FLAGS = ("owner", "xattrs", "acls")


def check_refused(options: MetadataOptions, operations: Sequence[Operation] = (), asked: Sequence[str] = ()) -> None:
    """Refuse (403) a tree request that would do what its export refuses, before it does anything."""
    refused = g.export.rules.refuse
    if not refused:
        return
    wanted = {*asked, *(flag for flag in REFUSED_FLAGS if getattr(options, flag)),
              *(REFUSED_OPERATIONS.get(operation.name) for operation in operations)}
    hit = sorted(wanted.intersection(refused))
    if hit:
        raise AccessDenied(f"{g.export.name} refuses to {REFUSABLE[hit[0]]}")


def client_policy() -> "_Policy":
    """What the export lets its clients set (``trust_clients``)."""
    return _Policy(g.export.rules.trust_clients)


def check_confined(root: Root, relative: str) -> None:
    """Refuse a tree path that leads out of the root (403), before any work starts.

    The tree confines every access anyway; this makes an escape a 403 for the
    whole request rather than one failure per entry. A path that does not
    exist (yet), or has a file on its way, is for the tree to report.
    """
    try:
        fd = root.open(relative or ".", os.O_PATH)
    except (FileMissing, NotAFile):
        return
    os.close(fd)


def check_files_to_read(entries: List[Entry]) -> None:
    """Bound a read request: regular files only, each and all of them small enough."""
    total = 0
    for entry in entries:
        if entry.kind != FILE:
            raise BadRequest(f"Not a regular file: {entry.path!r} is a {entry.kind}")
        if entry.size > MAX_FILE_BYTES:
            raise BadRequest(f"{entry.path!r} has {entry.size} bytes; at most {MAX_FILE_BYTES} "
                             f"travel whole")
        total += entry.size
    if total > MAX_BATCH_BYTES:
        raise BadRequest(f"At most {MAX_BATCH_BYTES} bytes per read request")


def check_server_root_kept(operations: List[Operation]) -> None:
    """Refuse to delete the server's root directory or change its metadata (a tree's own root is fair game)."""
    for operation in operations:
        if not operation.entry.path and operation.name in (DELETE, REMOVE, METADATA):
            raise AccessDenied("The root directory itself cannot be changed")


def metadata_options() -> MetadataOptions:
    """The ``times``, ``owner``, ``fsync``, ``xattrs``, ``acls``, ``numeric_ids`` and ``sparse`` query
    flags (0 or 1, 0 when missing)."""
    return MetadataOptions(times=flag_arg("times"), owner=flag_arg("owner"), fsync=flag_arg("fsync"),
                           xattrs=flag_arg("xattrs"), acls=flag_arg("acls"),
                           numeric_ids=flag_arg("numeric_ids"), sparse=flag_arg("sparse"))


def flag_arg(name: str) -> bool:
    value = request.args.get(name, "0")
    if value not in ("0", "1"):
        raise BadRequest(f"Parameter {name} must be 0 or 1")
    return value == "1"


def json_list(key: str, limit: int, parse: Callable[[Any], Any]) -> List[Any]:
    """The list under ``key`` of the request body's JSON object, each item checked by ``parse``.

    Read and checked one item at a time (:class:`~pdiffcopy.core.jsonstream.JsonStream`):
    only the parsed items are kept, never the whole text or its raw objects,
    and the first bad item ends the request, with the rest left unread.

    :raises PayloadTooLarge: For a body over :data:`MAX_JSON_BODY_BYTES` (by
                             its Content-Length before reading, or as it is read).
    :raises BadRequest: For anything but ``{key: [item, ...]}`` with at most
                        ``limit`` items that ``parse`` accepts.
    """
    length = request.content_length
    if length is not None and length > MAX_JSON_BODY_BYTES:
        raise PayloadTooLarge(f"The request body has {length} bytes; at most {MAX_JSON_BODY_BYTES} "
                              f"are accepted")
    reader = JsonStream(request.stream, MAX_JSON_ITEM_CHARS, MAX_JSON_BODY_BYTES)
    shape = f"The request body must be a JSON object with a list {key!r}"
    try:
        reader.begin_object()
        if reader.next_key() != key:
            raise BadRequest(shape)
        values = [parse(value) for value in reader.items(limit, key)]
        if reader.next_key() is not None:
            raise BadRequest(shape)
        reader.end()
    except PayloadTooLarge:
        raise
    except BadRequest as error:
        if str(error).startswith("Malformed JSON"):
            raise BadRequest(f"The request body is not valid JSON ({error})") from None
        raise
    return values


def packed_entries(limit: int) -> List[Entry]:
    """The entries of a packed request body (:mod:`~pdiffcopy.core.packedlisting`'s batches and
    end marker), each checked as :func:`json_list` checks a JSON one.

    :raises PayloadTooLarge: For a body over :data:`MAX_JSON_BODY_BYTES`.
    :raises BadRequest: For a body without a length, malformed, or with more than ``limit`` entries.
    """
    length = request.content_length
    if length is None:
        raise BadRequest("A packed request body needs a Content-Length")
    if length > MAX_JSON_BODY_BYTES:
        raise PayloadTooLarge(f"The request body has {length} bytes; at most {MAX_JSON_BODY_BYTES} "
                              f"are accepted")
    pieces, left = [], length
    while left:
        piece = request.stream.read(min(left, 1024 * 1024))
        if not piece:
            raise BadRequest("The request body was cut short")
        pieces.append(piece)
        left -= len(piece)
    body = io.BytesIO(b"".join(pieces))
    entries: List[Entry] = []
    for batch in packedlisting.decode_batches(body.read):
        entries += batch
        if len(entries) > limit:
            raise BadRequest(f"At most {limit} entries per request")
    if body.read(1):
        raise BadRequest("The request body goes on after its end marker")
    return entries


def listing_stream(tree: LocalTree, top: Optional[Entry], directories: Directories,
                   packed: bool = False) -> Iterator[bytes]:
    """A listing as JSON text (or, ``packed``, in :mod:`~pdiffcopy.core.packedlisting`'s form),
    sent while the tree is walked; closes the tree.

    The document is the one a client once received whole,
    ``{"root": ..., "entries": [...], "failures": [...]}``, and ends with
    ``"complete": true``: a listing cut short is never taken for a whole one.
    Should the walk fail midway, after the status was sent, the text ends
    with ``"error": MESSAGE`` and no closing brace, so that no client can
    read it as a complete listing (ours reports the message). Text is sent in
    pieces of about :data:`LISTING_PIECE_BYTES`; the failures, usually few,
    are kept until the end. A packed listing has the same ending, in JSON,
    after its batches.
    """
    encode = _COMPACT.encode
    failures: List[Failure] = []
    # Packed: the head, batches, the end marker, then the JSON ending; the JSON: its text.
    if packed:
        head, closing = packedlisting.encode_head(top), packedlisting.END + b"{"
    else:
        head = b'{"root":' + encode(None if top is None else top.to_wire()).encode("ascii") + b',"entries":['
        closing = b"],"
    try:
        pieces = [head]
        size, first = 0, True
        for entries, failed in directories:
            failures.extend(failed)
            if not entries:
                continue
            if packed:
                for batch in packedlisting.encode_batches(entries):
                    pieces.append(batch)
                    size += len(batch)
            else:
                text = encode([entry.to_wire() for entry in entries])[1:-1].encode("ascii")
                if not first:
                    pieces.append(b",")
                first = False
                pieces.append(text)
                size += len(text)
            if size >= LISTING_PIECE_BYTES:
                yield b"".join(pieces)
                pieces, size = [], 0
        pieces.append(closing + b'"failures":' + encode([list(failure) for failure in failures]).encode("ascii")
                      + b',"complete":true}')
        yield b"".join(pieces)
    except (OSError, PdiffcopyError) as error:
        message = storage_error(error, "list the tree") if isinstance(error, OSError) else error
        logger.warning("Listing of %s failed midway: %s", tree.location, message)
        yield (closing + b'"failures":' + encode([list(failure) for failure in failures]).encode("ascii")
               + b',"error":' + encode(str(message)).encode("ascii"))
    finally:
        tree.close()


def wants_packed_listing(accept: Optional[str]) -> bool:
    """Whether the Accept header names the packed listing (any other answer is JSON, as it always was)."""
    if not accept:
        return False
    for item in accept.split(","):
        media_type, _, parameters = item.partition(";")
        if media_type.strip().lower() == packedlisting.PACKED_LISTING_TYPE:
            return parameters.replace(" ", "").lower() not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


def json_answer(document: Any) -> Response:
    """A JSON answer written compactly: a listing of 60,000 entries takes a tenth of a second."""
    text = json.dumps(document, ensure_ascii=True, separators=(",", ":"))
    return Response(text, mimetype="application/json")


def failures_answer(failures: List[Failure], ignored: AbstractSet[str] = frozenset(),
                    notices: Sequence[str] = ()) -> Response:
    """The failures of a batch, and (``ignored`` and ``notices``, when not empty) what the server did
    not do: by its policy, or because its file system could not (attributes it does not support)."""
    document: dict = {"failures": [list(failure) for failure in failures]}
    if ignored or notices:
        document["ignored"] = [IGNORED_MESSAGES[name] for name in sorted(ignored)] + list(notices)
    return json_answer(document)


class _ClosingBody:
    """An answer's body that calls ``release`` when the server closes it (PEP 3333), even
    unstarted: a HEAD request's body is never read, and a generator that never
    started runs no ``finally``.
    """

    def __init__(self, body: Iterator[bytes], release: Callable[[], None]) -> None:
        self._body = body
        self._release = release

    def __iter__(self) -> Iterator[bytes]:
        return self._body

    def close(self) -> None:
        try:
            self._body.close()  # type: ignore[attr-defined]
        finally:
            self._release()


def _data_size(record: Tuple[Entry, Optional[bytes], str]) -> int:
    return len(record[1] or b"")


class _ClientBody:
    """A request body whose read errors (a client gone mid-body) are the client's: 400."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def readinto(self, view: memoryview) -> int:
        try:
            return self._body.readinto(view)
        except OSError as error:
            raise BadRequest(f"The request body could not be read: {error}") from None


#: The tree endpoints, each for a directory below the root and for the root itself.
trees = Blueprint("trees", __name__)


@trees.get(f"{PREFIX}/tree/")
@trees.get(f"{PREFIX}/tree/<path:path>")
@storage_failures
def tree_list(path: str = ""):
    """Everything below the tree (symlinks listed, not followed), and what could not be listed."""
    pushed_to = flag_arg("sweep")  # a push's target: refused here, before it copies, if it may not write
    if pushed_to:
        if g.export.rules.read_only:
            g.export.refuse_writes()
        check_refused(metadata_options(), asked=request.args.get("asking", "").split(","))
    tree = open_tree(path)
    # -X/-A: every attribute asked for is listed, security.* and trusted.* too
    # (what a client may read, as it reads owners and content); applying them is the policy's.
    tree.list_attributes(metadata_options())
    if pushed_to:  # remove what writers that are gone left (docs/design.rst)
        tree.sweep_while_listing()
    if flag_arg("root_link"):  # a single file pulled with -a: a symlink is listed as one
        tree.describe_root_link()
    try:
        # The root now: a missing or unreadable tree is an error status.
        top, directories = tree.walk()
    except BaseException:
        tree.close()
        raise

    def release() -> None:
        directories.close()
        tree.close()

    packed = wants_packed_listing(request.headers.get("Accept"))
    response = Response(_ClosingBody(listing_stream(tree, top, directories, packed), release),
                        mimetype=packedlisting.PACKED_LISTING_TYPE if packed else "application/json")
    response.headers[TREE_ORDER_HEADER] = TREE_ORDER_WALK  # LocalTree.walk's order
    policy = client_policy()
    not_kept = policy.not_kept()
    if not_kept:
        response.headers[NOT_KEPT_HEADER] = ", ".join(not_kept)
    response.headers[NODES_HEADER] = ", ".join(policy.nodes())
    response.headers["Vary"] = "Accept"
    return response


@trees.post(f"{PREFIX}/tree-read/")
@trees.post(f"{PREFIX}/tree-read/<path:path>")
@storage_failures
def tree_read(path: str = ""):
    """The files the body lists, whole, as a treewire stream (unreadable ones as error records)."""
    state = server_state()
    metrics, rate_limit = request_metrics(), state.rate_limit
    if packedlisting.media_type(request.headers.get("Content-Type")) == packedlisting.PACKED_LISTING_TYPE:
        entries = packed_entries(MAX_BATCH_FILES)
    else:
        entries = json_list("entries", MAX_BATCH_FILES, parse_entry)
    check_files_to_read(entries)
    tree = open_tree(path)

    def stream() -> Iterator[bytes]:
        # Runs after the view has returned; closes the tree when the
        # answer is done or abandoned (a client gone mid-stream).
        try:
            records = tree.read_files(entries)
            if metrics is not None:
                records = metrics.served(records, size=_data_size)
            if rate_limit is not None:
                records = _limited(records, rate_limit)
            if coded:
                if metrics is not None:
                    records = metrics.counted(records, metrics.compressed_bytes.labels("sent"), _data_size)
                yield from compression.compressed_stream(encode_files(records, packed), level)
            else:
                yield from encode_files(records, packed)
        finally:
            tree.close()

    packed = flag_arg(PACKED_RECORDS_PARAMETER)  # headers packed where they can be, for a client that asks
    # Compressed when the client asks (RFC 9110 content coding of the answer).
    coded = compression.accepts_zstd(request.headers.get("Accept-Encoding"))
    # At the level our client chose from the link it measured (?level=N); 1 for anyone else.
    level = compression.asked_level(request.args.get(compression.LEVEL_PARAMETER))
    response = Response(stream(), mimetype="application/octet-stream")
    response.headers["Vary"] = "Accept-Encoding"
    if coded:
        response.headers["Content-Encoding"] = compression.ENCODING
    return response


@trees.post(f"{PREFIX}/tree-write/")
@trees.post(f"{PREFIX}/tree-write/<path:path>")
@storage_failures
def tree_write(path: str = ""):
    """Write the files of the treewire stream in the body, each whole or not at all."""
    state = server_state()
    policy = client_policy()
    metrics, rate_limit = request_metrics(), state.rate_limit
    check_refused(metadata_options())
    options, ignored = policy.options(metadata_options())
    tree = open_tree(path)
    body = open_body(request.environ, request.content_length)
    coding = (request.headers.get("Content-Encoding") or "").strip().lower()
    if coding not in ("", "identity", compression.ENCODING):
        raise BadRequest(f"Unsupported Content-Encoding: {coding[:100]!r}")
    stream: Any = _ClientBody(body)
    if coding == compression.ENCODING:
        # Decompressed as read; every record's digest is checked before it is written.
        stream = compression.DecompressingReader(stream, TreeWireError)
    refusal: List[PdiffcopyError] = []

    def files() -> Iterator[Tuple[Entry, bytes]]:
        # Only records whose digest matched come out of decode_files: a
        # corrupt or cut-off record stops the stream before it is written.
        records = decode_files(stream, MAX_BATCH_FILES, MAX_BATCH_BYTES)
        if metrics is not None:  # a batch at a time: per file, the counter cost more than parsing the header
            records = metrics.counted(records, metrics.bytes_received, _data_size)
            if coding == compression.ENCODING:
                records = metrics.counted(records, metrics.compressed_bytes.labels("received"), _data_size)
        try:
            for entry, data, _ in records:
                if data is None:
                    raise TreeWireError(f"A write stream carries files, not errors ({entry.path!r})")
                if rate_limit is not None:
                    rate_limit.take(len(data))
                yield policy.entry(entry, ignored), data
        except PdiffcopyError as problem:
            refusal.append(problem)  # raised below, even if the tree took it for one failure
            raise
        finally:
            records.close()  # counts what is left to count now, not when collected

    try:
        failures = tree.write_files(files(), options, fresh=flag_arg("fresh"))
    except PdiffcopyError:
        if not refusal:
            raise
    finally:
        body.finish()
        tree.close()
    if refusal:
        raise refusal[0]
    return failures_answer(failures, ignored, tree.take_notices())


@trees.post(f"{PREFIX}/tree-apply/")
@trees.post(f"{PREFIX}/tree-apply/<path:path>")
@storage_failures
def tree_apply(path: str = ""):
    """Run the operations of the body in order; report the ones that failed."""
    policy = client_policy()
    options, ignored = policy.options(metadata_options())
    operations = [Operation(operation.name, policy.entry(operation.entry, ignored))
                  for operation in json_list("operations", MAX_BATCH_OPERATIONS, parse_operation)]
    check_refused(metadata_options(), operations)
    if not clean_relative_path(located(path)[1]):
        check_server_root_kept(operations)
    tree = open_tree(path)
    tree.make_devices = NODES_DEVICES in policy.nodes()
    try:
        failures = tree.apply(operations, options)
    finally:
        tree.close()
    return failures_answer(failures, ignored, tree.take_notices())


@trees.post(f"{PREFIX}/tree-alternates/")
@trees.post(f"{PREFIX}/tree-alternates/<path:path>")
@storage_failures
def tree_alternates(path: str = ""):
    """Take the body's files from the directories ``dir`` (relative to the tree, beneath the export's
    root) when they are what the client's entries say: rsync's --link-dest, --copy-dest, --compare-dest."""
    use = request.args.get("use", "")
    if use not in ALTERNATE_USES:
        raise BadRequest(f"Invalid use: {use[:20]!r} (expected {', '.join(ALTERNATE_USES)})")
    directories = request.args.getlist("dir")
    if not 0 < len(directories) <= MAX_ALTERNATE_DIRS or \
            any(not directory or len(directory) > MAX_PATH_LENGTH or "\0" in directory for directory in directories):
        raise BadRequest(f"Expected 1 to {MAX_ALTERNATE_DIRS} directories (dir), each a path")
    dry_run = request.args.get("dry_run") == "1"
    policy = client_policy()
    check_refused(metadata_options(), asked=("hard-links",) if use == "link" else ())
    options, ignored = policy.options(metadata_options())
    items = json_list("entries", MAX_BATCH_OPERATIONS, _alternate_item)
    tree = open_tree(path)
    try:
        taken, copied, failures = tree.take_from_alternates(
            [policy.entry(entry, ignored) for entry, _ in items], {entry.path for entry, exists in items if exists},
            directories, use, options, dry_run=dry_run)
    finally:
        tree.close()
    return json_answer({"taken": taken, "copied_bytes": copied, "failures": [list(f) for f in failures]})


def _alternate_item(value: Any) -> Tuple[Entry, bool]:
    """``[entry, exists]``: a file to take, and whether the tree has a version of it."""
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], bool):
        raise TreeWireError("Invalid item: expected [entry, exists]")
    entry = parse_entry(value[0])
    if entry.kind != FILE:
        raise TreeWireError(f"Invalid item: {entry.path!r} is not a file")
    return entry, value[1]


__all__ = ["trees"]

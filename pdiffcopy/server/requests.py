"""Reading a request: its path, query parameters, preconditions and small binary bodies.

Every view of the server parses its request with these, so that a bad request
gets the same one-line answer wherever it arrives.
"""

from __future__ import annotations

import os
import re
import stat as stat_module
from typing import List, Optional, Tuple
from urllib.parse import parse_qs

from flask import g, request
from werkzeug.http import unquote_etag
from werkzeug.routing import PathConverter

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.byteranges import overlapping, parse_explicit_ranges
from pdiffcopy.core.protocol import LEASE_HEADER, NO_FOLLOW_HEADER
from pdiffcopy.core.records import dataclass
from pdiffcopy.errors import AccessDenied, BadRequest, Conflict, PayloadTooLarge, RangeNotSatisfiable, storage_error
from pdiffcopy.local import devices
from pdiffcopy.local.confinement import Root
from pdiffcopy.local.descriptors import etag, is_temporary_name
from pdiffcopy.local.confinedfile import ConfinedFile
from pdiffcopy.local.localfile import LocalFile
from pdiffcopy.server.bodyreader import open_body
from pdiffcopy.server.exports import Export, ExportedDevice

#: Largest region one hash request may cover. A client asks per segment
#: (64 MiB by default); 1 GiB leaves room for large blocks and still bounds
#: the work one request can demand.
MAX_HASH_REQUEST_BYTES = 1024 * 1024 * 1024

#: Most blocks one hash request may cover (bounds the answer's size).
MAX_HASH_REQUEST_BLOCKS = 1024 * 1024

#: Largest file a resize may create: beyond what any disk holds, so a bogus
#: size is refused even before the free space check.
MAX_FILE_SIZE = 1 << 50


class AnyPathConverter(PathConverter):
    """Werkzeug's ``path`` converter, but matching any first character and newlines.

    The stock one wants a first character other than ``/`` and no newline
    after it, so ``/.pdiffcopy/resize//x`` or a name with a newline fell
    through to other rules (405, a generic 404, or the reserved-name 403).
    Matching everything lets one function, :func:`pdiffcopy.local.confinement.clean_relative_path`,
    judge every path, with a message that names the problem.
    """

    regex = r"[\s\S]+?"
    part_isolating = False  # it matches slashes (Werkzeug guesses from a literal "/")


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


@dataclass(frozen=True)
class Seen:
    """What a view knows of a file it opened: its ``fstat`` (which keys its lease), size and entity tag.

    A block device's ``st_size`` is 0 and its mtime tells nothing: its size is the device's and
    its tag its write counters (:func:`~pdiffcopy.local.devices.identity`), which the client's
    engine compares at the end of a sync and sends back in ``If-Match``.
    """

    info: os.stat_result
    size: int
    etag: str
    #: "file", "device" (only an export's), "directory" or "other".
    kind: str


def seen(fd: int, where: str) -> Seen:
    """The :class:`Seen` of the open file ``fd``: a regular file, or an exported device (the
    root's files are opened only when regular: a device descriptor comes from an export)."""
    info = os.fstat(fd)
    if not stat_module.S_ISBLK(info.st_mode):
        return seen_unopened(info)
    try:
        return Seen(info, devices.device_size(fd), devices.identity(fd), "device")
    except OSError as error:
        raise storage_error(error, f"read {where}") from None


def seen_unopened(info: os.stat_result) -> Seen:
    """The :class:`Seen` of a file looked at without opening it: a device node there (below the
    root) is "other", as a FIFO is, and never served."""
    kind = "file" if stat_module.S_ISREG(info.st_mode) else (
        "directory" if stat_module.S_ISDIR(info.st_mode) else "other")
    return Seen(info, info.st_size, etag(info), kind)


def describe(file: Seen) -> dict:
    """The JSON description of a file."""
    return {"type": file.kind, "size": file.size, "mtime_ns": file.info.st_mtime_ns,
            "mode": stat_module.S_IMODE(file.info.st_mode), "etag": file.etag}


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


def located(path: str) -> Tuple[Export, str]:
    """The export a path of this request names (its own, or a ``from``/``to`` argument's), and
    the path within it: only the export the request was admitted to
    (:mod:`~pdiffcopy.server.admission`), so that no argument crosses into another.

    :raises AccessDenied: For a path of another export (a device's NAME in the shorthand).
    """
    export, relative = g.exports.locate(path)
    admitted = g.get("export")
    if export is None or export is not admitted:
        shown = admitted.shown if admitted is not None else "no export"
        raise AccessDenied(f"{path} is not in {shown}, which this request uses: a request stays in one export")
    return export, relative


def file_or_device(path: str, follow: bool = True) -> LocalFile:
    """The file a request names: an exported device (:mod:`~pdiffcopy.server.exports`) by its
    NAME, else a regular file of the export (:func:`served`).

    The views that read or write bytes in place use it; those that make, rename or remove
    files (temporaries, trees) reach directories only.
    """
    export, relative = located(path)
    return ExportedDevice(export.device) if export.device is not None else _confined(export, relative, path, follow)


def refuse_export(path: str, what: str) -> None:
    """Refuse to make, replace or remove what a device's NAME names: a device is written in place."""
    if located(path)[0].device is not None:
        raise AccessDenied(f"Cannot {what} {path}: it is a block device, updated in place and never replaced")


def export_root(path: str) -> Tuple[Root, str]:
    """The directory of the export ``path`` is in, and the path below it."""
    export, relative = located(path)
    return export.directory(path), relative


def served(path: str, follow: bool = True) -> LocalFile:
    """The file a request names, confined beneath its export's directory
    (:class:`~pdiffcopy.local.confinedfile.ConfinedFile`).

    Every view reaches its files this way: only regular files are opened
    (FIFOs and devices are refused with 409 without being opened or waited
    on), nothing outside the export, and a symlink in the last name only when
    it stays inside (``follow``), and never when the request says
    :data:`~pdiffcopy.core.protocol.NO_FOLLOW_HEADER` (a tree's member, which is
    a file only if it is one). Messages name the path the client sent.
    """
    return _confined(*located(path), path, follow)


def _confined(export: Export, relative: str, path: str, follow: bool) -> LocalFile:
    value = request.headers.get(NO_FOLLOW_HEADER, "0")
    if value not in ("0", "1"):
        raise BadRequest(f"Header {NO_FOLLOW_HEADER} must be 0 or 1")
    return ConfinedFile(export.directory(path), relative, follow=follow and value == "0", name=path)


def require_temporary(path: str) -> None:
    """Refuse to let the atomic-write endpoints touch anything but temporary files."""
    if not is_temporary_name(path.rstrip("/").rpartition("/")[2]):
        raise AccessDenied(f"Not a pdiffcopy temporary file: {path}")


def check_preconditions(file: Seen) -> None:
    """Honour ``If-Match``: the client's idea of the file must still be true."""
    wanted = request.headers.get("If-Match")
    if wanted and wanted.strip() != "*" and file.etag not in [t.strip() for t in wanted.split(",")]:
        raise Conflict("The file changed since the sync started (ETag mismatch)")


def not_modified(file: Seen) -> bool:
    """Whether a GET or HEAD may be answered 304 Not Modified (RFC 9110, section 13.2.2).

    ``If-None-Match`` (a weak comparison, ``*`` matching any file) takes
    precedence; only without it does ``If-Modified-Since`` count, compared
    with the whole seconds that ``Last-Modified`` shows. A date that cannot
    be parsed is ignored, as the RFC says.
    """
    if "If-None-Match" in request.headers:
        return request.if_none_match.contains_weak(unquote_etag(file.etag)[0])
    since = request.if_modified_since
    # (A device's mtime does not tell its changes: only its tag answers 304.)
    return since is not None and file.kind != "device" and int(file.info.st_mtime) <= since.timestamp()


def lease_of_request() -> Optional[str]:
    """The write lease the request names (:data:`~pdiffcopy.core.protocol.LEASE_HEADER`), if any."""
    return request.headers.get(LEASE_HEADER) or None

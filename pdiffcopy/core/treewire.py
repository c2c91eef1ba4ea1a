"""The wire format of a batch of whole files, in either direction.

A tree sync moves small files many at a time: ``POST /.pdiffcopy/tree-read``
answers with such a stream and ``POST /.pdiffcopy/tree-write`` takes one
(docs/protocol.rst, section Trees). A stream is a sequence of records and an
end marker::

    record   = LENGTH HEADER DATA DIGEST
    LENGTH   = 4 bytes, big-endian, N > 0: the size of HEADER
    HEADER   = N bytes of UTF-8 JSON: {"entry": ENTRY, "size": n}
               or {"entry": ENTRY, "size": 0, "error": "why, in one line"}
    DATA     = n bytes: the file's content (none for an error record)
    DIGEST   = 8 bytes: the xxh3_64 digest of DATA, big-endian
    end      = 4 zero bytes, and nothing after them

``ENTRY`` is :meth:`Entry.to_wire`. A peer that knows it (see
:data:`PACKED_RECORDS_PARAMETER`) may also get a file record's header packed:
``0x01``, then size and mtime_ns (signed 64-bit), mode, uid, gid and nlink
(unsigned 32-bit), sparse (one byte), all little-endian, then the path's
bytes; a JSON header always starts with ``{``, so a decoder tells the two
apart by the first byte. Error records, and entries with a link group or
attributes, keep the JSON header. Headers are written with
``ensure_ascii``: a name that is not UTF-8 travels as the ``\\udcXX``
surrogate escapes :func:`os.fsdecode` gives it, and comes back as the same
``str``. The decoder verifies every digest before it hands a record out,
so a record that is corrupt or cut short is never written anywhere, and it
bounds each header and each file so that a hostile stream cannot make it
allocate without limit.
"""

from __future__ import annotations

import binascii
import json
import os
import re
import struct
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import xxhash

from pdiffcopy.errors import AccessDenied, BadRequest
from pdiffcopy.core.protocol import MAX_PATH_LENGTH
# Of the vocabulary of listings' headers and writes' answers, kept apart for local syncs (treestops).
from pdiffcopy.core.treestops import NOT_ATTEMPTED, NOT_KEPT_OWNER, NOT_KEPT_XATTRS, stop_cause
from pdiffcopy.core.entries import (
    DIR,
    FILE,
    OTHER,
    SYMLINK,
    Entry,
    device_numbers,
    is_device,
    known_mode,
    node_type,
    shared_mode,
)
from pdiffcopy.core.treeplan import BACKUP, LINK, MKNOD, OPERATIONS, Operation

#: Largest header accepted: an entry with a 4,096-byte path escaped six
#: bytes per byte fits many times over.
MAX_HEADER_BYTES = 1024 * 1024

#: Largest file one record may carry. Bigger files go through the block
#: engine (:meth:`~pdiffcopy.engine.treeendpoints.TreeEndpoint.file_endpoint`).
MAX_FILE_BYTES = 64 * 1024 * 1024

#: Most files one request may read or write, and most bytes all of them may
#: hold together: bounds the work and the time one request stands for.
MAX_BATCH_FILES = 10_000
MAX_BATCH_BYTES = 256 * 1024 * 1024

#: Most operations one apply request may carry.
MAX_BATCH_OPERATIONS = 10_000

#: Largest JSON request body (a read's entries, an apply's operations):
#: 10,000 entries with long paths fit, and it bounds what one request can
#: make the server hold. The body is read and checked one item at a time
#: (:mod:`~pdiffcopy.core.jsonstream`), so a worker holds the parsed items, not the
#: whole text and its raw objects (json.loads on 64 MiB of ``[[],[],...]``
#: took 1.7 GiB).
MAX_JSON_BODY_BYTES = 64 * 1024 * 1024

#: Longest JSON text of one item of such a body, or of a listing: an entry
#: with a path and a symlink target of 4,096 bytes each, escaped as six
#: characters per byte (``\udcff``), and its numbers, fits.
MAX_JSON_ITEM_CHARS = 64 * 1024

#: The header of a tree listing that says its entries come in walk order
#: (:func:`pdiffcopy.core.treeplan.walk_order`); without it, in no particular order.
TREE_ORDER_HEADER = "Pdiffcopy-Tree-Order"
TREE_ORDER_WALK = "walk"

#: The header of a tree listing that names, comma-separated, what the server will not set of what
#: its clients send (:mod:`pdiffcopy.core.treestops`): a client's plan leaves such differences out.
NOT_KEPT_HEADER = "Pdiffcopy-Not-Kept"

#: The header of a tree listing that names, comma-separated, the nodes the server makes of what
#: its clients send (:data:`~pdiffcopy.core.treestops.NODES_DEVICES`, ``NODES_SPECIALS``): an older
#: server, without it, makes none (it knows no ``mknod`` operation).
NODES_HEADER = "Pdiffcopy-Tree-Nodes"

DIGEST_SIZE = 8
_LENGTH = struct.Struct(">I")

#: The query parameter (``=1``) with which a client asks for, or announces, packed record
#: headers: a read's answer has them; a write's body may (docs/protocol.rst).
PACKED_RECORDS_PARAMETER = "packed"
#: The first byte of a packed header, and its numbers.
_PACKED_TAG = 1
_PACKED_HEADER = struct.Struct("<BqqIIIIB")
END_MARKER = _LENGTH.pack(0)

#: Files smaller than this are sent as one chunk with their header and digest
#: (one write instead of three); bigger ones are passed on without a copy.
_COALESCE_BYTES = 64 * 1024

#: Bounds of the numbers in an entry: what the system calls that use them take.
_MAX_UINT32 = 2 ** 32 - 1
_MAX_INT64 = 2 ** 63 - 1

#: A file read or written as a whole: the entry, its content (None when it
#: could not be read) and why not ("" when it could).
Record = Tuple[Entry, Optional[bytes], str]


class TreeWireError(BadRequest):
    """A batch stream or a tree request is malformed, corrupt, cut short or out of bounds.

    The server answers it with 400; the client reports it as the server's fault.
    """


def digest(data: bytes) -> bytes:
    """The 8-byte digest a record carries after its data."""
    return xxhash.xxh3_64_digest(data)


# -- entries -------------------------------------------------------------------


def _integer(value: Any, name: str, minimum: int, maximum: int) -> int:
    # bool is an int in Python, and JSON's true must not pass for 1.
    if type(value) is not int or not minimum <= value <= maximum:
        raise TreeWireError(f"Invalid entry: {name} must be an integer from {minimum} to {maximum}")
    return value


def check_encodable(text: str, what: str) -> None:
    """Refuse strings no file name can be: NUL, and surrogates other than fsdecode's escapes."""
    if "\x00" in text:
        raise TreeWireError(f"Invalid entry: its {what} contains a NUL byte")
    try:
        encoded = os.fsencode(text)
    except UnicodeError:
        raise TreeWireError(f"Invalid entry: its {what} is not a file name") from None
    if len(encoded) > MAX_PATH_LENGTH:
        raise TreeWireError(f"Invalid entry: its {what} is too long")


def check_relative_path(path: str, allow_root: bool = False) -> str:
    """Insist that ``path`` is a tree-relative path as :class:`Entry` writes them.

    ``/``-separated, no leading or trailing slash, no empty, ``.`` or ``..``
    component: the one spelling of each path, so the same file never goes
    by two names and nothing climbs out of the tree.

    :raises AccessDenied: For ``..`` components and absolute paths.
    :raises TreeWireError: For anything else that is not such a path.
    """
    if not isinstance(path, str):
        raise TreeWireError("Invalid entry: its path must be a string")
    if path == "" and allow_root:
        return path
    check_encodable(path, "path")
    if path.startswith("/"):
        raise AccessDenied(f"Path outside the tree: {path[:200]!r}")
    parts = path.split("/")
    if ".." in parts:
        raise AccessDenied(f"Path outside the tree: {path[:200]!r}")
    if any(part in ("", ".") for part in parts):
        raise TreeWireError(f"Invalid entry path {path[:200]!r}: empty or '.' component")
    return path


#: A "." or ".." component, or an empty one, anywhere in a path.
_ODD_COMPONENT = re.compile(r"(?:^|/)\.{0,2}(?:/|$)")


def _plain_path(path: str) -> bool:
    """Whether ``path`` passes :func:`check_relative_path` the cheap way (the common case: ASCII)."""
    return (path.isascii() and 0 < len(path) <= MAX_PATH_LENGTH and path[0] != "/" and "\x00" not in path
            and not _ODD_COMPONENT.search(path))


#: Each kind's one string object: a decoded listing's entries point at it, not at a copy each.
_KINDS = {kind: kind for kind in (FILE, DIR, SYMLINK, OTHER)}
_UINT32 = range(0, _MAX_UINT32 + 1)


def _plainly_valid(value: Any) -> Optional[Entry]:
    """The entry, when every check passes the cheap way (the common case:
    ASCII names, sane numbers); ``None`` sends it through the field-by-field
    checks, which also say what is wrong. A listing of 64,000 entries spent
    0.8 s in those."""
    if type(value) is not list or len(value) != 10:
        return None
    path, kind, size, mtime_ns, mode, uid, gid, target, nlink, sparse = value
    if not (type(path) is str and _plain_path(path)
            and type(target) is str and target.isascii() and "\x00" not in target
            and len(target) <= MAX_PATH_LENGTH and kind in _KINDS
            and type(size) is int and 0 <= size <= _MAX_INT64
            and type(mtime_ns) is int and -_MAX_INT64 - 1 <= mtime_ns <= _MAX_INT64
            and type(mode) is int and mode in _UINT32 and type(uid) is int and uid in _UINT32
            and type(gid) is int and gid in _UINT32 and type(nlink) is int and nlink in _UINT32
            and type(sparse) is int and sparse in (0, 1)):
        return None
    mode = known_mode(mode) or shared_mode(mode)
    return tuple.__new__(Entry, (path, _KINDS[kind], size, mtime_ns, mode, uid, gid, target, nlink,
                                 bool(sparse), "", ()))


#: Most extended attributes one entry may carry, and most bytes of their names and values
#: together (Linux allows 64 KiB per value; ext4 keeps them all in one 4 KiB block).
MAX_ENTRY_XATTRS = 1024
MAX_ENTRY_XATTR_BYTES = 1024 * 1024
#: Longest link group name.
MAX_LINK_LENGTH = 64


def check_extras(link: Any, xattrs: Any) -> None:
    """The link group and the attributes of a twelve-value entry."""
    if type(link) is not str or len(link) > MAX_LINK_LENGTH or not link.isascii():
        raise TreeWireError(f"Invalid entry: its link must be a string of at most {MAX_LINK_LENGTH} ASCII characters")
    if type(xattrs) is not list or len(xattrs) > MAX_ENTRY_XATTRS:
        raise TreeWireError(f"Invalid entry: its attributes must be a list of at most {MAX_ENTRY_XATTRS} pairs")
    total = 0
    for pair in xattrs:
        if (type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or type(pair[1]) is not str
                or not pair[0] or "\x00" in pair[0] or not pair[1].isascii()):
            raise TreeWireError("Invalid entry: an attribute must be [name, base64 value]")
        total += len(pair[0]) + len(pair[1])
    if total > MAX_ENTRY_XATTR_BYTES:
        raise TreeWireError("Invalid entry: its attributes are too long")


def parse_entry(value: Any, allow_root: bool = False) -> Entry:
    """An :class:`Entry` from its wire form, checked field by field.

    Stricter than :meth:`Entry.from_wire` (which converts what it is given):
    the values come from the network and end up in system calls.

    :param allow_root: Accept the path ``""`` (a listing's root entry).
    :raises TreeWireError: (or :class:`AccessDenied` for a path leading out)
                           with a one-line message.
    """
    quick = _plainly_valid(value)
    if quick is not None:
        return quick
    if not isinstance(value, list) or len(value) not in (10, 12):
        raise TreeWireError("Invalid entry: expected a list of 10 or 12 values")
    path, kind, size, mtime_ns, mode, uid, gid, target, nlink, sparse = value[:10]
    check_relative_path(path, allow_root)
    if not isinstance(kind, str) or not isinstance(target, str):
        raise TreeWireError("Invalid entry: its kind and target must be strings")
    if target:
        check_encodable(target, "symlink target")
    _integer(size, "size", 0, _MAX_INT64)
    _integer(mtime_ns, "mtime_ns", -_MAX_INT64 - 1, _MAX_INT64)
    _integer(mode, "mode", 0, _MAX_UINT32)
    _integer(uid, "uid", 0, _MAX_UINT32)
    _integer(gid, "gid", 0, _MAX_UINT32)
    _integer(nlink, "nlink", 0, _MAX_UINT32)
    if sparse not in (0, 1) or isinstance(sparse, float):
        raise TreeWireError("Invalid entry: sparse must be 0 or 1")
    if len(value) == 12:
        check_extras(value[10], value[11])
    try:
        return Entry.from_wire(value)
    except (ValueError, binascii.Error) as error:  # an unknown kind, bad base64
        raise TreeWireError(f"Invalid entry: {error}") from None


def parse_operation(value: Any) -> Operation:
    """An :class:`~pdiffcopy.engine.treeendpoints.Operation` from its wire form, checked.

    Its entry may be the tree's root (path ``""``): making the tree's
    directory is an operation like any other.
    """
    if not isinstance(value, list) or len(value) != 2:
        raise TreeWireError("Invalid operation: expected [name, entry]")
    name, entry = value
    if name not in OPERATIONS:
        raise TreeWireError(f"Unknown operation {str(name)[:100]!r}")
    operation = Operation(name, parse_entry(entry, allow_root=True))
    if name == LINK:
        check_link(operation.entry)
    elif name == MKNOD:
        check_node(operation.entry)
    elif name == BACKUP:
        check_backup(operation.entry)
    return operation


def check_backup(entry: Entry) -> None:
    """Insist that a :data:`BACKUP` operation names a path of the tree and a relative path to keep it as
    (it may lead out of the tree, into a --backup-dir: the tree refuses one beyond its root).

    :raises TreeWireError: For anything else.
    """
    kept = entry.target
    if not entry.path or not kept or kept.startswith("/") or "\0" in kept or len(kept) > MAX_PATH_LENGTH \
            or kept.endswith("/") or kept.rpartition("/")[2] in (".", ".."):
        raise TreeWireError("Invalid backup operation: its entry must name a path and a relative path "
                            "to keep it as")


def check_node(entry: Entry) -> None:
    """Insist that a :data:`MKNOD` operation names a device (with its numbers), a fifo or a socket.

    :raises TreeWireError: For anything else.
    """
    if entry.kind != OTHER or not entry.path or not node_type(entry.mode):
        raise TreeWireError("Invalid mknod operation: its entry must be a device, a fifo or a socket")
    if is_device(entry.mode) and device_numbers(entry.target) is None:
        raise TreeWireError(f"Invalid mknod operation: {entry.path[:200]!r} has no device numbers "
                            f"(MAJOR:MINOR)")
    if not is_device(entry.mode) and entry.target:
        raise TreeWireError(f"Invalid mknod operation: the {node_type(entry.mode)} {entry.path[:200]!r} "
                            f"has a target")


def check_link(entry: Entry) -> None:
    """Insist that a :data:`LINK` operation names a file and another path of the tree to link it to.

    :raises AccessDenied: When either path leads out of the tree.
    :raises TreeWireError: For anything else that is not such a pair.
    """
    if entry.kind != FILE or not entry.path or not entry.target:
        raise TreeWireError("Invalid link operation: its entry must be a file whose target is the path to link to")
    check_relative_path(entry.target)
    if entry.target == entry.path:
        raise TreeWireError(f"Invalid link operation: {entry.path[:200]!r} is linked to itself")


# -- encoding ------------------------------------------------------------------


def encode_header(entry: Entry, size: int, error: str = "", packed: bool = False) -> bytes:
    """One record's length prefix and header (``packed``: the packed one, where the entry allows)."""
    if packed and not error and not entry.link and not entry.xattrs and entry.kind == FILE:
        try:
            path = entry.path.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            pass  # not a file name: the JSON header carries it, and the receiver says so
        else:
            text = _PACKED_HEADER.pack(_PACKED_TAG, size, entry.mtime_ns, entry.mode, entry.uid, entry.gid,
                                       entry.nlink, int(entry.sparse)) + path
            return _LENGTH.pack(len(text)) + text
    header: dict = {"entry": entry.to_wire(), "size": size}
    if error:
        header["error"] = " ".join(error.splitlines()) or "unreadable"
    text = json.dumps(header, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return _LENGTH.pack(len(text)) + text


def encode_files(records: Iterable[Record], packed: bool = False) -> Iterator[bytes]:
    """The stream of ``records``, as chunks of bytes (ending with the end marker).

    :param records: ``(entry, content, "")`` per file, or ``(entry, None, why)``
                    for one that could not be read.
    :param packed: Packed headers for the files (the receiver must know them).
    :raises TreeWireError: For a file larger than :data:`MAX_FILE_BYTES` or
                           whose content is not as long as its entry says
                           (the receiver would refuse the whole stream).
    """
    # Small records go out together, in pieces of at least _COALESCE_BYTES:
    # one HTTP chunk (and one send) per small file would cost more than the file.
    pending: List[bytes] = []
    pending_size = 0
    for entry, data, error in records:
        if data is None:
            pending.append(encode_header(entry, 0, error or "unreadable") + digest(b""))
            pending_size += len(pending[-1])
            continue
        if len(data) != entry.size:
            raise TreeWireError(f"{entry.path!r} has {len(data)} bytes, its entry says {entry.size}")
        if len(data) > MAX_FILE_BYTES:
            raise TreeWireError(f"{entry.path!r} is larger than {MAX_FILE_BYTES} bytes, too large "
                                f"to travel whole")
        header = encode_header(entry, len(data), packed=packed)
        if len(data) < _COALESCE_BYTES:
            pending += (header, data, digest(data))
            pending_size += len(header) + len(data) + DIGEST_SIZE
            if pending_size >= _COALESCE_BYTES:
                yield b"".join(pending)
                pending, pending_size = [], 0
        else:
            pending.append(header)
            yield b"".join(pending)
            pending, pending_size = [], 0
            yield data
            yield digest(data)
    pending.append(END_MARKER)
    yield b"".join(pending)


# -- decoding ------------------------------------------------------------------


def _parse_packed_header(text: bytes) -> Tuple[Entry, int, str]:
    """A packed file header, checked as parse_entry checks an entry."""
    (size, mtime_ns, mode, uid, gid, nlink, sparse), raw = _packed_header(text)
    if size > MAX_FILE_BYTES:
        raise TreeWireError(f"Invalid batch stream: a file of {size} bytes, more than the "
                            f"{MAX_FILE_BYTES} one record may carry")
    path = raw.decode("utf-8", "surrogateescape")
    if not _plain_path(path):
        check_relative_path(path)  # says what is wrong, or passes an odd but valid name
    entry = tuple.__new__(Entry, (path, FILE, size, mtime_ns, known_mode(mode) or shared_mode(mode), uid, gid,
                                  "", nlink, sparse == 1, "", ()))
    return entry, size, ""



#: Bytes a decoder reads from its source at a time (more when a record needs it).
READ_AHEAD_BYTES = 256 * 1024


class ExactSource:
    """Exactly-``n``-bytes reads over a file-like object or an iterator of chunks.

    Reads are served from a read-ahead buffer: a record is four reads
    (length, header, data, digest), and four calls into a chunked HTTP
    response per small file cost more than the file itself.
    """

    def __init__(self, source: Any) -> None:
        self._read = getattr(source, "read", None)
        self._readinto = getattr(source, "readinto", None)
        self._chunks: Optional[Iterator[bytes]] = None
        if self._read is None and self._readinto is None:
            self._chunks = iter(source)
        self._buffer = b""  # read ahead; handed out from _position on
        self._position = 0
        self._scratch: Optional[memoryview] = None

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes; fewer only at the end of the stream."""
        if size <= 0:
            return b""
        start = self._position
        if len(self._buffer) - start >= size:
            self._position = start + size
            return self._buffer[start:start + size]
        parts = [self._buffer[start:]]
        have = len(parts[0])
        while have < size:
            more = self._raw(max(READ_AHEAD_BYTES, size - have))
            if not more:
                break
            parts.append(more)
            have += len(more)
        joined = b"".join(parts)
        self._buffer, self._position = joined, min(size, len(joined))
        return joined[:size]

    def _raw(self, size: int) -> bytes:
        """The next bytes of the underlying stream, at most ``size`` (empty at its end)."""
        if self._chunks is not None:
            return next(self._chunks, b"")
        if self._read is not None:
            return bytes(self._read(size))
        # One buffer for every read: a new zeroed 256 KiB per call, when a socket hands out a few
        # KiB at a time, was a quarter of a pushed small file's time on the server.
        if self._scratch is None or len(self._scratch) < size:
            self._scratch = memoryview(bytearray(size))
        count = self._readinto(self._scratch[:size])  # type: ignore[misc]
        return self._scratch[:count].tobytes() if count else b""


def decode_files(source: Any, max_files: Optional[int] = None,
                 max_total_bytes: Optional[int] = None,
                 expected: Optional[Sequence[Entry]] = None) -> Iterator[Tuple[Entry, Optional[bytes], str]]:
    """The records of a stream, each checked against its digest before it is yielded.

    :param source: An object with ``read(n)`` or ``readinto(buffer)`` (a
                   response, a request body, a file), or an iterable of
                   ``bytes`` chunks.
    :param max_files: Most records accepted (None: no limit).
    :param max_total_bytes: Most data bytes accepted in all (None: no limit).
    :param expected: The entries asked for, in order (a read's answer): each
                     record must name the next one's path and carry its size,
                     and is handed out with that entry, so the header's entry
                     is not checked field by field (a fifth of a pulled small
                     file's decoding). More records than these are refused.
    :returns: ``(entry, content, "")`` per file and ``(entry, None, why)`` per
              error record; every file record's entry is a regular file
              whose size is the content's.
    :raises TreeWireError: With a one-line message when the stream is
                           malformed, corrupt, cut short or out of bounds,
                           at the first record where that shows.
    """
    reader = ExactSource(source)
    files = 0
    total = 0
    while True:
        prefix = _exactly(reader, _LENGTH.size, "a record's length")
        (length,) = _LENGTH.unpack(prefix)
        if length == 0:
            if reader.read(1):
                raise TreeWireError("Invalid batch stream: data after its end marker")
            return
        if length > MAX_HEADER_BYTES:
            raise TreeWireError(f"Invalid batch stream: a header of {length} bytes "
                                f"(at most {MAX_HEADER_BYTES})")
        header = _exactly(reader, length, "a record's header")
        if expected is None:
            entry, size, error = _parse_header(header)
        elif files < len(expected):
            entry, size, error = _parse_expected_header(header, expected[files])
        else:
            raise TreeWireError(f"Invalid batch stream: more records than the {len(expected)} files "
                                f"asked for")
        files += 1
        if max_files is not None and files > max_files:
            raise TreeWireError(f"Too many files in one batch (at most {max_files})")
        total += size
        if max_total_bytes is not None and total > max_total_bytes:
            raise TreeWireError(f"Too much data in one batch (at most {max_total_bytes} bytes)")
        data = _exactly(reader, size, f"the data of {entry.path!r}")
        if _exactly(reader, DIGEST_SIZE, f"the digest of {entry.path!r}") != digest(data):
            raise TreeWireError(f"Digest mismatch: the data of {entry.path!r} arrived corrupted")
        yield (entry, None, error) if error else (entry, data, "")


def _exactly(reader: ExactSource, size: int, what: str) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise TreeWireError(f"The batch stream was cut short in {what}")
    return data


def _packed_header(text: bytes) -> Tuple[tuple, bytes]:
    """A packed header's numbers (size, mtime_ns, mode, uid, gid, nlink, sparse) and path bytes."""
    if len(text) <= _PACKED_HEADER.size:
        raise TreeWireError("Invalid batch stream: a packed header without a path")
    numbers = _PACKED_HEADER.unpack_from(text)[1:]
    if numbers[0] < 0 or numbers[6] > 1:
        raise TreeWireError("Invalid batch stream: a packed header's size or sparse flag is out of bounds")
    return numbers, text[_PACKED_HEADER.size:]


def _header_of(text: bytes) -> dict:
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise TreeWireError("Invalid batch stream: a record's header is not UTF-8 JSON") from None
    if not isinstance(header, dict) or "entry" not in header:
        raise TreeWireError("Invalid batch stream: a record's header has no entry")
    return header


def _parse_expected_header(text: bytes, wanted: Entry) -> Tuple[Entry, int, str]:
    """A record's header that must be ``wanted``'s: its path, and its size unless an error record."""
    if text[0] == _PACKED_TAG:
        numbers, path = _packed_header(text)
        if path != wanted.path.encode("utf-8", "surrogateescape"):
            raise TreeWireError(f"Invalid batch stream: a record of {path[:200]!r}, which was not asked for "
                                f"at that point ({wanted.path!r} was)")
        if numbers[0] != wanted.size:
            raise TreeWireError(f"Invalid batch stream: the record of {wanted.path!r} has {numbers[0]} bytes, "
                                f"its entry says {wanted.size}")
        return wanted, numbers[0], ""
    header = _header_of(text)
    sent = header["entry"]
    path = sent[0] if type(sent) is list and sent else None
    if path != wanted.path:
        raise TreeWireError(f"Invalid batch stream: a record of {str(path)[:200]!r}, which was not asked for "
                            f"at that point ({wanted.path!r} was)")
    size = header.get("size", 0)
    error = header.get("error", "")
    if not isinstance(error, str):
        raise TreeWireError(f"Invalid batch stream: the error of {wanted.path!r} is not a string")
    if error:
        if size:
            raise TreeWireError(f"Invalid batch stream: the error record of {wanted.path!r} has data")
        return wanted, 0, " ".join(error.splitlines())[:1000] or "unreadable"
    if type(size) is not int or size != wanted.size:
        raise TreeWireError(f"Invalid batch stream: the record of {wanted.path!r} has {str(size)[:30]} bytes, "
                            f"its entry says {wanted.size}")
    return wanted, size, ""


def _parse_header(text: bytes) -> Tuple[Entry, int, str]:
    if text[0] == _PACKED_TAG:
        return _parse_packed_header(text)
    header = _header_of(text)
    entry = parse_entry(header["entry"])
    size = header.get("size", 0)
    if type(size) is not int or size < 0:
        raise TreeWireError(f"Invalid batch stream: the size of {entry.path!r} is not a byte count")
    if size > MAX_FILE_BYTES:
        raise TreeWireError(f"Invalid batch stream: {entry.path!r} has {size} bytes, more than the "
                            f"{MAX_FILE_BYTES} one record may carry")
    error = header.get("error", "")
    if not isinstance(error, str):
        raise TreeWireError(f"Invalid batch stream: the error of {entry.path!r} is not a string")
    if error:
        if size:
            raise TreeWireError(f"Invalid batch stream: the error record of {entry.path!r} has data")
        return entry, 0, " ".join(error.splitlines())[:1000] or "unreadable"
    if entry.kind != FILE:
        raise TreeWireError(f"Invalid batch stream: {entry.path!r} is a {entry.kind}, not a file")
    if size != entry.size:
        raise TreeWireError(f"Invalid batch stream: the record of {entry.path!r} has {size} bytes, "
                            f"its entry says {entry.size}")
    return entry, size, ""


__all__ = [
    "DIGEST_SIZE", "END_MARKER", "ExactSource", "MAX_BATCH_BYTES", "MAX_BATCH_FILES", "MAX_BATCH_OPERATIONS",
    "MAX_FILE_BYTES", "MAX_HEADER_BYTES", "MAX_JSON_BODY_BYTES", "MAX_JSON_ITEM_CHARS", "NOT_KEPT_HEADER",
    "NOT_ATTEMPTED", "NOT_KEPT_OWNER", "NOT_KEPT_XATTRS", "PACKED_RECORDS_PARAMETER",
    "NODES_HEADER", "Record", "TreeWireError", "check_encodable", "check_extras", "check_link", "check_node",
    "check_relative_path",
    "decode_files", "digest", "encode_files", "encode_header", "parse_entry", "parse_operation", "stop_cause",
]

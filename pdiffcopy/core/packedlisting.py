"""The packed form of a tree listing: entries in columns, a batch at a time.

A client that sends ``Accept: application/vnd.pdiffcopy.listing`` with
``GET /.pdiffcopy/tree/{path}`` gets the listing in this form from a server
that knows it (the answer's Content-Type says which form came; an older
server answers JSON, docs/protocol.rst, section Trees). It carries the same
entries as the JSON listing; decoding one takes a few C calls per batch
instead of a JSON value and a field-by-field check per entry, which were
the client's largest per-entry cost on a no-change pull. A stream is::

    stream   = HEAD batch* END TAIL
    HEAD     = LENGTH, then LENGTH bytes of JSON: {"root": ENTRY or null}
    batch    = COUNT PATHS TARGETS EXTRAS  (four u32; 0 < COUNT <= MAX_PACKED_ENTRIES)
               kinds:   COUNT bytes (0 file, 1 dir, 2 symlink, 3 other)
               sparse:  COUNT bytes (0 or 1)
               size, mtime_ns:          COUNT signed 64-bit integers each
               mode, uid, gid, nlink:   COUNT unsigned 32-bit integers each
               PATHS bytes:   each path's bytes followed by a NUL
               TARGETS bytes: each symlink target's bytes ("" for others) followed by a NUL
               EXTRAS bytes:  for each entry with a link group or attributes, LENGTH and
                              LENGTH bytes of JSON [index, link, [[name, base64 value], ...]]
    END      = 4 zero bytes
    TAIL     = the rest: the JSON listing's ending, {"failures": [...], "complete": true},
               or {"failures": [...], "error": MESSAGE} when the walk failed midway

Integers are little-endian; LENGTH, COUNT, PATHS, TARGETS and EXTRAS are
unsigned 32-bit. Names travel as their bytes (a name that is not UTF-8
needs no escape), and every bound of :func:`~pdiffcopy.core.treewire.parse_entry`
holds: the decoder refuses what it would refuse.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
import sys
from array import array
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

from pdiffcopy.core.entries import DIR, FILE, OTHER, SYMLINK, Entry, shared_mode
from pdiffcopy.core.treewire import (
    MAX_JSON_ITEM_CHARS,
    TreeWireError,
    check_extras,
    check_encodable,
    check_relative_path,
    parse_entry,
)
from pdiffcopy.core.protocol import MAX_PATH_LENGTH

#: The media type of a packed listing: asked for in Accept, named in the answer's Content-Type.
PACKED_LISTING_TYPE = "application/vnd.pdiffcopy.listing"


def media_type(content_type: Optional[str]) -> str:
    """The media type of a Content-Type value, lower case, without its parameters."""
    return (content_type or "").partition(";")[0].strip().lower()


#: Most entries in one batch, and entries the encoder puts in one.
MAX_PACKED_ENTRIES = 8192
PACKED_BATCH_ENTRIES = 4096

#: Most bytes of a batch's extras; the encoder starts a new batch before it would pass
#: half of it (one entry's extras are at most MAX_JSON_ITEM_CHARS).
MAX_PACKED_EXTRAS_BYTES = 8 * 1024 * 1024

_KINDS = (FILE, DIR, SYMLINK, OTHER)
_KIND_CODES = {kind: code for code, kind in enumerate(_KINDS)}
_U32 = struct.Struct("<I")
_BATCH_HEAD = struct.Struct("<IIII")
END = _U32.pack(0)
_MAX_INT64 = 2 ** 63 - 1

# The columns' array types and their widths on the wire.
_I64, _U32_ARRAY = "q", "I"
if array(_I64).itemsize != 8 or array(_U32_ARRAY).itemsize != 4:  # pragma: no cover (every Linux ABI)
    raise ImportError("the packed listing needs 64-bit 'q' and 32-bit 'I' arrays")
_SWAP = sys.byteorder != "little"

#: A "", "." or ".." component (or a leading "/") in NUL-separated paths whose "/" became NUL too.
_ODD_COMPONENTS = ("\x00\x00", "\x00.\x00", "\x00..\x00")


def _column(typecode: str, values: Iterable[int]) -> bytes:
    column = array(typecode, values)
    if _SWAP:  # pragma: no cover (big-endian hosts)
        column.byteswap()
    return column.tobytes()


def _names(texts: Sequence[str], what: str) -> bytes:
    """NUL-terminated bytes of each name (os.fsencode's bytes)."""
    try:
        joined = ("\x00".join(texts) + "\x00").encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise TreeWireError(f"Invalid entry: a {what} is not a file name") from None
    if joined.count(b"\x00") != len(texts):
        raise TreeWireError(f"Invalid entry: a {what} contains a NUL byte")
    return joined


def _extras(entries: Sequence[Entry]) -> List[bytes]:
    extras = []
    for index, entry in enumerate(entries):
        if entry.link or entry.xattrs:
            text = json.dumps([index, *entry.to_wire()[10:]], ensure_ascii=True,
                              separators=(",", ":")).encode("ascii")
            extras.append(_U32.pack(len(text)) + text)
    return extras


def encode_batch(entries: Sequence[Entry]) -> bytes:
    """One batch (``entries`` not empty, at most :data:`MAX_PACKED_ENTRIES`)."""
    columns = list(zip(*entries))
    path, kind, size, mtime_ns, mode, uid, gid, target, nlink, sparse, link, xattrs = columns
    try:
        kinds = bytes(map(_KIND_CODES.__getitem__, kind))
    except KeyError as error:
        raise TreeWireError(f"Invalid entry: unknown kind {error}") from None
    extras = _extras(entries) if any(link) or any(xattrs) else []
    paths, targets = _names(path, "path"), _names(target, "symlink target")
    extra_bytes = b"".join(extras)
    return b"".join((
        _BATCH_HEAD.pack(len(entries), len(paths), len(targets), len(extra_bytes)),
        kinds, bytes(map(bool, sparse)),
        _column(_I64, size), _column(_I64, mtime_ns),
        _column(_U32_ARRAY, mode), _column(_U32_ARRAY, uid), _column(_U32_ARRAY, gid),
        _column(_U32_ARRAY, nlink),
        paths, targets, extra_bytes))


def encode_batches(entries: Sequence[Entry]) -> Iterator[bytes]:
    """``entries`` as batches of at most :data:`PACKED_BATCH_ENTRIES`, extras kept under their bound."""
    start = 0
    while start < len(entries):
        end = min(len(entries), start + PACKED_BATCH_ENTRIES)
        chunk = entries[start:end]
        while len(chunk) > 1 and sum(len(extra) for extra in _extras(chunk)) > MAX_PACKED_EXTRAS_BYTES // 2:
            chunk = chunk[:len(chunk) // 2]
        yield encode_batch(chunk)
        start += len(chunk)


def encode_head(root: Optional[Entry]) -> bytes:
    text = json.dumps({"root": None if root is None else root.to_wire()}, ensure_ascii=True,
                      separators=(",", ":")).encode("ascii")
    return _U32.pack(len(text)) + text


# -- decoding ------------------------------------------------------------------


def _exactly(read, size: int, what: str) -> bytes:
    data = read(size)
    if len(data) != size:
        raise TreeWireError(f"The packed listing was cut short in {what}")
    return data


def decode_head(read) -> Optional[Entry]:
    """The root entry (None: the tree is not there) from ``read(n)`` (a reader of exact sizes)."""
    (length,) = _U32.unpack(_exactly(read, 4, "its head"))
    if length > MAX_JSON_ITEM_CHARS:
        raise TreeWireError(f"Invalid packed listing: a head of {length} bytes")
    try:
        head = json.loads(_exactly(read, length, "its head").decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise TreeWireError("Invalid packed listing: its head is not JSON") from None
    if not isinstance(head, dict) or "root" not in head:
        raise TreeWireError("Invalid packed listing: its head has no root")
    return None if head["root"] is None else parse_entry(head["root"], allow_root=True)


def decode_batches(read) -> Iterator[List[Entry]]:
    """Each batch's entries, checked as :func:`~pdiffcopy.core.treewire.parse_entry` checks them;
    returns at the end marker (the tail, JSON, is what ``read`` has left)."""
    while True:
        (count,) = _U32.unpack(_exactly(read, 4, "a batch's count"))
        if count == 0:
            return
        yield decode_batch(count, read)


def decode_batch(count: int, read) -> List[Entry]:
    if count > MAX_PACKED_ENTRIES:
        raise TreeWireError(f"Invalid packed listing: a batch of {count} entries (at most {MAX_PACKED_ENTRIES})")
    paths_size, targets_size, extras_size = struct.unpack("<III", _exactly(read, 12, "a batch's sizes"))
    most_names = count * (MAX_PATH_LENGTH + 1)
    if paths_size > most_names or targets_size > most_names or extras_size > MAX_PACKED_EXTRAS_BYTES:
        raise TreeWireError("Invalid packed listing: a batch longer than its entries may be")
    numbers = memoryview(_exactly(read, count * 34, "a batch's numbers"))
    kinds, sparse = numbers[:count], numbers[count:2 * count]
    if max(kinds) >= len(_KINDS):
        raise TreeWireError("Invalid entry: unknown entry kind")
    if max(sparse) > 1:
        raise TreeWireError("Invalid entry: sparse must be 0 or 1")
    size, mtime_ns = (_numbers(_I64, numbers, 2 * count + 8 * count * column, count) for column in (0, 1))
    mode, uid, gid, nlink = (_numbers(_U32_ARRAY, numbers, 18 * count + 4 * count * column, count)
                             for column in range(4))
    if min(size) < 0:
        raise TreeWireError(f"Invalid entry: size must be an integer from 0 to {_MAX_INT64}")
    paths, text = _decode_names(_exactly(read, paths_size, "a batch's paths"), count, "path")
    _check_paths(paths, text)
    targets, _ = _decode_names(_exactly(read, targets_size, "a batch's targets"), count, "symlink target")
    _check_targets(targets)
    modes = {value: shared_mode(value) for value in set(mode)}
    new = tuple.__new__
    entries = [new(Entry, (p, _KINDS[k], s, m, modes[o], u, g, t, n, x == 1, "", ()))
               for p, k, s, m, o, u, g, t, n, x in zip(paths, kinds, size, mtime_ns, mode, uid, gid, targets,
                                                       nlink, sparse)]
    if extras_size:
        _apply_extras(entries, _exactly(read, extras_size, "a batch's extras"))
    return entries


def _numbers(typecode: str, numbers: memoryview, start: int, count: int) -> array:
    column = array(typecode)
    column.frombytes(numbers[start:start + count * column.itemsize])
    if _SWAP:  # pragma: no cover (big-endian hosts)
        column.byteswap()
    return column


def _decode_names(data: bytes, count: int, what: str) -> Tuple[List[str], str]:
    """The names, and their NUL-separated text."""
    if not data.endswith(b"\x00"):
        raise TreeWireError(f"Invalid packed listing: its {what}s do not end with a NUL")
    text = data[:-1].decode("utf-8", "surrogateescape")
    names = text.split("\x00")
    if len(names) != count:
        raise TreeWireError(f"Invalid packed listing: {len(names)} {what}s for {count} entries")
    return names, text


def _check_paths(paths: List[str], text: str) -> None:
    """What check_relative_path insists on, for the whole batch at once when every path is plain ASCII
    (a regular expression over the text took longer than decoding the batch)."""
    if text.isascii() and max(map(len, paths)) <= MAX_PATH_LENGTH:
        components = f"\x00{text}\x00".replace("/", "\x00")
        if not any(odd in components for odd in _ODD_COMPONENTS):
            return
    for path in paths:
        check_relative_path(path)


def _check_targets(targets: List[str]) -> None:
    if max(map(len, targets)) * 4 <= MAX_PATH_LENGTH:  # a character is at most four bytes
        return
    for target in targets:
        if target:
            check_encodable(target, "symlink target")


def _apply_extras(entries: List[Entry], data: bytes) -> None:
    """Give the entries the link groups and attributes that ``data`` holds for them."""
    position, last = 0, -1
    while position < len(data):
        if position + 4 > len(data):
            raise TreeWireError("Invalid packed listing: an extra cut short")
        (length,) = _U32.unpack_from(data, position)
        if length > MAX_JSON_ITEM_CHARS or position + 4 + length > len(data):
            raise TreeWireError("Invalid packed listing: an extra longer than it may be")
        try:
            value: Any = json.loads(data[position + 4:position + 4 + length].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise TreeWireError("Invalid packed listing: an extra is not JSON") from None
        position += 4 + length
        if type(value) is not list or len(value) != 3 or type(value[0]) is not int:
            raise TreeWireError("Invalid packed listing: an extra must be [index, link, attributes]")
        index, link, xattrs = value
        if not last < index < len(entries):
            raise TreeWireError("Invalid packed listing: extras out of order or of no entry")
        last = index
        check_extras(link, xattrs)
        try:
            pairs = tuple((name, base64.b64decode(encoded, validate=True)) for name, encoded in xattrs)
        except (binascii.Error, ValueError) as error:
            raise TreeWireError(f"Invalid entry: {error}") from None
        entries[index] = entries[index]._replace(link=link, xattrs=pairs)


__all__ = [
    "END", "MAX_PACKED_ENTRIES", "MAX_PACKED_EXTRAS_BYTES", "PACKED_BATCH_ENTRIES", "PACKED_LISTING_TYPE",
    "decode_batch", "decode_batches", "decode_head", "encode_batch", "encode_batches", "encode_head",
]

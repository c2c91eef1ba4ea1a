"""HTTP byte ranges: ``Range`` headers and ``multipart/byteranges`` bodies.

Pure functions and small stream parsers, shared by the server (answering
ranged GETs, accepting ranged PATCHes) and the client (sending and reading
them), so both sides speak exactly the same format (RFC 9110, section 14).
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Iterator, List, Optional, Protocol, Tuple

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import BadRequest, RangeNotSatisfiable

#: Random bytes in each multipart boundary. Our own readers count a part's
#: bytes by its Content-Range and never scan for the boundary, but standard
#: MIME readers do (RFC 2046 5.1.1: the boundary must not occur in the data),
#: so a fixed string broke them on any file that contains it. 16 bytes (32 hex
#: digits) make a collision with file data as unlikely as guessing a 128-bit key.
BOUNDARY_RANDOM_BYTES = 16

#: Most ranges the server accepts in one request; bounds the work a single
#: request can ask for. (Clients send at most blocks.MAX_RANGES_PER_REQUEST.)
MAX_RANGES_ACCEPTED = 4096

#: Bytes of part headers a multipart answer may add to the data it carries
#: before the server answers with the whole file instead (200, as RFC 9110,
#: section 14.2 allows). Our client asks for at most 200 ranges of at least
#: one 1 KiB block (about 20 KB of part headers); 4,096 ranges of one byte
#: each would add some 400 KB to a few KB of data.
MAX_MULTIPART_OVERHEAD = 64 * 1024

#: Longest header line accepted inside a multipart body.
MAX_PART_HEADER_LINE = 1024

# ASCII digits only (\d would accept "²"), and at most 20 of them: no byte
# offset needs more, and int() refuses strings of over 4300 digits anyway.
_RANGE_SPEC = re.compile(r"^[ \t]*([0-9]{0,20})[ \t]*-[ \t]*([0-9]{0,20})[ \t]*$")
_CONTENT_RANGE = re.compile(r"^[ \t]*bytes[ \t]+([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20}|\*)[ \t]*$",
                            re.IGNORECASE)


def parse_range_header(header: str, size: int) -> List[ByteRange]:
    """Parse a ``Range: bytes=...`` header against a file of ``size`` bytes.

    Ranges that overlap or touch are merged (RFC 9110, section 14.6 allows
    it), so an answer never carries a byte twice: 2,723 times ``0-`` is the
    file once, not 2,723 times.

    :returns: (offset, length) pairs in ascending order, clipped to the file,
              disjoint and not adjacent.
    :raises BadRequest: When the header is malformed.
    :raises RangeNotSatisfiable: When no range overlaps the file.
    """
    ranges: List[ByteRange] = []
    for first, last in _range_specs(header):
        if first == last == "":
            raise BadRequest(f"Malformed Range header: {header[:100]!r}")
        if first == "":  # suffix range: the last N bytes
            length = min(int(last), size)
            if length > 0:
                ranges.append((size - length, length))
            continue
        start = int(first)
        end = size - 1 if last == "" else min(int(last), size - 1)
        if last != "" and int(last) < start:
            raise BadRequest(f"Malformed Range header: {header[:100]!r}")
        if start < size:
            ranges.append((start, end - start + 1))
    if not ranges:
        raise RangeNotSatisfiable(f"Range not satisfiable for a file of {size} bytes", size)
    return merge_ranges(ranges)


def merge_ranges(ranges: Iterable[ByteRange]) -> List[ByteRange]:
    """``ranges`` sorted, with the ones that overlap or touch merged into one."""
    merged: List[ByteRange] = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            last_offset, last_length = merged[-1]
            merged[-1] = (last_offset, max(last_length, offset + length - last_offset))
        else:
            merged.append((offset, length))
    return merged


def overlapping(ranges: Iterable[ByteRange]) -> bool:
    """Whether any two of ``ranges`` share a byte."""
    end = -1
    for offset, length in sorted(ranges):
        if offset < end:
            return True
        end = max(end, offset + length)
    return False


def is_bytes_range(header: str) -> bool:
    """Whether a ``Range`` header asks for bytes: a server ignores other units (RFC 9110, section 14.2)."""
    return header.partition("=")[0].strip().lower() == "bytes"


def parse_explicit_ranges(header: str) -> List[ByteRange]:
    """Parse a ``Range`` header of explicit ``first-last`` ranges, without clipping to a file.

    Used where ranges name blocks to hash rather than bytes to send.

    :raises BadRequest: When the header is malformed or has suffix/open ranges.
    """
    ranges: List[ByteRange] = []
    for first, last in _range_specs(header):
        if not first or not last or int(last) < int(first):
            raise BadRequest(f"Malformed Range header: {header[:100]!r}")
        ranges.append((int(first), int(last) - int(first) + 1))
    return ranges


def _range_specs(header: str) -> List[Tuple[str, str]]:
    """The (first, last) digit strings of a ``bytes=`` header; either may be empty.

    :raises BadRequest: For another unit, a malformed spec or too many ranges.
    """
    unit, _, specs = header.partition("=")
    if unit.strip().lower() != "bytes" or not specs.strip():
        raise BadRequest(f"Malformed Range header: {header[:100]!r}")
    parts = specs.split(",")
    if len(parts) > MAX_RANGES_ACCEPTED:
        raise BadRequest(f"Too many ranges (at most {MAX_RANGES_ACCEPTED})")
    pairs = []
    for spec in parts:
        match = _RANGE_SPEC.match(spec)
        if not match:
            raise BadRequest(f"Malformed Range header: {header[:100]!r}")
        pairs.append((match.group(1), match.group(2)))
    return pairs


def format_range_header(ranges: Iterable[ByteRange]) -> str:
    """The ``Range`` header value asking for ``ranges``."""
    return "bytes=" + ",".join(f"{offset}-{offset + length - 1}" for offset, length in ranges)


def format_content_range(offset: int, length: int, size: Optional[int]) -> str:
    """A ``Content-Range`` value; ``size`` :data:`None` means unknown (``*``)."""
    total = "*" if size is None else str(size)
    return f"bytes {offset}-{offset + length - 1}/{total}"


def parse_content_range(value: str) -> Tuple[int, int, Optional[int]]:
    """Parse ``bytes FIRST-LAST/SIZE`` into (offset, length, size or None).

    :raises BadRequest: When the value is malformed.
    """
    match = _CONTENT_RANGE.match(value or "")
    if not match:
        raise BadRequest(f"Malformed Content-Range: {str(value)[:100]!r}")
    first, last = int(match.group(1)), int(match.group(2))
    if last < first:
        raise BadRequest(f"Malformed Content-Range: {value[:100]!r}")
    size = None if match.group(3) == "*" else int(match.group(3))
    return first, last - first + 1, size


def new_boundary() -> str:
    """A fresh random boundary for one multipart body (a request's or a response's)."""
    return f"pdiffcopy-{os.urandom(BOUNDARY_RANDOM_BYTES).hex()}"  # (secrets.token_hex; secrets loads OpenSSL)


def multipart_content_type(boundary: str) -> str:
    """The Content-Type of a multipart/byteranges body delimited by ``boundary``."""
    return f"multipart/byteranges; boundary={boundary}"


def part_header(offset: int, length: int, size: Optional[int], boundary: str,
                content_type: str = "application/octet-stream") -> bytes:
    """The delimiter and headers that open one part of a multipart body."""
    return (
        f"\r\n--{boundary}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Range: {format_content_range(offset, length, size)}\r\n\r\n"
    ).encode("ascii")


def closing_delimiter(boundary: str) -> bytes:
    """The delimiter that ends a multipart body."""
    return f"\r\n--{boundary}--\r\n".encode("ascii")


def multipart_length(ranges: Iterable[ByteRange], size: Optional[int], boundary: str) -> int:
    """Exact byte length of a multipart body for ``ranges`` (for Content-Length)."""
    total = len(closing_delimiter(boundary))
    for offset, length in ranges:
        total += len(part_header(offset, length, size, boundary)) + length
    return total


def boundary_of(content_type: str) -> Optional[str]:
    """The boundary parameter of a multipart Content-Type, or None."""
    kind, _, params = (content_type or "").partition(";")
    if kind.strip().lower() != "multipart/byteranges":
        return None
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary":
            return value.strip().strip('"')
    raise BadRequest("multipart/byteranges without a boundary")


class LineStream(Protocol):
    """What :func:`read_parts` reads from: a request body or a response."""

    def readline(self, limit: int) -> bytes: ...


def read_parts(stream: LineStream, boundary: str, max_parts: int = MAX_RANGES_ACCEPTED
               ) -> Iterator[Tuple[int, int, Optional[int]]]:
    """Walk the parts of a multipart/byteranges body.

    Yields each part's (offset, length, size) once its headers are read; the
    caller must then consume exactly ``length`` bytes of ``stream`` (the part's
    data) before asking for the next part.

    :param stream: A binary stream with ``readline``.
    :raises BadRequest: When the body is malformed or truncated.
    """
    delimiter = b"--" + boundary.encode("ascii", "replace")
    count = 0
    while True:
        line = _read_line(stream)
        if line == b"":
            continue  # the CRLF that ends the previous part, or a preamble line
        if line == delimiter + b"--":
            return
        if line != delimiter:
            raise BadRequest("Malformed multipart body: expected a boundary")
        count += 1
        if count > max_parts:
            raise BadRequest(f"Too many parts (at most {max_parts})")
        content_range = None
        while True:
            header = _read_line(stream)
            if header == b"":
                break
            name, _, value = header.decode("latin-1").partition(":")
            if name.strip().lower() == "content-range":
                content_range = value.strip()
        if content_range is None:
            raise BadRequest("Malformed multipart body: a part without Content-Range")
        yield parse_content_range(content_range)


def _read_line(stream: LineStream) -> bytes:
    line = stream.readline(MAX_PART_HEADER_LINE)
    if not line:
        raise BadRequest("Malformed multipart body: it ends too early")
    if not line.endswith(b"\n"):
        raise BadRequest("Malformed multipart body: a header line is too long")
    return line.rstrip(b"\r\n")

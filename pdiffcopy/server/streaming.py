"""File bytes in and out of a response: ranges streamed from a file, and request bodies written into one.

Every byte goes through :class:`~pdiffcopy.local.localfile.LocalFile` (its reads and
writes, its errors), counted in the server's metrics and taken from its ``--max-rate``.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, List, Optional

from flask import Response, request

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.byteranges import (
    MAX_MULTIPART_OVERHEAD,
    boundary_of,
    closing_delimiter,
    format_content_range,
    is_bytes_range,
    multipart_content_type,
    multipart_length,
    new_boundary,
    parse_content_range,
    parse_range_header,
    part_header,
    read_parts,
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
from pdiffcopy.engine.forkshared import Throttle
from pdiffcopy.errors import BadRequest, RangeNotSatisfiable, StorageError
from pdiffcopy.local.descriptors import TRANSFER_CHUNK_SIZE
from pdiffcopy.local.localfile import LocalFile
from pdiffcopy.server.bodyreader import BodyReader, open_body
from pdiffcopy.server.metrics import ServerMetrics
from pdiffcopy.server.requests import Seen, not_modified, one_line

logger = logging.getLogger(__name__)


def ranged_response(file: LocalFile, found: Seen, metrics: Optional[ServerMetrics] = None,
                    rate_limit: Optional[Throttle] = None) -> Response:
    """Answer a GET or HEAD for an open file (or device), honouring ``Range``. Closes ``file`` when done.

    The file bytes sent are counted in ``metrics`` and taken from ``rate_limit`` (``--max-rate``).
    """
    size = found.size
    headers = {"Accept-Ranges": "bytes", "ETag": found.etag,
               "Last-Modified": time.strftime("%a, %d %b %Y %H:%M:%S GMT",
                                              time.gmtime(found.info.st_mtime))}
    if not_modified(found):
        file.close()
        return Response(status=304, headers=headers)
    header = request.headers.get("Range")
    if header and not is_bytes_range(header):
        header = None  # a unit we do not know is ignored: the whole file (RFC 9110, section 14.2)
    ranges: List[ByteRange] = [(0, size)]
    status = 200
    boundary = new_boundary()
    # HEAD ignores Range (its document says so): the whole file's headers, never a 416.
    if header and request.method != "HEAD" and (not request.headers.get("If-Range")
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
        file.close()
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
        return Response(_frames_body(file, ranges, metrics, rate_limit, level), status=206, headers=headers,
                        content_type=FRAMES_TYPE, direct_passthrough=True)
    if status == 200:
        headers["Vary"] = "Accept-Encoding"
        if accepts_zstd(request.headers.get("Accept-Encoding")):
            # RFC 9110 content coding of the whole file; another representation, so another ETag.
            # Ranges are never coded: a range of a coded representation is a range of the
            # compressed bytes, which plain clients would take for file bytes.
            headers["ETag"] = headers["ETag"][:-1] + '-zstd"'
            headers["Content-Encoding"] = ENCODING
            return Response(_coded_body(file, size, metrics, rate_limit), status=200, headers=headers,
                            mimetype="application/octet-stream", direct_passthrough=True)
    if len(ranges) == 1:
        offset, length = ranges[0]
        if status == 206:
            headers["Content-Range"] = format_content_range(offset, length, size)
        headers["Content-Length"] = str(length)
        return Response(_file_body(file, ranges, None, metrics=metrics, rate_limit=rate_limit),
                        status=status, headers=headers,
                        mimetype="application/octet-stream", direct_passthrough=True)
    headers["Content-Length"] = str(multipart_length(ranges, size, boundary))
    return Response(_file_body(file, ranges, size, boundary, metrics, rate_limit), status=206, headers=headers,
                    content_type=multipart_content_type(boundary), direct_passthrough=True)


def _file_body(file: LocalFile, ranges: List[ByteRange], multipart_size: Optional[int],
               boundary: str = "", metrics: Optional[ServerMetrics] = None,
               rate_limit: Optional[Throttle] = None) -> Iterator[bytes]:
    """The body of a GET: the ranges' bytes, as multipart parts (delimited by ``boundary``)
    when ``multipart_size`` is set.

    Plain reads, not sendfile(2): on loopback here a pread-and-send loop ran
    at 2.3 GB/s and sendfile at 1.5 GB/s. Closes ``file`` when done.
    """
    try:
        for offset, length in ranges:
            if multipart_size is not None:
                yield part_header(offset, length, multipart_size, boundary)
            for _, data in file.read_copies([(offset, length)]):
                if metrics is not None:
                    metrics.bytes_served.inc(len(data))
                if rate_limit is not None:
                    rate_limit.take(len(data))
                yield data
        if multipart_size is not None:
            yield closing_delimiter(boundary)
    except StorageError as error:
        _cut_short(file, error)
    finally:
        file.close()


def _frames_body(file: LocalFile, ranges: List[ByteRange], metrics: Optional[ServerMetrics],
                 rate_limit: Optional[Throttle], level: int) -> Iterator[bytes]:
    """The body of a GET for compressed ranges: a header and a zstd frame per piece, compressed
    at ``level``. Closes ``file``."""
    try:
        for offset, length in pieces(ranges):
            # The piece whole, or nothing of it: a frame is one piece.
            data = b"".join(chunk for _, chunk in file.read_copies([(offset, length)], chunk_size=length))
            framed = frame(offset, data, level)
            if metrics is not None:
                metrics.bytes_served.inc(length)
                metrics.compressed_bytes.labels("sent").inc(length)
            if rate_limit is not None:
                rate_limit.take(len(framed))  # --max-rate limits the network, so the bytes sent
            yield framed
    except StorageError as error:
        _cut_short(file, error)
    finally:
        file.close()


def _coded_body(file: LocalFile, size: int, metrics: Optional[ServerMetrics],
                rate_limit: Optional[Throttle]) -> Iterator[bytes]:
    """The whole file as one zstd stream (``Content-Encoding: zstd``). Closes ``file``."""
    try:
        compressor = stream_compressor()
        try:
            for _, data in file.read_copies([(0, size)] if size else []):
                if metrics is not None:
                    metrics.bytes_served.inc(len(data))
                    metrics.compressed_bytes.labels("sent").inc(len(data))
                out = compressor.compress(data)
                if out:
                    if rate_limit is not None:
                        rate_limit.take(len(out))
                    yield out
        except StorageError as error:
            _cut_short(file, error)
        yield compressor.flush()
    finally:
        file.close()


def _cut_short(file: LocalFile, error: StorageError) -> None:
    # Mid-answer nothing can be said any more: the client sees a short body and fails.
    logger.warning("Serving %s stopped: %s", one_line(file.path), one_line(str(error)))


def receive_buffer(length: int = TRANSFER_CHUNK_SIZE) -> memoryview:
    """The buffer :func:`body_chunks` reads into: one per request body, not per range (a new
    1 MiB buffer is fresh pages from the kernel, faulted in again for every part)."""
    return memoryview(bytearray(min(TRANSFER_CHUNK_SIZE, max(1, length))))


def body_chunks(body: BodyReader, offset: int, length: int, ended: str,
                metrics: Optional[ServerMetrics] = None,
                rate_limit: Optional[Throttle] = None,
                buffer: Optional[memoryview] = None) -> Iterator[tuple]:
    """The next ``length`` bytes of a request body as (offset, chunk) pairs from ``offset`` on,
    for :meth:`LocalFile.write_ranges` (the chunks are views of one reused buffer).

    :param ended: What a body that ends too early is told (a :class:`BadRequest`).
    :param buffer: The request's :func:`receive_buffer` (made here if not given).
    """
    if buffer is None:
        buffer = receive_buffer(length)
    position, end = offset, offset + length
    while position < end:
        got = body.readinto(buffer[: min(len(buffer), end - position)])
        if not got:
            raise BadRequest(ended)
        yield position, buffer[:got]
        position += got
        # Counted once written (the writer asks for the next chunk then).
        if metrics is not None:
            metrics.bytes_received.inc(got)
        if rate_limit is not None:
            rate_limit.take(got)  # after the read: the wait holds back the next one, and TCP the client


def receive_ranges(file: LocalFile, size: int, metrics: Optional[ServerMetrics] = None,
                   rate_limit: Optional[Throttle] = None, sparse: bool = False) -> int:
    """Write the ranges of a PATCH body into ``file`` (open for writing in place); return the bytes written.

    Every range must lie inside the file as it is: writes never grow a file
    (a resize does that, bounded by free space), so a bogus offset cannot
    create a huge sparse file.

    :param sparse: Punch the runs of whole zero blocks instead of writing them (``--sparse``).
    """
    file.write_sparse(sparse)
    if (request.content_type or "").split(";")[0].strip().lower() == FRAMES_TYPE:
        return _receive_frames(file, size, metrics, rate_limit)
    boundary = boundary_of(request.content_type or "")
    single = None
    if boundary is None:
        single = parse_content_range(request.headers.get("Content-Range", ""))
        if request.content_length is not None and request.content_length != single[1]:
            raise BadRequest("Content-Length does not match Content-Range")
    body = open_body(request.environ, request.content_length)
    try:
        if boundary is None:
            assert single is not None  # parsed above
            return _receive_range(body, file, single[0], single[1], size, receive_buffer(single[1]), metrics,
                                  rate_limit)
        written = 0
        buffer = receive_buffer()
        for offset, length, _ in read_parts(body, boundary):
            written += _receive_range(body, file, offset, length, size, buffer, metrics, rate_limit)
        return written
    finally:
        body.finish()


def _receive_frames(file: LocalFile, size: int, metrics: Optional[ServerMetrics],
                    rate_limit: Optional[Throttle]) -> int:
    """Write the pieces of a compressed PATCH body; each is decompressed and checked before it is written."""
    body = open_body(request.environ, request.content_length)
    written = 0
    try:
        try:
            for offset, data, wire_length in read_frames(lambda count: _read_some(body, count)):
                check_inside(offset, len(data), size)
                written += file.write_ranges([(offset, len(data))], iter([(offset, data)]))
                if metrics is not None:
                    metrics.bytes_received.inc(len(data))
                    metrics.compressed_bytes.labels("received").inc(len(data))
                if rate_limit is not None:
                    rate_limit.take(wire_length)
        except CompressionError as error:
            raise BadRequest(str(error)) from None
        return written
    finally:
        body.finish()


def _read_some(body: BodyReader, count: int) -> bytes:
    buffer = bytearray(count)
    got = body.readinto(memoryview(buffer))
    return bytes(buffer[:got])


def _receive_range(body: BodyReader, file: LocalFile, offset: int, length: int, size: int, buffer: memoryview,
                   metrics: Optional[ServerMetrics] = None, rate_limit: Optional[Throttle] = None) -> int:
    check_inside(offset, length, size)
    # write_ranges starts writing the range to disk at its end: the client's
    # fsync request then finds little left to write.
    file.write_ranges([(offset, length)], body_chunks(body, offset, length, "The request body ended before the "
                                                      "range did", metrics, rate_limit, buffer))
    return length


def check_inside(offset: int, length: int, size: int) -> None:
    """Refuse a write that would reach past the end of a file of ``size`` bytes (writes never grow a file)."""
    if offset + length > size:
        raise RangeNotSatisfiable(f"Range {offset}+{length} is outside the file ({size} bytes)", size)

"""A file behind a pdiffcopy server, as a :class:`~pdiffcopy.engine.endpoints.FileEndpoint`.

Ranged GETs to read, ranged PATCHes to write, and the ``/.pdiffcopy/``
endpoints for hashes, resizing, flushing and atomic renames, sent through
:class:`~pdiffcopy.transport.httpclient.HttpClient` (connections, retries,
one-line errors) and compressed as :mod:`pdiffcopy.transport.compressionpolicy` says.
"""

from __future__ import annotations

import http.client
import logging
import os
import struct
import time
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence
from urllib.parse import urlencode

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core import compression
from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.datamap import MAX_DATA_MAP_EXTENTS
from pdiffcopy.core.byteranges import (
    boundary_of,
    closing_delimiter,
    format_content_range,
    format_range_header,
    merge_ranges,
    multipart_content_type,
    multipart_length,
    new_boundary,
    overlapping,
    parse_content_range,
    part_header,
    read_parts,
)
from pdiffcopy.core.compression import FRAMES_TYPE, CompressionError
from pdiffcopy.engine.interrupts import let_through
from pdiffcopy.engine.endpoints import (
    Chunk,
    ContentChunks,
    FileEndpoint,
    FileInfo,
    Holes,
    Leases,
    PartialFiles,
    PriorityHashing,
)
from pdiffcopy.errors import (
    BadRequest,
    FileMissing,
    NotAFile,
    PdiffcopyError,
    RemoteDataError,
    RemoteError,
    StorageError,
)
from pdiffcopy.core.hashing import digest_count, digest_size
from pdiffcopy.core.protocol import (
    LEASE_HEADER,
    NO_FOLLOW_HEADER,
    TRANSFER_CHUNK_SIZE,
    partial_name,
    temporary_name,
)
from pdiffcopy.engine.forkshared import Throttle
from pdiffcopy.transport.compressionpolicy import PROBE_BYTES, Compression, compressing_cores
from pdiffcopy.transport.httpclient import (
    DEFAULT_TIMEOUT,
    SERVER_CLOSED,
    HttpClient,
    Response,
    is_json,
    media_type,
)
from pdiffcopy.core.locations import quote_path
from pdiffcopy.transport.urls import parse_url

#: The binary entries of the shift-tolerant delta's requests (docs/protocol.rst): a range of
#: a chunk list request (offset, length) and a move of a copy request (from, to, length).
_CHUNK_RANGE = struct.Struct("<QQ")
_COPY_MOVE = struct.Struct("<QQQ")
#: Most ranges one chunk list request names: the server's bound (server.files.MAX_CHUNK_RANGES).
MAX_CHUNK_RANGES = 65536
#: Most ranges one punch request names: the server's bound (server.files.MAX_PUNCH_RANGES).
MAX_PUNCH_RANGES = 65536

logger = logging.getLogger(__name__)


class _RangesBody:
    """A PATCH body streaming ranges of a source: raw for one range, multipart for several.

    Its length is known, so it travels with a Content-Length, not chunked.
    """

    def __init__(self, ranges: List[ByteRange], chunks: Iterator[Chunk]) -> None:
        self.ranges = ranges
        self.chunks = chunks
        self.multipart = len(ranges) > 1
        #: Fresh per request, so that no data can contain it (see new_boundary).
        self.boundary = new_boundary()
        self.length = multipart_length(ranges, None, self.boundary) if self.multipart else ranges[0][1]

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for offset, length in self.ranges:
            if self.multipart:
                yield part_header(offset, length, None, self.boundary)
            remaining = length
            while remaining > 0:
                try:
                    _, data = next(self.chunks)
                except StopIteration:
                    raise StorageError("The source ended before the data to send did") from None
                remaining -= len(data)
                yield data
        if self.multipart:
            yield closing_delimiter(self.boundary)


class RemoteFile(FileEndpoint):
    """A file on a pdiffcopy server, named by its URL.

    With ``follow=False`` (a tree's member) every request asks the server not
    to follow a symlink in the last name (:data:`~pdiffcopy.core.protocol.NO_FOLLOW_HEADER`):
    such a file is refused with :class:`~pdiffcopy.errors.NotAFile`, as a
    local tree's member is.
    """

    capabilities = (PriorityHashing, Holes, ContentChunks, PartialFiles, Leases)

    def __init__(self, url: str, token: Optional[str] = None, concurrency: int = 4,
                 timeout: float = DEFAULT_TIMEOUT, ca_file: Optional[str] = None,
                 _base_path: Optional[tuple] = None, rate_limit: Optional[Throttle] = None,
                 follow: bool = True, compress: "str | Compression" = "auto") -> None:
        self.location = url
        self.follow = follow
        self.base, self.path = _base_path or parse_url(url)
        self.token = token
        self.timeout = timeout
        self.ca_file = ca_file
        self.concurrency = concurrency
        self.client = HttpClient(self.base, token, timeout, ca_file, rate_limit)
        self._hash_pool: Optional[ThreadPoolExecutor] = None
        #: Threads of :meth:`submit_hashes_first`: a queue of their own.
        self._first_hash_pool: Optional[ThreadPoolExecutor] = None
        self._etag: Optional[str] = None
        #: The free space beside the file, as the last stat reported it (None: not reported).
        self._free: Optional[int] = None
        #: The id of our write lease on the file, sent with every request while held.
        self._lease: Optional[str] = None
        self.compression = compress if isinstance(compress, Compression) else Compression(
            compress, self.base, cores=compressing_cores(concurrency))
        #: The answer of the stat :meth:`on_legacy_server` sent, for the next :meth:`stat` (at most one).
        self._first_stat: List["Optional[FileInfo] | PdiffcopyError"] = []
        #: Whether this file's server already said it wrote zeros for holes (warned once).
        self._warned_zeros = False
        #: ``--sparse``: the server punches the runs of zeros in what we write (a PATCH parameter).
        self._sparse_writes = False
        #: What the files made for this one that are not clones of it get (:meth:`use_mode`): the
        #: resize request that makes them says it.
        self._copies_mode: Dict[str, int] = {}

    # -- transport -------------------------------------------------------

    def _target(self, endpoint: Optional[str] = None, path: Optional[str] = None,
                params: Optional[dict] = None) -> str:
        quoted = quote_path(path if path is not None else self.path)
        target = f"/.pdiffcopy/{endpoint}/{quoted}" if endpoint else f"/{quoted}"
        return f"{target}?{urlencode(params)}" if params else target

    def request(self, method: str, target: str, expected=(200,), headers=None, body=None,
                replayable: bool = True) -> Response:
        """Send one request (see :meth:`HttpClient.request`)."""
        if self._lease:
            headers = {**(headers or {}), LEASE_HEADER: self._lease}
        if not self.follow:
            headers = {**(headers or {}), NO_FOLLOW_HEADER: "1"}
        return self.client.request(method, target, expected, headers, body, replayable)

    def _body(self, response: Response) -> bytes:
        return self.client.body(response)

    def _conditions(self) -> Dict[str, str]:
        return {"If-Match": self._etag} if self._etag else {}

    # -- FileEndpoint ----------------------------------------------------

    def pin(self, info: FileInfo) -> None:
        self._etag = info.etag

    def stat(self) -> Optional[FileInfo]:
        answer = self._first_stat.pop() if self._first_stat else self._ask_stat()
        if isinstance(answer, PdiffcopyError):
            raise answer  # a 1.0.1 server: a file of it is a LegacyRemoteFile (see on_legacy_server)
        return answer

    def exists(self) -> bool:
        return self.stat() is not None  # the server's answer: a dangling symlink there is missing

    def free_space(self) -> Optional[int]:
        """The free space the server reports in a stat now (None: a server that does not say)."""
        answer = self._ask_stat()
        return self._free if not isinstance(answer, PdiffcopyError) else None

    def _ask_stat(self) -> "Optional[FileInfo] | RemoteError":
        """The file's stat (None: missing), or the error naming a pdiffcopy 1.0.1 server."""
        response = self.request("GET", self._target("stat"), expected=(200, 404))
        if response.status == 404:
            response.close()
            if not is_json(response):  # our server's 404 is JSON; 1.0.1's is an HTML page
                legacy = self.client.legacy_server()
                if legacy is not None:
                    return legacy
            return None
        try:
            data = response.json()
            free = data.get("free")
            self._free = int(free) if free is not None else None
            mode = data.get("mode")
            return FileInfo(str(data["type"]), int(data["size"]), int(data["mtime_ns"]),
                            str(data["etag"]), int(mode) & 0o7777 if mode is not None else None)
        except (ValueError, KeyError, TypeError, OSError, http.client.HTTPException):
            raise self.client.malformed() from None

    def on_legacy_server(self) -> bool:
        """Whether the file's server is pdiffcopy 1.0.1, asked with the file's stat.

        (The probe is :data:`~pdiffcopy.transport.httpclient.LEGACY_PROBE`.)

        The answer, or the error, of that stat is kept for the next :meth:`stat`: a sync with a
        current server sends no request more for this question, and fails where it always did.
        """
        try:
            answer = self._ask_stat()
        except PdiffcopyError as error:
            self._first_stat = [error]
            return False
        if isinstance(answer, RemoteError):
            return True
        self._first_stat = [answer]
        return False

    def submit_hashes(self, ranges: Sequence[ByteRange], block_size: int, method: str
                      ) -> "Future[bytes]":
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hash")
        return self._hash_pool.submit(self._hashes, list(ranges), block_size, method)

    def submit_hashes_first(self, ranges: Sequence[ByteRange], block_size: int, method: str
                            ) -> "Future[bytes]":
        if self._first_hash_pool is None:
            self._first_hash_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hash-first")
        return self._first_hash_pool.submit(self._hashes, list(ranges), block_size, method)

    def hashes_pieces_cheaply(self) -> bool:
        return True  # the server hashes any ranges it is asked for

    def _hashes(self, ranges: List[ByteRange], block_size: int, method: str) -> bytes:
        """One hash request: one range in the query, several in a Range header."""
        params: dict = {"method": method, "block_size": block_size}
        headers = self._conditions()
        if len(ranges) == 1:
            params.update(offset=ranges[0][0], length=ranges[0][1])
        else:
            headers = {**headers, "Range": format_range_header(ranges)}
        response = self.request("GET", self._target("hashes", params=params), headers=headers)
        digests = self._body(response)
        expected = digest_count(ranges, block_size)
        if len(digests) != expected * digest_size(method):
            raise RemoteDataError(f"Server {self.base} sent {len(digests)} bytes of digests for "
                              f"{expected} blocks")
        return digests

    def _call(self, method: str, endpoint: str, path: Optional[str] = None,
              params: Optional[dict] = None, expected=(200,)) -> None:
        """A control request whose answer we only need to be a success."""
        response = self.request(method, self._target(endpoint, path, params), expected=expected)
        self._body(response)

    def prepare(self, size: int) -> None:
        self._call("POST", "resize", params={"size": size})

    def use_mode(self, mode: int, new: bool) -> None:
        # Permission bits only: a server never takes set-id bits from the resize that makes a file.
        self._copies_mode = {"mode": mode & 0o777, "umask": int(new)}

    def prepare_sparse(self, size: int, data_bytes: int) -> None:
        self._call("POST", "resize", params={"size": size, "data": data_bytes})

    def data_map(self, offset: int, length: int) -> List[ByteRange]:
        """One answer of the server's data map (at most MAX_DATA_MAP_EXTENTS extents)."""
        if length <= 0:
            return []
        response = self.request("GET", self._target("datamap", params={"offset": offset, "length": length}),
                                headers=self._conditions())
        body = self._body(response)
        if len(body) % _CHUNK_RANGE.size or len(body) // _CHUNK_RANGE.size > MAX_DATA_MAP_EXTENTS:
            raise self.client.malformed("its data map is not a list of extents")
        extents = list(_CHUNK_RANGE.iter_unpack(body))
        if any(start < offset or start + size > offset + length or size == 0 for start, size in extents) or \
                any(a[0] + a[1] > b[0] for a, b in zip(extents, extents[1:])):
            raise self.client.malformed("its data map has extents outside the range asked, or out of order")
        return extents

    def write_sparse(self, enabled: bool) -> None:
        self._sparse_writes = enabled

    def punch_ranges(self, ranges: Sequence[ByteRange], write_zeros: bool = True) -> int:
        """The server punches the holes (or writes zeros where its file system cannot), in pages."""
        ranges = list(ranges)
        punched = 0
        for start in range(0, len(ranges), MAX_PUNCH_RANGES):
            asked = ranges[start:start + MAX_PUNCH_RANGES]
            body = b"".join(_CHUNK_RANGE.pack(offset, length) for offset, length in asked)
            # (sparse=1: -S, which a block device there needs to discard rather than write zeros)
            params = {**({} if write_zeros else {"zeros": 0}), **({"sparse": 1} if self._sparse_writes else {})}
            response = self.request("POST", self._target("punch", params=params or None),
                                    body=body, headers={
                                        "Content-Length": str(len(body)), "Content-Type": "application/octet-stream"})
            answer = self.client.json(response)
            holes = not (isinstance(answer, dict) and answer.get("holes") is False)
            if not write_zeros:
                if not holes:
                    return punched  # its file system cannot: the zeros stay as they are
            elif not holes and not self._warned_zeros:
                self._warned_zeros = True
                logger.warning("The file system of %s cannot punch holes; the source's holes are written "
                               "there as zeros", self.location)
            punched += sum(length for _, length in asked)
        return punched

    def read_ranges(self, ranges: Iterable[ByteRange]) -> Iterator[Chunk]:
        ranges = list(ranges)
        if self.compression.probing():
            probe, ranges = compression.split_after(ranges, PROBE_BYTES)
            with self.compression.probe_lock:
                # Read whole before it is handed on: the lock is not held while the caller writes.
                chunks = [(offset, bytes(data)) for offset, data in self._read_ranges(probe)]
            for offset, data in chunks:
                yield offset, memoryview(data)
            if not ranges:
                return
        yield from self._read_ranges(ranges)

    def _read_ranges(self, ranges: List[ByteRange]) -> Iterator[Chunk]:
        headers = {"Range": format_range_header(ranges), **self._conditions()}
        level = self.compression.level()
        if level is not None:
            headers["Accept"] = compression.frames_accept(level)
        learning = self.compression.learning()
        started = time.perf_counter()
        response = self.request("GET", self._target(), expected=(206,), headers=headers)
        if media_type(response) == FRAMES_TYPE:
            self.compression.compressed_started(started)
            yield from self._read_frames(response, ranges)
            return
        sample: Optional[bytes] = None
        with self._reading(response):
            stream = response.raw
            # The server merges ranges that touch (byteranges.parse_range_header);
            # an older one sends them as asked. Either is fine, as long as
            # every byte asked for comes once.
            merged = merge_ranges(ranges)
            allowed = set(ranges) | set(merged)
            boundary = boundary_of(response.headers.get("Content-Type", ""))
            if boundary is None:
                offset, length, _ = parse_content_range(response.headers.get("Content-Range", ""))
                if [(offset, length)] != merged:
                    raise RemoteDataError(f"Server {self.base} sent other ranges than asked")
                for chunk in _read_exactly(stream, offset, length, self.base):
                    if learning and sample is None:
                        sample = bytes(chunk[1][:compression.SAMPLE_BYTES])
                    yield chunk
                if learning:
                    self.compression.observed(length, time.perf_counter() - started, sample)
                return
            received: List[ByteRange] = []
            for offset, length, _ in read_parts(stream, boundary, max_parts=len(ranges)):
                if (offset, length) not in allowed:
                    raise RemoteDataError(f"Server {self.base} sent a range that was not asked for")
                received.append((offset, length))
                for chunk in _read_exactly(stream, offset, length, self.base):
                    if learning and sample is None:
                        sample = bytes(chunk[1][:compression.SAMPLE_BYTES])
                    yield chunk
            if merge_ranges(received) != merged or overlapping(received):
                raise RemoteDataError(f"Server {self.base} left out ranges that were asked for")
            stream.read()  # the closing delimiter, so the connection can be reused
            if learning:
                self.compression.observed(sum(length for _, length in received), time.perf_counter() - started,
                                          sample)

    def _read_frames(self, response: Response, ranges: List[ByteRange]) -> Iterator[Chunk]:
        """The chunks of an answer of compressed pieces: exactly the pieces of the ranges asked for, in order."""
        with self._reading(response):
            expected = compression.pieces(merge_ranges(ranges))
            moved = 0
            for offset, data, wire_length in compression.read_frames(response.raw.read):
                if (offset, len(data)) != next(expected, None):
                    raise RemoteDataError(f"Server {self.base} sent a range that was not asked for")
                moved += wire_length
                yield offset, memoryview(data)
            self.compression.compressed_moved(moved)
            if next(expected, None) is not None:
                raise RemoteDataError(f"Server {self.base} left out ranges that were asked for")

    @contextmanager
    def _reading(self, response: Response) -> Iterator[None]:
        """Read the body of ``response`` inside: a failure becomes one line, and the answer is closed after.

        One place for what can go wrong in a body of ranges, plain or compressed: a malformed
        answer, damaged frames, or the connection lost midway.
        """
        try:
            yield
        except BadRequest as error:
            raise self.client.malformed(str(error)) from None
        except CompressionError as error:  # (a ValueError: before the clause below)
            raise RemoteDataError(f"Server {self.base} sent damaged data: {error}") from None
        except (OSError, ValueError, http.client.HTTPException) as error:
            raise self.client.lost(error) from None
        finally:
            response.close()

    def write_ranges(self, ranges: Iterable[ByteRange], chunks: Iterator[Chunk]) -> int:
        ranges = list(ranges)
        written = 0
        if self.compression.probing() and self.client.patch_frames:
            probe, ranges = compression.split_after(ranges, PROBE_BYTES)
            chunks = _Cuttable(chunks)
            with self.compression.probe_lock:
                written += self._write_ranges(probe, chunks.take(sum(length for _, length in probe)))
            if not ranges:
                return written
        return written + self._write_ranges(ranges, chunks)

    def _write_ranges(self, ranges: List[ByteRange], chunks: Iterator[Chunk]) -> int:
        level = self.compression.level()
        if level is not None and self.client.patch_frames:
            started = time.perf_counter()
            body = _framed_body(ranges, chunks, level)
            compressed = time.perf_counter()
            self.compression.compressed_started(compressed)
            response = self.request("PATCH", self._patch_target(), headers={
                "Content-Length": str(len(body)), "Content-Type": FRAMES_TYPE}, body=body, replayable=False)
            self._body(response)
            self.compression.compressed_moved(len(body))
            # Built whole, then sent: the two times say whether the CPU or the link held it up.
            self.compression.compressed(level, sum(length for _, length in ranges), compressed - started,
                                        time.perf_counter() - compressed)
            return sum(length for _, length in ranges)
        learning = self.compression.learning()
        if learning:
            chunks = _sampled(chunks, self.compression)
        started = time.perf_counter()
        body = _RangesBody(ranges, chunks)
        headers = {"Content-Length": str(len(body))}
        if body.multipart:
            headers["Content-Type"] = multipart_content_type(body.boundary)
        else:
            headers["Content-Type"] = "application/octet-stream"
            headers["Content-Range"] = format_content_range(ranges[0][0], ranges[0][1], None)
        response = self.request("PATCH", self._patch_target(), headers=headers, body=body,
                                replayable=False)
        self._body(response)
        if learning:
            self.compression.observed(len(body), time.perf_counter() - started, None)
        return sum(length for _, length in ranges)

    def _patch_target(self) -> str:
        return self._target(params={"sparse": 1}) if self._sparse_writes else self._target()

    def cut_chunks(self, ranges: Sequence[ByteRange], average: int) -> "List[cdc.Chunk]":
        """The server cuts its file (on its cores) and sends the list: 12 bytes a chunk."""
        chunks: "List[cdc.Chunk]" = []
        ranges = list(ranges)
        for start in range(0, len(ranges), MAX_CHUNK_RANGES):
            asked = ranges[start:start + MAX_CHUNK_RANGES]
            body = b"".join(_CHUNK_RANGE.pack(offset, length) for offset, length in asked)
            response = self.request("POST", self._target("chunks", params={"average": average}),
                                    headers={**self._conditions(), "Content-Length": str(len(body)),
                                             "Content-Type": "application/octet-stream"}, body=body)
            try:
                chunks += cdc.decode_ranges(self._body(response), asked)
            except ValueError as error:
                raise self.client.malformed(f"its chunk list does not fit the ranges asked ({error})") from None
        return chunks

    def can_copy_within(self, origin: FileEndpoint) -> bool:
        return isinstance(origin, RemoteFile) and origin.base == self.base

    def copy_within(self, origin: FileEndpoint, moves: "Sequence[cdc.Copy]") -> int:
        """The server copies ranges of ``origin`` into this (temporary) file: nothing crosses but the list."""
        assert isinstance(origin, RemoteFile) and origin.base == self.base, "the engine asks can_copy_within"
        body = b"".join(_COPY_MOVE.pack(move.target_offset, move.source_offset, move.length) for move in moves)
        response = self.request("POST", self._target("copy-ranges", params={"from": os.fsencode(origin.path)}),
                                headers={"Content-Length": str(len(body)), "Content-Type": "application/octet-stream"},
                                body=body)
        self._body(response)
        return sum(move.length for move in moves)

    def flush(self) -> None:
        self._call("POST", "fsync")

    def take_lease(self) -> None:
        response = self.request("POST", self._target("lease"))
        try:
            lease = self.client.json(response)["lease"]
        except (KeyError, TypeError):
            raise self.client.malformed() from None
        if not isinstance(lease, str) or not lease.isalnum():
            raise self.client.malformed()
        self._lease = lease

    def leases_stop_other_writers(self) -> bool:
        return True

    def end_lease(self) -> None:
        if self._lease:
            try:
                self._call("DELETE", "lease")
            finally:
                self._lease = None

    def create_temporary(self, clone: bool) -> "RemoteFile":
        temporary = self._sibling(temporary_name, self.follow)
        try:
            with let_through():  # the server may copy for long; this cleans up by itself
                self._fill(temporary, clone)
        except BaseException:
            # Interrupted while the server made it (Ctrl-C, SIGTERM): the caller never gets
            # the endpoint to clean up, so the temporary is removed here.
            temporary.remove_temporary()
            temporary.close()
            raise
        return temporary

    def open_partial(self, clone: bool) -> "tuple[RemoteFile, bool]":
        # The client names it, as it names every temporary of a push: the server keeps
        # it when the client goes away, and the next push to the same path finds it.
        partial = self._sibling(partial_name, follow=False)
        info = partial.stat()
        if info is not None:
            if info.kind != "file":
                partial.close()
                raise NotAFile(f"Cannot resume into the partial file {partial.path} of {self.location}: it "
                               f"is not a regular file; remove it")
            return partial, True
        self._fill(partial, clone)  # kept if interrupted here: it is the next run's to resume
        return partial, False

    def _sibling(self, naming: Callable[[str], str], follow: bool) -> "RemoteFile":
        """The hidden sibling on the server that ``naming`` names (a temporary, a partial file)."""
        directory, _, name = self.path.rpartition("/")
        path = f"{directory}/{naming(name)}" if directory else naming(name)
        return RemoteFile(self.location, self.token, self.concurrency, self.timeout,
                          self.ca_file, _base_path=(self.base, path), rate_limit=self.client.rate_limit,
                          follow=follow, compress=self.compression)

    def _fill(self, sibling: "RemoteFile", clone: bool) -> None:
        """Make a new sibling on the server: a clone of this file, or empty."""
        if clone:
            self._call("POST", "clone", sibling.path, params={"from": self.path})
        else:
            # Made now, empty, as a local temporary is: a missing directory or a
            # full disk fails here (one round trip) rather than at the first write. Its mode
            # is the one the sync gave (a server that does not know the parameters ignores them).
            try:
                sibling._call("POST", "resize", params={"size": 0, **self._copies_mode})
            except (FileMissing, NotAFile) as error:  # named as the user named it, not by the sibling's name
                reason = str(error).rpartition(": ")[2]
                if isinstance(error, FileMissing):
                    reason = f"its directory does not exist ({reason})"
                raise type(error)(f"Cannot create {self.location}: {reason}") from None

    def replace(self, other: FileEndpoint) -> None:
        assert isinstance(other, RemoteFile)
        # The name's bytes, not its characters: it may not be UTF-8.
        self._call("POST", "rename", params={"to": os.fsencode(other.path)})

    def sweep_temporaries(self) -> int:
        """Have the server remove the temporaries beside the file whose writers are gone.

        A server older than this request answers 404 (as it does for a missing directory): nothing.
        """
        try:
            response = self.request("POST", self._target("sweep"), expected=(200, 404, 405))
        except PdiffcopyError as error:  # housekeeping never stops a sync: its next request says what is wrong
            logger.debug("Sweeping beside %s failed: %s", self.location, error)
            return 0
        if response.status != 200:
            self._body(response)
            return 0
        answer = self.client.json(response)
        removed = answer.get("removed") if isinstance(answer, dict) else None
        return removed if isinstance(removed, int) else 0

    def remove_temporary(self) -> None:
        try:
            self._call("DELETE", "temporary", expected=(200, 404))
        except PdiffcopyError:
            pass  # best effort while already failing

    def close(self) -> None:
        for pool in (self._hash_pool, self._first_hash_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _read_exactly(stream: http.client.HTTPResponse, offset: int, length: int, base: str) -> Iterator[Chunk]:
    buffer = bytearray(min(TRANSFER_CHUNK_SIZE, max(length, 1)))
    view = memoryview(buffer)
    position, end = offset, offset + length
    while position < end:
        got = stream.readinto(view[: min(len(buffer), end - position)])
        if not got:
            raise RemoteError(f"Lost the connection to {base}: {SERVER_CLOSED}")
        yield position, view[:got]
        position += got


class _Cuttable:
    """Chunks handed out a number of bytes at a time: a chunk that crosses the count is cut
    there and its rest handed out next."""

    def __init__(self, chunks: Iterator[Chunk]) -> None:
        self._chunks = chunks
        self._pending: Optional[Chunk] = None

    def take(self, count: int) -> Iterator[Chunk]:
        """The next ``count`` bytes' chunks (fewer if the chunks end first)."""
        while count > 0:
            try:
                offset, data = next(self)
            except StopIteration:
                return
            if len(data) > count:
                view = memoryview(data)
                self._pending = (offset + count, view[count:])
                data = view[:count]
            count -= len(data)
            yield offset, data

    def __iter__(self) -> "_Cuttable":
        return self

    def __next__(self) -> Chunk:
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            return chunk
        return next(self._chunks)


def _framed_body(ranges: List[ByteRange], chunks: Iterator[Chunk], level: int = compression.LEVEL) -> bytes:
    """A compressed PATCH body: the ranges' bytes cut in pieces, each a header and a zstd frame.

    Built whole, as its length must be sent first; a request carries one transfer batch, and
    compressed it is smaller still.
    """
    parts: List[bytes] = []
    pending = bytearray()
    for offset, length in compression.pieces(ranges):
        while len(pending) < length:
            try:
                _, data = next(chunks)
            except StopIteration:
                raise StorageError("The source ended before the data to send did") from None
            pending += data
        parts.append(compression.frame(offset, pending[:length], level))
        del pending[:length]
    return b"".join(parts)


def _sampled(chunks: Iterator[Chunk], state: Compression) -> Iterator[Chunk]:
    """``chunks``, the first one also handed to the adaptive policy as a sample."""
    first = True
    for offset, data in chunks:
        if first:
            state.observed(0, 0.0, bytes(data[:compression.SAMPLE_BYTES]))
            first = False
        yield offset, data


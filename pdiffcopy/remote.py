"""A file behind a pdiffcopy server, as a :class:`~pdiffcopy.endpoints.FileEndpoint`.

The transport: HTTP with keep-alive connections (one :class:`requests.Session`
per thread), ranged GETs to read, ranged PATCHes to write, and the
``/.pdiffcopy/`` endpoints for hashes, resizing, flushing and atomic renames.
Every call has a timeout; every failure becomes a one-line
:class:`~pdiffcopy.exceptions.PdiffcopyError`.
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Iterable, Iterator, List, Optional, Type
from urllib.parse import quote, unquote, urlsplit

import requests

from pdiffcopy.blocks import ByteRange, Segment
from pdiffcopy.byteranges import (
    boundary_of,
    closing_delimiter,
    format_content_range,
    format_range_header,
    multipart_content_type,
    multipart_length,
    parse_content_range,
    part_header,
    read_parts,
)
from pdiffcopy.endpoints import Chunk, FileEndpoint, FileInfo
from pdiffcopy.exceptions import (
    AccessDenied,
    AuthenticationFailed,
    BadRequest,
    Conflict,
    FileMissing,
    NotAFile,
    PdiffcopyError,
    RemoteError,
    StorageError,
    UsageError,
)
from pdiffcopy.fileops import TRANSFER_CHUNK_SIZE, temporary_name
from pdiffcopy.hashing import digest_size

#: Seconds to wait for a connection, and for the server to start answering or
#: to send more data. Hashing a 64 MiB segment takes well under a second even
#: with slow hashes on slow disks; a minute means the server is gone.
DEFAULT_TIMEOUT = 60.0
CONNECT_TIMEOUT = 10.0

_STATUS_ERRORS: Dict[int, Type[PdiffcopyError]] = {
    400: BadRequest, 401: AuthenticationFailed, 403: AccessDenied, 404: FileMissing,
    409: NotAFile, 412: Conflict, 416: BadRequest, 507: StorageError,
}


def parse_url(url: str):
    """Split a file URL into (base URL, path relative to the server's root).

    :raises UsageError: For a URL that does not name a file on a server.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise UsageError(f"Invalid URL {url!r}: {error}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise UsageError(f"Invalid URL {url!r}: expected http://HOST:PORT/path")
    if parts.query or parts.fragment:
        raise UsageError(f"Invalid URL {url!r}: a query or fragment is not a file name")
    path = unquote(parts.path).lstrip("/")
    if not path or path.endswith("/"):
        raise UsageError(f"Invalid URL {url!r}: it names no file (expected http://HOST:PORT/path)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    base = f"{parts.scheme.lower()}://{host}" + (f":{port}" if port else "")
    return base, path


class _RangesBody:
    """A PATCH body streaming ranges of a source: raw for one range, multipart for several.

    It has a length, so requests sends a Content-Length instead of chunking.
    """

    def __init__(self, ranges: List[ByteRange], chunks: Iterator[Chunk]) -> None:
        self.ranges = ranges
        self.chunks = chunks
        self.multipart = len(ranges) > 1
        self.length = multipart_length(ranges, None) if self.multipart else ranges[0][1]
        self.sent = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for offset, length in self.ranges:
            if self.multipart:
                yield part_header(offset, length, None)
            remaining = length
            while remaining > 0:
                try:
                    _, data = next(self.chunks)
                except StopIteration:
                    raise StorageError("The source ended before the data to send did") from None
                remaining -= len(data)
                self.sent += len(data)
                yield data
        if self.multipart:
            yield closing_delimiter()


class RemoteFile(FileEndpoint):
    """A file on a pdiffcopy server, named by its URL."""

    is_remote = True

    def __init__(self, url: str, token: Optional[str] = None, concurrency: int = 4,
                 timeout: float = DEFAULT_TIMEOUT, verify: "bool | str" = True,
                 _base_path: Optional[tuple] = None) -> None:
        self.location = url
        self.base, self.path = _base_path or parse_url(url)
        self.token = token
        self.timeout = timeout
        self.verify = verify
        self.concurrency = concurrency
        self._local = threading.local()
        self._sessions: List[requests.Session] = []
        self._lock = threading.Lock()
        self._hash_pool: Optional[ThreadPoolExecutor] = None
        self._etag: Optional[str] = None

    # -- transport -------------------------------------------------------

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.trust_env = False  # no proxies or netrc: the server is named explicitly
            session.verify = self.verify
            if self.token:
                session.headers["Authorization"] = f"Bearer {self.token}"
            self._local.session = session
            with self._lock:
                self._sessions.append(session)
        return session

    def _url(self, endpoint: Optional[str] = None, path: Optional[str] = None) -> str:
        quoted = quote(path if path is not None else self.path, safe="/")
        if endpoint:
            return f"{self.base}/.pdiffcopy/{endpoint}/{quoted}"
        return f"{self.base}/{quoted}"

    def request(self, method: str, url: str, expected=(200,), **kwargs) -> requests.Response:
        """Send one request; turn every failure into a one-line error."""
        kwargs.setdefault("timeout", (CONNECT_TIMEOUT, self.timeout))
        try:
            response = self._session().request(method, url, **kwargs)
        except requests.exceptions.SSLError as error:
            raise RemoteError(f"TLS error talking to {self.base}: {_reason(error)}") from None
        except requests.exceptions.ConnectTimeout:
            raise RemoteError(f"Cannot connect to {self.base}: timed out") from None
        except requests.exceptions.ReadTimeout:
            raise RemoteError(
                f"The server at {self.base} did not answer within {self.timeout:g} seconds") from None
        except requests.exceptions.ConnectionError as error:
            raise RemoteError(f"Cannot talk to the server at {self.base}: {_reason(error)}") from None
        except requests.exceptions.RequestException as error:
            raise RemoteError(f"Request to {self.base} failed: {_reason(error)}") from None
        if response.status_code not in expected:
            raise self._error(response)
        return response

    def _error(self, response: requests.Response) -> PdiffcopyError:
        try:
            message = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {response.status_code} {response.reason}"
        finally:
            response.close()
        kind = _STATUS_ERRORS.get(response.status_code, RemoteError)
        return kind(f"Server {self.base}: {message}")

    def _conditions(self) -> Dict[str, str]:
        return {"If-Match": self._etag} if self._etag else {}

    # -- FileEndpoint ----------------------------------------------------

    def pin(self, info: FileInfo) -> None:
        self._etag = info.etag

    def stat(self) -> Optional[FileInfo]:
        response = self.request("GET", self._url("stat"), expected=(200, 404))
        if response.status_code == 404:
            response.close()
            return None
        try:
            data = response.json()
            return FileInfo(str(data["type"]), int(data["size"]), int(data["mtime_ns"]),
                            str(data["etag"]))
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"Server {self.base} sent a malformed answer; is it pdiffcopy?") from None

    def submit_hashes(self, segment: Segment, block_size: int, method: str) -> "Future[bytes]":
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hash")
        return self._hash_pool.submit(self._hashes, segment, block_size, method)

    def _hashes(self, segment: Segment, block_size: int, method: str) -> bytes:
        params = {"method": method, "block_size": block_size, "offset": segment.offset,
                  "length": segment.length}
        response = self.request("GET", self._url("hashes"), params=params,
                                headers=self._conditions())
        digests = response.content
        if len(digests) != segment.block_count * digest_size(method):
            raise RemoteError(f"Server {self.base} sent {len(digests)} bytes of digests for "
                              f"{segment.block_count} blocks")
        return digests

    def prepare(self, size: int) -> None:
        self.request("POST", self._url("resize"), params={"size": size}).close()

    def read_ranges(self, ranges: Iterable[ByteRange]) -> Iterator[Chunk]:
        ranges = list(ranges)
        headers = {"Range": format_range_header(ranges), **self._conditions()}
        response = self.request("GET", self._url(), expected=(206, 200), headers=headers,
                                stream=True)
        try:
            stream = io.BufferedReader(response.raw, TRANSFER_CHUNK_SIZE)
            boundary = boundary_of(response.headers.get("Content-Type", ""))
            if response.status_code == 200:
                raise RemoteError(f"Server {self.base} ignored the Range header")
            if boundary is None:
                offset, length, _ = parse_content_range(response.headers.get("Content-Range", ""))
                if (offset, length) != ranges[0] or len(ranges) != 1:
                    raise RemoteError(f"Server {self.base} sent other ranges than asked")
                yield from _read_exactly(stream, offset, length, self.base)
                return
            wanted = set(ranges)
            for offset, length, _ in read_parts(stream, boundary, max_parts=len(ranges)):
                if (offset, length) not in wanted:
                    raise RemoteError(f"Server {self.base} sent a range that was not asked for")
                wanted.discard((offset, length))
                yield from _read_exactly(stream, offset, length, self.base)
            if wanted:
                raise RemoteError(f"Server {self.base} left out ranges that were asked for")
        except BadRequest as error:
            raise RemoteError(f"Server {self.base} sent a malformed answer: {error}") from None
        except (requests.exceptions.RequestException, OSError, ValueError) as error:
            raise RemoteError(f"Lost the connection to {self.base}: {_reason(error)}") from None
        finally:
            response.close()

    def write_ranges(self, ranges: Iterable[ByteRange], chunks: Iterator[Chunk]) -> int:
        ranges = list(ranges)
        body = _RangesBody(ranges, chunks)
        headers = dict(self._conditions())
        headers.pop("If-Match", None)  # the target is pinned only while it is a source
        if body.multipart:
            headers["Content-Type"] = multipart_content_type()
        else:
            headers["Content-Type"] = "application/octet-stream"
            headers["Content-Range"] = format_content_range(ranges[0][0], ranges[0][1], None)
        self.request("PATCH", self._url(), data=body, headers=headers).close()
        return sum(length for _, length in ranges)

    def flush(self) -> None:
        self.request("POST", self._url("fsync")).close()

    def create_temporary(self, clone: bool) -> "RemoteFile":
        directory, _, name = self.path.rpartition("/")
        path = f"{directory}/{temporary_name(name)}" if directory else temporary_name(name)
        temporary = RemoteFile(self.location, self.token, self.concurrency, self.timeout,
                               self.verify, _base_path=(self.base, path))
        if clone:
            self.request("POST", self._url("clone", path), params={"from": self.path}).close()
        return temporary

    def replace(self, other: FileEndpoint) -> None:
        assert isinstance(other, RemoteFile)
        self.request("POST", self._url("rename"), params={"to": other.path}).close()

    def remove_temporary(self) -> None:
        try:
            self.request("DELETE", self._url("temporary"), expected=(200, 404)).close()
        except PdiffcopyError:
            pass  # best effort while already failing

    def close(self) -> None:
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for session in self._sessions:
                session.close()
            self._sessions.clear()


def _read_exactly(stream: io.BufferedReader, offset: int, length: int, base: str) -> Iterator[Chunk]:
    buffer = bytearray(min(TRANSFER_CHUNK_SIZE, max(length, 1)))
    view = memoryview(buffer)
    position, end = offset, offset + length
    while position < end:
        got = stream.readinto(view[: min(len(buffer), end - position)])
        if not got:
            raise RemoteError(f"The server at {base} closed the connection mid-transfer")
        yield position, view[:got]
        position += got


def _reason(error: BaseException) -> str:
    """The innermost, most specific sentence of a (requests) exception chain."""
    text = str(error)
    for marker in ("Connection refused", "Name or service not known", "No route to host",
                   "Connection reset by peer", "Remote end closed connection", "timed out",
                   "certificate verify failed", "Temporary failure in name resolution"):
        if marker in text:
            return marker[0].lower() + marker[1:]
    return text.splitlines()[0][:200] if text else type(error).__name__

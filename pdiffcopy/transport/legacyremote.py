"""A file behind a pdiffcopy 1.0.1 server, through 1.0.1's own API.

1.0.1 knows four requests, each naming the file by its absolute path in a
query string: ``GET /info`` (the size), ``GET /hashes`` (a digest per block
of the whole file, hex, one ``OFFSET<TAB>DIGEST`` line each), ``GET`` and
``POST /blocks`` (one range read or written), and ``POST /resize`` (create,
with missing parents, or truncate). There is no token, no TLS, no rename,
no lock and no fsync; this endpoint does without them: a new file is written
in place (``--atomic`` cannot be honoured), and only our own whole-file
verification at the end vouches for the result.

:func:`remote_file` (which :func:`pdiffcopy.api.file_endpoint` calls) makes a
:class:`LegacyRemoteFile` instead of a :class:`~pdiffcopy.transport.remote.RemoteFile`
when the file's first request finds a 1.0.1 server, so the sync engine needs
no knowledge of it, and no endpoint changes its kind midway.
"""

from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple
from urllib.parse import urlencode

from pdiffcopy.core.blocks import ByteRange
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
from pdiffcopy.errors import RemoteProtocolError, Unsupported
from pdiffcopy.core.hashing import digest_bytes, finish, new_hasher
from pdiffcopy.engine.forkshared import Throttle
from pdiffcopy.transport.httpclient import DEFAULT_TIMEOUT
from pdiffcopy.transport.remote import RemoteFile

logger = logging.getLogger(__name__)

#: Longest range read or written by one request: 1.0.1 holds a whole request
#: in memory on both ends, and its own client moved one block (1 MiB) at a time.
LEGACY_REQUEST_BYTES = 4 * 1024 * 1024

#: Block hashes a 1.0.1 server can compute: its ``hashlib.new(method)``.
#: Anything else (xxh3, blake3) is computed here from the data read through
#: ``/blocks``, which moves the whole file: ``-m sha1`` keeps the delta cheap.
#: (hashlib.algorithms_guaranteed less the SHAKEs, written out: importing hashlib loads OpenSSL,
#: ~3 ms of every remote sync; tests/test_startup.py checks the two agree.)
LEGACY_METHODS = frozenset({"blake2b", "blake2s", "md5", "sha1", "sha224", "sha256", "sha384", "sha3_224",
                            "sha3_256", "sha3_384", "sha3_512", "sha512"})


#: The servers found to be 1.0.1 in this run (each is named once).
_warned: Set[str] = set()


def remote_file(url: str, token: Optional[str] = None, concurrency: int = 4,
                timeout: float = DEFAULT_TIMEOUT, ca_file: Optional[str] = None,
                rate_limit: Optional[Throttle] = None, compress: "str | int" = "auto") -> RemoteFile:
    """The endpoint of a file URL: a :class:`RemoteFile`, or a :class:`LegacyRemoteFile` on a 1.0.1 server.

    Decided here by the file's first request (:meth:`RemoteFile.on_legacy_server`), whose answer
    serves the endpoint's first :meth:`~RemoteFile.stat`. With a token, a 1.0.1 server stops
    the sync instead: the user asked for a server that checks who writes, and 1.0.1 lets anyone
    in. Without one, the token is never sent (1.0.1 has no use for it).

    ``rate_limit`` (``--bwlimit``) holds for either; ``compress`` for a current server (1.0.1
    sends every byte plain).

    :raises RemoteError: For a 1.0.1 server when a token is set.
    """
    remote = RemoteFile(url, token=token, concurrency=concurrency, timeout=timeout, ca_file=ca_file,
                        rate_limit=rate_limit, compress=compress)
    try:
        if not remote.on_legacy_server():
            return remote
    except BaseException:
        remote.close()
        raise
    remote.close()
    if token:
        raise RemoteProtocolError(f"{remote.base}: this is a pdiffcopy 1.0.1 server, which cannot check a token; "
                                  f"sync without one to use its old API, or upgrade it (see docs/migration.rst)")
    return LegacyRemoteFile(url, concurrency=concurrency, timeout=timeout, ca_file=ca_file, rate_limit=rate_limit)


class LegacyRemoteFile(RemoteFile):
    """A file on a pdiffcopy 1.0.1 server (made by :func:`remote_file` when it finds one)."""

    #: A server's, less the holes: 1.0.1 has no data map and cannot punch. The rest it does
    #: not know (chunks, partial files, leases) it answers at run time, as its server would.
    capabilities = (PriorityHashing, ContentChunks, PartialFiles, Leases)

    def __init__(self, url: str, concurrency: int = 4, timeout: float = DEFAULT_TIMEOUT,
                 ca_file: Optional[str] = None, rate_limit: Optional[Throttle] = None) -> None:
        super().__init__(url, token=None, concurrency=concurrency, timeout=timeout, ca_file=ca_file,
                         rate_limit=rate_limit)
        #: By (block size, method): how many writes preceded the fetch, and the digests by offset.
        self._digest_cache: Dict[Tuple[int, str], Tuple[int, Dict[int, bytes]]] = {}
        #: Byte ranges (offset, end) written, in order: what makes cached digests stale.
        self._writes: List[Tuple[int, int]] = []
        self._cache_lock = threading.Lock()
        self._fetch_lock = threading.Lock()  # one whole-file hash on the server at a time

    def _legacy(self, endpoint: str, **params) -> str:
        # 1.0.1 takes the path of the URL as an absolute file name.
        return f"/{endpoint}?{urlencode(dict(filename='/' + self.path, **params))}"

    # -- FileEndpoint ----------------------------------------------------

    def pin(self, info: FileInfo) -> None:
        pass  # no ETags: the size is checked again at the end of the sync

    def stat(self) -> Optional[FileInfo]:
        response = self.request("GET", self._legacy("info"), expected=(200, 404))
        if response.status == 404:
            response.close()
            return None
        try:
            size = int(self.client.json(response)["size"])
        except (KeyError, TypeError, ValueError):
            raise self.client.malformed() from None
        # /info answers for directories too; only a file can be read.
        probe = self.request("GET", self._legacy("blocks", offset=0, size=0), expected=(200, 500))
        self._body(probe)
        if probe.status != 200:
            raise RemoteProtocolError(f"{self.base}: this is a pdiffcopy 1.0.1 server, which cannot read "
                                      f"/{self.path} (a directory? with 1.0.1, only single files sync)")
        # After the checks: a directory's error is then the only line.
        if self.base not in _warned:  # once per server and run, not per file opened
            _warned.add(self.base)
            logger.warning("%s: this is a pdiffcopy 1.0.1 server; syncing through its old API, without "
                           "token, TLS or atomic rename (upgrade it, see docs/migration.rst)", self.base)
        return FileInfo("file", size, 0, "")

    def submit_hashes_first(self, ranges: Sequence[ByteRange], block_size: int, method: str
                            ) -> "Future[bytes]":
        # Behind the whole-file hashing of submit_hashes, never RemoteFile's request that 1.0.1 does not know.
        return self.submit_hashes(ranges, block_size, method)

    def hashes_pieces_cheaply(self) -> bool:
        return False  # a whole-file hash list per piece size, or the data itself (see _legacy_hashes)

    def submit_hashes(self, ranges: Sequence[ByteRange], block_size: int, method: str
                      ) -> "Future[bytes]":
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hash")
        return self._hash_pool.submit(self._legacy_hashes, list(ranges), block_size, method)

    def _legacy_hashes(self, ranges: List[ByteRange], block_size: int, method: str) -> bytes:
        if method not in LEGACY_METHODS:
            return self._hash_here(ranges, block_size, method)
        digests = self._all_digests(ranges, block_size, method)
        empty = digest_bytes(method, b"")  # a block past the end, as our hashing does
        return b"".join(digests.get(block * block_size, empty)
                        for offset, length in ranges
                        for block in range(offset // block_size, -(-(offset + length) // block_size)))

    def _cached(self, ranges: List[ByteRange], key: Tuple[int, str]) -> Optional[Dict[int, bytes]]:
        """The cached digests of ``key``, unless a write since their fetch touched ``ranges``."""
        with self._cache_lock:
            if key not in self._digest_cache:
                return None
            since, digests = self._digest_cache[key]
            for start, end in self._writes[since:]:
                if any(start < offset + length and offset < end for offset, length in ranges):
                    return None
            return digests

    def _all_digests(self, ranges: List[ByteRange], block_size: int, method: str) -> Dict[int, bytes]:
        """Every block digest of the file, by offset, fresh for ``ranges``.

        1.0.1 hashes only whole files, so the digests are fetched once and
        kept: the comparison asks for blocks not written yet, and only the
        read-back of written blocks needs a second fetch (one, not one per
        write, which would hash a big file over and over).
        """
        key = (block_size, method)
        digests = self._cached(ranges, key)
        if digests is not None:
            return digests
        with self._fetch_lock:
            digests = self._cached(ranges, key)  # another thread may have fetched meanwhile
            if digests is not None:
                return digests
            with self._cache_lock:
                since = len(self._writes)
            response = self.request("GET", self._legacy("hashes", block_size=block_size, method=method,
                                                        concurrency=self.concurrency))
            digests = {}
            try:
                for line in self._body(response).decode("ascii").splitlines():
                    offset, _, digest = line.partition("\t")
                    digests[int(offset)] = bytes.fromhex(digest)
            except ValueError:
                raise self.client.malformed() from None
            with self._cache_lock:
                self._digest_cache[key] = (since, digests)
            return digests

    def _hash_here(self, ranges: List[ByteRange], block_size: int, method: str) -> bytes:
        """Hash blocks here, from their data read through ``/blocks`` (a method 1.0.1 lacks)."""
        out = []
        for offset, length in ranges:
            data = b"".join(bytes(chunk) for _, chunk in self.read_ranges([(offset, length)]))
            for start in range(0, max(length, 1), block_size):
                hasher = new_hasher(method)
                hasher.update(data[start:start + block_size])
                out.append(finish(hasher, method))
        return b"".join(out)

    def _changed(self, start: int, end: int) -> None:
        with self._cache_lock:
            self._writes.append((start, end))

    def prepare(self, size: int) -> None:
        self._changed(0, sys.maxsize)  # a new size changes the blocks at the end: refetch all
        self._body(self.request("POST", self._legacy("resize", size=size)))

    # A 1.0.1 server has no data map and cannot punch: every byte is data, holes are written as zeros.
    data_map = Holes.data_map
    punch_ranges = Holes.punch_ranges
    prepare_sparse = Holes.prepare_sparse
    write_sparse = Holes.write_sparse

    def read_ranges(self, ranges: Iterable[ByteRange]) -> Iterator[Chunk]:
        for offset, length in ranges:
            end = offset + length
            while offset < end:
                size = min(LEGACY_REQUEST_BYTES, end - offset)
                data = self._body(self.request("GET", self._legacy("blocks", offset=offset, size=size)))
                if not data:
                    break  # past the end: our hashing treats the missing bytes as absent too
                yield offset, data
                offset += len(data)

    def write_ranges(self, ranges: Iterable[ByteRange], chunks: Iterator[Chunk]) -> int:
        written = 0
        for offset, data in chunks:
            body = bytes(data)
            self._changed(offset, offset + len(body))
            response = self.request("POST", self._legacy("blocks", offset=offset), body=body,
                                    headers={"Content-Type": "application/octet-stream"})
            self._body(response)
            # Again: digests fetched while the write was on its way may predate it.
            self._changed(offset, offset + len(body))
            written += len(body)
        return written

    def cut_chunks(self, ranges, average):
        raise Unsupported(f"{self.base} is a pdiffcopy 1.0.1 server, which cannot cut its files into chunks")

    def can_copy_within(self, origin: FileEndpoint) -> bool:
        return False  # 1.0.1 cannot copy between files, nor rename a temporary

    def copy_within(self, origin: FileEndpoint, moves) -> int:
        # Not RemoteFile's request, which 1.0.1 does not know.
        raise Unsupported(f"{self.base} is a pdiffcopy 1.0.1 server, which cannot copy between files")

    def flush(self) -> None:
        pass  # 1.0.1 cannot fsync; its writes reach the disk when its kernel decides

    def take_lease(self) -> None:
        pass  # 1.0.1 has no locks

    def leases_stop_other_writers(self) -> bool:
        return False  # no leases at all

    def open_partial(self, clone: bool) -> "tuple[FileEndpoint, bool]":
        # 1.0.1 cannot rename: --partial writes in place, as without it.
        raise Unsupported(f"{self.location} is on a pdiffcopy 1.0.1 server, which cannot keep a partial file")

    def end_lease(self) -> None:
        pass

    def create_temporary(self, clone: bool) -> "LegacyRemoteFile":
        # 1.0.1 cannot rename: the file is written in place, as 1.0.1's client did.
        return self

    def replace(self, other: FileEndpoint) -> None:
        pass  # never reached: create_temporary gives the file itself

    def remove_temporary(self) -> None:
        pass


__all__ = ["LEGACY_METHODS", "LegacyRemoteFile", "remote_file"]

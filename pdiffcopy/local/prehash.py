"""Digests of a local file made ahead of the sync's request for them, while ssh logs in.

A sync over ssh knows its local file, the block size and the hash method before ssh
connects, and waits about half a second for the login and the remote server's start.
:func:`start_prehash` hashes the local file in the sync's own hashing processes meanwhile;
the engine's first request for those digests (:meth:`Prehash.take`, through
:meth:`LocalFile.submit_hashes <pdiffcopy.local.localfile.LocalFile.submit_hashes>`) gets
them instead of hashing again.

Digests are only handed out for the exact request they were made for (the same ranges,
block size and method) and only if the file is still the file that was hashed: the same
device, inode, size, modification and change time before the hash, after it, and when the
engine asks. Anything else hashes afresh; what is never asked for is cancelled at close.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import storage_error
from pdiffcopy.local.filehash import hash_region

if TYPE_CHECKING:
    from concurrent.futures import Executor

logger = logging.getLogger(__name__)

#: What says a file is unchanged: device, inode, size, modification and change times (ns).
Identity = Tuple[int, int, int, int, int]

#: The key of a set of digests: its ranges, block size and method.
RequestKey = Tuple[Tuple[ByteRange, ...], int, str]


def identity_of(info: os.stat_result) -> Identity:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def hash_path_with_identity(path: str, ranges: Sequence[ByteRange], block_size: int, method: str
                            ) -> "Tuple[bytes, Identity, Identity]":
    """The digests of ``ranges`` of ``path``, and the file's identity before and after hashing them.

    A hashing process's unit of work, as :func:`~pdiffcopy.local.filehash.hash_file_ranges`.
    """
    from pdiffcopy.local.confinement import open_regular_path

    fd = open_regular_path(path, os.O_RDONLY)
    try:
        before = identity_of(os.fstat(fd))
        digests = b"".join(hash_region(fd, offset, length, block_size, method) for offset, length in ranges)
        return digests, before, identity_of(os.fstat(fd))
    except OSError as error:
        raise storage_error(error, f"read {path}") from None
    finally:
        os.close(fd)


class Prehash:
    """Digests of one file being made in a pool it owns until the sync takes the pool over.

    :param path: The file (as :class:`~pdiffcopy.local.localfile.LocalFile` opens it).
    :param pool: The hashing processes; shut down by :meth:`close` unless :meth:`hand_over_pool` gave it away.
    """

    def __init__(self, path: str, pool: "Executor", concurrency: int, identity: Identity, block_size: int,
                 method: str) -> None:
        self.path = path
        self.pool: "Optional[Executor]" = pool
        self.concurrency = concurrency
        self.identity = identity
        self.block_size = block_size
        self.method = method
        self._entries: Dict[RequestKey, Future] = {}
        self._lock = threading.Lock()
        #: Requests answered from here, and requests that had to hash afresh (for -v and the tests).
        self.used = 0
        self.rejected = 0
        self._closed = False

    def submit(self, ranges: Sequence[ByteRange]) -> None:
        assert self.pool is not None
        key = (tuple(ranges), self.block_size, self.method)
        self._entries[key] = self.pool.submit(hash_path_with_identity, self.path, list(ranges),
                                              self.block_size, self.method)

    def hand_over_pool(self, concurrency: int) -> "Optional[Executor]":
        """The pool, for the sync to own from now on, if it has the size the sync wants."""
        pool = self.pool
        if pool is None or concurrency != self.concurrency:
            return None
        self.pool = None
        return pool

    def take(self, ranges: Sequence[ByteRange], block_size: int, method: str,
             hash_afresh) -> "Optional[Future[bytes]]":
        """The digests made for exactly this request, as a future; None when there are none.

        :param hash_afresh: Called (with no argument) for a future of the digests hashed now, when
                            the file turns out to have changed while or after it was hashed.
        """
        with self._lock:
            entry = self._entries.pop((tuple(ranges), block_size, method), None)
            if entry is None:
                if block_size == self.block_size and method != self.method:
                    self._drop()  # the sync hashes this file another way: these are of no use
                return None
        try:
            now = identity_of(os.stat(self.path))
        except OSError:
            now = None
        if now != self.identity:
            entry.cancel()
            self.rejected += 1
            return None
        answer: "Future[bytes]" = Future()

        def settle(done: Future) -> None:
            try:
                digests, before, after = done.result()
            except BaseException:  # (a failure is the fresh hash's to report)
                digests = before = after = None
            if before == after == now:
                self.used += 1
                answer.set_result(digests)
                return
            self.rejected += 1
            # Not in this callback's thread (the pool's own): a submit from there can wait on it.
            threading.Thread(target=_chain, args=(hash_afresh, answer), daemon=True,
                             name="prehash-afresh").start()

        entry.add_done_callback(settle)
        return answer

    def _drop(self) -> None:
        for entry in self._entries.values():
            entry.cancel()
        self._entries.clear()

    def close(self) -> None:
        """Cancel what was never asked for; stop the pool if the sync did not take it over."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            unused = len(self._entries)
            self._drop()
        logger.debug("%s: digests made while ssh logged in: %d used, %d not trusted (changed), %d unused",
                     self.path, self.used, self.rejected, unused)
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _chain(hash_afresh, answer: "Future[bytes]") -> None:
    try:
        answer.set_result(hash_afresh().result())
    except BaseException as error:
        answer.set_exception(error)


def start_prehash(path: str, ranges: "List[ByteRange]", block_size: int, method: str, concurrency: int,
                  start_pool) -> Optional[Prehash]:
    """Start hashing ``ranges`` of ``path`` (each range one request, as the engine makes them).

    :param start_pool: Makes the hashing processes (``start_hash_pool``).
    :returns: None when ``path`` is not a regular file that can be opened.
    """
    from pdiffcopy.local.confinement import open_regular_path
    from pdiffcopy.errors import PdiffcopyError

    try:
        fd = open_regular_path(path, os.O_RDONLY)
    except PdiffcopyError:
        return None
    try:
        identity = identity_of(os.fstat(fd))
    finally:
        os.close(fd)
    prehash = Prehash(path, start_pool(concurrency), concurrency, identity, block_size, method)
    for one in ranges:
        prehash.submit([one])
    return prehash


__all__ = ["Prehash", "hash_path_with_identity", "identity_of", "start_prehash"]

"""A file's block digests, a segment at a time: memory that does not grow with the file's size.

A file of a few terabytes has millions of blocks and hundreds of thousands of segments,
most of them holes when it is a thin image. Its digests are therefore never cut into one
object per block nor all hashed at once: each segment's digests stay one ``bytes`` (the
concatenation its hashing returns), hashing runs a bounded window ahead of the reader
(:class:`Lookahead`), a segment that is all hole is not hashed at all (:class:`~pdiffcopy.engine.segments.DataWalk`:
its digests are those of zeros, one shared object per length), what must be kept until the
verification is kept as runs (:class:`SegmentDigests`: a run of holes is one entry), and the
verification folds the whole-file digest segment by segment (:class:`StreamingVerification`).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
import threading
from typing import Deque, Iterator, List, Tuple, Union

from pdiffcopy.core.blocks import Segment, differing_digests, tree_digest_header
from pdiffcopy.core.hashing import digest_size, finish, new_hasher, zero_digests
from pdiffcopy.errors import VerificationFailed

#: Segments whose hashing runs ahead of the one being compared, per side: enough to keep a
#: hashing pool or a server's connections busy, few enough that a file's size never shows in
#: memory (each holds a segment's digests and a future).
HASH_WINDOW = 16

#: Segments (holes included, which cost no hashing) queued ahead at most: bounds the queue
#: while it looks for the next segment with data across a run of holes.
QUEUE_LIMIT = 256 * HASH_WINDOW

#: What a segment's digests are while they are made: done bytes, or futures to join.
Pending = Union[bytes, "Future[bytes]", List["Future[bytes]"]]


class Lookahead:
    """The digests of segments, in order, each started up to :data:`HASH_WINDOW` segments ahead.

    :param starts: Pairs of a segment and its digests as they are started (bytes when known
                   at once, a future or a list of futures when hashed): drawn from as the
                   window frees up, so a segment is started only shortly before it is read.
    """

    def __init__(self, starts: Iterator[Tuple[Segment, Pending]], window: int = HASH_WINDOW) -> None:
        self.starts = starts
        self.window = window
        self.queue: Deque[Tuple[Segment, Pending]] = deque()
        self.running = 0
        self.exhausted = False

    def fill(self) -> "Lookahead":
        """Start segments until the window is full (already at construction: :meth:`started`)."""
        while not self.exhausted and self.running < self.window and len(self.queue) < QUEUE_LIMIT:
            try:
                segment, pending = next(self.starts)
            except StopIteration:
                self.exhausted = True
                break
            self.queue.append((segment, pending))
            if not isinstance(pending, bytes):
                self.running += 1
        return self

    @classmethod
    def started(cls, starts: Iterator[Tuple[Segment, Pending]], window: int = HASH_WINDOW) -> "Lookahead":
        """A lookahead whose first window is started now (its hashing overlaps what comes before reading)."""
        return cls(starts, window).fill()

    def __iter__(self) -> Iterator[Tuple[Segment, bytes]]:
        while True:
            self.fill()
            if not self.queue:
                return
            segment, pending = self.queue.popleft()
            if isinstance(pending, bytes):
                yield segment, pending
                continue
            self.running -= 1
            futures = pending if isinstance(pending, list) else [pending]
            yield segment, b"".join(future.result() for future in futures)


class ZeroDigests:
    """The digests of zeros of one segment's length under one method, made once and shared."""

    def __init__(self, block_size: int, method: str) -> None:
        self.block_size = block_size
        self.method = method
        self.known: dict = {}

    def __call__(self, length: int) -> bytes:
        found = self.known.get(length)
        if found is None:
            found = self.known[length] = zero_digests([(0, length)], self.block_size, self.method)
        return found


class SegmentDigests:
    """The digests of every segment of a file, kept until its verification, as runs: a segment
    whose digests equal the one before's (a run of holes) adds a count, not an entry."""

    def __init__(self) -> None:
        self.runs: List[List] = []

    def append(self, digests: bytes) -> None:
        """Keep the next segment's digests."""
        if self.runs and (self.runs[-1][0] is digests or self.runs[-1][0] == digests):
            self.runs[-1][1] += 1
        else:
            self.runs.append([digests, 1])

    def __iter__(self) -> Iterator[bytes]:
        for digests, count in self.runs:
            for _ in range(count):
                yield digests


class StreamingVerification:
    """The verification of a whole file a segment at a time (:meth:`SegmentSteps.verify`, folded):
    every block of the work file has the source's digest, and the whole-file digest over every
    block digest in order (:func:`~pdiffcopy.core.blocks.tree_digest_input`) is the same value."""

    def __init__(self, size: int, block_size: int, method: str, location: str) -> None:
        self.method = method
        self.width = digest_size(method)
        self.location = location
        self.hasher = new_hasher(method)
        self.hasher.update(tree_digest_header(size, block_size, method))
        self.differing = 0

    def add(self, source: bytes, final: bytes, unknown: int = 0) -> None:
        """One segment: the source's digests, the work file's, and how many blocks of it have none."""
        self.hasher.update(source)
        if len(source) != len(final):
            self.differing += abs(len(source) - len(final)) // self.width + sum(
                1 for _ in differing_digests(source[: len(final)], final[: len(source)], self.width))
        else:
            self.differing += sum(1 for _ in differing_digests(source, final, self.width))
        self.differing += unknown

    def digest(self) -> str:
        """The whole-file digest as hex, once every segment is in.

        :raises VerificationFailed: Naming how many blocks differ, as :func:`~pdiffcopy.engine.segments.check_blocks`.
        """
        if self.differing:
            raise VerificationFailed(f"Verification failed: {self.differing} block(s) of {self.location} differ from "
                                     f"the source after the sync")
        return finish(self.hasher, self.method).hex()


def collect_in_background(stream: Lookahead) -> "Future[SegmentDigests]":
    """Keep every segment's digests of ``stream`` in a thread of its own, as they come: its window
    then keeps moving while this thread does something else (a whole-file copy)."""
    result: "Future[SegmentDigests]" = Future()

    def collect() -> None:
        digests = SegmentDigests()
        try:
            for _, segment_digests in stream:
                digests.append(segment_digests)
        except BaseException as error:  # handed to whoever waits for the result
            result.set_exception(error)
        else:
            result.set_result(digests)

    threading.Thread(target=collect, name="digests", daemon=True).start()
    return result


__all__ = ["HASH_WINDOW", "Lookahead", "SegmentDigests", "StreamingVerification", "ZeroDigests",
           "collect_in_background"]

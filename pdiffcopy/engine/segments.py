"""The segment engine: one segment of one file, brought from a source to a target.

A single-file sync (:mod:`pdiffcopy.engine.filejob`) and a tree sync's big files
(:mod:`pdiffcopy.engine.treesync`) both go through these steps, segment by segment::

    hash both sides -> compare (changed ranges) -> refine them into pieces
      -> move the changed pieces -> read back what must be read back -> verify every block

They are written once, as the methods of :class:`SegmentSteps`. The file job
drives them overlapped on futures (transfers start while later segments are
still hashed); a tree worker runs them one after another
(:meth:`SegmentSteps.run_segment`); the content-defined delta verifies with
them. Either way the rules are the ones below: which ranges
move, which are read back, and when a segment counts as verified. The
engine sees only the :class:`~pdiffcopy.engine.endpoints.FileEndpoint` interface;
an optional capability an endpoint lacks (a kernel copy, hashing in this
thread) has a fallback here.

The verification rule (docs/design.rst): after the move, every block of the
target must have the source's digest under the *verify method*, the block
hash itself when it is strong enough (:func:`~pdiffcopy.core.hashing.verify_method`),
else a strong one. A block moved is read back from the target; a block left
alone keeps the digest hashed from the target in this run, but only when that
digest was taken with the verify method; with a weak block hash every block
of both sides is hashed again with the strong one.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import (
    BlockPlan,
    ByteRange,
    Segment,
    batch_ranges,
    changed_blocks,
    coalesce,
    split_digests,
    split_ranges,
    tree_digest_input,
)
from pdiffcopy.core import records
from pdiffcopy.core.datamap import MAX_DATA_MAP_EXTENTS, overlaps, split_by_data
from pdiffcopy.core.refine import REFINE_PROBE_BYTES, RefineTally, differing_pieces, merge_close
from pdiffcopy.engine.digeststream import Lookahead, Pending, StreamingVerification, ZeroDigests
from pdiffcopy.engine.endpoints import Chunk, FileEndpoint
from pdiffcopy.errors import VerificationFailed
from pdiffcopy.core.hashing import digest_bytes, digest_size, verify_method, zero_digests

logger = logging.getLogger(__name__)

#: Largest byte range one transfer (one request, one read or write call)
#: carries. 16 MiB keeps a 100 % changed 1 GiB file spread over 64 requests,
#: so every connection stays busy until the end, while per-request overhead
#: stays under 1 %.
TRANSFER_REQUEST_BYTES = 16 * 1024 * 1024

#: Changed bytes whose pieces one refinement step hashes (one hash request to each
#: side, in parallel): one transfer batch, so a batch is refined in one round trip.
#: The first step is smaller: the probe (:data:`~pdiffcopy.core.refine.REFINE_PROBE_BYTES`)
#: that finds a dense rewrite out; after it, a step that stops paying wastes at most
#: 16 MiB of piece hashing (a few ms) and 64 KiB of digests (docs/benchmarks.rst).
REFINE_BATCH_BYTES = TRANSFER_REQUEST_BYTES

#: The source's holes are punched into a target's old data in whole units of this many bytes: the
#: block of most file systems (and the page), on which both sides' data maps fall.
PUNCH_ALIGNMENT = 4096

# -- hash ------------------------------------------------------------------


def hash_both(first: FileEndpoint, first_ranges: Sequence[ByteRange], second: FileEndpoint,
              second_ranges: Sequence[ByteRange], block_size: int, method: str,
              first_in_line: bool = False) -> Tuple[bytes, bytes]:
    """The digests of ``first_ranges`` of ``first`` and of ``second_ranges`` of ``second``, hashed at once.

    A side hashed elsewhere (by its server) is asked first: its request then runs in the
    background while a local file without a hash pool (a tree's worker) hashes in this
    thread, and the two sides wait for each other once instead of one after the other.

    :param first_in_line: Not behind the hashes queued before (refinement, while whole
                          segments are still hashed): a local file is hashed in this
                          thread, a remote one asked with :meth:`~FileEndpoint.submit_hashes_first`.
    """
    def submit(endpoint: FileEndpoint, ranges: Sequence[ByteRange]) -> "Optional[Future[bytes]]":
        if not ranges:
            return None
        if not first_in_line:
            return endpoint.submit_hashes(ranges, block_size, method)
        if endpoint.hashes_here():
            done: "Future[bytes]" = Future()
            done.set_result(endpoint.hash_ranges(ranges, block_size, method))
            return done
        return endpoint.submit_hashes_first(ranges, block_size, method)

    if first.hashes_here() and not second.hashes_here():
        theirs = submit(second, second_ranges)
        ours = submit(first, first_ranges)
    else:
        ours = submit(first, first_ranges)
        theirs = submit(second, second_ranges)
    return (ours.result() if ours else b""), (theirs.result() if theirs else b"")


# -- refine ----------------------------------------------------------------


def refine_ranges(source: FileEndpoint, work: FileEndpoint, ranges: Sequence[ByteRange], piece_size: int,
                  method: str, tally: RefineTally) -> List[ByteRange]:
    """The parts of the changed ``ranges`` that really differ: their pieces whose digests differ.

    Both sides hash the pieces of :data:`REFINE_BATCH_BYTES` of ranges at a
    time, in parallel (one request each for a remote file). Once ``tally``
    says refining does not pay (a dense rewrite), the rest moves whole.

    :param ranges: Changed ranges, starting at multiples of ``piece_size``.
    :param piece_size: A usable piece size (:func:`~pdiffcopy.core.refine.usable_piece_size`).
    :param method: The block hash method (the pieces only choose what moves:
                   the verification still reads back every changed block whole).
    """
    result: List[ByteRange] = []

    def refine(batch: List[ByteRange]) -> None:
        length = sum(part for _, part in batch)
        if not tally.pays():
            tally.skipped += length
            result.extend(batch)
            return
        ours, theirs = hash_both(source, batch, work, batch, piece_size, method, first_in_line=True)
        pieces = differing_pieces(batch, piece_size, ours, theirs, digest_size(method), TRANSFER_REQUEST_BYTES)
        tally.add(length, sum(part for _, part in pieces))
        result.extend(pieces)

    # Long ranges cut where pieces start: first in steps of the probe's size, so that a
    # dense rewrite costs one small probe, then (while refining pays) in whole steps.
    probe = max(piece_size, REFINE_PROBE_BYTES - REFINE_PROBE_BYTES % piece_size)
    step = REFINE_BATCH_BYTES - REFINE_BATCH_BYTES % piece_size
    parts = split_ranges(ranges, probe)
    taken = 0
    for batch in batch_ranges(parts, probe):
        if not tally.probing():
            break
        refine(batch)
        taken += len(batch)
    for batch in batch_ranges(parts[taken:], step):
        refine(batch)
    # Parts cut above that moved whole join again: one range, not a multipart request.
    return merge_close(result, 0, TRANSFER_REQUEST_BYTES)


# -- move ------------------------------------------------------------------


def iter_data_map(endpoint: FileEndpoint, offset: int, length: int) -> Iterator[ByteRange]:
    """Every data extent of ``[offset, offset + length)`` of ``endpoint``, asked for a page at a time.

    A file with millions of extents comes in bounded pages
    (:data:`~pdiffcopy.core.datamap.MAX_DATA_MAP_EXTENTS`), one with a few in one answer.
    """
    end = offset + length
    while offset < end:
        page = endpoint.data_map(offset, end - offset)
        yield from page
        if len(page) < MAX_DATA_MAP_EXTENTS:
            return
        offset = page[-1][0] + page[-1][1]


def source_data_bytes(source: FileEndpoint, size: int) -> Optional[int]:
    """How many bytes of data the source has, or None when it has no hole (all of it is data).

    One pass over its data map (one request for a file of a few extents).
    """
    data = 0
    for start, length in iter_data_map(source, 0, size):
        if (start, length) == (0, size):
            return None
        data += length
    return data if size else None


def holes_of(endpoint: FileEndpoint, offset: int, length: int) -> Iterator[ByteRange]:
    """Every hole of ``[offset, offset + length)`` of ``endpoint``: the gaps of its data map."""
    position, end = offset, offset + length
    for start, size in iter_data_map(endpoint, offset, length):
        if start > position:
            yield position, start - position
        position = start + size
    if position < end:
        yield position, end - position


class DataWalk:
    """Whether an endpoint has data in each of a run of segments, asked in ascending order.

    Its data map is walked alongside, a page at a time and only as far as the segments
    asked about: never a list of segments nor of extents.
    """

    def __init__(self, endpoint: FileEndpoint, size: int) -> None:
        self.endpoint = endpoint
        self.size = size
        self.extents: Optional[Iterator[ByteRange]] = None
        self.current: Optional[ByteRange] = None

    def has_data(self, segment: Segment) -> bool:
        """Whether the endpoint has data in ``segment`` (after every segment asked about before it)."""
        if self.extents is None:
            self.extents = iter_data_map(self.endpoint, segment.offset, max(0, self.size - segment.offset))
            self.current = next(self.extents, None)
        while self.current is not None and self.current[0] + self.current[1] <= segment.offset:
            self.current = next(self.extents, None)
        return self.current is not None and self.current[0] < segment.offset + segment.length


def punch_holes_of(source: FileEndpoint, work: FileEndpoint, offset: int, length: int) -> int:
    """Punch every hole the source has in ``[offset, offset + length)`` into ``work``; return the bytes.

    In pages of :data:`~pdiffcopy.core.datamap.MAX_DATA_MAP_EXTENTS` holes: bounded memory
    and requests for a file of millions of extents.
    """
    punched = 0
    page: List[ByteRange] = []
    for hole in holes_of(source, offset, length):
        page.append(hole)
        if len(page) >= MAX_DATA_MAP_EXTENTS:
            punched += work.punch_ranges(page)
            page = []
    if page:
        punched += work.punch_ranges(page)
    return punched


def punch_stale_data(source: FileEndpoint, work: FileEndpoint, offset: int, length: int,
                     zeros_already: bool = True) -> int:
    """Punch ``work`` where it holds data and the source has a hole, in ``[offset, offset + length)``.

    After the delta the bytes there are zeros on both sides already (a dense copy of a sparse
    image): the target keeps its size and bytes, and ends with the source's holes. Only where
    ``work`` is allocated: its own holes are not punched again; and never by writing zeros where
    its file system cannot punch: it stops there. Returns the bytes punched.

    :param zeros_already: False before a whole-file copy in place, where the old bytes there
                          are anything: where the file system cannot punch, zeros are written.
    """
    punched = 0
    page: List[ByteRange] = []
    end = offset + length
    for start, size in overlaps(holes_of(source, offset, length), iter_data_map(work, offset, length)):
        stop = start + size
        if zeros_already:
            # Whole blocks only (but at the end, which the file system rounds itself): punching part
            # of a block writes zeros over zeros, and every later sync would do it again.
            stop = stop if stop == end else stop // PUNCH_ALIGNMENT * PUNCH_ALIGNMENT
            start = -(-start // PUNCH_ALIGNMENT) * PUNCH_ALIGNMENT
            if stop <= start:
                continue
        page.append((start, stop - start))
        if len(page) >= MAX_DATA_MAP_EXTENTS:
            done = work.punch_ranges(page, write_zeros=not zeros_already)
            punched += done
            if done < sum(length for _, length in page):
                return punched  # its file system cannot punch: the rest would not either
            page = []
    if page:
        punched += work.punch_ranges(page, write_zeros=not zeros_already)
    return punched


def move_ranges(source: FileEndpoint, work: FileEndpoint, ranges: Sequence[ByteRange],
                on_moved: Optional[Callable[[int], None]] = None, fresh: bool = False) -> int:
    """Bring ``ranges`` of ``work`` to ``source``'s bytes; return the bytes of data written.

    Only the source's data moves: its holes (:meth:`FileEndpoint.data_map`) are never read
    nor sent, but punched in ``work`` (unless ``fresh``: a new file, holes already).
    Data moves inside the kernel where ``work`` can copy from ``source`` (two local
    files), else read and written in batches of :data:`TRANSFER_REQUEST_BYTES`.

    :param on_moved: Called with byte counts as data is written, holes included (progress).
    :param fresh: ``work`` has nothing but holes in ``ranges`` (a new file, just sized).
    """
    if not ranges:
        return 0
    start, end = ranges[0][0], ranges[-1][0] + ranges[-1][1]
    ranges, holes = split_by_data(ranges, list(iter_data_map(source, start, end - start)))
    if holes:
        if not fresh:
            work.punch_ranges(holes)
        if on_moved is not None:
            on_moved(sum(length for _, length in holes))
    return move_data(source, work, ranges, on_moved)


def move_data(source: FileEndpoint, work: FileEndpoint, ranges: Sequence[ByteRange],
              on_moved: Optional[Callable[[int], None]]) -> int:
    """Copy ``ranges`` (all data in the source) of ``source`` into ``work``; return the bytes written."""
    if not ranges:
        return 0
    if work.can_copy_from(source):
        written = work.copy_ranges_from(source, ranges)
        if on_moved is not None:
            on_moved(written)
        return written
    written = 0
    for batch in batch_ranges(ranges, TRANSFER_REQUEST_BYTES):
        chunks = source.read_ranges(batch)
        written += work.write_ranges(batch, _counted(chunks, on_moved) if on_moved else chunks)
    return written


def _counted(chunks: Iterator[Chunk], on_moved: Callable[[int], None]) -> Iterator[Chunk]:
    for offset, data in chunks:
        yield offset, data
        on_moved(len(data))


# -- read back and verify --------------------------------------------------


def readback_ranges(segment: Segment, moved: Sequence[ByteRange], target_known: bool) -> List[ByteRange]:
    """What of ``segment`` the verification reads back from the target.

    :param moved: The ranges written into the segment.
    :param target_known: Whether the target's digests of this segment were
                         hashed in this run *with the verify method*. Then the
                         blocks left alone are known and only the moved ones
                         are read back; else the whole segment is.
    """
    if not target_known:
        return [(segment.offset, segment.length)] if segment.length else []
    return list(moved)


def check_blocks(source_digests: Sequence[bytes], target_digests: Sequence[bytes], location: str) -> None:
    """The verification itself: every block of the target has the source's digest.

    :raises VerificationFailed: Naming how many blocks differ.
    """
    if len(source_digests) != len(target_digests) or list(source_digests) != list(target_digests):
        differing = sum(1 for a, b in zip(source_digests, target_digests) if a != b) + \
            abs(len(source_digests) - len(target_digests))
        raise VerificationFailed(f"Verification failed: {differing} block(s) of {location} differ from "
                                 f"the source after the sync")


def check_size(work: FileEndpoint, size: int, location: str) -> None:
    """The target has exactly the source's size (the block digests cannot see a longer tail);
    a block device at least that size (it keeps its own: its tail is not the sync's)."""
    info = work.stat()
    if info is None or not (info.size == size or (info.kind == "device" and info.size > size)):
        raise VerificationFailed(
            f"Verification failed: {location} has "
            f"{'no file' if info is None else f'{info.size} bytes'}, expected {size}")


def source_unchanged(source: FileEndpoint, size: int, mtime_ns: int, etag: Optional[str] = None) -> bool:
    """Whether the source still has the size and time it had when the sync began (or was listed),
    and the entity tag ``etag`` if given (a block device's, which its writes change)."""
    after = source.stat()
    return (after is not None and (after.size, after.mtime_ns) == (size, mtime_ns)
            and (etag is None or after.etag == etag))


# -- the steps of one file, run by a file job or a tree's worker ----------


class SegmentSteps:
    """The sync steps of one file, offered once: hash, compare, refine, move, read back, verify.

    A file job (:mod:`pdiffcopy.engine.filejob`) drives them segment by segment on
    futures (transfers of one segment while later ones are hashed); a tree's worker
    runs one segment start to end (:meth:`run_segment`); the content-defined delta
    verifies with :meth:`verify_all`. Thread-safe where a file job's transfer threads
    call it (:meth:`move`, :meth:`refine_and_move`): the counters are locked.

    :param work: What the sync writes into (the target or its temporary); None while
                 only the source is hashed.
    :param piece_size: Refine changed blocks into pieces of this size (0: off; off too
                       when a side cannot hash pieces cheaply).
    :param on_hashed: Called with byte counts as hashing finishes (progress), or None.
    :param on_moved: Called with byte counts as data is written (progress), or None.
    :param source_has_holes: False when the source is known to be all data: neither a move
                             nor its hashing then asks for its data map again.
    """

    def __init__(self, source: FileEndpoint, work: Optional[FileEndpoint], plan: BlockPlan, method: str,
                 location: str, piece_size: int = 0, on_hashed: Optional[Callable[[int], None]] = None,
                 on_moved: Optional[Callable[[int], None]] = None, source_has_holes: bool = True) -> None:
        self.source = source
        self.work = work
        self.plan = plan
        self.method = method
        self.strong = verify_method(method)
        self.location = location
        cheap = source.hashes_pieces_cheaply() and (work is None or work.hashes_pieces_cheaply())
        self.piece_size = piece_size if cheap else 0
        self.on_hashed = on_hashed
        self.on_moved = on_moved
        self.source_has_holes = source_has_holes
        #: Bytes of data written so far, and refinement so far (for the whole file).
        self.bytes_moved = 0
        self.refined = RefineTally()
        self.lock = threading.Lock()

    # -- hash ---------------------------------------------------------------

    def hash(self, endpoint: FileEndpoint, ranges: Sequence[ByteRange], method: str) -> "Future[bytes]":
        """Start hashing ``ranges`` of ``endpoint``; counted as hashed once done."""
        future = endpoint.submit_hashes(ranges, self.plan.block_size, method)
        if self.on_hashed is not None:
            future.add_done_callback(_count_hashed(self.on_hashed, sum(length for _, length in ranges)))
        return future

    def digest_stream(self, endpoint: FileEndpoint, segments: Iterable[Segment], method: str,
                      skip_holes: bool = True) -> Lookahead:
        """The digests of ``segments`` of ``endpoint`` in order, hashed a bounded window ahead
        (:class:`~pdiffcopy.engine.digeststream.Lookahead`); its first window starts now.

        :param skip_holes: A segment that is all hole needs no hashing (nor a request to a
                           server): its digests are those of zeros, one shared object. Costs
                           the endpoint's data map, walked alongside (:class:`DataWalk`).
        """
        # A source known to be all data has no hole to ask about again.
        known_dense = endpoint is self.source and not self.source_has_holes
        walk = DataWalk(endpoint, self.plan.size) if skip_holes and not known_dense else None
        zeros = ZeroDigests(self.plan.block_size, method)

        def starts() -> Iterator[Tuple[Segment, Pending]]:
            for segment in segments:
                if walk is not None and not walk.has_data(segment):
                    if self.on_hashed is not None:
                        self.on_hashed(segment.length)
                    yield segment, zeros(segment.length)
                else:
                    yield segment, self.hash(endpoint, [(segment.offset, segment.length)], method)

        return Lookahead.started(starts())

    # -- compare, refine, move ----------------------------------------------

    def changed(self, segment: Segment, source_digests: "Sequence[bytes] | bytes",
                target_digests: "Sequence[bytes] | bytes | None", digest_size: int = 0) -> List[ByteRange]:
        """The byte ranges of ``segment`` to move: its blocks whose digests differ, merged.

        :param target_digests: None when the target has no data there (every block moves).
        :param digest_size: The size of one digest when both are concatenations (a file job's).
        """
        return coalesce(self.plan, changed_blocks(segment, source_digests, target_digests, digest_size),
                        TRANSFER_REQUEST_BYTES)

    def refine(self, ranges: Sequence[ByteRange]) -> List[ByteRange]:
        """The parts of the changed ``ranges`` that really differ (:func:`refine_ranges`), judged by
        what every thread has refined so far; what the target already has counts as moved."""
        assert self.work is not None, "refinement compares with what is written into"
        if not self.piece_size or not ranges:
            return list(ranges)
        with self.lock:
            tally = records.replace(self.refined)
        before = records.replace(tally)
        pieces = refine_ranges(self.source, self.work, ranges, self.piece_size, self.method, tally)
        with self.lock:
            self.refined.add(tally.refined - before.refined, tally.moved - before.moved)
            self.refined.skipped += tally.skipped - before.skipped
        if self.on_moved is not None:
            self.on_moved(sum(length for _, length in ranges) - sum(length for _, length in pieces))
        return pieces

    def log_refinement(self, where: str) -> None:
        """Say that refining stopped paying (a dense change), once per file or segment that saw it."""
        if self.refined.skipped:
            logger.debug("Refinement into %d-byte pieces stopped paying for %s after %d of %d bytes refined "
                         "still differed (a dense change); %d bytes taken as whole blocks",
                         self.piece_size, where, self.refined.moved, self.refined.refined, self.refined.skipped)

    def move(self, ranges: Sequence[ByteRange], fresh: bool = False, all_data: bool = False) -> int:
        """Bring ``ranges`` of the work file to the source's bytes (:func:`move_ranges`); return the bytes.

        :param fresh: The work file has nothing but holes there (a new file, just sized).
        :param all_data: The ranges are all data in the source (its data map is not asked).
        """
        assert self.work is not None, "a move writes into the work file"
        if all_data or not self.source_has_holes:
            written = move_data(self.source, self.work, ranges, self.on_moved)
        else:
            written = move_ranges(self.source, self.work, ranges, self.on_moved, fresh)
        with self.lock:
            self.bytes_moved += written
        return written

    def refine_and_move(self, ranges: Sequence[ByteRange]) -> int:
        """Move only the pieces of ``ranges`` that differ (a file job's transfer thread)."""
        return self.move(self.refine(ranges))

    # -- read back and verify -----------------------------------------------

    def read_back(self, segment: Segment, ranges: Sequence[ByteRange], hole: bool = False
                  ) -> "List[Future[bytes]] | bytes":
        """Start hashing ``ranges`` of ``segment`` of the work file (:func:`readback_ranges`) with the strong method.

        :param hole: The segment is all hole in the work file: zeros, no request (done bytes).
        """
        assert self.work is not None, "what is read back is the work file"
        if hole:
            if self.on_hashed is not None:
                self.on_hashed(sum(length for _, length in ranges))
            return zero_digests(ranges, self.plan.block_size, self.strong)
        return [self.hash(self.work, batch, self.strong) for batch in batch_ranges(ranges, segment.length)]

    def final(self, segment: Segment, target_digests: Optional[Sequence[bytes]], read_back: Sequence[ByteRange],
              read_back_digests: bytes) -> List[bytes]:
        """The work file's digest of every block of ``segment`` after the move (under the strong method).

        :param target_digests: The target's digests of the segment from before the
                               move (only when hashed with the strong method), or None.
        :param read_back: The ranges read back (block-aligned but for the file's end).
        :param read_back_digests: Their digests, concatenated in order.
        :raises VerificationFailed: When the read-back digests do not cover the ranges.
        """
        digests = list(target_digests) if target_digests is not None else [b""] * segment.block_count
        bs = self.plan.block_size
        blocks = [block for offset, length in read_back for block in range(offset // bs, -(-(offset + length) // bs))]
        got = split_digests(read_back_digests, digest_size(self.strong))
        if len(got) != len(blocks) or any(not segment.first_block <= b < segment.first_block + segment.block_count
                                           for b in blocks):
            raise VerificationFailed("Verification failed: the read-back digests are incomplete")
        for block, digest in zip(blocks, got):
            digests[block - segment.first_block] = digest
        return digests

    def final_packed(self, segment: Segment, source_digests: bytes, target_digests: Optional[bytes],
                     read_back: Sequence[ByteRange], read_back_digests: bytes) -> Tuple[bytes, int]:
        """:meth:`final` with the digests concatenated (a file job's segment, compared as one ``bytes``).

        :param source_digests: The source's digests of the segment (strong): where the work
                               file's digest of a block is unknown, its place holds the
                               source's and it is counted apart.
        :returns: The work file's digests of the segment, and how many of its blocks have none.
        :raises VerificationFailed: When the read-back digests do not cover the ranges.
        """
        if not read_back:
            return (target_digests, 0) if target_digests is not None else (source_digests, segment.block_count)
        width = digest_size(self.strong)
        if _covers(read_back, segment):  # read back whole (a new file's segment): nothing to merge
            if len(read_back_digests) != segment.block_count * width:
                raise VerificationFailed("Verification failed: the read-back digests are incomplete")
            return read_back_digests, 0
        bs = self.plan.block_size
        blocks = [block for offset, length in read_back for block in range(offset // bs, -(-(offset + length) // bs))]
        if len(read_back_digests) != len(blocks) * width or any(
                not segment.first_block <= b < segment.first_block + segment.block_count for b in blocks):
            raise VerificationFailed("Verification failed: the read-back digests are incomplete")
        final = bytearray(target_digests if target_digests is not None else source_digests)
        for position, block in enumerate(blocks):
            place = (block - segment.first_block) * width
            final[place : place + width] = read_back_digests[position * width : (position + 1) * width]
        unknown = 0 if target_digests is not None else segment.block_count - len(set(blocks))
        return bytes(final), unknown

    def verify(self, source_digests: Sequence[bytes], final: Sequence[bytes]) -> str:
        """A whole file's verification: the work file has the source's size and every block its digest.

        :returns: The whole-file digest as hex: the digest of every block digest in order
                  (a one-level hash tree, :func:`~pdiffcopy.core.blocks.tree_digest_input`).
        :raises VerificationFailed: When the size or a block differs.
        """
        assert self.work is not None, "what is verified is the work file"
        check_size(self.work, self.plan.size, self.location)
        check_blocks(source_digests, final, self.location)
        return digest_bytes(self.strong, tree_digest_input(self.plan.size, self.plan.block_size, self.strong,
                                                           source_digests)).hex()

    def verify_all(self, ours: Optional[Lookahead] = None) -> str:
        """Hash every block of both sides again with the strong method, and verify (:meth:`verify`,
        a segment at a time).

        :param ours: The source's strong digests, if already started (:meth:`hash_source_strongly`):
                     they then overlap the writing.
        """
        assert self.work is not None, "what is verified is the work file"
        segments = self.plan.segment_sequence()
        if ours is None:
            ours = self.hash_source_strongly()
        theirs = self.digest_stream(self.work, segments, self.strong, skip_holes=False)
        verification = StreamingVerification(self.plan.size, self.plan.block_size, self.strong, self.location)
        for (_, source_digests), (_, work_digests) in zip(ours, theirs):
            verification.add(source_digests, work_digests)
        check_size(self.work, self.plan.size, self.location)
        return verification.digest()

    def hash_source_strongly(self) -> Lookahead:
        """Start hashing every segment of the source with the strong method (for :meth:`verify_all`)."""
        return self.digest_stream(self.source, self.plan.segment_sequence(), self.strong, skip_holes=False)

    # -- one segment, start to end (a tree's worker) ------------------------

    def run_segment(self, segment: Segment, compare: bool = True, punch_stale: bool = False) -> int:
        """Bring one segment of the work file to the source's bytes, verified; return the bytes moved.

        A local side hashes in this thread while a remote side's server hashes the same
        segment (:func:`hash_both`): a tree sync runs many of these at once, one per
        worker process. Refinement is judged per segment.

        :param compare: False when the work file has no data there yet (a new file):
                        every block moves and nothing of it is hashed first.
        :param punch_stale: The source may have holes: punch them where the work file still
                            has old data, equal zeros included (:func:`punch_stale_data`).
        :raises VerificationFailed: When a block of the target differs afterwards.
        """
        assert self.work is not None, "a segment is synced into the work file"
        if not segment.length:
            return 0
        whole = [(segment.offset, segment.length)]
        bs = self.plan.block_size
        theirs: Optional[List[bytes]] = None
        if compare:
            source_digests, target_digests = hash_both(self.source, whole, self.work, whole, bs, self.method)
            ours = split_digests(source_digests, digest_size(self.method))
            theirs = split_digests(target_digests, digest_size(self.method))
            ranges = self.changed(segment, ours, theirs)
            pieces = self.refine(ranges)
            self.log_refinement(f"{self.location} at offset {segment.offset}")
        else:
            ours = []
            ranges = pieces = split_ranges(whole, TRANSFER_REQUEST_BYTES)
        moved = self.move(pieces, fresh=not compare)
        if compare and punch_stale:
            punch_stale_data(self.source, self.work, segment.offset, segment.length)
        if self.strong != self.method:
            theirs = None  # hashed with a weak method: the whole segment is read back
        read_back = readback_ranges(segment, ranges, theirs is not None)
        source_strong, read_back_digests = hash_both(self.source, whole if theirs is None else [], self.work,
                                                     read_back, bs, self.strong)
        if theirs is None:
            ours = split_digests(source_strong, digest_size(self.strong))
        check_blocks(ours, self.final(segment, theirs, read_back, read_back_digests), self.location)
        return moved


def _covers(ranges: Sequence[ByteRange], segment: Segment) -> bool:
    """Whether ``ranges`` are the whole of ``segment``, in order, end to end."""
    position = segment.offset
    for offset, length in ranges:
        if offset != position:
            return False
        position += length
    return position == segment.offset + segment.length


def _count_hashed(on_hashed: Callable[[int], None], length: int) -> "Callable[[Future[bytes]], None]":
    """A done-callback that counts ``length`` bytes hashed when its future succeeded."""
    def counted(done: "Future[bytes]") -> None:
        if not done.cancelled() and done.exception() is None:
            on_hashed(length)

    return counted


def sync_segment(source: FileEndpoint, work: FileEndpoint, plan: BlockPlan, segment: Segment,
                 method: str, location: str, compare: bool = True, piece_size: int = 0,
                 punch_stale: bool = False) -> int:
    """Bring one segment of ``work`` to the source's bytes, verified; return the bytes moved
    (:meth:`SegmentSteps.run_segment`)."""
    return SegmentSteps(source, work, plan, method, location, piece_size).run_segment(segment, compare,
                                                                                     punch_stale)


__all__ = ["DataWalk", "SegmentSteps", "TRANSFER_REQUEST_BYTES", "check_blocks", "check_size", "hash_both", "holes_of",
           "iter_data_map", "move_data", "move_ranges", "punch_holes_of", "punch_stale_data", "readback_ranges",
           "refine_ranges", "source_data_bytes", "source_unchanged", "sync_segment"]

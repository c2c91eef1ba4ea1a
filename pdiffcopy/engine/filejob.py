"""The sync: bring a target to exactly a source's bytes, moving only what differs.

The pipeline, one step after another::

    block plan -> block digests of both sides (in parallel) -> changed ranges
      -> changed pieces (refined) -> transfer (ranged reads and writes) -> flush -> verify
      -> (atomic rename)

:func:`run_sync` runs it on two endpoints it is given; :func:`pdiffcopy.api.sync`
(the documented entry point, which the command line calls too) builds them
from paths and URLs.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from pdiffcopy.core.records import dataclass
from typing import TYPE_CHECKING, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import (
    BlockPlan,
    ByteRange,
    Segment,
    Similarity,
    batch_ranges,
    split_digests,
    split_ranges,
)
from pdiffcopy.core import chunks as cdc
from pdiffcopy.engine import autodelta, chunkdelta, recorded
from pdiffcopy.engine.digeststream import Lookahead, Pending, SegmentDigests, StreamingVerification, \
    collect_in_background
from pdiffcopy.engine.endpoints import FileEndpoint, FileInfo
from pdiffcopy.engine.options import FileOptions
from pdiffcopy.errors import (
    Conflict,
    FileMissing,
    NotAFile,
    StorageError,
    Unsupported,
    UsageError,
    VerificationFailed,
)
from pdiffcopy.engine.interrupts import held_back
from pdiffcopy.engine.workfile import WorkFile, open_work, prepare_work
from pdiffcopy.engine.segments import (
    TRANSFER_REQUEST_BYTES,
    DataWalk,
    SegmentSteps,
    check_size,
    iter_data_map,
    punch_stale_data,
    readback_ranges,
    source_data_bytes,
    source_unchanged,
)
from pdiffcopy.core.hashing import digest_size, verify_method

if TYPE_CHECKING:
    from concurrent.futures import Executor

logger = logging.getLogger(__name__)

#: How the error of a missing source begins (a missing target directory is told apart by it).
SOURCE_MISSING = "Source does not exist"

class Progress:
    """Counters a progress display reads; the sync only adds to them."""

    def __init__(self) -> None:
        self.hash_total = 0
        self.hashed = 0
        self.move_total = 0
        self.moved = 0
        self.phase = "starting"

    def add_hashed(self, count: int) -> None:
        self.hashed += count

    def add_moved(self, count: int) -> None:
        self.moved += count


@dataclass
class SyncResult:
    """What a sync did, or (with ``dry_run``) would do."""

    source: str
    target: str
    size: int
    block_size: int
    hash_method: str
    total_blocks: int
    changed_blocks: int
    bytes_moved: int
    similarity: float
    dry_run: bool
    verified: bool
    digest: str
    seconds: float
    #: The source's modification time, as the sync found it at its start and checked at its end.
    source_mtime_ns: Optional[int] = None
    #: For a symlink source made a symlink (``links``, the command line's ``-a``): what it points
    #: at; no data moved.
    symlink: str = ""


def run_sync(source: FileEndpoint, target: FileEndpoint, options: FileOptions,
             progress: Optional[Progress] = None, record: Optional[recorded.DigestRecord] = None) -> SyncResult:
    """Bring the endpoint ``target`` to exactly the bytes of the endpoint ``source``.

    The engine gets its endpoints ready made (:mod:`pdiffcopy.api` turns paths
    and URLs into them); it never builds one, reads a token or starts a server.

    :param record: The target's digests as the last sync left them (``--digest-file``,
                   :mod:`pdiffcopy.engine.recorded`): where it still stands for the target,
                   the target is not read but where this sync writes; it is written anew after.
    :raises PdiffcopyError: On any failure; the target is then not reported as synced.
    """
    return _SyncJob(source, target, options, progress or Progress(), record).run()


class _SyncJob:
    """One run of :func:`run_sync`: owns the pools and the counters, and closes the endpoints."""

    def __init__(self, source: FileEndpoint, target: FileEndpoint, options: FileOptions,
                 progress: Progress, record: Optional[recorded.DigestRecord] = None) -> None:
        self.options = options
        #: The digest record, how this sync uses it, and the blocks found to differ from it.
        self.record = record
        self.record_use: Optional[str] = None
        self.record_mismatch: Optional[str] = None
        self.record_differences = 0
        self.progress = progress
        self.started = time.monotonic()
        self.source = source
        self.target = target
        self.pool: Optional[Executor] = None
        local = [e for e in (self.source, self.target) if e.hashes_here()]
        if self.target.can_copy_from(self.source) and (options.whole_file or not target.exists()):
            # A whole-file copy between local files hashes in one thread beside the
            # copy: hashing releases the GIL and outruns the kernel's copy, so forked
            # processes or more threads only take CPU and disk from it (docs/benchmarks.rst).
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="hash")
        elif local:
            # Forked before any thread exists (see FileEndpoint.start_hash_pool).
            # (A remote target's existence would cost a request here: assumed.)
            cuts_likely = (options.delta != "blocks" and not options.whole_file
                           and (not target.hashes_here() or target.exists()))
            self.pool = local[0].start_hash_pool(options.concurrency, cuts_likely)
        for endpoint in local:
            endpoint.use_hash_pool(self.pool)
        for endpoint in (self.source, self.target):
            endpoint.use_cache(options.cache)
        self.transfers: Optional[ThreadPoolExecutor] = None
        #: The sync steps of this file (made once its size is known).
        self.steps: Optional[SegmentSteps] = None
        #: The ranges written, by segment index: they are read back to verify.
        self.written: Dict[int, List[ByteRange]] = {}
        #: Read-back hashing already started, by segment index (see _start_readback).
        self.readback: Dict[int, tuple] = {}
        #: Whether the whole target is a reflink clone of the source.
        self.cloned = False
        self.prepared = False
        #: What the sync writes into: the target, or its temporary sibling (:mod:`pdiffcopy.engine.workfile`).
        self.work: Optional[FileEndpoint] = None
        #: The source's bytes of data when it has holes (the work file then grows by a hole), else None.
        self.source_data: Optional[int] = None
        #: What the source was at the start (:meth:`_check_source`).
        self.source_info: Optional[FileInfo] = None

    def run(self) -> SyncResult:
        try:
            return self._run()
        except BrokenExecutor:  # a process of the hash pool was killed
            raise StorageError("A hashing process died unexpectedly; nothing was reported synced") from None
        finally:
            self._shutdown()

    def _stop_transfers(self) -> None:
        if self.transfers is not None:
            self.transfers.shutdown(wait=True, cancel_futures=True)

    def _shutdown(self) -> None:
        try:
            self._stop_transfers()
            for endpoint in (self.source, self.target, self.work):
                if endpoint is not None:
                    endpoint.close()  # the temporary too: its connections would wait for the GC
        finally:
            # Even when a close fails: no hashing thread may outlive the sync.
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)

    # -- the steps ---------------------------------------------------------

    def _run(self) -> SyncResult:
        options = self.options
        source_info = self._check_source()
        target_info = self._check_target()
        plan = BlockPlan(source_info.size, options.block_size)
        segments = plan.segment_sequence()
        self.source_data = None if options.dry_run else source_data_bytes(self.source, plan.size)
        self._choose_mode(source_info, target_info)
        # Refinement needs both ends known (a remote end may turn out to be a 1.0.1 server).
        self.steps = SegmentSteps(self.source, self.target, plan, options.hash_method, self.target.location,
                                  options.piece_size, self.progress.add_hashed, self.progress.add_moved,
                                  # (a dry run has not asked: it may still skip holes)
                                  source_has_holes=options.dry_run or self.source_data is not None)
        self._log_phase("checked source and target")
        self.progress.phase = "comparing"
        if self._choose_delta(source_info, target_info) == "chunks":
            assert target_info is not None, "only an existing target is chunked"
            result = self._run_chunked(plan, source_info, target_info)
            if result is not None:
                return result
        if options.dry_run:
            self._use_record(plan)
            similarity, _, _ = self._compare(plan, segments, self.target if target_info else None,
                                             transfer_to=None)
            return self._result(plan, similarity, verified=False, digest="")
        # A missing target is always written under a temporary name: nothing
        # half-written ever appears under the target's name.
        atomic = options.atomic or target_info is None
        self._sweep_temporaries()
        clone = target_info is not None and not options.whole_file
        # In place, the lease is taken before the target is hashed: from here to the end
        # nobody else writes it, so the digests of the blocks we leave alone stay true and
        # the read-back of the ones we write completes the check. A new partial file written
        # whole (not a clone to update) on a server, which stops unleased writers, is leased
        # only before it is read back (below): a lease outlives a killed client by a minute,
        # and the next run would wait for it.
        late = atomic and options.partial and not clone and self.target.leases_stop_other_writers()
        workfile: Optional[WorkFile] = None
        try:
            # Held back until the temporary is ours to remove: a Ctrl-C in between left it behind.
            with held_back():
                workfile = open_work(self.target, in_place=not atomic, partial=options.partial, clone=clone,
                                     lease_partial_now=not late)
            work, resumed = workfile.endpoint, workfile.resumed
            self.work = self.steps.work = work
            if options.sparse:
                work.write_sparse(True)
            self._use_record(plan)  # (after the lease: nobody else claims the target from here on)
            self.transfers = ThreadPoolExecutor(options.concurrency, thread_name_prefix="transfer")
            if options.whole_file or (target_info is None and not resumed):
                source_digests = self._copy_everything(plan, segments, work)
                target_digests = None
                similarity = Similarity(plan.block_count, plan.block_count, plan.size, plan.size)
            else:
                # An existing target, or the partial file an interrupted run
                # left: hash both, move what differs.
                similarity, source_digests, target_digests = self._compare(
                    plan, segments, work, transfer_to=work)
                self._punch_stale_data(work, plan.size)
                # What was sent after refinement, as the chunked delta counts it: one meaning.
                similarity = Similarity(similarity.total_blocks, similarity.changed_blocks, similarity.total_bytes,
                                        min(similarity.changed_bytes, self.steps.bytes_moved))
            self._log_phase("transferred %d bytes", self.steps.bytes_moved)
            # Before the read-back: from here on nobody else writes it unseen. A run
            # that resumed it meanwhile holds the lease and this one fails (Locked).
            workfile.take_late_lease()
            self.progress.phase = "verifying"
            # Read back while the data is flushed: hashing and the disk overlap.
            readback = self._start_readback(segments, work, target_digests is not None)
            work.flush()
            self._log_phase("flushed")
            try:
                digest = self._verify(segments, source_digests, target_digests, readback)
            except VerificationFailed:
                # A source that changed under us is the likelier cause: say so.
                self._check_source_unchanged(source_info)
                raise
            self._log_phase("verified")
            self._check_source_unchanged(source_info)
            workfile.finish()
            self._save_record(plan, source_digests)
        except BaseException:
            # Stop every transfer first: one still running could write into
            # (or re-create) the temporary file after its removal.
            self._stop_transfers()
            if workfile is None:
                raise
            # A partial file is kept for the next run, whatever stopped this one (Ctrl-C,
            # a lost connection, a full disk): it resumes from what is there.
            workfile.give_up()
            if workfile.endpoint is self.target and self.prepared:
                logger.warning("%s was being updated in place and may now be partly synchronised; "
                               "run again to finish%s", self.target.location,
                               " with --verify-whole (its digest record no longer says what it holds)"
                               if self.record is not None else
                               "" if target_info is not None and target_info.kind == "device" else " (or use --atomic)")
            raise
        return self._result(plan, similarity, verified=True, digest=digest)

    def _choose_mode(self, source_info: FileInfo, target_info: Optional[FileInfo]) -> None:
        """Tell the target the mode of a copy it makes: an existing target keeps its own, a new
        one gets the source's less the umask, never more (rsync's rule without ``-p``)."""
        if target_info is not None:
            if target_info.mode is not None:
                self.target.use_mode(target_info.mode, new=False)
        elif source_info.mode is not None:
            self.target.use_mode(source_info.mode, new=True)

    def _choose_delta(self, source_info: FileInfo, target_info: Optional[FileInfo]) -> str:
        """The delta this file gets ("blocks" or "chunks"), said in one line with -v."""
        options = self.options
        if target_info is None or not target_info.size:
            choice = autodelta.Choice("blocks", "no old target to find data in")
        elif target_info.kind == "device":
            choice = autodelta.Choice("blocks", "a block device is updated in place")
        elif options.whole_file:
            choice = autodelta.Choice("blocks", "--whole-file copies everything")
        elif options.delta != "auto":
            choice = autodelta.Choice(options.delta, f"--delta {options.delta}")
        else:
            choice = autodelta.choose(self.source, self.target, source_info.size, target_info.size,
                                      options.hash_method)
        logger.debug("%s: %s delta (%s)", self.target.location, choice.delta, choice.reason)
        return choice.delta

    def _run_chunked(self, plan: BlockPlan, source_info: FileInfo, target_info: FileInfo
                     ) -> Optional[SyncResult]:
        """The shift-tolerant delta (:mod:`pdiffcopy.engine.chunkdelta`) into a new temporary.

        :returns: None when a side cannot do it (an older server): the blocks then do.
        """
        short = None if self.options.dry_run else self._short_of_room(plan)
        early = None if self.options.dry_run or short else self._start_early_copies(plan, target_info)
        try:
            steps = chunkdelta.plan_delta(self.source, self.target, source_info.size, target_info.size, early)
        except Unsupported as error:
            self._drop_early_copies(early)
            logger.warning("%s; comparing fixed blocks instead", error)
            return None
        except BaseException:
            self._drop_early_copies(early)
            raise
        if early is None and not self.target.can_copy_within(self.target):
            logger.warning("Cannot copy within %s; comparing fixed blocks instead", self.target.location)
            return None
        to_send = cdc.bytes_to_send(steps)
        self._log_phase("planned: %d bytes to send, %d steps, %d bytes copied while planning", to_send,
                        len(steps), sum(copy.length for copy in early.started) if early is not None else 0)
        # The blocks the sends touch: what --stats and the similarity index count as changed.
        changed = len({block for step in steps if isinstance(step, cdc.Send)
                       for block in range(step.source_offset // plan.block_size,
                                          -(-(step.source_offset + step.length) // plan.block_size))})
        similarity = Similarity(plan.block_count, changed, plan.size, to_send)
        if self.options.dry_run:
            return self._result(plan, similarity, verified=False, digest="")
        self.progress.hash_total = 2 * plan.size  # the verification hashes both sides once
        if steps == [cdc.Copy(0, 0, plan.size)] and target_info.size == plan.size:
            # Every chunk where it was: nothing to write if the strong digests agree (and
            # nothing was copied early: no copy moved data).
            self.progress.phase = "verifying"
            try:
                digest = chunkdelta.verify(self.source, self.target, plan.size, plan.block_size,
                                        verify_method(self.options.hash_method), self.target.location,
                                        self.progress.add_hashed)
            except VerificationFailed:
                pass  # a chunk digest matched where the bytes differ: build it after all
            except BaseException:
                self._drop_early_copies(early)
                raise
            else:
                self._drop_early_copies(early)
                self._check_source_unchanged(source_info)
                return self._result(plan, similarity, verified=True, digest=digest)
        if short:
            # In place, the block delta needs no room beyond the target's own.
            logger.warning("Not enough free space beside %s for a new copy (%d bytes needed, %d free); "
                           "comparing fixed blocks instead", self.target.location, *short)
            return None
        if early is None:
            work = self._new_chunked_work(plan)
        else:
            work = early.work
        try:
            self.progress.move_total = to_send
            if self.transfers is None:
                self.transfers = ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="transfer")
            verification = chunkdelta.Verification(self.source, plan.size, plan.block_size,
                                                   verify_method(self.options.hash_method), self.target.location,
                                                   self.progress.add_hashed)
            try:
                self.steps.bytes_moved = chunkdelta.build(self.source, self.target, work, steps, self.transfers,
                                                          self.progress.add_moved, early)
            except BaseException:
                verification.cancel()
                raise
            self._log_phase("built: %d bytes sent", self.steps.bytes_moved)
            self.progress.phase = "verifying"
            # The new version is read back from the page cache while the disk writes it: the
            # fsync and the read-back each wait on something else (docs/design.rst).
            flushing = self.transfers.submit(work.flush)
            try:
                digest = verification.check(work)
            except VerificationFailed:
                self._check_source_unchanged(source_info)
                raise
            finally:
                flush_error = flushing.exception()  # waits: nothing may touch the file while it flushes
            if flush_error is not None:
                raise flush_error
            self._log_phase("verified")
            self._check_source_unchanged(source_info)
            work.replace(self.target)
        except BaseException:
            self._stop_transfers()
            work.remove_temporary()
            raise
        return self._result(plan, similarity, verified=True, digest=digest)

    def _new_chunked_work(self, plan: BlockPlan) -> FileEndpoint:
        """The new, empty temporary the chunked delta builds, sized to the source."""
        self._sweep_temporaries()
        workfile: Optional[WorkFile] = None
        try:
            with held_back():  # (as in _run)
                workfile = open_work(self.target, in_place=False)
            work = self.work = workfile.endpoint
            workfile.prepare(plan.size, self.source_data, self.options.sparse)
        except BaseException:
            if workfile is not None:
                workfile.give_up()
            self.work = None
            raise
        self.prepared = True
        return work

    def _start_early_copies(self, plan: BlockPlan, target_info: FileInfo) -> Optional[chunkdelta.EarlyCopies]:
        """The temporary made before planning, so that copies start while both sides cut.

        None where copies are impossible there: it then plans first and says why after, as
        without early copies. (The caller checked the room: :meth:`_short_of_room`.)
        """
        if not self.target.can_copy_within(self.target):
            return None
        work = self._new_chunked_work(plan)
        try:
            self.transfers = ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="transfer")
            return chunkdelta.EarlyCopies(self.target, work, self.transfers, target_info.size == plan.size)
        except BaseException:
            self._stop_transfers()
            self.transfers = None
            self._remove_chunked_work(work)
            raise

    def _short_of_room(self, plan: BlockPlan) -> Optional[Tuple[int, int]]:
        """(bytes needed, bytes free) when the target's side cannot hold a new copy; None when it can or cannot say."""
        needed = plan.size if self.source_data is None else self.source_data
        free = self.target.free_space()
        return (needed, free) if free is not None and free < needed else None

    def _remove_chunked_work(self, work: FileEndpoint) -> None:
        """Remove the chunked delta's temporary (nothing may write into it any more)."""
        try:
            work.remove_temporary()
        finally:
            work.close()  # its connections too: the blocks make another work file
        self.work = None
        self.prepared = False

    def _drop_early_copies(self, early: Optional[chunkdelta.EarlyCopies]) -> None:
        """Stop the early copies and remove their temporary (the blocks take over, or nothing is written)."""
        if early is None:
            return
        early.cancel()
        self._stop_transfers()  # no copy may still write into the temporary once it is gone
        self.transfers = None
        self._remove_chunked_work(early.work)

    def _sweep_temporaries(self) -> None:
        """Remove the stale temporaries that killed runs left beside the target, and say how many."""
        swept = self.target.sweep_temporaries()
        if swept:
            logger.info("Removed %d stale temporary file(s) left beside %s by interrupted runs",
                        swept, self.target.location)

    def _log_phase(self, message: str, *args) -> None:
        logger.debug("%.3f s: " + message, time.monotonic() - self.started, *args)

    def _check_source(self) -> FileInfo:
        info = self.source.stat()
        if info is None:
            raise FileMissing(f"{SOURCE_MISSING}: {self.source.location}")
        if info.kind not in ("file", "device"):
            raise NotAFile(f"Source is not a regular file or a block device: {self.source.location}")
        self.source.check_readable()
        self.source.pin(info)
        self.source_info = info
        return info

    def _check_target(self) -> Optional[FileInfo]:
        info = self.target.stat()
        if info is not None and info.kind not in ("file", "device"):
            raise NotAFile(f"Target is not a regular file or a block device: {self.target.location}")
        if info is not None and self.target.is_same_file(self.source):
                raise UsageError(f"Source and target are the same file: {self.source.location}")
        if info is not None and info.kind == "device":
            self._check_device_target(info)
        return info

    def _check_device_target(self, info: FileInfo) -> None:
        """A device is written in place and keeps its size: refuse what would need otherwise,
        before anything is written (docs/design.rst, "Block devices")."""
        assert self.source_info is not None, "the source is checked first"
        where = self.target.location
        for wanted, option in ((self.options.atomic, "--atomic"), (self.options.partial, "--partial")):
            if wanted:
                raise UsageError(f"{option} cannot be used with {where}: a block device is updated in place, "
                                 f"never replaced")
        size = self.source_info.size
        if info.size < size:
            raise UsageError(f"{where} is smaller than the source ({info.size} bytes, the source has {size}); "
                             f"nothing was written")
        if info.size > size:
            logger.warning("%s is larger than the source (%d bytes, the source has %d): its last %d bytes "
                           "are left as they were", where, info.size, size, info.size - size)

    def _compare(self, plan: BlockPlan, segments: List[Segment], target: Optional[FileEndpoint],
                 transfer_to: Optional[FileEndpoint]):
        """Hash both sides, find the changed blocks and (unless dry-run) transfer them.

        Transfers of a segment start as soon as both of its digest lists are
        in, while later segments are still being hashed.
        """
        method = self.options.hash_method
        size = digest_size(method)
        self.progress.hash_total = plan.size * (2 if target is not None else 1)
        steps = self.steps
        trusting = self.record_use == recorded.TRUST and target is not None
        if trusting:
            source_stream, target_stream = self._recorded_streams(plan, segments)
        else:
            # Both sides' first windows start at once: they hash in parallel.
            source_stream = steps.digest_stream(self.source, segments, method)
            target_stream = iter(steps.digest_stream(target, segments, method)) if target is not None else None
        checking = self.record is not None and self.record_use == recorded.REBUILD and target is not None \
            and self.record.exists() and self.record_mismatch is None
        # Kept until the verification, as runs (a run of holes is one entry); a trusted record's
        # digests stay in it, read again by segment to verify.
        source_digests = SegmentDigests()
        target_digests = SegmentDigests()
        changed_count = changed_bytes = 0
        pending: List[Future] = []
        for segment, ours in source_stream:
            theirs = next(target_stream)[1] if target_stream is not None else None
            source_digests.append(ours)
            if theirs is not None and not trusting:
                target_digests.append(theirs)
            if checking and theirs is not None:
                self.record_differences += recorded.count_differences(self.record, segment,
                                                                      split_digests(theirs, size))
            if segment.index == len(segments) - 1:
                self._log_phase("hashed both sides")
            ranges = steps.changed(segment, ours, theirs, size)
            changed_count += sum(-(-(offset % plan.block_size + length) // plan.block_size)
                                 for offset, length in ranges)
            changed_bytes += sum(length for _, length in ranges)
            if transfer_to is not None and ranges:
                self.progress.move_total = changed_bytes
                self.written[segment.index] = ranges
                self._prepare_once(transfer_to, plan.size)
                # Refined in a transfer thread: the piece hashes of this segment
                # wait there, while later segments are compared and moved.
                pending.extend(self.transfers.submit(steps.refine_and_move, batch)
                               for batch in batch_ranges(ranges, TRANSFER_REQUEST_BYTES))
            self._raise_failures(pending)
        if transfer_to is not None:
            self._prepare_once(transfer_to, plan.size)  # the size may differ with no block to move
        self._wait(pending)
        steps.log_refinement(self.source.location)
        similarity = Similarity(plan.block_count, changed_count, plan.size, changed_bytes)
        if trusting:
            assert self.record is not None, "trusted"
            return similarity, source_digests, recorded.RecordedSegments(self.record, segments)
        return similarity, source_digests, (target_digests if target is not None else None)

    def _use_record(self, plan: BlockPlan) -> None:
        """Decide how the digest record serves this sync (:func:`~pdiffcopy.engine.recorded.choose_use`):
        trusted, its target is read only where written; refined there only from a source across a network."""
        if self.record is None:
            return
        self.record_use, self.record_mismatch = recorded.choose_use(
            self.record, plan.size, plan.block_size, self.options.hash_method, self.options.verify_whole,
            self.options.dry_run)
        if self.record_use == recorded.TRUST and self.source.hashes_here():
            self.steps.piece_size = 0
        logger.debug("%s: digest record %s %s", self.target.location, self.record.location,
                     "trusted" if self.record_use == recorded.TRUST else "rebuilt from the whole target")

    def _recorded_streams(self, plan: BlockPlan, segments: Sequence[Segment]):
        """Both sides' digests by segment from a trusted record (:func:`~pdiffcopy.engine.recorded.trusted_streams`)."""
        assert self.record is not None, "only a trusted record serves digests"
        source_stream, target_stream, self.progress.hash_total = recorded.trusted_streams(
            self.record, self.steps, plan, segments, self.options.hash_method)
        self._log_phase("%d bytes of the source to hash", self.progress.hash_total)
        return source_stream, target_stream

    def _save_record(self, plan: BlockPlan, digests: Iterable[bytes]) -> None:
        """Write the digest record anew, for the target as the sync left it; say what a check found."""
        if self.record is None:
            return
        self.record.save(plan.size, plan.block_size, self.options.hash_method, digests)
        recorded.tell_what_the_check_found(self.record, self.target.location, self.record_differences,
                                           self.record_mismatch)

    def _prepare_once(self, work: FileEndpoint, size: int) -> None:
        """Resize the target just before its first change, not earlier.

        Until then a failure (an unreadable source, a server going away)
        leaves the target exactly as it was.
        """
        if not self.prepared:
            prepare_work(work, size, self.source_data, self.options.sparse)
            self.prepared = True

    def _copy_everything(self, plan: BlockPlan, segments: Sequence[Segment],
                         work: FileEndpoint) -> SegmentDigests:
        """Whole-file mode: copy every byte while the source is hashed for verification.

        Between local files the kernel copies (:mod:`pdiffcopy.local.fastcopy`);
        otherwise the transfer threads move the file in 16 MiB ranges.
        """
        method = verify_method(self.options.hash_method)
        self.progress.hash_total = 2 * plan.size
        self.progress.move_total = plan.size
        both_local = work.can_copy_from(self.source)
        if both_local and work.cache_mode(self.options.cache, plan.size) == "drop":
            # The verification's reads must not fill the cache the copy keeps clean.
            self.source.keep_out_of_cache()
            work.keep_out_of_cache()
        # Collected beside the copy: the source's hashing window keeps moving while it runs.
        source_digests = collect_in_background(self.steps.digest_stream(self.source, segments, method))
        if both_local and self.source_data is None and not self.options.sparse:
            early = work.cache_mode(self.options.cache, plan.size) == "keep"
            used = work.copy_all_from(
                self.source, plan.size, self.options.cache, progress=self.progress.add_moved,
                on_step=self._read_back_early(segments, work) if early else None)
            logger.debug("Copied %s with %s", self.source.location, used)
            # A clone shares the source's extents: reading them back through the
            # target would read the very blocks the source's digests come from.
            self.cloned = used == "reflink"
            work.prepare(plan.size)  # cuts an in-place target that was longer
            self.steps.bytes_moved = plan.size
        else:
            prepare_work(work, plan.size, self.source_data, self.options.sparse)
            self._wait(self._copy_data(plan.size, work))
        # (Nothing noted as written: without the target's digests every segment is read back whole.)
        return source_digests.result()

    def _copy_data(self, size: int, work: FileEndpoint) -> List[Future]:
        """Start moving the source's data extents into ``work``; punch its holes there unless ``work`` is new.

        The source's map comes a page at a time, its holes are never read; a new file (a
        temporary just sized) is holes already.
        """
        pending: List[Future] = []
        if work is self.target:
            # In place over old data: the source's holes become holes (or zeros) here too.
            self._punch_stale_data(work, size, zeros_already=False)
        page: List[ByteRange] = []
        data = 0
        for extent in iter_data_map(self.source, 0, size):
            data += extent[1]
            page.extend(split_ranges([extent], TRANSFER_REQUEST_BYTES))
            if len(page) >= 1024:
                pending += self._submit_data(page)
                page = []
        pending += self._submit_data(page)
        self.progress.add_moved(size - data)  # the holes: nothing to move, done
        return pending

    def _punch_stale_data(self, work: FileEndpoint, size: int, zeros_already: bool = True) -> None:
        """Punch the source's holes where ``work`` still holds (old) data, equal zeros included
        (:func:`~pdiffcopy.engine.segments.punch_stale_data`)."""
        if self.source_data is not None:
            punched = punch_stale_data(self.source, work, 0, size, zeros_already)
            self._log_phase("punched %d bytes of old data at the source's holes", punched)

    def _submit_data(self, pieces: List[ByteRange]) -> List[Future]:
        assert self.transfers is not None, "transfers start after the pool does"
        return [self.transfers.submit(self.steps.move, batch, all_data=True)
                for batch in batch_ranges(pieces, TRANSFER_REQUEST_BYTES)]

    def _read_back_early(self, segments: Sequence[Segment], work: FileEndpoint):
        """A step callback for the copy that starts hashing each segment of the target once copied.

        The read-back then runs while the next segments are copied, instead of
        all of it after the copy. It reads the page cache, as the read-back
        after the copy did with the cache kept. A clone is not read back.
        """
        method = verify_method(self.options.hash_method)
        pending = iter(segments)
        segment = next(pending, None)

        def copied(position: int, how: str) -> None:
            nonlocal segment
            if how == "reflink":
                return
            while segment is not None and segment.offset + segment.length <= position:
                ranges = [(segment.offset, segment.length)]
                self.progress.hash_total += segment.length
                self.readback[segment.index] = (ranges, [self.steps.hash(work, ranges, method)])
                segment = next(pending, None)

        return copied

    @staticmethod
    def _raise_failures(pending: List[Future]) -> None:
        for future in pending:
            error = future.exception() if future.done() else None
            if error is not None:
                raise error

    @staticmethod
    def _wait(pending: List[Future]) -> None:
        for future in pending:
            future.result()

    def _start_readback(self, segments: Sequence[Segment], work: FileEndpoint, target_hashed: bool) -> Lookahead:
        """Start hashing what the verification cannot take as known: the blocks written.

        Every other block's digest was computed in this run from the target
        as it is now. With a block hash too weak to verify with, or no
        earlier digests, whole segments are hashed again with a strong hash.
        A bounded window ahead of the verification (its first one starts now); a segment
        that is all hole in the work file is not read (its digests are those of zeros).

        :returns: Every segment's read-back digests, in order (empty where nothing is read back).
        """
        known = target_hashed and self.steps.strong == self.options.hash_method
        walk = DataWalk(work, self.steps.plan.size)

        def starts() -> Iterator[Tuple[Segment, Pending]]:
            for segment in segments:
                if self.cloned:
                    yield segment, b""
                    continue
                early = self.readback.pop(segment.index, None)
                if early is not None:  # started during the copy
                    yield segment, early[1]
                    continue
                ranges = readback_ranges(segment, self.written.get(segment.index, []), known)
                if not ranges:
                    yield segment, b""
                    continue
                self.progress.hash_total += sum(length for _, length in ranges)
                yield segment, self.steps.read_back(segment, ranges, not walk.has_data(segment))

        return Lookahead.started(starts())

    def _verify(self, segments: Sequence[Segment], source_digests: SegmentDigests,
                target_digests: Optional[SegmentDigests], readback: Lookahead) -> str:
        """Check every block of the work file against the source's digest (:meth:`SegmentSteps.verify`),
        a segment at a time: the whole-file digest is folded as they come."""
        steps = self.steps
        plan = steps.plan
        if steps.strong != self.options.hash_method and not self.options.whole_file:
            sources: "Iterator[bytes]" = (digests for _, digests in steps.digest_stream(self.source, segments,
                                                                                         steps.strong))
        else:
            sources = iter(source_digests)
        known = target_digests is not None and steps.strong == self.options.hash_method
        targets = iter(target_digests) if known and target_digests is not None else None
        written = self.written
        verification = StreamingVerification(plan.size, plan.block_size, steps.strong, steps.location)
        for (segment, read_back_digests), ours in zip(readback, sources):
            theirs = next(targets) if targets is not None else None
            if self.cloned:  # the clone shares the source's extents: its digests are the source's
                verification.add(ours, ours)
                continue
            ranges = readback_ranges(segment, written.get(segment.index, []), known)
            final, unknown = steps.final_packed(segment, ours, theirs, ranges, read_back_digests)
            verification.add(ours, final, unknown)
        assert self.work is not None, "what is verified is the work file"
        check_size(self.work, plan.size, steps.location)
        return verification.digest()

    def _check_source_unchanged(self, before: FileInfo) -> None:
        # A device's mtime never changes: its identity carries its write counters.
        etag = before.etag if before.kind == "device" else None
        if not source_unchanged(self.source, before.size, before.mtime_ns, etag):
            raise Conflict(f"Source changed during the sync: {self.source.location}; run again")

    def _result(self, plan: BlockPlan, similarity: Similarity, verified: bool, digest: str
                ) -> SyncResult:
        return SyncResult(
            source=self.source.location, target=self.target.location, size=plan.size,
            block_size=plan.block_size, hash_method=self.options.hash_method,
            total_blocks=plan.block_count, changed_blocks=similarity.changed_blocks,
            bytes_moved=self.steps.bytes_moved if not self.options.dry_run else similarity.changed_bytes,
            similarity=similarity.index, dry_run=self.options.dry_run, verified=verified,
            digest=digest, seconds=time.monotonic() - self.started,
            source_mtime_ns=self.source_info.mtime_ns if self.source_info is not None else None)


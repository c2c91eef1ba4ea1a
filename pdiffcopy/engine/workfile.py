"""The work file: what a sync writes a target's new version into, from its choice to its end.

One of three, chosen once per file by :func:`open_work`:

* **in place**: the target itself, under its write lease, so that nobody else
  writes it until every block is checked (the blocks left alone keep the digests
  this run hashed);
* **a temporary**: a new file beside the target, empty or a clone of it, renamed
  over the target once verified; nothing half-written ever has the target's name;
* **a partial file** (``--partial``): a temporary with a name of its own that a
  failure keeps, leased, for the next run to resume from.

A single file (:mod:`pdiffcopy.engine.filejob`), a tree's big files
(:mod:`pdiffcopy.engine.treerunner`, :mod:`pdiffcopy.engine.treeunits`) and the
chunked delta prepare it (:meth:`WorkFile.prepare`: its size, by a hole where the
source is sparse), end it (:meth:`WorkFile.finish`: end the lease, or rename) and
give it up (:meth:`WorkFile.give_up`: keep a partial file, remove a temporary, end
a lease quietly) here and nowhere else. :mod:`pdiffcopy.engine.segments` only
moves data into it.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Tuple

from pdiffcopy.core.records import dataclass
from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.engine.interrupts import let_through
from pdiffcopy.errors import Locked, PdiffcopyError, Unsupported

logger = logging.getLogger(__name__)

#: Seconds a --partial sync waits for the lease on the partial file it resumes: a server's
#: lease outlives a killed client by a minute (pdiffcopy.server.leasetable.LEASE_SECONDS), and
#: the run that resumes right after the kill must not fail for it. A local file's lock
#: ends with its process, so locally only a run still going is waited for.
PARTIAL_LEASE_WAIT_SECONDS = 65

#: How often that wait tries again.
PARTIAL_LEASE_POLL_SECONDS = 1.0


@dataclass
class WorkFile:
    """The file a sync writes ``target``'s new version into (see the module's description)."""

    target: FileEndpoint
    endpoint: FileEndpoint
    #: A new file renamed over the target at the end (else the target itself, in place).
    temporary: bool
    #: A ``--partial`` file: kept when the sync fails.
    partial: bool = False
    #: What a killed run left (a partial file): compared, not copied again.
    resumed: bool = False
    #: Whether its lease is held (a partial file written whole takes it late: :meth:`take_late_lease`).
    leased: bool = True

    def prepare(self, size: int, data_bytes: Optional[int], sparse: bool) -> None:
        """Size it (by a hole where the source is sparse); with ``sparse`` (``-S``), zeros become holes."""
        if sparse:
            self.endpoint.write_sparse(True)
        prepare_work(self.endpoint, size, data_bytes, sparse)

    def take_late_lease(self) -> None:
        """Before the read-back: from here on nobody else writes it unseen (a partial file's late lease)."""
        if self.partial and not self.leased:
            lease_partial(self.endpoint, False, self.target.location)
            self.leased = True

    def finish(self) -> None:
        """Once verified: a temporary replaces the target; a target written in place ends its lease.

        Ending a lease fails if it lapsed and somebody else wrote meanwhile.
        """
        if self.temporary:
            if self.partial:
                self.endpoint.end_lease()
            self.endpoint.replace(self.target)
        else:
            self.target.end_lease()

    def give_up(self, location: Optional[str] = None, announce: bool = True) -> None:
        """After a failure: a partial file is kept for the next run, a temporary removed, and a
        target updated in place has its lease ended."""
        give_up(self.endpoint, location or self.target.location, self.partial, self.temporary, announce)


def open_work(target: FileEndpoint, *, in_place: bool, partial: bool = False, clone: bool = False,
              lease_partial_now: bool = True) -> WorkFile:
    """Choose and open the work file of ``target``.

    :param in_place: Write the target itself, under its lease (taken here).
    :param partial: ``--partial``: a partial file, resumed if a killed run left one.
    :param clone: A new file starts as a clone of the target (a delta), else empty.
    :param lease_partial_now: Lease a new partial file at once (else :meth:`WorkFile.take_late_lease`).
    """
    if in_place:
        with let_through():  # nothing made yet: an interrupted request needs no cleaning up
            target.take_lease()
        return WorkFile(target, target, temporary=False)
    if partial:
        work, resumed, is_partial = open_partial(target, clone, lease=lease_partial_now)
        return WorkFile(target, work, temporary=True, partial=is_partial, resumed=resumed,
                        leased=resumed or lease_partial_now)
    return WorkFile(target, target.create_temporary(clone=clone), temporary=True)


def open_partial(target: FileEndpoint, clone: bool, lease: bool = True) -> "Tuple[FileEndpoint, bool, bool]":
    """The file a ``--partial`` sync writes ``target`` into; whether a killed run left it; whether it is one.

    The partial file (:meth:`FileEndpoint.open_partial`) comes leased when it
    was left (it is hashed next: another run resuming it would make those
    digests a lie) or when ``lease``. Where the target cannot keep one (a 1.0
    server), a temporary as without ``--partial``: then the third value is False.
    """
    try:
        partial, resumed = target.open_partial(clone)
    except Unsupported:
        logger.info("%s cannot keep a partial file; writing a temporary one", target.location)
        return target.create_temporary(clone=clone), False, False
    try:
        if resumed or lease:
            with let_through():  # may wait a minute for a killed run's lease; kept when interrupted
                lease_partial(partial, resumed, target.location)
    except BaseException:
        partial.close()  # kept: it is the other run's, or the next one's
        raise
    if resumed:
        logger.info("Resuming from the partial file an interrupted run left for %s", target.location)
    return partial, resumed, True


def lease_partial(partial: FileEndpoint, resumed: bool, location: str) -> None:
    """Take a partial file's lease; for one a killed run left, wait for that run's lease to lapse."""
    deadline = time.monotonic() + PARTIAL_LEASE_WAIT_SECONDS
    waiting = False
    while True:
        try:
            partial.take_lease()
            return
        except Locked:
            if not resumed or time.monotonic() >= deadline:
                raise
        if not waiting:
            logger.warning("The partial file of %s is leased by another run, or one that was killed; "
                           "waiting up to %d s for its lease to lapse", location, PARTIAL_LEASE_WAIT_SECONDS)
            waiting = True
        time.sleep(PARTIAL_LEASE_POLL_SECONDS)


def keep_partial(partial: FileEndpoint, location: str, announce: bool = True) -> None:
    """After a failure: leave a partial file for the next run (its lease ended), and say so (``announce``)."""
    end_lease_quietly(partial)
    if announce:
        logger.warning("Kept the partial file of %s; run again with --partial (-P) to resume", location)


def end_lease_quietly(endpoint: FileEndpoint) -> None:
    """End a lease while already failing: an unended one lapses by itself."""
    try:
        endpoint.end_lease()
    except PdiffcopyError:
        pass


def give_up(work: FileEndpoint, location: str, partial: bool, temporary: bool, announce: bool = True) -> None:
    """After a failure, what a sync wrote into: a partial file is kept for the next run, a
    temporary removed, and a target updated in place has its lease ended."""
    if partial:
        keep_partial(work, location, announce)
    elif temporary:
        work.remove_temporary()
    else:
        end_lease_quietly(work)


def prepare_work(work: FileEndpoint, size: int, data_bytes: Optional[int], zeros_to_holes: bool = False) -> None:
    """Size the work file; by a hole when the source is sparse (``data_bytes`` of data will be written).

    :param zeros_to_holes: ``--sparse``: the zeros written become holes, so a dense source's
                           growth is not reserved either (a reserved block that a write only
                           partly covers would stay allocated); all of it is checked.
    """
    if data_bytes is None and zeros_to_holes:
        data_bytes = size
    if data_bytes is None:
        work.prepare(size)
    else:
        work.prepare_sparse(size, data_bytes)


__all__ = ["PARTIAL_LEASE_POLL_SECONDS", "PARTIAL_LEASE_WAIT_SECONDS", "WorkFile", "end_lease_quietly", "give_up",
           "keep_partial", "lease_partial", "open_partial", "open_work", "prepare_work"]

"""A ``[USER@]HOST:PATH`` side: the server started on HOST over ssh, and the local file hashing meanwhile.

:func:`reached_over_ssh` replaces the ``HOST:PATH`` with the URL of a pdiffcopy server
that ssh starts on HOST (:mod:`pdiffcopy.transport.sshlaunch`, the system's OpenSSH
client: the user's ``~/.ssh/config``, agents and ProxyJump hold). While ssh logs in, the
local side's blocks are already hashing (:func:`prehash_local_files`): the login's second
is not lost. :func:`pdiffcopy.api.sync`, :func:`pdiffcopy.api.sync_tree` and the command
line all come through here.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

from pdiffcopy.core.locations import is_url
from pdiffcopy.errors import PdiffcopyError, UsageError

if TYPE_CHECKING:
    from pdiffcopy.engine.endpoints import FileEndpoint
    from pdiffcopy.engine.options import FileOptions


#: Files smaller than this are not hashed while ssh logs in: their hash takes milliseconds.
PREHASH_MIN_BYTES = 16 * 1024 * 1024

#: Segments hashed at most while ssh logs in: the login takes about a second, and a file of
#: terabytes must not get hundreds of thousands of requests queued.
PREHASH_SEGMENTS = 64


def prehash_local_files(source, target, options: "FileOptions",
                        close_in_workers: "Sequence[int]" = ()) -> "Dict[str, FileEndpoint]":
    """The local files among ``source`` and ``target`` (a sync over ssh), each already hashing
    (:func:`prehashed_file`), by location; the caller hands them to the sync or closes them."""
    prehashed = {}
    for location, is_target in ((source, False), (target, True)):
        if isinstance(location, str) and not over_ssh(location) and not is_url(location):
            endpoint = prehashed_file(location, options, is_target, close_in_workers)
            if endpoint is not None:
                prehashed[location] = endpoint
    return prehashed


def prehashed_file(path: str, options: "FileOptions", is_target: bool,
                   close_in_workers: "Sequence[int]" = ()) -> "Optional[FileEndpoint]":
    """The local file of a sync over ssh, already hashing its blocks while ssh logs in; None where it cannot pay.

    The sync's first request for those digests gets them (:mod:`pdiffcopy.local.prehash`).
    Not for a file smaller than :data:`PREHASH_MIN_BYTES`, nor when the sync will not hash
    its blocks in place: ``--whole-file``, ``--delta chunks``, or a target written into a
    new temporary (``--atomic``, ``--partial``). The caller hands the endpoint to :func:`sync`
    (which then owns it) or closes it.

    :param close_in_workers: Descriptors its hashing processes close (``SshSession.ssh_descriptors``).
    """
    import os
    import stat

    if options.whole_file or options.delta == "chunks" or (is_target and (options.atomic or options.partial)):
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None  # (the sync says what is wrong with it)
    if not stat.S_ISREG(info.st_mode) or info.st_size < PREHASH_MIN_BYTES:
        return None
    import itertools

    from pdiffcopy.core.blocks import BlockPlan
    from pdiffcopy.engine.segments import DataWalk
    from pdiffcopy.local.localfile import LocalFile

    endpoint = LocalFile(path)
    # The first segments with data, as the sync will ask for them: it hashes a bounded window
    # ahead and never asks for a segment that is all hole, so more would only be held.
    walk = DataWalk(endpoint, info.st_size)
    ranges = [(segment.offset, segment.length) for segment in itertools.islice(
        (segment for segment in BlockPlan(info.st_size, options.block_size).segment_sequence()
         if walk.has_data(segment)), PREHASH_SEGMENTS)]
    if not ranges:  # all hole: the sync asks for nothing but its data map (the first segment stands in)
        ranges = [(0, BlockPlan(info.st_size, options.block_size).segment(0).length)]
    if not endpoint.start_prehash(ranges, options.block_size, options.hash_method, options.concurrency,
                                  close_in_workers):
        return None
    return endpoint


def over_ssh(location) -> bool:
    """Whether ``location`` is a ``[USER@]HOST:PATH`` (a string in rsync's remote form)."""
    from pdiffcopy.core.sshform import parse_ssh_location

    return isinstance(location, str) and parse_ssh_location(location) is not None


@contextlib.contextmanager
def reached_over_ssh(source, target, *, rsh: Optional[str] = None, remote_pdiffcopy: Optional[str] = None,
                     timeout: Optional[float] = None, wait: bool = True, **session_options):
    """``(source, target, session)`` with a ``HOST:PATH`` replaced by the URL of a server started on HOST.

    The server (:mod:`pdiffcopy.transport.sshlaunch`) lives until the ``with`` block ends;
    ``session.token`` is its token, ``session.shown`` names its URL as the ``HOST:PATH``.
    An error in the block is told in the ``HOST:PATH``'s terms.

    :param wait: After the block succeeded, wait for the remote server to stop (the command
                 line does not: only the remote clean-up is left, and ssh ends on its own).
    :param session_options: For :class:`~pdiffcopy.transport.sshlaunch.SshSession`
                            (``verbose``, ``while_waiting``, ``direct``, ``direct_port``).

    :raises UsageError: When both sides are remote.
    """
    from pdiffcopy.core.sshform import parse_ssh_location
    from pdiffcopy.transport.sshlaunch import SshSession

    locations = [source, target]
    remote = [(index, parse_ssh_location(location)) for index, location in enumerate(locations)
              if isinstance(location, str)]
    remote = [(index, location) for index, location in remote if location is not None]
    if len(remote) != 1 or any(isinstance(location, str) and is_url(location) for location in locations):
        raise UsageError("SOURCE and TARGET cannot both be remote; one must be a local path")
    index, location = remote[0]
    session = SshSession(location, rsh=rsh, remote_program=remote_pdiffcopy, timeout=timeout, **session_options)
    session.start()
    try:
        locations[index] = session.url
        try:
            yield locations[0], locations[1], session
        except PdiffcopyError as error:
            error.args = (session.shown_message(str(error)),)
            raise
    except BaseException:
        wait = True  # after a failure, ssh's last words are worth waiting for
        raise
    finally:
        session.close(wait=wait)


@contextlib.contextmanager
def reached_over_ssh_together(locations: "List[str]", **ssh_options):
    """:func:`reached_over_ssh` for several SOURCEs and one TARGET (the last location): yields
    ``(locations, session)``, each ``HOST:PATH`` replaced by its URL on one server (``session``
    is None when none is remote).

    :raises UsageError: When the ``HOST:PATH`` arguments name several hosts, or both sides are remote.
    """
    from pdiffcopy.core.sshform import parse_ssh_location

    parsed = [parse_ssh_location(location) for location in locations]
    remote = [index for index, location in enumerate(parsed) if location is not None]
    if not remote:
        yield list(locations), None
        return
    hosts = sorted({parsed[index].destination for index in remote})
    if len(hosts) > 1:
        raise UsageError(f"The HOST:PATH arguments name {len(hosts)} hosts ({', '.join(hosts)}); "
                         f"all must be on one host, reached over one ssh session")
    first = remote[0]
    local = next((index for index, location in enumerate(parsed) if location is None), len(locations) - 1)
    if first == len(locations) - 1 and len(remote) > 1 or \
            (first != len(locations) - 1 and parsed[-1] is not None):
        raise UsageError("SOURCE and TARGET cannot both be remote; one must be a local path")
    pair = (locations[first], locations[local]) if first < local else (locations[local], locations[first])
    with reached_over_ssh(*pair, **ssh_options) as (_, _, session):
        yield [session.url_of(location) if location is not None else given
               for location, given in zip(parsed, locations)], session


@contextlib.contextmanager
def reached_with_local_hashing(source, target, options: "Optional[FileOptions]", *, hash_target: bool = True,
                               while_waiting=None, **ssh_options):
    """:func:`reached_over_ssh`, the local file hashing its blocks while ssh logs in (:func:`prehash_local_files`).

    Yields ``(source, target, session, prehashed)``: ``prehashed`` holds the hashing endpoints by
    location; the sync takes (pops) the one it syncs, and those left are closed when the block ends.

    :param options: The sync's options (None: nothing hashed ahead, the options are wrong or it
                    does not hash in place: the sync says why).
    :param hash_target: False where the target is not read (a digest record describes it).
    :param while_waiting: Also called with the session while ssh logs in.
    """
    prehashed: "Dict[str, FileEndpoint]" = {}

    def meanwhile(session) -> None:
        if options is not None:
            prehashed.update(prehash_local_files(source, target if hash_target else None, options,
                                                 session.ssh_descriptors()))
        if while_waiting is not None:
            while_waiting(session)

    try:
        with reached_over_ssh(source, target, while_waiting=meanwhile, **ssh_options) as (source, target, session):
            yield source, target, session, prehashed
    finally:
        for endpoint in prehashed.values():  # (not taken: the sync failed to start, or another side)
            endpoint.close()


__all__ = ["PREHASH_MIN_BYTES", "over_ssh", "prehash_local_files", "prehashed_file", "reached_over_ssh",
           "reached_over_ssh_together", "reached_with_local_hashing"]

"""Several SOURCEs into one TARGET directory, as rsync takes them: ``pdiffcopy a dir1 dir2/ dest/``.

Each SOURCE is synced in turn into TARGET by the sync of one SOURCE, with
rsync's rules: a file lands as TARGET/NAME, a directory as TARGET/NAME, and a
directory with a trailing slash merges its contents into TARGET. TARGET must
be a directory, made when missing (its parents with ``--mkpath``). With
``--delete``, what a merged directory deletes at TARGET's top leaves alone the
names the other SOURCEs bring, as rsync deletes only what none of them has.
One ssh session serves every ``HOST:PATH`` of the command line.
"""

from __future__ import annotations

import argparse
import logging
from typing import Callable, List, Optional

from pdiffcopy.core.filters import glob_escape
from pdiffcopy.core.locations import last_name
from pdiffcopy.errors import PartialTransfer, PdiffcopyError, UsageError

#: rsync's status for "some files were not transferred".
PARTIAL_STATUS = PartialTransfer.exit_code

logger = logging.getLogger("pdiffcopy")

#: The options that describe one sync's SOURCE and so take only one.
_ONE_SOURCE_OPTIONS = (("json", "--json"), ("benchmark", "-B/--benchmark"), ("digest_file", "--digest-file"),
                       ("changed_since", "--changed-since"), ("verify_whole", "--verify-whole"))


def run_several(args: argparse.Namespace, sources: List[str], target: str, token: Optional[str],
                sync_one: Callable[..., int]) -> int:
    """Sync each of ``sources`` into the directory ``target``; the exit status.

    :param sync_one: The sync of one SOURCE: ``sync_one(args, source, target, token, shown)``.
    :returns: 0; when some SOURCEs failed (each said in one error line) and others were
              synced, rsync's 23; when all failed, the first one's status.
    """
    for name, option in _ONE_SOURCE_OPTIONS:
        if getattr(args, name, None):
            raise UsageError(f"{option} takes one SOURCE, not {len(sources)}")
    merged = [source for source in sources if source.endswith("/")]
    if args.delete and len(merged) > 1:
        raise UsageError(f"--delete with {len(merged)} SOURCE/ merged into one TARGET: each would delete what "
                         f"the others bring; name them without the trailing slash, or sync them apart")
    from pdiffcopy import api

    with api.reached_over_ssh_together([*sources, target], rsh=args.rsh, remote_pdiffcopy=args.remote_pdiffcopy,
                                       timeout=args.timeout, wait=False, direct=args.direct,
                                       direct_port=args.direct_port) as (locations, session):
        *reached, target = locations
        shown = session.shown if session is not None else (lambda location: location)
        token = session.token if session is not None else token
        if session is not None and session.ca_file:
            args.ca_file = session.ca_file
        if not (args.dry_run or args.diff):
            api.make_directory(target, parents=args.mkpath, token=token, timeout=args.timeout,
                               ca_file=args.ca_file)
        named = [last_name(source) for source in sources if not source.endswith("/")]
        rules = list(args.rules or [])
        errors: List[PdiffcopyError] = []
        for given, source in zip(sources, reached):
            kept = [("-", "/" + glob_escape(name)) for name in named] if args.delete and given.endswith("/") else []
            args.rules = kept + rules
            try:
                sync_one(args, source, target.rstrip("/") + "/", token, shown)
            except UsageError:
                raise
            except PdiffcopyError as error:
                message = session.shown_message(str(error)) if session is not None else str(error)
                logger.error("%s", message)
                errors.append(error)
        args.rules = rules
    if not errors:
        return 0
    if len(errors) == len(sources):
        return errors[0].exit_code
    logger.error("%d of %d SOURCEs could not be synced; the others were", len(errors), len(sources))
    return PARTIAL_STATUS


__all__ = ["run_several"]

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
import os
from typing import Callable, Dict, List, Optional, Tuple
from urllib.parse import unquote_to_bytes, urlsplit

from pdiffcopy.core.filters import glob_escape, normalise_listed
from pdiffcopy.core.locations import is_url, last_name, looks_remote
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
    named = [last_name(source) for source in sources if not source.endswith("/")]
    rules = list(args.rules or [])
    # A merged SOURCE/'s --delete leaves alone the names the others bring to TARGET's top.
    kept = [("-", "/" + glob_escape(name)) for name in named]
    return _sync_each(args, [(source, kept + rules if args.delete and source.endswith("/") else rules, None)
                             for source in sources], target, token, sync_one)


def run_relative(args: argparse.Namespace, sources: List[str], target: str, token: Optional[str],
                 sync_one: Callable[..., int]) -> int:
    """-R/--relative: each SOURCE's path kept below ``target`` (from its ``/./`` marker, else whole),
    the directories on its way made as the source has them; the exit status, as :func:`run_several`'s.

    The SOURCEs that start from one directory are one sync of it, with their paths as its --files-from.
    """
    for name, option in _ONE_SOURCE_OPTIONS:
        if getattr(args, name, None):
            raise UsageError(f"{option} does not go with -R/--relative")
    bases: Dict[str, List[str]] = {}
    for source in sources:
        base, path = split_relative(source)
        bases.setdefault(base, []).append(path)
    rules = list(args.rules or [])
    return _sync_each(args, [(base, rules, paths) for base, paths in bases.items()], target, token, sync_one)


def split_relative(location: str) -> Tuple[str, str]:
    """A -R SOURCE as (the directory its kept path starts from, with a slash; that path).

    ``a/./b/c`` keeps ``b/c`` from ``a/``; without the marker the whole path is kept, from
    ``.`` (a relative path), ``/``, a URL's server root or a ``HOST:PATH``'s host.
    """
    head, marker, tail = location.partition("/./")
    if marker:
        base, path = head + "/", tail
    elif is_url(location):
        parts = urlsplit(location)
        base, path = f"{parts.scheme}://{parts.netloc}/", parts.path
    elif looks_remote(location):
        host, _, path = location.partition(":")
        base = f"{host}:/" if path.startswith("/") else f"{host}:"
    else:
        base, path = ("/" if location.startswith("/") else "./"), location
    if is_url(base):
        path = os.fsdecode(unquote_to_bytes(path))
    path = normalise_listed(path)
    if not path:
        raise UsageError(f"-R/--relative: {location} names no path to keep")
    return base, path


def _sync_each(args: argparse.Namespace, jobs: List[Tuple[str, list, Optional[List[str]]]], target: str,
               token: Optional[str], sync_one: Callable[..., int]) -> int:
    """Run ``sync_one`` for each (SOURCE, its glob rules, its --files-from or None) into ``target``."""
    from pdiffcopy import api

    sources = [source for source, _, _ in jobs]
    with api.reached_over_ssh_together([*sources, target], rsh=args.rsh, remote_pdiffcopy=args.remote_pdiffcopy,
                                       timeout=args.timeout, wait=False, direct=args.direct,
                                       direct_port=args.direct_port) as (locations, session):
        *reached, target = locations
        shown = session.shown if session is not None else (lambda location: location)
        token = session.token if session is not None else token
        if session is not None and session.ca_file:
            args.ca_file = session.ca_file
        with api.LocationProbes(token=token, timeout=args.timeout, ca_file=args.ca_file) as probes:
            anything = any(probes.kind(source) is not None for source in reached)
        if anything and not (args.dry_run or args.diff):  # (none there: each says so, TARGET not made)
            api.make_directory(target, parents=args.mkpath, token=token, timeout=args.timeout,
                               ca_file=args.ca_file)
        rules, files_from = args.rules, args.files_from
        errors: List[PdiffcopyError] = []
        for (_, job_rules, job_files), source in zip(jobs, reached):
            args.rules = job_rules
            args.files_from = files_from if job_files is None else job_files
            try:
                sync_one(args, source, target.rstrip("/") + "/", token, shown)
            except UsageError:
                raise
            except PdiffcopyError as error:
                message = session.shown_message(str(error)) if session is not None else str(error)
                logger.error("%s", message)
                errors.append(error)
        args.rules, args.files_from = rules, files_from
    if not errors:
        return 0
    if len(errors) == len(sources):
        return errors[0].exit_code
    logger.error("%d of %d SOURCEs could not be synced; the others were", len(errors), len(sources))
    return PARTIAL_STATUS


__all__ = ["run_relative", "run_several", "split_relative"]

"""The ``pdiffcopy`` command: running what :mod:`pdiffcopy.cli.options` parsed, logging and error reporting.

Every :class:`~pdiffcopy.errors.PdiffcopyError` ends the program with one
line on stderr and a non-zero exit status; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import time
from typing import List, Optional, Tuple

from pdiffcopy._version import __version__
from pdiffcopy.core.sshform import SERVE_OPTION
from pdiffcopy.core.locations import is_url
from pdiffcopy.cli.logs import DEBUG_VERBOSITY, setup_logging
from pdiffcopy.cli.options import build_parser
from pdiffcopy.cli.reports import print_stats, show_progress, wants_stats
from pdiffcopy.errors import PdiffcopyError, UsageError

logger = logging.getLogger("pdiffcopy")


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; return its status (with ``argv`` None: raise SystemExit with it)."""
    status, _ = _run_command(argv)
    if argv is None:
        sys.exit(status)
    return status


def console_main() -> None:
    """The console script: run with this process's arguments, then end the process with the status.

    After a sync or a removal the process ends without the interpreter's teardown
    (:func:`_exit_without_teardown`); a server's teardown is left as it was.
    """
    status, synced = _run_command(None)
    if synced:
        _exit_without_teardown(status)
    sys.exit(status)


def _run_command(argv: Optional[List[str]]) -> Tuple[int, bool]:
    """Run the command line: (its exit status, whether it was a sync or a removal)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.partial_progress:  # -P: rsync's --partial --progress
        args.partial = args.progress = True
    args.events = None
    if args.paths and not (args.remove or args.benchmark) and (args.json or args.metrics_file):
        from pdiffcopy.cli.events import Events

        args.events = Events(sys.stdout if args.json else None)
    # --json: the human lines off (the summary is an event), the warnings and errors kept.
    setup_logging(args.verbose - args.quiet, summary=not (args.json and args.paths),
                  json_lines=args.log_format == "json" and not args.paths)
    error_line = ""
    try:
        status = run(parser, args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except PdiffcopyError as error:
        logger.error("%s", error)
        status, error_line = error.exit_code, str(error)
    except KeyboardInterrupt as interrupt:
        status = _report_interrupt(interrupt)
        error_line = "interrupted"
    except Exception as error:
        behind = _interrupt_behind(error)
        if behind is not None:
            # The interrupt landed inside a lock's bookkeeping (a signal
            # handler raises between any two bytecodes), and the unwinding
            # tripped over the half-released lock: still an interruption.
            logger.debug("Interrupted, then %s while unwinding", type(error).__name__, exc_info=True)
            status = _report_interrupt(behind)
        elif _output_closed_behind(error):
            status = _end_quietly_after_closed_output()
        else:  # a bug: still one line, the details with -v
            logger.debug("Unexpected error", exc_info=True)
            logger.error("Unexpected error: %s: %s (run with -vv for details)", type(error).__name__, error)
            status, error_line = 1, f"Unexpected error: {type(error).__name__}: {error}"
    if args.events is not None:
        status = _end_events(args, status, error_line)
    return status, bool(args.paths)


def _end_events(args: argparse.Namespace, status: int, error_line: str) -> int:
    """The last event (``--json``) and the metrics file: the status, or 1 when the file cannot be written."""
    events = args.events
    if status == 0:
        events.finished()
    else:
        events.failed(status, error_line or f"exit status {status}")
    if args.metrics_file:
        try:
            events.write_metrics(args.metrics_file, status)
        except OSError as error:
            logger.error("Cannot write the metrics file %s: %s", args.metrics_file, error.strerror or error)
            return status or 1
    return status


def _exit_without_teardown(status: int) -> None:
    """End the process as Python would, less the teardown that frees every module and object one
    by one (8 ms of a 60 ms no-change sync): atexit's functions run, the standard streams are flushed.

    Not while another thread runs (Python's exit would wait for it), nor when a flush fails (a closed
    pipe: Python's own exit reports it); then this returns and the caller exits as usual.
    """
    import atexit
    import threading

    run_exit_functions = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_functions is None or threading.active_count() > 1:
        return
    run_exit_functions()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        return
    os._exit(status if isinstance(status, int) else 1)


#: Exit status after Ctrl-C or a clean-up signal: rsync's ("received SIGINT, SIGTERM, or SIGHUP").
INTERRUPTED_STATUS = 20


def _report_interrupt(interrupt: KeyboardInterrupt) -> int:
    how = f" by {signal.Signals(interrupt.signum).name}" if isinstance(interrupt, Terminated) else ""
    logger.error("Interrupted%s", how)
    return INTERRUPTED_STATUS


#: Exit status when standard output is closed under the command (``| head``): rsync's
#: "errors with program diagnostics", what it exits with when it cannot write its output.
CLOSED_OUTPUT_STATUS = 13


def _output_closed_behind(error: BaseException) -> bool:
    """Whether ``error`` is (or was raised while handling) a write into a standard output nobody reads."""
    seen = set()
    cause: Optional[BaseException] = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, BrokenPipeError):
            return _stdout_reader_gone()
        seen.add(id(cause))
        cause = cause.__context__
    return False


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe or socket whose other end closed (a broken pipe of a
    connection is not: that is the sync's own failure)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.__stdout__.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, ValueError, OSError):
        return False


def _end_quietly_after_closed_output() -> int:
    """Stop as other Unix tools do when their reader leaves: no message; what is still buffered
    for standard output goes to /dev/null, so that no flush at exit complains either."""
    logger.debug("Standard output was closed: stopped")
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)
    except (AttributeError, ValueError, OSError):
        pass
    return CLOSED_OUTPUT_STATUS


def _interrupt_behind(error: BaseException) -> Optional[KeyboardInterrupt]:
    """The Ctrl-C or clean-up signal during whose handling ``error`` was raised, if any."""
    seen = set()
    cause: Optional[BaseException] = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__context__
    return None


#: Signals that end a client run the way Ctrl-C does: SIGTERM (kill, systemd,
#: a job scheduler) and SIGHUP (the terminal or ssh session went away).
CLEAN_UP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """A clean-up signal arrived: unwind (removing temporaries) as after Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, frame) -> None:
    raise Terminated(signum)


def handle_termination() -> None:
    """Make :data:`CLEAN_UP_SIGNALS` raise :class:`Terminated` in the main thread (client runs only)."""
    for signum in CLEAN_UP_SIGNALS:
        signal.signal(signum, _terminate)


def read_token(token_file: Optional[str] = None) -> Optional[str]:
    """The shared secret from ``token_file`` or ``$PDIFFCOPY_TOKEN`` (None if neither).

    Only the command line reads them: the library and the server take the
    token they are given.

    :raises UsageError: When the file cannot be read or is empty.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as error:
            raise UsageError(f"Cannot read token file {token_file}: {error.strerror}") from None
        if not token:
            raise UsageError(f"Token file {token_file} is empty")
        return token
    from pdiffcopy.core.protocol import TOKEN_VARIABLE

    return os.environ.get(TOKEN_VARIABLE) or None


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Dispatch to the server, the benchmark or a sync."""
    if args.serve_over_ssh:
        if args.paths:
            raise UsageError(f"{SERVE_OPTION} takes no SOURCE and TARGET")
        require_extra(("flask", "gunicorn", "prometheus_client"), "server", "Serving over ssh")
        from pdiffcopy.server.sshserve import serve_over_ssh

        # Its stderr is the client's: request lines only with the client's -vv (which sends -v),
        # warnings unless the client is quiet (which sends -q).
        level = logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.WARNING
        logging.getLogger().setLevel(level)
        serve_over_ssh(workers=args.concurrency, log_level=logging.getLevelName(level).lower(),
                       direct_port=args.serve_direct, device=args.serve_device)
        return 0
    token = read_token(args.token_file)
    if not args.paths:
        if args.remove:
            raise UsageError("--remove needs the PATHs to remove")
        refuse_sync_options(parser, args)
        require_extra(("flask", "gunicorn", "prometheus_client"), "server", "The server")
        from pdiffcopy.server.service import DEFAULT_LISTEN, ServerOptions, run_server

        if args.config:
            refuse_beside_config(args, token)
        run_server(ServerOptions(listen=args.listen or DEFAULT_LISTEN, root=args.root or ".", token=token,
                                 config=args.config,
                                 insecure=args.insecure, workers=args.concurrency,
                                 trust_clients=args.trust_clients,
                                 write_hard_links=args.write_hard_links,
                                 legacy_api=args.legacy_api,
                                 certfile=args.certfile, keyfile=args.keyfile, client_ca=args.client_ca,
                                 hash_methods=args.hash_methods, metrics_listen=args.metrics_listen,
                                 max_rate=args.max_rate, devices=args.device,
                                 log_level=logging.getLevelName(logger.getEffectiveLevel()).lower()))
        return 0
    if args.listen:
        if set(args.listen) <= set("rlptgoDvnzHAXSxcuPhq"):  # rsync's bundle of flags: -rlptgoD
            raise UsageError(f"-l is --listen here (as in pdiffcopy 1.0.1), so -l{args.listen} names an "
                             f"address; rsync's -l is --links: write -a, or the flags with --links apart")
        raise UsageError("--listen is a server option; it makes no sense with SOURCE and TARGET")
    if args.group and not (args.owner or args.archive):
        raise UsageError("-g keeps the group with the owner here: give -o (or -a), which keeps both")
    if args.hash_methods:
        raise UsageError("--hash-methods is a server option; a sync chooses its method with -m")
    if args.metrics_listen:
        raise UsageError("--metrics-listen is a server option; it makes no sense with SOURCE and TARGET")
    if args.legacy_api:
        raise UsageError("--legacy-api is a server option; it makes no sense with SOURCE and TARGET")
    if args.max_rate:
        raise UsageError("--max-rate is a server option; a sync limits its own rate with --bwlimit")
    if args.device:
        raise UsageError("--device is a server option; a sync names a device as SOURCE or TARGET")
    if args.config:
        raise UsageError("--config is a server option; it makes no sense with SOURCE and TARGET")
    if args.log_format:
        raise UsageError("--log-format is a server option; a sync's own output can be JSON with --json")
    if args.client_ca:
        raise UsageError("--client-ca is a server option; a sync sends its certificate with --client-cert")
    if args.client_key and not args.client_cert:
        raise UsageError("--client-key goes with --client-cert (the certificate it is the key of)")
    if args.client_cert:
        from pdiffcopy.api import use_client_certificate

        use_client_certificate(args.client_cert, args.client_key)
    for given, name in ((args.json, "--json"), (args.metrics_file, "--metrics-file")):
        if given and (args.remove or args.benchmark):
            raise UsageError(f"{name} reports a sync; {'--remove' if args.remove else '--benchmark'} "
                             f"prints its own lines")
    handle_termination()
    from pdiffcopy.api import raise_open_file_limit

    raise_open_file_limit()  # deep trees hold a descriptor per level
    if args.remove:
        for location in args.paths:
            refuse_rsync_remote(location)
        from pdiffcopy.cli.treecli import run_remove

        return run_remove(args, token)
    if len(args.paths) < 2:
        raise UsageError(f"Expected SOURCE and TARGET, got {len(args.paths)} argument(s); "
                         f"see pdiffcopy --help")
    *sources, target = args.paths
    source = sources[0]
    if args.itemize_changes and len(sources) > 1:
        _refuse_regex_after_i(sources[0])
    from pdiffcopy.core.sshform import parse_ssh_location

    over_ssh = any(parse_ssh_location(location) is not None for location in args.paths)
    if not over_ssh and args.rsh is not None:
        raise UsageError(_rsh_without_remote(args.rsh))
    if not over_ssh and (args.direct or args.direct_port is not None):
        raise UsageError("--direct is for a [USER@]HOST:PATH reached over ssh; a URL's server is reached directly")
    if args.direct_port is not None and not 0 < args.direct_port < 65536:
        raise UsageError(f"--direct-port {args.direct_port}: not a port (1 to 65535)")
    if args.compress_level is not None:
        if args.compress == "never" and args.compress_level:
            raise UsageError("--no-compress and --compress-level contradict each other")
        args.compress = args.compress_level or "never"  # rsync's level 0: no compression
    if args.ca_file:
        check_ca_file(args.ca_file)
    if args.benchmark:
        require_extra(("executor",), "client", "The benchmark (-B)")
    if args.relative and args.files_from is None:  # (--files-from's paths are kept as they are anyway)
        from pdiffcopy.cli.sources import run_relative

        return run_relative(args, sources, target, token, sync_locations)
    if len(sources) > 1:
        from pdiffcopy.cli.sources import run_several

        return run_several(args, sources, target, token, sync_locations)
    if not over_ssh:
        return sync_locations(args, source, target, token)
    from pdiffcopy.api import reached_with_local_hashing
    from pdiffcopy.cli.logs import NamedAsTyped

    with reached_with_local_hashing(source, target, _prehash_options(args), hash_target=not args.digest_file,
                                    while_waiting=lambda session: _import_sync_modules(), rsh=args.rsh,
                                    remote_pdiffcopy=args.remote_pdiffcopy, timeout=args.timeout, wait=False,
                                    verbose=args.verbose >= DEBUG_VERBOSITY, quiet=args.quiet > 0, direct=args.direct,
                                    direct_port=args.direct_port) as (source, target, session, prehashed), \
            NamedAsTyped(session):
        if session.ca_file:  # --direct's pinned certificate
            args.ca_file = session.ca_file
        # The remote server's own token: the user's $PDIFFCOPY_TOKEN is not for it.
        return sync_locations(args, source, target, session.token, shown=session.shown, prepared=prehashed)


def _prehash_options(args: argparse.Namespace):
    """The file sync's options, for hashing the local file while ssh logs in; None where it would not
    (:func:`pdiffcopy.api.prehash_local_files`): a benchmark, or options the sync will refuse."""
    if args.benchmark:
        return None
    from pdiffcopy.api import DEFAULT_HASH_METHOD, file_options

    try:
        return file_options(block_size=args.block_size, hash_method=args.hash_method or DEFAULT_HASH_METHOD,
                            whole_file=args.whole_file, concurrency=args.concurrency, atomic=args.atomic,
                            partial=args.partial, delta=args.delta, piece_size=args.piece_size)
    except PdiffcopyError:
        return None  # the sync says what is wrong


def _import_sync_modules() -> None:
    """Import what a remote sync runs, while ssh logs in and the remote server starts."""
    for module in ("pdiffcopy.cli.treecli", "pdiffcopy.api", "pdiffcopy.engine.filejob",
                   "pdiffcopy.transport.legacyremote", "pdiffcopy.transport.remotetree"):
        importlib.import_module(module)


def _rsh_without_remote(rsh: str) -> str:
    from pdiffcopy.api import looks_like_regex

    if looks_like_regex(rsh):
        return (f"-e {rsh}: -e is --rsh, the ssh command for a HOST:PATH, as in rsync; the regex filter "
                f"is now --exclude-regex")
    return f"-e/--rsh {rsh}: only for a HOST:PATH SOURCE or TARGET (the regex filter is --exclude-regex)"


def _refuse_regex_after_i(first: str) -> None:
    """``-i REGEX``, 1.x's include filter, is rsync's --itemize-changes since 2.0: REGEX would be a
    SOURCE, and the others synced unfiltered. A first SOURCE that looks like one, and is not there, is refused."""
    from pdiffcopy.api import looks_like_regex
    from pdiffcopy.core.locations import is_url, looks_remote

    if looks_like_regex(first) and not is_url(first) and not looks_remote(first) and not os.path.lexists(first):
        raise UsageError(f"-i is rsync's --itemize-changes since pdiffcopy 2.0, and {first!r} looks like a "
                         f"regular expression: use --include-regex {first!r} (see docs/migration.rst)")


def sync_locations(args: argparse.Namespace, source: str, target: str, token: Optional[str],
                   shown=lambda location: location, prepared: Optional[dict] = None) -> int:
    """Sync a file or a tree between two paths or a path and a URL; the exit status.

    :param shown: What a location is called in the report (``HOST:PATH`` for the forwarded URL).
    :param prepared: Endpoints already made for some locations (a local file hashing ahead):
                     the file sync takes the one it syncs; this function closes the others.
    """
    from pdiffcopy.api import LocationProbes, resolve_locations

    if args.events is not None:
        args.events.started(shown(source), shown(target), dry_run=bool(args.dry_run or args.diff))
    wire = dict(token=token, concurrency=args.concurrency, timeout=args.timeout, ca_file=args.ca_file,
                bwlimit=args.bwlimit, compress=args.compress)
    with LocationProbes(**wire) as probes:  # a URL is probed once, here: the file sync takes its endpoint
        if prepared:
            probes.endpoints.update(prepared)
            prepared.clear()
        given_target = target
        source, target, is_tree = resolve_locations(source, target, probes, delete=args.delete,
                                                    files_from=args.files_from)
        if not is_tree and target != given_target and given_target.endswith("/") \
                and probes.kind(given_target) is None and not (args.dry_run or args.diff or args.benchmark):
            from pdiffcopy.api import make_directory, parent_location

            # TARGET/ names a directory, which rsync makes (its parents with --mkpath only).
            make_directory(parent_location(target), parents=args.mkpath, token=token, timeout=args.timeout,
                           ca_file=args.ca_file)
        if is_tree:
            from pdiffcopy.cli.treecli import run_tree

            for given, name in ((args.digest_file, "--digest-file"), (args.changed_since, "--changed-since"),
                                (args.verify_whole, "--verify-whole")):
                if given:
                    raise UsageError(f"{name} is for a single file or device, and {source} is a directory")

            probes.close()
            return run_tree(source, target, args, token, shown)
        if args.alternate_dirs:
            raise UsageError(f"--{args.alternate_dirs[0][0]}-dest is for tree syncs, and {source} is a file")
        if args.backup or args.backup_dir:
            raise UsageError(f"--backup is for tree syncs, and {source} is a file")
        from pdiffcopy.api import DEFAULT_HASH_METHOD

        options = dict(block_size=args.block_size, hash_method=args.hash_method or DEFAULT_HASH_METHOD,
                       whole_file=args.whole_file, concurrency=args.concurrency, atomic=args.atomic,
                       token=token, timeout=args.timeout, ca_file=args.ca_file, cache=args.cache,
                       bwlimit=args.bwlimit, compress=args.compress, piece_size=args.piece_size,
                       partial=args.partial, delta=args.delta, sparse=args.sparse)
        recording = dict(digest_file=args.digest_file, changed_since=args.changed_since,
                         verify_whole=args.verify_whole)
        if args.benchmark:
            from pdiffcopy.cli.benchmark import run_benchmark

            probes.close()  # every round makes its own
            # rsync reaches a HOST:PATH source over the same ssh.
            typed = shown(source)
            run_benchmark(source, target, rounds=args.benchmark, rsync_source=typed if typed != source else None,
                          rsh=args.rsh, **options)
            return 0
        if args.diff:
            args.dry_run = True
        from pdiffcopy.api import wire_totals

        started, wire_before = time.monotonic(), wire_totals()
        from pdiffcopy.cli.treecli import file_metadata

        result = run_sync(probes.take(source), probes.take(target), dry_run=args.dry_run,
                          show_progress=show_progress(args), keep_last=args.progress, **options,
                          **file_metadata(args), mkpath=args.mkpath, **recording, events=args.events)
    if args.events is not None:
        _count_file(args.events, result, shown)
        if args.json:
            return 0
    report(result, shown)
    if wants_stats(args) and not result.dry_run:
        print_stats(result.bytes_moved, None, time.monotonic() - started,
                    remote=is_url(source) or is_url(target), wire_before=wire_before)
    return 0


def refuse_beside_config(args: argparse.Namespace, token: Optional[str]) -> None:
    """Refuse the shorthand's options with ``--config``, whose exports say all of that.

    A token the operator set would otherwise be silently ignored, and the exports it was
    meant to guard left to the file's tokens.
    """
    from pdiffcopy.core.protocol import TOKEN_VARIABLE

    given = [name for name, value in (("--root", args.root), ("--device", args.device),
                                      ("--trust-clients", args.trust_clients), ("--legacy-api", args.legacy_api))
             if value]
    if given:
        raise UsageError(f"{given[0]} does not go with --config: its exports name their paths, devices and "
                         f"rules (--legacy-api: 1.0.1's clients need the one --root)")
    if token:
        raise UsageError(f"--config lists each export's tokens (NAME:sha256:HEX); a token from "
                         f"{'--token-file' if args.token_file else '$' + TOKEN_VARIABLE} does not go with it")


def refuse_sync_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse options that only mean something to a sync when there is none (the server starts).

    A user who typed ``pdiffcopy -a --delete`` and forgot the paths would
    otherwise get a read-write server on the current directory.
    """
    given = ["/".join(action.option_strings) for action in getattr(parser, "sync_only", [])
             if getattr(args, action.dest) != action.default]
    if given:
        raise UsageError(f"{', '.join(given)}: only for a sync, with SOURCE and TARGET; without them "
                         f"pdiffcopy starts a server (see pdiffcopy --help)")


def refuse_rsync_remote(location: str) -> None:
    """Refuse rsync's ``HOST:PATH`` form where only local paths and URLs are taken (``--remove``).

    :raises UsageError: For ``host:path``, ``user@host:path`` or ``host::module``.
    """
    from pdiffcopy.core.locations import looks_remote

    if looks_remote(location):
        raise UsageError(f"{location}: --remove takes local paths and URLs, not HOST:PATH (for a local "
                         f"name with a colon, write ./{location})")


def check_ca_file(name: str) -> None:
    """Refuse a --ca-file that cannot be read or holds no certificate, naming it."""
    import ssl

    try:
        ssl.create_default_context(cafile=name)
    except ssl.SSLError as error:  # before OSError: it is one
        raise UsageError(f"--ca-file {name} holds no usable CA certificate: "
                         f"{error.reason or error}") from None
    except OSError as error:
        raise UsageError(f"Cannot read the --ca-file {name}: {error.strerror or error}") from None


def require_extra(modules, extra: str, what: str) -> None:
    """Say which extra to install when a module of an optional feature is missing.

    :raises PdiffcopyError: Naming the missing module and the ``pip install`` that brings it.
    """
    for module in modules:
        # Found, not imported: serve-over-ssh hands over before it loads the server's modules.
        import importlib.util

        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise PdiffcopyError(f"{what} needs {module}, which is not installed: "
                                 f"python3 -m pip install 'pdiffcopy[{extra}]=={__version__}'") from None


def run_sync(source: str, target: str, show_progress: bool, keep_last: bool = False, events=None, **options):
    """Sync with an optional progress display (``keep_last``: leave its final state on screen), or
    the progress events of ``--json`` (``events``)."""
    from pdiffcopy.api import Progress, sync

    progress = Progress()
    if events is not None and events.stream is not None:
        with events.progress(progress):
            return sync(source, target, progress=progress, **options)
    if not show_progress:
        return sync(source, target, progress=progress, **options)
    from pdiffcopy.cli.progress import ProgressDisplay

    with ProgressDisplay(progress, keep_last=keep_last):
        return sync(source, target, progress=progress, **options)


def _count_file(events, result, shown) -> None:
    """A single file's ``file`` event and counts (``--json``, ``--metrics-file``)."""
    changed = bool(result.changed_blocks or result.bytes_moved or result.symlink) and not result.dry_run
    if changed or result.dry_run:
        events.file(shown(result.target), "symlink" if result.symlink else "file", size=result.size,
                    bytes_moved=result.bytes_moved, changed_blocks=result.changed_blocks,
                    total_blocks=result.total_blocks, dry_run=result.dry_run)
    events.count(bytes_moved=result.bytes_moved, files_copied=int(changed), unchanged=int(not changed),
                 deleted=0, failures=0, changed_blocks=result.changed_blocks, total_blocks=result.total_blocks,
                 verified=result.verified)


def report(result, shown=lambda location: location) -> None:
    """Print what a sync did: the similarity for a dry run, a summary otherwise."""
    from pdiffcopy.cli.humanize import format_size, format_timespan

    moved = format_size(result.bytes_moved, binary=True)
    if result.symlink:
        if result.dry_run:
            print(f"Dry run: {shown(result.target)} would be a symlink to {result.symlink}; nothing was changed")
        else:
            logger.info("Made %s a symlink to %s", shown(result.target), result.symlink)
        return
    if result.dry_run:
        print(f"Similarity index: {result.similarity:.2f}% "
              f"({result.changed_blocks} of {result.total_blocks} blocks differ, "
              f"{moved} would be transferred)")
        return
    logger.info("Synchronised %s to %s: %s moved, %d of %d blocks differed "
                "(similarity %.2f%%), verified in %s", shown(result.source), shown(result.target), moved,
                result.changed_blocks, result.total_blocks, result.similarity,
                format_timespan(result.seconds))


if __name__ == "__main__":
    console_main()


__all__ = ["main", "console_main", "build_parser", "Terminated", "CLEAN_UP_SIGNALS"]

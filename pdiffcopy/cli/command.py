"""The ``pdiffcopy`` command: argument parsing, logging and error reporting.

Every :class:`~pdiffcopy.errors.PdiffcopyError` ends the program with one
line on stderr and a non-zero exit status; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import signal
import sys
import time
from typing import List, Optional, Tuple

from pdiffcopy._version import __version__
from pdiffcopy.core.sshform import DIRECT_OPTION, SERVE_OPTION
from pdiffcopy.core.locations import is_url
from pdiffcopy.transport import counters
from pdiffcopy.cli.logs import DEBUG_VERBOSITY, setup_logging
from pdiffcopy.cli.reports import print_stats, show_progress, wants_stats
from pdiffcopy.errors import PdiffcopyError, UsageError

logger = logging.getLogger("pdiffcopy")

USAGE = "pdiffcopy [OPTIONS] [SOURCE TARGET | --remove PATH...]"

DESCRIPTION = """\
Synchronise a large file between Linux hosts at high speed, by hashing both
copies in fixed-size blocks on many cores and moving only the blocks that
differ, over HTTP.

One of SOURCE and TARGET is a local path and the other remote: a URL of a
file on a pdiffcopy server (http://HOST:PORT/path), or rsync's [USER@]HOST:PATH,
for which ssh (or -e COMMAND) starts pdiffcopy on HOST for the length of the
sync (a relative PATH is relative to the remote home; a local name with a
colon before any slash is written ./NAME). A remote SOURCE pulls, a remote
TARGET pushes. Both may be local paths. TARGET ends up with exactly SOURCE's
bytes and size, verified with a whole-file digest on both sides.

When SOURCE is a directory, the whole tree is copied or updated, as rsync
does: SOURCE/ (with a trailing slash) syncs the contents of SOURCE into
TARGET, SOURCE without it syncs the directory itself into TARGET/NAME. Files
of the same size and modification time are skipped (--checksum compares
their contents instead), changed big files go through the block delta,
new and small ones are copied whole, by -c worker processes at once. When
SOURCE is a file and TARGET an existing directory (or TARGET/, made if
missing), the file goes into it. A single file keeps what -a, -t, -o, -X
and -A keep of a tree's files; without -a a new copy gets SOURCE's mode
less the umask, and an existing one keeps its own. TARGET's parent
directory must exist unless --mkpath makes it, as in rsync.

Without SOURCE and TARGET, the server starts: it serves the files below
--root (default: the current directory) on --listen (default 127.0.0.1:8080);
the sync and tree options are then refused, since a server ignores them.
When $PDIFFCOPY_TOKEN is set (or --token-file given), server and client
require and send it; without a token the server serves only the clients its
own user and root run on this host."""

EPILOG = """\
exit status (rsync's, where rsync has one for the same failure):
    0  success
    1  bad usage, or a failure with no status of its own
    2  protocol incompatibility: the server refused a request as malformed,
       or cannot do what was asked (1.0.1; over ssh, another version)
    3  errors selecting files: SOURCE or TARGET missing, not a file or
       directory as needed, or not accessible
    5  error starting the protocol: the token refused, the server busy,
       the server started over ssh did not hand over
   10  socket I/O: the server cannot be reached or the connection broke
       (a server: it cannot listen)
   11  file I/O: reading or writing a file failed (I/O error, disk full)
   12  data stream: the server's answer was malformed or damaged
   13  standard output closed (| head): the run stopped there, quietly
   20  interrupted by SIGINT, SIGTERM or SIGHUP
   23  partial transfer: some paths of a tree failed (the rest was synced),
       a full or read-only target stopped it, a file failed its
       verification or changed during the sync
   24  source files vanished during a tree sync (and nothing else failed)
   30  timeout: the server did not answer within --timeout
  127  no pdiffcopy on the ssh host
  255  ssh failed
examples:
  pdiffcopy --root /srv/data --listen 0.0.0.0:8080   (with PDIFFCOPY_TOKEN set)
  pdiffcopy http://storage1:8080/db/big.ibd /srv/db/big.ibd
  pdiffcopy -n /srv/db/big.ibd http://storage2:8080/db/big.ibd
  pdiffcopy -a --delete /srv/photos/ http://storage2:8080/photos/
  pdiffcopy -a --delete /srv/photos/ storage2:/srv/photos/   (over ssh)
  pdiffcopy --remove /srv/scratch/old-run"""


#: The longest --timeout accepted: a week. Longer is a hang, not a timeout,
#: and a socket timeout must fit the C types below settimeout().
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600

class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's layout, with the help starting ``Usage:`` as 1.0.1's did (scripts and its tests look for it)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: Optional[int] = None, **more) -> None:
        if width is None:  # as argparse finds it, without importing shutil (and bz2, lzma) per run
            width = _terminal_columns() - 2
        super().__init__(prog, indent_increment, max_help_position, width, **more)

    def add_usage(self, usage, actions, groups, prefix=None):
        super().add_usage(usage, actions, groups, "Usage: " if prefix is None else prefix)


def _terminal_columns() -> int:
    """shutil.get_terminal_size().columns: $COLUMNS, else standard output's terminal, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Parser(argparse.ArgumentParser):
    #: The options that only mean something to a sync (set by build_parser).
    sync_only: List[argparse.Action] = []

    def error(self, message: str):  # one line, like every other error
        sys.stderr.write(f"pdiffcopy: {message} (see pdiffcopy --help)\n")
        sys.exit(UsageError.exit_code)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; its help text is the usage documented in README.rst."""
    parser = _Parser(
        prog="pdiffcopy", usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
        formatter_class=_Formatter, add_help=False)
    parser.add_argument("paths", nargs="*", metavar="SOURCE TARGET", help=argparse.SUPPRESS)
    sync = parser.add_argument_group("sync options")
    sync.add_argument("-b", "--block-size", metavar="BYTES", default="1MiB",
                      help="block size of the delta transfer: bytes or 5K, 1MiB, 4M... "
                           "(K/M/G are 1024-based; default 1MiB)")
    sync.add_argument("--piece-size", metavar="BYTES", default=None,
                      help="hash the changed blocks again in pieces of BYTES and move only the "
                           "pieces that differ: 4K, 16K... dividing the block size, 0 off "
                           "(default 4K; off for a dense change or a new file)")
    sync.add_argument("-m", "--hash-method", metavar="NAME", default=None,
                      help="block hash: any hashlib algorithm, xxh3_64, xxh3_128, blake3... "
                           "(default xxh3_128)")
    sync.add_argument("-W", "--whole-file", action="store_true",
                      help="copy every block without comparing (still verified)")
    sync.add_argument("-c", "--concurrency", metavar="COUNT", type=_positive_int, default=None,
                      help="hashing processes, connections and tree workers (default: number "
                           "of CPUs); for the server, worker processes")
    sync.add_argument("-n", "--dry-run", action="store_true",
                      help="report the similarity index and what would move; change nothing")
    sync.add_argument("--atomic", action="store_true",
                      help="write a temporary copy and rename it over TARGET when complete")
    sync.add_argument("--partial", action="store_true",
                      help="keep what an interrupted sync wrote of a new (or --atomic) TARGET, in a hidden "
                           ".NAME.pdiffcopy-partial beside it, and resume from it: the next run with "
                           "--partial moves only what it lacks (rsync's --partial; swept after a day)")
    sync.add_argument("-S", "--sparse", action="store_true",
                      help="also turn runs of zeros (whole file system blocks) in the data written into "
                           "holes, as rsync's -S; the source's own holes stay holes without it")
    sync.add_argument("--mkpath", action="store_true",
                      help="make the missing directories of TARGET's path, as rsync's --mkpath; without "
                           "it only TARGET's own directory is made (a directory SOURCE, or TARGET/ for "
                           "a file) and its parent must exist")
    sync.add_argument("--cache", choices=("auto", "drop", "keep"), default="auto",
                      help="page cache use of whole-file copies between local files: drop "
                           "keeps big copies from flushing the cache, keep leaves it alone "
                           "(default auto: drop from the kernel's writeback threshold up)")
    sync.add_argument("-B", "--benchmark", metavar="COUNT", type=_positive_int, default=None,
                      help="mutate the local TARGET and resync it COUNT times at varying "
                           "similarity, then print an overview (next to rsync if installed)")
    sync.add_argument("--stats", action="store_true",
                      help="end with a line of figures: bytes moved, bytes on the wire (remote "
                           "syncs), elapsed time and rate (also with -v)")
    sync.add_argument("--timeout", metavar="SECONDS", type=_timeout, default=None,
                      help="how long any network call may wait, in seconds above 0 (default 60)")
    sync.add_argument("--ca-file", metavar="FILE", default=None,
                      help="CA bundle to verify an https:// server with")
    sync.add_argument("--bwlimit", metavar="RATE", type=_bwlimit, default=None,
                      help="at most RATE bytes per second on the network, both directions and all "
                           "connections together, in rsync's units: a bare number is KiB/s, K/M/G "
                           "1024-based, KB/MB/GB 1000-based, 0 no limit (e.g. 50M; from 32K). "
                           "Copies between local paths ignore it")
    sync.add_argument("-e", "--rsh", metavar="COMMAND", default=None,
                      help="the ssh command that reaches a HOST:PATH, split into words as a shell "
                           "would, as rsync's -e (default ssh; e.g. -e 'ssh -p 2222 -i KEY')")
    sync.add_argument("--remote-pdiffcopy", metavar="PATH", default=None,
                      help="the command that runs pdiffcopy on the HOST of a HOST:PATH, as rsync's "
                           "--rsync-path (default: pdiffcopy on the remote PATH, else python3 -m pdiffcopy)")
    sync.add_argument("--direct", action="store_true",
                      help="for a HOST:PATH: ssh only starts pdiffcopy on HOST; the data goes over TLS "
                           "straight to HOST's address that ssh reached, verified against a one-time "
                           "certificate whose fingerprint comes over ssh (the port must be reachable)")
    sync.add_argument("--direct-port", metavar="PORT", type=int, default=None,
                      help="the port --direct listens on at HOST (implies --direct; default: a free one)")
    squeeze = sync.add_mutually_exclusive_group()
    squeeze.add_argument("-z", "--compress", dest="compress", action="store_const", const="always",
                         default="auto",
                         help="always compress the data on the wire (zstd); by default a remote sync "
                              "compresses when the data shrinks and the link, not the CPU, is the bottleneck")
    squeeze.add_argument("--no-compress", dest="compress", action="store_const", const="never",
                         default="auto", help="never compress the data on the wire")
    sync.add_argument("--compress-level", "--zl", metavar="LEVEL", type=_compress_level, default=None,
                      help="compress the data on the wire at this zstd level, from 1 (fastest, as -z) "
                           "to 19 (densest, for slow links); 0: do not compress (rsync's option)")
    sync.add_argument("--delta", choices=("auto", "blocks", "chunks"), default="auto",
                      help="how changes are found: blocks compares fixed blocks in place (files "
                           "changed in place: disk images, databases); chunks finds bytes that moved "
                           "(data inserted or removed: archives, logs, dumps) with content-defined "
                           "chunks and writes a new copy of TARGET; auto chooses per file from a "
                           "small sample of both (-vv says which and why) (default auto)")
    tree = parser.add_argument_group("tree options (SOURCE is a directory; -a -t -o -X -A for a file too)")
    tree.add_argument("-a", "--archive", action="store_true",
                      help="keep times and owner too (-t -o); a tree keeps permissions and symlinks always, "
                           "a single file with -a (a symlink SOURCE is then made a symlink)")
    tree.add_argument("-t", "--times", action="store_true", help="keep modification times")
    tree.add_argument("-H", "--hard-links", action="store_true",
                      help="keep hard links: names sharing a file in SOURCE share one in TARGET "
                           "(as rsync -H; not implied by -a)")
    tree.add_argument("-o", "--owner", action="store_true",
                      help="keep user and group (as root; a warning otherwise)")
    tree.add_argument("-X", "--xattrs", action="store_true",
                      help="keep extended attributes (user.*; security.* and trusted.* as root); not "
                           "part of -a, as in rsync")
    tree.add_argument("-A", "--acls", action="store_true",
                      help="keep POSIX ACLs, their users and groups by name (not part of -a)")
    tree.add_argument("--numeric-ids", action="store_true",
                      help="name the users and groups of ACLs by number between hosts, not by name")
    tree.add_argument("--fsync", action="store_true",
                      help="flush every file written, and its directory, to disk before reporting "
                           "success (as rsync --fsync; a server does it per request). Single "
                           "files and big files in a tree are always flushed")
    tree.add_argument("--checksum", action="store_true",
                      help="compare files of the same size by content, not by modification time")
    tree.add_argument("--delete", action="store_true",
                      help="delete what TARGET has and SOURCE does not (never excluded paths)")
    tree.add_argument("--force", action="store_true",
                      help="let --delete empty TARGET when SOURCE has nothing to sync")
    tree.add_argument("--include", metavar="GLOB", action=_Rule, dest="rules", default=[],
                      help="rsync's glob: take paths matching GLOB even if a later rule excludes "
                           "them (repeatable; rules apply in order, the first match wins)")
    tree.add_argument("--exclude", metavar="GLOB", action=_Rule, dest="rules", default=[],
                      help="rsync's glob: leave out paths matching GLOB (a leading / anchors it to "
                           "the tree, a trailing / matches directories, ** crosses /; repeatable)")
    tree.add_argument("--exclude-from", metavar="FILE", action=_Rule, dest="rules", default=[],
                      help="read --exclude globs from FILE, one a line ('+ GLOB' includes; "
                           "'#' and ';' comments; - reads stdin)")
    tree.add_argument("--files-from", metavar="FILE", action=_FilesFrom, default=None,
                      help="sync only the paths listed in FILE (relative to SOURCE, one a line, "
                           "with what is below them; - reads stdin)")
    tree.add_argument("-i", "--include-regex", metavar="REGEX", dest="include", action="append", default=[],
                      help="only sync paths (relative to the tree) matching REGEX (repeatable)")
    tree.add_argument("--exclude-regex", metavar="REGEX", dest="exclude", action="append", default=[],
                      help="leave out paths matching REGEX, and directories' contents (repeatable)")
    tree.add_argument("--diff", action="store_true",
                      help="list the differences between the trees, item by item; change nothing")
    tree.add_argument("--remove", action="store_true",
                      help="delete the trees (or files) given as arguments, in parallel: files "
                           "first, then directories deepest first; the filters and -n apply")
    # What the client runs on the HOST of a HOST:PATH (pdiffcopy.server.sshserve).
    parser.add_argument(SERVE_OPTION, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(DIRECT_OPTION, metavar="PORT", type=int, default=None, help=argparse.SUPPRESS)
    server = parser.add_argument_group("server options")
    server.add_argument("-l", "--listen", metavar="ADDRESS", default=None,
                        help="PORT, HOST:PORT or [IPv6]:PORT to listen on (default 127.0.0.1:8080)")
    server.add_argument("--root", metavar="DIR", default=".",
                        help="directory the server serves and is confined to (default: .)")
    server.add_argument("--certfile", metavar="FILE", default=None,
                        help="serve https with this certificate (PEM); needs --keyfile")
    server.add_argument("--keyfile", metavar="FILE", default=None,
                        help="the private key of --certfile (PEM)")
    server.add_argument("--hash-methods", metavar="LIST", default=None,
                        help="hash methods the server accepts, comma-separated, or 'all' "
                             "(default: the fast ones: xxh*, blake3, sha256, sha1)")
    server.add_argument("--metrics-listen", metavar="ADDRESS", default=None,
                        help="also answer GET /metrics (Prometheus) on this PORT or HOST:PORT, without "
                             "the token: keep it on loopback or a private network")
    server.add_argument("--max-rate", metavar="RATE", type=_max_rate, default=None,
                        help="at most RATE bytes per second of file data served and received, all "
                             "clients and worker processes together (--bwlimit's units; 0 no limit)")
    server.add_argument("--insecure", action="store_true",
                        help="without a token, serve everyone who can connect (every local user; on "
                             "a non-loopback address, the network); without it a token-less server "
                             "serves only the user running it and root, on this host")
    server.add_argument("--trust-clients", action="store_true",
                        help="let clients set owners, setuid/setgid bits (tree syncs with -o, "
                             "-a) and security.*/trusted.* attributes (-X); without it they are "
                             "ignored with a warning")
    server.add_argument("--write-hard-links", action="store_true",
                        help="let clients change files with several hard links in place (data, "
                             "size, metadata): every name of such a file changes, also outside "
                             "--root; without it that is refused and --atomic replaces them")
    server.add_argument("--legacy-api", action="store_true",
                        help="also serve the API of pdiffcopy 1.0.1 clients (below --root, and only "
                             "without a token: they cannot send one, so only the server's own user "
                             "and root, or everyone with --insecure); without it they get an error "
                             "saying so")
    # Without SOURCE and TARGET pdiffcopy starts a server, which would ignore
    # these: refused instead (-c is also the server's worker count).
    parser.sync_only = [action for group in (sync, tree) for action in group._group_actions
                        if action.dest != "concurrency"]
    common = parser.add_argument_group("common options")
    common.add_argument("--token-file", metavar="FILE", default=None,
                        help="read the shared secret from FILE instead of $PDIFFCOPY_TOKEN")
    common.add_argument("--progress", action="store_true",
                        help="show the progress line even when stderr is not a terminal, and keep its "
                             "last state")
    common.add_argument("-P", dest="partial_progress", action="store_true",
                        help="the same as --partial --progress, as rsync's -P")
    common.add_argument("--no-progress", action="store_true", help="no progress display")
    common.add_argument("-v", "--verbose", action="count", default=0,
                        help="list the paths a tree sync changes (as rsync -v) and end with the --stats "
                             "line; -vv also logs the internals (timings, the engine's choices, the remote "
                             "server's log)")
    common.add_argument("-q", "--quiet", action="count", default=0,
                        help="print nothing but errors: no summary, no warnings, no progress display")
    common.add_argument("--version", action="version", version=f"pdiffcopy {__version__}")
    common.add_argument("-h", "--help", action="help", help="show this message and exit")
    return parser


def _read_list(name: str) -> List[str]:
    """The lines of a --exclude-from or --files-from FILE (``-`` is stdin), without blanks and comments.

    :raises argparse.ArgumentError: (through the caller) when FILE cannot be read.
    """
    if name == "-":
        text = sys.stdin.read()
    else:
        with open(name, encoding="utf-8", errors="surrogateescape") as handle:
            text = handle.read()
    return [line.rstrip("\r") for line in text.split("\n")
            if line.strip() and not line.startswith(("#", ";"))]


class _Rule(argparse.Action):
    """--include/--exclude/--exclude-from: one ordered list of (action, glob), as rsync keeps it."""

    def __call__(self, parser, namespace, value, option_string=None):
        rules = list(getattr(namespace, self.dest) or [])
        if option_string == "--exclude-from":
            try:
                lines = _read_list(value)
            except OSError as error:
                raise argparse.ArgumentError(self, f"cannot read {value}: {error.strerror or error}") from None
            for line in lines:  # rsync's "+ GLOB" / "- GLOB" prefixes; a bare line excludes
                if line[:2] in ("+ ", "- "):
                    rules.append((line[0], line[2:]))
                else:
                    rules.append(("-", line))
        else:
            rules.append(("+" if option_string == "--include" else "-", value))
        setattr(namespace, self.dest, rules)


class _FilesFrom(argparse.Action):
    """--files-from FILE: the list of relative paths to sync."""

    def __call__(self, parser, namespace, value, option_string=None):
        try:
            setattr(namespace, self.dest, (getattr(namespace, self.dest) or []) + _read_list(value))
        except OSError as error:
            raise argparse.ArgumentError(self, f"cannot read {value}: {error.strerror or error}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, not {text!r}")
    return value


def _compress_level(text: str) -> int:
    """A --compress-level value: 0 (off) or a zstd level, or a usage error."""
    from pdiffcopy.core.compression import MAX_LEVEL

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_LEVEL:
        raise argparse.ArgumentTypeError(f"expected a level from 0 (off) to {MAX_LEVEL}, not {text!r}")
    return value


def _bwlimit(text: str) -> Optional[int]:
    """A --bwlimit value in bytes per second (None for 0), or a usage error."""
    from pdiffcopy.core.ratelimit import bandwidth_limit

    try:
        return bandwidth_limit(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error).partition(": ")[2]) from None


def _max_rate(text: str) -> Optional[int]:
    """A --max-rate value in bytes per second (None for 0), or a usage error."""
    from pdiffcopy.core.ratelimit import parse_rate

    try:
        return parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _timeout(text: str) -> float:
    """A --timeout value: a finite number of seconds above 0 (``nan``, ``-1``, ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_SECONDS):
        raise argparse.ArgumentTypeError(f"expected seconds above 0 and at most {MAX_TIMEOUT_SECONDS}, "
                                         f"not {text!r}")
    return value


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
    setup_logging(args.verbose - args.quiet)
    try:
        status = run(parser, args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except PdiffcopyError as error:
        logger.error("%s", error)
        status = error.exit_code
    except KeyboardInterrupt as interrupt:
        status = _report_interrupt(interrupt)
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
            status = 1
    return status, bool(args.paths)


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
                       direct_port=args.serve_direct)
        return 0
    token = read_token(args.token_file)
    if not args.paths:
        if args.remove:
            raise UsageError("--remove needs the PATHs to remove")
        refuse_sync_options(parser, args)
        require_extra(("flask", "gunicorn", "prometheus_client"), "server", "The server")
        from pdiffcopy.server.service import DEFAULT_LISTEN, ServerOptions, run_server

        run_server(ServerOptions(listen=args.listen or DEFAULT_LISTEN, root=args.root, token=token,
                                 insecure=args.insecure, workers=args.concurrency,
                                 trust_clients=args.trust_clients,
                                 write_hard_links=args.write_hard_links,
                                 legacy_api=args.legacy_api,
                                 certfile=args.certfile, keyfile=args.keyfile,
                                 hash_methods=args.hash_methods, metrics_listen=args.metrics_listen,
                                 max_rate=args.max_rate,
                                 log_level=logging.getLevelName(logger.getEffectiveLevel()).lower()))
        return 0
    if args.listen:
        raise UsageError("--listen is a server option; it makes no sense with SOURCE and TARGET")
    if args.hash_methods:
        raise UsageError("--hash-methods is a server option; a sync chooses its method with -m")
    if args.metrics_listen:
        raise UsageError("--metrics-listen is a server option; it makes no sense with SOURCE and TARGET")
    if args.legacy_api:
        raise UsageError("--legacy-api is a server option; it makes no sense with SOURCE and TARGET")
    if args.max_rate:
        raise UsageError("--max-rate is a server option; a sync limits its own rate with --bwlimit")
    handle_termination()
    from pdiffcopy.local.descriptors import raise_open_file_limit

    raise_open_file_limit()  # deep trees hold a descriptor per level
    if args.remove:
        for location in args.paths:
            refuse_rsync_remote(location)
        from pdiffcopy.cli.treecli import run_remove

        return run_remove(args, token)
    if len(args.paths) != 2:
        raise UsageError(f"Expected SOURCE and TARGET, got {len(args.paths)} argument(s); "
                         f"see pdiffcopy --help")
    source, target = args.paths
    from pdiffcopy.core.sshform import parse_ssh_location

    over_ssh = any(parse_ssh_location(location) is not None for location in (source, target))
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
    if not over_ssh:
        return sync_locations(args, source, target, token)
    from pdiffcopy.api import reached_over_ssh
    from pdiffcopy.cli.logs import NamedAsTyped

    prehashed: dict = {}

    def while_ssh_logs_in(session) -> None:
        _prehash_local_file(args, source, target, prehashed, session.ssh_descriptors())
        _import_sync_modules()

    try:
        with reached_over_ssh(source, target, rsh=args.rsh, remote_pdiffcopy=args.remote_pdiffcopy,
                              timeout=args.timeout, wait=False, verbose=args.verbose >= DEBUG_VERBOSITY,
                              quiet=args.quiet > 0, while_waiting=while_ssh_logs_in, direct=args.direct,
                              direct_port=args.direct_port) as (source, target, session), \
                NamedAsTyped(session):
            if session.ca_file:  # --direct's pinned certificate
                args.ca_file = session.ca_file
            # The remote server's own token: the user's $PDIFFCOPY_TOKEN is not for it.
            return sync_locations(args, source, target, session.token, shown=session.shown, prepared=prehashed)
    finally:
        for endpoint in prehashed.values():  # (the sync takes the one it uses)
            endpoint.close()


def _prehash_local_file(args: argparse.Namespace, source: str, target: str, prehashed: dict,
                        ssh_descriptors: List[int]) -> None:
    """Start hashing the local file of a file sync over ssh (:func:`pdiffcopy.api.prehash_local_files`).

    :param ssh_descriptors: The pipes to ssh, which the hashing processes must not hold open.
    """
    if args.benchmark:
        return
    from pdiffcopy.api import prehash_local_files
    from pdiffcopy.core.hashing import DEFAULT_HASH_METHOD
    from pdiffcopy.engine.options import file_options

    try:
        options = file_options(block_size=args.block_size, hash_method=args.hash_method or DEFAULT_HASH_METHOD,
                               whole_file=args.whole_file, concurrency=args.concurrency, atomic=args.atomic,
                               partial=args.partial, delta=args.delta, piece_size=args.piece_size)
    except PdiffcopyError:
        return  # the sync says what is wrong
    prehashed.update(prehash_local_files(source, target, options, ssh_descriptors))


def _import_sync_modules() -> None:
    """Import what a remote sync runs, while ssh logs in and the remote server starts."""
    for module in ("pdiffcopy.cli.treecli", "pdiffcopy.api", "pdiffcopy.engine.filejob",
                   "pdiffcopy.transport.legacyremote", "pdiffcopy.transport.remotetree"):
        importlib.import_module(module)


def _rsh_without_remote(rsh: str) -> str:
    from pdiffcopy.transport.sshlaunch import looks_like_regex

    if looks_like_regex(rsh):
        return (f"-e {rsh}: -e is --rsh, the ssh command for a HOST:PATH, as in rsync; the regex filter "
                f"is now --exclude-regex")
    return f"-e/--rsh {rsh}: only for a HOST:PATH SOURCE or TARGET (the regex filter is --exclude-regex)"


def sync_locations(args: argparse.Namespace, source: str, target: str, token: Optional[str],
                   shown=lambda location: location, prepared: Optional[dict] = None) -> int:
    """Sync a file or a tree between two paths or a path and a URL; the exit status.

    :param shown: What a location is called in the report (``HOST:PATH`` for the forwarded URL).
    :param prepared: Endpoints already made for some locations (a local file hashing ahead):
                     the file sync takes the one it syncs; this function closes the others.
    """
    from pdiffcopy.cli.treecli import Probes, resolve

    with Probes(token, args) as probes:  # a URL is probed once, here: the file sync takes its endpoint
        if prepared:
            probes.endpoints.update(prepared)
            prepared.clear()
        given_target = target
        source, target, is_tree = resolve(source, target, probes)
        if not is_tree and target != given_target and given_target.endswith("/") \
                and probes.kind(given_target) is None and not (args.dry_run or args.diff or args.benchmark):
            from pdiffcopy.api import make_directory
            from pdiffcopy.cli.treecli import parent_location

            # TARGET/ names a directory, which rsync makes (its parents with --mkpath only).
            make_directory(parent_location(target), parents=args.mkpath, token=token, timeout=args.timeout,
                           ca_file=args.ca_file)
        if is_tree:
            from pdiffcopy.cli.treecli import run_tree

            probes.close()
            return run_tree(source, target, args, token, shown)
        from pdiffcopy.core.hashing import DEFAULT_HASH_METHOD

        options = dict(block_size=args.block_size, hash_method=args.hash_method or DEFAULT_HASH_METHOD,
                       whole_file=args.whole_file, concurrency=args.concurrency, atomic=args.atomic,
                       token=token, timeout=args.timeout, ca_file=args.ca_file, cache=args.cache,
                       bwlimit=args.bwlimit, compress=args.compress, piece_size=args.piece_size,
                       partial=args.partial, delta=args.delta, sparse=args.sparse)
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
        started, wire_before = time.monotonic(), counters.totals()
        from pdiffcopy.cli.treecli import file_metadata

        result = run_sync(probes.take(source), probes.take(target), dry_run=args.dry_run,
                          show_progress=show_progress(args), keep_last=args.progress, **options,
                          **file_metadata(args), mkpath=args.mkpath)
    report(result, shown)
    if wants_stats(args) and not result.dry_run:
        print_stats(result.bytes_moved, None, time.monotonic() - started,
                    remote=is_url(source) or is_url(target), wire_before=wire_before)
    return 0


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


def run_sync(source: str, target: str, show_progress: bool, keep_last: bool = False, **options):
    """Sync with an optional progress display (``keep_last``: leave its final state on screen)."""
    from pdiffcopy.api import sync
    from pdiffcopy.engine.filejob import Progress

    progress = Progress()
    if not show_progress:
        return sync(source, target, progress=progress, **options)
    from pdiffcopy.cli.progress import ProgressDisplay

    with ProgressDisplay(progress, keep_last=keep_last):
        return sync(source, target, progress=progress, **options)


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

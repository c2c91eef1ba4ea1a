"""The ``pdiffcopy`` command's options: the usage text, the argument parser and its value types.

:mod:`pdiffcopy.cli.command` runs what is parsed here.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import stat
import sys
from typing import List, Optional

from pdiffcopy._version import __version__
from pdiffcopy.core.sshform import DIRECT_OPTION, SERVE_DEVICE_OPTION, SERVE_OPTION
from pdiffcopy.errors import UsageError

USAGE = "pdiffcopy [OPTIONS] [SOURCE... TARGET | --remove PATH...]"

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

Several SOURCEs go into the directory TARGET (made if missing), each by
the rules above, as rsync takes them: a file as TARGET/NAME, a directory as
TARGET/NAME, a SOURCE/ merged into TARGET. With --delete, a merged SOURCE/
leaves the names the others bring alone. Some SOURCEs failing and others
synced exits 23.

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
   25  --max-delete stopped deletions (and nothing else failed)
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
    parser.add_argument("paths", nargs="*", metavar="SOURCE... TARGET", help=argparse.SUPPRESS)
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
    sync.add_argument("--cache", choices=("auto", "drop", "keep", "direct"), default="auto",
                      help="page cache use of whole-file copies between local files: drop "
                           "keeps big copies from flushing the cache, keep leaves it alone "
                           "(default auto: drop from the kernel's writeback threshold up); "
                           "block devices drop what they read and write unless keep, and with "
                           "direct bypass the cache (O_DIRECT; files then as with drop)")
    sync.add_argument("-B", "--benchmark", metavar="COUNT", type=_positive_int, default=None,
                      help="mutate the local TARGET and resync it COUNT times at varying "
                           "similarity, then print an overview (next to rsync if installed)")
    sync.add_argument("--stats", action="store_true",
                      help="end with a line of figures: bytes moved, bytes on the wire (remote "
                           "syncs), elapsed time and rate (also with -v)")
    sync.add_argument("--json", action="store_true",
                      help="print what the sync does as JSON lines on stdout, one object per event "
                           "(started, progress, file, finished or failed, with the exit status and "
                           "the summary's counts), instead of the summary and the progress line")
    sync.add_argument("--metrics-file", metavar="PATH", default=None,
                      help="when done, write the summary as Prometheus text to PATH (for "
                           "node_exporter's textfile collector), replaced atomically")
    sync.add_argument("--timeout", metavar="SECONDS", type=_timeout, default=None,
                      help="how long any network call may wait, in seconds above 0 (default 60)")
    sync.add_argument("--ca-file", metavar="FILE", default=None,
                      help="CA bundle to verify an https:// server with")
    sync.add_argument("--client-cert", metavar="FILE", default=None,
                      help="present this certificate (PEM, with its key unless --client-key) to an "
                           "https:// server that verifies clients (its --client-ca)")
    sync.add_argument("--client-key", metavar="FILE", default=None,
                      help="the private key of --client-cert (PEM)")
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
    sync.add_argument("--digest-file", metavar="PATH", default=None,
                      help="keep TARGET's block digests in PATH as this sync leaves them, with what TARGET "
                           "was then (a device's write counters, a file's inode and times); the next sync "
                           "with it reads TARGET only where it writes, and refuses a record TARGET no longer "
                           "matches (local TARGET, a single file or device; blocksync-fast's idea)")
    sync.add_argument("--changed-since", metavar="SNAPSHOT", default=None,
                      help="SOURCE is a thin volume and SNAPSHOT the older thin snapshot of its origin the "
                           "last sync with --digest-file copied from: read and move only the ranges the pool "
                           "says differ between the two (needs --digest-file)")
    sync.add_argument("--verify-whole", action="store_true",
                      help="with --digest-file: read the whole TARGET anyway, say which blocks differ from "
                           "the record (they are synced) and make the record again")
    tree = parser.add_argument_group("tree options (SOURCE is a directory; -a -t -o -X -A for a file too)")
    tree.add_argument("-a", "--archive", action="store_true",
                      help="keep times, owner, devices and specials too (-t -o -D); a tree keeps permissions "
                           "and symlinks always, a single file with -a (a symlink SOURCE is then made a symlink)")
    tree.add_argument("-t", "--times", action="store_true", help="keep modification times")
    tree.add_argument("-r", "--recursive", action="store_true",
                      help="rsync's: a tree is always synced whole; without --links (or -a), as with "
                           "rsync -r, its symlinks are left out")
    tree.add_argument("--links", action="store_true",
                      help="keep symlinks as symlinks (rsync's -l; -l is --listen here, as in 1.0.1)")
    tree.add_argument("-p", "--perms", action="store_true", help="keep permissions (a tree always does)")
    tree.add_argument("-g", "--group", action="store_true", help="keep the group, with -o (which keeps both)")
    tree.add_argument("-H", "--hard-links", action="store_true",
                      help="keep hard links: names sharing a file in SOURCE share one in TARGET "
                           "(as rsync -H; not implied by -a)")
    tree.add_argument("-D", dest="devices_and_specials", action="store_true",
                      help="the same as --devices --specials (part of -a, as in rsync)")
    tree.add_argument("--devices", action="store_true",
                      help="make character and block devices as device nodes of the same numbers (as "
                           "root; skipped with a warning otherwise, as rsync does)")
    tree.add_argument("--specials", action="store_true",
                      help="make fifos and unix sockets as such nodes")
    tree.add_argument("--copy-devices", action="store_true",
                      help="copy each block device of a local SOURCE as a regular file of its contents "
                           "(rsync's --copy-devices; character devices, which have no size, are not read)")
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
    tree.add_argument("-u", "--update", action="store_true",
                      help="leave alone the files that are newer in TARGET (as rsync -u)")
    tree.add_argument("--existing", "--ignore-non-existing", dest="existing", action="store_true",
                      help="make nothing new in TARGET: update only what it has")
    tree.add_argument("--ignore-existing", action="store_true",
                      help="leave alone what TARGET has: make only what it lacks")
    tree.add_argument("--size-only", action="store_true",
                      help="take files of the same size for the same (their metadata is still set)")
    tree.add_argument("-I", "--ignore-times", action="store_true",
                      help="compare every file, even those of the same size and time")
    tree.add_argument("-@", "--modify-window", metavar="NUM", type=int, default=0,
                      help="times within NUM seconds are the same (default 0: whole seconds, as rsync; "
                           "-1: nanoseconds too)")
    tree.add_argument("--max-size", metavar="SIZE", type=_file_size, default=None,
                      help="leave alone files larger than SIZE (rsync's units: a bare number is bytes, "
                           "K/M/G binary, KB/MB/GB decimal, +1/-1 after them)")
    tree.add_argument("--min-size", metavar="SIZE", type=_file_size, default=None,
                      help="leave alone files smaller than SIZE")
    tree.add_argument("--delete", action="store_true",
                      help="delete what TARGET has and SOURCE does not (never excluded paths)")
    tree.add_argument("--delete-excluded", action="store_true",
                      help="also delete what the filters leave out of TARGET (implies --delete)")
    tree.add_argument("--max-delete", metavar="NUM", type=_whole_number, default=None,
                      help="delete at most NUM entries; with more to delete, leave the rest and exit 25")
    tree.add_argument("--prune-empty-dirs", action="store_true",
                      help="make no directory that would hold nothing once filtered (rsync's -m; -m is "
                           "the hash method here, as in pdiffcopy 1.0.1)")
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
    tree.add_argument("--include-regex", metavar="REGEX", dest="include", action="append", default=[],
                      help="only sync paths (relative to the tree) matching REGEX (repeatable)")
    tree.add_argument("--exclude-regex", metavar="REGEX", dest="exclude", action="append", default=[],
                      help="leave out paths matching REGEX, and directories' contents (repeatable)")
    tree.add_argument("-i", "--itemize-changes", action="store_true",
                      help="list each change in rsync's code (YXcstpoguax PATH), a dry run's too; -i "
                           "was --include-regex before 2.0")
    tree.add_argument("--diff", action="store_true",
                      help="list the differences between the trees, item by item; change nothing")
    tree.add_argument("--remove", action="store_true",
                      help="delete the trees (or files) given as arguments, in parallel: files "
                           "first, then directories deepest first; the filters and -n apply")
    for use, what in (("link", "hard link them from DIR"), ("copy", "copy them from DIR on TARGET's side"),
                      ("compare", "leave them out of TARGET")):
        tree.add_argument(f"--{use}-dest", metavar="DIR", action=_AlternateDir, dest="alternate_dirs", default=[],
                          help=f"files TARGET lacks that DIR (relative to TARGET) has as SOURCE has them: "
                               f"{what} (repeatable, up to 20, tried in order; as rsync's)")
    tree.add_argument("-R", "--relative", action="store_true",
                      help="keep each SOURCE's path below TARGET (from a /./ in it, else whole), the "
                           "directories on its way made as the source has them, as rsync -R")
    tree.add_argument("--backup", action="store_true",
                      help="keep what the sync replaces or deletes as NAME~ (rsync's -b; -b is the "
                           "block size here, as in pdiffcopy 1.0.1)")
    tree.add_argument("--backup-dir", metavar="DIR", default="",
                      help="with --backup (implied): move the old versions into DIR (relative to TARGET) "
                           "under their paths")
    tree.add_argument("--suffix", metavar="SUFFIX", default=None,
                      help="what ends a backup's name (default ~, or nothing with --backup-dir)")
    for flags, nargs, reason in _NO_SENSE_HERE:
        tree.add_argument(*flags, nargs=nargs, action=_NoSenseHere, reason=reason, help=argparse.SUPPRESS)
    # What the client runs on the HOST of a HOST:PATH (pdiffcopy.server.sshserve).
    parser.add_argument(SERVE_OPTION, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(DIRECT_OPTION, metavar="PORT", type=int, default=None, help=argparse.SUPPRESS)
    server = parser.add_argument_group("server options")
    server.add_argument("-l", "--listen", metavar="ADDRESS", default=None,
                        help="PORT, HOST:PORT or [IPv6]:PORT to listen on (default 127.0.0.1:8080)")
    server.add_argument("--root", metavar="DIR", default=None,
                        help="directory the server serves and is confined to (default: .)")
    server.add_argument("--config", metavar="FILE", default=None,
                        help="serve the exports this TOML file names, each at /EXPORT/... with its "
                             "own path, tokens, networks and rules (docs/exports.rst), instead of "
                             "--root, --device and one token; SIGHUP rereads it")
    server.add_argument("--device", metavar="NAME=PATH", action="append", default=[],
                        help="also serve the block device PATH at /NAME, read-only (NAME=PATH:rw: "
                             "writable too), updated in place under the same leases as files; "
                             "repeatable. Device nodes below --root are never served")
    server.add_argument(SERVE_DEVICE_OPTION, metavar="PATH", default=None, help=argparse.SUPPRESS)
    server.add_argument("--certfile", metavar="FILE", default=None,
                        help="serve https with this certificate (PEM); needs --keyfile")
    server.add_argument("--keyfile", metavar="FILE", default=None,
                        help="the private key of --certfile (PEM)")
    server.add_argument("--client-ca", metavar="FILE", default=None,
                        help="verify client certificates with this CA bundle (PEM); a certificate opens "
                             "the exports whose certificates list it, as a token does (needs --config)")
    server.add_argument("--hash-methods", metavar="LIST", default=None,
                        help="hash methods the server accepts, comma-separated, or 'all' "
                             "(default: the fast ones: xxh*, blake3, sha256, sha1)")
    server.add_argument("--log-format", choices=("text", "json"), default=None,
                        help="the server's log: lines of text (the default) or one JSON object a line, "
                             "the transfer log's fields included (docs/exports.rst)")
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
        _refuse_foreign_symlinks(name)
        with open(name, encoding="utf-8", errors="surrogateescape") as handle:
            text = handle.read()
    return [line.rstrip("\r") for line in text.split("\n")
            if line.strip() and not line.startswith(("#", ";"))]


def _refuse_foreign_symlinks(name: str, links_left: int = 40) -> None:
    """Refuse a list reached through a symlink another user owns (not root, not us), as rsync 3.5.0
    does: in a shared directory such a link makes the sync read a list of that user's choosing.

    :raises OSError: Naming the symlink, for the caller's one-line error.
    """
    path = os.path.abspath(name)
    parts = path.strip("/").split("/")
    me = os.geteuid()
    for index in range(1, len(parts) + 1):
        prefix = "/" + "/".join(parts[:index])
        try:
            info = os.lstat(prefix)
        except OSError:
            return  # the open says what is missing
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (0, me):
            raise PermissionError(errno.EPERM, f"reached through {prefix}, a symlink of another user "
                                               f"(uid {info.st_uid}): refused, as rsync does")
        if stat.S_ISLNK(info.st_mode):
            if not links_left:
                return  # a loop: the open says so
            target = os.path.join(os.path.dirname(prefix), os.readlink(prefix))
            return _refuse_foreign_symlinks(os.path.join(target, *parts[index:]), links_left - 1)


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


#: rsync's options for its daemon and its protocol: refused, each in one line saying why.
_NO_SENSE_HERE = (
    (("--daemon",), 0, "rsync's daemon: a pdiffcopy server starts without SOURCE and TARGET (see --root)"),
    (("--port",), 1, "the port of rsync's daemon: name a server by its URL, http(s)://HOST:PORT/PATH"),
    (("--password-file",), 1, "the password of rsync's daemon: a server's token is --token-file or "
                              "$PDIFFCOPY_TOKEN"),
    (("--rsync-path",), 1, "rsync on the other host: pdiffcopy there is named by --remote-pdiffcopy"),
    (("--protocol",), 1, "rsync's protocol version: pdiffcopy's protocol is told apart by itself"),
    (("--checksum-seed",), 1, "a seed of rsync's protocol's checksums: pdiffcopy's digests take none"),
    (("--blocking-io",), 0, "how rsync drives its remote shell: pdiffcopy's data goes over an ssh "
                            "forwarding, never through the shell's pipes"),
    (("--iconv",), 1, "names converted between character sets: pdiffcopy keeps a name's bytes as they are"),
    (("--sockopts",), 1, "socket options of rsync's daemon connections"),
)


class _NoSenseHere(argparse.Action):
    """An rsync option that makes no sense for pdiffcopy: refused, saying why."""

    def __init__(self, *args, reason: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, value, option_string=None):
        raise argparse.ArgumentError(self, f"not for pdiffcopy: {self.reason}")


class _AlternateDir(argparse.Action):
    """--link-dest, --copy-dest, --compare-dest DIR: (use, DIR) pairs; one use only, as in rsync."""

    def __call__(self, parser, namespace, value, option_string=None):
        use = option_string.strip("-").split("-")[0]
        given = list(getattr(namespace, self.dest) or [])
        if any(other != use for other, _ in given):
            raise argparse.ArgumentError(self, "--link-dest, --copy-dest and --compare-dest cannot be mixed "
                                               "(as in rsync)")
        setattr(namespace, self.dest, given + [(use, value)])


class _FilesFrom(argparse.Action):
    """--files-from FILE: the list of relative paths to sync."""

    def __call__(self, parser, namespace, value, option_string=None):
        try:
            setattr(namespace, self.dest, (getattr(namespace, self.dest) or []) + _read_list(value))
        except OSError as error:
            raise argparse.ArgumentError(self, f"cannot read {value}: {error.strerror or error}") from None


def _whole_number(text: str, least: int = 0) -> int:
    """``text`` as a whole number of at least ``least``, or argparse's one-line error."""
    what = "a positive whole number" if least == 1 else f"a whole number, {least} or more"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}")
    return value


def _file_size(text: str) -> int:
    """--max-size, --min-size: rsync's SIZE in bytes, or argparse's one-line error."""
    from pdiffcopy.core.ratelimit import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    return _whole_number(text, least=1)


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

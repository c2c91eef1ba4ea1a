#!/usr/bin/env python3
"""
Tree benchmark: copying and re-syncing whole directory trees with pdiffcopy -a, cp, rsync,
an rsync daemon, psync and parsync, side by side in one run.

Two workloads, generated deterministically from ``--seed`` (the same tree in every run):

``parsync``
    parsync's own benchmark: 500 files of 256 KiB in one directory (128 MiB), on a tmpfs
    that the script mounts under ``--workdir`` (and unmounts at the end).

``psync``
    psync's benchmark, a Linux kernel source tree: 60,000 files in 4,000 directories
    nested up to 5 levels, 893 MB. 88 % of the files are between 1 and 30 KiB (median about
    6 KiB), 5 % are below 1 KiB, 7 % between 30 and 96 KiB, and 5 large files (about 15 to
    100 MB) bring the total to 893 MB. 3 % of the files are executable (0755), mtimes are
    spread over a year with nanoseconds. On ext4 in ``--workdir`` (default
    /work/bench-tree); the source stays there between runs and is only rebuilt when its
    parameters change. ``--quick`` makes it 6,000 files in 400 directories, 89.3 MB.

For each workload, every tool makes a copy into a new target, and then syncs the unchanged
source onto the copy it just made ("no-change sync"): cp -a / cp -r and cp -au, rsync -a
locally, rsync -a pulling from and pushing to an rsync daemon on 127.0.0.1, psync (copy
only: it has no change detection), parsync copy / sync, and pdiffcopy -a locally, pulling
from and pushing to a pdiffcopy server on 127.0.0.1 (``--root DIR -c 2``). ``tar -cf - |
tar -xf -`` (copy only) is not a copier but a floor: one stream between two C processes on
a pipe, with no protocol, which a copy through one connection cannot beat by much. Nor is
``python_floor.py``: the least that a Python program must do to copy or re-sync the tree
with every core busy (see its docstring).

Measurement: ``--rounds`` rounds (default 3), the tools' order rotating from round to
round; each time is the wall time of the whole process. Before each timed copy the source
is read through (warm cache), the workload's file system is synced (``sync -f``) so that
no earlier run's writeback overlaps, and memory is faulted in and freed just before the
start (this machine hands freed memory back to the host after about 2 s, which otherwise
slows whichever copy comes first); on the tmpfs workload each timed copy also follows an
untimed warm-up copy of the same tool. Each timed no-change sync follows an untimed one of
the same tool. Targets are moved aside after each run and deleted at the end of the
workload (root ext4 here reuses freed inodes only after a minute or more, which slows file
creation right after big deletions 10 to 20 times). File creation on that ext4 also has slow
spells of a few minutes for other reasons (other work on the machine): before each round of
the ext4 workload a probe times the creation of 1,000 empty files, and while that is slow
(above 40 us per file, against about 15 normally) the round waits, up to --max-fs-wait
seconds. The probes, waits and load averages are in the report. The first big copy of a
run was up to 6 times slower than the next ones, whichever tool made it, so an untimed cp -a
precedes the first ext4 round.

Every result is verified outside the timing: the list of paths, types and sizes must equal
the source's; the modes and mtimes of files and directories must too, as far as the tool
promises to keep them; and the sha256 of a sample of the files (every file of small
workloads, every 25th of big ones, 3 MiB slices of large files) must match. A tool whose
result is wrong gets no time for that run and is reported as failed.

psync and parsync are built from source by setup_tree_tools.sh (run automatically when
missing); when one cannot be built the report quotes the issue's figures for it instead.
Our pdiffcopy is ``python3 -m pdiffcopy`` of this repository; if it cannot copy a small
tree yet, its rows say "not available" and everything else is still measured. With
``--baseline REV`` our pdiffcopy as it was at git revision REV (client and server, from
``git archive``) is measured too, in the same rounds, and an "/ baseline" column gives
each of today's rows (local, pull, push) over the same row at REV.
"""

import argparse
import contextlib
import json
import math
import mmap
import os
import random
import shlex
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import benchlib
from benchlib import BenchmarkError, log

TOOLS_DIR = benchlib.BENCH_DIR / ".tree-tools"
PSYNC = TOOLS_DIR / "bin" / "psync"
PARSYNC = TOOLS_DIR / "bin" / "parsync"
SETUP_TREE_TOOLS = benchlib.BENCH_DIR / "setup_tree_tools.sh"
DEFAULT_OUTPUT = benchlib.BENCH_DIR / "results" / "trees" / "all-tools.txt"
DEFAULT_WORKDIR = Path("/work/bench-tree")

WORKLOADS = ("parsync", "psync")
FAMILIES = ("cp", "tar", "rsync", "rsyncd", "psync", "parsync", "floor", "ours")

# Bump when the generated trees change, so that a kept source tree is rebuilt.
GENERATOR_VERSION = 1

# What a tool promises to keep besides names, types, sizes and contents.
FULL = frozenset({"mode", "mtime", "dirmode", "dirmtime"})

# Freed inodes of root ext4 are reused only after a minute or more; creating many files
# within that time after deleting many is 10 to 20 times slower. Timed runs wait this long
# after the harness's own big deletions.
INODE_REUSE_WAIT = 75.0

# Sample of files whose contents are hashed: all files of a workload of at most this many
# files, else every SAMPLE_EVERY-th file (by path); files above SLICE_THRESHOLD are hashed
# as three 1 MiB slices (start, middle, end).
# The file creation probe before each round of an ext4 workload: above this many
# microseconds per empty file the file system is in one of its slow spells (about 15 us when
# well, 100 to 300 in a slow spell, when every copy takes 5 to 20 times as long), and the
# round waits, probing again every FS_WAIT_STEP seconds, up to --max-fs-wait.
SLOW_CREATION_US = 40.0
FS_WAIT_STEP = 15.0

SAMPLE_ALL_UP_TO = 2000
SAMPLE_EVERY = 25
SLICE_THRESHOLD = 4 * 1024 * 1024
SLICE = 1024 * 1024

# The figures (2 cores, warm cache), seconds, keyed by workload, tool and operation.
QUOTED = {
    ("parsync", "parsync", "copy"): "0.034",
    ("parsync", "cp-r", "copy"): "0.060",
    ("parsync", "psync", "copy"): "0.060",
    ("parsync", "rsyncd-pull", "copy"): "0.241",
    ("parsync", "rsync", "copy"): "0.20-0.44",
    ("parsync", "cp-a", "sync"): "0.006",
    ("parsync", "parsync", "sync"): "0.007",
    ("parsync", "rsync", "sync"): "0.029",
    ("parsync", "rsyncd-pull", "sync"): "0.115",
    ("psync", "psync", "copy"): "1.65",
    ("psync", "parsync", "copy"): "1.83",
    ("psync", "cp-r", "copy"): "2.83",
    ("psync", "rsyncd-pull", "copy"): "4.40",
    ("psync", "rsync", "copy"): "5.16",
    ("psync", "parsync", "sync"): "0.35",
    ("psync", "rsync", "sync"): "0.45",
    ("psync", "rsyncd-pull", "sync"): "0.56",
}


# --------------------------------------------------------------------------- workloads


@dataclass
class WorkloadSpec:
    """The shape of one generated tree."""

    name: str
    files: int
    dirs: int  # besides the top directory
    total_bytes: int
    tmpfs: bool
    description: str


def workload_spec(name: str, quick: bool) -> WorkloadSpec:
    """The parsync or psync workload (``quick``: psync's at a tenth of the size)."""
    if name == "parsync":
        return WorkloadSpec("parsync", 500, 0, 500 * 256 * 1024, True, "parsync's: 500 files x 256 KiB, one directory")
    scale = 10 if quick else 1
    return WorkloadSpec(
        "psync", 60000 // scale, 4000 // scale, 893000000 // scale, False,
        "psync's (a kernel source tree): %i files in %i directories, %.1f MB%s"
        % (60000 // scale, 4000 // scale, 893.0 / scale, " (--quick: a tenth)" if quick else ""),
    )


@dataclass
class TreePlan:
    """Every directory and file of a tree: relative path, size, mode, mtime in ns."""

    dirs: List[Tuple[str, int, int]]  # (relpath, mode, mtime_ns), parents first
    files: List[Tuple[str, int, int, int]]  # (relpath, size, mode, mtime_ns)
    top_mtime: int


# Kernel-like extensions, and the ones that are executable.
EXTENSIONS = ("c", "c", "c", "h", "h", "S", "txt", "rst", "dts", "yaml", "sh", "py")
MTIME_BASE = 1577836800 * 10 ** 9  # 2020-01-01
MTIME_SPREAD = 365 * 86400 * 10 ** 9


def psync_sizes(rng: random.Random, spec: WorkloadSpec, num_large: int = 5) -> List[int]:
    """
    File sizes: 88 % in 1..30 KiB (lognormal, median 6 KiB), 5 % below 1 KiB, the rest of
    the small files 30..96 KiB, and `num_large` large files holding what is left of the total.
    """
    n = spec.files
    n_band = round(0.88 * n)
    n_tiny = round(0.05 * n)
    n_tail = n - n_band - n_tiny - num_large
    sizes = []
    for _ in range(n_tiny):
        sizes.append(int(math.exp(rng.uniform(math.log(64), math.log(1023)))))
    for _ in range(n_band):
        while True:
            size = int(rng.lognormvariate(math.log(6144), 0.9))
            if 1024 <= size <= 30 * 1024:
                break
        sizes.append(size)
    for _ in range(n_tail):
        sizes.append(int(math.exp(rng.uniform(math.log(30 * 1024 + 1), math.log(96 * 1024)))))
    rest = spec.total_bytes - sum(sizes)
    shares = (0.06, 0.10, 0.16, 0.26, 0.42)[-num_large:]
    if rest < num_large * 1024 * 1024:
        raise BenchmarkError("the small files of %s already hold %i of %i bytes"
                             % (spec.name, sum(sizes), spec.total_bytes))
    large = [int(rest * share / sum(shares)) for share in shares]
    large[-1] += rest - sum(large)
    sizes += large
    rng.shuffle(sizes)
    return sizes


def plan_tree(spec: WorkloadSpec, seed: int) -> TreePlan:
    """Lay out the directories and files of `spec`, the same for the same seed."""
    rng = random.Random("tree-%s-%i-%i" % (spec.name, seed, GENERATOR_VERSION))
    # A random recursive tree: each new directory hangs below a random earlier one that is
    # less than 5 levels deep, which nests a few levels with a few wide directories.
    dirs = [("", 0)]  # (relpath, depth); "" is the top directory
    parents = list(dirs)  # the directories that may get subdirectories
    for index in range(spec.dirs):
        parent, depth = rng.choice(parents)
        name = "dir%04d" % index
        dirs.append((parent + "/" + name if parent else name, depth + 1))
        if depth + 1 < 5:
            parents.append(dirs[-1])
    if spec.name == "parsync":
        sizes = [256 * 1024] * spec.files
    else:
        sizes = psync_sizes(rng, spec)
    # Every directory gets at least one file (copies that only make the parents of files
    # would otherwise look right); the rest go to random directories.
    homes = [d[0] for d in dirs] + [rng.choice(dirs)[0] for _ in range(max(0, spec.files - len(dirs)))]
    rng.shuffle(homes)
    files = []
    for index, (home, size) in enumerate(zip(homes, sizes)):
        ext = rng.choice(EXTENSIONS)
        mode = 0o755 if ext in ("sh", "py") and rng.random() < 0.3 else 0o644
        name = "file%05d.%s" % (index, ext) if spec.name == "psync" else "file%03d.bin" % index
        mtime = MTIME_BASE + rng.randrange(MTIME_SPREAD)
        files.append((home + "/" + name if home else name, size, mode, mtime))
    dir_entries = [(path, 0o755, MTIME_BASE + rng.randrange(MTIME_SPREAD)) for path, _ in dirs[1:]]
    return TreePlan(dir_entries, files, MTIME_BASE + rng.randrange(MTIME_SPREAD))


def write_tree(plan: TreePlan, top: Path, seed: int) -> None:
    """Create the tree of `plan` under `top` (which must not exist): contents, modes, mtimes."""
    top.mkdir(parents=True)
    for path, mode, _ in plan.dirs:
        (top / path).mkdir(mode)
    content = random.Random("content-%i" % seed)
    for path, size, mode, mtime in plan.files:
        target = top / path
        with open(target, "wb") as handle:
            for offset in range(0, size, benchlib.IO_CHUNK):
                handle.write(content.randbytes(min(benchlib.IO_CHUNK, size - offset)))
        os.chmod(target, mode)
        os.utime(target, ns=(mtime, mtime))
    for path, mode, mtime in reversed(plan.dirs):  # children before parents
        os.chmod(top / path, mode)
        os.utime(top / path, ns=(mtime, mtime))
    os.chmod(top, 0o755)
    os.utime(top, ns=(plan.top_mtime, plan.top_mtime))


# --------------------------------------------------------------------------- listing and checks

Entry = Tuple[str, int, int, int]  # kind ('d', 'f', 'l', '?'), size, permission bits, mtime ns


def scan(top: Path) -> Dict[str, Entry]:
    """Every entry below `top` (and `top` itself as '.'), without following symlinks."""
    st = os.lstat(top)
    entries = {".": ("d", 0, stat.S_IMODE(st.st_mode), st.st_mtime_ns)}
    stack = [("", str(top))]
    while stack:
        rel, path = stack.pop()
        with os.scandir(path) as iterator:
            for entry in iterator:
                st = entry.stat(follow_symlinks=False)
                relpath = rel + "/" + entry.name if rel else entry.name
                if stat.S_ISDIR(st.st_mode):
                    kind, size = "d", 0
                    stack.append((relpath, entry.path))
                elif stat.S_ISREG(st.st_mode):
                    kind, size = "f", st.st_size
                elif stat.S_ISLNK(st.st_mode):
                    kind, size = "l", st.st_size
                else:
                    kind, size = "?", 0
                entries[relpath] = (kind, size, stat.S_IMODE(st.st_mode), st.st_mtime_ns)
    return entries


def sample_digest(path: Path, size: int) -> str:
    """sha256 of a whole file, or of three 1 MiB slices (start, middle, end) of a large one."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        if size <= SLICE_THRESHOLD:
            digest.update(handle.read())
        else:
            for offset in (0, size // 2, size - SLICE):
                handle.seek(offset)
                digest.update(handle.read(SLICE))
    return digest.hexdigest()


@dataclass
class Expected:
    """What a correct copy of a source tree looks like."""

    entries: Dict[str, Entry]
    digests: Dict[str, str]  # relpath -> sample_digest of the sampled files


def expected_of(top: Path) -> Expected:
    """Scan a source tree and hash its sample of files."""
    entries = scan(top)
    files = sorted(path for path, entry in entries.items() if entry[0] == "f")
    sample = files if len(files) <= SAMPLE_ALL_UP_TO else files[::SAMPLE_EVERY]
    large = [path for path in files if entries[path][1] > SLICE_THRESHOLD]
    digests = {path: sample_digest(top / path, entries[path][1]) for path in sorted(set(sample + large))}
    return Expected(entries, digests)


# Differences that make a copy wrong (no time is posted for it); the others are kept
# metadata that differs from the source although the tool promises to keep it: the time is
# posted, flagged.
FATAL = ("missing", "unexpected", "wrong type", "wrong size", "wrong content")


def verify(top: Path, expected: Expected, promise: frozenset) -> Tuple[List[str], List[str]]:
    """
    How the tree at `top` differs from `expected`: (wrong contents, differing metadata).

    Both lists are empty for a correct copy.
    """
    if not top.is_dir():
        return ["%s does not exist" % top], []
    actual = scan(top)
    problems: Dict[str, List[str]] = {}

    def problem(kind: str, path: str) -> None:
        problems.setdefault(kind, []).append(path)

    for path in expected.entries.keys() - actual.keys():
        problem("missing", path)
    for path in actual.keys() - expected.entries.keys():
        problem("unexpected", path)
    for path, (kind, size, mode, mtime) in expected.entries.items():
        got = actual.get(path)
        if got is None:
            continue
        if got[0] != kind:
            problem("wrong type", path)
        elif kind == "f":
            if got[1] != size:
                problem("wrong size", path)
            if "mode" in promise and got[2] != mode:
                problem("file mode", path)
            if "mtime" in promise and got[3] != mtime:
                problem("file mtime", path)
        elif kind == "d":
            if "dirmode" in promise and got[2] != mode:
                problem("directory mode", path)
            if "dirmtime" in promise and got[3] != mtime:
                problem("directory mtime", path)
    for path, digest in expected.digests.items():
        got = actual.get(path)
        if got and got[0] == "f" and got[1] == expected.entries[path][1]:
            if sample_digest(top / path, got[1]) != digest:
                problem("wrong content", path)
    texts = {kind: "%s: %i (e.g. %s)" % (kind, len(paths), sorted(paths)[0])
             for kind, paths in sorted(problems.items())}
    return ([text for kind, text in texts.items() if kind in FATAL],
            [text for kind, text in texts.items() if kind not in FATAL])


# --------------------------------------------------------------------------- work spaces


@dataclass
class Workspace:
    """Where one workload lives: source, targets (also where pushes land), trash, logs."""

    spec: WorkloadSpec
    root: Path  # the server root: holds src/ and run/
    logs: Path
    mounted: bool = False
    notes: List[str] = field(default_factory=list)

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def trash(self) -> Path:
        return self.root / "trash"


class DeletionClock:
    """
    Big deletions of the harness, and when the last one ended (kept in the work dir).

    Deleting a run's targets (2 million files and 27 GB with the defaults) takes minutes on
    this ext4 (discard, no journal). Workloads move their targets into .deleting/ at once;
    at the very end, after the report, one `rm -rf` deletes them in the background (its pid
    in .deleting.pid) and records when it ended; the next run waits for it to end first.
    """

    def __init__(self, work_dir: Path):
        self.path = work_dir / ".last-big-delete"
        self.pending = work_dir / ".deleting"
        self.pid_path = work_dir / ".deleting.pid"
        self.log_path = work_dir / "logs" / "delete.log"

    def mark(self) -> None:
        self.path.write_text("%f\n" % time.time())

    def schedule(self, path: Path) -> None:
        """Move `path` (on the work dir's file system) into the pending deletions."""
        if path.exists():
            self.pending.mkdir(exist_ok=True)
            path.rename(self.pending / ("%s-%i" % (path.name, time.time_ns())))

    def wait_for_deleter(self) -> None:
        """Wait for the background deletion of an earlier run, then finish leftovers here."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pid_path.read_text())
            if str(self.pending) in Path("/proc/%i/cmdline" % pid).read_bytes().decode(errors="replace"):
                log("waiting for the deletion of an earlier run's targets (pid %i) to end" % pid)
                while Path("/proc/%i" % pid).exists():
                    time.sleep(1)
        self.pid_path.unlink(missing_ok=True)
        if self.pending.exists() and any(self.pending.iterdir()):
            log("deleting targets an earlier run left in %s" % self.pending)
            remove_tree(self.pending)
            self.mark()

    def start_deleter(self, foreground: bool) -> None:
        """Delete the pending targets: in the background (default) or now."""
        if not self.pending.exists():
            return
        if foreground:
            log("deleting the targets (%s)" % self.pending)
            remove_tree(self.pending)
            self.mark()
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        script = 'rm -rf --one-file-system "$1" && date +%s.%N > "$2"'
        with open(self.log_path, "ab") as log_file:
            process = subprocess.Popen(["sh", "-c", script, "sh", str(self.pending), str(self.path)],
                                       stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.pid_path.write_text("%i\n" % process.pid)
        log("deleting the targets in the background (pid %i, a few minutes); the next run waits for it"
            % process.pid)

    def wait(self) -> None:
        """Sleep until freed inodes are reusable again (see INODE_REUSE_WAIT)."""
        with contextlib.suppress(OSError, ValueError):
            remaining = float(self.path.read_text()) + INODE_REUSE_WAIT - time.time()
            if remaining > 0:
                log("waiting %.0f s after the last big deletion (ext4 reuses freed inodes late)" % remaining)
                time.sleep(remaining)


def remove_tree(path: Path) -> None:
    """rm -rf (much faster than shutil.rmtree on big trees)."""
    if path.exists() or path.is_symlink():
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=True)


def mount_tmpfs(mountpoint: Path, size: int) -> Tuple[bool, str]:
    """Mount a tmpfs of `size` bytes at `mountpoint`; returns (mounted, note)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(mountpoint):
        subprocess.run(["umount", str(mountpoint)], check=False)
    size_mib = -(-size // 1024 ** 2)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=%iM,mode=0755" % size_mib, "tmpfs", str(mountpoint)],
        capture_output=True, text=True,
    )
    if result.returncode == 0:
        return True, "tmpfs of %i MiB mounted at %s" % (size_mib, mountpoint)
    return False, "could not mount a tmpfs (%s)" % result.stderr.strip()


def make_workspace(spec: WorkloadSpec, args, clock: DeletionClock) -> Workspace:
    """Mount (tmpfs) or reuse (ext4) the workload's directory, with its source tree in place."""
    logs = args.workdir / "logs" / spec.name
    remove_tree(logs)
    logs.mkdir(parents=True)
    if spec.tmpfs:
        mountpoint = args.workdir / "parsync-tmpfs"
        # Source, a warm-up copy, a timed copy and slack.
        mounted, note = mount_tmpfs(mountpoint, 4 * spec.total_bytes + 256 * 1024 ** 2)
        if mounted:
            ws = Workspace(spec, mountpoint, logs, mounted=True, notes=[note])
        else:
            fallback = Path("/dev/shm") / ("tree-bench-%i" % os.getpid())
            remove_tree(fallback)
            fallback.mkdir()
            ws = Workspace(spec, fallback, logs, notes=[note + "; using %s (tmpfs) instead" % fallback])
        log("generating the %s workload in %s" % (spec.name, ws.src))
        write_tree(plan_tree(spec, args.seed), ws.src, args.seed)
    else:
        # Quick runs keep their own smaller source, so that both stay generated.
        ws = Workspace(spec, args.workdir / (spec.name + ("-quick" if args.quick else "")), logs)
        ws.root.mkdir(parents=True, exist_ok=True)
        stamp_path = ws.root / "src.stamp"
        stamp = json.dumps({"generator": GENERATOR_VERSION, "seed": args.seed, "files": spec.files,
                            "dirs": spec.dirs, "bytes": spec.total_bytes}, sort_keys=True)
        for leftover in (ws.run, ws.trash):
            if leftover.exists():
                log("removing %s left by an earlier run" % leftover)
                clock.schedule(leftover)
        clock.wait_for_deleter()
        if not ws.src.is_dir() or not stamp_path.exists() or stamp_path.read_text() != stamp:
            if ws.src.exists():
                log("removing the old source tree %s (other parameters)" % ws.src)
                remove_tree(ws.src)
                clock.mark()
            stamp_path.unlink(missing_ok=True)
            log("generating the %s workload in %s (once; kept for later runs)" % (spec.name, ws.src))
            started = time.monotonic()
            write_tree(plan_tree(spec, args.seed), ws.src, args.seed)
            stamp_path.write_text(stamp)
            log("generated in %.1f s" % (time.monotonic() - started))
        else:
            ws.notes.append("source tree kept from an earlier run (same seed and parameters)")
    ws.run.mkdir()
    ws.trash.mkdir()
    return ws


def release_workspace(ws: Workspace, clock: DeletionClock) -> None:
    """Delete the targets; unmount the tmpfs (or drop its stand-in)."""
    if ws.spec.tmpfs:
        if ws.mounted:
            subprocess.run(["umount", str(ws.root)], check=False)
            with contextlib.suppress(OSError):
                ws.root.rmdir()
        else:
            remove_tree(ws.root)
        return
    for path in (ws.run, ws.trash):
        clock.schedule(path)


# --------------------------------------------------------------------------- tools


@dataclass
class TreeTool:
    """One way of copying and re-syncing a tree: a row of the report."""

    key: str
    family: str
    label: str
    copy: Optional[Callable[[Path], List[str]]]
    sync: Optional[Callable[[Path], List[str]]]
    promise: frozenset
    env: Optional[Dict[str, str]] = None
    available: bool = True
    reason: str = ""  # why not available


def describe(command: Optional[List[str]], ws: Workspace) -> str:
    """A command line with the workload's paths shortened to SRC and DST."""
    if command is None:
        return "-"
    text = shlex.join(command)
    for path, name in ((ws.run / "DST", "DST"), (ws.src, "SRC"), (ws.run, "RUN"), (ws.root, "ROOT")):
        text = text.replace(str(path), name)
    for prefix in (sys.executable + " -m pdiffcopy", sys.executable + " -P -m pdiffcopy", str(PSYNC), str(PARSYNC)):
        text = text.replace(prefix, Path(prefix.split()[-1]).name)
    return text


def make_tools(args, ws: Workspace, daemon, our_server, ours, baseline_server=None, baseline=None) -> List[TreeTool]:
    """The tools of the chosen families for workspace `ws` (servers not started yet)."""
    src = str(ws.src)
    tools: List[TreeTool] = []
    families = args.tools
    if "cp" in families:
        tools.append(TreeTool("cp-a", "cp", "cp -a / cp -au", lambda t: ["cp", "-a", src, str(t)],
                              lambda t: ["cp", "-au", src + "/.", str(t)], FULL))
        tools.append(TreeTool("cp-r", "cp", "cp -r", lambda t: ["cp", "-r", src, str(t)], None,
                              frozenset({"mode", "dirmode"})))
    if "tar" in families:
        # Not a copier: the floor of one stream, two C processes joined by a pipe
        # (a socket would cost more), each file read and written once, no protocol;
        # pax headers keep nanosecond mtimes.
        pipe = lambda t: ["bash", "-o", "pipefail", "-c",  # noqa: E731
                          "mkdir {0} && tar --format=posix -C {1} -cf - . | tar -C {0} -xf -".format(
                              shlex.quote(str(t)), shlex.quote(src))]
        tools.append(TreeTool("tar", "tar", "tar | tar (one stream's floor)", pipe, None, FULL))
    if "rsync" in families:
        local = lambda t: ["rsync", "-a", src + "/", str(t) + "/"]  # noqa: E731
        tools.append(TreeTool("rsync", "rsync", "rsync -a", local, local, FULL))
    if "rsyncd" in families:
        pull = lambda t: ["rsync", "-a", daemon.url("src", ""), str(t) + "/"]  # noqa: E731
        push = lambda t: ["rsync", "-a", src + "/", daemon.url("run", t.name) + "/"]  # noqa: E731
        tools.append(TreeTool("rsyncd-pull", "rsyncd", "rsync -a, daemon pull", pull, pull, FULL))
        tools.append(TreeTool("rsyncd-push", "rsyncd", "rsync -a, daemon push", push, push, FULL))
    if "psync" in families:
        copy = lambda t: [str(PSYNC), "-threads", str(args.psync_threads), "-times", "-create", src, str(t)]  # noqa: E731
        tool = TreeTool("psync", "psync", "psync -threads %i" % args.psync_threads, copy, None, FULL)
        if not PSYNC.exists():
            tool.available, tool.reason = False, "not built (see setup_tree_tools.sh)"
        tools.append(tool)
    if "parsync" in families:
        threads = str(args.parsync_threads)
        copy = lambda t: [str(PARSYNC), "copy", "-t", threads, "--no-progress", src, str(t)]  # noqa: E731
        sync = lambda t: [str(PARSYNC), "sync", "-t", threads, "--no-progress", src, str(t)]  # noqa: E731
        # parsync copies file contents and mtimes only: new files get 0666 & ~umask, and
        # directories neither their modes nor their times.
        tool = TreeTool("parsync", "parsync", "parsync copy/sync -t %s" % threads, copy, sync, frozenset({"mtime"}))
        if not PARSYNC.exists():
            tool.available, tool.reason = False, "not built (see setup_tree_tools.sh)"
        tools.append(tool)
    if "floor" in families:
        # Not a copier either: the least Python must do, on every core (see python_floor.py).
        floor = lambda t: [sys.executable, str(benchlib.BENCH_DIR / "python_floor.py"), src, str(t)]  # noqa: E731
        tools.append(TreeTool("floor", "floor", "Python's floor, 2 processes", floor, floor, FULL))
    if "ours" in families:
        tools += our_tools(args, ws, "ours", our_server, ours, args.ours_ready, args.ours_reason)
        if args.baseline:
            tools += our_tools(args, ws, "baseline", baseline_server, baseline, args.baseline_ready,
                               args.baseline_reason, "@" + args.baseline)
    return tools


def our_tools(args, ws: Workspace, family: str, server, installation, ready: bool, reason: str,
              suffix: str = "") -> List[TreeTool]:
    """pdiffcopy -a local, pull and push, keyed FAMILY-local etc. (family "ours" or "baseline")."""
    src = str(ws.src)
    prefix = (installation.command if installation else ["pdiffcopy"]) + ["-a"] + args.ours_args
    env = installation.env if installation else None
    url = "http://127.0.0.1:%i/" % (server.port if server else 0)
    local = lambda t: prefix + [src + "/", str(t) + "/"]  # noqa: E731
    pull = lambda t: prefix + [url + "src/", str(t) + "/"]  # noqa: E731
    push = lambda t: prefix + [src + "/", url + "run/" + t.name + "/"]  # noqa: E731
    tools = []
    for mode, command in (("local", local), ("pull", pull), ("push", push)):
        tool = TreeTool("%s-%s" % (family, mode), family, "pdiffcopy%s -a, %s" % (suffix, mode), command, command,
                        FULL, env=env)
        if not ready:
            tool.available, tool.reason = False, "not available: " + reason
        tools.append(tool)
    return tools


def probe_ours(args, ours: Optional[benchlib.OursInstallation] = None
               ) -> Tuple[Optional[benchlib.OursInstallation], bool, str]:
    """
    Find our pdiffcopy (or take `ours`, the baseline) and check that ``-a`` copies a small tree correctly.

    Returns (installation or None, ready, reason when not ready).
    """
    if ours is None:
        ours, description = benchlib.find_ours()
        if ours is None:
            return None, False, description
    probe = args.workdir / "probe"
    remove_tree(probe)
    source = probe / "src"
    plan = TreePlan([("a", 0o755, MTIME_BASE + 1), ("a/b", 0o750, MTIME_BASE + 2)],
                    [("x.txt", 10, 0o644, MTIME_BASE + 3), ("a/y.sh", 3000, 0o755, MTIME_BASE + 4),
                     ("a/b/z", 70000, 0o600, MTIME_BASE + 5), ("a/b/e", 0, 0o644, MTIME_BASE + 6)],
                    MTIME_BASE + 7)
    write_tree(plan, source, args.seed)
    target = probe / "dst"
    command = ours.command + ["-a"] + args.ours_args + [str(source) + "/", str(target) + "/"]
    log_path = probe / "probe.log"
    try:
        benchlib.run_tool(command, log_path, ours.env)
        wrong, _ = verify(target, expected_of(source), FULL)
        if wrong:
            return ours, False, "its tree copy is wrong: " + "; ".join(wrong)
        # Once more: a no-change sync must work too.
        benchlib.run_tool(command, log_path, ours.env)
        wrong, _ = verify(target, expected_of(source), FULL)
        if wrong:
            return ours, False, "its no-change sync breaks the tree: " + "; ".join(wrong)
    except BenchmarkError:
        lines = [line for line in benchlib.tail(log_path, 30).splitlines() if line.strip()]
        return ours, False, "`pdiffcopy -a SRC/ DST/` fails: %s" % (lines[-1] if lines else "?")
    finally:
        remove_tree(probe)
    return ours, True, ""


# --------------------------------------------------------------------------- measuring


def prefault_memory(num_bytes: int) -> None:
    """Fault in `num_bytes` of anonymous memory and free it, so that the next run finds it warm."""
    if num_bytes <= 0:
        return
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    with contextlib.suppress(OSError, ValueError):
        region = mmap.mmap(-1, num_bytes, flags=flags)
        if not getattr(mmap, "MAP_POPULATE", 0):
            zero = bytes(1024 * 1024)
            for offset in range(0, num_bytes - len(zero) + 1, len(zero)):
                region[offset:offset + len(zero)] = zero
        region.close()


def creation_probe(directory: Path, dirs: int = 20, files: int = 50) -> float:
    """
    Microseconds per empty file created in `directory` (kept, deleted with the trash).

    A diagnostic: file creation on this ext4 slows down 10 to 20 times for minutes at a
    time (after big deletions, or under memory pressure from other work), and every copy
    time follows it.
    """
    directory.mkdir()
    started = time.perf_counter()
    for d in range(dirs):
        sub = directory / ("d%02d" % d)
        sub.mkdir()
        for f in range(files):
            os.close(os.open(sub / ("f%02d" % f), os.O_CREAT | os.O_WRONLY, 0o644))
    return (time.perf_counter() - started) / (dirs * files) * 1e6


def read_through_tree(top: Path) -> None:
    """Read every file of `top` once (the page cache forgets idle pages after a minute)."""
    subprocess.run(["sh", "-c", 'find "$1" -type f -print0 | xargs -0 -r cat > /dev/null', "sh", str(top)],
                   check=True)


def run_timed(command: List[str], log_path: Path, env: Optional[Dict[str, str]]) -> Tuple[float, float]:
    """
    Run one tool to completion as benchlib.run_tool does (wall time of the whole process,
    its process group killed on any error, BenchmarkError on a non-zero exit), and also
    return the CPU time (user + system) of the process and the children it waited for.
    """
    started = time.perf_counter()
    process = benchlib.start_process(command, log_path, env)
    try:
        rusage = benchlib.wait_rusage(process, benchlib.RUN_TIMEOUT)
    except BaseException:
        benchlib.kill_group(process, signal.SIGKILL)
        process.wait()
        raise
    elapsed = time.perf_counter() - started
    benchlib.kill_group(process, signal.SIGKILL)
    if process.returncode != 0:
        raise BenchmarkError("command failed with exit status %s: %s\n%s"
                             % (process.returncode, shlex.join(command), benchlib.tail(log_path)))
    return elapsed, rusage.ru_utime + rusage.ru_stime


@dataclass
class Cell:
    """The samples of one tool and operation, and what went wrong."""

    seconds: List[float] = field(default_factory=list)
    cpu: List[float] = field(default_factory=list)  # user + system seconds of the client
    failures: List[str] = field(default_factory=list)
    metadata: List[str] = field(default_factory=list)  # kept metadata that differs
    rounds: int = 0

    def add(self, seconds: float, cpu: float, metadata: List[str]) -> None:
        self.seconds.append(seconds)
        self.cpu.append(cpu)
        for text in metadata:
            if text not in self.metadata:
                self.metadata.append(text)

    def median(self) -> Optional[float]:
        return statistics.median(self.seconds) if self.seconds else None

    def best(self) -> Optional[float]:
        return min(self.seconds) if self.seconds else None

    def cpu_median(self) -> Optional[float]:
        return statistics.median(self.cpu) if self.cpu else None


class Runner:
    """Runs the rounds of one workload."""

    def __init__(self, args, ws: Workspace, tools: List[TreeTool], expected: Expected):
        self.args = args
        self.ws = ws
        self.tools = tools
        self.expected = expected
        self.cells: Dict[Tuple[str, str], Cell] = {}
        self.copy_warmup = args.copy_warmup if args.copy_warmup != "auto" else ("run" if ws.spec.tmpfs else "memory")
        self.prefault_bytes = int(min(ws.spec.total_bytes * 1.25 + 256 * 1024 ** 2, 6 * 1024 ** 3))
        self.round_loads: List[str] = []
        self.creation_probes: List[float] = []
        self.fs_waits: List[float] = []

    def cell(self, tool: TreeTool, op: str) -> Cell:
        return self.cells.setdefault((tool.key, op), Cell())

    def settle(self) -> None:
        """Write back what earlier runs left dirty on the workload's file system."""
        subprocess.run(["sync", "-f", str(self.ws.root)], check=False)

    def discard(self, target: Path) -> None:
        """Drop a target: at once on tmpfs, else moved aside and deleted at the end."""
        if not target.exists():
            return
        if self.ws.spec.tmpfs:
            remove_tree(target)
        else:
            target.rename(self.ws.trash / ("%s-%i" % (target.name, time.monotonic_ns())))

    def run(self, tool: TreeTool, command: List[str]) -> Tuple[float, float]:
        """Run `command` to completion: (wall seconds, user + system seconds of the client)."""
        return run_timed(command, self.ws.logs / ("%s.log" % tool.key), tool.env)

    def measure(self, tool: TreeTool, round_index: int) -> None:
        """One timed copy of `tool` into a new target, then its timed no-change sync."""
        target = self.ws.run / ("%s-r%i" % (tool.key, round_index))
        copy_cell = self.cell(tool, "copy")
        copy_cell.rounds += 1
        try:
            if self.copy_warmup == "run":
                warm = self.ws.run / ("%s-r%i-warmup" % (tool.key, round_index))
                self.run(tool, tool.copy(warm))
                self.discard(warm)
            read_through_tree(self.ws.src)
            self.settle()
            prefault_memory(self.prefault_bytes)
            seconds, cpu = self.run(tool, tool.copy(target))
        except BenchmarkError as error:
            copy_cell.failures.append(str(error).splitlines()[0])
            log("  %s copy FAILED: %s" % (tool.key, error))
            self.discard(target)
            return
        wrong, metadata = verify(target, self.expected, tool.promise)
        if wrong:
            copy_cell.failures.append("wrong result: " + "; ".join(wrong + metadata))
            log("  %s copy WRONG: %s" % (tool.key, "; ".join(wrong + metadata)))
        else:
            copy_cell.add(seconds, cpu, metadata)
            log("  %-12s copy            %7.3f s (client CPU %.3f s)%s" % (
                tool.key, seconds, cpu, "; METADATA DIFFERS: " + "; ".join(metadata) if metadata else ""))
        if tool.sync is not None and not wrong:
            sync_cell = self.cell(tool, "sync")
            sync_cell.rounds += 1
            try:
                self.run(tool, tool.sync(target))  # warm-up
                seconds, cpu = self.run(tool, tool.sync(target))
            except BenchmarkError as error:
                sync_cell.failures.append(str(error).splitlines()[0])
                log("  %s no-change sync FAILED: %s" % (tool.key, error))
            else:
                wrong, metadata = verify(target, self.expected, tool.promise)
                if wrong:
                    sync_cell.failures.append("wrong result: " + "; ".join(wrong + metadata))
                    log("  %s no-change sync WRONG: %s" % (tool.key, "; ".join(wrong + metadata)))
                else:
                    sync_cell.add(seconds, cpu, metadata)
                    log("  %-12s no-change sync  %7.3f s (client CPU %.3f s)%s" % (
                        tool.key, seconds, cpu, "; METADATA DIFFERS: " + "; ".join(metadata) if metadata else ""))
        self.discard(target)

    def wait_for_file_system(self, round_index: int) -> None:
        """
        Probe file creation before a round; while it is slow, wait (up to --max-fs-wait s).

        Records the last probe and how long the round waited.
        """
        deadline = time.monotonic() + self.args.max_fs_wait
        waited_from = time.monotonic()
        attempt = 0
        while True:
            micros = creation_probe(self.ws.trash / ("creation-probe-%i-%i" % (round_index, attempt)))
            attempt += 1
            if micros <= SLOW_CREATION_US or time.monotonic() >= deadline:
                break
            log("  file creation is slow (%.0f us per file): waiting %.0f s" % (micros, FS_WAIT_STEP))
            time.sleep(FS_WAIT_STEP)
        self.creation_probes.append(micros)
        self.fs_waits.append(time.monotonic() - waited_from)

    def rounds(self) -> None:
        active = [tool for tool in self.tools if tool.available]
        for round_index in range(self.args.rounds):
            shift = round_index % max(1, len(active))
            order = active[shift:] + active[:shift]
            if round_index == 0 and not self.ws.spec.tmpfs:
                # The first big copy of a run was up to 6 times slower than the next ones,
                # whichever tool made it: one untimed copy takes that hit.
                log("an untimed settling copy (cp -a) before the first round")
                read_through_tree(self.ws.src)
                subprocess.run(["cp", "-a", str(self.ws.src), str(self.ws.trash / "settling-copy")], check=True)
                self.settle()
            self.round_loads.append(benchlib.load_averages().split()[0])
            if not self.ws.spec.tmpfs:
                self.wait_for_file_system(round_index)
            log("%s workload, round %i/%i: %s" % (self.ws.spec.name, round_index + 1, self.args.rounds,
                                                 " ".join(tool.key for tool in order)))
            for tool in order:
                self.measure(tool, round_index)


# --------------------------------------------------------------------------- report


def fmt(value: Optional[float]) -> str:
    """Seconds: 3 decimals below 10 s."""
    if value is None:
        return "n/a"
    return "%.3f" % value if value < 10 else "%.2f" % value


def ratio(numerator: Optional[float], denominator: Optional[float]) -> str:
    if numerator is None or not denominator:
        return "-"
    return "%.2fx" % (numerator / denominator)


def text_table(header: List[str], rows: List[List[str]], left: int = 1) -> str:
    """A plain-text table: the first `left` columns left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]

    def render(cells):
        parts = [str(c).ljust(w) if i < left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    return "\n".join([render(header), "  ".join("-" * w for w in widths)] + [render(row) for row in rows])


def status_of(tool: TreeTool, cell: Optional[Cell]) -> str:
    if not tool.available:
        return tool.reason
    if cell is None:
        return ""
    text = "verified %i/%i" % (len(cell.seconds), cell.rounds)
    if cell.failures:
        text = "FAILED %i/%i: %s" % (len(cell.failures), cell.rounds, cell.failures[0][:160])
    if cell.metadata:
        text += "; kept metadata differs: " + "; ".join(cell.metadata)[:160]
    return text


def workload_report(runner: Runner) -> Tuple[str, Dict]:
    """The section of one workload, and its medians for the targets."""
    ws, spec = runner.ws, runner.ws.spec
    entries = runner.expected.entries
    sizes = sorted(e[1] for e in entries.values() if e[0] == "f")
    ndirs = sum(1 for e in entries.values() if e[0] == "d") - 1
    band = sum(1 for s in sizes if 1024 <= s <= 30 * 1024)
    fs_line = benchlib.command_output(["findmnt", "--noheadings", "--output", "FSTYPE,SOURCE",
                                       "--target", str(ws.root)])
    lines = ["", "=" * 100, "Workload %s: %s" % (spec.name, spec.description),
             "  %i files in %i directories below the top one, %i bytes (%.1f MB); median file %.1f KiB, "
             "%.0f %% of files 1..30 KiB, largest %s" % (
                 len(sizes), ndirs, sum(sizes), sum(sizes) / 1e6, statistics.median(sizes) / 1024,
                 100.0 * band / len(sizes),
                 ", ".join(benchlib.format_size(s) if s % 1024 == 0 else "%.1f MB" % (s / 1e6)
                           for s in sizes[-5:][::-1])),
             "  on %s (%s); %s" % (ws.root, " ".join(fs_line.split()), "; ".join(ws.notes) or "-"),
             "  copy warm-up: %s" % ("an untimed copy of the same tool just before" if runner.copy_warmup == "run"
                                      else "source read through, sync -f, %s of memory faulted in and freed just before"
                                      % benchlib.format_size(runner.prefault_bytes // 1024 ** 2 * 1024 ** 2)),
             "  load average (1 min) at the start of each round: %s%s" % (
                 ", ".join(runner.round_loads),
                 "; file creation before each round: %s us per empty file (about 15 when the file system is well; "
                 "rounds wait while it is above %i, up to %.0f s: waited %s s)" % (
                     ", ".join("%.0f" % v for v in runner.creation_probes), SLOW_CREATION_US, runner.args.max_fs_wait,
                     ", ".join("%.0f" % v for v in runner.fs_waits)) if runner.creation_probes else ""),
             "  %i rounds; seconds: median and best wall time of the verified runs (whole process); CPU: median user + "
             "system seconds of the client process and its children (servers not included)." % runner.args.rounds,
             ""]
    medians: Dict[Tuple[str, str], Optional[float]] = {}
    for (key, op), cell in runner.cells.items():
        medians[(key, op)] = cell.median()

    def med(key, op):
        return medians.get((key, op))

    def versus_baseline(tool: TreeTool, op: str, m: Optional[float]) -> List[str]:
        """The "/ baseline" cell of today's pdiffcopy rows (when --baseline is given)."""
        if not runner.args.baseline:
            return []
        if tool.family != "ours":
            return ["-"]
        return [ratio(m, med(tool.key.replace("ours-", "baseline-", 1), op))]

    baseline_column = ["/ baseline"] if runner.args.baseline else []

    # Copy table.
    refs = [("cp -r", med("cp-r", "copy")), ("rsync -a", med("rsync", "copy")),
            ("psync", med("psync", "copy")), ("parsync", med("parsync", "copy")), ("tar", med("tar", "copy")),
            ("floor", med("floor", "copy"))]
    header = (["copy into a new target", "median", "best", "CPU"] + ["/ " + name for name, _ in refs]
              + baseline_column + ["quoted", "check"])
    rows = []
    for tool in runner.tools:
        if tool.copy is None:
            continue
        cell = runner.cells.get((tool.key, "copy"))
        m = cell.median() if cell else None
        rows.append([tool.label, fmt(m), fmt(cell.best() if cell else None), fmt(cell.cpu_median() if cell else None)]
                    + [ratio(m, value) for _, value in refs] + versus_baseline(tool, "copy", m)
                    + [QUOTED.get((spec.name, tool.key, "copy"), "-"), status_of(tool, cell)])
    lines.append(text_table(header, rows, left=1))
    lines.append("")
    # No-change sync table.
    refs = [("cp -au", med("cp-a", "sync")), ("rsync -a", med("rsync", "sync")), ("parsync", med("parsync", "sync")),
            ("floor", med("floor", "sync"))]
    header = (["no-change sync", "median", "best", "CPU"] + ["/ " + name for name, _ in refs]
              + baseline_column + ["quoted", "check"])
    rows = []
    for tool in runner.tools:
        if tool.sync is None:
            continue
        cell = runner.cells.get((tool.key, "sync"))
        m = cell.median() if cell else None
        rows.append([tool.label, fmt(m), fmt(cell.best() if cell else None), fmt(cell.cpu_median() if cell else None)]
                    + [ratio(m, value) for _, value in refs] + versus_baseline(tool, "sync", m)
                    + [QUOTED.get((spec.name, tool.key, "sync"), "-"), status_of(tool, cell)])
    lines.append(text_table(header, rows, left=1))
    lines.append("")
    lines.append("Commands (SRC = %s, DST = a new directory in %s):" % (ws.src, ws.run))
    probe_target = ws.run / "DST"
    for tool in runner.tools:
        copy = describe(tool.copy(probe_target) if tool.copy else None, ws)
        sync = describe(tool.sync(probe_target) if tool.sync else None, ws)
        lines.append("  %-28s copy: %s" % (tool.label, copy))
        if tool.sync is not None and sync != copy:
            lines.append("  %-28s sync: %s" % ("", sync))
    lines.append("Samples (s):")
    for tool in runner.tools:
        for op in ("copy", "sync"):
            cell = runner.cells.get((tool.key, op))
            if cell and cell.seconds:
                lines.append("  %-16s %-5s %s" % (tool.key, op, " ".join("%.3f" % s for s in cell.seconds)))
    return "\n".join(lines) + "\n", medians


def targets_report(all_medians: Dict[str, Dict], ours_ready: bool, ours_reason: str, selected: List[str]) -> str:
    """The issue's targets for pdiffcopy -a, met or not."""
    lines = ["", "=" * 100, "The issue's targets for pdiffcopy -a (medians):"]
    if "ours" not in selected:
        return "\n".join(lines + ["  not measured (--tools without ours)"]) + "\n"
    if not ours_ready:
        return "\n".join(lines + ["  not available: %s" % ours_reason]) + "\n"

    def check(text: str, value: Optional[float], limit: Optional[float], factor: float = 1.0,
              floor: Optional[float] = None, floor_name: str = "") -> str:
        if value is None or limit is None:
            return "  %-72s n/a" % text
        bound = limit * factor
        verdict = "MET" if value <= bound else "MISSED"
        line = "  %-72s %s s vs %s s: %s (%.2fx)" % (text, fmt(value), fmt(bound), verdict, value / bound)
        if floor is not None:  # how far the target is below what any program of that kind can do
            line += "; %s %s s, the target %.2fx of it" % (floor_name, fmt(floor), bound / floor)
        return line

    p = all_medians.get("psync", {})
    q = all_medians.get("parsync", {})
    if p:
        fastest = [v for v in (p.get(("psync", "copy")), p.get(("parsync", "copy"))) if v is not None]
        python_copy, python_sync = p.get(("floor", "copy")), p.get(("floor", "sync"))
        lines.append(check("psync workload: local copy <= fastest of psync, parsync",
                           p.get(("ours-local", "copy")), min(fastest) if fastest else None,
                           floor=python_copy, floor_name="Python's floor"))
        for mode in ("pull", "push"):
            lines.append(check("psync workload: %s copy <= 0.5 x rsync daemon %s" % (mode, mode),
                               p.get(("ours-" + mode, "copy")), p.get(("rsyncd-" + mode, "copy")), 0.5,
                               floor=p.get(("tar", "copy")), floor_name="tar | tar"))
        lines.append(check("psync workload: local no-change sync <= parsync's", p.get(("ours-local", "sync")),
                           p.get(("parsync", "sync")), floor=python_sync, floor_name="Python's floor"))
        for mode in ("pull", "push"):
            lines.append(check("psync workload: %s no-change sync <= 1.5 x parsync's local one" % mode,
                               p.get(("ours-" + mode, "sync")), p.get(("parsync", "sync")), 1.5,
                               floor=python_sync, floor_name="Python's local floor"))
    if q:
        lines.append(check("parsync workload: no-change sync <= 2 x rsync -a", q.get(("ours-local", "sync")),
                           q.get(("rsync", "sync")), 2.0, floor=q.get(("floor", "sync")),
                           floor_name="Python's floor"))
        lines.append(check("parsync workload: copy <= 1.2 x cp -r", q.get(("ours-local", "copy")),
                           q.get(("cp-r", "copy")), 1.2, floor=q.get(("floor", "copy")),
                           floor_name="Python's floor"))
    return "\n".join(lines) + "\n"


def versions(args, ours, baseline=None) -> List[str]:
    lines = ["cp: %s" % benchlib.command_output(["cp", "--version"]).split("\n")[0],
             "rsync: %s" % " ".join(benchlib.command_output(["rsync", "--version"]).split("\n")[0].split())]
    if PSYNC.exists():
        lines.append("psync: github.com/hweidner/psync 3f9e42a (built by setup_tree_tools.sh with %s)"
                     % benchlib.command_output(["/usr/local/go/bin/go", "version"]))
    else:
        lines.append("psync: not built (setup_tree_tools.sh could not build it); its figures are quoted, not measured")
    if PARSYNC.exists():
        lines.append("parsync: %s, github.com/Saphereye/parsync 3d576d1 (built by setup_tree_tools.sh)"
                     % benchlib.command_output([str(PARSYNC), "--version"]))
    else:
        lines.append("parsync: not built (setup_tree_tools.sh could not build it); "
                     "its figures are quoted, not measured")
    if ours is not None:
        revision = benchlib.command_output(["git", "-C", str(benchlib.REPO_ROOT), "describe", "--always", "--dirty"])
        lines.append("pdiffcopy: %s -m pdiffcopy from %s, git %s" % (sys.executable, benchlib.REPO_ROOT, revision))
    if baseline is not None:
        lines.append("baseline (--baseline %s): %s" % (args.baseline, baseline.description))
    return lines


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Workloads, tools and method: see the top of %s." % Path(__file__).name)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        type=lambda text: benchlib.parse_name_list(text, WORKLOADS),
                        help="comma separated, from %s (default: both)" % ",".join(WORKLOADS))
    parser.add_argument("--tools", default=",".join(FAMILIES),
                        type=lambda text: benchlib.parse_name_list(text, FAMILIES),
                        help="comma separated, from %s (default: all)" % ",".join(FAMILIES))
    parser.add_argument("--rounds", default=3, type=int, help="timed runs per tool and operation (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help="psync workload at a tenth (6,000 files, 89 MB); no results file unless --output")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR, type=Path,
                        help="where the trees live (ext4 here; default %(default)s)")
    parser.add_argument("--seed", default=benchlib.DEFAULT_SEED, type=int, help="seed of the generated trees")
    parser.add_argument("--psync-threads", default=16, type=int, help="psync -threads (default 16, as quoted)")
    parser.add_argument("--parsync-threads", default=4, type=int, help="parsync -t (default 4, as in its benchmark)")
    parser.add_argument("--baseline", metavar="REV", default=None,
                        help="also measure our pdiffcopy at git revision REV (client and server), beside today's, "
                        "with an ours/baseline column")
    parser.add_argument("--ours-args", default="--no-progress -q", type=shlex.split,
                        help="options of our client besides -a (default: %(default)s)")
    parser.add_argument("--ours-server-args", default="-c 2", type=shlex.split,
                        help="options of our server besides --root and --listen (default: %(default)s)")
    parser.add_argument("--copy-warmup", default="auto", choices=("auto", "run", "memory"),
                        help="before each timed copy: an untimed copy of the same tool (run) or only memory "
                        "faulted in (memory); auto: run on tmpfs, memory on ext4 (default)")
    parser.add_argument("--max-fs-wait", default=180.0, type=float,
                        help="seconds an ext4 round may wait for file creation to be fast again (default 180)")
    parser.add_argument("--run-timeout", default=900.0, type=float, help="seconds before a tool run is killed")
    parser.add_argument("--delete-now", action="store_true",
                        help="delete the ext4 targets before exiting (default: in the background after the report)")
    parser.add_argument("--no-setup", action="store_true", help="do not run setup_tree_tools.sh for missing tools")
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the report here (default: %s, none with --quick); '-' for none"
                        % DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.output is None:
        args.output = None if args.quick else DEFAULT_OUTPUT
    elif str(args.output) == "-":
        args.output = None
    args.workdir = args.workdir.absolute()
    return args


def check_space(args, specs: List[WorkloadSpec], num_copies: int) -> None:
    """Fail early when the ext4 workload's targets (kept until its end) would not fit."""
    for spec in specs:
        if spec.tmpfs:
            continue
        per_copy = spec.total_bytes + spec.files * 4096 + spec.dirs * 4096
        needed = per_copy * num_copies * args.rounds * (2 if args.copy_warmup == "run" else 1) + 2 * per_copy
        free = shutil.disk_usage(args.workdir).free
        if needed > free * 0.9:
            raise BenchmarkError("the %s workload needs about %.1f GB in %s, %.1f GB are free: use fewer --rounds or "
                                 "--tools" % (spec.name, needed / 1e9, args.workdir, free / 1e9))


def main(argv=None) -> int:
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    benchlib.RUN_TIMEOUT = args.run_timeout
    args.workdir.mkdir(parents=True, exist_ok=True)
    command_line = "python3 benchmarks/tree_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    started = datetime.now(timezone.utc).astimezone()
    start_load = benchlib.load_averages()
    machine = benchlib.machine_description(args.workdir)
    log(machine)

    missing = [p for p, family in ((PSYNC, "psync"), (PARSYNC, "parsync")) if family in args.tools and not p.exists()]
    if missing and not args.no_setup:
        log("building psync/parsync with %s" % SETUP_TREE_TOOLS)
        subprocess.run(["bash", str(SETUP_TREE_TOOLS)], check=False)

    # A deletion still running from an earlier run would compete with every timing.
    DeletionClock(args.workdir).wait_for_deleter()

    ours = baseline = None
    args.ours_ready, args.ours_reason = False, "not selected"
    args.baseline_ready, args.baseline_reason = False, "not selected"
    if "ours" in args.tools:
        ours, args.ours_ready, args.ours_reason = probe_ours(args)
        log("our pdiffcopy -a: %s" % ("ready" if args.ours_ready else "NOT AVAILABLE: " + args.ours_reason))
        if args.baseline:
            try:
                baseline = benchlib.baseline_installation(args.baseline, args.workdir / "baseline")
                baseline, args.baseline_ready, args.baseline_reason = probe_ours(args, baseline)
            except BenchmarkError as error:
                args.baseline_reason = str(error)
            log("pdiffcopy -a at %s: %s" % (args.baseline, "ready" if args.baseline_ready
                                             else "NOT AVAILABLE: " + args.baseline_reason))

    clock = DeletionClock(args.workdir)
    try:
        return measure_and_report(args, clock, ours, machine, command_line, started, start_load, baseline)
    finally:
        clock.start_deleter(args.delete_now)


def measure_and_report(args, clock: DeletionClock, ours, machine: str, command_line: str, started: datetime,
                       start_load: str, baseline=None) -> int:
    """Measure the chosen workloads, then print and write the report; returns the exit status."""
    specs = [workload_spec(name, args.quick) for name in args.workloads]
    sections: List[str] = []
    all_medians: Dict[str, Dict] = {}
    try:
        for spec in specs:
            ws = make_workspace(spec, args, clock)
            try:
                daemon = benchlib.RsyncDaemon(args.workdir / "state" / spec.name / "rsyncd",
                                              {"src": ws.src, "run": ws.run}, writable={"run"})
                our_server = None
                if args.ours_ready:
                    our_server = benchlib.OursServer(args.workdir / "state" / spec.name / "ours", ours, ws.root,
                                                     args.ours_server_args)
                baseline_server = None
                if args.baseline_ready:
                    baseline_server = benchlib.OursServer(args.workdir / "state" / spec.name / "baseline", baseline,
                                                          ws.root, args.ours_server_args)
                tools = make_tools(args, ws, daemon, our_server, ours, baseline_server, baseline)
                check_space(args, [spec], sum(1 for t in tools if t.available and t.copy))
                log("scanning and hashing the source sample")
                expected = expected_of(ws.src)
                runner = Runner(args, ws, tools, expected)
                with contextlib.ExitStack() as stack:
                    if any(t.available and t.family == "rsyncd" for t in tools):
                        stack.enter_context(daemon)
                    for server in (our_server, baseline_server):
                        if server is not None:
                            stack.enter_context(server)
                    if not spec.tmpfs:
                        clock.wait()
                    runner.rounds()
                section, medians = workload_report(runner)
                sections.append(section)
                all_medians[spec.name] = medians
                log(section)
            finally:
                release_workspace(ws, clock)
    except BenchmarkError as error:
        log("BENCHMARK FAILED: %s" % error)
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130

    header = ["Tree copy and no-change sync benchmark, %s" % started.strftime("%Y-%m-%d %H:%M %Z"),
              "Command: %s" % command_line, machine,
              "Load average (1, 5, 15 min): %s at the start, %s at the end." % (start_load, benchlib.load_averages())]
    header += versions(args, ours, baseline)
    if "ours" in args.tools and not args.ours_ready:
        header.append("pdiffcopy -a: not available: %s" % args.ours_reason)
    if args.baseline and not args.baseline_ready:
        header.append("pdiffcopy -a at %s: not available: %s" % (args.baseline, args.baseline_reason))
    header.append("Quoted = the issue's figures from another 2-core machine (warm cache), for comparison; "
                  "'/ X' = this row's median over X's median"
                  + ("; '/ baseline' = today's row over the same row at %s." % args.baseline if args.baseline else "."))
    report = "\n".join(header) + "\n" + "".join(sections) + targets_report(all_medians, args.ours_ready,
                                                                         args.ours_reason, args.tools)
    print(report, end="")
    if args.output:
        args.output.write_text(report)
        log("report written to %s" % args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

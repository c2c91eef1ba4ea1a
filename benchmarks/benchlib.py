"""Shared plumbing of the pdiffcopy benchmarks: test data, servers, tools, timing, reports.

Everything here uses public tools only (rsync, cp, curl, the original pdiffcopy 1.0.1 from
PyPI) and talks to servers on 127.0.0.1 only. See README.rst for how the scripts use it.
"""

import argparse
import contextlib
import hashlib
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

# The workload mutates whole 1 MiB blocks, which is also the block size of both
# pdiffcopy versions, so a mutated block never straddles two of their blocks.
BLOCK_SIZE = 1024 * 1024

# A fixed seed makes the source, the mutated block positions and their contents the same
# in every run, so results of different runs and machines compare like for like.
DEFAULT_SEED = 20200306

# Deltas of the workload, in percent of the 1 MiB blocks overwritten.
DEFAULT_DELTAS = (0, 10, 50, 100)

# Kernel copies and hashing go in 1 MiB steps: the machine notes show writes of 128 KiB to
# 1 MiB per call are fast here while 4 MiB writes into new files are several times slower.
IO_CHUNK = 1024 * 1024

# Servers start in about a second; allow plenty for a loaded 2-core machine before failing.
SERVER_START_TIMEOUT = 60.0

# How often to try connecting to a starting server: short enough to add no visible delay.
PORT_POLL_INTERVAL = 0.05

# A server gets this long to exit after SIGTERM (gunicorn stops its workers gracefully)
# before its whole process group is killed.
SERVER_STOP_TIMEOUT = 10.0

# No single sync of a few GiB takes an hour here; a run that does has hung, and the harness
# must end rather than wait forever.
RUN_TIMEOUT = 3600.0

# Where the original pdiffcopy 1.0.1 is installed by setup_original.sh.
ORIGINAL_VENV = BENCH_DIR / ".venv-original"
SETUP_ORIGINAL = BENCH_DIR / "setup_original.sh"

# rsync options of the issue: update the target in place, use the delta algorithm even
# between local paths, and never skip a file because its size and time look unchanged.
RSYNC_OPTIONS = ("--inplace", "--no-whole-file", "--ignore-times")

# Tool families that can be chosen with --tools, in the order of the report's columns;
# cp and curl are whole-file copies, measured as references.
# "baseline": our pdiffcopy at an earlier revision (--baseline REV), measured in the same run.
FAMILIES = ("rsync", "original", "baseline", "ours", "cp", "curl")
DIRECTIONS = ("pull", "push")


class BenchmarkError(Exception):
    """A benchmark cannot go on (a tool failed, a result is wrong, a server did not start)."""


# --------------------------------------------------------------------------- small helpers


def log(message: str) -> None:
    """Print a progress message to stderr, at once (stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """Parse a size like ``64M``, ``1G``, ``1GiB`` or ``4096`` into bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError("invalid size %r (expected e.g. 64M, 1G, 4GiB)" % text)
    number, unit = match.groups()
    return int(float(number) * 1024 ** "_KMGT".index(unit.upper() or "_"))


def format_size(num_bytes: int) -> str:
    """Format a byte count compactly in binary units (``64 MiB``, ``1 GiB``)."""
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return "%i %s" % (num_bytes // scale, unit)
    return "%i bytes" % num_bytes


def parse_int_list(text: str) -> List[int]:
    """Parse a comma separated list of integers such as ``0,10,50,100``."""
    return [int(item) for item in text.split(",") if item.strip()]


def parse_name_list(text: str, allowed) -> List[str]:
    """Parse a comma separated list of names, each of which must be in `allowed`."""
    names = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError("unknown %s (choose from %s)" % (", ".join(unknown), ", ".join(allowed)))
    return names


def command_output(command: List[str]) -> str:
    """Return the stripped stdout of a short informational command, or '?' if it fails."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


# --------------------------------------------------------------------------- machine facts


def machine_description(work_dir: Path) -> str:
    """One line naming the machine: cores, CPU model, kernel, Python, file system of `work_dir`."""
    cpu_model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    memory = "?"
    with contextlib.suppress(OSError, ValueError):
        total_kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = "%.1f GiB" % (total_kib / 1024 ** 2)
    findmnt = ["findmnt", "--noheadings", "--output", "FSTYPE,SOURCE,OPTIONS", "--target", str(work_dir)]
    file_system = " ".join(command_output(findmnt).split())
    return "Machine: nproc=%s, CPU=%s, memory=%s, kernel=%s, Python %s, work dir %s on %s" % (
        os.cpu_count(),
        cpu_model,
        memory,
        platform.release(),
        platform.python_version(),
        work_dir,
        file_system,
    )


def load_averages() -> str:
    """The 1, 5 and 15 minute load averages now: other work on the 2 cores skews timings."""
    return "%.2f %.2f %.2f" % os.getloadavg()


# --------------------------------------------------------------------------- test data


def copy_file(source: Path, target: Path) -> None:
    """Copy `source` to a new file `target` inside the kernel (``copy_file_range``)."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        while os.copy_file_range(src.fileno(), dst.fileno(), IO_CHUNK):
            pass


def sha256_file(path: Path) -> str:
    """Return the hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        for chunk in iter(lambda: handle.read(IO_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_through(path: Path) -> None:
    """Read a file once so that it is in the page cache (idle cache is paged out after ~1 min)."""
    buffer = bytearray(IO_CHUNK)
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass


def generate_source(path: Path, size: int, seed: int) -> None:
    """Write `size` deterministic random bytes (seeded) to `path`, in 1 MiB writes."""
    rng = random.Random("source-%i" % seed)
    with open(path, "wb") as handle:
        for offset in range(0, size, BLOCK_SIZE):
            handle.write(rng.randbytes(min(BLOCK_SIZE, size - offset)))


def make_mutated_copy(source: Path, target: Path, percent: int, seed: int) -> int:
    """
    Copy `source` to `target` and overwrite `percent` % of its 1 MiB blocks with random bytes.

    Positions and contents come from a generator seeded with `seed` and `percent`, so the
    same arguments give the same file. Returns the number of blocks overwritten.
    """
    size = source.stat().st_size
    num_blocks = -(-size // BLOCK_SIZE)
    num_mutated = round(num_blocks * percent / 100)
    rng = random.Random("delta-%i-%i" % (seed, percent))
    copy_file(source, target)
    with open(target, "r+b") as handle:
        for index in sorted(rng.sample(range(num_blocks), num_mutated)):
            offset = index * BLOCK_SIZE
            handle.seek(offset)
            handle.write(rng.randbytes(min(BLOCK_SIZE, size - offset)))
    return num_mutated


def fresh_target(base: Path, target: Path, copy_base: bool) -> None:
    """Replace `target` by a copy of `base` (or by nothing, for tools that create the file).

    The copy is flushed to disk before the tool starts, as a target that has been on a
    host for a while is: left dirty, the first tool that flushes (pdiffcopy does, rsync
    does not) would pay for writing back the benchmark's own copy of the whole file
    (0.38 s of a 0.90 s sparse pull of 1 GiB on the shaped link).
    """
    target.unlink(missing_ok=True)
    if copy_base:
        copy_file(base, target)
        with open(target, "rb") as handle:
            os.fsync(handle.fileno())


def verify_copy(path: Path, expected_sha256: str, expected_size: int, what: str) -> None:
    """Raise :class:`BenchmarkError` unless `path` has the expected size and SHA-256."""
    if not path.exists():
        raise BenchmarkError("VERIFICATION FAILED for %s: %s does not exist" % (what, path))
    size = path.stat().st_size
    if size != expected_size:
        raise BenchmarkError(
            "VERIFICATION FAILED for %s: %s has %i bytes, expected %i" % (what, path, size, expected_size)
        )
    actual = sha256_file(path)
    if actual != expected_sha256:
        raise BenchmarkError(
            "VERIFICATION FAILED for %s: sha256 of %s is %s, expected %s" % (what, path, actual, expected_sha256)
        )


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """Ask the kernel for a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(path: Path, lines: int = 15) -> str:
    """Return the last `lines` lines of a log file, for error messages."""
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def kill_group(process: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group led by `process` (started with its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def start_process(command: List[str], log_path: Path, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """
    Start `command` in a new session (its own process group), output going to `log_path`.

    The own process group lets the harness stop a server with all its workers, and keeps a
    Ctrl-C in the terminal from reaching the tool before the harness can clean up.
    """
    with open(log_path, "ab") as log_file:
        log_file.write(("$ %s\n" % shlex.join(command)).encode())
        log_file.flush()
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
            start_new_session=True
        )


def wait_rusage(process: subprocess.Popen, timeout: Optional[float] = None):
    """
    Wait for `process` and return its ``resource.struct_rusage`` (from ``wait4``).

    ``ru_maxrss`` of it is the peak RSS in KiB of the largest single process among the
    child and the descendants it waited for, as ``/usr/bin/time -v`` reports it. The wait
    blocks in the kernel, so it adds no polling delay to a timing; after `timeout` seconds a
    timer kills the process group, and once the process is reaped
    :class:`subprocess.TimeoutExpired` is raised.
    """
    timed_out = threading.Event()

    def expire():
        timed_out.set()
        kill_group(process, signal.SIGKILL)

    timer = threading.Timer(timeout, expire) if timeout is not None else None
    if timer:
        timer.start()
    try:
        _, status, rusage = os.wait4(process.pid, 0)
    finally:
        if timer:
            timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(process.args, timeout)
    return rusage


@dataclass
class RunResult:
    """Wall time and kernel figures of one finished tool run."""

    seconds: float
    max_rss_kib: int
    #: User and system CPU seconds of the tool and every descendant it waited for.
    cpu_seconds: float = 0.0


def run_tool(
    command: List[str],
    log_path: Path,
    env: Optional[Dict[str, str]] = None,
    on_start: Optional[Callable[[subprocess.Popen], None]] = None,
) -> RunResult:
    """
    Run one tool invocation to completion and return its wall time, as a user would see it.

    The clock covers the whole process, start-up included. `on_start` is called with the
    started process (the memory benchmark uses it to watch the process). A non-zero exit
    raises :class:`BenchmarkError` with the end of the log; any exception (Ctrl-C too) kills
    the tool's process group first so that nothing is left behind.
    """
    started = time.perf_counter()
    process = start_process(command, log_path, env)
    try:
        if on_start:
            on_start(process)
        rusage = wait_rusage(process, RUN_TIMEOUT)
    except BaseException:
        kill_group(process, signal.SIGKILL)
        process.wait()
        raise
    elapsed = time.perf_counter() - started
    # Children the tool left running (it should leave none) must not outlive the run.
    kill_group(process, signal.SIGKILL)
    if process.returncode != 0:
        raise BenchmarkError(
            "command failed with exit status %s: %s\n%s" % (process.returncode, shlex.join(command), tail(log_path))
        )
    return RunResult(seconds=elapsed, max_rss_kib=rusage.ru_maxrss,
                     cpu_seconds=rusage.ru_utime + rusage.ru_stime)


def install_signal_handlers() -> None:
    """Turn SIGTERM and SIGHUP into SystemExit so that every ``finally`` stops its servers."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


# --------------------------------------------------------------------------- servers


class Server:
    """
    A server process on 127.0.0.1, started in its own process group and always stopped.

    It keeps its port for its lifetime, so it can be stopped and started again (the memory
    benchmark does that to measure each sync with a fresh server).
    """

    name = "server"

    def __init__(self, state_dir: Path):
        """Prepare a server whose configuration and log live in `state_dir`."""
        self.state_dir = state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = state_dir / "server.log"
        self.port = free_port()
        self.process: Optional[subprocess.Popen] = None
        self.exit_rusage = None

    def command(self) -> List[str]:
        """The command line that starts the server in the foreground."""
        raise NotImplementedError

    def environment(self) -> Optional[Dict[str, str]]:
        """The environment of the server process (None: inherit the harness's)."""
        return None

    def start(self) -> "Server":
        """Start the server and wait until it accepts connections."""
        log("starting %s on 127.0.0.1:%i" % (self.name, self.port))
        self.exit_rusage = None
        self.process = start_process(self.command(), self.log_path, self.environment())
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise BenchmarkError("%s exited during start-up:\n%s" % (self.name, tail(self.log_path)))
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            if time.monotonic() > deadline:
                raise BenchmarkError("%s did not accept connections:\n%s" % (self.name, tail(self.log_path)))
            time.sleep(PORT_POLL_INTERVAL)

    def stop(self) -> None:
        """Stop the server: SIGTERM, then SIGKILL to its whole process group if it lingers."""
        if self.process is None or self.process.returncode is not None:
            return
        kill_group(self.process, signal.SIGTERM)
        try:
            self.exit_rusage = wait_rusage(self.process, SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            # wait_rusage() has killed the process group and reaped the server by now.
            log("%s did not stop within %.0f s of SIGTERM: killed" % (self.name, SERVER_STOP_TIMEOUT))
        # Workers that outlived their master are still in the group.
        kill_group(self.process, signal.SIGKILL)

    def __enter__(self) -> "Server":
        """Start the server (see :meth:`start`)."""
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        """Stop the server (see :meth:`stop`)."""
        self.stop()


class RsyncDaemon(Server):
    """An rsync daemon with one module per directory; a module is writable if asked."""

    name = "rsync daemon"

    def __init__(self, state_dir: Path, modules: Dict[str, Path], writable=()):
        """Serve each directory of `modules` under its name; names in `writable` accept pushes."""
        super().__init__(state_dir)
        lines = [
            "address = 127.0.0.1",
            "port = %i" % self.port,
            # Run as whoever runs the harness (root is fine) and without chroot, as the issue asks.
            "uid = %i" % os.getuid(),
            "gid = %i" % os.getgid(),
            "use chroot = no",
            # No network but loopback here: never wait for a DNS lookup of the client.
            "reverse lookup = no",
            "log file = %s" % (state_dir / "rsyncd.log"),
        ]
        for module, path in modules.items():
            lines += ["[%s]" % module, "path = %s" % path, "read only = %s" % ("no" if module in writable else "yes")]
        self.config_path = state_dir / "rsyncd.conf"
        self.config_path.write_text("\n".join(lines) + "\n")

    def command(self) -> List[str]:
        """``rsync --daemon --no-detach`` with this daemon's own configuration file."""
        return ["rsync", "--daemon", "--no-detach", "--config=%s" % self.config_path]

    def url(self, module: str, name: str) -> str:
        """The rsync URL of file `name` in `module`."""
        return "rsync://127.0.0.1:%i/%s/%s" % (self.port, module, name)


class GunicornEnvironmentMixin:
    """Gives a gunicorn-based server a private XDG_RUNTIME_DIR."""

    def environment(self) -> Dict[str, str]:
        """The harness's environment, with XDG_RUNTIME_DIR set to the server's own directory.

        gunicorn 25.1 and later create a control socket in $XDG_RUNTIME_DIR (else in
        ~/.gunicorn), shared by all gunicorn servers of the user unless redirected.
        """
        return dict(os.environ, XDG_RUNTIME_DIR=str(self.state_dir))


class OriginalServer(GunicornEnvironmentMixin, Server):
    """The original pdiffcopy 1.0.1 server (gunicorn + flask); it serves absolute paths."""

    name = "original pdiffcopy server"

    def __init__(self, state_dir: Path, program: Path):
        """Prepare the server of the original `program` (``.venv-original/bin/pdiffcopy``)."""
        super().__init__(state_dir)
        self.program = program

    def command(self) -> List[str]:
        """``pdiffcopy -l 127.0.0.1:PORT``: no positional arguments starts its server."""
        return [str(self.program), "--listen=127.0.0.1:%i" % self.port]

    def url(self, path: Path) -> str:
        """The original's URL form: ``http://HOST:PORT`` followed by the absolute path."""
        return "http://127.0.0.1:%i%s" % (self.port, Path(path).absolute())


class OursServer(GunicornEnvironmentMixin, Server):
    """The pdiffcopy server of this repository, confined to a root directory."""

    name = "our pdiffcopy server"

    def __init__(self, state_dir: Path, ours: "OursInstallation", root: Path, extra_args: List[str]):
        """Prepare our server serving `root`, with `extra_args` appended to its command line."""
        super().__init__(state_dir)
        self.ours = ours
        self.root = root
        self.extra_args = extra_args

    def command(self) -> List[str]:
        """``python3 -m pdiffcopy --listen 127.0.0.1:PORT --root DIR``."""
        return self.ours.command + ["--listen", "127.0.0.1:%i" % self.port, "--root", str(self.root)] + self.extra_args

    def environment(self) -> Dict[str, str]:
        """Our environment (PYTHONPATH reaching the repository) plus a private XDG_RUNTIME_DIR."""
        return dict(self.ours.env, XDG_RUNTIME_DIR=str(self.state_dir))

    def url(self, path: Path) -> str:
        """Our URL form: the path relative to the server's root."""
        return "http://127.0.0.1:%i/%s" % (self.port, Path(path).absolute().relative_to(self.root.absolute()))


# --------------------------------------------------------------------------- the programs


def find_original(install: bool = True) -> Path:
    """
    Return the original pdiffcopy 1.0.1 program, running setup_original.sh first if needed.

    Raises :class:`BenchmarkError` if it is missing and cannot be installed.
    """
    program = ORIGINAL_VENV / "bin" / "pdiffcopy"
    if not program.exists() and install:
        log("installing the original pdiffcopy 1.0.1 with %s" % SETUP_ORIGINAL)
        subprocess.run(["bash", str(SETUP_ORIGINAL), str(ORIGINAL_VENV)], check=True)
    if not program.exists():
        raise BenchmarkError("the original pdiffcopy is not installed: run %s" % SETUP_ORIGINAL)
    return program


@dataclass
class OursInstallation:
    """How to run the pdiffcopy of this repository: command prefix, environment, description."""

    command: List[str]
    env: Dict[str, str]
    description: str


def find_ours() -> "tuple[Optional[OursInstallation], str]":
    """
    Locate our pdiffcopy: ``python3 -m pdiffcopy`` with the repository first on PYTHONPATH.

    Returns ``(installation, description)``, or ``(None, reason)`` when the package is
    missing or cannot be imported yet (it is being written concurrently), so that callers
    can skip it with a message.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    probe = (
        "import importlib.util, pdiffcopy; "
        "print(pdiffcopy.__file__); print(getattr(pdiffcopy, '__version__', '?')); "
        "print(importlib.util.find_spec('pdiffcopy.__main__') is not None)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or ["?"])[-1]
        return None, "our pdiffcopy cannot be imported (%s)" % last_line
    module_file, version, has_main = result.stdout.split("\n")[:3]
    if has_main != "True":
        return None, "our pdiffcopy at %s has no __main__ module yet" % module_file
    if REPO_ROOT not in Path(module_file).resolve().parents and version == "1.0.1":
        return None, "'import pdiffcopy' finds the original 1.0.1 at %s, not ours" % module_file
    precompile(Path(module_file).parent)
    description = "our pdiffcopy %s (%s, %s -m pdiffcopy)" % (version, Path(module_file).parent, sys.executable)
    return OursInstallation([sys.executable, "-m", "pdiffcopy"], env, description), description


def precompile(package: Path) -> None:
    """
    Write the bytecode of `package`, as ``pip install`` does for an installed package.

    Without it, under ``PYTHONDONTWRITEBYTECODE=1`` (set on these machines) every run
    compiles every module it imports again, 30 to 60 ms that grow with the code's size
    and that no installed copy pays; a before/after comparison would measure that.
    """
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)


def baseline_installation(revision: str, work_dir: Path) -> OursInstallation:
    """
    Our pdiffcopy as it was at `revision`: its package extracted with ``git archive`` into
    `work_dir`, run as ``python3 -P -m pdiffcopy`` with that copy first on PYTHONPATH.

    Before/after comparisons then run both in one benchmark, on the same data and load.
    """
    tree = work_dir / ("baseline-%s" % revision.replace("/", "_"))
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", revision, "pdiffcopy"], capture_output=True)
    if archive.returncode != 0:
        raise BenchmarkError("git archive %s failed: %s" % (revision, archive.stderr.decode(errors="replace").strip()))
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    precompile(tree / "pdiffcopy")
    commit = command_output(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", revision])
    env = dict(os.environ, PYTHONPATH=str(tree))
    # ``python -m`` puts the working directory first on the module path: run from the
    # repository, it would import today's package, not the baseline's, and compare a
    # revision with itself. -P (Python 3.11+) leaves it out; older ones drop it by hand.
    if sys.version_info >= (3, 11):
        command = [sys.executable, "-P", "-m", "pdiffcopy"]
    else:
        command = [sys.executable, "-c", "import runpy, sys; del sys.path[0]; "
                   "runpy.run_module('pdiffcopy', run_name='__main__', alter_sys=True)"]
    probe = "import sys; del sys.path[0]; import pdiffcopy; print(pdiffcopy.__file__)"
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if tree.resolve() not in Path(found.stdout.strip() or "/").resolve().parents:
        raise BenchmarkError("the baseline at %s imports %s, not its own package"
                             % (revision, found.stdout.strip() or found.stderr.strip()))
    description = "our pdiffcopy at git %s (%s, %s)" % (commit, tree / "pdiffcopy", " ".join(command[1:3]))
    return OursInstallation(command, env, description)


def tool_versions(families: List[str], original: Optional[Path], ours_description: Optional[str]) -> List[str]:
    """Lines naming the versions of the chosen tools, for the report header."""
    lines = []
    if "rsync" in families:
        lines.append("rsync: %s" % " ".join(command_output(["rsync", "--version"]).split("\n")[0].split()))
    if "curl" in families and ours_description:
        lines.append("curl: %s" % command_output(["curl", "--version"]).split("\n")[0])
    if original is not None:
        freeze = command_output([str(original.parent / "python"), "-m", "pip", "freeze", "--disable-pip-version-check"])
        wanted = ("pdiffcopy", "gunicorn", "flask", "requests", "werkzeug")
        pins = [line for line in freeze.split("\n") if line.split("==")[0].lower() in wanted]
        python = command_output([str(original.parent / "python"), "--version"])
        lines.append("original: %s, %s" % (", ".join(pins), python))
    if ours_description:
        revision = command_output(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"])
        lines.append("ours: %s, git %s" % (ours_description, revision))
    return lines


# --------------------------------------------------------------------------- tools


@dataclass
class Tool:
    """
    One way of making the target equal to the source, measured as one column.

    `command` maps the target path of a run to the command line. `needs_target` says
    whether each run starts from a fresh copy of the mutated file (delta tools) or from no
    file at all (whole-file reference copies). `server` is the server the tool talks to.
    """

    name: str
    family: str
    direction: str
    command: Callable[[Path], List[str]]
    needs_target: bool = True
    env: Optional[Dict[str, str]] = None
    server: Optional[Server] = None


@dataclass
class Setup:
    """The servers and tools of one benchmark, with the skip messages of tools left out."""

    tools: List[Tool] = field(default_factory=list)
    servers: List[Server] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    versions: List[str] = field(default_factory=list)


def rsync_tools(daemon: RsyncDaemon, source: Path, directions: List[str], extra_args: List[str]) -> List[Tool]:
    """rsync (with `extra_args`) pulling `source` from module ``data`` and pushing it into ``run``."""
    rsync = ["rsync", *RSYNC_OPTIONS, *extra_args]

    def pull(target: Path) -> List[str]:
        return rsync + [daemon.url("data", source.name), str(target)]

    def push(target: Path) -> List[str]:
        return rsync + [str(source), daemon.url("run", target.name)]

    commands = {"pull": pull, "push": push}
    return [Tool("rsync-" + d, "rsync", d, commands[d], server=daemon) for d in DIRECTIONS if d in directions]


def pdiffcopy_tools(family, server, prefix: List[str], source: Path, directions: List[str], env=None) -> List[Tool]:
    """
    A pdiffcopy client (`prefix`: program and options) pulling from and pushing to `server`.

    Both versions take ``SOURCE TARGET`` with one of them a URL of the server; only the URL
    form differs, and ``server.url()`` knows it.
    """

    def pull(target: Path) -> List[str]:
        return prefix + [server.url(source), str(target)]

    def push(target: Path) -> List[str]:
        return prefix + [str(source), server.url(target)]

    commands = {"pull": pull, "push": push}
    return [
        Tool(family + "-" + d, family, d, commands[d], env=env, server=server) for d in DIRECTIONS if d in directions
    ]


def whole_file_fetch(server: "OursServer", source: Path) -> Callable[[Path], List[str]]:
    """curl downloading all of `source` from our server with one plain GET (a reference)."""

    def fetch(target: Path) -> List[str]:
        return ["curl", "--silent", "--show-error", "--fail", "-o", str(target), server.url(source)]

    return fetch


def local_copy(source: Path) -> Callable[[Path], List[str]]:
    """cp of `source` into a new file (a reference: the cost of writing the whole file)."""

    def copy(target: Path) -> List[str]:
        return ["cp", str(source), str(target)]

    return copy


def build_setup(
    families: List[str],
    directions: List[str],
    work_dir: Path,
    source: Path,
    run_dir: Path,
    original_args: List[str],
    ours_args: List[str],
    ours_server_args: List[str],
    rsync_args: List[str],
    baseline: Optional[str] = None,
) -> Setup:
    """
    Create (without starting) the servers and the tools for the chosen families and directions.

    Every server serves `source` for pulls and accepts pushes into `run_dir`, where the
    targets of all runs live. Families whose program is missing are left out with a note.
    `baseline` (a git revision) adds our pdiffcopy at that revision as the family "baseline".
    """
    setup = Setup()
    state_root = work_dir / "servers"
    original = ours = None
    ours_description = None
    if "original" in families:
        original = find_original()
    if "ours" in families or "curl" in families:
        ours, ours_description = find_ours()
        if ours is None:
            skipped = " and ".join(family for family in ("ours", "curl") if family in families)
            setup.notes.append("skipped %s: %s" % (skipped, ours_description))
            log("SKIPPING %s: %s" % (skipped, ours_description))
            ours_description = None
    setup.versions = tool_versions(families, original, ours_description)
    if baseline and "baseline" in families:
        before = baseline_installation(baseline, work_dir)
        setup.versions.append("baseline: %s" % before.description)
        before_server = OursServer(state_root / "baseline", before, work_dir, ours_server_args)
        setup.servers.append(before_server)
        setup.tools += pdiffcopy_tools("baseline", before_server, before.command + ours_args, source, directions,
                                       before.env)

    if "rsync" in families:
        daemon = RsyncDaemon(state_root / "rsyncd", {"data": source.parent, "run": run_dir}, writable={"run"})
        setup.servers.append(daemon)
        setup.tools += rsync_tools(daemon, source, directions, rsync_args)
    if original is not None:
        original_server = OriginalServer(state_root / "original", original)
        setup.servers.append(original_server)
        setup.tools += pdiffcopy_tools("original", original_server, [str(original)] + original_args, source, directions)
    if ours is not None:
        our_server = OursServer(state_root / "ours", ours, work_dir, ours_server_args)
        setup.servers.append(our_server)
        if "ours" in families:
            setup.tools += pdiffcopy_tools("ours", our_server, ours.command + ours_args, source, directions, ours.env)
        if "curl" in families:
            fetch = whole_file_fetch(our_server, source)
            setup.tools.append(Tool("curl", "curl", "copy", fetch, needs_target=False, server=our_server))
    if "cp" in families:
        setup.tools.append(Tool("cp", "cp", "copy", local_copy(source), needs_target=False))
    return setup


# --------------------------------------------------------------------------- statistics and tables


def median_and_best(samples: List[float]) -> "tuple[float, float]":
    """The median and the minimum of a list of timings."""
    return statistics.median(samples), min(samples)


def format_seconds(value: Optional[float]) -> str:
    """Seconds with two decimals, or 'n/a'."""
    return "n/a" if value is None else "%.2f" % value


def format_ratio(numerator: Optional[float], denominator: Optional[float]) -> str:
    """A ratio with two decimals and an 'x', or 'n/a' when either side is missing."""
    if numerator is None or not denominator:
        return "n/a"
    return "%.2fx" % (numerator / denominator)


def markdown_table(header: List[str], rows: List[List[str]]) -> str:
    """Render a GitHub-style markdown table with right-aligned numeric columns."""
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]

    def render(cells):
        return "| " + " | ".join(str(cell).rjust(width) for cell, width in zip(cells, widths)) + " |"

    separator = "|" + "|".join("-" * (width + 1) + ":" for width in widths) + "|"
    return "\n".join([render(header), separator] + [render(row) for row in rows])


# --------------------------------------------------------------------------- the scripts' frame

# Inside a script's work directory: the source and mutated base files, the targets of the
# runs (also where pushes land), and one log per tool.
SOURCE_NAME = "source.img"


@dataclass
class WorkDirs:
    """The temporary directory of one benchmark run and its parts."""

    root: Path
    data: Path
    run: Path
    logs: Path

    @classmethod
    def make(cls, parent: Path, prefix: str) -> "WorkDirs":
        """A new temporary directory under ``parent`` with its data, run and logs directories."""
        root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent)).resolve()
        dirs = cls(root=root, data=root / "data", run=root / "run", logs=root / "logs")
        for directory in (dirs.data, dirs.run, dirs.logs):
            directory.mkdir()
        return dirs

    @property
    def source(self) -> Path:
        """The source file that every tool copies."""
        return self.data / SOURCE_NAME

    def base(self, delta: int) -> Path:
        """The mutated base file of `delta` %, copied to make each run's fresh target."""
        return self.data / ("delta-%03d.img" % delta)


def add_common_arguments(parser, families, default_families) -> None:
    """Add the options both scripts share: tools, directions, seed, tool options, work dir, output."""
    parser.add_argument(
        "--tools",
        default=",".join(default_families),
        type=lambda text: parse_name_list(text, families),
        help="comma separated tools from %s (default %s)" % (",".join(families), ",".join(default_families)),
    )
    parser.add_argument(
        "--directions",
        default=",".join(DIRECTIONS),
        type=lambda text: parse_name_list(text, DIRECTIONS),
        help="pull, push or both (default pull,push)",
    )
    parser.add_argument("--seed", default=DEFAULT_SEED, type=int, help="seed of the test data")
    parser.add_argument("--ours-args", default="", type=shlex.split, help="extra options for our pdiffcopy client")
    parser.add_argument("--ours-server-args", default="", type=shlex.split, help="extra options for our server")
    parser.add_argument("--original-args", default="", type=shlex.split, help="extra options for the original client")
    if "rsync" in families:
        parser.add_argument(
            "--rsync-args", default="", type=shlex.split, help="extra options for rsync, e.g. --fsync"
        )
    else:
        parser.set_defaults(rsync_args=[])
    parser.add_argument(
        "--workdir",
        default=Path(tempfile.gettempdir()),
        type=Path,
        help="directory in which a temporary data directory is made; its file system is part of "
        "what is measured (default %(default)s)",
    )
    parser.add_argument("--keep-data", action="store_true", help="keep the data directory at the end")
    parser.add_argument(
        "--baseline", metavar="REV", default=None,
        help="also measure our pdiffcopy at git revision REV (client and server), beside today's",
    )
    parser.add_argument("--output", type=Path, help="also write the report to this file")


def run_script(args, prefix: str, body: Callable[[Setup, WorkDirs, str], str]) -> int:
    """
    The frame of both scripts around `body`; returns the exit status.

    Makes a temporary work directory under ``args.workdir``, builds the servers and tools
    chosen by the common options, calls ``body(setup, dirs, machine_line)`` for the report,
    prints it (and writes it to ``--output``), and always removes the data files. The logs
    are kept when the benchmark failed, the whole directory with ``--keep-data``.
    """
    install_signal_handlers()
    args.workdir.mkdir(parents=True, exist_ok=True)
    dirs = WorkDirs.make(args.workdir, prefix)
    root = dirs.root
    machine = machine_description(root)
    log(machine)
    succeeded = False
    try:
        setup = build_setup(
            args.tools, args.directions, root, dirs.source, dirs.run,
            args.original_args, args.ours_args, args.ours_server_args, args.rsync_args,
            getattr(args, "baseline", None),
        )
        if not setup.tools:
            raise BenchmarkError("no tool left to measure")
        start_load = load_averages()
        report = body(setup, dirs, machine)
        report += "\nLoad average (1, 5, 15 min): %s at the start, %s at the end.\n" % (start_load, load_averages())
        print(report, end="")
        if args.output:
            args.output.write_text(report)
            log("report written to %s" % args.output)
        succeeded = True
        return 0
    except BenchmarkError as error:
        log("BENCHMARK FAILED: %s" % error)
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if args.keep_data:
            log("work directory kept: %s" % root)
        elif succeeded:
            shutil.rmtree(root)
        else:
            for image in root.rglob("*.img"):
                image.unlink()
            log("logs kept for a post-mortem in %s" % root)

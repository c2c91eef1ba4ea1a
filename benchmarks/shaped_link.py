#!/usr/bin/env python3
"""
Shaped-link benchmark: pdiffcopy, pdiffcopy 1.0.1 and rsync over a real, rate-limited link.

Loopback hides what bytes on the wire cost. Here the server runs in one network namespace
and the client in another, joined by a veth pair whose both ends are shaped with
``tc qdisc ... tbf`` (this kernel has tbf but no netem) to each rate of ``--rates``. For each
workload and tool the report gives the median wall time, the bytes that crossed the link
(both directions, from the veth counters: headers, hashes and retransmissions included)
and the efficiency: the rate the tool reached on the wire against the link's rate.

The ``*-ssh-*`` tools go through an OpenSSH server (``sshd``) started in the server's
namespace with throwaway keys: ``rsync -e ssh`` and ``pdiffcopy HOST:PATH`` then use the same
sshd, client and cipher (``--ssh-cipher``); ``ours-ssh-direct-*`` is ``pdiffcopy --direct``
(ssh starts the server, the data goes over TLS straight to it). For them the report adds the
CPU seconds of the ssh clients, of sshd (the remote program's own CPU taken out) and of the
remote program (with --direct, the server's TLS is in it), from small wrappers that record
what their child used. pdiffcopy's client does not wait for its ssh to end (only the remote
clean-up is left): the ssh wrapper runs in a session of its own, so that the run's end does not
kill it, and a run's CPU is read once every ssh it started has ended.

The issue-21 table (no change, sparse edits, 10 % dense, new random, new compressible against
rsync -z; ssh and --direct against rsync -e ssh) is::

    ours=ours-ssh-pull,ours-ssh-push,ours-ssh-direct-pull,ours-ssh-direct-push
    theirs=rsync-ssh-pull,rsync-ssh-push,rsync-ssh-z-pull,rsync-ssh-z-push
    benchmarks/shaped_link.py --workloads dense0,sparse,dense10,random,text --tools $ours,$theirs

Needs root and iproute2 (``ip``, ``tc``). Everything it creates (two namespaces, the veth
pair, the servers, the data) is removed at the end, also on Ctrl-C or an error. Every
result is checked by size and sha256 outside the timing. Run with --help for the options.
"""

import argparse
import contextlib
import itertools
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import benchlib
from benchlib import BLOCK_SIZE, BenchmarkError, log

# Addresses of the two ends; a /30 of the private 10/8 that nothing else here uses.
SERVER_IP = "10.213.7.1"
CLIENT_IP = "10.213.7.2"

# Fixed ports are safe: the namespaces are ours alone.
OURS_PORT, BASELINE_PORT, ORIGINAL_PORT, RSYNC_PORT, OURS_CDC_PORT, SSH_PORT = 8101, 8102, 8103, 8873, 8104, 8022
OURS_BLOCKS_PORT = 8105
# The port --direct's server listens on in the server's namespace.
DIRECT_PORT = 8106
# Seconds a run's ssh clients get to end after the client did (the remote clean-up).
SSH_END_SECONDS = 10

# The token bucket holds 10 ms of the rate (at least 64 KiB): tbf needs a bucket of at least
# one timer tick's worth of bytes to reach its rate, and a bigger one would let bursts
# through faster than the link.
BURST_SECONDS = 0.01
MIN_BURST = 64 * 1024
# Packets may wait this long in the shaper's queue before being dropped, as a router's
# buffer would hold them; TCP then sees the link's rate, not losses.
QUEUE_LATENCY = "50ms"

# Workloads: what the source is, and what the target holds before the run.
SHIFTED = "shift-"
WORKLOADS = ("dense0", "dense10", "dense50", "sparse", "text", "random", "shift-start", "shift-every",
             "shift-delete", "shift-tar", "shift-unrelated")
DEFAULT_WORKLOADS = WORKLOADS
# Sparse edits: this many bytes changed in this share of the 1 MiB blocks (a database page).
SPARSE_BYTES = 16
SPARSE_PERCENT = 10
# Shifted data: 100 bytes inserted near the start; one byte inserted every 16 MiB; 100 bytes
# deleted near the start; a tar of a tree of TAR_FILES files in which the first grew by
# TAR_GROWTH; and, at the same size, random data that shares nothing with the target.
SHIFT_INSERT = 100
TAR_FILES = 64
TAR_GROWTH = 10 * 1024
SHIFT_OFFSET = 4096
SHIFT_EVERY = 16 * 1024 * 1024
# Text-like data: words from a fixed vocabulary; each 16 MiB stretch permutes the letters
# so that no compressor finds a repeat longer than its window. With 2,000 words and Zipf's
# exponent 1.2, zstd shrinks it 3.9:1 at level 1 and 4.2:1 at level 3 (measured here).
TEXT_STRETCH = 16 * 1024 * 1024
TEXT_VOCABULARY = 2000
TEXT_ZIPF = 1.2

# ours-cdc: our client with --delta chunks (the shift-tolerant delta), against a server of its own;
# ours-blocks: with --delta blocks (the default before --delta auto).
# *-ssh-*: through sshd in the server's namespace (pdiffcopy HOST:PATH, rsync -e ssh).
TOOLS = ("ours-pull", "ours-push", "ours-cdc-pull", "ours-cdc-push", "ours-blocks-pull", "ours-blocks-push",
         "baseline-pull", "baseline-push",
         "original-pull", "original-push",
         "rsync-pull", "rsync-push", "rsync-z-pull", "rsync-z-push",
         "ours-ssh-pull", "ours-ssh-push", "ours-ssh-direct-pull", "ours-ssh-direct-push",
         "rsync-ssh-pull", "rsync-ssh-push", "rsync-ssh-z-pull", "rsync-ssh-z-push")
SSH_FAMILIES = {"ours-ssh", "ours-ssh-direct", "rsync-ssh", "rsync-ssh-z"}
# The cipher both ssh tools use; aes128-gcm is the fastest with AES-NI.
DEFAULT_SSH_CIPHER = "aes128-gcm@openssh.com"
DEFAULT_TOOLS = ("ours-pull", "ours-push", "original-pull", "rsync-pull", "rsync-z-pull")


def parse_rate(text: str) -> int:
    """A link rate such as 200mbit or 1gbit, in bits per second."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
    for unit, factor in units.items():
        if text.lower().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    raise argparse.ArgumentTypeError("a rate such as 200mbit or 1gbit, not %r" % text)


def format_rate(bits: int) -> str:
    """200000000 -> '200 Mbit'."""
    return "%g Gbit" % (bits / 1e9) if bits >= 10**9 else "%g Mbit" % (bits / 1e6)


def run(command: List[str]) -> str:
    """Run a setup command; a failure is a BenchmarkError naming it."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BenchmarkError("%s failed: %s" % (shlex.join(command), result.stderr.strip()))
    return result.stdout


class Link:
    """Two network namespaces joined by a veth pair, shaped the same way in both directions."""

    def __init__(self) -> None:
        tag = "%x" % os.getpid()
        self.server_ns, self.client_ns = "pdcb-s-" + tag, "pdcb-c-" + tag
        self.server_dev, self.client_dev = "pdcbs" + tag, "pdcbc" + tag

    def __enter__(self) -> "Link":
        try:
            run(["ip", "netns", "add", self.server_ns])
            run(["ip", "netns", "add", self.client_ns])
            run(["ip", "link", "add", self.server_dev, "netns", self.server_ns,
                 "type", "veth", "peer", "name", self.client_dev, "netns", self.client_ns])
            for ns, dev, address in ((self.server_ns, self.server_dev, SERVER_IP),
                                     (self.client_ns, self.client_dev, CLIENT_IP)):
                run(["ip", "-n", ns, "addr", "add", address + "/30", "dev", dev])
                run(["ip", "-n", ns, "link", "set", dev, "up"])
                run(["ip", "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        # Deleting a namespace deletes its end of the veth pair, and with it the other end.
        for ns in (self.server_ns, self.client_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def shape(self, rate: int) -> None:
        """Limit both directions to `rate` bits per second."""
        burst = max(MIN_BURST, int(rate / 8 * BURST_SECONDS))
        for ns, dev in ((self.server_ns, self.server_dev), (self.client_ns, self.client_dev)):
            run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", str(rate), "burst", str(burst), "latency", QUEUE_LATENCY])

    def wire_bytes(self) -> int:
        """Bytes sent so far by both ends: everything that crossed the link either way."""
        total = 0
        for ns, dev in ((self.server_ns, self.server_dev), (self.client_ns, self.client_dev)):
            total += int(run(["ip", "netns", "exec", ns, "cat", "/sys/class/net/%s/statistics/tx_bytes" % dev]))
        return total

    def in_server(self, command: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.server_ns] + command

    def in_client(self, command: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.client_ns] + command


@dataclass
class Server:
    """A server process in the server namespace, listening on SERVER_IP:port."""

    name: str
    command: List[str]
    port: int
    log_path: Path
    env: Optional[Dict[str, str]] = None
    process: Optional[subprocess.Popen] = None

    def start(self, link: Link) -> None:
        log("starting %s on %s:%i" % (self.name, getattr(link, "address", SERVER_IP), self.port))
        self.process = benchlib.start_process(link.in_server(self.command), self.log_path, self.env)
        deadline = time.monotonic() + benchlib.SERVER_START_TIMEOUT
        probe = link.in_server(["ss", "-Hltn", "sport", "=", ":%i" % self.port])
        while not subprocess.run(probe, capture_output=True, text=True).stdout.strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise BenchmarkError("%s did not start:\n%s" % (self.name, benchlib.tail(self.log_path)))
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            benchlib.kill_group(self.process, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(benchlib.SERVER_STOP_TIMEOUT)
            benchlib.kill_group(self.process, 9)
            self.process.wait()


# A wrapper that runs its arguments as a child and, once the child has ended, appends the
# child's CPU (user, system; bash's `times`) to $1: a signal to the wrapper goes on to the
# child, and the child keeps the wrapper's stdin (ssh and the remote program talk over it).
CPU_WRAPPER = """#!/bin/bash
log=$1; shift
"$@" <&0 &
child=$!
trap 'kill -TERM $child 2>/dev/null' TERM HUP INT
while :; do wait $child; status=$?; kill -0 $child 2>/dev/null || break; done
times >> "$log"
exit $status
"""


def cpu_logged(path: Path) -> float:
    """The CPU seconds of the children the wrapper's log `path` holds.

    bash's `times` writes two lines, the shell's own CPU then its children's (user, system,
    e.g. ``0m1.230s 0m0.040s``); only the second of each pair counts. (Not through a pipe:
    a builtin in a pipeline runs in a subshell, which has no children.)
    """
    total = 0.0
    if path.exists():
        for line in path.read_text().splitlines()[1::2]:
            for field in line.split():
                minutes, _, seconds = field.rstrip("s").partition("m")
                total += 60 * float(minutes) + float(seconds)
    return total


class SshSetup:
    """sshd in the server's namespace, throwaway keys, and the commands that reach it.

    `rsh` is the ssh command line both rsync (-e) and pdiffcopy (-e) use; `remote_ours` and
    `remote_rsync` are the remote programs (through the CPU wrapper). CPU logs: `ssh_cpu`
    (every ssh client; `ssh_started` has a line per ssh started), `remote_cpu` (the remote
    programs); sshd's own CPU is its master's reaped children less the remote programs'.
    """

    def __init__(self, logs: Path, cipher: str, ours: "benchlib.OursInstallation") -> None:
        self.dir = logs / "ssh"
        self.dir.mkdir(mode=0o700)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "host_key")])
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "user_key")])
        (self.dir / "authorized_keys").write_text((self.dir / "user_key.pub").read_text())
        self.config = self.dir / "sshd_config"
        self.config.write_text("\n".join([
            "ListenAddress %s:%i" % (SERVER_IP, SSH_PORT), "HostKey %s" % (self.dir / "host_key"),
            "AuthorizedKeysFile %s" % (self.dir / "authorized_keys"), "PermitRootLogin prohibit-password",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            "PidFile %s" % (self.dir / "sshd.pid"), "Ciphers %s" % cipher, "LogLevel ERROR", ""]))
        wrapper = self.dir / "cpu-wrapper"
        wrapper.write_text(CPU_WRAPPER)
        self.ssh_cpu, self.remote_cpu = self.dir / "ssh-cpu.log", self.dir / "remote-cpu.log"
        self.ssh_started = self.dir / "ssh-started.log"
        ssh = self.dir / "ssh"
        # setsid: out of the client's process group, which the run's end kills (pdiffcopy's
        # ssh may outlive its client by the remote clean-up).
        ssh.write_text("#!/bin/sh\necho >> %s\nexec setsid %s %s /usr/bin/ssh \"$@\"\n" % (
            self.ssh_started, wrapper, self.ssh_cpu))
        self.rsh = shlex.join([str(ssh), "-F", "none", "-p", str(SSH_PORT), "-i", str(self.dir / "user_key"),
                               "-c", cipher, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                               "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"])
        self.remote_ours = self.dir / "remote-pdiffcopy"
        self.remote_ours.write_text("#!/bin/sh\nexport PYTHONPATH=%s\nexec %s %s %s\n" % (
            shlex.quote(ours.env.get("PYTHONPATH", "")), wrapper, self.remote_cpu,
            shlex.join(ours.command) + ' "$@"'))
        self.remote_rsync = self.dir / "remote-rsync"
        self.remote_rsync.write_text("#!/bin/sh\nexec %s %s rsync \"$@\"\n" % (wrapper, self.remote_cpu))
        for program in (wrapper, ssh, self.remote_ours, self.remote_rsync):
            program.chmod(0o755)
        # sshd refuses to start without its privilege separation directory.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.server = Server("sshd", ["/usr/sbin/sshd", "-D", "-e", "-f", str(self.config)], SSH_PORT,
                             logs / "sshd.log")

    def sshd_children_cpu(self) -> float:
        """CPU seconds of the sshd master's reaped children (its sessions and what they ran)."""
        assert self.server.process is not None
        fields = Path("/proc/%i/stat" % self.server.process.pid).read_text().rsplit(")", 1)[1].split()
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime

    def start_run(self) -> float:
        for path in (self.ssh_cpu, self.remote_cpu, self.ssh_started):
            path.unlink(missing_ok=True)
        return self.sshd_children_cpu()

    def end_run(self, sshd_before: float) -> "tuple[float, float, float]":
        """(ssh clients' CPU, sshd's own CPU, the remote program's CPU) of the run since start_run."""
        # Every ssh started has ended (its wrapper wrote two lines), and the session's sshd,
        # reaped a moment after, has been counted.
        deadline = time.monotonic() + SSH_END_SECONDS
        while time.monotonic() < deadline and _lines(self.ssh_cpu) < 2 * _lines(self.ssh_started):
            time.sleep(0.05)
        if _lines(self.ssh_cpu) < 2 * _lines(self.ssh_started):
            log("warning: an ssh client of the run did not end within %g s; its CPU is missing" % SSH_END_SECONDS)
        remote = cpu_logged(self.remote_cpu)
        sshd = self.sshd_children_cpu() - sshd_before
        while sshd < remote and time.monotonic() < deadline + 2:
            time.sleep(0.05)
            sshd = self.sshd_children_cpu() - sshd_before
        return cpu_logged(self.ssh_cpu), max(0.0, sshd - remote), remote


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@dataclass
class Workload:
    """One workload: the source's path and the target's starting state (None: no target)."""

    name: str
    source: Path
    base: Optional[Path]


@dataclass
class Tool:
    name: str
    direction: str
    # (source path, target path) -> the client's command line
    command: Callable[[Path, Path], List[str]]
    env: Optional[Dict[str, str]] = None


def text_like(path: Path, size: int, seed: int) -> None:
    """Write `size` bytes of text-like, compressible data (see TEXT_STRETCH)."""
    rng = random.Random("text-%i" % seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(TEXT_VOCABULARY)]
    # Word frequencies follow Zipf's law, as in natural text and logs.
    weights = list(itertools.accumulate(1 / rank**TEXT_ZIPF for rank in range(1, TEXT_VOCABULARY + 1)))
    words = rng.choices(vocabulary, cum_weights=weights, k=TEXT_STRETCH // 5)
    stretch = " ".join(words).encode()[:TEXT_STRETCH]
    with open(path, "wb") as handle:
        for offset in range(0, size, TEXT_STRETCH):
            shuffled = list(letters)
            rng.shuffle(shuffled)
            table = bytes.maketrans(letters.encode(), "".join(shuffled).encode())
            handle.write(stretch.translate(table)[: size - offset])


def sparse_copy(source: Path, target: Path, seed: int) -> None:
    """Copy `source`, then change SPARSE_BYTES bytes in SPARSE_PERCENT % of its 1 MiB blocks."""
    benchlib.copy_file(source, target)
    size = source.stat().st_size
    blocks = -(-size // BLOCK_SIZE)
    rng = random.Random("sparse-%i" % seed)
    with open(target, "r+b") as handle:
        for index in sorted(rng.sample(range(blocks), round(blocks * SPARSE_PERCENT / 100))):
            block_end = min(size, (index + 1) * BLOCK_SIZE)
            handle.seek(rng.randrange(index * BLOCK_SIZE, block_end - SPARSE_BYTES))
            handle.write(rng.randbytes(SPARSE_BYTES))


def with_insertions(base: Path, source: Path, positions: List[int], count: int, seed: int) -> None:
    """Write `source` as `base` with `count` random bytes inserted before each of `positions`."""
    rng = random.Random("shift-%i" % seed)
    with open(base, "rb") as reader, open(source, "wb") as writer:
        done = 0
        for position in positions + [None]:
            while position is None or done < position:
                chunk = reader.read(BLOCK_SIZE if position is None else min(BLOCK_SIZE, position - done))
                if not chunk:
                    break
                writer.write(chunk)
                done += len(chunk)
            if position is not None:
                writer.write(rng.randbytes(count))


def with_deletion(base: Path, source: Path, offset: int, count: int) -> None:
    """Write `source` as `base` without its `count` bytes at `offset`."""
    with open(base, "rb") as reader, open(source, "wb") as writer:
        writer.write(reader.read(offset))
        reader.seek(count, os.SEEK_CUR)
        shutil.copyfileobj(reader, writer, BLOCK_SIZE)


def tar_of_tree(path: Path, size: int, seed: int, grown: int) -> None:
    """Write a tar of TAR_FILES random files of about `size` bytes in all, the first `grown` bytes longer.

    The same seed gives the same files, names and times: two calls differ only by the growth.
    """
    import io
    import tarfile

    rng = random.Random("tar-%i" % seed)
    each = max(1, size // TAR_FILES)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as archive:
        for index in range(TAR_FILES):
            data = rng.randbytes(each)
            if index == 0:
                data += random.Random("tar-growth-%i" % seed).randbytes(grown)
            member = tarfile.TarInfo("tree/dir%02i/file%03i.dat" % (index // 8, index))
            member.size, member.mtime, member.mode = len(data), 1_700_000_000, 0o644
            archive.addfile(member, io.BytesIO(data))


def prepare_workloads(data: Path, names: List[str], size: int, shift_size: int, seed: int) -> List[Workload]:
    """Write each workload's source and base files under `data`."""
    workloads = []
    random_source = data / "random.img"
    log("generating %s of random data" % benchlib.format_size(size))
    benchlib.generate_source(random_source, size, seed)
    for name in names:
        if name.startswith("dense"):
            base = data / (name + ".base")
            benchlib.make_mutated_copy(random_source, base, int(name[len("dense"):]), seed)
            workloads.append(Workload(name, random_source, base))
        elif name == "sparse":
            base = data / "sparse.base"
            sparse_copy(random_source, base, seed)
            workloads.append(Workload(name, random_source, base))
        elif name == "random":
            workloads.append(Workload(name, random_source, None))
        elif name == "text":
            source = data / "text.img"
            text_like(source, size, seed)
            workloads.append(Workload(name, source, None))
        else:
            base = data / ("%s.base" % name)
            benchlib.generate_source(base, shift_size, seed + 1)
            source = data / ("%s.img" % name)
            if name == "shift-start":
                with_insertions(base, source, [SHIFT_OFFSET], SHIFT_INSERT, seed)
            elif name == "shift-delete":
                with_deletion(base, source, SHIFT_OFFSET, SHIFT_INSERT)
            elif name == "shift-tar":
                tar_of_tree(base, shift_size, seed, 0)
                tar_of_tree(source, shift_size, seed, TAR_GROWTH)
            elif name == "shift-unrelated":
                benchlib.generate_source(source, shift_size, seed + 2)
            else:
                with_insertions(base, source, list(range(SHIFT_EVERY, shift_size, SHIFT_EVERY)), 1, seed)
            workloads.append(Workload(name, source, base))
    # Written back now, not by the kernel in the middle of a timed run.
    os.sync()
    return workloads


def build_tools(args, work: Path, link: Link, logs: Path):
    """The servers to start and the client tools to time, for the chosen --tools."""
    servers, tools = [], []
    families = {tool.rsplit("-", 1)[0] for tool in args.tools}
    token = "shaped-link-benchmark-token"

    def ours_family(family: str, installation: benchlib.OursInstallation, port: int, extra: List[str]) -> None:
        env = dict(installation.env, PDIFFCOPY_TOKEN=token, XDG_RUNTIME_DIR=str(logs))
        servers.append(Server(family, installation.command + ["--listen", "%s:%i" % (SERVER_IP, port),
                                                              "--root", str(work)] + args.ours_server_args,
                              port, logs / ("%s-server.log" % family), env))
        url = "http://%s:%i/" % (SERVER_IP, port)
        prefix = installation.command + extra
        tools.append(Tool(family + "-pull", "pull", lambda s, t: prefix + [url + str(s.relative_to(work)), str(t)],
                          env))
        tools.append(Tool(family + "-push", "push", lambda s, t: prefix + [str(s), url + str(t.relative_to(work))],
                          env))

    ssh: Optional[SshSetup] = None
    if families & {"ours", "ours-cdc", "ours-blocks", "ours-ssh"}:
        ours, reason = benchlib.find_ours()
        if ours is None:
            raise BenchmarkError(reason)
        if "ours" in families:
            ours_family("ours", ours, OURS_PORT, args.ours_args)
        if "ours-cdc" in families:
            ours_family("ours-cdc", ours, OURS_CDC_PORT, args.ours_args + ["--delta", "chunks"])
        if "ours-blocks" in families:
            ours_family("ours-blocks", ours, OURS_BLOCKS_PORT, args.ours_args + ["--delta", "blocks"])
    if "baseline" in families:
        if not args.baseline:
            raise BenchmarkError("the baseline tools need --baseline REV")
        ours_family("baseline", benchlib.baseline_installation(args.baseline, work), BASELINE_PORT, args.ours_args)
    if "original" in families:
        program = benchlib.find_original()
        env = dict(os.environ, XDG_RUNTIME_DIR=str(logs))
        servers.append(Server("original", [str(program), "--listen=%s:%i" % (SERVER_IP, ORIGINAL_PORT)],
                              ORIGINAL_PORT, logs / "original-server.log", env))
        url = "http://%s:%i" % (SERVER_IP, ORIGINAL_PORT)
        tools.append(Tool("original-pull", "pull", lambda s, t, u=url: [str(program), u + str(s), str(t)], env))
        tools.append(Tool("original-push", "push", lambda s, t, u=url: [str(program), str(s), u + str(t)], env))
    if families & {"rsync", "rsync-z"}:
        config = logs / "rsyncd.conf"
        config.write_text("\n".join([
            "address = %s" % SERVER_IP, "port = %i" % RSYNC_PORT, "uid = %i" % os.getuid(), "gid = %i" % os.getgid(),
            "use chroot = no", "reverse lookup = no", "log file = %s" % (logs / "rsyncd.log"),
            "[work]", "path = %s" % work, "read only = no", ""]))
        servers.append(Server("rsync daemon", ["rsync", "--daemon", "--no-detach", "--config=%s" % config],
                              RSYNC_PORT, logs / "rsyncd-server.log"))
        url = "rsync://%s:%i/work/" % (SERVER_IP, RSYNC_PORT)
        for family, extra in (("rsync", []), ("rsync-z", ["-z"])):
            def rsync(source: Path, extra=extra) -> List[str]:
                # In place, rsync cannot use a match that lies before the write position: shifted
                # data is what its default mode (a new file, then a rename) is made for.
                options = [o for o in benchlib.RSYNC_OPTIONS if not (SHIFTED in source.name and o == "--inplace")]
                return ["rsync", *options, *extra, *args.rsync_args]

            tools.append(Tool(family + "-pull", "pull",
                              lambda s, t, r=rsync, u=url: r(s) + [u + str(s.relative_to(work)), str(t)]))
            tools.append(Tool(family + "-push", "push",
                              lambda s, t, r=rsync, u=url: r(s) + [str(s), u + str(t.relative_to(work))]))
    if families & SSH_FAMILIES:
        ours, reason = benchlib.find_ours()
        if ours is None and families & {"ours-ssh", "ours-ssh-direct"}:
            raise BenchmarkError(reason)
        ssh = SshSetup(logs, args.ssh_cipher, ours)
        servers.append(ssh.server)
        host = "root@%s:" % SERVER_IP
        prefix = (ours.command if ours else []) + ["-e", ssh.rsh, "--remote-pdiffcopy", str(ssh.remote_ours)]
        env = dict(ours.env, XDG_RUNTIME_DIR=str(logs)) if ours else None
        tools.append(Tool("ours-ssh-pull", "pull", lambda s, t: prefix + args.ours_args + [host + str(s), str(t)],
                          env))
        tools.append(Tool("ours-ssh-push", "push", lambda s, t: prefix + args.ours_args + [str(s), host + str(t)],
                          env))
        direct = prefix + ["--direct-port", str(DIRECT_PORT)]
        tools.append(Tool("ours-ssh-direct-pull", "pull",
                          lambda s, t: direct + args.ours_args + [host + str(s), str(t)], env))
        tools.append(Tool("ours-ssh-direct-push", "push",
                          lambda s, t: direct + args.ours_args + [str(s), host + str(t)], env))
        for family, extra in (("rsync-ssh", []), ("rsync-ssh-z", ["-z"])):
            def rsync_ssh(source: Path, extra=extra) -> List[str]:
                options = [o for o in benchlib.RSYNC_OPTIONS if not (SHIFTED in source.name and o == "--inplace")]
                return ["rsync", *options, *extra, "-e", ssh.rsh, "--rsync-path", str(ssh.remote_rsync),
                        *args.rsync_args]

            tools.append(Tool(family + "-pull", "pull", lambda s, t, r=rsync_ssh: r(s) + [host + str(s), str(t)]))
            tools.append(Tool(family + "-push", "push", lambda s, t, r=rsync_ssh: r(s) + [str(s), host + str(t)]))
    return servers, [tool for tool in tools if tool.name in args.tools], ssh


@dataclass
class Sample:
    seconds: float
    wire: int
    #: CPU seconds of the client (every process it waited for, its ssh clients too).
    cpu: float = 0.0
    #: CPU seconds of the ssh clients, of sshd (its sessions, less the remote program) and of
    #: the remote program, or None.
    ssh_cpu: Optional[float] = None
    sshd_cpu: Optional[float] = None
    remote_cpu: Optional[float] = None


def measure(tool: Tool, workload: Workload, link: Link, work: Path, logs: Path, expected: str,
            warm_up: bool, ssh: Optional[SshSetup] = None) -> Sample:
    """One run of `tool` on `workload` (after an untimed warm-up run if asked); checks the result."""
    # The puller's target lives on the client's side, the pusher's on the server's; both
    # are under `work` here, since both namespaces share this machine's file systems.
    target = work / "run" / ("%s-%s.img" % (workload.name, tool.name))
    log_path = logs / ("%s-%s.log" % (tool.name, workload.name))
    runs = [False, True] if warm_up else [True]
    for _timed in runs:
        benchlib.fresh_target(workload.base or target, target, workload.base is not None)
        benchlib.read_through(workload.source)
        through_ssh = ssh is not None and "-ssh-" in tool.name
        sshd_before = ssh.start_run() if through_ssh else 0.0
        before = link.wire_bytes()
        result = benchlib.run_tool(link.in_client(tool.command(workload.source, target)), log_path, tool.env)
        wire = link.wire_bytes() - before
        ssh_cpu, sshd_cpu, remote_cpu = ssh.end_run(sshd_before) if through_ssh else (None, None, None)
    benchlib.verify_copy(target, expected, workload.source.stat().st_size, "%s on %s" % (tool.name, workload.name))
    target.unlink()
    return Sample(result.seconds, wire, result.cpu_seconds, ssh_cpu, sshd_cpu, remote_cpu)


def median_cpu(samples: List[Sample], field: str) -> str:
    values = [getattr(sample, field) for sample in samples]
    return "-" if None in values else "%.2f" % statistics.median(values)


def report(args, machine: str, versions: List[str], results: Dict, workloads: List[Workload],
           tools: List[Tool], start_load: str) -> str:
    lines = ["# Shaped-link benchmark", "", machine, ""] + ["- %s" % v for v in versions] + [
        "- command: `%s`" % shlex.join([sys.executable] + sys.argv),
        "- link: veth pair between two network namespaces, `tc qdisc tbf` on both ends "
        "(burst %g ms of the rate, latency %s); client and server share this machine's cores and disks"
        % (BURST_SECONDS * 1000, QUEUE_LATENCY),
        "- rsync: `%s` against an rsync daemon; on the shifted workloads without `--inplace`"
        % shlex.join(benchlib.RSYNC_OPTIONS),
        "- *-ssh-*: through OpenSSH's sshd in the server's namespace, cipher %s; their time / rsync and "
        "bytes / rsync are against rsync -e ssh through the same sshd (on the text workload against "
        "rsync -e ssh -z when it ran); ours-ssh-direct: --direct, TLS straight to the server" % args.ssh_cipher,
        "- CPU: client = the client process and every process it waited for; ssh = the ssh clients "
        "(pdiffcopy's session too, which ends after its client); sshd = sshd's sessions less the remote "
        "program they ran; remote = the remote program (with --direct, the server's TLS)",
        "- each cell: median of %i run(s)%s; bytes: both directions on the link, from the veth counters"
        % (args.rounds, ", each after an untimed warm-up run" if args.warm_up else ""),
        "- efficiency: bytes on the link x 8 / time / link rate (100 % = the link was full all the time)", ""]
    for rate in args.rates:
        lines += ["## %s" % format_rate(rate), ""]
        header = ["workload", "tool", "median s", "best s", "MiB on the link", "efficiency", "time / rsync",
                  "bytes / rsync", "client CPU s", "ssh CPU s", "sshd CPU s", "remote CPU s"]
        rows = []
        for workload in workloads:
            cells = {tool.name: results[(rate, workload.name, tool.name)] for tool in tools
                     if results.get((rate, workload.name, tool.name))}
            medians = {name: statistics.median(s.seconds for s in samples) for name, samples in cells.items()}
            wires = {name: statistics.median(s.wire for s in samples) for name, samples in cells.items()}
            for tool in tools:
                samples = cells.get(tool.name)
                if not samples:
                    continue
                # Through ssh, against rsync through the same sshd.
                reference = ("rsync-ssh-" if "-ssh-" in tool.name else "rsync-") + tool.direction
                compressed = "rsync-ssh-z-" + tool.direction
                if tool.name.startswith("ours-ssh") and workload.name == "text" and compressed in medians:
                    reference = compressed
                seconds, rsync_time = medians[tool.name], medians.get(reference)
                wire = wires[tool.name]
                rows.append([workload.name, tool.name, "%.2f" % seconds, "%.2f" % min(s.seconds for s in samples),
                             "%.3f" % (wire / 2**20), "%.0f %%" % (100 * wire * 8 / seconds / rate),
                             benchlib.format_ratio(seconds, rsync_time),
                             benchlib.format_ratio(wire, wires.get(reference)),
                             median_cpu(samples, "cpu"), median_cpu(samples, "ssh_cpu"),
                             median_cpu(samples, "sshd_cpu"), median_cpu(samples, "remote_cpu")])
        lines += [benchlib.markdown_table(header, rows), ""]
    lines.append("Load average (1, 5, 15 min): %s at the start, %s at the end."
                 % (start_load, benchlib.load_averages()))
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--size", default="1G", type=benchlib.parse_size, help="size of most workloads (default 1G)")
    parser.add_argument("--shift-size", default="256M", type=benchlib.parse_size,
                        help="size of the shifted-data workloads (default 256M)")
    parser.add_argument("--rates", default="200mbit,1gbit", type=lambda t: [parse_rate(x) for x in t.split(",")],
                        help="link rates, both directions (default 200mbit,1gbit)")
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                        type=lambda t: benchlib.parse_name_list(t, WORKLOADS),
                        help="comma separated, from %s" % ",".join(WORKLOADS))
    parser.add_argument("--tools", default=",".join(DEFAULT_TOOLS), type=lambda t: benchlib.parse_name_list(t, TOOLS),
                        help="comma separated, from %s (default %s)" % (",".join(TOOLS), ",".join(DEFAULT_TOOLS)))
    parser.add_argument("--rounds", default=3, type=int, help="timed runs per cell (default 3)")
    parser.add_argument("--warm-up", action="store_true",
                        help="an untimed run before each timed one (doubles the time; the link dominates here)")
    parser.add_argument("--seed", default=benchlib.DEFAULT_SEED, type=int)
    parser.add_argument("--baseline", metavar="REV", help="the baseline-* tools: our pdiffcopy at git revision REV")
    parser.add_argument("--ours-args", default="", type=shlex.split, help="extra options for our client")
    parser.add_argument("--ours-server-args", default="", type=shlex.split, help="extra options for our server")
    parser.add_argument("--rsync-args", default="", type=shlex.split, help="extra options for rsync")
    parser.add_argument("--ssh-cipher", default=DEFAULT_SSH_CIPHER,
                        help="the cipher of the *-ssh-* tools, client and server (default %s)" % DEFAULT_SSH_CIPHER)
    parser.add_argument("--workdir", default=Path("/var/tmp"), type=Path,
                        help="where the data directory is made (default /var/tmp)")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if os.geteuid() != 0:
        parser.error("network namespaces need root")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    dirs = benchlib.WorkDirs.make(args.workdir, "shaped-link-")
    work, data, logs = dirs.root, dirs.data, dirs.logs
    servers: List[Server] = []
    try:
        machine = benchlib.machine_description(work)
        workloads = prepare_workloads(data, args.workloads, args.size, args.shift_size, args.seed)
        expected = {w.name: benchlib.sha256_file(w.source) for w in workloads}
        with Link() as link:
            servers, tools, ssh = build_tools(args, work, link, logs)
            for server in servers:
                server.start(link)
            start_load = benchlib.load_averages()
            results: Dict = {}
            for rate in args.rates:
                link.shape(rate)
                for workload in workloads:
                    for round_number in range(args.rounds):
                        # Alternate the order of the tools from round to round.
                        order = tools if round_number % 2 == 0 else list(reversed(tools))
                        for tool in order:
                            sample = measure(tool, workload, link, work, logs, expected[workload.name], args.warm_up,
                                             ssh)
                            log("%s %s %s: %.2f s, %.1f MiB on the link" % (
                                format_rate(rate), workload.name, tool.name, sample.seconds, sample.wire / 2**20))
                            results.setdefault((rate, workload.name, tool.name), []).append(sample)
            for server in servers:
                server.stop()
        versions = benchlib.tool_versions(
            ["rsync"] if any(t.name.startswith("rsync") for t in tools) else [], None, None)
        if ssh is not None:
            versions.append(subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip())
        text = report(args, machine, versions, results, workloads, tools, start_load)
        print(text, end="")
        if args.output:
            args.output.write_text(text)
        return 0
    except BenchmarkError as error:
        log("FAILED: %s" % error)
        return 1
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Block devices, side by side: pdiffcopy, rsync and blocksync-fast on loop devices (issue 37).

Run as root with this checkout's virtualenv (the servers import flask and gunicorn)::

    sudo .venv/bin/python benchmarks/device_bench.py                 # 8 GiB, every case, 3 rounds
    sudo .venv/bin/python benchmarks/device_bench.py --size 1G --rounds 1 --links loopback
    sudo .venv/bin/python benchmarks/device_bench.py --size 1G --footprint-only

Devices: loop devices over files in ``--work-dir`` (one file system, named in the report):
a source over a dense file (random bytes throughout) and one over a sparse file (random
bytes in 10 % of its 1 MiB blocks, holes elsewhere), and one target device whose backing
file is restored before every run. Cases: ``nochange`` (the target equals the source),
``changed10`` (random 4 KiB writes, one at a random 4 KiB-aligned offset in each of 10 % of
the 1 MiB blocks that hold data: a VM's page writes, not whole blocks) and ``new`` (a zeroed
target: every block differs). Directions: ``local`` (device to device), ``pull`` (the
source served, the target here) and ``push``, over ``--links``: ``loopback`` (one network
namespace of the benchmark's own, so that its ``lo`` counts only our bytes) and ``shaped``
(two namespaces joined by a veth pair, both ends shaped with ``tc qdisc tbf rate 1gbit burst
128kb latency 50ms``).

Tools (``--tools``):

- ``ours``: ``python3 -m pdiffcopy`` of this checkout; its server exports the devices with
  ``--device src=/dev/loopS --device dst=/dev/loopT:rw`` and is asked for
  ``http://IP:PORT/src``, ``.../dst``. A checkout whose server cannot export devices fails
  those cells with its one-line error (the table says so).
- ``ours-digest``: ``pdiffcopy --digest-file RECORD`` (local and pull: the target is local);
  the record is made by an untimed sync of the old target's content onto the restored
  target just before the timed run. ``ours-direct``: ``--cache direct``.
- ``rsync``: ``rsync -I --copy-devices --write-devices --inplace --no-whole-file``, against
  an rsync daemon whose module holds device nodes of the loop devices (``mknod``).
- ``blocksync-fast``: the binary of ``--blocksync-fast`` (or on PATH); local ``-s S -d T``;
  remote, its way: ``--make-delta -s S -f DIGEST`` piped over one TCP connection into
  ``--apply-delta -d T`` (the digest of the old target made untimed before the run, as
  its backups keep it). Not built here: see the report's notes.
- pdiffcopy 1.0.1 is not measured: it refuses anything but regular files.

Each run: the target's backing file restored (holes kept), the target's buffers flushed,
``echo 3 > /proc/sys/vm/drop_caches``; then the run, timed (wall time of the client, or of
the whole pipeline), with the bytes on the link (tx counters of the link's devices, both
directions) and the bytes read from each device (``/sys/block/loopN/stat``, sectors read x
512) before and after; then, untimed, ``cmp`` of the target with the source. Tools
alternate from round to round.

``--footprint`` adds the page cache footprint of a local device sync (``--footprint-size``,
default 1 GiB, new target): the default (read, then dropped), ``--cache direct`` and
``--cache keep``, with the devices held open meanwhile (a device's cache is emptied at its
last close), the peak and final resident bytes of each device by ``mincore``
(``pagecache.py``) and the time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import benchlib
import pagecache
from benchlib import BenchmarkError, log

MiB = 1024 * 1024
PAGE = 4096
CASES = ("nochange", "changed10", "new")
KINDS = ("dense", "sparse")
DIRECTIONS = ("local", "pull", "push")
LINKS = ("loopback", "shaped")
TOOLS = ("ours", "ours-direct", "ours-digest", "rsync", "blocksync-fast")
DEFAULT_TOOLS = ("ours", "rsync", "blocksync-fast")
RSYNC_DEVICE_OPTIONS = ["-I", "--copy-devices", "--write-devices", "--inplace", "--no-whole-file"]
SERVER_IP, CLIENT_IP = "10.213.9.1", "10.213.9.2"
LOOPBACK_IP = "127.0.0.1"
OURS_PORT, RSYNC_PORT, DELTA_PORT = 8201, 8873, 8202
SHAPE = ["rate", "1gbit", "burst", "128kb", "latency", "50ms"]
TOKEN = "device-benchmark-token"
#: GNU time, for the client's peak RSS (``ru_maxrss``); none: the column stays 0.
TIME_PROGRAM = shutil.which("time", path="/usr/bin:/bin")
DATA_SHARE = 10  # % of a sparse source's 1 MiB blocks that hold data
CHANGED_SHARE = 10  # % of the data blocks that get one 4 KiB write


def run(command: List[str], **kwargs) -> str:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise BenchmarkError("%s failed: %s" % (shlex.join(command), done.stderr.strip()[-500:]))
    return done.stdout


# --------------------------------------------------------------------------- data and devices


def write_random(path: Path, size: int, blocks: Optional[List[int]], seed: int) -> None:
    """A file of ``size`` bytes: random in the 1 MiB ``blocks`` given (all when None), holes elsewhere."""
    rng = random.Random(seed)
    with open(path, "wb") as handle:
        handle.truncate(size)
        for block in (range(-(-size // MiB)) if blocks is None else blocks):
            handle.seek(block * MiB)
            handle.write(rng.randbytes(min(MiB, size - block * MiB)))
        os.fsync(handle.fileno())


def data_extents(path: Path) -> List["tuple[int, int]"]:
    extents, fd = [], os.open(path, os.O_RDONLY)
    try:
        size, position = os.fstat(fd).st_size, 0
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, end - start))
            position = end
    finally:
        os.close(fd)
    return extents


def restore(old: Path, target: Path) -> None:
    """Make ``target`` (a loop device's backing file, kept open by it) hold ``old``'s bytes and holes."""
    with open(old, "rb") as source, open(target, "r+b") as destination:
        size = os.fstat(source.fileno()).st_size
        os.truncate(destination.fileno(), 0)  # (the loop device keeps its size)
        os.truncate(destination.fileno(), size)
        for offset, length in data_extents(old):
            done = 0
            while done < length:
                copied = os.copy_file_range(source.fileno(), destination.fileno(), length - done,
                                            offset + done, offset + done)
                if copied <= 0:
                    raise BenchmarkError("short copy restoring %s" % target)
                done += copied
        os.fsync(destination.fileno())


def changed_copy(source: Path, target: Path, seed: int) -> None:
    """``source`` with one random 4 KiB write in CHANGED_SHARE % of its data's 1 MiB blocks."""
    target.touch()
    restore(source, target)
    blocks = sorted({offset // MiB + i for offset, length in data_extents(source) for i in range(-(-length // MiB))})
    rng = random.Random(seed)
    chosen = rng.sample(blocks, max(1, len(blocks) * CHANGED_SHARE // 100))
    size = source.stat().st_size
    with open(target, "r+b") as handle:
        for block in chosen:
            offset = block * MiB + rng.randrange(MiB // PAGE) * PAGE
            if offset + PAGE <= size:
                handle.seek(offset)
                handle.write(rng.randbytes(PAGE))
        os.fsync(handle.fileno())


class Loops:
    """Loop devices this benchmark made (``losetup``); it detaches only those."""

    def __init__(self) -> None:
        self.made: List[str] = []

    def attach(self, backing: Path) -> str:
        """A loop device over ``backing`` reading it with direct I/O where its file system can: a
        disk's device has no second cache below its own, and the loop's backing file would be one."""
        done = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(backing)],
                              capture_output=True, text=True)
        device = done.stdout.strip() if done.returncode == 0 else run(
            ["losetup", "--find", "--show", str(backing)]).strip()
        self.made.append(device)
        return device

    def detach_all(self) -> None:
        for device in reversed(self.made):
            subprocess.run(["losetup", "--detach", device], capture_output=True)
        self.made.clear()


def sectors_read(device: str) -> int:
    fields = Path("/sys/block/%s/stat" % Path(device).name).read_text().split()
    return int(fields[2]) * 512


def flush_device(device: str, write_back: bool = True) -> None:
    with contextlib.suppress(OSError):
        pagecache.drop(device, write_back)


def drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


# --------------------------------------------------------------------------- network


class Net:
    """Where servers and clients run: one namespace with lo (``loopback``), or two joined by a shaped veth."""

    def __init__(self, kind: str) -> None:
        tag = "%x" % os.getpid()
        self.kind = kind
        self.server_ns = "pdcd-s-" + tag
        self.client_ns = self.server_ns if kind == "loopback" else "pdcd-c-" + tag
        self.devices = [(self.server_ns, "lo")] if kind == "loopback" else [
            (self.server_ns, "pdcds" + tag), (self.client_ns, "pdcdc" + tag)]
        self.server_ip = LOOPBACK_IP if kind == "loopback" else SERVER_IP

    def __enter__(self) -> "Net":
        try:
            for ns in {self.server_ns, self.client_ns}:
                run(["ip", "netns", "add", ns])
                run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.kind == "shaped":
                (sns, sdev), (cns, cdev) = self.devices
                run(["ip", "link", "add", sdev, "netns", sns, "type", "veth", "peer", "name", cdev, "netns", cns])
                for ns, dev, address in ((sns, sdev, SERVER_IP), (cns, cdev, CLIENT_IP)):
                    run(["ip", "-n", ns, "addr", "add", address + "/30", "dev", dev])
                    run(["ip", "-n", ns, "link", "set", dev, "up"])
                    run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf"] + SHAPE)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        for ns in {self.server_ns, self.client_ns}:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def wire_bytes(self) -> int:
        return sum(int(run(["ip", "netns", "exec", ns, "cat", "/sys/class/net/%s/statistics/tx_bytes" % dev]))
                   for ns, dev in self.devices)

    def in_server(self, command: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.server_ns] + command

    def in_client(self, command: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.client_ns] + command


@dataclass
class Daemon:
    name: str
    command: List[str]
    port: int
    log_path: Path
    env: Optional[Dict[str, str]] = None
    process: Optional[subprocess.Popen] = None

    def start(self, net: Net) -> None:
        self.process = benchlib.start_process(net.in_server(self.command), self.log_path, self.env)
        deadline = time.monotonic() + benchlib.SERVER_START_TIMEOUT
        probe = net.in_server(["ss", "-Hltn", "sport", "=", ":%i" % self.port])
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


# --------------------------------------------------------------------------- tools and runs


@dataclass
class Devices:
    sources: Dict[str, str]  # kind -> /dev/loopN
    source_files: Dict[str, Path]
    target: str
    target_file: Path
    nodes: Path  # the rsync module: device nodes of the loop devices


@dataclass
class Sample:
    seconds: Optional[float]
    wire: int = 0
    read_source: int = 0
    read_target: int = 0
    error: str = ""
    #: The client's peak RSS (the largest process of the command and what it waited for).
    rss: int = 0


@dataclass
class Cell:
    samples: List[Sample] = field(default_factory=list)


def receiver_command(port: int) -> List[str]:
    """A one-connection TCP listener writing what it receives to stdout (blocksync-fast's delta);
    it gives up after a minute without a connection."""
    code = ("import socket,sys,shutil;s=socket.create_server(('0.0.0.0',%i));s.settimeout(60);c,_=s.accept();"
            "c.settimeout(None);shutil.copyfileobj(c.makefile('rb'),sys.stdout.buffer,1<<20)" % port)
    return [sys.executable, "-c", code]


def sender_command(address: str, port: int) -> List[str]:
    """Its stdin to one TCP connection, retried for up to a minute while nobody listens yet."""
    code = ("import socket,sys,shutil,time\nfor _ in range(600):\n try: c=socket.create_connection(('%s',%i));break\n"
            " except OSError: time.sleep(0.1)\nelse: sys.exit('no receiver')\n"
            "f=c.makefile('wb');shutil.copyfileobj(sys.stdin.buffer,f,1<<20);f.close();c.close()" % (address, port))
    return [sys.executable, "-c", code]


def client_command(tool: str, direction: str, kind: str, devices: Devices, net: Optional[Net], work: Path,
                   ours: benchlib.OursInstallation, blocksync: Optional[str], record: Path) -> List[str]:
    """The command a timed run executes (in the client's namespace where remote)."""
    source, target = devices.sources[kind], devices.target
    if tool.startswith("ours"):
        extra = {"ours-direct": ["--cache", "direct"], "ours-digest": ["--digest-file", str(record)]}.get(tool, [])
        prefix = ours.command + extra
        if direction == "local":
            return prefix + [source, target]
        url = "http://%s:%i/" % (net.server_ip, OURS_PORT)
        if direction == "pull":
            return net.in_client(prefix + [url + "src-" + kind, target])
        return net.in_client(prefix + [source, url + "dst"])
    if tool == "rsync":
        if direction == "local":
            return ["rsync"] + RSYNC_DEVICE_OPTIONS + [source, target]
        url = "rsync://%s:%i/devices/" % (net.server_ip, RSYNC_PORT)
        if direction == "pull":
            return net.in_client(["rsync"] + RSYNC_DEVICE_OPTIONS + [url + "src-" + kind, target])
        return net.in_client(["rsync"] + RSYNC_DEVICE_OPTIONS + [source, url + "dst"])
    assert tool == "blocksync-fast" and blocksync
    if direction == "local":
        return [blocksync, "--silent", "-s", source, "-d", target]
    # Its remote mode: the delta against a digest of the target, on one connection.
    receiver_ip = CLIENT_IP if (direction == "pull" and net.kind == "shaped") else (
        SERVER_IP if net.kind == "shaped" else LOOPBACK_IP)
    make = "set -o pipefail; %s --silent --make-delta -s %s -f %s | %s" % (
        blocksync, source, record, shlex.join(sender_command(receiver_ip, DELTA_PORT)))
    apply = "set -o pipefail; %s | %s --silent --apply-delta -d %s" % (
        shlex.join(receiver_command(DELTA_PORT)), blocksync, target)
    receiving, sending = (net.in_client, net.in_server) if direction == "pull" else (net.in_server, net.in_client)
    # Both ends at once (the sender retries until the receiver listens); the time is that of both.
    return ["bash", "-c", "%s & receiver=$!; %s || { kill $receiver; exit 1; }; wait $receiver" % (
        shlex.join(receiving(["bash", "-c", apply])), shlex.join(sending(["bash", "-c", make])))]


def prepare_record(tool: str, kind: str, case_old: Path, devices: Devices, ours, blocksync, record: Path,
                   logs: Path) -> None:
    """The digest record of the restored target, made untimed (ours-digest; blocksync-fast's remote digest)."""
    with contextlib.suppress(FileNotFoundError):
        record.unlink()
    if tool == "ours-digest":
        run(ours.command + ["--digest-file", str(record), str(case_old), devices.target], env=ours.env)
    elif tool == "blocksync-fast":
        run([blocksync, "--silent", "--make-digest", "-s", devices.target, "-f", str(record)])


def one_run(tool: str, direction: str, kind: str, case_old: Path, devices: Devices, net: Optional[Net],
            work: Path, ours, blocksync, logs: Path) -> Sample:
    record = work / ("record-%s" % tool)
    restore(case_old, devices.target_file)
    flush_device(devices.target)
    needs_record = tool == "ours-digest" or (tool == "blocksync-fast" and direction != "local")
    try:
        if needs_record:
            prepare_record(tool, kind, case_old, devices, ours, blocksync, record, logs)
    except BenchmarkError as error:
        return Sample(None, error="record: " + str(error).splitlines()[-1][:120])
    for device in (devices.sources[kind], devices.target):
        flush_device(device, write_back=not needs_record)  # (an fsync moves the record's write counters)
    drop_caches()
    command = client_command(tool, direction, kind, devices, net, work, ours, blocksync, record)
    wire_before = net.wire_bytes() if net else 0
    source_before, target_before = sectors_read(devices.sources[kind]), sectors_read(devices.target)
    log_path = logs / ("%s-%s-%s.log" % (tool, direction, kind))
    rss_path = logs / "rss"
    if TIME_PROGRAM:  # (a small C parent: the harness's own pages do not count as the client's)
        command = [TIME_PROGRAM, "-f", "%M", "-o", str(rss_path)] + command
    with open(log_path, "w") as log_file:
        log_file.write(shlex.join(command) + "\n")
        log_file.flush()
        started = time.monotonic()
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
                                   env=dict(ours.env, PDIFFCOPY_TOKEN=TOKEN), start_new_session=True)
        try:
            process.wait(benchlib.RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            benchlib.kill_group(process, 9)
            process.wait()
            return Sample(None, error="timed out")
        seconds = time.monotonic() - started
    rss = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        rss = int(rss_path.read_text().split()[-1]) * 1024
    sample = Sample(seconds, (net.wire_bytes() - wire_before) if net else 0,
                    sectors_read(devices.sources[kind]) - source_before,
                    sectors_read(devices.target) - target_before, rss=rss)
    if process.returncode != 0:
        stderr = log_path.read_text().split("\n", 1)[-1]
        lines = [line for line in stderr.splitlines() if line.strip()] or ["exit %i" % process.returncode]
        return Sample(None, error=re.sub(r"^\S+ \S+ pdiffcopy\[\d+\] ERROR ", "", lines[-1])[-160:])
    if subprocess.run(["cmp", "-n", str(devices.source_files[kind].stat().st_size), devices.sources[kind],
                       devices.target], capture_output=True).returncode != 0:
        return Sample(None, error="target differs from the source after the run")
    return sample


def start_servers(net: Net, devices: Devices, ours, tools: List[str], logs: Path, server_args: List[str]
                  ) -> List[Daemon]:
    daemons = []
    if any(tool.startswith("ours") for tool in tools):
        exports = []
        for kind, device in devices.sources.items():
            exports += ["--device", "src-%s=%s" % (kind, device)]
        exports += ["--device", "dst=%s:rw" % devices.target]
        root = logs / "ours-root"
        root.mkdir(exist_ok=True)
        daemons.append(Daemon("our server", ours.command + ["--listen", "0.0.0.0:%i" % OURS_PORT, "--root", str(root)]
                              + exports + server_args, OURS_PORT, logs / "ours-server.log",
                              dict(ours.env, PDIFFCOPY_TOKEN=TOKEN, XDG_RUNTIME_DIR=str(logs))))
    if "rsync" in tools:
        config = logs / "rsyncd.conf"
        config.write_text("\n".join([
            "port = %i" % RSYNC_PORT, "uid = 0", "gid = 0", "use chroot = no", "reverse lookup = no",
            "log file = %s" % (logs / "rsyncd.log"), "[devices]", "path = %s" % devices.nodes, "read only = no",
            # A daemon refuses both by default.
            "refuse options = !copy-devices !write-devices", ""]))
        daemons.append(Daemon("rsync daemon", ["rsync", "--daemon", "--no-detach", "--config=%s" % config],
                              RSYNC_PORT, logs / "rsyncd-server.log"))
    started = []
    for daemon in daemons:
        try:
            daemon.start(net)
            started.append(daemon)
        except BenchmarkError as error:
            log("%s: %s" % (daemon.name, error))
            daemon.stop()
    return started


def device_nodes(directory: Path, devices: Dict[str, str]) -> None:
    """Device nodes of the loop devices in ``directory`` (the rsync daemon's module)."""
    directory.mkdir(exist_ok=True)
    for name, device in devices.items():
        node = directory / name
        with contextlib.suppress(FileNotFoundError):
            node.unlink()
        os.mknod(node, stat.S_IFBLK | 0o600, os.stat(device).st_rdev)


# --------------------------------------------------------------------------- the page cache footprint


class PeakResident:
    """The most of each device seen in the page cache at once, polled every 50 ms while in the block."""

    def __init__(self, devices: List[str]) -> None:
        self.devices = devices
        self.peak = {device: 0 for device in devices}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            for device in self.devices:
                self.peak[device] = max(self.peak[device], pagecache.resident_bytes(device))

    def __enter__(self) -> "PeakResident":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def footprint(args, work: Path, loops: Loops, ours, logs: Path) -> str:
    """The page cache footprint of a local device sync: default (drop), --cache direct, --cache keep."""
    size = args.footprint_size
    source_file, target_file = work / "footprint-source.img", work / "footprint-target.img"
    write_random(source_file, size, None, args.seed + 7)
    empty = work / "footprint-empty.img"
    with open(empty, "wb") as handle:
        handle.truncate(size)
    target_file.touch()
    restore(empty, target_file)
    source, target = loops.attach(source_file), loops.attach(target_file)
    rows = []
    for case, old in (("new", empty), ("nochange", source_file)):
        for mode in ("drop", "direct", "keep"):
            restore(old, target_file)
            samples = []
            for device in (source, target):
                flush_device(device)
            holders = [os.open(device, os.O_RDONLY) for device in (source, target)]
            try:
                peak = PeakResident([source, target])
                cached_before = meminfo()
                started = time.monotonic()
                command = ours.command + ([] if mode == "drop" else ["--cache", mode]) + [source, target]
                with peak:
                    done = subprocess.run(command, capture_output=True, text=True, env=ours.env)
                seconds = time.monotonic() - started
                peak = peak.peak
                after = {device: pagecache.resident_bytes(device) for device in (source, target)}
                cached_delta = meminfo() - cached_before
            finally:
                for fd in holders:
                    os.close(fd)
            if done.returncode != 0:
                rows.append([case, mode, "failed: " + done.stderr.strip().splitlines()[-1][:100], "", "", "", ""])
                continue
            same = subprocess.run(["cmp", source, target], capture_output=True).returncode == 0
            samples.append(seconds)
            rows.append([case, "default (drop)" if mode == "drop" else "--cache " + mode, "%.2f" % seconds,
                         "%s / %s" % (benchlib.format_size(peak[source]), benchlib.format_size(peak[target])),
                         "%s / %s" % (benchlib.format_size(after[source]), benchlib.format_size(after[target])),
                         benchlib.format_size(max(0, cached_delta)), "yes" if same else "NO"])
    return "\n".join([
        "## Page cache footprint of a local device sync (%s devices)" % benchlib.format_size(size), "",
        "Both devices held open meanwhile (a device's cache empties at its last close); resident bytes by "
        "mincore, polled every 50 ms; Buffers+Cached from /proc/meminfo (the whole machine's: other work moves "
        "it). Loop devices read their backing files with direct I/O (`losetup --direct-io=on`).", "",
        benchlib.markdown_table(["case", "mode", "seconds", "peak resident src / dst",
                                 "resident after src / dst", "Buffers+Cached after - before", "equal"], rows), ""])


def meminfo() -> int:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        values[name] = int(rest.split()[0]) * 1024
    return values.get("Buffers", 0) + values.get("Cached", 0)


# --------------------------------------------------------------------------- the report


def cell_text(cell: Cell) -> "tuple[str, str, str, str, str]":
    good = [s for s in cell.samples if s.seconds is not None]
    if not good:
        errors = {s.error for s in cell.samples}
        return ("failed: " + "; ".join(sorted(errors))[:140], "", "", "", "")
    median = sorted(good, key=lambda s: s.seconds)[len(good) // 2]
    return ("%.2f" % median.seconds, benchlib.format_size(median.wire), benchlib.format_size(median.read_source),
            benchlib.format_size(median.read_target), benchlib.format_size(max(s.rss for s in good)))


def report(args, machine: str, results: Dict, mapped: Dict[str, int], notes: List[str], footprint_text: str,
           load_start: str) -> str:
    lines = ["# Block devices: pdiffcopy, rsync, blocksync-fast (%s devices)" % benchlib.format_size(args.size), "",
             "- %s" % machine,
             "- load average at the start %s, at the end %s" % (load_start, benchlib.load_averages()),
             "- rounds: %i, tools alternating; each cell: the median run's time (s), bytes on the link (both "
             "directions; 0 local), bytes read from the source and from the target device, and the client's peak "
             "RSS (GNU time's %%M: the largest single process of the command and what it waited for; "
             "of all rounds)" % args.rounds,
             "- rsync: `rsync %s`" % " ".join(RSYNC_DEVICE_OPTIONS),
             "- changed10: one random 4 KiB write in %i %% of the 1 MiB blocks holding data; sparse: data in "
             "%i %% of the 1 MiB blocks (mapped: %s)" % (CHANGED_SHARE, DATA_SHARE,
                                                          benchlib.format_size(mapped.get("sparse", 0))),
             "- pdiffcopy 1.0.1: not measured (it syncs regular files only)"] + ["- " + note for note in notes] + [""]
    for link in args.links:
        for kind in args.kinds:
            rows = []
            for case in args.cases:
                for direction in args.directions:
                    for tool in args.tools:
                        cell = results.get((link, kind, case, direction, tool))
                        if cell is None:
                            continue
                        rows.append([case, direction, tool, *cell_text(cell)])
            if rows:
                lines += ["## %s, %s-backed source" % (link, kind), "",
                          benchlib.markdown_table(["case", "direction", "tool", "seconds", "link bytes",
                                                   "read src", "read dst", "client peak RSS"], rows), ""]
    lines += targets(args, results, mapped)
    if footprint_text:
        lines += [footprint_text]
    return "\n".join(lines) + "\n"


def targets(args, results: Dict, mapped: Dict[str, int]) -> List[str]:
    """The issue's targets, each checked against this run's medians."""
    def median(key) -> Optional[Sample]:
        cell = results.get(key)
        good = [s for s in (cell.samples if cell else []) if s.seconds is not None]
        return sorted(good, key=lambda s: s.seconds)[len(good) // 2] if good else None

    rows = []
    for link in args.links:
        for kind in args.kinds:
            for case in ("nochange", "changed10"):
                for direction in args.directions:
                    ours = median((link, kind, case, direction, "ours"))
                    if ours is None:
                        continue
                    # blocksync-fast's remote mode reads a digest file of the target, not the target:
                    # it is compared with ours that does too, where measured.
                    digest = median((link, kind, case, direction, "ours-digest"))
                    for other, limit in (("rsync", 0.25), ("blocksync-fast", 1.0)):
                        them = median((link, kind, case, direction, other))
                        mine, name = (digest, "ours-digest") if other == "blocksync-fast" and \
                            direction != "local" and digest is not None else (ours, "ours")
                        if them is not None:
                            ratio = mine.seconds / them.seconds
                            rows.append(["%s %s %s %s" % (link, kind, case, direction),
                                         "%s / %s <= %g" % (name, other, limit),
                                         "%.2f" % ratio, "met" if ratio <= limit else "NOT met"])
            if kind == "sparse":
                for direction in args.directions:
                    ours = median((link, kind, "changed10", direction, "ours"))
                    if ours is not None and mapped.get("sparse"):
                        ratio = ours.read_source / mapped["sparse"]
                        rows.append(["%s sparse changed10 %s" % (link, direction), "read src / mapped <= 1.1",
                                     "%.2f" % ratio, "met" if ratio <= 1.1 else "NOT met"])
            for direction in ("local", "pull"):
                digest = median((link, kind, "nochange", direction, "ours-digest"))
                if digest is not None:
                    rows.append(["%s %s nochange %s" % (link, kind, direction), "--digest-file: target read = 0",
                                 benchlib.format_size(digest.read_target),
                                 "met" if digest.read_target == 0 else "NOT met"])
    if not rows:
        return []
    return ["## Targets (issue 37)", "", benchlib.markdown_table(["where", "target", "measured", ""], rows), ""]


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=benchlib.parse_size, default=benchlib.parse_size("8G"),
                        help="device size (default 8G; 1G for a quick run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", type=lambda t: benchlib.parse_name_list(t, CASES), default=list(CASES))
    parser.add_argument("--kinds", type=lambda t: benchlib.parse_name_list(t, KINDS), default=list(KINDS))
    parser.add_argument("--directions", type=lambda t: benchlib.parse_name_list(t, DIRECTIONS),
                        default=list(DIRECTIONS))
    parser.add_argument("--links", type=lambda t: benchlib.parse_name_list(t, LINKS), default=list(LINKS))
    parser.add_argument("--tools", type=lambda t: benchlib.parse_name_list(t, TOOLS), default=list(DEFAULT_TOOLS),
                        help="of %s (default %s)" % (",".join(TOOLS), ",".join(DEFAULT_TOOLS)))
    parser.add_argument("--digest-file", action="store_true",
                        help="add ours-digest (pdiffcopy --digest-file; where this checkout has it)")
    parser.add_argument("--direct", action="store_true", help="add ours-direct (pdiffcopy --cache direct)")
    parser.add_argument("--blocksync-fast", default=None, metavar="PROGRAM",
                        help="the blocksync-fast binary (default: blocksync-fast on PATH; none: its rows are left out)")
    parser.add_argument("--ours-server-args", type=shlex.split, default=[])
    parser.add_argument("--ours-checkout", type=Path, default=None, metavar="DIR",
                        help="run the pdiffcopy of another checkout (its top directory) instead of this one")
    parser.add_argument("--footprint", action="store_true", help="add the page cache footprint table")
    parser.add_argument("--footprint-only", action="store_true", help="only the page cache footprint table")
    parser.add_argument("--footprint-size", type=benchlib.parse_size, default=benchlib.parse_size("1G"))
    parser.add_argument("--work-dir", type=Path, default=None, help="where the backing files go (default: a "
                        "directory under the system's temporary directory)")
    parser.add_argument("--seed", type=int, default=benchlib.DEFAULT_SEED)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--keep-data", action="store_true")
    args = parser.parse_args(argv)
    if args.digest_file and "ours-digest" not in args.tools:
        args.tools.append("ours-digest")
    if args.direct and "ours-direct" not in args.tools:
        args.tools.append("ours-direct")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("device_bench.py: needs root (loop devices, namespaces, drop_caches)", file=sys.stderr)
        return 2
    benchlib.install_signal_handlers()
    ours, reason = benchlib.find_ours()
    if ours is None:
        print("device_bench.py: %s" % reason, file=sys.stderr)
        return 2
    if args.ours_checkout:
        checkout = str(args.ours_checkout.resolve())
        ours = benchlib.OursInstallation([sys.executable, "-P", "-m", "pdiffcopy"], dict(ours.env, PYTHONPATH=checkout),
                                         "our pdiffcopy of %s" % checkout)
    notes: List[str] = [ours.description]
    blocksync = args.blocksync_fast or shutil.which("blocksync-fast")
    if "blocksync-fast" in args.tools and not blocksync:
        notes.append("blocksync-fast: not measured (no binary: give --blocksync-fast PROGRAM)")
        args.tools = [tool for tool in args.tools if tool != "blocksync-fast"]
    elif blocksync:
        version = subprocess.run([blocksync, "-V"], capture_output=True, text=True).stdout.splitlines()
        notes.append("blocksync-fast: %s (%s)" % (version[0] if version else "?", blocksync))
    parent = args.work_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    work = Path(tempfile.mkdtemp(prefix="pdiffcopy-devices-", dir=parent))
    logs = work / "logs"
    logs.mkdir()
    loops = Loops()
    load_start = benchlib.load_averages()
    machine = benchlib.machine_description(work)
    failed = False
    try:
        footprint_text = footprint(args, work, loops, ours, logs) if (args.footprint or args.footprint_only) else ""
        results: Dict = {}
        mapped: Dict[str, int] = {}
        if not args.footprint_only:
            results, mapped = measure(args, work, loops, ours, blocksync, logs)
        text = report(args, machine, results, mapped, notes, footprint_text, load_start)
        print(text)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(text)
        return 0
    except BaseException:
        failed = True
        raise
    finally:
        loops.detach_all()
        if args.keep_data or failed:
            log("data and logs kept in %s" % work)
            if not args.keep_data:
                for image in work.glob("*.img"):
                    image.unlink()
        else:
            shutil.rmtree(work, ignore_errors=True)


def measure(args, work: Path, loops: Loops, ours, blocksync, logs: Path):
    size = args.size
    blocks = -(-size // MiB)
    source_files = {"dense": work / "source-dense.img", "sparse": work / "source-sparse.img"}
    log("writing the sources (%s each)" % benchlib.format_size(size))
    write_random(source_files["dense"], size, None, args.seed)
    rng = random.Random(args.seed + 1)
    write_random(source_files["sparse"], size, sorted(rng.sample(range(blocks), max(1, blocks * DATA_SHARE // 100))),
                 args.seed + 2)
    mapped = {kind: sum(length for _, length in data_extents(path)) for kind, path in source_files.items()}
    olds: Dict = {}
    for kind in args.kinds:
        for case in args.cases:
            old = work / ("old-%s-%s.img" % (kind, case))
            if case == "nochange":
                old.touch()
                restore(source_files[kind], old)
            elif case == "changed10":
                changed_copy(source_files[kind], old, args.seed + 3)
            else:
                with open(old, "wb") as handle:
                    handle.truncate(size)
            olds[kind, case] = old
    target_file = work / "target.img"
    with open(target_file, "wb") as handle:
        handle.truncate(size)
    sources = {kind: loops.attach(source_files[kind]) for kind in args.kinds}
    devices = Devices(sources, source_files, loops.attach(target_file), target_file, work / "nodes")
    device_nodes(devices.nodes, dict({"src-" + kind: device for kind, device in sources.items()},
                                     dst=devices.target))
    results: Dict = {}
    for link in args.links:
        remote = [d for d in args.directions if d != "local"]
        with contextlib.ExitStack() as stack:
            net = stack.enter_context(Net(link)) if remote else None
            daemons = start_servers(net, devices, ours, args.tools, logs, args.ours_server_args) if net else []
            for daemon in daemons:
                stack.callback(daemon.stop)
            serving = {daemon.name for daemon in daemons}
            for round_index in range(args.rounds):
                order = args.tools[round_index % len(args.tools):] + args.tools[: round_index % len(args.tools)]
                for kind in args.kinds:
                    for case in args.cases:
                        for direction in args.directions:
                            if direction == "local" and link != args.links[0]:
                                continue  # local runs do not use the link: measured once
                            for tool in order:
                                if tool == "ours-digest" and direction == "push":
                                    continue  # the record is the target's: a local target only
                                log("round %i: %s %s %s %s %s" % (round_index + 1, link, kind, case, direction, tool))
                                server = "our server" if tool.startswith("ours") else (
                                    "rsync daemon" if tool == "rsync" else None)
                                if direction != "local" and server and server not in serving:
                                    reason = ("this checkout's server does not export devices (--device)"
                                              if tool.startswith("ours") else "the rsync daemon did not start")
                                    results.setdefault((link, kind, case, direction, tool), Cell()).samples.append(
                                        Sample(None, error=reason))
                                    continue
                                sample = one_run(tool, direction, kind, olds[kind, case], devices,
                                                 net if direction != "local" else None, work, ours, blocksync, logs)
                                if sample.error:
                                    log("  failed: %s" % sample.error)
                                else:  # as it goes: a run stopped early still says what it measured
                                    log("  %.2f s, wire %s, read source %s, target %s" % (
                                        sample.seconds, benchlib.format_size(sample.wire),
                                        benchlib.format_size(sample.read_source),
                                        benchlib.format_size(sample.read_target)))
                                results.setdefault((link, kind, case, direction, tool), Cell()).samples.append(sample)
    return results, mapped


if __name__ == "__main__":
    sys.exit(main())

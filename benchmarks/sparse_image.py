#!/usr/bin/env python3
"""
Sparse-image benchmark: a thin-provisioned VM disk image synced by pdiffcopy and by ``rsync -S``.

The source is a raw image of ``--size`` bytes (default 16 GiB) that holds ``--data`` bytes
(default 1 GiB) of random data in ``--extents`` extents (default 256) at seeded, 4 KiB-aligned
offsets; the rest is holes. Cases:

- ``new``: no target;
- ``changed10``: the target is an older copy of the image: 10 % of its data (64 KiB pieces at
  seeded places in the data extents) differs;
- ``nochange``: the target is an exact (sparse) copy.

Each case runs locally, as a pull and as a push, on loopback (``127.0.0.1``) and on a
veth link between two network namespaces shaped with ``tc tbf`` (``--nets loopback,1gbit``).
rsync runs as ``rsync -S`` (with ``--inplace --no-whole-file --ignore-times`` when a target
exists, so that it compares rather than skips) locally and against an rsync daemon; ours as
``pdiffcopy SRC TGT`` against its server. ``--baseline REV`` adds our client and server at
an earlier git revision, for a before/after in one run. For every run the report gives the
wall time of the client process, the bytes on the link (veth or lo counters), the peak RSS of
the client and of the largest server process, and the target's allocation against the
source's; every result is checked by size and sha256 outside the timing.

Needs root for the shaped link (iproute2). Everything it makes is removed at the end.
"""

import argparse
import os
import random
import shlex
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import benchlib
import shaped_link
from benchlib import BenchmarkError, log

CASES = ("new", "changed10", "nochange")
MODES = ("local", "pull", "push")
TOOLS = ("ours", "baseline", "rsync")
LOOPBACK = "loopback"
#: Data extents start at multiples of this (a file system block; not of our 1 MiB blocks).
EXTENT_ALIGNMENT = 4096
#: A changed piece of the changed10 case: a few database pages or a VM's write cluster.
CHANGE_PIECE = 64 * 1024
CHANGE_PERCENT = 10
OURS_PORT, BASELINE_PORT, RSYNC_PORT = 8201, 8202, 8873


def data_extents(path: Path):
    """The (offset, length) data extents of a file, by SEEK_DATA / SEEK_HOLE."""
    extents = []
    with open(path, "rb") as handle:
        fd, size, position = handle.fileno(), os.fstat(handle.fileno()).st_size, 0
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole remains
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, end - start))
            position = end
    return extents


def sparse_copy(source: Path, target: Path) -> None:
    """Copy `source` to a new `target` with the same holes (data extents only), flushed."""
    target.unlink(missing_ok=True)
    with open(source, "rb") as src, open(target, "wb") as dst:
        os.ftruncate(dst.fileno(), os.fstat(src.fileno()).st_size)
        for offset, length in data_extents(source):
            done = 0
            while done < length:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), min(benchlib.IO_CHUNK, length - done),
                                            offset + done, offset + done)
                if not copied:
                    raise BenchmarkError("short copy of %s" % source)
                done += copied
        os.fsync(dst.fileno())


def same_content(source: Path, target: Path) -> bool:
    """Whether two files hold the same bytes, reading only where either has data (holes read as zeros).

    Exact, and fast for a 1 TiB image: a sha256 of it would read a tebibyte of zeros.
    """
    if source.stat().st_size != target.stat().st_size:
        return False
    ranges = sorted(data_extents(source) + data_extents(target))
    with open(source, "rb") as a, open(target, "rb") as b:
        position = 0
        for offset, length in ranges:
            start, end = max(offset, position), offset + length
            while start < end:
                count = min(benchlib.IO_CHUNK, end - start)
                if os.pread(a.fileno(), count, start) != os.pread(b.fileno(), count, start):
                    return False
                start += count
            position = max(position, end)
    return True


def make_image(path: Path, size: int, data: int, extents: int, seed: int) -> None:
    """A sparse image of `size` bytes with `data` bytes of random data in `extents` extents."""
    rng = random.Random("image-%i" % seed)
    length = data // extents - (data // extents) % EXTENT_ALIGNMENT
    slots = size // EXTENT_ALIGNMENT
    stride = slots // extents  # one extent in each stride, at a random place inside it
    if length <= 0 or stride * EXTENT_ALIGNMENT < length:
        raise BenchmarkError("cannot place %i extents of %i bytes in %i bytes" % (extents, length, size))
    with open(path, "wb") as handle:
        handle.truncate(size)
        for index in range(extents):
            room = stride - length // EXTENT_ALIGNMENT
            offset = (index * stride + rng.randrange(room + 1)) * EXTENT_ALIGNMENT
            handle.seek(offset)
            for done in range(0, length, benchlib.IO_CHUNK):
                handle.write(rng.randbytes(min(benchlib.IO_CHUNK, length - done)))
        os.fsync(handle.fileno())


def make_older(source: Path, target: Path, seed: int) -> int:
    """`target`: a sparse copy of `source` with CHANGE_PERCENT % of its data rewritten; the bytes changed."""
    sparse_copy(source, target)
    rng = random.Random("older-%i" % seed)
    pieces = [(offset + done, min(CHANGE_PIECE, length - done))
              for offset, length in data_extents(source) for done in range(0, length, CHANGE_PIECE)]
    chosen = rng.sample(pieces, round(len(pieces) * CHANGE_PERCENT / 100))
    with open(target, "r+b") as handle:
        for offset, length in sorted(chosen):
            handle.seek(offset)
            handle.write(rng.randbytes(length))
        os.fsync(handle.fileno())
    return sum(length for _, length in chosen)


class Loopback:
    """The client and the servers in this network namespace, on 127.0.0.1: the link is lo."""

    address = "127.0.0.1"

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def shape(self, rate: int) -> None:
        pass

    def wire_bytes(self) -> int:
        # lo's tx counts every packet once (what lo sends, it receives).
        return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())

    def in_server(self, command: List[str]) -> List[str]:
        return command

    def in_client(self, command: List[str]) -> List[str]:
        return command


class Shaped(shaped_link.Link):
    address = shaped_link.SERVER_IP


@dataclass
class Tool:
    name: str
    mode: str
    # (source, target, whether the target exists) -> the client's command line
    command: object
    env: Optional[Dict[str, str]] = None


@dataclass
class Sample:
    seconds: float
    wire: int
    client_rss_kib: int
    allocated: int


def server_peak_rss_kib(server: shaped_link.Server) -> int:
    """The peak RSS (VmHWM) of the largest process of a server's process group."""
    if server.process is None:
        return 0
    peak = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != server.process.pid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
        except (OSError, ValueError):
            continue
    return peak


def build(args, net, work: Path, logs: Path):
    """The servers and the tools for one network."""
    servers: List[shaped_link.Server] = []
    tools: List[Tool] = []
    token = "sparse-image-benchmark-token"
    for family in args.tools:
        if family == "rsync":
            config = logs / ("rsyncd-%s.conf" % id(net))
            config.write_text("\n".join([
                "address = %s" % net.address, "port = %i" % RSYNC_PORT, "uid = %i" % os.getuid(),
                "gid = %i" % os.getgid(), "use chroot = no", "reverse lookup = no",
                "log file = %s" % (logs / "rsyncd.log"), "[work]", "path = %s" % work, "read only = no", ""]))
            daemon = ["rsync", "--daemon", "--no-detach", "--config=%s" % config]
            servers.append(shaped_link.Server("rsync daemon", daemon, RSYNC_PORT, logs / "rsyncd-server.log"))
            url = "rsync://%s:%i/work/" % (net.address, RSYNC_PORT)

            def rsync(exists: bool) -> List[str]:
                return ["rsync", "-S", *(benchlib.RSYNC_OPTIONS if exists else ("--ignore-times",))]

            tools += [Tool("rsync", "local", lambda s, t, e: rsync(e) + [str(s), str(t)]),
                      Tool("rsync", "pull", lambda s, t, e, u=url: rsync(e) + [u + str(s.relative_to(work)), str(t)]),
                      Tool("rsync", "push", lambda s, t, e, u=url: rsync(e) + [str(s), u + str(t.relative_to(work))])]
            continue
        if family == "ours":
            installation, reason = benchlib.find_ours()
            if installation is None:
                raise BenchmarkError(reason)
            port = OURS_PORT
        else:
            if not args.baseline:
                raise BenchmarkError("the baseline tool needs --baseline REV")
            installation = benchlib.baseline_installation(args.baseline, work)
            port = BASELINE_PORT
        env = dict(installation.env, PDIFFCOPY_TOKEN=token, XDG_RUNTIME_DIR=str(logs))
        servers.append(shaped_link.Server(family, installation.command + [
            "--listen", "%s:%i" % (net.address, port), "--root", str(work)], port,
            logs / ("%s-server.log" % family), env))
        url = "http://%s:%i/" % (net.address, port)
        prefix = installation.command + args.ours_args
        tools += [Tool(family, "local", lambda s, t, e, p=prefix: p + [str(s), str(t)], env),
                  Tool(family, "pull", lambda s, t, e, p=prefix, u=url: p + [u + str(s.relative_to(work)), str(t)],
                       env),
                  Tool(family, "push", lambda s, t, e, p=prefix, u=url: p + [str(s), u + str(t.relative_to(work))],
                       env)]
    return servers, [tool for tool in tools if tool.mode in args.modes]


def measure(tool: Tool, case: str, source: Path, older: Path, net, work: Path, logs: Path,
            warm_up: bool) -> Sample:
    target = work / "run" / ("%s-%s-%s.img" % (case, tool.name, tool.mode))
    log_path = logs / ("%s-%s-%s.log" % (tool.name, tool.mode, case))
    exists = case != "new"
    for _timed in ([False, True] if warm_up else [True]):
        target.unlink(missing_ok=True)
        if case == "changed10":
            sparse_copy(older, target)
        elif case == "nochange":
            sparse_copy(source, target)
        with open(source, "rb") as handle:  # the source's data in the page cache, as for every tool
            for offset, length in data_extents(source):
                os.posix_fadvise(handle.fileno(), offset, length, os.POSIX_FADV_WILLNEED)
        before = net.wire_bytes()
        command = tool.command(source, target, exists)
        result = benchlib.run_tool(command if tool.mode == "local" else net.in_client(command), log_path, tool.env)
        wire = net.wire_bytes() - before
    allocated = target.stat().st_blocks * 512
    if not same_content(source, target):
        raise BenchmarkError("VERIFICATION FAILED for %s %s on %s: %s differs from the source"
                             % (tool.name, tool.mode, case, target))
    target.unlink()
    return Sample(result.seconds, wire, result.max_rss_kib, allocated)


def report(args, machine, results, source_allocated: int, changed: int, server_rss: Dict, start_load: str) -> str:
    lines = ["# Sparse-image benchmark", "", machine, "",
             "- command: `%s`" % shlex.join([sys.executable] + sys.argv),
             "- source: %s apparent, %s of data in %i extents (%s allocated); changed10 differs in %s"
             % (benchlib.format_size(args.size), benchlib.format_size(args.data), args.extents,
                benchlib.format_size(source_allocated), benchlib.format_size(changed)),
             "- rsync: `rsync -S` (a new target) or `rsync -S %s` (an existing one), local or against its daemon"
             % " ".join(benchlib.RSYNC_OPTIONS),
             "- each cell: median of %i run(s); bytes: both directions on the link; RSS: peak of the client "
             "process (children included by wait4's rule: the largest one)" % args.rounds, ""]
    header = ["net", "case", "mode", "tool", "median s", "best s", "time / rsync", "MiB on the link",
              "client RSS MiB", "allocation / source"]
    rows = []
    for (net, case, mode, name), samples in results.items():
        median = statistics.median(s.seconds for s in samples)
        rsync = results.get((net, case, mode, "rsync"))
        rsync_median = statistics.median(s.seconds for s in rsync) if rsync else None
        rows.append([net, case, mode, name, "%.2f" % median, "%.2f" % min(s.seconds for s in samples),
                     benchlib.format_ratio(median, rsync_median) if name != "rsync" else "",
                     "-" if mode == "local" else "%.1f" % (statistics.median(s.wire for s in samples) / 2**20),
                     "%.0f" % (max(s.client_rss_kib for s in samples) / 1024),
                     "%.3f" % (max(s.allocated for s in samples) / source_allocated)])
    lines += [benchlib.markdown_table(header, rows), ""]
    if server_rss:
        lines += ["Peak RSS of the largest server process after each network's runs: " + ", ".join(
            "%s %s %.0f MiB" % (net, name, kib / 1024) for (net, name), kib in server_rss.items()), ""]
    lines.append("Load average (1, 5, 15 min): %s at the start, %s at the end."
                 % (start_load, benchlib.load_averages()))
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--size", default="16G", type=benchlib.parse_size, help="apparent size (default 16G)")
    parser.add_argument("--data", default="1G", type=benchlib.parse_size, help="data in the image (default 1G)")
    parser.add_argument("--extents", default=256, type=int, help="data extents (default 256)")
    parser.add_argument("--cases", default=",".join(CASES), type=lambda t: benchlib.parse_name_list(t, CASES))
    parser.add_argument("--modes", default=",".join(MODES), type=lambda t: benchlib.parse_name_list(t, MODES))
    parser.add_argument("--tools", default="ours,rsync", type=lambda t: benchlib.parse_name_list(t, TOOLS))
    parser.add_argument("--nets", default="loopback,1gbit",
                        help="loopback and/or link rates for the shaped veth link (default loopback,1gbit)")
    parser.add_argument("--rounds", default=3, type=int)
    parser.add_argument("--warm-up", action="store_true", help="an untimed run before each timed one")
    parser.add_argument("--seed", default=benchlib.DEFAULT_SEED, type=int)
    parser.add_argument("--baseline", metavar="REV", help="the baseline tool: our pdiffcopy at git revision REV")
    parser.add_argument("--ours-args", default="", type=shlex.split, help="extra options for our client")
    parser.add_argument("--workdir", default=Path("/var/tmp"), type=Path)
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    args.nets = [n if n == LOOPBACK else shaped_link.parse_rate(n) for n in args.nets.split(",")]
    if any(n != LOOPBACK for n in args.nets) and os.geteuid() != 0:
        parser.error("the shaped link needs root")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    dirs = benchlib.WorkDirs.make(args.workdir, "sparse-image-")
    work, data, logs = dirs.root, dirs.data, dirs.logs
    (work / "run").mkdir(exist_ok=True)
    servers: List[shaped_link.Server] = []
    try:
        machine = benchlib.machine_description(work)
        source, older = data / "source.img", data / "older.img"
        log("making a %s image with %s of data" % (benchlib.format_size(args.size), benchlib.format_size(args.data)))
        make_image(source, args.size, args.data, args.extents, args.seed)
        changed = make_older(source, older, args.seed) if "changed10" in args.cases else 0
        source_allocated = source.stat().st_blocks * 512
        results: Dict = {}
        server_rss: Dict = {}
        start_load = benchlib.load_averages()
        local_done = False
        for net_name in args.nets:
            modes = [m for m in args.modes if m != "local" or not local_done]
            if not modes:
                continue
            with (Loopback() if net_name == LOOPBACK else Shaped()) as net:
                net.shape(0 if net_name == LOOPBACK else net_name)
                label = net_name if net_name == LOOPBACK else shaped_link.format_rate(net_name)
                servers, tools = build(argparse.Namespace(**{**vars(args), "modes": modes}), net, work, logs)
                for server in servers:
                    server.start(net)
                for case in args.cases:
                    for round_number in range(args.rounds):
                        for tool in (tools if round_number % 2 == 0 else list(reversed(tools))):
                            sample = measure(tool, case, source, older, net, work, logs, args.warm_up)
                            where = "local" if tool.mode == "local" else label
                            log("%s %s %s %s: %.2f s, %.1f MiB on the link, allocation %.3f" % (
                                where, case, tool.mode, tool.name, sample.seconds, sample.wire / 2**20,
                                sample.allocated / source_allocated))
                            results.setdefault((where, case, tool.mode, tool.name), []).append(sample)
                for server in servers:
                    server_rss[(label, server.name)] = server_peak_rss_kib(server)
                    server.stop()
                servers = []
            local_done = True
        text = report(args, machine, results, source_allocated, changed, server_rss, start_load)
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

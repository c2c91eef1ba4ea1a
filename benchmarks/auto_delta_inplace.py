#!/usr/bin/env python3
"""
The default delta (``--delta auto``) against both deltas and rsync, on writes in place and on shifted data.

A choice right on one change pattern can be wrong on another: the automatic delta once sent
database pages rewritten in place down the chunked path, 5.9 times slower than the block
delta. Here, in one run and alternating, the default, ``--delta blocks``, ``--delta chunks``,
rsync (and with ``--baseline REV`` the default of an earlier revision) sync each workload:

- in place: 1 % and 10 % of the 16 KiB pages rewritten at random page offsets (InnoDB),
  10 % of the 8 KiB pages (PostgreSQL), 4 KiB rewritten at the start of every 10th MiB
  (a header at a block boundary);
- shifted: 100 bytes inserted near the start, 1 byte inserted every 16 MiB, 100 bytes
  deleted near the start, a tar whose first member grew by 10 KiB.

``local`` syncs one file onto another (``rsync -I --inplace --no-whole-file``); ``pull``
fetches from our server on 127.0.0.1 (rsync from an rsync daemon there). Each cache state
of ``--caches``: ``warm`` (the source read through, an untimed warm-up run of the same tool
just before, on its own fresh target) or ``cold`` (written back, then
``echo 3 > /proc/sys/vm/drop_caches``: needs root). Every run starts from a fresh copy of
the old target, flushed; every result is checked by size and sha256 outside the timing.
The report gives medians and bests, the ratios the issue asks about (the default against
``--delta blocks`` on writes in place, against ``--delta chunks`` on shifted data, against
rsync everywhere), the delta the default chose, the bytes each sent, and the load.

    python3 benchmarks/auto_delta_inplace.py --sizes 1G --rounds 2 --workdir /work/bench \\
        --baseline a5d9ac4 --output benchmarks/results/autodelta/inplace-1g-warm-cold.txt

Files live under ``--workdir`` (one workload's at a time: the old target, the source, a
target; about 4 times the size), and are removed at the end.
"""

import argparse
import os
import random
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import benchlib
from benchlib import BenchmarkError, log
from shaped_link import tar_of_tree, with_deletion, with_insertions

MIB = 1024 * 1024

#: (name, kind, description) of every workload, in the report's order.
WORKLOADS = (
    ("pages16-1", "in place", "1 % of 16 KiB pages rewritten"),
    ("pages16-10", "in place", "10 % of 16 KiB pages rewritten"),
    ("pages8-10", "in place", "10 % of 8 KiB pages rewritten"),
    ("heads10m", "in place", "4 KiB at every 10th MiB"),
    ("shift-start", "shifted", "100 bytes inserted near the start"),
    ("shift-every", "shifted", "1 byte inserted every 16 MiB"),
    ("shift-delete", "shifted", "100 bytes deleted near the start"),
    ("shift-tar", "shifted", "a tar whose first member grew"),
)
#: The order they run in: in place and shifted by turns, so that a run cut short has both kinds.
RUN_ORDER = ("pages16-10", "shift-start", "pages16-1", "shift-every", "pages8-10", "shift-delete", "heads10m",
             "shift-tar")
TOOLS = ("auto", "blocks", "chunks", "rsync", "baseline")
DIRECTIONS = ("local", "pull")
CACHES = ("warm", "cold")

#: Where the shifts are, as in benchmarks/shaped_link.py.
SHIFT_OFFSET = 4096
SHIFT_BYTES = 100
SHIFT_EVERY = 16 * MIB
TAR_GROWTH = 10 * 1024
HEAD_EVERY = 10 * MIB
HEAD_BYTES = 4096

#: Seconds a cold run waits after the page cache was dropped: freed memory goes back to the host
#: after about 2 s, and without the wait the run after a tool that filled more of the cache (rsync)
#: would pay for faulting it back in while the others did not.
COLD_SETTLE_SECONDS = 3.0

#: What the ratios are held against: the default at most this many times the better delta.
ALLOWED_RATIO = 1.2


@dataclass
class Workload:
    name: str
    kind: str
    description: str
    base: Path
    source: Path
    sha256: str = ""
    size: int = 0


@dataclass
class Sample:
    seconds: float
    sent: Optional[int]
    chosen: str = ""


@dataclass
class Tool:
    name: str
    # (workload, direction, target) -> command line
    command: Callable[[Workload, str, Path], List[str]]
    env: Optional[Dict[str, str]] = None


@dataclass
class Cell:
    samples: List[Sample] = field(default_factory=list)

    def median(self) -> float:
        return statistics.median(sample.seconds for sample in self.samples)

    def best(self) -> float:
        return min(sample.seconds for sample in self.samples)

    def sent(self) -> Optional[int]:
        values = [sample.sent for sample in self.samples if sample.sent is not None]
        return int(statistics.median(values)) if values else None

    def chosen(self) -> str:
        return ",".join(sorted({sample.chosen for sample in self.samples if sample.chosen}))


def rewrite_pages(base: Path, source: Path, page: int, percent: float, seed: int) -> None:
    """``source``: ``base`` with ``percent`` % of its ``page``-byte pages, at random page offsets, rewritten."""
    benchlib.copy_file(base, source)
    size = base.stat().st_size
    pages = size // page
    rng = random.Random("pages-%i-%i-%s" % (seed, page, percent))
    with open(source, "r+b") as handle:
        for index in sorted(rng.sample(range(pages), round(pages * percent / 100))):
            handle.seek(index * page)
            handle.write(rng.randbytes(page))


def rewrite_heads(base: Path, source: Path, seed: int) -> None:
    """``source``: ``base`` with HEAD_BYTES rewritten at the start of every HEAD_EVERY."""
    benchlib.copy_file(base, source)
    rng = random.Random("heads-%i" % seed)
    with open(source, "r+b") as handle:
        for offset in range(0, base.stat().st_size, HEAD_EVERY):
            handle.seek(offset)
            handle.write(rng.randbytes(HEAD_BYTES))


def prepare(name: str, data: Path, random_base: Path, size: int, seed: int) -> Workload:
    """Write one workload's source (and, for the tar, its own base) under ``data``."""
    kind, description = next((kind, text) for known, kind, text in WORKLOADS if known == name)
    source = data / ("%s.img" % name)
    base = random_base
    if name == "pages16-1":
        rewrite_pages(base, source, 16 * 1024, 1, seed)
    elif name == "pages16-10":
        rewrite_pages(base, source, 16 * 1024, 10, seed)
    elif name == "pages8-10":
        rewrite_pages(base, source, 8 * 1024, 10, seed)
    elif name == "heads10m":
        rewrite_heads(base, source, seed)
    elif name == "shift-start":
        with_insertions(base, source, [SHIFT_OFFSET], SHIFT_BYTES, seed)
    elif name == "shift-every":
        with_insertions(base, source, list(range(SHIFT_EVERY, size, SHIFT_EVERY)), 1, seed)
    elif name == "shift-delete":
        with_deletion(base, source, SHIFT_OFFSET, SHIFT_BYTES)
    elif name == "shift-tar":
        base = data / "tar.base"
        tar_of_tree(base, size, seed, 0)
        tar_of_tree(source, size, seed, TAR_GROWTH)
    else:
        raise BenchmarkError("unknown workload %s" % name)
    os.sync()
    return Workload(name, kind, description, base, source, benchlib.sha256_file(source), source.stat().st_size)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as handle:
        handle.write("3\n")


def sent_bytes(tool: str, log_path: Path) -> "tuple[Optional[int], str]":
    """(bytes the run sent, the delta the default chose) from the run's log."""
    text = log_path.read_text(errors="replace")
    if tool == "rsync":
        found = re.search(r"Literal data: ([\d,]+) bytes", text)
        return (int(found.group(1).replace(",", "")) if found else None), ""
    found = re.search(r"moved (\d+) bytes", text)
    chose = re.search(r": (blocks|chunks) delta \(", text)
    return (int(found.group(1)) if found else None), (chose.group(1) if chose else "")


def measure(tool: Tool, workload: Workload, direction: str, cache: str, run: Path, logs: Path) -> Sample:
    target = run / ("%s-%s-%s.img" % (workload.name, tool.name, direction))
    log_path = logs / ("%s-%s-%s-%s.log" % (workload.name, tool.name, direction, cache))
    if cache == "warm":
        # The untimed warm-up: freed memory goes back to the host after about 2 s.
        benchlib.fresh_target(workload.base, target, True)
        benchlib.run_tool(tool.command(workload, direction, target), log_path, tool.env)
    benchlib.fresh_target(workload.base, target, True)
    if cache == "warm":
        benchlib.read_through(workload.source)
    else:
        drop_caches()
        time.sleep(COLD_SETTLE_SECONDS)
    result = benchlib.run_tool(tool.command(workload, direction, target), log_path, tool.env)
    sent, chosen = sent_bytes(tool.name, log_path)
    benchlib.verify_copy(target, workload.sha256, workload.size, "%s %s on %s" % (tool.name, direction, workload.name))
    target.unlink()
    return Sample(result.seconds, sent, chosen)


def build_tools(names: List[str], ours: benchlib.OursInstallation, baseline: Optional[benchlib.OursInstallation],
                our_server, baseline_server, daemon, data: Path) -> List[Tool]:
    """The tools of ``names``; pdiffcopy runs with -vv --stats (the choice and the bytes, in its log)."""
    tools = []

    def pdiffcopy(prefix: List[str], server, options: List[str]):
        def command(workload: Workload, direction: str, target: Path) -> List[str]:
            source = server.url(workload.source) if direction == "pull" else str(workload.source)
            return prefix + ["-vv", "--stats"] + options + [source, str(target)]
        return command

    def rsync(workload: Workload, direction: str, target: Path) -> List[str]:
        source = daemon.url("data", workload.source.name) if direction == "pull" else str(workload.source)
        return ["rsync", "-I", "--inplace", "--no-whole-file", "--stats", source, str(target)]

    for name in names:
        if name == "rsync":
            tools.append(Tool(name, rsync))
        elif name == "baseline":
            tools.append(Tool(name, pdiffcopy(baseline.command, baseline_server, []), baseline.env))
        else:
            options = [] if name == "auto" else ["--delta", name]
            tools.append(Tool(name, pdiffcopy(ours.command, our_server, options), ours.env))
    return tools


def ratio(one: Cell, other: Optional[Cell]) -> str:
    if other is None or not other.samples:
        return "-"
    return "%.2fx" % (one.median() / other.median())


def report(results: Dict, workloads: List[Workload], names: List[str], sizes: List[int], header: List[str]) -> str:
    lines = header[:]
    problems = []
    for size in sizes:
        for cache in CACHES:
            for direction in DIRECTIONS:
                cells = {(w, t): results.get((size, cache, direction, w, t)) for w in [x.name for x in workloads]
                         for t in names}
                if not any(cell for cell in cells.values()):
                    continue
                lines += ["", "## %s, %s, page cache %s" % (benchlib.format_size(size), direction, cache), ""]
                columns = ["workload"] + ["%s s (best)" % name for name in names]
                columns += ["auto/blocks", "auto/chunks", "auto/rsync"]
                if "baseline" in names:
                    columns.append("auto/baseline")
                columns += ["auto chose", "auto sent", "rsync sent"]
                rows = []
                for workload in workloads:
                    auto = cells.get((workload.name, "auto"))
                    if not auto:
                        continue
                    row = [workload.name]
                    for name in names:
                        cell = cells.get((workload.name, name))
                        row.append("%.2f (%.2f)" % (cell.median(), cell.best()) if cell else "-")
                    row += [ratio(auto, cells.get((workload.name, other))) for other in ("blocks", "chunks", "rsync")]
                    if "baseline" in names:
                        row.append(ratio(auto, cells.get((workload.name, "baseline"))))
                    rsync = cells.get((workload.name, "rsync"))
                    row += [auto.chosen(), str(auto.sent()), str(rsync.sent()) if rsync else "-"]
                    rows.append(row)
                    against = "blocks" if workload.kind == "in place" else "chunks"
                    other = cells.get((workload.name, against))
                    if other and auto.median() > ALLOWED_RATIO * other.median():
                        problems.append("%s %s %s %s: auto %.2f s is more than %.1fx --delta %s's %.2f s"
                                        % (benchlib.format_size(size), direction, cache, workload.name,
                                           auto.median(), ALLOWED_RATIO, against, other.median()))
                lines.append(benchlib.markdown_table(columns, rows))
    lines += ["", "## Every sample (seconds)", ""]
    for key, cell in sorted(results.items(), key=lambda item: tuple(map(str, item[0]))):
        size, cache, direction, workload, tool = key
        lines.append("%s %s %s %s %s: %s" % (benchlib.format_size(size), cache, direction, workload, tool,
                                             " ".join("%.2f" % sample.seconds for sample in cell.samples)))
    lines += ["", "## Against the issue's bound (the default at most %.1fx the better delta)" % ALLOWED_RATIO, ""]
    lines += problems or ["every in-place pattern within %.1fx --delta blocks, every shifted one within %.1fx "
                          "--delta chunks" % (ALLOWED_RATIO, ALLOWED_RATIO)]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1G",
                        type=lambda text: [benchlib.parse_size(part) for part in text.split(",")],
                        help="file sizes, comma separated (default 1G)")
    parser.add_argument("--workloads", default=",".join(RUN_ORDER),
                        type=lambda text: benchlib.parse_name_list(text, [name for name, _, _ in WORKLOADS]))
    parser.add_argument("--tools", default="auto,blocks,chunks,rsync",
                        type=lambda text: benchlib.parse_name_list(text, TOOLS),
                        help="from %s (baseline needs --baseline)" % ",".join(TOOLS))
    parser.add_argument("--directions", default=",".join(DIRECTIONS),
                        type=lambda text: benchlib.parse_name_list(text, DIRECTIONS))
    parser.add_argument("--caches", default=",".join(CACHES), type=lambda text: benchlib.parse_name_list(text, CACHES))
    parser.add_argument("--rounds", default=2, type=int, help="timed runs of each tool per cell (default 2)")
    parser.add_argument("--bound-only", action="store_true",
                        help="only the delta each workload is held against (blocks in place, chunks shifted), "
                        "beside the default, rsync and the baseline: for big sizes")
    parser.add_argument("--baseline", metavar="REV", help="also the default of our pdiffcopy at git revision REV")
    parser.add_argument("--seed", default=benchlib.DEFAULT_SEED, type=int)
    parser.add_argument("--workdir", default=Path("/tmp"), type=Path)
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    if "baseline" in args.tools and not args.baseline:
        args.tools.remove("baseline")
    if args.baseline and "baseline" not in args.tools:
        args.tools.append("baseline")
    if "cold" in args.caches and os.geteuid() != 0:
        parser.error("dropping the page cache (--caches cold) needs root")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    args.workdir.mkdir(parents=True, exist_ok=True)
    dirs = benchlib.WorkDirs.make(args.workdir, "auto-delta-")
    servers = []
    try:
        ours, description = benchlib.find_ours()
        if ours is None:
            raise BenchmarkError(description)
        header = ["# The default delta on writes in place and on shifted data", "",
                  benchlib.machine_description(dirs.root), "", "ours: %s, git %s" % (
                      description, benchlib.command_output(["git", "-C", str(benchlib.REPO_ROOT), "describe",
                                                            "--always", "--dirty"]))]
        header.append("rsync: %s" % benchlib.command_output(["rsync", "--version"]).split("\n")[0])
        baseline = None
        if "baseline" in args.tools:
            baseline = benchlib.baseline_installation(args.baseline, dirs.root)
            header.append("baseline: %s" % baseline.description)
        header += ["", "Rounds: %i; pdiffcopy runs with -vv --stats; rsync -I --inplace --no-whole-file --stats "
                   "(pulled from an rsync daemon on 127.0.0.1); pdiffcopy pulls from its server on 127.0.0.1."
                   % args.rounds,
                   "Load average (1, 5, 15 min) at the start: %s" % benchlib.load_averages()]
        our_server = benchlib.OursServer(dirs.root / "servers" / "ours", ours, dirs.data, [])
        servers.append(our_server)
        baseline_server = None
        if baseline is not None:
            baseline_server = benchlib.OursServer(dirs.root / "servers" / "baseline", baseline, dirs.data, [])
            servers.append(baseline_server)
        daemon = benchlib.RsyncDaemon(dirs.root / "servers" / "rsyncd", {"data": dirs.data})
        servers.append(daemon)
        for server in servers:
            server.start()
        tools = build_tools(args.tools, ours, baseline, our_server, baseline_server, daemon, dirs.data)
        results: Dict = {}
        done: List[Workload] = []
        for size in args.sizes:
            random_base = dirs.data / "random.base"
            log("generating %s of random data" % benchlib.format_size(size))
            benchlib.generate_source(random_base, size, args.seed)
            for name in args.workloads:
                log("preparing %s at %s" % (name, benchlib.format_size(size)))
                workload = prepare(name, dirs.data, random_base, size, args.seed)
                if not any(known.name == name for known in done):
                    done.append(workload)
                for round_index in range(args.rounds):
                    for cache in args.caches:
                        for direction in args.directions:
                            # Alternate: each round starts with the next tool.
                            chosen = [tool for tool in tools if not args.bound_only
                                      or tool.name != ("chunks" if workload.kind == "in place" else "blocks")]
                            order = chosen[round_index % len(chosen):] + chosen[:round_index % len(chosen)]
                            for tool in order:
                                sample = measure(tool, workload, direction, cache, dirs.run, dirs.logs)
                                log("%s %s %s %s %s: %.2f s, sent %s %s" % (
                                    benchlib.format_size(size), name, cache, direction, tool.name, sample.seconds,
                                    sample.sent, sample.chosen))
                                key = (size, cache, direction, name, tool.name)
                                results.setdefault(key, Cell()).samples.append(sample)
                workload.source.unlink()
                if workload.base != random_base:
                    workload.base.unlink()
                # The report so far, in case the run is cut short.
                text = report(results, done, args.tools, args.sizes, header)
                if args.output:
                    args.output.write_text(text + "\n(unfinished)\n")
            random_base.unlink()
        text = report(results, done, args.tools, args.sizes, header)
        text += "Load average (1, 5, 15 min) at the end: %s\n" % benchlib.load_averages()
        print(text, end="")
        if args.output:
            args.output.write_text(text)
        return 0
    except BenchmarkError as error:
        log("BENCHMARK FAILED: %s" % error)
        return 1
    finally:
        for server in servers:
            server.stop()
        for image in list(dirs.root.rglob("*.img")) + list(dirs.root.rglob("*.base")):
            image.unlink()
        shutil.rmtree(dirs.root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""
Tree memory benchmark: peak RSS of the pdiffcopy client and server against the number of files.

For each count (10,000, 100,000 and 1,000,000 files by default) a tree is generated once:
directories of 1,000 files, one file in ten 100 bytes long, the rest empty (issue 22's
memory workload). For each direction (local, pull, push) two syncs are measured, each with
a fresh server: a copy into an empty target, then a no-change sync of the result. Both
sides' figures are those of :mod:`memory`: the peak of the summed RSS of the process and
all its descendants, polled from /proc, and the kernel's peak RSS of the largest single
process (``ru_maxrss``). A local sync has no server.

Memory flat in the number of files shows as the same figures for every count; the last
column divides the client's summed peak by the file count, so a per-file cost stands out.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import benchlib
from benchlib import log
from memory import TreeMonitor

DEFAULT_COUNTS = "10000,100000,1000000"
DIRECTIONS = ("local", "pull", "push")
FILES_PER_DIRECTORY = 1000
MIB = 1024 * 1024


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--counts", default=DEFAULT_COUNTS, type=benchlib.parse_int_list,
                        help="numbers of files (default %s)" % DEFAULT_COUNTS)
    parser.add_argument("--directions", default=",".join(DIRECTIONS),
                        type=lambda text: benchlib.parse_name_list(text, DIRECTIONS),
                        help="local, pull, push (default all)")
    parser.add_argument("--poll-interval", default=0.02, type=float, help="RSS polling interval (s)")
    parser.add_argument("--work-dir", default="/tmp", type=Path,
                        help="where the trees are made (default /tmp; needs ~3 inodes per file)")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    return parser.parse_args(argv)


def make_tree(root: Path, count: int) -> None:
    """`count` files in directories of FILES_PER_DIRECTORY; one in ten 100 bytes, the rest empty."""
    for index in range(count):
        directory = root / ("d%05d" % (index // FILES_PER_DIRECTORY))
        if index % FILES_PER_DIRECTORY == 0:
            directory.mkdir(parents=True)
        with open(directory / ("f%07d" % index), "wb") as handle:
            if index % 10 == 0:
                handle.write(b"x" * 100)


def count_files(root: Path) -> int:
    """The number of regular files below `root`."""
    return sum(len(files) for _, _, files in os.walk(root))


def measure(command: List[str], ours: benchlib.OursInstallation, server: Optional[benchlib.OursServer],
            log_path: Path, interval: float) -> Dict:
    """One sync, with the RSS of the client's and the server's process trees tracked."""
    monitor = TreeMonitor(interval)
    if server is not None:
        server.start()
        monitor.watch("server", server.process.pid)
    monitor.start()
    try:
        result = benchlib.run_tool(command, log_path, ours.env,
                                   on_start=lambda process: monitor.watch("client", process.pid))
    finally:
        monitor.stop()
        if server is not None:
            server.stop()
    return {
        "seconds": result.seconds,
        "client_sum": monitor.peaks["client"],
        "client_max": result.max_rss_kib * 1024,
        "server_sum": monitor.peaks.get("server"),
        "server_max": server.exit_rusage.ru_maxrss * 1024 if server is not None and server.exit_rusage else None,
    }


def mib(value: Optional[int]) -> str:
    """Bytes as MiB with no decimals, or '-'."""
    return "-" if value is None else "%.0f" % (value / MIB)


def run_count(count: int, args, ours: benchlib.OursInstallation, root: Path, logs: Path) -> List[List[str]]:
    """Generate the tree of `count` files and measure every direction's copy and no-change sync."""
    source = root / "src"
    log("making a tree of %d files" % count)
    make_tree(source, count)
    rows = []
    for direction in args.directions:
        target = root / "run" / direction
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(exist_ok=True)
        server = benchlib.OursServer(root / "server", ours, root, []) if direction != "local" else None
        source_arg = server.url(source) + "/" if direction == "pull" else str(source) + "/"
        target_arg = server.url(target) + "/" if direction == "push" else str(target) + "/"
        for kind in ("copy", "no-change"):
            log("%d files, %s %s" % (count, direction, kind))
            figures = measure(ours.command + ["-a", source_arg, target_arg], ours, server,
                              logs / ("%d-%s-%s.log" % (count, direction, kind)), args.poll_interval)
            copied = count_files(target)
            if copied != count:
                raise benchlib.BenchmarkError("%s %s: %d files in the target, not %d"
                                              % (direction, kind, copied, count))
            rows.append(["{:,}".format(count), direction, kind, "%.2f" % figures["seconds"],
                         mib(figures["client_sum"]), mib(figures["client_max"]),
                         mib(figures["server_sum"]), mib(figures["server_max"]),
                         "%.2f" % (figures["client_sum"] / count / 1024)])
        shutil.rmtree(target)
    shutil.rmtree(source)
    return rows


def main(argv=None) -> int:
    """Run the benchmark and print the report."""
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    ours, description = benchlib.find_ours()
    if ours is None:
        print("tree_memory: %s" % description, file=sys.stderr)
        return 1
    root = Path(benchlib.tempfile.mkdtemp(prefix="tree-memory-", dir=args.work_dir)).resolve()
    logs = root / "logs"
    logs.mkdir()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows = []
    try:
        for count in args.counts:
            rows.extend(run_count(count, args, ours, root, logs))
    except benchlib.BenchmarkError as error:
        print("tree_memory: %s" % error, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = "\n".join([
        "# Tree memory: peak RSS against the number of files",
        "",
        "Started %s; %s; load before: %s." % (started, description, benchlib.load_averages()),
        "Command: `pdiffcopy -a SRC/ DST/`; sums are of the whole process tree, polled every %g s;"
        " max is the largest single process (ru_maxrss)." % args.poll_interval,
        "",
        benchlib.markdown_table(["files", "direction", "sync", "seconds", "client sum MiB", "client max MiB",
                                 "server sum MiB", "server max MiB", "client KiB/file"], rows),
    ])
    print(report)
    if args.output:
        args.output.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

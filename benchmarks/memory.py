#!/usr/bin/env python3
"""
Memory benchmark: peak RSS of the pdiffcopy client and server during one sync.

For each size (1 GiB and 4 GiB by default), delta and direction, a fresh server is started,
one sync is run from a fresh copy of the mutated target, and two figures are taken for the
client and for the server:

- the peak of the summed RSS of the process and all its descendants (gunicorn master plus
  workers plus their helpers), polled from /proc every few milliseconds; shared pages are
  counted once per process, so this is an upper bound of what the tree really uses;
- the kernel's peak RSS of the largest single process in the tree (``ru_maxrss`` from
  ``wait4``, the "Maximum resident set size" of ``/usr/bin/time -v``), exact but not summed.

Our pdiffcopy is measured, and the original 1.0.1 for comparison; a missing program is
skipped with a message. Every result is verified by sha256. See README.rst.
"""

import argparse
import contextlib
import os
import sys
import threading
from typing import Dict, List

import benchlib
from benchlib import Tool, WorkDirs, log

# Summed RSS is polled this often: fine enough to catch a buffer that lives for a few tens
# of milliseconds, coarse enough that reading a handful of /proc files costs little CPU.
DEFAULT_POLL_INTERVAL = 0.01

# Only the two pdiffcopy versions have a client and a server worth measuring here.
MEMORY_FAMILIES = ("original", "ours")

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024


def process_tree(pid: int) -> List[int]:
    """The pid and all its descendants, from /proc/PID/task/TID/children (no full /proc scan)."""
    pids, pending = [], [pid]
    while pending:
        current = pending.pop()
        pids.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir("/proc/%i/task" % current):
                with contextlib.suppress(OSError), open("/proc/%i/task/%s/children" % (current, task)) as handle:
                    pending.extend(int(child) for child in handle.read().split())
    return pids


def rss_bytes(pid: int) -> int:
    """The current RSS of one process in bytes (0 once it has gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/%i/statm" % pid) as handle:
        return int(handle.read().split()[1]) * PAGE_SIZE
    return 0


def anonymous_bytes(pid: int) -> int:
    """The process's own memory: RSS less file-backed pages (0 once it has gone).

    pdiffcopy hashes through mmap, so its RSS includes page-cache pages of the
    file it maps (at most a segment per hashing process); those are shared
    with the page cache, not memory the program holds. statm's third field
    counts them (with shared memory).
    """
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/%i/statm" % pid) as handle:
        fields = handle.read().split()
        return (int(fields[1]) - int(fields[2])) * PAGE_SIZE
    return 0


class TreeMonitor(threading.Thread):
    """Polls the summed RSS of the process trees of some root pids; keeps each tree's peak."""

    def __init__(self, interval: float):
        """Prepare a monitor polling every `interval` seconds; add roots with :meth:`watch`."""
        super().__init__(daemon=True)
        self.interval = interval
        self.roots: Dict[str, int] = {}
        self.peaks: Dict[str, int] = {}
        self.anonymous_peaks: Dict[str, int] = {}
        self.halt = threading.Event()

    def watch(self, label: str, pid: int) -> None:
        """Start tracking the tree of `pid` under `label`."""
        self.peaks.setdefault(label, 0)
        self.anonymous_peaks.setdefault(label, 0)
        self.roots[label] = pid

    def sample(self) -> None:
        """Take one sample of every watched tree."""
        for label, pid in list(self.roots.items()):
            members = process_tree(pid)
            total = sum(rss_bytes(member) for member in members)
            self.peaks[label] = max(self.peaks[label], total)
            anonymous = sum(anonymous_bytes(member) for member in members)
            self.anonymous_peaks[label] = max(self.anonymous_peaks[label], anonymous)

    def run(self) -> None:
        """Sample until :meth:`stop` is called."""
        while not self.halt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self.halt.set()
        self.join()


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="1G,4G",
        type=lambda text: [benchlib.parse_size(item) for item in text.split(",")],
        help="source sizes (default 1G,4G)",
    )
    parser.add_argument("--deltas", default="10,100", type=benchlib.parse_int_list,
                        help="deltas in %% (default 10,100)")
    parser.add_argument("--poll-interval", default=DEFAULT_POLL_INTERVAL, type=float, help="RSS polling interval (s)")
    benchlib.add_common_arguments(parser, MEMORY_FAMILIES, MEMORY_FAMILIES)
    return parser.parse_args(argv)


def measure(tool: Tool, delta: int, dirs: WorkDirs, expected_sha: str, interval: float) -> Dict:
    """
    One sync of `tool` against a freshly started server, with the RSS of both sides tracked.

    Returns a dict with the wall time in seconds and the four memory figures in bytes.
    """
    target = dirs.run / ("%s.img" % tool.name)
    benchlib.fresh_target(dirs.base(delta), target, tool.needs_target)
    os.sync()
    monitor = TreeMonitor(interval)
    with tool.server as server:
        monitor.watch("server", server.process.pid)
        monitor.start()
        try:
            result = benchlib.run_tool(
                tool.command(target),
                dirs.logs / ("%s.log" % tool.name),
                tool.env,
                on_start=lambda process: monitor.watch("client", process.pid),
            )
        finally:
            monitor.stop()
    size = dirs.source.stat().st_size
    benchlib.verify_copy(target, expected_sha, size, "%s (delta %i%%)" % (tool.name, delta))
    target.unlink()
    return {
        "seconds": result.seconds,
        "client_sum": monitor.peaks["client"],
        "client_anon": monitor.anonymous_peaks["client"],
        "server_anon": monitor.anonymous_peaks["server"],
        "client_max": result.max_rss_kib * 1024,
        "server_sum": monitor.peaks["server"],
        "server_max": server.exit_rusage.ru_maxrss * 1024 if server.exit_rusage else None,
    }


def format_mib(num_bytes) -> str:
    """Bytes as MiB with no decimals, or 'n/a'."""
    return "n/a" if num_bytes is None else "%.0f" % (num_bytes / MIB)


def run_all(args, setup: benchlib.Setup, dirs: WorkDirs) -> List[List[str]]:
    """Measure every size, delta and tool; return the table rows."""
    rows = []
    for size in args.sizes:
        log("generating %s source (seed %i)" % (benchlib.format_size(size), args.seed))
        benchlib.generate_source(dirs.source, size, args.seed)
        expected_sha = benchlib.sha256_file(dirs.source)
        for delta in args.deltas:
            benchlib.make_mutated_copy(dirs.source, dirs.base(delta), delta, args.seed)
            for tool in setup.tools:
                figures = measure(tool, delta, dirs, expected_sha, args.poll_interval)
                memory = [format_mib(figures[key]) for key in
                          ("client_sum", "client_anon", "client_max", "server_sum", "server_anon", "server_max")]
                log(
                    "%s delta %i%% %s: %.2f s, client %s/%s/%s MiB, server %s/%s/%s MiB "
                    "(summed/anonymous/largest), sha256 ok"
                    % (benchlib.format_size(size), delta, tool.name, figures["seconds"], *memory)
                )
                row = [benchlib.format_size(size), str(delta), tool.direction, tool.family]
                rows.append(row + memory + ["%.2f" % figures["seconds"]])
            dirs.base(delta).unlink()
    return rows


def render_report(args, setup: benchlib.Setup, rows: List[List[str]], machine: str) -> str:
    """The report: header lines and the table."""
    header = [
        "size", "delta %", "direction", "tool",
        "client RSS summed (MiB)", "client anonymous (MiB)", "client largest process (MiB)",
        "server RSS summed (MiB)", "server anonymous (MiB)", "server largest process (MiB)", "wall s",
    ]
    lines = [
        "# pdiffcopy memory benchmark",
        "",
        machine,
        "",
        "One sync per row against a freshly started server on 127.0.0.1, target made from a seeded "
        "random source with delta %% of its 1 MiB blocks overwritten. 'Summed': peak of the RSS summed "
        "over the process and all its descendants, polled every %g s (shared pages counted once per "
        "process). 'Anonymous': the same sum without file-backed pages (the page cache that mmap "
        "hashing maps counts in RSS but is not memory the program holds). 'Largest process': "
        "the kernel's peak RSS of the largest single process (wait4 "
        "ru_maxrss, as /usr/bin/time -v reports it). Every result verified by sha256."
        % args.poll_interval,
        "",
        "Versions:",
    ]
    lines += ["- %s" % line for line in setup.versions]
    lines += ["- note: %s" % note for note in setup.notes]
    lines += ["", benchlib.markdown_table(header, rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Run the memory benchmark; print the report and write it to --output."""
    args = parse_args(argv)

    def body(setup: benchlib.Setup, dirs: WorkDirs, machine: str) -> str:
        return render_report(args, setup, run_all(args, setup, dirs), machine)

    return benchlib.run_script(args, "pdiffcopy-memory-", body)


if __name__ == "__main__":
    sys.exit(main())

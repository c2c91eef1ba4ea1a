#!/usr/bin/env python3
"""
Sparse-memory benchmark: peak memory of client and server against a sparse file's apparent size.

For each ``--sizes`` (default 8 GiB, 1 TiB and 8 TiB) a sparse image holding the same
``--data`` (default 64 MiB, in ``--extents`` extents at seeded offsets) is synced locally, as a
pull and as a push against a server on 127.0.0.1, into a new file (``new``) and into an
identical copy (``nochange``). Memory should not grow with the apparent size: only the data
does any work. For every run a fresh server is started, and the report gives the wall time,
the client's peak RSS (``ru_maxrss`` from ``wait4``: its largest process, hashing children
included, as ``/usr/bin/time -v`` reports it) and the server's (the largest ``VmHWM`` of its
process group, read just before it stops), and each size's ratio to the smallest size's.
``--baseline REV`` adds our client and server at an earlier git revision, for a before/after
in one run. Every result is checked outside the timing: same bytes where either side has
data, same data map (holes stay holes).
"""

import argparse
import shutil
import shlex
import statistics
import sys
from pathlib import Path
from typing import Dict, Tuple

import benchlib
import sparse_image
from benchlib import BenchmarkError, log

CASES = ("new", "nochange")
MODES = ("local", "pull", "push")
TOOLS = ("baseline", "ours")


def measure(tool: sparse_image.Tool, server, case: str, source: Path, work: Path, logs: Path) -> Dict:
    """One sync (fresh server unless local): seconds, client and server peak RSS in KiB."""
    target = work / "run" / ("%s-%s-%s.img" % (case, tool.name, tool.mode))
    target.unlink(missing_ok=True)
    if case == "nochange":
        sparse_image.sparse_copy(source, target)
    net = sparse_image.Loopback()
    if server is not None:
        server.start(net)
    try:
        result = benchlib.run_tool(tool.command(source, target, case != "new"),
                                   logs / ("%s-%s-%s.log" % (tool.name, tool.mode, case)), tool.env)
        server_kib = sparse_image.server_peak_rss_kib(server) if server is not None else None
    finally:
        if server is not None:
            server.stop()
    if not sparse_image.same_content(source, target):
        raise BenchmarkError("VERIFICATION FAILED: %s %s %s differs from the source" % (tool.name, tool.mode, case))
    if sparse_image.data_extents(source) != sparse_image.data_extents(target):
        raise BenchmarkError("VERIFICATION FAILED: %s %s %s has other holes than the source"
                             % (tool.name, tool.mode, case))
    target.unlink()
    return {"seconds": result.seconds, "client": result.max_rss_kib, "server": server_kib}


def run_size(args, size: int, work: Path, data: Path, logs: Path, results: Dict) -> None:
    """Every tool, case and mode on one image of `size` bytes."""
    source = data / "source.img"
    log("making a %s image with %s of data" % (benchlib.format_size(size), benchlib.format_size(args.data)))
    sparse_image.make_image(source, size, args.data, args.extents, args.seed)
    try:
        servers, tools = sparse_image.build(argparse.Namespace(**{**vars(args), "modes": args.modes}),
                                            sparse_image.Loopback(), work, logs)
        by_family = {server.name: server for server in servers}
        for case in args.cases:
            for round_number in range(args.rounds):
                for tool in (tools if round_number % 2 == 0 else list(reversed(tools))):
                    server = by_family[tool.name] if tool.mode != "local" else None
                    figures = measure(tool, server, case, source, work, logs)
                    log("%s %s %s %s: %.2f s, client %.0f MiB, server %s MiB" % (
                        benchlib.format_size(size), case, tool.mode, tool.name, figures["seconds"],
                        figures["client"] / 1024,
                        "-" if figures["server"] is None else "%.0f" % (figures["server"] / 1024)))
                    results.setdefault((size, case, tool.mode, tool.name), []).append(figures)
    finally:
        source.unlink()


def report(args, machine: str, results: Dict, start_load: str) -> str:
    """The report: header lines and one table row per size, case, mode and tool."""
    smallest = min(args.sizes)

    def peak(key: Tuple, side: str):
        values = [figures[side] for figures in results.get(key, []) if figures[side] is not None]
        return max(values) if values else None

    header = ["size", "case", "mode", "tool", "median s", "client peak MiB", "client / smallest",
              "server peak MiB", "server / smallest"]
    rows = []
    for (size, case, mode, name), samples in results.items():
        row = [benchlib.format_size(size), case, mode, name,
               "%.2f" % statistics.median(figures["seconds"] for figures in samples)]
        for side in ("client", "server"):
            value, base = peak((size, case, mode, name), side), peak((smallest, case, mode, name), side)
            row += ["-" if value is None else "%.0f" % (value / 1024),
                    "-" if value is None or not base else "%.2f" % (value / base)]
        rows.append(row)
    lines = ["# Sparse-memory benchmark", "", machine, "",
             "- command: `%s`" % shlex.join([sys.executable] + sys.argv),
             "- source: sparse images of %s apparent size, each with %s of data in %i extents"
             % (", ".join(benchlib.format_size(size) for size in args.sizes), benchlib.format_size(args.data),
                args.extents),
             "- new: no target; nochange: the target is an identical sparse copy",
             "- each row: median time of %i run(s), a fresh server per run; peaks are the largest of the runs: "
             "client = wait4 ru_maxrss (its largest process), server = the largest VmHWM of its process group; "
             "'/ smallest' = the peak over the same row's at %s" % (args.rounds, benchlib.format_size(smallest)),
             "- every copy checked: same bytes where either side has data, same data map", ""]
    lines += [benchlib.markdown_table(header, rows), ""]
    lines.append("Load average (1, 5, 15 min): %s at the start, %s at the end."
                 % (start_load, benchlib.load_averages()))
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--sizes", default="8G,1T,8T",
                        type=lambda text: [benchlib.parse_size(item) for item in text.split(",")],
                        help="apparent sizes (default 8G,1T,8T)")
    parser.add_argument("--data", default="64M", type=benchlib.parse_size, help="data in each image (default 64M)")
    parser.add_argument("--extents", default=16, type=int, help="data extents (default 16)")
    parser.add_argument("--cases", default=",".join(CASES), type=lambda t: benchlib.parse_name_list(t, CASES))
    parser.add_argument("--modes", default=",".join(MODES), type=lambda t: benchlib.parse_name_list(t, MODES))
    parser.add_argument("--tools", default="ours", type=lambda t: benchlib.parse_name_list(t, TOOLS))
    parser.add_argument("--rounds", default=1, type=int)
    parser.add_argument("--seed", default=benchlib.DEFAULT_SEED, type=int)
    parser.add_argument("--baseline", metavar="REV", help="the baseline tool: our pdiffcopy at git revision REV")
    parser.add_argument("--ours-args", default="", type=shlex.split, help="extra options for the clients")
    parser.add_argument("--workdir", default=Path("/var/tmp"), type=Path)
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Run the benchmark; print the report and write it to --output."""
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    dirs = benchlib.WorkDirs.make(args.workdir, "sparse-memory-")
    try:
        machine = benchlib.machine_description(dirs.root)
        start_load = benchlib.load_averages()
        results: Dict = {}
        for size in args.sizes:
            run_size(args, size, dirs.root, dirs.data, dirs.logs, results)
        text = report(args, machine, results, start_load)
        print(text, end="")
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(text)
        return 0
    except BenchmarkError as error:
        log("FAILED: %s" % error)
        return 1
    finally:
        shutil.rmtree(dirs.root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

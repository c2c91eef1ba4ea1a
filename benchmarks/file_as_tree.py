#!/usr/bin/env python3
"""
One big file synced as a file and as a tree of one: do the two schedulers match?

A single-file sync (``pdiffcopy SRC DST``) runs the pipeline: hashing in a pool of processes,
transfers on threads, overlapped by futures. A tree sync (``pdiffcopy -a SRCDIR/ DSTDIR/``)
runs its units (a big file's segments among them) on forked workers, each hashing and moving
one segment at a time. Both call the same segment engine. This benchmark measures whether a
single file could simply be a tree of one: the same 1 GiB file, new (no target) and with 10 %
of its 1 MiB blocks changed, local, pulled and pushed through our server on 127.0.0.1, both
ways in alternating rounds; medians and the tree/file ratio.

    python3 benchmarks/file_as_tree.py --size 1G --rounds 3
"""

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import benchlib
from benchlib import log

CASES = ("new", "delta10")
DIRECTIONS = ("local", "pull", "push")
SHAPES = ("file", "tree")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--size", default="1G", type=benchlib.parse_size, help="file size (default 1G)")
    parser.add_argument("--rounds", default=3, type=int, help="timed runs per case (default 3)")
    parser.add_argument("--workdir", default="/work/bench-file-as-tree", type=Path)
    parser.add_argument("--seed", default=1, type=int)
    parser.add_argument("--concurrency", default=str(os.cpu_count()), help="-c of client and server")
    parser.add_argument("--output", type=Path, help="also write the report here")
    return parser.parse_args(argv)


def command(ours, server, shape: str, direction: str, source_dir: Path, target_dir: Path,
            concurrency: str) -> List[str]:
    """The client's command line: the file itself, or its directory with -a (a tree of one)."""
    source = source_dir if shape == "tree" else source_dir / "big.img"
    target = target_dir if shape == "tree" else target_dir / "big.img"
    options = ["-q", "-c", concurrency] + (["-a", "--no-progress"] if shape == "tree" else [])

    def spell(path: Path, remote: bool) -> str:
        text = server.url(path) if remote else str(path)
        return text + "/" if shape == "tree" else text

    return ours.command + options + [spell(source, direction == "pull"), spell(target, direction == "push")]


def main(argv=None) -> int:
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    ours, description = benchlib.find_ours()
    if ours is None:
        sys.exit("file_as_tree: " + description)
    load_at_start = benchlib.load_averages()
    root = args.workdir
    shutil.rmtree(root, ignore_errors=True)
    (root / "src").mkdir(parents=True)
    source = root / "src" / "big.img"
    log("generating %s" % benchlib.format_size(args.size))
    benchlib.generate_source(source, args.size, args.seed)
    base = root / "base10.img"
    benchlib.make_mutated_copy(source, base, 10, args.seed)
    expected = benchlib.sha256_file(source)
    samples: Dict[Tuple[str, str, str], List[float]] = {}
    server = benchlib.OursServer(root / "state", ours, root, ["-c", args.concurrency])
    with server:
        for round_number in range(args.rounds + 1):  # round 0 warms up and is not kept
            for case in CASES:
                for direction in DIRECTIONS:
                    shapes = SHAPES if round_number % 2 else tuple(reversed(SHAPES))
                    for shape in shapes:
                        target_dir = root / "dst"
                        shutil.rmtree(target_dir, ignore_errors=True)
                        target_dir.mkdir()
                        if case == "delta10":
                            benchlib.copy_file(base, target_dir / "big.img")
                        os.sync()
                        line = command(ours, server, shape, direction, root / "src", target_dir, args.concurrency)
                        result = benchlib.run_tool(line, root / "run.log", ours.env)
                        benchlib.verify_copy(target_dir / "big.img", expected, args.size, shape)
                        if round_number:
                            samples.setdefault((case, direction, shape), []).append(result.seconds)
                            log("%s %s %s: %.2f s" % (case, direction, shape, result.seconds))
    lines = ["One file as a file and as a tree of one (%s, %i rounds, -c %s)" %
             (benchlib.format_size(args.size), args.rounds, args.concurrency),
             description,
             "load average at the start: %s, at the end: %s" % (load_at_start, benchlib.load_averages()), ""]
    rows = []
    for case in CASES:
        for direction in DIRECTIONS:
            file_median = statistics.median(samples[(case, direction, "file")])
            tree_median = statistics.median(samples[(case, direction, "tree")])
            rows.append([case, direction, "%.2f" % file_median, "%.2f" % tree_median,
                         "%.2fx" % (tree_median / file_median),
                         " ".join("%.2f" % s for s in samples[(case, direction, "file")]),
                         " ".join("%.2f" % s for s in samples[(case, direction, "tree")])])
    lines.append(benchlib.markdown_table(["case", "direction", "file (s)", "tree of one (s)", "tree / file",
                                          "file samples", "tree samples"], rows))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.output:
        args.output.write_text(text)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""
Remote delta benchmark: rsync, the original pdiffcopy 1.0.1 and our pdiffcopy, side by side.

The workload: a seeded random source file (1 GiB by default) and, for each delta (0, 10,
50, 100 %), a target made from the source with that percentage of its 1 MiB blocks
overwritten with random bytes at seeded random positions. Each tool makes the target equal
to the source through a server on 127.0.0.1, pulling (client fetches) and pushing (client
sends). Plain whole-file copies (cp, curl) are measured alongside for context.

Every timed run starts from a fresh copy of the mutated target and follows an untimed
warm-up run of the same tool on another fresh copy (this machine returns freed memory to
the host after ~2 s, which otherwise makes whichever run comes first slower). Tools are
alternated between rounds. Each result is checked by size and sha256 outside the timing,
and a wrong result aborts the benchmark. Run with --help for the options; see README.rst.
"""

import argparse
import contextlib
import os
import shlex
import sys
from typing import Dict, List, Tuple

import benchlib
from benchlib import Tool, WorkDirs, log

def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--size", default="1G", type=benchlib.parse_size, help="source size, e.g. 64M, 1G (default 1G)")
    parser.add_argument(
        "--deltas",
        default=",".join(map(str, benchlib.DEFAULT_DELTAS)),
        type=benchlib.parse_int_list,
        help="percentages of 1 MiB blocks to overwrite (default 0,10,50,100)",
    )
    parser.add_argument("--rounds", default=3, type=int, help="timed runs per tool and delta (default 3)")
    benchlib.add_common_arguments(parser, benchlib.FAMILIES, benchlib.FAMILIES)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if any(not 0 <= delta <= 100 for delta in args.deltas):
        parser.error("--deltas must be percentages between 0 and 100")
    return args


def prepare_data(dirs: WorkDirs, size: int, seed: int, deltas: List[int]) -> str:
    """
    Write the source and one mutated base file per delta; return the source's sha256.

    Runs copy a base file to make their fresh target; the bases themselves never change.
    """
    log("generating %s source (seed %i)" % (benchlib.format_size(size), seed))
    benchlib.generate_source(dirs.source, size, seed)
    for delta in deltas:
        num_blocks = benchlib.make_mutated_copy(dirs.source, dirs.base(delta), delta, seed)
        log("target for delta %i%%: %i blocks of 1 MiB overwritten" % (delta, num_blocks))
    return benchlib.sha256_file(dirs.source)


def measure(tool: Tool, delta: int, dirs: WorkDirs, expected_sha: str) -> Tuple[float, float]:
    """
    Measure one timed run of `tool` right after its untimed warm-up; return both wall times.

    Both runs get their own fresh target (a copy of the delta's base file, or no file for
    whole-file copy tools), made before either starts and written back to disk, so that the
    timed run follows the warm-up at once. Both results are verified by size and sha256.
    """
    base = dirs.base(delta)
    warm_target = dirs.run / ("%s-warmup.img" % tool.name)
    timed_target = dirs.run / ("%s-timed.img" % tool.name)
    for target in (warm_target, timed_target):
        benchlib.fresh_target(base, target, tool.needs_target)
    os.sync()
    benchlib.read_through(dirs.source)
    log_path = dirs.logs / ("%s.log" % tool.name)
    warm = benchlib.run_tool(tool.command(warm_target), log_path, tool.env)
    timed = benchlib.run_tool(tool.command(timed_target), log_path, tool.env)
    size = dirs.source.stat().st_size
    benchlib.verify_copy(warm_target, expected_sha, size, "%s (warm-up, delta %i%%)" % (tool.name, delta))
    benchlib.verify_copy(timed_target, expected_sha, size, "%s (timed, delta %i%%)" % (tool.name, delta))
    for target in (warm_target, timed_target):
        target.unlink()
    return warm.seconds, timed.seconds


def run_rounds(args, tools: List[Tool], dirs: WorkDirs, expected_sha: str) -> Dict:
    """
    Run every tool `args.rounds` times per delta, rotating the order of the tools each round.

    Returns ``{(delta, tool name): {"timed": [...], "warmup": [...]}}`` in seconds.
    """
    samples = {}
    for delta_index, delta in enumerate(args.deltas):
        for round_index in range(args.rounds):
            shift = (delta_index * args.rounds + round_index) % len(tools)
            for tool in tools[shift:] + tools[:shift]:
                warm, timed = measure(tool, delta, dirs, expected_sha)
                cell = samples.setdefault((delta, tool.name), {"timed": [], "warmup": []})
                cell["timed"].append(timed)
                cell["warmup"].append(warm)
                log(
                    "delta %3i%%  round %i/%i  %-14s %7.3f s  (warm-up %.3f s)  sha256 ok"
                    % (delta, round_index + 1, args.rounds, tool.name, timed, warm)
                )
    return samples


def direction_table(direction: str, tools: List[Tool], deltas: List[int], samples: Dict) -> str:
    """The markdown table of one direction: median and best per tool, and ratios of ours."""
    columns = sorted(
        (tool for tool in tools if tool.direction in (direction, "copy")),
        key=lambda tool: benchlib.FAMILIES.index(tool.family),
    )
    baseline_present = any(tool.family == "baseline" for tool in columns)
    header = ["delta %"]
    for tool in columns:
        label = tool.family if tool.direction != "copy" else "%s (whole file)" % tool.family
        header += ["%s median" % label, "%s best" % label]
    header += ["ours/original", "ours/rsync"] + (["ours/baseline"] if baseline_present else [])
    rows = []
    for delta in deltas:
        row = [str(delta)]
        medians = {}
        for tool in columns:
            median, best = benchlib.median_and_best(samples[(delta, tool.name)]["timed"])
            medians[tool.family] = median
            row += [benchlib.format_seconds(median), benchlib.format_seconds(best)]
        row.append(benchlib.format_ratio(medians.get("ours"), medians.get("original")))
        row.append(benchlib.format_ratio(medians.get("ours"), medians.get("rsync")))
        if baseline_present:
            row.append(benchlib.format_ratio(medians.get("ours"), medians.get("baseline")))
        rows.append(row)
    return benchlib.markdown_table(header, rows)


def render_report(args, setup: benchlib.Setup, samples: Dict, machine: str, dirs: WorkDirs) -> str:
    """The whole report: header lines, commands, one table per direction, and every sample."""
    size = benchlib.format_size(args.size)
    lines = [
        "# pdiffcopy remote delta benchmark",
        "",
        machine,
        "",
        "Workload: %s source of seeded random bytes (seed %i); the target of delta D %% is the source "
        "with D %% of its 1 MiB blocks overwritten with random bytes at seeded random positions. Each "
        "timed run starts from a fresh copy of that target and comes right after an untimed warm-up "
        "run of the same tool; tools alternate between rounds. Times are wall seconds of the whole "
        "client process (start-up included), median and best of %i. Every result was verified by size "
        "and sha256 outside the timing. Ratios are of medians (below 1: ours is faster)."
        % (size, args.seed, args.rounds),
        "",
        "Versions:",
    ]
    lines += ["- %s" % line for line in setup.versions]
    lines += ["", "Commands (TARGET.img: the fresh target file of a run):"]
    example_target = dirs.run / "TARGET.img"
    lines += ["- %s: `%s`" % (tool.name, shlex.join(tool.command(example_target))) for tool in setup.tools]
    lines += ["- note: %s" % note for note in setup.notes]
    titles = {
        "pull": "Pull: the client fetches the source from a server",
        "push": "Push: the client sends the source to a server",
    }
    for direction, title in titles.items():
        if any(tool.direction == direction for tool in setup.tools):
            table = direction_table(direction, setup.tools, args.deltas, samples)
            lines += ["", "## %s (%s, seconds)" % (title, size), "", table]
    lines += ["", "## Every run (seconds: the timed runs, then their warm-ups)", ""]
    for (delta, name), cell in sorted(samples.items()):
        timed = " ".join("%.3f" % seconds for seconds in cell["timed"])
        warmups = " ".join("%.3f" % seconds for seconds in cell["warmup"])
        lines.append("- delta %i %%, %s: %s; warm-ups %s" % (delta, name, timed, warmups))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Run the benchmark; print the report and write it to --output."""
    args = parse_args(argv)

    def body(setup: benchlib.Setup, dirs: WorkDirs, machine: str) -> str:
        expected_sha = prepare_data(dirs, args.size, args.seed, args.deltas)
        with contextlib.ExitStack() as stack:
            for server in setup.servers:
                stack.enter_context(server)
            samples = run_rounds(args, setup.tools, dirs, expected_sha)
        return render_report(args, setup, samples, machine, dirs)

    return benchlib.run_script(args, "pdiffcopy-remote-delta-", body)


if __name__ == "__main__":
    sys.exit(main())

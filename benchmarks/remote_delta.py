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
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import benchlib
from benchlib import BenchmarkError, Tool, log

# The table shows these families in this order; curl and cp are whole-file references.
COLUMN_ORDER = ("rsync", "original", "ours", "cp", "curl")

# Data files are named by their delta so that logs and kept work dirs are easy to read.
BASE_NAME = "delta-%03d.img"


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
    parser.add_argument(
        "--tools",
        default=",".join(benchlib.FAMILIES),
        type=lambda text: benchlib.parse_name_list(text, benchlib.FAMILIES),
        help="comma separated tool families from %s (default all)" % ",".join(benchlib.FAMILIES),
    )
    parser.add_argument(
        "--directions",
        default=",".join(benchlib.DIRECTIONS),
        type=lambda text: benchlib.parse_name_list(text, benchlib.DIRECTIONS),
        help="pull, push or both (default pull,push)",
    )
    parser.add_argument("--seed", default=benchlib.DEFAULT_SEED, type=int, help="seed of the test data")
    parser.add_argument("--ours-args", default="", type=shlex.split, help="extra options for our pdiffcopy client")
    parser.add_argument("--ours-server-args", default="", type=shlex.split, help="extra options for our server")
    parser.add_argument("--original-args", default="", type=shlex.split, help="extra options for the original client")
    parser.add_argument(
        "--workdir",
        default=tempfile.gettempdir(),
        type=Path,
        help="directory in which a temporary data directory is made (its file system is measured too)",
    )
    parser.add_argument("--keep-data", action="store_true", help="keep the data directory at the end")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if any(not 0 <= delta <= 100 for delta in args.deltas):
        parser.error("--deltas must be percentages between 0 and 100")
    return args


def prepare_data(data_dir: Path, size: int, seed: int, deltas: List[int]) -> Tuple[Path, str, Dict[int, Path]]:
    """
    Write the source and one mutated base file per delta into `data_dir`.

    Returns the source path, its sha256 and the base file of each delta. Runs copy a base
    file to make their fresh target; the bases themselves are never changed.
    """
    source = data_dir / "source.img"
    log("generating %s source (seed %i)" % (benchlib.format_size(size), seed))
    benchlib.generate_source(source, size, seed)
    bases = {}
    for delta in deltas:
        bases[delta] = data_dir / (BASE_NAME % delta)
        num_blocks = benchlib.make_mutated_copy(source, bases[delta], delta, seed)
        log("target for delta %i%%: %i blocks of 1 MiB overwritten" % (delta, num_blocks))
    return source, benchlib.sha256_file(source), bases


def measure(tool: Tool, base: Path, source: Path, expected_sha: str, run_dir: Path, logs_dir: Path) -> Tuple[float, float]:
    """
    Measure one timed run of `tool` right after its untimed warm-up; return both wall times.

    Both runs get their own fresh target (a copy of `base`, or no file for whole-file copy
    tools), made before either starts and written back to disk, so the timed run follows the
    warm-up immediately. Both results are verified by size and sha256 afterwards.
    """
    warm_target = run_dir / ("%s-warmup.img" % tool.name)
    timed_target = run_dir / ("%s-timed.img" % tool.name)
    for target in (warm_target, timed_target):
        target.unlink(missing_ok=True)
        if tool.needs_target:
            benchlib.copy_file(base, target)
    os.sync()
    benchlib.read_through(source)
    log_path = logs_dir / ("%s.log" % tool.name)
    warm = benchlib.run_tool(tool.command(warm_target), log_path, tool.env)
    timed = benchlib.run_tool(tool.command(timed_target), log_path, tool.env)
    size = source.stat().st_size
    benchlib.verify_copy(warm_target, expected_sha, size, "%s (warm-up, %s)" % (tool.name, base.name))
    benchlib.verify_copy(timed_target, expected_sha, size, "%s (timed, %s)" % (tool.name, base.name))
    for target in (warm_target, timed_target):
        target.unlink()
    return warm.seconds, timed.seconds


def run_rounds(args, tools: List[Tool], source: Path, expected_sha: str, bases: Dict[int, Path], run_dir: Path, logs_dir: Path):
    """
    Run every tool `args.rounds` times per delta, rotating the order of tools every round.

    Returns ``{(delta, tool name): {"timed": [...], "warmup": [...]}}`` in seconds.
    """
    samples = {}
    for delta_index, delta in enumerate(args.deltas):
        for round_index in range(args.rounds):
            shift = (delta_index * args.rounds + round_index) % len(tools)
            for tool in tools[shift:] + tools[:shift]:
                warm, timed = measure(tool, bases[delta], source, expected_sha, run_dir, logs_dir)
                cell = samples.setdefault((delta, tool.name), {"timed": [], "warmup": []})
                cell["timed"].append(timed)
                cell["warmup"].append(warm)
                log(
                    "delta %3i%%  round %i/%i  %-14s %7.3f s  (warm-up %.3f s)  sha256 ok"
                    % (delta, round_index + 1, args.rounds, tool.name, timed, warm)
                )
    return samples


def direction_table(direction: str, tools: List[Tool], deltas: List[int], samples) -> str:
    """The markdown table of one direction: median and best per tool, ratios of ours."""
    columns = [tool for tool in tools if tool.direction in (direction, "copy")]
    columns.sort(key=lambda tool: COLUMN_ORDER.index(tool.family))
    header = ["delta %"]
    for tool in columns:
        label = tool.family if tool.direction != "copy" else "%s (whole file)" % tool.family
        header += ["%s median" % label, "%s best" % label]
    header += ["ours/original", "ours/rsync"]
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
        rows.append(row)
    return benchlib.markdown_table(header, rows)


def render_report(args, setup: benchlib.Setup, samples, machine: str, run_dir: Path) -> str:
    """The whole report: header lines, commands, one table per direction and every sample."""
    size = benchlib.format_size(args.size)
    lines = [
        "# pdiffcopy remote delta benchmark",
        "",
        machine,
        "",
        "Workload: %s source of seeded random bytes (seed %i); the target of delta D %% is the source with "
        "D %% of its 1 MiB blocks overwritten with random bytes at seeded random positions. Each timed run "
        "starts from a fresh copy of that target and comes right after an untimed warm-up run of the same "
        "tool; tools alternate between rounds. Times are wall seconds of the whole client process "
        "(start-up included), median and best of %i. Every result was verified by size and sha256 "
        "outside the timing. Ratios are of medians (below 1: ours is faster)." % (size, args.seed, args.rounds),
        "",
        "Versions:",
    ]
    lines += ["- %s" % line for line in setup.versions]
    lines += ["", "Commands (TARGET.img: the fresh target file of a run):"]
    example_target = run_dir / "TARGET.img"
    lines += ["- %s: `%s`" % (tool.name, shlex.join(tool.command(example_target))) for tool in setup.tools]
    lines += ["- note: %s" % note for note in setup.notes]
    for direction, title in (("pull", "Pull: the client fetches the source from a server"), ("push", "Push: the client sends the source to a server")):
        if any(tool.direction == direction for tool in setup.tools):
            lines += ["", "## %s (%s, seconds)" % (title, size), "", direction_table(direction, setup.tools, args.deltas, samples)]
    lines += ["", "## Every run (seconds; timed runs, then their warm-ups)", ""]
    for (delta, name), cell in sorted(samples.items()):
        lines.append(
            "- delta %i %%, %s: %s; warm-ups %s"
            % (delta, name, " ".join("%.3f" % s for s in cell["timed"]), " ".join("%.3f" % s for s in cell["warmup"]))
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Run the benchmark and print (and optionally save) the report."""
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    args.workdir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="pdiffcopy-remote-delta-", dir=args.workdir)).resolve()
    data_dir, run_dir, logs_dir = work_dir / "data", work_dir / "run", work_dir / "logs"
    for directory in (data_dir, run_dir, logs_dir):
        directory.mkdir()
    machine = benchlib.machine_description(work_dir)
    log(machine)
    succeeded = False
    try:
        setup = benchlib.build_setup(
            args.tools, args.directions, work_dir, data_dir / "source.img", run_dir,
            args.original_args, args.ours_args, args.ours_server_args,
        )
        if not setup.tools:
            raise BenchmarkError("no tool left to measure")
        source, expected_sha, bases = prepare_data(data_dir, args.size, args.seed, args.deltas)
        with contextlib.ExitStack() as stack:
            for server in setup.servers:
                stack.enter_context(server)
            samples = run_rounds(args, setup.tools, source, expected_sha, bases, run_dir, logs_dir)
        report = render_report(args, setup, samples, machine, run_dir)
        print(report, end="")
        if args.output:
            args.output.write_text(report)
            log("report written to %s" % args.output)
        succeeded = True
    except BenchmarkError as error:
        log("BENCHMARK FAILED: %s" % error)
        return 1
    finally:
        if args.keep_data:
            log("data kept in %s" % work_dir)
        elif succeeded:
            shutil.rmtree(work_dir)
        else:
            # Keep the logs and server configurations for a post-mortem, drop the big files.
            for image in work_dir.rglob("*.img"):
                image.unlink()
            log("logs kept in %s" % work_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

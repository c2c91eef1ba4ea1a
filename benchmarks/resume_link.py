#!/usr/bin/env python3
"""
Resume benchmark: a new-file pull and push over a shaped link, killed half-way, then run again.

The link is shaped_link.py's: the server in one network namespace, the client in another,
joined by a veth pair shaped with ``tc qdisc tbf`` to ``--rate`` both ways. Each round
starts a client with ``--partial`` on a new target, watches the veth counters, kills the
client with SIGKILL once ``--kill-at`` of the file has crossed the link, and runs it again
with ``--partial``. The report gives the bytes on the link of the rerun (both directions,
headers and hashes included) as a share of the file, and its time. With ``--contrast`` the
same is done without ``--partial`` (the killed run's temporary is not resumed: the rerun
moves the whole file). Every result is checked by size and sha256.

Needs root and iproute2. Everything it creates is removed at the end. Run with --help.
"""

import argparse
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import benchlib
from benchlib import BenchmarkError, log
from shaped_link import OURS_PORT, SERVER_IP, Link, Server, format_rate, parse_rate

#: How often the veth counters are read while waiting for the kill point.
POLL_SECONDS = 0.05


def wait_for_wire(link: Link, before: int, threshold: int, process: subprocess.Popen) -> int:
    """Wait until `threshold` bytes crossed the link since `before` (or the client ended); return them."""
    while process.poll() is None:
        moved = link.wire_bytes() - before
        if moved >= threshold:
            return moved
        time.sleep(POLL_SECONDS)
    raise BenchmarkError("the client ended before the kill point (make --size bigger)")


def one_round(link: Link, command: List[str], env: Dict[str, str], size: int, kill_at: float,
              target: Path, expected: str, log_path: Path) -> Tuple[int, int, float]:
    """Kill a first run at `kill_at` of `size` on the link, rerun; (bytes at the kill, rerun bytes, rerun s)."""
    before = link.wire_bytes()
    process = benchlib.start_process(link.in_client(command), log_path, env)
    try:
        wait_for_wire(link, before, int(kill_at * size), process)
    finally:
        benchlib.kill_group(process, signal.SIGKILL)
        process.wait()
    killed_at = link.wire_bytes() - before
    if target.exists():
        raise BenchmarkError("the killed run left the target under its own name")
    before = link.wire_bytes()
    result = benchlib.run_tool(link.in_client(command), log_path, env)
    rerun = link.wire_bytes() - before
    benchlib.verify_copy(target, expected, size, "the rerun")
    return killed_at, rerun, result.seconds


def clean(target: Path) -> None:
    """Remove the target and every temporary or partial file beside it."""
    for path in target.parent.iterdir():
        if path.name == target.name or path.name.startswith("." + target.name + ".pdiffcopy-"):
            path.unlink()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--sizes", default="256M", type=lambda t: [benchlib.parse_size(x) for x in t.split(",")],
                        help="file sizes, comma separated (default 256M; 1G for the long run)")
    parser.add_argument("--rate", default=parse_rate("200mbit"), type=parse_rate,
                        help="link rate, both directions (default 200mbit)")
    parser.add_argument("--kill-at", default=0.5, type=float,
                        help="share of the file on the link when the first run is killed (default 0.5)")
    parser.add_argument("--directions", default="pull,push",
                        type=lambda t: benchlib.parse_name_list(t, ("pull", "push")))
    parser.add_argument("--rounds", default=3, type=int, help="kill-and-rerun rounds per cell (default 3)")
    parser.add_argument("--contrast", action="store_true", help="also kill and rerun without --partial")
    parser.add_argument("--ours-args", default="", type=shlex.split, help="extra options for our client")
    parser.add_argument("--seed", default=benchlib.DEFAULT_SEED, type=int)
    parser.add_argument("--workdir", default=Path("/var/tmp"), type=Path,
                        help="where the data directory is made (default /var/tmp)")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    if not 0 < args.kill_at < 1:
        parser.error("--kill-at must be between 0 and 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if os.geteuid() != 0:
        parser.error("network namespaces need root")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    benchlib.install_signal_handlers()
    dirs = benchlib.WorkDirs.make(args.workdir, "resume-link-")
    work, data, logs, run = dirs.root, dirs.data, dirs.logs, dirs.run
    server = None
    try:
        machine = benchlib.machine_description(work)
        ours, reason = benchlib.find_ours()
        if ours is None:
            raise BenchmarkError(reason)
        token = "resume-link-benchmark-token"
        env = dict(ours.env, PDIFFCOPY_TOKEN=token, XDG_RUNTIME_DIR=str(logs))
        url = "http://%s:%i/" % (SERVER_IP, OURS_PORT)
        rows = []
        with Link() as link:
            server = Server("ours", ours.command + ["--listen", "%s:%i" % (SERVER_IP, OURS_PORT), "--root", str(work)],
                            OURS_PORT, logs / "server.log", env)
            server.start(link)
            link.shape(args.rate)
            start_load = benchlib.load_averages()
            for size in args.sizes:
                source = data / ("source-%s.img" % benchlib.format_size(size).replace(" ", ""))
                log("generating %s of random data" % benchlib.format_size(size))
                benchlib.generate_source(source, size, args.seed)
                expected = benchlib.sha256_file(source)
                for direction in args.directions:
                    for partial in [True, False] if args.contrast else [True]:
                        samples = []
                        for round_number in range(args.rounds):
                            target = run / ("%s-%s.img" % (direction, round_number))
                            clean(target)
                            options = ours.command + args.ours_args + (["--partial"] if partial else [])
                            command = options + ([url + str(source.relative_to(work)), str(target)]
                                                 if direction == "pull" else
                                                 [str(source), url + str(target.relative_to(work))])
                            benchlib.read_through(source)
                            killed_at, rerun, seconds = one_round(
                                link, command, env, size, args.kill_at, target, expected,
                                logs / ("%s-%s.log" % (direction, "partial" if partial else "plain")))
                            log("%s %s %s: killed at %.1f MiB, rerun %.1f MiB on the link (%.1f %%), %.2f s" % (
                                benchlib.format_size(size), direction, "--partial" if partial else "plain",
                                killed_at / 2**20, rerun / 2**20, 100 * rerun / size, seconds))
                            samples.append((killed_at, rerun, seconds))
                            clean(target)
                        rows.append([benchlib.format_size(size), direction, "yes" if partial else "no",
                                     "%.1f" % (statistics.median(s[0] for s in samples) / 2**20),
                                     "%.1f" % (statistics.median(s[1] for s in samples) / 2**20),
                                     "%.1f %%" % (100 * statistics.median(s[1] for s in samples) / size),
                                     "%.1f %%" % (100 * max(s[1] for s in samples) / size),
                                     "%.2f" % statistics.median(s[2] for s in samples)])
            server.stop()
        lines = ["# Resume benchmark", "", machine, "", "- %s" % ours.description,
                 "- command: `%s`" % shlex.join([sys.executable] + sys.argv),
                 "- link: %s, veth pair between two network namespaces, `tc qdisc tbf` on both ends"
                 % format_rate(args.rate),
                 "- each row: %i round(s) of a new-file sync killed (SIGKILL) once %.0f %% of the file had "
                 "crossed the link, then run again; medians, and the worst rerun" % (args.rounds, 100 * args.kill_at),
                 "- bytes: both directions on the link, from the veth counters (headers and hashes included)", "",
                 benchlib.markdown_table(["size", "direction", "--partial", "MiB at the kill", "MiB of the rerun",
                                          "rerun / file", "worst rerun / file", "rerun s"], rows), "",
                 "Load average (1, 5, 15 min): %s at the start, %s at the end."
                 % (start_load, benchlib.load_averages())]
        text = "\n".join(lines) + "\n"
        print(text, end="")
        if args.output:
            args.output.write_text(text)
        return 0
    except BenchmarkError as error:
        log("FAILED: %s" % error)
        return 1
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

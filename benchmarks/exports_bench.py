#!/usr/bin/env python3
"""Does admitting requests to exports cost anything on the hot path? (issue 34's measurement)

Three servers side by side, the same files behind each, every round in turn:

- ``before``: the ``--root`` server of a baseline revision (``--baseline-tree``, a checkout
  of the revision before exports, run with this checkout's venv);
- ``root``: this revision's ``--root`` server with one token (the one-export shorthand);
- ``config``: this revision with ``--config`` naming ``--exports`` exports of ``--tokens``
  tokens each, the files in the middle one and the client's token its last.

Workloads: a no-change pull of one ``--size`` file and a no-change pull of a tree of
``--files`` small files. Prints the median seconds of each and the ratios to ``before``.

    .venv/bin/python benchmarks/exports_bench.py --baseline-tree /work/wt/before --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

TOKEN = "bench-token-0"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(command: List[str], cwd: Path, env: Dict[str, str], log: Path) -> "tuple[subprocess.Popen, int]":
    port = free_port()
    handle = open(log, "wb")
    process = subprocess.Popen([*command, "--listen", f"127.0.0.1:{port}", "-c", "2"], cwd=cwd, env=env,
                               stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process, port
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"server did not start: {log.read_text()}")


def make_tree(directory: Path, files: int) -> None:
    for index in range(files):
        sub = directory / f"d{index // 1000:03d}"
        if index % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{index:05d}.txt").write_bytes(hashlib.sha256(str(index).encode()).digest() * 8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", required=True, type=Path, help="a checkout of the revision before")
    parser.add_argument("--size", type=int, default=1024, help="MiB of the pulled file (default 1024)")
    parser.add_argument("--files", type=int, default=60000, help="files of the pulled tree (default 60000)")
    parser.add_argument("--exports", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="exports-bench-"))
    served = work / "served"
    middle = args.exports // 2
    data = served / f"e{middle:03d}"
    data.mkdir(parents=True, exist_ok=True)
    print(f"# making {args.size} MiB and {args.files} files in {data}", flush=True)
    with open(data / "big.img", "wb") as handle:
        block = os.urandom(1 << 20)
        for index in range(args.size):
            handle.write(hashlib.sha256(str(index).encode()).digest() + block[32:])
    make_tree(data / "tree", args.files)
    for index in range(args.exports):
        (served / f"e{index:03d}").mkdir(exist_ok=True)
    lines = []
    for index in range(args.exports):
        tokens = ", ".join(
            f'"t{index}-{number}:sha256:{hashlib.sha256((TOKEN if (index, number) == (middle, args.tokens - 1) else f"other-{index}-{number}").encode()).hexdigest()}"'  # noqa: E501
            for number in range(args.tokens))
        lines.append(f'[export.e{index:03d}]\npath = "{served / f"e{index:03d}"}"\nread_only = false\n'
                     f"tokens = [{tokens}]\n")
    config = work / "exports.toml"
    config.write_text("\n".join(lines))
    python = str(Path(sys.executable))
    env = {key: value for key, value in os.environ.items() if key != "PDIFFCOPY_TOKEN"}
    here = Path(__file__).resolve().parent.parent
    servers = {}
    for name, cwd, command, token_env in (
            ("before", args.baseline_tree, [python, "-m", "pdiffcopy", "--root", str(data)],
             {"PDIFFCOPY_TOKEN": TOKEN}),
            ("root", here, [python, "-m", "pdiffcopy", "--root", str(data)], {"PDIFFCOPY_TOKEN": TOKEN}),
            ("config", here, [python, "-m", "pdiffcopy", "--config", str(config)], {})):
        server_env = dict(env, PYTHONPATH=str(cwd), **token_env)
        process, port = start(command, cwd, server_env, work / f"{name}.log")
        prefix = f"http://127.0.0.1:{port}/" + (f"e{middle:03d}/" if name == "config" else "")
        servers[name] = (process, prefix)
    client_env = dict(env, PDIFFCOPY_TOKEN=TOKEN, PYTHONPATH=str(here))
    local = work / "local"
    local.mkdir(exist_ok=True)
    shutil.copyfile(data / "big.img", local / "big.img")
    subprocess.run([python, "-m", "pdiffcopy", "-q", f"{data / 'tree'}/", f"{local / 'tree'}/"], check=True,
                   env=client_env)
    times: Dict[str, Dict[str, List[float]]] = {name: {"file": [], "tree": []} for name in servers}
    try:
        for round_number in range(args.rounds):
            for name, (_, prefix) in servers.items():
                for workload, source, target in (("file", f"{prefix}big.img", str(local / "big.img")),
                                                 ("tree", f"{prefix}tree/", f"{local / 'tree'}/")):
                    started = time.perf_counter()
                    done = subprocess.run([python, "-m", "pdiffcopy", "-q", source, target], env=client_env,
                                          capture_output=True, text=True)
                    elapsed = time.perf_counter() - started
                    if done.returncode != 0:
                        raise SystemExit(f"{name} {workload}: {done.stderr.strip()}")
                    times[name][workload].append(elapsed)
                    print(f"round {round_number + 1} {name:6s} {workload}: {elapsed:.2f} s", flush=True)
    finally:
        for process, _ in servers.values():
            os.killpg(process.pid, signal.SIGTERM)
    print(f"\n# medians of {args.rounds} rounds, load {os.getloadavg()[0]:.2f}; "
          f"{args.exports} exports x {args.tokens} tokens")
    for workload in ("file", "tree"):
        base = statistics.median(times["before"][workload])
        cells = ", ".join(f"{name} {statistics.median(times[name][workload]):.2f} s "
                          f"({statistics.median(times[name][workload]) / base:.3f}x)" for name in servers)
        print(f"{workload}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What the transfer log adds to a sync (issue 34): per request, and per sync.

- ``TransferLog.add``, the work each answered request adds (a record file under flock),
  timed over ``--adds`` calls in /dev/shm;
- the end-of-sync request (``POST /.pdiffcopy/done``): ``--syncs`` no-change pulls of a
  small file through ``api.sync`` from a ``--config`` server, with it, without it (the
  server's echo ignored), and with it again.

    .venv/bin/python benchmarks/transfer_log_cost.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def time_adds(count: int) -> float:
    from pdiffcopy.server.audit import TransferLog
    from pdiffcopy.server.metrics import RequestTally

    log = TransferLog(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    log._sweeper_pid = os.getpid()  # (no sweeper thread: only the adds are timed)
    tally = RequestTally()
    tally.sent = 1 << 20
    started = time.perf_counter()
    for _ in range(count):
        log.add("k" * 32, "vms", "ops", "127.0.0.1", "disk.img", False, tally, 200)
    return (time.perf_counter() - started) / count


def time_syncs(url: str, target: str, count: int) -> float:
    import pdiffcopy.api as api

    times = []
    for _ in range(count):
        started = time.perf_counter()
        api.sync(url, target)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adds", type=int, default=5000)
    parser.add_argument("--syncs", type=int, default=30)
    args = parser.parse_args()
    print(f"TransferLog.add: {time_adds(args.adds) * 1e6:.1f} us per request ({args.adds} adds)")
    from pdiffcopy.transport import syncs

    with tempfile.TemporaryDirectory() as work:
        served = Path(work, "served")
        served.mkdir()
        (served / "small.txt").write_bytes(b"x" * 1000)
        config = Path(work, "exports.toml")
        config.write_text(f'[export.e]\npath = "{served}"\n')
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "pdiffcopy", "--config", str(config), "--listen",
                                   f"127.0.0.1:{port}", "-c", "2"], stderr=subprocess.DEVNULL)
        try:
            time.sleep(2)
            url, target = f"http://127.0.0.1:{port}/e/small.txt", str(Path(work, "copy.txt"))
            time_syncs(url, target, 3)  # (warm-up)
            with_end = time_syncs(url, target, args.syncs)
            said = syncs.CurrentSync.logged_by
            syncs.CurrentSync.logged_by = lambda self, server, say_over: None
            without = time_syncs(url, target, args.syncs)
            syncs.CurrentSync.logged_by = said
            again = time_syncs(url, target, args.syncs)
        finally:
            server.terminate()
            server.wait()
    print(f"a small no-change pull, median of {args.syncs}: with the end-of-sync request {with_end * 1000:.1f} ms, "
          f"without {without * 1000:.1f} ms, with again {again * 1000:.1f} ms")


if __name__ == "__main__":
    main()

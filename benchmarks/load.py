"""Load: many clients syncing different files against one pdiffcopy server at once.

Starts a server on 127.0.0.1 (a free port) over a fresh directory, makes
``--clients`` random files of ``--size`` bytes (half on the server, to be
pulled; half local, to be pushed), starts that many ``pdiffcopy`` command
lines at once (``-c 1`` each: one connection, one hashing process), and
waits for all of them. Optionally one more client trickles a PATCH body a
few bytes at a time the whole while (``--slow-client``). At the end every
target's sha256 must equal its source's.

It prints the wall time from the first client's start to the last one's
exit, each client's time, and the aggregate throughput: all bytes synced
divided by that wall time::

    python3 benchmarks/load.py                         # 16 clients x 64 MiB
    python3 benchmarks/load.py --clients 16 --size 16M --slow-client

tests/test_load.py runs :func:`run_load` (smaller in CI) and asserts on it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

#: Seconds the server may take to start answering.
SERVER_START_TIMEOUT = 30.0

#: Seconds the whole load may take before it counts as hung.
DEFAULT_DEADLINE = 300.0

#: The slow client sends this many bytes at a time...
TRICKLE_BYTES = 4
#: ...this often (16 bytes a second): far slower than any real client.
TRICKLE_INTERVAL = 0.25

MIB = 1024 * 1024


@dataclass
class ClientRun:
    """One client's sync: what, how long, how it ended."""

    direction: str
    source: Path
    target: Path
    seconds: float = 0.0
    began: float = 0.0
    returncode: Optional[int] = None
    stderr: str = ""
    verified: bool = False


@dataclass
class LoadResult:
    """What a load run measured."""

    clients: List[ClientRun]
    size: int
    wall_seconds: float
    slow_client_bytes: int = 0
    slow_client_answered: bool = False
    server_log: str = ""
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.size * len(self.clients)

    @property
    def throughput(self) -> float:
        """Aggregate bytes per second."""
        return self.total_bytes / self.wall_seconds

    def report(self) -> str:
        pulls = sum(c.direction == "pull" for c in self.clients)
        seconds = [c.seconds for c in self.clients]
        lines = [
            (f"{len(self.clients)} clients x {self.size / MIB:g} MiB ({pulls} pulls, "
             f"{len(self.clients) - pulls} pushes), one server, {os.cpu_count()} CPUs"),
            (f"wall time {self.wall_seconds:.2f} s, slowest client {max(seconds):.2f} s, "
             f"fastest {min(seconds):.2f} s"),
            (f"aggregate throughput {self.throughput / MIB:.1f} MiB/s "
             f"({self.total_bytes / MIB:g} MiB in {self.wall_seconds:.2f} s)"),
            f"all verified: {all(c.verified for c in self.clients)}",
        ]
        if self.slow_client_bytes:
            lines.append(f"slow client: {self.slow_client_bytes} bytes trickled meanwhile, "
                         f"answered before the end: {self.slow_client_answered}")
        return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command(*args: str) -> List[str]:
    return [sys.executable, "-m", "pdiffcopy", *args]


def clean_env() -> dict:
    env = dict(os.environ)
    env.pop("PDIFFCOPY_TOKEN", None)
    return env


def start_server(root: Path, log: Path, workers: Optional[int]) -> subprocess.Popen:
    port = free_port()
    extra = ["-c", str(workers)] if workers else []
    with open(log, "wb") as output:  # the child keeps its own copy
        process = subprocess.Popen(command("--root", str(root), "--listen", f"127.0.0.1:{port}",
                                           *extra),
                                   stdout=output, stderr=subprocess.STDOUT, env=clean_env(),
                                   start_new_session=True)
    process.port = port  # type: ignore[attr-defined]
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process
        except OSError:
            time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError("the server did not start")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def make_file(path: Path, size: int) -> str:
    """A file of random bytes; returns its sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as handle:
        for offset in range(0, size, 16 * MIB):
            data = os.urandom(min(16 * MIB, size - offset))
            digest.update(data)
            handle.write(data)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(16 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


class SlowClient:
    """A PATCH whose body arrives a few bytes at a time, for as long as it runs."""

    def __init__(self, port: int, name: str, length: int) -> None:
        self.sent = 0
        self.answered = False
        self._stop = threading.Event()
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = (f"PATCH /{name} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Range: bytes 0-{length - 1}/*\r\nContent-Length: {length}\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode("ascii")
        self._sock.sendall(head)
        self._sock.setblocking(False)
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        while not self._stop.wait(TRICKLE_INTERVAL):
            try:
                if self._sock.recv(1):  # the server answered (or closed) early
                    self.answered = True
                    return
            except BlockingIOError:
                pass
            except OSError:
                self.answered = True
                return
            try:
                self._sock.send(b"s" * TRICKLE_BYTES)
                self.sent += TRICKLE_BYTES
            except OSError:
                self.answered = True
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


def run_load(workdir: Path, clients: int = 16, size: int = 64 * MIB,
             workers: Optional[int] = None, slow_client: bool = False,
             deadline: float = DEFAULT_DEADLINE) -> LoadResult:
    """Run one load test in ``workdir`` (which it fills) and return the measurements.

    :param clients: How many command lines sync at once; every other one pulls.
    :param size: Bytes per file.
    :param workers: Server worker processes (default: the server's, one per CPU).
    :param slow_client: Also trickle a PATCH body the whole time.
    :param deadline: Seconds after which the clients are killed and the run fails.
    """
    root, local = workdir / "root", workdir / "local"
    root.mkdir(parents=True)
    local.mkdir()
    runs: List[ClientRun] = []
    digests: Dict[Path, str] = {}
    for index in range(clients):
        name = f"file-{index:02d}.img"
        if index % 2 == 0:
            run = ClientRun("pull", root / name, local / name)
        else:
            run = ClientRun("push", local / name, root / name)
        digests[run.source] = make_file(run.source, size)
        runs.append(run)
    if slow_client:
        (root / "slow.img").write_bytes(b"\0" * MIB)
    log = workdir / "server.log"
    server = start_server(root, log, workers)
    port = server.port  # type: ignore[attr-defined]
    trickler = None
    try:
        if slow_client:
            trickler = SlowClient(port, "slow.img", MIB)
            time.sleep(0.5)  # it holds a worker thread before the crowd arrives
        base = f"http://127.0.0.1:{port}"
        waiters, processes = [], []
        started = time.monotonic()
        for run in runs:
            source = f"{base}/{run.source.name}" if run.direction == "pull" else str(run.source)
            target = f"{base}/{run.target.name}" if run.direction == "push" else str(run.target)
            process = subprocess.Popen(
                command("-c", "1", "--no-progress", source, target),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env(),
                start_new_session=True)
            processes.append(process)
            waiter = threading.Thread(target=_wait, args=(run, process, time.monotonic()))
            waiter.start()
            waiters.append(waiter)
        for waiter in waiters:
            waiter.join(timeout=max(0.1, started + deadline - time.monotonic()))
        if any(waiter.is_alive() for waiter in waiters):
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
            raise RuntimeError(f"the clients did not finish within {deadline:g} s")
        result = LoadResult(runs, size, max(run.seconds + run.began for run in runs) - started)
        if trickler is not None:
            result.slow_client_bytes = trickler.sent
            result.slow_client_answered = trickler.answered
    finally:
        if trickler is not None:
            trickler.close()
        stop_server(server)
    for run in runs:
        run.verified = (run.returncode == 0 and run.target.exists()
                        and file_digest(run.target) == digests[run.source])
    result.server_log = log.read_text(errors="replace")
    return result


def _wait(run: ClientRun, process: subprocess.Popen, began: float) -> None:
    """Wait for one client and record how it ended and how long it took."""
    _, run.stderr = process.communicate()
    run.seconds = time.monotonic() - began
    run.began = began
    run.returncode = process.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--size", default="64M", help="bytes per file: 64M, 16M, 1G...")
    parser.add_argument("--workers", type=int, default=None,
                        help="server worker processes (default: one per CPU)")
    parser.add_argument("--slow-client", action="store_true",
                        help="also trickle a PATCH body a few bytes at a time")
    parser.add_argument("--workdir", default=None, help="where to put the files (default: /tmp)")
    args = parser.parse_args()
    from humanfriendly import parse_size

    size = parse_size(args.size, binary=True)
    workdir = Path(tempfile.mkdtemp(prefix="pdiffcopy-load-", dir=args.workdir))
    try:
        result = run_load(workdir, args.clients, size, args.workers, args.slow_client)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(result.report())
    for run in result.clients:
        print(f"  {run.direction} {run.source.name}: {run.seconds:.2f} s, exit {run.returncode}"
              + ("" if run.verified else f", NOT VERIFIED: {run.stderr.strip()[-300:]}"))
    if not all(run.verified for run in result.clients):
        sys.exit(1)


if __name__ == "__main__":
    main()

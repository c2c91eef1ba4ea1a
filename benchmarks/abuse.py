#!/usr/bin/env python3
"""
Hostile-clients benchmark: does a normal sync still complete while an attack goes on?

For each attack kind at 16, 128 and 1,000 connections, a fresh pdiffcopy server on
127.0.0.1 (default settings: 2 workers on 2 CPUs) gets that many hostile connections; once
they are open, a normal client pulls a 64 MiB file with 10 % of its 1 MiB blocks changed
(``python3 -m pdiffcopy URL TARGET``) three times; the median is reported next to one such
sync on the same server just before the attack. A sync that has not finished after
--sync-timeout seconds counts as failed. Every result is checked by sha256 outside the
timing.

Attack kinds (each connection, after connecting):

- ``silent``: sends nothing.
- ``one-byte``: sends one byte of a request line, then nothing.
- ``tls-one-byte``: (against an HTTPS server) sends the first byte of a TLS record.
- ``slow-read``: asks for the whole file with ``Range: bytes=0-`` and never reads.
- ``trickle-patch``: a PATCH of 1 MiB whose body comes one byte every half second.
- ``trickle-tree-write``: a chunked tree-write body, one byte every half second.
- ``trickle-json``: a tree-read JSON body of 100 kB, one byte every half second.

Runs against 127.0.0.1 only. Example::

    PYTHONPATH=. python3 benchmarks/abuse.py --output benchmarks/results/abuse/hostile-clients.txt
"""

import argparse
import contextlib
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional, Tuple

import benchlib
from benchlib import log

KINDS = ("silent", "one-byte", "tls-one-byte", "slow-read", "trickle-patch", "trickle-tree-write",
         "trickle-json")

# The numbers of hostile connections.
DEFAULT_COUNTS = (16, 128, 1000)

# Seconds between two bytes of a trickled request: slow enough to hold a thread of a server
# without a minimum rate, fast enough that the server never sees a silent socket.
TRICKLE_INTERVAL = 0.5

# Seconds the attack runs before the normal syncs start. Connections that never finish
# their headers cost the server nothing to start; those that reach a request thread (slow
# reads, trickled bodies) cost it about 4 s of CPU for 1,000 on a loaded 2-core machine, and
# the attack's start-up is not what this measures. Both stay below the server's limits
# (10 s for headers, 30 s of stall for bodies), so the attack is open during the syncs.
SETTLE = {"silent": 2.0, "one-byte": 2.0, "tls-one-byte": 2.0}
SETTLE_IN_THREADS = 10.0

# Timed syncs per run; the median counts. One more, untimed, warms the server up first, and
# one before the attack is the run's own baseline (the load of the machine drifts).
SYNCS = 3

# Linux TCP states (the first byte of TCP_INFO) of a connection the other side has closed.
TCP_CLOSE, TCP_CLOSE_WAIT = 7, 8

# Seconds to wait for the server to close all hostile connections of the largest count: its
# limits are 10 s for headers and 30 s plus the data moved at 16 KiB/s for bodies and reads.
DEFAULT_CLOSE_WAIT = 60.0

# The requests of the attacks; the file names are the benchmark's own.
HEADS = {
    "one-byte": b"G",
    "slow-read": b"GET /source.img HTTP/1.1\r\nHost: bench\r\nRange: bytes=0-\r\n\r\n",
    "trickle-patch": b"PATCH /victim.img HTTP/1.1\r\nHost: bench\r\nContent-Range: bytes 0-1048575/*\r\n"
                     b"Content-Type: application/octet-stream\r\nContent-Length: 1048576\r\n\r\n",
    "trickle-tree-write": b"POST /.pdiffcopy/tree-write/ HTTP/1.1\r\nHost: bench\r\n"
                          b"Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
    "trickle-json": b"POST /.pdiffcopy/tree-read/ HTTP/1.1\r\nHost: bench\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
    "tls-one-byte": b"\x16",
}
TRICKLES = {"trickle-patch": b"x", "trickle-tree-write": b"1\r\nx\r\n", "trickle-json": b" "}


def raise_open_file_limit() -> None:
    """Soft limit up to the hard one: 1,000 hostile sockets do not fit in the usual 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Attack:
    """``count`` hostile connections of one kind, kept open (and trickling) until :meth:`stop`."""

    def __init__(self, kind: str, port: int, count: int) -> None:
        self.kind = kind
        self.socks: List[socket.socket] = []
        self.failed_connects = 0
        self._stopping = threading.Event()
        for _ in range(count):
            sock = socket.socket()
            if kind == "slow-read":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(5)
            try:
                sock.connect(("127.0.0.1", port))
                if kind in HEADS:
                    sock.sendall(HEADS[kind])
            except OSError:
                self.failed_connects += 1
                sock.close()
                continue
            sock.setblocking(False)
            self.socks.append(sock)
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        data = TRICKLES.get(self.kind)
        while data and not self._stopping.wait(TRICKLE_INTERVAL):
            for sock in self.socks:
                with contextlib.suppress(OSError):
                    sock.send(data)

    def closed_by_server(self) -> int:
        """How many of the connections the server has closed (or reset) so far.

        Read from the kernel's TCP state (CLOSE_WAIT after a FIN, CLOSE after a reset), not
        by reading: reading would make a slow reader a fast one.
        """
        closed = 0
        for sock in self.socks:
            try:
                state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
            except OSError:
                state = TCP_CLOSE
            closed += state in (TCP_CLOSE, TCP_CLOSE_WAIT)
        return closed

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        for sock in self.socks:
            sock.close()


class Server:
    """A pdiffcopy server with default settings, in its own process group."""

    def __init__(self, root: Path, log_path: Path, tls: Optional[Tuple[Path, Path]]) -> None:
        self.port = benchlib.free_port()
        command = [sys.executable, "-m", "pdiffcopy", "--root", str(root), "--listen", "127.0.0.1:%d" % self.port]
        if tls:
            command += ["--certfile", str(tls[0]), "--keyfile", str(tls[1])]
        self.process = benchlib.start_process(command, log_path, env=dict(os.environ))
        deadline = time.monotonic() + benchlib.SERVER_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise benchlib.BenchmarkError("server exited: %s" % benchlib.tail(log_path))
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(benchlib.PORT_POLL_INTERVAL)
        self.stop()
        raise benchlib.BenchmarkError("server did not start: %s" % benchlib.tail(log_path))

    def stop(self) -> None:
        benchlib.kill_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(benchlib.SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            benchlib.kill_group(self.process, signal.SIGKILL)
            self.process.wait()


def timed_sync(server: Server, scheme: str, ca_file: Optional[Path], base: Path, target: Path,
               expected: str, size: int, timeout: float, log_path: Path) -> Optional[float]:
    """Seconds a pull of source.img into a fresh copy of ``base`` took, or None if it failed."""
    benchlib.fresh_target(base, target, True)
    command = [sys.executable, "-m", "pdiffcopy", "--no-progress",
               "%s://127.0.0.1:%d/source.img" % (scheme, server.port), str(target)]
    if ca_file:
        command += ["--ca-file", str(ca_file)]
    started = time.monotonic()
    with open(log_path, "ab") as handle:
        try:
            completed = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    elapsed = time.monotonic() - started
    if completed.returncode != 0:
        return None
    benchlib.verify_copy(target, expected, size, "the normal sync")
    return elapsed


def make_certificate(directory: Path) -> Tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--size", default="64M", type=benchlib.parse_size, help="file size (default 64M)")
    parser.add_argument("--counts", default=",".join(map(str, DEFAULT_COUNTS)), type=benchlib.parse_int_list,
                        help="hostile connections per run (default 16,128,1000)")
    parser.add_argument("--kinds", default=",".join(KINDS), type=lambda text: benchlib.parse_name_list(text, KINDS),
                        help="attack kinds (default: all)")
    parser.add_argument("--sync-timeout", default=60.0, type=float,
                        help="seconds after which a normal sync counts as failed (default 60)")
    parser.add_argument("--close-wait", default=DEFAULT_CLOSE_WAIT, type=float,
                        help="seconds to wait for the server to close the largest attack (default 60; 0: skip)")
    parser.add_argument("--workdir", default=None, help="where the temporary files go")
    parser.add_argument("--output", default=None, help="also write the report to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    raise_open_file_limit()
    work = Path(tempfile.mkdtemp(prefix="pdiffcopy-abuse-", dir=args.workdir))
    try:
        root, local, logs = work / "root", work / "local", work / "logs"
        for directory in (root, local, logs):
            directory.mkdir()
        source = root / "source.img"
        benchlib.generate_source(source, args.size, benchlib.DEFAULT_SEED)
        (root / "victim.img").write_bytes(bytes(2 * 1024 * 1024))
        base = local / "base.img"
        benchlib.make_mutated_copy(source, base, 10, benchlib.DEFAULT_SEED)
        expected = benchlib.sha256_file(source)
        tls = make_certificate(work) if "tls-one-byte" in args.kinds else None
        target = local / "target.img"

        def one_run(kind: str, count: int):
            """(baseline s, median s under attack or None, connections opened, still open after the syncs,
            None or (seconds until all closed or None, closed))."""
            use_tls = kind == "tls-one-byte"
            server = Server(root, logs / "server.log", tls if use_tls else None)
            attack = None

            def sync() -> Optional[float]:
                return timed_sync(server, "https" if use_tls else "http", tls[0] if use_tls else None,
                                  base, target, expected, args.size, args.sync_timeout, logs / "client.log")

            try:
                sync()  # warm-up
                baseline = sync()
                if baseline is None:
                    raise benchlib.BenchmarkError("a sync without an attack failed; see %s" % logs)
                started = time.monotonic()
                attack = Attack(kind, server.port, count)
                time.sleep(SETTLE.get(kind, SETTLE_IN_THREADS))
                samples = []
                for _ in range(SYNCS):
                    samples.append(sync())
                    if samples[-1] is None:
                        break
                elapsed = None if None in samples else statistics.median(samples)
                opened = len(attack.socks)
                still_open = opened - attack.closed_by_server()
                if count < max(args.counts) or not args.close_wait:
                    return baseline, elapsed, opened, still_open, None
                # How long until the server closed every hostile connection (from the attack's start).
                while attack.closed_by_server() < opened and time.monotonic() < started + args.close_wait:
                    time.sleep(0.5)
                closed = attack.closed_by_server()
                closure = (time.monotonic() - started if closed == opened else None, closed)
                return baseline, elapsed, opened, still_open, closure
            finally:
                if attack:
                    attack.stop()
                server.stop()

        rows = []
        for kind in args.kinds:
            for count in args.counts:
                baseline, elapsed, opened, still_open, closure = one_run(kind, count)
                if closure is None:
                    closing = ""
                elif closure[0] is None:
                    closing = "%d of %d after %.0f s" % (closure[1], opened, args.close_wait)
                else:
                    closing = "all after %.1f s" % closure[0]
                rows.append([kind, str(count), "%d" % still_open, "yes" if elapsed is not None else "NO",
                             benchlib.format_seconds(baseline), benchlib.format_seconds(elapsed),
                             benchlib.format_ratio(elapsed, baseline), closing])
                log("%s x %d: %s" % (kind, count, rows[-1][2:]))
        table = benchlib.markdown_table(
            ["attack", "connections", "open after the syncs", "synced", "s before", "s during", "ratio",
             "server closed them"], rows)
        report = "\n".join([
            "Hostile clients: a %s pull (10 %% of 1 MiB blocks changed) during each attack" % benchlib.format_size(
                args.size),
            benchlib.machine_description(work), "load: %s" % benchlib.load_averages(),
            "s before: one sync on the same server just before the attack; s during: median of %d syncs "
            "during it, after %.0f s (%.0f s for attacks on headers); sync timeout %.0f s; closing is timed "
            "from the attack's start, for the largest count" % (
                SYNCS, SETTLE_IN_THREADS, max(SETTLE.values()), args.sync_timeout),
            "", table, ""])
        print(report)
        if args.output:
            Path(args.output).write_text(report)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

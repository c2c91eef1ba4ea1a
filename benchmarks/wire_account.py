"""Where a sync's bytes on the wire go, by request kind: a counting run on 127.0.0.1.

Starts a server on a free port (as the tests do), syncs a file of --size bytes with one byte
inserted every 16 MiB (shaped_link.py's shift-every), pull and push with the default command
line, and counts what the client's sockets sent and received while each kind of request was
the current one on its thread (request line and headers, body, answer). The bytes are the
application's: TCP/IP headers and ACKs, which the shaped link's veth counters include, are not.

    .venv/bin/python benchmarks/wire_account.py --size 1G
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import start_server  # noqa: E402

import benchlib  # noqa: E402
from pdiffcopy import sync  # noqa: E402
from pdiffcopy.transport import httpclient  # noqa: E402

SHIFT_EVERY = 16 * 1024 * 1024

_current = threading.local()
_table: "collections.defaultdict[str, list]" = collections.defaultdict(lambda: [0, 0, 0])


def _label(method: str, target: str) -> str:
    """``POST chunks avg=131072``, ``GET hashes``, ``PATCH file``..."""
    kind = re.match(r"/\.pdiffcopy/([a-z-]+)", target.split("?")[0])
    label = f"{method} {kind.group(1) if kind else 'file'}"
    average = re.search(r"average=(\d+)", target)
    return label + (f" avg={average.group(1)}" if average else "")


def _install_counters() -> None:
    """Count every request, and every byte each thread's sockets move, under its current request."""
    send_request = httpclient.HttpClient._send
    sendall, recv_into = socket.socket.sendall, socket.socket.recv_into

    def counted_send(self, method, target, *args, **kwargs):
        _current.label = _label(method, target)
        _table[_current.label][0] += 1
        return send_request(self, method, target, *args, **kwargs)

    def counted_sendall(self, data, *args):
        _table[getattr(_current, "label", "?")][1] += memoryview(data).nbytes
        return sendall(self, data, *args)

    def counted_recv_into(self, buffer, *args):
        received = recv_into(self, buffer, *args)
        _table[getattr(_current, "label", "?")][2] += received
        return received

    httpclient.HttpClient._send = counted_send
    socket.socket.sendall, socket.socket.recv_into = counted_sendall, counted_recv_into


def shifted(old: bytes) -> bytes:
    """``old`` with one byte inserted every :data:`SHIFT_EVERY` bytes."""
    cuts = range(SHIFT_EVERY, len(old), SHIFT_EVERY)
    parts, previous = [], 0
    for position in cuts:
        parts += [old[previous:position], b"x"]
        previous = position
    parts.append(old[previous:])
    return b"".join(parts)


def report(direction: str, seconds: float, bytes_moved: int) -> None:
    print(f"{direction}: {seconds:.2f} s, {bytes_moved} bytes of data sent")
    print(f"  {'request':28s} {'count':>5s} {'sent':>9s} {'received':>9s} {'KiB':>8s}")
    totals = [0, 0, 0]
    for label, (count, sent, received) in sorted(_table.items(), key=lambda item: -sum(item[1][1:])):
        print(f"  {label:28s} {count:5d} {sent:9d} {received:9d} {(sent + received) / 1024:8.1f}")
        totals = [totals[0] + count, totals[1] + sent, totals[2] + received]
    print(f"  {'total':28s} {totals[0]:5d} {totals[1]:9d} {totals[2]:9d} {(totals[1] + totals[2]) / 1024:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1G", type=benchlib.parse_size)
    parser.add_argument("--directions", default="pull,push")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    _install_counters()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="wire-account-") as name:
        work = Path(name)
        root = work / "root"
        root.mkdir()
        old = os.urandom(args.size)
        new = shifted(old)
        server = start_server(root, work / "server.log")
        try:
            for direction in args.directions.split(","):
                _table.clear()
                if direction == "pull":
                    (root / "file").write_bytes(new)
                    target = work / "target"
                    target.write_bytes(old)
                    ends = (server.url("file"), str(target))
                else:
                    source = work / "source"
                    source.write_bytes(new)
                    target = root / "file"
                    target.write_bytes(old)
                    ends = (str(source), server.url("file"))
                started = time.perf_counter()
                result = sync(*ends)
                seconds = time.perf_counter() - started
                if target.read_bytes() != new:
                    raise SystemExit(f"{direction}: the target differs from the source")
                report(direction, seconds, result.bytes_moved)
        finally:
            server.stop()


if __name__ == "__main__":
    main()

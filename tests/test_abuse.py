"""Hostile connections: the server keeps answering others and closes them within a bound.

Each test opens a crowd of connections of one hostile kind against a real
server on 127.0.0.1 (started with short limits, see :data:`LIMITS`), checks
that a normal request is answered while they stay open, and that the server
closed every one of them within :data:`CLOSE_BOUND` seconds.
"""

from __future__ import annotations

import http.client
import shutil
import socket
import ssl
import subprocess
import time
from typing import List

import pytest

from conftest import random_bytes, run_cli, start_server

#: These measure this machine (``-m "not measures"`` leaves them out).
pytestmark = pytest.mark.measures

#: Short limits, so that each test takes seconds (pdiffcopy/server/guard.py reads them).
LIMITS = {
    "PDIFFCOPY_HEADER_TIMEOUT": "1",
    "PDIFFCOPY_STALL_GRACE": "1",
    "PDIFFCOPY_MIN_RATE": str(4 * 1024 * 1024),
}

#: Seconds after the attack started by which the server must have closed
#: every hostile connection: the 1 s limits, the event loop's 1 s tick, and
#: slack for a busy 2-CPU machine.
CLOSE_BOUND = 6.0

#: Seconds a normal request may take while an attack goes on (it takes
#: milliseconds when the server is well; unguarded, it waits forever).
SERVE_BOUND = 5.0

#: Size of the file the slow readers ask for: more than the kernel's socket
#: buffers on both sides hold, so that the server's writes block.
BIG_FILE = 24 * 1024 * 1024


@pytest.fixture(params=["root", "export"])
def guarded(tmp_path, monkeypatch, request):
    """A --root server, or one with --config whose export (with a max_connections count each
    request enters) serves the same files at /e/...: ``server.prefix``."""
    for name, value in LIMITS.items():
        monkeypatch.setenv(name, value)
    root = tmp_path / "root"
    root.mkdir()
    (root / "small.img").write_bytes(random_bytes(100000))
    if request.param == "root":
        server = start_server(root, tmp_path / "server.log")
        server.prefix = ""
    else:
        config = tmp_path / "exports.toml"
        config.write_text(f'[export.e]\npath = "{root}"\nread_only = false\nmax_connections = 60\n')
        server = start_server(None, tmp_path / "server.log", extra=("--config", str(config)))
        server.root, server.prefix = root, "/e"
    yield server
    server.stop()


def connect(port: int, receive_buffer: int = 0) -> socket.socket:
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    return sock


def assert_served(server, tls_context=None) -> None:
    """A normal GET is answered, completely, within :data:`SERVE_BOUND` seconds."""
    if tls_context is None:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=SERVE_BOUND)
    else:
        connection = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=SERVE_BOUND,
                                                 context=tls_context)
    try:
        connection.request("GET", f"{getattr(server, 'prefix', '')}/small.img")
        response = connection.getresponse()
        assert response.status == 200
        assert response.read() == (server.root / "small.img").read_bytes()
    except (socket.timeout, TimeoutError):
        pytest.fail(f"a normal request was not served within {SERVE_BOUND} s during the attack")
    finally:
        connection.close()


def assert_closed(socks: List[socket.socket], started: float, limit: int = 1 << 40) -> None:
    """The server closed each socket by ``started + CLOSE_BOUND`` (after sending at most ``limit`` bytes)."""
    for sock in socks:
        received = 0
        try:
            while True:
                remaining = started + CLOSE_BOUND - time.monotonic()
                if remaining <= 0:
                    pytest.fail(f"a hostile connection was still open after {CLOSE_BOUND} s")
                sock.settimeout(remaining)
                data = sock.recv(1 << 20)
                if not data:
                    break
                received += len(data)
        except ConnectionResetError:
            pass
        except (socket.timeout, TimeoutError):
            pytest.fail(f"a hostile connection was still open after {CLOSE_BOUND} s")
        finally:
            sock.close()
        assert received < limit, "the server sent a slow reader the whole answer"


def test_one_byte_connections_neither_stop_the_server_nor_stay_open(guarded, tmp_path):
    started = time.monotonic()
    socks = [connect(guarded.port) for _ in range(64)]
    for sock in socks:
        sock.sendall(b"G")
    assert_served(guarded)
    completed = run_cli(f"{guarded.base}{guarded.prefix}/small.img", str(tmp_path / "copy.img"), "--no-progress",
                        "--timeout", str(SERVE_BOUND), timeout=3 * SERVE_BOUND)
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "copy.img").read_bytes() == (guarded.root / "small.img").read_bytes()
    assert_closed(socks, started)


def test_one_byte_on_kept_alive_connections_is_cut_off(guarded):
    started = time.monotonic()
    socks = [connect(guarded.port) for _ in range(48)]
    for sock in socks:  # one whole request and answer first (the token check would pass here)
        sock.sendall(b"GET /.pdiffcopy/version HTTP/1.1\r\nHost: x\r\n\r\n")
    for sock in socks:
        sock.settimeout(SERVE_BOUND)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"G")
    assert_served(guarded)
    assert_closed(socks, started)


def test_silent_connections_neither_stall_the_server_nor_stay_open(guarded):
    started = time.monotonic()
    socks = [connect(guarded.port) for _ in range(128)]
    time.sleep(0.2)  # all accepted and waiting
    assert_served(guarded)
    assert_closed(socks, started)


def test_a_request_line_trickled_byte_by_byte_is_cut_off(guarded):
    started = time.monotonic()
    socks = [connect(guarded.port) for _ in range(48)]
    request = b"GET %s/small.img HTTP/1.1\r\nHost: x\r\n" % guarded.prefix.encode()
    for byte in range(4):  # slowloris: a byte now and then, never the blank line
        for sock in socks:
            sock.sendall(request[byte:byte + 1])
        time.sleep(0.1)
    assert_served(guarded)
    assert_closed(socks, started)


def test_slow_readers_of_a_ranged_get_are_cut_off(guarded):
    (guarded.root / "big.img").write_bytes(random_bytes(BIG_FILE))
    started = time.monotonic()
    socks = [connect(guarded.port, receive_buffer=4096) for _ in range(48)]
    for sock in socks:
        sock.sendall(b"GET %s/big.img HTTP/1.1\r\nHost: x\r\nRange: bytes=0-\r\n\r\n" % guarded.prefix.encode())
    time.sleep(0.5)  # the server's writes fill the buffers and block; nobody reads
    assert_served(guarded)
    # Reading now would make a slow reader of the attacker, whom the server
    # then (rightly) keeps serving: look only after the limits ran out.
    time.sleep(max(0.0, started + CLOSE_BOUND / 2 - time.monotonic()))
    assert_closed(socks, started, limit=BIG_FILE)


@pytest.mark.parametrize("kind", ["patch", "tree-write", "json"])
def test_trickled_bodies_are_cut_off(guarded, kind):
    prefix = guarded.prefix.encode()
    heads = {
        "patch": b"PATCH %s/target.img HTTP/1.1\r\nHost: x\r\nContent-Range: bytes 0-1048575/*\r\n"
                 b"Content-Type: application/octet-stream\r\nContent-Length: 1048576\r\n\r\n",
        "tree-write": b"POST /.pdiffcopy/tree-write%s/ HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
        "json": b"POST /.pdiffcopy/tree-read%s/ HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
    }
    heads = {name: head % prefix for name, head in heads.items()}
    (guarded.root / "target.img").write_bytes(bytes(2 * 1024 * 1024))
    trickle = {"patch": b"x", "tree-write": b"1\r\nx\r\n", "json": b" "}
    started = time.monotonic()
    socks = [connect(guarded.port) for _ in range(48)]
    for sock in socks:
        sock.sendall(heads[kind])
    for _ in range(5):
        for sock in socks:
            try:
                sock.sendall(trickle[kind])
            except OSError:
                pass  # already cut off
        time.sleep(0.2)
    assert_served(guarded)
    assert_closed(socks, started)
    if guarded.prefix:  # the export answers after the attack (each cut request left its count)
        answered = [http_status(guarded, f"{guarded.prefix}/small.img") for _ in range(3)]
        assert answered == [200] * 3


def http_status(server, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=SERVE_BOUND)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_one_byte_tls_handshakes_do_not_stop_an_https_server(tmp_path, monkeypatch):
    for name, value in LIMITS.items():
        monkeypatch.setenv(name, value)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    root = tmp_path / "root"
    root.mkdir()
    (root / "small.img").write_bytes(random_bytes(100000))
    server = start_server(root, tmp_path / "server.log", extra=(
        "--certfile", str(tmp_path / "cert.pem"), "--keyfile", str(tmp_path / "key.pem")))
    try:
        started = time.monotonic()
        socks = [connect(server.port) for _ in range(64)]
        for sock in socks:
            sock.sendall(b"\x16")  # the first byte of a TLS record, then nothing
        assert_served(server, ssl.create_default_context(cafile=str(tmp_path / "cert.pem")))
        assert_closed(socks, started)
    finally:
        server.stop()

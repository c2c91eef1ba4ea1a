"""Prometheus metrics: GET /.pdiffcopy/metrics behind the token, --metrics-listen without it.

Real servers with several worker processes: the counters must add up over
all of them, their labels must not grow with the paths clients ask for, and
the directory of the per-process files must go when the server stops.
"""

from __future__ import annotations

import glob
import hashlib
import http.client
import os
import re
import signal
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Optional

import pytest
from conftest import free_port, http_get, random_bytes, run_cli, start_server

from pdiffcopy.server.metrics import DIRECTORY_PREFIX, METRICS_PATH

TOKEN = "metrics-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

#: Seconds a test waits for requests to have landed on both worker processes.
SPREAD_TIMEOUT = 10.0

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse(text: str) -> Dict[str, float]:
    """``{'name{labels}': value}`` of a text exposition (comments left out).

    The ``export`` label of the --root shorthand (empty, which Prometheus reads as no label)
    is left out of the keys, as a query would see them.
    """
    samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = (match.group(2) or "").replace(',export=""', "").replace('export=""', "").replace("{}", "")
            samples[match.group(1) + labels] = float(match.group(3))
    return samples


def scrape(base: str, headers=None) -> Dict[str, float]:
    status, _, body = http_get(base + METRICS_PATH, headers or AUTH)
    assert status == 200, body
    return parse(body.decode())


def metrics_directory(pid: int) -> Optional[str]:
    """The metrics directory of the server whose main process is ``pid``, if any."""
    for parent in ("/dev/shm", tempfile.gettempdir()):
        found = glob.glob(os.path.join(parent, f"{DIRECTORY_PREFIX}{pid}-*"))
        if found:
            return found[0]
    return None


def worker_pids_counted(directory: str, master: int) -> set:
    """The worker processes that have written counters (one file per process)."""
    pids = {int(m.group(1)) for name in os.listdir(directory)
            if (m := re.fullmatch(r"counter_([0-9]+)\.db", name))}
    return pids - {master}


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory):
    """Two workers, a token, and a metrics address of its own."""
    root = tmp_path_factory.mktemp("metrics-root")
    log = tmp_path_factory.mktemp("metrics-log") / "server.log"
    metrics_port = free_port()
    running = start_server(root, log, token=TOKEN,
                           extra=("--metrics-listen", f"127.0.0.1:{metrics_port}"))
    running.metrics_port = metrics_port
    yield running
    running.stop()


def get_on_new_connection(url: str) -> int:
    """GET on a connection of its own (so that any worker may accept it); the bytes read."""
    request = urllib.request.Request(url, headers={**AUTH, "Connection": "close"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return len(response.read())


def test_counters_add_up_over_worker_processes(metrics_server):
    data = random_bytes(100_000, seed=5)
    (metrics_server.root / "counted.bin").write_bytes(data)
    directory = metrics_directory(metrics_server.process.pid)
    assert directory and os.path.isdir(directory)
    before = scrape(metrics_server.base)
    sent = 0
    deadline = time.monotonic() + SPREAD_TIMEOUT
    with ThreadPoolExecutor(8) as pool:
        # Concurrent requests on fresh connections, until both workers have answered some.
        while len(worker_pids_counted(directory, metrics_server.process.pid)) < 2:
            assert time.monotonic() < deadline, "the requests never reached both workers"
            moved = list(pool.map(get_on_new_connection, [metrics_server.url("counted.bin")] * 16))
            assert moved == [len(data)] * 16
            sent += 16
    # A push of two ranges: file bytes received.
    connection = http.client.HTTPConnection("127.0.0.1", metrics_server.port, timeout=30)
    connection.request("PATCH", "/counted.bin", body=b"x" * 1000,
                       headers={**AUTH, "Content-Range": "bytes 0-999/100000"})
    assert connection.getresponse().status == 200
    connection.close()
    after = scrape(metrics_server.base)
    key = 'pdiffcopy_requests_total{endpoint="read_file",status="200"}'
    assert after[key] - before.get(key, 0) == sent
    assert after["pdiffcopy_served_bytes_total"] - before.get("pdiffcopy_served_bytes_total", 0) == sent * len(data)
    assert after["pdiffcopy_received_bytes_total"] - before.get("pdiffcopy_received_bytes_total", 0) == 1000
    assert after['pdiffcopy_requests_total{endpoint="write_ranges",status="200"}'] >= 1
    assert after["pdiffcopy_hash_jobs_running"] == 0


def test_metrics_need_the_token(metrics_server):
    status, headers, body = http_get(metrics_server.base + METRICS_PATH)
    assert status == 401
    assert b"pdiffcopy_requests_total" not in body
    status, headers, body = http_get(metrics_server.base + METRICS_PATH, {"Authorization": "Bearer wrong"})
    assert status == 401
    status, headers, body = http_get(metrics_server.base + METRICS_PATH, AUTH)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b"# TYPE pdiffcopy_requests_total counter" in body
    counts = scrape(metrics_server.base)
    assert counts['pdiffcopy_requests_total{endpoint="metrics",status="401"}'] >= 2


def test_metrics_listen_answers_without_the_token_and_only_metrics(metrics_server):
    (metrics_server.root / "secret.txt").write_bytes(b"not for the metrics address")
    base = f"http://127.0.0.1:{metrics_server.metrics_port}"
    for path in ("/metrics", METRICS_PATH):
        status, headers, body = http_get(base + path)
        assert status == 200, body
        assert headers["Content-Type"].startswith("text/plain")
        assert "pdiffcopy_served_bytes_total" in parse(body.decode())
    # Files and every other endpoint stay on the main address, behind the token.
    for path in ("/secret.txt", "/.pdiffcopy/stat/secret.txt", "/.pdiffcopy/version"):
        status, _, body = http_get(base + path, AUTH)
        assert status == 404, (path, body)
        assert b"not for the metrics" not in body
    status, _, _ = http_get(metrics_server.url("secret.txt"))
    assert status == 401


def test_label_values_stay_few_whatever_paths_clients_ask_for(metrics_server):
    names = [f"nowhere-{index}-{os.urandom(4).hex()}" for index in range(40)]
    for name in names:
        assert http_get(metrics_server.url(name), AUTH)[0] == 404
        connection = http.client.HTTPConnection("127.0.0.1", metrics_server.port, timeout=30)
        connection.request("POST", f"/{name}", headers=AUTH)  # no such route: 405
        response = connection.getresponse()
        response.read()
        assert response.status == 405
        connection.request("BREW", f"/.pdiffcopy/{name}", headers=AUTH)
        connection.getresponse().read()
        connection.close()
    status, _, body = http_get(metrics_server.base + METRICS_PATH, AUTH)
    text = body.decode()
    assert not any(name in text for name in names)
    endpoints = set(re.findall(r'pdiffcopy_requests_total\{endpoint="([^"]*)"', text))
    assert "unmatched" in endpoints and "read_file" in endpoints
    # Only the names of views (and "unmatched"): a few dozen at most, not one per path.
    assert all(re.fullmatch(r"[a-z_]+", endpoint) for endpoint in endpoints), endpoints
    series = [line for line in text.splitlines() if line.startswith("pdiffcopy_requests_total{")]
    assert len(series) < 40, series


def test_busy_refusals_and_running_hash_jobs_are_counted(tmp_path):
    """One worker, one client, hash requests of over half a second each: beyond its slots, 503s."""
    started = time.monotonic()
    hashlib.new("sha3_512", bytes(8 << 20)).digest()
    rate = (8 << 20) / max(time.monotonic() - started, 1e-6)  # sha3_512, bytes per second here
    size = min(1 << 30, max(8 << 20, int(rate * 0.6) >> 20 << 20))  # over half a second of hashing
    root = tmp_path / "root"
    root.mkdir()
    # Data, not a hole: a block in a hole hashes as zeros without being read (issue 19).
    with open(root / "zeros.img", "wb") as handle:
        chunk = bytes(8 << 20)
        for _ in range(size // len(chunk)):
            handle.write(chunk)
    server = start_server(root, tmp_path / "server.log", extra=("-c", "1", "--hash-methods", "all"))
    try:
        query = f"/.pdiffcopy/hashes/zeros.img?method=sha3_512&block_size=1048576&offset=0&length={size}"

        def ask() -> int:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            connection.request("GET", query)
            status = connection.getresponse().status
            connection.close()
            return status

        running = []

        def watch() -> None:
            time.sleep(0.3)
            running.append(scrape(server.base, {})["pdiffcopy_hash_jobs_running"])

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(6) as pool:
            statuses = list(pool.map(lambda _: ask(), range(6)))
        watcher.join()
        refused = statuses.count(503)
        assert refused >= 1 and statuses.count(200) >= 1, statuses
        assert running and running[0] >= 1
        after = scrape(server.base, {})
        assert after["pdiffcopy_busy_refusals_total"] == refused
        assert after['pdiffcopy_requests_total{endpoint="hashes",status="503"}'] == refused
        assert after["pdiffcopy_hash_jobs_running"] == 0
    finally:
        server.stop()


def test_metrics_directory_is_removed_when_the_server_stops(tmp_path):
    server = start_server(tmp_path, tmp_path.parent / f"{tmp_path.name}.log")
    try:
        assert http_get(server.url("missing"))[0] == 404  # a worker writes its counters
        directory = metrics_directory(server.process.pid)
        assert directory and any(Path(directory).iterdir())
    finally:
        assert server.stop() == 0
    assert not os.path.exists(directory)


def test_the_metrics_directory_of_a_killed_server_is_removed_by_the_next(tmp_path):
    killed = start_server(tmp_path, tmp_path.parent / f"{tmp_path.name}-killed.log")
    directory = metrics_directory(killed.process.pid)
    assert directory and os.path.isdir(directory)
    os.killpg(killed.process.pid, signal.SIGKILL)  # no atexit: the directory stays
    killed.process.wait()
    assert os.path.isdir(directory)
    successor = start_server(tmp_path, tmp_path.parent / f"{tmp_path.name}-next.log")
    try:
        assert not os.path.exists(directory)
    finally:
        successor.stop()


@pytest.mark.parametrize("args, message", [
    (("--metrics-listen", "9100", "a", "b"), "--metrics-listen is a server option"),
    (("--metrics-listen", "127.0.0.1:0"), "--metrics-listen needs a port of its own"),
    (("--metrics-listen", "nonsense:port"), "Invalid listen address"),
])
def test_a_wrong_metrics_listen_is_one_line_and_the_usage_status(tmp_path, args, message):
    server = () if "a" in args else ("--root", str(tmp_path), "--listen", f"127.0.0.1:{free_port()}")
    result = run_cli(*server, *args, timeout=30)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr

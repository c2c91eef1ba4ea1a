"""The server's transfer log (docs/exports.rst, "The transfer log") and its metrics by export.

A real server with ``--config`` and ``--log-format json``: every sync leaves one line, whose
bytes are checked against the files on disk; a refused sync, a killed client and a text log
are tried too.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import http_get, mutate, one_line_error, pdiffcopy_command, random_bytes, run_cli, start_server

TOKENS = {"ops": "ops-token-for-the-log", "reader": "reader-token-for-the-log"}
BLOCK = 1 << 20


def token_line(name: str) -> str:
    return f'"{name}:sha256:{hashlib.sha256(TOKENS[name].encode()).hexdigest()}"'


def config_of(vms: Path, golden: Path) -> str:
    return (f'[export.vms]\npath = "{vms}"\nread_only = false\ntokens = [{token_line("ops")}]\n\n'
            f'[export.golden]\npath = "{golden}"\ntokens = [{token_line("reader")}]\n')


def transfers(log: Path) -> List[Dict]:
    """The transfer lines of a JSON log; every line of it must be JSON."""
    found = []
    for line in log.read_text().splitlines():
        record = json.loads(line)  # gunicorn's lines too
        assert {"time", "level", "logger", "message"} <= set(record), record
        if record.get("event") == "transfer":
            found.append(record)
    return sorted(found, key=lambda record: record["started"])  # (written as each is over)


def wait_for_transfers(log: Path, count: int, timeout: float = 20) -> List[Dict]:
    deadline = time.monotonic() + timeout
    while len(found := transfers(log)) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} transfer lines: {log.read_text()[-3000:]}"
        time.sleep(0.1)
    time.sleep(1.5)  # (and no more come)
    return transfers(log)


@pytest.fixture
def logged(tmp_path):
    vms, golden = tmp_path / "vms", tmp_path / "golden"
    vms.mkdir()
    golden.mkdir()
    config = tmp_path / "exports.toml"
    config.write_text(config_of(vms, golden))
    log = tmp_path / "server.log"
    server = start_server(None, log, extra=("--config", str(config), "--log-format", "json"))
    yield server, vms, golden, log
    server.stop()


def test_one_line_per_sync_with_the_bytes_on_disk(logged, tmp_path):
    server, vms, golden, log = logged
    base = f"http://127.0.0.1:{server.port}"
    ops, reader = {"PDIFFCOPY_TOKEN": TOKENS["ops"]}, {"PDIFFCOPY_TOKEN": TOKENS["reader"]}
    data = random_bytes(8 * BLOCK, seed=4)
    (tmp_path / "disk.img").write_bytes(data)
    # A new file pushed whole, then one changed block pushed again.
    assert run_cli(str(tmp_path / "disk.img"), f"{base}/vms/disk.img", env_extra=ops).returncode == 0
    changed = mutate(data, [3 * BLOCK + 10])
    (tmp_path / "disk.img").write_bytes(changed)
    again = run_cli("--json", "-b", str(BLOCK), str(tmp_path / "disk.img"), f"{base}/vms/disk.img", env_extra=ops)
    assert again.returncode == 0, again.stderr
    said = json.loads(again.stdout.splitlines()[-1])
    # A pull from the read-only export, and a tree pushed.
    (golden / "base.img").write_bytes(data[: 3 * BLOCK])
    assert run_cli(f"{base}/golden/base.img", str(tmp_path / "pulled.img"), env_extra=reader).returncode == 0
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "a.txt").write_bytes(b"a" * 1000)
    (tmp_path / "tree" / "b.txt").write_bytes(b"b" * 234)
    assert run_cli(f"{tmp_path / 'tree'}/", f"{base}/vms/tree/", env_extra=ops).returncode == 0
    lines = wait_for_transfers(log, 4)
    assert len(lines) == 4, lines
    first, second, pull, tree = lines
    assert (vms / "disk.img").read_bytes() == changed
    assert {key: first[key] for key in ("export", "token", "client", "path", "direction", "result")} == {
        "export": "vms", "token": "ops", "client": "127.0.0.1", "path": "disk.img", "direction": "push",
        "result": "ok"}
    assert first["moved_bytes"] == len(data)  # the whole file, and nothing more
    assert second["path"] == "disk.img" and second["direction"] == "push" and second["result"] == "ok"
    assert 0 < second["moved_bytes"] == said["bytes_moved"] <= BLOCK  # the one block that differed, or less
    assert second["compared_bytes"] >= len(data)  # (every block hashed; and read back)
    assert {key: pull[key] for key in ("export", "token", "path", "direction", "result", "moved_bytes")} == {
        "export": "golden", "token": "reader", "path": "base.img", "direction": "pull", "result": "ok",
        "moved_bytes": os.path.getsize(tmp_path / "pulled.img")}
    assert tree["path"] == "tree" and tree["direction"] == "push" and tree["result"] == "ok"
    assert tree["moved_bytes"] == 1234 == sum(os.path.getsize(path) for path in (vms / "tree").rglob("*.txt"))
    assert all(line["seconds"] >= 0 and line["requests"] >= 1 for line in lines)
    # The metrics, by export, say the same.
    status, _, body = http_get(f"{base}/.pdiffcopy/metrics", {"Authorization": f"Bearer {TOKENS['ops']}"})
    assert status == 200
    samples = dict(re.findall(r'^(pdiffcopy_\w+\{[^}]*\}) (\S+)$', body.decode(), re.MULTILINE))
    assert float(samples['pdiffcopy_served_bytes_total{export="golden"}']) == pull["moved_bytes"]
    assert float(samples['pdiffcopy_received_bytes_total{export="vms"}']) == len(data) + said["bytes_moved"] + 1234
    assert float(samples['pdiffcopy_requests_total{endpoint="hashes",export="vms",status="200"}']) >= 1, samples


def test_a_refused_sync_is_logged_failed_with_its_status(logged, tmp_path):
    server, vms, golden, log = logged
    (tmp_path / "new.img").write_bytes(random_bytes(100_000, seed=2))
    done = run_cli(str(tmp_path / "new.img"), f"http://127.0.0.1:{server.port}/golden/new.img",
                   env_extra={"PDIFFCOPY_TOKEN": TOKENS["reader"]})
    assert "read-only" in one_line_error(done)
    [line] = wait_for_transfers(log, 1)
    assert (line["export"], line["token"], line["path"], line["direction"]) == ("golden", "reader", "new.img", "push")
    assert line["result"] == "failed" and line["status"] == 403 and line["moved_bytes"] == 0
    assert not os.path.exists(golden / "new.img")


def test_a_killed_client_and_a_client_that_never_says_are_logged_when_the_server_stops(logged, tmp_path):
    server, vms, golden, log = logged
    source = tmp_path / "big.img"
    source.write_bytes(random_bytes(64 * BLOCK, seed=6))
    push = subprocess.Popen(pdiffcopy_command("--bwlimit", "8M", str(source),
                                              f"http://127.0.0.1:{server.port}/vms/big.img"),
                            env=dict(os.environ, PDIFFCOPY_TOKEN=TOKENS["ops"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not any(name.startswith(".big.img.pdiffcopy-") for name in os.listdir(vms)):
        assert push.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(2)  # (some 16 MiB on their way)
    push.send_signal(signal.SIGKILL)
    push.wait()
    (golden / "plain.img").write_bytes(b"p" * 5000)
    status, _, body = http_get(f"http://127.0.0.1:{server.port}/golden/plain.img",
                               {"Authorization": f"Bearer {TOKENS['reader']}"})  # (curl: no sync, no end)
    assert status == 200 and body == b"p" * 5000
    time.sleep(2)
    assert transfers(log) == []  # (neither is over: their clients said nothing)
    server.stop()
    killed, plain = sorted(transfers(log), key=lambda line: line["path"])
    # The write the kill cut is the transfer's status; what arrived before it is counted.
    assert killed["path"] == "big.img" and killed["result"] == "failed" and killed["status"] == 400, killed["message"]
    assert BLOCK <= killed["moved_bytes"] < 64 * BLOCK
    assert plain["path"] == "plain.img" and plain["result"] == "unfinished" and plain["moved_bytes"] == 5000


def test_the_text_log_has_the_same_fields(tmp_path):
    vms = tmp_path / "vms"
    vms.mkdir()
    (vms / "odd name.img").write_bytes(random_bytes(50_000, seed=3))
    config = tmp_path / "exports.toml"
    config.write_text(f'[export.vms]\npath = "{vms}"\ntokens = [{token_line("ops")}]\n')
    log = tmp_path / "server.log"
    server = start_server(None, log, extra=("--config", str(config)))
    try:
        done = run_cli(f"http://127.0.0.1:{server.port}/vms/odd%20name.img", str(tmp_path / "copy.img"),
                       env_extra={"PDIFFCOPY_TOKEN": TOKENS["ops"]})
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 20
        while "Transfer " not in log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        server.stop()
    [line] = [line for line in log.read_text().splitlines() if " Transfer " in line]
    fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line.partition(" Transfer ")[2]))
    assert fields["export"] == "vms" and fields["token"] == "ops" and fields["client"] == "127.0.0.1"
    assert json.loads(fields["path"]) == "odd name.img"  # quoted: a space stays inside one field
    assert fields["direction"] == "pull" and fields["result"] == "ok" and int(fields["moved_bytes"]) == 50_000


def test_log_format_is_a_server_option(tmp_path):
    (tmp_path / "a").write_bytes(b"a")
    done = run_cli("--log-format", "json", str(tmp_path / "a"), str(tmp_path / "b"))
    assert "--log-format is a server option" in one_line_error(done)


def test_a_sync_id_that_is_no_id_is_not_echoed_and_changes_nothing(logged):
    server, vms, golden, log = logged
    (golden / "x.img").write_bytes(b"x" * 100)
    for sync in ("a" * 65, "../../etc", "a b", "x\u00e9"):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.putrequest("GET", "/golden/x.img")
        connection.putheader("Authorization", f"Bearer {TOKENS['reader']}")
        connection.putheader("X-Pdiffcopy-Sync", sync.encode("utf-8"))
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 200 and response.read() == b"x" * 100
        assert response.getheader("X-Pdiffcopy-Sync") is None, sync
        connection.close()
    good = "0123456789abcdef"
    status, headers, _ = http_get(f"http://127.0.0.1:{server.port}/golden/x.img",
                                  {"Authorization": f"Bearer {TOKENS['reader']}", "X-Pdiffcopy-Sync": good})
    assert status == 200 and headers.get("X-Pdiffcopy-Sync") == good

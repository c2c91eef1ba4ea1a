"""Reloading a server's exports on SIGHUP (docs/exports.rst, "Reloading").

A real server with ``--config``: a reload during a 1 GiB push lets it finish under the rules
it started with and applies the new ones to the next request; a broken file is refused in
one line and the server keeps serving under the old one; a ticket names a generation only
for the token and address it was given to.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

from conftest import one_line_error, pdiffcopy_command, random_bytes, run_cli, start_server

TOKENS = {"ops": "ops-token-of-the-vms", "newops": "the-next-ops-token", "reader": "a-reader-token"}
RULES_HEADER = "X-Pdiffcopy-Rules"


def token_line(name: str) -> str:
    return f'"{name}:sha256:{hashlib.sha256(TOKENS[name].encode()).hexdigest()}"'


def export(name: str, path: Path, tokens=("ops",), read_only: bool = False) -> str:
    listed = ", ".join(token_line(token) for token in tokens)
    return f'[export.{name}]\npath = "{path}"\nread_only = {str(read_only).lower()}\ntokens = [{listed}]\n'


class ReloadingServer:
    def __init__(self, base: Path, first_config: str) -> None:
        self.base = base
        self.config = base / "exports.toml"
        self.config.write_text(first_config)
        self.log = base / "server.log"
        self.server = start_server(None, self.log, extra=("--config", str(self.config)))
        self.port = self.server.port

    def reload(self, config: str, expect: str) -> None:
        """Write ``config``, send SIGHUP and wait for the server to log ``expect``."""
        seen = self.log.read_text().count(expect)
        self.config.write_text(config)
        os.kill(self.server.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while self.log.read_text().count(expect) == seen:
            assert time.monotonic() < deadline, f"no {expect!r} in {self.log.read_text()[-2000:]}"
            time.sleep(0.05)

    def request(self, method: str, path: str, token: Optional[str] = None, body: bytes = b"",
                headers: Optional[Dict[str, str]] = None) -> Tuple[int, bytes, http.client.HTTPMessage]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            sent = dict(headers or {})
            if token is not None:
                sent["Authorization"] = f"Bearer {TOKENS[token]}"
            connection.request(method, path, body=body or None, headers=sent)
            response = connection.getresponse()
            return response.status, response.read(), response.headers
        finally:
            connection.close()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def directories(tmp_path):
    vms, golden = tmp_path / "vms", tmp_path / "golden"
    for directory in (vms, golden):
        directory.mkdir()
        (directory / "small.img").write_bytes(random_bytes(100_000, seed=len(directory.name)))
    return vms, golden


def write_random_file(path: Path, size: int) -> str:
    """A file of random bytes (no block like another: nothing compresses); its SHA-256."""
    digest = hashlib.sha256()
    generator = random.Random(7)
    with open(path, "wb") as handle:
        for _ in range(size // (64 << 20)):
            chunk = generator.randbytes(64 << 20)
            digest.update(chunk)
            handle.write(chunk)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(16 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def test_a_reload_during_a_push_lets_it_finish_then_applies_the_new_rules(directories, tmp_path):
    """The 1 GiB push (with --bwlimit) started under rules that let ``ops`` write; the reload
    makes the export read-only and replaces the token. The push ends whole; the next
    request is refused."""
    vms, golden = directories
    source = tmp_path / "big.img"
    expected = write_random_file(source, 1 << 30)
    running = ReloadingServer(tmp_path, export("vms", vms) + export("golden", golden, ("reader",), True))
    try:
        environment = dict(os.environ, PDIFFCOPY_TOKEN=TOKENS["ops"])
        push = subprocess.Popen(pdiffcopy_command("--bwlimit", "120M", str(source),
                                                  f"http://127.0.0.1:{running.port}/vms/big.img"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
        deadline = time.monotonic() + 60
        while not any(name.startswith(".big.img.pdiffcopy-") and os.path.getsize(vms / name) > (64 << 20)
                      for name in os.listdir(vms)):
            assert push.poll() is None, push.communicate()
            assert time.monotonic() < deadline, "the push did not start writing"
            time.sleep(0.05)
        running.reload(export("vms", vms, ("newops",), read_only=True) + export("golden", golden, ("reader",), True),
                       "Reloaded")
        assert push.poll() is None, "the push ended before the reload: nothing was tested"
        _, stderr = push.communicate(timeout=300)
        assert push.returncode == 0, stderr.decode()
        assert file_digest(vms / "big.img") == expected
        # The next sync, and every request without the old rules' ticket, gets the new rules.
        done = run_cli(str(tmp_path / "big.img"), f"http://127.0.0.1:{running.port}/vms/again.img",
                       env_extra={"PDIFFCOPY_TOKEN": TOKENS["ops"]})
        assert done.returncode != 0 and "Missing or wrong token" in one_line_error(done), done.stderr
        status, body, _ = running.request("PATCH", "/vms/small.img", "newops", b"x")
        assert status == 403 and b"read-only" in body
        assert running.request("GET", "/.pdiffcopy/stat/vms/small.img", "newops")[0] == 200
        assert not os.path.exists(vms / "again.img")
        assert (vms / "small.img").read_bytes() == random_bytes(100_000, seed=len("vms"))
    finally:
        running.stop()


def test_a_broken_config_is_refused_in_one_line_and_the_old_one_stays(directories, tmp_path):
    vms, golden = directories
    first = export("vms", vms) + export("golden", golden, ("reader",), True)
    running = ReloadingServer(tmp_path, first)
    try:
        for broken, message in [("[export.vms\n", "not valid TOML"),
                                (export("vms", tmp_path / "missing"), "does not exist"),
                                (export("vms", vms).replace("tokens", "tokenz"), "unknown key 'tokenz'")]:
            running.reload(broken, "Reload refused")
            refusal = [line for line in running.log.read_text().splitlines() if "Reload refused" in line][-1]
            assert message in refusal and "Traceback" not in running.log.read_text()
            # Still the first file's rules: ops writes vms, reader reads golden.
            status, _, _ = running.request("PATCH", "/vms/small.img", "ops", b"same",
                                           headers={"Content-Range": "bytes 0-3/*"})
            assert status in (200, 204), status
            assert (vms / "small.img").read_bytes()[:4] == b"same"
            assert running.request("GET", "/golden/small.img", "reader")[0] == 200
        assert running.server.process.poll() is None
    finally:
        running.stop()


def test_a_reload_adds_and_removes_exports(directories, tmp_path):
    vms, golden = directories
    running = ReloadingServer(tmp_path, export("vms", vms))
    try:
        assert running.request("GET", "/golden/small.img", "reader")[0] in (401, 404)
        running.reload(export("golden", golden, ("reader",), True), "Reloaded")
        status, body, _ = running.request("GET", "/golden/small.img", "reader")
        assert status == 200 and body == (golden / "small.img").read_bytes()
        status, body, _ = running.request("GET", "/vms/small.img", "ops")
        assert status == 401, (status, body)  # ops opens nothing any more
        status, body, _ = running.request("GET", "/", "reader")
        assert json.loads(body)["exports"] == ["golden"]
    finally:
        running.stop()


def test_a_ticket_keeps_only_its_own_tokens_rules(directories, tmp_path):
    """A sync in flight keeps its rules by the ticket of its first answer; the ticket of one
    token, forged or replayed with another, buys nothing."""
    vms, golden = directories
    running = ReloadingServer(tmp_path, export("vms", vms, ("ops", "reader")))
    try:
        _, _, headers = running.request("GET", "/.pdiffcopy/stat/vms/small.img", "ops")
        ops_ticket = headers[RULES_HEADER]
        _, _, headers = running.request("GET", "/.pdiffcopy/stat/vms/small.img", "reader")
        reader_ticket = headers[RULES_HEADER]
        assert ops_ticket.startswith("1.") and ops_ticket != reader_ticket
        running.reload(export("vms", vms, ("newops",)), "Reloaded")
        stat = "/.pdiffcopy/stat/vms/small.img"
        # ops's sync in flight goes on; a new one (no ticket) is refused.
        assert running.request("GET", stat, "ops", headers={RULES_HEADER: ops_ticket})[0] == 200
        assert running.request("GET", stat, "ops")[0] == 401
        # reader's ticket does not serve ops, nor a forged one, nor a changed generation.
        for ticket in (reader_ticket, "1." + "0" * 32, "0" + ops_ticket, ops_ticket.replace("1.", "2.", 1)):
            assert running.request("GET", stat, "ops", headers={RULES_HEADER: ticket})[0] == 401, ticket
        _, _, headers = running.request("GET", stat, "newops")
        assert headers[RULES_HEADER].startswith("2.")
    finally:
        running.stop()


def children(pid: int):
    return sorted(subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split())


def test_sighup_without_config_changes_nothing(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.bin").write_bytes(b"a" * 1000)
    server = start_server(root, tmp_path / "server.log")
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("GET", "/a.bin")
        assert connection.getresponse().read() == b"a" * 1000
        deadline = time.monotonic() + 20
        while len(worker_pids := children(server.process.pid)) < 2:  # (-c 2: two workers)
            assert time.monotonic() < deadline, worker_pids
            time.sleep(0.05)
        os.kill(server.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "nothing to reload" not in (tmp_path / "server.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # The same workers, and the kept-alive connection still answers.
        connection.request("GET", "/a.bin")
        assert connection.getresponse().read() == b"a" * 1000
        assert children(server.process.pid) == worker_pids
    finally:
        server.stop()

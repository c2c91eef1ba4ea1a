"""Small trust items: the token in the clear, /proc-like files."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from conftest import free_port, pdiffcopy_command, random_bytes, run_cli

TOKEN = "small-items-token"
WARNING = "over plain http"


def non_loopback_address():
    """An address of this host that is not loopback, or None (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.fixture
def public_server(tmp_path):
    """A server with a token on a non-loopback address of this host."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback address")
    port = free_port()
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ, PDIFFCOPY_TOKEN=TOKEN)
    with open(tmp_path / "server.log", "wb") as log:
        process = subprocess.Popen(pdiffcopy_command("--root", str(root), "--listen", f"{address}:{port}",
                                                     "-c", "1"),
                                   stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection((address, port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.skip(f"no server on {address}: {(tmp_path / 'server.log').read_text()}")
                time.sleep(0.05)
        yield root, f"http://{address}:{port}"
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_the_token_over_plain_http_to_another_host_is_warned_about_once(public_server, tmp_path):
    root, base = public_server
    source = tmp_path / "tree"
    for index in range(3):
        (source / f"d{index}").mkdir(parents=True)
        (source / f"d{index}" / "big.img").write_bytes(random_bytes(300000, index))
    completed = run_cli(str(source) + "/", f"{base}/tree", env_extra={"PDIFFCOPY_TOKEN": TOKEN})
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.count(WARNING) == 1, completed.stderr
    assert (root / "tree" / "d2" / "big.img").read_bytes() == random_bytes(300000, 2)
    completed = run_cli(f"{base}/tree/d1/big.img", str(tmp_path / "pulled.img"),
                        env_extra={"PDIFFCOPY_TOKEN": TOKEN})
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.count(WARNING) == 1, completed.stderr


def test_no_warning_without_a_token_or_on_loopback(token_server, tmp_path, unique):
    (token_server.root / unique).write_bytes(b"data")
    completed = run_cli(token_server.url(unique), str(tmp_path / "a"),
                        env_extra={"PDIFFCOPY_TOKEN": token_server.token})
    assert completed.returncode == 0, completed.stderr
    assert WARNING not in completed.stderr
    # Unreachable, but not loopback and no token: nothing to warn about either.
    completed = run_cli("--timeout", "1", "http://192.0.2.1:9/a", str(tmp_path / "b"))
    assert WARNING not in completed.stderr


def test_the_token_to_an_unreachable_other_host_is_warned_about_before_it_is_sent(tmp_path):
    completed = run_cli("--timeout", "1", "http://192.0.2.1:9/a", str(tmp_path / "b"),
                        env_extra={"PDIFFCOPY_TOKEN": TOKEN})
    assert completed.returncode in (10, 30)  # refused or unanswered: socket I/O or a timeout
    assert completed.stderr.count(WARNING) == 1, completed.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if " ERROR " in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("direction", ["local", "push"])
def test_a_proc_file_is_refused_not_copied_empty(server, tmp_path, unique, direction):
    target = tmp_path / "status" if direction == "local" else server.root / unique
    target_arg = str(target) if direction == "local" else server.url(unique)
    completed = run_cli("/proc/self/status", target_arg)
    assert completed.returncode == 3, completed.stderr
    assert "/proc/self/status" in one_error_line(completed.stderr)
    assert "0 bytes but has content" in completed.stderr
    assert not target.exists()


@pytest.mark.parametrize("direction", ["local", "push"])
def test_an_empty_file_is_still_synced(server, tmp_path, unique, direction):
    (tmp_path / "empty").write_bytes(b"")
    target = tmp_path / "copy" if direction == "local" else server.root / unique
    target_arg = str(target) if direction == "local" else server.url(unique)
    completed = run_cli(str(tmp_path / "empty"), target_arg)
    assert completed.returncode == 0, completed.stderr
    assert target.read_bytes() == b""

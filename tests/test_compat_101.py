"""Interop with the deployed pdiffcopy 1.0.1, and the behaviours its own test suite checks.

Part one starts the real 1.0.1 server (``benchmarks/setup_original.sh``
installs it into ``benchmarks/.venv-original``; ``$PDIFFCOPY_ORIGINAL`` names
another copy of its program) and checks that this client recognises it and
stops with one line, instead of calling an existing file missing.

Part two checks, through the command line and the HTTP API of this version and
with its URL form (paths below ``--root``), each behaviour that 1.0.1's
``pdiffcopy/tests.py`` checks: pull and push (whole, delta, nothing to move,
dry run), the benchmark mode, location parsing, ``python -m pdiffcopy``,
block hashes and the usage message. These are our own tests, not copies.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import free_port, random_bytes, run_cli

#: The 1.0.1 program: where benchmarks/setup_original.sh installs it, unless
#: $PDIFFCOPY_ORIGINAL says otherwise.
ORIGINAL_PROGRAM = Path(os.environ.get(
    "PDIFFCOPY_ORIGINAL",
    Path(__file__).resolve().parent.parent / "benchmarks" / ".venv-original" / "bin" / "pdiffcopy"))

#: How long the 1.0.1 server (gunicorn, one worker) may take to listen.
ORIGINAL_START_TIMEOUT = 20.0


@pytest.fixture(scope="module")
def original_server(tmp_path_factory):
    """A pdiffcopy 1.0.1 server on 127.0.0.1 and a free port: yields its base URL."""
    if not os.access(ORIGINAL_PROGRAM, os.X_OK):
        pytest.skip(f"pdiffcopy 1.0.1 is not installed at {ORIGINAL_PROGRAM} (benchmarks/setup_original.sh)")
    port = free_port()
    log = tmp_path_factory.mktemp("original-log") / "server.log"
    # Without our PYTHONPATH: 1.0.1 must import its own package, not this one.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PDIFFCOPY_TOKEN")}
    with open(log, "wb") as handle:
        process = subprocess.Popen([str(ORIGINAL_PROGRAM), "--listen", f"127.0.0.1:{port}", "-c", "1"],
                                   stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + ORIGINAL_START_TIMEOUT
        while True:
            if process.poll() is not None:
                pytest.fail(f"pdiffcopy 1.0.1 exited with {process.returncode}: {log.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"pdiffcopy 1.0.1 did not start: {log.read_text()}")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _one_line_naming_101(completed: subprocess.CompletedProcess, base: str) -> None:
    assert completed.returncode == 1, completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    assert f"{base}: this is a pdiffcopy 1.0.1 server" in lines[0]


def test_pull_from_a_101_server_names_the_version(original_server, tmp_path):
    """Pulling an existing file from 1.0.1 says which server it is (not 'Source does not exist')."""
    source = tmp_path / "source.bin"
    source.write_bytes(random_bytes(300_000))
    target = tmp_path / "target.bin"
    completed = run_cli(f"{original_server}{source}", str(target), timeout=60)
    _one_line_naming_101(completed, original_server)
    assert not target.exists()


def test_push_to_a_101_server_names_the_version(original_server, tmp_path):
    """Pushing to 1.0.1 stops before writing anything, naming the version."""
    source = tmp_path / "source.bin"
    source.write_bytes(random_bytes(300_000))
    target = tmp_path / "pushed.bin"
    completed = run_cli(str(source), f"{original_server}{target}", timeout=60)
    _one_line_naming_101(completed, original_server)
    assert not target.exists()


def test_tree_sync_with_a_101_server_names_the_version(original_server, tmp_path):
    """A directory URL, and the server's root, on 1.0.1 get the same line."""
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "a").write_bytes(b"a")
    for url in (f"{original_server}{tmp_path}/tree/", f"{original_server}/"):
        completed = run_cli("-a", url, str(tmp_path / "copy"), timeout=60)
        _one_line_naming_101(completed, original_server)

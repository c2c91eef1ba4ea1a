"""The command line as rsync users type it: mistakes end in one line and a non-zero exit (issue 13).

Nothing here may start a server by accident: every command that used to do so
runs with a short timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import free_port, pdiffcopy_command, run_cli, start_server
from pdiffcopy import __version__
from pdiffcopy.errors import PdiffcopyError, RemoteError

#: Long enough for the command line to start and refuse; a server started by
#: mistake would still be running then.
REFUSAL_SECONDS = 20


def refused(*args: str, cwd=None, env_extra=None) -> subprocess.CompletedProcess:
    """Run pdiffcopy expecting a quick one-line refusal; a server that starts instead fails the test."""
    env = {**os.environ, **(env_extra or {})}
    env.pop("PDIFFCOPY_TOKEN", None)
    try:
        completed = subprocess.run(pdiffcopy_command(*args), capture_output=True, text=True,
                                   timeout=REFUSAL_SECONDS, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pdiffcopy {' '.join(args)} kept running (it started a server?)")
    assert "Traceback" not in completed.stderr, completed.stderr
    assert "Unexpected error" not in completed.stderr, completed.stderr
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, completed.stderr
    return completed


# -- 6. sync-only options without SOURCE and TARGET -----------------------------------------

@pytest.mark.parametrize("options", [
    ["-a"], ["-n"], ["--delete"], ["--diff"], ["-e", "x"], ["-i"], ["--include-regex", "x"], ["--remove"],
    ["--checksum"], ["-W"], ["--atomic"], ["-b", "64K"], ["-t"],
])
def test_sync_only_options_without_paths_are_refused(tmp_path, options):
    port = free_port()
    completed = refused(*options, "--listen", f"127.0.0.1:{port}", cwd=tmp_path)
    assert completed.returncode == 1, completed.stderr
    assert options[0] in completed.stderr
    with socket.socket() as probe:  # nothing listens: no server was started
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_server_options_alone_still_start_the_server(tmp_path):
    server = start_server(tmp_path, tmp_path.parent / f"{tmp_path.name}.log", extra=("--no-progress",))
    try:
        assert server.process.poll() is None
    finally:
        assert server.stop() == 0


# -- 7. rsync's ssh form -------------------------------------------------------------------

@pytest.mark.parametrize("remote", ["host::module/x", "user@host::module"])
@pytest.mark.parametrize("as_target", [True, False])
def test_rsync_daemon_form_is_refused(tmp_path, remote, as_target):
    (tmp_path / "a").write_bytes(b"data")
    args = ["a", remote] if as_target else [remote, "a"]
    completed = refused(*args, cwd=tmp_path)
    assert completed.returncode == 1, completed.stderr
    assert "HOST::MODULE" in completed.stderr and "HOST:PATH" in completed.stderr, completed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"], "a local file was created"


@pytest.mark.parametrize("args", [["host:a", "http://127.0.0.1:9/b"], ["host:a", "other:b"]])
def test_two_remote_sides_are_refused(tmp_path, args):
    completed = refused(*args, cwd=tmp_path)
    assert completed.returncode == 1 and "cannot both be remote" in completed.stderr, completed.stderr


def test_local_names_with_a_colon_after_a_slash_stay_local(tmp_path):
    (tmp_path / "a").write_bytes(b"data")
    completed = run_cli("--no-progress", str(tmp_path / "a"), str(tmp_path / "b:c"))
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "b:c").read_bytes() == b"data"
    completed = subprocess.run(pdiffcopy_command("--no-progress", "a", "./d:e"), cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "d:e").read_bytes() == b"data"


# -- 8. bad values and missing pieces -----------------------------------------------------

@pytest.mark.parametrize("value", ["-1", "nan", "inf", "0", "abc"])
def test_bad_timeout_is_a_usage_error(tmp_path, value):
    (tmp_path / "a").write_bytes(b"data")
    completed = refused("--timeout", value, "a", "http://127.0.0.1:9/x", cwd=tmp_path)
    assert completed.returncode == 1, completed.stderr
    assert "--timeout" in completed.stderr


def test_missing_ca_file_is_named(tmp_path):
    (tmp_path / "a").write_bytes(b"data")
    completed = refused("--ca-file", str(tmp_path / "nope.pem"), "a", "https://127.0.0.1:9/x", cwd=tmp_path)
    assert completed.returncode == 1, completed.stderr
    assert "nope.pem" in completed.stderr


def test_missing_server_extra_says_what_to_install(tmp_path):
    """With flask and gunicorn not importable (as without the server extra)."""
    script = ("import sys; sys.modules['flask'] = sys.modules['gunicorn'] = None; "
              "from pdiffcopy.cli import main; main()")
    try:
        completed = subprocess.run([sys.executable, "-c", script, "--listen", f"127.0.0.1:{free_port()}"],
                                   capture_output=True, text=True, timeout=REFUSAL_SECONDS, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("the server started without flask and gunicorn?")
    assert completed.returncode == 1, completed.stderr
    assert f"pip install 'pdiffcopy[server]=={__version__}'" in completed.stderr
    assert "Traceback" not in completed.stderr and len(completed.stderr.strip().splitlines()) == 1


def test_missing_client_extra_for_benchmark_says_what_to_install(tmp_path):
    (tmp_path / "a").write_bytes(os.urandom(64 * 1024))
    (tmp_path / "b").write_bytes(os.urandom(64 * 1024))
    script = "import sys; sys.modules['executor'] = None; from pdiffcopy.cli import main; main()"
    completed = subprocess.run([sys.executable, "-c", script, "-q", "-B", "1", "a", "b"],
                               capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert completed.returncode == 1, completed.stderr
    assert f"pip install 'pdiffcopy[client]=={__version__}'" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_busy_port_fails_at_once_with_one_line(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        completed = refused("--listen", f"127.0.0.1:{port}", cwd=tmp_path)
        elapsed = time.monotonic() - started
    assert completed.returncode == 10, completed.stderr
    assert str(port) in completed.stderr and "in use" in completed.stderr
    assert elapsed < 4, f"took {elapsed:.1f} s (gunicorn retries for 5 s)"


def kill_while_streaming(server, rest, expected=PdiffcopyError) -> None:
    """Kill ``server`` outright while it streams an answer, then read ``rest`` of it: the error is plain words."""
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    with pytest.raises(expected) as caught:
        for _ in rest:
            pass
    message = str(caught.value)
    assert "the server closed the connection" in message, message
    assert "IncompleteRead" not in message


@pytest.mark.parametrize("parts", [1, 2])
def test_interrupted_pull_says_the_server_closed_the_connection(tmp_path, parts):
    """The server killed while an answer streams: the client's error is plain words."""
    from pdiffcopy.transport.remote import RemoteFile

    size = 256 * 1024 * 1024  # sparse: far more than socket buffers hold
    with open(tmp_path / "big.img", "wb") as handle:
        handle.truncate(size)
    server = start_server(tmp_path, tmp_path.parent / f"{tmp_path.name}-server.log")
    remote = RemoteFile(server.url("big.img"), timeout=10)
    half = size // 2
    try:
        chunks = remote.read_ranges([(0, size)] if parts == 1 else [(0, half), (half, half)])
        next(chunks)  # the answer is streaming, at our pace
        kill_while_streaming(server, chunks, RemoteError)
    finally:
        remote.close()
        server.stop()


def test_interrupted_tree_pull_says_the_server_closed_the_connection(tmp_path):
    """The same for a tree's files, which arrive as a chunked stream."""
    from pdiffcopy.transport.remotetree import RemoteTree
    from pdiffcopy.core.treewire import MAX_FILE_BYTES

    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_bytes(b"small")
    for name in ("b", "c"):  # sparse, each as big as a file sent whole may be
        with open(root / name, "wb") as handle:
            handle.truncate(MAX_FILE_BYTES)
    server = start_server(root, tmp_path / "server.log")
    tree = RemoteTree(server.base + "/", timeout=10)
    try:
        entries = sorted(tree.list().entries, key=lambda entry: entry.path)
        files = tree.read_files(entries)
        first = next(files)
        assert first[0].path == "a" and first[1] == b"small"
        kill_while_streaming(server, files)
    finally:
        server.stop()


def test_the_entry_point_of_101_takes_an_argument_list(tmp_path):
    """``from pdiffcopy.cli import main; main([...])``, as 1.0.1's tests and users' scripts call it."""
    (tmp_path / "a").write_bytes(os.urandom(3 * 1024 * 1024 + 5))
    script = ("import sys; from pdiffcopy.cli import main; status = main(['-q', 'a', 'b']); "
              "from pdiffcopy.cli import main as again; print(status, callable(again))")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                               cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["0", "True"]
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes()


def test_the_entry_point_of_101_reads_the_command_line_when_given_nothing(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100)
    script = "from pdiffcopy.cli import main; main()"
    completed = subprocess.run([sys.executable, "-c", script, "-q", "a", "b"], capture_output=True, text=True,
                               timeout=120, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "b").read_bytes() == b"x" * 100

"""Faults: a client or a server process killed, a full disk, a silent server, a changing source.

Whatever happens, the server stays up, answers others and leaves no process
behind, and the client either fails with one clear line or succeeds with a
target that verifies: never success with a hole or a mixture. (The server
killed mid-transfer is in test_errors.py.) Every test is bounded in time.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import mutate, pdiffcopy_command, start_server
from test_errors import (
    _first_block_written,
    error_message,
    raw_request,
    session_processes,
    temporaries,
)

from pdiffcopy import Progress, sync
from pdiffcopy.errors import Conflict, RemoteError, VerificationFailed

BIG = 64 * 1024 * 1024

#: Seconds a client may run in any of these tests.
CLIENT_DEADLINE = 60


@pytest.fixture(scope="module")
def big_data():
    return os.urandom(BIG)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def client_env():
    env = dict(os.environ)
    env.pop("PDIFFCOPY_TOKEN", None)
    return env


def start_client(*args: str) -> subprocess.Popen:
    """The command line in its own session (so that its children can be found)."""
    return subprocess.Popen(pdiffcopy_command(*args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=client_env(),
                            start_new_session=True)


def wait_until(condition, seconds: float, interval: float = 0.001) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return False


def server_processes(server) -> set:
    """The pids in the server's session: its master and its workers."""
    return {pid for pid, _, _ in session_processes(server.process.pid)}


def workers_of(server) -> list:
    """The worker processes: children of the master."""
    found = []
    for pid in server_processes(server):
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
        if int(text[text.rfind(")") + 2 :].split()[1]) == server.process.pid:
            found.append(pid)
    return found


def ready_server(root: Path, log: Path, workers: int = 2):
    """A server whose workers have all booted (so its session is complete)."""
    server = start_server(root, log, extra=("-c", str(workers)))
    assert wait_until(lambda: len(workers_of(server)) == workers, 20, 0.05)
    assert raw_request(server.port, "GET", "/")[0] == 200
    return server


def stop(server) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


def finish(client: subprocess.Popen, seconds: float = CLIENT_DEADLINE):
    try:
        return client.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(client.pid, signal.SIGKILL)
        client.communicate()
        pytest.fail(f"the client did not finish within {seconds} s")


# -- the client killed mid-transfer ---------------------------------------------------------


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_client_killed_mid_transfer_leaves_nothing_running_on_the_server(
        tmp_path, big_data, direction):
    root, local_dir = tmp_path / "root", tmp_path / "local"
    root.mkdir()
    local_dir.mkdir()
    (root / "other.img").write_bytes(b"another client's file")
    server = ready_server(root, tmp_path / "server.log")
    try:
        before = server_processes(server)
        if direction == "pull":
            (root / "big.img").write_bytes(big_data)
            args, watched = (server.url("big.img"), str(local_dir / "big.img")), local_dir
        else:
            (local_dir / "big.img").write_bytes(big_data)
            args, watched = (str(local_dir / "big.img"), server.url("big.img")), root
        client = start_client("-c", "1", *args)
        try:
            assert wait_until(lambda: _first_block_written(watched) or client.poll() is not None,
                              CLIENT_DEADLINE)
            assert client.poll() is None, "the transfer finished before the client could be killed"
            os.killpg(client.pid, signal.SIGKILL)  # the client and its hashing processes
            client.communicate(timeout=10)
        finally:
            if client.poll() is None:
                os.killpg(client.pid, signal.SIGKILL)
        # A few seconds later the server's session holds exactly what it held
        # before: the same master and workers, none died or was added.
        time.sleep(3)
        assert server_processes(server) == before
        # And it answers others at once.
        started = time.monotonic()
        status, _, body = raw_request(server.port, "GET", "/other.img")
        assert (status, body) == (200, b"another client's file")
        assert time.monotonic() - started < 2
        result = sync(server.url("other.img"), str(tmp_path / "other-copy.img"), concurrency=2)
        assert result.verified
        assert (tmp_path / "other-copy.img").read_bytes() == b"another client's file"
    finally:
        stop(server)
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "Unexpected error" not in log, log[-3000:]


# -- a worker process killed mid-request ------------------------------------------------


@pytest.mark.parametrize("target_exists", [False, True], ids=["new-target", "old-target"])
def test_worker_killed_mid_pull_never_yields_success_with_a_hole(tmp_path, big_data,
                                                                 target_exists):
    root, local_dir = tmp_path / "root", tmp_path / "local"
    root.mkdir()
    local_dir.mkdir()
    (root / "big.img").write_bytes(big_data)
    target = local_dir / "big.img"
    if target_exists:
        with open(target, "wb") as handle:  # all zeros: every block must travel
            handle.truncate(BIG)
    # One worker, so the worker killed is the one serving the pull.
    server = ready_server(root, tmp_path / "server.log", workers=1)
    try:
        (worker,) = workers_of(server)
        client = start_client("-c", "1", "--timeout", "20", server.url("big.img"), str(target))

        def transferring() -> bool:
            if target_exists:
                with open(target, "rb") as handle:
                    return handle.read(4096).strip(b"\0") != b""
            return _first_block_written(local_dir)

        assert wait_until(lambda: transferring() or client.poll() is not None, CLIENT_DEADLINE)
        assert client.poll() is None, "the pull finished before the worker could be killed"
        os.kill(worker, signal.SIGKILL)
        _, stderr = finish(client)
        if client.returncode == 0:
            # A retry may have completed the pull: then the target must be whole.
            assert digest(target) == hashlib.sha256(big_data).hexdigest()
        else:
            assert client.returncode == RemoteError.exit_code, stderr
            error_message(stderr)
            if not target_exists:
                assert not target.exists(), "a failed pull left a target under its name"
            assert temporaries(local_dir) == []
        # gunicorn replaces the worker; the server answers again.
        assert wait_until(lambda: raw_request(server.port, "GET", "/")[0] == 200, 20, 0.2)
        assert worker not in workers_of(server)
    finally:
        stop(server)


# -- the disk full on the server during a push -----------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs to serve (needs root and the right to mount)."""
    mountpoint = tmp_path / "small-disk"
    mountpoint.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


MIB = 1024 * 1024


@pytest.mark.parametrize("old_size,new_size,atomic", [
    (None, 20 * MIB, False),    # a new target larger than the disk: the resize is refused
    (10 * MIB, 10 * MIB, True),  # --atomic: no room for the copy of the old target
    (5 * MIB, 12 * MIB, True),   # --atomic: room for the copy, not for growing it
], ids=["new-target", "atomic-clone", "atomic-growth"])
def test_disk_full_during_a_push(tmp_path, small_disk, old_size, new_size, atomic):
    source = tmp_path / "source.img"
    source.write_bytes(os.urandom(new_size))
    target = small_disk / "target.img"
    if old_size:
        target.write_bytes(os.urandom(old_size))
        old_digest = digest(target)
    server = start_server(small_disk, tmp_path / "server.log")
    try:
        args = ["--atomic"] if atomic else []
        client = start_client("-c", "2", "--timeout", "20", *args, str(source),
                              server.url("target.img"))
        _, stderr = finish(client)
        assert client.returncode == 11, stderr
        message = error_message(stderr)
        assert "space" in message.lower(), message
        if old_size:
            assert digest(target) == old_digest, "the old target changed"
        else:
            assert not target.exists()
        assert temporaries(small_disk) == [], "a temporary file was left on the server"
        assert raw_request(server.port, "GET", "/")[0] == 200
    finally:
        stop(server)


# -- a server that accepts and never answers -------------------------------------------------


@pytest.fixture
def silent_server():
    """A listener that accepts every connection and then says nothing."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted = []
    done = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not done.is_set():
            try:
                connection, _ = listener.accept()
                accepted.append(connection)  # held open, never answered
            except socket.timeout:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    done.set()
    thread.join(timeout=5)
    for connection in accepted:
        connection.close()
    listener.close()


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_silent_server_times_out_within_the_timeout(tmp_path, silent_server, direction):
    base, accepted = silent_server
    local = tmp_path / "local.img"
    if direction == "push":
        local.write_bytes(b"x" * 100_000)
    args = (f"{base}/file.img", str(local)) if direction == "pull" else (str(local),
                                                                        f"{base}/file.img")
    started = time.monotonic()
    client = start_client("--timeout", "2", *args)
    _, stderr = finish(client, 30)
    elapsed = time.monotonic() - started
    assert client.returncode == 30, stderr
    message = error_message(stderr)
    assert "did not answer within 2 seconds" in message, message
    assert accepted, "the client never connected"
    assert elapsed < 2 + 5, f"took {elapsed:.1f} s with --timeout 2"
    if direction == "pull":
        assert not local.exists()
    assert temporaries(tmp_path) == []


# -- a source that changes during the sync ------------------------------------------------


class ChangeSourceDuringSync(Progress):
    """Progress counters that rewrite a byte of the source at a chosen moment.

    ``moment`` is "transfer" (the first bytes moved: after hashing started,
    while transfers run) or "verify" (every byte moved, before the check).
    The change keeps the size, so only the ETag/mtime can tell.
    """

    def __init__(self, source: Path, moment: str) -> None:
        self._source, self._moment, self.changed = source, moment, False
        super().__init__()

    def _change(self) -> None:
        if not self.changed:
            self.changed = True
            with open(self._source, "r+b") as handle:
                first = handle.read(1)
                handle.seek(0)
                handle.write(bytes([first[0] ^ 0xFF]))

    def add_moved(self, count: int) -> None:
        super().add_moved(count)
        if self._moment == "transfer":
            self._change()

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if value == "verifying" and self._moment == "verify":
            self._change()


@pytest.mark.parametrize("moment", ["transfer", "verify"])
@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize("atomic", [False, True], ids=["new-target", "atomic-old-target"])
def test_a_changing_source_fails_the_sync(server, tmp_path, big_data, unique, moment,
                                          direction, atomic):
    remote = server.root / unique
    local = tmp_path / "local.img"
    source, target = (remote, local) if direction == "pull" else (local, remote)
    source.write_bytes(big_data)
    time.sleep(0.02)  # the change below gets another mtime than the write above
    if atomic:
        target.write_bytes(mutate(big_data, range(0, BIG, BIG // 16)))
        old_target = digest(target)
    progress = ChangeSourceDuringSync(source, moment)
    urls = (server.url(unique), str(local)) if direction == "pull" else (str(local),
                                                                        server.url(unique))
    # A remote source is pinned with If-Match: the server refuses at once. A
    # local source is checked at the end, after the verification, which
    # fails first when a changed block was sent: a failure either way.
    # (pipeline.py could report that case as "changed" too.)
    expected = Conflict if direction == "pull" else (Conflict, VerificationFailed)
    with pytest.raises(expected) as failure:
        sync(*urls, concurrency=2, atomic=atomic, progress=progress)
    assert progress.changed
    if isinstance(failure.value, Conflict):
        assert "changed" in str(failure.value)
    if atomic:
        assert digest(target) == old_target, "the old target changed"
    else:
        assert not target.exists(), "a target appeared although the sync failed"
    assert temporaries(target.parent) == []


def test_a_source_changed_during_a_cli_pull(server, tmp_path, big_data, unique):
    """The same from outside: the source rewritten while the command line pulls."""
    source = server.root / unique
    source.write_bytes(big_data)
    time.sleep(0.02)
    target = tmp_path / "target.img"
    client = start_client("-c", "1", server.url(unique), str(target))
    assert wait_until(lambda: _first_block_written(tmp_path) or client.poll() is not None,
                      CLIENT_DEADLINE)
    assert client.poll() is None, "the pull finished before the source could change"
    with open(source, "r+b") as handle:
        handle.seek(BIG // 2)
        handle.write(b"changed!")
    _, stderr = finish(client)
    assert client.returncode == 23, stderr
    assert "changed" in error_message(stderr)
    assert not target.exists()
    assert temporaries(tmp_path) == []

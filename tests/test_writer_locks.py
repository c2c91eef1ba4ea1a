"""A killed run's temporaries are gone after the next run; a live writer's are never touched (issue 24).

Real clients killed with SIGKILL mid-transfer (a bandwidth limit keeps them mid-transfer),
a real multi-worker server, and the same command run again at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import List, Sequence

import pytest

from conftest import pdiffcopy_command, random_bytes, run_cli, start_server
from pdiffcopy.engine.treerunner import RANGE_SIZE
from pdiffcopy.local.descriptors import is_temporary_name

SIZE = 24 * 1024 * 1024

#: Keeps a sync of SIZE going for seconds: the kill always lands mid-transfer.
SLOW = ("--bwlimit", "2M")


def write_random(path: Path, seed: int, size: int = SIZE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(random_bytes(size, seed))


def temporaries(directory: Path) -> List[Path]:
    return sorted(p for p in directory.rglob("*") if is_temporary_name(p.name))


def names(directory: Path) -> List[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def start_slow(arguments: Sequence[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as handle:  # a file, not a pipe: nothing waits on it
        return subprocess.Popen(pdiffcopy_command("-c", "2", *SLOW, *arguments), stdout=subprocess.DEVNULL,
                                stderr=handle, start_new_session=True)


def wait_for_temporary(directory: Path, process: subprocess.Popen, known: Sequence[Path] = (),
                       timeout: float = 60) -> Path:
    """The first temporary (not one of ``known``) that the running ``process`` wrote data into."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        for path in temporaries(directory):
            try:
                if path not in known and path.stat().st_size > 0:
                    return path
            except FileNotFoundError:
                continue
        time.sleep(0.01)
    raise AssertionError(f"the run never wrote a temporary in {directory} (exit {process.poll()})")


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the client and its workers, as the OOM killer or a crash would: no clean-up at all."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def kill_mid_transfer(arguments: Sequence[str], directory: Path, log: Path) -> Path:
    process = start_slow(arguments, log)
    try:
        temporary = wait_for_temporary(directory, process)
    finally:
        kill_group(process)
    assert temporary.exists(), "SIGKILL leaves the temporary (nothing could clean up)"
    return temporary


@pytest.fixture
def tree_on_server(server, unique) -> Path:
    tree = server.root / f"{unique}-source"
    write_random(tree / "a.img", 1, RANGE_SIZE)
    write_random(tree / "sub" / "b.img", 2)
    return tree


@pytest.fixture
def local_tree(tmp_path) -> Path:
    tree = tmp_path / "source"
    write_random(tree / "a.img", 3, RANGE_SIZE)
    write_random(tree / "sub" / "b.img", 4)
    return tree


def test_a_pull_run_again_after_sigkill_leaves_nothing_of_the_dead_run(server, unique, tmp_path):
    write_random(server.root / f"{unique}.img", 5)
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    arguments = (server.url(f"{unique}.img"), str(target_dir / "new.img"))
    kill_mid_transfer(arguments, target_dir, tmp_path / "client.log")
    completed = run_cli(*arguments)
    assert completed.returncode == 0, completed.stderr
    assert names(target_dir) == ["new.img"]
    assert (target_dir / "new.img").read_bytes() == (server.root / f"{unique}.img").read_bytes()


def test_a_push_run_again_after_sigkill_leaves_nothing_of_the_dead_run(server, unique, tmp_path):
    source = tmp_path / "source.img"
    write_random(source, 6)
    target_dir = server.root / unique
    target_dir.mkdir()
    arguments = (str(source), server.url(f"{unique}/pushed.img"))
    kill_mid_transfer(arguments, target_dir, tmp_path / "client.log")
    completed = run_cli(*arguments)
    assert completed.returncode == 0, completed.stderr
    assert names(target_dir) == ["pushed.img"]
    assert (target_dir / "pushed.img").read_bytes() == source.read_bytes()


def test_a_tree_pull_run_again_after_sigkill_leaves_nothing_of_the_dead_run(server, tree_on_server, tmp_path):
    target_dir = tmp_path / "target"
    arguments = (server.url(tree_on_server.name) + "/", str(target_dir))
    target_dir.mkdir()
    kill_mid_transfer(arguments, target_dir, tmp_path / "client.log")
    completed = run_cli(*arguments)
    assert completed.returncode == 0, completed.stderr
    assert names(target_dir) == ["a.img", "sub", "sub/b.img"]
    assert (target_dir / "sub" / "b.img").read_bytes() == (tree_on_server / "sub" / "b.img").read_bytes()


def test_a_tree_push_run_again_after_sigkill_leaves_nothing_of_the_dead_run(server, local_tree, unique, tmp_path):
    target_dir = server.root / unique
    target_dir.mkdir()
    arguments = (str(local_tree) + "/", server.url(unique))
    kill_mid_transfer(arguments, target_dir, tmp_path / "client.log")
    completed = run_cli(*arguments)
    assert completed.returncode == 0, completed.stderr
    assert names(target_dir) == ["a.img", "sub", "sub/b.img"]
    assert (target_dir / "a.img").read_bytes() == (local_tree / "a.img").read_bytes()


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_a_live_writers_temporary_is_left_alone_and_a_dead_ones_goes(server, unique, tmp_path, direction):
    """A killed run, then a slow run still writing, then a third run into the same directory."""
    unique = unique.replace(".img", "")
    if direction == "pull":
        for index in range(3):
            write_random(server.root / unique / f"{index}.img", 10 + index)
        target_dir = tmp_path / "target"
        target_dir.mkdir()
        commands = [(server.url(f"{unique}/{index}.img"), str(target_dir / f"{index}.img")) for index in range(3)]
    else:
        for index in range(3):
            write_random(tmp_path / f"{index}.img", 20 + index)
        target_dir = server.root / unique
        target_dir.mkdir()
        commands = [(str(tmp_path / f"{index}.img"), server.url(f"{unique}/{index}.img")) for index in range(3)]
    dead = kill_mid_transfer(commands[0], target_dir, tmp_path / "dead.log")
    live_run = start_slow(commands[1], tmp_path / "live.log")
    try:
        live = wait_for_temporary(target_dir, live_run, known=[dead])
        live_inode = live.stat().st_ino
        completed = run_cli(*commands[2])
        assert completed.returncode == 0, completed.stderr
        assert live_run.poll() is None, "the slow run must still be writing for this test to mean anything"
        assert live.stat().st_ino == live_inode  # never touched, though younger than a second's sweep
        assert not dead.exists()
        assert sorted(set(names(target_dir)) - {live.name}) == ["2.img"]
    finally:
        kill_group(live_run)


def test_a_server_killed_mid_push_leaves_nothing_after_its_restart(tmp_path):
    root = tmp_path / "root"
    (root / "deep").mkdir(parents=True)
    source = tmp_path / "source.img"
    write_random(source, 30)
    server = start_server(root, tmp_path / "server.log")
    client = start_slow((str(source), server.url("deep/pushed.img")), tmp_path / "client.log")
    try:
        temporary = wait_for_temporary(root / "deep", client)
        os.killpg(server.process.pid, signal.SIGKILL)  # the server and its workers, no clean-up
        server.process.wait(timeout=30)
        client.wait(timeout=60)
    finally:
        kill_group(client)
    assert temporary.exists(), "SIGKILL leaves the pushed temporary"
    restarted = start_server(root, tmp_path / "server2.log")
    try:
        assert names(root) == ["deep"]
    finally:
        restarted.stop()


def test_a_temporary_a_push_just_made_is_never_swept_by_another_push(server, unique):
    """The server holds a new temporary's writer lock from the moment it makes it.

    Sixteen pushes at once each sweep their target's directory before they start:
    a temporary that a resize request had just made, but whose lock the server
    took only after the request, was removed under its push (its next PATCH got
    404 and the client a broken pipe). Here one client makes temporaries as a push
    does while another sweeps the same directory without pause.
    """
    import http.client
    import json
    import threading

    directory = server.root / unique
    directory.mkdir()
    stop = threading.Event()
    swept = []

    def ask(connection: http.client.HTTPConnection, method: str, path: str, body: bytes = b"",
            headers=None):
        """One request on a kept-alive connection, as a push sends them: (status, body)."""
        connection.request(method, path, body=body, headers=headers or {})
        answer = connection.getresponse()
        return answer.status, answer.read()

    def sweep_without_pause() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            while not stop.is_set():
                status, body = ask(connection, "POST", f"/.pdiffcopy/sweep/{unique}/other.img")
                swept.append(json.loads(body)["removed"])
        finally:
            connection.close()

    sweeper = threading.Thread(target=sweep_without_pause)
    sweeper.start()
    lost = []
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)  # held open as a push's are
    try:
        for attempt in range(300):
            name = f"{unique}/.pushed-{attempt}.img.pdiffcopy-{os.getpid():08x}{attempt:04x}"
            status, body = ask(connection, "POST", f"/.pdiffcopy/resize/{name}?size=4096")
            assert status == 200, body
            status, _ = ask(connection, "PATCH", f"/{name}", b"x" * 4096,
                            {"Content-Range": "bytes 0-4095/4096"})
            if status == 404:
                lost.append(name)
    finally:
        connection.close()
        stop.set()
        sweeper.join(timeout=30)
    assert len(swept) > 0
    assert lost == [], f"{len(lost)} of 300 new temporaries were swept under their writer"


def test_a_temporary_made_again_after_a_sweep_removed_it_holds_its_own_lock(tmp_path, monkeypatch):
    """A sweep can remove a new temporary between its making and its lock: the writer makes it
    again, and that one must be locked too (the lock of the removed one was kept instead once,
    and the next sweep removed the new file under its writer)."""
    from pdiffcopy.local import writerlocks
    from pdiffcopy.local.descriptors import temporary_name
    from pdiffcopy.local.localfile import LocalFile

    path = tmp_path / temporary_name("image.img")
    real, swept = writerlocks.hold_descriptor, []

    def swept_before_the_first_lock(fd):
        if not swept:
            swept.append(path)
            os.unlink(path)  # as a sweep that found it unlocked does
        return real(fd)

    monkeypatch.setattr(writerlocks, "hold_descriptor", swept_before_the_first_lock)
    temporary = LocalFile(str(path))
    try:
        temporary.held_writer()
        assert swept and path.exists()
        directory = os.open(tmp_path, os.O_RDONLY)
        try:
            state, _ = writerlocks.probe_writer(path.name, directory, os.lstat(path))
        finally:
            os.close(directory)
        assert state == writerlocks.HELD
    finally:
        temporary.close()

"""Nothing left behind: a killed client leaves no process, temporaries are never data and get swept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import pdiffcopy_command, process_stats, random_bytes, run_cli, start_server
from pdiffcopy.local.descriptors import is_temporary_name
from pdiffcopy.local.sweep import ORPHAN_TEMPORARY_SECONDS, STALE_TEMPORARY_SECONDS
from pdiffcopy.local.writerlocks import create_held
from test_interrupt import session_processes

#: Big enough (hashed with a slow method) that the sync is still running when the signal comes.
BIG_SIZE = 128 * 1024 * 1024

# (read with defaults, so that these tests run, and fail, on code without the sweep too)

#: How long a client's processes may outlive it.
SURVIVAL_LIMIT = 2.0

#: A bandwidth limit that keeps a sync of BIG_SIZE going for half a minute: the signal always
#: lands in the middle of it, so these tests never find the sync over before it comes.
SLOW = ("--bwlimit", "4M")


def dead_pid() -> int:
    """The id of a process that just ended (not reused within a test)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def temporary_of(name: str, pid: int, serial: int = 1) -> str:
    return f".{name}.pdiffcopy-{(pid << 24) | serial:012x}"


def held_by_this_process(path: Path) -> int:
    """Make the temporary ``path`` as a writer does, holding its writer lock; the caller closes the descriptor."""
    fd = create_held(str(path), 0o600)
    os.write(fd, b"being written")
    return fd


def backdate(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def write_big(path: Path, seed: int) -> None:
    chunk = random_bytes(1024 * 1024, seed)
    with open(path, "wb") as handle:
        for index in range(BIG_SIZE // len(chunk)):
            handle.write(chunk[index % 7:] + chunk[: index % 7])


def children_of(pid: int):
    return [child for child, fields in process_stats() if int(fields[1]) == pid]


def wait_for(condition, process: subprocess.Popen, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if condition():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def big_pair(server):
    """A big source on the server and a different local copy, each made once."""
    write_big(server.root / "leftovers-big.img", seed=1)
    local = server.root.parent / "leftovers-local.img"
    write_big(local, seed=2)
    return server.root / "leftovers-big.img", local


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_a_killed_client_leaves_no_process(server, big_pair, tmp_path, signum, direction):
    remote, local = big_pair
    target = tmp_path / "target.img"
    if direction == "pull":
        target.write_bytes(local.read_bytes())
        arguments = (server.url(remote.name), str(target))
    else:
        name = f"leftovers-push-{signum}.img"
        (server.root / name).write_bytes(remote.read_bytes())
        arguments = (str(local), server.url(name))
    # sha3_512 hashes slowly: the hashing processes are busy when the signal comes.
    # Output to a file, not a pipe: surviving workers would hold a pipe open.
    log = open(tmp_path / "client.log", "w+")
    process = subprocess.Popen(pdiffcopy_command("-c", "2", "-m", "sha3_512", "-b", "64K", *arguments),
                               stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        assert wait_for(lambda: len(children_of(process.pid)) >= 2, process), \
            "the client never started its hashing processes"
        time.sleep(0.2)
        process.send_signal(signum)  # to the client alone, as kill(1) or a supervisor does
        process.wait(timeout=30)
        stderr = (tmp_path / "client.log").read_text()
        deadline = time.monotonic() + SURVIVAL_LIMIT
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_processes(process.pid) == []
        if signum != signal.SIGKILL:
            assert process.returncode == 20, stderr
            assert f"Interrupted by {signal.Signals(signum).name}" in stderr
            assert "Traceback" not in stderr
    finally:
        log.close()
        for pid in session_processes(process.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_tree_sync_leaves_no_worker(server, big_pair, tmp_path, unique):
    remote, _ = big_pair
    tree = server.root / unique
    tree.mkdir()
    for index in range(4):  # big files: units for forked tree workers
        os.link(remote, tree / f"{index}.img")
    log = open(tmp_path / "client.log", "w+")
    process = subprocess.Popen(pdiffcopy_command("-c", "2", *SLOW, server.url(unique) + "/", str(tmp_path / "t")),
                               stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        assert wait_for(lambda: len(children_of(process.pid)) >= 2, process), \
            "the tree sync never started its workers"
        process.kill()
        process.wait(timeout=30)
        deadline = time.monotonic() + SURVIVAL_LIMIT
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_processes(process.pid) == []
    finally:
        log.close()
        for pid in session_processes(process.pid):
            os.kill(pid, signal.SIGKILL)


def test_term_during_a_push_removes_the_servers_temporary(server, big_pair, tmp_path, unique):
    _, local = big_pair
    with open(tmp_path / "client.log", "w") as log:  # a file: survivors would hold a pipe
        process = subprocess.Popen(pdiffcopy_command("-c", "2", *SLOW, str(local), server.url(unique)),
                                   stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    started = wait_for(lambda: any(is_temporary_name(p.name) and unique in p.name
                                   for p in server.root.iterdir()), process)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    stderr = (tmp_path / "client.log").read_text()
    assert started, "the push never made its temporary"
    assert process.returncode == 20, stderr
    assert not [p for p in server.root.iterdir() if unique in p.name]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_term_and_hup_remove_the_temporary_like_ctrl_c(server, big_pair, tmp_path, signum):
    remote, _ = big_pair
    target = tmp_path / "new.img"
    process = subprocess.Popen(pdiffcopy_command("-c", "2", *SLOW, server.url(remote.name), str(target)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    started = wait_for(lambda: any(tmp_path.iterdir()), process)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=30)
    assert started, "the pull never made its temporary"
    assert process.returncode == 20, stderr
    assert "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_the_temporary_of_a_killed_pull_is_swept_by_the_next_run(server, big_pair, tmp_path):
    remote, _ = big_pair
    target = tmp_path / "new.img"
    process = subprocess.Popen(pdiffcopy_command("-c", "2", *SLOW, server.url(remote.name), str(target)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    started = wait_for(lambda: any(tmp_path.iterdir()), process)
    process.kill()
    process.communicate(timeout=30)
    assert started, "the pull never made its temporary"
    assert process.returncode == -signal.SIGKILL
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and is_temporary_name(left[0].name)  # SIGKILL: no chance to clean up
    backdate(left[0], ORPHAN_TEMPORARY_SECONDS + 60)  # its process is dead: a grace period on
    completed = run_cli("-c", "2", server.url(remote.name), str(target))
    assert completed.returncode == 0, completed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.img"]
    assert "stale temporary" in completed.stderr


def test_temporaries_whose_writer_lock_is_held_are_kept_whatever_their_age(tmp_path):
    (tmp_path / "a.img").write_bytes(b"new data")
    live = tmp_path / temporary_of("b.img", dead_pid())  # its lock held (by this process), a day old
    live_partial = tmp_path / ".f.img.pdiffcopy-partial"
    recent = tmp_path / temporary_of("c.img", os.getpid())  # unlocked: its writer is gone, whatever its name says
    orphan = tmp_path / temporary_of("d.img", dead_pid())
    old = tmp_path / temporary_of("e.img", os.getpid(), 2)
    partial = tmp_path / ".g.img.pdiffcopy-partial"  # unlocked: kept for the next run to resume
    old_partial = tmp_path / ".h.img.pdiffcopy-partial"
    holders = [held_by_this_process(live), held_by_this_process(live_partial)]
    try:
        for path in (recent, orphan, old, partial, old_partial):
            path.write_bytes(b"partial")
        for path in (live, live_partial, old, old_partial):
            backdate(path, STALE_TEMPORARY_SECONDS + 60)
        backdate(orphan, ORPHAN_TEMPORARY_SECONDS + 60)
        completed = run_cli(str(tmp_path / "a.img"), str(tmp_path / "b.img"))
        assert completed.returncode == 0, completed.stderr
        assert live.exists() and live_partial.exists() and partial.exists()
        assert not recent.exists() and not orphan.exists() and not old.exists() and not old_partial.exists()
    finally:
        for fd in holders:
            os.close(fd)


def make_tree_with_temporaries(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "data.txt").write_bytes(b"data")
    (root / temporary_of("big.img", os.getpid())).write_bytes(b"being written")
    (root / "sub" / temporary_of("x", dead_pid())).write_bytes(b"left over")


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_temporaries_are_never_copied_as_data(server, tmp_path, unique, direction):
    if direction == "pull":
        source, target_dir = server.root / unique, tmp_path / "target"
        make_tree_with_temporaries(source)
        arguments = (server.url(unique) + "/", str(target_dir))
    elif direction == "push":
        source, target_dir = tmp_path / "source", server.root / unique
        make_tree_with_temporaries(source)
        arguments = (str(source) + "/", server.url(unique))
    else:
        source, target_dir = tmp_path / "source", tmp_path / "target"
        make_tree_with_temporaries(source)
        arguments = (str(source) + "/", str(target_dir))
    completed = run_cli("-a", *arguments)
    assert completed.returncode == 0, completed.stderr
    names = sorted(str(p.relative_to(target_dir)) for p in target_dir.rglob("*"))
    assert names == ["sub", "sub/data.txt"]
    # Nor are they deleted as extraneous by --delete: they are not the tree's (the sweep's, when stale).
    completed = run_cli("-a", "--delete", *arguments)
    assert completed.returncode == 0, completed.stderr


def test_a_tree_sync_sweeps_stale_temporaries_of_its_local_target(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.txt").write_bytes(b"a")
    (target / "sub").mkdir(parents=True)
    stale = target / "sub" / temporary_of("a.txt", os.getpid())  # just made, but nobody holds its lock
    live = target / temporary_of("b.txt", dead_pid())
    stale.write_bytes(b"partial")
    holder = held_by_this_process(live)
    try:
        backdate(live, STALE_TEMPORARY_SECONDS + 60)
        completed = run_cli("-n", str(source) + "/", str(target))
        assert completed.returncode == 0, completed.stderr
        assert stale.exists()  # a dry run changes nothing
        completed = run_cli(str(source) + "/", str(target))
        assert completed.returncode == 0, completed.stderr
        assert not stale.exists() and live.exists()
        assert (target / "sub" / "a.txt").read_bytes() == b"a"
    finally:
        os.close(holder)


def test_the_server_sweeps_stale_temporaries_of_its_root_at_start(tmp_path):
    root = tmp_path / "root"
    (root / "deep" / "er").mkdir(parents=True)
    stale = root / "deep" / "er" / temporary_of("pushed.img", os.getpid())  # recent, but unlocked
    old = root / temporary_of("older.img", os.getpid())
    kept = root / "deep" / temporary_of("recent.img", dead_pid())  # its writer (this process) is alive
    for path in (stale, old):
        path.write_bytes(b"partial")
    holder = held_by_this_process(kept)
    backdate(old, STALE_TEMPORARY_SECONDS + 60)
    backdate(kept, STALE_TEMPORARY_SECONDS + 60)
    server = start_server(root, tmp_path / "server.log")
    try:
        assert not stale.exists() and not old.exists()
        assert kept.exists()
    finally:
        server.stop()
        os.close(holder)

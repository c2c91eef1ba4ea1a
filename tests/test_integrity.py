"""Two writers of one file: a sync reports success only when the whole target equals its source.

An in-place sync hashes the target first and reads back only the blocks it
wrote; without a lease, a second writer in between left a mix that the sync
still reported as verified. These tests force that interleaving (through
the progress counters, which a sync calls while it moves data) and check
that the other writer is refused with one clear line and the target ends
exactly as the source.
"""

from __future__ import annotations

import fcntl
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from conftest import held_lease, random_bytes, run_cli

from pdiffcopy.engine.filejob import Progress
from pdiffcopy.api import sync

#: Big enough for several 1 MiB blocks, small enough to sync in a blink.
SIZE = 4 * 1024 * 1024
BLOCK = 1024 * 1024

#: The tree engine's smallest file for the block delta is 8 MiB.
TREE_BIG = 9 * 1024 * 1024


def raw_patch(url: str, offset: int, data: bytes):
    """A plain HTTP client writing ``data`` at ``offset`` (no lease): (status, JSON body)."""
    request = urllib.request.Request(url, data=data, method="PATCH", headers={
        "Content-Type": "application/octet-stream",
        "Content-Range": f"bytes {offset}-{offset + len(data) - 1}/*"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


class Hook(Progress):
    """Progress counters that run ``action`` once, when the sync has written and starts verifying."""

    def __init__(self, action) -> None:
        self.action = action
        self.outcome = None
        super().__init__()

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if value == "verifying" and self.action is not None:
            action, self.action = self.action, None
            self.outcome = action()


def two_versions(seed: int, size: int = SIZE):
    """A target and a source that differs from it in its first block only."""
    old = random_bytes(size, seed)
    new = bytearray(old)
    new[:4096] = random_bytes(4096, seed + 1)
    return old, bytes(new)


def big_file_trees(target: Path, source: Path, seed: int):
    """Trees with one big file, ``big.img``: the old version in ``target``, the new in ``source``.

    Both directories are made; returns (old, new).
    """
    old, new = two_versions(seed, TREE_BIG)
    for directory, data in ((target, old), (source, new)):
        directory.mkdir()
        (directory / "big.img").write_bytes(data)
    return old, new


def test_push_refuses_a_plain_write_in_the_middle(server, unique, tmp_path):
    old, new = two_versions(11)
    (server.root / unique).write_bytes(old)
    source = tmp_path / "source.img"
    source.write_bytes(new)
    # A plain client rewrites the last block after the sync wrote the first.
    hook = Hook(lambda: raw_patch(server.url(unique), SIZE - BLOCK, b"\xff" * 4096))
    result = sync(str(source), server.url(unique), block_size=BLOCK, concurrency=1, progress=hook)
    status, answer = hook.outcome
    assert (server.root / unique).read_bytes() == new, "the sync reported success over a mix"
    assert result.verified
    assert status == 423 and answer["status"] == 423
    assert "being written by another client" in answer["error"]


def test_second_push_during_a_push_fails_with_one_line(server, unique, tmp_path):
    old, new = two_versions(21)
    other = bytearray(old)
    other[-4096:] = random_bytes(4096, 23)  # the second push rewrites another block
    (server.root / unique).write_bytes(old)
    first, second = tmp_path / "first.img", tmp_path / "second.img"
    first.write_bytes(new)
    second.write_bytes(bytes(other))
    hook = Hook(lambda: run_cli(str(second), server.url(unique), "-c", "1", "-b", str(BLOCK),
                                timeout=60))
    result = sync(str(first), server.url(unique), block_size=BLOCK, concurrency=1, progress=hook)
    loser = hook.outcome
    assert (server.root / unique).read_bytes() == new
    assert result.verified
    assert loser.returncode != 0, loser.stdout
    lines = loser.stderr.strip().splitlines()
    assert len(lines) == 1 and "being written by another client" in lines[0], loser.stderr
    assert "Traceback" not in loser.stderr


def test_push_over_a_held_lease_is_refused(server, unique, tmp_path):
    old, new = two_versions(31)
    (server.root / unique).write_bytes(old)
    source = tmp_path / "source.img"
    source.write_bytes(new)
    with held_lease(server, unique) as lease:
        for atomic in ((), ("--atomic",)):
            completed = run_cli(str(source), server.url(unique), "-b", str(BLOCK), *atomic, timeout=60)
            assert completed.returncode != 0
            assert "being written by another client" in completed.stderr, completed.stderr
            assert (server.root / unique).read_bytes() == old
        end = urllib.request.Request(f"{server.base}/.pdiffcopy/lease/{unique}", method="DELETE",
                                     headers={"X-Pdiffcopy-Lease": lease})
        with urllib.request.urlopen(end, timeout=30) as response:
            assert response.status == 200
    completed = run_cli(str(source), server.url(unique), "-b", str(BLOCK), timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert (server.root / unique).read_bytes() == new


def test_pull_into_a_locked_local_file_is_refused(server, unique, tmp_path):
    old, new = two_versions(41)
    (server.root / unique).write_bytes(new)
    target = tmp_path / "target.img"
    target.write_bytes(old)
    with open(target, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another pdiffcopy updating it would
        completed = run_cli(server.url(unique), str(target), "-b", str(BLOCK), timeout=60)
    assert completed.returncode != 0
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and "being written by another pdiffcopy" in lines[0], completed.stderr
    assert target.read_bytes() == old
    assert run_cli(server.url(unique), str(target), "-b", str(BLOCK), timeout=60).returncode == 0
    assert target.read_bytes() == new


class TreeHook:
    """Tree progress counters that run ``action`` once, after the first unit."""

    def __init__(self, action) -> None:
        from pdiffcopy.engine.treesync import TreeProgress

        self.progress = TreeProgress(1)
        original = self.progress.add
        self.outcome = None

        def add(slot: int, *counts: int) -> None:
            nonlocal action
            if action is not None:
                todo, action = action, None
                self.outcome = todo()
            original(slot, *counts)

        self.progress.add = add  # type: ignore[method-assign]


def test_tree_push_of_a_big_changed_file_refuses_a_plain_write(server, tmp_path):
    from pdiffcopy.local.localtree import LocalTree
    from pdiffcopy.transport.remotetree import RemoteTree
    from pdiffcopy.engine.treesync import TreeOptions, run_tree_sync

    name = f"tree-{os.getpid()}"
    remote, source = server.root / name, tmp_path / "src"
    _, new = big_file_trees(remote, source, 51)
    os.utime(source / "big.img", ns=(1, 1))  # another time: compared, then synced by the delta
    # Between the big file's checked segment and its end, a plain client
    # rewrites a block the segment left alone.
    hook = TreeHook(lambda: raw_patch(f"{server.base}/{name}/big.img", TREE_BIG - BLOCK,
                                      b"\xee" * 4096))
    source_tree, target_tree = LocalTree(str(source)), RemoteTree(f"{server.base}/{name}/")
    try:
        result = run_tree_sync(source_tree, target_tree, TreeOptions(concurrency=1, block_size=BLOCK),
                           hook.progress)
    finally:
        source_tree.close()
        target_tree.close()
    status, answer = hook.outcome
    assert (remote / "big.img").read_bytes() == new, "the tree sync reported success over a mix"
    assert not result.failures and result.files_copied == 1
    assert status == 423, answer


def test_tree_push_of_a_big_file_under_lease_fails_that_file(server, tmp_path):
    name = f"tree-leased-{os.getpid()}"
    remote, source = server.root / name, tmp_path / "src"
    old, _ = big_file_trees(remote, source, 61)
    (source / "small.txt").write_bytes(b"small")
    with held_lease(server, f"{name}/big.img"):
        completed = run_cli(f"{source}/", f"{server.base}/{name}/", "-b", str(BLOCK), timeout=60)
    assert completed.returncode == 23, completed.stderr
    assert "big.img" in completed.stderr and "being written by another client" in completed.stderr
    assert "Traceback" not in completed.stderr
    assert (remote / "big.img").read_bytes() == old
    assert (remote / "small.txt").read_bytes() == b"small"


def test_local_tree_big_file_in_place_holds_a_lock(tmp_path):
    """A local tree sync updating a big file in place refuses when another holds its lock."""
    source, target = tmp_path / "src", tmp_path / "dst"
    old, _ = big_file_trees(target, source, 71)
    with open(target / "big.img", "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        completed = run_cli(f"{source}/", f"{target}/", "-b", str(BLOCK), timeout=60)
    assert completed.returncode == 23, completed.stderr
    assert "being written by another pdiffcopy" in completed.stderr
    assert Path(target / "big.img").read_bytes() == old


# -- durability of tree syncs (--fsync) ---------------------------------------

#: Small files in two directories: each is written whole, by a batch.
FSYNC_FILES = 12


def small_tree(root: Path) -> None:
    for index in range(FSYNC_FILES):
        directory = root / ("a" if index % 2 else "b")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"f{index}").write_bytes(random_bytes(1000 + index, index))


def count_fsyncs(log: Path) -> int:
    """The successful fsync and fdatasync calls an ``strace -f`` log shows."""
    return sum(1 for line in log.read_text().splitlines()
               if ("fsync(" in line or "fdatasync(" in line) and line.rstrip().endswith("= 0"))


def strace(*command: str, log: Path) -> list:
    import shutil

    import pytest

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    return ["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync", "-o", str(log), *command]


def test_local_tree_fsync_flushes_every_file_and_directory(tmp_path):
    import subprocess
    import sys

    source = tmp_path / "src"
    small_tree(source)
    counts = {}
    for flag in ((), ("--fsync",)):
        target, log = tmp_path / f"dst{len(flag)}", tmp_path / f"strace{len(flag)}.log"
        command = strace(sys.executable, "-m", "pdiffcopy", "-c", "1", "-q", *flag, f"{source}/",
                         f"{target}/", log=log)
        completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert completed.returncode == 0, completed.stderr
        counts[flag] = count_fsyncs(log)
    # Every file, and the directories a, b and the root that got new names.
    assert counts[("--fsync",)] - counts[()] >= FSYNC_FILES + 2, counts


def test_tree_push_fsync_is_honoured_by_the_server(tmp_path):
    import socket
    import subprocess
    import sys
    import time

    from conftest import free_port

    root, log = tmp_path / "root", tmp_path / "server-strace.log"
    root.mkdir()
    port = free_port()
    command = strace(sys.executable, "-m", "pdiffcopy", "--root", str(root), "--listen",
                     f"127.0.0.1:{port}", "-c", "1", log=log)
    env = {k: v for k, v in os.environ.items() if k != "PDIFFCOPY_TOKEN"}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "server did not start"
                time.sleep(0.1)
        source = tmp_path / "src"
        small_tree(source)
        base = f"http://127.0.0.1:{port}"
        completed = run_cli(f"{source}/", f"{base}/plain/", "-c", "1", timeout=60)
        assert completed.returncode == 0, completed.stderr
        plain = count_fsyncs(log)
        completed = run_cli("--fsync", f"{source}/", f"{base}/flushed/", "-c", "1", timeout=60)
        assert completed.returncode == 0, completed.stderr
        time.sleep(0.2)  # strace writes its log as the calls return
        flushed = count_fsyncs(log) - plain
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
    assert flushed >= FSYNC_FILES + 2, (plain, flushed)
    assert (root / "flushed" / "a" / "f1").read_bytes() == (source / "a" / "f1").read_bytes()


def lease_files(directory) -> list:
    """The lease files of a lease directory (not the directories of the server's other state)."""
    return [name for name in os.listdir(directory) if not os.path.isdir(os.path.join(directory, name))]


def test_lease_files_do_not_pile_up(tmp_path):
    """Every write consults a lease file; an empty one is removed, so months of writes leave none."""
    from pdiffcopy.server.app import ServerConfig, create_app

    root, leases = tmp_path / "root", tmp_path / "leases"
    root.mkdir()
    leases.mkdir()
    (root / "a.img").write_bytes(b"\0" * 8192)
    client = create_app(ServerConfig(root=str(root), lease_directory=str(leases), serve_anyone=True)).test_client()
    answer = client.patch("/a.img", data=b"x" * 10, headers={"Content-Range": "bytes 0-9/*"})
    assert answer.status_code == 200 and lease_files(leases) == []
    lease = client.post("/.pdiffcopy/lease/a.img").get_json()["lease"]
    assert len(lease_files(leases)) == 1
    refused = client.patch("/a.img", data=b"y" * 10, headers={"Content-Range": "bytes 0-9/*"})
    assert refused.status_code == 423 and refused.get_json()["status"] == 423
    assert client.post("/.pdiffcopy/lease/a.img").status_code == 423
    answer = client.patch("/a.img", data=b"z" * 10, headers={"Content-Range": "bytes 0-9/*",
                                                             "X-Pdiffcopy-Lease": lease})
    assert answer.status_code == 200
    assert client.delete("/.pdiffcopy/lease/a.img", headers={"X-Pdiffcopy-Lease": lease}).status_code == 200
    assert lease_files(leases) == []
    # Ended: the old id no longer writes, and says why.
    stale = client.patch("/a.img", data=b"w" * 10, headers={"Content-Range": "bytes 0-9/*",
                                                            "X-Pdiffcopy-Lease": lease})
    assert stale.status_code == 412 and "Lost the write lease" in stale.get_json()["error"]
    assert (root / "a.img").read_bytes()[:10] == b"z" * 10


def test_a_killed_servers_lease_directory_is_swept_at_start(tmp_path, monkeypatch):
    import subprocess

    from pdiffcopy.server.leasetable import LeaseTable

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"pdiffcopy-leases-{gone.pid}-abcd1234"
    stale.mkdir()
    (stale / "1-2").write_bytes(b" " * 128)
    alive = tmp_path / f"pdiffcopy-leases-{os.getpid()}-efgh5678"
    alive.mkdir()
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    leases = LeaseTable()
    assert not stale.exists()
    assert alive.exists()
    assert Path(leases.directory).parent == tmp_path

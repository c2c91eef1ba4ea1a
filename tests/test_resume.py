"""--partial: an interrupted sync of a new target keeps what it wrote, and the next run resumes from it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import pdiffcopy_command, random_bytes, run_cli, start_server
from pdiffcopy.api import sync
from pdiffcopy.local import descriptors
from pdiffcopy.local.sweep import STALE_TEMPORARY_SECONDS

#: The file every interrupted sync moves: with BWLIMIT it takes seconds, so the
#: kill lands in the middle, where the partial file's content says it is.
SIZE = 32 * 1024 * 1024
BWLIMIT = "8M"
BLOCK = 1024 * 1024



def partial_of(path: Path) -> Path:
    return path.parent / f".{path.name}.pdiffcopy-partial"


def arrived(path: Path, data: bytes) -> int:
    """The bytes of ``path`` that already hold ``data``'s, whole blocks counted (a file is made
    full size, preallocated, before the data arrives)."""
    count = 0
    try:
        with open(path, "rb") as handle:
            for offset in range(0, len(data), BLOCK):
                block = handle.read(BLOCK)
                if block == data[offset:offset + BLOCK]:
                    count += len(block)
    except FileNotFoundError:
        pass
    return count


def interrupt_at(arguments, watched: Path, data: bytes, fraction: float, signum: int, log: Path) -> int:
    """Run the client until ``watched`` holds ``fraction`` of ``data``, signal it; return the bytes seen then."""
    with open(log, "w") as handle:  # a file, not a pipe: nothing waits on a reader
        process = subprocess.Popen(pdiffcopy_command("-c", "2", "--bwlimit", BWLIMIT, *arguments),
                                   stdout=subprocess.DEVNULL, stderr=handle, start_new_session=True)
    seen = 0
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            seen = arrived(watched, data)
            if seen >= fraction * len(data):
                process.send_signal(signum)
                break
            time.sleep(0.02)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert seen >= fraction * len(data), f"the sync ended before {fraction:.0%}: {log.read_text()}"
    assert process.returncode != 0, log.read_text()
    if signum != signal.SIGKILL:
        assert process.returncode == 20, log.read_text()
        assert "Traceback" not in log.read_text()
    return seen


def ends(server, tmp_path: Path, unique: str, direction: str):
    """(source path, target path, source argument, target argument) of a new-file pull or push."""
    if direction == "pull":
        source, target = server.root / unique, tmp_path / "target.img"
        return source, target, server.url(unique), str(target)
    source, target = tmp_path / "source.img", server.root / unique
    return source, target, str(source), server.url(unique)


@pytest.mark.parametrize("signum, fraction", [(signal.SIGKILL, 0.3), (signal.SIGINT, 0.3),
                                              (signal.SIGKILL, 0.6), (signal.SIGINT, 0.6)],
                         ids=["kill-30", "int-30", "kill-60", "int-60"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_an_interrupted_new_file_resumes(server, tmp_path, unique, direction, signum, fraction):
    source, target, source_arg, target_arg = ends(server, tmp_path, unique, direction)
    data = random_bytes(SIZE, seed=int(fraction * 10) + signum)
    source.write_bytes(data)
    seen = interrupt_at(("--partial", source_arg, target_arg), partial_of(target), data, fraction, signum,
                        tmp_path / "client.log")
    assert not target.exists()  # nothing half-written under the target's name
    assert partial_of(target).exists(), (tmp_path / "client.log").read_text()
    result = sync(source_arg, target_arg, partial=True, concurrency=2)
    assert result.verified
    assert target.read_bytes() == data
    # Only what the killed run had not written moves (a block or two in flight when it died again).
    assert result.bytes_moved <= SIZE - seen + 4 * BLOCK, (result.bytes_moved, seen)
    assert not partial_of(target).exists()


def test_the_short_option_is_rsyncs_partial_progress(server, tmp_path, unique):
    source, target, source_arg, target_arg = ends(server, tmp_path, unique, "pull")
    data = random_bytes(SIZE, seed=7)
    source.write_bytes(data)
    seen = interrupt_at(("-P", source_arg, target_arg), partial_of(target), data, 0.5, signal.SIGTERM,
                        tmp_path / "client.log")
    completed = run_cli("-P", "--stats", source_arg, target_arg)
    assert completed.returncode == 0, completed.stderr
    assert target.read_bytes() == data
    assert not partial_of(target).exists()
    assert seen < SIZE


def test_a_changed_source_replaces_what_the_partial_file_held(server, tmp_path, unique):
    source, target, source_arg, target_arg = ends(server, tmp_path, unique, "pull")
    old = random_bytes(SIZE, seed=11)
    source.write_bytes(old)
    interrupt_at(("--partial", source_arg, target_arg), partial_of(target), old, 0.5, signal.SIGKILL,
                 tmp_path / "client.log")
    changed = random_bytes(SIZE + 12345, seed=12)
    source.write_bytes(changed)
    result = sync(source_arg, target_arg, partial=True, concurrency=2)
    assert result.verified and result.bytes_moved == len(changed)  # nothing of the old source was kept
    assert target.read_bytes() == changed
    assert not partial_of(target).exists()


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_only_partial_keeps_what_an_interrupted_sync_wrote(server, tmp_path, unique, direction):
    source, target, source_arg, target_arg = ends(server, tmp_path, unique, direction)
    data = random_bytes(SIZE, seed=13)
    source.write_bytes(data)
    watched = target.parent
    (tmp_path / "client.log").touch()
    before = set(watched.iterdir())

    def temporary() -> Path:
        new = [p for p in watched.iterdir() if p not in before and descriptors.is_temporary_name(p.name)]
        return new[0] if new else watched / "none-yet"

    # Without --partial, as ever: the temporary goes with the interrupted sync.
    with open(tmp_path / "client.log", "w") as handle:
        process = subprocess.Popen(pdiffcopy_command("-c", "2", "--bwlimit", BWLIMIT, source_arg, target_arg),
                                   stdout=subprocess.DEVNULL, stderr=handle, start_new_session=True)
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline and arrived(temporary(), data) < SIZE // 3:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    assert process.returncode == 20, (tmp_path / "client.log").read_text()
    assert set(watched.iterdir()) == before
    # With it, the same interruption keeps the partial file, and says so.
    interrupt_at(("--partial", source_arg, target_arg), partial_of(target), data, 1 / 3, signal.SIGINT,
                 tmp_path / "client.log")
    assert set(watched.iterdir()) == before | {partial_of(target)}
    assert "run again with --partial" in (tmp_path / "client.log").read_text()
    partial_of(target).unlink()


def test_local_partial_resumes_and_stale_ones_are_swept(tmp_path):
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    data = random_bytes(4 * BLOCK + 5, seed=14)
    source.write_bytes(data)
    partial = partial_of(target)
    partial.write_bytes(data[: 2 * BLOCK])  # what a killed local copy left
    old = tmp_path / ".other.img.pdiffcopy-partial"
    old.write_bytes(b"left a day ago")
    then = time.time() - STALE_TEMPORARY_SECONDS - 60
    os.utime(old, (then, then))
    result = sync(str(source), str(target), partial=True, concurrency=2)
    assert result.verified and target.read_bytes() == data
    assert result.bytes_moved == len(data) - 2 * BLOCK
    assert not partial.exists() and not old.exists()


def test_the_server_sweeps_stale_partial_files_and_keeps_fresh_ones(tmp_path):
    root = tmp_path / "root"
    (root / "deep").mkdir(parents=True)
    stale, fresh = root / "deep" / ".a.img.pdiffcopy-partial", root / ".b.img.pdiffcopy-partial"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    then = time.time() - STALE_TEMPORARY_SECONDS - 60
    os.utime(stale, (then, then))
    os.utime(fresh, (time.time() - 3600, time.time() - 3600))  # an hour: a dead pid's grace would be over
    server = start_server(root, tmp_path / "server.log")
    try:
        assert not stale.exists() and fresh.exists()
    finally:
        server.stop()


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_partial_files_are_never_tree_data(server, tmp_path, unique, direction):
    if direction == "pull":
        source, target = server.root / unique, tmp_path / "target"
        arguments = (server.url(unique) + "/", str(target))
    elif direction == "push":
        source, target = tmp_path / "source", server.root / unique
        arguments = (str(source) + "/", server.url(unique))
    else:
        source, target = tmp_path / "source", tmp_path / "target"
        arguments = (str(source) + "/", str(target))
    source.mkdir()
    (source / "data.txt").write_bytes(b"data")
    (source / ".big.img.pdiffcopy-partial").write_bytes(b"being resumed")
    completed = run_cli("-a", *arguments)
    assert completed.returncode == 0, completed.stderr
    assert sorted(p.name for p in target.iterdir()) == ["data.txt"]
    kept = target / ".big.img.pdiffcopy-partial"
    kept.write_bytes(b"the target's own partial file")
    completed = run_cli("-a", "--delete", *arguments)  # not extraneous data either
    assert completed.returncode == 0, completed.stderr
    assert kept.read_bytes() == b"the target's own partial file"


@pytest.mark.parametrize("direction", ["local", "push"])
def test_a_partial_name_that_leads_elsewhere_is_refused(server, tmp_path, unique, direction):
    outside = tmp_path / "outside.img"
    outside.write_bytes(b"not to be touched")
    source = tmp_path / "source.img"
    source.write_bytes(random_bytes(BLOCK, seed=15))
    if direction == "local":
        target, target_arg = tmp_path / "target.img", str(tmp_path / "target.img")
    else:
        target, target_arg = server.root / unique, server.url(unique)
    partial_of(target).symlink_to(outside)
    completed = run_cli("--partial", str(source), target_arg)
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr and len(completed.stderr.strip().splitlines()) == 1
    assert "not a regular file" in completed.stderr, completed.stderr
    assert outside.read_bytes() == b"not to be touched" and not target.exists()
    partial_of(target).unlink()


def test_the_server_refuses_partial_names_outside_its_root(server, tmp_path):
    import urllib.error
    import urllib.request

    outside = server.root.parent / ".escape.img.pdiffcopy-partial"
    outside.write_bytes(b"outside the root")
    for method, path in (("DELETE", "/.pdiffcopy/temporary/../.escape.img.pdiffcopy-partial"),
                         ("DELETE", "/.pdiffcopy/temporary/%2E%2E/.escape.img.pdiffcopy-partial"),
                         ("POST", "/.pdiffcopy/rename/x/../../.escape.img.pdiffcopy-partial?to=stolen.img")):
        request = urllib.request.Request(server.base + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert 400 <= refused.value.code < 500
    assert outside.read_bytes() == b"outside the root"
    assert not (server.root / "stolen.img").exists()
    # Inside the root a partial file is a temporary like any other: a client may remove it.
    inside = server.root / ".inside.img.pdiffcopy-partial"
    inside.write_bytes(b"left by a push")
    request = urllib.request.Request(server.base + "/.pdiffcopy/temporary/.inside.img.pdiffcopy-partial",
                                     method="DELETE")
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200
    assert not inside.exists()


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_a_big_new_file_of_a_tree_resumes(server, tmp_path, unique, direction):
    from pdiffcopy.api import sync_tree
    from pdiffcopy.engine.treerunner import RANGE_SIZE

    size = RANGE_SIZE + 3 * BLOCK + 17  # a big file: copied by ranges, in two segments
    data = random_bytes(size, seed=16)
    if direction == "pull":
        source, target = server.root / unique, tmp_path / "target"
        source_arg, target_arg = server.url(unique) + "/", str(target)
    else:
        source, target = tmp_path / "source", server.root / unique
        source_arg, target_arg = str(source) + "/", server.url(unique)
    source.mkdir()
    (source / "big.img").write_bytes(data)
    (source / "small.txt").write_bytes(b"small")
    seen = interrupt_at(("--partial", source_arg, target_arg), partial_of(target / "big.img"), data, 0.5,
                        signal.SIGKILL, tmp_path / "client.log")
    assert not (target / "big.img").exists()
    result = sync_tree(source_arg.rstrip("/"), target_arg, partial=True, concurrency=2)
    assert not result.failures
    assert (target / "big.img").read_bytes() == data
    assert result.bytes_moved <= size - seen + 4 * BLOCK + len(b"small"), (result.bytes_moved, seen)
    assert sorted(p.name for p in target.iterdir()) == ["big.img", "small.txt"]

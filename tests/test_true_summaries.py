"""A tree sync's summary says what happened: every count it prints is what is on the target.

A sync that stops (a full target, a read-only one) says so in one line with
the files copied, unchanged, failed and not synced, each counted here on the
target afterwards; it never claims that "everything else was synced". What the
other side has said it will not apply (owners for a server that does not
trust its clients, or that does not run as root, as over ssh to another
user) is neither a failure nor a change. Each scenario runs locally, pushed
to a server whose root is the small file system, and pulled into one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict

import pytest

from conftest import random_bytes, run_cli, start_server

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="mounting file systems and setting owners needs root")

#: The small target file system: room for about 40 of the source's files.
TINY_SIZE = "8m"
FILE_SIZE = 200 * 1024
DIRECTORIES, FILES_PER_DIRECTORY = 4, 25
#: Files the target already holds as the source has them (content and time): unchanged.
ALREADY_THERE = 10

OTHER_UID = 1234  # neither root nor the user of the non-root server
NOBODY = 65534


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli("--no-progress", *map(str, args), timeout=120)


def mount_tmpfs(directory: Path, size: str = TINY_SIZE) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@pytest.fixture
def mounts():
    """Mount points to unmount at the end of the test (the last mounted first)."""
    mounted: list = []
    yield mounted
    for directory in reversed(mounted):
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def make_source(root: Path) -> Dict[str, bytes]:
    """Files of :data:`FILE_SIZE` in a few directories; their contents by path."""
    contents = {}
    for d in range(DIRECTORIES):
        (root / f"d{d}").mkdir(parents=True, exist_ok=True)
        for f in range(FILES_PER_DIRECTORY):
            path = f"d{d}/f{f:02}"
            contents[path] = random_bytes(FILE_SIZE, seed=d * 100 + f)
            (root / path).write_bytes(contents[path])
    return contents


def put_some_in_place(source: Path, target: Path, contents: Dict[str, bytes]) -> None:
    """The first :data:`ALREADY_THERE` files as the source has them, times too (a quick check passes)."""
    for path in sorted(contents)[:ALREADY_THERE]:
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / path, target / path)


def on_target(source: Path, target: Path, contents: Dict[str, bytes]) -> int:
    """Files on the target with the source's whole content and time."""
    count = 0
    for path, data in contents.items():
        try:
            if (target / path).read_bytes() == data and \
                    os.stat(target / path).st_mtime_ns == os.stat(source / path).st_mtime_ns:
                count += 1
        except FileNotFoundError:
            continue
    return count


def assert_no_partial_files(target: Path, contents: Dict[str, bytes]) -> None:
    for directory, _, names in os.walk(target):
        for name in names:
            path = str((Path(directory) / name).relative_to(target))
            assert not name.startswith("."), f"temporary left: {path}"
            assert (Path(directory) / name).read_bytes() == contents[path], f"partial file: {path}"


def counts_of(line: str) -> Dict[str, int]:
    """The numbers of a stop line: copied, unchanged, failed, not synced."""
    found = {}
    for key, pattern in (("copied", r"(\d+) file\(s\) copied"), ("unchanged", r"(\d+) unchanged"),
                         ("failed", r"(\d+) path\(s\) failed"), ("not synced", r"(\d+) not synced")):
        match = re.search(pattern, line)
        assert match, f"no {key!r} count in {line!r}"
        found[key] = int(match.group(1))
    return found


def error_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if " ERROR " in line]


def notes(stderr: str) -> list:
    return [line for line in stderr.splitlines() if " WARNING " in line]


class Ends:
    """The source and target of one mode, as this machine's disk sees them and as arguments."""

    def __init__(self, source: Path, target: Path, source_arg: str, target_arg: str) -> None:
        self.source, self.target = source, target
        self.source_arg, self.target_arg = source_arg, target_arg


def small_target_ends(mode: str, tmp_path: Path, mounts: list, request, prepare=None) -> Ends:
    """A source of :func:`make_source`'s files and a target directory ``ft`` on a small tmpfs.

    ``prepare(target)`` runs once the target exists, before the server starts (a push's
    server serves the tmpfs). Local: both here; push: to a server whose root is the tmpfs;
    pull: from the session's server into the tmpfs here.
    """
    tiny = tmp_path / "tiny"
    mount_tmpfs(tiny)
    mounts.append(tiny)
    target = tiny / "ft"
    target.mkdir()
    if mode == "pull":
        server = request.getfixturevalue("server")
        name = f"summaries-{os.getpid()}-{request.node.name}".replace("[", "-").replace("]", "")
        source = server.root / name
        source_arg = server.url(name) + "/"
    else:
        source = tmp_path / "src"
        source_arg = f"{source}/"
    request.node.contents = make_source(source)
    if prepare is not None:
        prepare(source, target)
    if mode == "push":
        pushed = start_server(tiny, tmp_path / "server.log")
        request.addfinalizer(pushed.stop)
        return Ends(source, target, source_arg, pushed.url("ft") + "/")
    return Ends(source, target, source_arg, str(target) + "/")


# -- 1. a full target ------------------------------------------------------


@needs_root
@pytest.mark.parametrize("mode", ["local", "push", "pull"])
def test_a_sync_stopped_by_a_full_target_counts_what_is_on_it(mode, tmp_path, mounts, request):
    ends = small_target_ends(mode, tmp_path, mounts, request,
                             prepare=lambda source, target: put_some_in_place(
                                 source, target, request.node.contents))
    contents = request.node.contents
    done = cli("-a", ends.source_arg, ends.target_arg)
    assert done.returncode == 23, done.stderr
    assert "Traceback" not in done.stderr
    assert "everything else was synced" not in done.stderr
    assert "Synchronised" not in done.stderr  # it did not: it stopped
    assert_no_partial_files(ends.target, contents)
    present = on_target(ends.source, ends.target, contents)
    assert ALREADY_THERE < present < len(contents), "the test's sizes no longer fill the target midway"
    last = error_lines(done.stderr)[-1]
    assert "full" in last and "stopped" in last, done.stderr
    counts = counts_of(last)
    assert counts["unchanged"] == ALREADY_THERE, done.stderr
    assert counts["copied"] + counts["unchanged"] == present, done.stderr
    assert counts["failed"] + counts["not synced"] == len(contents) - present, done.stderr
    assert counts["failed"] <= 4, done.stderr  # the file each worker was writing, not one per file


# -- 2. a read-only target -------------------------------------------------


@needs_root
@pytest.mark.parametrize("mode", ["local", "push", "pull"])
def test_a_read_only_target_stops_the_sync_in_one_line(mode, tmp_path, mounts, request):
    ends = small_target_ends(mode, tmp_path, mounts, request)
    contents = request.node.contents
    (ends.target / "old").write_bytes(b"an older file")
    subprocess.run(["mount", "-o", "remount,ro", str(tmp_path / "tiny")], check=True)
    done = cli("-a", ends.source_arg, ends.target_arg)
    assert done.returncode == 23, done.stderr
    assert "Traceback" not in done.stderr
    errors = error_lines(done.stderr)
    assert len(errors) == 1, done.stderr
    assert "Read-only file system" in errors[0] and "stopped" in errors[0], done.stderr
    assert "everything else was synced" not in done.stderr and "Synchronised" not in done.stderr
    # Nothing else but a note of what the server does not keep (owners, for -a).
    assert all("not kept" in line for line in done.stderr.splitlines() if line not in errors), done.stderr
    counts = counts_of(errors[0])
    assert counts["copied"] == counts["unchanged"] == 0, done.stderr
    # Every file, and every directory (none was made).
    assert counts["failed"] + counts["not synced"] == len(contents) + DIRECTORIES, done.stderr
    assert sorted(os.listdir(ends.target)) == ["old"]


# -- 3. what the other side will not apply ----------------------------------


def linked_tree_of_others(root: Path) -> None:
    """Files of another user: two with two names each, one with one."""
    (root / "sub").mkdir(parents=True)
    (root / "a").write_bytes(b"two names\n")
    os.link(root / "a", root / "b")
    (root / "sub" / "c").write_bytes(b"two names, one in a directory\n")
    os.link(root / "sub" / "c", root / "d")
    (root / "plain").write_bytes(b"one name\n")
    for path in ("a", "sub/c", "plain", "sub", ""):
        os.chown(root / path, OTHER_UID, OTHER_UID)


@pytest.fixture
def non_root_server(tmp_path):
    """A server trusting its clients that runs as nobody (as ``pdiffcopy --serve`` over ssh to a user)."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    as_nobody = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    probe = subprocess.run([*as_nobody, sys.executable, "-c", "import pdiffcopy.server.app"], capture_output=True,
                           text=True, cwd="/", timeout=60)
    if probe.returncode != 0:  # a checkout in a directory only root may enter, say
        pytest.skip(f"uid {NOBODY} cannot run this pdiffcopy: {probe.stderr.strip()[-200:]}")
    root = Path(tempfile.mkdtemp(prefix="pdiffcopy-nobody-", dir="/tmp"))  # pytest's tmp is root's only
    os.chmod(root, 0o755)
    os.chown(root, NOBODY, NOBODY)
    running = start_server(root, tmp_path / "server.log", extra=("--trust-clients",),
                           wrapper=as_nobody)
    yield running
    running.stop()
    shutil.rmtree(root, ignore_errors=True)


@needs_root
@pytest.mark.parametrize("side", ["untrusting", "non-root"])
def test_owners_the_server_will_not_keep_are_neither_failures_nor_changes(side, tmp_path, request):
    server = request.getfixturevalue("server" if side == "untrusting" else "non_root_server")
    source = tmp_path / "src"
    linked_tree_of_others(source)
    url = server.url(f"owners-{side}-{os.getpid()}") + "/"
    first = cli("-aH", f"{source}/", url)
    assert first.returncode == 0, first.stderr
    assert len(notes(first.stderr)) <= 1, first.stderr
    for _ in range(2):
        again = cli("-aH", f"{source}/", url)
        assert again.returncode == 0, again.stderr
        assert not error_lines(again.stderr), again.stderr
        assert len(notes(again.stderr)) <= 1, again.stderr
    for options in ("-aH", "-a"):
        diff = cli("--diff", options, f"{source}/", url)
        assert diff.returncode == 0, diff.stderr
        assert diff.stdout == "", diff.stdout
        assert len(notes(diff.stderr)) <= 1, diff.stderr


@needs_root
def test_a_stop_counts_the_pieces_never_started_and_the_links_never_made(tmp_path, mounts, monkeypatch):
    """In the engine, with a plan of many pieces, forked workers and hard links (-H): what the
    pieces after the stop held is counted not synced, as the rest of the piece that stopped."""
    from pdiffcopy.core import treestream
    from pdiffcopy.engine import treerunner
    from pdiffcopy.engine.options import TreeOptions
    from pdiffcopy.engine.treesync import run_tree_sync
    from pdiffcopy.local.localtree import LocalTree

    monkeypatch.setattr(treestream, "PIECE_ACTIONS", 240)
    monkeypatch.setattr(treerunner, "INLINE_FILES", 0)  # every piece forks its workers
    monkeypatch.setattr(treerunner, "INLINE_BYTES", 0)
    monkeypatch.setattr(treerunner, "BATCH_FILES", 16)
    source = tmp_path / "src"
    contents = {}
    for d in range(12):
        (source / f"d{d:02}").mkdir(parents=True)
        for f in range(60):
            path = f"d{d:02}/f{f:02}"
            contents[path] = random_bytes(20 * 1024, seed=d * 100 + f)
            (source / path).write_bytes(contents[path])
        os.link(source / f"d{d:02}" / "f00", source / f"d{d:02}" / "g00")  # a second name: a link to make
    tiny = tmp_path / "tiny"
    mount_tmpfs(tiny, "4m")
    mounts.append(tiny)
    result = run_tree_sync(LocalTree(f"{source}/"), LocalTree(str(tiny / "ft")),
                       TreeOptions(times=True, hard_links=True, concurrency=2))
    assert result.stopped == "The target file system is full"
    present = on_target(source, tiny / "ft", contents)
    assert 0 < present < len(contents) / 2, "the test's sizes no longer fill the target in its first pieces"
    assert_no_partial_files(tiny / "ft", {**contents, **{f"d{d:02}/g00": contents[f"d{d:02}/f00"]
                                                         for d in range(12)}})
    linked = sum(1 for d in range(12) if (tiny / "ft" / f"d{d:02}" / "g00").exists())
    failed = [path for path, _ in result.failures if path]
    assert len(failed) == len(result.failures) <= 4, result.failures
    assert result.files_copied == present and result.unchanged == 0
    assert result.linked == linked
    # Each file and link not there, and each directory not made, failed or was not tried.
    directories = sum(1 for d in range(12) if (tiny / "ft" / f"d{d:02}").exists())
    assert len(failed) + result.not_synced == len(contents) - present + 12 - linked + 12 - directories

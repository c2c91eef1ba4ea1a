"""rsync's transfer rules and quick check: -u, --existing, --ignore-existing, --size-only, -I, --modify-window.

Each case starts two copies of one target, runs rsync on one and pdiffcopy
(same options) on the other, and compares bytes, modes and times, locally,
pulled and pushed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from test_tree import snapshot

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")

SECOND = 10 ** 9
PAST = 1_600_000_000 * SECOND


def put(root: Path, name: str, data: bytes, mtime_ns: int, mode: int = 0o644) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def scenario(source: Path, target: Path) -> None:
    """Files that each rule treats its own way."""
    put(source, "newer-in-target", b"source", PAST)
    put(target, "newer-in-target", b"target", PAST + 100 * SECOND)
    put(source, "older-in-target", b"source", PAST + 100 * SECOND)
    put(target, "older-in-target", b"target", PAST)
    put(source, "same-size-other-time", b"AAAA", PAST + 50 * SECOND, 0o600)
    put(target, "same-size-other-time", b"BBBB", PAST)
    put(source, "same-size-same-time", b"CCCC", PAST)
    put(target, "same-size-same-time", b"DDDD", PAST)
    put(source, "nanoseconds-apart", b"EEEE", PAST + 123)
    put(target, "nanoseconds-apart", b"FFFF", PAST)  # a target that keeps whole seconds
    put(source, "new/file", b"new", PAST)
    put(source, "two-seconds-apart", b"GGGG", PAST + 2 * SECOND)
    put(target, "two-seconds-apart", b"HHHH", PAST)


def without_directory_times(tree: Path) -> dict:
    return {path: item[:2] if item[0] == "dir" else item for path, item in snapshot(tree, times=True).items()}


@pytest.mark.parametrize("options", [[], ["-u"], ["--existing"], ["--ignore-non-existing"], ["--ignore-existing"],
                                     ["--size-only"], ["-I"], ["--modify-window=2"], ["--modify-window=-1"],
                                     ["-u", "--size-only"]],
                         ids=lambda options: " ".join(options) or "default")
def test_each_rule_gives_rsyncs_result(ends, tmp_path, options):
    ends.source.mkdir(parents=True, exist_ok=True)
    reference = tmp_path / "rsync"
    scenario(ends.source, ends.target)
    scenario(tmp_path / "unused", reference)
    subprocess.run(["rsync", "-a", *options, f"{ends.source}/", f"{reference}/"], check=True)
    done = run_cli("--no-progress", "-a", *options, ends.source_arg(), ends.target_arg)
    assert done.returncode == 0, done.stderr
    assert without_directory_times(ends.target) == without_directory_times(reference)


def test_a_bad_window_is_refused_in_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    done = run_cli("--no-progress", "--modify-window=soon", f"{tmp_path}/src/", tmp_path / "dst")
    assert done.returncode == 1 and "--modify-window" in done.stderr and "Traceback" not in done.stderr


def test_times_both_to_the_nanosecond_are_compared_to_the_nanosecond(tmp_path):
    """Where rsync differs, on purpose: its whole seconds miss a file rewritten at its size within
    the second it was synced; where both sides keep nanoseconds, pdiffcopy compares them."""
    put(tmp_path / "src", "f", b"EEEE", PAST + 123)
    put(tmp_path / "dst", "f", b"FFFF", PAST + 456)
    done = run_cli("--no-progress", "-a", f"{tmp_path}/src/", tmp_path / "dst")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "dst" / "f").read_bytes() == b"EEEE"
    put(tmp_path / "dst", "f", b"FFFF", PAST + 456)
    done = run_cli("--no-progress", "-a", "--modify-window=1", f"{tmp_path}/src/", tmp_path / "dst")
    assert done.returncode == 0 and (tmp_path / "dst" / "f").read_bytes() == b"FFFF"  # asked: seconds


@pytest.mark.parametrize("options", [["--max-size=1999"], ["--max-size=1.9K"], ["--max-size=2000-1"],
                                     ["--min-size=2000"], ["--min-size=1KB+1", "--max-size=3K"]],
                         ids=lambda options: " ".join(options))
def test_size_bounds_leave_files_alone_as_rsyncs(ends, tmp_path, options):
    ends.source.mkdir(parents=True, exist_ok=True)
    for name, size in (("big", 2000), ("small", 2), ("huge", 5000)):
        put(ends.source, name, b"x" * size, PAST)
    put(ends.target, "huge", b"old", PAST)  # larger in the source: left as it is with --max-size
    reference = tmp_path / "rsync"
    put(reference, "huge", b"old", PAST)
    subprocess.run(["rsync", "-a", *options, f"{ends.source}/", f"{reference}/"], check=True)
    done = run_cli("--no-progress", "-a", *options, ends.source_arg(), ends.target_arg)
    assert done.returncode == 0, done.stderr
    assert without_directory_times(ends.target) == without_directory_times(reference)


def test_a_bad_size_is_refused_in_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    done = run_cli("--no-progress", "--max-size=abc", f"{tmp_path}/src/", tmp_path / "dst")
    assert done.returncode == 1 and "--max-size" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "dst").exists()

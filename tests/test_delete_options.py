"""--delete-excluded, --max-delete, --prune-empty-dirs (rsync's -m): what a sync deletes and makes, as rsync's.

Each case runs rsync and pdiffcopy with the same options on copies of one
starting target, and compares the results, locally, pulled and pushed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from test_tree import snapshot

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")


def make(root: Path, names) -> None:
    for name in names:
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())


def both(ends, tmp_path, target_names, *options):
    """Make the starting target twice, run rsync on one and pdiffcopy on the other: (ours, theirs, done)."""
    reference = tmp_path / "rsync"
    for target in (ends.target, reference):
        make(target, target_names)
    rsynced = subprocess.run(["rsync", "-r", *options, f"{ends.source}/", f"{reference}/"], capture_output=True)
    done = run_cli("--no-progress", *options, ends.source_arg(), ends.target_arg)
    return snapshot(ends.target), snapshot(reference), done, rsynced


def test_delete_excluded_deletes_what_the_filters_leave_out(ends, tmp_path):
    make(ends.source, ["keep.txt", "skip.o", "sub/", "sub/x.o", "sub/y.txt"])
    ours, theirs, done, rsynced = both(ends, tmp_path, ["old.o", "keep.txt", "sub/", "sub/z.o", "sub/gone.txt"],
                                       "--delete-excluded", "--exclude", "*.o")
    assert done.returncode == 0 == rsynced.returncode, done.stderr
    assert ours == theirs
    assert set(ours) == {"keep.txt", "sub", "sub/y.txt"}


@pytest.mark.parametrize("limit", [2, 0])
def test_max_delete_stops_deletions_with_exit_25(ends, tmp_path, limit):
    make(ends.source, ["f4", "f5"])
    ours, theirs, done, rsynced = both(ends, tmp_path, ["f1", "f2", "f3", "f4", "f5"],
                                       "--delete", f"--max-delete={limit}")
    assert done.returncode == 25 == rsynced.returncode, done.stderr
    assert "max-delete" in done.stderr and "Traceback" not in done.stderr
    assert len(ours) == len(theirs) == 5 - limit


def test_prune_empty_dirs_makes_no_empty_directory_chains(ends, tmp_path):
    make(ends.source, ["e/f/", "g/x", "h/i/j.o", "k/"])
    ours, theirs, done, rsynced = both(ends, tmp_path, ["old/"], "--prune-empty-dirs", "--exclude", "*.o")
    assert done.returncode == 0 == rsynced.returncode, done.stderr
    assert ours == theirs
    assert set(ours) == {"g", "g/x", "old"}

"""--backup, --backup-dir, --suffix: what a sync replaces or deletes is kept, as rsync keeps it.

Without --backup-dir the old version stays beside the new as NAME~ (or NAME
and --suffix), and --delete never deletes such names; with it the old
versions move into DIR (relative to TARGET) under their paths. Each case is
compared with rsync's result on the same trees, locally, pulled and pushed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import random_bytes, run_cli
from test_tree import snapshot

needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")

PAST = 1_600_000_000_000_000_000


def make_source(root: Path) -> Path:
    for name, data in (("a", b"a\n"), ("sub/b", b"b" * 3000), ("gone", b"gone\n"), ("same", b"same\n"),
                       ("big", random_bytes(3 * 1024 * 1024, seed=3))):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        os.utime(root / name, ns=(PAST, PAST))
    os.symlink("a", root / "link")
    return root


def change_source(root: Path) -> None:
    (root / "a").write_bytes(b"a, changed\n")
    os.remove(root / "gone")
    os.remove(root / "link")
    os.symlink("sub", root / "link")
    (root / "c").write_bytes(b"new\n")
    with open(root / "big", "r+b") as handle:  # a big file's delta, into a new file: the old one kept
        handle.seek(1024 * 1024)
        handle.write(b"changed in the middle")
    for name in ("a", "c", "big"):
        os.utime(root / name, ns=(PAST + 10 ** 9, PAST + 10 ** 9))


def as_rsync_made(reference: Path, ours: Path) -> tuple:
    """rsync's copy and ours, directory times left out (rsync's are those of its last write)."""
    def without_directory_times(tree: Path) -> dict:
        return {path: item[:2] if item[0] == "dir" else item for path, item in snapshot(tree, times=True).items()}
    return without_directory_times(reference), without_directory_times(ours)


@needs_rsync
@pytest.mark.parametrize("options", [("--backup",), ("--backup", "--suffix=.old"), ("--backup-dir=../{name}-bak",)],
                         ids=["suffix", "own-suffix", "backup-dir"])
def test_replaced_and_deleted_files_are_kept_as_rsync_keeps_them(ends, tmp_path, monkeypatch, options):
    from test_tree import small_engine

    small_engine(monkeypatch)
    source = make_source(ends.source)
    reference = tmp_path / "rsync"
    for target in (ends.target, reference):
        subprocess.run(["rsync", "-a", f"{source}/", f"{target}/"], check=True)
    change_source(source)
    subprocess.run(["rsync", "-a", "--delete", *[o.format(name=reference.name) for o in options],
                    f"{source}/", f"{reference}/"], check=True)
    done = run_cli("--no-progress", "-a", "--delete", *[o.format(name=ends.target.name) for o in options],
                   ends.source_arg(), ends.target_arg)
    assert done.returncode == 0, done.stderr
    theirs, ours = as_rsync_made(reference, ends.target)
    assert ours == theirs
    if "backup-dir" in options[0]:
        theirs, ours = as_rsync_made(tmp_path / "rsync-bak", ends.target.parent / f"{ends.target.name}-bak")
        assert ours == theirs and set(ours) == {"a", "gone", "link", "big"}
    # Nothing left to do; --delete leaves the backups alone, and another run keeps them.
    again = run_cli("--no-progress", "-a", "--delete", "--diff",
                    *[o.format(name=ends.target.name) for o in options], ends.source_arg(), ends.target_arg)
    assert again.returncode == 0 and again.stdout == "", again.stdout


def test_the_options_are_checked(tmp_path):
    (tmp_path / "src").mkdir()
    empty = run_cli("--no-progress", "--backup", "--suffix=", f"{tmp_path}/src/", tmp_path / "dst")
    assert empty.returncode == 1 and "--suffix" in empty.stderr and "Traceback" not in empty.stderr
    slash = run_cli("--no-progress", "--backup", "--suffix=a/b", f"{tmp_path}/src/", tmp_path / "dst")
    assert slash.returncode == 1 and "--suffix" in slash.stderr
    assert not (tmp_path / "dst").exists()

"""-i/--itemize-changes: one line per change in rsync's code, the lines rsync prints for the same change.

Both tools run on copies of one tree, with one set of changes, and their
itemized lines are compared (as sets: rsync deletes as it goes, pdiffcopy
lists its deletions in path order). Pushed, a file is sent (``<f``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli

needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None or shutil.which("setfattr") is None,
                                 reason="rsync and setfattr are needed")

PAST = 1_600_000_000_000_000_000


def first_tree(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "gone-dir").mkdir()
    for name in ("a", "b", "c", "m", "gone"):
        (root / name).write_bytes(name.encode() + b"\n")
    os.symlink("a", root / "l")
    for path in [root / "sub", root / "gone-dir", *(root / name for name in ("a", "b", "c", "m", "gone"))]:
        os.utime(path, ns=(PAST, PAST))


def change(root: Path) -> None:
    (root / "a2").write_bytes(b"new\n")
    (root / "b").write_bytes(b"changed size\n")
    os.utime(root / "c", ns=(PAST + 10 ** 9, PAST + 10 ** 9))
    os.chmod(root / "c", 0o600)
    os.remove(root / "l")
    os.symlink("b", root / "l")
    os.remove(root / "gone")
    os.rmdir(root / "gone-dir")
    (root / "newdir").mkdir()
    os.utime(root / "sub", ns=(PAST + 5 * 10 ** 9, PAST + 5 * 10 ** 9))
    os.link(root / "a", root / "hl")
    os.chmod(root / "m", 0o640)
    os.setxattr(root / "a", "user.k", b"v")


def itemized(output: str) -> set:
    return {line for line in output.splitlines() if line and not line.startswith(("Dry run:", "stats:"))}


@needs_rsync
@pytest.mark.parametrize("dry_run", [False, True], ids=["sync", "dry-run"])
def test_the_lines_are_rsyncs(ends, tmp_path, dry_run):
    first_tree(ends.source)
    reference = tmp_path / "rsync"
    for target in (ends.target, reference):
        subprocess.run(["rsync", "-aHX", f"{ends.source}/", f"{target}/"], check=True)
    os.utime(ends.source, ns=(PAST, PAST))
    for target in (ends.target, reference):
        os.utime(target, ns=(PAST, PAST))
    change(ends.source)
    extra = ["-n"] if dry_run else []
    theirs = subprocess.run(["rsync", "-aHXi", "--delete", *extra, f"{ends.source}/", f"{reference}/"],
                            check=True, capture_output=True, text=True).stdout
    done = run_cli("--no-progress", "-aHX", "-i", "--delete", *extra, ends.source_arg(), ends.target_arg)
    assert done.returncode == 0, done.stderr
    expected = itemized(theirs)
    if ends.mode == "push":
        expected = {line.replace(">f", "<f", 1) for line in expected}
    assert itemized(done.stdout) == expected


def test_i_followed_by_a_regex_is_refused_not_taken_for_a_source(tmp_path):
    (tmp_path / "src").mkdir()
    done = run_cli("--no-progress", "-i", r"\.bin$", f"{tmp_path}/src/", tmp_path / "dst")
    assert done.returncode == 1 and "--include-regex" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "dst").exists()

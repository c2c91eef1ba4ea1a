"""--link-dest, --copy-dest and --compare-dest: snapshot backups, as rsync makes them.

A file the target lacks (or has otherwise) that DIR holds exactly as the
source has it (size, time and the attributes kept) is hard linked from DIR
(--link-dest), copied from DIR on the target's side (--copy-dest), or left
out (--compare-dest); one that differs only in its attributes is copied from
DIR and given the source's. DIR is relative to TARGET. Each case is compared
with rsync's result on the same trees, locally, pulled and pushed.
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
    for name, data in (("same", b"same\n"), ("changed", b"old\n"), ("sub/s", b"s" * 5000), ("mode", b"mode\n"),
                       ("big", random_bytes(3 * 1024 * 1024, seed=9))):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        os.utime(root / name, ns=(PAST, PAST))
    (root / "empty").mkdir()
    return root


def change_source(root: Path) -> None:
    """After the prior snapshot: one file's content, one file's mode, one file new."""
    (root / "changed").write_bytes(b"new content\n")
    os.utime(root / "changed", ns=(PAST + 10 ** 9, PAST + 10 ** 9))
    os.chmod(root / "mode", 0o600)
    (root / "sub" / "new").write_bytes(b"new")


def linked_to(tree: Path, prior: Path) -> set:
    """The files of ``tree`` that are the same file as their namesake in ``prior``."""
    names = set()
    for path in tree.rglob("*"):
        other = prior / path.relative_to(tree)
        if path.is_file() and other.is_file() and os.path.samestat(os.stat(path), os.stat(other)):
            names.add(str(path.relative_to(tree)))
    return names


def as_rsync_made(reference: Path, source: Path) -> dict:
    """rsync's copy, directory times the source's (rsync's own are those of its last write in
    them, some made after it set them)."""
    theirs, original = snapshot(reference, times=True), snapshot(source, times=True)
    return {path: original[path] if item[0] == "dir" else item for path, item in theirs.items()}


@needs_rsync
@pytest.mark.parametrize("how", ["link", "copy", "compare"])
def test_unchanged_files_come_from_dir_as_rsync_takes_them(ends, tmp_path, how):
    source = make_source(ends.source)
    prior = ends.target.parent / f"{ends.target.name}-prior"
    subprocess.run(["rsync", "-a", f"{source}/", f"{prior}/"], check=True)
    reference, reference_prior = tmp_path / "rsync", tmp_path / "rsync-prior"
    subprocess.run(["rsync", "-a", f"{source}/", f"{reference_prior}/"], check=True)
    change_source(source)
    option = f"--{how}-dest=../{prior.name}"
    subprocess.run(["rsync", "-a", f"--{how}-dest=../{reference_prior.name}", f"{source}/", f"{reference}/"],
                   check=True)
    prior_before = snapshot(prior, times=True)
    done = run_cli("--no-progress", "-a", option, ends.source_arg(), ends.target_arg)
    assert done.returncode == 0, done.stderr
    assert snapshot(ends.target, times=True) == as_rsync_made(reference, source)
    assert linked_to(ends.target, prior) == linked_to(reference, reference_prior)
    if how == "link":
        assert linked_to(ends.target, prior) == {"same", "sub/s", "big"}
        # The summary counts what the disk shows: three linked; "changed", "mode" and "sub/new" copied.
        assert "3 file(s) copied" in done.stderr and "3 hard link(s) made" in done.stderr, done.stderr
    assert snapshot(prior, times=True) == prior_before  # DIR is never changed
    again = run_cli("--no-progress", "-a", "--diff", option, ends.source_arg(), ends.target_arg)
    assert again.returncode == 0 and again.stdout == "", again.stdout


def test_the_options_are_checked(tmp_path):
    (tmp_path / "src").mkdir()
    mixed = run_cli("--no-progress", "--link-dest=a", "--copy-dest=b", f"{tmp_path}/src/", tmp_path / "dst")
    assert mixed.returncode == 1 and "cannot be mixed" in mixed.stderr and "Traceback" not in mixed.stderr
    many = run_cli("--no-progress", *[f"--link-dest=d{i}" for i in range(21)], f"{tmp_path}/src/", tmp_path / "dst")
    assert many.returncode == 1 and "20" in many.stderr
    assert not (tmp_path / "dst").exists()


@needs_rsync
def test_a_server_takes_files_only_from_beneath_its_root(tmp_path, server, unique):
    """A DIR that leads out of the export is refused in one line, and nothing is linked from there;
    an absolute one is from the server's root (over ssh: the host's /)."""
    source = make_source(tmp_path / "src")
    outside = tmp_path / "outside"
    subprocess.run(["rsync", "-a", f"{source}/", f"{outside}/"], check=True)
    name = unique.replace(".img", "")
    escape = os.path.relpath(outside, server.root / name)
    done = run_cli("--no-progress", "-a", f"--link-dest={escape}", f"{source}/", server.url(name) + "/")
    assert done.returncode != 0, done.stderr
    assert "outside" in done.stderr and "Traceback" not in done.stderr
    assert not any(path.is_file() and os.stat(path).st_nlink > 1 for path in outside.rglob("*"))
    prior = server.root / f"{name}-prior"
    subprocess.run(["rsync", "-a", f"{source}/", f"{prior}/"], check=True)
    done = run_cli("--no-progress", "-a", f"--link-dest=/{prior.name}", f"{source}/", server.url(name) + "/")
    assert done.returncode == 0, done.stderr
    assert os.path.samefile(server.root / name / "sub" / "s", prior / "sub" / "s")


def test_a_single_file_refuses_them(tmp_path):
    (tmp_path / "a").write_bytes(b"a")
    done = run_cli("--no-progress", "--link-dest=prior", tmp_path / "a", tmp_path / "b")
    assert done.returncode == 1 and "tree" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "b").exists()

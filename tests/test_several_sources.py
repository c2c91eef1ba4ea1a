"""Several SOURCEs into one TARGET directory, as rsync takes them: ``pdiffcopy a dir1 dir2/ dest/``.

A file lands as TARGET/NAME, a directory without a trailing slash as
TARGET/NAME/..., one with the slash merges its contents into TARGET. Each case
is compared with rsync's result on the same tree, locally, pulled and pushed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

from conftest import run_cli
from test_tree import snapshot

needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")


def make_sources(root: Path) -> Path:
    for name, data in (("f1", b"one"), ("dir1/a", b"a"), ("dir1/sub/b", b"b" * 3000), ("dir2/c", b"c"),
                       ("dir2/deep/d", b"d"), ("dir3/e", b"e")):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    os.chmod(root / "f1", 0o640)
    for path in root.rglob("*"):
        os.utime(path, ns=(1_600_000_000_000_000_000,) * 2, follow_symlinks=False)
    return root


def arguments(ends, names: List[str]) -> List[str]:
    """SOURCE arguments, in the ends' mode: a local path or a URL of the server."""
    base = ends.source_url or str(ends.source)
    return [f"{base}/{name}" for name in names]


def rsynced(source: Path, names: List[str], reference: Path, *options: str) -> Path:
    subprocess.run(["rsync", "-a", *options, *[f"{source}/{name}" for name in names], f"{reference}/"],
                   check=True)
    return reference


@needs_rsync
def test_files_directories_and_contents_land_as_rsync_puts_them(ends, tmp_path):
    make_sources(ends.source)
    names = ["f1", "dir1", "dir2/", "dir3"]
    done = run_cli("--no-progress", "-a", *arguments(ends, names), ends.target_arg.rstrip("/") + "/")
    assert done.returncode == 0, done.stderr
    reference = rsynced(ends.source, names, tmp_path / "rsync")
    assert snapshot(ends.target, times=True) == snapshot(reference, times=True)
    assert sorted(os.listdir(ends.target)) == ["c", "deep", "dir1", "dir3", "f1"]


@needs_rsync
def test_delete_deletes_inside_what_each_source_brings_as_rsync_does(ends, tmp_path):
    make_sources(ends.source)
    names = ["f1", "dir1", "dir2/"]
    reference = tmp_path / "rsync"
    for target in (ends.target, reference):
        (target / "dir1").mkdir(parents=True)
        (target / "dir1" / "stale").write_bytes(b"not in dir1: deleted")
        (target / "extra").write_bytes(b"at the top, beside dir2's contents: deleted")
    rsynced(ends.source, names, reference, "--delete")
    done = run_cli("--no-progress", "-a", "--delete", *arguments(ends, names), ends.target_arg.rstrip("/") + "/")
    assert done.returncode == 0, done.stderr
    assert snapshot(ends.target, times=True) == snapshot(reference, times=True)
    assert (ends.target / "f1").exists() and (ends.target / "dir1").exists()  # not taken for extraneous
    assert not (ends.target / "extra").exists() and not (ends.target / "dir1" / "stale").exists()


def test_a_missing_target_directory_is_made_and_a_missing_source_exits_23(ends, tmp_path):
    make_sources(ends.source)
    target_arg = ends.target_arg.rstrip("/") + "/"
    done = run_cli("--no-progress", "-a", *arguments(ends, ["f1", "nonexistent", "dir3"]), target_arg)
    assert done.returncode == 23, done.stderr
    assert "nonexistent" in done.stderr and "Traceback" not in done.stderr
    assert sorted(os.listdir(ends.target)) == ["dir3", "f1"]


def test_several_sources_need_a_directory_target(tmp_path):
    make_sources(tmp_path / "src")
    (tmp_path / "file").write_bytes(b"x")
    done = run_cli("--no-progress", tmp_path / "src" / "f1", tmp_path / "src" / "dir3", tmp_path / "file")
    assert done.returncode != 0
    assert "directory" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "file").read_bytes() == b"x"

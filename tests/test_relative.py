"""-R/--relative: each SOURCE's path is kept below TARGET, as rsync keeps it.

``pdiffcopy -R src/a/b/c dest/`` makes ``dest/src/a/b/c``, the directories on
its way made as the source has them (rsync's implied directories); ``/./``
marks where the kept path starts (``src/./d`` makes ``dest/d``). A URL's path
is kept from the server's root. Compared with rsync, locally, pulled and pushed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from test_tree import snapshot

needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")


def make_tree(root: Path) -> Path:
    for name, data in (("a/b/c", b"c"), ("d/e/f", b"f" * 2000), ("d/g", b"g")):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    os.chmod(root / "a", 0o750)
    for path in root.rglob("*"):
        os.utime(path, ns=(1_600_000_000_000_000_000,) * 2)
    return root


def without_directory_times(tree: Path) -> dict:
    """rsync sets the times of some implied directories and not others; ours are the source's."""
    return {path: item[:2] if item[0] == "dir" else item for path, item in snapshot(tree, times=True).items()}


@needs_rsync
def test_relative_keeps_each_sources_path_as_rsync_does(tmp_path, monkeypatch):
    root = tmp_path / "work"
    make_tree(root / "src")
    monkeypatch.chdir(root)
    done = run_cli("--no-progress", "-a", "-R", "src/a/b/c", "src/./d", str(tmp_path / "ours") + "/")
    assert done.returncode == 0, done.stderr
    subprocess.run(["rsync", "-a", "-R", "src/a/b/c", "src/./d", str(tmp_path / "theirs") + "/"], check=True,
                   cwd=root)
    assert without_directory_times(tmp_path / "ours") == without_directory_times(tmp_path / "theirs")
    assert os.stat(tmp_path / "ours" / "src" / "a").st_mtime_ns == os.stat(root / "src" / "a").st_mtime_ns
    assert set(snapshot(tmp_path / "ours")) == {"src", "src/a", "src/a/b", "src/a/b/c", "d", "d/e", "d/e/f", "d/g"}


@needs_rsync
def test_an_absolute_source_is_kept_whole(tmp_path):
    make_tree(tmp_path / "src")
    done = run_cli("--no-progress", "-a", "--relative", str(tmp_path / "src" / "d" / "e"), str(tmp_path / "ours"))
    assert done.returncode == 0, done.stderr
    subprocess.run(["rsync", "-a", "-R", str(tmp_path / "src" / "d" / "e"), str(tmp_path / "theirs")], check=True)
    assert without_directory_times(tmp_path / "ours") == without_directory_times(tmp_path / "theirs")
    assert (tmp_path / "ours" / str(tmp_path / "src" / "d" / "e" / "f").lstrip("/")).read_bytes() == b"f" * 2000


def test_pulled_and_pushed_the_marker_says_what_is_kept(tmp_path, server, unique):
    name = unique.replace(".img", "")
    make_tree(server.root / name)
    pulled = run_cli("--no-progress", "-a", "-R", f"{server.url(name)}/./a/b", f"{server.url(name)}/./d/g",
                     str(tmp_path / "pulled") + "/")
    assert pulled.returncode == 0, pulled.stderr
    assert set(snapshot(tmp_path / "pulled")) == {"a", "a/b", "a/b/c", "d", "d/g"}
    assert os.stat(tmp_path / "pulled" / "a").st_mode & 0o777 == 0o750  # an implied directory, as the source's
    pushed = run_cli("--no-progress", "-a", "-R", f"{tmp_path}/pulled/./a/b/c", server.url(f"{name}-pushed") + "/")
    assert pushed.returncode == 0, pushed.stderr
    assert set(snapshot(server.root / f"{name}-pushed")) == {"a", "a/b", "a/b/c"}

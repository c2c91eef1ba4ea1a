"""A source file that vanishes during a tree sync: rsync's "file has vanished" and exit status 24.

The file is removed after the source was listed and the plan made (when the
sync enters its "preparing" phase), so the copy meets a listed file that is
gone: locally, pushed (the client reads it) and pulled (the server reads it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from conftest import start_server

from pdiffcopy.cli.command import main
from pdiffcopy.core.treestops import VANISHED
from pdiffcopy.engine import treesync
from pdiffcopy.engine.treeunits import TreeProgress


def vanishing_progress(*doomed: Path):
    """A progress record that removes ``doomed`` once the sync has planned its copies."""

    class VanishingProgress(TreeProgress):
        @property
        def phase(self) -> str:
            return self._phase

        @phase.setter
        def phase(self, value: str) -> None:
            self._phase = value
            if value == "preparing":
                for path in doomed:
                    path.unlink(missing_ok=True)

    return VanishingProgress


@pytest.fixture(scope="module")
def tree_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vanished-root")
    running = start_server(root, tmp_path_factory.mktemp("vanished-log") / "server.log")
    yield running
    running.stop()


def make_source(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name in ("a.txt", "b.txt", "c.txt"):
        (directory / name).write_bytes(name.encode() * 100)
    return directory


@pytest.mark.parametrize("direction", ["local", "push", "pull"])
def test_a_source_file_that_vanished_is_named_and_exits_24(direction, tree_server, tmp_path, monkeypatch,
                                                           caplog):
    if direction == "pull":
        source = make_source(tree_server.root / f"pull-{tmp_path.name}")
        source_arg, target = f"{tree_server.url(source.name)}/", tmp_path / "target"
        target_arg = str(target)
    else:
        source = make_source(tmp_path / "source")
        source_arg = f"{source}/"
        if direction == "push":
            target = tree_server.root / f"push-{tmp_path.name}"
            target_arg = tree_server.url(target.name)
        else:
            target = tmp_path / "target"
            target_arg = str(target)
    monkeypatch.setattr(treesync, "TreeProgress", vanishing_progress(source / "b.txt"))
    status = main(["-a", "--no-progress", source_arg, target_arg])
    errors = caplog.text
    assert status == 24, errors
    assert sorted(path.name for path in target.iterdir()) == ["a.txt", "c.txt"]
    assert "b.txt" in errors and VANISHED in errors
    assert "vanished" in errors.strip().splitlines()[-1]


def test_a_vanished_file_among_other_failures_is_a_partial_transfer(tmp_path, monkeypatch, caplog):
    """rsync's 24 only when vanishing is all that went wrong; else 23."""
    source = make_source(tmp_path / "source")
    (source / "sub").mkdir()
    (source / "sub" / "d.txt").write_bytes(b"d")
    target = tmp_path / "target"
    target.mkdir()
    (target / "sub").write_bytes(b"a file where the source has a directory, and it cannot be removed")
    (target / "sub").chmod(0o444)
    import subprocess

    subprocess.run(["chattr", "+i", str(target / "sub")], check=False, capture_output=True)
    try:
        if not subprocess.run(["lsattr", str(target / "sub")], capture_output=True, text=True).stdout[:20].count("i"):
            pytest.skip("chattr +i is not available here")
        monkeypatch.setattr(treesync, "TreeProgress", vanishing_progress(source / "b.txt"))
        status = main(["-a", "--no-progress", f"{source}/", str(target)])
    finally:
        subprocess.run(["chattr", "-i", str(target / "sub")], check=False, capture_output=True)
    errors = caplog.text
    assert status == 23, errors
    assert VANISHED in errors


def dying_worker_progress(parent: int):
    """A progress record whose first forked worker kills itself (SIGKILL) once it has done a unit."""

    class DyingWorkerProgress(TreeProgress):
        def add(self, slot: int, files: int, size: int, moved=None) -> None:
            super().add(slot, files, size, moved)
            if os.getpid() != parent and slot == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    return DyingWorkerProgress


def test_a_worker_that_died_is_no_finished_sync(tmp_path, monkeypatch, caplog):
    """What a dead worker did is not known: no "Synchronised", no "everything else was synced"."""
    source = tmp_path / "source"
    for directory in range(8):
        (source / f"d{directory}").mkdir(parents=True)
        for index in range(40):
            (source / f"d{directory}" / f"f{index}").write_bytes(b"x" * 200_000)
    monkeypatch.setattr(treesync, "TreeProgress", dying_worker_progress(os.getpid()))
    caplog.set_level("INFO")
    status = main(["-a", "--no-progress", "-c", "2", f"{source}/", str(tmp_path / "target")])
    assert status == 23, caplog.text
    assert "Synchronised" not in caplog.text
    last = caplog.text.strip().splitlines()[-1]
    assert "everything else was synced" not in last and "did not finish" in last, last

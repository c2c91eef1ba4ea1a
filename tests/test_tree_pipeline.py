"""A streamed tree sync keeps the workers busy while it plans (issue 22): copying starts after a
short first piece, and each next piece is listed and planned while the workers copy the one before.

The pieces here are forked (no piece is small enough to run in this process), so the overlap is
real: the workers of one piece copy while this process reads both trees further.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pdiffcopy.core import treestream
from pdiffcopy.core.treeplan import DIR, FILE, Entry, PlanOptions
from pdiffcopy.engine import treelisting, treerunner
from pdiffcopy.engine.treesync import TreeOptions, run_tree_sync
from pdiffcopy.local.localtree import LocalTree

PAST = 1_500_000_000_000_000_000


def test_the_first_piece_is_an_eighth_and_the_pieces_double_up_to_the_bound():
    entries = [Entry(f"d{index // 100:02d}", DIR, 0, 1, 0o40755) for index in range(0, 3000, 100)]
    entries += [Entry(f"d{index // 100:02d}/f{index:05d}", FILE, 10, 1, 0o100644) for index in range(3000)]
    entries.sort(key=lambda entry: treestream.walk_order(entry.path))
    planner = treestream.StreamPlanner(PlanOptions(), piece_actions=800)
    sizes = [len(piece.files) + len(piece.directories) for piece in planner.plan(entries, None)]
    assert sum(sizes) == len(entries)
    # Cut at the first check past each bound (every 100 entries here): 100, 200, 400, then 800s.
    assert sizes[:4] == [100, 200, 400, 800]
    assert max(sizes) == 800


@contextlib.contextmanager
def caplog_steps():
    """The tree runner's and sync's phase messages (-vv), in order, as they are logged."""
    steps = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.name.startswith("pdiffcopy.engine.tree"):
                steps.append(record.getMessage().split(": ", 1)[1])

    handler = Collect(logging.DEBUG)
    engine = logging.getLogger("pdiffcopy.engine")
    level = engine.level
    engine.addHandler(handler)
    engine.setLevel(logging.DEBUG)
    try:
        yield steps
    finally:
        engine.removeHandler(handler)
        engine.setLevel(level)


def make_tree(root: Path, directories: int = 12, files: int = 60) -> None:
    for index in range(directories):
        directory = root / f"d{index:02d}" / "inner"
        directory.mkdir(parents=True)
        for number in range(files):
            (directory.parent / f"f{number:03d}").write_bytes(os.urandom(64 + number))
        (directory / "deep").write_bytes(b"deep %d" % index)
        os.chmod(directory, 0o550)  # read-only: its file goes in before its mode is set
    os.link(root / "d00" / "f000", root / "d11" / "again")  # a link whose leader is in the first piece
    for directory, _, _ in os.walk(root, topdown=False):
        os.utime(directory, ns=(PAST, PAST))


def state(root: Path) -> dict:
    found = {}
    for directory, directories, files in os.walk(root):
        for name in directories + files:
            path = Path(directory) / name
            info = os.lstat(path)
            content = path.read_bytes() if path.is_file() else None
            found[str(path.relative_to(root))] = (info.st_mode, info.st_mtime_ns, info.st_nlink, content)
    return found


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")
def test_each_next_piece_is_planned_while_the_workers_copy_and_the_tree_ends_as_rsyncs(tmp_path, monkeypatch):
    monkeypatch.setattr(treestream, "PIECE_ACTIONS", 240)
    monkeypatch.setattr(treerunner, "INLINE_FILES", 0)  # every piece forks its workers
    monkeypatch.setattr(treerunner, "INLINE_BYTES", 0)
    monkeypatch.setattr(treerunner, "BATCH_FILES", 32)  # several units a piece: both workers copy
    source, target, reference = tmp_path / "src", tmp_path / "dst", tmp_path / "ref"
    make_tree(source)
    subprocess.run(["rsync", "-aH", f"{source}/", str(reference)], check=True)
    with caplog_steps() as steps:
        result = run_tree_sync(LocalTree(f"{source}/"), LocalTree(str(target)),
                           TreeOptions(times=True, hard_links=True, concurrency=2))
    assert not result.failures
    assert result.files_copied == 12 * 61
    assert state(target) == state(reference)
    started = [index for index, step in enumerate(steps) if step.startswith("queued")]
    collected = [index for index, step in enumerate(steps) if step == "ran the queue"]
    planned = [index for index, step in enumerate(steps) if step.startswith("planned")]
    assert len(started) == len(collected) >= 3
    for start, end in zip(started[:-1], collected[:-1]):
        # The next piece came from the listings between the start of this one's queue and its end.
        assert any(start < plan < end for plan in planned), steps
    # No piece's queue starts before the one before it is collected (its directories and links first).
    assert all(end < next_start for end, next_start in zip(collected, started[1:])), steps


def children() -> set:
    """This process's child processes (zombies included)."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        found.update((task / "children").read_text().split())
    return found


def test_an_interrupt_while_the_next_piece_is_listed_stops_the_workers_and_leaves_only_whole_files(
        tmp_path, monkeypatch):
    # Guards the path main never had: the interrupt comes from the listing while a piece's
    # workers copy. They stop after the unit in hand, are reaped, and leave no temporary.
    monkeypatch.setattr(treestream, "PIECE_ACTIONS", 240)
    monkeypatch.setattr(treerunner, "INLINE_FILES", 0)
    monkeypatch.setattr(treerunner, "INLINE_BYTES", 0)
    monkeypatch.setattr(treerunner, "BATCH_FILES", 4)
    # Read as it comes: a small source is otherwise read ahead whole before the plan starts.
    monkeypatch.setattr(treelisting, "SMALL_TREE_ENTRIES", 0)
    source, target = tmp_path / "src", tmp_path / "dst"
    make_tree(source)
    reached = []

    class InterruptedListing(LocalTree):
        def stream(self):
            listing = super().stream()

            def batches():
                for entries, failures in listing.batches:
                    for entry in entries:  # one entry at a time: the planner asks as it goes
                        if entry.path.startswith("d08/"):
                            reached.append(entry.path)
                            raise KeyboardInterrupt
                        yield [entry], []
                    if failures:
                        yield [], failures

            return dataclasses.replace(listing, batches=batches())

    before = children()
    with caplog_steps() as steps, pytest.raises(KeyboardInterrupt):
        run_tree_sync(InterruptedListing(f"{source}/"), LocalTree(str(target)),
                  TreeOptions(times=True, concurrency=2))
    assert reached
    assert children() <= before, "a worker was left running or unreaped"
    # The interrupt came while a piece's workers ran (not between pieces).
    assert steps[-1].startswith("queued"), steps
    copied = 0
    for directory, _, files in os.walk(target):
        for name in files:
            assert not name.startswith("."), f"temporary left: {directory}/{name}"
            path = Path(directory) / name
            assert path.read_bytes() == (source / path.relative_to(target)).read_bytes()
            copied += 1
    assert copied  # the first pieces copied before the interrupt

"""The progress line: fits the terminal, its rate and ETA follow bytes moved; --progress and -P."""

from __future__ import annotations

import io

import pytest

from conftest import random_bytes, run_cli
from pdiffcopy.engine.filejob import Progress
from pdiffcopy.cli.progress import ProgressDisplay, TreeProgressDisplay
from pdiffcopy.engine.treesync import TreeProgress

MiB = 1024 ** 2
GiB = 1024 ** 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def display(progress, clock, cls=ProgressDisplay):
    return cls(progress, stream=io.StringIO(), clock=clock)


def copying_tree(monkeypatch, files: int, total: int):
    """A tree sync copying ``files`` files of ``total`` bytes, shown on a wide terminal: (progress, clock, display)."""
    monkeypatch.setenv("COLUMNS", "200")
    clock = FakeClock()
    progress = TreeProgress(2)
    progress.phase, progress.files_total, progress.bytes_total = "copying", files, total
    return progress, clock, display(progress, clock, TreeProgressDisplay)


@pytest.mark.parametrize("columns", [40, 60, 80, 120])
def test_line_never_reaches_the_last_column(monkeypatch, columns):
    """80 columns wrapped on every redraw with lines of 81-90 characters."""
    monkeypatch.setenv("COLUMNS", str(columns))
    clock = FakeClock()
    progress = Progress()
    progress.phase = "comparing"
    progress.hash_total, progress.move_total = 2 * 1023 * GiB, 1000 * GiB + 12345
    shown = display(progress, clock)
    for _ in range(1, 30):
        clock.now += 1
        progress.hashed += 37 * GiB + 123457
        progress.moved += 19 * MiB + 4321
        line = shown.render()
        assert len(line) <= columns - 1, line
        assert line.startswith("comparing:")
    assert len(TreeProgressDisplay(TreeProgress(2), stream=io.StringIO(), clock=clock).render()) <= columns - 1


def test_redraws_fit_too(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    clock = FakeClock()
    progress = Progress()
    progress.hash_total, progress.move_total = 10 * GiB, 10 * GiB
    shown = display(progress, clock)
    for _ in range(5):
        clock.now += 1
        progress.hashed += GiB + 1
        progress.moved += 123 * MiB + 1
        shown.draw()
    drawn = shown.stream.getvalue().split("\r")[1:]
    assert drawn and all(len(line) <= 79 for line in drawn), [len(line) for line in drawn]


def test_rate_counts_bytes_moved_not_hashed_and_eta_follows(monkeypatch):
    """A 19 MiB/s link once showed 810 MiB/s: the hashing rate."""
    monkeypatch.setenv("COLUMNS", "200")
    clock = FakeClock()
    progress = Progress()
    progress.phase = "comparing"
    progress.hash_total, progress.move_total = 20 * GiB, 190 * MiB
    shown = display(progress, clock)
    assert "ETA" not in shown.render()  # nothing moved yet: no rate to promise anything with
    clock.now += 1
    progress.hashed, progress.moved = 800 * MiB, 19 * MiB
    line = shown.render()
    assert "19 MiB/s" in line and "800" not in line.split("(hashed")[0]
    assert "ETA 0:09" in line  # 171 MiB left at 19 MiB/s
    # The rate follows the link (the last seconds), not the average since the start.
    for _ in range(10):
        clock.now += 1
        progress.hashed += 800 * MiB
        progress.moved += 2 * MiB
    line = shown.render()
    assert "2 MiB/s" in line, line
    assert "ETA 1:15" in line  # (190 - 39) MiB at 2 MiB/s


def test_tree_rate_and_eta_from_bytes_done(monkeypatch):
    progress, clock, shown = copying_tree(monkeypatch, 10, 100 * MiB)
    clock.now += 2
    progress.add(0, 3, 20 * MiB)
    line = shown.render()
    assert "10 MiB/s" in line and "ETA 0:08" in line and "3 of 10 files" in line


def test_tree_rate_counts_what_a_big_changed_file_moved_not_what_was_checked(monkeypatch):
    progress, clock, shown = copying_tree(monkeypatch, 1, 1000 * MiB)
    clock.now += 1
    progress.add(1, 0, 800 * MiB, 19 * MiB)  # 800 MiB of segments checked, 19 MiB of them moved
    line = shown.render()
    assert "19 MiB/s" in line and "800 MiB/s" not in line
    assert "ETA 0:00" in line  # the 200 MiB left are checked at the pace the 800 were


@pytest.mark.parametrize("option", ["--progress", "-P"])
def test_progress_and_P_are_accepted_and_keep_the_last_line(tmp_path, option):
    (tmp_path / "a").write_bytes(random_bytes(300_000))
    done = run_cli(option, "-b", "4K", str(tmp_path / "a"), str(tmp_path / "b"), env_extra={"COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes()
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if "moved" in line
             and "Synchronised" not in line]
    assert lines and all(len(line) <= 79 for line in lines)
    assert "moved 292.97 KiB of 292.97 KiB" in lines[-1]


def test_progress_on_a_tree(tmp_path):
    (tmp_path / "src" / "d").mkdir(parents=True)
    (tmp_path / "src" / "d" / "f").write_bytes(random_bytes(5000))
    done = run_cli("-P", f"{tmp_path / 'src'}/", str(tmp_path / "dst"), env_extra={"COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert "1 of 1 files" in done.stderr


def test_a_slow_rate_is_shown_in_whole_bytes(monkeypatch):
    """As the stats line's: "89 bytes/s", never "88.7804189463045 bytes/s"."""
    monkeypatch.setenv("COLUMNS", "200")
    clock = FakeClock()
    progress = Progress()
    progress.hash_total, progress.move_total = GiB, GiB
    shown = display(progress, clock)
    clock.now += 1.0025
    progress.moved = 89
    assert " 89 bytes/s" in shown.render(), shown.render()
    tree, tree_clock, tree_shown = copying_tree(monkeypatch, 10, 100 * MiB)
    tree_clock.now += 3
    tree.add(0, 1, 100)
    assert " 33 bytes/s" in tree_shown.render(), tree_shown.render()

"""What a tree sync holds and spends per file (issue 22): the plan's memory and time per file.

The whole-process figures against the number of files are benchmarks/tree_memory.py's
(docs/benchmarks.rst); RSS at small scale is too noisy to assert here, the planner's own
allocations are exact.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Iterator, Tuple

import pytest

from pdiffcopy.core.treeplan import DIR, FILE, Entry, PathFilter, PlanOptions, plan_tree
from pdiffcopy.core.treestream import StreamPlanner

#: These measure this machine (``-m "not measures"`` leaves them out).
pytestmark = pytest.mark.measures


def test_planning_a_copy_holds_under_80_bytes_per_new_file_beyond_its_entry():
    # A plan keeps one action per file to copy until the queue has run: with a __dict__
    # each (~105 bytes a file) a million new files cost 100 MB before anything moves.
    entries = [Entry(f"d{index // 1000}/f{index:06d}", FILE, 100, 1, 0o100644) for index in range(20_000)]
    tracemalloc.start()
    try:
        plan = plan_tree(entries, None)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sorted(action.path for action in plan.files) == sorted(entry.path for entry in entries)
    assert all(action.reason == "new" and action.target is None for action in plan.files)
    assert held / len(entries) < 80


def test_an_include_filter_over_40000_files_plans_in_linear_time():
    # Each kept file was looked up in a list of all the kept files: 20,000 files took 4.5 s,
    # 40,000 four times that, a million days. Linear, it is a tenth of a second.
    entries = [Entry(f"d{index // 1000}", DIR, 0, 1, 0o40755) for index in range(0, 40_000, 1000)]
    entries += [Entry(f"d{index // 1000}/f{index:06d}.{'txt' if index % 2 else 'bin'}", FILE, 100, 1, 0o100644)
                for index in range(40_000)]
    started = time.monotonic()
    plan = plan_tree(entries, None, path_filter=PathFilter(includes=[r"\.txt$"]))
    assert time.monotonic() - started < 3
    assert sorted(action.path for action in plan.files) == sorted(
        entry.path for entry in entries if entry.path.endswith(".txt"))
    assert len(plan.directories) == 40


def _walk(count: int, mtime: int = 1) -> Iterator[Entry]:
    """A tree of ``count`` files in directories of 1,000, in walk order, made as it is read."""
    directories = [f"d{index:04d}" for index in range((count + 999) // 1000)]
    for name in directories:
        yield Entry(name, DIR, 0, 1, 0o40755)
    for number, name in enumerate(directories):
        for index in range(number * 1000, min(count, number * 1000 + 1000)):
            yield Entry(f"{name}/f{index:07d}", FILE, 100, mtime, 0o100644)


def _streamed_peak(count: int, copy: bool) -> Tuple[int, int]:
    """The planner's peak of traced memory over a copy (or a no-change sync) of ``count`` files, and
    the files it planned to copy; each piece is dropped as a runner would drop it once run."""
    planner = StreamPlanner(PlanOptions(times=True, delete=True), piece_actions=1000)
    to_copy = 0
    tracemalloc.start()
    try:
        for piece in planner.plan(_walk(count), None if copy else _walk(count)):
            to_copy += len(piece.files)
            del piece
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, to_copy


def test_a_streamed_plan_holds_the_same_for_80000_files_as_for_20000():
    # Both listings merged as they come, the plan handed on in pieces: nothing held per file
    # (a whole plan of 80,000 new files is ~20 MB; the pieces here are of 1,000 actions).
    for copy in (True, False):
        small, planned_small = _streamed_peak(20_000, copy)
        large, planned_large = _streamed_peak(80_000, copy)
        assert (planned_small, planned_large) == ((20_000, 80_000) if copy else (0, 0))
        assert large < small * 1.5 + 256 * 1024, (copy, small, large)

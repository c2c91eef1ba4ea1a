"""What a tree sync holds and spends per file (issue 22): the plan's memory and time per file.

The whole-process figures against the number of files are benchmarks/tree_memory.py's
(docs/benchmarks.rst); RSS at small scale is too noisy to assert here, the planner's own
allocations are exact.
"""

from __future__ import annotations

import time
import tracemalloc

from pdiffcopy.core.treeplan import DIR, FILE, Entry, PathFilter, plan_tree


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

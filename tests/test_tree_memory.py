"""Memory a tree sync holds per file (issue 22): what the plan keeps for each file it copies.

The whole-process figures against the number of files are benchmarks/tree_memory.py's
(docs/benchmarks.rst); RSS at small scale is too noisy to assert here, the planner's own
allocations are exact.
"""

from __future__ import annotations

import tracemalloc

from pdiffcopy.core.treeplan import FILE, Entry, plan_tree


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

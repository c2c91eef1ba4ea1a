"""How far a tree listing is from its floor: os.listdir and lstat in a bare loop, against
pdiffcopy's own listing (LocalTree.stream) of the same tree, alternating, in one process; and
what planning a no-change sync of the tree against its own listing costs.

Usage: python3 benchmarks/listing_floor.py TREE [--rounds N]

The bare loop makes the same system calls (one listdir, one lstat per name, names sorted) and
builds nothing: the difference is what the listing's Python costs per entry.
"""

import argparse
import os
import stat
import statistics
import time


def bare_walk(root: str) -> int:
    """List `root` with the listing's system calls and nothing else; return the entry count."""
    count, pending = 0, [""]
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while pending:
            relative = pending.pop()
            fd = os.open(relative or ".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
            try:
                names = os.listdir(fd)
                names.sort()
                for name in names:
                    info = os.lstat(name, dir_fd=fd)
                    count += 1
                    if stat.S_ISDIR(info.st_mode):
                        pending.append(relative + "/" + name if relative else name)
            finally:
                os.close(fd)
    finally:
        os.close(top)
    return count


def our_walk(root: str) -> int:
    from pdiffcopy.local.localtree import LocalTree

    return sum(len(entries) for entries, _ in LocalTree(root).stream().batches)


def plan_unchanged(entries) -> int:
    """Plan the listing against itself (every entry unchanged); the number of unchanged entries."""
    from pdiffcopy.core.treeplan import PlanOptions
    from pdiffcopy.core.treestream import StreamPlanner

    planner = StreamPlanner(PlanOptions(times=True, owner=True))
    return sum(piece.unchanged for piece in planner.plan(iter(entries), iter(entries)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times = {"bare listdir + lstat": [], "pdiffcopy's listing": []}
    counts = {}
    for _ in range(args.rounds):
        for label, walk in (("bare listdir + lstat", bare_walk), ("pdiffcopy's listing", our_walk)):
            started = time.process_time()
            counts[label] = walk(args.tree)
            times[label].append(time.process_time() - started)
    print("load average: %.2f %.2f %.2f" % os.getloadavg())
    from pdiffcopy.local.localtree import LocalTree

    entries = [entry for batch, _ in LocalTree(args.tree).stream().batches for entry in batch]
    times["planning, no change"] = []
    counts["planning, no change"] = len(entries)
    for _ in range(args.rounds):
        started = time.process_time()
        plan_unchanged(entries)
        times["planning, no change"].append(time.process_time() - started)
    for label, values in times.items():
        print("%-22s %7d entries  CPU median %.3f s, best %.3f s, %.2f us an entry"
              % (label, counts[label], statistics.median(values), min(values),
                 statistics.median(values) / max(1, counts[label]) * 1e6))


if __name__ == "__main__":
    main()

"""A tree sync planned and run in pieces as both listings come (issue 22): the same end as one piece.

The pieces here hold two actions each, so that every step falls in another piece
than what it depends on: directories made before their files, a hard link after
its group's first name, a directory's times set after everything inside it (and
again after the deletions at the end), deletions only once both walks ended.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import random_bytes
from pdiffcopy.core import treestream
from pdiffcopy.engine.treesync import TreeOptions, run_tree_sync
from pdiffcopy.local.localtree import LocalTree

PAST = 1_500_000_000_000_000_000


def make_source(root: Path) -> None:
    for directory in ("a/b", "a-c", "b/deep/er", "skip", "z"):
        (root / directory).mkdir(parents=True)
    for index, path in enumerate(("a/one", "a/b/two", "a-c/three", "a.b", "b/deep/er/four", "skip/kept",
                                  "z/five", "b/six")):
        (root / path).write_bytes(random_bytes(1000 + index, seed=index))
    os.link(root / "a-c" / "three", root / "z" / "three-again")
    os.link(root / "a-c" / "three", root / "a" / "b" / "three-too")
    (root / "a" / "to-one").symlink_to("one")
    for directory, _, _ in os.walk(root, topdown=False):
        os.utime(directory, ns=(PAST, PAST))


def make_target(root: Path) -> None:
    for directory in ("a/b", "gone/sub", "skip", "z"):
        (root / directory).mkdir(parents=True)
    for path in ("a/old", "a/b/old", "gone/sub/old", "skip/theirs", "z/five", "b"):
        (root / path).write_bytes(b"old " + path.encode())
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            os.utime(Path(directory) / name, ns=(PAST, PAST))
        os.utime(directory, ns=(PAST, PAST))


def state(root: Path) -> dict:
    """Every entry below ``root``: kind, mode, mtime (directories too), content or link target, link group."""
    found = {}
    groups: dict = {}
    for directory, directories, files in os.walk(root):
        for name in directories + files:
            path = Path(directory) / name
            info = os.lstat(path)
            relative = str(path.relative_to(root))
            if path.is_symlink():
                found[relative] = ("symlink", os.readlink(path))
            elif path.is_dir():
                found[relative] = ("dir", info.st_mode, info.st_mtime_ns)
            else:
                groups.setdefault(info.st_ino, set()).add(relative)
                found[relative] = ("file", info.st_mode, info.st_mtime_ns, path.read_bytes())
    return {"entries": found, "links": {frozenset(g) for g in groups.values() if len(g) > 1}}


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")
def test_a_sync_in_pieces_of_two_actions_ends_as_rsync_does(tmp_path, monkeypatch):
    monkeypatch.setattr(treestream, "PIECE_ACTIONS", 2)
    source, target, reference = tmp_path / "src", tmp_path / "dst", tmp_path / "ref"
    make_source(source)
    make_target(target)
    make_target(reference)
    subprocess.run(["rsync", "-aH", "--delete", "--exclude", "skip/", f"{source}/", str(reference)], check=True)
    result = run_tree_sync(LocalTree(f"{source}/"), LocalTree(str(target)),
                       TreeOptions(times=True, delete=True, hard_links=True, rules=(("-", "skip/"),),
                                   concurrency=2))
    assert not result.failures
    ours, theirs = state(target), state(reference)
    assert ours["links"] == theirs["links"] == {frozenset({"a-c/three", "z/three-again", "a/b/three-too"})}
    # rsync -H sets some directories' times before it links into them: those of the source count.
    for path, item in theirs["entries"].items():
        if item[0] == "dir" and path != "skip":
            theirs["entries"][path] = item[:2] + (os.lstat(source / path).st_mtime_ns,)
    assert ours["entries"] == theirs["entries"]
    assert result.deleted == 5  # a/old, a/b/old, gone/sub/old, gone/sub, gone


def test_a_dry_run_in_pieces_lists_what_one_piece_would_in_path_order(tmp_path, monkeypatch):
    source, target = tmp_path / "src", tmp_path / "dst"
    make_source(source)
    make_target(target)
    listings = []
    for piece_actions in (1_000_000, 2):
        monkeypatch.setattr(treestream, "PIECE_ACTIONS", piece_actions)
        lines: list = []
        run_tree_sync(LocalTree(f"{source}/"), LocalTree(str(target)),
                  TreeOptions(times=True, delete=True, hard_links=True, dry_run=True, concurrency=2),
                  report_line=lines.append)
        listings.append(lines)
    assert listings[0] == listings[1]
    paths = [line.split()[2].rstrip("/") for line in listings[0]]
    assert paths == sorted(paths)
    assert "delete     dir     gone/" in listings[0] and any(line.startswith("new        file    z/five") or
                                                              line.startswith("changed    file    z/five")
                                                              for line in listings[0])
    assert state(target)["entries"]["a/old"][3] == b"old a/old"  # nothing changed


class FailingToList(LocalTree):
    """A source tree whose directory ``a`` cannot be listed, said at the end as a server says it."""

    def stream(self):
        listing = super().stream()

        def batches():
            for entries, failures in listing.batches:
                yield [entry for entry in entries if not entry.path.startswith("a/")], failures
            yield [], [("a", "cannot list: Permission denied")]

        return dataclasses.replace(listing, batches=batches())


def test_deletions_wait_for_the_source_walk_and_none_follow_a_failed_listing(tmp_path, monkeypatch):
    # What the target holds in "a" looks extraneous; it must survive --delete although pieces
    # of the sync have run before the failure was known.
    monkeypatch.setattr(treestream, "PIECE_ACTIONS", 2)
    source, target = tmp_path / "src", tmp_path / "dst"
    make_source(source)
    make_target(target)
    result = run_tree_sync(FailingToList(f"{source}/"), LocalTree(str(target)),
                       TreeOptions(times=True, delete=True, concurrency=2))
    assert [path for path, _ in result.failures] == ["a"]
    assert (target / "a" / "old").read_bytes() == b"old a/old"
    assert (target / "gone" / "sub" / "old").exists()  # nothing deleted at all, as before
    assert (target / "b" / "deep" / "er" / "four").read_bytes() == (source / "b" / "deep" / "er" / "four").read_bytes()
    assert result.deleted == 0 and result.files_copied >= 6


def make_many(root: Path) -> None:
    """200 small files in 10 directories, and a 5 MiB one: pieces of 40 actions fork their workers."""
    for index in range(200):
        path = root / f"d{index % 10}" / f"f{index:03d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(random_bytes(500 + index, seed=index))
    (root / "d3" / "big").write_bytes(random_bytes(5 * 1024 * 1024, seed=1))
    for directory, _, _ in os.walk(root, topdown=False):
        os.utime(directory, ns=(PAST, PAST))


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_a_pull_or_push_in_pieces_reads_the_servers_listing_as_it_goes(server, unique, tmp_path, monkeypatch,
                                                                       direction):
    from pdiffcopy.transport.remotetree import RemoteTree

    monkeypatch.setattr(treestream, "PIECE_ACTIONS", 40)
    local, remote = tmp_path / "local", server.root / unique
    source, target = (remote, local) if direction == "pull" else (local, remote)
    make_many(source)
    (target / "d1").mkdir(parents=True)
    (target / "d1" / "extra").write_bytes(b"extraneous")
    (target / "d9" / "gone").mkdir(parents=True)
    trees = {"pull": (RemoteTree(server.url(unique)), LocalTree(str(local))),
             "push": (LocalTree(f"{local}/"), RemoteTree(server.url(unique)))}[direction]
    try:
        result = run_tree_sync(*trees, TreeOptions(times=True, delete=True, concurrency=2))
    finally:
        for tree in trees:
            tree.close()
    assert not result.failures
    assert result.files_copied == 201 and result.deleted == 2
    assert state(target)["entries"] == state(source)["entries"]


def _random_tree(rng) -> list:
    """Entries of a small random tree: names that sort around ``/`` (``a-c``, ``a.b``), files and directories."""
    from pdiffcopy.core.treeplan import DIR, FILE, Entry

    entries = []

    def fill(prefix: str, depth: int) -> None:
        for _ in range(rng.randint(0, 5)):
            path = prefix + rng.choice(["a", "b", "a-c", "a.b", "z"]) + str(rng.randint(0, 2))
            if any(entry.path == path for entry in entries):
                continue
            if depth < 3 and rng.random() < 0.4:
                entries.append(Entry(path, DIR, 0, rng.choice([1, 2]), 0o40755))
                fill(path + "/", depth + 1)
            else:
                entries.append(Entry(path, FILE, rng.choice([1, 2]), rng.choice([1, 2]), 0o100644))

    fill("", 0)
    return entries


@pytest.mark.parametrize("filters", ["none", "exclude", "include"])
def test_a_plan_in_pieces_has_the_actions_of_the_whole_plan(filters):
    """Property: for random trees, the pieces' actions are the whole planner's, and every directory's
    fix comes after its contents' pieces and before its parent's fix."""
    import random

    from pdiffcopy.core.treeplan import PathFilter, PlanOptions, plan_tree

    rng = random.Random(22)
    path_filter = {"none": PathFilter(), "exclude": PathFilter(excludes=["b1"]),
                   "include": PathFilter(includes=["a"])}[filters]
    for _ in range(200):
        source, target = _random_tree(rng), _random_tree(rng)
        for options in (PlanOptions(delete=True, times=True), PlanOptions()):
            whole = plan_tree(list(source), list(target), options, path_filter)
            pieces = list(treestream.StreamPlanner(options, path_filter, piece_actions=3).plan(
                treestream.in_walk_order(source), treestream.in_walk_order(target)))
            for name in ("directories", "files", "symlinks", "metadata", "removals", "deletions", "extraneous",
                         "links"):
                assert sorted(map(repr, getattr(whole, name))) == \
                    sorted(repr(item) for piece in pieces for item in getattr(piece, name)), name
            assert whole.unchanged == sum(piece.unchanged for piece in pieces)
            fixed = {}  # path -> (piece, place) of its first fix
            for number, piece in enumerate(pieces):
                for place, fix in enumerate(piece.directory_metadata):
                    fixed.setdefault(fix.source.path, (number, place))
            wanted = {fix.source.path for fix in whole.directory_metadata if fix.changes}
            assert wanted <= set(fixed)
            for number, piece in enumerate(pieces):
                for path in [action.path for action in piece.files] + [entry.path for entry in piece.directories]:
                    parent = path.rpartition("/")[0]
                    while parent:
                        assert parent not in fixed or fixed[parent][0] >= number, (parent, path)
                        parent = parent.rpartition("/")[0]
            for path, place in fixed.items():
                parent = path.rpartition("/")[0]
                while parent:
                    assert parent not in fixed or fixed[parent] > place, (path, parent)
                    parent = parent.rpartition("/")[0]

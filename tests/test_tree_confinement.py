"""Big tree members are opened beneath the tree's root: a directory swapped for a symlink mid-sync leads nowhere.

A tree sync lists both trees, then works through the plan; the big files
(changed ones from 8 MiB, new ones from 64 MiB) go through the block engine
as :class:`~pdiffcopy.local.localfile.LocalFile` endpoints. If those were opened by
path, a directory of the tree replaced by a symlink between the listing and
the copy would send the write (or the read) to wherever the symlink points.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from conftest import random_bytes
from pdiffcopy.local.localtree import LocalTree
from pdiffcopy.transport.remotetree import RemoteTree
from pdiffcopy.engine.treesync import TreeOptions, run_tree_sync

MIB = 1024 * 1024

#: A changed file this size goes through the block engine (it is >= 8 MiB).
BIG = 9 * MIB


def swap_after_listing(tree, directory: Path, outside: Path) -> None:
    """Replace ``directory`` with a symlink to ``outside`` as soon as ``tree`` has been listed."""
    streamed = tree.stream

    def stream_then_swap():
        listing = streamed()

        def batches():
            yield from listing.batches
            shutil.rmtree(directory)
            os.symlink(outside, directory)

        return dataclasses.replace(listing, batches=batches())

    tree.stream = stream_then_swap


def big_pair(source: Path, target: Path) -> bytes:
    """A 9 MiB ``sub/big.img`` in both trees, with different first blocks; returns the source's bytes."""
    wanted = random_bytes(BIG, seed=5)
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "big.img").write_bytes(wanted)
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "big.img").write_bytes(b"x" * MIB + wanted[MIB:])
    return wanted


def run(source, target, **options) -> list:
    try:
        result = run_tree_sync(source, target, TreeOptions(concurrency=1, **options))
    finally:
        source.close()
        target.close()
    return result.failures


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory outside both trees holding a file of the member's name that must stay as it is."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "big.img").write_bytes(b"precious" * MIB)  # 8 MiB of someone else's data
    return directory


@pytest.mark.parametrize("atomic", [False, True])
def test_local_target_directory_swapped_for_a_symlink(tmp_path, outside, atomic):
    source, target = tmp_path / "src", tmp_path / "dst"
    big_pair(source, target)
    target_tree = LocalTree(str(target))
    swap_after_listing(target_tree, target / "sub", outside)
    failures = run(LocalTree(str(source)), target_tree, atomic=atomic)
    assert (outside / "big.img").read_bytes() == b"precious" * MIB
    assert [path for path, _ in failures] == ["sub/big.img"]
    assert not [name for name in os.listdir(outside) if name != "big.img"]  # no temporary left there


def test_local_source_directory_swapped_for_a_symlink(tmp_path, outside):
    source, target = tmp_path / "src", tmp_path / "dst"
    big_pair(source, target)
    (outside / "big.img").write_bytes(random_bytes(BIG, seed=6))  # same size: the read would go on
    source_tree = LocalTree(str(source))
    swap_after_listing(source_tree, source / "sub", outside)
    before = (target / "sub" / "big.img").read_bytes()
    failures = run(source_tree, LocalTree(str(target)))
    assert [path for path, _ in failures] == ["sub/big.img"]
    assert (target / "sub" / "big.img").read_bytes() == before  # nothing of the outside file landed


def test_new_big_file_by_ranges_into_a_swapped_directory(tmp_path, outside, monkeypatch):
    """New files from 64 MiB are written by ranges into a temporary: made beneath the root too."""
    import pdiffcopy.engine.treerunner as treerunner

    monkeypatch.setattr(treerunner, "RANGE_SIZE", 4 * MIB)  # 9 MiB then goes by ranges, as 64 MiB would
    source, target = tmp_path / "src", tmp_path / "dst"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "new.img").write_bytes(random_bytes(BIG, seed=7))
    (target / "sub").mkdir(parents=True)
    target_tree = LocalTree(str(target))
    swap_after_listing(target_tree, target / "sub", outside)
    failures = run(LocalTree(str(source)), target_tree)
    assert sorted(os.listdir(outside)) == ["big.img"]
    assert [path for path, _ in failures] == ["sub/new.img"]


def test_pull_into_a_target_directory_swapped_for_a_symlink(server, unique, tmp_path, outside):
    remote_root = server.root / unique
    target = tmp_path / "dst"
    big_pair(remote_root, target)
    target_tree = LocalTree(str(target))
    swap_after_listing(target_tree, target / "sub", outside)
    failures = run(RemoteTree(server.url(unique)), target_tree)
    assert (outside / "big.img").read_bytes() == b"precious" * MIB
    assert [path for path, _ in failures] == ["sub/big.img"]


def test_push_from_a_source_directory_swapped_for_a_symlink(server, unique, tmp_path, outside):
    source = tmp_path / "src"
    remote_root = server.root / unique
    big_pair(source, remote_root)
    (outside / "big.img").write_bytes(random_bytes(BIG, seed=6))
    before = (remote_root / "sub" / "big.img").read_bytes()
    source_tree = LocalTree(str(source))
    swap_after_listing(source_tree, source / "sub", outside)
    failures = run(source_tree, RemoteTree(server.url(unique)))
    assert [path for path, _ in failures] == ["sub/big.img"]
    assert (remote_root / "sub" / "big.img").read_bytes() == before

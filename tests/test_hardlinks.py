"""Hard links in tree syncs (-H/--hard-links): names that share a file in the source share one in the target.

Each scenario runs in each mode (local, pull, push: the ``ends`` fixture) and,
where rsync is installed, is checked against ``rsync -aH`` on the same tree:
the same bytes, times and modes, and the same names sharing the same files.
The last tests hold a server to its root: a link operation never names, nor
makes, a file outside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import FrozenSet, Iterable, Set

import pytest
from test_errors import assert_json_error, raw_request, snapshot as outside_snapshot
from test_tree import small_engine, snapshot, sync
from test_treeserver import file_entry, outside, remote, tree_dir  # noqa: F401 (fixtures)

from conftest import random_bytes
from pdiffcopy.core.treeplan import LINK, Entry, Operation
from pdiffcopy.core.treewire import TreeWireError, parse_operation
from pdiffcopy.engine.treeendpoints import MetadataOptions
from pdiffcopy.core.locations import quote_path

#: The filters of the scenarios: the first name of a group (in path order) and a
#: directory holding another name are left out, in both tools' syntax.
FILTERS = ("--exclude", "*.tmp", "--exclude", "skip/")

PAST = 1_600_000_000_000_000_000


def link_groups(root: Path) -> Set[FrozenSet[str]]:
    """The regular files below ``root`` as sets of the names that share each (one name: a set of one)."""
    names: dict = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            info = os.lstat(path)
            if not path.is_symlink():
                names.setdefault((info.st_dev, info.st_ino), []).append(str(path.relative_to(root)))
    return {frozenset(group) for group in names.values()}


def linked(groups: Iterable[FrozenSet[str]]) -> Set[FrozenSet[str]]:
    return {group for group in groups if len(group) > 1}


def make_linked_tree(root: Path, outside_file: Path) -> Path:
    """Hard-link groups across directories, some of whose names the filters leave out."""
    for directory in ("a", "b/c", "skip"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    # Its first name in path order is excluded: another name leads the group.
    (root / "a" / "0-first.tmp").write_bytes(random_bytes(20_000, seed=1))
    for name in ("a/one", "b/c/one", "z-one"):
        os.link(root / "a" / "0-first.tmp", root / name)
    # One of its names is in an excluded directory.
    (root / "b" / "two").write_bytes(b"two\n" * 100)
    os.link(root / "b" / "two", root / "skip" / "two")
    os.link(root / "b" / "two", root / "a" / "two")
    # Its other name is outside the tree: one name here, copied as a plain file.
    outside_file.write_bytes(b"shared with a file outside\n")
    os.link(outside_file, root / "b" / "alone")
    (root / "plain").write_bytes(b"plain")
    (root / "link").symlink_to("a/one")
    for name in ("a/one", "b/two", "b/alone", "plain"):
        os.utime(root / name, ns=(PAST, PAST))
    return root


@pytest.fixture
def linked_tree(ends, tmp_path) -> Path:
    return make_linked_tree(ends.source, tmp_path / "outside-file")


def rsync_reference(source: Path, target: Path, *args: str) -> Path:
    """What ``rsync -aH ARGS`` makes of ``source`` in ``target`` (skips the test without rsync)."""
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    subprocess.run(["rsync", "-aH", *args, f"{source}/", str(target)], check=True)
    return target


def assert_same_as_rsync(target: Path, reference: Path, source: Path) -> None:
    """The same bytes, modes, times and link groups as rsync's copy.

    Directory times are compared with the source's: rsync -H makes some links
    after it has set them, and they come out as the time of the copy.
    """
    ours, theirs, original = (snapshot(tree, times=True) for tree in (target, reference, source))
    for path, item in theirs.items():
        if item[0] == "dir":
            theirs[path] = original[path]
    assert ours == theirs
    assert link_groups(target) == link_groups(reference)


def test_groups_across_directories_are_linked_as_rsync_links_them(ends, linked_tree, tmp_path):
    sync("-aH", *FILTERS, ends.source_arg(), ends.target_arg)
    reference = rsync_reference(linked_tree, tmp_path / "rsync", *FILTERS)
    assert_same_as_rsync(ends.target, reference, linked_tree)
    assert linked(link_groups(ends.target)) == {frozenset({"a/one", "b/c/one", "z-one"}),
                                               frozenset({"a/two", "b/two"})}


def test_a_second_sync_links_new_names_relinks_separate_ones_and_copies_nothing(ends, linked_tree, tmp_path):
    target = ends.target
    sync("-aH", *FILTERS, ends.source_arg(), ends.target_arg)
    leader = os.stat(target / "a" / "one")
    # A name added to a group whose file did not change; one name deleted from the source.
    os.link(linked_tree / "a" / "one", linked_tree / "b" / "new-one")
    os.unlink(linked_tree / "z-one")
    # In the target, a name of the group made a separate file with the same bytes and times,
    # and one group's names made separate files altogether (as a copy without -H leaves them).
    for name in ("b/c/one", "a/two"):
        shutil.copy2(target / name, target / f"{name}.copy")
        os.replace(target / f"{name}.copy", target / name)
    second = sync("-aH", "-v", "--delete", *FILTERS, ends.source_arg(), ends.target_arg)
    assert "0 file(s) copied (0 bytes moved)" in second.stderr  # linked, not copied again
    assert "3 hard link(s) made, 1 deleted" in second.stderr  # b/new-one, b/c/one, b/two; z-one
    assert os.stat(target / "a" / "one").st_ino == leader.st_ino
    reference = rsync_reference(linked_tree, tmp_path / "rsync", *FILTERS)
    assert_same_as_rsync(target, reference, linked_tree)
    assert frozenset({"a/one", "b/c/one", "b/new-one"}) in link_groups(target)
    assert not (target / "z-one").exists()


def test_a_group_whose_file_changed_is_written_once_and_linked_again(ends, linked_tree):
    target = ends.target
    sync("-aH", *FILTERS, ends.source_arg(), ends.target_arg)
    with open(linked_tree / "b" / "two", "ab") as handle:  # in place: every name sees it
        handle.write(b"more\n")
    second = sync("-aH", "-v", *FILTERS, ends.source_arg(), ends.target_arg)
    assert "1 file(s) copied" in second.stderr
    assert (target / "a" / "two").read_bytes() == (linked_tree / "b" / "two").read_bytes()
    assert frozenset({"a/two", "b/two"}) in link_groups(target)


def test_a_big_group_is_written_once_by_the_workers_and_linked(ends, monkeypatch):
    treesync = small_engine(monkeypatch)
    source = ends.source
    (source / "x" / "y").mkdir(parents=True)
    big = random_bytes(5 * 1024 * 1024 + 321, seed=7)  # several ranges, several workers
    (source / "x" / "big").write_bytes(big)
    for name in ("big-too", "x/y/big-three"):
        os.link(source / "x" / "big", source / name)
    for index in range(100):  # small groups too, many of them, spread over the batches
        (source / "x" / f"small-{index}").write_bytes(b"s%d" % index)
        os.link(source / "x" / f"small-{index}", source / "x" / "y" / f"small-{index}")
    options = treesync.TreeOptions(times=True, concurrency=2, block_size=64 * 1024, hard_links=True)

    def run():
        return ends.sync_engine(options)

    first = run()
    assert not first.failures
    assert first.files_copied == 101 and first.linked == 102
    assert first.bytes_moved == len(big) + sum(len(b"s%d" % i) for i in range(100))
    assert snapshot(ends.target, times=True) == snapshot(source, times=True)
    assert link_groups(ends.target) == link_groups(source)
    changed = bytearray(big)
    changed[3 * 1024 * 1024] ^= 0x55
    with open(source / "x" / "big", "r+b") as handle:  # in place: the group stays one file
        handle.write(bytes(changed))
    os.utime(source / "x" / "big", ns=(PAST, PAST))
    second = run()  # the big file goes by its block delta, into a new file, then linked again
    assert not second.failures
    assert second.bytes_moved <= 2 * 64 * 1024, second.bytes_moved
    assert snapshot(ends.target, times=True) == snapshot(source, times=True)
    assert link_groups(ends.target) == link_groups(source)


def test_the_library_keeps_links_with_hard_links_true(tmp_path):
    import pdiffcopy

    source = make_linked_tree(tmp_path / "src", tmp_path / "outside-file")
    result = pdiffcopy.sync_tree(str(source), str(tmp_path / "dst"), hard_links=True, times=True)
    assert not result.failures and result.linked == 5  # 3 + 2 names besides the groups' first
    assert link_groups(tmp_path / "dst") == link_groups(source)


def test_without_h_links_are_copied_apart_with_a_warning(ends, linked_tree):
    done = sync("-a", ends.source_arg(), ends.target_arg)
    assert "hard-linked file(s) as separate files" in done.stderr
    assert not linked(link_groups(ends.target))
    assert snapshot(ends.target) == snapshot(linked_tree)


def test_dry_run_and_diff_list_the_links_and_change_nothing(ends, linked_tree):
    target = ends.target
    sync("-aH", *FILTERS, ends.source_arg(), ends.target_arg)
    os.link(linked_tree / "a" / "one", linked_tree / "b" / "new-one")
    shutil.copy2(target / "a" / "two", target / "a" / "two.copy")
    os.replace(target / "a" / "two.copy", target / "a" / "two")
    before = snapshot(target, times=True), link_groups(target)
    diff = sync("-aH", "--diff", *FILTERS, ends.source_arg(), ends.target_arg)
    lines = [line for line in diff.stdout.splitlines() if not line.startswith("changed    dir")]
    # Linked to the group's first name in the walk's order: a directory's files before its subdirectories'.
    assert lines == ["new        file    b/new-one  (hard link to z-one)",
                     "changed    file    b/two  (hard link to a/two)"], diff.stdout
    dry = sync("-aH", "-n", *FILTERS, ends.source_arg(), ends.target_arg)
    assert "new        file    b/new-one  (hard link to z-one)" in dry.stdout.splitlines()
    assert (snapshot(target, times=True), link_groups(target)) == before


# -- the server keeps links inside its root ----------------------------------------------------------


def link_operation(path: str, leader: str) -> Operation:
    return Operation(LINK, file_entry(path, b"")._replace(target=leader))


def test_link_operations_are_parsed_strictly():
    assert parse_operation(link_operation("a/b", "c").to_wire()).entry.target == "c"
    for path, leader in (("a", ""), ("a", "a"), ("", "c"), ("a", "x//y")):
        with pytest.raises(TreeWireError):
            parse_operation(link_operation(path, leader).to_wire())
    directory = Entry("d", "dir", 0, 0, 0o40755, target="c")
    with pytest.raises(TreeWireError):
        parse_operation(Operation(LINK, directory).to_wire())


def test_a_server_refuses_links_that_leave_its_root(server, tree_dir, outside):  # noqa: F811
    (tree_dir / "inside").write_bytes(b"inside")
    (tree_dir / "link-out").symlink_to(outside)
    (tree_dir / "to-secret").symlink_to(outside / "secret.txt")
    before = outside_snapshot(outside)
    target = quote_path(tree_dir.relative_to(server.root).as_posix())
    # A leader (or a name) leading out by its path: the whole request is refused.
    for path, leader in (("x", f"../../{outside.name}/secret.txt"), ("x", "/etc/passwd"),
                         (f"../../{outside.name}/new", "inside")):
        body = json.dumps({"operations": [link_operation(path, leader).to_wire()]})
        status, headers, answer = raw_request(server.port, "POST", f"/.pdiffcopy/tree-apply/{target}",
                                              body=body)
        assert "outside" in assert_json_error(status, headers, answer, 403)
    # Through a symlink: each is a failure of its own, and nothing is linked.
    tree = remote(server, tree_dir)
    operations = [link_operation("x", "link-out/secret.txt"), link_operation("y", "to-secret"),
                  link_operation("link-out/new", "inside")]
    failures = tree.apply(operations, MetadataOptions())
    assert [path for path, _ in failures] == ["x", "y", "link-out/new"]
    assert "not a regular file" in failures[1][1]
    # Ours refuses a leader leading out without sending it.
    failures = tree.apply([link_operation("z", "../elsewhere")], MetadataOptions())
    assert [path for path, _ in failures] == ["z"]
    assert sorted(os.listdir(tree_dir)) == ["inside", "link-out", "to-secret"]
    assert outside_snapshot(outside) == before
    # Inside the root it links (and a second time changes nothing).
    for _ in range(2):
        assert tree.apply([link_operation("sub-less", "inside")], MetadataOptions()) == []
    assert os.stat(tree_dir / "sub-less").st_ino == os.stat(tree_dir / "inside").st_ino
    assert sorted(os.listdir(tree_dir)) == ["inside", "link-out", "sub-less", "to-secret"]
    tree.close()


@pytest.mark.parametrize("options", ["-aH", "-a"])
def test_a_link_broken_in_the_source_is_broken_in_the_target(ends, tmp_path, monkeypatch, options):
    """Once, ``b`` made its own file in the source kept sharing ``a``'s in the target: its mode
    and time were set on the shared file, so ``a`` changed too, and no run ever converged."""
    small_engine(monkeypatch)
    source = ends.source
    source.mkdir(parents=True, exist_ok=True)
    for name, size in (("a", 5000), ("big-a", 3 * 1024 * 1024)):
        (source / name).write_bytes(random_bytes(size, seed=size))
        os.utime(source / name, ns=(PAST, PAST))
        os.link(source / name, source / name.replace("a", "b"))
    reference = tmp_path / "rsync"
    rsync_reference(source, reference)
    sync("-aH", ends.source_arg(), ends.target_arg)
    assert linked(link_groups(ends.target)) == {frozenset({"a", "b"}), frozenset({"big-a", "big-b"})}
    for name in ("b", "big-b"):  # its own file now: the same bytes, another mode and time
        shutil.copyfile(source / name, source / f"{name}.new")
        os.replace(source / f"{name}.new", source / name)
        os.chmod(source / name, 0o600)
        os.utime(source / name, ns=(PAST + 10 ** 9,) * 2)
    subprocess.run(["rsync", options, f"{source}/", str(reference)], check=True)
    sync(options, ends.source_arg(), ends.target_arg)
    assert_same_as_rsync(ends.target, reference, source)
    assert not linked(link_groups(ends.target))
    # Converged: nothing left to do, and another run changes nothing.
    diff = sync(options, "--diff", ends.source_arg(), ends.target_arg)
    assert diff.stdout.strip() == "", diff.stdout
    before = snapshot(ends.target, times=True)
    sync(options, ends.source_arg(), ends.target_arg)
    assert snapshot(ends.target, times=True) == before

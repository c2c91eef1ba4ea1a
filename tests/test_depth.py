"""Deep and long trees: any depth is replaced or deleted, an overlong path fails alone (exit 23)."""

from __future__ import annotations

import os
import resource
import subprocess
from pathlib import Path

import pytest

from conftest import pdiffcopy_command, run_cli
from pdiffcopy.local.treewalk import remove_all

#: Deeper than Python's recursion limit (1,000 frames).
DEPTH = 1100

#: Names of this many bytes, 25 levels deep: a path of 5,000 bytes, over Linux's PATH_MAX.
LONG_NAME, LONG_LEVELS = 200, 25


def make_deep(base: Path, levels: int, name: str = "d") -> None:
    """``base/name/name/.../leaf.txt``, made one directory descriptor at a time (no path limit)."""
    base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            following = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = following
        leaf = os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"leaf")
        os.close(leaf)
    finally:
        os.close(fd)


def remove_deep(path: Path) -> None:
    """Remove a tree of any depth (pytest's own clean-up, shutil.rmtree, recurses and fails on these),
    with the package's own iterative removal."""
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        remove_all(parent, path.name)
    finally:
        os.close(parent)


@pytest.fixture(autouse=True)
def remove_deep_trees(server, tmp_path, unique):
    """After each test: its deep trees, wherever they are (the shared server root too)."""
    yield
    for path in (tmp_path, server.root / unique):
        remove_deep(path)


def locations(direction: str, server, tmp_path: Path, unique: str):
    """(source directory, target directory, SOURCE argument, TARGET argument)."""
    if direction == "pull":
        source, target = server.root / unique / "source", tmp_path / "target"
        return source, target, server.url(f"{unique}/source") + "/", str(target)
    if direction == "push":
        source, target = tmp_path / "source", server.root / unique / "target"
        target.parent.mkdir()  # (a tree's target is made, its parent must exist: rsync's rule)
        return source, target, str(source) + "/", server.url(f"{unique}/target")
    source, target = tmp_path / "source", tmp_path / "target"
    return source, target, str(source) + "/", str(target)


def one_line_errors(stderr: str):
    return [line for line in stderr.splitlines() if " ERROR " in line]


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_a_deep_directory_where_the_source_has_a_file_is_replaced(server, tmp_path, unique, direction):
    source, target, source_arg, target_arg = locations(direction, server, tmp_path, unique)
    source.mkdir(parents=True)
    (source / "x").write_bytes(b"a file now")
    (source / "y").write_bytes(b"y")
    make_deep(target / "x", DEPTH)
    completed = run_cli(source_arg, target_arg)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr
    assert (target / "x").read_bytes() == b"a file now"
    assert (target / "y").read_bytes() == b"y"


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_delete_removes_a_deep_tree(server, tmp_path, unique, direction):
    source, target, source_arg, target_arg = locations(direction, server, tmp_path, unique)
    source.mkdir(parents=True)
    (source / "y").write_bytes(b"y")
    make_deep(target / "extra", DEPTH)
    completed = run_cli("--delete", source_arg, target_arg)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert sorted(p.name for p in target.iterdir()) == ["y"]


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_a_path_over_path_max_fails_alone(server, tmp_path, unique, direction):
    source, target, source_arg, target_arg = locations(direction, server, tmp_path, unique)
    make_deep(source / "long", LONG_LEVELS, "n" * LONG_NAME)
    (source / "ok").mkdir()
    (source / "ok" / "file").write_bytes(b"fine")
    completed = run_cli(source_arg, target_arg)
    assert completed.returncode == 23, completed.stderr[-2000:]
    assert (target / "ok" / "file").read_bytes() == b"fine"
    errors = one_line_errors(completed.stderr)
    assert len([line for line in errors if "longer than 4096 bytes" in line]) == 1, errors
    assert "Traceback" not in completed.stderr


def test_remove_of_a_server_tree_with_a_path_over_path_max_removes_the_rest(server, unique):
    tree = server.root / unique
    make_deep(tree / "long", LONG_LEVELS, "n" * LONG_NAME)
    (tree / "ok").mkdir()
    (tree / "ok" / "file").write_bytes(b"fine")
    completed = run_cli("--remove", server.url(unique))
    assert completed.returncode == 23, completed.stderr[-2000:]
    assert not (tree / "ok").exists()
    errors = one_line_errors(completed.stderr)
    assert len(errors) == 2 and "longer than 4096 bytes" in errors[0], errors  # the entry, the summary


def test_remove_of_a_local_deep_tree(tmp_path):
    make_deep(tmp_path / "deep", DEPTH)
    completed = run_cli("--remove", str(tmp_path / "deep"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert not (tmp_path / "deep").exists()


def test_a_wide_directory_is_listed_with_few_descriptors(tmp_path):
    # 300 subdirectories under a limit of 128 descriptors: the listing must not
    # hold one descriptor per directory still to list.
    source = tmp_path / "source"
    for index in range(300):
        (source / f"d{index}").mkdir(parents=True)
    (source / "d299" / "file").write_bytes(b"x")

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    completed = subprocess.run(pdiffcopy_command("-c", "1", str(source) + "/", str(tmp_path / "target")),
                               capture_output=True, text=True, timeout=60, preexec_fn=low_limit)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert (tmp_path / "target" / "d299" / "file").read_bytes() == b"x"
    assert len(list((tmp_path / "target").iterdir())) == 300


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_a_path_over_path_max_in_the_target_fails_alone(server, tmp_path, unique, direction):
    source, target, source_arg, target_arg = locations(direction, server, tmp_path, unique)
    (source / "ok").mkdir(parents=True)
    (source / "ok" / "file").write_bytes(b"fine")
    make_deep(target / "long", LONG_LEVELS, "n" * LONG_NAME)
    (target / "extra.txt").write_bytes(b"extra")
    completed = run_cli("--delete", source_arg, target_arg)
    assert completed.returncode == 23, completed.stderr[-2000:]
    assert (target / "ok" / "file").read_bytes() == b"fine"
    assert not (target / "extra.txt").exists()
    errors = one_line_errors(completed.stderr)
    assert len(errors) == 2 and "longer than 4096 bytes" in errors[0], errors  # the entry, the summary


def test_a_deep_tree_under_the_usual_soft_descriptor_limit(server, tmp_path, unique, direction="local"):
    # 1,024 is the usual soft limit; a walk of 1,100 levels holds a descriptor per level.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard limit ({hard}) leaves no room to raise the soft one")
    source, target, source_arg, target_arg = locations(direction, server, tmp_path, unique)
    (source / "x").parent.mkdir(parents=True, exist_ok=True)
    (source / "x").write_bytes(b"a file now")
    make_deep(source / "deep", DEPTH)
    make_deep(target / "x", DEPTH)

    def usual_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    completed = subprocess.run(pdiffcopy_command(source_arg, target_arg), capture_output=True, text=True,
                               timeout=120, preexec_fn=usual_limit)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert (target / "x").read_bytes() == b"a file now"
    assert (target / ("deep" + "/d" * DEPTH) / "leaf.txt").read_bytes() == b"leaf"

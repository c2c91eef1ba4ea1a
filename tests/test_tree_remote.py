"""Tree sync through the real server: pull, push, delete, filters, dry run, big files."""

from __future__ import annotations

import os

import pytest

from conftest import random_bytes, run_cli
from test_tree import make_tree, snapshot


def sync(*args, ok: bool = True, env_extra=None):
    done = run_cli("--no-progress", *map(str, args), env_extra=env_extra)
    if ok:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "src")


@pytest.fixture
def remote(server, unique):
    """A fresh directory name on the server: (URL with trailing slash, local path)."""
    name = unique.replace(".img", "")
    return server.url(name) + "/", server.root / name


def test_push_then_pull_round_trip_keeps_everything(tree, tmp_path, remote):
    url, path = remote
    sync("-a", f"{tree}/", url)
    assert snapshot(path, times=True) == snapshot(tree, times=True)
    assert os.stat(path).st_mtime_ns == os.stat(tree).st_mtime_ns  # the tree's own directory
    sync("-a", url, tmp_path / "back")
    assert snapshot(tmp_path / "back", times=True) == snapshot(tree, times=True)
    assert os.stat(tmp_path / "back").st_mtime_ns == os.stat(tree).st_mtime_ns
    assert os.readlink(tmp_path / "back" / "link-outside") == "/etc/hostname"


def test_second_push_and_pull_move_nothing(tree, tmp_path, remote):
    url, _ = remote
    sync("-a", f"{tree}/", url)
    assert "0 file(s) copied (0 bytes moved)" in sync("-a", f"{tree}/", url).stderr
    sync("-a", url, tmp_path / "back")
    assert "0 file(s) copied (0 bytes moved)" in sync("-a", url, tmp_path / "back").stderr


def test_push_directory_itself_without_trailing_slash(tree, remote):
    url, path = remote
    sync(tree, url)
    assert snapshot(path / "src") == snapshot(tree)


def test_push_updates_and_deletes_but_never_excluded(tree, remote):
    url, path = remote
    sync("-a", f"{tree}/", url)
    (path / "extra").write_bytes(b"x")
    (path / "keep.log").write_bytes(b"log")
    (path / "extra-dir" / "deep").mkdir(parents=True)
    (tree / "a.txt").write_bytes(b"shorter")
    sync("-a", "--delete", "-e", r"\.log$", f"{tree}/", url)
    expected = snapshot(tree, times=True)
    got = snapshot(path, times=True)
    assert got.pop("keep.log")[0] == "file"
    assert got == expected


def test_pull_with_delete_and_include(tree, tmp_path, remote):
    url, _ = remote
    sync("-a", f"{tree}/", url)
    target = tmp_path / "back"
    target.mkdir()
    (target / "stale.bin").write_bytes(b"stale")
    (target / "other.txt").write_bytes(b"not selected: protected")
    sync("-a", "--delete", "-i", r"\.bin$", url, target)
    assert set(snapshot(target)) == {"sub", "sub/b.bin", "sub/deeper", "sub/deeper/c.bin", "other.txt"}


def test_remote_dry_run_and_diff_change_nothing(tree, remote):
    url, path = remote
    sync("-a", f"{tree}/", url)
    (tree / "a.txt").write_bytes(b"different")
    (path / "extraneous").write_bytes(b"x")
    before = snapshot(path, times=True)
    lines = sync("-a", "--diff", f"{tree}/", url).stdout.splitlines()
    assert snapshot(path, times=True) == before
    assert len(lines) == 2, lines
    assert lines[0].startswith("changed") and "a.txt" in lines[0]
    assert lines[1].startswith("extraneous")


def test_remote_remove(tree, remote):
    url, path = remote
    sync("-a", f"{tree}/", url)
    sync("--remove", url)
    assert not path.exists()


def test_token_is_required_and_sent(token_server, tree, tmp_path):
    url = token_server.url("tree-with-token") + "/"
    refused = sync(f"{tree}/", url, ok=False)
    assert refused.returncode == 1 and "token" in refused.stderr.lower()
    sync(f"{tree}/", url, env_extra={"PDIFFCOPY_TOKEN": "s3cret-token"})
    assert snapshot(token_server.root / "tree-with-token") == snapshot(tree)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_big_files_by_ranges_and_block_delta_remote(tmp_path, remote, monkeypatch, direction):
    from pdiffcopy import treesync
    from pdiffcopy.localtree import LocalTree
    from pdiffcopy.remotetree import RemoteTree

    monkeypatch.setattr(treesync, "RANGE_SIZE", 1024 * 1024)
    monkeypatch.setattr(treesync, "DELTA_MIN_SIZE", 256 * 1024)
    url, path = remote
    local = tmp_path / "local"
    local.mkdir()
    side = local if direction == "push" else path
    side.mkdir(exist_ok=True)
    big = random_bytes(4 * 1024 * 1024 + 999, seed=11)
    name = os.fsdecode(b"big \xe9 name")  # not UTF-8: its URL must carry the bytes
    (side / name).write_bytes(big)
    (side / "small").write_bytes(b"small")

    def run():
        remote_tree = RemoteTree(url, token=None, concurrency=2, timeout=30, ca_file=None)
        trees = (LocalTree(f"{local}/"), remote_tree) if direction == "push" else \
            (remote_tree, LocalTree(f"{local}/"))
        try:
            return treesync.sync_tree(*trees, treesync.TreeOptions(times=True, concurrency=2,
                                                                   block_size=64 * 1024))
        finally:
            remote_tree.close()

    first = run()
    assert not first.failures and first.bytes_moved == len(big) + 5
    assert snapshot(path, times=True) == snapshot(local, times=True)
    changed = bytearray(big)
    changed[2 * 1024 * 1024] ^= 0x55
    (side / name).write_bytes(bytes(changed))
    second = run()
    assert not second.failures
    assert second.bytes_moved <= 2 * 64 * 1024, second.bytes_moved
    assert snapshot(path, times=True) == snapshot(local, times=True)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_sparse_files_stay_sparse_through_the_server(tmp_path, remote, direction):
    url, path = remote
    local = tmp_path / "local"
    side = local if direction == "push" else path
    side.mkdir(parents=True)
    with open(side / "sparse", "wb") as handle:
        handle.truncate(8 * 1024 * 1024)
        handle.seek(4 * 1024 * 1024)
        handle.write(b"the only data")
    if direction == "push":
        sync(f"{local}/", url)
    else:
        sync(url, f"{local}/")
    copy = (path if direction == "push" else local) / "sparse"
    assert copy.read_bytes() == (side / "sparse").read_bytes()
    assert os.stat(copy).st_blocks * 512 <= 64 * 1024, os.stat(copy).st_blocks


def test_file_with_url_characters_goes_into_a_remote_directory(tmp_path, remote):
    url, path = remote
    path.mkdir()
    name = "a #1 %41?.txt"  # '#', '%' and '?' must be encoded in the URL
    (tmp_path / name).write_bytes(b"odd name")
    sync(tmp_path / name, url)
    assert (path / name).read_bytes() == b"odd name"
    assert sorted(os.listdir(path)) == [name]

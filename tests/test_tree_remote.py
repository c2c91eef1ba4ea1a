"""Tree sync through the real server: what only a server has (its token, URL-encoded names).

The scenarios shared with local syncs run in each mode (local, pull, push) in test_tree.py.
"""

from __future__ import annotations

import os

import pytest

from test_tree import make_tree, snapshot, sync


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "src")


@pytest.fixture
def remote(server, unique):
    """A fresh directory name on the server: (URL with trailing slash, local path)."""
    name = unique.replace(".img", "")
    return server.url(name) + "/", server.root / name


def test_token_is_required_and_sent(token_server, tree, tmp_path):
    url = token_server.url("tree-with-token") + "/"
    refused = sync(f"{tree}/", url, ok=False)
    assert refused.returncode == 5 and "token" in refused.stderr.lower()
    sync(f"{tree}/", url, env_extra={"PDIFFCOPY_TOKEN": "s3cret-token"})
    assert snapshot(token_server.root / "tree-with-token") == snapshot(tree)


def test_file_with_url_characters_goes_into_a_remote_directory(tmp_path, remote):
    url, path = remote
    path.mkdir()
    name = "a #1 %41?.txt"  # '#', '%' and '?' must be encoded in the URL
    (tmp_path / name).write_bytes(b"odd name")
    sync(tmp_path / name, url)
    assert (path / name).read_bytes() == b"odd name"
    assert sorted(os.listdir(path)) == [name]


def test_a_remote_listing_shares_one_kind_and_mode_object_among_its_entries(server, unique):
    # A million-entry listing holds every entry at once: a string per kind and an int per mode
    # each would be ~80 bytes an entry more on the client (issue 22: memory flat in the files).
    from pdiffcopy.core.treeplan import FILE
    from pdiffcopy.transport.remotetree import RemoteTree

    root = server.root / unique.replace(".img", "")
    root.mkdir()
    for index in range(50):
        (root / f"f{index}").write_bytes(b"x" * index)
        os.chmod(root / f"f{index}", 0o640)
    tree = RemoteTree(server.url(root.name) + "/", concurrency=1, timeout=30)
    try:
        entries = tree.list().entries
    finally:
        tree.close()
    assert sorted(e.path for e in entries) == sorted(f"f{index}" for index in range(50))
    assert all(e.kind is FILE for e in entries)
    assert len({id(e.mode) for e in entries}) == 1 and entries[0].mode & 0o7777 == 0o640

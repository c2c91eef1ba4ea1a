"""What a server lets its clients do to the files it holds: set-id bits, owners, hard-linked files.

A token holder is not root on the server: unless the server is started with
``--trust-clients``, a tree push with ``-a`` keeps neither setuid/setgid bits
nor owners (and says so once). A file with several hard links is not changed
in place (data, size or metadata) unless the server is started with
``--write-hard-links``: its other names, maybe outside the root, would
change too; ``--atomic`` replaces it instead. Reading it is allowed.
"""

from __future__ import annotations

import os
import struct
import stat
import urllib.error
import urllib.request

import pytest

from conftest import http_get, random_bytes, run_cli, start_server

IS_ROOT = os.geteuid() == 0
OTHER_UID = 1234  # someone else, neither the server's user nor root

needs_root = pytest.mark.skipif(not IS_ROOT, reason="setting other owners needs root")


@pytest.fixture(scope="module")
def trusting_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("trusting-root")
    running = start_server(root, tmp_path_factory.mktemp("trusting-log") / "server.log",
                           extra=("--trust-clients", "--write-hard-links"))
    yield running
    running.stop()


def setid_tree(directory) -> None:
    """A setuid program of someone else, a setuid-root one, a setgid directory."""
    (directory / "shared").mkdir(parents=True)
    os.chmod(directory / "shared", 0o2775)
    for name, mode, uid in (("tool", 0o6755, OTHER_UID), ("rootshell", 0o4755, 0)):
        path = directory / name
        path.write_bytes(b"#!/bin/sh\nid\n")
        os.chown(path, uid, uid)
        os.chmod(path, mode)  # after chown, which clears set-id bits
    (directory / "plain").write_bytes(b"later made setuid")
    os.chown(directory / "plain", OTHER_UID, OTHER_UID)


def push(*args):
    return run_cli("--no-progress", *args, timeout=60)


def push_setid_tree(server, unique, tmp_path):
    """Push :func:`setid_tree` with ``-a`` to a new directory of ``server``: (source, target, result)."""
    source = tmp_path / "src"
    setid_tree(source)
    result = push("-a", f"{source}/", server.url(unique) + "/")
    assert result.returncode == 0, result.stderr
    return source, server.root / unique, result


@needs_root
def test_a_push_with_archive_plants_no_setid_files_and_no_owners(server, unique, tmp_path):
    source, target, result = push_setid_tree(server, unique, tmp_path)
    for name in ("tool", "rootshell", "plain"):
        info = os.lstat(target / name)
        assert not info.st_mode & (stat.S_ISUID | stat.S_ISGID), name
        assert (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid()), name  # the server's
    assert stat.S_IMODE(os.lstat(target / "tool").st_mode) == 0o755
    assert os.lstat(target / "shared").st_mode & stat.S_ISGID  # a directory's: only inheritance
    assert result.stderr.count("owners are not kept") == 1
    assert result.stderr.count("setuid/setgid bits are not kept") == 1
    assert "Traceback" not in result.stderr
    # Made setuid later: the metadata change (no data moves) is stripped the same way.
    os.chmod(source / "plain", 0o4755)
    result = push("-a", f"{source}/", server.url(unique) + "/")
    assert result.returncode == 0, result.stderr
    assert not os.lstat(target / "plain").st_mode & stat.S_ISUID


@needs_root
def test_a_server_that_trusts_its_clients_keeps_setid_bits_and_owners(trusting_server, unique, tmp_path):
    _, target, result = push_setid_tree(trusting_server, unique, tmp_path)
    tool = os.lstat(target / "tool")
    assert stat.S_IMODE(tool.st_mode) == 0o6755 and tool.st_uid == OTHER_UID
    assert os.lstat(target / "rootshell").st_mode & stat.S_ISUID
    assert "not kept" not in result.stderr


@pytest.fixture
def hard_link(server, unique):
    """A file in the root that is a hard link to a file outside it."""
    outside = server.root.parent / f"outside-{unique}"
    outside.write_bytes(random_bytes(200_000, seed=11))
    os.chmod(outside, 0o640)
    os.link(outside, server.root / unique)
    yield outside
    outside.unlink()


def test_a_hard_linked_file_is_not_written_in_place(server, unique, hard_link, tmp_path):
    before = hard_link.read_bytes()
    source = tmp_path / "new.img"
    source.write_bytes(random_bytes(200_000, seed=12))
    result = push(str(source), server.url(unique))
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "2 hard links" in result.stderr
    assert "--atomic" in result.stderr
    assert hard_link.read_bytes() == before
    # Replaced through a temporary and a rename, only the name in the root changes.
    result = push("--atomic", str(source), server.url(unique))
    assert result.returncode == 0, result.stderr
    assert hard_link.read_bytes() == before
    assert (server.root / unique).read_bytes() == source.read_bytes()
    assert os.lstat(server.root / unique).st_nlink == 1


def test_patch_resize_and_punch_of_a_hard_linked_file_are_refused(server, unique, hard_link):
    before = hard_link.read_bytes()
    patch = urllib.request.Request(server.url(unique), data=b"xxxx", method="PATCH",
                                   headers={"Content-Range": "bytes 0-3/*"})
    resize = urllib.request.Request(f"{server.base}/.pdiffcopy/resize/{unique}?size=10", method="POST")
    punch = urllib.request.Request(f"{server.base}/.pdiffcopy/punch/{unique}", method="POST",
                                   data=struct.pack("<QQ", 0, 4), headers={"Content-Type": "application/octet-stream"})
    for request in (patch, resize, punch):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 403
        assert b"hard links" in refused.value.read()
    assert hard_link.read_bytes() == before
    # Reading it is allowed: whoever made the link could read the file already.
    status, _, body = http_get(server.url(unique))
    assert status == 200 and body == before


def test_a_tree_push_gives_a_hard_linked_name_its_own_file_and_leaves_the_other_alone(server, unique, tmp_path):
    target = server.root / unique
    target.mkdir()
    outside = server.root.parent / f"outside-{unique}"
    outside.write_bytes(b"same content")
    os.chmod(outside, 0o600)
    os.link(outside, target / "linked")
    source = tmp_path / "src"
    source.mkdir()
    (source / "linked").write_bytes(b"same content")
    os.chmod(source / "linked", 0o666)
    os.utime(source / "linked", ns=(os.lstat(outside).st_mtime_ns,) * 2)  # only the mode differs
    try:
        # The name gets a file of its own, with the source's mode, as rsync's copy through a
        # temporary gives it; the file outside keeps its mode.
        result = push(f"{source}/", server.url(unique) + "/")
        assert result.returncode == 0, result.stderr
        assert stat.S_IMODE(os.lstat(outside).st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(target / "linked").st_mode) == 0o666
        assert not os.path.samefile(outside, target / "linked")
    finally:
        outside.unlink()


def test_a_server_may_be_told_to_write_hard_linked_files(trusting_server, unique, tmp_path):
    outside = trusting_server.root.parent / f"outside-{unique}"
    outside.write_bytes(random_bytes(200_000, seed=11))
    os.link(outside, trusting_server.root / unique)
    source = tmp_path / "new.img"
    source.write_bytes(random_bytes(200_000, seed=12))
    try:
        result = push(str(source), trusting_server.url(unique))
        assert result.returncode == 0, result.stderr
        assert outside.read_bytes() == source.read_bytes()  # what the option is for: every name changes
    finally:
        outside.unlink()

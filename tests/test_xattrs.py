"""Extended attributes (-X) and POSIX ACLs (-A) of tree syncs, local, pull and push, compared with rsync -aAX.

The trees carry attributes in every namespace the test can set (user.*; as root
trusted.* and security.*, on symlinks too), ACLs naming users and groups, and
default ACLs on directories. The session server does not trust its clients:
a push to it keeps user.* and ACLs only; a server started with
--trust-clients keeps the rest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli, start_server

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="trusted.* and security.* need root")
needs_acl_tools = pytest.mark.skipif(not shutil.which("setfacl") or not shutil.which("getfacl"),
                                     reason="setfacl/getfacl missing (Debian's acl)")
PRIVILEGED = ("trusted.", "security.")


def sync(*args, ok: bool = True) -> subprocess.CompletedProcess:
    done = run_cli("--no-progress", *map(str, args))
    if ok:
        assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done


def attributes(root: Path, privileged: bool = True) -> dict:
    """Every attribute below ``root`` (the root too), by relative path: {name: value}; symlinks' own."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in ["", *dirs, *files] if directory == str(root) else [*dirs, *files]:
            path = os.path.join(directory, name) if name else directory
            values = {key: os.getxattr(path, key, follow_symlinks=False)
                      for key in os.listxattr(path, follow_symlinks=False)
                      if privileged or not key.startswith(PRIVILEGED)}
            found[os.path.relpath(path, root)] = values
    return found


def getfacl(root: Path) -> str:
    """``getfacl -R`` of a tree, with paths relative to it (the reference tool's view of the ACLs)."""
    done = subprocess.run(["getfacl", "-R", "-p", "."], cwd=root, capture_output=True, text=True, check=True)
    return done.stdout


def setfacl(*args) -> None:
    subprocess.run(["setfacl", *map(str, args)], check=True)


def attributed_tree(root: Path) -> Path:
    """Files, directories and symlinks with attributes and ACLs of every kind the test can set."""
    (root / "dir" / "inner").mkdir(parents=True)
    (root / "file").write_bytes(b"content\n")
    (root / "dir" / "inner" / "deep").write_bytes(b"deep\n")
    (root / "plain").write_bytes(b"no attributes\n")
    os.symlink("file", root / "link")
    os.setxattr(root / "file", "user.colour", b"blue")
    os.setxattr(root / "file", "user.binary", bytes(range(256)))
    os.setxattr(root / "file", "user.empty", b"")
    os.setxattr(root / "dir", "user.purpose", b"holds things")
    os.setxattr(root, "user.root", b"the tree's own directory")
    if IS_ROOT:
        os.setxattr(root / "file", "trusted.md5", b"0123456789abcdef")
        os.setxattr(root / "file", "security.label", b"secret")
        os.setxattr(root / "dir", "trusted.dir", b"1")
        os.setxattr(root / "link", "trusted.link", b"on the link itself", follow_symlinks=False)
    setfacl("-m", "u:daemon:r-x,g:bin:rw-,u:bin:r--", root / "file")
    setfacl("-m", "u:daemon:rwx", root / "dir")
    setfacl("-d", "-m", "u:bin:rwx,g:daemon:r-x", root / "dir")
    setfacl("-d", "-m", "u:daemon:r--", root / "dir" / "inner")
    return root


@needs_acl_tools
def test_attributes_and_acls_kept_as_rsync_keeps_them(ends, tmp_path):
    source = attributed_tree(ends.source)
    trusted = ends.mode != "push"  # the session server does not trust its clients
    done = sync("-aXA", ends.source_arg(), ends.target_arg)
    assert attributes(ends.target) == attributes(source, privileged=trusted)
    assert attributes(ends.target)["link"] == ({"trusted.link": b"on the link itself"} if IS_ROOT and trusted
                                               else {})
    assert getfacl(ends.target) == getfacl(source)
    assert os.readlink(ends.target / "link") == "file"
    assert (ends.target / "dir" / "inner" / "deep").read_bytes() == b"deep\n"
    if ends.mode == "push" and IS_ROOT:
        assert done.stderr.count("security.* and trusted.* attributes are not kept") == 1
    if shutil.which("rsync"):
        reference = tmp_path / "rsync"
        subprocess.run(["rsync", "-aAX", f"{source}/", f"{reference}/"], check=True)
        assert attributes(ends.target) == attributes(reference, privileged=trusted)
        assert getfacl(ends.target) == getfacl(reference)
    # Nothing differs now: the second run changes nothing.
    again = sync("-aXA", "-v", ends.source_arg(), ends.target_arg)
    assert "0 file(s) copied" in again.stderr and "metadata" not in again.stderr.split("INFO")[-1]


@needs_acl_tools
def test_attributes_gone_from_the_source_are_removed(ends):
    source = attributed_tree(ends.source)
    sync("-aXA", ends.source_arg(), ends.target_arg)
    os.removexattr(source / "file", "user.colour")
    os.removexattr(source / "dir", "user.purpose")
    setfacl("-b", source / "file")
    setfacl("-k", source / "dir")
    sync("-aXA", ends.source_arg(), ends.target_arg)
    assert "user.colour" not in os.listxattr(ends.target / "file")
    assert "user.binary" in os.listxattr(ends.target / "file")
    assert "user.purpose" not in os.listxattr(ends.target / "dir")
    assert getfacl(ends.target) == getfacl(source)
    assert "system.posix_acl_access" not in os.listxattr(ends.target / "file")


def test_a_change_of_attributes_alone_is_synced_with_X_only(ends):
    source = ends.source
    source.mkdir()
    (source / "file").write_bytes(b"same size, same time\n")
    os.setxattr(source / "file", "user.version", b"1")
    sync("-aX", ends.source_arg(), ends.target_arg)
    assert os.getxattr(ends.target / "file", "user.version") == b"1"
    before = os.stat(source / "file").st_mtime_ns
    os.setxattr(source / "file", "user.version", b"2")
    assert os.stat(source / "file").st_mtime_ns == before  # the quick check sees nothing else
    sync("-a", ends.source_arg(), ends.target_arg)
    assert os.getxattr(ends.target / "file", "user.version") == b"1"  # -a alone: attributes are not its
    sync("-aX", ends.source_arg(), ends.target_arg)
    assert os.getxattr(ends.target / "file", "user.version") == b"2"


def test_a_keeps_no_attributes_as_in_rsync(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "file").write_bytes(b"x")
    os.setxattr(source / "file", "user.kept", b"only with -X")
    sync("-a", f"{source}/", tmp_path / "dst")
    assert os.listxattr(tmp_path / "dst" / "file") == []


@needs_acl_tools
def test_the_library_keeps_them_when_asked(tmp_path):
    import pdiffcopy

    source = attributed_tree(tmp_path / "src")
    result = pdiffcopy.sync_tree(f"{source}/", str(tmp_path / "dst"), xattrs=True, acls=True, times=True)
    assert not result.failures
    assert attributes(tmp_path / "dst") == attributes(source)
    assert getfacl(tmp_path / "dst") == getfacl(source)


@needs_acl_tools
def test_acls_alone_with_A(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "file").write_bytes(b"x")
    os.setxattr(source / "file", "user.left", b"out")
    setfacl("-m", "u:daemon:rw-", source / "file")
    sync("-aA", f"{source}/", tmp_path / "dst")
    assert getfacl(tmp_path / "dst") == getfacl(source)
    assert "user.left" not in os.listxattr(tmp_path / "dst" / "file")


@pytest.fixture(scope="module")
def trusting_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("trusting-root")
    running = start_server(root, tmp_path_factory.mktemp("trusting-log") / "server.log",
                           extra=("--trust-clients",))
    yield running
    running.stop()


@needs_root
def test_privileged_attributes_go_to_a_trusting_server_only(server, trusting_server, unique, tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "file").write_bytes(b"x")
    os.setxattr(source / "file", "user.plain", b"1")
    os.setxattr(source / "file", "trusted.secret", b"2")
    os.setxattr(source / "file", "security.label", b"3")
    sync("-a", f"{source}/", server.url(unique) + "/")
    # The untrusting server's own privileged attributes are left alone, not removed.
    target = server.root / unique / "file"
    os.setxattr(target, "trusted.servers", b"own")
    done = sync("-aX", f"{source}/", server.url(unique) + "/")
    assert {name: os.getxattr(target, name) for name in os.listxattr(target)} == \
        {"user.plain": b"1", "trusted.servers": b"own"}
    assert done.stderr.count("security.* and trusted.* attributes are not kept") == 1
    sync("-aX", f"{source}/", trusting_server.url(unique) + "/")
    assert attributes(trusting_server.root / unique)["file"] == attributes(source)["file"]



@needs_acl_tools
def test_a_target_without_attributes_warns_once_and_gets_the_data(ramfs, tmp_path):
    source = tmp_path / "src"
    (source / "dir").mkdir(parents=True)
    for number in range(150):  # enough for several worker processes (-c 2)
        path = source / "dir" / f"file{number}"
        path.write_bytes(b"data %d\n" % number)
        os.setxattr(path, "user.number", b"%d" % number)
    setfacl("-m", "u:daemon:r--", source / "dir" / "file0")
    done = sync("-c", "2", "-tXA", f"{source}/", ramfs / "dst")
    assert done.stderr.count("not kept") == 1, done.stderr
    assert "does not support them" in done.stderr
    assert sorted(os.listdir(ramfs / "dst" / "dir")) == sorted(os.listdir(source / "dir"))
    assert (ramfs / "dst" / "dir" / "file149").read_bytes() == b"data 149\n"


def test_acl_users_travel_by_name_unless_numeric_ids(server, unique):
    """A client's ACL naming ``daemon`` with a number this host gives someone else gets this host's daemon."""
    from pdiffcopy.core.treeplan import METADATA, Entry, Operation
    from pdiffcopy.core.xattrs import ACL_ACCESS
    from pdiffcopy.engine.treeendpoints import MetadataOptions
    from pdiffcopy.transport.remotetree import RemoteTree

    directory = server.root / unique
    directory.mkdir()
    (directory / "file").write_bytes(b"x")
    acl = b"user:::rw-\nuser:daemon:4242:r--\ngroup:::r--\ngroup:nosuchgroup-pdc:4343:rw-\nmask:::rw-\nother:::---\n"
    entry = Entry("file", "file", 1, 0, 0o100640, xattrs=((ACL_ACCESS, acl),))
    tree = RemoteTree(server.url(unique) + "/", timeout=30)
    try:
        assert tree.apply([Operation(METADATA, entry)], MetadataOptions(acls=True)) == []
        text = subprocess.run(["getfacl", "-n", "-p", directory / "file"], capture_output=True, text=True).stdout
        assert "user:1:r--" in text  # daemon is 1 here
        assert "group:4343:rw-" in text  # an unknown name keeps its number, as rsync does
        assert tree.apply([Operation(METADATA, entry)], MetadataOptions(acls=True, numeric_ids=True)) == []
        text = subprocess.run(["getfacl", "-n", "-p", directory / "file"], capture_output=True, text=True).stdout
        assert "user:4242:r--" in text
        # The listing names them (numbers with --numeric-ids).
        tree.list_attributes(MetadataOptions(acls=True))
        listed = dict(next(e for e in tree.list().entries if e.path == "file").xattrs)[ACL_ACCESS]
        assert b"user::4242:r--" in listed  # nobody here is 4242: a number only
        setfacl("-m", "u:daemon:r-x", directory / "file")
        listed = dict(next(e for e in tree.list().entries if e.path == "file").xattrs)[ACL_ACCESS]
        assert b"user:daemon:1:r-x" in listed
        tree.list_attributes(MetadataOptions(acls=True, numeric_ids=True))
        listed = dict(next(e for e in tree.list().entries if e.path == "file").xattrs)[ACL_ACCESS]
        assert b"user::1:r-x" in listed
    finally:
        tree.close()


def test_a_malformed_acl_from_a_client_fails_that_path_only(server, unique):
    from pdiffcopy.core.treeplan import METADATA, Entry, Operation
    from pdiffcopy.core.xattrs import ACL_ACCESS
    from pdiffcopy.engine.treeendpoints import MetadataOptions
    from pdiffcopy.transport.remotetree import RemoteTree

    directory = server.root / unique
    directory.mkdir()
    for name in ("bad", "good"):
        (directory / name).write_bytes(b"x")
    bad = Entry("bad", "file", 1, 0, 0o100644, xattrs=((ACL_ACCESS, b"user:::rwz\n"),))
    good = Entry("good", "file", 1, 0, 0o100644, xattrs=(("user.fine", b"yes"),))
    tree = RemoteTree(server.url(unique) + "/", timeout=30)
    try:
        failures = tree.apply([Operation(METADATA, bad), Operation(METADATA, good)],
                              MetadataOptions(xattrs=True, acls=True))
    finally:
        tree.close()
    assert [path for path, _ in failures] == ["bad"] and "ACL" in failures[0][1]
    assert os.getxattr(directory / "good", "user.fine") == b"yes"


def test_acls_of_two_hosts_compare_by_name_where_both_have_one():
    """The same users under other numbers on another host are the same ACL; other permissions are not."""
    from pdiffcopy.core.xattrs import ACL_ACCESS, acl_from_text, acl_to_text, attributes_differ

    here = b"user:::rw-\nuser:daemon:1:r--\nuser:bin:2:r--\ngroup:::r--\nmask:::r--\nother:::---\n"
    there = b"user:::rw-\nuser:daemon:9:r--\nuser:bin:7:r--\ngroup:::r--\nmask:::r--\nother:::---\n"
    numbers = b"user:::rw-\nuser::1:r--\nuser::2:r--\ngroup:::r--\nmask:::r--\nother:::---\n"
    wider = there.replace(b"bin:7:r--", b"bin:7:r-x")
    assert not attributes_differ(((ACL_ACCESS, here),), ((ACL_ACCESS, there),))
    assert not attributes_differ(((ACL_ACCESS, here),), ((ACL_ACCESS, numbers),))
    assert attributes_differ(((ACL_ACCESS, here),), ((ACL_ACCESS, wider),))
    # Through the kernel's format (ordered by number) and back: numbers from names, names from numbers.
    binary = acl_from_text(there, lambda tag, name: {"daemon": 1, "bin": 2}[name])
    assert acl_to_text(binary, lambda tag, number: {1: "daemon", 2: "bin"}[number]) == here
    assert acl_to_text(binary, None) == numbers

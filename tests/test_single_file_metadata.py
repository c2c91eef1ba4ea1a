"""A single file keeps what ``-a``, ``-X`` and ``-A`` promise, as a tree of one does (issue 38).

A file SOURCE once lost all of it: ``pdiffcopy -aAX key d/key`` made a 0600 key 0644, with the
current time, root's owner, no attributes and no ACLs, and ``pdiffcopy -a link d/`` wrote the
link's target as a regular file. Each case is run locally, pulled from a server and pushed to
one, and compared with what ``rsync`` makes of the same file; one goes over ssh.

Without ``-a`` a new copy gets the source's mode less the umask (rsync's rule: never more than
the source has) and an existing target keeps its own mode.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from conftest import run_cli, start_server
import test_ssh
from test_ssh import over_ssh

#: The ssh tests' sshd, for the test over ssh.
sshd = test_ssh.sshd

needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is needed to compare with")
needs_acl_tools = pytest.mark.skipif(not (shutil.which("rsync") and shutil.which("setfacl")),
                                     reason="rsync and setfacl (Debian's rsync and acl) are needed")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="owners can only be given as root")

#: A time no sync would give a file by chance.
OLD_NS = 981_173_106_123_456_789
OWNER = (1234, 4321)


@pytest.fixture(scope="module")
def trusting_server(tmp_path_factory):
    """A server that lets its clients set owners (--trust-clients), as one pushing -a needs."""
    root = tmp_path_factory.mktemp("trusting-root")
    running = start_server(root, tmp_path_factory.mktemp("trusting-log") / "server.log",
                           extra=("--trust-clients",))
    yield running
    running.stop()


@dataclass
class FileEnds:
    """Where the single file's source and its target directory are, on disk and as arguments."""

    mode: str
    source_dir: Path
    target_dir: Path
    source_url: Optional[str] = None
    target_url: Optional[str] = None

    def source_arg(self, name: str) -> str:
        return f"{self.source_url}/{name}" if self.source_url else str(self.source_dir / name)

    def target_arg(self, name: str = "") -> str:
        """The target: the file ``name`` in the target directory, or the directory itself (``dir/``)."""
        return f"{self.target_url or self.target_dir}/{name}"


@pytest.fixture(params=("local", "pull", "push"))
def ends(request, tmp_path, unique, trusting_server) -> FileEnds:
    """A file sync's two ends: local -> local, server -> local, local -> server (one that trusts its clients)."""
    server = trusting_server
    name = unique.replace(".img", "")
    if request.param == "local":
        source, target = tmp_path / "src", tmp_path / "dst"
        urls = {}
    elif request.param == "pull":
        source, target = server.root / name, tmp_path / "dst"
        urls = {"source_url": server.url(name)}
    else:
        source, target = tmp_path / "src", server.root / name
        urls = {"target_url": server.url(name)}
    source.mkdir()
    target.mkdir()
    return FileEnds(request.param, source, target, **urls)


def make_key(directory: Path, name: str = "key", mode: int = 0o600) -> Path:
    key = directory / name
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot really\n")
    os.chmod(key, mode)
    if os.geteuid() == 0:
        os.chown(key, *OWNER)
    os.utime(key, ns=(OLD_NS, OLD_NS))
    return key


def sync(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = run_cli("--no-progress", *args)
    assert "Traceback" not in done.stderr, done.stderr
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def described(path: Path) -> dict:
    """What -a, -X and -A keep of a file (the link itself for a symlink)."""
    info = os.lstat(path)
    found = {"kind": stat.S_IFMT(info.st_mode), "mode": oct(stat.S_IMODE(info.st_mode)),
             "owner": (info.st_uid, info.st_gid), "mtime_ns": info.st_mtime_ns}
    if stat.S_ISLNK(info.st_mode):
        found["target"] = os.readlink(path)
    else:
        found["bytes"] = path.read_bytes()
        found["xattrs"] = {name: os.getxattr(path, name) for name in sorted(os.listxattr(path))}
    return found


def rsync(*args: str) -> None:
    subprocess.run(["rsync", *args], check=True)


def getfacl(path: Path) -> str:
    return subprocess.run(["getfacl", "-c", "-p", str(path)], capture_output=True, text=True, check=True).stdout


@needs_acl_tools
@needs_root
def test_aAX_keeps_mode_owner_time_attributes_and_acls_as_rsync(ends, tmp_path):
    key = make_key(ends.source_dir)
    os.setxattr(key, "user.comment", b"deploy key")
    subprocess.run(["setfacl", "-m", "u:daemon:r--,g:bin:r--", str(key)], check=True)
    sync("-aAX", ends.source_arg("key"), ends.target_arg("key"))
    reference = tmp_path / "rsync"
    reference.mkdir()
    rsync("-aAX", str(key), f"{reference}/key")
    ours = described(ends.target_dir / "key")
    assert ours == described(reference / "key")
    assert ours["mode"] == oct(0o640)  # the ACL's mask is the group bits: never world-readable
    assert getfacl(ends.target_dir / "key") == getfacl(reference / "key")


@needs_rsync
@needs_root
def test_a_into_a_directory_keeps_them_too(ends, tmp_path):
    key = make_key(ends.source_dir)
    sync("-a", ends.source_arg("key"), ends.target_arg())
    reference = tmp_path / "rsync"
    reference.mkdir()
    rsync("-a", str(key), f"{reference}/")
    assert described(ends.target_dir / "key") == described(reference / "key")


@needs_rsync
def test_a_resync_of_an_unchanged_file_still_sets_its_metadata(ends):
    key = make_key(ends.source_dir)
    target = ends.target_dir / "key"
    target.write_bytes(key.read_bytes())
    os.chmod(target, 0o666)
    sync("-a", ends.source_arg("key"), ends.target_arg("key"))
    info = os.stat(target)
    assert (stat.S_IMODE(info.st_mode), info.st_mtime_ns) == (0o600, OLD_NS)


@needs_rsync
def test_a_symlink_source_stays_a_symlink_with_a(ends, tmp_path):
    make_key(ends.source_dir)
    os.symlink("key", ends.source_dir / "link")
    os.utime(ends.source_dir / "link", ns=(OLD_NS, OLD_NS), follow_symlinks=False)
    sync("-a", ends.source_arg("link"), ends.target_arg())
    reference = tmp_path / "rsync"
    reference.mkdir()
    rsync("-a", str(ends.source_dir / "link"), f"{reference}/")
    assert described(ends.target_dir / "link") == described(reference / "link")
    assert os.readlink(ends.target_dir / "link") == "key"


@needs_rsync
def test_a_symlink_source_replaces_a_file_of_its_name(ends):
    make_key(ends.source_dir)
    os.symlink("key", ends.source_dir / "link")
    (ends.target_dir / "link").write_bytes(b"an old regular file\n")
    sync("-a", ends.source_arg("link"), ends.target_arg("link"))
    assert os.readlink(ends.target_dir / "link") == "key"


def test_without_a_a_symlink_source_is_followed(ends):
    key = make_key(ends.source_dir)
    os.symlink("key", ends.source_dir / "link")
    sync(ends.source_arg("link"), ends.target_arg("copy"))
    copy = ends.target_dir / "copy"
    assert not copy.is_symlink() and copy.read_bytes() == key.read_bytes()


@needs_rsync
@pytest.mark.parametrize("mode", [0o600, 0o755, 0o640, 0o4755])
def test_without_a_a_new_copy_gets_the_source_mode_less_the_umask_as_rsync(ends, tmp_path, mode):
    key = make_key(ends.source_dir, mode=mode)
    sync(ends.source_arg("key"), ends.target_arg("key"))
    reference = tmp_path / "rsync"
    reference.mkdir()
    rsync(str(key), f"{reference}/key")
    ours = os.stat(ends.target_dir / "key")
    assert oct(stat.S_IMODE(ours.st_mode)) == oct(stat.S_IMODE(os.stat(reference / "key").st_mode))
    assert stat.S_IMODE(ours.st_mode) & ~mode == 0  # never more than the source's


@needs_rsync
@pytest.mark.parametrize("how", [(), ("--atomic",), ("--whole-file", "--atomic"), ("--whole-file", "--partial")])
def test_without_a_an_existing_target_keeps_its_mode_as_rsync(ends, tmp_path, how):
    key = make_key(ends.source_dir, mode=0o644)
    target = ends.target_dir / "key"
    target.write_bytes(b"old content")
    os.chmod(target, 0o640)
    sync(*how, ends.source_arg("key"), ends.target_arg("key"))
    reference = tmp_path / "rsync"
    reference.mkdir()
    (reference / "key").write_bytes(b"old content")
    os.chmod(reference / "key", 0o640)
    rsync(str(key), f"{reference}/key")
    assert stat.S_IMODE(os.stat(target).st_mode) == stat.S_IMODE(os.stat(reference / "key").st_mode) == 0o640
    assert target.read_bytes() == key.read_bytes()


def test_t_keeps_the_time_and_not_the_mode_of_an_existing_target(ends):
    make_key(ends.source_dir, mode=0o600)
    target = ends.target_dir / "key"
    target.write_bytes(b"old")
    os.chmod(target, 0o644)
    sync("-t", ends.source_arg("key"), ends.target_arg("key"))
    info = os.stat(target)
    assert (stat.S_IMODE(info.st_mode), info.st_mtime_ns) == (0o644, OLD_NS)


def test_dry_run_with_a_changes_nothing(ends):
    make_key(ends.source_dir)
    target = ends.target_dir / "key"
    target.write_bytes(b"old")
    os.chmod(target, 0o644)
    before = described(target)
    sync("-a", "-n", ends.source_arg("key"), ends.target_arg("key"))
    assert described(target) == before


@needs_root
def test_a_push_to_a_server_that_does_not_trust_clients_keeps_all_but_the_owner(server, unique, tmp_path):
    key = make_key(tmp_path)
    target = server.root / f"{unique}-key"
    done = sync("-a", str(key), server.url(f"{unique}-key"))
    info = os.stat(target)
    assert (stat.S_IMODE(info.st_mode), info.st_mtime_ns) == (0o600, OLD_NS)
    assert (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid())
    assert "owners are not kept" in done.stderr


@needs_root
def test_over_ssh_a_single_file_keeps_what_a_promises(sshd, tmp_path):
    key = make_key(tmp_path)
    (tmp_path / "remote").mkdir()
    done = over_ssh(sshd, "-a", str(key), f"127.0.0.1:{tmp_path}/remote/key")
    assert done.returncode == 0, done.stderr
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    done = over_ssh(sshd, "-a", f"127.0.0.1:{tmp_path}/remote/key", f"{pulled}/")
    assert done.returncode == 0, done.stderr
    for copy in (tmp_path / "remote" / "key", pulled / "key"):
        assert described(copy) == described(key)

"""Trees with device nodes, fifos and sockets: ``-D`` makes them as nodes, ``--copy-devices`` copies a device.

As rsync does: ``-D`` (``--devices --specials``, part of ``-a``) makes each character and
block device as a node of the same numbers (as root; a user's sync skips them with a warning
and exits 0), and each fifo and unix socket as such a node (any user); an identical node is
left alone, one of other numbers or of another type replaced; ``--delete``, the filters and
``-n`` treat them as any entry. ``--copy-devices`` copies a block device of a local source as
a regular file of its contents; a character device, which has no size, is never read. Each
scenario runs locally, pulled from a server and pushed to one (a server that trusts its
clients: only those get device nodes), and every count a summary prints is checked on the disk.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest

from conftest import TREE_MODES, TreeEnds, random_bytes, run_cli, start_server

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes needs root")

NOBODY = 65534
OTHER_UID = 1234
#: /dev/null's numbers, and a loop device's (major 7): nodes of them open nothing here.
NULL = os.makedev(1, 3)
LOOP = os.makedev(7, 0)
ZERO = os.makedev(1, 5)
MTIME_NS = 1_700_000_000_123_456_789

#: The nodes of a source tree: path -> (type, permissions, rdev).
NODES: Dict[str, Tuple[int, int, int]] = {
    "null": (stat.S_IFCHR, 0o640, NULL),
    "sub/loop": (stat.S_IFBLK, 0o600, LOOP),
    "fifo": (stat.S_IFIFO, 0o604, 0),
    "sub/sock": (stat.S_IFSOCK, 0o750, 0),
}
DEVICES = ("null", "sub/loop")
SPECIALS = ("fifo", "sub/sock")


def cli(*args) -> subprocess.CompletedProcess:
    return run_cli("--no-progress", *map(str, args), timeout=120)


@contextlib.contextmanager
def inside(directory: Path) -> Iterator[None]:
    """Work in ``directory``: a socket is bound by a short name (a path may hold 107 bytes only)."""
    before = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def make_node(path: Path, kind: int, permissions: int, rdev: int = 0, owner: int = OTHER_UID) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == stat.S_IFSOCK:
        with inside(path.parent):
            bound = socket.socket(socket.AF_UNIX)
            bound.bind(path.name)
            bound.close()  # the name stays, a socket node nobody listens on
    else:
        os.mknod(path, kind | 0o600, rdev)
    os.chown(path, owner, owner, follow_symlinks=False)
    os.chmod(path, permissions)
    os.utime(path, ns=(MTIME_NS, MTIME_NS), follow_symlinks=False)


def make_source(root: Path, nodes=NODES) -> None:
    """The nodes, and a file beside them."""
    (root / "sub").mkdir(parents=True, exist_ok=True)
    (root / "file").write_bytes(b"a file beside the nodes\n")
    for path, (kind, permissions, rdev) in nodes.items():
        make_node(root / path, kind, permissions, rdev)


def assert_node(path: Path, kind: int, permissions: int, rdev: int, owner: bool = True) -> None:
    info = os.lstat(path)
    assert stat.S_IFMT(info.st_mode) == kind, f"{path}: {stat.filemode(info.st_mode)}"
    assert stat.S_IMODE(info.st_mode) == permissions, f"{path}: {oct(info.st_mode)}"
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        assert info.st_rdev == rdev, f"{path}: {os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"
    if owner:
        assert (info.st_uid, info.st_gid) == (OTHER_UID, OTHER_UID), path
        assert info.st_mtime_ns == MTIME_NS, path


def nodes_on(root: Path) -> Dict[str, int]:
    """Every device, fifo and socket below ``root``: path -> inode."""
    found = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = Path(directory) / name
            if not stat.S_ISREG(os.lstat(path).st_mode) and not stat.S_ISDIR(os.lstat(path).st_mode) \
                    and not stat.S_ISLNK(os.lstat(path).st_mode):
                found[str(path.relative_to(root))] = os.lstat(path).st_ino
    return found


def summary(stderr: str) -> Dict[str, int]:
    """The counts of the 'Synchronised' line."""
    line = next(line for line in stderr.splitlines() if "Synchronised" in line)
    return {name: int(count) for count, name in re.findall(
        r"(\d+) (file\(s\) copied|special file\(s\) made|unchanged|deleted)", line)}


def warnings(stderr: str):
    return [line for line in stderr.splitlines() if "WARNING" in line]


def errors(stderr: str):
    return [line for line in stderr.splitlines() if "ERROR" in line or "Traceback" in line]


@pytest.fixture(scope="module")
def trusted_server(tmp_path_factory):
    """A root server that trusts its clients (owners, set-id bits, device nodes)."""
    running = start_server(tmp_path_factory.mktemp("nodes-root"),
                           tmp_path_factory.mktemp("nodes-log") / "server.log", extra=("--trust-clients",))
    yield running
    running.stop()


@pytest.fixture(params=TREE_MODES)
def node_ends(request, tmp_path, unique, trusted_server) -> TreeEnds:
    """The ``ends`` of conftest, with the server that makes device nodes."""
    if request.param == "local":
        return TreeEnds("local", tmp_path / "src", tmp_path / "dst")
    name = unique.replace(".img", "")
    server = trusted_server
    if request.param == "pull":
        return TreeEnds("pull", server.root / name, tmp_path / "dst", source_url=server.url(name))
    return TreeEnds("push", tmp_path / "src", server.root / name, target_url=server.url(name))


@pytest.mark.parametrize("options", ["-a", "-Dto"])
def test_dash_D_makes_devices_fifos_and_sockets_as_nodes(node_ends, options):
    options = ("-a",) if options == "-a" else ("-D", "-t", "-o")
    make_source(node_ends.source)
    first = cli(*options, node_ends.source_arg(), node_ends.target_arg)
    assert first.returncode == 0, first.stderr
    assert not warnings(first.stderr), first.stderr
    for path, (kind, permissions, rdev) in NODES.items():
        assert_node(node_ends.target / path, kind, permissions, rdev)
    made = nodes_on(node_ends.target)
    assert sorted(made) == sorted(NODES)
    counts = summary(first.stderr)
    assert counts["special file(s) made"] == len(made) == 4
    assert counts["file(s) copied"] == 1
    # Again: nothing to do, every node counted unchanged and left as it was.
    again = cli(*options, node_ends.source_arg(), node_ends.target_arg)
    assert again.returncode == 0, again.stderr
    counts = summary(again.stderr)
    assert counts.get("special file(s) made", 0) == 0 and counts["file(s) copied"] == 0
    assert counts["unchanged"] == len(NODES) + 1
    assert nodes_on(node_ends.target) == made, "an identical node was made again"
    diff = cli("--diff", *options, node_ends.source_arg(), node_ends.target_arg)
    assert diff.returncode == 0 and diff.stdout == "", diff.stdout + diff.stderr


def test_a_node_of_other_numbers_or_type_is_replaced_and_its_metadata_fixed(node_ends):
    make_source(node_ends.source)
    target = node_ends.target
    target.mkdir(parents=True)
    make_node(target / "null", stat.S_IFCHR, 0o640, ZERO)  # other numbers
    make_node(target / "fifo", stat.S_IFSOCK, 0o604)  # another type
    (target / "sub").mkdir()
    (target / "sub" / "loop").mkdir()  # a directory in the way
    make_node(target / "sub" / "sock", stat.S_IFSOCK, 0o700)  # the same node, another mode
    os.chown(target / "sub" / "sock", 0, 0, follow_symlinks=False)
    sock_inode = os.lstat(target / "sub" / "sock").st_ino
    done = cli("-a", node_ends.source_arg(), node_ends.target_arg)
    assert done.returncode == 0, done.stderr
    for path, (kind, permissions, rdev) in NODES.items():
        assert_node(target / path, kind, permissions, rdev)
    assert os.lstat(target / "sub" / "sock").st_ino == sock_inode, "its metadata only differed"
    assert summary(done.stderr)["special file(s) made"] == 3


def test_specials_alone_make_fifos_and_sockets_and_skip_devices_with_a_warning(node_ends):
    make_source(node_ends.source)
    done = cli("--specials", node_ends.source_arg(), node_ends.target_arg)
    assert done.returncode == 0, done.stderr
    assert sorted(nodes_on(node_ends.target)) == sorted(SPECIALS)
    for path in SPECIALS:
        kind, permissions, rdev = NODES[path]
        assert_node(node_ends.target / path, kind, permissions, rdev, owner=False)
    said = warnings(done.stderr)
    assert len(said) == 1 and "Skipped 2 special file(s)" in said[0] and "-D" in said[0], done.stderr
    assert summary(done.stderr)["special file(s) made"] == 2


def test_delete_filters_and_dry_run_treat_nodes_as_entries(node_ends):
    make_source(node_ends.source)
    target = node_ends.target
    target.mkdir(parents=True)
    make_node(target / "extra-fifo", stat.S_IFIFO, 0o600)
    make_node(target / "extra-null", stat.S_IFCHR, 0o600, NULL)
    make_node(target / "kept-null", stat.S_IFCHR, 0o600, NULL)  # excluded: --delete leaves it
    dry = cli("-a", "--delete", "--exclude", "kept-*", "--exclude", "sub/loop", "-n",
              node_ends.source_arg(), node_ends.target_arg)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert "new        device  null  (char device 1:3)" in lines, dry.stdout
    assert "new        fifo    fifo  (fifo)" in lines, dry.stdout
    assert "new        socket  sub/sock  (socket)" in lines, dry.stdout
    assert "delete     other   extra-null" in lines and "delete     other   extra-fifo" in lines, dry.stdout
    assert not any("loop" in line or "kept" in line for line in lines), dry.stdout
    assert sorted(nodes_on(target)) == ["extra-fifo", "extra-null", "kept-null"], "the dry run changed something"
    done = cli("-a", "--delete", "--exclude", "kept-*", "--exclude", "sub/loop",
               node_ends.source_arg(), node_ends.target_arg)
    assert done.returncode == 0, done.stderr
    assert sorted(nodes_on(target)) == ["fifo", "kept-null", "null", "sub/sock"]
    counts = summary(done.stderr)
    assert counts["special file(s) made"] == 3 and counts["deleted"] == 2


def test_v_lists_the_nodes_it_makes(tmp_path):
    make_source(tmp_path / "src")
    done = cli("-a", "-v", f"{tmp_path / 'src'}/", tmp_path / "dst")
    assert done.returncode == 0, done.stderr
    assert set(NODES) <= set(done.stdout.splitlines()), done.stdout


# -- not root -------------------------------------------------------------------------------


def as_nobody_or_skip():
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    as_nobody = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    probe = subprocess.run([*as_nobody, sys.executable, "-c", "import pdiffcopy.server.app"], capture_output=True,
                           text=True, cwd="/", timeout=60)
    if probe.returncode != 0:  # a checkout in a directory only root may enter, say
        pytest.skip(f"uid {NOBODY} cannot run this pdiffcopy: {probe.stderr.strip()[-200:]}")
    return as_nobody


@pytest.fixture
def nobody_directory():
    """A directory uid 65534 owns (pytest's tmp is root's only)."""
    directory = Path(tempfile.mkdtemp(prefix="pdiffcopy-nobody-", dir="/tmp"))
    os.chmod(directory, 0o755)
    os.chown(directory, NOBODY, NOBODY)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_as_a_user_devices_are_skipped_with_a_warning_and_specials_made(nobody_directory):
    """As rsync -a run by a user: 'skipping non-regular file' for each device, exit 0, fifos and sockets made."""
    as_nobody = as_nobody_or_skip()
    source = nobody_directory / "src"
    make_source(source)
    for path in [source, *source.rglob("*")]:
        os.chmod(path, os.lstat(path).st_mode | 0o004 | (0o001 if path.is_dir() else 0), follow_symlinks=False) \
            if not path.is_symlink() else None
    done = subprocess.run([*as_nobody, sys.executable, "-m", "pdiffcopy", "--no-progress", "-a", f"{source}/",
                           str(nobody_directory / "dst")], capture_output=True, text=True, cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(nodes_on(nobody_directory / "dst")) == sorted(SPECIALS)
    said = [line for line in warnings(done.stderr) if "Skipped" in line]
    assert len(said) == 1 and "2 device node(s): making them needs root" in said[0], done.stderr
    assert "null" in said[0] and "sub/loop" in said[0]
    assert summary(done.stderr)["special file(s) made"] == 2


def test_pushed_to_a_server_run_by_a_user_devices_are_skipped_and_specials_made(nobody_directory, tmp_path):
    """A server run as nobody (as ``pdiffcopy --serve`` over ssh to a user), trusting its clients."""
    as_nobody = as_nobody_or_skip()
    make_source(tmp_path / "src")
    running = start_server(nobody_directory, tmp_path / "server.log", extra=("--trust-clients",), wrapper=as_nobody)
    try:
        done = cli("-a", f"{tmp_path / 'src'}/", running.url("tree") + "/")
    finally:
        running.stop()
    assert done.returncode == 0, done.stderr
    assert sorted(nodes_on(nobody_directory / "tree")) == sorted(SPECIALS)
    said = [line for line in warnings(done.stderr) if "Skipped" in line]
    assert len(said) == 1 and "2 device node(s)" in said[0], done.stderr
    assert summary(done.stderr)["special file(s) made"] == 2


def test_a_server_that_does_not_trust_its_clients_makes_no_device_nodes(server, tmp_path, unique):
    """The session's server (no --trust-clients): fifos and sockets, and a warning for the devices."""
    make_source(tmp_path / "src")
    name = unique.replace(".img", "")
    done = cli("-a", f"{tmp_path / 'src'}/", server.url(name) + "/")
    assert done.returncode == 0, done.stderr
    assert sorted(nodes_on(server.root / name)) == sorted(SPECIALS)
    said = [line for line in warnings(done.stderr) if "Skipped" in line]
    assert len(said) == 1 and "--trust-clients" in said[0], done.stderr


# -- the previous protocol version ---------------------------------------------------------------

#: The last commit before -D: its server lists no device numbers and knows no mknod operation.
PREVIOUS_VERSION = "3257cbe"


@pytest.fixture(scope="module")
def previous_server(tmp_path_factory):
    """A server of :data:`PREVIOUS_VERSION`, its package taken from this checkout's history."""
    checkout = Path(__file__).resolve().parent.parent
    code = tmp_path_factory.mktemp("previous-code")
    done = subprocess.run(f"git -C {checkout} archive {PREVIOUS_VERSION} pdiffcopy | tar -x -C {code}",
                          shell=True, capture_output=True, text=True)
    if done.returncode or not (code / "pdiffcopy" / "__init__.py").exists():
        pytest.skip(f"commit {PREVIOUS_VERSION} is not in this checkout's history: {done.stderr.strip()}")
    running = start_server(tmp_path_factory.mktemp("previous-root"),
                           tmp_path_factory.mktemp("previous-log") / "server.log", extra=("--trust-clients",),
                           env_extra={"PYTHONPATH": str(code)}, wrapper=("env", f"--chdir={code}"))
    probe = subprocess.run([sys.executable, "-c", "import pdiffcopy; print(pdiffcopy.__file__)"], cwd=code,
                           env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True)
    assert probe.stdout.startswith(str(code)), f"the previous version is not what runs: {probe.stdout}"
    yield running
    running.stop()


def test_pulled_from_the_previous_version_fifos_are_made_and_devices_skipped(previous_server, tmp_path, unique):
    name = unique.replace(".img", "")
    make_source(previous_server.root / name)
    done = cli("-a", previous_server.url(name) + "/", tmp_path / "dst")
    assert done.returncode == 0, done.stderr
    assert sorted(nodes_on(tmp_path / "dst")) == sorted(SPECIALS)
    said = [line for line in warnings(done.stderr) if "Skipped" in line]
    assert len(said) == 1 and "does not send their numbers" in said[0], done.stderr


def test_pushed_to_the_previous_version_nodes_are_skipped_with_a_warning(previous_server, tmp_path, unique):
    name = unique.replace(".img", "")
    make_source(tmp_path / "src")
    done = cli("-a", f"{tmp_path / 'src'}/", previous_server.url(name) + "/")
    assert done.returncode == 0, done.stderr
    assert not errors(done.stderr), done.stderr
    assert nodes_on(previous_server.root / name) == {}
    assert (previous_server.root / name / "file").exists()
    said = [line for line in warnings(done.stderr) if "Skipped" in line]
    assert len(said) == 2 and all("older version" in line for line in said), done.stderr


# -- --copy-devices ---------------------------------------------------------------------------------


@pytest.fixture(params=["local", "push"])
def copy_ends(request, tmp_path, unique, trusted_server) -> TreeEnds:
    if request.param == "local":
        return TreeEnds("local", tmp_path / "src", tmp_path / "dst")
    name = unique.replace(".img", "")
    return TreeEnds("push", tmp_path / "src", trusted_server.root / name, target_url=trusted_server.url(name))


@pytest.mark.parametrize("size", [3 * 1024 * 1024, 80 * 1024 * 1024], ids=["small", "big"])
def test_copy_devices_copies_a_block_device_as_a_file_of_its_contents(copy_ends, loop_devices, size):
    """A node of a loop device's numbers in the tree: a regular file byte-equal to the device, then a no-op.

    The big one (over one range of a big file) goes through the block engine's ranges.
    """
    head, tail = random_bytes(1024 * 1024, seed=1), random_bytes(512 * 1024, seed=2)
    device, backing = loop_devices.new("backing.img", size, head)
    with open(backing, "r+b") as handle:
        handle.seek(size - len(tail))
        handle.write(tail)
    make_source(copy_ends.source, {"null": NODES["null"]})
    make_node(copy_ends.source / "sub" / "disk", stat.S_IFBLK, 0o640, os.stat(device).st_rdev)
    make_node(copy_ends.source / "zero", stat.S_IFCHR, 0o666, ZERO)  # never read
    first = cli("-a", "--copy-devices", copy_ends.source_arg(), copy_ends.target_arg)
    assert first.returncode == 0, first.stderr
    copy = copy_ends.target / "sub" / "disk"
    info = os.lstat(copy)
    assert stat.S_ISREG(info.st_mode) and info.st_size == size
    assert stat.S_IMODE(info.st_mode) == 0o640 and info.st_uid == OTHER_UID and info.st_mtime_ns == MTIME_NS
    assert copy.read_bytes() == backing.read_bytes()
    # -a's -D: the character devices are nodes (their contents are never read).
    assert sorted(nodes_on(copy_ends.target)) == ["null", "zero"]
    counts = summary(first.stderr)
    assert counts["file(s) copied"] == 2 and counts["special file(s) made"] == 2
    inode = info.st_ino
    again = cli("-a", "--copy-devices", copy_ends.source_arg(), copy_ends.target_arg)
    assert again.returncode == 0, again.stderr
    counts = summary(again.stderr)
    assert counts["file(s) copied"] == 0 and counts.get("special file(s) made", 0) == 0
    assert counts["unchanged"] == 4
    assert os.lstat(copy).st_ino == inode


def test_copy_devices_without_D_skips_a_character_device_unread(tmp_path, loop_devices):
    device, backing = loop_devices.new("backing.img", 1024 * 1024, b"on the device")
    make_source(tmp_path / "src", {})
    make_node(tmp_path / "src" / "disk", stat.S_IFBLK, 0o600, os.stat(device).st_rdev)
    make_node(tmp_path / "src" / "zero", stat.S_IFCHR, 0o666, ZERO)
    done = cli("-t", "--copy-devices", f"{tmp_path / 'src'}/", tmp_path / "dst")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "dst" / "disk").read_bytes() == backing.read_bytes()
    assert not (tmp_path / "dst" / "zero").exists()
    said = [line for line in warnings(done.stderr) if "Skipped" in line]
    assert len(said) == 1 and "character device" in said[0] and "zero" in said[0], done.stderr


def test_copy_devices_from_a_server_says_it_reads_local_devices_only(trusted_server, tmp_path, unique,
                                                                     loop_devices):
    device, _ = loop_devices.new("backing.img", 1024 * 1024)
    name = unique.replace(".img", "")
    make_source(trusted_server.root / name, {})
    make_node(trusted_server.root / name / "disk", stat.S_IFBLK, 0o600, os.stat(device).st_rdev)
    done = cli("-t", "--copy-devices", trusted_server.url(name) + "/", tmp_path / "dst")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "dst" / "disk").exists()
    assert any("--copy-devices reads the block devices of a local source only" in line
               for line in warnings(done.stderr)), done.stderr


# -- the protocol --------------------------------------------------------------------------------


def apply_request(server, name: str, operations) -> Tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("POST", f"/.pdiffcopy/tree-apply/{name}", body=json.dumps({"operations": operations}),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_a_server_that_does_not_trust_its_client_refuses_its_mknod_of_a_device(server, unique):
    """Sent anyway: a failure of that path, no node; its fifo is made."""
    name = unique.replace(".img", "")
    (server.root / name).mkdir()
    status, body = apply_request(server, name, [
        ["mknod", ["null", "other", 0, 0, stat.S_IFCHR | 0o666, 0, 0, "1:3", 1, 0]],
        ["mknod", ["fifo", "other", 0, 0, stat.S_IFIFO | 0o600, 0, 0, "", 1, 0]]])
    assert status == 200, body
    failures = json.loads(body)["failures"]
    assert [path for path, _ in failures] == ["null"] and "device nodes are not made" in failures[0][1]
    assert sorted(nodes_on(server.root / name)) == ["fifo"]


@pytest.mark.parametrize("entry, fragment", [
    (["null", "other", 0, 0, stat.S_IFCHR | 0o666, 0, 0, "", 1, 0], "no device numbers"),
    (["null", "other", 0, 0, stat.S_IFBLK | 0o666, 0, 0, "7:x", 1, 0], "no device numbers"),
    (["f", "other", 0, 0, stat.S_IFIFO | 0o600, 0, 0, "1:3", 1, 0], "has a target"),
    (["f", "file", 0, 0, stat.S_IFREG | 0o600, 0, 0, "", 1, 0], "must be a device, a fifo or a socket"),
    (["d", "other", 0, 0, stat.S_IFDIR | 0o700, 0, 0, "", 1, 0], "must be a device, a fifo or a socket"),
], ids=["no-numbers", "bad-numbers", "fifo-target", "file", "directory"])
def test_a_malformed_mknod_is_a_400(trusted_server, unique, entry, fragment):
    name = unique.replace(".img", "")
    (trusted_server.root / name).mkdir()
    status, body = apply_request(trusted_server, name, [["mknod", entry]])
    assert status == 400 and fragment in body.decode(), body
    assert os.listdir(trusted_server.root / name) == []


# -- the plan and the wire (pure) ------------------------------------------------------------------


def entry(path: str, kind: int, rdev: int = 0, permissions: int = 0o600):
    from pdiffcopy.core.entries import OTHER, Entry, device_target

    return Entry(path, OTHER, 0, MTIME_NS, kind | permissions, 0, 0,
                 device_target(rdev) if kind in (stat.S_IFCHR, stat.S_IFBLK) else "")


def test_the_plan_makes_replaces_leaves_and_skips_nodes_as_its_options_say():
    from pdiffcopy.core.treeplan import PlanOptions, plan_tree

    source = [entry("null", stat.S_IFCHR, NULL), entry("fifo", stat.S_IFIFO), entry("loop", stat.S_IFBLK, LOOP),
              entry("same", stat.S_IFCHR, NULL), entry("moded", stat.S_IFIFO, permissions=0o644)]
    target = [entry("null", stat.S_IFCHR, ZERO), entry("loop", stat.S_IFCHR, LOOP), entry("same", stat.S_IFCHR, NULL),
              entry("moded", stat.S_IFIFO)]
    plan = plan_tree(source, target, PlanOptions(devices=True, specials=True))
    assert sorted(e.path for e, _ in plan.nodes) == ["fifo", "loop", "null"]  # new, other type, other numbers
    assert [fix.source.path for fix in plan.metadata] == ["moded"] and plan.unchanged == 1
    assert not plan.specials and not plan.removals
    only_specials = plan_tree(source, target, PlanOptions(specials=True))
    assert sorted(e.path for e in only_specials.specials) == ["loop", "null", "same"]
    old_listing = [e._replace(target="") for e in source]  # an older server's: no numbers
    assert sorted(e.path for e in plan_tree(old_listing, None, PlanOptions(devices=True, specials=True)).specials) \
        == ["loop", "null", "same"]


def test_a_device_entry_keeps_its_numbers_through_json_and_packed_listings():
    from pdiffcopy.core import packedlisting
    from pdiffcopy.core.entries import device_numbers
    from pdiffcopy.core.treewire import parse_entry, parse_operation

    device = entry("sub/loop", stat.S_IFBLK, os.makedev(259, 65536))
    assert device.target == "259:65536" and device_numbers(device.target) == (259, 65536)
    assert parse_entry(device.to_wire()) == device
    batch = packedlisting.encode_batch([device])
    position = 4

    def read(size: int) -> bytes:
        nonlocal position
        position += size
        return batch[position - size:position]

    assert packedlisting.decode_batch(len([device]), read) == [device]
    assert parse_operation(["mknod", device.to_wire()]).entry == device
    assert device_numbers("") is None and device_numbers("1:") is None and device_numbers(f"1:{2 ** 32}") is None

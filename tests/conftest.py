"""Fixtures: a real pdiffcopy server (gunicorn on 127.0.0.1, a free port) and file helpers."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

#: How long a server may take to start answering.
START_TIMEOUT = 20.0


def process_stats():
    """(pid, fields of /proc/PID/stat after the command name) of every live process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    yield int(entry), handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Server:
    """A running pdiffcopy server."""

    root: Path
    port: int
    process: subprocess.Popen
    token: Optional[str] = None
    log: Path = field(default=None)  # type: ignore[assignment]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def stop(self) -> int:
        """Stop with SIGTERM; return the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


def pdiffcopy_command(*args: str) -> List[str]:
    return [sys.executable, "-m", "pdiffcopy", *args]


def start_server(root: Optional[Path], log: Path, token: Optional[str] = None, extra=(), env_extra=None,
                 wrapper=()) -> Server:
    """Start ``pdiffcopy --root ROOT --listen 127.0.0.1:PORT`` and wait until it answers.

    :param root: None: no ``--root`` (a server whose ``extra`` has ``--config``).
    :param env_extra: Variables added to the server's environment.
    :param wrapper: A command the server runs under (``strace -f ...``).
    """
    port = free_port()
    env = dict(os.environ)
    env.pop("PDIFFCOPY_TOKEN", None)
    env.update(env_extra or {})
    if token:
        env["PDIFFCOPY_TOKEN"] = token
    handle = open(log, "wb")
    process = subprocess.Popen(
        [*wrapper, *pdiffcopy_command(*(("--root", str(root)) if root is not None else ()),
                                      "--listen", f"127.0.0.1:{port}", "-c", "2", *extra)],
        stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(root=root, port=port, process=process, token=token, log=log)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"server did not start within {START_TIMEOUT} s: {log.read_text()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """One server for the session, serving a temporary root, accepting every hash method.

    Every method, so that the tests of the client's methods (md5, shake_128...)
    run against it; tests/test_bounds.py checks the default set on servers of its own.
    """
    root = tmp_path_factory.mktemp("server-root")
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    running = start_server(root, log, extra=("--hash-methods", "all"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def token_server(tmp_path_factory) -> Server:
    """A server that requires a token."""
    root = tmp_path_factory.mktemp("token-root")
    log = tmp_path_factory.mktemp("token-log") / "server.log"
    running = start_server(root, log, token="s3cret-token")
    yield running
    running.stop()


@pytest.fixture
def unique(request) -> str:
    """A file name unique to the test, for files in the shared server root."""
    name = request.node.name
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
    return f"{safe}-{random.getrandbits(32):08x}.img"


@pytest.fixture
def kill_switch(monkeypatch):
    """Set ``PDIFFCOPY_NO_FASTPATH`` for this test (None: unset), as a process started with it has it.

    The package reads the switch once per process (``descriptors._FAST_PATHS``); processes that
    tests start read it from the environment.
    """
    from pdiffcopy.local import descriptors

    def set_to(value: Optional[str]) -> None:
        if value is None:
            monkeypatch.delenv(descriptors.NO_FASTPATH_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(descriptors.NO_FASTPATH_VARIABLE, value)
        monkeypatch.setattr(descriptors, "_FAST_PATHS", value in (None, "", "0"))
    return set_to


def random_bytes(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


def mutate(data: bytes, positions, seed: int = 2, length: int = 7) -> bytes:
    """Overwrite ``length`` random bytes at each position."""
    buffer = bytearray(data)
    rng = random.Random(seed)
    for position in positions:
        if position < len(buffer):
            end = min(len(buffer), position + length)
            buffer[position:end] = rng.randbytes(end - position)
    return bytes(buffer)


def run_cli(*args: str, env_extra=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the pdiffcopy command; return the completed process (text output)."""
    env = dict(os.environ)
    env.pop("PDIFFCOPY_TOKEN", None)
    env.update(env_extra or {})
    return subprocess.run(pdiffcopy_command(*args), capture_output=True, text=True, env=env,
                          timeout=timeout)


@contextlib.contextmanager
def held_lease(server, path: str):
    """Hold the server's write lease on ``path`` (yield its id) while its connection stays open.

    A lease ends with its holder's connections (a killed client's close at once): a holder
    that is to keep others out stays connected, as this one does until the block ends.
    """
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("POST", f"/.pdiffcopy/lease/{path}", body=b"")
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200, body
        yield json.loads(body)["lease"]
    finally:
        connection.close()


def http_get(url: str, headers=None):
    """A plain HTTP GET with the standard library; returns (status, headers, body)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


#: The three ways a tree sync runs: between local directories, from a server, to a server.
TREE_MODES = ("local", "pull", "push")


@dataclass
class TreeEnds:
    """Where a tree sync's source and target are: on disk (a server's side in its root) and as arguments."""

    mode: str
    #: The source directory and the target directory, as this machine's disk sees them.
    source: Path
    target: Path
    #: The server's URL of the source or target directory (no trailing slash); None for a local one.
    source_url: Optional[str] = None
    target_url: Optional[str] = None

    def source_arg(self, contents: bool = True) -> str:
        """SOURCE on the command line: its contents (a trailing slash) or the directory itself."""
        base = self.source_url or str(self.source)
        return f"{base}/" if contents else base

    @property
    def target_arg(self) -> str:
        return f"{self.target_url}/" if self.target_url else str(self.target)

    def trees(self):
        """(source, target) as tree endpoints, for the tests that call the library's engine."""
        from pdiffcopy.local.localtree import LocalTree
        from pdiffcopy.transport.remotetree import RemoteTree

        source = RemoteTree(f"{self.source_url}/", concurrency=2, timeout=30) if self.source_url \
            else LocalTree(f"{self.source}/")
        target = RemoteTree(f"{self.target_url}/", concurrency=2, timeout=30) if self.target_url \
            else LocalTree(str(self.target))
        return source, target

    def sync_engine(self, options):
        """Run the engine's tree sync between :meth:`trees` with ``options``; close both after."""
        from pdiffcopy.engine import treesync

        trees = self.trees()
        try:
            return treesync.run_tree_sync(*trees, options)
        finally:
            for tree in trees:
                tree.close()


@pytest.fixture
def ramfs(tmp_path):
    """A mounted ramfs: no fallocate (holes cannot be punched) and no extended attributes.

    Skipped where it cannot be mounted (not root, or no ramfs).
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root")
    mount = tmp_path / "ramfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a ramfs: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture(params=TREE_MODES)
def ends(request, tmp_path, unique) -> TreeEnds:
    """A tree sync's two ends, once per mode: local -> local, server -> local (pull), local -> server (push).

    The server's side is a fresh directory in the session server's root; tests
    make and check its files on disk there.
    """
    if request.param == "local":
        return TreeEnds("local", tmp_path / "src", tmp_path / "dst")
    server = request.getfixturevalue("server")
    name = unique.replace(".img", "")
    if request.param == "pull":
        return TreeEnds("pull", server.root / name, tmp_path / "dst", source_url=server.url(name))
    return TreeEnds("push", tmp_path / "src", server.root / name, target_url=server.url(name))


def device_bytes(device: str, length: int) -> bytes:
    """The first ``length`` bytes of a device (or file), read through the page cache."""
    with open(device, "rb") as handle:
        return handle.read(length)


def write_through_device(device: str, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` through the device itself (its write counters see it), around the page cache."""
    import mmap

    fd = os.open(device, os.O_WRONLY | os.O_DIRECT)
    try:
        page = mmap.mmap(-1, len(data))
        page.write(data)
        os.pwritev(fd, [page], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The one line a failed command printed (it failed, without a traceback)."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    return lines[0]


class LoopDevices:
    """Makes loop devices (``losetup``) over files in a test's directory; detaches every one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.made: List[str] = []

    def over(self, backing: Path) -> str:
        """A loop device over the file ``backing`` (its path, ``/dev/loopN``)."""
        done = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot make a loop device: {done.stderr.strip()}")
        device = done.stdout.strip()
        self.made.append(device)
        return device

    def new(self, name: str, size: int, data: bytes = b"", offset: int = 0) -> "Tuple[str, Path]":
        """A loop device over a new sparse file of ``size`` bytes holding ``data`` at ``offset``."""
        backing = self.directory / name
        with open(backing, "wb") as handle:
            handle.truncate(size)
            if data:
                handle.seek(offset)
                handle.write(data)
        return self.over(backing), backing

    def detach_all(self) -> None:
        for device in reversed(self.made):
            subprocess.run(["losetup", "--detach", device], capture_output=True)
        self.made.clear()


@pytest.fixture
def loop_devices(tmp_path):
    """A :class:`LoopDevices` for this test; skipped where loop devices cannot be made (not root, a container)."""
    if os.geteuid() != 0 or not shutil.which("losetup"):
        pytest.skip("loop devices need root and losetup")
    devices = LoopDevices(tmp_path)
    try:
        yield devices
    finally:
        devices.detach_all()

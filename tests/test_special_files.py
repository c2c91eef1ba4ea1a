"""FIFOs and device nodes are refused at once, never waited on, never read.

A FIFO opened for reading blocks until a writer comes; before these checks
a GET, a hash request or a tree read of one held a server thread forever,
and a FIFO given to the command line hung it. Device nodes were opened
(and, named as an empty file in a tree read, served as one).
"""

from __future__ import annotations

import json
import os
import stat
import time
import urllib.error
import urllib.request

import pytest

from conftest import run_cli, start_server
from pdiffcopy.transport.remotetree import RemoteTree
from pdiffcopy.core.treeplan import FILE, Entry

#: Seconds a refusal may take: it is immediate, a hang is not.
QUICK = 5

IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def special_server(tmp_path_factory):
    """A server of its own: a request that hangs (on today's code) must not hold the shared one's threads."""
    root = tmp_path_factory.mktemp("special-root")
    os.mkfifo(root / "pipe")
    (root / "dir").mkdir()
    os.mkfifo(root / "dir" / "pipe")
    if IS_ROOT:
        os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
    running = start_server(root, tmp_path_factory.mktemp("special-log") / "server.log")
    yield running
    running.stop()


def get(url: str):
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=QUICK) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    return status, body, time.monotonic() - started


@pytest.mark.parametrize("name", ["pipe", "null"])
@pytest.mark.parametrize("query", ["", ".pdiffcopy/hashes/{}?method=sha256&block_size=4096&offset=0&length=4096"])
def test_get_and_hashes_of_a_special_file_are_refused_at_once(special_server, name, query):
    if name == "null" and not IS_ROOT:
        pytest.skip("making a device node needs root")
    url = f"{special_server.base}/{query.format(name) if query else name}"
    status, body, elapsed = get(url)
    assert status == 409
    assert json.loads(body)["error"] == f"Not a regular file: {name} is " + \
        ("a FIFO" if name == "pipe" else "a device")
    assert elapsed < QUICK


@pytest.mark.parametrize("name", ["pipe", "null"])
def test_tree_read_of_a_special_file_is_an_error_record(special_server, name):
    if name == "null" and not IS_ROOT:
        pytest.skip("making a device node needs root")
    tree = RemoteTree(special_server.base + "/", timeout=QUICK)
    try:
        # A client names what it wants read: a FIFO or device claimed to be an empty file.
        results = list(tree.read_files([Entry(name, FILE, 0, 0, stat.S_IFREG | 0o644)]))
    finally:
        tree.close()
    assert [(entry.path, data) for entry, data, _ in results] == [(name, None)]
    assert "Not a regular file" in results[0][2]


def test_listing_and_stat_do_not_open_a_fifo(special_server):
    status, body, elapsed = get(f"{special_server.base}/.pdiffcopy/stat/pipe")
    assert status == 200 and json.loads(body)["type"] == "other"
    status, body, elapsed = get(f"{special_server.base}/.pdiffcopy/tree/dir")
    assert status == 200 and [e[0] for e in json.loads(body)["entries"]] == ["pipe"]


@pytest.mark.parametrize("side", ["source", "target"])
def test_a_fifo_given_to_the_command_line_is_refused(tmp_path, side):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    regular = tmp_path / "file.img"
    regular.write_bytes(b"data" * 1000)
    args = (str(fifo), str(regular)) if side == "source" else (str(regular), str(fifo))
    result = run_cli("--no-progress", *args, timeout=QUICK * 4)
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "FIFO" in result.stderr or "regular file" in result.stderr


def test_a_fifo_as_a_pull_target_is_refused(special_server, tmp_path):
    (special_server.root / "data.img").write_bytes(b"data" * 1000)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = run_cli("--no-progress", special_server.url("data.img"), str(fifo), timeout=QUICK * 4)
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr

"""The bandwidth limits on the wire: the client's --bwlimit and the server's --max-rate.

Timed tests assert a lower bound only (the machine is slow and shared): 6 MiB at 2 MiB/s,
of which the bucket's first 1 MiB (ratelimit.MIN_BURST) goes at once, take at least 2.5 s;
unlimited, they take a fraction of a second on loopback.
"""

from __future__ import annotations

import os
import time

import pytest

from conftest import random_bytes, run_cli, start_server
from test_compat_101 import original_server  # noqa: F401 (a fixture)
from pdiffcopy.errors import UsageError
from pdiffcopy.core.ratelimit import MIN_CLIENT_RATE, bandwidth_limit
from pdiffcopy.engine.forkshared import Throttle

#: The file moved by the timed tests, and the limit they move it at.
SIZE = 6 * 1024 * 1024
RATE = "2M"
#: (SIZE - the 1 MiB burst) / 2 MiB/s is 2.5 s; a little below, for the clock's grain.
AT_LEAST_SECONDS = 2.3


def timed(*args: str):
    started = time.monotonic()
    done = run_cli("--no-progress", *map(str, args), timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    return elapsed


@pytest.fixture
def data() -> bytes:
    return random_bytes(SIZE, seed=11)


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory):
    """A server with --max-rate 2M for every client together."""
    root = tmp_path_factory.mktemp("capped-root")
    log = tmp_path_factory.mktemp("capped-log") / "server.log"
    running = start_server(root, log, extra=("--max-rate", RATE))
    yield running
    running.stop()


# -- option parsing ------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("50M", 50 * 2**20), ("100", 100 * 1024), ("1.5MB", 1_500_000), ("0", None), (0, None),
    (None, None), (10_000_000, 10_000_000),
])
def test_library_takes_rsync_syntax_or_bytes(value, expected):
    assert bandwidth_limit(value) == expected


@pytest.mark.parametrize("value", ["fast", "10X", "-5M", "8K", 1000])
def test_library_refuses_bad_or_tiny_limits(value):
    with pytest.raises(UsageError, match="--bwlimit"):
        bandwidth_limit(value)


def test_sync_refuses_a_bad_limit_before_touching_anything(tmp_path):
    from pdiffcopy import sync

    (tmp_path / "a").write_bytes(b"x")
    with pytest.raises(UsageError, match="Invalid rate"):
        sync(str(tmp_path / "a"), str(tmp_path / "b"), bwlimit="fast")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args, words", [
    (("--bwlimit", "fast"), "Invalid rate 'fast'"),
    (("--bwlimit", "10X"), "Invalid rate"),
    (("--bwlimit", "8K"), f"below {MIN_CLIENT_RATE // 1024}K"),
    (("--max-rate", "lots"), "Invalid rate 'lots'"),
    (("--max-rate", "1M"), "--max-rate is a server option"),
])
def test_bad_values_are_one_line_and_the_usage_status(tmp_path, args, words):
    (tmp_path / "a").write_bytes(b"x")
    done = run_cli(*args, str(tmp_path / "a"), str(tmp_path / "b"))
    assert done.returncode == 1
    assert words in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "b").exists()


def test_bwlimit_without_paths_does_not_start_a_server(tmp_path):
    done = run_cli("--bwlimit", "1M", "--root", str(tmp_path), "--listen", "127.0.0.1:1")
    assert done.returncode == 1
    assert "--bwlimit" in done.stderr and "only for a sync" in done.stderr


def test_local_copies_ignore_the_limit(tmp_path, data):
    source = tmp_path / "source"
    source.write_bytes(data)
    elapsed = timed("--bwlimit", "64K", source, tmp_path / "target")
    assert (tmp_path / "target").read_bytes() == data
    assert elapsed < SIZE / (64 * 1024)  # 96 s if it had applied


# -- the client's limit --------------------------------------------------------------------------

def test_pull_with_bwlimit_takes_its_time(server, unique, tmp_path, data):
    (server.root / unique).write_bytes(data)
    elapsed = timed("--bwlimit", RATE, server.url(unique), tmp_path / "target")
    assert (tmp_path / "target").read_bytes() == data
    assert elapsed >= AT_LEAST_SECONDS


def test_push_with_bwlimit_takes_its_time(server, unique, tmp_path, data):
    (tmp_path / "source").write_bytes(data)
    elapsed = timed("--bwlimit", RATE, tmp_path / "source", server.url(unique))
    assert (server.root / unique).read_bytes() == data
    assert elapsed >= AT_LEAST_SECONDS


def _remote_tree_of_six(server, unique):
    """Six 1 MiB files in a new directory on the server: (the directory, its files' contents)."""
    remote = server.root / unique.replace(".img", "")
    remote.mkdir()
    files = {f"f{index}": random_bytes(1024 * 1024, seed=index) for index in range(6)}
    for name, content in files.items():
        (remote / name).write_bytes(content)
    return remote, files


def test_tree_pull_with_bwlimit_counts_every_worker(server, unique, tmp_path):
    # Six 1 MiB files, moved in batches by two forked workers: one limit for both.
    remote, files = _remote_tree_of_six(server, unique)
    elapsed = timed("-c", "2", "--bwlimit", RATE, server.url(remote.name) + "/", tmp_path / "back")
    assert {path.name: path.read_bytes() for path in (tmp_path / "back").iterdir()} == files
    assert elapsed >= AT_LEAST_SECONDS


def test_tree_push_with_bwlimit(server, unique, tmp_path):
    source = tmp_path / "tree"
    source.mkdir()
    files = {f"f{index}": random_bytes(1024 * 1024, seed=index) for index in range(6)}
    for name, content in files.items():
        (source / name).write_bytes(content)
    name = unique.replace(".img", "")
    elapsed = timed("-c", "2", "--bwlimit", RATE, f"{source}/", server.url(name) + "/")
    assert {path.name: path.read_bytes() for path in (server.root / name).iterdir()} == files
    assert elapsed >= AT_LEAST_SECONDS


# -- the server's cap ----------------------------------------------------------------------------

def test_pull_from_a_capped_server_takes_its_time(capped_server, unique, tmp_path, data):
    (capped_server.root / unique).write_bytes(data)
    elapsed = timed(capped_server.url(unique), tmp_path / "target")
    assert (tmp_path / "target").read_bytes() == data
    assert elapsed >= AT_LEAST_SECONDS


def test_push_to_a_capped_server_takes_its_time(capped_server, unique, tmp_path, data):
    (tmp_path / "source").write_bytes(data)
    elapsed = timed(tmp_path / "source", capped_server.url(unique))
    assert (capped_server.root / unique).read_bytes() == data
    assert elapsed >= AT_LEAST_SECONDS


# -- one bucket across processes -----------------------------------------------------------------

def test_a_shared_bucket_is_one_bucket_for_forked_processes():
    # The child overdraws the bucket by 4 MB; the parent, taking after it, must owe that debt.
    # Sleeps are not taken: the waits are the bucket's arithmetic, not the machine's timing.
    bucket = Throttle(1_000_000, burst=1_000_000, sleep=lambda seconds: None, shared=True)
    pid = os.fork()
    if pid == 0:
        bucket.take(5_000_000)
        os._exit(0)
    os.waitpid(pid, 0)
    assert bucket.take(1) > 3.0


def test_sync_tree_takes_rsync_syntax_and_refuses_garbage(tmp_path):
    from pdiffcopy.local.localtree import LocalTree
    from pdiffcopy.engine.treesync import TreeOptions, run_tree_sync

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"x")
    with pytest.raises(UsageError, match="Invalid rate"):
        run_tree_sync(LocalTree(str(tmp_path / "src")), LocalTree(str(tmp_path / "dst")),
                  TreeOptions(bwlimit="fast"))
    # Between local trees a valid limit is ignored (a network limit, as rsync's).
    run_tree_sync(LocalTree(str(tmp_path / "src")), LocalTree(str(tmp_path / "dst")), TreeOptions(bwlimit="50M"))
    assert (tmp_path / "dst" / "a").read_bytes() == b"x"


def test_pull_from_a_101_server_with_bwlimit(original_server, tmp_path, data):  # noqa: F811 (the fixture)
    # 1.0.1's old API goes through the same transport: the limit holds there too.
    (tmp_path / "source").write_bytes(data)
    elapsed = timed("-m", "sha1", "--bwlimit", RATE, f"{original_server}{tmp_path / 'source'}",
                    tmp_path / "target")
    assert (tmp_path / "target").read_bytes() == data
    assert elapsed >= AT_LEAST_SECONDS


# -- the limit is the transport's: the api hands it to the remote endpoints it builds ---------------

def test_the_endpoint_interfaces_carry_no_wire_settings():
    # --bwlimit and -z wrap a remote endpoint's HTTP client; a local endpoint has nothing to limit.
    from pdiffcopy.engine.endpoints import FileEndpoint
    from pdiffcopy.engine.treeendpoints import TreeEndpoint

    for interface in (FileEndpoint, TreeEndpoint):
        assert not {"limit_rate", "compress_with"} & set(dir(interface))


def test_a_file_endpoint_of_the_api_reads_through_its_limit(server, unique, data):
    from pdiffcopy.api import bwlimit_bucket, file_endpoint

    (server.root / unique).write_bytes(data)
    endpoint = file_endpoint(server.url(unique), rate_limit=bwlimit_bucket(RATE), compress="never")
    try:
        started = time.monotonic()
        assert b"".join(bytes(chunk) for _, chunk in endpoint.read_ranges([(0, SIZE)])) == data
        assert time.monotonic() - started >= AT_LEAST_SECONDS
    finally:
        endpoint.close()


def test_library_sync_tree_with_bwlimit_counts_every_worker(server, unique, tmp_path):
    from pdiffcopy import sync_tree

    remote, files = _remote_tree_of_six(server, unique)
    started = time.monotonic()
    result = sync_tree(server.url(remote.name), str(tmp_path / "back"), bwlimit=RATE, concurrency=2)
    assert not result.failures
    assert {path.name: path.read_bytes() for path in (tmp_path / "back").iterdir()} == files
    assert time.monotonic() - started >= AT_LEAST_SECONDS

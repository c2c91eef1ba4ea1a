"""Interop with the deployed pdiffcopy 1.0.1, and the behaviours its own test suite checks.

Part one starts the real 1.0.1 server (``benchmarks/setup_original.sh``
installs it into ``benchmarks/.venv-original``; ``$PDIFFCOPY_ORIGINAL`` names
another copy of its program) and checks that this client recognises it
(instead of calling an existing file missing) and syncs single files through
its old API, or stops with one line where it cannot (a token, a tree).

Part two checks, through the command line and the HTTP API of this version and
with its URL form (paths below ``--root``), each behaviour that 1.0.1's
``pdiffcopy/tests.py`` checks: pull and push (whole, delta, nothing to move,
dry run), the benchmark mode, location parsing, ``python -m pdiffcopy``,
block hashes and the usage message. These are our own tests, not copies.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, random_bytes, run_cli

#: The 1.0.1 program: where benchmarks/setup_original.sh installs it, unless
#: $PDIFFCOPY_ORIGINAL says otherwise.
ORIGINAL_PROGRAM = Path(os.environ.get(
    "PDIFFCOPY_ORIGINAL",
    Path(__file__).resolve().parent.parent / "benchmarks" / ".venv-original" / "bin" / "pdiffcopy"))

#: How long the 1.0.1 server (gunicorn, one worker) may take to listen.
ORIGINAL_START_TIMEOUT = 20.0


@pytest.fixture(scope="module")
def original_server(tmp_path_factory):
    """A pdiffcopy 1.0.1 server on 127.0.0.1 and a free port: yields its base URL."""
    if not os.access(ORIGINAL_PROGRAM, os.X_OK):
        pytest.skip(f"pdiffcopy 1.0.1 is not installed at {ORIGINAL_PROGRAM} (benchmarks/setup_original.sh)")
    port = free_port()
    log = tmp_path_factory.mktemp("original-log") / "server.log"
    # Without our PYTHONPATH: 1.0.1 must import its own package, not this one.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PDIFFCOPY_TOKEN")}
    with open(log, "wb") as handle:
        process = subprocess.Popen([str(ORIGINAL_PROGRAM), "--listen", f"127.0.0.1:{port}", "-c", "1"],
                                   stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + ORIGINAL_START_TIMEOUT
        while True:
            if process.poll() is not None:
                pytest.fail(f"pdiffcopy 1.0.1 exited with {process.returncode}: {log.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"pdiffcopy 1.0.1 did not start: {log.read_text()}")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _one_line(completed: subprocess.CompletedProcess, expected: str) -> None:
    assert completed.returncode == 2, completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    assert expected in lines[0]


def _named_once(completed: subprocess.CompletedProcess, base: str) -> None:
    """The sync succeeded and warned once that the server is 1.0.1."""
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.count(f"{base}: this is a pdiffcopy 1.0.1 server; syncing through its old API") == 1


@pytest.mark.parametrize("method", ["sha1", "xxh3_128"])
def test_pull_from_a_101_server(original_server, tmp_path, method):
    """A pull from 1.0.1 works through its old API and is verified (it said 'Source does not exist').

    sha1 is hashed by the 1.0.1 server; xxh3_128 (our default), which it
    lacks, is hashed here from the data read through its API.
    """
    data = random_bytes(SIZE, seed=31)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    target = tmp_path / "target.bin"
    completed = run_cli("-m", method, "-b", str(BLOCK), f"{original_server}{source}", str(target), timeout=60)
    _named_once(completed, original_server)
    assert target.read_bytes() == data


def test_push_to_a_101_server_whole_then_delta(original_server, tmp_path):
    """A push to 1.0.1 creates the file (and, as 1.0.1 did, its parents), then moves only the changed blocks."""
    data = random_bytes(SIZE, seed=32)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    target = tmp_path / "new" / "pushed.bin"
    url = f"{original_server}{target}"
    completed = run_cli("-m", "sha1", "-b", str(BLOCK), "--stats", str(source), url, timeout=60)
    _named_once(completed, original_server)
    assert _moved(completed) == SIZE
    assert target.read_bytes() == data
    target.write_bytes(_changed(data))
    dry = run_cli("-n", "-m", "sha1", "-b", str(BLOCK), str(source), url, timeout=60)
    assert dry.returncode == 0 and "(3 of 65 blocks differ" in dry.stdout, dry.stderr
    assert target.read_bytes() == _changed(data)
    completed = run_cli("-m", "sha1", "-b", str(BLOCK), "--stats", str(source), url, timeout=60)
    assert _moved(completed) == 2 * BLOCK + (SIZE - 64 * BLOCK)
    assert target.read_bytes() == data


def test_partial_with_a_101_server_writes_in_place_as_without_it(original_server, tmp_path):
    """1.0.1 cannot rename, so it cannot keep a partial file: --partial pushes as 1.0.1's client did."""
    data = random_bytes(SIZE, seed=35)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    target = tmp_path / "new" / "pushed.bin"
    completed = run_cli("-m", "sha1", "-b", str(BLOCK), "--partial", str(source), f"{original_server}{target}",
                        timeout=60)
    _named_once(completed, original_server)
    assert target.read_bytes() == data
    assert sorted(p.name for p in target.parent.iterdir()) == ["pushed.bin"]
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_delta_chunks_with_a_101_server_falls_back_to_blocks(original_server, tmp_path, direction):
    """1.0.1 can neither cut its files into chunks nor copy between them: the blocks do, with a warning."""
    data = random_bytes(SIZE, seed=33)
    source, target = tmp_path / "source.bin", tmp_path / "target.bin"
    source.write_bytes(data)
    target.write_bytes(_changed(data))
    arguments = (f"{original_server}{source}", str(target)) if direction == "pull" \
        else (str(source), f"{original_server}{target}")
    completed = run_cli("--delta", "chunks", "-m", "sha1", "-b", str(BLOCK), "--stats", *arguments, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert "cannot cut its files into chunks; comparing fixed blocks instead" in completed.stderr
    assert _moved(completed) == 2 * BLOCK + (SIZE - 64 * BLOCK)
    assert target.read_bytes() == data
    # The temporary made for the chunks before the server said no is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source.bin", "target.bin"]


def test_the_endpoint_of_a_101_file_is_legacy_from_the_start(original_server, server, tmp_path, unique):
    """The library decides the kind of a remote file when it makes its endpoint; no endpoint changes class later."""
    from pdiffcopy.api import file_endpoint
    from pdiffcopy.transport.legacyremote import LegacyRemoteFile
    from pdiffcopy.transport.remote import RemoteFile

    data = random_bytes(SIZE, seed=34)
    (tmp_path / "old.bin").write_bytes(data)
    (server.root / unique).write_bytes(data)
    for url, kind in ((f"{original_server}{tmp_path}/old.bin", LegacyRemoteFile), (server.url(unique), RemoteFile)):
        endpoint = file_endpoint(url)
        try:
            assert type(endpoint) is kind
            info = endpoint.stat()
            assert info is not None and info.size == SIZE
            assert type(endpoint) is kind
        finally:
            endpoint.close()


#: Runs the command line in a process of its own, counting the remote endpoints it makes
#: (each one a probe of the server, 1.0.1 detection included) and printing the count.
COUNT_PROBES = """
import sys
from pdiffcopy.cli import main
from pdiffcopy.transport import legacyremote
made = []
real = legacyremote.remote_file
legacyremote.remote_file = lambda url, **options: made.append(url) or real(url, **options)
status = main(sys.argv[1:])
print(len(made), file=sys.stderr)
sys.exit(status)
"""


@pytest.mark.parametrize("direction", ["pull-101", "pull", "push"])
def test_a_remote_file_is_probed_once(request, server, unique, tmp_path, direction):
    """The command line resolves a URL once; the sync takes that endpoint instead of probing again."""
    data = random_bytes(SIZE, seed=35)
    local = tmp_path / "local.bin"
    if direction == "pull-101":
        original = tmp_path / "old.bin"
        original.write_bytes(data)
        source, target = f"{request.getfixturevalue('original_server')}{original}", str(local)
    elif direction == "pull":
        (server.root / unique).write_bytes(data)
        source, target = server.url(unique), str(local)
    else:
        local.write_bytes(data)
        source, target = str(local), server.url(unique)
    completed = subprocess.run([sys.executable, "-c", COUNT_PROBES, "--no-progress", source, target],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.strip().splitlines()[-1] == "1", completed.stderr
    assert local.read_bytes() == data
    if direction == "push":
        assert (server.root / unique).read_bytes() == data


def test_101_server_with_a_token_stops_in_one_line(original_server, tmp_path):
    """With a token set, the client refuses a server that cannot check it, and writes nothing."""
    source = tmp_path / "source.bin"
    source.write_bytes(random_bytes(SIZE, seed=33))
    for source_arg, target in ((f"{original_server}{source}", tmp_path / "target.bin"),
                               (str(source), tmp_path / "pushed.bin")):
        target_arg = str(target) if source_arg.startswith("http") else f"{original_server}{target}"
        completed = run_cli(source_arg, target_arg, env_extra={"PDIFFCOPY_TOKEN": "s3cret"}, timeout=60)
        _one_line(completed, f"{original_server}: this is a pdiffcopy 1.0.1 server, which cannot check a token")
        assert not target.exists()


def test_tree_sync_with_a_101_server_stops_in_one_line(original_server, tmp_path):
    """A directory URL, and the server's root, on 1.0.1 stop with one line naming it."""
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "a").write_bytes(b"a")
    for url in (f"{original_server}{tmp_path}/tree/", f"{original_server}/"):
        completed = run_cli("-a", url, str(tmp_path / "copy"), timeout=60)
        _one_line(completed, f"{original_server}: this is a pdiffcopy 1.0.1 server")
    assert not (tmp_path / "copy").exists()


# -- Part two: what 1.0.1's own test suite checks, in this version's terms -------------------

#: Block size of these tests (4 KiB, the smallest --block-size takes but one):
#: files of a few hundred KiB then have enough blocks for a delta to show.
BLOCK = 4096

#: Size of the test files: 64 blocks and a short last one, so the short last
#: block (which 1.0.1 counted with care) is part of every case.
SIZE = 64 * BLOCK + 1000

#: Blocks a delta case changes (of 65): few enough that moving only them is
#: clearly not a whole copy.
CHANGED_BLOCKS = (3, 17, 64)


def _changed(data: bytes, blocks=CHANGED_BLOCKS) -> bytes:
    """``data`` with one byte changed in each of ``blocks``."""
    buffer = bytearray(data)
    for block in blocks:
        buffer[block * BLOCK] ^= 0xFF
    return bytes(buffer)


def _moved(completed: subprocess.CompletedProcess) -> int:
    """The bytes moved, from the --stats line."""
    assert completed.returncode == 0, completed.stderr
    line = [line for line in completed.stdout.splitlines() if line.startswith("stats: moved ")][-1]
    return int(line.split()[2])


def _sides(server, unique: str, direction: str, tmp_path: Path):
    """(source path, target path, SOURCE argument, TARGET argument) of a pull or a push."""
    remote, local = server.root / unique, tmp_path / "local.bin"
    if direction == "pull":
        return remote, local, server.url(unique), str(local)
    return local, remote, str(local), server.url(unique)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_full_transfer_creates_the_target(server, unique, tmp_path, direction):
    """1.0.1's *_full_transfer: a missing target gets the whole file."""
    source, target, source_arg, target_arg = _sides(server, unique, direction, tmp_path)
    source.write_bytes(random_bytes(SIZE, seed=11))
    completed = run_cli("-b", str(BLOCK), "--stats", source_arg, target_arg)
    assert _moved(completed) == SIZE
    assert target.read_bytes() == source.read_bytes()


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_delta_transfer_moves_only_changed_blocks(server, unique, tmp_path, direction):
    """1.0.1's *_delta_transfer: an existing target that differs ends equal, moving only what differs."""
    source, target, source_arg, target_arg = _sides(server, unique, direction, tmp_path)
    data = random_bytes(SIZE, seed=12)
    source.write_bytes(data)
    target.write_bytes(_changed(data))
    completed = run_cli("-b", str(BLOCK), "--stats", source_arg, target_arg)
    # Two full blocks and the short last one.
    assert _moved(completed) == 2 * BLOCK + (SIZE - 64 * BLOCK)
    assert target.read_bytes() == data


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_different_files_end_equal(server, unique, tmp_path, direction):
    """1.0.1's delta tests used two unrelated random files of different sizes: they end equal too."""
    source, target, source_arg, target_arg = _sides(server, unique, direction, tmp_path)
    source.write_bytes(random_bytes(SIZE, seed=13))
    target.write_bytes(random_bytes(SIZE // 2 + 77, seed=14))
    completed = run_cli("-b", str(BLOCK), source_arg, target_arg)
    assert completed.returncode == 0, completed.stderr
    assert target.read_bytes() == source.read_bytes()


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_no_transfer_when_equal(server, unique, tmp_path, direction):
    """1.0.1's *_no_transfer: equal files move nothing and stay equal, untouched."""
    source, target, source_arg, target_arg = _sides(server, unique, direction, tmp_path)
    data = random_bytes(SIZE, seed=15)
    source.write_bytes(data)
    target.write_bytes(data)
    os.utime(target, ns=(1_000_000_000, 1_000_000_000))
    completed = run_cli("-b", str(BLOCK), "--stats", source_arg, target_arg)
    assert _moved(completed) == 0
    assert target.read_bytes() == data
    assert target.stat().st_mtime_ns == 1_000_000_000  # not rewritten


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_dry_run_changes_nothing(server, unique, tmp_path, direction):
    """1.0.1's *_dry_run (-n): the similarity is reported, the target still differs."""
    source, target, source_arg, target_arg = _sides(server, unique, direction, tmp_path)
    data = random_bytes(SIZE, seed=16)
    source.write_bytes(data)
    before = _changed(data)
    target.write_bytes(before)
    completed = run_cli("-n", "-b", str(BLOCK), source_arg, target_arg)
    assert completed.returncode == 0, completed.stderr
    assert "Similarity index: " in completed.stdout and "(3 of 65 blocks differ" in completed.stdout
    assert target.read_bytes() == before


@pytest.mark.parametrize("direction", ["pull", "local"])
def test_benchmark_mode(server, unique, tmp_path, direction):
    """1.0.1's test_benchmark (-B): rounds of mutate-and-resync, a table, and the target equal at the end.

    1.0.1 compared with an rsync daemon when told where one was; ours starts
    one by itself for a local SOURCE when rsync is installed (the local case).
    """
    source = server.root / unique if direction == "pull" else tmp_path / "source.bin"
    source.write_bytes(random_bytes(SIZE, seed=17))
    target = tmp_path / "target.bin"
    source_arg = server.url(unique) if direction == "pull" else str(source)
    completed = run_cli("-B", "2", "-b", str(BLOCK), source_arg, str(target), timeout=60)
    assert completed.returncode == 0, completed.stderr
    # One row a round; "Of the file" is the share that moved: about half of the
    # blocks in round 1 (mutated at random, so not exactly 50 %), all of them in round 2.
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in completed.stdout.splitlines()
            if line.startswith("| ") and "%" in line]
    assert "Data moved" in completed.stdout and len(rows) == 2
    assert 40 <= int(rows[0][3].rstrip("%")) <= 60 and rows[1][3] == "100%"
    assert target.read_bytes() == source.read_bytes()


def test_location_parsing():
    """1.0.1's test_location_parsing: a path is local, an http URL names host, port and file, udp:// is refused.

    1.0.1 took the URL's path as an absolute file name; ours is a path below the
    server's --root (the leading slash only separates it from the host).
    """
    from pdiffcopy.core.locations import is_url
    from pdiffcopy.errors import UsageError
    from pdiffcopy.transport.urls import parse_url

    assert not is_url("/foo/bar")
    assert is_url("http://server:12345/foo/bar")
    assert parse_url("http://server:12345/foo/bar") == ("http://server:12345", "foo/bar")
    assert parse_url("http://server/foo/bar") == ("http://server", "foo/bar")
    with pytest.raises(UsageError, match="Unsupported URL"):
        parse_url("udp://server/filename")


def test_unsupported_scheme_is_one_line(tmp_path):
    """The command line refuses udp:// with one line and the usage exit status."""
    completed = run_cli("udp://server/filename", str(tmp_path / "x"))
    assert completed.returncode == 1, completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1
    assert "Unsupported URL" in completed.stderr


def test_hashes_serial_parallel_and_http_agree(server, unique):
    """1.0.1's test_compute_hashes: hashing serially, in parallel, and through the HTTP API gives the same digests."""
    import hashlib

    from conftest import http_get

    from pdiffcopy.local.localfile import LocalFile, start_hash_pool

    data = random_bytes(SIZE, seed=18)
    path = server.root / unique
    path.write_bytes(data)
    expected = b"".join(hashlib.sha1(data[offset:offset + BLOCK]).digest() for offset in range(0, SIZE, BLOCK))
    segments = [(offset, min(16 * BLOCK, SIZE - offset)) for offset in range(0, SIZE, 16 * BLOCK)]
    for processes in (1, 4):
        pool = start_hash_pool(processes)
        file = LocalFile(str(path), pool=pool)
        try:
            futures = [file.submit_hashes([segment], BLOCK, "sha1") for segment in segments]
            assert b"".join(future.result() for future in futures) == expected, processes
        finally:
            file.close()
            pool.shutdown()
    status, headers, body = http_get(f"{server.base}/.pdiffcopy/hashes/{unique}?method=sha1"
                                     f"&block_size={BLOCK}&offset=0&length={SIZE}")
    assert status == 200 and headers["X-Digest-Size"] == "20"
    assert body == expected


def test_main_module_help():
    """1.0.1's test_main_module: ``python -m pdiffcopy --help`` prints the usage."""
    completed = run_cli("--help")
    assert completed.returncode == 0
    assert completed.stdout.startswith("Usage: pdiffcopy ")


@pytest.mark.parametrize("option", ["-h", "--help"])
def test_usage_message_starts_with_usage(option):
    """1.0.1's test_usage_message: -h and --help exit 0 with a help that starts with 'Usage:'."""
    completed = run_cli(option)
    assert completed.returncode == 0
    assert completed.stdout.startswith("Usage:")
    assert completed.stderr == ""


# -- Parent directories on push (docs/migration.rst) -----------------------------------------

def test_file_push_does_not_create_parent_directories(server, unique, tmp_path):
    """1.0.1 created missing parents of a pushed file; ours refuses in one line and creates nothing.

    A typo in a URL must not grow a directory tree below --root: the parent
    has to exist (a tree push, below, makes what it needs).
    """
    source = tmp_path / "source.bin"
    source.write_bytes(random_bytes(SIZE, seed=19))
    completed = run_cli(str(source), server.url(f"{unique}.d/sub/file.bin"))
    assert completed.returncode == 3, completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
    assert "does not exist (--mkpath makes it)" in completed.stderr
    assert not (server.root / f"{unique}.d").exists()


def test_file_pull_does_not_create_parent_directories(server, unique, tmp_path):
    """Pulling into a missing local directory likewise fails in one line and creates nothing."""
    (server.root / unique).write_bytes(random_bytes(SIZE, seed=20))
    completed = run_cli(server.url(unique), str(tmp_path / "missing" / "file.bin"))
    assert completed.returncode == 3, completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
    assert not (tmp_path / "missing").exists()


def test_tree_push_creates_the_target_directories(server, unique, tmp_path):
    """A directory push (-a SRC/ URL/) makes the target directory, and with --mkpath its missing
    parents (as rsync: without it, one line and nothing made)."""
    (tmp_path / "tree" / "x").mkdir(parents=True)
    data = random_bytes(SIZE, seed=21)
    (tmp_path / "tree" / "x" / "file.bin").write_bytes(data)
    completed = run_cli("-a", f"{tmp_path}/tree/", server.url(f"{unique}.d/deep/"))
    assert completed.returncode == 11 and "--mkpath" in completed.stderr, completed.stderr  # rsync's 11
    assert not (server.root / f"{unique}.d").exists()
    completed = run_cli("-a", "--mkpath", f"{tmp_path}/tree/", server.url(f"{unique}.d/deep/"))
    assert completed.returncode == 0, completed.stderr
    assert (server.root / f"{unique}.d" / "deep" / "x" / "file.bin").read_bytes() == data

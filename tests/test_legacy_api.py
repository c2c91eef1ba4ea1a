"""The API of the deployed pdiffcopy 1.0.1, on the new server (issue 13).

1.0.1's client asks ``GET /info?filename=/abs/path``, ``GET /hashes?...``,
``GET|POST /blocks?...`` and ``POST /resize?...``. Without ``--legacy-api``
the server refuses such requests (never answering them with the bytes of a
file called ``info`` or ``blocks`` below its root); with it, it serves them
confined to ``--root`` and behind the token.

The tests run the real 1.0.1 client when it is installed (benchmarks/setup_original.sh,
or ``$PDIFFCOPY_ORIGINAL`` naming its program) and skip those otherwise; the
raw HTTP tests imitate its requests exactly and always run.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
from pathlib import Path
from urllib.parse import urlencode

import pytest

from conftest import held_lease, mutate, random_bytes, run_cli, start_server
from test_metrics import scrape

REPO = Path(__file__).resolve().parent.parent
ORIGINAL = Path(os.environ.get("PDIFFCOPY_ORIGINAL")
                or REPO / "benchmarks" / ".venv-original" / "bin" / "pdiffcopy")
needs_original = pytest.mark.skipif(
    not os.access(ORIGINAL, os.X_OK),
    reason=f"pdiffcopy 1.0.1 is not installed at {ORIGINAL} (run benchmarks/setup_original.sh)")

MiB = 1024 * 1024

#: Files named like 1.0.1's endpoints, at the top of every root here.
DECOYS = {"info": b'{"size": 100}', "blocks": b"B" * 100, "hashes": b"0\tdeadbeef\n", "resize": b"R"}


def make_root(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in DECOYS.items():
        (path / name).write_bytes(data)
    return path


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """A server without --legacy-api."""
    root = make_root(tmp_path_factory.mktemp("plain-root"))
    running = start_server(root, tmp_path_factory.mktemp("plain-log") / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def legacy_server(tmp_path_factory):
    """A server with --legacy-api (and the default hash methods: sha1, 1.0.1's default, among them)."""
    root = make_root(tmp_path_factory.mktemp("legacy-root"))
    (root / "sub").mkdir()
    running = start_server(root, tmp_path_factory.mktemp("legacy-log") / "server.log",
                           extra=("--legacy-api",))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def legacy_token_server(tmp_path_factory):
    root = make_root(tmp_path_factory.mktemp("legacy-token-root"))
    running = start_server(root, tmp_path_factory.mktemp("legacy-token-log") / "server.log",
                           token="legacy-s3cret", extra=("--legacy-api",))
    yield running
    running.stop()


def old_request(server, verb: str, endpoint: str, body: bytes = None, headers=None, **params):
    """One request as 1.0.1's client makes it; returns (status, reason, content type, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request(verb, f"/{endpoint}?{urlencode(params)}", body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.reason, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


def run_original(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The 1.0.1 program, with its output (it logs to stderr)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PDIFFCOPY") and key != "PYTHONPATH"}
    return subprocess.run([str(ORIGINAL), "-c", "2", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=60)


def requests_logged(server, method: str, endpoint: str) -> int:
    """How many ``METHOD /endpoint?...`` requests the server logged."""
    return server.log.read_text().count(f" {method} /{endpoint}?")


# Without --legacy-api ---------------------------------------------------------------------------

OLD_REQUESTS = [
    ("GET", "info", {}),
    ("GET", "hashes", {"block_size": MiB, "concurrency": 2, "method": "sha1"}),
    ("GET", "blocks", {"offset": 0, "size": MiB}),
    ("POST", "blocks", {"offset": 0}),
    ("POST", "resize", {"size": 10}),
]


@pytest.mark.parametrize("method, endpoint, params", OLD_REQUESTS)
def test_an_old_request_is_refused_with_a_hint_not_answered_with_a_file(plain_server, method, endpoint,
                                                                       params):
    (plain_server.root / "data.bin").write_bytes(b"x" * 10)
    body = b"y" * 10 if method == "POST" else None
    status, reason, content_type, answer = old_request(
        plain_server, method, endpoint, body=body, filename=str(plain_server.root / "data.bin"), **params)
    assert status == 400
    assert answer != DECOYS[endpoint]
    error = json.loads(answer)
    assert error["status"] == 400
    assert "1.0.1" in error["error"] and "--legacy-api" in error["error"]
    # 1.0.1's client shows only the status line (requests' raise_for_status): the hint is there too.
    assert "--legacy-api" in reason and "1.0.1" in reason
    assert (plain_server.root / "data.bin").read_bytes() == b"x" * 10
    # The metrics show that 1.0.1 clients still come (and are refused).
    assert scrape(plain_server.base, headers={})[
        f'pdiffcopy_requests_total{{endpoint="legacy_{endpoint}",status="400"}}'] >= 1
    assert (plain_server.root / endpoint).read_bytes() == DECOYS[endpoint]


@pytest.mark.parametrize("query", ["", "?x=1", "?file=a"])
@pytest.mark.parametrize("name", ["info", "blocks"])
def test_files_named_like_old_endpoints_are_still_files(plain_server, legacy_server, name, query):
    for server in (plain_server, legacy_server):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("GET", f"/{name}{query}")
        response = connection.getresponse()
        assert (response.status, response.read()) == (200, DECOYS[name])
        connection.close()


@needs_original
def test_old_client_pull_fails_cleanly_without_legacy_api(plain_server, tmp_path):
    (plain_server.root / "pulled.bin").write_bytes(random_bytes(3 * MiB))
    target = tmp_path / "pulled.bin"
    done = run_original(f"{plain_server.base}{plain_server.root}/pulled.bin", str(target), cwd=tmp_path)
    assert done.returncode != 0
    assert not target.exists()  # no wrong data (today: the 100 bytes of the root's file "blocks")
    assert "--legacy-api" in done.stderr


@needs_original
def test_old_client_push_fails_cleanly_without_legacy_api(plain_server, tmp_path):
    source = tmp_path / "pushed.bin"
    source.write_bytes(random_bytes(2 * MiB))
    done = run_original(str(source), f"{plain_server.base}{plain_server.root}/pushed.bin", cwd=tmp_path)
    assert done.returncode != 0
    assert not (plain_server.root / "pushed.bin").exists()
    assert "--legacy-api" in done.stderr
    assert all((plain_server.root / name).read_bytes() == data for name, data in DECOYS.items())


# With --legacy-api ------------------------------------------------------------------------------

def test_legacy_info_hashes_and_blocks_answer_as_1_0_1_did(legacy_server):
    data = random_bytes(2 * MiB + 5000, seed=3)
    path = legacy_server.root / "served.bin"
    path.write_bytes(data)
    status, _, _, answer = old_request(legacy_server, "GET", "info", filename=str(path))
    assert (status, json.loads(answer)["size"]) == (200, len(data))
    status, _, content_type, answer = old_request(legacy_server, "GET", "hashes", filename=str(path),
                                                  block_size=MiB, concurrency=4, method="sha1")
    assert status == 200 and content_type.startswith("text/plain")
    lines = answer.decode().splitlines()
    expected = {offset: hashlib.sha1(data[offset:offset + MiB]).hexdigest()
                for offset in range(0, len(data), MiB)}
    assert {int(offset): digest for offset, digest in (line.split("\t") for line in lines)} == expected
    assert len(lines) == 3
    status, _, _, answer = old_request(legacy_server, "GET", "blocks", filename=str(path), offset=MiB,
                                       size=MiB)
    assert (status, answer) == (200, data[MiB:2 * MiB])
    status, _, _, answer = old_request(legacy_server, "GET", "blocks", filename=str(path), offset=2 * MiB,
                                       size=MiB)
    assert (status, answer) == (200, data[2 * MiB:])  # the last, short block
    status, _, _, _ = old_request(legacy_server, "GET", "info", filename=str(legacy_server.root / "nope"))
    assert status == 404  # what 1.0.1's client takes for "does not exist"


def test_legacy_resize_and_write(legacy_server):
    path = legacy_server.root / "sub" / "written.bin"
    status, _, _, _ = old_request(legacy_server, "POST", "resize", filename=str(path), size=3000)
    assert status == 200 and path.read_bytes() == bytes(3000)
    status, _, _, _ = old_request(legacy_server, "POST", "blocks", body=b"z" * 1000, filename=str(path),
                                  offset=1000)
    assert status == 200
    assert path.read_bytes() == bytes(1000) + b"z" * 1000 + bytes(1000)
    # Writes never grow a file (a resize does that, checked against free space), as in the new API.
    status, _, _, _ = old_request(legacy_server, "POST", "blocks", body=b"z" * 1000, filename=str(path),
                                  offset=2500)
    assert status == 416 and path.stat().st_size == 3000
    status, _, _, _ = old_request(legacy_server, "POST", "resize", filename=str(path), size=10)
    assert status == 200 and path.read_bytes() == bytes(10)
    # Unlike 1.0.1, a resize does not create missing parent directories (as the new API's).
    status, _, _, _ = old_request(legacy_server, "POST", "resize", size=10,
                                  filename=str(legacy_server.root / "no-such-dir" / "x.bin"))
    assert status == 404 and not (legacy_server.root / "no-such-dir").exists()


@pytest.mark.parametrize("name, status", [
    ("/etc/passwd", 403),
    ("{root}/../outside.bin", 403),
    ("{root}x/sibling.bin", 403),  # a directory whose name merely starts like the root
    ("{root}/.pdiffcopy/x", 403),
    ("/", 403),
    ("{root}/sub/rel.bin", 200),
    ("{root}//sub/rel.bin", 200),
    ("sub/rel.bin", 200),  # relative names are below the root
])
def test_legacy_names_are_mapped_into_the_root(legacy_server, name, status):
    (legacy_server.root / "sub" / "rel.bin").write_bytes(b"rel")
    filename = name.format(root=legacy_server.root)
    got, _, _, answer = old_request(legacy_server, "GET", "blocks", filename=filename, offset=0, size=3)
    assert got == status, answer
    if status == 200:
        assert answer == b"rel"
    got, _, _, _ = old_request(legacy_server, "POST", "resize", filename=filename, size=1)
    assert got == status
    assert not (legacy_server.root.parent / "outside.bin").exists()


def test_legacy_api_keeps_the_servers_refusals(legacy_server):
    root = legacy_server.root
    os.mkfifo(root / "fifo")
    (root / "linked.bin").write_bytes(b"1234")
    os.link(root / "linked.bin", root / "second-name.bin")
    try:
        for method, endpoint, params in OLD_REQUESTS:
            body = b"x" if method == "POST" else None
            got, _, _, _ = old_request(legacy_server, method, endpoint, body=body,
                                       filename=str(root / "fifo"), **params)
            assert got == 409, endpoint
        got, _, _, _ = old_request(legacy_server, "POST", "blocks", body=b"ab", filename=str(root / "linked.bin"),
                                   offset=0)
        assert got == 403
        got, _, _, _ = old_request(legacy_server, "POST", "resize", filename=str(root / "linked.bin"), size=1)
        assert got == 403
        assert (root / "second-name.bin").read_bytes() == b"1234"
        # A hash method outside the server's list (--hash-methods) is refused as in the new API.
        got, _, _, answer = old_request(legacy_server, "GET", "hashes", filename=str(root / "linked.bin"),
                                        block_size=MiB, concurrency=2, method="md5")
        assert got == 400 and b"md5" in answer
    finally:
        for name in ("fifo", "linked.bin", "second-name.bin"):
            os.unlink(root / name)


def test_legacy_hash_requests_give_their_hash_slot_back(legacy_server):
    """Each holds a hash slot while its answer streams: sent, abandoned or HEAD, the slot comes back."""
    path = legacy_server.root / "slots.bin"
    path.write_bytes(random_bytes(3 * MiB, seed=4))
    params = urlencode({"filename": str(path), "block_size": 1024, "method": "sha1", "concurrency": 2})
    for _ in range(6):  # more than a worker process's slots (server.MAX_CONCURRENT_HASHES)
        for verb, read in (("GET", True), ("HEAD", True), ("GET", False)):
            connection = http.client.HTTPConnection("127.0.0.1", legacy_server.port, timeout=30)
            connection.request(verb, f"/hashes?{params}")
            response = connection.getresponse()
            assert response.status == 200
            if read:
                assert len(response.read().splitlines()) == (3 * MiB // 1024 if verb == "GET" else 0)
            connection.close()  # unread: the server's write fails and the answer is closed


def test_legacy_requests_are_counted_in_the_metrics(legacy_server):
    path = legacy_server.root / "counted.bin"
    path.write_bytes(random_bytes(5000, seed=6))
    before = scrape(legacy_server.base, headers={})
    assert old_request(legacy_server, "GET", "blocks", filename=str(path), offset=0, size=5000)[0] == 200
    assert old_request(legacy_server, "POST", "blocks", body=b"c" * 100, filename=str(path), offset=0)[0] == 200
    assert old_request(legacy_server, "GET", "hashes", filename=str(path), block_size=1024, method="sha1")[0] == 200
    after = scrape(legacy_server.base, headers={})
    assert after["pdiffcopy_served_bytes_total"] - before.get("pdiffcopy_served_bytes_total", 0) == 5000
    assert after["pdiffcopy_received_bytes_total"] - before.get("pdiffcopy_received_bytes_total", 0) == 100
    # Labelled by the legacy endpoint, not as reads of a file called "blocks".
    for endpoint in ("legacy_blocks", "legacy_hashes"):
        key = f'pdiffcopy_requests_total{{endpoint="{endpoint}",status="200"}}'
        assert after[key] - before.get(key, 0) >= 1, sorted(after)


def test_legacy_writes_respect_the_write_lease(legacy_server):
    path = legacy_server.root / "leased.bin"
    path.write_bytes(b"a" * 100)
    with held_lease(legacy_server, "leased.bin"):
        got, _, _, _ = old_request(legacy_server, "POST", "blocks", body=b"b" * 10, filename=str(path), offset=0)
        assert got == 423
        got, _, _, _ = old_request(legacy_server, "POST", "resize", filename=str(path), size=5)
        assert got == 423
    assert path.read_bytes() == b"a" * 100


def test_the_legacy_api_is_behind_the_token(legacy_token_server):
    path = legacy_token_server.root / "secret.bin"
    path.write_bytes(b"secret")
    status, reason, _, answer = old_request(legacy_token_server, "GET", "blocks", filename=str(path),
                                            offset=0, size=6)
    assert status == 401 and b"secret" not in answer
    assert "token" in reason  # what 1.0.1's client shows: it cannot send one
    status, _, _, answer = old_request(legacy_token_server, "GET", "blocks", filename=str(path), offset=0,
                                       size=6, headers={"Authorization": "Bearer legacy-s3cret"})
    assert (status, answer) == (200, b"secret")
    assert "1.0.1 clients cannot send it" in legacy_token_server.log.read_text()  # warned at start


def test_an_old_request_to_a_token_server_without_legacy_api_says_to_upgrade(token_server):
    (token_server.root / "t.bin").write_bytes(b"secret")
    status, reason, _, answer = old_request(token_server, "GET", "blocks", offset=0, size=6,
                                            filename=str(token_server.root / "t.bin"))
    # The token is checked first (401), and the status line says what the 1.0.1 user can do.
    assert status == 401 and b"secret" not in answer
    assert "upgrade the client" in reason and "--legacy-api" in reason


def test_legacy_api_is_a_server_option(tmp_path):
    (tmp_path / "a").write_bytes(b"a")
    done = run_cli("--legacy-api", str(tmp_path / "a"), str(tmp_path / "b"))
    assert done.returncode == 1 and "--legacy-api is a server option" in done.stderr
    assert not (tmp_path / "b").exists()


# The real 1.0.1 client with --legacy-api --------------------------------------------------------

@needs_original
def test_old_client_pulls_a_delta(legacy_server, tmp_path):
    source = random_bytes(5 * MiB + 4321, seed=11)
    (legacy_server.root / "pull.bin").write_bytes(source)
    target = tmp_path / "pull.bin"
    target.write_bytes(mutate(source, [MiB + 10, 5 * MiB + 100]))  # two blocks differ, the last one short
    before = requests_logged(legacy_server, "GET", "blocks")
    done = run_original(f"{legacy_server.base}{legacy_server.root}/pull.bin", str(target), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == source
    assert requests_logged(legacy_server, "GET", "blocks") - before == 2  # a delta: only those moved


@needs_original
def test_old_client_pushes_a_delta_and_a_new_file(legacy_server, tmp_path):
    source_data = random_bytes(4 * MiB + 999, seed=12)
    source = tmp_path / "push.bin"
    source.write_bytes(source_data)
    remote = legacy_server.root / "sub" / "push.bin"
    remote.write_bytes(mutate(source_data, [10, 3 * MiB + 5]) + b"tail beyond the source")
    before = requests_logged(legacy_server, "POST", "blocks")
    done = run_original(str(source), f"{legacy_server.base}{remote}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert remote.read_bytes() == source_data  # shrunk by /resize, two blocks written
    # Blocks 0 and 3 differ, and block 4 (the source's last, short one) hashes unlike the
    # target's longer block 4.
    assert requests_logged(legacy_server, "POST", "blocks") - before == 3
    fresh = legacy_server.root / "sub" / "fresh.bin"
    done = run_original(str(source), f"{legacy_server.base}{fresh}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert fresh.read_bytes() == source_data


@needs_original
def test_old_client_cannot_leave_the_root(legacy_server, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept.bin").write_bytes(b"outside the root")
    done = run_original(f"{legacy_server.base}{outside}/kept.bin", str(tmp_path / "copy.bin"), cwd=tmp_path)
    assert done.returncode != 0 and not (tmp_path / "copy.bin").exists()
    assert "outside" in done.stderr
    source = tmp_path / "evil.bin"
    source.write_bytes(b"evil")
    done = run_original(str(source), f"{legacy_server.base}{outside}/planted.bin", cwd=tmp_path)
    assert done.returncode != 0 and not (outside / "planted.bin").exists()


@needs_original
def test_old_client_fails_cleanly_against_a_token_server(legacy_token_server, tmp_path):
    (legacy_token_server.root / "t.bin").write_bytes(b"secret")
    done = run_original(f"{legacy_token_server.base}{legacy_token_server.root}/t.bin", str(tmp_path / "t.bin"),
                        cwd=tmp_path)
    assert done.returncode != 0 and not (tmp_path / "t.bin").exists()
    assert "401" in done.stderr and "token" in done.stderr

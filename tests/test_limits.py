"""Limits: too many hash requests at once are refused with 503 and Retry-After, and
the client waits and retries, so a busy server slows a sync down instead of failing it.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import pytest
from conftest import mutate, start_server

from pdiffcopy import sync
from pdiffcopy.errors import ServerBusy
from pdiffcopy.transport.httpclient import MAX_BUSY_RETRIES
from pdiffcopy.transport.remote import RemoteFile
from pdiffcopy.server.context import MAX_CONCURRENT_HASHES

#: The file the syncs move.
SIZE = 64 * 1024 * 1024

#: A sparse file hashed with a slow hash (sha3_512: about 0.9 s per 128 MiB on
#: one core here), so that hash requests overlap even on a fast machine.
SPARSE_SIZE = 512 * 1024 * 1024
SLOW_METHOD = "sha3_512"


def hash_request(port: int, length: int = 128 * 1024 * 1024, source: str = "127.0.0.1"):
    """One slow hash request of the file of zeros from ``source``: (status, Retry-After, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    try:
        connection.request("GET", f"/.pdiffcopy/hashes/sparse.img?method={SLOW_METHOD}"
                                  f"&block_size=1048576&offset=0&length={length}")
        response = connection.getresponse()
        return response.status, response.getheader("Retry-After"), response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    """A server with one worker process (-c 1), so its hash slots are few."""
    root = tmp_path_factory.mktemp("busy-root")
    (root / "big.img").write_bytes(os.urandom(SIZE))
    # Zeros written, not a hole: a block in a hole hashes without being read (issue 19), too fast here.
    with open(root / "sparse.img", "wb") as handle:
        chunk = bytes(8 * 1024 * 1024)
        for _ in range(SPARSE_SIZE // len(chunk)):
            handle.write(chunk)
    running = start_server(root, tmp_path_factory.mktemp("busy-log") / "server.log",
                           extra=("-c", "1", "--hash-methods", f"xxh3_128,{SLOW_METHOD}"))
    yield running
    running.stop()


def test_a_burst_of_hash_requests_is_partly_refused_with_retry_after(busy_server):
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: hash_request(busy_server.port), range(12)))
    statuses = [status for status, _, _ in answers]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) > 0, "12 parallel hash requests and not one was refused"
    # A lone client may hold all slots but one (kept free for a newcomer).
    assert statuses.count(200) >= MAX_CONCURRENT_HASHES - 1, statuses
    for status, retry_after, body in answers:
        if status == 503:
            assert retry_after is not None and re.fullmatch(r"[0-9]+", retry_after)
            assert int(retry_after) >= 1
            document = json.loads(body)
            assert document["status"] == 503 and "busy" in document["error"].lower()
        else:
            assert len(body) == 128 * 64  # 128 blocks, 64-byte sha3_512 digests
    # Refusing is cheap and leaves the server answering everything else.
    assert hash_request(busy_server.port)[0] == 200


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_syncs_succeed_while_the_server_refuses_hash_requests(busy_server, tmp_path, direction):
    source_data = (busy_server.root / "big.img").read_bytes()
    local = tmp_path / "local.img"
    remote_name = f"pushed-{direction}.img"
    if direction == "push":
        # An old target to update: the sync hashes it first thing.
        local.write_bytes(source_data)
        (busy_server.root / remote_name).write_bytes(mutate(source_data, range(0, SIZE, SIZE // 8)))
    # Hash requests that take every slot for a few seconds (256 MiB of
    # sha3_512 each, four at once on this machine's cores): every hash
    # request of the sync meanwhile is refused, until they are done. They
    # come from two other addresses, each within its fair share of the slots.
    holders = ThreadPoolExecutor(MAX_CONCURRENT_HASHES)
    held = [holders.submit(hash_request, busy_server.port, SPARSE_SIZE // 2,
                           f"127.0.0.{2 + number % 2}")
            for number in range(MAX_CONCURRENT_HASHES)]
    try:
        time.sleep(0.5)  # they have their slots
        started = time.monotonic()
        if direction == "pull":
            result = sync(busy_server.url("big.img"), str(local), concurrency=2)
            assert local.read_bytes() == source_data
        else:
            result = sync(str(local), busy_server.url(remote_name), concurrency=2)
            assert (busy_server.root / remote_name).read_bytes() == source_data
        assert result.verified
        assert time.monotonic() - started < 60
        assert [future.result()[0] for future in held] == [200] * MAX_CONCURRENT_HASHES
    finally:
        holders.shutdown(wait=True)
    # The sync's own hash requests were refused, and sent again until answered.
    synced = "big.img" if direction == "pull" else re.escape(remote_name)
    own = re.findall(rf"GET /\.pdiffcopy/hashes/{synced}\?\S* (\d{{3}}) ",
                     busy_server.log.read_text())
    assert "503" in own and own[-1] == "200", own


# -- the client's retries, against a scripted server ------------------------------------


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers stat requests with the statuses in ``script``, then 200.

    The ``scripted`` fixture gives each test a subclass with its own lists.
    """

    script: ClassVar[list] = []
    seen: ClassVar[list] = []

    def do_GET(self) -> None:
        self.seen.append(self.path)
        status, retry_after = self.script.pop(0) if self.script else (200, None)
        body = (json.dumps({"type": "file", "size": 5, "mtime_ns": 1, "etag": '"e"', "mode": 420})
                if status == 200 else json.dumps({"error": "Busy", "status": status})).encode()
        self.send_response(status)
        if retry_after is not None:
            self.send_header("Retry-After", retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def scripted():
    handler = type("Handler", (_Scripted,), {"script": [], "seen": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}/file.img"
    httpd.shutdown()
    httpd.server_close()


def test_the_client_retries_a_503_with_retry_after(scripted):
    handler, url = scripted
    handler.script.extend([(503, "0"), (503, "0"), (503, "0")])
    info = RemoteFile(url).stat()
    assert info is not None and info.size == 5
    assert len(handler.seen) == 4


def test_the_client_does_not_retry_a_503_without_retry_after(scripted):
    # Maintenance, a proxy: nothing says that asking again will help.
    handler, url = scripted
    handler.script.extend([(503, None)])
    started = time.monotonic()
    with pytest.raises(ServerBusy, match="Busy"):
        RemoteFile(url).stat()
    assert len(handler.seen) == 1
    assert time.monotonic() - started < 5


def test_the_client_gives_up_on_a_server_that_stays_busy(scripted):
    handler, url = scripted
    handler.script.extend([(503, "0")] * (MAX_BUSY_RETRIES + 5))
    with pytest.raises(ServerBusy, match=f"still busy after {MAX_BUSY_RETRIES} retries"):
        RemoteFile(url).stat()
    assert len(handler.seen) == MAX_BUSY_RETRIES + 1


def test_the_client_caps_a_huge_retry_after(scripted, monkeypatch):
    handler, url = scripted
    handler.script.extend([(503, "99999")])
    slept = []
    monkeypatch.setattr("pdiffcopy.transport.httpclient.time.sleep", slept.append)
    RemoteFile(url).stat()
    assert len(slept) == 1 and slept[0] <= 15


def test_the_client_waits_out_a_minute_long_burst(scripted, monkeypatch):
    # A server refusing hash requests with Retry-After: 1 for a minute (one
    # client's burst of slow hash requests) once failed a sync after 25
    # retries in about 30 s; the waits now grow, and outlast it.
    handler, url = scripted
    handler.script.extend([(503, "1")] * MAX_BUSY_RETRIES)
    slept = []
    monkeypatch.setattr("pdiffcopy.transport.httpclient.time.sleep", slept.append)
    assert RemoteFile(url).stat() is not None
    assert len(slept) == MAX_BUSY_RETRIES
    assert slept[0] < 2  # the first retry comes soon
    assert sum(slept) > 120

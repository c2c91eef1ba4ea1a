"""Bounds on what one request may make the server do: ranges, hashes, bodies, listings, CPU."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import socket
import threading
import time
from typing import ClassVar

import pytest
from conftest import http_get, mutate, random_bytes, run_cli, start_server

from pdiffcopy import sync
from pdiffcopy.errors import RemoteError
from pdiffcopy.core.byteranges import MAX_RANGES_ACCEPTED, parse_range_header
from pdiffcopy.transport.remote import RemoteFile
from pdiffcopy.transport.remotetree import RemoteTree
from pdiffcopy.server.slots import FairSlots


# -- item 9: range amplification -----------------------------------------------


def test_overlapping_and_adjacent_ranges_are_coalesced():
    assert parse_range_header("bytes=0-,0-,0-", 100) == [(0, 100)]
    assert parse_range_header("bytes=50-59,0-9,10-19,5-14", 100) == [(0, 20), (50, 10)]
    assert parse_range_header("bytes=-10,95-", 100) == [(90, 10)]


def test_a_header_of_overlapping_ranges_promises_no_more_than_the_file(server, unique):
    data = random_bytes(64 * 1024)
    (server.root / unique).write_bytes(data)
    header = "bytes=" + ",".join(["0-"] * 1000)
    status, headers, body = http_get(server.url(unique), {"Range": header})
    assert status == 206
    assert int(headers["Content-Length"]) == len(data) == len(body)
    assert body == data


def test_many_tiny_ranges_get_the_whole_file_rather_than_a_bloated_multipart(server, unique):
    data = random_bytes(64 * 1024)
    (server.root / unique).write_bytes(data)
    header = "bytes=" + ",".join(f"{offset}-{offset}" for offset in range(0, 2 * MAX_RANGES_ACCEPTED, 2)
                                 )[:8000].rpartition(",")[0]
    status, headers, body = http_get(server.url(unique), {"Range": header})
    # A multipart answer would carry ~100 bytes of part headers per byte asked.
    assert status == 200
    assert body == data


def test_overlapping_hash_ranges_are_refused(server, unique):
    (server.root / unique).write_bytes(random_bytes(64 * 1024))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        header = "bytes=" + ",".join(["0-65535"] * 100)
        connection.request("GET", f"/.pdiffcopy/hashes/{unique}?method=xxh3_128&block_size=1024",
                           headers={"Range": header})
        response = connection.getresponse()
        document = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 400
    assert "overlap" in document["error"]


def test_many_tiny_ranges_of_a_big_file_are_refused_with_416(server, unique):
    with open(server.root / unique, "wb") as handle:
        handle.truncate(64 * 1024 * 1024)
    header = "bytes=" + ",".join(f"{offset}-{offset}" for offset in range(0, 750 * 4, 4))
    status, _, body = http_get(server.url(unique), {"Range": header})
    assert status == 416
    assert "Too many small ranges" in json.loads(body)["error"]


def test_the_client_reads_ranges_the_server_merged(server, unique):
    data = random_bytes(64 * 1024)
    (server.root / unique).write_bytes(data)
    asked = [(0, 1024), (1024, 1024), (4096, 1024), (5120, 100), (9000, 10)]
    remote = RemoteFile(server.url(unique))
    try:
        got = {}
        for offset, chunk in remote.read_ranges(asked):
            got[offset] = bytes(chunk)
    finally:
        remote.close()
    joined = b"".join(got[offset] for offset in sorted(got))
    assert joined == data[0:2048] + data[4096:5220] + data[9000:9010]
    # Merged or not, every range asked for came once.
    assert sum(len(chunk) for chunk in got.values()) == sum(length for _, length in asked)


# -- item 10: CPU fairness and the hash methods a server accepts ------------------------


#: The abusive client's address: loopback, but another one than the normal client's.
ABUSER = "127.0.0.2"


def abusive_hashes(port: int, stop: threading.Event, statuses: list) -> None:
    """Hash requests as fast as one connection goes: 1 KiB blocks of a 256 MiB sparse file."""
    while not stop.is_set():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60,
                                                source_address=(ABUSER, 0))
        try:
            connection.request("GET", "/.pdiffcopy/hashes/sparse.img?method=sha256"
                                      f"&block_size=1024&offset=0&length={SPARSE_SIZE}")
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        except OSError:
            pass
        finally:
            connection.close()


SPARSE_SIZE = 256 * 1024 * 1024


@pytest.fixture(scope="module")
def hammered_server(tmp_path_factory):
    """A server with one worker process (its hash slots are few) and a big sparse file."""
    root = tmp_path_factory.mktemp("hammered-root")
    with open(root / "sparse.img", "wb") as handle:
        handle.truncate(SPARSE_SIZE)
    (root / "normal.img").write_bytes(random_bytes(8 * 1024 * 1024, seed=5))
    running = start_server(root, tmp_path_factory.mktemp("hammered-log") / "server.log",
                           extra=("-c", "1"))
    yield running
    running.stop()


def test_a_client_hammering_hash_requests_leaves_slots_for_a_normal_sync(hammered_server, tmp_path):
    stop = threading.Event()
    statuses: list = []
    abusers = [threading.Thread(target=abusive_hashes, args=(hammered_server.port, stop, statuses))
               for _ in range(6)]
    for thread in abusers:
        thread.start()
    try:
        time.sleep(1.5)  # they hold every slot they can get
        local = tmp_path / "normal.img"
        local.write_bytes(mutate((hammered_server.root / "normal.img").read_bytes(), range(0, 8 << 20, 1 << 20)))
        started = time.monotonic()
        result = sync(hammered_server.url("normal.img"), str(local), concurrency=2)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        for thread in abusers:
            thread.join()
    assert result.verified
    assert local.read_bytes() == (hammered_server.root / "normal.img").read_bytes()
    assert 200 in statuses  # the abuser was served too, its fair share
    own = re.findall(r"127\.0\.0\.1 GET /\.pdiffcopy/hashes/normal\.img\S* (\d{3}) ",
                     hammered_server.log.read_text())
    # The normal client was never refused: the abuser could take only its share of the slots.
    assert own and set(own) == {"200"}, (own, elapsed)
    assert elapsed < 20


def test_a_slow_hash_method_is_refused_by_default_and_the_client_says_so_in_one_line(hammered_server,
                                                                                       tmp_path):
    server, unique = hammered_server, "normal.img"
    status, _, body = http_get(server.url(f".pdiffcopy/hashes/{unique}?method=sm3&block_size=1024"
                                          "&offset=0&length=65536"))
    assert status == 400
    assert "does not accept the hash method 'sm3'" in json.loads(body)["error"]
    status, _, body = http_get(server.url(".pdiffcopy/version"))
    assert "sm3" not in json.loads(body)["methods"] and "xxh3_128" in json.loads(body)["methods"]
    result = run_cli("-m", "sm3", "--no-progress", server.url(unique), str(tmp_path / "copy.img"))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not accept the hash method 'sm3'" in lines[0], result.stderr


def test_the_operator_chooses_the_hash_methods(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "a.img").write_bytes(random_bytes(64 * 1024))
    running = start_server(tmp_path / "root", tmp_path / "server.log", extra=("--hash-methods", "sm3,sha256"))
    try:
        query = "block_size=1024&offset=0&length=65536"
        assert http_get(running.url(f".pdiffcopy/hashes/a.img?method=sm3&{query}"))[0] == 200
        assert http_get(running.url(f".pdiffcopy/hashes/a.img?method=xxh3_128&{query}"))[0] == 400
        result = run_cli("-m", "sm3", "--no-progress", running.url("a.img"), str(tmp_path / "copy.img"))
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "copy.img").read_bytes() == (tmp_path / "root" / "a.img").read_bytes()
    finally:
        running.stop()
    result = run_cli("--root", str(tmp_path), "--hash-methods", "nosuch", "-l", "127.0.0.1:0")
    assert result.returncode == 1 and "Unknown hash method: 'nosuch'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# -- item 8: memory: JSON bodies read item by item, listings streamed ---------------------


def worker_peak_kib(server) -> int:
    """The peak resident memory (VmHWM, KiB) of the server's one worker process."""
    children = []
    for task in os.listdir(f"/proc/{server.process.pid}/task"):
        with open(f"/proc/{server.process.pid}/task/{task}/children") as handle:
            children += [int(pid) for pid in handle.read().split()]
    assert len(children) == 1, children
    with open(f"/proc/{children[0]}/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def post_raw(port: int, target: str, head_only_length: int = 0, body: bytes = b""):
    """POST ``body`` (or only headers announcing ``head_only_length`` bytes); (status, document) or None.

    None when the server closed the connection before its answer could be
    read: it stopped reading a body it refused, and the kernel reset the
    connection over the unread rest.
    """
    length = head_only_length or len(body)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        try:
            connection.sendall(f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               f"Content-Length: {length}\r\n\r\n".encode() + body)
        except OSError:
            pass
        answer = b""
        try:
            while True:
                data = connection.recv(65536)
                if not data:
                    break
                answer += data
                head, _, rest = answer.partition(b"\r\n\r\n")
                match = re.search(rb"Content-Length: (\d+)", head)
                if match and len(rest) >= int(match.group(1)):
                    break
        except OSError:
            return None
    if not answer:
        return None
    head, _, rest = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


@pytest.fixture
def lean_server(tmp_path):
    """A fresh server with one worker process, whose memory the test watches."""
    (tmp_path / "root").mkdir()
    running = start_server(tmp_path / "root", tmp_path / "server.log", extra=("-c", "1"))
    assert http_get(running.url(".pdiffcopy/version"))[0] == 200  # the worker is warm
    yield running
    running.stop()


def test_an_oversize_json_body_is_refused_by_its_length_before_it_is_read(lean_server):
    started = time.monotonic()
    for endpoint in ("tree-read", "tree-apply"):
        answer = post_raw(lean_server.port, f"/.pdiffcopy/{endpoint}/", head_only_length=1 << 30)
        assert answer is not None
        status, document = answer
        assert status == 413 and document["status"] == 413
        assert "at most 67108864" in document["error"]
    assert time.monotonic() - started < 5  # no wait for the gigabyte that never came
    assert http_get(lean_server.url(".pdiffcopy/version"))[0] == 200


def test_a_json_body_of_many_tiny_values_costs_a_worker_little_memory(lean_server):
    # 16 MiB of empty lists: json.loads made 5.6 million list objects of it
    # (some 400 MiB) before looking at the first one.
    body = b'{"entries":[' + b",".join([b"[]"] * (16 * 1024 * 1024 // 3)) + b"]}"
    before = worker_peak_kib(lean_server)
    for endpoint in ("tree-read", "tree-apply"):
        answer = post_raw(lean_server.port, f"/.pdiffcopy/{endpoint}/", body=body.replace(
            b"entries", b"entries" if endpoint == "tree-read" else b"operations"))
        if answer is not None:  # else refused unread, the connection reset
            assert answer[0] == 400, answer
    grown = worker_peak_kib(lean_server) - before
    assert grown < 48 * 1024, f"the worker grew by {grown} KiB"
    assert http_get(lean_server.url(".pdiffcopy/version"))[0] == 200


def test_a_listing_is_streamed_and_ends_with_a_status(lean_server):
    tree = lean_server.root / "many"
    tree.mkdir()
    for index in range(30_000):
        os.close(os.open(tree / f"file-{index:05d}", os.O_CREAT | os.O_WRONLY, 0o644))
    before = worker_peak_kib(lean_server)
    connection = http.client.HTTPConnection("127.0.0.1", lean_server.port, timeout=30)
    try:
        connection.request("GET", "/.pdiffcopy/tree/many")
        response = connection.getresponse()
        # Sent while the tree is walked: no length known in advance.
        assert response.status == 200 and response.getheader("Content-Length") is None
        assert response.getheader("Transfer-Encoding") == "chunked"
        document = json.loads(response.read())
    finally:
        connection.close()
    assert document["complete"] is True and document["failures"] == []
    assert len(document["entries"]) == 30_000
    grown = worker_peak_kib(lean_server) - before
    assert grown < 12 * 1024, f"the worker grew by {grown} KiB"
    listing = RemoteTree(lean_server.url("many")).list()
    assert len(listing.entries) == 30_000 and listing.root is not None


class _ListingServer(http.server.BaseHTTPRequestHandler):
    """Answers every GET with ``body`` (a listing as a server might send it)."""

    body: ClassVar[bytes] = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


ROOT_WIRE = ["", "dir", 0, 0, 0o40755, 0, 0, "", 2, 0]
FILE_WIRE = ["a", "file", 1, 0, 0o100644, 0, 0, "", 1, 0]


@pytest.mark.parametrize("body, message", [
    ({"root": ROOT_WIRE, "entries": [FILE_WIRE], "failures": [], "complete": True}, None),
    ({"root": ROOT_WIRE, "entries": [FILE_WIRE], "failures": []}, "listing: it ended early"),
    ('{"root":%s,"entries":[%s],"failures":[],"error":"Cannot read sub: I/O error"'
     % (json.dumps(ROOT_WIRE), json.dumps(FILE_WIRE)), "could not list .*: Cannot read sub: I/O error"),
    ('{"root":%s,"entries":[%s' % (json.dumps(ROOT_WIRE), json.dumps(FILE_WIRE)), "malformed"),
], ids=["complete", "no-status", "error-at-the-end", "cut-off"])
def test_the_client_takes_only_a_listing_that_says_it_is_complete(body, message):
    handler = type("Handler", (_ListingServer,), {
        "body": (body if isinstance(body, str) else json.dumps(body)).encode()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        tree = RemoteTree(f"http://127.0.0.1:{httpd.server_address[1]}/tree")
        if message is None:
            assert [entry.path for entry in tree.list().entries] == ["a"]
        else:
            with pytest.raises(RemoteError, match=message):
                tree.list()
        tree.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_listings_never_read_or_abandoned_leave_no_descriptor_open(lean_server):
    # A regression test of the streamed listing: a HEAD never reads its body,
    # a client that goes away reads part of it.
    tree = lean_server.root / "some"
    for directory in range(5):
        (tree / f"d{directory}").mkdir(parents=True)
        for index in range(3000):
            (tree / f"d{directory}" / f"f{index}").write_bytes(b"")

    def worker_descriptors() -> int:
        children = open(f"/proc/{lean_server.process.pid}/task/{lean_server.process.pid}/children").read()
        return len(os.listdir(f"/proc/{int(children.split()[0])}/fd"))

    before = worker_descriptors()
    for _ in range(10):
        connection = http.client.HTTPConnection("127.0.0.1", lean_server.port, timeout=30)
        connection.request("HEAD", "/.pdiffcopy/tree/some")
        assert connection.getresponse().status == 200
        connection.close()
        with socket.create_connection(("127.0.0.1", lean_server.port), timeout=30) as gone:
            gone.sendall(b"GET /.pdiffcopy/tree/some HTTP/1.1\r\nHost: x\r\n\r\n")
            gone.recv(1000)
    deadline = time.monotonic() + 10
    while worker_descriptors() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_descriptors() <= before + 2
    assert http_get(lean_server.url(".pdiffcopy/version"))[0] == 200


def test_fair_slots_give_a_lone_client_all_but_one_and_a_crowd_their_share():
    slots = FairSlots(4, 2, contention_seconds=60)
    assert [slots.acquire("a", timeout=0) for _ in range(4)] == [True, True, True, False]
    # A newcomer finds the slot kept free, at once.
    assert slots.acquire("b", timeout=0)
    # "a" holds more than its share now: its next request is refused at once
    # (no waiting), and slots it gives back go to "b", not to it.
    started = time.monotonic()
    assert not slots.acquire("a", timeout=5)
    assert time.monotonic() - started < 1
    slots.release("a")
    assert not slots.acquire("a", timeout=0)
    assert slots.acquire("b", timeout=0)
    assert slots.held("a") == 2 and slots.held("b") == 2
    for _ in range(2):
        slots.release("a")
        slots.release("b")
    assert slots.held("a") == slots.held("b") == 0

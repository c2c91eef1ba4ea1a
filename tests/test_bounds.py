"""Bounds on what one request may make the server do: ranges, hashes, bodies, listings, CPU."""

from __future__ import annotations

import http.client
import json

from conftest import http_get, random_bytes

from pdiffcopy.byteranges import MAX_RANGES_ACCEPTED, parse_range_header
from pdiffcopy.remote import RemoteFile


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

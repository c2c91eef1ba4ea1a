"""HTTP as RFC 9110 and RFC 2046 say: what any standard client may rely on (issue 13).

Every test talks to a real server with the standard library's HTTP client or
parses its answers with the standard library's MIME parser.
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import http.client
import json
import os
import time

from conftest import http_get, random_bytes

#: The boundary the server used for every multipart answer before issue 13.
OLD_FIXED_BOUNDARY = b"pdiffcopy-byteranges-3f9c1b"


def request(server, method: str, name: str, headers=None):
    """One request with http.client (it allows HEAD and shows the raw status); returns (status, headers, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request(method, "/" + name, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def parse_mime(headers, body: bytes):
    """The parts of a multipart body as Python's email parser (any MIME reader) sees them."""
    head = f"Content-Type: {headers['Content-Type']}\r\n\r\n".encode()
    message = email.message_from_bytes(head + body, policy=email.policy.HTTP)
    return [(part["Content-Range"], part.get_payload(decode=True)) for part in message.iter_parts()]


# 1. multipart/byteranges boundaries (RFC 2046 5.1.1: a boundary must not occur in the data)

def test_multipart_boundary_survives_a_file_containing_the_old_fixed_boundary(server, unique):
    data = bytearray(random_bytes(4000))
    line = b"\r\n--" + OLD_FIXED_BOUNDARY + b"\r\n"  # as docs/protocol.rst has it
    data[100:100 + len(line)] = line
    (server.root / unique).write_bytes(bytes(data))
    status, headers, body = http_get(server.url(unique), {"Range": "bytes=0-999,2000-2099"})
    assert status == 206
    parts = parse_mime(headers, body)
    assert parts == [("bytes 0-999/4000", bytes(data[0:1000])),
                     ("bytes 2000-2099/4000", bytes(data[2000:2100]))]


def test_multipart_boundary_is_fresh_per_response(server, unique):
    (server.root / unique).write_bytes(random_bytes(1000))
    types = {http_get(server.url(unique), {"Range": "bytes=0-9,20-29"})[1]["Content-Type"] for _ in range(3)}
    assert len(types) == 3, types


def test_client_push_and_pull_with_multipart_still_exact(server, unique, tmp_path):
    """Our own client sends and reads multipart bodies with the fresh boundaries."""
    from conftest import mutate, run_cli

    original = random_bytes(3 * 1024 * 1024, seed=5)
    changed = mutate(original, range(0, len(original), 300_000))
    (server.root / unique).write_bytes(original)
    local = tmp_path / "local.img"
    local.write_bytes(changed)
    result = run_cli("-b", "64KiB", "--no-progress", str(local), server.url(unique))
    assert result.returncode == 0, result.stderr
    assert (server.root / unique).read_bytes() == changed
    (server.root / unique).write_bytes(mutate(changed, range(1000, len(changed), 700_000), seed=9))
    result = run_cli("-b", "64KiB", "--no-progress", server.url(unique), str(local))
    assert result.returncode == 0, result.stderr
    assert local.read_bytes() == (server.root / unique).read_bytes()


# 2. An unknown range unit is ignored (RFC 9110 14.2)

def test_unknown_range_unit_is_ignored(server, unique):
    data = random_bytes(5000, seed=3)
    (server.root / unique).write_bytes(data)
    status, headers, body = http_get(server.url(unique), {"Range": "items=0-5"})
    assert status == 200
    assert body == data and "Content-Range" not in headers


# 3. A 416 says the current length (RFC 9110 15.5.17)

def test_head_ignores_range_even_one_past_the_end(server, unique):
    # The document says so; schemathesis found a HEAD answered 416, which it does not list.
    (server.root / unique).write_bytes(b"small file\n")
    for asked in ("bytes=5735-", "bytes=2-3", "bytes=0-1,5-6"):
        status, headers, body = request(server, "HEAD", unique, {"Range": asked})
        assert (status, headers["Content-Length"], body) == (200, "11", b""), asked


def test_416_carries_content_range_with_the_size(server, unique):
    (server.root / unique).write_bytes(random_bytes(1234))
    status, headers, body = http_get(server.url(unique), {"Range": "bytes=5000-6000"})
    assert status == 416
    assert headers["Content-Range"] == "bytes */1234"
    assert body.startswith(b"{")  # still our JSON error


# 4. Conditional requests (RFC 9110 13.1.2, 13.1.3, 13.2.2)

def test_if_none_match_with_the_current_etag_answers_304(server, unique):
    (server.root / unique).write_bytes(random_bytes(2000))
    current = request(server, "HEAD", unique)[1]["ETag"]
    for method in ("GET", "HEAD"):
        status, headers, body = request(server, method, unique, {"If-None-Match": f'"other", {current}'})
        assert (status, body) == (304, b""), method
        assert headers["ETag"] == current
    status, _, body = request(server, "GET", unique, {"If-None-Match": '"other"'})
    assert status == 200 and len(body) == 2000
    assert request(server, "GET", unique, {"If-None-Match": "*"})[0] == 304


def test_if_modified_since_answers_304_when_not_modified(server, unique):
    path = server.root / unique
    path.write_bytes(random_bytes(2000))
    mtime = time.time() - 3600
    os.utime(path, (mtime, mtime))
    last_modified = request(server, "HEAD", unique)[1]["Last-Modified"]
    assert request(server, "GET", unique, {"If-Modified-Since": last_modified})[:3:2] == (304, b"")
    earlier = email.utils.formatdate(mtime - 60, usegmt=True)
    status, _, body = request(server, "GET", unique, {"If-Modified-Since": earlier})
    assert status == 200 and len(body) == 2000
    assert request(server, "GET", unique, {"If-Modified-Since": "not a date"})[0] == 200


def test_if_none_match_takes_precedence_over_if_modified_since(server, unique):
    path = server.root / unique
    path.write_bytes(random_bytes(2000))
    last_modified = request(server, "HEAD", unique)[1]["Last-Modified"]
    # A different ETag wins over a date that says "not modified".
    status, _, body = request(server, "GET", unique,
                              {"If-None-Match": '"other"', "If-Modified-Since": last_modified})
    assert status == 200 and len(body) == 2000


# 5. The auth scheme is case-insensitive (RFC 9110 11.1)

def test_auth_scheme_is_case_insensitive(token_server, unique):
    (token_server.root / unique).write_bytes(b"secret data")
    for scheme in ("bearer", "BEARER", "Bearer"):
        status, _, body = http_get(token_server.url(unique), {"Authorization": f"{scheme} s3cret-token"})
        assert (status, body) == (200, b"secret data"), scheme
    for header in ("bearer wrong-token", "Basic s3cret-token", "bearer", "s3cret-token", "bearers3cret-token"):
        assert http_get(token_server.url(unique), {"Authorization": header})[0] == 401, header


def test_health_answers_without_the_token_and_tells_nothing_about_files(token_server):
    """A load balancer or systemd probe asks GET /.pdiffcopy/health with no token (liveness only)."""
    (token_server.root / "secret.img").write_bytes(b"x" * 10)
    status, headers, body = http_get(f"{token_server.base}/.pdiffcopy/health")
    assert status == 200, body
    assert json.loads(body) == {"status": "ok"}
    # Everything else still wants the token, and the health check names no file.
    assert http_get(f"{token_server.base}/.pdiffcopy/version")[0] == 401
    assert http_get(f"{token_server.base}/secret.img")[0] == 401
    assert b"secret" not in body

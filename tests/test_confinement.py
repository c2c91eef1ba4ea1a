"""Escapes that must not work: tokens in URLs, encodings, long names, a symlink swapped in mid-request."""

from __future__ import annotations

import os
import threading
import time

import pytest

from conftest import http_get

SECRET = b"outside the root: must never be served\n"


@pytest.fixture
def outside_file(server):
    """A file next to (not inside) the server's root."""
    path = server.root.parent / f"outside-{os.getpid()}.txt"
    path.write_bytes(SECRET)
    yield path
    path.unlink()


def test_a_token_in_the_url_is_not_a_token(token_server, unique):
    (token_server.root / unique).write_bytes(b"private")
    for query in (f"?token={token_server.token}", f"?access_token={token_server.token}",
                  f"?Authorization=Bearer%20{token_server.token}"):
        status, _, body = http_get(token_server.url(unique) + query)
        assert status == 401, query
        assert b"private" not in body


@pytest.mark.parametrize("path", [
    "%252e%252e/%252e%252e/etc/passwd",   # double encoding: one decode leaves literal names
    "..%5c..%5cetc%5cpasswd",              # backslashes are ordinary characters on Linux
    "%2e%2e%5c%2e%2e%5cetc%5cpasswd",
])
def test_encoded_escapes_stay_inside_the_root(server, path):
    status, _, body = http_get(f"{server.base}/{path}")
    assert status in (403, 404)
    assert b"root:" not in body


def test_an_overlong_name_is_a_client_error(server):
    status, _, body = http_get(f"{server.base}/{'n' * 300}")
    assert status == 400
    assert b"too long" in body


def test_a_symlink_swapped_in_during_requests_never_leaks(server, outside_file, unique):
    """Race a symlink to an outside file against reads of the same name.

    A check-then-open server would sometimes open the symlink after checking
    the regular file; openat2(RESOLVE_BENEATH) resolves and opens in one step.
    """
    name = server.root / unique
    inside = server.root / (unique + ".inside")
    inside.write_bytes(b"inside\n")
    link, plain = server.root / (unique + ".link"), server.root / (unique + ".plain")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for source in (link, plain):
                try:
                    if source is link:
                        os.symlink(outside_file, source)
                    else:
                        os.link(inside, source)
                    os.replace(source, name)
                except OSError:
                    pass

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    statuses = set()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for endpoint in ("", ".pdiffcopy/hashes/"):
                query = "?method=md5&block_size=1024&offset=0&length=1024" if endpoint else ""
                status, _, body = http_get(f"{server.base}/{endpoint}{unique}{query}")
                statuses.add(status)
                assert SECRET not in body
                if endpoint and status == 200:
                    # The digest of the inside file's block, never the outside one's.
                    import hashlib

                    assert body == hashlib.md5(b"inside\n").digest()
    finally:
        stop.set()
        swapper.join()
    assert 200 in statuses and 403 in statuses  # both sides of the race were hit
    assert outside_file.read_bytes() == SECRET

"""The server as any HTTP client sees it: ranged reads, HEAD, the request log."""

from __future__ import annotations

import subprocess

from conftest import http_get, random_bytes


def test_plain_get_with_a_range_answers_206(server, unique):
    data = random_bytes(100000)
    (server.root / unique).write_bytes(data)
    status, headers, body = http_get(server.url(unique), {"Range": "bytes=10-19"})
    assert status == 206
    assert headers["Content-Range"] == "bytes 10-19/100000"
    assert body == data[10:20]
    status, headers, body = http_get(server.url(unique), {"Range": "bytes=-5"})
    assert status == 206 and body == data[-5:]


def test_several_ranges_answer_multipart_byteranges(server, unique):
    data = random_bytes(50000, seed=3)
    (server.root / unique).write_bytes(data)
    status, headers, body = http_get(server.url(unique), {"Range": "bytes=0-3,40000-40009"})
    assert status == 206
    assert headers["Content-Type"].startswith("multipart/byteranges; boundary=")
    assert b"Content-Range: bytes 0-3/50000\r\n\r\n" + data[0:4] in body
    assert b"Content-Range: bytes 40000-40009/50000\r\n\r\n" + data[40000:40010] in body
    assert int(headers["Content-Length"]) == len(body)


def test_get_without_range_and_head(server, unique):
    data = random_bytes(12345, seed=4)
    (server.root / unique).write_bytes(data)
    status, headers, body = http_get(server.url(unique))
    assert status == 200 and body == data
    assert headers["Accept-Ranges"] == "bytes" and headers["ETag"]
    result = subprocess.run(["curl", "-sI", server.url(unique)], capture_output=True, text=True)
    if result.returncode == 0:  # curl may be missing; urllib has no HEAD shortcut
        assert "content-length: 12345" in result.stdout.lower()


def test_each_request_is_logged_once(server, unique):
    (server.root / unique).write_bytes(b"logged")
    http_get(server.url(unique) + "?marker=1")
    log = server.log.read_text()
    lines = [line for line in log.splitlines() if f"GET /{unique}?marker=1 200" in line]
    assert len(lines) == 1 and " INFO " in lines[0]


def test_the_views_live_in_blueprints(tmp_path):
    # Files, trees and 1.0.1's API each in a blueprint of their own; the application
    # itself keeps only what says who it is (health, version, metrics, its document) and the
    # end of a client's sync (for its transfer log).
    from pdiffcopy.server.app import ServerConfig, create_app

    app = create_app(ServerConfig(root=str(tmp_path), lease_directory=str(tmp_path / "leases")))
    assert set(app.blueprints) == {"files", "trees", "legacy"}
    own = {rule.endpoint for rule in app.url_map.iter_rules() if "." not in rule.endpoint}
    assert own == {"health", "version", "metrics", "openapi", "index", "sync_done"}
    assert any(rule.endpoint.startswith("files.") for rule in app.url_map.iter_rules())
    assert any(rule.endpoint.startswith("trees.") for rule in app.url_map.iter_rules())


def test_the_file_views_hash_map_punch_and_resize_through_the_file_they_open():
    """Not over raw descriptors: the endpoint's rules and errors hold, and an exported device's
    own data map (its holes never read)."""
    import ast
    from pathlib import Path

    import pdiffcopy.server

    tree = ast.parse((Path(pdiffcopy.server.__file__).parent / "files.py").read_text())
    called = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and node.module in ("pdiffcopy.local.descriptors", "pdiffcopy.local.filehash")
              for alias in node.names}
    # Left: the umask query, and the chunk list's cut, streamed as it is cut.
    assert called <= {"process_umask", "cut_region"}, called


def test_the_server_moves_file_bytes_through_local_file():
    # Reads and writes of file data go through LocalFile (its loops, its errors): no
    # pread or write loop of the server's own.
    from pathlib import Path

    import pdiffcopy.server

    # (The lease table's records and the transfer log's are their own small files in their own
    # directories, never served data.)
    sources = {path.name: path.read_text() for path in Path(pdiffcopy.server.__file__).parent.glob("*.py")
               if path.name not in ("leasetable.py", "audit.py")}
    own_loops = sorted(name for name, text in sources.items()
                       if "os.pread(" in text or "write_all(" in text or "os.pwrite(" in text)
    assert own_loops == []

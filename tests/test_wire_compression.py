"""zstd on the wire (-z, --no-compress, adaptive): exact bytes, fewer bytes on the wire, damage caught."""

from __future__ import annotations

import http.client
import shutil
import http.server
import re
import threading
import urllib.parse

import pytest

from conftest import random_bytes, run_cli, start_server

zstandard = pytest.importorskip("zstandard")

from pdiffcopy.core import compression  # noqa: E402

MiB = 1024 ** 2

#: A real bandwidth limit (``--bwlimit``), slow enough that one core compresses faster than the
#: link moves bytes, fast enough that 48 MiB cross it in a few seconds.
SLOW_LINK = "16M"

WIRE = re.compile(r"moved (?P<moved>\d+) bytes.*?(?P<sent>\d+) bytes sent and (?P<received>\d+) bytes received "
                  r"on the wire")


def text(size: int, seed: int = 0) -> bytes:
    """Log-like data that zstd shrinks several times over."""
    line = 0
    parts = []
    total = 0
    while total < size:
        part = b"%08d host%d GET /api/v1/items/%d?page=%d 200 %d ms\n" % (
            line, (line + seed) % 7, (line * 31 + seed) % 5000, line % 13, (line * 17) % 900)
        parts.append(part)
        total += len(part)
        line += 1
    return b"".join(parts)[:size]


def wire(done) -> dict:
    assert done.returncode == 0, done.stderr
    found = WIRE.search(done.stdout)
    assert found, done.stdout
    return {key: int(value) for key, value in found.groupdict().items()}


def test_pull_with_z_sends_compressed_ranges(tmp_path, server, unique):
    data = text(8 * MiB)
    (server.root / unique).write_bytes(data)
    got = wire(run_cli("--no-progress", "--stats", "-z", server.url(unique), tmp_path / "b"))
    assert (tmp_path / "b").read_bytes() == data
    assert got["received"] < 0.4 * len(data)
    assert got["moved"] == len(data)  # the file's bytes, not the wire's
    # An existing target that differs: the changed blocks come compressed too.
    changed = bytearray(data)
    changed[3 * MiB:5 * MiB] = text(2 * MiB, seed=3)
    (server.root / unique).write_bytes(bytes(changed))
    got = wire(run_cli("--no-progress", "--stats", "-z", server.url(unique), tmp_path / "b"))
    assert (tmp_path / "b").read_bytes() == bytes(changed)
    assert got["received"] < 0.4 * 2 * MiB


def test_push_with_z_sends_compressed_bodies(tmp_path, server, unique):
    data = text(8 * MiB, seed=1)
    (tmp_path / "a").write_bytes(data)
    got = wire(run_cli("--no-progress", "--stats", "-z", tmp_path / "a", server.url(unique)))
    assert (server.root / unique).read_bytes() == data
    assert got["sent"] < 0.4 * len(data)
    assert got["moved"] == len(data)
    changed = text(8 * MiB, seed=2)
    (tmp_path / "a").write_bytes(changed)
    got = wire(run_cli("--no-progress", "--stats", "-z", "--atomic", tmp_path / "a", server.url(unique)))
    assert (server.root / unique).read_bytes() == changed
    assert got["sent"] < 0.4 * len(data)


def test_random_data_with_z_stays_exact(tmp_path, server, unique):
    data = random_bytes(3 * MiB + 12345, seed=9)
    (tmp_path / "a").write_bytes(data)
    assert run_cli("--no-progress", "-z", tmp_path / "a", server.url(unique)).returncode == 0
    assert (server.root / unique).read_bytes() == data
    assert run_cli("--no-progress", "-z", server.url(unique), tmp_path / "b").returncode == 0
    assert (tmp_path / "b").read_bytes() == data


def test_tree_pull_and_push_with_z(tmp_path, server, unique):
    big = text(10 * MiB, seed=4)
    source = tmp_path / "src"
    source.mkdir()
    (source / "big.log").write_bytes(big)
    (source / "small.txt").write_bytes(b"small\n")
    remote = server.root / unique
    remote.mkdir()
    # An older, different copy on the other side: the big file goes through the block engine.
    (remote / "big.log").write_bytes(text(10 * MiB, seed=5))
    got = wire(run_cli("--no-progress", "--stats", "-z", f"{source}/", server.url(unique)))
    assert (remote / "big.log").read_bytes() == big
    assert (remote / "small.txt").read_bytes() == b"small\n"
    assert got["sent"] < 0.4 * len(big)
    target = tmp_path / "dst"
    target.mkdir()
    (target / "big.log").write_bytes(text(10 * MiB, seed=6))
    got = wire(run_cli("--no-progress", "--stats", "-z", server.url(unique) + "/", str(target)))
    assert (target / "big.log").read_bytes() == big
    assert got["received"] < 0.4 * len(big)


def test_the_default_on_loopback_stays_plain(tmp_path, server, unique):
    data = text(4 * MiB, seed=7)
    (server.root / unique).write_bytes(data)
    got = wire(run_cli("--no-progress", "--stats", server.url(unique), tmp_path / "b"))
    assert (tmp_path / "b").read_bytes() == data
    assert got["received"] >= len(data)  # no compression: loopback has no link to spare


def test_no_compress_stays_plain(tmp_path, server, unique):
    data = text(2 * MiB, seed=8)
    (tmp_path / "a").write_bytes(data)
    got = wire(run_cli("--no-progress", "--stats", "--no-compress", tmp_path / "a", server.url(unique)))
    assert got["sent"] >= len(data)


def _measuring(url: str):
    """The adaptive policy told to measure a loopback link, as it would the near end of a tunnel."""
    from pdiffcopy.transport.compressionpolicy import Compression
    from pdiffcopy.transport.urls import split_server_url

    return Compression("auto", split_server_url(url)[0], measure_loopback=True)


def _traffic(run) -> dict:
    """What ``run()`` (an in-process sync) moved: its result's bytes and this process's bytes on the wire."""
    from pdiffcopy.transport import counters

    before = counters.totals()
    result = run()
    sent, received = (now - then for now, then in zip(counters.totals(), before))
    return {"result": result, "sent": sent, "received": received}


def _pull_on_a_slow_link(url: str, target) -> dict:
    """Pull ``url`` into ``target`` through the library over a real slow link (the transport's --bwlimit)."""
    from pdiffcopy.api import bwlimit_bucket
    from pdiffcopy.engine.filejob import run_sync
    from pdiffcopy.engine.options import file_options
    from pdiffcopy.local.localfile import LocalFile
    from pdiffcopy.transport.remote import RemoteFile

    source = RemoteFile(url, concurrency=1, compress=_measuring(url), rate_limit=bwlimit_bucket(SLOW_LINK))
    return _traffic(lambda: run_sync(source, LocalFile(str(target)), file_options(concurrency=1)))


def test_the_default_switches_on_a_slow_link(tmp_path, server, unique):
    # A genuinely slow link: the first transfer goes plain, then the sample and the link rate say
    # compressing pays, and the rest goes compressed.
    data = text(48 * MiB, seed=10)
    (server.root / unique).write_bytes(data)
    got = _pull_on_a_slow_link(server.url(unique), tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == data
    assert got["received"] < 0.6 * len(data)


def test_the_client_ignores_the_old_link_rate_variable(tmp_path, server, unique):
    # It was a test hook that made loopback look like a 1 MB/s link; loopback stays plain.
    data = text(24 * MiB, seed=14)
    (server.root / unique).write_bytes(data)
    got = wire(run_cli("--no-progress", "--stats", "-c", "1", server.url(unique), tmp_path / "b",
                       env_extra={"PDIFFCOPY_TEST_LINK_RATE": "1000000"}))
    assert (tmp_path / "b").read_bytes() == data
    assert got["received"] >= len(data)


def test_z_and_no_compress_together_are_a_usage_error(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    done = run_cli("-z", "--no-compress", tmp_path / "a", tmp_path / "b")
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "b").exists()


def test_a_bad_mode_is_a_usage_error(tmp_path):
    from pdiffcopy.api import sync
    from pdiffcopy.errors import UsageError

    (tmp_path / "a").write_bytes(b"x")
    with pytest.raises(UsageError):
        sync(str(tmp_path / "a"), str(tmp_path / "b"), compress="sometimes")


def _patch(server, name: str, body: bytes):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("PATCH", "/" + urllib.parse.quote(name), body=body,
                           headers={"Content-Type": compression.FRAMES_TYPE})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _damage(framed: bytes, how: str) -> bytes:
    header = compression.FRAME_HEADER
    offset, length, frame_length = header.unpack_from(framed)
    if how == "truncate":
        return framed[: header.size + frame_length // 2]
    if how == "length":
        return header.pack(offset, length + 1, frame_length) + framed[header.size:]
    body = bytearray(framed)
    body[header.size + frame_length // 2] ^= 0xFF
    return bytes(body)


@pytest.mark.parametrize("how", ["corrupt", "truncate", "length"])
def test_the_server_refuses_a_damaged_patch_and_writes_nothing(server, unique, how):
    before = b"\0" * (2 * MiB)
    (server.root / unique).write_bytes(before)
    new = text(MiB, seed=11)
    status, body = _patch(server, unique, _damage(compression.frame(MiB, new), how))
    assert status == 400, body
    assert b'"error"' in body
    assert (server.root / unique).read_bytes() == before
    # The same frame undamaged is written.
    status, body = _patch(server, unique, compression.frame(MiB, new))
    assert status == 200, body
    assert (server.root / unique).read_bytes() == before[:MiB] + new


class DamagingProxy:
    """An HTTP proxy on 127.0.0.1 in front of a real server that damages every compressed frame it passes on.

    Everything else (requests, headers, other answers) goes through unchanged, so the client talks
    to the real server and only its checks of the frames stand between the damage and the target.
    """

    def __init__(self, upstream_port: int, how: str) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client expects

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {key: value for key, value in self.headers.items()
                           if key.lower() not in ("connection", "keep-alive")}
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                if (answer.headers.get("Content-Type") or "").startswith(compression.FRAMES_TYPE):
                    data = _damage_every_frame(data, proxy.how)
                    proxy.damaged += 1
                self.send_response_only(answer.status, answer.reason)
                for key, value in answer.headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "keep-alive"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = forward

            def log_message(self, *args) -> None:
                pass

        self.how = how
        #: Answers damaged so far: the test checks that the damage was really done.
        self.damaged = 0
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}/{name}"

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _damage_every_frame(body: bytes, how: str) -> bytes:
    """``body`` (headers and zstd frames) with each frame damaged as :func:`_damage` does."""
    header = compression.FRAME_HEADER
    out, position = [], 0
    while position < len(body):
        _, _, frame_length = header.unpack_from(body, position)
        end = position + header.size + frame_length
        out.append(_damage(body[position:end], how))
        position = end
    return b"".join(out)


@pytest.mark.parametrize("how", ["corrupt", "truncate", "length"])
def test_the_client_catches_damaged_frames(tmp_path, server, unique, how):
    data = text(3 * MiB, seed=12)
    (server.root / unique).write_bytes(data)
    proxy = DamagingProxy(server.port, how)
    try:
        done = run_cli("--no-progress", "-z", proxy.url(unique), tmp_path / "b")
        assert proxy.damaged, "no compressed answer went through the proxy"
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "damaged" in lines[0].lower() or "not asked" in lines[0] or "left out" in lines[0], lines[0]
        assert not (tmp_path / "b").exists() or (tmp_path / "b").read_bytes() != data
        assert "synced" not in done.stdout.lower()
    finally:
        proxy.stop()


def test_the_server_ignores_the_old_damage_variable(tmp_path):
    # It was a test hook that made a server damage its own frames; a server sends them whole.
    root = tmp_path / "root"
    root.mkdir()
    data = text(3 * MiB, seed=12)
    (root / "f").write_bytes(data)
    running = start_server(root, tmp_path / "server.log", env_extra={"PDIFFCOPY_TEST_DAMAGE_FRAMES": "corrupt"})
    try:
        done = run_cli("--no-progress", "-z", running.url("f"), tmp_path / "b")
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "b").read_bytes() == data
    finally:
        running.stop()


def _get(server, name: str, headers: dict):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("GET", "/" + urllib.parse.quote(name), headers=headers)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def test_a_plain_client_asking_for_zstd_gets_a_zstd_stream(server, unique):
    data = text(3 * MiB, seed=13)
    (server.root / unique).write_bytes(data)
    status, headers, body = _get(server, unique, {"Accept-Encoding": "gzip, zstd"})
    assert status == 200
    assert headers["Content-Encoding"] == "zstd"
    assert "Accept-Encoding" in headers["Vary"]
    assert len(body) < len(data) / 3
    assert zstandard.ZstdDecompressor().decompressobj().decompress(body) == data
    # Without it, or refusing it with q=0, plain bytes as before.
    for asked in ({}, {"Accept-Encoding": "zstd;q=0"}):
        status, headers, body = _get(server, unique, asked)
        assert status == 200 and body == data and "Content-Encoding" not in headers
    # A range is never coded: plain clients would take compressed bytes for file bytes.
    status, headers, body = _get(server, unique, {"Accept-Encoding": "zstd", "Range": "bytes=10-99"})
    assert status == 206 and body == data[10:100] and "Content-Encoding" not in headers


def test_tree_batches_of_small_files_with_z(tmp_path, server, unique):
    source = tmp_path / "src"
    source.mkdir()
    files = {f"f{i:03d}.log": text(64 * 1024, seed=i) for i in range(100)}  # 6.4 MB in batches
    for name, data in files.items():
        (source / name).write_bytes(data)
    total = sum(len(data) for data in files.values())
    got = wire(run_cli("--no-progress", "--stats", "-z", f"{source}/", server.url(unique)))
    for name, data in files.items():
        assert (server.root / unique / name).read_bytes() == data
    assert got["sent"] < 0.4 * total
    target = tmp_path / "dst"
    got = wire(run_cli("--no-progress", "--stats", "-z", server.url(unique) + "/", str(target)))
    for name, data in files.items():
        assert (target / name).read_bytes() == data
    assert got["received"] < 0.4 * total


def _tree_write(server, name: str, body: bytes):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("POST", f"/.pdiffcopy/tree-write/{name}?times=0&owner=0&fsync=0&fresh=0", body=body,
                           headers={"Content-Type": "application/octet-stream", "Content-Encoding": "zstd"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
def test_a_damaged_compressed_tree_write_writes_nothing(server, unique, how):
    from pdiffcopy.core.treeplan import FILE, Entry
    from pdiffcopy.core.treewire import encode_files

    (server.root / unique).mkdir()
    data = text(300 * 1024, seed=20)
    entry = Entry(path="a.log", kind=FILE, size=len(data), mtime_ns=0, mode=0o644, uid=0, gid=0)
    stream = b"".join(compression.compressed_stream(bytes(part) for part in encode_files([(entry, data, "")])))
    if how == "truncate":
        damaged = stream[: len(stream) // 2]
    else:
        damaged = bytearray(stream)
        damaged[len(stream) // 2] ^= 0xFF
    status, body = _tree_write(server, unique, bytes(damaged))
    assert status == 400, body
    assert not (server.root / unique / "a.log").exists()
    status, body = _tree_write(server, unique, stream)
    assert status == 200, body
    assert (server.root / unique / "a.log").read_bytes() == data


def _compressed_sent(server) -> float:
    from conftest import http_get

    status, _, body = http_get(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert status == 200, body
    found = re.search(r'^pdiffcopy_compressed_bytes_total\{direction="sent",export=""\} (\S+)$', body.decode(),
                      re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_the_metrics_count_compressed_bytes_only_when_compressing(tmp_path):
    pytest.importorskip("prometheus_client")
    from conftest import free_port

    root = tmp_path / "root"
    root.mkdir()
    data = text(3 * MiB, seed=21)
    (root / "f").write_bytes(data)
    metrics_port = free_port()
    running = start_server(root, tmp_path / "server.log", extra=("--metrics-listen", f"127.0.0.1:{metrics_port}"))
    running.metrics_port = metrics_port
    try:
        # The adaptive default on loopback: plain, nothing counted as compressed.
        assert run_cli("--no-progress", running.url("f"), tmp_path / "plain").returncode == 0
        assert _compressed_sent(running) == 0
        assert run_cli("--no-progress", "-z", running.url("f"), tmp_path / "z").returncode == 0
        assert _compressed_sent(running) == len(data)
    finally:
        running.stop()


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_tree_batches_switch_on_a_slow_link(tmp_path, server, unique, direction):
    # The first batch goes plain and teaches the policy (a genuinely slow link); the batches after
    # it go compressed.
    from pdiffcopy.api import bwlimit_bucket
    from pdiffcopy.engine.treesync import TreeOptions, run_tree_sync
    from pdiffcopy.local.localtree import LocalTree
    from pdiffcopy.transport.remotetree import RemoteTree

    source = tmp_path / "src"
    source.mkdir()
    files = {f"f{i:02d}.log": text(MiB, seed=100 + i) for i in range(48)}
    for name, data in files.items():
        (source / name).write_bytes(data)
    total = sum(len(data) for data in files.values())
    remote = RemoteTree(server.url(unique), concurrency=1, compress=_measuring(server.url(unique)),
                        rate_limit=bwlimit_bucket(SLOW_LINK, shared=True))
    if direction == "pull":
        source.rename(server.root / unique)
        trees, written = (remote, LocalTree(str(tmp_path / "dst"))), tmp_path / "dst"
    else:
        trees, written = (LocalTree(str(source)), remote), server.root / unique
    try:
        got = _traffic(lambda: run_tree_sync(*trees, TreeOptions(concurrency=1)))
    finally:
        for tree in trees:
            tree.close()
    assert not got["result"].failures
    for name, data in files.items():
        assert (written / name).read_bytes() == data
    assert got["sent" if direction == "push" else "received"] < 0.6 * total


def test_the_default_switches_for_scattered_changes_too(tmp_path, server, unique):
    # Changed blocks apart from each other come as multipart answers: those teach the policy too.
    data = text(64 * MiB, seed=30)
    changed = bytearray(data)
    for start in range(0, len(data), 2 * MiB):  # every other 1 MiB block differs
        changed[start:start + MiB] = text(MiB, seed=start)
    (server.root / unique).write_bytes(bytes(changed))
    (tmp_path / "b").write_bytes(data)
    got = _pull_on_a_slow_link(server.url(unique), tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == bytes(changed)
    # The first request (16 MiB of ranges) goes plain; the other 16 MiB compressed.
    assert got["received"] < 0.75 * 32 * MiB


# -- the level chosen from the link ---------------------------------------------


def words(size: int, seed: int = 0) -> bytes:
    """Zipf-distributed words, as the shaped-link benchmark's text: level 6 shrinks it about 12 %
    more than level 1 (4.3:1 against 3.85:1)."""
    import itertools
    import random

    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 10))) for _ in range(2000)]
    weights = list(itertools.accumulate(1 / rank ** 1.2 for rank in range(1, 2001)))
    return " ".join(rng.choices(vocabulary, cum_weights=weights, k=size // 5)).encode()[:size]


class Clock:
    """Every timing takes 1 ms: the same speed at every level, whatever this machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def _slow_link_policy(data: "bytes | None"):
    """A policy that saw a 1 MB/s link (and a sample of ``data``, if given): it picks level 6
    of levels 1 and 6, the denser one."""
    from pdiffcopy.transport.compressionpolicy import AdaptivePolicy

    policy = AdaptivePolicy(cores=2, clock=Clock(), levels=(1, 6))
    policy.link_observed(1_000_000, 1.0)
    if data is not None:
        policy.sample(data)
        assert policy.level() == 6
    return policy


def _level_one_size(data: bytes) -> int:
    return sum(len(compression.frame(offset, data[offset:offset + length], 1))
               for offset, length in compression.pieces([(0, len(data))]))


def _sync_with(policy, source, target):
    from pdiffcopy.engine.filejob import run_sync
    from pdiffcopy.engine.options import file_options
    from pdiffcopy.local.localfile import LocalFile
    from pdiffcopy.transport import counters
    from pdiffcopy.transport.compressionpolicy import Compression
    from pdiffcopy.transport.remote import RemoteFile

    def endpoint(location):
        if str(location).startswith("http"):
            return RemoteFile(str(location), concurrency=2, compress=Compression(
                "auto", str(location), measure_loopback=True, cores=2, policy=policy))
        return LocalFile(str(location))

    before = counters.totals()
    run_sync(endpoint(source), endpoint(target), file_options(concurrency=2))
    after = counters.totals()
    return after[0] - before[0], after[1] - before[1]


def test_a_pull_at_the_chosen_level_decodes_right(tmp_path, server, unique):
    data = words(4 * MiB, seed=1)
    (server.root / unique).write_bytes(data)
    _, received = _sync_with(_slow_link_policy(data), server.url(unique), tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == data
    # The server compressed at level 6, which the client asked for: fewer bytes than level 1's.
    assert received < _level_one_size(data)


def test_a_push_at_the_chosen_level_decodes_right(tmp_path, server, unique):
    data = words(4 * MiB, seed=2)
    (tmp_path / "a").write_bytes(data)
    sent, _ = _sync_with(_slow_link_policy(data), tmp_path / "a", server.url(unique))
    assert (server.root / unique).read_bytes() == data
    assert sent < _level_one_size(data)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_an_undecided_transfer_probes_with_one_frame_plain(tmp_path, server, unique, direction):
    # The policy knows the link but has no sample: the first request carries 1 MiB plain, and
    # the rest goes compressed. A whole first request (here the whole file) went plain before.
    data = words(8 * MiB, seed=3)
    if direction == "pull":
        (server.root / unique).write_bytes(data)
        _, moved = _sync_with(_slow_link_policy(None), server.url(unique), tmp_path / "b")
        assert (tmp_path / "b").read_bytes() == data
    else:
        (tmp_path / "a").write_bytes(data)
        moved, _ = _sync_with(_slow_link_policy(None), tmp_path / "a", server.url(unique))
        assert (server.root / unique).read_bytes() == data
    assert MiB < moved < MiB + _level_one_size(data)


def test_the_server_compresses_ranges_at_the_level_asked(server, unique):
    data = words(3 * MiB, seed=4)
    (server.root / unique).write_bytes(data)
    sizes = {}
    for accept in (compression.FRAMES_TYPE, compression.frames_accept(6), f"{compression.FRAMES_TYPE}; level=x",
                   f"{compression.FRAMES_TYPE}; level=99"):
        status, headers, body = _get(server, unique, {"Accept": accept, "Range": f"bytes=0-{len(data) - 1}"})
        assert status == 206 and headers["Content-Type"] == compression.FRAMES_TYPE
        import io

        assert b"".join(piece for _, piece, _ in compression.read_frames(io.BytesIO(body).read)) == data
        sizes[accept] = len(body)
    assert sizes[compression.frames_accept(6)] < sizes[compression.FRAMES_TYPE]  # no level: level 1
    assert sizes[f"{compression.FRAMES_TYPE}; level=x"] == sizes[compression.FRAMES_TYPE]


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_tree_batches_at_the_chosen_level_decode_right(tmp_path, server, unique, direction):
    from pdiffcopy.engine.treeendpoints import MetadataOptions
    from pdiffcopy.local.localtree import LocalTree
    from pdiffcopy.transport import counters
    from pdiffcopy.transport.compressionpolicy import Compression
    from pdiffcopy.transport.remotetree import RemoteTree

    files = {f"f{i:02d}.txt": words(128 * 1024, seed=i) for i in range(24)}  # 3 MiB in one batch
    level_one = len(b"".join(compression.compressed_stream([b"".join(files.values())], 1)))
    remote = RemoteTree(server.url(unique) + "/", concurrency=2)
    remote.compression = Compression("auto", remote.base, measure_loopback=True, cores=2,
                                     policy=_slow_link_policy(b"".join(files.values())))
    try:
        if direction == "pull":
            for name, data in files.items():
                (server.root / unique / name).parent.mkdir(exist_ok=True)
                (server.root / unique / name).write_bytes(data)
            entries = [entry for entry in remote.list().entries if entry.path in files]
            before = counters.totals()[1]
            got = {entry.path: data for entry, data, error in remote.read_files(entries)}
            moved = counters.totals()[1] - before
            assert got == files
        else:
            source = tmp_path / "src"
            source.mkdir()
            for name, data in files.items():
                (source / name).write_bytes(data)
            local = LocalTree(str(source))
            entries = [entry for entry in local.list().entries if entry.path in files]
            (server.root / unique).mkdir()
            remote.list()  # as a sync does first: its answer says the server takes compressed bodies
            before = counters.totals()[0]
            failures = remote.write_files([(entry, data) for entry, data, _ in local.read_files(entries)],
                                          MetadataOptions())
            moved = counters.totals()[0] - before
            assert failures == []
            for name, data in files.items():
                assert (server.root / unique / name).read_bytes() == data
        assert moved < level_one  # compressed at level 6, which shrinks it more than level 1
    finally:
        remote.close()


# -- --compress-level (rsync's --compress-level / --zl) ---------------------------------


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_compress_level_compresses_harder_than_z(tmp_path, server, unique, direction):
    data = text(4 * MiB, seed=5)
    source = tmp_path / "source"
    source.write_bytes(data)
    (server.root / unique).write_bytes(data)

    def moved(*options: str) -> int:
        target = tmp_path / "target"
        target.unlink(missing_ok=True)
        (server.root / (unique + ".out")).unlink(missing_ok=True)
        if direction == "pull":
            got = wire(run_cli("--no-progress", "--stats", *options, server.url(unique), target))
            assert target.read_bytes() == data
            return got["received"]
        got = wire(run_cli("--no-progress", "--stats", *options, source, server.url(unique + ".out")))
        assert (server.root / (unique + ".out")).read_bytes() == data
        return got["sent"]

    fastest = moved("-z")
    densest = moved("--compress-level", "19")
    assert densest < 0.9 * fastest, (densest, fastest)
    assert moved("--zl=0") >= len(data)  # level 0: not compressed, as rsync's


def test_a_bad_compress_level_is_a_usage_error(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    for options in (["--compress-level", "20"], ["--zl", "fast"], ["--no-compress", "--zl", "3"]):
        done = run_cli(*options, tmp_path / "a", tmp_path / "b")
        assert done.returncode == 1, (options, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
        assert not (tmp_path / "b").exists()


def test_the_library_takes_a_level(tmp_path, server, unique):
    from pdiffcopy.api import sync
    from pdiffcopy.errors import UsageError

    data = text(4 * MiB, seed=6)
    (server.root / unique).write_bytes(data)
    sync(server.url(unique), str(tmp_path / "b"), compress=12)
    assert (tmp_path / "b").read_bytes() == data
    for bad in (0, 20, True, "3"):
        with pytest.raises(UsageError):
            sync(server.url(unique), str(tmp_path / "c"), compress=bad)


def test_a_tree_pull_and_push_at_a_compress_level(tmp_path, server, unique):
    source = tmp_path / "src"
    source.mkdir()
    for index in range(3):  # a big file (ranges) and small ones (batches)
        (source / f"small-{index}.log").write_bytes(text(256 * 1024, seed=index))
    (source / "big.log").write_bytes(text(4 * MiB, seed=9))
    remote = server.root / unique

    def push(*options: str) -> int:
        shutil.rmtree(remote, ignore_errors=True)
        got = wire(run_cli("--no-progress", "--stats", *options, f"{source}/", server.url(unique)))
        assert sorted(p.name for p in remote.iterdir()) == sorted(p.name for p in source.iterdir())
        assert all((remote / p.name).read_bytes() == p.read_bytes() for p in source.iterdir())
        return got["sent"]

    assert push("--compress-level", "19") < 0.9 * push("-z")
    target = tmp_path / "dst"
    got = wire(run_cli("--no-progress", "--stats", "--zl", "19", server.url(unique) + "/", str(target)))
    assert all((target / p.name).read_bytes() == p.read_bytes() for p in source.iterdir())
    assert got["received"] < 0.3 * sum(p.stat().st_size for p in source.iterdir())

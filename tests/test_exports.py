"""A server with ``--config``: exports, each with its tokens, networks and rules (docs/exports.rst).

One real server with three exports: ``golden`` (read-only, the token ``reader``),
``vms`` (writable, the tokens ``ops`` and ``backup``) and ``far`` (a network allow-list
that excludes 127.0.0.1). Every endpoint is tried with each token and with none.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

from conftest import one_line_error, random_bytes, run_cli, start_server

TOKENS = {"reader": "golden-reader-token", "ops": "vms-ops-token", "backup": "vms-backup-token",
          "faraway": "far-token"}


def token_line(name: str) -> str:
    return f'"{name}:sha256:{hashlib.sha256(TOKENS[name].encode()).hexdigest()}"'


def snapshot(directory: Path) -> Dict[str, Tuple[int, int, int, bytes]]:
    """Every entry below ``directory``: mode, size, ctime and a regular file's digest."""
    found = {}
    for top, dirs, names in os.walk(directory):
        for name in dirs + names:
            path = os.path.join(top, name)
            info = os.lstat(path)
            digest = b""
            if os.path.isfile(path) and not os.path.islink(path):
                digest = hashlib.sha256(Path(path).read_bytes()).digest()
            found[os.path.relpath(path, directory)] = (info.st_mode, info.st_size, info.st_ctime_ns, digest)
    return found


class ExportServer:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.golden, self.vms, self.far = base / "golden", base / "vms", base / "far"
        for directory in (self.golden, self.vms, self.far):
            directory.mkdir()
            (directory / "disk.img").write_bytes(random_bytes(256 * 1024, seed=len(directory.name)))
            (directory / "tree").mkdir()
            (directory / "tree" / "a.txt").write_text(f"a of {directory.name}\n")
        self.config = base / "exports.toml"
        self.config.write_text(f"""
[export.golden]
path = "{self.golden}"
tokens = [{token_line("reader")}]

[export.vms]
path = "{self.vms}"
read_only = false
tokens = [{token_line("ops")}, {token_line("backup")}]
max_connections = 50

[export.far]
path = "{self.far}"
read_only = false
tokens = [{token_line("faraway")}]
allow = ["10.0.0.0/8", "192.168.0.0/16"]
""")
        self.server = start_server(None, base / "server.log", extra=("--config", str(self.config)))
        self.port = self.server.port

    def request(self, method: str, path: str, token: Optional[str] = None, body: bytes = b"",
                headers: Optional[dict] = None) -> Tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            sent = dict(headers or {})
            if token is not None:
                sent["Authorization"] = f"Bearer {TOKENS[token]}"
            connection.request(method, path, body=body or None, headers=sent)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    running = ExportServer(tmp_path_factory.mktemp("exports"))
    yield running
    running.server.stop()


#: Every endpoint, as (method, path with {e} for the export, query, body); writes marked.
ENDPOINTS = [
    ("GET", "/{e}/disk.img", "", b"", False),
    ("HEAD", "/{e}/disk.img", "", b"", False),
    ("GET", "/.pdiffcopy/stat/{e}/disk.img", "", b"", False),
    ("GET", "/.pdiffcopy/hashes/{e}/disk.img", "?method=xxh64&block_size=65536&offset=0&length=65536", b"", False),
    ("GET", "/.pdiffcopy/datamap/{e}/disk.img", "?offset=0&length=65536", b"", False),
    ("POST", "/.pdiffcopy/chunks/{e}/disk.img", "?average=8192", b"", False),
    ("GET", "/.pdiffcopy/tree/{e}/tree", "", b"", False),
    ("POST", "/.pdiffcopy/tree-read/{e}/tree", "", b'{"entries": []}', False),
    ("PATCH", "/{e}/disk.img", "", b"x", True),
    ("POST", "/.pdiffcopy/punch/{e}/disk.img", "?offset=0&length=4096", b"", True),
    ("POST", "/.pdiffcopy/resize/{e}/disk.img", "?size=1", b"", True),
    ("POST", "/.pdiffcopy/fsync/{e}/disk.img", "", b"", True),
    ("POST", "/.pdiffcopy/lease/{e}/disk.img", "", b"", True),
    ("DELETE", "/.pdiffcopy/lease/{e}/disk.img", "?lease=x", b"", True),
    ("POST", "/.pdiffcopy/sweep/{e}/disk.img", "", b"", True),
    ("POST", "/.pdiffcopy/clone/{e}/.disk.img.pdiffcopy-0123456789ab", "?from={e}/disk.img", b"", True),
    ("POST", "/.pdiffcopy/rename/{e}/.disk.img.pdiffcopy-0123456789ab", "?to={e}/disk.img", b"", True),
    ("DELETE", "/.pdiffcopy/temporary/{e}/.disk.img.pdiffcopy-0123456789ab", "", b"", True),
    ("POST", "/.pdiffcopy/copy-ranges/{e}/.disk.img.pdiffcopy-0123456789ab", "?from={e}/disk.img", b"", True),
    ("POST", "/.pdiffcopy/tree-apply/{e}/tree", "",
     b'{"operations": [["delete", ["a.txt", "file", 0, 0, 33188, 0, 0, "", 1, 0]]]}', True),
    ("POST", "/.pdiffcopy/tree-write/{e}/tree", "", b"", True),
    ("GET", "/.pdiffcopy/tree/{e}/tree", "?sweep=1", b"", True),
]


def test_every_endpoint_with_each_token_and_none(exports):
    """No token: 401; another export's token: 403; outside the allow-list: 403; the read-only
    export refuses every write with 403 and nothing on disk changes."""
    before = {name: snapshot(getattr(exports, name)) for name in ("golden", "vms", "far")}
    owners = {"golden": ("reader",), "vms": ("ops", "backup"), "far": ("faraway",)}
    for method, path, query, body, writes in ENDPOINTS:
        for export in ("golden", "far", "vms"):  # vms last: its writes may change it
            url = path.format(e=export) + query.format(e=export)
            if export == "far":  # the networks first, as rsync's hosts allow: any token, or none
                for token in (None, *TOKENS):
                    status, answer = exports.request(method, url, token, body=body)
                    assert status == 403 and (method == "HEAD" or b"Clients at 127.0.0.1 may not use" in answer), \
                            (method, url, answer)
                continue
            status, answer = exports.request(method, url, body=body)
            assert status == 401, (method, url, status, answer)
            for token in TOKENS:
                if token not in owners[export]:
                    status, answer = exports.request(method, url, token, body=body)
                    assert status == 403 and (method == "HEAD" or b"does not open the export" in answer), \
                            (method, url, token, answer)
            for token in owners[export]:
                status, answer = exports.request(method, url, token, body=body)
                if export == "golden" and writes:
                    assert status == 403 and b"golden is exported read-only" in answer, (method, url, status, answer)
                else:
                    assert status not in (401, 403), (method, url, status, answer)
    assert snapshot(exports.golden) == before["golden"]
    assert snapshot(exports.far) == before["far"]


def test_a_token_opens_only_its_exports_and_the_index_lists_them(exports):
    status, answer = exports.request("GET", "/", "backup")
    assert status == 200 and json.loads(answer)["exports"] == ["vms"]
    status, answer = exports.request("GET", "/", "reader")
    assert json.loads(answer)["exports"] == ["golden"]
    status, answer = exports.request("GET", "/", "faraway")  # from 127.0.0.1: outside its networks
    assert json.loads(answer)["exports"] == []
    assert exports.request("GET", "/.pdiffcopy/version")[0] == 401
    assert exports.request("GET", "/.pdiffcopy/version", "ops")[0] == 200
    status, answer = exports.request("GET", "/nowhere/disk.img", "ops")
    assert status == 404 and b"No export named 'nowhere'" in answer
    assert exports.request("GET", "/nowhere/disk.img")[0] == 401  # nothing said without a token
    assert exports.request("GET", "/.pdiffcopy/tree/", "ops")[0] == 404  # no export named


@pytest.mark.parametrize("path", [
    "/vms/../golden/disk.img",
    "/vms/%2E%2E/golden/disk.img",
    "/vms%2F..%2Fgolden%2Fdisk.img",
    "/vms/tree/../../golden/disk.img",
    "/vms//..//golden/disk.img",
    "/./golden/disk.img",
    "/vms/to-golden",
    "/vms/to-golden-dir/disk.img",
    "/.pdiffcopy/stat/vms/../golden/disk.img",
    "/.pdiffcopy/tree/vms/to-golden-dir",
])
def test_nothing_crosses_from_one_export_into_another(exports, path):
    """With the vms token: never golden's bytes, whatever the path says."""
    for name, target in (("to-golden", exports.golden / "disk.img"), ("to-golden-dir", exports.golden)):
        if not os.path.lexists(exports.vms / name):
            os.symlink(target, exports.vms / name)
    secret = (exports.golden / "disk.img").read_bytes()
    status, answer = exports.request("GET", path, "ops")
    assert status in (400, 403, 404), (path, status, answer[:200])
    assert secret[:64] not in answer


def test_an_argument_cannot_name_another_export(exports):
    """A clone's ``from`` and a rename's ``to`` stay in the export the request was admitted to."""
    before = snapshot(exports.golden)
    temporary = "vms/.disk.img.pdiffcopy-ba9876543210"
    status, answer = exports.request("POST", f"/.pdiffcopy/clone/{temporary}?from=golden/disk.img", "ops")
    assert status == 403 and b"stays in one export" in answer, answer
    assert not (exports.vms / ".disk.img.pdiffcopy-ba9876543210").exists()
    status, answer = exports.request("POST", f"/.pdiffcopy/clone/{temporary}?from=vms/disk.img", "ops")
    assert status == 200, answer
    status, answer = exports.request("POST", f"/.pdiffcopy/rename/{temporary}?to=golden/disk.img", "ops")
    assert status == 403, answer
    assert snapshot(exports.golden) == before
    assert exports.request("DELETE", f"/.pdiffcopy/temporary/{temporary}", "ops")[0] == 200


def test_syncs_through_exports(exports, tmp_path):
    """Pulls and pushes of files and trees at /EXPORT/PATH, with each token's rights."""
    ops = {"PDIFFCOPY_TOKEN": TOKENS["ops"]}
    reader = {"PDIFFCOPY_TOKEN": TOKENS["reader"]}
    base = f"http://127.0.0.1:{exports.port}"
    # A file pulled from the read-only export, then pushed to the writable one.
    done = run_cli(f"{base}/golden/disk.img", str(tmp_path / "pulled.img"), env_extra=reader)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pulled.img").read_bytes() == (exports.golden / "disk.img").read_bytes()
    done = run_cli(str(tmp_path / "pulled.img"), f"{base}/vms/copy.img", env_extra=ops)
    assert done.returncode == 0, done.stderr
    assert (exports.vms / "copy.img").read_bytes() == (exports.golden / "disk.img").read_bytes()
    # A tree pushed with --delete, and pulled back.
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "b.bin").write_bytes(random_bytes(100_000, seed=5))
    (exports.vms / "pushed").mkdir()
    (exports.vms / "pushed" / "extra.txt").write_text("not in the source\n")
    done = run_cli("--delete", f"{source}/", f"{base}/vms/pushed/", env_extra=ops)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(exports.vms / "pushed")) == ["sub"]
    assert (exports.vms / "pushed" / "sub" / "b.bin").read_bytes() == (source / "sub" / "b.bin").read_bytes()
    done = run_cli(f"{base}/vms/pushed/", f"{tmp_path / 'back'}/", env_extra=ops)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "back" / "sub" / "b.bin").read_bytes() == (source / "sub" / "b.bin").read_bytes()


def test_a_push_to_a_read_only_export_fails_in_one_line_and_changes_nothing(exports, tmp_path):
    reader = {"PDIFFCOPY_TOKEN": TOKENS["reader"]}
    base = f"http://127.0.0.1:{exports.port}"
    before = snapshot(exports.golden)
    (tmp_path / "new.img").write_bytes(random_bytes(300_000, seed=9))
    for args in ([str(tmp_path / "new.img"), f"{base}/golden/disk.img"],
                 [str(tmp_path / "new.img"), f"{base}/golden/fresh.img"],
                 [f"{tmp_path}/", f"{base}/golden/tree/"]):
        done = run_cli(*args, env_extra=reader)
        assert done.returncode != 0, args
        assert "read-only" in one_line_error(done), done.stderr
        assert "Traceback" not in done.stderr
    done = run_cli(str(tmp_path / "new.img"), f"{base}/golden/disk.img",
                   env_extra={"PDIFFCOPY_TOKEN": TOKENS["ops"]})
    assert done.returncode != 0 and "does not open the export golden" in one_line_error(done), done.stderr
    assert snapshot(exports.golden) == before


def test_max_connections_answers_busy_beyond_the_limit(tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    (root / "big.img").write_bytes(random_bytes(64 * 1024 * 1024, seed=3))
    config = tmp_path / "exports.toml"
    config.write_text(f'[export.small]\npath = "{root}"\nmax_connections = 1\n')
    server = start_server(None, tmp_path / "server.log", extra=("--config", str(config)))
    try:
        reader = socket.create_connection(("127.0.0.1", server.port))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.sendall(b"GET /small/big.img HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reader.recv(12).startswith(b"HTTP/1.1 200")  # answering, and held by a reader that stalls
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("GET", "/.pdiffcopy/stat/small/big.img")
        response = connection.getresponse()
        assert response.status == 503 and b"at most 1 requests at once" in response.read()
        assert response.getheader("Retry-After") == "1"
        connection.close()
        reader.close()  # the answer is abandoned: the export's count goes down again
        deadline = time.monotonic() + 10
        while True:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            connection.request("GET", "/.pdiffcopy/stat/small/big.img")
            response = connection.getresponse()
            response.read()
            connection.close()
            if response.status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert response.status == 200
    finally:
        server.stop()


@pytest.mark.parametrize("text, message", [
    ("[export.a]\n", "path must be an absolute path"),
    ('[export.a]\npath = "relative"\n', "path must be an absolute path"),
    ('[export.a]\npath = "/nonexistent-export-dir"\n', "path /nonexistent-export-dir does not exist"),
    ('[export.a]\npath = "/tmp"\ntokens = ["plain-secret"]\n', "a token must be NAME:sha256:HEX"),
    ('[export.a]\npath = "/tmp"\nallow = ["10.0.0.300/8"]\n', "is not a network"),
    ('[export.a]\npath = "/tmp"\nread_only = "no"\n', "read_only must be true or false"),
    ('[export.a]\npath = "/tmp"\nmax_connections = 0\n', "max_connections must be a whole number"),
    ('[export.a]\npath = "/tmp"\nrefuse = ["everything"]\n', "refuse: 'everything' is not one of"),
    ('[export.a]\npath = "/tmp"\nwritable = true\n', "unknown key 'writable'"),
    ('[export."../x"]\npath = "/tmp"\n', "the name must be one path component"),
    ("[server]\n", "unknown table or key 'server'"),
    ("", "no export"),
    ("[export.a\n", "not valid TOML"),
])
def test_a_bad_config_is_refused_in_one_line(tmp_path, text, message):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    done = run_cli("--config", str(config), "--listen", "127.0.0.1:1")
    assert done.returncode == 1, done.stderr
    assert message in one_line_error(done), done.stderr
    assert "plain-secret" not in done.stderr  # a token pasted by mistake is not echoed
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_config_refuses_the_shorthands_options(tmp_path):
    config = tmp_path / "ok.toml"
    config.write_text(f'[export.a]\npath = "{tmp_path}"\n')
    for extra, message in ((("--root", str(tmp_path)), "--root does not go with --config"),
                           (("--legacy-api",), "--legacy-api does not go with --config"),
                           (("--trust-clients",), "--trust-clients does not go with --config")):
        done = run_cli("--config", str(config), *extra)
        assert done.returncode == 1 and message in one_line_error(done), done.stderr
    done = run_cli("--config", str(config), env_extra={"PDIFFCOPY_TOKEN": "x"})
    assert done.returncode == 1 and "does not go with it" in one_line_error(done), done.stderr
    done = run_cli("--config", str(config), "--listen", "0.0.0.0:1")
    assert done.returncode == 1 and "the export a without tokens" in one_line_error(done), done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_an_export_without_tokens_serves_only_the_servers_user(tmp_path):
    """Tried as another local uid (nobody): a token-less export is as closed as a token-less --root."""
    from test_owner_only import NOBODY, as_user, plain_request

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "secret").write_bytes(b"the owner's secret\n")
    os.chmod(tmp_path, 0o755)
    config = tmp_path / "exports.toml"
    config.write_text(f'[export.home]\npath = "{shared}"\nread_only = false\n')
    server = start_server(None, tmp_path / "server.log", extra=("--config", str(config)))
    try:
        for method, path, body in (("GET", "/home/secret", None), ("GET", "/.pdiffcopy/tree/home", None),
                                   ("PATCH", "/home/secret", b"x"), ("GET", "/", None)):
            outcome, result = as_user(NOBODY, plain_request, "127.0.0.1", server.port, method, path, body)
            assert outcome == "ok", result
            status, answer = result
            assert status == 403 and b"serves only its own user" in answer, (method, path, status, answer)
            status, answer = plain_request("127.0.0.1", server.port, method, path, body)  # root: served
            assert status not in (401, 403), (method, path, status, answer)
        assert (shared / "secret").read_bytes() == b"the owner's secret\n"
    finally:
        server.stop()


def test_an_export_refuses_what_its_refuse_names(tmp_path):
    """refuse = ["delete", "hard-links"]: a push asking for them fails before it copies anything
    (one line, the target unchanged); one that does not is served; a raw delete is refused too."""
    keep = tmp_path / "keep"
    (keep / "tree").mkdir(parents=True)
    (keep / "tree" / "kept.txt").write_text("the target's own\n")
    config = tmp_path / "exports.toml"
    config.write_text(f'[export.keep]\npath = "{keep}"\nread_only = false\nrefuse = ["delete", "hard-links"]\n')
    server = start_server(None, tmp_path / "server.log", extra=("--config", str(config)))
    source = tmp_path / "source"
    source.mkdir()
    (source / "new.bin").write_bytes(random_bytes(50_000, seed=4))
    url = f"http://127.0.0.1:{server.port}/keep/tree/"
    try:
        before = snapshot(keep)
        for option, message in (("--delete", "keep refuses to delete what the source does not have"),
                                ("-H", "keep refuses to make hard links")):
            done = run_cli(option, f"{source}/", url)
            assert done.returncode != 0 and message in one_line_error(done), done.stderr
            assert snapshot(keep) == before  # refused before anything was copied
        done = run_cli(f"{source}/", url)
        assert done.returncode == 0, done.stderr
        assert sorted(os.listdir(keep / "tree")) == ["kept.txt", "new.bin"]
        body = json.dumps({"operations": [["delete", ["kept.txt", "file", 0, 0, 33188, 0, 0, "", 1, 0]]]}).encode()
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("POST", "/.pdiffcopy/tree-apply/keep/tree", body=body,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 403 and b"refuses to delete" in response.read()
        connection.close()
        assert (keep / "tree" / "kept.txt").exists()
    finally:
        server.stop()

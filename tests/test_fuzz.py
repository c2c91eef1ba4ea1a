"""Fuzzing: requests generated from the server's own OpenAPI document, valid and invalid.

The contract (h11's fuzz/afl-server.py states the same one): whatever a
client sends, the server answers with a documented status, never 500, every
error with a JSON ``{"error", "status"}`` body; no request hangs; and nothing
outside the root is created or changed.

schemathesis reads the document from the running server and generates cases
for every operation, both conforming to it and violating it. Paths and the
``from``/``to`` parameters are mixed with names that exist in the root, that
lead out of it (``..``, symlinks) or that are temporary names, so the
generated requests reach real files, not only 404s.

The normal run makes ``FUZZ_EXAMPLES`` examples per operation (about 180 in
all, well under a minute); ``tox -e fuzz`` sets ``PDIFFCOPY_FUZZ_EXAMPLES``
for a longer run.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit

import pytest
from conftest import http_get, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_errors import assert_json_error, raw_request, snapshot
from test_openapi import openapi_path
from werkzeug.exceptions import HTTPException

from pdiffcopy.server.openapi import DOCUMENT_PATH, build_document
from pdiffcopy.server.app import ServerConfig, create_app

schemathesis = pytest.importorskip("schemathesis", reason="fuzzing needs schemathesis (extra: test)")
checks = pytest.importorskip("schemathesis.specs.openapi.checks")

#: The schemathesis checks every answer must pass (besides this file's own).
CHECKS = [checks.status_code_conformance, checks.content_type_conformance,
          checks.response_headers_conformance, checks.response_schema_conformance]

TOKEN = "fuzz-token"

#: Examples per operation and mode (valid, invalid) in the normal run: 18
#: operations, about 180 requests in all.
FUZZ_EXAMPLES = int(os.environ.get("PDIFFCOPY_FUZZ_EXAMPLES", "5"))

#: Largest size a generated resize may ask for (see _adjust).
MAX_RESIZE = 16 * 1024 * 1024

#: Seconds any one request may take before the test calls it a hang.
REQUEST_TIMEOUT = 10

TEMPORARY = "db/.big.ibd.pdiffcopy-1a2b3c4d5e6f"

#: Names generated values are mixed with: existing files, a directory, a
#: temporary name, escapes (.. and symlinks leading out of the root).
KNOWN_PATHS = [
    "db/big.ibd", "small.txt", "db", TEMPORARY, "db/.x.pdiffcopy-000000000000",
    "../outside/secret.txt", "link-out/secret.txt", "db/link-secret", "link-out",
    "%2e%2e/outside/secret.txt", ".pdiffcopy/nothing", "db/big.ibd/x", "/etc/passwd",
    "static/x", "openapi.json",
]

#: The file beside the root: no answer may hold it (an error message may say "outside the root").
SECRET = b"a secret beside the served root: 5d41402a"

#: Counts what the fuzzer did, for the final check.
requests_made = {"count": 0}


@pytest.fixture(scope="module")
def fuzz_tree(tmp_path_factory):
    """base/root (served), base/outside (a sibling) and a file next to both."""
    base = tmp_path_factory.mktemp("fuzz")
    root, outside = base / "root", base / "outside"
    (root / "db").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    (base / "neighbour.txt").write_bytes(b"next to the root")
    (root / "db" / "big.ibd").write_bytes(os.urandom(300_000))
    (root / TEMPORARY).write_bytes(os.urandom(5000))
    (root / "small.txt").write_bytes(b"hello\n")
    (root / "link-out").symlink_to(outside)
    (root / "db" / "link-secret").symlink_to(outside / "secret.txt")
    return base


@pytest.fixture(scope="module")
def fuzz_server(fuzz_tree, tmp_path_factory):
    running = start_server(fuzz_tree / "root", tmp_path_factory.mktemp("fuzz-log") / "server.log",
                           token=TOKEN)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def outside_before(fuzz_tree, fuzz_server):
    """Everything beside the root, taken before the first generated request."""
    return outside_state(fuzz_tree)


def outside_state(base: Path) -> dict:
    everything = snapshot(base)
    root = str(base / "root")
    return {path: state for path, state in everything.items()
            if path != root and not path.startswith(root + os.sep)}


@pytest.fixture(scope="module")
def api_schema(fuzz_server, outside_before):
    """The document as the running server serves it, loaded by schemathesis."""
    return schemathesis.openapi.from_url(f"{fuzz_server.base}{DOCUMENT_PATH}",
                                         headers={"Authorization": f"Bearer {TOKEN}"},
                                         timeout=REQUEST_TIMEOUT)


#: The server's router, to tell which operation a generated URL reaches.
ROUTES = create_app(ServerConfig(root="/nonexistent")).url_map.bind("localhost")


def routed_operation(url: str, method: str) -> Optional[str]:
    """The OpenAPI path of the operation the server routes ``url`` to (None: 404/405).

    Usually the generated operation, but not always, and rightly so: a path
    value of ``/.pdiffcopy/version`` for ``GET /{path}`` makes the URL of
    ``GET /.pdiffcopy/version``, and the client (urllib3) removes dot
    segments, so ``/.pdiffcopy/rename/../x`` is sent as ``/.pdiffcopy/x``.
    Such answers are checked for no 500 and a JSON error, not against the
    generated operation's description. (Raw ``..`` requests are in test_errors.py.)
    """
    try:
        rule, _ = ROUTES.match(unquote(urlsplit(url).path), method=method, return_rule=True)
    except HTTPException:
        return None
    return openapi_path(rule.rule)


def _operations():
    document = build_document()
    return [(method.upper(), path) for path, item in document["paths"].items()
            for method in item]


def _adjust(data, case, known_paths) -> None:
    """Sometimes point the case at a name that exists, escapes or is a temporary file.

    And keep resizes small: a resize is bounded only by the free space (a
    sync may need all of it), and the fuzzer would otherwise fill the disk
    the test runs on. Sizes beyond the document's bound stay as they are.
    """
    size = (case.query or {}).get("size")
    if isinstance(size, int) and not isinstance(size, bool) and MAX_RESIZE < size <= 2 ** 50:
        case.query["size"] = size % MAX_RESIZE
    if "path" in (case.path_parameters or {}) and data.draw(st.booleans(), label="known path"):
        case.path_parameters["path"] = data.draw(st.sampled_from(known_paths), label="path")
    for name in ("from", "to"):
        if name in (case.query or {}) and data.draw(st.booleans(), label=f"known {name}"):
            case.query[name] = data.draw(st.sampled_from(known_paths), label=name)


# schemathesis's own pytest integration (schema.parametrize) does not work with
# pytest 9.2 (it sets a private attribute pytest no longer has), so the
# operations are parametrised here and each case is drawn from schemathesis's
# hypothesis strategy for it: the same generator, driven by plain hypothesis.
@pytest.mark.parametrize("mode", ["positive", "negative"], ids=["valid", "invalid"])
@pytest.mark.parametrize("method,path", _operations(), ids=[f"{m} {p}" for m, p in _operations()])
def test_generated_requests_get_documented_answers(api_schema, fuzz_server, method, path, mode):
    fuzz_operation(api_schema, fuzz_server, method, path, mode, KNOWN_PATHS, (SECRET,))


def fuzz_operation(api_schema, fuzz_server, method: str, path: str, mode: str, known_paths, forbidden) -> None:
    """Send FUZZ_EXAMPLES generated requests of one operation; check each answer (which holds
    none of ``forbidden``)."""
    operation = api_schema[path][method]
    if mode == "negative" and not any(operation.iter_parameters()) and not operation.body:
        pytest.skip("nothing to make invalid: the operation takes no parameters")
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one_request(data):
        case = data.draw(strategy, label="case")
        _adjust(data, case, known_paths)
        response = case.call(base_url=fuzz_server.base, timeout=REQUEST_TIMEOUT,
                             headers={"Authorization": f"Bearer {TOKEN}"})
        requests_made["count"] += 1
        request = case.as_curl_command(headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code != 500, (request, response.text[:300])
        assert not any(secret in response.content for secret in forbidden), (request, response.content[:300])
        if routed_operation(response.request.url, method) == path:
            case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400 and method != "HEAD":
            content_type = response.headers.get("content-type", [""])[0]
            assert content_type.startswith("application/json"), (request, content_type)
            body = json.loads(response.content)
            assert body["status"] == response.status_code, (request, body)
            assert isinstance(body["error"], str) and body["error"].strip(), (request, body)
            assert "\n" not in body["error"], (request, body)

    one_request()


def test_nothing_outside_the_root_changed(fuzz_tree, fuzz_server, outside_before):
    if requests_made["count"] == 0:
        pytest.skip("runs after test_generated_requests_get_documented_answers")
    assert requests_made["count"] >= FUZZ_EXAMPLES
    assert outside_state(fuzz_tree) == outside_before
    assert fuzz_server.process.poll() is None, "the server died"
    log = fuzz_server.log.read_text()
    assert "Traceback" not in log and "Unexpected error" not in log, log[-3000:]


# -- the same, through exports ---------------------------------------------------------

#: The token of export b, which the fuzzer does not send: b is another team's.
OTHER_TOKEN = "fuzz-token-of-b"

#: Export a's known names, and ways to name export b from a request admitted to a.
CROSSING_PATHS = [
    "b/small.txt", "b/db/big.ibd", "a/../b/small.txt", "a/%2e%2e/b/small.txt", "a/%2Fb/small.txt",
    "a/link-b/small.txt", "a/db/../../b/small.txt", "b", "c/x", "a//b/small.txt", "./b/small.txt",
    "b/db/.big.ibd.pdiffcopy-1a2b3c4d5e6f", "a/link-out/secret.txt",
]
#: As likely to cross as not.
KNOWN_EXPORT_PATHS = [f"a/{path}" for path in KNOWN_PATHS] + CROSSING_PATHS * (len(KNOWN_PATHS) // len(CROSSING_PATHS))

#: What no answer of export a's may hold: export b's files, the file outside both.
NOT_IN_A = (b"hello from b", b"a secret beside every export: 7d793037")


@pytest.fixture(scope="module")
def export_tree(tmp_path_factory):
    """base/a and base/b (two exports), base/outside (neither) and links from a to both."""
    base = tmp_path_factory.mktemp("fuzz-exports")
    for export in ("a", "b"):
        (base / export / "db").mkdir(parents=True)
        (base / export / "db" / "big.ibd").write_bytes(os.urandom(300_000))
        (base / export / "small.txt").write_bytes(f"hello from {export}\n".encode())
    (base / "a" / TEMPORARY).write_bytes(os.urandom(5000))
    (base / "outside").mkdir()
    (base / "outside" / "secret.txt").write_bytes(NOT_IN_A[1])
    (base / "a" / "link-out").symlink_to(base / "outside")
    (base / "a" / "link-b").symlink_to(base / "b")
    (base / "a" / "db" / "link-secret").symlink_to(base / "outside" / "secret.txt")
    return base


@pytest.fixture(scope="module")
def export_server(export_tree, tmp_path_factory):
    import hashlib

    def listed(token: str) -> str:
        return f'"fuzzer:sha256:{hashlib.sha256(token.encode()).hexdigest()}"'

    config = export_tree / "exports.toml"
    config.write_text(f'[export.a]\npath = "{export_tree / "a"}"\nread_only = false\ntokens = [{listed(TOKEN)}]\n'
                      f'[export.b]\npath = "{export_tree / "b"}"\nread_only = false\n'
                      f'tokens = [{listed(OTHER_TOKEN).replace("fuzzer", "other")}]\n')
    running = start_server(None, tmp_path_factory.mktemp("fuzz-exports-log") / "server.log",
                           extra=("--config", str(config)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def beside_export_a(export_tree, export_server):
    """Everything but export a (export b included), before the first generated request."""
    return beside(export_tree, "a")


def beside(base: Path, export: str) -> dict:
    kept = str(base / export)
    return {path: state for path, state in snapshot(base).items()
            if path != kept and not path.startswith(kept + os.sep)}


@pytest.fixture(scope="module")
def export_schema(export_server, beside_export_a):
    return schemathesis.openapi.from_url(f"{export_server.base}{DOCUMENT_PATH}",
                                         headers={"Authorization": f"Bearer {TOKEN}"},
                                         timeout=REQUEST_TIMEOUT)


export_requests = {"count": 0}


@pytest.mark.parametrize("mode", ["positive", "negative"], ids=["valid", "invalid"])
@pytest.mark.parametrize("method,path", _operations(), ids=[f"{m} {p}" for m, p in _operations()])
def test_generated_requests_to_an_export_get_documented_answers(export_schema, export_server, method, path,
                                                                mode):
    """With the token of export a only: paths in a, and ones that try to reach b or out."""
    before = requests_made["count"]
    fuzz_operation(export_schema, export_server, method, path, mode, KNOWN_EXPORT_PATHS, NOT_IN_A)
    export_requests["count"] += requests_made["count"] - before


def test_nothing_beside_the_export_changed(export_tree, export_server, beside_export_a):
    if export_requests["count"] == 0:
        pytest.skip("runs after test_generated_requests_to_an_export_get_documented_answers")
    assert beside(export_tree, "a") == beside_export_a
    assert (export_tree / "b" / "small.txt").read_bytes() == b"hello from b\n"
    of_b = (export_tree / "b" / "db" / "big.ibd").read_bytes()
    for path in (export_tree / "a").rglob("*"):
        if path.is_file() and not path.is_symlink():  # nothing of b's or outside's copied into a
            data = path.read_bytes()
            assert not any(secret in data for secret in NOT_IN_A) and of_b[:4096] not in data, path
    assert export_server.process.poll() is None, "the server died"
    log = export_server.log.read_text()
    assert "Traceback" not in log and "Unexpected error" not in log, log[-3000:]


# -- what fuzzing found ----------------------------------------------------------------


def test_a_newline_in_a_path_stays_escaped_in_errors_and_log(fuzz_server):
    """Found by fuzzing: a path with a newline split the error message and the log line."""
    status, _, body = http_get(f"{fuzz_server.base}/.pdiffcopy/stat/a%0AINFO%20forged%0Ab",
                                     {"Authorization": f"Bearer {TOKEN}"})
    assert status == 404
    message = json.loads(body)["error"]
    assert "\n" not in message
    assert "a\\nINFO forged\\nb" in message
    time.sleep(0.2)  # the log line is written after the answer
    lines = fuzz_server.log.read_text().splitlines()
    assert not any(line.startswith("INFO forged") for line in lines)
    assert any("/.pdiffcopy/stat/a\\nINFO forged\\nb 404" in line for line in lines)


def test_a_name_with_a_newline_is_a_file_like_any_other(fuzz_server, fuzz_tree):
    """Werkzeug's path converter stopped at a newline: such a file got a generic 404."""
    (fuzz_tree / "root" / "two\nlines").write_bytes(b"12345")
    try:
        status, _, body = http_get(f"{fuzz_server.base}/.pdiffcopy/stat/two%0Alines",
                                   {"Authorization": f"Bearer {TOKEN}"})
        assert (status, json.loads(body)["size"]) == (200, 5)
    finally:
        (fuzz_tree / "root" / "two\nlines").unlink()


@pytest.mark.parametrize("method,target", [
    ("POST", "/.pdiffcopy/resize/%2F?size=0"),
    ("POST", "/.pdiffcopy/resize//etc/passwd?size=0"),
    ("GET", "/.pdiffcopy/stat//etc/passwd"),
    ("GET", "/.pdiffcopy/hashes//etc/passwd?method=sha256&block_size=4096&offset=0&length=1"),
    ("DELETE", "/.pdiffcopy/temporary//tmp/.x.pdiffcopy-000000000000"),
])
def test_an_absolute_path_reaches_its_endpoint_and_is_refused_there(fuzz_server, method, target):
    """Found by fuzzing: '/.pdiffcopy/resize/%2F' fell through to another route (405)."""
    status, headers, body = raw_request(fuzz_server.port, method, target, token=TOKEN)
    message = assert_json_error(status, headers, body, 403)
    assert "outside the root" in message


@pytest.mark.parametrize("raw,status", [
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"HEAD /.pdiffcopy/version HTTP/1.1\r\nHost: x\r\nContent-Length: G\"u\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", 431),
    (b"NOT AN HTTP REQUEST\r\n\r\n", 400),
], ids=["line-too-long", "bad-content-length", "too-many-headers", "garbage"])
def test_errors_of_the_http_layer_are_json_too(fuzz_server, raw, status):
    """Found by fuzzing: gunicorn answered malformed HTTP with HTML, not the JSON error."""
    with socket.create_connection(("127.0.0.1", fuzz_server.port), timeout=REQUEST_TIMEOUT) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, _, header_block = head.partition(b"\r\n")
    headers = http.client.parse_headers(io.BytesIO(header_block + b"\r\n\r\n"))
    assert int(status_line.split()[1]) == status, answer[:300]
    assert_json_error(status, headers, body, status)
    assert json.loads(body)["status"] == status


@pytest.mark.parametrize("target,name", [
    ("/.pdiffcopy/clone/db/.big.ibd.pdiffcopy-000000000001", "from"),
    ("/.pdiffcopy/clone/db/.big.ibd.pdiffcopy-000000000001?from=", "from"),
    (f"/.pdiffcopy/rename/{TEMPORARY}", "to"),
])
def test_a_missing_required_path_parameter_is_a_bad_request(fuzz_server, fuzz_tree, target,
                                                             name):
    """Found while describing the API: a missing ``from`` got 409, a missing ``to`` 403."""
    status, headers, body = raw_request(fuzz_server.port, "POST", target, token=TOKEN)
    assert f"Missing parameter: {name}" in assert_json_error(status, headers, body, 400)
    assert not (fuzz_tree / "root" / "db" / ".big.ibd.pdiffcopy-000000000001").exists()

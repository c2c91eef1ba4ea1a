"""The OpenAPI document: it describes exactly the routes the server has, and docs/ holds it.

A route added to server.py without a description (or a description left
behind by a removed route) fails here, and so does a docs/openapi.json that
was not rewritten with ``python3 docs/write_openapi.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import http_get

from pdiffcopy import errors as exceptions
from pdiffcopy.server.openapi import DOCUMENT_PATH, ERROR_STATUSES, build_document, render_document
from pdiffcopy.server.app import ServerConfig, create_app

DOCS = Path(__file__).resolve().parent.parent / "docs"

#: The methods every Flask rule answers by itself (RFC 9110 OPTIONS), not API operations.
AUTOMATIC_METHODS = {"OPTIONS"}

#: Errors only the client raises; the server never answers with their status.
CLIENT_ONLY_ERRORS = {exceptions.RemoteError, exceptions.RemoteProtocolError, exceptions.VerificationFailed,
                      exceptions.SshFailed, exceptions.RemoteProgramMissing, exceptions.SshStartFailed,
                      exceptions.ServerFailed, exceptions.RemoteTimeout, exceptions.RemoteDataError}

HTTP_METHODS = {"get", "head", "post", "put", "patch", "delete", "options", "trace"}


def openapi_path(rule: str) -> str:
    """A Werkzeug rule (``/x/<path:path>``) written as an OpenAPI path (``/x/{path}``)."""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def routes_of_app(tmp_path) -> set:
    app = create_app(ServerConfig(root=str(tmp_path)))
    return {(openapi_path(rule.rule), method.lower())
            for rule in app.url_map.iter_rules()
            for method in rule.methods - AUTOMATIC_METHODS}


def operations_of(document: dict) -> set:
    return {(path, method) for path, item in document["paths"].items()
            for method in item if method in HTTP_METHODS}


def test_every_route_is_described_and_nothing_else(tmp_path):
    routes, described = routes_of_app(tmp_path), operations_of(build_document())
    assert routes - described == set(), "routes of server.py missing from pdiffcopy/server/openapi.py"
    assert described - routes == set(), "operations in pdiffcopy/server/openapi.py the server lacks"
    # The comparison is not vacuous: the API has all these operations.
    assert len(routes) >= 18


def test_path_templates_match_the_declared_parameters():
    document = build_document()
    parameters = document["components"]["parameters"]
    for path, item in document["paths"].items():
        in_template = set(re.findall(r"{([^}]+)}", path))
        for method, operation in item.items():
            declared = set()
            for parameter in operation["parameters"]:
                if "$ref" in parameter:
                    parameter = parameters[parameter["$ref"].rsplit("/", 1)[1]]
                if parameter["in"] == "path":
                    declared.add(parameter["name"])
            assert declared == in_template, (method, path)


def test_every_error_answer_is_the_json_error_object():
    document = build_document()
    error = document["components"]["schemas"]["Error"]
    assert set(error["required"]) == {"error", "status"}
    without_token = set()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            statuses = {int(status) for status in operation["responses"]}
            assert 500 not in statuses, (method, path)
            if operation.get("security") == []:
                without_token.add(path)
            else:
                assert 401 in statuses, f"{method} {path}: every request may lack the token"
            for status, answer in operation["responses"].items():
                if int(status) >= 400 and method != "head":
                    assert answer == {"$ref": f"#/components/responses/Error{status}"}
    # Only the liveness probe is answered without the token.
    assert without_token == {"/.pdiffcopy/health"}


def test_every_status_the_server_maps_errors_to_is_documented():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    statuses = {cls.http_status for cls in subclasses(exceptions.PdiffcopyError)
                if cls not in CLIENT_ONLY_ERRORS and cls.http_status != 500}
    assert statuses - set(ERROR_STATUSES) == set()


def test_the_document_is_valid_openapi_3():
    # schemathesis carries the OpenAPI 3.0 meta-schema and a validator for it.
    definitions = pytest.importorskip("schemathesis.specs.openapi.definitions")
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    validator = jsonschema_rs.Draft4Validator(definitions.OPENAPI_30)
    document = build_document()
    assert document["openapi"].startswith("3.0.")
    assert [f"{list(e.instance_path)}: {e.message[:200]}"
            for e in validator.iter_errors(document)] == []
    broken = build_document()
    broken["paths"]["/"]["get"]["responses"]["200"]["description"] = 5
    assert list(validator.iter_errors(broken)), "the validator accepts anything"
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        **document["components"]["securitySchemes"]["bearerAuth"],
        "type": "http", "scheme": "bearer"}
    assert document["security"] == [{"bearerAuth": []}]


def test_docs_copy_is_current():
    assert (DOCS / "openapi.json").read_text() == render_document(), \
        "docs/openapi.json is stale: run python3 docs/write_openapi.py"


def test_the_server_serves_the_document_behind_its_token(token_server):
    url = f"{token_server.base}{DOCUMENT_PATH}"
    status, headers, body = http_get(url)
    assert status == 401
    assert json.loads(body)["status"] == 401
    status, headers, body = http_get(url, {"Authorization": f"Bearer {token_server.token}"})
    assert status == 200
    assert headers["Content-Type"].startswith("application/json")
    assert json.loads(body) == build_document()


def test_a_file_called_openapi_json_is_still_a_file(server):
    # The document lives under the reserved prefix, so it hides no file of the root.
    (server.root / "openapi.json").write_bytes(b"just a file")
    try:
        assert http_get(server.url("openapi.json"))[::2] == (200, b"just a file")
    finally:
        (server.root / "openapi.json").unlink()


def test_a_top_level_static_directory_is_served_like_any_other(server):
    # Flask's default static route used to answer /static/... from its own
    # empty folder: a 404 for files the server could write but never read.
    (server.root / "static").mkdir(exist_ok=True)
    (server.root / "static" / "style.css").write_bytes(b"body {}")
    assert http_get(server.url("static/style.css"))[::2] == (200, b"body {}")
    status, _, body = http_get(f"{server.base}/.pdiffcopy/stat/static/style.css")
    assert (status, json.loads(body)["size"]) == (200, 7)

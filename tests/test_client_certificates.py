"""Client certificates (mutual TLS): ``--client-ca`` on the server, ``--client-cert`` on the client.

A real https server whose exports list client certificates by their SHA-256, as they list
tokens: the listed certificate opens its export and no other, one the CA signed but no
export lists opens nothing, one the CA did not sign fails the handshake, and a token still
opens what it opens.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import pytest

from conftest import one_line_error, random_bytes, run_cli, start_server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")

TOKEN = "a-token-for-the-golden-export"


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def issue(keys: Path, name: str, ca: str = "ca", extension: str = "") -> Path:
    """A certificate for ``name`` signed by ``ca`` (its key beside it, in one PEM)."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(keys / f"{name}.key"),
            "-out", str(keys / f"{name}.csr"), "-subj", f"/CN={name}")
    extra = ["-extfile", str(keys / f"{name}.ext")] if extension else []
    if extension:
        (keys / f"{name}.ext").write_text(extension)
    openssl("x509", "-req", "-in", str(keys / f"{name}.csr"), "-CA", str(keys / f"{ca}.pem"),
            "-CAkey", str(keys / f"{ca}.key"), "-CAcreateserial", "-days", "2", "-out", str(keys / f"{name}.crt"),
            *extra)
    combined = keys / f"{name}.pem"
    combined.write_text((keys / f"{name}.crt").read_text() + (keys / f"{name}.key").read_text())
    return combined


def fingerprint(path: Path) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(path.read_text().split("-----BEGIN PRIVATE KEY")[0])).hexdigest()


@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    keys = tmp_path_factory.mktemp("mtls")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", str(keys / f"{ca}.key"),
                "-out", str(keys / f"{ca}.pem"), "-subj", f"/CN={ca}")
    issue(keys, "server", extension="subjectAltName=IP:127.0.0.1\n")
    ops, unlisted = issue(keys, "ops"), issue(keys, "unlisted")
    stranger = issue(keys, "stranger", ca="other-ca")
    vms, golden = keys / "vms", keys / "golden"
    for directory in (vms, golden):
        directory.mkdir()
        (directory / "disk.img").write_bytes(random_bytes(200_000, seed=len(directory.name)))
    token = hashlib.sha256(TOKEN.encode()).hexdigest()
    config = keys / "exports.toml"
    config.write_text(f'[export.vms]\npath = "{vms}"\nread_only = false\n'
                      f'certificates = ["ops-laptop:sha256:{fingerprint(ops)}"]\n\n'
                      f'[export.golden]\npath = "{golden}"\ntokens = ["reader:sha256:{token}"]\n')
    log = keys / "server.log"
    server = start_server(None, log, extra=("--config", str(config), "--certfile", str(keys / "server.crt"),
                                            "--keyfile", str(keys / "server.key"), "--client-ca",
                                            str(keys / "ca.pem"), "--log-format", "json"))
    server.keys, server.vms, server.golden = keys, vms, golden
    server.certificates = {"ops": ops, "unlisted": unlisted, "stranger": stranger}
    yield server
    server.stop()


def base(server) -> str:
    return f"https://127.0.0.1:{server.port}"


def with_certificate(server, name: str, *args: str, token: str = ""):
    certificate = ["--client-cert", str(server.certificates[name])] if name else []
    return run_cli("--ca-file", str(server.keys / "ca.pem"), *certificate, *args,
                   env_extra={"PDIFFCOPY_TOKEN": token} if token else None)


def test_a_listed_certificate_opens_its_export(mtls, tmp_path):
    done = with_certificate(mtls, "ops", f"{base(mtls)}/vms/disk.img", str(tmp_path / "pulled.img"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pulled.img").read_bytes() == (mtls.vms / "disk.img").read_bytes()
    (tmp_path / "new.img").write_bytes(random_bytes(100_000, seed=8))
    done = with_certificate(mtls, "ops", str(tmp_path / "new.img"), f"{base(mtls)}/vms/new.img")
    assert done.returncode == 0, done.stderr
    assert (mtls.vms / "new.img").read_bytes() == (tmp_path / "new.img").read_bytes()
    # The transfer log names the certificate as it names a token.
    deadline = time.monotonic() + 20
    while True:
        lines = [json.loads(line) for line in mtls.log.read_text().splitlines()]
        pushed = [line for line in lines if line.get("event") == "transfer" and line["path"] == "new.img"]
        if pushed or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert pushed and pushed[0]["token"] == "ops-laptop" and pushed[0]["result"] == "ok"


def test_a_certificate_opens_no_other_export_and_an_unlisted_one_opens_nothing(mtls, tmp_path):
    done = with_certificate(mtls, "ops", f"{base(mtls)}/golden/disk.img", str(tmp_path / "a.img"))
    assert "The certificate 'ops-laptop' does not open the export golden" in one_line_error(done)
    for name in ("unlisted", ""):
        done = with_certificate(mtls, name, f"{base(mtls)}/vms/disk.img", str(tmp_path / "b.img"))
        assert "Missing or wrong token" in one_line_error(done), name
    assert not (tmp_path / "a.img").exists() and not (tmp_path / "b.img").exists()


def test_a_certificate_of_another_ca_fails_the_handshake(mtls, tmp_path):
    done = with_certificate(mtls, "stranger", f"{base(mtls)}/vms/disk.img", str(tmp_path / "c.img"))
    assert "TLS error" in one_line_error(done) or "Lost the connection" in one_line_error(done), done.stderr
    assert not (tmp_path / "c.img").exists()


def test_a_token_still_opens_its_export_beside_certificates(mtls, tmp_path):
    done = with_certificate(mtls, "", f"{base(mtls)}/golden/disk.img", str(tmp_path / "g.img"), token=TOKEN)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "g.img").read_bytes() == (mtls.golden / "disk.img").read_bytes()


@pytest.mark.parametrize("extra, message", [
    (("--client-ca", "{ca}"), "--client-ca needs TLS"),
    (("--certfile", "{crt}", "--keyfile", "{key}"), "lists client certificates: give --client-ca"),
    (("--certfile", "{crt}", "--keyfile", "{key}", "--client-ca", "{config}"), "not a CA bundle"),
])
def test_client_ca_mistakes_are_refused_at_start(mtls, tmp_path, extra, message):
    values = {"ca": mtls.keys / "ca.pem", "crt": mtls.keys / "server.crt", "key": mtls.keys / "server.key",
              "config": mtls.keys / "exports.toml"}
    done = run_cli("--config", str(mtls.keys / "exports.toml"), "--listen", "127.0.0.1:0",
                   *(value.format(**values) for value in extra))
    assert message in one_line_error(done)


def test_client_cert_mistakes_are_one_line(mtls, tmp_path):
    (tmp_path / "a").write_bytes(b"a")
    done = run_cli("--client-cert", str(mtls.keys / "ops.crt"), str(tmp_path / "a"), f"{base(mtls)}/vms/a")
    assert "--client-cert" in one_line_error(done) and "--client-key" in one_line_error(done)
    done = run_cli("--client-cert", str(tmp_path / "missing.pem"), str(tmp_path / "a"), f"{base(mtls)}/vms/a")
    assert "Cannot read --client-cert" in one_line_error(done)

"""https: the server with --certfile/--keyfile, the client verifying it (or refusing to)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import random_bytes, run_cli, start_server
from pdiffcopy import sync
from pdiffcopy.errors import RemoteError

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(keys / "key.pem"), "-out", str(keys / "cert.pem"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    root = tmp_path_factory.mktemp("tls-root")
    server = start_server(root, keys / "server.log",
                          extra=("--certfile", str(keys / "cert.pem"), "--keyfile", str(keys / "key.pem")))
    server.ca_file = str(keys / "cert.pem")
    yield server
    server.stop()


def test_pull_and_push_over_https_with_the_ca_file(tls_server, tmp_path):
    data = random_bytes(300000)
    (tls_server.root / "a.img").write_bytes(data)
    url = f"https://127.0.0.1:{tls_server.port}/a.img"
    result = sync(url, str(tmp_path / "a.img"), ca_file=tls_server.ca_file, block_size=4096)
    assert (tmp_path / "a.img").read_bytes() == data and result.verified
    (tmp_path / "b.img").write_bytes(data[::-1])
    sync(str(tmp_path / "b.img"), f"https://127.0.0.1:{tls_server.port}/b.img",
         ca_file=tls_server.ca_file)
    assert (tls_server.root / "b.img").read_bytes() == data[::-1]


def test_an_unknown_certificate_is_refused_not_downgraded(tls_server, tmp_path):
    (tls_server.root / "c.img").write_bytes(b"secret")
    with pytest.raises(RemoteError, match="certificate verify failed"):
        sync(f"https://127.0.0.1:{tls_server.port}/c.img", str(tmp_path / "c.img"))
    assert not (tmp_path / "c.img").exists()
    completed = run_cli(f"https://127.0.0.1:{tls_server.port}/c.img", str(tmp_path / "c.img"))
    assert completed.returncode == 10
    assert "certificate verify failed" in completed.stderr and "Traceback" not in completed.stderr


def test_half_a_tls_configuration_is_a_usage_error(tmp_path):
    completed = run_cli("--root", str(tmp_path), "--listen", "127.0.0.1:0", "--certfile", "/nonexistent")
    assert completed.returncode == 1
    assert "--keyfile" in completed.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if " ERROR " in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_self_signed_certificate_is_named_as_the_reason(tls_server, tmp_path):
    completed = run_cli(f"https://127.0.0.1:{tls_server.port}/c.img", str(tmp_path / "c.img"))
    assert completed.returncode == 10
    assert "certificate verify failed: self-signed certificate" in one_error_line(completed.stderr)


def test_a_host_name_the_certificate_is_not_for_is_named_as_the_reason(tls_server, tmp_path):
    completed = run_cli("--ca-file", tls_server.ca_file, f"https://localhost:{tls_server.port}/c.img",
                        str(tmp_path / "c.img"))
    assert completed.returncode == 10
    assert "Hostname mismatch" in one_error_line(completed.stderr)


def test_https_to_a_plain_http_server_says_so(server, tmp_path):
    completed = run_cli(f"https://127.0.0.1:{server.port}/c.img", str(tmp_path / "c.img"))
    assert completed.returncode == 10
    line = one_error_line(completed.stderr)
    assert "TLS error" in line and "wrong version number" in line.lower(), line


def test_an_unusable_ca_file_is_a_usage_error_with_its_reason(tls_server, tmp_path):
    # The command line checks the file first; the API (next test) fails as it loads it.
    (tmp_path / "not-a-ca.pem").write_text("hello\n")
    for ca_file, reason in ((tmp_path / "not-a-ca.pem", "no certificate"),
                            (tmp_path / "missing.pem", "No such file or directory")):
        completed = run_cli("--ca-file", str(ca_file), f"https://127.0.0.1:{tls_server.port}/c.img",
                            str(tmp_path / "c.img"))
        assert completed.returncode == 1
        line = one_error_line(completed.stderr)
        assert str(ca_file) in line and reason.lower() in line.lower().replace("_", " "), line


def test_an_unusable_ca_file_given_to_the_api_says_why(tls_server, tmp_path):
    from pdiffcopy.errors import UsageError

    (tmp_path / "not-a-ca.pem").write_text("hello\n")
    with pytest.raises(UsageError, match="Cannot use the CA file .*: no certificate"):
        sync(f"https://127.0.0.1:{tls_server.port}/c.img", str(tmp_path / "c.img"),
             ca_file=str(tmp_path / "not-a-ca.pem"))


def test_stats_count_the_tls_bytes_on_the_wire(tls_server, tmp_path):
    """The kernel's counters see TLS records: a little more than the data, never less."""
    data = random_bytes(1024 * 1024, seed=9)
    (tls_server.root / "s.img").write_bytes(data)
    done = run_cli("--no-progress", "--stats", "--ca-file", tls_server.ca_file,
                   f"https://127.0.0.1:{tls_server.port}/s.img", str(tmp_path / "s.img"))
    assert done.returncode == 0, done.stderr
    received = int(done.stdout.split(" bytes received on the wire")[0].rsplit(" ", 1)[1])
    assert len(data) < received < len(data) + 256 * 1024

"""How the command ends: its exit statuses (rsync's table), and ending without a trace when called from Python."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, run_cli
from pdiffcopy.errors import UsageError

REPOSITORY = Path(__file__).resolve().parent.parent

#: Calls ``pdiffcopy.cli.main()`` with no arguments after setting ``sys.argv``, as 1.0.1's test
#: suite does through humanfriendly's ``run_cli``, then goes on: the caller must survive.
CALLER = """\
import atexit, sys
from pdiffcopy.cli import {function} as entry
atexit.register(lambda: print("atexit ran", flush=True))
sys.argv = ["pdiffcopy", "-q", *sys.argv[1:]]
try:
    entry()
    print("returned", flush=True)
except SystemExit as exit:
    print("SystemExit", exit.code, flush=True)
"""


def call_in_python(function: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CALLER.format(function=function), *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def test_main_called_from_python_after_a_sync_hands_the_status_back(tmp_path):
    (tmp_path / "a").write_bytes(os.urandom(3 * 1024 * 1024 + 5))
    completed = call_in_python("main", "a", "b", cwd=tmp_path)
    assert completed.stdout.splitlines() == ["SystemExit 0", "atexit ran"], completed.stderr
    assert completed.returncode == 0
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes()
    failed = call_in_python("main", "missing", "b", cwd=tmp_path)
    assert failed.stdout.splitlines()[0].startswith("SystemExit "), failed.stderr
    assert failed.stdout.splitlines()[0] != "SystemExit 0"


def test_main_runs_under_humanfriendlys_run_cli_as_101s_test_suite_runs_it(tmp_path):
    """humanfriendly.testing.run_cli patches sys.argv, calls main() and catches SystemExit."""
    (tmp_path / "a").write_bytes(os.urandom(100_000))
    script = ("import warnings; warnings.simplefilter('ignore')\n"
              "try:\n    from humanfriendly.testing import run_cli\n"
              "except ImportError:\n    raise SystemExit(99)\n"
              "from pdiffcopy.cli import main\n"
              "status, output = run_cli(main, '-q', 'a', 'b')\n"
              "print('survived', status)\n")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                               cwd=tmp_path)
    if completed.returncode == 99:
        pytest.skip("humanfriendly.testing cannot be imported here (it needs the pipes module)")
    assert completed.stdout.split() == ["survived", "0"], completed.stderr
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes()


def test_the_console_script_alone_ends_the_process_after_a_sync(tmp_path):
    """Its exit skips the interpreter's teardown, not the atexit functions (docs/benchmarks.rst)."""
    from importlib import metadata

    scripts = [entry for entry in metadata.entry_points(group="console_scripts") if entry.name == "pdiffcopy"]
    assert [entry.value for entry in scripts] == ["pdiffcopy.cli:console_main"]
    (tmp_path / "a").write_bytes(b"x" * 100)
    completed = call_in_python("console_main", "a", "b", cwd=tmp_path)
    assert completed.stdout.splitlines() == ["atexit ran"], completed.stderr
    assert completed.returncode == 0
    assert (tmp_path / "b").read_bytes() == b"x" * 100


# -- a server's TLS configuration is checked before it listens ---------------------------------

@pytest.fixture(scope="module")
def key_pairs(tmp_path_factory):
    """Two self-signed certificates with their keys (cert.pem/key.pem, other-cert.pem/other-key.pem)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    keys = tmp_path_factory.mktemp("keys")
    for prefix in ("", "other-"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-keyout", str(keys / f"{prefix}key.pem"), "-out", str(keys / f"{prefix}cert.pem"),
                        "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    (keys / "junk.pem").write_text("hello\n")
    return keys


@pytest.mark.parametrize("certfile,keyfile,reason", [
    ("key.pem", "cert.pem", "swapped"),
    ("cert.pem", "other-key.pem", "not the key of"),
    ("junk.pem", "key.pem", "no certificate"),
    ("cert.pem", "junk.pem", "no private key"),
], ids=["swapped", "another-key", "no-certificate", "no-key"])
def test_a_bad_certificate_or_key_is_one_line_before_the_server_listens(tmp_path, key_pairs, certfile, keyfile,
                                                                         reason):
    """Before: "Serving ... on https://", every worker died with a traceback, exit 3 (under systemd's
    Restart=on-failure, a loop every 5 s)."""
    port = free_port()
    started = time.monotonic()
    completed = run_cli("--root", str(tmp_path), "--listen", f"127.0.0.1:{port}", "-c", "1",
                        "--certfile", str(key_pairs / certfile), "--keyfile", str(key_pairs / keyfile), timeout=60)
    assert completed.returncode == UsageError.exit_code == 1, completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in completed.stderr and "Serving" not in completed.stderr, lines
    assert reason in lines[0] and certfile in lines[0], lines[0]
    assert time.monotonic() - started < 30


def test_the_service_unit_does_not_restart_after_a_configuration_error():
    unit = (REPOSITORY / "docs" / "pdiffcopy.service").read_text()
    prevented = [line.partition("=")[2].split() for line in unit.splitlines()
                 if line.startswith("RestartPreventExitStatus=")]
    assert prevented == [[str(UsageError.exit_code)]], prevented
    assert "Restart=on-failure" in unit.splitlines()


# -- the documented table ----------------------------------------------------------------------------

#: The statuses that no exception class carries: success, a closed standard output, an interruption.
STATUSES_OF_THEIR_OWN = {0, 13, 20}

#: rsync's exit values (its man page), for the failures pdiffcopy has in common with it.
RSYNC = {"syntax or usage": 1, "protocol incompatibility": 2, "errors selecting": 3,
         "starting the protocol": 5, "socket i/o": 10, "file i/o": 11, "data stream": 12,
         "sigint": 20, "partial transfer": 23, "timeout": 30}


def error_classes():
    from pdiffcopy import errors

    return [value for value in vars(errors).values()
            if isinstance(value, type) and issubclass(value, errors.PdiffcopyError)]


def documented_statuses(text: str) -> dict:
    """The ``exit status`` list of --help: {status: its words}."""
    table = text.split("exit status", 1)[1].split("examples:", 1)[0]
    statuses: dict = {}
    status = None
    for line in table.splitlines()[1:]:
        first, _, rest = line.strip().partition(" ")
        if first.isdigit():
            status = int(first)
            statuses[status] = rest.strip()
        elif status is not None:
            statuses[status] += " " + line.strip()
    return statuses


def test_help_lists_every_exit_status_and_only_those():
    completed = run_cli("--help")
    statuses = documented_statuses(completed.stdout)
    used = {kind.exit_code for kind in error_classes()} | STATUSES_OF_THEIR_OWN
    assert set(statuses) == used, statuses


def test_the_statuses_rsync_has_mean_what_they_mean_in_rsync():
    statuses = {status: words.lower() for status, words in documented_statuses(run_cli("--help").stdout).items()}
    for meaning, status in RSYNC.items():
        words = {"syntax or usage": "usage", "starting the protocol": "starting the protocol",
                 "sigint": "sigint"}.get(meaning, meaning)
        assert words in statuses[status], (status, statuses[status])


def test_the_api_documentation_shows_each_class_with_its_statuses():
    text = (REPOSITORY / "docs" / "api.rst").read_text()
    table = text.split("Exceptions\n----------", 1)[1].split("\n\n.. automodule::", 1)[0]
    rows = {}
    for row in table.split("   * - ")[2:]:
        cells = [cell.strip() for cell in row.split("\n     - ")]
        rows[cells[0].split("``")[1]] = (int(cells[1]), int(cells[2].split()[0]))
    from pdiffcopy import errors

    for kind in error_classes():
        if kind is errors.Unsupported:  # a bug if ever seen: not for users to handle
            continue
        assert rows.get(kind.__name__) == (kind.exit_code, kind.http_status), kind.__name__

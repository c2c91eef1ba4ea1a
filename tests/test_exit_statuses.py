"""How the command ends: its exit statuses (rsync's table), and ending without a trace when called from Python."""

from __future__ import annotations

import os
import subprocess
import sys

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

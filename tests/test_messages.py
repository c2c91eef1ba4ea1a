"""What the command prints: -q is quiet but for errors, -v tells about the files, -vv the internals;
a server's log has one format.

(The ssh side of these, HOST:PATH named as typed, the remote's output and the install hints, is
in tests/test_ssh.py; the missing extras' hints in tests/test_cli_mistakes.py.)
"""

from __future__ import annotations

import re

from conftest import http_get, random_bytes, run_cli, start_server

#: Every line of a log: the time, the logger and process, the level, the message.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [\w.]+\[\d+\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S")


def make_tree(root):
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_bytes(b"in a tree")
    (root / "g").write_bytes(random_bytes(100_000, seed=4))
    (root / "link").symlink_to("g")
    return root


# -- -q ------------------------------------------------------------------------------------

def test_quiet_is_silent_about_a_successful_sync_that_warns(server, tmp_path, unique):
    """The server keeps no owners for an untrusted client: a warning, but no error; -q shows neither."""
    source = make_tree(tmp_path / "src")
    target = f"{server.base}/{unique}-tree/"
    loud = run_cli("-a", f"{source}/", target)
    assert loud.returncode == 0, loud.stderr
    assert "owners are not kept" in loud.stderr  # (the warning this test silences)
    (source / "g").write_bytes(random_bytes(100_000, seed=5))
    quiet = run_cli("-a", "-q", f"{source}/", target)
    assert quiet.returncode == 0, quiet.stderr
    assert (quiet.stdout, quiet.stderr) == ("", "")
    assert (server.root / f"{unique}-tree" / "g").read_bytes() == (source / "g").read_bytes()


def test_quiet_still_says_what_failed(tmp_path):
    completed = run_cli("-q", str(tmp_path / "missing"), str(tmp_path / "copy"))
    assert completed.returncode != 0
    assert "does not exist" in completed.stderr and completed.stdout == ""


# -- -v and -vv ----------------------------------------------------------------------------

def test_verbose_lists_the_files_a_tree_sync_transfers(tmp_path):
    source, target = make_tree(tmp_path / "src"), tmp_path / "dst"
    first = run_cli("-v", "-t", f"{source}/", str(target))
    assert first.returncode == 0, first.stderr
    listed = [line for line in first.stdout.splitlines() if not line.startswith("stats:")]
    assert listed == ["g", "link -> g", "sub/", "sub/f"], first.stdout
    assert " DEBUG " not in first.stderr, first.stderr  # the internals are -vv's
    (source / "sub" / "f").write_bytes(b"changed, and longer")
    (target / "stale").write_bytes(b"not in the source")
    second = run_cli("-v", "-t", "--delete", f"{source}/", str(target))
    assert second.returncode == 0, second.stderr
    listed = [line for line in second.stdout.splitlines() if not line.startswith("stats:")]
    assert listed == ["deleting stale", "sub/f"], second.stdout


def test_verbose_says_what_happened_to_a_single_file_and_debug_is_for_vv(tmp_path):
    (tmp_path / "a").write_bytes(random_bytes(3 * 1024 * 1024, seed=7))
    verbose = run_cli("-v", str(tmp_path / "a"), str(tmp_path / "b"))
    assert verbose.returncode == 0, verbose.stderr
    assert f"Synchronised {tmp_path / 'a'} to {tmp_path / 'b'}: 3 MiB moved" in verbose.stderr, verbose.stderr
    assert " DEBUG " not in verbose.stderr, verbose.stderr
    very = run_cli("-vv", str(tmp_path / "a"), str(tmp_path / "b"))
    assert very.returncode == 0, very.stderr
    assert " DEBUG " in very.stderr and "checked source and target" in very.stderr


def test_refinement_internals_are_not_normal_output(tmp_path):
    """Every block differs: refining them into pieces stops paying. That is -vv's business."""
    (tmp_path / "a").write_bytes(random_bytes(4 * 1024 * 1024, seed=8))
    for verbosity, shown in (("-v", False), ("-vv", True)):
        (tmp_path / "b").write_bytes(random_bytes(4 * 1024 * 1024, seed=9))
        completed = run_cli(verbosity, "--delta", "blocks", str(tmp_path / "a"), str(tmp_path / "b"))
        assert completed.returncode == 0, completed.stderr
        assert ("stopped paying" in completed.stderr) == shown, completed.stderr


# -- the server's log ----------------------------------------------------------------------

def test_every_line_of_the_servers_log_has_one_format(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "file").write_bytes(b"served")
    running = start_server(tmp_path / "root", tmp_path / "server.log", extra=("-v",))
    try:
        status, _, body = http_get(f"{running.base}/.pdiffcopy/stat/file")
        assert status == 200, body
        pushed = run_cli(str(tmp_path / "root" / "file"), f"{running.base}/copy")
        assert pushed.returncode == 0, pushed.stderr
    finally:
        assert running.stop() == 0
    lines = (tmp_path / "server.log").read_text().splitlines()
    assert any("gunicorn" in line for line in lines), lines  # gunicorn's own lines are there...
    assert [line for line in lines if not LOG_LINE.match(line)] == []  # ...in the one format
    assert not any("Current configuration" in line for line in lines)  # not its settings, one a line

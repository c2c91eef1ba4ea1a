"""Ctrl-C and the progress display: prompt stops, no orphaned processes, no half-written target."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from conftest import pdiffcopy_command, process_stats, random_bytes
from pdiffcopy.engine.filejob import Progress
from pdiffcopy.cli.progress import ProgressDisplay


def session_processes(session_id: int):
    """PIDs of live processes in a session (the client and any hashing processes it forked)."""
    return [pid for pid, fields in process_stats() if int(fields[3]) == session_id and fields[0] != "Z"]


def test_ctrl_c_stops_a_pull_promptly_and_leaves_nothing(server, tmp_path, unique):
    # Big enough that the pull is still running when the signal arrives.
    source = server.root / unique
    with open(source, "wb") as handle:
        chunk = random_bytes(1024 * 1024)
        for _ in range(400):
            handle.write(chunk)
    target = tmp_path / "target.img"
    process = subprocess.Popen(pdiffcopy_command("-c", "2", server.url(unique), str(target)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    # Interrupt once the sync is under way (its temporary file exists), not
    # while the interpreter is still starting.
    deadline = time.monotonic() + 30
    while not list(tmp_path.iterdir()) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.01)
    time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    started = time.monotonic()
    _, stderr = process.communicate(timeout=20)
    assert time.monotonic() - started < 10
    if process.returncode == 0:
        # The machine was fast enough to finish first: then the copy must be complete.
        assert target.read_bytes() == source.read_bytes()
    else:
        assert process.returncode == 20, stderr
        assert "Interrupted" in stderr
        assert "Traceback" not in stderr
        # A new target is written under a temporary name: nothing half-written under its name.
        assert not target.exists()
        assert [p.name for p in tmp_path.iterdir()] == []
    time.sleep(0.5)
    assert session_processes(process.pid) == []


def test_progress_line_shows_counts_rate_and_eta():
    progress = Progress()
    progress.phase = "comparing"
    progress.hash_total, progress.hashed = 4 * 1024 ** 3, 1024 ** 3
    progress.move_total, progress.moved = 512 * 1024 ** 2, 0
    line = ProgressDisplay(progress).render()
    # The rate and ETA follow bytes moved (none yet), not bytes hashed: see tests/test_progress.py.
    assert line.startswith("comparing: moved 0 bytes of 512 MiB, -/s (hashed 1 GiB of 4 GiB)")


def test_no_progress_output_when_stderr_is_not_a_terminal(tmp_path):
    (tmp_path / "a").write_bytes(random_bytes(300000))
    completed = subprocess.run(pdiffcopy_command("-b", "4K", str(tmp_path / "a"), str(tmp_path / "b")),
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert "\r" not in completed.stderr

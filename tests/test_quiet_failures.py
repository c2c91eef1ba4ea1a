"""Failures that are no one's error end quietly: a reader that closed the pipe (``| head``)."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import pdiffcopy_command, random_bytes

#: rsync's exit status when it cannot write its output ("errors with program diagnostics").
CLOSED_OUTPUT_STATUS = 13


def noise(stderr: str) -> list:
    """The lines of ``stderr`` that would tell a user something went wrong."""
    return [line for line in stderr.splitlines()
            if " ERROR " in line or "Traceback" in line or "Broken pipe" in line or "Exception" in line]


def run_into_a_closed_pipe(*args: str, cwd) -> subprocess.CompletedProcess:
    """Run the command with standard output a pipe whose reader is gone before it starts."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(pdiffcopy_command(*args), stdout=writer, stderr=subprocess.PIPE, text=True,
                              timeout=120, cwd=cwd)
    finally:
        os.close(writer)


def make_tree(root, count: int) -> None:
    root.mkdir()
    for number in range(count):
        (root / f"file-{number:05d}.txt").write_text(f"{number}\n")


def test_a_diff_piped_into_head_ends_quietly(tmp_path):
    """``pdiffcopy --diff -a SRC/ DST/ | head -1``: more lines than a pipe holds, the reader leaves after one."""
    make_tree(tmp_path / "src", 3000)
    (tmp_path / "dst").mkdir()
    process = subprocess.Popen(pdiffcopy_command("--diff", "-a", "src/", "dst/"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    first = process.stdout.readline()
    if first.startswith("changed    dir     ./"):  # the root's own time comes first
        first = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read()
    process.wait(timeout=120)
    assert "file-00000.txt" in first
    assert noise(stderr) == [], stderr
    assert process.returncode == CLOSED_OUTPUT_STATUS, stderr
    assert os.listdir(tmp_path / "dst") == []


@pytest.mark.parametrize("options", [("--stats", "-a"), ("-n", "-a")], ids=["stats", "dry-run"])
def test_a_tree_sync_whose_output_nobody_reads_ends_quietly(tmp_path, options):
    make_tree(tmp_path / "src", 20)
    completed = run_into_a_closed_pipe(*options, "src/", "dst/", cwd=tmp_path)
    assert noise(completed.stderr) == [], completed.stderr
    assert completed.returncode == CLOSED_OUTPUT_STATUS, completed.stderr


def test_a_file_dry_run_whose_similarity_nobody_reads_ends_quietly(tmp_path):
    (tmp_path / "a.img").write_bytes(random_bytes(200_000))
    (tmp_path / "b.img").write_bytes(random_bytes(200_000, seed=2))
    completed = run_into_a_closed_pipe("-n", "a.img", "b.img", cwd=tmp_path)
    assert noise(completed.stderr) == [], completed.stderr
    assert completed.returncode == CLOSED_OUTPUT_STATUS, completed.stderr


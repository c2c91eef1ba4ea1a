"""Local-to-local syncs through the command line: the kernel's fast paths and cache control."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import mutate, random_bytes, run_cli

SIZE = 5 * 1024 * 1024 + 7


@pytest.mark.parametrize("method", ["copy_file_range", "sendfile", "readwrite"])
def test_whole_file_copy_takes_the_forced_path(tmp_path, method):
    data = random_bytes(SIZE)
    (tmp_path / "a").write_bytes(data)
    completed = run_cli("-v", str(tmp_path / "a"), str(tmp_path / "b"),
                        env_extra={"PDIFFCOPY_COPY_METHOD": method})
    assert completed.returncode == 0, completed.stderr
    assert f"Copied {tmp_path / 'a'} with {method}" in completed.stderr
    assert (tmp_path / "b").read_bytes() == data


def test_no_fastpath_switch_forces_plain_reads_and_writes(tmp_path):
    data = random_bytes(SIZE, seed=5)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(b"old and longer" * 1000000)
    completed = run_cli("-v", "-W", str(tmp_path / "a"), str(tmp_path / "b"),
                        env_extra={"PDIFFCOPY_NO_FASTPATH": "1"})
    assert completed.returncode == 0, completed.stderr
    assert "with readwrite" in completed.stderr
    assert (tmp_path / "b").read_bytes() == data


def test_local_delta_moves_only_changed_blocks(tmp_path):
    data = random_bytes(SIZE, seed=6)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(mutate(data, [100, 3 * 1024 * 1024 + 5]))
    completed = run_cli("-b", "64K", str(tmp_path / "a"), str(tmp_path / "b"))
    assert completed.returncode == 0, completed.stderr
    assert "128 KiB moved, 2 of 81 blocks differed" in completed.stderr
    assert (tmp_path / "b").read_bytes() == data


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is not installed")
def test_cache_drop_leaves_the_copy_out_of_the_page_cache(tmp_path):
    data = random_bytes(8 * 1024 * 1024, seed=7)
    (tmp_path / "a").write_bytes(data)
    completed = run_cli("--cache", "drop", str(tmp_path / "a"), str(tmp_path / "b"))
    assert completed.returncode == 0, completed.stderr
    # Neither the copy nor its verification left the files in the page cache.
    for name in ("a", "b"):
        resident = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                                   str(tmp_path / name)], capture_output=True, text=True)
        assert resident.returncode == 0
        assert int(resident.stdout.strip() or 0) < 1024 * 1024, name
    assert (tmp_path / "b").read_bytes() == data


def test_source_and_target_the_same_file_is_refused(tmp_path):
    (tmp_path / "a").write_bytes(b"data")
    completed = run_cli(str(tmp_path / "a"), str(tmp_path / "." / "a"))
    assert completed.returncode == 2
    assert "same file" in completed.stderr
    assert (tmp_path / "a").read_bytes() == b"data"

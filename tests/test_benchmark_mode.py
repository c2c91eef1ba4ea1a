"""Benchmark mode (-B): the table reports what each round really moved."""

from __future__ import annotations

import re

from conftest import random_bytes, run_cli

#: Small files keep the rounds (and the whole-file copy comparison) to a few seconds.
SIZE = 4 * 1024 * 1024


def table_rows(output: str):
    """(delta, data moved) of every row of the rounds table."""
    return re.findall(r"^\|\s*([0-9]+%)\s*\|\s*([^|]+?)\s*\|", output, re.MULTILINE)


def test_benchmark_reports_the_measured_delta_of_a_target_that_differed(tmp_path):
    """A target that differs from the source moves whole in round 1: that round's delta is 100 %."""
    source, target = tmp_path / "a.bin", tmp_path / "b.bin"
    source.write_bytes(random_bytes(SIZE, seed=1))
    target.write_bytes(random_bytes(SIZE, seed=2))
    result = run_cli("-B", "4", "-b", "1MiB", str(source), str(target), timeout=60)
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert rows[:4] == [("100%", "4 MiB"), ("50%", "2 MiB"), ("75%", "3 MiB"), ("100%", "4 MiB")], result.stdout
    assert target.read_bytes() == source.read_bytes()

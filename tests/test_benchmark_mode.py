"""Benchmark mode (-B): the table reports what each round really moved, under headers that say so."""

from __future__ import annotations

import re

from conftest import random_bytes, run_cli

#: Small files keep the rounds (and the whole-file copy comparison) to a few seconds.
SIZE = 4 * 1024 * 1024


def rounds_table(output: str):
    """The rows of the rounds table (the first table), each a dict by column header."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != len(header) or not cells[0].isdigit():
            break  # the next table
        rows.append(dict(zip(header, cells)))
    return rows


def test_benchmark_reports_the_measured_delta_of_a_target_that_differed(tmp_path):
    """A target that differs from the source moves whole in round 1, although 25 % of it was mutated."""
    source, target = tmp_path / "a.bin", tmp_path / "b.bin"
    source.write_bytes(random_bytes(SIZE, seed=1))
    target.write_bytes(random_bytes(SIZE, seed=2))
    result = run_cli("-B", "4", "-b", "1MiB", str(source), str(target), timeout=60)
    assert result.returncode == 0, result.stderr
    rows = rounds_table(result.stdout)
    assert [(row["Blocks mutated"], row["Data moved"], row["Of the file"]) for row in rows] == [
        ("25%", "4 MiB", "100%"), ("50%", "2 MiB", "50%"), ("75%", "3 MiB", "75%"), ("100%", "4 MiB", "100%")], \
        result.stdout
    assert target.read_bytes() == source.read_bytes()


def test_a_zero_filled_file_says_what_was_mutated_and_what_moved(tmp_path):
    """Zeros overwritten with random bytes come back from the target's own zeros: nothing moves.
    The row says both: the share mutated (as the log does) and the bytes moved."""
    source, target = tmp_path / "zeros.src", tmp_path / "zeros.dst"
    source.write_bytes(bytes(SIZE))
    target.write_bytes(bytes(SIZE))
    result = run_cli("-B", "3", "-b", "1MiB", str(source), str(target), timeout=60)
    assert result.returncode == 0, result.stderr
    logged = re.findall(r"Round \d of 3: (\d+%) of the blocks mutated, (.+?) moved \((\d+%) of the file\)",
                        result.stderr)
    rows = rounds_table(result.stdout)
    assert [(row["Blocks mutated"], row["Data moved"], row["Of the file"]) for row in rows] == logged, \
        (result.stdout, result.stderr)
    assert [row["Blocks mutated"] for row in rows] == ["33%", "67%", "100%"]
    assert target.read_bytes() == source.read_bytes()

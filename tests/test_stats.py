"""The final stats line (rsync's --stats figures): bytes moved, bytes on the wire, elapsed time, rate."""

from __future__ import annotations

import re

import pytest

from conftest import random_bytes, run_cli

MiB = 1024 ** 2

STATS = re.compile(r"^stats: moved (?P<moved>\d+) bytes(?: in (?P<files>\d+) files?)?"
                   r"(?:, (?P<sent>\d+) bytes sent and (?P<received>\d+) bytes received on the wire)?"
                   r", (?P<seconds>[\d.]+) s, (?P<rate>[\d.]+ \S+/s)$", re.MULTILINE)


def stats(done) -> dict:
    assert done.returncode == 0, done.stderr
    found = STATS.search(done.stdout)
    assert found, f"no stats line in {done.stdout!r}"
    return {key: value for key, value in found.groupdict().items() if value is not None}


@pytest.mark.parametrize("option", ["--stats", "-v"])
def test_local_file_sync_prints_stats(tmp_path, option):
    data = random_bytes(2 * MiB)
    (tmp_path / "a").write_bytes(data)
    got = stats(run_cli("--no-progress", option, tmp_path / "a", tmp_path / "b"))
    assert int(got["moved"]) == len(data)
    assert "sent" not in got  # a local sync has no wire
    assert float(got["seconds"]) > 0


def test_no_stats_line_without_the_options(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1000)
    done = run_cli("--no-progress", tmp_path / "a", tmp_path / "b")
    assert done.returncode == 0 and "stats:" not in done.stdout


def test_pull_and_push_count_bytes_on_the_wire(tmp_path, server, unique):
    data = random_bytes(2 * MiB, seed=5)
    (server.root / unique).write_bytes(data)
    pulled = stats(run_cli("--no-progress", "--stats", server.url(unique), tmp_path / "b"))
    assert int(pulled["moved"]) == len(data)
    # The data came in, plus HTTP's headers and the hashes: a little more, never less.
    assert len(data) <= int(pulled["received"]) < len(data) + MiB // 4
    assert int(pulled["sent"]) < MiB // 4
    (tmp_path / "b").write_bytes(random_bytes(2 * MiB, seed=6))
    pushed = stats(run_cli("--no-progress", "--stats", tmp_path / "b", server.url(unique)))
    assert int(pushed["moved"]) == len(data)
    assert len(data) <= int(pushed["sent"]) < len(data) + MiB // 4
    # A new target is written under a temporary name: its connections count too.
    fresh = stats(run_cli("--no-progress", "--stats", tmp_path / "b", server.url(unique + ".new")))
    assert int(fresh["moved"]) == len(data)
    assert len(data) <= int(fresh["sent"]) < len(data) + MiB // 4


def test_tree_syncs_print_stats_local_and_remote(tmp_path, server, unique):
    source = tmp_path / "src"
    (source / "d").mkdir(parents=True)
    sizes = {f"d/f{i}": 100_000 + i for i in range(80)}  # enough files to fork the workers
    for name, size in sizes.items():
        (source / name).write_bytes(random_bytes(size, seed=size))
    total = sum(sizes.values())
    local = stats(run_cli("--no-progress", "--stats", f"{source}/", tmp_path / "dst"))
    assert (int(local["moved"]), int(local["files"])) == (total, 80)
    assert "sent" not in local
    url = server.url(unique.replace(".img", "")) + "/"
    pushed = stats(run_cli("--no-progress", "--stats", "-c", "3", f"{source}/", url))
    assert (int(pushed["moved"]), int(pushed["files"])) == (total, 80)
    assert total <= int(pushed["sent"]) < total + MiB
    pulled = stats(run_cli("--no-progress", "-v", "-c", "3", url, tmp_path / "back"))
    assert total <= int(pulled["received"]) < total + MiB


def test_stats_is_a_sync_option(tmp_path):
    done = run_cli("--stats", "--root", tmp_path)
    assert done.returncode == 1 and "--stats" in done.stderr


@pytest.mark.parametrize("moved, seconds, shown", [(89, 1.0025, "89 bytes/s"), (1, 3.0, "0 bytes/s"),
                                                    (1536, 1.0, "1.5 KiB/s")])
def test_a_slow_rate_is_printed_in_whole_bytes(capsys, moved, seconds, shown):
    """A rate below 1 KiB/s was once printed as a raw float: "88.7804189463045 bytes/s"."""
    from pdiffcopy.cli.reports import print_stats

    print_stats(moved, None, seconds, remote=False)
    line = capsys.readouterr().out.strip()
    assert line.endswith(f", {shown}"), line

"""``--json`` (events as JSON lines on stdout) and ``--metrics-file`` (Prometheus text), read as a
script and node_exporter would: every line parsed, every count checked against the disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import pdiffcopy_command, random_bytes, run_cli
import test_ssh
from test_ssh import over_ssh

MiB = 1024 * 1024

#: The ssh tests' sshd, for a push over ssh.
sshd = test_ssh.sshd


def events_of(stdout: str) -> list:
    """Every line of stdout, parsed: a line that is not a JSON object fails the test."""
    events = [json.loads(line) for line in stdout.splitlines()]
    assert all(isinstance(event, dict) and "event" in event for event in events), stdout
    return events


def check_frame(events: list, status: int) -> dict:
    """``started`` first, ``finished`` (status 0) or ``failed`` last, nothing else once each; the last."""
    names = [event["event"] for event in events]
    assert names[0] == "started" and names.count("started") == 1, names
    assert events[0]["schema"] == 1
    last = events[-1]
    assert last["event"] == ("finished" if status == 0 else "failed"), names
    assert last["exit_status"] == status
    assert names.count("finished") + names.count("failed") == 1, names
    return last


def test_a_pulled_file_says_what_it_moved(server, tmp_path, unique):
    data = random_bytes(3 * MiB + 5, seed=81)
    (server.root / unique).write_bytes(data)
    target = tmp_path / "copy.img"
    done = run_cli("--json", server.url(unique), str(target))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # the human lines are off
    events = events_of(done.stdout)
    last = check_frame(events, 0)
    assert events[0]["source"] == server.url(unique) and events[0]["target"] == str(target)
    files = [event for event in events if event["event"] == "file"]
    assert [event["path"] for event in files] == [str(target)]
    assert last["bytes_moved"] == files[0]["bytes_moved"] == len(data) == target.stat().st_size
    assert last["files_copied"] == 1 and last["unchanged"] == 0 and last["verified"] is True
    assert target.read_bytes() == data
    again = run_cli("--json", server.url(unique), str(target))
    last = check_frame(events_of(again.stdout), 0)
    assert (last["files_copied"], last["unchanged"], last["bytes_moved"]) == (0, 1, 0)
    assert [event for event in events_of(again.stdout) if event["event"] == "file"] == []


def test_a_pushed_tree_has_an_event_per_change_and_counts_the_disk_agrees_with(server, tmp_path, unique):
    source = tmp_path / "src"
    for index in range(12):
        path = source / f"d{index % 3}" / f"f{index}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(random_bytes(1000 + 700 * index, seed=index))
    (source / "link").symlink_to("d0/f0.bin")
    done = run_cli("--json", "-a", f"{source}/", server.url(unique) + "/")
    assert done.returncode == 0, done.stderr
    events = events_of(done.stdout)
    last = check_frame(events, 0)
    target = server.root / unique
    on_disk = sorted(str(path.relative_to(target)) for path in target.rglob("*") if path.is_file()
                     and not path.is_symlink())
    changes = {event["path"]: event["change"] for event in events if event["event"] == "file"}
    assert sorted(path for path, change in changes.items() if change == "file") == on_disk
    assert changes["link"] == "symlink" and os.readlink(target / "link") == "d0/f0.bin"
    assert sorted(path for path, change in changes.items() if change == "directory") == ["d0", "d1", "d2"]
    assert last["files_copied"] == len(on_disk) == 12
    assert last["bytes_moved"] == sum((target / path).stat().st_size for path in on_disk)
    assert last["failures"] == 0 and last["directories_made"] == 3


def test_over_ssh_the_events_name_the_locations_as_typed(sshd, tmp_path):
    data = random_bytes(MiB + 3, seed=85)
    (tmp_path / "src.img").write_bytes(data)
    typed = f"127.0.0.1:{tmp_path}/pushed.img"
    done = over_ssh(sshd, "--json", str(tmp_path / "src.img"), typed)
    assert done.returncode == 0, done.stderr
    events = events_of(done.stdout)
    last = check_frame(events, 0)
    assert events[0]["target"] == typed
    assert [event["path"] for event in events if event["event"] == "file"] == [typed]
    assert last["bytes_moved"] == len(data) and (tmp_path / "pushed.img").read_bytes() == data


def test_a_failed_sync_ends_with_its_exit_status_and_one_error_line(tmp_path):
    done = run_cli("--json", str(tmp_path / "missing.img"), str(tmp_path / "copy.img"))
    assert done.returncode == 3
    last = check_frame(events_of(done.stdout), 3)
    assert "missing.img" in last["error"]
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_ctrl_c_ends_with_a_failed_event_and_status_20(server, tmp_path, unique):
    (server.root / unique).write_bytes(random_bytes(16 * MiB, seed=83))
    target = tmp_path / "copy.img"
    process = subprocess.Popen(pdiffcopy_command("--json", "--bwlimit", "2M", server.url(unique), str(target)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 30
    while not list(tmp_path.iterdir()) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.01)
    time.sleep(2.5)  # long enough for progress events (at most one a second)
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 20, stderr
    events = events_of(stdout)
    last = check_frame(events, 20)
    assert last["error"] == "interrupted"
    progress = [event for event in events if event["event"] == "progress"]
    assert 1 <= len(progress) <= last["seconds"] + 1, progress  # at most one a second
    assert all(later["seconds"] - earlier["seconds"] >= 0.9 for earlier, later in zip(progress, progress[1:]))
    assert all(0 <= event["bytes_moved"] <= 16 * MiB for event in progress)
    assert not target.exists()


def test_the_metrics_file_is_what_node_exporter_reads(server, tmp_path, unique):
    parser = pytest.importorskip("prometheus_client.parser")
    data = random_bytes(2 * MiB, seed=84)
    (server.root / unique).write_bytes(data)
    metrics = tmp_path / "metrics" / "pdiffcopy.prom"
    metrics.parent.mkdir()
    done = run_cli("--metrics-file", str(metrics), server.url(unique), str(tmp_path / "copy.img"))
    assert done.returncode == 0, done.stderr
    assert "Synchronised" in done.stderr  # without --json the summary stays
    values = {sample.name: sample.value for family in parser.text_string_to_metric_families(metrics.read_text())
              for sample in family.samples}
    assert values["pdiffcopy_last_run_exit_status"] == 0
    assert values["pdiffcopy_last_run_bytes_moved"] == len(data) == (tmp_path / "copy.img").stat().st_size
    assert values["pdiffcopy_last_run_files_copied"] == 1
    assert abs(values["pdiffcopy_last_run_timestamp_seconds"] - time.time()) < 60
    assert os.listdir(metrics.parent) == ["pdiffcopy.prom"]  # replaced whole: no temporary left
    failed = run_cli("--metrics-file", str(metrics), server.url(unique + ".missing"), str(tmp_path / "other.img"))
    assert failed.returncode == 3
    values = {sample.name: sample.value for family in parser.text_string_to_metric_families(metrics.read_text())
              for sample in family.samples}
    assert values["pdiffcopy_last_run_exit_status"] == 3


def test_a_metrics_file_that_cannot_be_written_fails_the_run_in_one_line(tmp_path):
    (tmp_path / "a.img").write_bytes(b"data")
    done = run_cli("--metrics-file", str(tmp_path / "missing" / "m.prom"), str(tmp_path / "a.img"),
                   str(tmp_path / "b.img"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].endswith("No such file or directory")
    assert "Traceback" not in done.stderr


def test_json_is_a_sync_option():
    done = run_cli("--json", "--listen", "127.0.0.1:1")
    assert done.returncode == 1 and "--json" in done.stderr


@pytest.mark.parametrize("option", ["--json", "--metrics-file"])
@pytest.mark.parametrize("other", ["--remove", "-B"])
def test_what_is_not_a_sync_is_refused_in_one_line_before_anything_is_done(tmp_path, option, other):
    (tmp_path / "x").mkdir()
    (tmp_path / "a.img").write_bytes(b"data")
    metrics = tmp_path / "m.prom"
    given = [option] + ([str(metrics)] if option == "--metrics-file" else [])
    paths = [str(tmp_path / "x")] if other == "--remove" else ["2", str(tmp_path / "a.img"), str(tmp_path / "b.img")]
    done = run_cli(*given, other, *paths)
    assert done.returncode == 1 and option in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""
    assert (tmp_path / "x").is_dir() and not (tmp_path / "b.img").exists() and not metrics.exists()

"""``--digest-file``: the target's digests as the last sync left it, so that the next sync need not
read the target; checked before it is relied on (loop devices over files in the test's directory)."""

from __future__ import annotations

import os
import re

import pytest

from conftest import device_bytes, one_line_error, random_bytes, run_cli, write_through_device
import test_ssh
from test_ssh import over_ssh
from pdiffcopy.local import devices

MiB = 1024 * 1024
SIZE = 16 * MiB

#: The ssh tests' sshd, for a pull over ssh.
sshd = test_ssh.sshd


def sectors_read(device: str) -> int:
    return devices.counters(os.stat(device).st_rdev).sectors_read








@pytest.fixture
def synced(loop_devices, tmp_path):
    """A source and a target device synced once with a record: (source, target, target's backing file, record)."""
    source, _ = loop_devices.new("source.img", SIZE, random_bytes(SIZE, seed=41))
    target, backing = loop_devices.new("target.img", SIZE, random_bytes(SIZE, seed=42))
    record = str(tmp_path / "target.digests")
    done = run_cli("--digest-file", record, source, target)
    assert done.returncode == 0, done.stderr
    assert os.path.exists(record)
    assert device_bytes(target, SIZE) == device_bytes(source, SIZE)
    assert [name for name in os.listdir(tmp_path) if "pdiffcopy" in name] == []  # renamed, nothing left
    return source, target, backing, record


def test_with_a_record_and_no_change_the_target_is_not_read(synced):
    source, target, _, record = synced
    target_before, source_before = sectors_read(target), sectors_read(source)
    done = run_cli("--stats", "--digest-file", record, source, target)
    assert done.returncode == 0, done.stderr
    assert "0 of 16 blocks differed" in done.stderr, done.stderr
    assert sectors_read(target) == target_before
    assert (sectors_read(source) - source_before) * 512 >= SIZE  # the source alone is read


def test_with_a_tenth_changed_only_that_moves_and_is_read_back(synced):
    source, target, _, record = synced
    change = random_bytes(2 * MiB, seed=43)
    write_through_device(source, 5 * MiB, change[:MiB])
    write_through_device(source, 11 * MiB, change[MiB:])
    target_before = sectors_read(target)
    done = run_cli("--stats", "--digest-file", record, source, target)
    assert done.returncode == 0, done.stderr
    assert "2 MiB moved, 2 of 16 blocks differed" in done.stderr, done.stderr
    assert (sectors_read(target) - target_before) * 512 <= 2 * MiB  # the read-back of what was written
    assert device_bytes(target, SIZE) == device_bytes(source, SIZE)
    # The record was made again: the next sync trusts it too.
    target_before = sectors_read(target)
    assert run_cli("--digest-file", record, source, target).returncode == 0
    assert sectors_read(target) == target_before


def test_a_target_written_behind_the_records_back_is_refused(synced):
    source, target, _, record = synced
    write_through_device(target, 3 * MiB, b"written by someone else!" * 4096)
    written = device_bytes(target, SIZE)
    done = run_cli("--digest-file", record, source, target)
    line = one_line_error(done)
    assert "was written since the digest record" in line and "--verify-whole" in line, line
    assert device_bytes(target, SIZE) == written  # refused before anything was written
    done = run_cli("--verify-whole", "--digest-file", record, source, target)
    assert done.returncode == 0, done.stderr
    assert device_bytes(target, SIZE) == device_bytes(source, SIZE)
    assert run_cli("--digest-file", record, source, target).returncode == 0  # made again


def test_a_record_of_another_device_or_block_size_is_refused(synced, loop_devices):
    source, target, _, record = synced
    other, _ = loop_devices.new("other.img", SIZE, device_bytes(target, SIZE))
    assert "made for another target" in one_line_error(run_cli("--digest-file", record, source, other))
    line = one_line_error(run_cli("-b", "512K", "--digest-file", record, source, target))
    assert "1048576-byte blocks" in line and "524288-byte" in line, line


def test_verify_whole_catches_a_write_below_the_device(synced):
    """A write to a loop device's backing file passes its counters by: trusted, until --verify-whole."""
    source, target, backing, record = synced
    with open(backing, "r+b") as handle:
        handle.seek(7 * MiB + 100)
        handle.write(b"bit rot")
        os.fsync(handle.fileno())
    damaged = backing.read_bytes()
    assert run_cli("--digest-file", record, source, target).returncode == 0
    assert backing.read_bytes() == damaged  # trusted: not seen (docs/design.rst says so)
    before = sectors_read(target)
    done = run_cli("--verify-whole", "--digest-file", record, source, target)
    assert done.returncode == 0, done.stderr
    assert "1 block(s) of" in done.stderr and "differed from the digest record" in done.stderr, done.stderr
    assert (sectors_read(target) - before) * 512 >= SIZE
    assert device_bytes(target, SIZE) == device_bytes(source, SIZE)


def test_a_damaged_record_is_refused(synced):
    source, target, _, record = synced
    with open(record, "r+b") as handle:
        handle.seek(-40, os.SEEK_END)
        handle.write(b"\xff")
    line = one_line_error(run_cli("--digest-file", record, source, target))
    assert "damaged" in line and "--verify-whole" in line, line


def test_a_regular_file_target_modified_since_is_refused(tmp_path):
    source, target, record = tmp_path / "source.img", tmp_path / "target.img", str(tmp_path / "digests")
    source.write_bytes(random_bytes(4 * MiB, seed=44))
    target.write_bytes(random_bytes(4 * MiB, seed=45))
    assert run_cli("--digest-file", record, str(source), str(target)).returncode == 0
    assert target.read_bytes() == source.read_bytes()
    assert run_cli("--digest-file", record, str(source), str(target)).returncode == 0
    with open(target, "r+b") as handle:
        handle.write(b"x")
    assert "was modified since" in one_line_error(run_cli("--digest-file", record, str(source), str(target)))


@pytest.mark.parametrize("options, said", [
    (["--verify-whole"], "--verify-whole needs --digest-file"),
    (["--changed-since", "/dev/null"], "--changed-since needs --digest-file"),
    (["--digest-file", "D", "--atomic"], "--atomic cannot be used with --digest-file"),
    (["--digest-file", "D", "-m", "xxh3_64"], "strong enough"),
    (["--digest-file", "D", "--delta", "chunks"], "--delta chunks cannot"),
    (["--digest-file", "D", "-t"], "-a, -t, -o, -X and -A cannot be used with --digest-file"),
])
def test_options_a_record_cannot_go_with_are_refused(tmp_path, options, said):
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    source.write_bytes(b"data")
    done = run_cli(*options, str(source), str(target))
    assert said in one_line_error(done)
    assert not target.exists()


def test_a_dry_run_with_a_record_reads_no_target_and_keeps_the_record(synced):
    source, target, _, record = synced
    write_through_device(source, 4 * MiB, random_bytes(MiB, seed=46))
    kept = open(record, "rb").read()
    before = sectors_read(target)
    done = run_cli("-n", "--digest-file", record, source, target)
    assert done.returncode == 0, done.stderr
    assert "1 of 16 blocks differ" in done.stdout, done.stdout
    assert sectors_read(target) == before
    assert open(record, "rb").read() == kept


def test_a_pull_into_a_device_uses_the_record(server, loop_devices, tmp_path, unique):
    data = random_bytes(SIZE, seed=47)
    (server.root / unique).write_bytes(data)
    target, _ = loop_devices.new("target.img", SIZE)
    record = str(tmp_path / "digests")
    assert run_cli("--digest-file", record, server.url(unique), target).returncode == 0
    changed = bytearray(data)
    changed[9 * MiB : 9 * MiB + 10] = b"0123456789"
    (server.root / unique).write_bytes(bytes(changed))
    before = sectors_read(target)
    done = run_cli("--stats", "--digest-file", record, server.url(unique), target)
    assert done.returncode == 0, done.stderr
    assert "1 of 16 blocks differed" in done.stderr, done.stderr
    # Only the changed block is read: its pieces hashed (refinement), then read back. Up to
    # twice that: where the cache lost the device's pages (a busy machine), the kernel's
    # readahead around those reads reaches the device too (3 MiB once in a full run).
    assert (sectors_read(target) - before) * 512 <= 4 * MiB
    # Refined across the network: a piece of the block moves, not the whole block.
    moved = int(re.search(r"moved (\d+) bytes", done.stdout).group(1))
    assert 10 <= moved <= MiB // 8, done.stdout
    assert device_bytes(target, SIZE) == bytes(changed)


def test_a_remote_target_is_refused():
    from pdiffcopy import api
    from pdiffcopy.errors import UsageError

    with pytest.raises(UsageError, match="--digest-file needs a local TARGET"):
        api.sync("/etc/hostname", "http://127.0.0.1:9/file", digest_file="/nonexistent/digests")


def test_a_pull_over_ssh_into_a_device_reads_only_the_source(sshd, loop_devices, tmp_path):
    data = random_bytes(SIZE, seed=48)
    (tmp_path / "remote.img").write_bytes(data)
    target, _ = loop_devices.new("target.img", SIZE)
    record = str(tmp_path / "digests")
    done = over_ssh(sshd, "--digest-file", record, f"127.0.0.1:{tmp_path}/remote.img", target)
    assert done.returncode == 0, done.stderr
    before = sectors_read(target)
    done = over_ssh(sshd, "--stats", "--digest-file", record, f"127.0.0.1:{tmp_path}/remote.img", target)
    assert done.returncode == 0, done.stderr
    assert "0 of 16 blocks differed" in done.stderr, done.stderr
    assert sectors_read(target) == before
    assert device_bytes(target, SIZE) == data


def test_a_flush_of_the_target_is_no_write_the_record_refuses(synced):
    """``fsync`` (``blockdev --flushbufs``, a VM's flush) counts as a write request of no sector:
    the record still describes the target, and the next sync trusts it."""
    source, target, _, record = synced
    fd = os.open(target, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    target_before = sectors_read(target)
    done = run_cli("--stats", "--digest-file", record, source, target)
    assert done.returncode == 0, done.stderr
    assert "0 of 16 blocks differed" in done.stderr, done.stderr
    assert sectors_read(target) == target_before

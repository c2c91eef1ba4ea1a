"""Block devices as a single sync's source and target, locally: loop devices over files in the
test's directory (the ``loop_devices`` fixture detaches them, also on failure)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from conftest import device_bytes, random_bytes, run_cli

MiB = 1024 * 1024


def digest(path, length=None) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read(length) if length is not None else handle.read()).hexdigest()


def allocated(path) -> int:
    os.sync()
    return os.stat(path).st_blocks * 512




def one_line_error(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return lines[-1]


def test_a_device_syncs_to_a_device_moving_only_what_differs(loop_devices):
    data = random_bytes(16 * MiB, seed=11)
    source, _ = loop_devices.new("source.img", 16 * MiB, data)
    old = bytearray(data)
    old[5 * MiB : 5 * MiB + 100] = bytes(100)  # one block differs
    target, target_backing = loop_devices.new("target.img", 16 * MiB, bytes(old))
    done = run_cli("--stats", source, target)
    assert done.returncode == 0, done.stderr
    assert device_bytes(target, 16 * MiB) == data
    assert "4 KiB moved, 1 of 16 blocks differed" in done.stderr, done.stderr
    assert os.path.getsize(target_backing) == 16 * MiB


def test_a_device_syncs_to_a_new_file_and_back(loop_devices, tmp_path):
    data = random_bytes(8 * MiB, seed=12)
    source, _ = loop_devices.new("source.img", 8 * MiB, data)
    copy = tmp_path / "copy.img"
    done = run_cli(source, str(copy))
    assert done.returncode == 0, done.stderr
    assert copy.read_bytes() == data
    changed = bytearray(data)
    changed[3 * MiB : 3 * MiB + 10] = b"0123456789"
    copy.write_bytes(bytes(changed))
    target, _ = loop_devices.new("target.img", 8 * MiB)
    done = run_cli(str(copy), target)
    assert done.returncode == 0, done.stderr
    assert device_bytes(target, 8 * MiB) == bytes(changed)
    done = run_cli(source, str(copy))  # a delta into the existing file
    assert done.returncode == 0, done.stderr
    assert copy.read_bytes() == data


def test_a_larger_target_device_keeps_its_tail_and_says_so(loop_devices):
    data = random_bytes(4 * MiB, seed=13)
    tail = random_bytes(4 * MiB, seed=14)
    source, _ = loop_devices.new("source.img", 4 * MiB, data)
    target, backing = loop_devices.new("target.img", 8 * MiB, bytes(4 * MiB) + tail)
    done = run_cli(source, target)
    assert done.returncode == 0, done.stderr
    assert "left as they were" in done.stderr, done.stderr
    assert device_bytes(target, 8 * MiB) == data + tail
    assert os.path.getsize(backing) == 8 * MiB


def test_a_smaller_target_device_is_refused_with_nothing_written(loop_devices):
    source, _ = loop_devices.new("source.img", 8 * MiB, random_bytes(8 * MiB, seed=15))
    old = random_bytes(4 * MiB, seed=16)
    target, backing = loop_devices.new("target.img", 4 * MiB, old)
    done = run_cli(source, target)
    assert "smaller than the source" in one_line_error(done)
    assert device_bytes(target, 4 * MiB) == old
    assert backing.read_bytes() == old


@pytest.mark.parametrize("option", ["--atomic", "--partial"])
def test_replacing_a_device_is_refused_before_anything_is_written(loop_devices, option):
    source, _ = loop_devices.new("source.img", 4 * MiB, random_bytes(4 * MiB, seed=17))
    old = random_bytes(4 * MiB, seed=18)
    target, backing = loop_devices.new("target.img", 4 * MiB, old)
    done = run_cli(option, source, target)
    assert option in one_line_error(done)
    assert backing.read_bytes() == old
    assert sorted(os.listdir(os.path.dirname(target))) == sorted(os.listdir("/dev"))  # nothing made beside it


def test_with_sparse_a_thin_target_stays_thin(loop_devices, tmp_path):
    """-S: the source's holes and zeros are discarded on the device (a loop device punches its backing file)."""
    source = tmp_path / "sparse.img"
    with open(source, "wb") as handle:
        handle.truncate(32 * MiB)
        handle.seek(4 * MiB)
        handle.write(random_bytes(2 * MiB, seed=19))
        handle.seek(20 * MiB)
        handle.write(bytes(4 * MiB))  # zeros written as data
    target, backing = loop_devices.new("target.img", 32 * MiB, random_bytes(32 * MiB, seed=20))
    assert allocated(backing) >= 32 * MiB
    done = run_cli("-S", str(source), target)
    assert done.returncode == 0, done.stderr
    assert device_bytes(target, 32 * MiB) == source.read_bytes()
    assert allocated(backing) <= 3 * MiB


def test_without_sparse_the_source_holes_are_written_as_zeros(loop_devices, tmp_path):
    source = tmp_path / "sparse.img"
    with open(source, "wb") as handle:
        handle.truncate(16 * MiB)
        handle.seek(8 * MiB)
        handle.write(random_bytes(MiB, seed=21))
    target, _ = loop_devices.new("target.img", 16 * MiB, random_bytes(16 * MiB, seed=22))
    for options in (["-W"], []):  # whole: every byte written; delta: the old data in the holes replaced
        done = run_cli(*options, str(source), target)
        assert done.returncode == 0, done.stderr
        assert device_bytes(target, 16 * MiB) == source.read_bytes()
        with open(target, "r+b") as handle:
            handle.write(random_bytes(MiB, seed=23))  # old data in the first hole again


def test_a_dry_run_writes_nothing_to_a_device(loop_devices):
    source, _ = loop_devices.new("source.img", 4 * MiB, random_bytes(4 * MiB, seed=24))
    old = random_bytes(4 * MiB, seed=25)
    target, backing = loop_devices.new("target.img", 4 * MiB, old)
    done = run_cli("-n", source, target)
    assert done.returncode == 0, done.stderr
    assert backing.read_bytes() == old


def test_a_source_device_written_during_the_sync_is_reported(loop_devices, tmp_path):
    """A device has no mtime: its write counters tell that something wrote it meanwhile."""
    from pdiffcopy import api
    from pdiffcopy.engine.filejob import Progress
    from pdiffcopy.errors import Conflict

    source, _ = loop_devices.new("source.img", 8 * MiB, random_bytes(8 * MiB, seed=26))
    target = tmp_path / "copy.img"

    class WritesTheSource(Progress):
        written = False

        def add_moved(self, count: int) -> None:
            super().add_moved(count)
            if not self.written:
                self.written = True
                fd = os.open(source, os.O_WRONLY | os.O_DIRECT)
                try:
                    import mmap

                    page = mmap.mmap(-1, 4096)
                    page.write(b"changed!" * 512)
                    os.pwritev(fd, [page], 7 * MiB)
                    os.fsync(fd)
                finally:
                    os.close(fd)

    with pytest.raises(Conflict, match="Source changed during the sync"):
        api.sync(source, str(target), progress=WritesTheSource(), whole_file=True)


def test_a_mounted_device_is_refused_as_a_target(loop_devices, tmp_path):
    if not shutil.which("mkfs.ext4"):
        pytest.skip("no mkfs.ext4")
    target, _ = loop_devices.new("target.img", 16 * MiB)
    # Without lazy initialisation: the kernel would write the inode tables after the mount.
    subprocess.run(["mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", target],
                   check=True, capture_output=True)
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(["mount", target, str(mount)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount: {done.stderr.strip()}")
    try:
        before = device_bytes(target, 16 * MiB)
        source = tmp_path / "source.img"
        source.write_bytes(random_bytes(16 * MiB, seed=27))
        done = run_cli(str(source), target)
        assert "in use" in one_line_error(done)
        assert device_bytes(target, 16 * MiB) == before
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_character_device_is_still_refused(tmp_path):
    done = run_cli("/dev/zero", str(tmp_path / "zero.img"))
    assert "not a regular file" in one_line_error(done).lower()
    assert not (tmp_path / "zero.img").exists()

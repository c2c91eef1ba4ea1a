"""Whole-file local copies (pdiffcopy.local.fastcopy) on real files and real file systems.

Every copy method is exercised twice: where the kernel takes it by itself
(ext4 for copy_file_range, ext4 to tmpfs for sendfile, a loop-mounted XFS
image for reflink) and forced by the environment variable, the way a user
with a kernel bug would. Tests that need root (mounting tmpfs or XFS) skip
with the reason otherwise.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pdiffcopy.local import fastcopy
from pdiffcopy.errors import Conflict, FileMissing, NotAFile, StorageError, UsageError
from pdiffcopy.local.fastcopy import METHODS, copy_file, copy_into
from pdiffcopy.local.descriptors import FICLONE, is_temporary_name

MiB = 1024 * 1024

#: Sizes every method must copy byte for byte: empty, one byte, one byte short
#: of a page, a MiB and a bit (several pipeline blocks), and a few MiB (above
#: fastcopy.RESERVE_MIN_SIZE, so the space is reserved first).
SIZES = [0, 1, 4095, MiB + 3, 5 * MiB + 7]

#: Size of the loop-mounted XFS image: big enough for a 100 MiB file and one
#: real (unshared) copy of it, small enough to make in a second.
XFS_IMAGE_SIZE = 300 * MiB

#: The file cloned on XFS: big enough that a real copy would visibly take space.
REFLINK_FILE_SIZE = 100 * MiB

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="mounting tmpfs or a loop device needs root")


def data(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


def leftovers(directory: Path) -> list:
    """Temporary files of pdiffcopy left in a directory."""
    return [name for name in os.listdir(directory) if is_temporary_name(name)]


def supports_reflink(directory: Path) -> bool:
    """Whether FICLONE works between two files in ``directory``."""
    source, target = directory / ".probe-source", directory / ".probe-target"
    source.write_bytes(b"x" * 4096)
    try:
        with open(source, "rb") as src, open(target, "wb") as dst:
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
        return True
    except OSError:
        return False
    finally:
        source.unlink()
        target.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, kill_switch):
    """No forced method from the caller's environment; fresh detection per test."""
    monkeypatch.delenv(fastcopy.METHOD_VARIABLE, raising=False)
    kill_switch(None)
    fastcopy.forget_refusals()
    yield
    fastcopy.forget_refusals()


def mount(kind: str, mountpoint: Path, *options: str, source: str = "none") -> None:
    mountpoint.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", kind, *options, source, str(mountpoint)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount {kind}: {result.stderr.strip()}")


def unmount(mountpoint: Path) -> None:
    if subprocess.run(["umount", str(mountpoint)], capture_output=True, check=False).returncode:
        # Busy (a test failed with a file open): detach it now, it goes when closed.
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs (another file system than tmp_path's, and easy to fill)."""
    if not IS_ROOT:
        pytest.skip("mounting tmpfs needs root")
    mountpoint = tmp_path / "tmpfs"
    mount("tmpfs", mountpoint, "-o", "size=8m")
    yield mountpoint
    unmount(mountpoint)


@pytest.fixture(scope="module")
def xfs(tmp_path_factory):
    """A loop-mounted XFS file system with reflink, unmounted at the end."""
    if not IS_ROOT:
        pytest.skip("mounting a loop device needs root")
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs is missing (apt-get install xfsprogs)")
    base = tmp_path_factory.mktemp("xfs")
    image, mountpoint = base / "xfs.img", base / "mnt"
    with open(image, "wb") as handle:
        handle.truncate(XFS_IMAGE_SIZE)
    made = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"mkfs.xfs -m reflink=1 failed: {made.stderr.strip()}")
    mount("xfs", mountpoint, "-o", "loop", source=str(image))
    try:
        yield mountpoint
    finally:
        unmount(mountpoint)
        image.unlink()


# --------------------------------------------------------------------------- every method

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cache", ["drop", "keep"])
def test_forced_method_copies_byte_for_byte(tmp_path, monkeypatch, method, size, cache):
    source, target = tmp_path / "source", tmp_path / "target"
    content = data(size)
    source.write_bytes(content)
    monkeypatch.setenv(fastcopy.METHOD_VARIABLE, method)
    report = copy_file(str(source), str(target), cache=cache)
    assert target.read_bytes() == content
    # A reflink refused by this file system falls back to the next method.
    expected = method
    if method == "reflink" and not supports_reflink(tmp_path):
        expected = "copy_file_range"
    assert report.method == expected
    assert report.size == size and report.cache == cache
    assert leftovers(tmp_path) == []


def test_no_fastpath_variable_forces_read_write(tmp_path, kill_switch):
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(data(MiB + 3))
    kill_switch("1")
    assert copy_file(str(source), str(target)).method == "readwrite"
    assert target.read_bytes() == source.read_bytes()
    kill_switch("0")  # 0 means off
    assert copy_file(str(source), str(target)).method != "readwrite"


def test_unknown_method_is_a_usage_error(tmp_path, monkeypatch):
    source = tmp_path / "source"
    source.write_bytes(b"abc")
    monkeypatch.setenv(fastcopy.METHOD_VARIABLE, "teleport")
    with pytest.raises(UsageError, match="PDIFFCOPY_COPY_METHOD=teleport"):
        copy_file(str(source), str(tmp_path / "target"))
    with pytest.raises(UsageError, match="cache mode"):
        copy_file(str(source), str(tmp_path / "target"), cache="sometimes", method="readwrite")
    assert leftovers(tmp_path) == []


def test_fastest_method_taken_by_itself(tmp_path):
    """Unforced, a copy on one file system is a reflink or a copy_file_range."""
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(data(3 * MiB))
    expected = "reflink" if supports_reflink(tmp_path) else "copy_file_range"
    assert copy_file(str(source), str(target)).method == expected
    assert target.read_bytes() == source.read_bytes()
    device = source.stat().st_dev
    if expected == "copy_file_range":
        # The refusal is remembered: the next copy does not ask again.
        assert fastcopy.refused_methods(device, device) == {"reflink"}
    fastcopy.forget_refusals()
    assert fastcopy.refused_methods(device, device) == set()


@needs_root
@pytest.mark.parametrize("size", SIZES)
def test_sendfile_taken_between_file_systems(tmp_path, small_tmpfs, size):
    """ext4 to tmpfs: no reflink, copy_file_range answers EXDEV, sendfile copies."""
    source, target = tmp_path / "source", small_tmpfs / "target"
    content = data(size)
    source.write_bytes(content)
    report = copy_file(str(source), str(target))
    assert target.read_bytes() == content
    # And back, from tmpfs to ext4.
    back = tmp_path / "back"
    report_back = copy_file(str(target), str(back))
    assert back.read_bytes() == content
    if size:  # an empty file needs no copy call, so no method is refused
        assert report.method == report_back.method == "sendfile"
        refused = fastcopy.refused_methods(source.stat().st_dev, target.stat().st_dev)
        assert refused == {"reflink", "copy_file_range"}


@needs_root
def test_read_write_forced_between_file_systems(tmp_path, small_tmpfs, monkeypatch):
    source, target = tmp_path / "source", small_tmpfs / "target"
    source.write_bytes(data(5 * MiB + 7))
    monkeypatch.setenv(fastcopy.METHOD_VARIABLE, "readwrite")
    assert copy_file(str(source), str(target)).method == "readwrite"
    assert target.read_bytes() == source.read_bytes()


# --------------------------------------------------------------------------- reflink on XFS

def shared_extents(path: Path) -> int:
    """How many extents ``filefrag -v`` marks as shared."""
    output = subprocess.run(["filefrag", "-v", str(path)], capture_output=True, text=True,
                            check=True).stdout
    return sum(1 for line in output.splitlines() if "shared" in line)


def used_bytes(path: Path) -> int:
    os.sync()  # XFS accounts delayed allocations only once they are written
    stats = os.statvfs(path)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def test_reflink_shares_extents_on_xfs(xfs):
    if shutil.which("filefrag") is None:
        pytest.skip("filefrag (e2fsprogs) is missing")
    source, target = xfs / "source", xfs / "target"
    content = data(REFLINK_FILE_SIZE)
    source.write_bytes(content)
    before = used_bytes(xfs)
    report = copy_file(str(source), str(target))
    after = used_bytes(xfs)
    try:
        assert report.method == "reflink" and report.cloned
        assert target.read_bytes() == content
        assert shared_extents(target) > 0 and shared_extents(source) > 0
        # A real copy would take another 100 MiB; a clone takes metadata only.
        assert after - before < 4 * MiB
    finally:
        target.unlink()


def test_reflink_fallback_copies_every_block_on_xfs(xfs, monkeypatch):
    """Forced off, the copy is real: no shared extents, and the space is used."""
    source, target = xfs / "source2", xfs / "target2"
    content = data(REFLINK_FILE_SIZE // 2, seed=3)
    source.write_bytes(content)
    monkeypatch.setenv(fastcopy.METHOD_VARIABLE, "sendfile")
    before = used_bytes(xfs)
    try:
        report = copy_file(str(source), str(target))
        after = used_bytes(xfs)
        assert report.method == "sendfile" and not report.cloned
        assert target.read_bytes() == content
        assert shared_extents(target) == 0
        assert after - before >= len(content)
    finally:
        source.unlink()
        target.unlink(missing_ok=True)


def test_copy_into_clones_a_temporary_on_xfs(xfs):
    """What --atomic does: start its temporary file as a clone of the target."""
    source = xfs / "source3"
    content = data(8 * MiB, seed=4)
    source.write_bytes(content)
    temporary = xfs / ".source3.pdiffcopy-000000000000"
    try:
        with open(source, "rb") as src, open(temporary, "wb") as dst:
            assert copy_into(src.fileno(), dst.fileno(), len(content)) == "reflink"
        assert temporary.read_bytes() == content
    finally:
        source.unlink()
        temporary.unlink(missing_ok=True)


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is missing")
def test_sync_of_a_new_file_on_xfs_is_a_clone_not_read_back(xfs, caplog):
    """The command line's whole-file copy on XFS: a clone, verified without reading the clone.

    Reading it back would fill the page cache with the clone's pages (and on
    a cold cache read the whole file from disk); the source is hashed for the
    digest, the target not at all.
    """
    import logging

    from pdiffcopy import sync

    source, target = xfs / "source4", xfs / "target4"
    content = data(REFLINK_FILE_SIZE // 4, seed=5)
    source.write_bytes(content)
    try:
        with caplog.at_level(logging.DEBUG, logger="pdiffcopy.engine.filejob"):
            result = sync(str(source), str(target))
        assert f"Copied {source} with reflink" in caplog.text
        assert result.verified and result.digest
        assert resident_bytes(target) == 0
        assert target.read_bytes() == content
        if shutil.which("filefrag") is not None:
            assert shared_extents(target) > 0
    finally:
        source.unlink()
        target.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the page cache

def resident_bytes(path: Path) -> int:
    output = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                            capture_output=True, text=True, check=True).stdout
    return int(output.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is missing")
@pytest.mark.parametrize("method", ["copy_file_range", "sendfile", "readwrite"])
def test_drop_leaves_nothing_in_the_page_cache(tmp_path, method):
    source, target = tmp_path / "source", tmp_path / "target"
    # More than two cache windows, so that the rolling window moves.
    source.write_bytes(data(2 * fastcopy.CACHE_WINDOW + 5 * MiB))
    copy_file(str(source), str(target), cache="keep", method=method)
    assert resident_bytes(target) == target.stat().st_size
    copy_file(str(source), str(target), cache="drop", method=method)
    assert target.read_bytes() == source.read_bytes()  # reading caches both again...
    copy_file(str(source), str(target), cache="drop", method=method)
    assert resident_bytes(target) == 0  # ...and the copy dropped both
    assert resident_bytes(source) == 0


def test_auto_cache_by_size(tmp_path):
    assert fastcopy.resolve_cache("auto", 1) == "keep"
    assert fastcopy.resolve_cache("auto", fastcopy.drop_threshold()) == "drop"
    assert fastcopy.resolve_cache("keep", 1 << 50) == "keep"
    source = tmp_path / "source"
    source.write_bytes(b"small")
    assert copy_file(str(source), str(tmp_path / "target")).cache == "keep"


# --------------------------------------------------------------------------- atomicity

#: A copy that is slow on purpose: the progress callback announces each step
#: and sleeps, so that the test can interrupt it half-way.
SLOW_COPY = """
import sys, time
from pdiffcopy.local.fastcopy import copy_file
def progress(count):
    print("copied", count, flush=True)
    time.sleep(0.05)
copy_file(sys.argv[1], sys.argv[2], method=sys.argv[3], progress=progress)
print("done", flush=True)
"""


def interrupt_copy(tmp_path: Path, method: str, signal_number: int) -> Path:
    """Start a slow copy over an existing target, and signal it after its first step."""
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(data(32 * MiB))
    target.write_bytes(data(7 * MiB + 1, seed=5))
    process = subprocess.Popen([sys.executable, "-c", SLOW_COPY, str(source), str(target), method],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("copied")
        assert leftovers(tmp_path)  # the temporary file is being written
        process.send_signal(signal_number)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0
    assert "done" not in process.stdout.read()
    return target


@pytest.mark.parametrize("method", ["copy_file_range", "readwrite"])
def test_killed_copy_leaves_the_old_target_whole(tmp_path, method):
    target = interrupt_copy(tmp_path, method, signal.SIGKILL)
    assert target.read_bytes() == data(7 * MiB + 1, seed=5)
    # SIGKILL gives no chance to clean up: only then is a temporary file left.
    for name in leftovers(tmp_path):
        os.unlink(tmp_path / name)


@pytest.mark.parametrize("method", ["copy_file_range", "readwrite"])
def test_ctrl_c_leaves_the_old_target_and_no_temporary(tmp_path, method):
    target = interrupt_copy(tmp_path, method, signal.SIGINT)
    assert target.read_bytes() == data(7 * MiB + 1, seed=5)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("exception", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("method", METHODS)
def test_exception_mid_copy_removes_the_temporary(tmp_path, method, exception):
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(data(3 * MiB))
    old = data(MiB, seed=6)
    target.write_bytes(old)

    def progress(count: int) -> None:
        raise exception("stop")

    with pytest.raises(exception):
        copy_file(str(source), str(target), method=method, progress=progress)
    assert target.read_bytes() == old
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- bad input and faults

@needs_root
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("source_size", [16 * MiB, 3 * MiB])
def test_no_space_left(tmp_path, small_tmpfs, method, source_size):
    """16 MiB fails when its space is reserved; 3 MiB (not reserved) half-way through."""
    source, target = tmp_path / "source", small_tmpfs / "target"
    source.write_bytes(data(source_size))
    old = data(6 * MiB, seed=7)  # leaves 2 MiB free of 8
    target.write_bytes(old)
    with pytest.raises(StorageError, match="No space left on device") as caught:
        copy_file(str(source), str(target), method=method)
    assert str(caught.value).startswith(f"Cannot copy {source} to {target}")
    assert target.read_bytes() == old
    assert leftovers(small_tmpfs) == []


def test_same_file_is_refused(tmp_path):
    source = tmp_path / "source"
    content = data(5000)
    source.write_bytes(content)
    os.link(source, tmp_path / "hardlink")
    os.symlink(source, tmp_path / "symlink")
    for target in ("source", "hardlink", "symlink"):
        with pytest.raises(UsageError, match="the same file"):
            copy_file(str(source), str(tmp_path / target))
    assert source.read_bytes() == content
    assert leftovers(tmp_path) == []


def test_bad_paths(tmp_path):
    source = tmp_path / "source"
    source.write_bytes(b"data")
    (tmp_path / "directory").mkdir()
    with pytest.raises(NotAFile, match="target is a directory"):
        copy_file(str(source), str(tmp_path / "directory"))
    with pytest.raises(NotAFile, match="Not a regular file"):
        copy_file(str(tmp_path / "directory"), str(tmp_path / "target"))
    with pytest.raises(FileMissing):
        copy_file(str(tmp_path / "missing"), str(tmp_path / "target"))
    with pytest.raises(FileMissing):
        copy_file(str(source), str(tmp_path / "no-such-directory" / "target"))
    assert not (tmp_path / "target").exists()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("change", ["grow", "shrink", "overwrite"])
@pytest.mark.parametrize("method", METHODS)
def test_source_changing_during_the_copy(tmp_path, method, change):
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(data(3 * MiB))
    # An old modification time, so that any write changes it even within the
    # kernel's timestamp granularity.
    os.utime(source, (1_000_000_000, 1_000_000_000))
    old = data(100, seed=8)
    target.write_bytes(old)
    changed = []

    def progress(count: int) -> None:
        if not changed:
            changed.append(True)
            with open(source, "r+b") as handle:
                if change == "grow":
                    handle.seek(0, os.SEEK_END)
                    handle.write(b"more")
                elif change == "shrink":
                    handle.truncate(MiB)
                else:
                    handle.write(b"X")

    with pytest.raises(Conflict, match="changed size|was modified"):
        copy_file(str(source), str(target), method=method, progress=progress)
    assert target.read_bytes() == old
    assert leftovers(tmp_path) == []


def test_permissions(tmp_path):
    source = tmp_path / "source"
    source.write_bytes(b"data")
    source.chmod(0o640)
    mask = os.umask(0o022)
    try:
        copy_file(str(source), str(tmp_path / "new"))
        existing = tmp_path / "existing"
        existing.write_bytes(b"old")
        existing.chmod(0o604)
        copy_file(str(source), str(existing))
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o640
    assert stat.S_IMODE(existing.stat().st_mode) == 0o604
    assert existing.read_bytes() == b"data"


# --------------------------------------------------------------------------- copy_into

@pytest.mark.parametrize("method", METHODS)
def test_copy_into_open_files(tmp_path, method):
    source, target = tmp_path / "source", tmp_path / "target"
    content = data(5 * MiB + 7)
    source.write_bytes(content)
    progress = []
    with open(source, "rb") as src, open(target, "wb") as dst:
        used = copy_into(src.fileno(), dst.fileno(), len(content), cache="drop",
                         method=method, progress=progress.append)
    assert used in METHODS[METHODS.index(method):]
    assert sum(progress) == len(content)
    assert target.read_bytes() == content


@pytest.mark.parametrize("method", METHODS)
def test_copy_into_source_shorter_than_announced(tmp_path, method):
    source, target = tmp_path / "source", tmp_path / "target"
    content = data(MiB + 3)
    source.write_bytes(content)
    with open(source, "rb") as src, open(target, "wb") as dst, \
            pytest.raises(Conflict, match="changed size"):
        copy_into(src.fileno(), dst.fileno(), 2 * MiB, method=method)
    with open(source, "rb") as src, open(target, "wb") as dst:
        copy_into(src.fileno(), dst.fileno(), 2 * MiB, method=method, detect_changes=False)
    assert target.read_bytes() == content  # cut to what there was


def test_reserve_fails_early_only_for_lack_of_space(tmp_path):
    path = tmp_path / "file"
    with open(path, "wb") as handle:
        fastcopy.reserve(handle.fileno(), 0, 3 * MiB)
        assert os.fstat(handle.fileno()).st_size == 3 * MiB
        with pytest.raises(OSError) as caught:
            fastcopy.reserve(handle.fileno(), 0, 1 << 62)  # more than any disk
        assert caught.value.errno in (errno.ENOSPC, errno.EFBIG)


def _dirty_pages(fd: int) -> int | None:
    """Dirty (not yet submitted) page cache pages of a file: cachestat(2), Linux 6.5+."""
    import ctypes

    class CacheStat(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in (
            "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    result, whole = CacheStat(), Range(0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(451, fd, ctypes.byref(whole), ctypes.byref(result), 0) != 0:
        return None
    return result.nr_dirty


@pytest.mark.parametrize("method", ["copy_file_range", "sendfile", "readwrite"])
def test_durable_copy_starts_writeback_as_it_goes(tmp_path, method):
    """durable=True with the cache kept: by the end every range is on its way to the disk.

    Without the early writeback the kernel would leave the pages dirty for
    its own writeback (30 s later by default), and the caller's fsync would
    write them all at the end.
    """
    source, target = tmp_path / "source", tmp_path / "target"
    content = data(2 * fastcopy.CACHE_WINDOW + 3 * MiB + 5)  # full windows and a partial one
    source.write_bytes(content)
    with open(source, "rb") as src, open(target, "wb") as dst:
        if _dirty_pages(dst.fileno()) is None:
            pytest.skip("no cachestat(2) in this kernel")
        copy_into(src.fileno(), dst.fileno(), len(content), cache="keep", method=method)
        lazy = _dirty_pages(dst.fileno())
    with open(source, "rb") as src, open(target, "r+b") as dst:
        dst.truncate(0)
        os.fsync(dst.fileno())
        copy_into(src.fileno(), dst.fileno(), len(content), cache="keep", durable=True,
                  method=method)
        eager = _dirty_pages(dst.fileno())
    assert target.read_bytes() == content
    assert lazy is not None and lazy * 4096 >= len(content) // 2, "the kernel wrote back early itself"
    assert eager == 0

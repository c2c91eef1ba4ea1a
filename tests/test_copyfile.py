"""pdiffcopy.copyfile: shutil.copyfile's contract, its fast paths, and the monkeypatch.

This kernel has no SMB client, so the CIFS copychunk ioctl cannot succeed
here: the tests check the file system detection, that the ioctl on other file
systems is refused and the copy falls back cleanly, and everything else.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdiffcopy import copyfile as module
from pdiffcopy.local import fastcopy
from pdiffcopy.local.copyfile import (
    CIFS_IOC_COPYCHUNK_FILE,
    cifs_copychunk,
    copyfile,
    filesystem_magic,
    is_cifs,
    mount_type,
    patch_copyfile,
    unpatch_copyfile,
)

MiB = 1024 * 1024
SIZES = [0, 1, 4095, MiB + 3, 5 * MiB + 7]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
ORIGINAL = shutil.copyfile


def data(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture(autouse=True)
def clean_state(monkeypatch, kill_switch):
    for name in (fastcopy.METHOD_VARIABLE, module.METHOD_VARIABLE, module.DEBUG_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    kill_switch(None)
    fastcopy.forget_refusals()
    yield
    unpatch_copyfile()
    assert shutil.copyfile is ORIGINAL


@pytest.fixture
def debug_log(caplog):
    """The methods logged by copyfile, as a list that fills as copies run."""
    caplog.set_level(logging.DEBUG, logger="pdiffcopy.copyfile")

    class Methods(list):
        def refresh(self) -> Methods:
            self[:] = [record.getMessage().rsplit(": ", 1)[1] for record in caplog.records
                       if record.name == "pdiffcopy.copyfile"
                       and record.getMessage().startswith("copyfile(")]
            return self

    return Methods()


# --------------------------------------------------------------------------- the data

@pytest.mark.parametrize("size", SIZES)
def test_copies_byte_for_byte(tmp_path, size):
    source, target = tmp_path / "source", tmp_path / "target"
    content = data(size)
    source.write_bytes(content)
    target.write_bytes(data(2 * MiB, seed=2))  # longer: must be truncated
    assert copyfile(source, target) == target
    assert target.read_bytes() == content
    assert copyfile(str(source), str(tmp_path / "new")) == str(tmp_path / "new")
    assert (tmp_path / "new").read_bytes() == content


@pytest.mark.parametrize("method", fastcopy.METHODS)
def test_each_fast_path_forced(tmp_path, monkeypatch, debug_log, method):
    source, target = tmp_path / "source", tmp_path / "target"
    content = data(5 * MiB + 7)
    source.write_bytes(content)
    monkeypatch.setenv(fastcopy.METHOD_VARIABLE, method)
    copyfile(source, target)
    assert target.read_bytes() == content
    taken = debug_log.refresh()[-1]
    if method == "reflink" and taken != "reflink":
        assert taken == "copy_file_range"  # this file system cannot clone: fell back
    else:
        assert taken == method


def test_accepts_dir_entries_and_bytes(tmp_path):
    source = tmp_path / "source"
    source.write_bytes(b"entry")
    entry = next(e for e in os.scandir(tmp_path) if e.name == "source")
    copyfile(entry, tmp_path / "a")
    copyfile(bytes(source), bytes(tmp_path / "b"))
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == b"entry"


# --------------------------------------------------------------------------- the contract

def scenario_same_file(tmp: Path):
    (tmp / "s").write_bytes(b"x")
    return tmp / "s", tmp / "s", {}


def scenario_hardlink(tmp: Path):
    (tmp / "s").write_bytes(b"x")
    os.link(tmp / "s", tmp / "h")
    return tmp / "s", tmp / "h", {}


def scenario_target_directory(tmp: Path):
    (tmp / "s").write_bytes(b"x")
    (tmp / "d").mkdir()
    return tmp / "s", tmp / "d", {}


def scenario_target_slash_missing_directory(tmp: Path):
    (tmp / "s").write_bytes(b"x")
    return tmp / "s", str(tmp / "nodir") + "/", {}


def scenario_source_missing(tmp: Path):
    return tmp / "missing", tmp / "t", {}


def scenario_source_directory(tmp: Path):
    (tmp / "d").mkdir()
    return tmp / "d", tmp / "t", {}


def scenario_target_parent_missing(tmp: Path):
    (tmp / "s").write_bytes(b"x")
    return tmp / "s", tmp / "nodir" / "t", {}


def scenario_fifo(tmp: Path):
    os.mkfifo(tmp / "f")
    return tmp / "f", tmp / "t", {}


def scenario_symlink_kept(tmp: Path):
    (tmp / "s").write_bytes(b"x")
    os.symlink("s", tmp / "link")
    return tmp / "link", tmp / "t", {"follow_symlinks": False}


def scenario_symlink_followed(tmp: Path):
    (tmp / "s").write_bytes(b"x")
    os.symlink("s", tmp / "link")
    return tmp / "link", tmp / "t", {}


SCENARIOS = [value for name, value in sorted(globals().items()) if name.startswith("scenario_")]


def outcome(function, tmp: Path, scenario):
    source, target, options = scenario(tmp)
    try:
        result = function(source, target, **options)
    except Exception as error:  # noqa: BLE001 (the point is to compare them)
        return type(error), None
    kind = "link" if os.path.islink(target) else "file"
    return result == target, (kind, Path(target).read_bytes())


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__[len("scenario_"):])
def test_same_contract_as_shutil(tmp_path, scenario):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    assert outcome(copyfile, ours, scenario) == outcome(ORIGINAL, theirs, scenario)


def test_same_file_error_is_shutils(tmp_path):
    source = tmp_path / "s"
    source.write_bytes(b"x")
    with pytest.raises(shutil.SameFileError):
        copyfile(source, source)
    with pytest.raises(IsADirectoryError):
        copyfile(source, tmp_path)


# --------------------------------------------------------------------------- CIFS

def test_copychunk_ioctl_number():
    # _IOW(0xCF, 3, int) from the kernel's fs/smb/client/cifs_ioctl.h.
    assert CIFS_IOC_COPYCHUNK_FILE == 0x4004CF03


def test_file_system_detection(tmp_path):
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    expected = subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True,
                              text=True, check=True).stdout.strip()
    with open(probe, "rb") as handle:
        assert filesystem_magic(handle.fileno()) == int(expected, 16)
        assert mount_type(handle.fileno())  # some type, e.g. ext4
        assert not is_cifs(handle.fileno())


def test_copychunk_refused_on_a_local_file(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(data(MiB))
    with open(source, "rb") as src, open(target, "wb") as dst:
        assert cifs_copychunk(src.fileno(), dst.fileno()) is False
    assert target.read_bytes() == b""  # nothing written: the caller copies another way


@pytest.mark.skipif(not IS_ROOT, reason="mounting tmpfs needs root")
def test_copychunk_refused_on_tmpfs(tmp_path):
    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "none", str(mountpoint)], check=True)
    try:
        source, target = mountpoint / "source", mountpoint / "target"
        source.write_bytes(data(MiB))
        with open(source, "rb") as src, open(target, "wb") as dst:
            assert mount_type(src.fileno()) == "tmpfs"
            assert filesystem_magic(src.fileno()) == 0x01021994  # TMPFS_MAGIC
            assert cifs_copychunk(src.fileno(), dst.fileno()) is False
        copyfile(source, target)
        assert target.read_bytes() == source.read_bytes()
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_forced_copychunk_falls_back_cleanly(tmp_path, monkeypatch, debug_log, caplog):
    source, target = tmp_path / "source", tmp_path / "target"
    content = data(MiB + 3)
    source.write_bytes(content)
    monkeypatch.setenv(module.METHOD_VARIABLE, "copychunk")
    copyfile(source, target)
    assert target.read_bytes() == content
    messages = [record.getMessage() for record in caplog.records]
    assert any(message.startswith("copychunk refused") for message in messages)
    assert debug_log.refresh()[-1] in fastcopy.METHODS


# --------------------------------------------------------------------------- debugging

def test_debug_log_names_the_path(tmp_path, debug_log):
    source = tmp_path / "source"
    source.write_bytes(data(4096))
    copyfile(source, tmp_path / "target")
    (tmp_path / "link").symlink_to("source")
    copyfile(tmp_path / "link", tmp_path / "link2", follow_symlinks=False)
    assert debug_log.refresh() == [debug_log[0], "symlink"]
    assert debug_log[0] in fastcopy.METHODS


def test_debug_variable_prints_to_stderr(tmp_path):
    source = tmp_path / "source"
    source.write_bytes(b"x" * 10)
    script = "import sys; from pdiffcopy.local.copyfile import copyfile; copyfile(sys.argv[1], sys.argv[2])"
    env = dict(os.environ, **{module.DEBUG_VARIABLE: "1"})
    result = subprocess.run([sys.executable, "-c", script, str(source), str(tmp_path / "t")],
                            capture_output=True, text=True, env=env, check=True)
    assert "pdiffcopy.copyfile: copyfile(" in result.stderr
    quiet = subprocess.run([sys.executable, "-c", script, str(source), str(tmp_path / "u")],
                           capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != module.DEBUG_VARIABLE})
    assert quiet.stderr == ""


# --------------------------------------------------------------------------- the patch

def test_patch_and_unpatch(tmp_path, debug_log):
    source = tmp_path / "source"
    source.write_bytes(data(MiB))
    patch_copyfile()
    assert shutil.copyfile is copyfile and module.is_patched()
    patch_copyfile()  # twice is harmless
    shutil.copyfile(source, tmp_path / "a")
    shutil.copy(source, tmp_path / "b")  # shutil.copy calls copyfile through the module
    assert len(debug_log.refresh()) == 2
    unpatch_copyfile()
    assert shutil.copyfile is ORIGINAL and not module.is_patched()
    shutil.copyfile(source, tmp_path / "c")
    shutil.copy(source, tmp_path / "d")
    assert len(debug_log.refresh()) == 2  # nothing went through pdiffcopy
    for name in "abcd":
        assert (tmp_path / name).read_bytes() == source.read_bytes()


@pytest.mark.skipif(os.name != "nt", reason="CopyFile2 exists only on Windows")
def test_copyfile2_on_windows(tmp_path, debug_log):
    source = tmp_path / "source"
    source.write_bytes(data(MiB))
    copyfile(source, tmp_path / "target")
    assert (tmp_path / "target").read_bytes() == source.read_bytes()
    assert debug_log.refresh() == ["CopyFile2"]


def test_package_attribute_is_callable_like_speedcopy(tmp_path):
    """``pdiffcopy.copyfile(src, dst)`` works although ``pdiffcopy.copyfile`` is the module."""
    import pdiffcopy

    source = tmp_path / "source"
    source.write_bytes(data(5000))
    assert pdiffcopy.copyfile is module
    assert pdiffcopy.copyfile(source, tmp_path / "target") == tmp_path / "target"
    assert (tmp_path / "target").read_bytes() == source.read_bytes()

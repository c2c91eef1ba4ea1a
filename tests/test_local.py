"""Local-to-local syncs through the command line: the kernel's fast paths and cache control."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import mutate, random_bytes, run_cli

SIZE = 5 * 1024 * 1024 + 7


@pytest.mark.parametrize("method", ["copy_file_range", "sendfile", "readwrite"])
def test_whole_file_copy_takes_the_forced_path(tmp_path, method):
    data = random_bytes(SIZE)
    (tmp_path / "a").write_bytes(data)
    completed = run_cli("-vv", str(tmp_path / "a"), str(tmp_path / "b"),
                        env_extra={"PDIFFCOPY_COPY_METHOD": method})
    assert completed.returncode == 0, completed.stderr
    assert f"Copied {tmp_path / 'a'} with {method}" in completed.stderr
    assert (tmp_path / "b").read_bytes() == data


def test_no_fastpath_switch_forces_plain_reads_and_writes(tmp_path):
    data = random_bytes(SIZE, seed=5)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(b"old and longer" * 1000000)
    completed = run_cli("-vv", "-W", str(tmp_path / "a"), str(tmp_path / "b"),
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
    # Two 4 KiB pieces of the two changed 64 KiB blocks (sub-block refinement).
    assert "8 KiB moved, 2 of 81 blocks differed" in completed.stderr
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
    assert completed.returncode == 1
    assert "same file" in completed.stderr
    assert (tmp_path / "a").read_bytes() == b"data"


# --------------------------------------------------------------------------- verification of whole-file copies

#: More than one 64 MiB segment, so the read-back of a finished segment runs
#: while the next one is copied (pdiffcopy.core.blocks.DEFAULT_SEGMENT_SIZE).
TWO_SEGMENTS = 64 * 1024 * 1024 + 3 * 1024 * 1024 + 11


def _corrupt_writes(monkeypatch, method: str, where: int, data: bytes) -> None:
    """Make the kernel's (or the write loop's) copy land one wrong byte at ``where``.

    The byte is flipped in the target right after the call that wrote it
    returns, as a kernel or file system bug in a fast path would leave it.
    """
    from pdiffcopy.local import fastcopy

    monkeypatch.setenv(fastcopy.METHOD_VARIABLE, method)
    real = {"copy_file_range": os.copy_file_range, "sendfile": os.sendfile, "readwrite": os.pwrite}

    def flip(fd: int, start: int, count: int) -> None:
        if start <= where < start + count:
            real["readwrite"](fd, bytes([data[where] ^ 0xFF]), where)

    def copy_file_range(source_fd, target_fd, count, offset_src, offset_dst):
        copied = real["copy_file_range"](source_fd, target_fd, count, offset_src, offset_dst)
        flip(target_fd, offset_dst, copied)
        return copied

    def sendfile(out_fd, in_fd, offset, count):
        sent = real["sendfile"](out_fd, in_fd, offset, count)
        flip(out_fd, offset, sent)
        return sent

    def pwrite(fd, data, offset):
        written = real["readwrite"](fd, data, offset)
        flip(fd, offset, written)
        return written

    monkeypatch.setattr(os, method if method != "readwrite" else "pwrite",
                        {"copy_file_range": copy_file_range, "sendfile": sendfile,
                         "readwrite": pwrite}[method])


@pytest.mark.parametrize("method", ["copy_file_range", "sendfile", "readwrite"])
@pytest.mark.parametrize("where", [5, 64 * 1024 * 1024 - 1, TWO_SEGMENTS - 1],
                         ids=["first-segment", "end-of-first-segment", "last-byte"])
@pytest.mark.parametrize("cache", ["keep", "drop"])
def test_whole_file_copy_detects_a_wrong_byte(tmp_path, monkeypatch, method, where, cache):
    """A copy that comes out wrong fails the sync, wherever the byte is, and leaves no target.

    With the cache kept, each segment of the target is read back as soon as
    it is copied; a read-back that were skipped, or done before the data
    landed, would let the wrong byte through.
    """
    from pdiffcopy import sync
    from pdiffcopy.errors import VerificationFailed

    data = random_bytes(TWO_SEGMENTS, seed=8)
    (tmp_path / "a").write_bytes(data)
    _corrupt_writes(monkeypatch, method, where, data)
    with pytest.raises(VerificationFailed, match="1 block"):
        sync(str(tmp_path / "a"), str(tmp_path / "b"), cache=cache, concurrency=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_whole_file_copy_in_place_detects_a_wrong_byte(tmp_path, monkeypatch):
    """-W over an existing target (in place, no temporary file): the same check, the same error."""
    from pdiffcopy import sync
    from pdiffcopy.errors import VerificationFailed

    data = random_bytes(TWO_SEGMENTS, seed=9)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(b"old")
    _corrupt_writes(monkeypatch, "copy_file_range", 66 * 1024 * 1024, data)
    with pytest.raises(VerificationFailed, match="1 block"):
        sync(str(tmp_path / "a"), str(tmp_path / "b"), whole_file=True, cache="keep")


def test_whole_file_copy_reads_back_every_segment_but_not_a_clone(tmp_path, monkeypatch):
    """The target is hashed once per segment; a reflink clone (simulated here) is not re-read.

    The clone shares the source's extents, so reading it would read the very
    blocks the source's digests came from. Every other method's result is read.
    """
    import pdiffcopy.local.localfile
    from pdiffcopy import sync
    from pdiffcopy.local import fastcopy

    data = random_bytes(TWO_SEGMENTS, seed=10)
    (tmp_path / "a").write_bytes(data)
    hashed = []
    real_hash = pdiffcopy.local.localfile.hash_file_ranges

    def spy(path, ranges, *args):
        hashed.append((os.path.basename(path), tuple(ranges)))
        return real_hash(path, ranges, *args)

    monkeypatch.setattr(pdiffcopy.local.localfile, "hash_file_ranges", spy)
    result = sync(str(tmp_path / "a"), str(tmp_path / "b"), cache="keep")
    assert result.verified and (tmp_path / "b").read_bytes() == data
    target_reads = sorted(ranges for name, ranges in hashed if name != "a")
    assert target_reads == [((0, 64 * 1024 * 1024),), ((64 * 1024 * 1024, TWO_SEGMENTS - 64 * 1024 * 1024),)]

    def fake_clone(source_fd, target_fd, position, size, window, progress):
        # A successful FICLONE, as far as the caller can tell: all bytes at once.
        os.copy_file_range(source_fd, target_fd, size, 0, 0)
        if progress is not None:
            progress(size)
        return size

    monkeypatch.setitem(fastcopy._COPIERS, "reflink", fake_clone)
    fastcopy.forget_refusals()  # ext4 refused the real FICLONE above
    hashed.clear()
    (tmp_path / "b").unlink()
    result = sync(str(tmp_path / "a"), str(tmp_path / "c"), cache="keep")
    assert result.verified and (tmp_path / "c").read_bytes() == data
    assert [name for name, _ in hashed if name != "a"] == []
    assert len([name for name, _ in hashed if name == "a"]) == 2  # the digest still comes from the source


def test_ctrl_c_during_a_whole_file_copy_leaves_no_temporary_and_no_thread(tmp_path, monkeypatch):
    """Interrupted after the first segment (its read-back already running): nothing is left behind.

    The hashing threads of a whole-file copy cannot be interrupted; the sync
    waits for them before it returns, so none of them outlives it reading a
    file that is being removed.
    """
    import threading

    from pdiffcopy import sync
    from pdiffcopy.local import fastcopy

    data = random_bytes(TWO_SEGMENTS, seed=11)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(b"old")
    monkeypatch.setenv(fastcopy.METHOD_VARIABLE, "copy_file_range")
    real = os.copy_file_range
    calls = []

    def interrupted(source_fd, target_fd, count, offset_src, offset_dst):
        calls.append(offset_dst)
        if offset_dst >= 64 * 1024 * 1024:
            raise KeyboardInterrupt
        return real(source_fd, target_fd, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sync(str(tmp_path / "a"), str(tmp_path / "b"), whole_file=True, atomic=True, cache="keep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert (tmp_path / "b").read_bytes() == b"old"
    assert [t.name for t in threading.enumerate() if t.name.startswith("hash")] == []
    assert max(calls) >= 64 * 1024 * 1024  # the first segment was copied (and read back)

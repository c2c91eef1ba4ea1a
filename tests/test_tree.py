"""Tree sync through the command line: what lands, what is kept, what is left alone.

Most tests run between local directories; the scenarios of the last section run
in each mode (local, pull from a server, push to it: the ``ends`` fixture).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import pdiffcopy_command, random_bytes, run_cli


def snapshot(root: Path, times: bool = False) -> dict:
    """Everything below ``root``: kind, permissions, content digest or link target (and mtime)."""
    result = {}
    base = os.fsencode(root)
    for directory, dirs, files in os.walk(base):
        for name in dirs + files:
            path = os.path.join(directory, name)
            relative = os.fsdecode(os.path.relpath(path, base))
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                item = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                item = ("dir", stat.S_IMODE(info.st_mode))
            elif stat.S_ISREG(info.st_mode):
                with open(path, "rb") as handle:
                    item = ("file", stat.S_IMODE(info.st_mode), hashlib.sha256(handle.read()).hexdigest())
            else:
                item = ("other",)
            if times and not stat.S_ISLNK(info.st_mode):
                item += (info.st_mtime_ns,)
            result[relative] = item
    return result


def make_tree(root: Path) -> Path:
    """A tree with the usual awkward members."""
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_bytes(b"hello\n")
    (root / "zero").write_bytes(b"")
    (root / "one").write_bytes(b"x")
    (root / "sub" / "b.bin").write_bytes(random_bytes(300_000, seed=3))
    (root / "sub" / "deeper" / "c.bin").write_bytes(random_bytes(5000, seed=4))
    (root / "with space.txt").write_bytes(b"spaces")
    (root / "-leading-dash").write_bytes(b"dash")
    (root / "new\nline").write_bytes(b"newline")
    (root / os.fsdecode(b"latin1-\xe9")).write_bytes(b"not utf-8")
    os.symlink("a.txt", root / "link-inside")
    os.symlink("/etc/hostname", root / "link-outside")
    os.symlink("loop", root / "loop")  # points at itself: never followed
    os.chmod(root / "sub" / "deeper" / "c.bin", 0o640)
    os.chmod(root / "sub" / "deeper", 0o750)
    os.chmod(root / "one", 0o755)
    (root / ".pdiffcopy").mkdir()  # reserved on a server's root, a plain name in a local tree
    (root / ".pdiffcopy" / "inside").write_bytes(b"ok")
    past = time.time_ns() - 86400 * 10**9
    for path in (root / "a.txt", root / "sub" / "b.bin", root / "sub"):
        os.utime(path, ns=(past, past))
    return root


@pytest.fixture
def tree(tmp_path) -> Path:
    return make_tree(tmp_path / "src")


def sync(*args: str, ok: bool = True, env_extra=None) -> subprocess.CompletedProcess:
    """Run ``pdiffcopy --no-progress ARGS``; with ``ok``, assert that it succeeded."""
    done = run_cli("--no-progress", *map(str, args), env_extra=env_extra)
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def test_permissions_kept_always_times_only_with_t(tree, tmp_path):
    sync(f"{tree}/", tmp_path / "plain")
    copied = tmp_path / "plain"
    assert stat.S_IMODE(os.stat(copied / "sub" / "deeper" / "c.bin").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(copied / "sub" / "deeper").st_mode) == 0o750
    assert os.stat(copied / "a.txt").st_mtime_ns != os.stat(tree / "a.txt").st_mtime_ns
    sync("-t", f"{tree}/", tmp_path / "timed")
    assert os.stat(tmp_path / "timed" / "a.txt").st_mtime_ns == os.stat(tree / "a.txt").st_mtime_ns
    # The target's own directory too, as rsync -a does.
    assert os.stat(tmp_path / "timed").st_mtime_ns == os.stat(tree).st_mtime_ns
    # Directory times are set after their contents changed.
    assert os.stat(tmp_path / "timed" / "sub").st_mtime_ns == os.stat(tree / "sub").st_mtime_ns


def test_changed_files_updated_and_stale_bytes_gone(tree, tmp_path):
    target = tmp_path / "dst"
    sync("-a", f"{tree}/", target)
    (tree / "a.txt").write_bytes(b"hi")  # shorter: no stale tail may survive
    (tree / "sub" / "b.bin").write_bytes(random_bytes(300_000, seed=9))  # same size, new content
    os.chmod(tree / "zero", 0o600)  # metadata only
    sync("-a", f"{tree}/", target)
    assert snapshot(target, times=True) == snapshot(tree, times=True)
    assert (target / "a.txt").read_bytes() == b"hi"


def test_same_size_same_time_is_skipped_unless_checksum(tree, tmp_path):
    target = tmp_path / "dst"
    sync("-a", f"{tree}/", target)
    info = os.stat(tree / "sub" / "b.bin")
    different = bytearray((tree / "sub" / "b.bin").read_bytes())
    different[1000] ^= 0xFF
    (target / "sub" / "b.bin").write_bytes(bytes(different))
    os.utime(target / "sub" / "b.bin", ns=(info.st_atime_ns, info.st_mtime_ns))
    sync("-a", f"{tree}/", target)
    assert (target / "sub" / "b.bin").read_bytes() == bytes(different)  # the quick check trusts it
    sync("-a", "--checksum", f"{tree}/", target)
    assert (target / "sub" / "b.bin").read_bytes() == (tree / "sub" / "b.bin").read_bytes()


def test_without_times_a_resync_compares_content_and_writes_nothing(tree, tmp_path):
    target = tmp_path / "dst"
    sync(f"{tree}/", target)
    inode = os.stat(target / "sub" / "b.bin").st_ino
    second = sync("-v", f"{tree}/", target)
    assert "0 file(s) copied" in second.stderr
    assert os.stat(target / "sub" / "b.bin").st_ino == inode  # not rewritten


def test_odd_names_are_printed_on_one_line(tree, tmp_path):
    listing = sync("-n", f"{tree}/", tmp_path / "dst").stdout
    assert "new\\nline" in listing
    assert "latin1-\\xe9" in listing


def test_special_files_skipped_with_a_warning(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    os.mkfifo(source / "pipe")
    (source / "f").write_bytes(b"f")
    done = sync(f"{source}/", tmp_path / "dst")
    assert "pipe" in done.stderr and "special" in done.stderr
    assert sorted(os.listdir(tmp_path / "dst")) == ["f"]


def test_file_into_existing_directory(tmp_path):
    (tmp_path / "f.txt").write_bytes(b"content")
    (tmp_path / "dir").mkdir()
    sync(tmp_path / "f.txt", tmp_path / "dir")
    assert (tmp_path / "dir" / "f.txt").read_bytes() == b"content"


def test_target_inside_source_refused(tree):
    done = sync(f"{tree}/", tree / "sub" / "copy", ok=False)
    assert done.returncode == 1
    assert "inside the source" in done.stderr
    assert not (tree / "sub" / "copy").exists()


def test_delete_with_empty_source_refused_unless_forced(tree, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = sync("--delete", f"{empty}/", f"{tree}/", ok=False)
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert (tree / "a.txt").exists()
    sync("--delete", "--force", f"{empty}/", f"{tree}/")
    assert os.listdir(tree) == []


def test_missing_source_is_one_line_error(tmp_path):
    done = sync(f"{tmp_path}/nothing/", tmp_path / "dst", ok=False)
    assert done.returncode == 3
    assert len(done.stderr.strip().splitlines()) == 1 and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_type_changes_replace_what_is_in_the_way(tree, tmp_path):
    target = tmp_path / "dst"
    sync("-a", f"{tree}/", target)
    os.unlink(tree / "a.txt")
    (tree / "a.txt").mkdir()  # was a file, now a directory
    (tree / "a.txt" / "inside").write_bytes(b"i")
    shutil.rmtree(tree / "empty")
    (tree / "empty").write_bytes(b"now a file")
    sync("-a", f"{tree}/", target)
    assert snapshot(target) == snapshot(tree)


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0,
                    reason="needs root and setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
def test_unreadable_file_reported_rest_copied(tree, tmp_path):
    """Without the capability to override permissions, a mode 000 file cannot be read:
    it fails with exit status 23 and every other file lands."""
    os.chmod(tree / "a.txt", 0o000)
    target = tmp_path / "dst"
    drop = "-dac_override,-dac_read_search"
    done = subprocess.run(["setpriv", "--bounding-set", drop, "--inh-caps", drop,
                           *pdiffcopy_command("--no-progress", f"{tree}/", str(target))],
                          capture_output=True, text=True)
    assert done.returncode == 23, done.stderr
    assert "a.txt" in done.stderr and "Permission denied" in done.stderr
    assert "Traceback" not in done.stderr
    expected = snapshot(tree)
    del expected["a.txt"]
    assert snapshot(target) == expected


def test_remove_with_filters_keeps_the_rest(tree):
    sync("--remove", "--include-regex", r"\.bin$", tree)
    assert not (tree / "sub" / "b.bin").exists() and not (tree / "sub" / "deeper" / "c.bin").exists()
    assert (tree / "a.txt").exists() and (tree / "sub" / "deeper").is_dir()


def test_remove_missing_path_fails_cleanly(tmp_path):
    done = sync("--remove", tmp_path / "nothing", ok=False)
    assert done.returncode == 3 and "does not exist" in done.stderr


def small_engine(monkeypatch):
    """Make "big" small, so ranges and block deltas run on files of a few MiB."""
    from pdiffcopy.engine import treerunner, treesync

    monkeypatch.setattr(treerunner, "RANGE_SIZE", 1024 * 1024)
    monkeypatch.setattr(treerunner, "DELTA_MIN_SIZE", 256 * 1024)
    return treesync


def test_file_growing_while_copied_is_reported_and_not_left_half_written(tmp_path, monkeypatch):
    treesync = small_engine(monkeypatch)
    from pdiffcopy.local.localtree import LocalTree

    source = tmp_path / "src"
    source.mkdir()
    for name, size in (("grows-small", 1000), ("grows-big", 3 * 1024 * 1024), ("steady", 2000)):
        (source / name).write_bytes(random_bytes(size, seed=size))

    class GrowingAfterListing(LocalTree):
        def stream(self):
            listing = super().stream()

            def batches():
                yield from listing.batches
                for name in ("grows-small", "grows-big"):
                    with open(source / name, "ab") as handle:
                        handle.write(b"more")

            return dataclasses.replace(listing, batches=batches())

    result = treesync.run_tree_sync(GrowingAfterListing(f"{source}/"), LocalTree(str(tmp_path / "dst")),
                                treesync.TreeOptions(concurrency=2))
    failed = {path for path, _ in result.failures}
    assert failed == {"grows-small", "grows-big"}, result.failures
    assert all("changed" in message for _, message in result.failures)
    assert sorted(os.listdir(tmp_path / "dst")) == ["steady"]  # no temporary, no partial file


def test_interrupted_tree_sync_leaves_whole_files_and_a_rerun_completes(tmp_path):
    import signal

    source = tmp_path / "src"
    for d in range(40):
        (source / f"d{d}").mkdir(parents=True)
        for f in range(50):
            (source / f"d{d}" / f"f{f}").write_bytes(random_bytes(20_000, seed=d * 100 + f))
    with open(source / "large", "wb") as handle:  # big enough to be still running when stopped
        for seed in range(8):
            handle.write(random_bytes(64 * 1024 * 1024, seed=seed))
    target = tmp_path / "dst"
    process = subprocess.Popen(pdiffcopy_command("--no-progress", "-a", f"{source}/", str(target)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            name.startswith("f") for name in (os.listdir(target / "d0") if (target / "d0").exists() else ())):
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    process.wait(timeout=60)
    assert process.returncode == 20, process.stderr.read()
    expected = snapshot(source, times=True)
    for path, item in snapshot(target).items():
        name = path.rpartition("/")[2]
        assert not name.startswith("."), f"temporary file left: {path}"
        if item[0] == "file":
            assert item[2] == expected[path][2], f"half-written file under its name: {path}"
    sync("-a", f"{source}/", target)
    assert snapshot(target, times=True) == expected


def test_progress_counts_every_file_and_byte_across_worker_processes(tmp_path, monkeypatch):
    from pdiffcopy.engine import treerunner, treesync
    from pdiffcopy.local.localtree import LocalTree
    from pdiffcopy.cli.progress import TreeProgressDisplay

    monkeypatch.setattr(treerunner, "INLINE_FILES", 1)  # force the forked workers
    source = tmp_path / "src"
    sizes = [(f"d{i % 7}/f{i}", 1000 + 37 * i) for i in range(300)]
    for name, size in sizes:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(random_bytes(size, seed=size))
    progress = treesync.TreeProgress(3)
    result = treesync.run_tree_sync(LocalTree(f"{source}/"), LocalTree(str(tmp_path / "dst")),
                                treesync.TreeOptions(concurrency=3), progress)
    total = sum(size for _, size in sizes)
    assert result.files_copied == 300 and result.bytes_moved == total
    assert (progress.files_total, progress.files_done) == (300, 300)
    assert (progress.bytes_total, progress.bytes_done) == (total, total)
    line = TreeProgressDisplay(progress).render()
    assert "300 of 300 files" in line


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0,
                    reason="needs root and setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
def test_delete_deletes_nothing_when_part_of_the_source_cannot_be_listed(tree, tmp_path):
    target = tmp_path / "dst"
    sync(f"{tree}/", target)
    os.chmod(tree / "sub", 0o000)  # its contents would look deleted
    drop = "-dac_override,-dac_read_search"
    done = subprocess.run(["setpriv", "--bounding-set", drop, "--inh-caps", drop,
                           *pdiffcopy_command("--no-progress", "--delete", f"{tree}/", str(target))],
                          capture_output=True, text=True)
    os.chmod(tree / "sub", 0o755)
    assert done.returncode == 23, done.stderr
    assert "Not deleting anything" in done.stderr
    assert (target / "sub" / "b.bin").exists() and (target / "sub" / "deeper" / "c.bin").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_target_stops_the_run_with_whole_files_only(tmp_path):
    source = tmp_path / "src"
    for d in range(20):  # 2,000 files: 8 batches, each of which would meet the full disk
        (source / f"d{d}").mkdir(parents=True)
        for f in range(100):
            (source / f"d{d}" / f"f{f}").write_bytes(random_bytes(3000, seed=d * 100 + f))
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        done = sync("-a", f"{source}/", small / "dst", ok=False)
        assert done.returncode == 23, done.stderr
        assert "file system is full: stopped" in done.stderr
        assert "Traceback" not in done.stderr
        # It stopped at the first full write of each worker, not after trying all 400 files.
        import re

        failed = int(re.search(r"(\d+) path\(s\) failed", done.stderr).group(1))
        assert failed <= 4, done.stderr[-2000:]
        expected = snapshot(source)
        for path, item in snapshot(small / "dst").items():
            assert not path.rpartition("/")[2].startswith("."), f"temporary left: {path}"
            if item[0] == "file":
                assert item == expected[path], f"partial file: {path}"
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_checksum_diff_lists_only_files_whose_content_differs(tree, tmp_path):
    target = tmp_path / "dst"
    sync("-a", f"{tree}/", target)
    (target / "sub" / "b.bin").write_bytes(bytes(300_000))  # same size, other content
    info = os.stat(tree / "sub" / "b.bin")
    os.utime(target / "sub" / "b.bin", ns=(info.st_atime_ns, info.st_mtime_ns))
    lines = sync("-a", "--checksum", "--diff", f"{tree}/", target).stdout.splitlines()
    assert len(lines) == 1 and "sub/b.bin" in lines[0] and "content" in lines[0], lines


def test_dot_source_means_its_contents(tree, tmp_path):
    done = subprocess.run(pdiffcopy_command("--no-progress", ".", str(tmp_path / "dst")), cwd=tree,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert snapshot(tmp_path / "dst") == snapshot(tree)


# -- The same scenarios at both ends: local -> local, server -> local (pull), local -> server (push) --------


@pytest.fixture
def source_tree(ends) -> Path:
    """The awkward tree (:func:`make_tree`) as the source of each mode (in the server's root for a pull)."""
    return make_tree(ends.source)


def test_copy_contents_with_trailing_slash(ends, source_tree):
    sync("-a", ends.source_arg(), ends.target_arg)
    target = ends.target
    assert snapshot(target, times=True) == snapshot(source_tree, times=True)
    assert os.stat(target).st_mtime_ns == os.stat(source_tree).st_mtime_ns  # the tree's own directory
    assert os.readlink(target / "link-outside") == "/etc/hostname"  # kept, not followed
    assert os.path.islink(target / "loop")


def test_copy_directory_itself_without_trailing_slash(ends, source_tree):
    ends.target.mkdir()
    sync(ends.source_arg(contents=False), ends.target_arg)
    assert snapshot(ends.target / source_tree.name) == snapshot(source_tree)
    assert sorted(os.listdir(ends.target)) == [source_tree.name]


def test_second_sync_moves_nothing(ends, source_tree):
    sync("-a", ends.source_arg(), ends.target_arg)
    second = sync("-a", "-v", ends.source_arg(), ends.target_arg)
    assert "0 file(s) copied (0 bytes moved)" in second.stderr


def test_delete_removes_extraneous_but_never_excluded(ends, source_tree):
    target = ends.target
    sync("-a", ends.source_arg(), ends.target_arg)
    (target / "extra.txt").write_bytes(b"extra")
    (target / "extra-dir" / "inner").mkdir(parents=True)
    (target / "extra-dir" / "inner" / "f").write_bytes(b"f")
    (target / "keep.log").write_bytes(b"log")
    (source_tree / "a.txt").write_bytes(b"shorter")
    kept = sync("-a", ends.source_arg(), ends.target_arg)
    assert (target / "extra.txt").exists()  # no --delete, nothing deleted
    assert kept.returncode == 0
    sync("-a", "--delete", "--exclude-regex", r"\.log$", ends.source_arg(), ends.target_arg)
    assert not (target / "extra.txt").exists()
    assert not (target / "extra-dir").exists()
    assert (target / "keep.log").read_bytes() == b"log"
    assert snapshot(target) == {**snapshot(source_tree), "keep.log": snapshot(target)["keep.log"]}
    got = snapshot(target, times=True)
    assert got.pop("keep.log")[0] == "file"
    assert got == snapshot(source_tree, times=True)


def test_include_and_exclude_filter_copy_and_delete(ends, source_tree):
    target = ends.target
    sync("--include-regex", r"\.bin$", "--exclude-regex", "^sub/deeper/", ends.source_arg(), ends.target_arg)
    copied = snapshot(target)
    assert set(copied) == {"sub", "sub/b.bin"}
    # An excluded directory is not entered: its contents are protected from --delete too.
    (target / "sub" / "deeper").mkdir()
    (target / "sub" / "deeper" / "mine").write_bytes(b"mine")
    (target / "other.txt").write_bytes(b"not selected by the include")
    sync("--delete", "--include-regex", r"\.bin$", "--exclude-regex", "^sub/deeper/", ends.source_arg(),
         ends.target_arg)
    assert (target / "sub" / "deeper" / "mine").exists()
    assert (target / "other.txt").exists()


def test_delete_with_include_deletes_only_what_the_include_selects(ends, source_tree):
    target = ends.target
    target.mkdir()
    (target / "stale.bin").write_bytes(b"stale")
    (target / "other.txt").write_bytes(b"not selected: protected")
    sync("-a", "--delete", "--include-regex", r"\.bin$", ends.source_arg(), ends.target_arg)
    assert set(snapshot(target)) == {"sub", "sub/b.bin", "sub/deeper", "sub/deeper/c.bin", "other.txt"}


def test_dry_run_and_diff_change_nothing_and_report_exactly(ends, source_tree):
    target = ends.target
    sync("-a", ends.source_arg(), ends.target_arg)
    (source_tree / "a.txt").write_bytes(b"changed content")
    (source_tree / "brand-new").write_bytes(b"new")
    (target / "extraneous").write_bytes(b"x")
    os.chmod(source_tree / "zero", 0o600)
    os.utime(source_tree, ns=(1_500_000_000_000_000_000,) * 2)  # seconds apart: rsync's quick check sees it
    before = snapshot(target, times=True)
    diff = sync("-a", "--diff", ends.source_arg(), ends.target_arg)
    lines = diff.stdout.splitlines()
    assert snapshot(target, times=True) == before
    assert any(line.startswith("new") and line.endswith("brand-new  (3 bytes)") for line in lines)
    assert any(line.startswith("changed") and "a.txt" in line and "size 6 -> 15" in line for line in lines)
    assert any(line.startswith("changed") and "zero" in line and "mode" in line for line in lines)
    assert any(line.startswith("extraneous") and line.endswith("extraneous") for line in lines)
    # The root's time, as rsync's ".d..t...... ./".
    assert lines[0] == "changed    dir     ./  (time)", lines
    assert len(lines) == 5, lines
    assert lines[1].startswith("changed") and "a.txt" in lines[1], lines
    dry = sync("-a", "-n", "--delete", ends.source_arg(), ends.target_arg)
    assert snapshot(target, times=True) == before
    assert any(line.startswith("delete") and "extraneous" in line for line in dry.stdout.splitlines())
    assert "Dry run:" in dry.stdout


#: Sparse files for each mode: (size, most bytes the copy may allocate). The big one goes
#: by ranges (at least treerunner.RANGE_SIZE), the small one whole.
SPARSE_CASES = {"small": (8 * 1024 * 1024, 64 * 1024), "big": (64 * 1024 * 1024, 1024 * 1024 - 1)}


@pytest.mark.parametrize("case", sorted(SPARSE_CASES))
def test_sparse_files_stay_sparse(ends, case):
    size, most = SPARSE_CASES[case]
    source = ends.source
    source.mkdir(parents=True)
    with open(source / "sparse", "wb") as handle:
        handle.truncate(size)
        handle.seek(size // 2)
        handle.write(b"data in the middle")
    sync(ends.source_arg(), ends.target_arg)
    copied = ends.target / "sparse"
    assert copied.read_bytes() == (source / "sparse").read_bytes()
    assert os.stat(copied).st_blocks * 512 <= most, os.stat(copied).st_blocks


def test_big_files_go_by_ranges_then_by_block_delta(ends, monkeypatch):
    treesync = small_engine(monkeypatch)
    source = ends.source
    source.mkdir(parents=True)
    big = random_bytes(5 * 1024 * 1024 + 12345, seed=5)
    name = os.fsdecode(b"big \xe9 name")  # not UTF-8: a URL must carry its bytes
    (source / name).write_bytes(big)
    (source / "small").write_bytes(b"s" * 100)
    options = treesync.TreeOptions(times=True, concurrency=2, block_size=64 * 1024)

    def run():
        return ends.sync_engine(options)

    first = run()
    assert not first.failures
    assert first.files_copied == 2 and first.bytes_moved == len(big) + 100
    assert snapshot(ends.target, times=True) == snapshot(source, times=True)
    changed = bytearray(big)
    changed[2 * 1024 * 1024] ^= 0x55  # one block
    (source / name).write_bytes(bytes(changed))
    second = run()
    assert not second.failures
    assert second.bytes_moved <= 2 * 64 * 1024, second.bytes_moved
    assert snapshot(ends.target, times=True) == snapshot(source, times=True)
    changed[3 * 1024 * 1024 + 7] ^= 1  # another block
    changed += b"tail"  # and the last block grows
    (source / name).write_bytes(bytes(changed))
    third = run()
    assert not third.failures
    assert third.bytes_moved <= 3 * 64 * 1024, third.bytes_moved
    assert (ends.target / name).read_bytes() == bytes(changed)
    assert snapshot(ends.target, times=True) == snapshot(source, times=True)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_remove_deletes_a_tree(request, tmp_path, where):
    if where == "local":
        tree, argument = make_tree(tmp_path / "src"), str(tmp_path / "src")
    else:
        server = request.getfixturevalue("server")
        name = request.getfixturevalue("unique").replace(".img", "")
        tree, argument = make_tree(server.root / name), server.url(name)
    dry = sync("--remove", "-n", argument)
    assert os.path.exists(tree / "sub" / "deeper" / "c.bin")
    assert "sub/deeper/c.bin" in dry.stdout
    sync("--remove", argument)
    assert not tree.exists()


def test_sync_tree_takes_sizes_as_text_as_sync_does(tmp_path):
    """The library's tree sync checks its options as the file sync does: ``"1M"`` is a size."""
    import pdiffcopy
    from pdiffcopy.errors import UsageError

    source = tmp_path / "src"
    source.mkdir()
    data = random_bytes(10 * 1024 * 1024)  # big enough for the block engine (DELTA_MIN_SIZE)
    (source / "big.bin").write_bytes(data)
    target = tmp_path / "dst"
    target.mkdir()
    (target / "big.bin").write_bytes(data[:5_000_000] + b"changed" + data[5_000_007:])
    result = pdiffcopy.sync_tree(str(source), str(target), block_size="1M", piece_size="4K",
                                 bwlimit="1G", concurrency=2)
    assert not result.failures
    assert (target / "big.bin").read_bytes() == (source / "big.bin").read_bytes()
    with pytest.raises(UsageError, match="block size"):
        pdiffcopy.sync_tree(str(source), str(target), block_size="lots")


def test_a_dry_run_closes_the_files_it_compares(tmp_path):
    """The dry run's content check (-n -c) hashes both sides and closes both: no descriptor outlives it."""
    import gc

    import pdiffcopy

    for side in ("src", "dst"):
        (tmp_path / side).mkdir()
        for index in range(20):
            (tmp_path / side / f"f{index}").write_bytes(random_bytes(100_000, seed=index + len(side)))

    def open_files():
        """The files of the two trees this process has open."""
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:  # (the listing's own descriptor)
                continue
            if path.startswith(str(tmp_path)) and os.path.isfile(path):
                found.append(path)
        return found

    was_enabled = gc.isenabled()
    gc.disable()  # a collection would close what the sync left open, by chance
    try:
        result = pdiffcopy.sync_tree(str(tmp_path / "src"), str(tmp_path / "dst"), dry_run=True, checksum=True)
        left_open = open_files()
    finally:
        if was_enabled:
            gc.enable()
    assert len(result.differences) == 20  # every file differs, found by content
    assert left_open == []


def test_dry_run_and_diff_list_the_roots_own_changes(ends):
    """-n and --diff once said "nothing to do" while the sync then changed the root's mode and time."""
    source, target = ends.source, ends.target
    source.mkdir(parents=True, exist_ok=True)
    (source / "f").write_bytes(b"f")
    sync("-a", ends.source_arg(), ends.target_arg)
    os.chmod(source, 0o750)
    os.utime(source, ns=(1_600_000_000_000_000_000,) * 2)
    before = os.stat(target)
    diff = sync("-a", "--diff", ends.source_arg(), ends.target_arg)
    assert diff.stdout.splitlines() == ["changed    dir     ./  (mode, time)"], diff.stdout
    dry = sync("-a", "-n", ends.source_arg(), ends.target_arg)
    assert "nothing to do" not in dry.stdout and "1 changed" in dry.stdout, dry.stdout
    assert os.stat(target).st_mode == before.st_mode and os.stat(target).st_mtime_ns == before.st_mtime_ns
    sync("-a", ends.source_arg(), ends.target_arg)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o750
    assert os.stat(target).st_mtime_ns == 1_600_000_000_000_000_000
    assert sync("-a", "--diff", ends.source_arg(), ends.target_arg).stdout == ""

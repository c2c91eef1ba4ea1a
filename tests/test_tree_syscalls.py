"""The system calls a tree sync spends per file: none that would change nothing.

Checked in the calls a real run makes (``strace -f``): as root with ``-a``,
a file or directory made by the sync is already ours, so only those of other
owners are chowned; an existing one's owner and mode, already known from the
``fstat`` that checks its kind, are set only where they differ. The owners
themselves must come out right, in set-group-ID directories too.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest
from test_kill_switch_and_confinement import needs_strace

from conftest import pdiffcopy_command, random_bytes

#: These measure this machine (``-m "not measures"`` leaves them out).
pytestmark = pytest.mark.measures

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="owners are kept only by root")

#: A chown-family call's last two numbers (uid, gid), before fchownat's flags.
_CHOWN = re.compile(r"\b[fl]?chown(?:at)?\(.*\b(-?\d+), (-?\d+)(?:, [A-Z_|]+)?\)\s+=")
#: A chmod-family call's mode (strace prints it in octal).
_CHMOD = re.compile(r"\bf?chmod(?:at)?\(.*, (0\d+)(?:, [A-Z_|]+)?\)\s+=")

THEIRS = (1234, 2345)


def run_traced(calls: str, trace: Path, *args: str) -> None:
    done = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), "-e", f"trace={calls}",
                           *pdiffcopy_command(*args)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def owner_calls(trace: Path) -> List[Tuple[int, int]]:
    return [(int(m.group(1)), int(m.group(2))) for m in map(_CHOWN.search, trace.read_text().splitlines()) if m]


def mode_calls(trace: Path) -> List[int]:
    return [int(m.group(1), 8) for m in map(_CHMOD.search, trace.read_text().splitlines()) if m]


def owner(path: Path) -> Tuple[int, int]:
    info = os.lstat(path)
    return info.st_uid, info.st_gid


def make_tree(source: Path) -> None:
    for name in ("d/one", "d/two", "d/three", "e/sub/four", "theirs/five"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(random_bytes(3000, seed=len(name)))
    os.chown(source / "d" / "two", *THEIRS)
    os.chown(source / "theirs", *THEIRS)


@needs_root
@needs_strace
def test_a_copy_as_root_chowns_only_what_belongs_to_others(ends, tmp_path):
    if ends.mode == "push":
        pytest.skip("a server keeps owners only for clients it trusts (test_server_trust)")
    make_tree(ends.source)
    trace = tmp_path / "trace"
    run_traced("chown,fchown,fchownat,lchown", trace, "-a", "--no-progress", "-q",
               ends.source_arg(), ends.target_arg)
    ours = (os.geteuid(), os.getegid())
    assert owner(ends.target / "d" / "two") == THEIRS
    assert owner(ends.target / "theirs") == THEIRS
    for name in ("", "d", "d/one", "d/three", "e", "e/sub", "e/sub/four", "theirs/five"):
        assert owner(ends.target / name) == ours, name
    calls = owner_calls(trace)
    assert calls.count(THEIRS) == 2
    # theirs/five only: made in a directory of another owner, its group might be that directory's.
    assert calls.count(ours) == 1, "a new file or directory was chowned to the owner it already had"


@needs_root
@needs_strace
def test_a_resync_as_root_sets_only_the_modes_and_owners_that_differ(ends, tmp_path):
    if ends.mode == "push":
        pytest.skip("a server keeps owners only for clients it trusts (test_server_trust)")
    make_tree(ends.source)
    done = subprocess.run(pdiffcopy_command("-a", "--no-progress", "-q", ends.source_arg(), ends.target_arg),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    os.utime(ends.source / "d" / "one", ns=(1_600_000_000_000_000_000,) * 2)  # a new time only
    os.chmod(ends.source / "d" / "three", 0o600)
    os.chown(ends.source / "e" / "sub" / "four", *THEIRS)
    trace = tmp_path / "trace"
    run_traced("chown,fchown,fchownat,lchown,chmod,fchmod,fchmodat", trace, "-a", "--no-progress", "-q",
               ends.source_arg(), ends.target_arg)
    assert os.stat(ends.target / "d" / "one").st_mtime_ns == 1_600_000_000_000_000_000
    assert os.stat(ends.target / "d" / "three").st_mode & 0o7777 == 0o600
    assert owner(ends.target / "e" / "sub" / "four") == THEIRS
    assert owner_calls(trace) == [THEIRS]
    assert mode_calls(trace) == [0o600]


@needs_root
def test_new_files_in_a_set_group_id_directory_get_the_source_group(tmp_path):
    source, target = tmp_path / "src", tmp_path / "dst"
    make_tree(source)
    target.mkdir()
    os.chown(target, os.geteuid(), 4321)
    os.chmod(target, 0o2775)  # what is made in it gets group 4321 unless chowned
    done = subprocess.run(pdiffcopy_command("-a", "--no-progress", "-q", f"{source}/", str(target)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ours = (os.geteuid(), os.getegid())
    for name in ("", "d", "d/one", "d/three", "e", "e/sub", "e/sub/four", "theirs/five"):
        assert owner(target / name) == ours, name
    assert owner(target / "d" / "two") == THEIRS

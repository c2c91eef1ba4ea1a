"""A missing target directory, as rsync treats it, and ``--mkpath`` (issue 38).

rsync makes the last directory of a target it is told is one (a file to ``dir/``, a tree
to ``dir/``), but not its missing parents, unless ``--mkpath``: a single file to
``missing/sub/`` fails, and so does a tree to ``missing/deeper/`` (pdiffcopy once failed the
first and made any depth for the second). Each case runs locally, pulled and pushed, and
is compared with what rsync makes of it, when rsync is installed; one runs over ssh.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

import test_ssh
from conftest import run_cli
from test_ssh import over_ssh

#: The ssh tests' sshd, for the case over ssh.
sshd = test_ssh.sshd

needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is needed to compare with")


@dataclass
class Ends:
    """A sync's source directory and target directory, on disk and as arguments."""

    mode: str
    source: Path
    target: Path
    source_url: Optional[str] = None
    target_url: Optional[str] = None

    def source_arg(self, name: str) -> str:
        return f"{self.source_url or self.source}/{name}"  # (a Path would drop a trailing slash)

    def target_arg(self, name: str) -> str:
        return f"{self.target_url or self.target}/{name}"


@pytest.fixture(params=("local", "pull", "push"))
def ends(request, tmp_path, unique) -> Ends:
    if request.param == "local":
        found = Ends("local", tmp_path / "src", tmp_path / "dst")
    else:
        server = request.getfixturevalue("server")
        name = unique.replace(".img", "")
        if request.param == "pull":
            found = Ends("pull", server.root / name, tmp_path / "dst", source_url=server.url(name))
        else:
            found = Ends("push", tmp_path / "src", server.root / name, target_url=server.url(name))
    found.source.mkdir()
    found.target.mkdir()
    (found.source / "f").write_bytes(b"a file\n")
    (found.source / "d").mkdir()
    (found.source / "d" / "x").write_bytes(b"in the tree\n")
    return found


def layout(root: Path) -> List[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def one_line_error(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr
    return lines[0]


#: (SOURCE, TARGET below the target directory, extra options, whether rsync 3.2.3+ succeeds).
CASES = [
    ("f", "missing/", (), True),
    ("f", "missing/sub/", (), False),
    ("f", "missing/sub", (), False),
    ("d/", "missing/", (), True),
    ("d/", "missing/deeper/", (), False),
    ("d", "missing/deeper/", (), False),
    ("d/", "missing/deeper", (), False),
    ("f", "missing/sub/", ("--mkpath",), True),
    ("f", "missing/sub", ("--mkpath",), True),
    ("f", "missing/a/b/", ("--mkpath",), True),
    ("d/", "missing/deeper/", ("--mkpath",), True),
    ("d", "missing/a/b", ("--mkpath",), True),
]


@pytest.mark.parametrize("source, target, extra, succeeds", CASES,
                         ids=[" ".join((*case[2], case[0], case[1])) for case in CASES])
def test_a_missing_target_directory_as_rsync(ends, tmp_path, source, target, extra, succeeds):
    done = run_cli("--no-progress", *extra, ends.source_arg(source), ends.target_arg(target))
    if succeeds:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode != 0
        message = one_line_error(done)
        assert "--mkpath" in message, message
        assert layout(ends.target) == []  # nothing made on the way
    if shutil.which("rsync"):
        reference = tmp_path / "rsync"
        reference.mkdir()
        made = subprocess.run(["rsync", "-r", *extra, f"{ends.source}/{source}", f"{reference}/{target}"],
                              capture_output=True)
        assert (made.returncode == 0) == succeeds, made.stderr
        assert layout(ends.target) == layout(reference)


def test_a_single_file_into_a_missing_directory_keeps_going_with_a(ends):
    done = run_cli("--no-progress", "-a", ends.source_arg("f"), ends.target_arg("made/"))
    assert done.returncode == 0, done.stderr
    assert (ends.target / "made" / "f").read_bytes() == b"a file\n"


def test_a_dry_run_makes_no_directory(ends):
    done = run_cli("--no-progress", "-n", "--mkpath", ends.source_arg("f"), ends.target_arg("a/b/"))
    assert done.returncode == 0, done.stderr
    assert layout(ends.target) == []


def test_mkpath_is_refused_by_a_server_start():
    done = run_cli("--mkpath")
    assert done.returncode == 1  # usage, as rsync's
    assert "--mkpath" in one_line_error(done)


def test_over_ssh_missing_parents_fail_unless_mkpath(sshd, tmp_path):
    (tmp_path / "f").write_bytes(b"over ssh\n")
    remote = tmp_path / "remote"
    remote.mkdir()
    done = over_ssh(sshd, str(tmp_path / "f"), f"127.0.0.1:{remote}/a/b/")
    assert done.returncode != 0
    assert "--mkpath" in one_line_error(done)
    assert layout(remote) == []
    done = over_ssh(sshd, "--mkpath", str(tmp_path / "f"), f"127.0.0.1:{remote}/a/b/")
    assert done.returncode == 0, done.stderr
    assert (remote / "a" / "b" / "f").read_bytes() == b"over ssh\n"
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    done = over_ssh(sshd, f"127.0.0.1:{remote}/a/", f"{pulled}/one/two/")
    assert done.returncode != 0 and "--mkpath" in one_line_error(done)
    done = over_ssh(sshd, "--mkpath", f"127.0.0.1:{remote}/a/", f"{pulled}/one/two/")
    assert done.returncode == 0, done.stderr
    assert (pulled / "one" / "two" / "b" / "f").read_bytes() == b"over ssh\n"

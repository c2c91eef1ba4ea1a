"""rsync's short flags as scripts type them: -r, --links, -p, -g; and rsync's options that make no sense here.

``-r`` without ``--links`` (or ``-a``) leaves symlinks out, as rsync's does;
``-rptgoD --links`` is ``-a``. An rsync option for its daemon or its
protocol is refused in one line that says why, never ignored.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from test_tree import snapshot

needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")


def tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "f").write_bytes(b"f")
    (root / "sub" / "g").write_bytes(b"g")
    os.symlink("f", root / "link")
    os.symlink("sub", root / "sub-link")
    os.chmod(root / "f", 0o640)
    return root


@needs_rsync
@pytest.mark.parametrize("options", [["-r"], ["-r", "--links"], ["-rptgoD", "--links"], ["-rtp"]],
                         ids=["r", "r-links", "a-spelled-out", "rtp"])
def test_the_flags_copy_what_rsyncs_copy(ends, tmp_path, options):
    tree(ends.source)
    done = run_cli("--no-progress", *options, ends.source_arg(), ends.target_arg)
    assert done.returncode == 0, done.stderr
    reference = tmp_path / "rsync"
    subprocess.run(["rsync", *options, f"{ends.source}/", f"{reference}/"], check=True)
    times = "t" in options[0]
    theirs = snapshot(reference, times=times)
    if times:  # directories: the source's times (rsync's are those of its last write in them)
        original = snapshot(ends.source, times=True)
        theirs = {path: original[path] if item[0] == "dir" else item for path, item in theirs.items()}
    assert snapshot(ends.target, times=times) == theirs
    if "--links" not in options:
        assert "Skipped 2 symlink(s)" in done.stderr and "--links" in done.stderr


@pytest.mark.parametrize("option, words", [
    (["--daemon"], "daemon"), (["--rsync-path=/usr/bin/rsync"], "--remote-pdiffcopy"),
    (["--password-file=x"], "daemon"), (["--protocol=30"], "protocol"), (["--blocking-io"], "ssh"),
    (["--checksum-seed=1"], "protocol"), (["--port=873"], "daemon"), (["--iconv=utf8"], "bytes"),
])
def test_rsync_options_that_make_no_sense_here_are_refused_in_one_line(tmp_path, option, words):
    (tmp_path / "src").mkdir()
    done = run_cli("--no-progress", *option, f"{tmp_path}/src/", tmp_path / "dst")
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "dst").exists()


def test_g_alone_and_rsyncs_l_in_a_bundle_are_explained(tmp_path):
    (tmp_path / "src").mkdir()
    alone = run_cli("--no-progress", "-g", f"{tmp_path}/src/", tmp_path / "dst")
    assert alone.returncode == 1 and "-o" in alone.stderr
    bundled = run_cli("--no-progress", "-rlptgoD", f"{tmp_path}/src/", tmp_path / "dst")
    assert bundled.returncode == 1 and "--links" in bundled.stderr and "Traceback" not in bundled.stderr
    assert not (tmp_path / "dst").exists()

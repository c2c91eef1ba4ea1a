"""``-aHAXS`` as a whole, as rsync users type it: one awkward tree, local, pulled and pushed, against ``rsync -aHAXS``.

The tree holds sparse files (holes at the start, the middle and the end, all hole,
empty, one big enough for the block engine), a hard-linked sparse file, names of
a group across directories, extended attributes on linked and sparse files, and
ACLs with named users and a default ACL. The target must have the same bytes,
modes and times, the same allocation (within one file system block per extent),
the same names sharing the same files, the same attributes and the same ACLs as
rsync's copy of the same tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_hardlinks import assert_same_as_rsync
from test_holes import make_sparse
from test_xattrs import attributes, getfacl, setfacl

from conftest import run_cli

KIB, MIB = 1024, 1024 * 1024

#: name -> (size, data extents); "big" goes through the block engine in a tree (64 MiB and up).
SPARSE = {
    "holes/start.img": (4 * MIB, [(3 * MIB, MIB)]),
    "holes/middle.img": (4 * MIB, [(0, MIB), (3 * MIB, MIB)]),
    "holes/end.img": (4 * MIB, [(0, MIB + 192 * KIB)]),
    "holes/all-hole.img": (3 * MIB, []),
    "holes/empty.img": (0, []),
    "big/disk.img": (96 * MIB, [(8 * MIB, 2 * MIB), (70 * MIB, MIB), (96 * MIB - 64 * KIB, 64 * KIB)]),
}

needs_tools = pytest.mark.skipif(not (shutil.which("rsync") and shutil.which("setfacl")),
                                 reason="rsync and setfacl (Debian's rsync and acl) are needed")


def awkward_tree(root: Path) -> Path:
    for name, (size, extents) in SPARSE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        make_sparse(root / name, size, extents, seed=len(name))
    (root / "links").mkdir()
    os.link(root / "holes" / "middle.img", root / "links" / "middle-again.img")
    (root / "links" / "text").write_bytes(b"shared\n" * 1000)
    os.link(root / "links" / "text", root / "big" / "text")
    os.setxattr(root / "links" / "text", "user.colour", b"green")
    os.setxattr(root / "big" / "disk.img", "user.kind", b"raw")
    os.setxattr(root / "holes", "user.purpose", b"sparse files")
    setfacl("-m", "u:daemon:r--,g:bin:rw-", root / "holes" / "start.img")
    setfacl("-d", "-m", "u:bin:rwx", root / "big")
    for directory, _, files in os.walk(root):
        for name in files:
            os.utime(os.path.join(directory, name), ns=(1_600_000_000_000_000_000,) * 2)
    return root


def allocation(root: Path) -> dict:
    """Each regular file's allocated bytes, after a flush (delayed allocation counts too)."""
    os.sync()
    return {str(path.relative_to(root)): os.lstat(path).st_blocks * 512
            for path in root.rglob("*") if path.is_file() and not path.is_symlink()}


def assert_allocated_alike(ours: Path, reference: Path) -> None:
    block = os.statvfs(ours).f_bsize
    theirs = allocation(reference)
    for name, allocated in allocation(ours).items():
        extents = len(SPARSE.get(name, (0, [(0, 0)]))[1])
        assert abs(allocated - theirs[name]) <= block * (extents + 1), (name, allocated, theirs[name])


@needs_tools
def test_aHAXS_makes_what_rsync_aHAXS_makes(ends, tmp_path):
    source = awkward_tree(ends.source)
    done = run_cli("--no-progress", "-aHAXS", ends.source_arg(), ends.target_arg)
    assert done.returncode == 0, done.stderr
    reference = tmp_path / "rsync"
    subprocess.run(["rsync", "-aHAXS", f"{source}/", f"{reference}/"], check=True)
    assert_same_as_rsync(ends.target, reference, source)  # bytes, modes, times, names sharing files
    assert_allocated_alike(ends.target, reference)
    # The session server does not trust its clients: a push keeps user.* and ACLs only.
    trusted = ends.mode != "push"
    assert attributes(ends.target, privileged=trusted) == attributes(reference, privileged=trusted)
    assert getfacl(ends.target) == getfacl(reference)
    # The big sparse file went through the block engine with its holes: it holds its data only.
    assert os.stat(ends.target / "big" / "disk.img").st_blocks * 512 < 8 * MIB

"""The one segment engine: a file sync and a tree sync share its rules, and it sees only interfaces.

A tree's big files and a single-file sync go through the same hashing,
comparison, move and verification (pdiffcopy.engine.segments). These tests pin what
that buys: the same (stronger) verification rule on both paths, one set of
errors, one options object, and an engine that works with any
:class:`~pdiffcopy.engine.endpoints.FileEndpoint` / :class:`~pdiffcopy.engine.treeendpoints.TreeEndpoint`,
not only the two it was written beside.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from conftest import random_bytes

from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.errors import FileMissing, VerificationFailed
from pdiffcopy.core.hashing import digest_bytes
from pdiffcopy.local.localtree import LocalTree
from pdiffcopy.api import sync
from pdiffcopy.engine.treeendpoints import TreeEndpoint
from pdiffcopy.engine.treesync import TreeOptions, run_tree_sync

#: The smallest block size: many blocks in a small file.
BLOCK = 1024

#: Above the tree engine's smallest file for the block delta (8 MiB).
BIG = 9 * 1024 * 1024

#: Two different 1 KiB blocks with the same xxh32 digest (found by a birthday
#: search over 8-byte counters repeated to fill a block): a weak block hash
#: takes one for the other, only a strong verification tells them apart.
COLLIDING = ((42263).to_bytes(8, "big") * 128, (64095).to_bytes(8, "big") * 128)


def _colliding_pair(tmp_path):
    """A source and a target file that differ only in block 0, which xxh32 cannot tell apart."""
    first, second = COLLIDING
    assert first != second and digest_bytes("xxh32", first) == digest_bytes("xxh32", second)
    body = random_bytes(BIG - BLOCK, seed=11)
    return first + body, second + body


def test_a_tree_verifies_like_a_file_sync_when_the_block_hash_is_weak(tmp_path):
    """With a weak block hash, every block is verified with a strong one, in a tree as in a file sync.

    The tree engine used to read back only the blocks it wrote: a block the
    weak hash took for unchanged stayed wrong and the file was reported synced.
    """
    wanted, stale = _colliding_pair(tmp_path)
    for kind in ("file", "tree"):
        source, target = tmp_path / kind / "source", tmp_path / kind / "target"
        source.mkdir(parents=True)
        target.mkdir()
        (source / "big.img").write_bytes(wanted)
        (target / "big.img").write_bytes(stale)
        os.utime(source / "big.img", ns=(1, 1))  # another time: compared, then synced by the delta
        if kind == "file":
            with pytest.raises(VerificationFailed):
                sync(str(source / "big.img"), str(target / "big.img"), block_size=BLOCK,
                     hash_method="xxh32", concurrency=1)
            continue
        result = run_tree_sync(LocalTree(str(source)), LocalTree(str(target)),
                           TreeOptions(concurrency=1, block_size=BLOCK, hash_method="xxh32"))
        if (target / "big.img").read_bytes() != wanted:
            assert [path for path, _ in result.failures] == ["big.img"], \
                "the tree sync reported a file synced that differs from its source"
            assert "Verification failed" in result.failures[0][1]


class PlainFile(FileEndpoint):
    """A file endpoint with only the required operations: no optional capability at all."""

    def __init__(self, inner: FileEndpoint) -> None:
        self.inner = inner
        self.location = inner.location

    def stat(self):
        return self.inner.stat()

    def submit_hashes(self, ranges, block_size, method):
        return self.inner.submit_hashes(ranges, block_size, method)

    def prepare(self, size):
        self.inner.prepare(size)

    def read_ranges(self, ranges):
        return self.inner.read_ranges(ranges)

    def write_ranges(self, ranges, chunks):
        return self.inner.write_ranges(ranges, chunks)

    def flush(self):
        self.inner.flush()

    def create_temporary(self, clone):
        return PlainFile(self.inner.create_temporary(clone))

    def replace(self, other):
        self.inner.replace(other.inner)

    def remove_temporary(self):
        self.inner.remove_temporary()

    def take_lease(self):
        self.inner.take_lease()

    def end_lease(self):
        self.inner.end_lease()

    def close(self):
        self.inner.close()


class PlainTree(TreeEndpoint):
    """A tree endpoint with only the required operations, handing out :class:`PlainFile` files."""

    def __init__(self, inner: TreeEndpoint) -> None:
        self.inner = inner
        self.location = inner.location

    def list(self):
        return self.inner.list()

    def read_files(self, entries):
        return self.inner.read_files(entries)

    def write_files(self, files, options, fresh=False):
        return self.inner.write_files(files, options, fresh)

    def apply(self, operations, options):
        return self.inner.apply(operations, options)

    def file_endpoint(self, path):
        return PlainFile(self.inner.file_endpoint(path))

    def close(self):
        self.inner.close()


def test_the_engine_needs_no_optional_capability(tmp_path):
    """Trees and files offering only the interface's required operations sync completely.

    The engine used to ask local files for kernel copies and in-thread
    hashing without asking whether they could: any other endpoint failed.
    """
    source, target = tmp_path / "source", tmp_path / "target"
    (source / "sub").mkdir(parents=True)
    target.mkdir()
    old = random_bytes(BIG, seed=3)
    new = bytearray(old)
    new[5 * BLOCK:6 * BLOCK] = bytes(BLOCK)
    (source / "big.img").write_bytes(bytes(new))
    (target / "big.img").write_bytes(old)
    os.utime(source / "big.img", ns=(1, 1))
    for index in range(5):
        (source / "sub" / f"small-{index}").write_bytes(random_bytes(1000 + index, seed=index))
    result = run_tree_sync(PlainTree(LocalTree(str(source))), PlainTree(LocalTree(str(target))),
                       TreeOptions(concurrency=1, block_size=64 * 1024))
    assert not result.failures
    assert (target / "big.img").read_bytes() == bytes(new)
    for index in range(5):
        assert (target / "sub" / f"small-{index}").read_bytes() == random_bytes(1000 + index, seed=index)
    assert result.bytes_moved < BIG // 4, "the big file was copied whole, not by its delta"


def test_a_missing_source_tree_is_file_missing(tmp_path):
    with pytest.raises(FileMissing, match="Source does not exist"):
        run_tree_sync(LocalTree(str(tmp_path / "nothing")), LocalTree(str(tmp_path / "target")),
                  TreeOptions(concurrency=1))


def test_file_options_are_a_subset_of_tree_options():
    from pdiffcopy.engine.options import FileOptions

    assert issubclass(TreeOptions, FileOptions)
    file_fields = {field.name for field in dataclasses.fields(FileOptions)}
    assert {"block_size", "hash_method", "whole_file", "concurrency", "dry_run", "atomic"} <= file_fields
    assert file_fields <= {field.name for field in dataclasses.fields(TreeOptions)}


def test_the_engine_imports_no_kind_of_endpoint():
    """The segment engine knows the interfaces only: no local or remote file, no tree, no server."""
    import ast
    import importlib.util
    from pathlib import Path

    tree = ast.parse(Path(importlib.util.find_spec("pdiffcopy.engine.segments").origin).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module} | \
        {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not imported & {"pdiffcopy.local.localfile", "pdiffcopy.transport.remote", "pdiffcopy.local.localtree",
                           "pdiffcopy.transport.remotetree", "pdiffcopy.server.app", "pdiffcopy.server.service",
                           "pdiffcopy.api", "pdiffcopy.cli.command"}


class _LocalHashes:
    """How many times the local side started hashing, for the remote side to wait on."""

    def __init__(self) -> None:
        import threading

        self.started = 0
        self.changed = threading.Condition()

    def start(self) -> None:
        with self.changed:
            self.started += 1
            self.changed.notify_all()

    def wait_for_one_after(self, count: int, seconds: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.started > count, seconds)


class _Remote(PlainFile):
    """A real remote file whose server answers only once the local side starts hashing too (10 s at most).

    Its answer comes at once only if the engine asked it first and hashed the local side meanwhile.
    """

    def __init__(self, inner: FileEndpoint, local: _LocalHashes) -> None:
        super().__init__(inner)
        self.local = local
        self.waited_in_vain = 0

    def hashes_here(self):
        return False

    def submit_hashes(self, ranges, block_size, method):
        from concurrent.futures import ThreadPoolExecutor

        before = self.local.started

        def hashes():
            if not self.local.wait_for_one_after(before, 10):
                self.waited_in_vain += 1
            return self.inner.submit_hashes(ranges, block_size, method).result()

        pool = ThreadPoolExecutor(1)
        try:
            return pool.submit(hashes)
        finally:
            pool.shutdown(wait=False)


class _Local(PlainFile):
    """A real local file hashed in this thread (as in a tree's worker) that says when it starts."""

    def __init__(self, inner: FileEndpoint, local: _LocalHashes) -> None:
        super().__init__(inner)
        self.local = local

    def hashes_here(self):
        return True

    def submit_hashes(self, ranges, block_size, method):
        self.local.start()
        return self.inner.submit_hashes(ranges, block_size, method)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_a_segment_hashes_both_sides_at_once(server, tmp_path, unique, direction):
    """A tree's worker hashes its local side while the server hashes the remote one.

    It used to wait for the server's digests of a segment before it hashed its
    own (or the reverse): the two sides' times added up, per segment of a big file.
    A weak block hash makes every step hash both sides (compare, verify).
    """
    from pdiffcopy.core.blocks import BlockPlan
    from pdiffcopy.engine.segments import sync_segment
    from pdiffcopy.local.localfile import LocalFile
    from pdiffcopy.transport.remote import RemoteFile

    old = random_bytes(4 * 64 * 1024, seed=21)
    new = bytearray(old)
    new[70000:70016] = bytes(16)
    remote_path, local_path = server.root / unique, tmp_path / "local.img"
    remote_path.write_bytes(bytes(new) if direction == "pull" else old)
    local_path.write_bytes(old if direction == "pull" else bytes(new))
    hashes = _LocalHashes()
    remote = _Remote(RemoteFile(server.url(unique)), hashes)
    local = _Local(LocalFile(str(local_path)), hashes)
    source, work = (remote, local) if direction == "pull" else (local, remote)
    plan = BlockPlan(len(new), 64 * 1024)
    try:
        for segment in plan.segments():
            sync_segment(source, work, plan, segment, "xxh3_64", "test", piece_size=4096)
    finally:
        remote.close()
        local.close()
    assert (local_path if direction == "pull" else remote_path).read_bytes() == bytes(new)
    assert hashes.started >= 2
    assert remote.waited_in_vain == 0, "one side's hashes were waited for before the other side hashed"


def test_the_steps_are_written_once():
    """The file job, the content-defined delta and a tree's units run the steps of SegmentSteps.

    Each used to hash, compare, move and verify with loops of its own: a fix to one (the
    hole shortcut, progress counting, the read-back rule) missed the others.
    """
    import ast
    import importlib.util
    from pathlib import Path

    steps = {"submit_hashes", "hash_ranges", "zero_digests", "coalesce", "refine_ranges",
             "check_blocks", "tree_digest_input", "digest_bytes"}
    for module, also in (("pdiffcopy.engine.filejob", {"move_data", "move_ranges", "data_map"}),
                         ("pdiffcopy.engine.chunkdelta", set()), ("pdiffcopy.engine.treeunits", set())):
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
            {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        assert not used & (steps | also), f"{module} runs steps of its own: {sorted(used & (steps | also))}"

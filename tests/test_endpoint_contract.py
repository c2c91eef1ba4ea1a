"""One contract for every endpoint kind, restic's backend test suite being the model.

Each test below runs against every kind of :class:`~pdiffcopy.engine.endpoints.FileEndpoint`
(a local file, a file behind a real server) or of
:class:`~pdiffcopy.engine.treeendpoints.TreeEndpoint` (a local tree, a tree behind a
real server), built over a temporary directory by the fixtures. A sync only
sees these interfaces, so whatever one kind does the others must do too: the
same digests for the same bytes, the same exception class for the same
mistake, the same failures reported for the same batch. Only public methods
are used; the files are checked on disk, under the directory each kind serves.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

import pdiffcopy

from pdiffcopy.engine.endpoints import (
    CAPABILITIES,
    ContentChunks,
    FileEndpoint,
    HashingHere,
    Holes,
    KernelCopies,
    Leases,
    PartialFiles,
    PriorityHashing,
)
from pdiffcopy.engine.capabilities import without
from pdiffcopy.errors import AccessDenied, Conflict, FileMissing, Locked, NotAFile, PdiffcopyError, Unsupported
from pdiffcopy.core.hashing import SERVER_HASH_METHODS, available_methods, digest_bytes
from pdiffcopy.local.localfile import LocalFile
from pdiffcopy.local.localtree import LocalTree
from pdiffcopy.transport.legacyremote import LegacyRemoteFile
from pdiffcopy.transport.remote import RemoteFile
from pdiffcopy.transport.remotetree import RemoteTree
from pdiffcopy.engine.treeendpoints import (
    DELETE,
    Alternates,
    METADATA,
    MKDIR,
    REMOVE,
    SYMLINK,
    MetadataOptions,
    TREE_CAPABILITIES,
    KeptAttributes,
    Operation,
    ServedTree,
    TreeCopies,
    TreeEndpoint,
    WalkedHere,
)
from pdiffcopy.core.treeplan import DIR, FILE, Entry
from pdiffcopy.core.treeplan import SYMLINK as SYMLINK_KIND

from conftest import random_bytes
from test_compat_101 import original_server  # noqa: F401 (a fixture: the legacy kind's server)

#: Small blocks, so that a few KiB of data make several of them (and a partial last one).
BLOCK_SIZE = 1024

#: Big enough for several blocks and a partial last one, small enough to take no time.
DATA_SIZE = 5 * BLOCK_SIZE + 123

#: A method every server here accepts and every installation has.
METHOD = "sha1"

#: The file kinds and tree kinds of the contract. "legacy" is a file of a pdiffcopy 1.0.1 server
#: (skipped where 1.0.1 is not installed): what its old API cannot do, it answers "unsupported"
#: in the interface's way (:data:`LEGACY_CANNOT`), and the tests assert that answer instead.
FILE_KINDS = ("local", "remote")
ANY_FILE_KINDS = FILE_KINDS + ("legacy",)
TREE_KINDS = ("local", "remote")

#: Metadata options of the tree tests: times kept, so that the metadata operation has something to show.
TIMES = MetadataOptions(times=True)


@dataclass
class FileKind:
    """One kind of file endpoint over a directory: ``open(name)`` makes an endpoint of ``directory/name``."""

    name: str
    directory: Path
    open: Callable[[str], FileEndpoint]


@dataclass
class TreeKind:
    """One kind of tree endpoint over a directory: ``open(name)`` makes the tree at ``directory/name``."""

    name: str
    directory: Path
    open: Callable[[str], TreeEndpoint]


def _subdirectory(server, request) -> Path:
    """A directory of its own in the shared server's root (tests share the session server)."""
    safe = "".join(c if c.isalnum() else "_" for c in request.node.name)
    directory = server.root / "contract" / safe
    directory.mkdir(parents=True)
    return directory


def _kinds(request, tmp_path, local: Callable[[str], object], remote: Callable[[str], object],
           legacy: Callable[[str], object] = None):
    """The directory a kind works in and a factory of its endpoints (closed at the end)."""
    opened: list = []
    if request.param == "local":
        directory, make = tmp_path, local
        prefix = str(tmp_path)
    elif request.param == "legacy":
        # 1.0.1 names a file by its absolute path, anywhere: the URL's path is the local one.
        directory, make = tmp_path, legacy
        prefix = request.getfixturevalue("original_server") + str(tmp_path)
    else:
        server = request.getfixturevalue("server")
        directory, make = _subdirectory(server, request), remote
        prefix = server.url(directory.relative_to(server.root).as_posix())

    def open_one(name: str):
        endpoint = make(f"{prefix}/{name}")
        opened.append(endpoint)
        return endpoint

    return directory, open_one, opened


def _files(request, tmp_path) -> Iterator[FileKind]:
    pool = ThreadPoolExecutor(2)
    directory, make, opened = _kinds(request, tmp_path, lambda path: LocalFile(path, pool),
                                     lambda url: RemoteFile(url, concurrency=2),
                                     lambda url: LegacyRemoteFile(url, concurrency=2))
    yield FileKind(request.param, directory, make)
    for endpoint in opened:
        endpoint.close()
    pool.shutdown()


@pytest.fixture(params=FILE_KINDS)
def files(request, tmp_path) -> Iterator[FileKind]:
    """A factory of file endpoints of each kind, and the directory it works in."""
    yield from _files(request, tmp_path)


@pytest.fixture(params=ANY_FILE_KINDS)
def any_files(request, tmp_path) -> Iterator[FileKind]:
    """:func:`files`, and a file of a pdiffcopy 1.0.1 server (for what its old API does, or declines)."""
    yield from _files(request, tmp_path)


@pytest.fixture(params=TREE_KINDS)
def trees(request, tmp_path) -> Iterator[TreeKind]:
    """A factory of tree endpoints of each kind, and the directory it works in."""
    directory, make, opened = _kinds(request, tmp_path, LocalTree,
                                     lambda url: RemoteTree(url, concurrency=2))
    yield TreeKind(request.param, directory, make)
    for tree in opened:
        tree.close()


def block_digests(data: bytes, block_size: int = BLOCK_SIZE, method: str = METHOD) -> bytes:
    """What every kind must answer for the blocks of ``data``, computed here with the plain hash."""
    return b"".join(digest_bytes(method, data[offset:offset + block_size])
                    for offset in range(0, len(data), block_size))


def read_all(endpoint: FileEndpoint, ranges) -> bytes:
    return b"".join(bytes(data) for _, data in endpoint.read_ranges(ranges))


# -- files: describing ----------------------------------------------------------------------


def test_exists_says_whether_the_file_is_there(any_files):
    (any_files.directory / "there").write_bytes(b"x")
    (any_files.directory / "empty").write_bytes(b"")
    assert any_files.open("there").exists()
    assert any_files.open("empty").exists()
    assert not any_files.open("none").exists()




def test_stat_of_a_missing_file_is_none(any_files):
    assert any_files.open("missing.img").stat() is None


def test_stat_of_a_file_in_a_missing_directory_is_none(any_files):
    assert any_files.open("no-such-dir/missing.img").stat() is None


def test_stat_describes_a_present_file(files):
    path = files.directory / "present.img"
    path.write_bytes(random_bytes(DATA_SIZE))
    os.utime(path, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    info = files.open("present.img").stat()
    assert info is not None
    assert (info.kind, info.size, info.mtime_ns) == ("file", DATA_SIZE, 1_600_000_000_123_456_789)
    assert info.etag


def test_etag_changes_when_the_file_changes(files):
    path = files.directory / "changing.img"
    path.write_bytes(b"one")
    before = files.open("changing.img").stat()
    path.write_bytes(b"other content")
    after = files.open("changing.img").stat()
    assert before is not None and after is not None
    assert before.etag != after.etag


def test_stat_of_a_directory_says_directory(files):
    (files.directory / "subdir").mkdir()
    info = files.open("subdir").stat()
    assert info is not None and info.kind == "directory"


# -- files: reading and hashing -------------------------------------------------------------


def test_read_ranges_gives_the_bytes_asked_for(any_files):
    data = random_bytes(DATA_SIZE)
    (any_files.directory / "read.img").write_bytes(data)
    ranges = [(0, 10), (1000, 2048), (DATA_SIZE - 5, 5)]
    # A chunk may be a view of a reused buffer (see the next test): copied as it comes.
    chunks = [(offset, bytes(piece)) for offset, piece in any_files.open("read.img").read_ranges(ranges)]
    assert b"".join(piece for _, piece in chunks) == b"".join(data[o:o + n] for o, n in ranges)
    # Every chunk says where it belongs, in order.
    for offset, piece in chunks:
        assert piece == data[offset:offset + len(piece)]
    assert [offset for offset, _ in chunks] == sorted(offset for offset, _ in chunks)


#: Larger than the buffer a reader reuses (descriptors.TRANSFER_CHUNK_SIZE, 1 MiB): one range takes several chunks.
REUSED_BUFFER_DATA_SIZE = 2 * 1024 * 1024 + 4321


def test_read_chunks_are_used_before_the_next_is_asked_for(any_files):
    # The rule of FileEndpoint.read_ranges: a chunk may be a view of a buffer the next one reuses
    # (a local file's and a remote file's are), so each is used (checked here) as it comes...
    data = random_bytes(REUSED_BUFFER_DATA_SIZE, seed=12)
    (any_files.directory / "big.img").write_bytes(data)
    ranges = [(0, REUSED_BUFFER_DATA_SIZE - 1000), (REUSED_BUFFER_DATA_SIZE - 500, 500)]
    position = 0
    for offset, piece in any_files.open("big.img").read_ranges(ranges):
        assert len(piece) > 0 and bytes(piece) == data[offset:offset + len(piece)]
        position += len(piece)
    assert position == sum(length for _, length in ranges)
    # ...which is how a sync uses them: a reader's chunks go straight into a writer, one at a time.
    copy = any_files.open("copy.img")
    copy.prepare(REUSED_BUFFER_DATA_SIZE)
    assert copy.write_ranges(ranges, any_files.open("big.img").read_ranges(ranges)) == position
    copy.flush()
    written = (any_files.directory / "copy.img").read_bytes()
    assert all(written[o:o + n] == data[o:o + n] for o, n in ranges)


@pytest.mark.parametrize("method", SERVER_HASH_METHODS)
def test_hashes_are_the_plain_digests_of_the_blocks(any_files, method):
    if method not in available_methods():
        pytest.skip(f"{method} is not installed")
    data = random_bytes(DATA_SIZE, seed=3)
    (any_files.directory / "hash.img").write_bytes(data)
    endpoint = any_files.open("hash.img")
    everything = endpoint.submit_hashes([(0, DATA_SIZE)], BLOCK_SIZE, method).result(timeout=30)
    assert everything == block_digests(data, method=method)
    # Several block-aligned ranges: the digests of their blocks, in order.
    ranges = [(0, BLOCK_SIZE), (3 * BLOCK_SIZE, DATA_SIZE - 3 * BLOCK_SIZE)]
    some = endpoint.submit_hashes(ranges, BLOCK_SIZE, method).result(timeout=30)
    assert some == block_digests(data[:BLOCK_SIZE], method=method) + \
        block_digests(data[3 * BLOCK_SIZE:], method=method)


def test_hashes_of_blocks_beyond_the_end_hash_what_there_is(any_files):
    data = random_bytes(BLOCK_SIZE + 100, seed=4)
    (any_files.directory / "short.img").write_bytes(data)
    digests = any_files.open("short.img").submit_hashes([(0, 3 * BLOCK_SIZE)], BLOCK_SIZE, METHOD).result(timeout=30)
    # The whole block, the partial one, and an empty one past the end.
    assert digests == block_digests(data) + digest_bytes(METHOD, b"")


def test_check_readable_passes_for_a_regular_file(any_files):
    (any_files.directory / "readable.img").write_bytes(b"x")
    any_files.open("readable.img").check_readable()


# -- files: errors, the same class from every kind ------------------------------------------


def test_reading_a_missing_file_raises_file_missing(files):
    with pytest.raises(FileMissing):
        read_all(files.open("missing.img"), [(0, 10)])


def test_hashing_a_missing_file_raises_file_missing(files):
    future = files.open("missing.img").submit_hashes([(0, BLOCK_SIZE)], BLOCK_SIZE, METHOD)
    with pytest.raises(FileMissing):
        future.result(timeout=30)


def test_reading_a_directory_raises_not_a_file(files):
    (files.directory / "subdir").mkdir()
    with pytest.raises(NotAFile):
        read_all(files.open("subdir"), [(0, 10)])


def test_reading_a_fifo_raises_not_a_file_without_waiting(files):
    os.mkfifo(files.directory / "fifo")
    with pytest.raises(NotAFile):
        read_all(files.open("fifo"), [(0, 10)])


def test_writing_over_a_directory_raises_not_a_file(files):
    (files.directory / "subdir").mkdir()
    with pytest.raises(NotAFile):
        files.open("subdir").prepare(10)


@pytest.mark.parametrize("operation", ["prepare", "take_lease", "clone"])
def test_changing_a_missing_file_raises_file_missing(files, operation):
    actions = {
        "prepare": lambda: files.open("no-such-dir/new.img").prepare(5),
        "take_lease": lambda: files.open("missing.img").take_lease(),
        "clone": lambda: files.open("missing.img").create_temporary(clone=True),
    }
    with pytest.raises(FileMissing):
        actions[operation]()
    assert sorted(p.name for p in files.directory.iterdir()) == []


@pytest.mark.parametrize("clone", [False, True], ids=["empty", "clone"])
def test_a_temporary_in_a_missing_directory_fails_at_once(files, clone):
    # At create_temporary, not at the first write: a sync learns it before it moves anything.
    with pytest.raises(FileMissing):
        files.open("no-such-dir/new.img").create_temporary(clone=clone)
    assert sorted(p.name for p in files.directory.iterdir()) == []


def test_reading_past_the_end_fails(files):
    (files.directory / "short.img").write_bytes(b"abc")
    with pytest.raises(PdiffcopyError):
        read_all(files.open("short.img"), [(0, 10)])


def test_a_second_lease_is_refused_with_locked(files):
    (files.directory / "leased.img").write_bytes(b"x" * 100)
    first, second = files.open("leased.img"), files.open("leased.img")
    first.take_lease()
    try:
        with pytest.raises(Locked):
            second.take_lease()
    finally:
        first.end_lease()
    # Once ended, somebody else may take it.
    second.take_lease()
    second.end_lease()


# -- files: writing -------------------------------------------------------------------------


def test_prepare_creates_a_file_of_the_size(files):
    endpoint = files.open("new.img")
    endpoint.prepare(DATA_SIZE)
    endpoint.flush()
    path = files.directory / "new.img"
    assert path.stat().st_size == DATA_SIZE
    assert path.read_bytes() == bytes(DATA_SIZE)  # a hole reads as zeroes


def test_prepare_truncates_and_extends(files):
    path = files.directory / "resized.img"
    data = random_bytes(DATA_SIZE)
    path.write_bytes(data)
    endpoint = files.open("resized.img")
    endpoint.prepare(100)
    assert path.read_bytes() == data[:100]
    endpoint.prepare(300)
    assert path.read_bytes() == data[:100] + bytes(200)


def test_write_ranges_in_place_then_read_back(files):
    path = files.directory / "inplace.img"
    old = random_bytes(DATA_SIZE, seed=5)
    path.write_bytes(old)
    new = random_bytes(DATA_SIZE, seed=6)
    ranges = [(0, 100), (2 * BLOCK_SIZE, BLOCK_SIZE), (DATA_SIZE - 23, 23)]
    endpoint = files.open("inplace.img")
    endpoint.prepare(DATA_SIZE)
    written = endpoint.write_ranges(ranges, iter([(o, new[o:o + n]) for o, n in ranges]))
    endpoint.flush()
    assert written == sum(n for _, n in ranges)
    expected = bytearray(old)
    for offset, length in ranges:
        expected[offset:offset + length] = new[offset:offset + length]
    assert path.read_bytes() == bytes(expected)
    # A fresh endpoint reads back what was written, and hashes it the same.
    again = files.open("inplace.img")
    assert read_all(again, [(0, DATA_SIZE)]) == bytes(expected)
    assert again.submit_hashes([(0, DATA_SIZE)], BLOCK_SIZE, METHOD).result(timeout=30) == \
        block_digests(bytes(expected))


def test_write_ranges_accepts_chunks_split_finer_than_the_ranges(files):
    endpoint = files.open("split.img")
    endpoint.prepare(200)
    data = random_bytes(200, seed=7)
    endpoint.write_ranges([(0, 200)], iter([(0, data[:50]), (50, memoryview(data)[50:200])]))
    endpoint.flush()
    assert (files.directory / "split.img").read_bytes() == data


def test_temporary_is_invisible_until_replace(files):
    path = files.directory / "atomic.img"
    old = random_bytes(DATA_SIZE, seed=8)
    path.write_bytes(old)
    target = files.open("atomic.img")
    temporary = target.create_temporary(clone=True)
    new_part = b"N" * 50
    temporary.write_ranges([(10, 50)], iter([(10, new_part)]))
    temporary.flush()
    # The target is untouched until the rename, and the temporary is a hidden sibling.
    assert path.read_bytes() == old
    siblings = sorted(p.name for p in files.directory.iterdir())
    assert len(siblings) == 2 and all(name == "atomic.img" or name.startswith(".") for name in siblings)
    temporary.replace(target)
    assert path.read_bytes() == old[:10] + new_part + old[60:]
    assert sorted(p.name for p in files.directory.iterdir()) == ["atomic.img"]


def test_temporary_without_clone_starts_empty_and_creates_the_target(files):
    target = files.open("created.img")
    temporary = target.create_temporary(clone=False)
    data = random_bytes(DATA_SIZE, seed=9)
    temporary.prepare(DATA_SIZE)
    temporary.write_ranges([(0, DATA_SIZE)], iter([(0, data)]))
    temporary.flush()
    assert not (files.directory / "created.img").exists()
    temporary.replace(target)
    assert (files.directory / "created.img").read_bytes() == data
    assert target.stat().size == DATA_SIZE


def test_clone_keeps_the_permissions(files):
    path = files.directory / "mode.img"
    path.write_bytes(b"data")
    path.chmod(0o640)
    target = files.open("mode.img")
    temporary = target.create_temporary(clone=True)
    temporary.flush()
    temporary.replace(target)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


@pytest.mark.parametrize("mode, new", [(0o640, False), (0o600, True), (0o775, True), (0o6755, True)])
def test_a_temporary_without_clone_gets_the_mode_the_sync_gives(files, mode, new):
    """An existing target's own mode as it is, a new one's (the source's) less the umask, without set-id bits."""
    target = files.open("moded.img")
    target.use_mode(mode, new)
    temporary = target.create_temporary(clone=False)
    temporary.flush()
    temporary.replace(target)
    umask = os.umask(0o022)
    os.umask(umask)  # (the server's umask: it inherited this process's)
    assert oct(stat.S_IMODE((files.directory / "moded.img").stat().st_mode)) == \
        oct(mode & 0o777 & ~umask if new else mode)


def test_stat_says_the_permissions(files):
    path = files.directory / "permissions.img"
    path.write_bytes(b"x")
    path.chmod(0o4750)
    assert files.open("permissions.img").stat().mode == 0o4750


def test_remove_temporary_leaves_only_the_target(files):
    path = files.directory / "abandoned.img"
    path.write_bytes(b"keep me")
    temporary = files.open("abandoned.img").create_temporary(clone=True)
    temporary.write_ranges([(0, 4)], iter([(0, b"lost")]))
    temporary.remove_temporary()
    assert sorted(p.name for p in files.directory.iterdir()) == ["abandoned.img"]
    assert path.read_bytes() == b"keep me"
    temporary.remove_temporary()  # twice is fine: nothing is left to remove


# -- the shift-tolerant delta's operations ---------------------------------------------------


def test_cut_chunks_gives_the_chunks_of_each_range_in_order(files):
    from pdiffcopy.core import chunks

    data = random_bytes(200_000, seed=13)
    (files.directory / "cut.img").write_bytes(data)
    endpoint = files.open("cut.img")
    assert endpoint.cut_chunks([(0, len(data))], 4096) == chunks.cut(data, average=4096)
    assert endpoint.cut_chunks([(7, 20_000), (50_000, 100_000)], 1024) == \
        chunks.cut(data[7:20_007], 7, 1024) + chunks.cut(data[50_000:150_000], 50_000, 1024)
    assert endpoint.cut_chunks([], 4096) == []


def test_cut_chunks_past_the_end_fails(files):
    (files.directory / "short.img").write_bytes(b"short")
    with pytest.raises(PdiffcopyError):
        files.open("short.img").cut_chunks([(0, 1000)], 4096)


def test_free_space_is_what_the_files_directory_has(files):
    (files.directory / "room.img").write_bytes(b"room")
    free = files.open("room.img").free_space()
    stats = os.statvfs(files.directory)
    # Anything else writing to this disk meanwhile moves it a little, not by a GiB.
    assert free is not None and abs(free - stats.f_bavail * stats.f_frsize) < 1024 ** 3


def test_copy_within_copies_the_old_files_bytes_to_other_offsets(files):
    from pdiffcopy.core.chunks import Copy

    old = random_bytes(DATA_SIZE, seed=14)
    path = files.directory / "moved.img"
    path.write_bytes(old)
    path.chmod(0o640)
    target = files.open("moved.img")
    temporary = target.create_temporary(clone=False)
    assert temporary.can_copy_within(target)
    temporary.prepare(3000)
    copied = temporary.copy_within(target, [Copy(0, 1000, 1000), Copy(2000, 0, 1000)])
    temporary.write_ranges([(1000, 1000)], iter([(1000, b"x" * 1000)]))
    temporary.flush()
    temporary.replace(target)
    assert copied == 2000
    assert path.read_bytes() == old[1000:2000] + b"x" * 1000 + old[:1000]
    # The new version keeps the old one's mode, as a clone does.
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_copy_within_refuses_ranges_past_the_end_of_the_old_file(files):
    from pdiffcopy.core.chunks import Copy

    (files.directory / "old.img").write_bytes(b"old bytes")
    target = files.open("old.img")
    temporary = target.create_temporary(clone=False)
    try:
        temporary.prepare(100)
        with pytest.raises(PdiffcopyError):
            temporary.copy_within(target, [Copy(0, 5, 50)])
    finally:
        temporary.remove_temporary()


# -- trees: listing -------------------------------------------------------------------------


def build_tree(directory: Path) -> None:
    """A small tree with a file of each shape, a subdirectory, a symlink and an empty directory."""
    directory.mkdir()
    (directory / "a.txt").write_bytes(b"alpha")
    (directory / "empty").write_bytes(b"")
    (directory / "sub").mkdir()
    (directory / "sub" / "b.bin").write_bytes(random_bytes(3000))
    (directory / "sub" / "b.bin").chmod(0o640)
    (directory / "hollow").mkdir()
    os.symlink("a.txt", directory / "link")
    os.utime(directory / "a.txt", ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))


def test_listing_a_missing_tree_has_no_root(trees):
    listing = trees.open("missing").list()
    assert listing.root is None
    assert listing.entries == [] and listing.failures == []


def test_listing_describes_every_entry_without_following_symlinks(trees):
    build_tree(trees.directory / "tree")
    listing = trees.open("tree").list()
    assert listing.root is not None and listing.root.kind == DIR
    assert listing.failures == []
    by_path = {entry.path: entry for entry in listing.entries}
    assert sorted(by_path) == ["a.txt", "empty", "hollow", "link", "sub", "sub/b.bin"]
    assert (by_path["a.txt"].kind, by_path["a.txt"].size) == (FILE, 5)
    assert by_path["a.txt"].mtime_ns == 1_500_000_000_000_000_000
    assert (by_path["sub/b.bin"].size, by_path["sub/b.bin"].permissions) == (3000, 0o640)
    assert by_path["sub"].kind == DIR and by_path["hollow"].kind == DIR
    assert (by_path["link"].kind, by_path["link"].target) == (SYMLINK_KIND, "a.txt")


def test_listing_is_the_same_from_every_kind(trees):
    # The same tree listed locally gives the same entries (the reference).
    build_tree(trees.directory / "tree")
    reference = LocalTree(str(trees.directory / "tree")).list()
    listing = trees.open("tree").list()
    assert sorted(listing.entries) == sorted(reference.entries)
    assert listing.root == reference.root


def test_listing_a_file_gives_its_entry_as_the_root(trees):
    (trees.directory / "plain").write_bytes(b"x")
    listing = trees.open("plain").list()
    assert listing.root is not None and (listing.root.kind, listing.root.size) == (FILE, 1)
    assert listing.entries == [] and listing.failures == []


def test_a_root_that_is_a_symlink_is_followed_unless_described_as_the_link(trees):
    (trees.directory / "plain").write_bytes(b"xy")
    os.symlink("plain", trees.directory / "link")
    assert trees.open("link").list().root.kind == FILE
    tree = trees.open("link")
    tree.describe_root_link()
    listing = tree.list()
    assert (listing.root.kind, listing.root.target, listing.entries) == (SYMLINK_KIND, "plain", [])


def test_a_file_root_lists_its_attributes_when_asked(trees):
    path = trees.directory / "plain"
    path.write_bytes(b"x")
    os.setxattr(path, "user.colour", b"red")
    tree = trees.open("plain")
    tree.list_attributes(MetadataOptions(xattrs=True))
    assert tree.list().root.xattrs == (("user.colour", b"red"),)


# -- trees: reading -------------------------------------------------------------------------


def test_read_files_gives_the_contents(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    files = [entry for entry in tree.list().entries if entry.kind == FILE]
    contents = {entry.path: (data, why) for entry, data, why in tree.read_files(files)}
    assert contents == {
        "a.txt": (b"alpha", ""),
        "empty": (b"", ""),
        "sub/b.bin": (random_bytes(3000), ""),
    }


def test_read_files_reports_a_missing_or_changed_file_and_goes_on(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    by_path = {entry.path: entry for entry in tree.list().entries}
    (trees.directory / "tree" / "sub" / "b.bin").unlink()
    (trees.directory / "tree" / "empty").write_bytes(b"grown")
    results = list(tree.read_files([by_path["sub/b.bin"], by_path["empty"], by_path["a.txt"]]))
    assert [entry.path for entry, _, _ in results] == ["sub/b.bin", "empty", "a.txt"]
    assert [data is None and bool(why) for _, data, why in results] == [True, True, False]
    assert "changed while copying" in results[1][2]
    assert results[2][1:] == (b"alpha", "")


def test_read_files_refuses_a_symlink_or_directory_listed_as_a_file(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    posing = [Entry("link", FILE, 5, 0, 0o100644), Entry("sub", FILE, 0, 0, 0o100644)]
    results = list(tree.read_files(posing))
    assert [(entry.path, data) for entry, data, _ in results] == [("link", None), ("sub", None)]
    assert all(why for _, _, why in results)


# -- trees: writing -------------------------------------------------------------------------


def file_entry(path: str, data: bytes, mode: int = 0o100644, mtime_ns: int = 1_400_000_000_000_000_000) -> Entry:
    return Entry(path, FILE, len(data), mtime_ns, mode)


@pytest.mark.parametrize("fresh", [False, True], ids=["replace", "fresh"])
def test_write_files_writes_content_permissions_and_times(trees, fresh):
    (trees.directory / "tree" / "sub").mkdir(parents=True)
    tree = trees.open("tree")
    data = random_bytes(2000, seed=11)
    batch = [(file_entry("one", b"first"), b"first"), (file_entry("sub/two", data, 0o100600), data)]
    assert tree.write_files(batch, TIMES, fresh=fresh) == []
    assert (trees.directory / "tree" / "one").read_bytes() == b"first"
    two = trees.directory / "tree" / "sub" / "two"
    assert two.read_bytes() == data
    assert stat.S_IMODE(two.stat().st_mode) == 0o600
    assert two.stat().st_mtime_ns == 1_400_000_000_000_000_000
    # No temporary is left beside them.
    assert sorted(p.name for p in (trees.directory / "tree").iterdir()) == ["one", "sub"]


def test_write_files_replaces_an_existing_file_whole(trees):
    (trees.directory / "tree").mkdir()
    (trees.directory / "tree" / "old").write_bytes(b"a much longer old content")
    tree = trees.open("tree")
    assert tree.write_files([(file_entry("old", b"new"), b"new")], TIMES) == []
    assert (trees.directory / "tree" / "old").read_bytes() == b"new"


def test_write_files_reports_a_failure_and_goes_on(trees):
    (trees.directory / "tree").mkdir()
    tree = trees.open("tree")
    batch = [
        (file_entry("no-such-dir/x", b"x"), b"x"),  # its directory is missing
        (file_entry("wrong-size", b"12345"), b"123"),  # the data is not what the entry says
        (file_entry("fine", b"ok"), b"ok"),
    ]
    failures = tree.write_files(batch, TIMES)
    # In any order: a remote tree checks the sizes before it sends anything.
    assert sorted(path for path, _ in failures) == ["no-such-dir/x", "wrong-size"]
    assert all(why for _, why in failures)
    assert (trees.directory / "tree" / "fine").read_bytes() == b"ok"
    assert not (trees.directory / "tree" / "wrong-size").exists()


def test_a_missing_root_is_a_failure_of_each_file_not_an_error(trees):
    tree = trees.open("missing")
    entry = file_entry("x", b"x")
    assert [(e.path, data) for e, data, _ in tree.read_files([entry])] == [("x", None)]
    assert [path for path, _ in tree.write_files([(entry, b"x")], TIMES)] == ["x"]


# -- trees: operations ----------------------------------------------------------------------


def test_apply_makes_directories_symlinks_and_metadata(trees):
    tree = trees.open("tree")
    root = Entry("", DIR, 0, 0, 0o40755)
    directory = Entry("made", DIR, 0, 1_300_000_000_000_000_000, 0o40750)
    link = Entry("made/link", SYMLINK_KIND, 0, 0, 0o120777, target="../elsewhere")
    operations = [Operation(MKDIR, root), Operation(MKDIR, directory), Operation(SYMLINK, link),
                  Operation(METADATA, directory)]
    assert tree.apply(operations, TIMES) == []
    made = trees.directory / "tree" / "made"
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o750
    assert made.stat().st_mtime_ns == 1_300_000_000_000_000_000
    assert os.readlink(made / "link") == "../elsewhere"


def test_apply_replaces_a_symlink_and_mkdir_of_an_existing_directory_is_fine(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    operations = [Operation(SYMLINK, Entry("link", SYMLINK_KIND, 0, 0, 0o120777, target="sub/b.bin")),
                  Operation(MKDIR, Entry("sub", DIR, 0, 0, 0o40755))]
    assert tree.apply(operations, TIMES) == []
    assert os.readlink(trees.directory / "tree" / "link") == "sub/b.bin"
    assert (trees.directory / "tree" / "sub" / "b.bin").exists()


def test_apply_deletes_and_removes(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    operations = [Operation(DELETE, Entry("a.txt", FILE, 5, 0, 0o100644)),
                  Operation(DELETE, Entry("link", SYMLINK_KIND, 0, 0, 0o120777, target="a.txt")),
                  Operation(DELETE, Entry("hollow", DIR, 0, 0, 0o40755)),
                  Operation(REMOVE, Entry("sub", DIR, 0, 0, 0o40755))]
    assert tree.apply(operations, TIMES) == []
    assert sorted(p.name for p in (trees.directory / "tree").iterdir()) == ["empty"]


def test_apply_reports_failures_and_goes_on(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    operations = [Operation(DELETE, Entry("sub", DIR, 0, 0, 0o40755)),  # not empty
                  Operation(MKDIR, Entry("a.txt", DIR, 0, 0, 0o40755)),  # a file stands there
                  Operation(DELETE, Entry("gone", FILE, 0, 0, 0o100644)),  # nothing to delete
                  Operation(DELETE, Entry("empty", FILE, 0, 0, 0o100644))]
    failures = tree.apply(operations, TIMES)
    assert [path for path, _ in failures] == ["sub", "a.txt", "gone"]
    assert all(why for _, why in failures)
    assert not (trees.directory / "tree" / "empty").exists()
    assert (trees.directory / "tree" / "sub" / "b.bin").exists()


#: Paths of a batch that would leave the tree: up, up through a subdirectory, through a symlink.
ESCAPES = ["../outside", "sub/../../outside", "sub/up/outside"]


def tree_with_a_way_out(trees) -> TreeEndpoint:
    build_tree(trees.directory / "tree")
    os.symlink(str(trees.directory), trees.directory / "tree" / "sub" / "up")
    return trees.open("tree")


@pytest.mark.parametrize("path", ESCAPES)
def test_apply_never_makes_anything_outside_the_tree(trees, path):
    tree = tree_with_a_way_out(trees)
    try:
        tree.apply([Operation(MKDIR, Entry(path, DIR, 0, 0, 0o40755))], TIMES)
    except AccessDenied:
        pass  # a whole batch refused is safe too (see the next test for the contract)
    assert not (trees.directory / "outside").exists()


@pytest.mark.parametrize("path", ESCAPES)
def test_apply_reports_a_path_that_leaves_the_tree_and_goes_on(trees, path):
    # As rsync reports a file and goes on: the one path is refused (never acted on), the rest run.
    tree = tree_with_a_way_out(trees)
    failures = tree.apply([Operation(MKDIR, Entry(path, DIR, 0, 0, 0o40755)),
                           Operation(MKDIR, Entry("inside", DIR, 0, 0, 0o40755))], TIMES)
    assert [p for p, _ in failures] == [path]
    assert (trees.directory / "tree" / "inside").is_dir()
    assert not (trees.directory / "outside").exists()


@pytest.mark.parametrize("path", ESCAPES)
def test_write_files_reports_a_path_that_leaves_the_tree_and_goes_on(trees, path):
    tree = tree_with_a_way_out(trees)
    failures = tree.write_files([(file_entry(path, b"x"), b"x"), (file_entry("inside", b"in"), b"in")], TIMES)
    assert [p for p, _ in failures] == [path]
    assert all(why for _, why in failures)
    assert (trees.directory / "tree" / "inside").read_bytes() == b"in"
    assert not (trees.directory / "outside").exists()


@pytest.mark.parametrize("path", ESCAPES)
def test_read_files_reports_a_path_that_leaves_the_tree_and_goes_on(trees, path):
    tree = tree_with_a_way_out(trees)
    (trees.directory / "outside").write_bytes(b"x")
    results = list(tree.read_files([file_entry(path, b"x"), file_entry("a.txt", b"alpha")]))
    assert [(entry.path, data) for entry, data, _ in results] == [(path, None), ("a.txt", b"alpha")]
    assert results[0][2]


def test_write_files_never_follows_a_symlinked_directory(trees):
    build_tree(trees.directory / "tree")
    os.symlink(str(trees.directory), trees.directory / "tree" / "up")
    tree = trees.open("tree")
    failures = tree.write_files([(file_entry("up/planted", b"x"), b"x")], TIMES)
    assert [path for path, _ in failures] == ["up/planted"]
    assert not (trees.directory / "planted").exists()


# -- trees: big files through the block engine ----------------------------------------------


def test_file_endpoint_reads_and_writes_a_member(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    member = tree.file_endpoint("sub/b.bin")
    assert member.exists()
    info = member.stat()
    assert info is not None and (info.kind, info.size) == ("file", 3000)
    assert read_all(member, [(0, 3000)]) == random_bytes(3000)
    member.prepare(3000)
    member.write_ranges([(0, 4)], iter([(0, b"HEAD")]))
    member.flush()
    assert (trees.directory / "tree" / "sub" / "b.bin").read_bytes()[:4] == b"HEAD"


def test_file_endpoint_of_a_missing_member_is_missing(trees):
    build_tree(trees.directory / "tree")
    member = trees.open("tree").file_endpoint("sub/none")
    assert not member.exists()
    assert member.stat() is None
    with pytest.raises(FileMissing):
        read_all(member, [(0, 1)])


def test_file_endpoint_never_reads_outside_the_tree(trees):
    build_tree(trees.directory / "tree")
    (trees.directory / "secret").write_bytes(b"outside the tree")
    os.symlink(str(trees.directory / "secret"), trees.directory / "tree" / "leak")
    member = trees.open("tree").file_endpoint("leak")
    with pytest.raises(NotAFile):
        read_all(member, [(0, 5)])


@pytest.mark.parametrize("link", ["leak", "link"], ids=["out-of-the-tree", "within-the-tree"])
def test_file_endpoint_refuses_a_symlinked_member_with_not_a_file(trees, link):
    # The tree engine copies a symlink as a symlink: a member that became one since the listing
    # is refused, never followed, whether its target is outside the tree or inside it.
    build_tree(trees.directory / "tree")  # its "link" -> a.txt
    (trees.directory / "secret").write_bytes(b"outside the tree")
    os.symlink(str(trees.directory / "secret"), trees.directory / "tree" / "leak")
    with pytest.raises(NotAFile):
        read_all(trees.open("tree").file_endpoint(link), [(0, 5)])


@pytest.mark.parametrize("path", ["../secret", "sub/../../secret", "/etc/hostname"])
@pytest.mark.parametrize("operation", ["stat", "read", "prepare"])
def test_file_endpoint_refuses_a_path_that_leaves_the_tree(trees, path, operation):
    build_tree(trees.directory / "tree")
    (trees.directory / "secret").write_bytes(b"outside the tree")
    tree = trees.open("tree")
    actions = {"stat": lambda member: member.stat(), "read": lambda member: read_all(member, [(0, 5)]),
               "prepare": lambda member: member.prepare(3)}
    # Refused when the endpoint is made (a remote tree's absolute path) or when it is used.
    with pytest.raises(AccessDenied):
        actions[operation](tree.file_endpoint(path))
    assert (trees.directory / "secret").read_bytes() == b"outside the tree"


# -- files: holes ---------------------------------------------------------------------------

#: A unit every file system here allocates in (ext4, xfs, btrfs, tmpfs: 4 KiB).
HOLE_UNIT = 64 * 1024


def make_sparse(path: Path, size: int, extents) -> bytes:
    """A file of ``size`` bytes with data only in ``extents`` (offset, length); return its bytes."""
    expected = bytearray(size)
    with open(path, "wb") as handle:
        handle.truncate(size)
        for offset, length in extents:
            data = random_bytes(length, seed=offset + 1)
            handle.seek(offset)
            handle.write(data)
            expected[offset:offset + length] = data
    return bytes(expected)


def test_data_map_names_the_extents_with_data(files):
    size = 8 * HOLE_UNIT
    make_sparse(files.directory / "sparse.img", size, [(2 * HOLE_UNIT, HOLE_UNIT), (5 * HOLE_UNIT, 2 * HOLE_UNIT)])
    endpoint = files.open("sparse.img")
    assert endpoint.data_map(0, size) == [(2 * HOLE_UNIT, HOLE_UNIT), (5 * HOLE_UNIT, 2 * HOLE_UNIT)]
    # Clipped to the range asked; a range in a hole has none.
    assert endpoint.data_map(2 * HOLE_UNIT + 10, 4 * HOLE_UNIT) == [(2 * HOLE_UNIT + 10, HOLE_UNIT - 10),
                                                                   (5 * HOLE_UNIT, HOLE_UNIT + 10)]
    assert endpoint.data_map(0, 2 * HOLE_UNIT) == []


def test_data_map_of_a_file_that_is_all_hole_or_empty_is_empty(files):
    (files.directory / "empty.img").write_bytes(b"")
    make_sparse(files.directory / "hole.img", 4 * HOLE_UNIT, [])
    assert files.open("empty.img").data_map(0, 0) == []
    assert files.open("hole.img").data_map(0, 4 * HOLE_UNIT) == []


def test_blocks_in_holes_hash_as_zeros(files):
    size = 6 * HOLE_UNIT + 100
    data = make_sparse(files.directory / "sparse.img", size, [(HOLE_UNIT, 3000), (6 * HOLE_UNIT, 100)])
    digests = files.open("sparse.img").submit_hashes([(0, size)], BLOCK_SIZE, METHOD).result(timeout=30)
    assert digests == block_digests(data)


def test_punch_ranges_makes_holes_that_read_as_zeros(files):
    path = files.directory / "dense.img"
    data = random_bytes(8 * HOLE_UNIT, seed=3)
    path.write_bytes(data)
    os.sync()
    before = path.stat().st_blocks
    endpoint = files.open("dense.img")
    endpoint.take_lease()  # a remote file's punch is a write: it honours the lease
    try:
        assert endpoint.punch_ranges([(HOLE_UNIT, 2 * HOLE_UNIT), (5 * HOLE_UNIT, HOLE_UNIT)]) == 3 * HOLE_UNIT
    finally:
        endpoint.end_lease()
    expected = bytearray(data)
    expected[HOLE_UNIT:3 * HOLE_UNIT] = bytes(2 * HOLE_UNIT)
    expected[5 * HOLE_UNIT:6 * HOLE_UNIT] = bytes(HOLE_UNIT)
    assert path.read_bytes() == bytes(expected)
    assert path.stat().st_size == len(data)
    assert path.stat().st_blocks * 512 <= before * 512 - 3 * HOLE_UNIT
    assert files.open("dense.img").data_map(0, len(data)) == [(0, HOLE_UNIT), (3 * HOLE_UNIT, 2 * HOLE_UNIT),
                                                              (6 * HOLE_UNIT, 2 * HOLE_UNIT)]


def test_punching_a_file_leased_by_another_is_refused(files):
    (files.directory / "leased.img").write_bytes(random_bytes(2 * HOLE_UNIT))
    holder, other = files.open("leased.img"), files.open("leased.img")
    holder.take_lease()
    try:
        if other.leases_stop_other_writers():
            with pytest.raises(Locked):
                other.punch_ranges([(0, HOLE_UNIT)])
    finally:
        holder.end_lease()


def test_prepare_sparse_grows_by_a_hole(files):
    endpoint = files.open("grown.img")
    endpoint.prepare_sparse(64 * HOLE_UNIT, 0)
    endpoint.flush()
    path = files.directory / "grown.img"
    assert path.stat().st_size == 64 * HOLE_UNIT
    assert path.stat().st_blocks == 0
    assert endpoint.data_map(0, 64 * HOLE_UNIT) == []


def test_write_sparse_turns_zero_runs_into_holes(files):
    path = files.directory / "written.img"
    endpoint = files.open("written.img")
    endpoint.prepare_sparse(4 * HOLE_UNIT, 2 * HOLE_UNIT)
    endpoint.write_sparse(True)
    data = random_bytes(HOLE_UNIT, seed=4) + bytes(2 * HOLE_UNIT) + random_bytes(HOLE_UNIT, seed=5)
    endpoint.write_ranges([(0, len(data))], iter([(0, data)]))
    endpoint.flush()
    assert path.read_bytes() == data
    assert files.open("written.img").data_map(0, len(data)) == [(0, HOLE_UNIT), (3 * HOLE_UNIT, HOLE_UNIT)]


def test_prepare_sparse_checks_only_the_data_against_the_free_space(files):
    free = os.statvfs(files.directory).f_bavail * os.statvfs(files.directory).f_frsize
    endpoint = files.open("thin.img")
    try:
        # Far bigger than the disk, but its data fits: fine, and nothing is allocated.
        endpoint.prepare_sparse(free * 4, 64 * 1024)
        assert (files.directory / "thin.img").stat().st_size == free * 4
        assert (files.directory / "thin.img").stat().st_blocks == 0
    finally:  # a file bigger than the disk left in the session server's root trips tests that read it all
        (files.directory / "thin.img").unlink(missing_ok=True)
    # Its data does not fit: refused before anything is written.
    with pytest.raises(PdiffcopyError, match="(?i)space"):
        files.open("thick.img").prepare_sparse(free * 4, free * 2)


# -- files: every optional capability, on every kind (1.0.1's answers asserted as what they are) ------


def test_hash_ranges_waits_for_the_same_digests(any_files):
    data = random_bytes(DATA_SIZE, seed=41)
    (any_files.directory / "waited.img").write_bytes(data)
    endpoint = any_files.open("waited.img")
    assert endpoint.hash_ranges([(0, DATA_SIZE)], BLOCK_SIZE, METHOD) == block_digests(data)
    assert endpoint.hash_ranges([], BLOCK_SIZE, METHOD) == b""


def test_submit_hashes_first_gives_the_same_digests(any_files):
    data = random_bytes(DATA_SIZE, seed=42)
    (any_files.directory / "first.img").write_bytes(data)
    ranges = [(0, BLOCK_SIZE), (3 * BLOCK_SIZE, 2 * BLOCK_SIZE)]
    digests = any_files.open("first.img").submit_hashes_first(ranges, BLOCK_SIZE, METHOD).result(timeout=30)
    assert digests == block_digests(data[:BLOCK_SIZE]) + block_digests(data[3 * BLOCK_SIZE:5 * BLOCK_SIZE])


def test_hashing_pieces_is_cheap_except_on_a_101_server(any_files):
    # 1.0.1 hashes whole files only: refining changed blocks in pieces would not pay there.
    assert any_files.open("any.img").hashes_pieces_cheaply() is (any_files.name != "legacy")


def test_copy_ranges_from_copies_between_local_files_only(any_files, tmp_path):
    data = random_bytes(DATA_SIZE, seed=43)
    (any_files.directory / "from.img").write_bytes(data)
    (any_files.directory / "into.img").write_bytes(bytes(DATA_SIZE))
    source, target = any_files.open("from.img"), any_files.open("into.img")
    if any_files.name != "local":
        assert not target.can_copy_from(source)
        with pytest.raises(Unsupported):
            target.copy_ranges_from(source, [(0, BLOCK_SIZE)])
        with pytest.raises(Unsupported):
            target.copy_all_from(source, DATA_SIZE, "keep")
        return
    assert target.can_copy_from(source)
    assert target.copy_ranges_from(source, [(BLOCK_SIZE, 2 * BLOCK_SIZE)]) == 2 * BLOCK_SIZE
    expected = bytes(BLOCK_SIZE) + data[BLOCK_SIZE:3 * BLOCK_SIZE] + bytes(DATA_SIZE - 3 * BLOCK_SIZE)
    assert (any_files.directory / "into.img").read_bytes() == expected
    whole = any_files.open("whole.img")
    assert isinstance(whole.copy_all_from(source, DATA_SIZE, "keep"), str)
    assert (any_files.directory / "whole.img").read_bytes() == data


def test_is_same_file_tells_a_file_from_another(any_files):
    (any_files.directory / "one.img").write_bytes(b"1")
    (any_files.directory / "two.img").write_bytes(b"2")
    one = any_files.open("one.img")
    assert not one.is_same_file(any_files.open("two.img"))
    # Only a local file can tell (False is "cannot tell": the sync then goes on).
    assert one.is_same_file(any_files.open("one.img")) is (any_files.name == "local")


def test_open_partial_keeps_a_sibling_the_next_run_finds(any_files):
    (any_files.directory / "resumed.img").write_bytes(b"old bytes")
    target = any_files.open("resumed.img")
    if any_files.name == "legacy":  # 1.0.1 cannot rename: the sync writes in place instead
        with pytest.raises(Unsupported):
            target.open_partial(clone=True)
        return
    partial, resumed = target.open_partial(clone=True)
    try:
        assert not resumed
        assert read_all(partial, [(0, 9)]) == b"old bytes"
        partial.write_ranges([(0, 3)], iter([(0, b"new")]))
    finally:
        partial.close()
    again, resumed = any_files.open("resumed.img").open_partial(clone=True)
    try:
        assert resumed and read_all(again, [(0, 9)]) == b"new bytes"
        again.replace(target)
    finally:
        again.close()
    assert sorted(path.name for path in any_files.directory.iterdir()) == ["resumed.img"]
    assert (any_files.directory / "resumed.img").read_bytes() == b"new bytes"


def test_sweep_temporaries_answers_a_count(any_files):
    (any_files.directory / "swept.img").write_bytes(b"x")
    assert any_files.open("swept.img").sweep_temporaries() >= 0


def test_leases_stop_other_writers_only_on_a_current_server(any_files):
    (any_files.directory / "leased.img").write_bytes(b"x" * 10)
    endpoint = any_files.open("leased.img")
    endpoint.take_lease()
    try:
        # A server refuses writes without the lease (423); a local flock is advisory; 1.0.1 has none.
        assert endpoint.leases_stop_other_writers() is (any_files.name == "remote")
        assert endpoint.write_ranges([(0, 2)], iter([(0, b"ab")])) == 2
    finally:
        endpoint.end_lease()
    assert (any_files.directory / "leased.img").read_bytes() == b"ab" + b"x" * 8


def test_cut_chunks_and_copy_within_are_unsupported_on_a_101_server(any_files):
    data = random_bytes(DATA_SIZE, seed=44)
    (any_files.directory / "old.img").write_bytes(data)
    old, new = any_files.open("old.img"), any_files.open("new.img")
    if any_files.name != "legacy":
        assert new.can_copy_within(old)  # both on one side: the other cases are above
        return
    with pytest.raises(Unsupported):
        old.cut_chunks([(0, DATA_SIZE)], 4096)
    assert not new.can_copy_within(old)
    with pytest.raises(Unsupported):
        new.copy_within(old, [])


@pytest.mark.parametrize("any_files", ["legacy"], indirect=True)  # the other kinds' holes: tests above
def test_a_101_server_has_no_holes_it_can_tell_or_punch(any_files):
    (any_files.directory / "dense.img").write_bytes(b"y" * DATA_SIZE)
    endpoint = any_files.open("dense.img")
    assert endpoint.data_map(0, DATA_SIZE) == [(0, DATA_SIZE)]  # every byte is data to it
    # Punching writes the zeros (dense, the same bytes).
    assert endpoint.punch_ranges([(BLOCK_SIZE, BLOCK_SIZE)]) == BLOCK_SIZE
    assert (any_files.directory / "dense.img").read_bytes() == \
        b"y" * BLOCK_SIZE + bytes(BLOCK_SIZE) + b"y" * (DATA_SIZE - 2 * BLOCK_SIZE)


def test_a_hash_pool_is_started_only_where_hashing_runs_here(any_files):
    data = random_bytes(DATA_SIZE, seed=45)
    (any_files.directory / "pooled.img").write_bytes(data)
    endpoint = any_files.open("pooled.img")
    pool = endpoint.start_hash_pool(1)
    try:
        # A local file hashes in this machine's processes; a server hashes its own files.
        assert endpoint.hashes_here() is (any_files.name == "local")
        assert (pool is not None) is endpoint.hashes_here()
        if pool is not None:
            endpoint.use_hash_pool(pool)
        endpoint.keep_out_of_cache()  # a hint: the digests stay the same
        assert endpoint.submit_hashes([(0, DATA_SIZE)], BLOCK_SIZE, METHOD).result(timeout=30) == block_digests(data)
    finally:
        if pool is not None:
            pool.shutdown()


@pytest.mark.parametrize("cache", ["drop", "keep"])
def test_cache_mode_keeps_what_was_asked(any_files, cache):
    # Only "auto" is decided, by a local whole-file copy's size; elsewhere the cache is kept.
    endpoint = any_files.open("cached.img")
    assert endpoint.cache_mode(cache, DATA_SIZE) == cache
    endpoint.use_cache(cache)  # a hint for a device's reads and writes: a file's mode stays its own
    assert endpoint.cache_mode(cache, DATA_SIZE) == cache
    assert endpoint.cache_mode("auto", DATA_SIZE) in (("drop", "keep") if any_files.name == "local" else ("keep",))


def test_pin_keeps_a_file_until_it_changes(any_files):
    """Pinned to what it was: unchanged, it reads on; changed, a server refuses (a local file and
    a 1.0.1 server's have no ETag: the sync's own check at its end sees the change)."""
    path = any_files.directory / "pinned.img"
    path.write_bytes(random_bytes(DATA_SIZE, seed=46))
    endpoint = any_files.open("pinned.img")
    endpoint.pin(endpoint.stat())
    assert read_all(endpoint, [(0, BLOCK_SIZE)]) == path.read_bytes()[:BLOCK_SIZE]
    path.write_bytes(b"changed" + path.read_bytes()[7:])
    os.utime(path, ns=(1, 1))
    if any_files.name == "remote":
        with pytest.raises(Conflict):
            read_all(endpoint, [(0, BLOCK_SIZE)])
    else:
        assert read_all(endpoint, [(0, BLOCK_SIZE)]).startswith(b"changed")


# -- capabilities: what each kind declares, and that every operation of each has a case above


#: The capabilities each kind names. A 1.0.1 server's file has no holes; what else 1.0.1
#: cannot do it answers at run time, as the cases above assert.
DECLARED = {LocalFile: {HashingHere, KernelCopies, Holes, ContentChunks, PartialFiles, Leases},
            RemoteFile: {PriorityHashing, Holes, ContentChunks, PartialFiles, Leases},
            LegacyRemoteFile: {PriorityHashing, ContentChunks, PartialFiles, Leases}}


@pytest.mark.parametrize("kind", list(DECLARED), ids=lambda kind: kind.__name__)
def test_each_kind_declares_its_capabilities(kind):
    assert set(kind.capabilities) == DECLARED[kind]
    for capability in DECLARED[kind]:  # whole (the class could not be made otherwise)
        assert all(getattr(kind, name) is not getattr(capability, name) for name in capability.operations())


def check_grouping(interface: type, capabilities: tuple, ungrouped: set) -> None:
    """Every optional operation of ``interface`` (but ``ungrouped``) is stated once, in one capability,
    whose body is the fallback the engine gets; and each has a case in this suite."""
    own = {name for name, value in vars(interface).items() if callable(value) and not name.startswith("_")}
    grouped = [name for capability in capabilities for name in capability.operations()]
    assert len(grouped) == len(set(grouped)), "an operation in two capabilities"
    assert not own & set(grouped), "an operation stated twice: in the interface and in a capability"
    assert own - interface.__abstractmethods__ == ungrouped
    assert all(issubclass(interface, capability) for capability in capabilities), "a capability without fallbacks"
    source = Path(__file__).read_text()
    missing = sorted(name for name in set(grouped) | ungrouped - {"close"} if f".{name}(" not in source)
    assert not missing, f"no contract case calls {missing}"


def test_every_optional_file_operation_belongs_to_one_capability_and_has_a_case_here():
    """The interface stays small: its required operations, three checks, and its capabilities."""
    check_grouping(FileEndpoint, CAPABILITIES, {"exists", "close", "is_same_file", "check_readable", "pin",
                                                "use_mode"})
    assert len(FileEndpoint.__abstractmethods__) <= 10


def test_a_capability_is_declared_whole():
    """A kind that names a capability must implement every operation of it, or cannot be made."""
    methods = {name: (lambda self, *args: None) for name in FileEndpoint.__abstractmethods__ | {"data_map"}}
    with pytest.raises(TypeError, match="HalfHoles has Holes but does not implement .*punch_ranges"):
        type("HalfHoles", (FileEndpoint,), dict(methods, capabilities=(Holes,)))
    with pytest.raises(TypeError, match="not a capability"):
        type("Foreign", (FileEndpoint,), dict(methods, capabilities=(WalkedHere,)))


def test_a_capability_switched_off_by_name_gives_its_fallbacks(tmp_path):
    """rclone's Features.Disable: a local file without its holes is all data to the engine, and a
    sync from it writes the zeros (still the same bytes)."""
    mib = 1024 * 1024
    source = tmp_path / "sparse.img"
    with open(source, "wb") as handle:
        handle.truncate(8 * mib)
        handle.seek(3 * mib)
        handle.write(random_bytes(mib))
    endpoint = LocalFile(str(source))
    try:
        assert endpoint.data_map(0, 8 * mib) == [(3 * mib, mib)]
        without(endpoint, "Holes")
        without(endpoint, "KernelCopies")  # (a kernel copy would skip the holes by itself)
        assert endpoint.data_map(0, 8 * mib) == [(0, 8 * mib)]
        assert Holes not in endpoint.capabilities and Holes in LocalFile.capabilities
        target = tmp_path / "copy.img"
        pdiffcopy.sync(endpoint, str(target))
        assert target.read_bytes() == source.read_bytes()
        assert os.stat(target).st_blocks * 512 >= 8 * mib  # dense: nothing told it of the holes
        with pytest.raises(ValueError, match="no capability Holes"):
            without(endpoint, "Holes")
    finally:
        endpoint.close()


# -- trees: capabilities


def test_a_listing_streams_in_walk_order_what_list_gives(trees):
    """Each directory's entries sorted by name, the directories depth first: a plan merges two as they come."""
    root = trees.directory / "tree"
    for path in ("a-c/x", "a/b/y", "a/z", "a.b", "b/a-c/q", "b/a/p", "c"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(b"x")
    (root / "empty").mkdir()
    whole = trees.open("tree").list()
    stream = trees.open("tree").stream()
    assert stream.ordered and stream.root == whole.root
    paths = [entry.path for entries, _ in stream.batches for entry in entries]
    assert paths == ["a", "a-c", "a.b", "b", "c", "empty", "a/b", "a/z", "a/b/y", "a-c/x",
                     "b/a", "b/a-c", "b/a/p", "b/a-c/q"]
    assert sorted(paths) == sorted(entry.path for entry in whole.entries)


def test_a_local_tree_is_walked_here_and_a_served_one_counts_its_traffic(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    umask = os.umask(0o022)
    os.umask(umask)
    tree.enter_worker()
    # A local tree's worker makes files without a umask (their modes set as they are made).
    assert os.umask(umask) == (0 if trees.name == "local" else umask)
    before = tree.traffic()
    assert tree.list().root is not None
    after = tree.traffic()
    assert tree.walks_here() is (trees.name == "local")
    assert tree.may_change_root()  # a directory below a server's root may change too
    if trees.name == "local":
        assert before == after == (0, 0)
        return
    assert after[0] > before[0] and after[1] > before[1]
    tree.add_traffic(10, 20)  # a forked worker's figures, counted in its parent
    assert tree.traffic() == (after[0] + 10, after[1] + 20)


def test_a_servers_root_directory_is_never_changed(server):
    tree = RemoteTree(server.url(""))
    try:
        assert not tree.may_change_root()
    finally:
        tree.close()


def test_sweep_while_listing_removes_abandoned_temporaries(trees):
    from pdiffcopy.core.protocol import temporary_name

    build_tree(trees.directory / "tree")
    stale = trees.directory / "tree" / temporary_name("a.txt")
    stale.write_bytes(b"left by a killed run")
    os.utime(stale, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    tree = trees.open("tree")
    tree.sweep_while_listing()
    tree.list()
    # No writer holds its lock: gone at once, here and on a server (the listing's sweep=1).
    assert not stale.exists()


def test_expect_writes_changes_nothing_where_nothing_is_refused(trees):
    """Saying what a sync will ask (a server's export may refuse it: tests/test_exports.py) keeps
    the listing whole where nothing is refused."""
    build_tree(trees.directory / "tree")
    expected = sorted(entry.path for entry in trees.open("tree").list().entries)
    tree = trees.open("tree")
    tree.sweep_while_listing()
    tree.expect_writes(("delete", "owner", "hard-links", "xattrs", "acls", "devices"))
    assert sorted(entry.path for entry in tree.list().entries) == expected != []


def test_same_content_tells_where_it_is_cheap(trees):
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    entry = next(entry for entry in tree.list().entries if entry.path == "a.txt")
    assert tree.same_content(entry, b"alpha") is (trees.name == "local")
    assert not tree.same_content(entry, b"alphA")


def test_copy_files_from_copies_between_local_trees_only(trees, tmp_path):
    build_tree(tmp_path / "origin")
    origin = LocalTree(str(tmp_path / "origin"))
    (trees.directory / "copy").mkdir()
    tree = trees.open("copy")
    entry = next(entry for entry in origin.list().entries if entry.path == "a.txt")
    if trees.name != "local":
        assert not tree.can_copy_files_from(origin)
        with pytest.raises(Unsupported):
            tree.copy_files_from(origin, [entry], TIMES)
        return
    assert tree.can_copy_files_from(origin)
    assert tree.copy_files_from(origin, [entry], TIMES) == ([], 5, 1)
    assert (trees.directory / "copy" / "a.txt").read_bytes() == b"alpha"


def test_list_attributes_lists_what_was_asked_and_nothing_to_notice(trees):
    build_tree(trees.directory / "tree")
    try:
        os.setxattr(trees.directory / "tree" / "a.txt", "user.colour", b"blue")
    except OSError:
        pytest.skip("this file system keeps no user attributes")
    tree = trees.open("tree")
    by_path = {entry.path: entry for entry in tree.list().entries}
    assert by_path["a.txt"].xattrs == ()  # not asked for
    tree.list_attributes(MetadataOptions(xattrs=True))
    by_path = {entry.path: entry for entry in tree.list().entries}
    assert ("user.colour", b"blue") in by_path["a.txt"].xattrs
    assert tree.take_notices() == []


def test_not_kept_says_what_the_tree_will_not_set_once_listed(trees):
    """A tree here sets owners when this process is root; the session's server does not trust its
    clients with them, nor with security.* and trusted.* attributes."""
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    tree.stream().close()
    if trees.name == "local":
        assert tree.not_kept() == (frozenset() if os.geteuid() == 0 else {"owner"})
    else:
        assert tree.not_kept() == {"owner", "xattrs"}


def test_makes_nodes_says_which_nodes_the_tree_makes_once_listed(trees):
    """A tree here makes device nodes as root, fifos and sockets always; the session's server, which
    does not trust its clients, fifos and sockets only."""
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    tree.stream().close()
    if trees.name == "local":
        assert tree.makes_nodes() == ({"devices", "specials"} if os.geteuid() == 0 else {"specials"})
    else:
        assert tree.makes_nodes() == {"specials"}


def test_a_tree_here_lists_its_block_devices_as_files_when_asked(trees, loop_devices):
    """--copy-devices: a block device below the root is listed as a file of the device's size and read
    as one; a served tree lists devices as what they are."""
    build_tree(trees.directory / "tree")
    device, backing = loop_devices.new("backing.img", 64 * 1024, b"device contents")
    os.mknod(trees.directory / "tree" / "disk", stat.S_IFBLK | 0o600, os.stat(device).st_rdev)
    tree = trees.open("tree")
    assert tree.list_devices_as_files() == (trees.name == "local")
    disk = {entry.path: entry for entry in tree.list().entries}["disk"]
    if trees.name != "local":
        assert (disk.kind, disk.target) == ("other", f"{os.major(os.stat(device).st_rdev)}:"
                                                     f"{os.minor(os.stat(device).st_rdev)}")
        return
    assert (disk.kind, disk.size) == ("file", 64 * 1024)
    [(_, data, error)] = list(tree.read_files([disk]))
    assert (data, error) == (backing.read_bytes(), "")


def test_walk_only_enters_the_directories_it_is_told_here_and_all_on_a_server(trees):
    """--files-from and -R: a walk here need not read what no listed path is below."""
    build_tree(trees.directory / "tree")
    tree = trees.open("tree")
    tree.walk_only(lambda path: path != "sub")
    listed = {entry.path for entry in tree.list().entries}
    assert {"sub", "hollow", "a.txt"} <= listed  # the directory itself is listed, not entered
    assert ("sub/b.bin" in listed) is (trees.name != "local")


def test_take_from_alternates_links_copies_or_leaves_out_what_a_directory_has_alike(trees):
    """--link-dest, --copy-dest, --compare-dest: on the tree's side, from a directory beside it."""
    build_tree(trees.directory / "prior")
    tree = trees.open("new")
    tree.apply([Operation(MKDIR, Entry("", DIR, 0, 0, 0o40755))], TIMES)
    entry = next(entry for entry in LocalTree(str(trees.directory / "prior")).list().entries
                 if entry.path == "a.txt")
    other = entry._replace(path="b.txt", size=4)
    assert tree.takes_from_alternates()
    assert tree.take_from_alternates([entry, other], set(), ["../prior"], "link", TIMES, dry_run=True) == (
        {"a.txt": "linked"}, 0, [])
    assert not (trees.directory / "new" / "a.txt").exists()
    assert tree.take_from_alternates([entry], set(), ["../missing", "../prior"], "link", TIMES) == (
        {"a.txt": "linked"}, 0, [])
    assert os.path.samefile(trees.directory / "new" / "a.txt", trees.directory / "prior" / "a.txt")
    changed_mode = entry._replace(path="a.txt", mode=entry.mode ^ 0o020)
    assert tree.take_from_alternates([changed_mode], {"a.txt"}, ["../prior"], "compare", TIMES) == (
        {"a.txt": "copied"}, 5, [])  # alike but for its mode: copied, and given the entry's
    assert not os.path.samefile(trees.directory / "new" / "a.txt", trees.directory / "prior" / "a.txt")
    assert tree.take_from_alternates([entry], {"a.txt"}, ["../prior"], "compare", TIMES) == (
        {"a.txt": "removed"}, 0, [])
    assert not (trees.directory / "new" / "a.txt").exists()
    assert (trees.directory / "prior" / "a.txt").read_bytes() == b"alpha"


TREE_DECLARED = {LocalTree: {WalkedHere, TreeCopies, KeptAttributes, Alternates},
                 RemoteTree: {ServedTree, KeptAttributes, Alternates}}


@pytest.mark.parametrize("kind", list(TREE_DECLARED), ids=lambda kind: kind.__name__)
def test_each_tree_kind_declares_its_capabilities(kind):
    assert set(kind.capabilities) == TREE_DECLARED[kind]


def test_every_optional_tree_operation_belongs_to_one_capability_and_has_a_case_here():
    check_grouping(TreeEndpoint, TREE_CAPABILITIES, {"close", "stream", "describe_root_link"})

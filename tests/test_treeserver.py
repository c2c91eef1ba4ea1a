"""Trees over HTTP: the batch wire format, the four tree endpoints and the RemoteTree client.

The treewire tests need no server: round trips of odd names, and streams
that are corrupt, cut short at every byte, or hostile (huge lengths), which
must end in a one-line error without a record escaping early. The endpoint
tests run against the real server of conftest.py, through RemoteTree and
through raw HTTP where a client would not send such a request: listings,
byte-identical reads and writes, metadata, confinement (nothing outside the
root read or changed), refused bodies that leave no file behind, the token,
and errors that are always one-line JSON.
"""

from __future__ import annotations

import io
import json
import os
import stat
import threading
from pathlib import Path
from typing import Iterator, List, Optional

import pytest
from conftest import http_get
from test_errors import assert_json_error, raw_request, snapshot

from pdiffcopy.transport import remotetree
from pdiffcopy.errors import AccessDenied, AuthenticationFailed, RemoteError
from pdiffcopy.local.localtree import LocalTree
from pdiffcopy.core.protocol import NO_FOLLOW_HEADER
from pdiffcopy.transport.remote import RemoteFile
from pdiffcopy.core.locations import quote_path
from pdiffcopy.transport.remotetree import RemoteTree
from pdiffcopy.engine.treeendpoints import DELETE, METADATA, MKDIR, REMOVE, SYMLINK, MetadataOptions, Operation
from pdiffcopy.core.treeplan import DIR, FILE, Entry
from pdiffcopy.core.treewire import (
    END_MARKER,
    MAX_FILE_BYTES,
    MAX_HEADER_BYTES,
    READ_AHEAD_BYTES,
    TreeWireError,
    decode_files,
    digest,
    encode_files,
    encode_header,
    parse_entry,
    parse_operation,
)

#: Names a tree must carry unchanged: spaces, a newline, bytes that are not
#: UTF-8, a leading dash, characters URLs reserve, a valid U+FFFD.
ODD_NAMES = [
    "with space.txt",
    "two\nlines",
    os.fsdecode(b"latin1-\xe9t\xe9"),
    os.fsdecode(b"\xff\xfe"),
    "-rf",
    "--help",
    "q?a#b%20c&d",
    "real-\ufffd-replacement",
]


def file_entry(path: str, data: bytes, mode: int = 0o644, mtime_ns: int = 1_500_000_000_123_456_789
               ) -> Entry:
    return Entry(path, FILE, len(data), mtime_ns, stat.S_IFREG | mode)


def dir_entry(path: str, mode: int = 0o755, mtime_ns: int = 1_500_000_000_000_000_000) -> Entry:
    return Entry(path, DIR, 0, mtime_ns, stat.S_IFDIR | mode)


def stream_of(*records) -> bytes:
    return b"".join(encode_files(records))


def one_byte_chunks(data: bytes) -> Iterator[bytes]:
    for index in range(len(data)):
        yield data[index:index + 1]


class ReadintoOnly:
    """A source with readinto only (like the server's request body), handing out little at a time."""

    def __init__(self, data: bytes, step: int = 3) -> None:
        self.data, self.position, self.step, self.consumed = data, 0, step, 0

    def readinto(self, view) -> int:
        count = min(len(view), self.step, len(self.data) - self.position)
        view[:count] = self.data[self.position:self.position + count]
        self.position += count
        self.consumed += count
        return count


# -- treewire, without a server ---------------------------------------------------------


def sample_records():
    big = bytes(range(256)) * 800  # beyond the size sent in one chunk with its header
    records = []
    for name in ODD_NAMES:
        data = os.fsencode(name) * 3
        records.append((file_entry(name, data), data, ""))
    return records + [
        (file_entry("empty", b""), b"", ""),
        (file_entry("big/one", big), big, ""),
        (file_entry("gone", b"12345"), None, "No such file or directory"),
    ]


def test_records_round_trip_through_every_kind_of_source():
    records = sample_records()
    data = stream_of(*records)
    expected = [(entry, content, error) for entry, content, error in records]
    assert list(decode_files(io.BytesIO(data))) == expected
    assert list(decode_files(one_byte_chunks(data))) == expected
    assert list(decode_files(ReadintoOnly(data))) == expected
    assert list(decode_files([data])) == expected


def test_an_answer_to_a_read_is_decoded_against_the_entries_asked_for():
    records = sample_records()
    asked = [entry for entry, _, _ in records]
    data = stream_of(*records)
    decoded = list(decode_files(one_byte_chunks(data), expected=asked))
    assert decoded == records
    assert all(entry is wanted for (entry, _, _), wanted in zip(decoded, asked))  # ours, not the header's


@pytest.mark.parametrize("change", ["other path", "other size", "one more"])
def test_an_answer_to_a_read_that_is_not_what_was_asked_is_refused(change):
    asked = [file_entry("a", b"123"), file_entry("b", b"45")]
    sent = [(asked[0], b"123", ""), (asked[1], b"45", "")]
    if change == "other path":
        sent[1] = (file_entry("c", b"45"), b"45", "")
    elif change == "other size":
        sent[1] = (file_entry("b", b"456"), b"456", "")
    else:
        sent.append((file_entry("d", b"6"), b"6", ""))
    handed = []
    with pytest.raises(TreeWireError):
        for record in decode_files(io.BytesIO(stream_of(*sent)), expected=asked):
            handed.append(record)
    assert handed == sent[:1] if change != "one more" else handed == sent[:2]


def test_names_that_are_not_utf8_travel_as_ascii_escapes_and_come_back_as_bytes():
    name = os.fsdecode(b"caf\xe9\n-x")
    header = encode_header(file_entry(name, b"abc"), 3)
    text = header[4:]
    assert text.isascii()
    assert b"\\udce9" in text and b"\\n" in text
    [(entry, content, _)] = decode_files(io.BytesIO(header + b"abc" + digest(b"abc") + END_MARKER))
    assert os.fsencode(entry.path) == b"caf\xe9\n-x"
    assert content == b"abc"


def test_an_error_record_carries_one_line_and_no_data():
    data = stream_of((file_entry("a", b"12"), None, "first line\nsecond line"))
    [(entry, content, error)] = decode_files(io.BytesIO(data))
    assert (entry.path, content, error) == ("a", None, "first line second line")


@pytest.mark.parametrize("where", ["data", "digest"])
def test_a_corrupt_record_is_refused_and_never_handed_out(where):
    first, second = b"A" * 100, b"B" * 100
    data = bytearray(stream_of((file_entry("first", first), first, ""),
                               (file_entry("second", second), second, "")))
    if where == "data":
        data[data.index(b"B" * 100) + 50] ^= 0x01
    else:
        data[-len(END_MARKER) - 1] ^= 0x01
    decoded = []
    with pytest.raises(TreeWireError, match="Digest mismatch.*second"):
        for record in decode_files(io.BytesIO(bytes(data))):
            decoded.append(record)
    assert [entry.path for entry, _, _ in decoded] == ["first"]


def test_a_stream_cut_anywhere_fails_and_yields_only_whole_records():
    records = [(file_entry(f"f{index}", bytes([index]) * 40), bytes([index]) * 40, "")
               for index in range(3)]
    data = stream_of(*records)
    for cut in range(len(data)):
        decoded = []
        with pytest.raises(TreeWireError) as caught:
            for record in decode_files(io.BytesIO(data[:cut])):
                decoded.append(record)
        assert "\n" not in str(caught.value)
        assert decoded == records[:len(decoded)], cut
    assert list(decode_files(io.BytesIO(data))) == records


def test_data_after_the_end_marker_is_refused():
    data = stream_of((file_entry("a", b"1"), b"1", "")) + b"more"
    with pytest.raises(TreeWireError, match="after its end marker"):
        list(decode_files(io.BytesIO(data)))


def test_a_hostile_header_length_is_refused_before_reading_it():
    source = ReadintoOnly((MAX_HEADER_BYTES + 1).to_bytes(4, "big") + b"{" * (4 * MAX_HEADER_BYTES),
                          step=1 << 30)
    with pytest.raises(TreeWireError, match="header of"):
        list(decode_files(source))
    assert source.consumed <= READ_AHEAD_BYTES  # the read-ahead, not the hostile length


def test_a_hostile_file_size_is_refused_before_reading_the_data():
    entry = Entry("huge", FILE, MAX_FILE_BYTES + 1, 0, 0o100644)
    header = encode_header(entry, MAX_FILE_BYTES + 1)
    source = ReadintoOnly(header + b"\0" * (2 * READ_AHEAD_BYTES), step=1 << 30)
    with pytest.raises(TreeWireError, match="more than"):
        list(decode_files(source))
    assert source.consumed <= READ_AHEAD_BYTES  # the read-ahead, not the hostile size


def test_the_batch_bounds_are_enforced():
    records = [(file_entry(f"f{i}", b"12345"), b"12345", "") for i in range(4)]
    data = stream_of(*records)
    assert len(list(decode_files(io.BytesIO(data), max_files=4, max_total_bytes=20))) == 4
    with pytest.raises(TreeWireError, match="Too many files"):
        list(decode_files(io.BytesIO(data), max_files=3))
    with pytest.raises(TreeWireError, match="Too much data"):
        list(decode_files(io.BytesIO(data), max_total_bytes=19))


def raw_record(header: dict, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(4, "big") + text + data + digest(data) + END_MARKER


@pytest.mark.parametrize("header,data,message", [
    ({"entry": ["a", "file", 2, 0, 33188, 0, 0, "", 1, 0], "size": 3}, b"abc", "entry says 2"),
    ({"entry": ["d", "dir", 0, 0, 16877, 0, 0, "", 1, 0], "size": 0}, b"", "not a file"),
    ({"entry": ["a", "file", 1, 0, 33188, 0, 0, "", 1, 0], "size": 1, "error": "x"}, b"1",
     "has data"),
    ({"entry": ["a", "file", True, 0, 33188, 0, 0, "", 1, 0], "size": 1}, b"1", "size must"),
    ({"entry": ["a", "file", 1, 0, 33188, 0, 0, "", 1]}, b"", "10 or 12 values"),
    ({"entry": ["a\u0000b", "file", 0, 0, 33188, 0, 0, "", 1, 0]}, b"", "NUL"),
    ({"entry": ["\ud800", "file", 0, 0, 33188, 0, 0, "", 1, 0]}, b"", "not a file name"),
    ({"entry": ["a//b", "file", 0, 0, 33188, 0, 0, "", 1, 0]}, b"", "empty or '.'"),
    ({"entry": ["", "file", 0, 0, 33188, 0, 0, "", 1, 0]}, b"", "empty or '.'"),
    ({"entry": ["a", "fifo", 0, 0, 33188, 0, 0, "", 1, 0]}, b"", "unknown entry kind"),
    ({"entry": ["a", "file", 0, 0, -1, 0, 0, "", 1, 0]}, b"", "mode must"),
    ({"size": 0}, b"", "no entry"),
], ids=["size-mismatch", "directory", "error-with-data", "bool-size", "short-entry", "nul",
        "lone-surrogate", "double-slash", "empty-path", "unknown-kind", "negative-mode",
        "no-entry"])
def test_malformed_headers_are_refused_in_one_line(header, data, message):
    with pytest.raises(TreeWireError, match=message) as caught:
        list(decode_files(io.BytesIO(raw_record(header, data))))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd"])
def test_an_entry_leading_out_is_access_denied(path):
    with pytest.raises(AccessDenied):
        parse_entry([path, "file", 0, 0, 33188, 0, 0, "", 1, 0])


def test_header_that_is_not_json_is_refused():
    with pytest.raises(TreeWireError, match="not UTF-8 JSON"):
        list(decode_files(io.BytesIO(b"\0\0\0\x03{x}" + digest(b"") + END_MARKER)))


def test_operations_are_parsed_strictly():
    operation = parse_operation(["mkdir", ["", "dir", 0, 0, 16877, 0, 0, "", 1, 0]])
    assert operation == Operation(MKDIR, Entry("", DIR, 0, 0, 16877))
    with pytest.raises(TreeWireError, match="Unknown operation"):
        parse_operation(["chmod", ["a", "dir", 0, 0, 16877, 0, 0, "", 1, 0]])
    with pytest.raises(TreeWireError, match=r"\[name, entry\]"):
        parse_operation({"mkdir": "a"})


def test_the_encoder_refuses_content_that_does_not_match_its_entry():
    with pytest.raises(TreeWireError, match="has 3 bytes, its entry says 2"):
        list(encode_files([(file_entry("a", b"12"), b"123", "")]))


# -- the endpoints ----------------------------------------------------------------------


@pytest.fixture
def tree_dir(server, unique) -> Path:
    """An empty directory of its own in the shared server root."""
    directory = server.root / unique.replace(".img", "")
    directory.mkdir()
    return directory


@pytest.fixture
def outside(server, unique) -> Path:
    """A directory next to the server's root, with a file, and a symlink to it inside the root."""
    directory = server.root.parent / f"outside-{unique}"
    directory.mkdir()
    (directory / "secret.txt").write_bytes(b"outside the root\n")
    return directory


def remote(server, directory: Path, token: Optional[str] = None) -> RemoteTree:
    relative = os.fsencode(directory.relative_to(server.root))
    return RemoteTree(f"{server.base}/{quote_path(os.fsdecode(relative))}", token=token)


def write_file(path: Path, data: bytes) -> None:
    with open(os.fsencode(path), "wb") as handle:
        handle.write(data)


def populate(directory: Path, outside: Optional[Path] = None) -> dict:
    """Files, nested directories and symlinks with odd names; returns {path: content}."""
    contents = {}
    (directory / "sub" / "deeper").mkdir(parents=True)
    for index, name in enumerate(ODD_NAMES):
        data = f"content of {index}\n".encode() * (index + 1)
        write_file(directory / name, data)
        contents[name] = data
    write_file(directory / "sub" / "deeper" / "leaf.bin", os.urandom(70_000))
    contents["sub/deeper/leaf.bin"] = (directory / "sub" / "deeper" / "leaf.bin").read_bytes()
    (directory / "sub" / "to-leaf").symlink_to("deeper/leaf.bin")
    if outside is not None:
        (directory / "link-out").symlink_to(outside)
    return contents


def test_a_listing_has_every_entry_once_and_follows_no_symlink(server, tree_dir, outside):
    populate(tree_dir, outside)
    listing = remote(server, tree_dir).list()
    assert listing.root is not None and listing.root.kind == DIR and listing.root.path == ""
    assert listing.failures == []
    by_path = {entry.path: entry for entry in listing.entries}
    assert len(by_path) == len(listing.entries)
    assert set(by_path) == set(ODD_NAMES) | {"sub", "sub/deeper", "sub/deeper/leaf.bin",
                                             "sub/to-leaf", "link-out"}
    assert by_path["sub/to-leaf"].kind == "symlink"
    assert by_path["sub/to-leaf"].target == "deeper/leaf.bin"
    assert by_path["link-out"].kind == "symlink" and by_path["link-out"].target == str(outside)
    assert not any(path.startswith("link-out/") or "secret" in path for path in by_path)
    leaf = os.lstat(tree_dir / "sub" / "deeper" / "leaf.bin")
    assert by_path["sub/deeper/leaf.bin"].size == leaf.st_size == 70_000
    assert by_path["sub/deeper/leaf.bin"].mtime_ns == leaf.st_mtime_ns
    name = os.fsdecode(b"\xff\xfe")
    assert by_path[name].size == os.lstat(os.fsencode(tree_dir) + b"/\xff\xfe").st_size


def test_a_listing_is_compact_json(server, tree_dir):
    for index in range(300):
        (tree_dir / f"f{index}").write_bytes(b"")
    status, headers, body = http_get(f"{server.base}/.pdiffcopy/tree/{tree_dir.name}")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert b"\n" not in body and b", " not in body and b": " not in body
    document = json.loads(body)
    assert len(document["entries"]) == 300 and document["failures"] == []


def test_a_missing_tree_has_no_root_and_the_root_tree_lists_everything(server, tree_dir):
    assert remote(server, tree_dir / "missing").list().root is None
    (tree_dir / "file").write_bytes(b"x")
    assert remote(server, tree_dir / "file" / "below").list().root is None
    with_slash = RemoteTree(f"{server.base}/{tree_dir.name}/").list()
    assert [entry.path for entry in with_slash.entries] == ["file"]
    listing = RemoteTree(server.base + "/").list()
    assert listing.root is not None and listing.root.kind == DIR
    assert f"{tree_dir.name}/file" in {entry.path for entry in listing.entries}


def test_a_tree_whose_own_name_is_not_utf8(server, tree_dir):
    directory = os.fsencode(tree_dir) + b"/dir-\xe9"
    os.mkdir(directory)
    write_file(Path(os.fsdecode(directory + b"/inner")), b"inner data")
    tree = RemoteTree(f"{server.base}/{tree_dir.name}/dir-%E9")
    listing = tree.list()
    assert [entry.path for entry in listing.entries] == ["inner"]
    [(_, data, error)] = tree.read_files(listing.entries)
    assert (data, error) == (b"inner data", "")
    # A file of that name is reachable for the block engine too.
    endpoint = tree.file_endpoint("inner")
    try:
        info = endpoint.stat()
        assert info is not None and info.size == 10
    finally:
        endpoint.close()


def test_reads_are_byte_identical_and_report_what_changed(server, tree_dir):
    contents = populate(tree_dir)
    tree = remote(server, tree_dir)
    files = [entry for entry in tree.list().entries if entry.kind == FILE]
    assert len(files) == len(contents)
    changed = next(entry for entry in files if entry.path == "-rf")
    write_file(tree_dir / "-rf", b"now another size")
    got = {entry.path: (data, error) for entry, data, error in tree.read_files(files)}
    assert got.pop("-rf") == (None, f"changed while copying (16 bytes, expected {changed.size})")
    assert got == {path: (data, "") for path, data in contents.items() if path != "-rf"}


def test_writes_are_byte_identical_with_modes_and_times_as_asked(server, tree_dir):
    source = tree_dir / "source"
    source.mkdir()
    contents = populate(source)
    (source / "sub" / "deeper" / "leaf.bin").chmod(0o751)
    os.chmod(os.fsencode(source / ODD_NAMES[2]), 0o600)
    source_tree, target_tree = remote(server, source), remote(server, tree_dir / "target")
    listing = source_tree.list()
    directories = sorted((entry for entry in listing.entries if entry.kind == DIR),
                         key=lambda entry: entry.depth)
    assert target_tree.apply([Operation(MKDIR, listing.root)] +
                             [Operation(MKDIR, entry) for entry in directories],
                             MetadataOptions()) == []
    files = [entry for entry in listing.entries if entry.kind == FILE]
    half = len(files) // 2
    records = [(entry, data) for entry, data, _ in source_tree.read_files(files)]
    assert target_tree.write_files(records[:half], MetadataOptions(times=True)) == []
    assert target_tree.write_files(records[half:], MetadataOptions(times=False)) == []
    for index, (entry, data) in enumerate(records):
        written = os.fsencode(tree_dir / "target" / entry.path)
        with open(written, "rb") as handle:
            assert handle.read() == contents[entry.path] == data
        info = os.stat(written)
        assert stat.S_IMODE(info.st_mode) == entry.permissions, entry.path
        assert (info.st_mtime_ns == entry.mtime_ns) == (index < half), entry.path
    assert stat.S_IMODE(os.stat(tree_dir / "target" / "sub/deeper/leaf.bin").st_mode) == 0o751
    assert not [name for name in os.listdir(tree_dir / "target") if ".pdiffcopy-" in name]


def test_batches_beyond_the_bounds_are_split_without_losing_a_file(server, tree_dir, monkeypatch):
    monkeypatch.setattr(remotetree, "MAX_BATCH_FILES", 3)
    monkeypatch.setattr(remotetree, "MAX_BATCH_BYTES", 50)
    tree = remote(server, tree_dir)
    records = [(file_entry(f"f{index:02}", bytes([65 + index]) * (index * 3)),
                bytes([65 + index]) * (index * 3)) for index in range(11)]
    assert tree.write_files(iter(records), MetadataOptions()) == []
    assert sorted(os.listdir(tree_dir)) == [f"f{index:02}" for index in range(11)]
    back = list(tree.read_files([entry for entry, _ in records]))
    assert [(entry, data) for entry, data, _ in back] == records


def test_batches_keep_their_json_bodies_within_the_bound(monkeypatch):
    """Every request body stays under the JSON bound, odd (escaped) names too, and no item is lost."""
    monkeypatch.setattr(remotetree, "_JSON_BATCH_BYTES", 3000)
    names = [("dir/" + "é" * (index % 40) + "x" * (index % 97) + f"-{index}") for index in range(700)]
    entries = [file_entry(name, b"z" * (index % 5)) for index, name in enumerate(names)]
    batches = list(remotetree._batches(entries, 256, 40, lambda entry: entry.size,
                                       lambda entry: entry.to_wire(), "entries"))
    assert [entry for batch, _ in batches for entry in batch] == entries
    for batch, body in batches:
        assert json.loads(body) == {"entries": [entry.to_wire() for entry in batch]}
        assert len(batch) <= 256 and (len(body) <= 3000 or len(batch) == 1)
        assert sum(entry.size for entry in batch) <= 40 or len(batch) == 1
    # Not cut needlessly: most batches are full to within a tenth of the bound.
    assert sum(len(body) for _, body in batches) > 0.8 * 3000 * (len(batches) - 1)
    # An item longer than the bound alone still goes, alone.
    long = [file_entry("y" * 5000, b""), file_entry("a", b"")]
    assert [len(batch) for batch, _ in remotetree._batches(long, 256, None, None,
                                                           lambda entry: entry.to_wire(), "entries")] == [1, 1]


def test_a_failed_file_does_not_stop_the_batch(server, tree_dir):
    records = [(file_entry("missing-dir/a", b"1"), b"1"), (file_entry("b", b"22"), b"22")]
    failures = remote(server, tree_dir).write_files(records, MetadataOptions())
    assert [path for path, _ in failures] == ["missing-dir/a"]
    assert "No such file or directory" in failures[0][1]
    assert (tree_dir / "b").read_bytes() == b"22"


def test_operations_run_in_order_and_report_failures(server, tree_dir):
    (tree_dir / "old").mkdir()
    (tree_dir / "old" / "inside").write_bytes(b"x")
    (tree_dir / "file").write_bytes(b"y")
    (tree_dir / "empty").mkdir()
    operations = [
        Operation(MKDIR, dir_entry("made", 0o750, 1_400_000_000_000_000_000)),
        Operation(SYMLINK, Entry("made/link", "symlink", 0, 0, stat.S_IFLNK | 0o777,
                                 target="../file")),
        Operation(METADATA, file_entry("file", b"y", 0o604, 1_300_000_000_000_000_000)),
        Operation(DELETE, dir_entry("old")),  # not empty: fails, the rest goes on
        Operation(DELETE, dir_entry("empty")),
        Operation(REMOVE, dir_entry("old")),
        Operation(METADATA, dir_entry("made", 0o750, 1_400_000_000_000_000_000)),
    ]
    failures = remote(server, tree_dir).apply(operations, MetadataOptions(times=True))
    assert [path for path, _ in failures] == ["old"]
    assert os.readlink(tree_dir / "made" / "link") == "../file"
    info = os.stat(tree_dir / "file")
    assert (stat.S_IMODE(info.st_mode), info.st_mtime_ns) == (0o604, 1_300_000_000_000_000_000)
    made = os.stat(tree_dir / "made")
    assert (stat.S_IMODE(made.st_mode), made.st_mtime_ns) == (0o750, 1_400_000_000_000_000_000)
    assert not (tree_dir / "old").exists() and not (tree_dir / "empty").exists()


def test_the_server_root_itself_cannot_be_deleted(server):
    with pytest.raises(AccessDenied, match="root directory itself"):
        RemoteTree(server.base).apply([Operation(DELETE, dir_entry(""))], MetadataOptions())
    assert server.root.is_dir()


# -- confinement ---------------------------------------------------------------------


TREE_REQUESTS = [
    ("GET", "tree", None),
    ("POST", "tree-read", json.dumps({"entries": [["a", "file", 0, 0, 33188, 0, 0, "", 1, 0]]})),
    ("POST", "tree-write", stream_of((file_entry("b", b"written"), b"written", ""))),
    ("POST", "tree-apply", json.dumps({"operations": [["mkdir", ["a", "dir", 0, 0, 16877, 0, 0,
                                                                    "", 1, 0]]]})),
]


@pytest.mark.parametrize("method,endpoint,body", TREE_REQUESTS, ids=[r[1] for r in TREE_REQUESTS])
@pytest.mark.parametrize("path", ["../{outside}", "%2e%2e/{outside}", "/{outside_abs}",
                                  "{tree}/link-out", "{tree}/link-out/sub"])
def test_a_tree_path_leading_out_is_refused(server, tree_dir, outside, method, endpoint, body,
                                            path):
    (tree_dir / "link-out").symlink_to(outside)
    before = snapshot(outside)
    target = path.format(outside=outside.name, outside_abs=str(outside).lstrip("/"),
                         tree=tree_dir.name)
    status, headers, answer = raw_request(server.port, method, f"/.pdiffcopy/{endpoint}/{target}",
                                          body=body)
    assert "outside the root" in assert_json_error(status, headers, answer, 403)
    assert snapshot(outside) == before
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert not (tree_dir / "b").exists() and not (server.root / "b").exists()


@pytest.mark.parametrize("endpoint", ["", ".pdiffcopy/stat/", ".pdiffcopy/hashes/"])
def test_a_member_asked_not_to_follow_is_refused_as_a_symlink(server, tree_dir, endpoint):
    (tree_dir / "real").write_bytes(b"inside the tree")
    (tree_dir / "link").symlink_to("real")
    target = f"/{endpoint}{quote_path(tree_dir.relative_to(server.root).as_posix())}/link"
    if endpoint.endswith("hashes/"):
        target += "?method=sha1&block_size=4096&offset=0&length=15"
    # A file URL follows a symlink that stays beneath the root...
    status, _, answer = raw_request(server.port, "GET", target)
    assert status == 200
    if endpoint.endswith("stat/"):
        assert json.loads(answer)["type"] == "file"
    # ...a tree's member (the header RemoteTree's file endpoints send) never does.
    status, headers, answer = raw_request(server.port, "GET", target, headers={NO_FOLLOW_HEADER: "1"})
    if endpoint.endswith("stat/"):
        assert status == 200 and json.loads(answer)["type"] == "other"  # the link itself, as lstat says
    else:
        assert_json_error(status, headers, answer, 409)
    status, headers, answer = raw_request(server.port, "GET", target, headers={NO_FOLLOW_HEADER: "yes"})
    assert NO_FOLLOW_HEADER in assert_json_error(status, headers, answer, 400)


def test_entries_leading_out_are_refused(server, tree_dir, outside):
    (tree_dir / "link-out").symlink_to(outside)
    before = snapshot(outside)
    escape = f"../../{outside.name}/secret.txt"
    target = quote_path(tree_dir.relative_to(server.root).as_posix())
    # A batch that carries a path with ".." is refused whole by the server: no client of ours sends one.
    bodies = [("tree-write", stream_of((file_entry(escape, b"pwned"), b"pwned", ""))),
              ("tree-read", json.dumps({"entries": [file_entry(escape, b"outside the root\n").to_wire()]})),
              ("tree-apply", json.dumps({"operations": [[REMOVE, dir_entry(f"../../{outside.name}").to_wire()]]}))]
    for endpoint, body in bodies:
        status, headers, answer = raw_request(server.port, "POST", f"/.pdiffcopy/{endpoint}/{target}", body=body)
        assert "outside the tree" in assert_json_error(status, headers, answer, 403)
    # Ours reports such a path as that entry's failure, as a local tree does, without sending it.
    tree = remote(server, tree_dir)
    failures = tree.write_files([(file_entry(escape, b"pwned"), b"pwned")], MetadataOptions())
    assert [path for path, _ in failures] == [escape]
    [(_, data, error)] = tree.read_files([file_entry(escape, b"outside the root\n")])
    assert data is None and "outside the tree" in error
    failures = tree.apply([Operation(REMOVE, dir_entry(f"../../{outside.name}"))], MetadataOptions())
    assert [path for path, _ in failures] == [f"../../{outside.name}"]
    # Through the symlink: not an escape by name, so each is one failure, and nothing happens.
    through = "link-out/secret.txt"
    failures = tree.write_files([(file_entry(through, b"pwned"), b"pwned")], MetadataOptions())
    assert [path for path, _ in failures] == [through]
    [(_, data, error)] = tree.read_files([file_entry(through, b"outside the root\n")])
    assert data is None and error
    failures = tree.apply([Operation(REMOVE, dir_entry("link-out/secret.txt")),
                           Operation(METADATA, file_entry(through, b"", 0o777))],
                          MetadataOptions())
    assert [path for path, _ in failures] == [through, through]
    assert snapshot(outside) == before


# -- refused bodies ---------------------------------------------------------------------


def write_raw(server, directory: Path, body: bytes, query: str = ""):
    return raw_request(server.port, "POST", f"/.pdiffcopy/tree-write/{directory.name}{query}",
                       body=body, headers={"Content-Type": "application/octet-stream"})


def test_a_corrupt_record_is_refused_and_not_written(server, tree_dir):
    good, bad = b"good data", b"bad data!"
    data = bytearray(stream_of((file_entry("good", good), good, ""),
                               (file_entry("bad", bad), bad, "")))
    data[data.index(bad) + 2] ^= 0x20
    message = assert_json_error(*write_raw(server, tree_dir, bytes(data)), 400)
    assert "Digest mismatch" in message and "bad" in message
    assert sorted(os.listdir(tree_dir)) == ["good"]  # each whole: the bad one not at all
    assert (tree_dir / "good").read_bytes() == good


@pytest.mark.parametrize("cut", ["in-data", "before-digest", "no-end-marker", "empty"])
def test_a_truncated_body_is_refused_and_leaves_no_file(server, tree_dir, cut):
    content = b"z" * 1000
    data = stream_of((file_entry("file", content), content, ""))
    body = {"in-data": data[:200], "before-digest": data[:-12], "no-end-marker": data[:-4],
            "empty": b""}[cut]
    message = assert_json_error(*write_raw(server, tree_dir, body), 400)
    assert "cut short" in message
    expected = ["file"] if cut == "no-end-marker" else []  # its record was whole
    assert sorted(os.listdir(tree_dir)) == expected


def test_an_error_record_is_not_something_to_write(server, tree_dir):
    body = stream_of((file_entry("a", b"1"), None, "unreadable"))
    assert "not errors" in assert_json_error(*write_raw(server, tree_dir, body), 400)
    assert os.listdir(tree_dir) == []


@pytest.mark.parametrize("endpoint,query,body,fragment", [
    ("tree-read", "", b"{not json", "not valid JSON"),
    ("tree-read", "", b"[" * 100_000, "not valid JSON"),
    ("tree-read", "", b"\xff\xfe", "not valid JSON"),
    ("tree-read", "", b'{"paths": ["a"]}', "list 'entries'"),
    ("tree-read", "", b'{"entries": [["a", "dir", 0, 0, 16877, 0, 0, "", 1, 0]]}',
     "Not a regular file"),
    ("tree-read", "", json.dumps({"entries": [["a", "file", MAX_FILE_BYTES + 1, 0, 33188, 0, 0, "",
                                               1, 0]]}).encode(), "travel whole"),
    ("tree-read", "", json.dumps({"entries": [[f"f{i}", "file", 0, 0, 33188, 0, 0, "", 1, 0]
                                              for i in range(10_001)]}).encode(), "At most 10000"),
    ("tree-read", "", b'{"entries": [["a", "file", "1", 0, 33188, 0, 0, "", 1, 0]]}', "size must"),
    ("tree-apply", "", b'{"operations": [["explode", ["a", "dir", 0, 0, 16877, 0, 0, "", 1, 0]]]}',
     "Unknown operation"),
    ("tree-apply", "", b'{"operations": [["mkdir", ["a", "dir", 0, 0, 16877, 0, 0, "", 1]]]}',
     "10 or 12 values"),
    ("tree-apply", "?times=yes",
     b'{"operations": [["mkdir", ["a", "dir", 0, 0, 16877, 0, 0, "", 1, 0]]]}',
     "times must be 0 or 1"),
    ("tree-write", "?owner=2", END_MARKER, "owner must be 0 or 1"),
], ids=["syntax", "deep-nesting", "not-utf8", "wrong-key", "directory", "too-large",
        "too-many", "string-size", "unknown-operation", "short-entry", "bad-times", "bad-owner"])
def test_bad_requests_get_a_one_line_json_400(server, tree_dir, endpoint, query, body, fragment):
    status, headers, answer = raw_request(server.port, "POST",
                                          f"/.pdiffcopy/{endpoint}/{tree_dir.name}{query}",
                                          body=body)
    assert fragment in assert_json_error(status, headers, answer, 400)
    assert os.listdir(tree_dir) == []


# -- the client ---------------------------------------------------------------------------


def test_the_token_is_required(token_server):
    directory = token_server.root / "tree-auth"
    directory.mkdir(exist_ok=True)
    (directory / "a").write_bytes(b"secret")
    for method, endpoint, body in TREE_REQUESTS:
        status, headers, answer = raw_request(token_server.port, method,
                                              f"/.pdiffcopy/{endpoint}/tree-auth", body=body)
        assert_json_error(status, headers, answer, 401)
        assert headers["WWW-Authenticate"] == 'Bearer realm="pdiffcopy"'
        assert b"secret" not in answer
    with pytest.raises(AuthenticationFailed):
        RemoteTree(f"{token_server.base}/tree-auth", token="wrong").list()
    tree = RemoteTree(f"{token_server.base}/tree-auth", token=token_server.token)
    [entry] = tree.list().entries
    assert [data for _, data, _ in tree.read_files([entry])] == [b"secret"]
    assert not (directory / "b").exists()  # the refused write above wrote nothing


def test_head_of_a_listing_has_no_body(server, tree_dir):
    (tree_dir / "a").write_bytes(b"1")
    status, headers, body = raw_request(server.port, "HEAD", f"/.pdiffcopy/tree/{tree_dir.name}")
    assert (status, body) == (200, b"")
    assert headers["Content-Type"].startswith("application/json")


def test_other_requests_can_be_sent_while_a_read_streams(server, tree_dir):
    for index in range(5):
        (tree_dir / f"f{index}").write_bytes(bytes([index]) * 100_000)
    tree = remote(server, tree_dir)
    files = sorted((entry for entry in tree.list().entries), key=lambda entry: entry.path)
    seen = []
    for entry, data, error in tree.read_files(files):
        # The same thread, the same tree, mid-stream: the read has its own connection.
        assert len(tree.list().entries) == 5
        seen.append((entry.path, data == bytes([int(entry.path[1])]) * 100_000, error))
    assert seen == [(f"f{index}", True, "") for index in range(5)]


def test_threads_share_one_tree(server, tree_dir):
    contents = populate(tree_dir)
    tree = remote(server, tree_dir)
    files = [entry for entry in tree.list().entries if entry.kind == FILE]
    results: List[dict] = []
    errors: List[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                results.append({entry.path: data for entry, data, _ in tree.read_files(files)})
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(results) == 20 and all(result == contents for result in results)
    tree.close()


def test_a_forked_child_opens_its_own_connection(server, tree_dir):
    (tree_dir / "a").write_bytes(b"1")
    tree = remote(server, tree_dir)
    tree.list()
    parent_connection = tree.client.connection()
    assert parent_connection.http is not None  # kept alive for the next request
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports by its exit status
        status = 1
        try:
            connection = tree.client.connection()
            fresh = connection is not parent_connection and connection.http is None
            status = 0 if fresh and [e.path for e in tree.list().entries] == ["a"] else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's connection survived the child.
    assert tree.client.connection() is parent_connection
    assert [entry.path for entry in tree.list().entries] == ["a"]


def test_file_endpoints_reach_odd_names(server, tree_dir):
    populate(tree_dir)
    tree = remote(server, tree_dir)
    for name in ODD_NAMES:
        endpoint = tree.file_endpoint(name)
        try:
            assert isinstance(endpoint, RemoteFile)
            info = endpoint.stat()
            assert info is not None, name
            assert info.size == os.lstat(os.fsencode(tree_dir / name)).st_size, name
        finally:
            endpoint.close()


def test_what_cannot_travel_whole_fails_without_a_request(server, tree_dir):
    tree = RemoteTree(f"{server.base}/{tree_dir.name}")
    huge = Entry("huge", FILE, MAX_FILE_BYTES + 1, 0, 0o100644)
    results = list(tree.read_files([dir_entry("a-dir"), huge]))
    assert [(entry.path, data) for entry, data, _ in results] == [("a-dir", None), ("huge", None)]
    assert "too large" in results[1][2]
    # Nothing was asked of the server: no connection was even opened.
    assert tree.client.connection().http is None


def test_an_unreachable_server_is_a_one_line_error():
    with pytest.raises(RemoteError, match="connection refused") as caught:
        RemoteTree("http://127.0.0.1:9/x", timeout=5).list()
    assert "\n" not in str(caught.value)


def test_local_and_remote_trees_agree(server, tree_dir, outside):
    populate(tree_dir, outside)
    local = LocalTree(str(tree_dir)).list()
    over_http = remote(server, tree_dir).list()
    assert sorted(local.entries, key=lambda e: e.path) == sorted(over_http.entries,
                                                                 key=lambda e: e.path)

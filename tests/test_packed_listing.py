"""The packed tree listing (pdiffcopy.core.packedlisting): its codec, and how client and server agree on it.

The codec must carry every entry a JSON listing carries, unchanged (odd
names, symlinks, link groups, attributes, numbers at their bounds), and
refuse whatever parse_entry refuses. Over HTTP: a client that asks gets it,
one that does not (every older client) gets JSON; our client reads either,
and against a server of the revision before the packed form (an older
server, run from git history) its listing is the same.
"""

from __future__ import annotations

import io
import json
import os
import stat
import struct
import subprocess
from pathlib import Path

import pytest
from conftest import http_get, start_server
from test_errors import raw_request
from test_treeserver import (ODD_NAMES, one_byte_chunks, outside, populate, remote, sample_records,  # noqa: F401
                             tree_dir)

from pdiffcopy.core import packedlisting
from pdiffcopy.core.packedlisting import PACKED_LISTING_TYPE, decode_batch, decode_head, encode_batch, encode_head
from pdiffcopy.core.treeplan import DIR, FILE, OTHER, SYMLINK, Entry
from pdiffcopy.core.treewire import END_MARKER, TreeWireError, decode_files, digest, encode_files, parse_entry
from pdiffcopy.engine.treeendpoints import MetadataOptions
from pdiffcopy.transport import remotetree
from pdiffcopy.core.locations import quote_path
from pdiffcopy.errors import AccessDenied, RemoteError

#: The last revision of main whose server knows only the JSON listing.
BEFORE_PACKED = "f8aa5cd"


def sample_entries():
    entries = [Entry(name, FILE, index * 1000, 1_500_000_000_123_456_789 + index, stat.S_IFREG | 0o644,
                     1000, 1000) for index, name in enumerate(ODD_NAMES)]
    return entries + [
        Entry("sub", DIR, 4096, -1, stat.S_IFDIR | 0o2775, 0, 2 ** 32 - 1, nlink=3),
        Entry("sub/link", SYMLINK, 9, 0, stat.S_IFLNK | 0o777, target=os.fsdecode(b"../\xff/x y")),
        Entry("sub/fifo", OTHER, 0, 2 ** 63 - 1, stat.S_IFIFO | 0o600, 2 ** 32 - 1, 7),
        Entry("sub/huge-sparse", FILE, 2 ** 63 - 1, -2 ** 63, stat.S_IFREG | 0o4755, sparse=True),
        Entry("sub/a", FILE, 5, 7, stat.S_IFREG | 0o600, nlink=2, link="g1",
              xattrs=(("system.posix_acl_access", b"\x02\x00\x00"), ("user.note", b"\x00\xffvalue"))),
        Entry("sub/b", FILE, 5, 7, stat.S_IFREG | 0o600, nlink=2, link="g1"),
        Entry(".hidden/...", FILE, 0, 7, stat.S_IFREG | 0o600),
    ]


def decoded(data: bytes):
    reader = io.BytesIO(data)
    (count,) = struct.unpack("<I", reader.read(4))
    entries = decode_batch(count, reader.read)
    assert reader.read() == b""
    return entries


def test_a_batch_carries_every_field_unchanged():
    entries = sample_entries()
    assert decoded(encode_batch(entries)) == entries
    # The same entries as the JSON form gives them, field by field checked.
    assert decoded(encode_batch(entries)) == [parse_entry(json.loads(json.dumps(entry.to_wire())))
                                             for entry in entries]


def test_the_head_carries_the_root_or_its_absence():
    root = Entry("", DIR, 0, 5, stat.S_IFDIR | 0o755)
    assert decode_head(io.BytesIO(encode_head(root)).read) == root
    assert decode_head(io.BytesIO(encode_head(None)).read) is None


def test_big_listings_are_cut_into_bounded_batches():
    entries = [Entry(f"d/f{index}", FILE, index, index, stat.S_IFREG | 0o644) for index in range(10_000)]
    batches = list(packedlisting.encode_batches(entries))
    assert len(batches) == 3
    assert [entry for batch in batches for entry in decoded(batch)] == entries


@pytest.mark.parametrize("path, error", [
    ("../up", AccessDenied), ("a/../../up", AccessDenied), ("/abs", AccessDenied), ("", TreeWireError),
    ("a//b", TreeWireError), ("a/./b", TreeWireError), ("a/", TreeWireError), (".", TreeWireError),
    ("x" * 4097, TreeWireError), (os.fsdecode(b"\xff/../x"), AccessDenied),
])
def test_a_path_parse_entry_refuses_is_refused(path, error):
    entries = sample_entries()
    entries[3] = entries[3]._replace(path=path)
    with pytest.raises(error):
        decoded(encode_batch(entries))


def batch_with(entries, **columns) -> bytes:
    """A batch whose columns are replaced by hand (what no encoder of ours writes)."""
    data = bytearray(encode_batch(entries))
    count = len(entries)
    offsets = {"kinds": 16, "sparse": 16 + count, "size": 16 + 2 * count}
    for name, value in columns.items():
        data[offsets[name]:offsets[name] + len(value)] = value
    return bytes(data)


@pytest.mark.parametrize("columns, message", [
    ({"kinds": b"\x04"}, "unknown entry kind"),
    ({"sparse": b"\x02"}, "sparse must be 0 or 1"),
    ({"size": struct.pack("<q", -1)}, "size must be"),
])
def test_numbers_out_of_bounds_are_refused(columns, message):
    with pytest.raises(TreeWireError, match=message):
        decoded(batch_with(sample_entries()[:1], **columns))


def test_a_batch_that_is_not_what_it_says_is_refused():
    data = encode_batch(sample_entries())
    # Cut anywhere: a one-line error, never a short list.
    for cut in range(4, len(data), 97):
        with pytest.raises(TreeWireError, match="cut short|paths|targets|extra"):
            decoded(data[:cut])
    count = struct.unpack_from("<I", data)[0]
    with pytest.raises(TreeWireError, match="at most"):
        decoded(struct.pack("<I", 100_000) + data[4:])
    with pytest.raises(TreeWireError, match="longer than its entries"):
        decoded(data[:4] + struct.pack("<I", count * 5000) + data[8:])
    # One path fewer than entries (its NUL taken out joins two names).
    paths_at = 16 + 34 * count
    nul = data.index(b"\x00", paths_at)
    with pytest.raises(TreeWireError):
        decoded(data[:nul] + b"x" + data[nul + 1:])


def test_extras_must_name_entries_in_order():
    entries = sample_entries()[-3:-1]
    data = encode_batch(entries)
    extras = b'[5,"g1",[]]'
    tampered = data[:12] + struct.pack("<I", 4 + len(extras)) + data[16:data.rindex(b"[0,") - 4]
    with pytest.raises(TreeWireError, match="out of order"):
        decoded(tampered + struct.pack("<I", len(extras)) + extras)


# -- over HTTP ---------------------------------------------------------------------------


def test_the_server_sends_the_packed_listing_only_to_a_client_that_asks(server, tree_dir, outside):  # noqa: F811
    populate(tree_dir, outside)
    url = f"{server.base}/.pdiffcopy/tree/{tree_dir.name}"
    status, headers, body = http_get(url)  # an older client
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    document = json.loads(body)
    status, headers, packed = http_get(url, {"Accept": f"{PACKED_LISTING_TYPE}, application/json;q=0.5"})
    assert status == 200 and headers["Content-Type"] == PACKED_LISTING_TYPE
    assert "Accept" in headers["Vary"]
    reader = io.BytesIO(packed)
    assert decode_head(reader.read) == parse_entry(document["root"], allow_root=True)
    entries = [entry for batch in packedlisting.decode_batches(reader.read) for entry in batch]
    assert entries == [parse_entry(value) for value in document["entries"]]
    assert json.loads(reader.read()) == {"failures": [], "complete": True}
    status, headers, _ = http_get(url, {"Accept": f"{PACKED_LISTING_TYPE};q=0, application/json"})
    assert headers["Content-Type"].startswith("application/json")


def test_our_client_reads_the_packed_listing(server, tree_dir, outside, monkeypatch):  # noqa: F811
    populate(tree_dir, outside)
    batches = []
    real = packedlisting.decode_batch
    monkeypatch.setattr(packedlisting, "decode_batch", lambda *args: batches.append(real(*args)) or batches[-1])
    listing = remote(server, tree_dir).list()
    assert batches and [entry for batch in batches for entry in batch] == listing.entries
    assert {entry.path for entry in listing.entries} == set(ODD_NAMES) | {
        "sub", "sub/deeper", "sub/deeper/leaf.bin", "sub/to-leaf", "link-out"}


def test_a_listing_cut_short_after_its_batches_is_an_error(server, tree_dir, monkeypatch):  # noqa: F811
    populate(tree_dir)
    real = packedlisting.decode_batches

    def then_nothing(read):
        yield from real(read)
        while read(65536):  # the JSON ending never arrives
            pass

    monkeypatch.setattr(packedlisting, "decode_batches", then_nothing)
    with pytest.raises(RemoteError, match="malformed"):
        remote(server, tree_dir).list()


@pytest.fixture(scope="module")
def older_server(tmp_path_factory):
    """A server of the revision before the packed listing, run from the repository's history."""
    repository = Path(__file__).resolve().parent.parent
    code = tmp_path_factory.mktemp("older-code")
    archive = subprocess.run(["git", "-C", str(repository), "archive", BEFORE_PACKED, "pdiffcopy"],
                             capture_output=True)
    if archive.returncode:
        pytest.skip(f"revision {BEFORE_PACKED} is not in this checkout's history")
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive.stdout, check=True)
    root = tmp_path_factory.mktemp("older-root")
    # Started in the older code's directory: ``python -m`` looks there first.
    running = start_server(root, tmp_path_factory.mktemp("older-log") / "server.log",
                           env_extra={"PYTHONPATH": str(code)}, wrapper=("env", "-C", str(code)))
    yield running
    running.stop()


def test_an_older_server_answers_json_and_our_client_reads_it(older_server, server, unique):
    trees = []
    for running in (older_server, server):
        directory = running.root / f"tree-{unique}"
        directory.mkdir()
        populate(directory)
        trees.append(remote(running, directory).list())
    status, headers, _ = http_get(f"{older_server.base}/.pdiffcopy/tree/tree-{unique}",
                                  {"Accept": PACKED_LISTING_TYPE})
    assert headers["Content-Type"].startswith("application/json")  # it did not know the packed form
    older, newer = trees
    assert sorted((entry.path, entry.kind, entry.size, entry.target) for entry in older.entries) == sorted(
        (entry.path, entry.kind, entry.size, entry.target) for entry in newer.entries)


# -- packed record headers (tree-read answers, tree-write bodies) -------------------------


def headers_of(stream: bytes):
    """The first byte of each record's header in a treewire stream."""
    position, kinds = 0, []
    while True:
        (length,) = struct.unpack_from(">I", stream, position)
        if length == 0:
            return kinds
        header = stream[position + 4:position + 4 + length]
        kinds.append(header[:1])
        size = json.loads(header)["size"] if header[:1] == b"{" else struct.unpack_from("<q", header, 1)[0]
        position += 4 + length + size + 8


def test_file_records_travel_with_packed_headers_and_decode_as_the_json_ones():
    records = sample_records()
    packed = b"".join(encode_files(records, packed=True))
    assert list(decode_files(io.BytesIO(packed))) == records
    asked = [entry for entry, _, _ in records]
    assert list(decode_files(one_byte_chunks(packed), expected=asked)) == records
    # Files packed; the error record keeps its JSON header, as do entries with extras.
    assert headers_of(packed) == [b"\x01"] * (len(records) - 1) + [b"{"]
    linked = Entry("a", FILE, 1, 5, stat.S_IFREG | 0o644, nlink=2, link="g")
    assert headers_of(b"".join(encode_files([(linked, b"x", "")], packed=True))) == [b"{"]
    assert list(decode_files(io.BytesIO(b"".join(encode_files([(linked, b"x", "")], packed=True))))) == [
        (linked, b"x", "")]


def packed_record(path: bytes, size: int = 1, sparse: int = 0) -> bytes:
    header = struct.pack("<BqqIIIIB", 1, size, 5, stat.S_IFREG | 0o644, 0, 0, 1, sparse) + path
    data = b"x" * max(size, 0)
    return struct.pack(">I", len(header)) + header + data + digest(data) + END_MARKER


@pytest.mark.parametrize("record, error, message", [
    (packed_record(b"../up"), AccessDenied, "outside"),
    (packed_record(b"/abs"), AccessDenied, "outside"),
    (packed_record(b"a//b"), TreeWireError, "empty"),
    (packed_record(b"a\x00b"), TreeWireError, "NUL"),
    (packed_record(b"x", size=-1), TreeWireError, "out of bounds"),
    (packed_record(b"x", sparse=2), TreeWireError, "out of bounds"),
    (packed_record(b""), TreeWireError, "without a path"),
])
def test_a_packed_header_is_checked_as_parse_entry_checks_an_entry(record, error, message):
    with pytest.raises(error, match=message):
        list(decode_files(io.BytesIO(record)))


def test_a_packed_header_too_big_for_a_record_is_refused_before_its_data():
    header = struct.pack("<BqqIIIIB", 1, 2 ** 40, 5, stat.S_IFREG, 0, 0, 1, 0) + b"big"
    with pytest.raises(TreeWireError, match="more than"):
        list(decode_files(io.BytesIO(struct.pack(">I", len(header)) + header)))


def test_a_packed_answer_must_be_the_file_asked_for():
    asked = [Entry("a", FILE, 1, 5, stat.S_IFREG | 0o644)]
    with pytest.raises(TreeWireError, match="not asked for"):
        list(decode_files(io.BytesIO(packed_record(b"b")), expected=asked))
    with pytest.raises(TreeWireError, match="has 2 bytes"):
        list(decode_files(io.BytesIO(packed_record(b"a", size=2)), expected=asked))


def test_the_server_packs_a_read_answer_only_for_a_client_that_asks(server, tree_dir):  # noqa: F811
    contents = populate(tree_dir)
    listing = remote(server, tree_dir).list()
    files = [entry for entry in listing.entries if entry.kind == FILE]
    body = json.dumps({"entries": [entry.to_wire() for entry in files]})
    target = f"/.pdiffcopy/tree-read/{quote_path(tree_dir.name)}"
    answers = {}
    for query in ("", "?packed=1"):
        status, _, answer = raw_request(server.port, "POST", target + query, {"Content-Type": "application/json"},
                                        body)
        assert status == 200
        assert [record[:2] for record in decode_files(io.BytesIO(answer), expected=files)] == [
            (entry, contents[entry.path]) for entry in files]
        answers[query] = headers_of(answer)
    assert set(answers[""]) == {b"{"}  # an older client's answer, as it always was
    assert set(answers["?packed=1"]) == {b"\x01"}


def test_our_client_writes_packed_headers_to_a_server_that_listed_packed(server, tree_dir, monkeypatch):  # noqa: F811
    source = tree_dir / "source"
    source.mkdir()
    contents = populate(source)
    source_tree, target_tree = remote(server, source), remote(server, tree_dir)
    files = [entry for entry in source_tree.list().entries if entry.kind == FILE]
    records = [(entry._replace(path=f"copy-{index}"), data)
               for index, (entry, data, _) in enumerate(source_tree.read_files(files))]
    sent = []
    real = remotetree.encode_files
    monkeypatch.setattr(remotetree, "encode_files",
                        lambda records, packed=False: sent.append(packed) or real(records, packed))
    assert target_tree.write_files(records[:2], MetadataOptions()) == []  # not listed yet: JSON, as ever
    target_tree.list()
    assert target_tree.write_files(records[2:], MetadataOptions(times=True)) == []
    assert sent == [False, True]
    for index, (entry, _) in enumerate(records):
        assert (tree_dir / f"copy-{index}").read_bytes() == contents[files[index].path]
        assert os.stat(tree_dir / f"copy-{index}").st_mtime_ns == entry.mtime_ns or index < 2


def test_an_older_server_gets_json_headers_and_its_answers_are_read(older_server, unique):
    directory = older_server.root / f"rw-{unique}"
    directory.mkdir()
    contents = populate(directory)
    tree = remote(older_server, directory)
    files = [entry for entry in tree.list().entries if entry.kind == FILE]
    got = {entry.path: data for entry, data, _ in tree.read_files(files)}  # it ignores ?packed=1
    assert got == contents
    records = [(entry._replace(path=f"copy-{index}"), got[entry.path]) for index, entry in enumerate(files)]
    assert tree.write_files(records, MetadataOptions(times=True)) == []  # a packed header would be a 400
    assert [(directory / f"copy-{index}").read_bytes() for index in range(len(files))] == [
        got[entry.path] for entry in files]


# -- packed read requests ----------------------------------------------------------------


def read_packed(server, tree_dir, body: bytes):  # noqa: F811
    return raw_request(server.port, "POST", f"/.pdiffcopy/tree-read/{quote_path(tree_dir.name)}?packed=1",
                       {"Content-Type": PACKED_LISTING_TYPE}, body)


def test_a_read_request_may_carry_its_entries_packed(server, tree_dir):  # noqa: F811
    contents = populate(tree_dir)
    files = [entry for entry in remote(server, tree_dir).list().entries if entry.kind == FILE]
    status, _, answer = read_packed(server, tree_dir, encode_batch(files) + packedlisting.END)
    assert status == 200
    assert [(entry, data) for entry, data, _ in decode_files(io.BytesIO(answer), expected=files)] == [
        (entry, contents[entry.path]) for entry in files]


@pytest.mark.parametrize("body, status, message", [
    (encode_batch([Entry("../x", FILE, 1, 1, stat.S_IFREG | 0o644)]) + packedlisting.END, 403, "outside"),
    (encode_batch([Entry("d", DIR, 0, 1, stat.S_IFDIR | 0o755)]) + packedlisting.END, 400, "Not a regular"),
    (encode_batch([Entry("x", FILE, 1, 1, stat.S_IFREG | 0o644)]) + packedlisting.END + b"more", 400,
     "after its end"),
    (encode_batch([Entry("x", FILE, 1, 1, stat.S_IFREG | 0o644)]), 400, "cut short"),
], ids=["leading out", "a directory", "after the end", "no end"])
def test_a_bad_packed_read_request_is_refused_in_one_line(server, tree_dir, body, status, message):  # noqa: F811
    got, headers, answer = read_packed(server, tree_dir, body)
    assert got == status and message in json.loads(answer)["error"]
    assert b"\n" not in answer.strip()


def test_a_packed_read_request_is_bounded(server, tree_dir, monkeypatch):  # noqa: F811
    many = [Entry(f"f{index}", FILE, 0, 1, stat.S_IFREG | 0o644) for index in range(10_001)]
    got, _, answer = read_packed(server, tree_dir, b"".join(packedlisting.encode_batches(many)) + packedlisting.END)
    assert got == 400 and "At most 10000" in json.loads(answer)["error"]


def test_our_client_sends_packed_reads_to_a_server_that_listed_packed(server, tree_dir, monkeypatch):  # noqa: F811
    contents = populate(tree_dir)
    tree = remote(server, tree_dir)
    packed = []
    real = remotetree._packed_batches
    monkeypatch.setattr(remotetree, "_packed_batches", lambda entries: packed.append(len(entries)) or real(entries))
    files = [entry for entry in tree.list().entries if entry.kind == FILE]
    assert {entry.path: data for entry, data, _ in tree.read_files(files)} == contents
    assert packed == [len(files)]


def test_plain_writes_go_in_bodies_of_known_length_within_their_bound(server, tree_dir, monkeypatch):  # noqa: F811
    monkeypatch.setattr(remotetree, "SIZED_WRITE_BYTES", 5000)
    bodies = []
    real = remotetree.HttpClient.request

    def request(client, method, target, *args, body=None, **kwargs):
        if "tree-write" in target:
            bodies.append(body)
        return real(client, method, target, *args, body=body, **kwargs)

    monkeypatch.setattr(remotetree.HttpClient, "request", request)
    records = [(Entry(f"f{index}", FILE, 1500, 7, stat.S_IFREG | 0o644), bytes([index]) * 1500)
               for index in range(10)]
    tree = remote(server, tree_dir)
    tree.list()
    assert tree.write_files(records, MetadataOptions()) == []
    # Bytes (sent with a Content-Length, which the server reads straight from its socket), three
    # files a request, every file whole.
    assert [type(body) for body in bodies] == [bytes] * 4
    assert [len(list(decode_files(io.BytesIO(body)))) for body in bodies] == [3, 3, 3, 1]
    assert [(tree_dir / entry.path).read_bytes() for entry, _ in records] == [data for _, data in records]

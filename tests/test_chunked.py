"""The shift-tolerant delta (``--delta chunks``) through the real server and between local files.

Bytes inserted or removed shift everything after them: fixed blocks then resend the rest
of the file, content-defined chunks only what is new. Every case checks the target ends
byte-identical, and the shifted ones that only a little crossed.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import struct

import pytest

from conftest import random_bytes, run_cli
from pdiffcopy import sync, sync_tree
from pdiffcopy.core.protocol import temporary_name
from pdiffcopy.transport import counters

MIB = 1024 * 1024
SIZE = 8 * MIB


def inserted(data: bytes, positions, length: int, seed: int = 5) -> bytes:
    """``data`` with ``length`` random bytes inserted before each position."""
    rng = random.Random(seed)
    out = bytearray(data)
    for position in sorted(positions, reverse=True):
        out[position:position] = rng.randbytes(length)
    return bytes(out)


OLD = random_bytes(SIZE, seed=21)

#: (name, source, old target, most bytes the sync may send or None for no bound)
CASES = [
    ("insert-near-start", inserted(OLD, [4096], 100), OLD, 64 * 1024),
    ("delete-near-start", OLD[:5000] + OLD[5100:], OLD, 64 * 1024),
    ("insert-every-mib", inserted(OLD, range(MIB, SIZE, MIB), 1), OLD, 7 * 32 * 1024),
    ("appended", OLD + random_bytes(10_000, seed=22), OLD, 64 * 1024),
    ("cut-short", OLD[: SIZE // 2], OLD, 16 * 1024),  # its last chunk ends early: sent
    ("prepended-and-moved", OLD[SIZE // 2:] + b"header" + OLD[: SIZE // 2], OLD, 64 * 1024),
    ("completely-different", random_bytes(SIZE // 4, seed=23), OLD, None),
    ("empty-target", random_bytes(100_000, seed=24), b"", None),
    ("missing-target", random_bytes(100_000, seed=25), None, None),
    ("tiny", b"\x42", b"\x41", None),
    ("empty-source", b"", b"old", None),
    ("identical", OLD, OLD, 0),
]


def arrange(direction, server, tmp_path, unique, source_data, target_data):
    """Write the source and (unless None) the old target; return (SOURCE, TARGET, target path)."""
    if direction == "local":
        source, target = tmp_path / "source.img", tmp_path / "target.img"
        args = (str(source), str(target))
    elif direction == "pull":
        source, target = server.root / unique, tmp_path / "target.img"
        args = (server.url(unique), str(target))
    else:
        source, target = tmp_path / "source.img", server.root / unique
        args = (str(source), server.url(unique))
    source.write_bytes(source_data)
    if target_data is not None:
        target.write_bytes(target_data)
    return args[0], args[1], target


def leftovers(target) -> list:
    prefix = f".{target.name}.pdiffcopy-"
    return [p.name for p in target.parent.iterdir() if p.name.startswith(prefix)]


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
@pytest.mark.parametrize("name,source_data,target_data,most", CASES, ids=[c[0] for c in CASES])
def test_chunks_make_the_target_identical_and_send_little(server, tmp_path, unique, direction, name,
                                                         source_data, target_data, most):
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, target_data)
    result = sync(source, target, delta="chunks", concurrency=2)
    assert path.read_bytes() == source_data
    assert result.verified and result.size == len(source_data)
    assert leftovers(path) == []
    if most is not None:
        assert result.bytes_moved <= most
    else:
        assert result.bytes_moved <= len(source_data)


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_an_insertion_near_the_start_moves_far_less_than_blocks_would(server, tmp_path, unique, direction):
    source_data = inserted(OLD, [4096], 100)
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, OLD)
    blocks = sync(source, target, dry_run=True, delta="blocks")
    chunks = sync(source, target, delta="chunks")
    assert path.read_bytes() == source_data
    # The fixed blocks after the insertion all moved by 100 bytes: every one differs.
    assert blocks.bytes_moved >= len(source_data) - 1024 * 1024
    assert 100 <= chunks.bytes_moved <= 16 * 1024
    assert chunks.similarity > 99.8


def test_a_dry_run_reports_what_chunks_would_send_and_changes_nothing(tmp_path):
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    source.write_bytes(inserted(OLD, [4096], 100))
    target.write_bytes(OLD)
    result = sync(str(source), str(target), delta="chunks", dry_run=True)
    assert result.dry_run and not result.verified
    assert 100 <= result.bytes_moved <= 16 * 1024
    assert target.read_bytes() == OLD
    assert leftovers(target) == []


def test_the_command_line_takes_delta_chunks_and_reports_the_bytes(server, tmp_path, unique):
    (server.root / unique).write_bytes(inserted(OLD, [4096], 100))
    target = tmp_path / "target.img"
    target.write_bytes(OLD)
    done = run_cli("--delta", "chunks", "--stats", server.url(unique), str(target))
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == (server.root / unique).read_bytes()
    found = re.search(r"moved (\d+) bytes, (\d+) bytes sent and (\d+) bytes received on the wire", done.stdout)
    assert found, done.stdout
    moved, sent, received = map(int, found.groups())
    assert 100 <= moved <= 16 * 1024
    # Everything on the wire, the chunk list and the digests included: a small part of the 8 MiB.
    assert sent + received <= 128 * 1024


def test_an_unknown_delta_mode_is_a_one_line_usage_error(tmp_path):
    (tmp_path / "a").write_bytes(b"a")
    done = run_cli("--delta", "rolling", str(tmp_path / "a"), str(tmp_path / "b"))
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1 and "--delta" in done.stderr
    assert not (tmp_path / "b").exists()
    with pytest.raises(Exception, match="Invalid delta mode"):
        sync(str(tmp_path / "a"), str(tmp_path / "b"), delta="rolling")


def test_trees_send_only_what_is_new_in_their_big_files(ends):
    big = inserted(OLD, [4096, SIZE // 2], 100)
    (ends.source / "sub").mkdir(parents=True, exist_ok=True)
    (ends.target / "sub").mkdir(parents=True, exist_ok=True)
    (ends.source / "sub" / "big.img").write_bytes(big)
    (ends.target / "sub" / "big.img").write_bytes(OLD)
    (ends.source / "small.txt").write_bytes(b"small")
    result = sync_tree(ends.source_arg(), ends.target_arg, delta="chunks", concurrency=2)
    assert result.failures == []
    assert (ends.target / "sub" / "big.img").read_bytes() == big
    assert (ends.target / "small.txt").read_bytes() == b"small"
    assert result.bytes_moved <= 64 * 1024
    assert leftovers(ends.target / "sub" / "big.img") == []


# -- the server's new operations refuse what they must ------------------------------


def post(server, target: str, body: bytes = b"", headers=None):
    """POST ``body`` to the server; return (status, parsed JSON or the raw body)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("POST", target, body=body,
                           headers={"Content-Length": str(len(body)), **(headers or {})})
        response = connection.getresponse()
        data = response.read()
        if response.headers.get("Content-Type", "").startswith("application/json"):
            return response.status, json.loads(data)
        return response.status, data
    finally:
        connection.close()


def ranges(*pairs) -> bytes:
    return b"".join(struct.pack("<QQ", offset, length) for offset, length in pairs)


def moves(*triples) -> bytes:
    return b"".join(struct.pack("<QQQ", *triple) for triple in triples)


def test_the_chunk_list_of_a_whole_file_and_of_ranges(server, unique):
    from pdiffcopy.core import chunks

    data = random_bytes(300_000, seed=31)
    (server.root / unique).write_bytes(data)
    status, body = post(server, f"/.pdiffcopy/chunks/{unique}?average=4096")
    assert status == 200
    assert chunks.decode(body) == chunks.cut(data, average=4096)
    status, body = post(server, f"/.pdiffcopy/chunks/{unique}?average=4096", ranges((10, 5000), (9000, 100_000)))
    assert status == 200
    assert chunks.decode_ranges(body, [(10, 5000), (9000, 100_000)]) == \
        chunks.cut(data[10:5010], 10, 4096) + chunks.cut(data[9000:109_000], 9000, 4096)


@pytest.mark.parametrize("query,body,status", [
    ("average=4096", ranges((0, 1), (2_000_000, 5)), 416),
    ("average=4096", ranges((0, 100), (50, 100)), 400),
    ("average=4096", ranges((500, 10), (0, 10)), 400),
    ("average=4096", ranges((0, 0)), 400),
    ("average=4096", b"\0" * 17, 400),
    ("average=4096", b"\0" * 16 * 70_000, 413),
    ("average=1", b"", 400),
    ("average=999999999", b"", 400),
    ("", b"", 400),
], ids=["past-the-end", "overlapping", "out-of-order", "empty", "not-whole-entries", "too-many-ranges",
        "tiny-average", "huge-average", "no-average"])
def test_bad_chunk_list_requests_get_a_clear_4xx(server, unique, query, body, status):
    (server.root / unique).write_bytes(random_bytes(100_000, seed=32))
    got, answer = post(server, f"/.pdiffcopy/chunks/{unique}?{query}", body)
    assert got == status
    assert isinstance(answer, dict) and answer["error"] and "\n" not in answer["error"]


@pytest.mark.parametrize("path", ["../outside.img", "/etc/passwd", "sub/../../outside.img"])
def test_chunk_lists_and_copies_stay_inside_the_root(server, unique, path):
    (server.root / unique).write_bytes(random_bytes(1000, seed=36))
    got, _ = post(server, f"/.pdiffcopy/chunks/{path}?average=4096")
    assert 400 <= got < 500
    temporary = temporary_name(unique)
    (server.root / temporary).write_bytes(bytes(1000))
    try:
        # The same requests inside the root are answered: the refusals are about the paths.
        assert post(server, f"/.pdiffcopy/chunks/{unique}?average=4096")[0] == 200
        assert post(server, f"/.pdiffcopy/copy-ranges/{temporary}?from={unique}", moves((0, 0, 10)))[0] == 200
        (server.root / temporary).write_bytes(bytes(1000))
        got, _ = post(server, f"/.pdiffcopy/copy-ranges/{temporary}?from={path}", moves((0, 0, 10)))
        assert 400 <= got < 500
        assert (server.root / temporary).read_bytes() == bytes(1000)
    finally:
        (server.root / temporary).unlink()


@pytest.mark.parametrize("body,status", [
    (moves((0, 0, 100), (50, 50, 100)), 400),
    (moves((0, 0, 0)), 400),
    (moves((9_990, 0, 100)), 416),
    (moves((0, 990, 100)), 416),  # a copy never grows the temporary
    (moves((0, 0, 1 << 62)), 416),
    (moves(*[(0, n * 2, 1) for n in range(500)]) + b"\0" * 24 * 16_000, 413),
    (b"\0" * 25, 400),
], ids=["overlapping-writes", "empty", "past-the-origin", "past-the-temporary", "huge", "too-many-moves",
        "not-whole-entries"])
def test_bad_copy_requests_get_a_clear_4xx_and_write_nothing(server, unique, body, status):
    (server.root / unique).write_bytes(random_bytes(10_000, seed=33))
    temporary = temporary_name(unique)
    (server.root / temporary).write_bytes(bytes(1000))
    try:
        got, answer = post(server, f"/.pdiffcopy/copy-ranges/{temporary}?from={unique}", body)
        assert got == status
        assert isinstance(answer, dict) and "\n" not in answer["error"]
        assert (server.root / temporary).read_bytes() == bytes(1000)
    finally:
        (server.root / temporary).unlink()


def test_copies_go_only_into_temporaries(server, unique):
    data = random_bytes(10_000, seed=34)
    (server.root / unique).write_bytes(data)
    (server.root / f"other-{unique}").write_bytes(bytes(1000))
    got, answer = post(server, f"/.pdiffcopy/copy-ranges/other-{unique}?from={unique}", moves((0, 0, 100)))
    assert got == 403 and "temporary" in answer["error"]
    assert (server.root / f"other-{unique}").read_bytes() == bytes(1000)


def test_a_copy_request_copies_to_other_offsets(server, unique):
    data = random_bytes(10_000, seed=35)
    (server.root / unique).write_bytes(data)
    temporary = temporary_name(unique)
    (server.root / temporary).write_bytes(bytes(1000))
    try:
        got, answer = post(server, f"/.pdiffcopy/copy-ranges/{temporary}?from={unique}",
                           moves((5000, 0, 100), (0, 900, 100)))
        assert got == 200 and answer["copied"] == 200
        written = (server.root / temporary).read_bytes()
        assert written[:100] == data[5000:5100] and written[900:] == data[:100]
        assert written[100:900] == bytes(800)
    finally:
        (server.root / temporary).unlink()


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
@pytest.mark.parametrize("source_data", [inserted(OLD, [4096], 100), random_bytes(20_000, seed=37)],
                         ids=["shifted", "nothing-in-common"])
def test_the_new_version_keeps_the_old_ones_mode(server, tmp_path, unique, direction, source_data):
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, OLD)
    path.chmod(0o640)
    sync(source, target, delta="chunks")
    assert path.read_bytes() == source_data
    assert path.stat().st_mode & 0o7777 == 0o640


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_an_identical_target_is_verified_where_it_is_not_rewritten(server, tmp_path, unique, direction):
    source, target, path = arrange(direction, server, tmp_path, unique, OLD, OLD)
    before = path.stat()
    result = sync(source, target, delta="chunks")
    assert result.verified and result.bytes_moved == 0 and result.similarity == 100.0
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_chunk_lists_give_their_hash_slots_back(server, unique):
    # More requests, one after another, than a worker process has hash slots: a slot kept
    # after an answer would make the later ones wait and then fail with 503.
    (server.root / unique).write_bytes(random_bytes(10_000, seed=38))
    for _ in range(12):
        status, _ = post(server, f"/.pdiffcopy/chunks/{unique}?average=4096")
        assert status == 200


def test_the_command_line_takes_delta_chunks_for_trees(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    big = inserted(OLD, [4096], 100)
    (source / "big.img").write_bytes(big)
    (target / "big.img").write_bytes(OLD)
    done = run_cli("--delta", "chunks", "--stats", f"{source}/", str(target))
    assert done.returncode == 0, done.stderr
    assert (target / "big.img").read_bytes() == big
    found = re.search(r"moved (\d+) bytes in 1 file", done.stdout)
    assert found and 100 <= int(found.group(1)) <= 16 * 1024, done.stdout


# -- copies started while both sides cut -------------------------------------------------------


@pytest.fixture
def small_pieces(monkeypatch):
    """Cut in 1 MiB pieces and start copies per 512 KiB, so that 8 MiB files take the early path."""
    from pdiffcopy.engine import chunkdelta

    monkeypatch.setattr(chunkdelta, "CUT_PIECE_BYTES", MIB)
    monkeypatch.setattr(chunkdelta, "EARLY_COPY_BATCH_BYTES", MIB // 2)


def copied_while_planning(records) -> int:
    for record in records:
        found = re.search(r"(\d+) bytes copied while planning", record.getMessage())
        if found:
            return int(found.group(1))
    raise AssertionError("no planning line was logged")


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
@pytest.mark.parametrize("name,source_data,most", [
    ("insert-near-start", inserted(OLD, [4096], 100), 64 * 1024),
    ("insert-every-mib", inserted(OLD, range(MIB, SIZE, MIB), 1), 7 * 32 * 1024),
    ("prepended-and-moved", OLD[SIZE // 2:] + b"header" + OLD[: SIZE // 2], 64 * 1024),
    ("cut-short", OLD[: SIZE // 2], 16 * 1024),
], ids=["insert-near-start", "insert-every-mib", "prepended-and-moved", "cut-short"])
def test_copies_start_while_both_sides_cut_and_the_result_is_the_same(
        server, tmp_path, unique, direction, name, source_data, most, small_pieces, caplog):
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, OLD)
    with caplog.at_level("DEBUG", logger="pdiffcopy.engine.filejob"):
        result = sync(source, target, delta="chunks", concurrency=2)
    assert path.read_bytes() == source_data
    assert result.verified and result.bytes_moved <= most
    assert leftovers(path) == []
    # Most of the file was copied before the plan was complete, none of it twice (the
    # file is right, and a second copy over an early one would not show: the bound is the file).
    early = copied_while_planning(caplog.records)
    assert len(source_data) // 2 <= early <= len(source_data)


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_an_identical_target_starts_no_copies_and_is_not_rewritten(server, tmp_path, unique, direction,
                                                                  small_pieces, caplog):
    source, target, path = arrange(direction, server, tmp_path, unique, OLD, OLD)
    before = path.stat()
    with caplog.at_level("DEBUG", logger="pdiffcopy.engine.filejob"):
        result = sync(source, target, delta="chunks")
    assert result.verified and result.bytes_moved == 0
    assert copied_while_planning(caplog.records) == 0
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert leftovers(path) == []


@pytest.mark.parametrize("direction", ["local", "pull"])
def test_cutting_a_piece_at_a_time_gives_the_chunks_of_one_whole_cut(server, tmp_path, unique, direction):
    from pdiffcopy.api import file_endpoint
    from pdiffcopy.core import chunks
    from pdiffcopy.engine.chunkdelta import cut_pieces

    data = inserted(OLD, [4096], 100)
    source, _, _ = arrange(direction, server, tmp_path, unique, data, None)
    endpoint = file_endpoint(source, token=server.token)
    try:
        pieces = list(cut_pieces(endpoint, len(data), 4096, piece=64 * 1024))
    finally:
        endpoint.close()
    assert len(pieces) > 100
    assert [chunk for piece in pieces for chunk in piece] == chunks.cut(data, average=4096)


def test_the_copies_left_after_early_ones_are_the_plans_copies_less_those():
    from pdiffcopy.core.chunks import Copy
    from pdiffcopy.engine.chunkdelta import not_copied

    plan = [Copy(0, 0, 100), Copy(150, 250, 300), Copy(500, 1000, 50)]
    started = [Copy(150, 250, 100), Copy(300, 400, 50), Copy(0, 0, 100)]
    assert not_copied(plan, started) == [Copy(250, 350, 50), Copy(350, 450, 100), Copy(500, 1000, 50)]
    assert not_copied(plan, []) == plan
    assert not_copied(plan, plan) == []
    with pytest.raises(ValueError):
        not_copied(plan, [Copy(120, 120, 10)])  # not within any of the plan's copies


@pytest.mark.parametrize("direction", ["local", "pull", "push"])
def test_a_sparse_source_keeps_its_hole_when_copies_start_early(server, tmp_path, unique, direction, small_pieces,
                                                                caplog):
    hole = 2 * MIB
    data = inserted(OLD, [4096], 100)
    source_data = data[:3 * MIB] + bytes(hole) + data[3 * MIB + hole:]
    source, target, path = arrange(direction, server, tmp_path, unique, b"", OLD)
    source_path = tmp_path / "source.img" if direction != "pull" else server.root / unique
    with open(source_path, "r+b") as file:  # data, a hole, data: sparse
        file.write(source_data[:3 * MIB])
        file.seek(3 * MIB + hole)
        file.write(source_data[3 * MIB + hole:])
    assert source_path.stat().st_blocks * 512 <= len(source_data) - hole + 64 * 1024
    with caplog.at_level("DEBUG", logger="pdiffcopy.engine.filejob"):
        result = sync(source, target, delta="chunks")
    assert copied_while_planning(caplog.records) > 0
    assert result.verified and path.read_bytes() == source_data
    assert result.bytes_moved <= 64 * 1024
    assert path.stat().st_blocks * 512 <= len(source_data) - hole + 64 * 1024
    assert leftovers(path) == []


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_one_byte_every_mebibyte_costs_far_less_than_a_fine_list_of_the_changed_chunks(
        server, tmp_path, unique, direction):
    # 63 one-byte insertions in 64 MiB (issue 23's shift-every, scaled down). Going from the
    # 64 KiB pass straight to 1 KiB chunks put about 96 KiB of fine list and 107 KiB of data on
    # the wire; passes 8 times finer each list only what the one before left, and end at 256 bytes.
    old = random_bytes(64 * MIB, seed=26)
    source_data = inserted(old, range(MIB, 64 * MIB, MIB), 1)
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, old)
    before = counters.totals()
    result = sync(source, target, delta="chunks", concurrency=2)
    on_the_wire = sum(counters.totals()) - sum(before)
    assert path.read_bytes() == source_data and result.verified
    assert result.bytes_moved <= 63 * 640
    assert on_the_wire <= 100 * 1024, on_the_wire


@pytest.mark.parametrize("direction, change", [("pull", "inserted"), ("push", "removed")])
def test_data_only_one_side_has_is_not_listed_in_chunks_under_a_kibibyte(server, tmp_path, unique, direction, change):
    # 2 MiB that only one side has, and 63 one-byte insertions around it. The insertions need
    # the finest pass (256 bytes); the 2 MiB, where no pass finds anything, would cost 96 KiB of
    # list in it (12 bytes per 256) and is left out: it costs its 8 KiB and 1 KiB passes' lists
    # (3 and 24 KiB). The list that crosses is the server's: the source's in a pull, the old
    # target's in a push. Main's single 1 KiB pass put about 230 KiB beside the 2 MiB.
    shared = random_bytes(64 * MIB, seed=27)
    only_one_side = shared[:30 * MIB] + random_bytes(2 * MIB, seed=28) + shared[30 * MIB:]
    source_data, old = (only_one_side, shared) if change == "inserted" else (shared, only_one_side)
    source_data = inserted(source_data, range(MIB, len(source_data), MIB), 1)
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, old)
    before = counters.totals()
    result = sync(source, target, delta="chunks", concurrency=2, compress="never")
    on_the_wire = sum(counters.totals()) - sum(before)
    assert path.read_bytes() == source_data and result.verified
    extra = len(only_one_side) - len(shared) if change == "inserted" else 0
    assert on_the_wire - extra <= 140 * 1024, on_the_wire - extra


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_edits_a_few_kibibytes_apart_are_found_between_by_the_kibibyte_passes(server, tmp_path, unique, direction):
    # A byte inserted every 6 KiB over 4 MiB (a dump where many rows changed): no 8 KiB chunk
    # there survives, so the range is long after that pass, yet 1 KiB chunks find most of it.
    old = random_bytes(16 * MIB, seed=29)
    source_data = inserted(old, range(8 * MIB, 12 * MIB, 6 * 1024), 1)
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, old)
    result = sync(source, target, delta="chunks", concurrency=2)
    assert path.read_bytes() == source_data and result.verified
    # Main's single 1 KiB pass sent 1.1 MiB here, 8 times finer passes without it 2.7 MiB.
    assert result.bytes_moved <= MIB, result.bytes_moved


@pytest.fixture
def watched_flush(monkeypatch):
    """Make the temporary's flush wait (up to 10 s) for its read-back to start; record whether it did."""
    import threading

    from pdiffcopy.local.localfile import LocalFile

    read_back = threading.Event()
    overlapped: list = []
    submit_hashes, flush = LocalFile.submit_hashes, LocalFile.flush

    def watching_submit(self, ranges, block_size, method):
        if self.temporary:
            read_back.set()
        return submit_hashes(self, ranges, block_size, method)

    def waiting_flush(self):
        if self.temporary:
            overlapped.append(read_back.wait(10))
        flush(self)

    monkeypatch.setattr(LocalFile, "submit_hashes", watching_submit)
    monkeypatch.setattr(LocalFile, "flush", waiting_flush)
    return overlapped


@pytest.mark.parametrize("direction", ["local", "pull"])
def test_the_new_version_is_read_back_while_it_is_flushed(server, tmp_path, unique, direction, watched_flush):
    source_data = inserted(OLD, [4096], 100)
    source, target, path = arrange(direction, server, tmp_path, unique, source_data, OLD)
    result = sync(source, target, delta="chunks", concurrency=2)
    assert path.read_bytes() == source_data and result.verified
    assert watched_flush == [True]  # the read-back started before the fsync returned
    assert leftovers(path) == []


@pytest.mark.parametrize("direction", ["local", "pull"])
def test_a_failed_flush_during_the_read_back_fails_the_sync_and_keeps_the_old_target(
        server, tmp_path, unique, direction, monkeypatch):
    from pdiffcopy.errors import StorageError
    from pdiffcopy.local.localfile import LocalFile

    flush = LocalFile.flush

    def failing_flush(self):
        if self.temporary:
            raise StorageError(f"Cannot flush {self.path}: No space left on device")
        flush(self)

    monkeypatch.setattr(LocalFile, "flush", failing_flush)
    source, target, path = arrange(direction, server, tmp_path, unique, inserted(OLD, [4096], 100), OLD)
    with pytest.raises(StorageError, match="Cannot flush"):
        sync(source, target, delta="chunks", concurrency=2)
    assert path.read_bytes() == OLD
    assert leftovers(path) == []

"""The shift-tolerant delta's plan: content-defined chunks rebuild the source exactly, and an
insertion costs a chunk or two of data, not the rest of the file."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdiffcopy.core import chunks

pytest.importorskip("pyfastcdc")

AVERAGE = 4096


def rebuild(steps, old: bytes, source: bytes) -> bytes:
    """What the writing side builds: copies from its old target, sent bytes from the source."""
    parts = []
    for step in steps:
        if isinstance(step, chunks.Copy):
            parts.append(old[step.target_offset:step.target_offset + step.length])
        else:
            parts.append(source[step.source_offset:step.source_offset + step.length])
    return b"".join(parts)


def delta(old: bytes, new: bytes):
    return chunks.plan(chunks.cut(new, average=AVERAGE), chunks.index(chunks.cut(old, average=AVERAGE)))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(0, 300_000),
       edits=st.lists(st.tuples(st.sampled_from(["insert", "delete", "overwrite"]), st.floats(0, 1),
                                st.integers(1, 5000)), max_size=6))
def test_the_plan_rebuilds_the_source_exactly(seed, size, edits):
    rng = random.Random(seed)
    old = rng.randbytes(size)
    new = bytearray(old)
    for kind, where, count in edits:
        position = int(where * len(new))
        if kind == "insert":
            new[position:position] = rng.randbytes(count)
        elif kind == "delete":
            del new[position:position + count]
        else:
            new[position:position + count] = rng.randbytes(len(new[position:position + count]))
    new = bytes(new)
    steps = delta(old, new)
    assert rebuild(steps, old, new) == new
    # The steps cover the source once, in order.
    assert sum(step.length for step in steps) == len(new)


def test_an_insertion_near_the_start_costs_a_chunk_or_two():
    rng = random.Random(1)
    old = rng.randbytes(4 << 20)
    new = old[:4096] + rng.randbytes(100) + old[4096:]
    sent = chunks.bytes_to_send(delta(old, new))
    assert 100 <= sent <= 2 * AVERAGE * chunks.MAX_FACTOR
    # A fixed-block comparison would have resent everything after the insertion.
    assert sent < len(new) / 100


def test_one_byte_every_megabyte_costs_a_chunk_or_two_each():
    rng = random.Random(2)
    old = rng.randbytes(8 << 20)
    new = bytearray(old)
    for position in reversed(range(1 << 20, len(old), 1 << 20)):
        new[position:position] = b"x"
    sent = chunks.bytes_to_send(delta(old, bytes(new)))
    assert sent <= 7 * 2 * AVERAGE * chunks.MAX_FACTOR


def test_the_chunk_list_survives_the_wire():
    data = random.Random(3).randbytes(200_000)
    cut = chunks.cut(data, offset=1000, average=AVERAGE)
    assert chunks.decode(chunks.encode(cut), offset=1000) == cut
    assert len(chunks.encode(cut)) == 12 * len(cut)


@pytest.mark.parametrize("payload, message", [(b"x" * 13, "whole number"), (b"\0" * 12, "empty chunk")])
def test_a_damaged_chunk_list_is_refused(payload, message):
    with pytest.raises(ValueError, match=message):
        chunks.decode(payload)


@pytest.mark.parametrize("size, average", [
    (0, 64 * 1024), (1, 64 * 1024), (256 << 20, 64 * 1024), (512 << 20, 64 * 1024),
    (1 << 30, 128 * 1024), (2 << 30, 128 * 1024), (4 << 30, 256 * 1024), (1 << 50, chunks.MAX_AVERAGE),
])
def test_the_first_pass_average_grows_with_big_files(size, average):
    # The whole file's list crosses the link: 12 bytes a chunk, 157 KiB for 1 GiB at 64 KiB.
    assert chunks.coarse_average(size) == average


def test_one_byte_every_two_megabytes_costs_about_one_and_a_half_fine_chunks_each():
    sent = changes = 0
    for seed in range(3, 8):
        rng = random.Random(seed)
        old = rng.randbytes(16 << 20)
        new = bytearray(old)
        positions = range(2 << 20, len(old), 2 << 20)
        for position in reversed(positions):
            new[position:position] = b"x"
        new = bytes(new)
        steps = chunks.plan(chunks.cut(new), chunks.index(chunks.cut(old)))
        sends, gaps = chunks.sends(steps), chunks.target_gaps(steps, len(old))
        fine_new = [c for o, n in sends for c in chunks.cut(memoryview(new)[o:o + n], o, chunks.FINE_AVERAGE)]
        fine_old = [c for o, n in gaps for c in chunks.cut(memoryview(old)[o:o + n], o, chunks.FINE_AVERAGE)]
        refined = chunks.refine(steps, chunks.plan(fine_new, chunks.index(fine_old)))
        assert rebuild(refined, old, new) == new
        sent += chunks.bytes_to_send(refined)
        changes += len(positions)
    # 2 KiB fine chunks sent about 3.3 KiB a change here; 1 KiB chunks about 1.9 KiB.
    assert sent <= changes * 2560


@pytest.mark.parametrize("coarse, averages", [
    (128 * 1024, [16384, 2048, 256]), (64 * 1024, [8192, 1024, 256]), (4 << 20, [524288, 65536, 8192, 1024, 256]),
    (256, []),
])
def test_each_refining_pass_is_eight_times_finer_down_to_the_finest(coarse, averages):
    assert chunks.refining_averages(coarse) == averages


def test_a_send_the_finer_pass_left_out_stays_a_send():
    steps = [chunks.Copy(0, 0, 100), chunks.Send(100, 50), chunks.Copy(150, 150, 100), chunks.Send(250, 30)]
    finer = [chunks.Copy(250, 400, 10), chunks.Send(260, 20)]  # only the second send was cut again
    assert chunks.refine(steps, finer) == [chunks.Copy(0, 0, 100), chunks.Send(100, 50), chunks.Copy(150, 150, 100),
                                           chunks.Copy(250, 400, 10), chunks.Send(260, 20)]


def test_a_file_is_cut_window_by_window_into_the_chunks_of_the_whole(tmp_path, monkeypatch):
    """The file adapters cut a mapped window at a time; a chunk a window's end cut short is cut
    again from the next window, so both sides list the chunks of the whole range, as one cut of
    all its bytes would (and as an older peer's stream cut does)."""
    import os

    from pdiffcopy.local import filehash

    monkeypatch.setattr(filehash, "CUT_WINDOW_BYTES", 64 * 1024)  # 16 chunks of 4 KiB a window
    data = random.Random(7).randbytes(1_000_003)
    path = tmp_path / "file"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        windows = list(filehash.cut_region(fd, 0, len(data), AVERAGE))
        assert len(windows) > 10
        assert [c for window in windows for c in window] == chunks.cut(data, 0, AVERAGE)
        # A range that starts and ends inside the file: chunks at the file's offsets.
        inside = [c for window in filehash.cut_region(fd, 123_457, 600_000, AVERAGE) for c in window]
        assert inside == chunks.cut(data[123_457:723_457], 123_457, AVERAGE)
        # The range reaches past the end: the file became shorter.
        with pytest.raises(EOFError):
            list(filehash.cut_region(fd, 900_000, 200_000, AVERAGE))
    finally:
        os.close(fd)


def test_a_hole_is_cut_as_the_zeros_it_reads(tmp_path):
    import os

    from pdiffcopy.local import filehash

    path = tmp_path / "sparse"
    with open(path, "wb") as handle:
        handle.write(b"x" * 5000)
        handle.seek(300_000)
        handle.write(random.Random(3).randbytes(50_000))
    data = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert [c for w in filehash.cut_region(fd, 0, len(data), AVERAGE) for c in w] == chunks.cut(data, 0, AVERAGE)
    finally:
        os.close(fd)


def test_a_file_that_cannot_be_mapped_is_read_and_cut_the_same(tmp_path, monkeypatch):
    """Some file systems refuse mmap (FUSE ones may): the window is read instead, same chunks."""
    import os

    from pdiffcopy.local import filehash

    def refuse(fd, offset, length):
        raise OSError(19, "No such device")

    monkeypatch.setattr(filehash, "_map", refuse)
    monkeypatch.setattr(filehash, "CUT_WINDOW_BYTES", 64 * 1024)
    data = random.Random(11).randbytes(300_001)
    path = tmp_path / "file"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert [c for w in filehash.cut_region(fd, 0, len(data), AVERAGE) for c in w] == chunks.cut(data, 0, AVERAGE)
    finally:
        os.close(fd)

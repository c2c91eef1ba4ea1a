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

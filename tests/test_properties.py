"""Property tests: a sync always ends with identical files, and the pure core keeps its promises.

Hypothesis draws source sizes, block sizes and ways to damage the target
(overwritten bytes, truncation, extension, a missing or unrelated file) and
checks that every sync, local or through the real server in either direction,
leaves the target byte-identical to the source, reports what it did
truthfully, and leaves nothing behind. The second half checks the pure
functions of pdiffcopy/core/blocks.py and pdiffcopy/core/byteranges.py against simple
reference implementations.
"""

from __future__ import annotations

import io
import itertools
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdiffcopy import sync
from pdiffcopy.core.blocks import (
    BlockPlan,
    Similarity,
    batch_ranges,
    changed_blocks,
    coalesce,
    parse_block_size,
    split_digests,
    split_ranges,
)
from pdiffcopy.core.byteranges import (
    boundary_of,
    closing_delimiter,
    format_content_range,
    format_range_header,
    merge_ranges,
    multipart_content_type,
    multipart_length,
    new_boundary,
    parse_content_range,
    parse_range_header,
    part_header,
    read_parts,
)
from pdiffcopy.core.refine import resolve_piece_size
from pdiffcopy.errors import BadRequest, RangeNotSatisfiable, UsageError

# -- the sync, end to end ---------------------------------------------------------------

MAX_SOURCE = 300 * 1024

#: Powers of two and awkward sizes that do not divide anything nicely.
BLOCK_SIZES = st.one_of(
    st.sampled_from([1024, 2048, 4096, 8192, 16384, 32768, 65536]),
    st.sampled_from([1025, 1536, 3000, 5000, 7777, 12345, 65535]),
    st.integers(1024, 65536),
)

SIZES = st.one_of(
    st.integers(0, MAX_SOURCE),
    st.integers(MAX_SOURCE // 4, MAX_SOURCE),  # many blocks, room for many separate changes
    st.integers(MAX_SOURCE // 4, MAX_SOURCE),
    st.sampled_from([0, 1, 1023, 1024, 1025, 4096, 5000, 65536, 65537, MAX_SOURCE]),
)

FRACTION = st.integers(0, 1000).map(lambda n: n / 1000)

#: Changes of the target's length, applied first.
RESIZES = st.one_of(
    st.just(("keep",)),
    st.tuples(st.just("truncate"), FRACTION),
    st.tuples(st.just("extend"), st.integers(1, 70000)),
)

#: Edits of the target's bytes, applied after the resize.
EDITS = st.one_of(
    st.tuples(st.just("scatter"), st.integers(1, 30)),  # that many overwrites, anywhere
    st.tuples(st.just("overwrite"), FRACTION, st.integers(1, 5000)),
    st.tuples(st.just("zero"), FRACTION, st.integers(1, 70000)),  # a partly sparse target
    # Bytes inserted or removed: everything after them shifts (what --delta chunks is for).
    st.tuples(st.just("insert"), FRACTION, st.integers(1, 5000)),
    st.tuples(st.just("delete"), FRACTION, st.integers(1, 5000)),
)

#: How the target starts out: mostly an older copy of the source with damage here and
#: there (several separate changed runs, so that the delta has many ranges).
TARGET_KINDS = st.sampled_from(["mutated"] * 6 + ["missing", "unrelated", "empty", "identical"])

SYNC_SETTINGS = settings(max_examples=25, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                HealthCheck.too_slow])


def build_target(source: bytes, kind: str, mutations, seed: int) -> Optional[bytes]:
    """The target's old contents (None for a missing target)."""
    rng = random.Random(seed)
    if kind == "missing":
        return None
    if kind == "empty":
        return b""
    if kind == "identical":
        return source
    if kind == "unrelated":
        return rng.randbytes(rng.randrange(0, MAX_SOURCE))
    resize, edits = mutations
    buffer = bytearray(source)
    if resize[0] == "truncate":
        del buffer[int(resize[1] * len(buffer)) :]
    elif resize[0] == "extend":
        buffer += rng.randbytes(resize[1])
    for edit in edits:
        if edit[0] == "scatter":
            for _ in range(edit[1]):
                position = rng.randrange(len(buffer) + 1)
                end = min(len(buffer), position + rng.randrange(1, 3000))
                buffer[position:end] = rng.randbytes(end - position)
        elif edit[0] in ("insert", "delete"):
            _, where, length = edit
            position = int(where * len(buffer))
            if edit[0] == "insert":
                buffer[position:position] = rng.randbytes(length)
            else:
                del buffer[position:position + length]
        else:
            _, where, length = edit
            position = int(where * len(buffer))
            end = min(len(buffer), position + length)
            buffer[position:end] = rng.randbytes(end - position) if edit[0] == "overwrite" \
                else bytes(end - position)
    return bytes(buffer)


def refined_bytes(source: bytes, target: bytes, block_size: int, piece_size: int) -> int:
    """What a refined sync moves (a reference for pdiffcopy/core/refine.py on files under its probe).

    Each run of changed blocks (against the target cut or zero-padded to the source's
    size, as the target is when its pieces are hashed) moves its differing pieces, or
    the whole run when those cover more than three quarters of it.
    """
    target = target[: len(source)] + bytes(max(0, len(source) - len(target)))
    changed = differing_blocks(source, target, block_size, pad=True)
    runs: List[List[int]] = []
    for block in changed:
        if runs and runs[-1][-1] == block - 1:
            runs[-1].append(block)
        else:
            runs.append([block])
    moved = 0
    for run in runs:
        start, end = run[0] * block_size, min(len(source), (run[-1] + 1) * block_size)
        differ = sum(min(piece_size, end - offset) for offset in range(start, end, piece_size)
                     if source[offset:offset + piece_size] != target[offset:offset + piece_size])
        moved += end - start if differ > 0.75 * (end - start) else differ
    return moved


def block_lengths(size: int, block_size: int) -> List[int]:
    return [min(block_size, size - offset) for offset in range(0, size, block_size)]


def differing_blocks(source: bytes, target: bytes, block_size: int, pad: bool) -> List[int]:
    """Blocks where ``target`` differs from ``source``.

    ``pad``: compare against the target cut or zero-padded to the source's size
    (what a target resized before hashing holds); otherwise bytes the target
    lacks always differ.
    """
    if pad:
        target = target[: len(source)] + bytes(max(0, len(source) - len(target)))
    result = []
    for number, offset in enumerate(range(0, len(source), block_size)):
        ours = source[offset : offset + block_size]
        theirs = target[offset : offset + block_size]
        if ours != theirs:
            result.append(number)
    return result


@st.composite
def scenarios(draw):
    size = draw(SIZES)
    block_size = draw(BLOCK_SIZES)
    kind = draw(TARGET_KINDS)
    mutations = (draw(RESIZES), draw(st.lists(EDITS, min_size=1, max_size=4))) \
        if kind == "mutated" else None
    seed = draw(st.integers(0, 2**32 - 1))
    options = dict(
        hash_method=draw(st.sampled_from(["xxh3_128", "xxh3_128", "xxh3_64", "sha1", "md5",
                                          "blake3"])),
        concurrency=draw(st.integers(1, 3)),
        atomic=draw(st.booleans()),
        whole_file=draw(st.sampled_from([False, False, False, True])),
        # -z frames every transferred range, whatever its offset and length.
        compress=draw(st.sampled_from(["auto", "always", "never"])),
        # Sub-block refinement: the default (4 KiB where it divides the block size), off, or
        # the block cut into 2 to 16 pieces where that makes whole pieces of at least 1 KiB.
        piece_size=draw(st.sampled_from([None, 0, 2, 3, 4, 16])),
        # Fixed blocks, or content-defined chunks copied from anywhere in the old target.
        delta=draw(st.sampled_from(["blocks", "blocks", "chunks"])),
    )
    if options["piece_size"]:
        pieces = options["piece_size"]
        options["piece_size"] = block_size // pieces \
            if block_size % pieces == 0 and block_size // pieces >= 1024 else None
    # Only the recipe: the bytes are made in the test, so a failure's report stays short.
    return size, kind, mutations, seed, block_size, options


class Sides:
    """Where the source and target live for one direction, and how to name them."""

    def __init__(self, direction: str, workdir: Path, server, name: str) -> None:
        self.direction = direction
        local = workdir / "local.img"
        if direction == "local":
            self.source_path, self.target_path = workdir / "source.img", workdir / "target.img"
            self.source, self.target = str(self.source_path), str(self.target_path)
        elif direction == "pull":
            self.source_path, self.target_path = server.root / name, local
            self.source, self.target = server.url(name), str(local)
        else:
            self.source_path, self.target_path = local, server.root / name
            self.source, self.target = str(local), server.url(name)

    def leftovers(self) -> List[str]:
        """Hidden temporaries next to the target."""
        prefix = f".{self.target_path.name}.pdiffcopy-"
        return [p.name for p in self.target_path.parent.iterdir() if p.name.startswith(prefix)]

    def cleanup(self) -> None:
        for path in (self.source_path, self.target_path):
            if path.exists():
                path.unlink()


_names = itertools.count()


def check_sync(direction: str, server, workdir: Path, scenario) -> None:
    size, kind, mutations, seed, block_size, options = scenario
    source = random.Random(seed ^ 0x5EED).randbytes(size)
    target = build_target(source, kind, mutations, seed)
    sides = Sides(direction, workdir, server, f"prop-{os.getpid()}-{next(_names)}.img")
    try:
        sides.source_path.write_bytes(source)
        if target is not None:
            sides.target_path.write_bytes(target)

        # A dry run reports the comparison and changes nothing.
        dry = sync(sides.source, sides.target, block_size=block_size, dry_run=True,
                   hash_method=options["hash_method"], concurrency=options["concurrency"])
        if target is None:
            assert not sides.target_path.exists(), "a dry run created the target"
        else:
            assert sides.target_path.read_bytes() == target, "a dry run changed the target"
        assert sides.leftovers() == []

        result = sync(sides.source, sides.target, block_size=block_size, **options)
        piece_size = resolve_piece_size(options.get("piece_size"), block_size)
        assert sides.target_path.read_bytes() == source
        assert sides.source_path.read_bytes() == source, "the source changed"
        assert sides.leftovers() == [], "a temporary file was left behind"

        blocks = block_lengths(len(source), block_size)
        assert result.verified and not result.dry_run
        assert result.size == len(source)
        assert result.block_size == block_size
        assert result.total_blocks == len(blocks) == dry.total_blocks
        assert result.digest and all(c in "0123456789abcdef" for c in result.digest)

        chunked = options.get("delta") == "chunks" and bool(target) and not options["whole_file"]
        if target is None or options["whole_file"]:
            assert result.changed_blocks == len(blocks)
            assert result.bytes_moved == len(source)
        elif chunked:
            # Sent: what the old target holds nowhere (as whole chunks); the rest was copied there.
            assert result.bytes_moved <= len(source)
            assert result.changed_blocks <= len(blocks)
            assert dry.total_blocks == result.total_blocks
        else:
            fewest = differing_blocks(source, target, block_size, pad=True)
            most = differing_blocks(source, target, block_size, pad=False)
            assert len(fewest) <= result.changed_blocks <= len(most)
            assert result.bytes_moved <= sum(blocks[b] for b in most)
            if fewest == most:  # (they differ only where the source has zeros the target lacks)
                assert result.changed_blocks == len(fewest)
                assert dry.changed_blocks == result.changed_blocks
                assert dry.bytes_moved == sum(blocks[b] for b in fewest)
                # Refined, the pieces that differ move; else the blocks.
                assert result.bytes_moved == (refined_bytes(source, target, block_size, piece_size)
                                              if piece_size else dry.bytes_moved)
        # The similarity index: the share of the source's bytes that did not have to be sent,
        # after refinement, whichever delta ran (a dry run's: what it would send unrefined).
        expected_similarity = 100.0 if not source else \
            100.0 * (len(source) - result.bytes_moved) / len(source)
        assert result.similarity == pytest.approx(expected_similarity)

        # Synced means in sync: a second run finds nothing to move and the same digest.
        again = sync(sides.source, sides.target, block_size=block_size,
                     hash_method=options["hash_method"], concurrency=options["concurrency"])
        assert again.changed_blocks == 0 and again.bytes_moved == 0
        assert again.similarity == 100.0
        assert again.digest == result.digest
        assert sides.target_path.read_bytes() == source
    finally:
        sides.cleanup()


def _options(**changes):
    options = dict(hash_method="xxh3_128", concurrency=2, atomic=False, whole_file=False)
    options.update(changes)
    return options


#: Cases every run checks, whatever Hypothesis draws: many separate changed runs
#: (so many ranges per request), with the target shorter, longer or sparse.
EXPLICIT = [
    (MAX_SOURCE, "mutated", (("keep",), [("scatter", 25)]), 7, 4096, _options()),
    (MAX_SOURCE - 123, "mutated", (("truncate", 0.6), [("scatter", 12)]), 8, 5000, _options()),
    (200_000, "mutated", (("extend", 33333), [("scatter", 9), ("zero", 0.5, 20000)]), 9, 1024,
     _options(hash_method="xxh3_64", concurrency=3)),
    (150_001, "mutated", (("keep",), [("scatter", 30)]), 10, 1536, _options(atomic=True)),
    (MAX_SOURCE, "mutated", (("keep",), [("scatter", 3)]), 11, 65536, _options(hash_method="md5")),
    (100_000, "identical", None, 12, 3000, _options(concurrency=1)),
    (MAX_SOURCE, "mutated", (("keep",), [("insert", 0.01, 100), ("delete", 0.5, 3000)]), 13, 4096,
     _options(delta="chunks")),
    (MAX_SOURCE, "mutated", (("extend", 5000), [("insert", 0.9, 1)]), 14, 1024,
     _options(delta="chunks", atomic=True, compress="always")),
]


def with_explicit_examples(test):
    for case in reversed(EXPLICIT):
        test = example(scenario=case)(test)
    return test


@SYNC_SETTINGS
@given(scenario=scenarios())
@with_explicit_examples
def test_local_sync_makes_identical_files(tmp_path, scenario):
    workdir = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        check_sync("local", None, workdir, scenario)
        assert sorted(p.name for p in workdir.iterdir()) == []
    finally:
        shutil.rmtree(workdir)


@SYNC_SETTINGS
@given(scenario=scenarios())
@with_explicit_examples
def test_pull_makes_identical_files(server, tmp_path, scenario):
    workdir = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        check_sync("pull", server, workdir, scenario)
        assert sorted(p.name for p in workdir.iterdir()) == []
    finally:
        shutil.rmtree(workdir)


@SYNC_SETTINGS
@given(scenario=scenarios())
@with_explicit_examples
def test_push_makes_identical_files(server, tmp_path, scenario):
    workdir = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        check_sync("push", server, workdir, scenario)
        assert sorted(p.name for p in workdir.iterdir()) == []
    finally:
        shutil.rmtree(workdir)


# -- blocks.py ----------------------------------------------------------------------------


@st.composite
def plans(draw, max_blocks: int = 3000):
    """A BlockPlan with a bounded number of blocks and segments of any size."""
    block_size = draw(st.one_of(st.integers(1, 70000),
                                st.sampled_from([1, 2, 1024, 4096, 1 << 20])))
    block_count = draw(st.integers(0, max_blocks))
    if block_count == 0:
        size = 0
    else:
        size = (block_count - 1) * block_size + draw(st.integers(1, block_size))
    per_segment = draw(st.integers(1, max_blocks + 10))
    segment_size = draw(st.one_of(
        st.integers(1, max(1, block_size - 1)),                       # smaller than a block
        st.integers(0, block_size - 1).map(lambda extra: per_segment * block_size + extra),
    ))
    return BlockPlan(size, block_size, segment_size)


@settings(max_examples=300, deadline=None)
@given(plan=plans())
def test_plan_segments_tile_the_file(plan):
    segments = plan.segments()
    block_size = plan.block_size
    assert plan.block_count == -(-plan.size // block_size)
    per_segment = max(1, plan.segment_size // block_size)
    position = block = 0
    for index, segment in enumerate(segments):
        assert segment.index == index
        assert segment.offset == position, "gap or overlap between segments"
        assert segment.offset % block_size == 0
        assert segment.first_block == block == segment.offset // block_size
        assert 1 <= segment.block_count <= per_segment
        assert segment.length > 0
        numbers = range(segment.first_block, segment.first_block + segment.block_count)
        assert segment.length == sum(plan.block_range(b)[1] for b in numbers)
        if index < len(segments) - 1:
            assert segment.length == segment.block_count * block_size
            assert segment.block_count == per_segment
        position += segment.length
        block += segment.block_count
    assert position == plan.size, "the segments do not end where the file does"
    assert block == plan.block_count
    assert (segments == []) == (plan.size == 0)


@settings(max_examples=200, deadline=None)
@given(plan=plans())
def test_block_ranges_tile_the_file(plan):
    position = 0
    for block in range(plan.block_count):
        offset, length = plan.block_range(block)
        assert offset == position
        assert 1 <= length <= plan.block_size
        assert length == plan.block_size or block == plan.block_count - 1
        position += length
    assert position == plan.size


@pytest.mark.parametrize("size,block_size", [(-1, 1024), (10, 0), (10, -4)])
def test_plan_refuses_nonsense(size, block_size):
    with pytest.raises(UsageError):
        BlockPlan(size, block_size)


def blocks_of_range(plan: BlockPlan, offset: int, length: int) -> List[int]:
    """The block numbers a byte range covers, insisting that it covers whole blocks."""
    assert offset % plan.block_size == 0, "a range does not start on a block boundary"
    end = offset + length
    assert end == plan.size or end % plan.block_size == 0, "a range ends inside a block"
    return list(range(offset // plan.block_size, -(-end // plan.block_size)))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_coalesce_covers_exactly_the_blocks(data):
    plan = data.draw(plans(max_blocks=500))
    blocks = sorted(data.draw(st.sets(st.integers(0, max(0, plan.block_count - 1)), max_size=300))
                    if plan.block_count else set())
    max_length = data.draw(st.one_of(
        st.integers(1, 20 * plan.block_size),
        st.integers(1, 20).map(lambda n: n * plan.block_size),
        st.just(1 << 40),
    ))
    ranges = coalesce(plan, blocks, max_length)
    covered = [b for offset, length in ranges for b in blocks_of_range(plan, offset, length)]
    assert covered == blocks, "the ranges do not cover exactly the given blocks, once, in order"
    for (offset, length), (next_offset, next_length) in zip(ranges, ranges[1:]):
        assert offset + length <= next_offset, "ranges overlap or are out of order"
        if offset + length == next_offset:
            # Touching ranges are only left apart when together they would be too long.
            assert length + next_length > max_length
    for offset, length in ranges:
        assert length > 0
        if max_length >= plan.block_size:
            assert length <= max_length
        else:
            assert len(blocks_of_range(plan, offset, length)) == 1
    if max_length >= plan.size:
        # Without a length limit, a range per run of consecutive blocks.
        runs = sum(1 for i, b in enumerate(blocks) if i == 0 or blocks[i - 1] != b - 1)
        assert len(ranges) == runs


RANGE_LISTS = st.lists(st.tuples(st.integers(0, 10**12), st.integers(0, 10**6)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), max_length=st.integers(1, 3 * 10**5))
def test_split_ranges_preserves_bytes_and_order(data, max_length):
    # At most ~100 pieces per range, so that a tiny max_length stays quick.
    ranges = data.draw(st.lists(st.tuples(st.integers(0, 10**12), st.integers(0, 100 * max_length)),
                                max_size=40))
    pieces = split_ranges(ranges, max_length)
    assert sum(length for _, length in pieces) == sum(length for _, length in ranges)
    assert all(1 <= length <= max_length for _, length in pieces)
    # Walking the pieces in order rebuilds every non-empty range, in order.
    walk = iter(pieces)
    for offset, length in ranges:
        position, end = offset, offset + length
        count = 0
        while position < end:
            piece_offset, piece_length = next(walk)
            assert piece_offset == position
            position += piece_length
            count += 1
        assert position == end
        assert count == -(-length // max_length), "more pieces than needed"
    assert next(walk, None) is None


@settings(max_examples=300, deadline=None)
@given(ranges=RANGE_LISTS, max_bytes=st.integers(1, 3 * 10**6),
       max_count=st.one_of(st.none(), st.integers(1, 12)))
def test_batch_ranges_preserves_ranges_and_order(ranges, max_bytes, max_count):
    if max_count is None:
        batches = list(batch_ranges(ranges, max_bytes))
        from pdiffcopy.core.blocks import MAX_RANGES_PER_REQUEST as limit
    else:
        batches, limit = list(batch_ranges(ranges, max_bytes, max_count)), max_count
    assert [r for batch in batches for r in batch] == ranges
    assert all(batch for batch in batches), "an empty batch"
    for batch in batches:
        total = sum(length for _, length in batch)
        assert total <= max_bytes or len(batch) == 1
        assert len(batch) <= limit
    for batch, following in zip(batches, batches[1:]):
        # A batch is closed only when the next range would not fit.
        full = len(batch) >= limit
        assert full or sum(length for _, length in batch) + following[0][1] > max_bytes


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_changed_blocks_against_reference(data):
    from pdiffcopy.core.blocks import Segment

    count = data.draw(st.integers(0, 50))
    first = data.draw(st.integers(0, 10**6))
    segment = Segment(index=0, offset=first * 1024, length=count * 1024, first_block=first,
                      block_count=count)
    ours = data.draw(st.lists(st.binary(min_size=2, max_size=2), min_size=count, max_size=count))
    missing = data.draw(st.booleans())
    theirs = None if missing else data.draw(
        st.lists(st.binary(min_size=2, max_size=2), min_size=count, max_size=count))
    expected = [first + i for i in range(count) if theirs is None or ours[i] != theirs[i]]
    assert changed_blocks(segment, ours, theirs) == expected


@given(digests=st.lists(st.binary(min_size=16, max_size=16), max_size=50))
def test_split_digests_round_trip(digests):
    assert split_digests(b"".join(digests), 16) == digests
    if digests:
        with pytest.raises(ValueError):
            split_digests(b"".join(digests) + b"x", 16)


@given(total=st.integers(0, 10**12), changed_fraction=FRACTION)
def test_similarity_index_bounds(total, changed_fraction):
    changed = int(total * changed_fraction)
    index = Similarity(1, 0, total, changed).index
    assert 0.0 <= index <= 100.0
    assert index == (100.0 if total == 0 else pytest.approx(100.0 * (total - changed) / total))


UNITS = {"": 1, "K": 1024, "KiB": 1024, "M": 1024**2, "MiB": 1024**2, "G": 1024**3,
         "KB": 1000, "MB": 1000**2}


@settings(max_examples=300, deadline=None)
@given(number=st.integers(-10, 300 * 1024 * 1024), unit=st.sampled_from(sorted(UNITS)),
       spaced=st.booleans())
def test_parse_block_size_against_reference(number, unit, spaced):
    text = f"{number}{' ' if spaced and unit else ''}{unit}"
    expected = number * UNITS[unit]
    if 1024 <= expected <= 256 * 1024 * 1024:
        assert parse_block_size(text) == expected
        if not unit:
            assert parse_block_size(number) == number
    else:
        with pytest.raises(UsageError):
            parse_block_size(text)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=20))
@example("1024.5")
@example("nan")
@example("inf")
@example("1e400")
def test_parse_block_size_never_crashes(text):
    try:
        value = parse_block_size(text)
    except UsageError:
        return
    assert isinstance(value, int) and 1024 <= value <= 256 * 1024 * 1024


# -- byteranges.py -------------------------------------------------------------------------


#: Most digits a number in a range may have (byteranges.py refuses longer ones: no
#: byte offset needs more, and int() refuses strings of over 4300 digits).
MAX_DIGITS = 20


def reference_ranges(specs: List[Tuple[Optional[int], Optional[int]]], size: int):
    """RFC 9110 section 14.1.2, read literally: the satisfiable ranges, in order.

    ``specs`` holds (first, last) with None for an omitted number. Returns a
    list, or the exception class a server must answer with.
    """
    result = []
    for first, last in specs:
        if first is None and last is None:
            return BadRequest
        if first is not None and last is not None and last < first:
            return BadRequest
        if any(n is not None and len(str(n)) > MAX_DIGITS for n in (first, last)):
            return BadRequest
    for first, last in specs:
        if first is None:  # suffix: the last `last` bytes
            length = min(last, size)
            if length > 0:
                result.append((size - length, length))
        elif first < size:
            end = size - 1 if last is None else min(last, size - 1)
            result.append((first, end - first + 1))
    return result or RangeNotSatisfiable


def numbers_near(size: int):
    return st.one_of(st.integers(0, size + 2), st.integers(0, 2**64),
                     st.sampled_from([max(0, size - 1), size, size + 1, 0]),
                     st.sampled_from([10**19, 10**20 - 1, 10**20, 2**70]))  # around the bound


@st.composite
def range_headers(draw):
    size = draw(st.one_of(st.integers(0, 10**6), st.sampled_from([0, 1, 2, 100])))
    specs = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["closed", "closed", "open", "suffix", "backwards"]))
        if kind == "closed":
            first = draw(numbers_near(size))
            specs.append((first, first + draw(st.integers(0, size + 5))))
        elif kind == "open":
            specs.append((draw(numbers_near(size)), None))
        elif kind == "suffix":
            specs.append((None, draw(numbers_near(size))))
        else:
            last = draw(numbers_near(size))
            specs.append((last + draw(st.integers(1, 100)), last))
    unit = draw(st.sampled_from(["bytes", "BYTES", "Bytes"]))
    separator = draw(st.sampled_from([",", ", ", " , ", ",\t"]))
    text = separator.join(f"{'' if a is None else a}-{'' if b is None else b}" for a, b in specs)
    return f"{unit}={text}", size, specs


@settings(max_examples=500, deadline=None)
@given(case=range_headers())
@example(case=("bytes=0-0", 0, [(0, 0)]))
@example(case=("bytes=-0", 10, [(None, 0)]))
@example(case=("bytes=9-", 10, [(9, None)]))
@example(case=("bytes=10-", 10, [(10, None)]))
@example(case=("bytes=-11", 10, [(None, 11)]))
@example(case=("bytes=5-4", 10, [(5, 4)]))
@example(case=(f"bytes=0-{10**20 - 1}", 10, [(0, 10**20 - 1)]))
@example(case=(f"bytes=0-{10**20}", 10, [(0, 10**20)]))
def test_parse_range_header_against_reference(case):
    header, size, specs = case
    expected = reference_ranges(specs, size)
    if isinstance(expected, type):
        with pytest.raises(expected) as raised:
            parse_range_header(header, size)
        if expected is BadRequest:
            assert not isinstance(raised.value, RangeNotSatisfiable), \
                "a malformed header must be a 400, not a 416"
    else:
        # Overlapping and touching ranges come merged, in ascending order.
        assert parse_range_header(header, size) == merge_ranges(expected)


@settings(max_examples=500, deadline=None)
@given(header=st.one_of(
    st.text(max_size=40),
    st.text(alphabet="bytes=0123456789-, \t", max_size=40),
    st.from_regex(r"\Abytes=[0-9 ,-]{0,30}\Z"),
), size=st.integers(0, 10**6))
@example(header="bytes=0-" + "9" * 5000, size=10)      # beyond int()'s 4300 digits
@example(header="bytes=" + "1" * 5000 + "-", size=10)
@example(header="bytes=-" + "1" * 5000, size=10)
def test_parse_range_header_never_crashes(header, size):
    """Any header yields ranges inside the file, or BadRequest (a 400 or 416): never a 500."""
    try:
        ranges = parse_range_header(header, size)
    except BadRequest:
        return
    assert ranges
    for offset, length in ranges:
        assert 0 <= offset and length >= 1 and offset + length <= size


@settings(max_examples=300, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 100)), max_size=12))
def test_merged_ranges_cover_the_same_bytes_once_in_order(ranges):
    merged = merge_ranges(ranges)
    covered = {byte for offset, length in ranges for byte in range(offset, offset + length)}
    assert [byte for offset, length in merged for byte in range(offset, offset + length)] == sorted(covered)
    # Ascending, and a gap between each two: nothing left to merge.
    assert all(a + n < b for (a, n), (b, _) in zip(merged, merged[1:]))


def test_parse_range_header_limits_the_number_of_ranges():
    from pdiffcopy.core.byteranges import MAX_RANGES_ACCEPTED

    header = "bytes=" + ",".join("0-0" for _ in range(MAX_RANGES_ACCEPTED + 1))
    with pytest.raises(BadRequest):
        parse_range_header(header, 10)
    header = "bytes=" + ",".join(f"{2 * n}-{2 * n}" for n in range(MAX_RANGES_ACCEPTED))
    assert len(parse_range_header(header, 10**6)) == MAX_RANGES_ACCEPTED


def reference_explicit_ranges(specs):
    """Explicit ranges only: every spec ``first-last`` with first <= last; no clipping."""
    if any(first is None or last is None or last < first for first, last in specs):
        return BadRequest
    if any(len(str(n)) > MAX_DIGITS for spec in specs for n in spec):
        return BadRequest
    return [(first, last - first + 1) for first, last in specs]


@settings(max_examples=300, deadline=None)
@given(case=range_headers())
@example(case=("bytes=0-0", 0, [(0, 0)]))
@example(case=("bytes=0-", 10, [(0, None)]))
@example(case=("bytes=-5", 10, [(None, 5)]))
def test_parse_explicit_ranges_against_reference(case):
    from pdiffcopy.core.byteranges import parse_explicit_ranges

    header, _, specs = case
    expected = reference_explicit_ranges(specs)
    if expected is BadRequest:
        with pytest.raises(BadRequest):
            parse_explicit_ranges(header)
    else:
        assert parse_explicit_ranges(header) == expected


@settings(max_examples=300, deadline=None)
@given(header=st.one_of(st.text(max_size=40), st.from_regex(r"\Abytes=[0-9 ,-]{0,30}\Z")))
@example(header="bytes=0-" + "9" * 5000)
def test_parse_explicit_ranges_never_crashes(header):
    from pdiffcopy.core.byteranges import parse_explicit_ranges

    try:
        ranges = parse_explicit_ranges(header)
    except BadRequest:
        return
    assert ranges and all(offset >= 0 and length >= 1 for offset, length in ranges)


@st.composite
def ranges_inside(draw, min_size=1):
    size = draw(st.integers(min_size, 10**9))
    ranges = []
    for _ in range(draw(st.integers(1, 20))):
        offset = draw(st.integers(0, size - 1))
        ranges.append((offset, draw(st.integers(1, size - offset))))
    return size, ranges


@settings(max_examples=300, deadline=None)
@given(case=ranges_inside())
def test_format_and_parse_range_header_round_trip(case):
    size, ranges = case
    assert parse_range_header(format_range_header(ranges), size) == merge_ranges(ranges)


@settings(max_examples=300, deadline=None)
@given(offset=st.integers(0, 2**63), length=st.integers(1, 2**40),
       size=st.one_of(st.none(), st.integers(0, 2**64)))
def test_content_range_round_trip(offset, length, size):
    assert parse_content_range(format_content_range(offset, length, size)) == (offset, length, size)


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.text(max_size=40),
                       st.from_regex(r"\Abytes [0-9]{0,6}-[0-9]{0,6}/[0-9*]{0,6}\Z")))
@example(value="bytes 0-" + "9" * 5000 + "/*")          # beyond int()'s 4300 digits
@example(value="bytes 5-4/*")
def test_parse_content_range_never_crashes(value):
    try:
        offset, length, size = parse_content_range(value)
    except BadRequest:
        return
    assert offset >= 0 and length >= 1 and (size is None or size >= 0)


#: One boundary for these tests, so that part data can contain it (readers count bytes, never scan).
BOUNDARY = new_boundary()

#: Part data that likes to look like multipart syntax.
TRICKY = st.sampled_from([
    b"\r\n", b"--", f"--{BOUNDARY}".encode(), f"\r\n--{BOUNDARY}--\r\n".encode(),
    f"\r\n--{BOUNDARY}\r\nContent-Range: bytes 0-1/*\r\n\r\n".encode(), b"\n", b"\r",
])
PART_DATA = st.lists(st.one_of(st.binary(min_size=1, max_size=64), TRICKY),
                     min_size=1, max_size=6).map(b"".join)


@st.composite
def multipart_cases(draw):
    parts = draw(st.lists(st.tuples(st.integers(0, 10**12), PART_DATA), min_size=1, max_size=8))
    end = max(offset + len(data) for offset, data in parts)
    size = draw(st.one_of(st.none(), st.integers(end, end + 10**6)))
    return parts, size


def encode_multipart(parts, size) -> bytes:
    body = b"".join(part_header(offset, len(data), size, BOUNDARY) + data for offset, data in parts)
    return body + closing_delimiter(BOUNDARY)


def decode_multipart(body: bytes, boundary: str = BOUNDARY):
    """Read every part as a server or client does: headers by line, data by count."""
    stream = io.BytesIO(body)
    decoded = []
    for offset, length, size in read_parts(stream, boundary):
        data = stream.read(length)
        decoded.append((offset, length, size, data))
        if len(data) < length:
            return decoded, stream, False  # the body ended inside a part
    return decoded, stream, True


@settings(max_examples=300, deadline=None)
@given(case=multipart_cases())
def test_multipart_round_trip(case):
    parts, size = case
    body = encode_multipart(parts, size)
    assert multipart_length([(o, len(d)) for o, d in parts], size, BOUNDARY) == len(body)
    decoded, stream, complete = decode_multipart(body, boundary_of(multipart_content_type(BOUNDARY)))
    assert complete
    assert [(o, d) for o, _, _, d in decoded] == parts
    assert all(length == len(d) and s == size for _, length, s, d in decoded)
    assert stream.read() == b"", "bytes after the closing delimiter were not consumed"


@settings(max_examples=300, deadline=None)
@given(case=multipart_cases(), cut=st.integers(0, 10**6))
def test_truncated_multipart_is_detected(case, cut):
    """Any strict prefix of a body fails loudly: BadRequest, or a part that comes up short."""
    parts, size = case
    body = encode_multipart(parts, size)
    prefix = body[: cut % len(body)]
    try:
        _, _, complete = decode_multipart(prefix)
    except BadRequest:
        return
    assert not complete, f"a body cut at {len(prefix)} of {len(body)} bytes was read as complete"


@settings(max_examples=200, deadline=None)
@given(parts=st.integers(1, 12), limit=st.integers(1, 12))
def test_read_parts_enforces_max_parts(parts, limit):
    body = encode_multipart([(i * 10, b"x" * 10) for i in range(parts)], None)
    stream = io.BytesIO(body)
    if parts <= limit:
        read = [stream.read(length) for _, length, _ in read_parts(stream, BOUNDARY, limit)]
        assert len(read) == parts
    else:
        with pytest.raises(BadRequest):
            for _, length, _ in read_parts(stream, BOUNDARY, limit):
                stream.read(length)


@pytest.mark.parametrize("content_type,expected", [
    (multipart_content_type(BOUNDARY), BOUNDARY),
    ('multipart/byteranges; boundary="abc"', "abc"),
    ("Multipart/ByteRanges;charset=x; Boundary=abc", "abc"),
    ("application/octet-stream", None),
    ("", None),
])
def test_boundary_of(content_type, expected):
    assert boundary_of(content_type) == expected


def test_boundary_of_refuses_multipart_without_boundary():
    with pytest.raises(BadRequest):
        boundary_of("multipart/byteranges")

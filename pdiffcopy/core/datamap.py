"""Data maps: where a sparse file has data, and where it has holes (no I/O).

A data map is a sorted list of disjoint ``(offset, length)`` extents that hold data; every
other byte of the file is a hole, which reads as zeros. The engine splits the ranges it
moves by the source's map (:func:`split_by_data`): the data parts move, the hole parts
are punched in the target, never read nor sent. :func:`zero_runs` finds the runs of zeros
that ``--sparse`` (``-S``) turns into holes as well.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Sequence, Tuple

from pdiffcopy.core.blocks import ByteRange

#: Most extents one answer of a data map carries (the server's bound, the client's page):
#: a file with millions of punched pages answers in pages of 16 bytes an extent, a file
#: of a few extents in one.
MAX_DATA_MAP_EXTENTS = 65536


def split_by_data(ranges: Sequence[ByteRange], extents: Sequence[ByteRange]
                  ) -> Tuple[List[ByteRange], List[ByteRange]]:
    """Cut sorted, disjoint ``ranges`` by the data map ``extents``: (data parts, hole parts).

    Both lists come sorted; together they cover ``ranges`` exactly. Linear in the two lists.
    """
    data: List[ByteRange] = []
    holes: List[ByteRange] = []
    index = 0
    for offset, length in ranges:
        position, end = offset, offset + length
        # Extents wholly before this range cannot touch it or any later one.
        while index < len(extents) and extents[index][0] + extents[index][1] <= position:
            index += 1
        scan = index
        while position < end:
            if scan < len(extents) and extents[scan][0] < end:
                start, size = extents[scan]
                if start > position:
                    holes.append((position, start - position))
                    position = start
                stop = min(start + size, end)
                if stop > position:
                    data.append((position, stop - position))
                    position = stop
                scan += 1
            else:
                holes.append((position, end - position))
                position = end
    return data, holes


def overlaps(first: Iterable[ByteRange], second: Iterable[ByteRange]) -> Iterator[ByteRange]:
    """The ranges that both ``first`` and ``second`` cover (each sorted and disjoint), in order.

    Lazy and linear: two data maps read a page at a time are intersected without being held.
    """
    others = iter(second)
    other: "ByteRange | None" = None
    started = False
    for offset, length in first:
        if not started:  # the second is asked only once the first has a range
            other, started = next(others, None), True
        end = offset + length
        while other is not None and other[0] + other[1] <= offset:
            other = next(others, None)
        while other is not None and other[0] < end:
            start, stop = max(offset, other[0]), min(end, other[0] + other[1])
            if stop > start:
                yield start, stop - start
            if other[0] + other[1] > end:
                break  # it reaches into the next range of ``first``
            other = next(others, None)


def zero_runs(data: "bytes | memoryview", offset: int, unit: int) -> List[ByteRange]:
    """The runs of zeros in ``data`` (which sits at ``offset``) to punch rather than write, merged.

    ``--sparse`` punches these: whole ``unit``-aligned units of zeros (a unit is a file system
    block, so a hole never splits one), and the zero parts of units that ``data`` only
    partly covers (its head and tail): data that arrives in pieces that do not fall on
    block boundaries still leaves whole blocks unallocated, and punching part of a block
    only zeroes it.
    """
    view = memoryview(data).cast("B")
    # bytes.startswith compares in C; a memoryview compares element by element, 100 times slower.
    haystack = data if isinstance(data, (bytes, bytearray)) else view.tobytes()
    runs: List[ByteRange] = []
    end = offset + len(view)

    def add(start: int, length: int) -> None:
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((start, length))

    first = min(-(-offset // unit) * unit, end)
    if first > offset and haystack.count(0, 0, first - offset) == first - offset:
        add(offset, first - offset)
    zeros = bytes(unit)
    position = first
    while position + unit <= end:
        if haystack.startswith(zeros, position - offset):
            add(position, unit)
        position += unit
    if end > position and haystack.count(0, position - offset) == end - position:
        add(position, end - position)
    return runs

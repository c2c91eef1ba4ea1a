"""Compression on the wire: zstd frames that check themselves, and when to use them.

zstd through the well-kept ``zstandard`` binding (it releases the GIL, so chunks compress in
parallel threads). Every frame carries its content size and a checksum, so a corrupted,
truncated or wrongly sized frame is an error here, never wrong bytes in a target.

Whether to compress is decided per stream
(:class:`~pdiffcopy.transport.compressionpolicy.AdaptivePolicy`): only when the data shrinks
and the link, not the CPU, is the bottleneck. On loopback or a fast LAN, and for
random data, compressing would only cost time. How hard to compress is decided from the same
measurements (:func:`choose_level`): the highest zstd level whose speed on the cores still
outruns the link, so a slow link carries fewer bytes and a fast one is never starved.
"""

from __future__ import annotations

import struct
import threading
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

#: The HTTP content coding (RFC 8878 registers "zstd").
ENCODING = "zstd"
#: The level when none was chosen (``-z`` before anything is measured, a peer that names none,
#: whole-file streams): level 1, the fastest, can never make the CPU the bottleneck where
#: compression pays at all. Text-like data shrank 3.85:1 at level 1 and 4.10:1 at level 3 here.
LEVEL = 1
#: The levels :func:`choose_level` picks from, in order of speed. On the benchmark's text
#: (1 MiB frames, one core here): level 1 3.85:1 at 330 MB/s, 2 3.93:1 at 337, 3 4.10:1 at 250,
#: 5 4.23:1 at 137, 6 4.33:1 at 89, 7 4.40:1 at 81, 9 4.44:1 at 58, 12 4.55:1 at 33, 15 4.88:1
#: at 6, 19 5.22:1 at 2.8: past 9 only a link of a few MB/s leaves the CPU time for them.
#: Levels 4 and 8 are left out: no denser than 3 and 9, and timing each costs the sync time.
LEVELS = (1, 2, 3, 5, 6, 7, 9, 12, 15, 19)
#: The highest level a peer may ask for (zstd's own maximum without the "ultra" modes, whose
#: windows a 1 MiB frame cannot use anyway).
MAX_LEVEL = 19
#: Compress only when it saves at least this share of the bytes: below it the CPU time and
#: the latency of compressing buy almost nothing.
MIN_SAVING = 0.1
#: ...and only when the compressors (on all cores) outrun the link by this margin, so that
#: compressing never becomes the bottleneck instead of the link: the cores also decompress,
#: hash, write and serve others. At 1.5 the 200 Mbit benchmark (client and server on the same
#: two cores) chose levels 7 to 9 for a pull and took 4.0 to 5.2 s, CPU-bound, where rsync -z
#: took 2.9; at 2 it chose level 5 or 6 and took 2.9 s.
CPU_MARGIN = 2.0
#: Bytes sampled to estimate how well a stream compresses and how fast at each level: one
#: frame (FRAME_BYTES), as the frames are. zstd sizes its tables to the input, so a 256 KiB
#: sample showed level 6 shrinking text less than level 5, where 1 MiB frames shrink it more.
SAMPLE_BYTES = 1024 * 1024


class CompressionError(ValueError):
    """A compressed frame that does not decode to exactly the bytes announced."""


def _zstd():
    import zstandard  # imported when first used: plain transfers never pay for it

    return zstandard


_local = threading.local()


def level_compressor(level: int = LEVEL):
    # A ZstdCompressor must not be shared between threads; one per thread and level is reused.
    compressors = getattr(_local, "compressors", None)
    if compressors is None:
        compressors = _local.compressors = {}
    compressor = compressors.get(level)
    if compressor is None:
        compressor = compressors[level] = _zstd().ZstdCompressor(
            level=level, write_checksum=True, write_content_size=True)
    return compressor


def compress(data: "bytes | memoryview", level: int = LEVEL) -> bytes:
    """One zstd frame holding `data`, with its size and a checksum, compressed at `level`."""
    return level_compressor(level).compress(data)


def decompress(frame: bytes, expected_length: int) -> bytes:
    """The bytes of one frame, which must be exactly `expected_length` long.

    :raises CompressionError: For a corrupted or truncated frame or a wrong length.
    """
    zstd = _zstd()
    try:
        size = zstd.frame_content_size(frame)
    except zstd.ZstdError as error:
        raise CompressionError(f"Damaged compressed data: {error}") from None
    if size != expected_length:
        raise CompressionError(f"Compressed data announces {size} bytes where {expected_length} were expected")
    try:
        data = zstd.ZstdDecompressor().decompress(frame, max_output_size=expected_length)
    except zstd.ZstdError as error:
        raise CompressionError(f"Damaged compressed data: {error}") from None
    if len(data) != expected_length:
        raise CompressionError(f"Compressed data held {len(data)} bytes where {expected_length} were expected")
    return data


#: One level's measurement on a sample: (compression ratio, raw bytes per second on one core).
Measurement = Tuple[float, float]


def outruns(measurement: Measurement, cores: int, link_rate: float, margin: float = CPU_MARGIN) -> bool:
    """Whether ``cores`` compressing at this speed feed a link of ``link_rate`` (bytes/s on the
    wire) faster than it drains, by ``margin``: the link, not the CPU, stays the bottleneck.

    Compressed, the link carries ``ratio`` times its rate in file bytes, so that is what the
    compressors must produce.
    """
    ratio, speed = measurement
    return cores * speed >= margin * ratio * link_rate


def choose_level(measured: Dict[int, Measurement], cores: int, link_rate: float,
                 margin: float = CPU_MARGIN) -> Optional[int]:
    """The zstd level to compress at, or None when compressing does not pay.

    ``measured`` maps levels to their :data:`Measurement` on a sample. Compressing pays when
    the data shrinks by :data:`MIN_SAVING` and the fastest level measured outruns the plain
    link by ``margin``. Then the level that moves file bytes fastest wins: each moves
    ``min(cores * speed / margin, ratio * link_rate)``, the CPU's or the link's share, so among
    the levels that still outrun the link the highest ratio wins (fewest bytes too), and on a
    link so fast that none outruns it, the level that loses least to the CPU. A tie goes to
    the higher level: the same speed with fewer bytes on the wire.
    """
    if not measured or link_rate <= 0:
        return None
    fastest = min(measured)
    ratio, speed = measured[fastest]
    if ratio <= 0 or 1 - 1 / ratio < MIN_SAVING or cores * speed < margin * link_rate:
        return None

    def throughput(level: int) -> float:
        ratio, speed = measured[level]
        return min(cores * speed / margin, ratio * link_rate)

    return max(sorted(measured, reverse=True), key=throughput)  # max() keeps the first of equals


def starved(compress_seconds: float, send_seconds: float, transfers: int) -> bool:
    """Whether compressing, not the link, held a transfer up.

    With ``transfers`` in flight, the others send while one compresses; the link waits when one
    transfer's compressing takes longer than the others' sending. The speeds timed on a sample
    miss what the timing cannot see: other work on the same cores, a link measured too slow.
    """
    return compress_seconds > send_seconds * max(1, transfers - 1)


# -- the modes a sync can be asked for ----------------------------------------

#: ``auto``: the :class:`~pdiffcopy.transport.compressionpolicy.AdaptivePolicy` decides per stream;
#: ``always`` (``-z``); ``never``.
#: A level (an int, ``--compress-level``) is a mode too: always, at that level.
MODES = ("auto", "always", "never")


def check_mode(value: "str | int") -> "str | int":
    """``value`` if it is one of :data:`MODES` or a level in ``1..MAX_LEVEL``; a usage error otherwise."""
    if type(value) is int and 1 <= value <= MAX_LEVEL:
        return value
    if type(value) is not str or value not in MODES:
        from pdiffcopy.errors import UsageError

        raise UsageError(f"Invalid compression mode: {value!r} "
                         f"(expected auto, always, never or a level from 1 to {MAX_LEVEL})")
    return value


# -- the framing of compressed ranges (application/x-pdiffcopy-frames) --------

#: The media type of a body of compressed ranges, both in answers to a ranged GET and in PATCH bodies.
FRAMES_TYPE = "application/x-pdiffcopy-frames"
#: Before each frame: the offset in the file (u64), the raw length (u32) and the frame's length (u32).
FRAME_HEADER = struct.Struct(">QII")
#: Raw bytes per frame: bounds what either side holds in memory per frame, while zstd's window
#: at level 1 (512 KiB) still finds all the redundancy it would find in a longer frame.
FRAME_BYTES = 1024 * 1024
#: The longest frame accepted: zstd's worst case for FRAME_BYTES is 1/256 above it plus a few
#: bytes; 64 KiB of slack covers that, and a bogus header cannot make a peer buffer more.
MAX_FRAME_LENGTH = FRAME_BYTES + 64 * 1024


def split_after(ranges: Sequence[Tuple[int, int]], count: int
                ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """The first ``count`` bytes of ``ranges`` and the rest, each as ranges in the same order."""
    head: List[Tuple[int, int]] = []
    tail: List[Tuple[int, int]] = []
    for offset, length in ranges:
        if count >= length:
            head.append((offset, length))
            count -= length
        elif count > 0:
            head.append((offset, count))
            tail.append((offset + count, length - count))
            count = 0
        else:
            tail.append((offset, length))
    return head, tail


def pieces(ranges: Iterable[Tuple[int, int]]) -> Iterator[Tuple[int, int]]:
    """``ranges`` cut into pieces of at most :data:`FRAME_BYTES`: one frame each."""
    for offset, length in ranges:
        end = offset + length
        while offset < end:
            step = min(FRAME_BYTES, end - offset)
            yield offset, step
            offset += step


def frame(offset: int, data: "bytes | memoryview", level: int = LEVEL) -> bytes:
    """The header and the zstd frame of one piece, compressed at `level`."""
    compressed = compress(data, level)
    return FRAME_HEADER.pack(offset, len(data), len(compressed)) + compressed


def read_frames(read: Callable[[int], bytes]) -> Iterator[Tuple[int, bytes, int]]:
    """(offset, the raw bytes, the frame's length) of each frame of a body read with ``read(n)``.

    Every frame is decompressed and its length checked before it is handed on, so damage is
    never written. The body ends cleanly only between frames.

    :raises CompressionError: For a truncated body, a bogus header or a damaged frame.
    """
    while True:
        header = _read_exactly(read, FRAME_HEADER.size, allow_end=True)
        if header is None:
            return
        offset, length, frame_length = FRAME_HEADER.unpack(header)
        if not 0 < length <= FRAME_BYTES or not 0 < frame_length <= MAX_FRAME_LENGTH:
            raise CompressionError(f"Damaged compressed data: a frame of {frame_length} bytes "
                                   f"announced for {length} bytes")
        data = decompress(_read_exactly(read, frame_length), length)
        yield offset, data, FRAME_HEADER.size + frame_length


def _read_exactly(read, count: int, allow_end: bool = False) -> Optional[bytes]:
    parts, wanted = [], count
    while wanted:
        part = read(wanted)
        if not part:
            if allow_end and wanted == count:
                return None
            raise CompressionError("Damaged compressed data: the body ended inside a frame")
        parts.append(part)
        wanted -= len(part)
    return b"".join(parts)


def stream_compressor(level: int = LEVEL):
    """A zstd compressor for one whole streamed body (``Content-Encoding: zstd``), with a checksum."""
    return _zstd().ZstdCompressor(level=level, write_checksum=True).compressobj()


#: The parameter of :data:`FRAMES_TYPE` in an ``Accept`` header by which a client names the
#: level it chose (``Accept: application/x-pdiffcopy-frames; level=6``); without it, :data:`LEVEL`.
LEVEL_PARAMETER = "level"


def frames_accept(level: int) -> str:
    """The ``Accept`` header asking for compressed ranges at ``level``."""
    return f"{FRAMES_TYPE}; {LEVEL_PARAMETER}={level}"


def _header_parameters(header: "Optional[str]", name: str) -> "Optional[Dict[str, str]]":
    """The parameters of the first item called ``name`` in a list header (``Accept``,
    ``Accept-Encoding``), keys in lower case; None when no item has that name."""
    for item in (header or "").split(","):
        item_name, _, params = item.strip().partition(";")
        if item_name.strip().lower() != name:
            continue
        found: Dict[str, str] = {}
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            found.setdefault(key.strip().lower(), value.strip())
        return found
    return None


def accepted_frames_level(header: "Optional[str]") -> Optional[int]:
    """The level an ``Accept`` header asks compressed ranges at; None when it asks for none.

    A missing or unreadable level is :data:`LEVEL` and one out of range is brought into
    ``1..MAX_LEVEL``: the client only tunes speed against size here, and every level decodes.
    """
    params = _header_parameters(header, FRAMES_TYPE)
    if params is None:
        return None
    return asked_level(params[LEVEL_PARAMETER].strip('"')) if LEVEL_PARAMETER in params else LEVEL


def asked_level(value: "Optional[str]") -> int:
    """The level a peer asked for as text (a ``level`` parameter): brought into ``1..MAX_LEVEL``,
    and :data:`LEVEL` when missing or unreadable."""
    try:
        return min(max(int(value or ""), 1), MAX_LEVEL)
    except ValueError:
        return LEVEL


def accepts_zstd(header: "Optional[str]") -> bool:
    """Whether an ``Accept-Encoding`` header accepts zstd (RFC 9110, 12.5.3: ``q=0`` refuses it)."""
    params = _header_parameters(header, ENCODING)
    if params is None:
        return False
    if "q" not in params:
        return True
    try:
        return float(params["q"]) > 0
    except ValueError:
        return False


# -- whole streams (tree batches) -------------------------------------------------


def compressed_stream(chunks: Iterable[bytes], level: int = LEVEL) -> Iterator[bytes]:
    """``chunks`` as one zstd stream with a checksum, compressed at `level` as they come."""
    compressor = stream_compressor(level)
    for chunk in chunks:
        out = compressor.compress(chunk)
        if out:
            yield out
    yield compressor.flush()


class DecompressingReader:
    """The decompressed bytes of a zstd stream read from ``source`` (``read(n)`` or ``readinto``).

    Damage is :class:`CompressionError` (or ``error``, a subclass the caller wants); a stream cut
    short simply ends early, which the framing read through it must notice (a treewire stream
    then lacks its end marker, and every record carries its own digest).
    """

    def __init__(self, source, error: type = CompressionError) -> None:
        self._source = source
        self._error = error
        self._reader = _zstd().ZstdDecompressor().stream_reader(_Raw(self._raw_read), read_across_frames=True)

    def read(self, size: int = -1) -> bytes:
        try:
            return self._reader.read(size if size > 0 else FRAME_BYTES)
        except _zstd().ZstdError as error:
            raise self._error(f"Damaged compressed data: {error}") from None

    def _raw_read(self, size: int) -> bytes:
        read = getattr(self._source, "read", None)
        if read is not None:
            return bytes(read(size))
        buffer = bytearray(size)
        count = self._source.readinto(memoryview(buffer))
        return bytes(buffer[:count]) if count else b""


class _Raw:
    def __init__(self, read) -> None:
        self.read = read

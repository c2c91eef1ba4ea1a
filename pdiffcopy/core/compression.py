"""Compression on the wire: zstd frames that check themselves, and when to use them.

zstd through the well-kept ``zstandard`` binding (it releases the GIL, so chunks compress in
parallel threads). Every frame carries its content size and a checksum, so a corrupted,
truncated or wrongly sized frame is an error here, never wrong bytes in a target.

Whether to compress is decided per stream (:class:`AdaptivePolicy`): only when the data
shrinks and the link, not the CPU, is the bottleneck. On loopback or a fast LAN, and for
random data, compressing would only cost time.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Callable, Iterable, Iterator, Optional, Tuple

#: The HTTP content coding (RFC 8878 registers "zstd").
ENCODING = "zstd"
#: zstd level 1: text-like data shrank 3.9:1 at level 1 and 4.2:1 at level 3 here, and level 1
#: compresses about twice as fast; on a link where compression pays, the CPU must keep up.
LEVEL = 1
#: Compress only when it saves at least this share of the bytes: below it the CPU time and
#: the latency of compressing buy almost nothing.
MIN_SAVING = 0.1
#: ...and only when the compressors (on all cores) outrun the link by this margin, so that
#: compressing never becomes the bottleneck instead of the link.
CPU_MARGIN = 1.5
#: Bytes sampled to estimate how well a stream compresses and how fast.
SAMPLE_BYTES = 256 * 1024


class CompressionError(ValueError):
    """A compressed frame that does not decode to exactly the bytes announced."""


def _zstd():
    import zstandard  # imported when first used: plain transfers never pay for it

    return zstandard


_local = threading.local()


def _compressor():
    # A ZstdCompressor must not be shared between threads; one per thread is reused.
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = _zstd().ZstdCompressor(
            level=LEVEL, write_checksum=True, write_content_size=True)
    return compressor


def compress(data: "bytes | memoryview") -> bytes:
    """One zstd frame holding `data`, with its size and a checksum."""
    return _compressor().compress(data)


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


class AdaptivePolicy:
    """Decide per stream whether compressing pays, from what the stream itself shows.

    The transport reports how fast bytes cross the link (:meth:`link_observed`) and hands over
    a sample of the data (:meth:`sample`); :meth:`compress` is the answer. Until both are
    known it answers no: a transfer starts plain, as on loopback it should stay.
    """

    def __init__(self, cores: int, clock=time.perf_counter) -> None:
        self.cores = max(1, cores)
        self._clock = clock
        self.ratio: Optional[float] = None
        self.compress_rate: Optional[float] = None
        self.link_rate: Optional[float] = None
        self._lock = threading.Lock()

    def sample(self, data: "bytes | memoryview") -> None:
        """Compress a sample once, to learn the ratio and the speed of one core."""
        if self.ratio is not None or not data:
            return
        data = memoryview(data)[:SAMPLE_BYTES]
        # The import and the compressor's context are made first: timed with the sample, they
        # made one core look 20 times slower than it is (18 MB/s here) and kept -z off.
        _compressor()
        started = self._clock()
        compressed = len(compress(data))
        seconds = max(self._clock() - started, 1e-6)
        with self._lock:
            self.ratio = len(data) / max(compressed, 1)
            self.compress_rate = len(data) / seconds

    def link_observed(self, count: int, seconds: float) -> None:
        """Plain bytes took `seconds` to cross the link (keeps a moving average)."""
        if seconds <= 0 or count <= 0:
            return
        rate = count / seconds
        with self._lock:
            self.link_rate = rate if self.link_rate is None else 0.7 * self.link_rate + 0.3 * rate

    def compress(self) -> bool:
        """Whether the rest of the stream should be compressed."""
        if self.ratio is None or self.link_rate is None:
            return False
        if 1 - 1 / self.ratio < MIN_SAVING:
            return False
        return self.cores * self.compress_rate >= CPU_MARGIN * self.link_rate


# -- the modes a sync can be asked for ----------------------------------------

#: ``auto``: the :class:`AdaptivePolicy` decides per stream; ``always`` (``-z``); ``never``.
MODES = ("auto", "always", "never")


def check_mode(value: str) -> str:
    """``value`` if it is one of :data:`MODES`; a usage error otherwise."""
    if value not in MODES:
        from pdiffcopy.errors import UsageError

        raise UsageError(f"Invalid compression mode: {value!r} (expected auto, always or never)")
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


def pieces(ranges: Iterable[Tuple[int, int]]) -> Iterator[Tuple[int, int]]:
    """``ranges`` cut into pieces of at most :data:`FRAME_BYTES`: one frame each."""
    for offset, length in ranges:
        end = offset + length
        while offset < end:
            step = min(FRAME_BYTES, end - offset)
            yield offset, step
            offset += step


def frame(offset: int, data: "bytes | memoryview") -> bytes:
    """The header and the zstd frame of one piece."""
    compressed = compress(data)
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


def stream_compressor():
    """A zstd compressor for one whole streamed body (``Content-Encoding: zstd``), with a checksum."""
    return _zstd().ZstdCompressor(level=LEVEL, write_checksum=True).compressobj()


def accepts_zstd(header: "Optional[str]") -> bool:
    """Whether an ``Accept-Encoding`` header accepts zstd (RFC 9110, 12.5.3: ``q=0`` refuses it)."""
    for item in (header or "").split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() != ENCODING:
            continue
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


# -- whole streams (tree batches) -------------------------------------------------


def compressed_stream(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """``chunks`` as one zstd stream with a checksum, compressed as they come."""
    compressor = stream_compressor()
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

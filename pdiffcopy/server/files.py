"""The file views: a file's bytes at its own URL, and the operations a sync needs under ``/.pdiffcopy/``.

Views are thin: they parse the request (:mod:`~pdiffcopy.server.requests`), call
``local/`` and leave errors to the application's one handler; bytes are streamed
by :mod:`~pdiffcopy.server.streaming`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from typing import Iterator, List, Optional

from flask import Blueprint, Response, jsonify, request

from pdiffcopy.core import chunks as cdc
from pdiffcopy.core.blocks import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, ByteRange
from pdiffcopy.core.hashing import digest_size, validate_method
from pdiffcopy.core.protocol import LEASE_HEADER
from pdiffcopy.errors import (
    BadRequest,
    FileMissing,
    PayloadTooLarge,
    PdiffcopyError,
    RangeNotSatisfiable,
    ServerBusy,
    UsageError,
    storage_error,
)
from pdiffcopy.local.confinement import refuse_hard_links
from pdiffcopy.local.descriptors import process_umask
from pdiffcopy.local.filehash import cut_region
from pdiffcopy.server.leasetable import LEASE_SECONDS
from pdiffcopy.server.context import (
    API_PREFIX,
    HASH_RETRY_AFTER_SECONDS,
    HASH_SLOT_WAIT_SECONDS,
    MAX_CONCURRENT_HASHES,
    MAX_HASHES_PER_CLIENT,
    request_metrics,
    server_state,
)
from pdiffcopy.server.exports import ExportedDevice, drop_cached
from pdiffcopy.server.requests import (
    MAX_FILE_SIZE,
    binary_body,
    check_disjoint,
    check_preconditions,
    describe,
    file_or_device,
    hash_ranges,
    int_arg,
    lease_of_request,
    located,
    one_line,
    path_arg,
    refuse_export,
    require_temporary,
    seen,
    seen_unopened,
    served,
)
from pdiffcopy.server.streaming import ranged_response, receive_ranges

logger = logging.getLogger(__name__)

#: Most ranges one chunk list request may name (16 bytes each in its body): the finer pass
#: of a sync asks for the ranges the first pass left unmatched, fewer than this for any
#: file edited in places rather than rewritten.
MAX_CHUNK_RANGES = 65536

#: A range of a chunk list request: offset and length, little-endian.
CHUNK_RANGE_ENTRY = struct.Struct("<QQ")

#: An extent of a data map answer, and a range of a punch request: offset and length, little-endian.
EXTENT_ENTRY = CHUNK_RANGE_ENTRY

#: Most ranges one punch request may name (16 bytes each in its body).
MAX_PUNCH_RANGES = 65536

#: Chunks encoded per write of a chunk list answer (12 KiB): streamed, not held whole.
CHUNKS_PER_WRITE = 1024

#: Most moves one copy request may name (24 bytes each in its body), and most bytes it may
#: copy: a client sends at most engine.chunkdelta's COPY_REQUEST_MOVES and COPY_REQUEST_BYTES.
MAX_COPY_MOVES = 16384
MAX_COPY_REQUEST_BYTES = 1024 * 1024 * 1024

#: A move of a copy request: from offset, to offset, length, little-endian.
COPY_MOVE_ENTRY = struct.Struct("<QQQ")

files = Blueprint("files", __name__)


def renew(info: os.stat_result, path: str) -> None:
    """A leased read or flush: the lease must still be the client's; it is renewed."""
    lease = lease_of_request()
    if lease:
        server_state().leases.renew(info, lease, path)


@files.get(f"{API_PREFIX}/stat/<path:path>")
def stat_file(path: str):
    """Size, mtime and type of a file, and the free space beside it; or 404."""
    file = file_or_device(path)
    try:
        # A device is opened for its size and tag; a file's kind is looked at without opening it.
        description = describe(seen(file.read_descriptor(), path) if file.is_device else seen_unopened(file.status()))
    finally:
        file.close()
    free = file.free_space()
    if free is not None:
        description["free"] = free
    return jsonify(description)


@files.get(f"{API_PREFIX}/hashes/<path:path>")
def hashes(path: str):
    """The digests of the blocks of one range (offset, length) or of several (Range header)."""
    state = server_state()
    method = validate_method(request.args.get("method", ""))
    if method not in state.config.hash_methods:
        raise BadRequest(f"This server does not accept the hash method {method!r} (it accepts "
                         f"{', '.join(state.config.hash_methods)}); choose one with -m")
    block_size = int_arg("block_size", MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)
    file = file_or_device(path)
    try:
        found = seen(file.read_descriptor(), path)
        check_preconditions(found)
        renew(found.info, path)
        ranges = hash_ranges(block_size, found.size)
        # Checked before taking a slot: a bad request is refused at once.
        client = request.remote_addr or ""
        if not state.hash_slots.acquire(client, timeout=HASH_SLOT_WAIT_SECONDS):
            raise ServerBusy(f"Busy: {MAX_CONCURRENT_HASHES} hash requests are running "
                             f"(at most {MAX_HASHES_PER_CLIENT} per client while others wait); "
                             f"retry in {HASH_RETRY_AFTER_SECONDS} s", HASH_RETRY_AFTER_SECONDS)
        state.metrics.hash_jobs.inc()
        try:
            # (a device's holes, where it knows them, are not read; what is read leaves the cache)
            digests = file.hash_ranges(ranges, block_size, method)
            request_metrics().bytes_compared.inc(sum(length for _, length in ranges))
        finally:
            state.metrics.hash_jobs.dec()
            state.hash_slots.release(client)
    finally:
        file.close()
    response = Response(digests, mimetype="application/octet-stream")
    response.headers["X-Digest-Size"] = str(digest_size(method))
    response.headers["ETag"] = found.etag
    return response


@files.post(f"{API_PREFIX}/chunks/<path:path>")
def chunks_of_file(path: str):
    """The content-defined chunks of the file, or of the ranges in the body (``--delta chunks``).

    Cut here, on the server's cores, and streamed as they are cut: 12 bytes a chunk
    (its length and an 8-byte digest; offsets follow from the lengths).
    """
    state = server_state()
    try:
        average = cdc.check_average(int_arg("average", 0, cdc.MAX_AVERAGE))
    except UsageError as error:
        raise BadRequest(str(error)) from None
    asked = binary_body(CHUNK_RANGE_ENTRY.size, MAX_CHUNK_RANGES)
    fd = file_or_device(path).open_descriptor(os.O_RDONLY)
    try:
        found = seen(fd, path)
        check_preconditions(found)
        renew(found.info, path)
        ranges = [(offset, length) for offset, length in CHUNK_RANGE_ENTRY.iter_unpack(asked)] \
            if asked else ([(0, found.size)] if found.size else [])
        check_disjoint(ranges, found.size, ordered=True)
        request_metrics().bytes_compared.inc(sum(length for _, length in ranges))
        client = request.remote_addr or ""
        # Cutting is CPU and disk work, as hashing is: it takes one of the same slots.
        if not state.hash_slots.acquire(client, timeout=HASH_SLOT_WAIT_SECONDS):
            raise ServerBusy(f"Busy: {MAX_CONCURRENT_HASHES} hash requests are running; "
                             f"retry in {HASH_RETRY_AFTER_SECONDS} s", HASH_RETRY_AFTER_SECONDS)
    except BaseException:
        os.close(fd)
        raise
    state.metrics.hash_jobs.inc()

    def finished() -> None:
        # On the response's close, which the server calls whether or not the body was sent.
        os.close(fd)
        state.metrics.hash_jobs.dec()
        state.hash_slots.release(client)

    # Not direct_passthrough: Werkzeug then hands the bare generator to the server and
    # never calls the response's close.
    response = Response(_chunks_body(fd, ranges, average, path), mimetype="application/octet-stream")
    response.call_on_close(finished)
    response.headers["ETag"] = found.etag
    return response


@files.post(f"{API_PREFIX}/copy-ranges/<path:path>")
def copy_ranges(path: str):
    """Copy ranges of the file ``from`` to other offsets of the temporary file ``path``.

    The temporary takes the mode of ``from`` (even with no moves), as a clone of it would.

    The shift-tolerant delta builds a new temporary of a target from the old target's
    bytes that the source still has (wherever they moved) and the bytes it sends.
    """
    state = server_state()
    require_temporary(path)
    origin_path = path_arg("from")
    moves = [(offset, to, length) for offset, to, length
             in COPY_MOVE_ENTRY.iter_unpack(binary_body(COPY_MOVE_ENTRY.size, MAX_COPY_MOVES))]
    origin = served(origin_path)
    try:
        origin_size = os.fstat(origin.read_descriptor()).st_size
        temporary = served(path, follow=False)
        try:
            info = os.fstat(temporary.write_in_place())
            refuse_hard_links(info, path, state.config.write_hard_links)
            # Read from anywhere in the old file (twice, even); written once each, inside the file.
            check_disjoint([(offset, length) for offset, _, length in moves], origin_size, ordered=False,
                           overlap=True)
            # The ranges written must not overlap (nor leave the file: writes never grow it).
            check_disjoint([(to, length) for _, to, length in moves], info.st_size, ordered=False)
            if sum(length for _, _, length in moves) > MAX_COPY_REQUEST_BYTES:
                raise PayloadTooLarge(f"At most {MAX_COPY_REQUEST_BYTES} bytes per copy request")
            with state.leases.writing(info, lease_of_request(), path):
                # (it takes the old version's mode, as a clone of it would)
                copied = temporary.copy_within(origin, [cdc.Copy(to, offset, length) for offset, to, length in moves])
        finally:
            temporary.close()
    finally:
        origin.close()
    return jsonify(copied=copied)


@files.route("/<path:path>", methods=["GET", "HEAD"])
def read_file(path: str):
    """The file's bytes: all of them, one range (206), or several (multipart/byteranges)."""
    state = server_state()
    file = file_or_device(path)
    try:
        found = seen(file.read_descriptor(), path)
        check_preconditions(found)
        return ranged_response(file, found, request_metrics(), state.rate_limit)
    except BaseException:
        file.close()
        raise


@files.route("/<path:path>", methods=["PATCH"])
def write_ranges(path: str):
    """Write byte ranges into an existing file, in place."""
    state = server_state()
    file = file_or_device(path)
    try:
        found = seen(file.write_in_place(), path)
        check_preconditions(found)
        refuse_hard_links(found.info, path, state.config.write_hard_links)
        with state.leases.writing(found.info, lease_of_request(), path):
            written = receive_ranges(file, found.size, request_metrics(), state.rate_limit,
                                     sparse=request.args.get("sparse") == "1")
    finally:
        file.close()
    return jsonify(written=written)


@files.get(f"{API_PREFIX}/datamap/<path:path>")
def data_map(path: str):
    """Where the range ``offset``/``length`` of the file holds data: its extents, the rest are holes.

    At most MAX_DATA_MAP_EXTENTS extents (16 bytes each); an answer that long may have
    more after its last extent: ask again from there.
    """
    offset = int_arg("offset", 0, MAX_FILE_SIZE)
    length = int_arg("length", 0, MAX_FILE_SIZE)
    file = file_or_device(path)
    try:
        found = seen(file.read_descriptor(), path)
        check_preconditions(found)
        renew(found.info, path)
        extents = file.data_map(offset, length)  # (a device's own map, where it has one)
    finally:
        file.close()
    response = Response(b"".join(EXTENT_ENTRY.pack(start, size) for start, size in extents),
                        mimetype="application/octet-stream")
    response.headers["ETag"] = found.etag
    return response


@files.post(f"{API_PREFIX}/punch/<path:path>")
def punch_file(path: str):
    """Make the ranges in the body holes (zeros where the file system cannot), in place.

    With ``zeros=0`` the ranges hold zeros already: where the file system cannot punch they are
    left as they are, and the answer says ``"holes": false``. A write: refused like a PATCH
    while another client holds the lease, or when If-Match fails.
    """
    state = server_state()
    zeros = int_arg("zeros", 0, 1) == 1 if "zeros" in request.args else True
    ranges = [(offset, length) for offset, length
              in EXTENT_ENTRY.iter_unpack(binary_body(EXTENT_ENTRY.size, MAX_PUNCH_RANGES))]
    file = file_or_device(path)
    try:
        fd = file.write_in_place()
        found = seen(fd, path)
        check_preconditions(found)
        refuse_hard_links(found.info, path, state.config.write_hard_links)
        check_disjoint(ranges, found.size, ordered=True)
        with state.leases.writing(found.info, lease_of_request(), path):
            # A device's are discarded with -S (the client says sparse=1: a thin volume stays thin),
            # else zeroed by its own command; with zeros=0 (zeros already) left as they are.
            file.write_sparse(request.args.get("sparse") == "1")
            holes = file.punch_holes(ranges, write_zeros=zeros)
    finally:
        file.close()
    return jsonify(punched=sum(length for _, length in ranges), holes=holes)


@files.post(f"{API_PREFIX}/resize/<path:path>")
def resize_file(path: str):
    """Create the file if missing and make it exactly ``size`` bytes long.

    A file it makes gets the permission bits ``mode`` (less this server's umask with ``umask=1``),
    else the usual ``0o666`` less the umask; an existing file keeps its own.
    """
    state = server_state()
    size = int_arg("size", 0, MAX_FILE_SIZE)
    # Grown by a hole (the source is sparse): only this much data will be written.
    data_bytes = int_arg("data", 0, MAX_FILE_SIZE) if "data" in request.args else None
    mode = int_arg("mode", 0, 0o777) if "mode" in request.args else None
    if mode is not None and request.args.get("umask") == "1":
        mode &= ~process_umask()
    file = file_or_device(path)
    if isinstance(file, ExportedDevice):
        return _resize_device(file, path, size)
    try:
        fd, created = file.held_writer()
        try:
            if not created:
                refuse_hard_links(os.fstat(fd), path, state.config.write_hard_links)
            elif mode is not None:
                try:
                    os.fchmod(fd, mode)
                except OSError as error:
                    raise storage_error(error, f"set the mode of {path}") from None
            with state.leases.writing(os.fstat(fd), None if created else lease_of_request(), path):
                if data_bytes is None:
                    file.prepare(size)
                else:
                    file.prepare_sparse(size, data_bytes)
            return jsonify(describe(seen(fd, path)))
        except BaseException:
            if created:  # a refused resize leaves no new empty file behind
                with contextlib.suppress(PdiffcopyError):
                    file.unlink()
            raise
    finally:
        file.close()


@files.post(f"{API_PREFIX}/fsync/<path:path>")
def fsync_file(path: str):
    """Flush the file's data and its directory entry to disk."""
    file = file_or_device(path)
    fd = file.open_descriptor(os.O_RDONLY)
    try:
        renew(os.fstat(fd), path)
        try:
            os.fsync(fd)
        except OSError as error:
            raise storage_error(error, f"flush {path}") from None
        if file.is_device:
            drop_cached(fd, 0, 0)  # written through: the page cache is the VMs'
    finally:
        os.close(fd)
    if not file.is_device:  # (a device's name is not the sync's: nothing to make durable)
        file.flush_directory()
    return jsonify(flushed=True)


@files.post(f"{API_PREFIX}/clone/<path:path>")
def clone_file(path: str):
    """Create the temporary file ``path`` as a copy of ``from`` (reflink where possible)."""
    require_temporary(path)
    origin = served(path_arg("from"))
    try:
        temporary = origin.create_temporary(clone=True, relative=located(path)[1])
        temporary.close()
    finally:
        origin.close()
    return jsonify(method=temporary.clone_method)


@files.post(f"{API_PREFIX}/rename/<path:path>")
def rename_file(path: str):
    """Atomically replace ``to`` with the temporary file ``path``."""
    state = server_state()
    require_temporary(path)
    destination = path_arg("to")
    refuse_export(destination, "replace")
    temporary, target = served(path), served(destination, follow=False)
    try:
        replaced: Optional[os.stat_result] = target.status()  # the name itself, not where it leads
    except FileMissing:
        replaced = None
    # Replacing a file counts as writing it: not while another client holds its lease.
    with state.leases.writing(replaced, lease_of_request(), destination) if replaced \
            else contextlib.nullcontext():
        temporary.replace(target)
    return jsonify(renamed=True)


@files.post(f"{API_PREFIX}/lease/<path:path>")
def take_lease(path: str):
    """Take the write lease on a file: until it ends, nobody else may write it."""
    state = server_state()
    file = file_or_device(path)
    if isinstance(file, ExportedDevice):
        file.check_writable()
    fd = file.open_descriptor(os.O_RDONLY)
    try:
        lease = state.leases.acquire(os.fstat(fd), path)
    finally:
        os.close(fd)
    return jsonify(lease=lease, seconds=LEASE_SECONDS)


@files.delete(f"{API_PREFIX}/lease/<path:path>")
def end_lease(path: str):
    """End a write lease; 412 when it lapsed and somebody else wrote meanwhile."""
    state = server_state()
    lease = lease_of_request()
    if not lease:
        raise BadRequest(f"Missing header: {LEASE_HEADER}")
    fd = file_or_device(path).open_descriptor(os.O_RDONLY)
    try:
        state.leases.release(os.fstat(fd), lease, path)
    finally:
        os.close(fd)
    return jsonify(released=True)


@files.post(f"{API_PREFIX}/sweep/<path:path>")
def sweep_beside(path: str):
    """Remove the temporaries beside ``path`` whose writers are gone (docs/design.rst, "Temporaries")."""
    removed = file_or_device(path, follow=False).sweep_temporaries()  # (none beside a device)
    if removed:
        logger.info("Removed %d temporary file(s) of interrupted runs beside %s", removed, one_line(path))
    return jsonify(removed=removed)


@files.delete(f"{API_PREFIX}/temporary/<path:path>")
def delete_temporary(path: str):
    """Remove a temporary file left by an aborted atomic sync."""
    require_temporary(path)
    served(path, follow=False).unlink()
    return jsonify(removed=True)


def _chunks_body(fd: int, ranges: List[ByteRange], average: int, path: str) -> Iterator[bytes]:
    """The chunk list of ``ranges`` of ``fd``, sent as it is cut (the caller closes ``fd``)."""
    pending: List[cdc.Chunk] = []
    try:
        for offset, length in ranges:
            for window in cut_region(fd, offset, length, average):
                pending.extend(window)
                if len(pending) >= CHUNKS_PER_WRITE:
                    yield cdc.encode(pending)
                    pending = []
    except (OSError, EOFError) as error:
        # Mid-answer nothing can be said any more: the client sees a short list and refuses it.
        logger.warning("Cutting %s failed: %s", one_line(path), error)
        return
    if pending:
        yield cdc.encode(pending)


def _resize_device(device: ExportedDevice, path: str, size: int):
    """A resize of a device: it keeps its size, so only a size it holds is accepted (writes
    never grow it); refused like any write on a read-only export or while another client leases it."""
    state = server_state()
    try:
        fd = device.write_in_place()
        found = seen(fd, path)
        with state.leases.writing(found.info, lease_of_request(), path):
            if size > found.size:
                raise RangeNotSatisfiable(f"Cannot make {path} {size} bytes long: it is a block device of "
                                          f"{found.size} bytes, and a device keeps its size", found.size)
        return jsonify(describe(found))
    finally:
        device.close()

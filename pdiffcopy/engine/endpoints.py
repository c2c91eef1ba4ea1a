"""One interface for a file, wherever it is.

A sync talks to its source and its target through :class:`FileEndpoint`:
a local file (:mod:`pdiffcopy.local.localfile`) and a file behind a pdiffcopy server
(:mod:`pdiffcopy.transport.remote`) offer the same few operations, so the sync logic
is written once and one test suite exercises both. What only some kinds can do
comes in capabilities (:mod:`pdiffcopy.engine.capabilities`), each operation stated once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pdiffcopy.core.records import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.engine.capabilities import Capability, check_declared
from pdiffcopy.errors import Unsupported

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future

    from pdiffcopy.core import chunks as cdc

#: A piece of file data and where it belongs: (offset, bytes-like).
Chunk = Tuple[int, "bytes | memoryview"]


@dataclass(frozen=True)
class FileInfo:
    """What a sync needs to know about a file."""

    kind: str  # "file", "device" (a block device: a file of fixed size), "directory" or "other"
    size: int
    mtime_ns: int
    etag: str
    #: The permission bits (``st_mode & 0o7777``); None where the file's side does not say (a 1.0.1 server).
    mode: Optional[int] = None


# -- capabilities: each operation's contract, and (its body) what a kind without it gives


class HashingHere(Capability):
    """Hashed in this process (a local file): in this thread, or in a pool of hash processes, and
    through the page cache, which a whole-file copy may keep clean."""

    def hash_ranges(self, ranges: Sequence[ByteRange], block_size: int, method: str) -> bytes:
        """The block digests of ``ranges``, hashed in this thread (a tree's worker, refinement).

        Without it: :meth:`~FileEndpoint.submit_hashes`, waited for."""
        if not ranges:
            return b""
        return self.submit_hashes(ranges, block_size, method).result()

    def hashes_here(self) -> bool:
        """Whether hashing this file runs in this process (and so wants :meth:`use_hash_pool`).

        Without it: no, the file is hashed elsewhere."""
        return False

    def use_hash_pool(self, pool: "Executor") -> None:
        """Hash in ``pool`` from now on (see :meth:`hashes_here`). Without it: nothing to do."""

    def start_hash_pool(self, concurrency: int, cuts_likely: bool = False) -> "Optional[Executor]":
        """Start ``concurrency`` processes that hash files of this kind here.

        Called before the sync starts any thread (forking a process with threads can deadlock it).
        Without it: None, nothing hashes here.

        :param cuts_likely: The sync may cut content-defined chunks: the processes load the
                            chunker while the sync's first requests wait on the other side.
        """
        return None

    def cache_mode(self, cache: str, size: int) -> str:
        """``"drop"`` or ``"keep"``: what the page cache policy ``cache`` means for a copy of ``size`` bytes.

        Only a local whole-file copy decides by size (``"auto"``). Without it: the cache is
        kept unless asked otherwise.
        """
        return "keep" if cache == "auto" else cache

    def keep_out_of_cache(self) -> None:
        """Drop what hashing reads from the page cache (whole-file copies that bypass it). A hint.

        Without it: ignored (no page cache of ours)."""

    def use_cache(self, cache: str) -> None:
        """Read and write by the sync's page cache policy (``--cache``), told at its start: a block
        device drops what it read and wrote, bypasses the cache (``direct``) or keeps it. A hint.

        Without it: ignored."""


class PriorityHashing(Capability):
    """Hashed elsewhere (by a server), where the few small hashes of refinement can jump the queue."""

    def submit_hashes_first(self, ranges: Sequence[ByteRange], block_size: int, method: str
                            ) -> "Future[bytes]":
        """Like :meth:`FileEndpoint.submit_hashes`, but not queued behind the hashes submitted before.

        Refinement waits on these while the whole segments are still being hashed:
        behind them in one queue, no piece could move before the last segment was
        hashed (a file hashed here is hashed in the waiting thread instead, see
        :func:`~pdiffcopy.engine.segments.hash_both`). Without it: :meth:`~FileEndpoint.submit_hashes`.
        """
        return self.submit_hashes(ranges, block_size, method)

    def hashes_pieces_cheaply(self) -> bool:
        """Whether hashing a few small ranges costs no more than their digests (sub-block refinement).

        A pdiffcopy 1.0.1 server hashes only whole files, or not at all in our
        methods (then the data is read to hash it here): no. Without it: yes.
        """
        return True


class KernelCopies(Capability):
    """Data copied between two files without passing through this process (two local files)."""

    def can_copy_from(self, other: "FileEndpoint") -> bool:
        """Whether :meth:`copy_ranges_from` and :meth:`copy_all_from` can take data from ``other``.

        Without it: never."""
        return False

    def copy_ranges_from(self, other: "FileEndpoint", ranges: Iterable[ByteRange]) -> int:
        """Copy ``ranges`` of ``other`` into this file, inside the kernel; return the bytes written.

        :raises Unsupported: Unless :meth:`can_copy_from` says yes (always, without it).
        """
        raise Unsupported(f"Cannot copy from {other.location} into {self.location} directly")

    def copy_all_from(self, other: "FileEndpoint", size: int, cache: str,
                      progress: Optional[Callable[[int], None]] = None,
                      on_step: Optional[Callable[[int, str], None]] = None) -> str:
        """Copy the whole of ``other`` into this file, the fastest way there is; return the way used.

        ``progress`` and ``on_step`` are passed to :func:`pdiffcopy.local.fastcopy.copy_into`.

        :raises Unsupported: Unless :meth:`can_copy_from` says yes (always, without it).
        """
        raise Unsupported(f"Cannot copy from {other.location} into {self.location} directly")


class Holes(Capability):
    """Sparse files: holes read as zeros and are never read, hashed or sent, only made again."""

    def data_map(self, offset: int, length: int) -> List[ByteRange]:
        """The extents of ``[offset, offset + length)`` that hold data, in order; the rest are holes.

        At most :data:`~pdiffcopy.core.datamap.MAX_DATA_MAP_EXTENTS` extents: with that many,
        ask again from the end of the last one (:func:`~pdiffcopy.engine.segments.iter_data_map`).
        Without it: everything is data (a 1.0.1 server cannot tell).
        """
        return [(offset, length)] if length > 0 else []

    def prepare_sparse(self, size: int, data_bytes: int) -> None:
        """:meth:`FileEndpoint.prepare`, growing by a hole: the source has holes, and only
        ``data_bytes`` will be written.

        The growth is not reserved, and only as much of it as ``data_bytes`` is checked
        against the free space. Without it: :meth:`~FileEndpoint.prepare` (dense, as ever).
        """
        self.prepare(size)

    def punch_ranges(self, ranges: Sequence[ByteRange], write_zeros: bool = True) -> int:
        """Make ``ranges`` holes (zeros that take no space); return the bytes covered.

        Where the file system cannot punch, zeros are written (and a warning given once).
        Without it: zeros are written, the same bytes, dense (or, without ``write_zeros``, nothing).

        :param write_zeros: False when ``ranges`` hold zeros already and only their space is to
                            be freed: where the file system cannot punch, they are left as they
                            are (no warning), and only the bytes that became holes are counted.
        """
        ranges = list(ranges)
        return self.write_ranges(ranges, _zeros(ranges)) if write_zeros else 0

    def write_sparse(self, enabled: bool) -> None:
        """``--sparse``: turn runs of zeros (whole file system blocks) in what is written into holes.

        Without it: ignored, the zeros are written."""


class ContentChunks(Capability):
    """The shift-tolerant delta (``--delta chunks``): files cut where they are, copies on the target's side."""

    def cut_chunks(self, ranges: Sequence[ByteRange], average: int) -> "List[cdc.Chunk]":
        """The content-defined chunks (:mod:`pdiffcopy.core.chunks`) of each of ``ranges``, in order.

        Cut where the file is (a server cuts its own files on its own cores), so only
        the list, 12 bytes a chunk, crosses the network.

        :raises Unsupported: Where the file cannot be cut there (always, without it): the
                             engine falls back to blocks.
        """
        raise Unsupported(f"Cannot cut {self.location} into content-defined chunks")

    def free_space(self) -> Optional[int]:
        """Bytes free for a new file in this file's directory, or None when unknown (an older server).

        The shift-tolerant delta writes a whole new temporary: it asks first, and without room
        the block delta updates the file in place instead. Without it: None (the engine
        assumes enough).
        """
        return None

    def can_copy_within(self, origin: "FileEndpoint") -> bool:
        """Whether :meth:`copy_within` can copy from ``origin`` without the data crossing a network.

        True where both files are on the same side: two local files, or two files of one
        server. Without it: never.
        """
        return False

    def copy_within(self, origin: "FileEndpoint", moves: Sequence[cdc.Copy]) -> int:
        """Copy ranges of ``origin`` (the old target) to other offsets of this file; return the bytes copied.

        Each move copies ``origin``'s bytes at ``target_offset`` to ``source_offset`` here (the
        offset they have in the source, which this file becomes). This file also takes
        ``origin``'s mode (even with no moves), as a clone of it would.

        :raises Unsupported: Unless :meth:`can_copy_within` says yes (always, without it).
        """
        raise Unsupported(f"Cannot copy from {origin.location} into {self.location} on their side")


class PartialFiles(Capability):
    """``--partial``: a sibling kept when a sync is interrupted, and the stale temporaries swept."""

    def open_partial(self, clone: bool) -> "Tuple[FileEndpoint, bool]":
        """The hidden ``--partial`` sibling to write into, kept when the sync is interrupted.

        The one an earlier, interrupted run left (then the second value is
        True and the sync resumes into it as into an existing target), else
        a new one, a copy of this file when ``clone``. Its name is stable
        (:func:`~pdiffcopy.core.protocol.partial_name`), so that the next run
        finds it; it is removed only by its rename over this file and by the
        sweeps of temporaries untouched for a day.

        :raises Unsupported: Where there is no such sibling (a 1.0 server, and always without
                             it): the sync then writes a temporary, as without ``--partial``.
        """
        raise Unsupported(f"Cannot keep a partial file of {self.location}")

    def sweep_temporaries(self) -> int:
        """Remove stale temporaries that killed runs left beside this file; return how many.

        Without it: none removed."""
        return 0


class Leases(Capability):
    """Other writers kept out while a sync updates a file in place (or resumes a partial file)."""

    def take_lease(self) -> None:
        """Keep every other writer out of this file until :meth:`end_lease` (for in-place updates).

        A sync that updates a file in place trusts its first digests of the
        blocks it does not write; a second writer would make that a lie.
        Without it: nothing keeps other writers out.

        :raises Locked: When another client is writing the file.
        """

    def leases_stop_other_writers(self) -> bool:
        """Whether, while somebody holds this file's lease, writes without it are refused.

        A server's files: yes (423), and a lease cannot be taken while such a
        write is under way. A local file's lock is advisory: no. Without it: no.
        """
        return False

    def end_lease(self) -> None:
        """Let other writers in again. Without it: nothing to end.

        :raises Conflict: When the lease lapsed and somebody else wrote the file meanwhile.
        """


#: Every capability of a file, for the contract suite.
CAPABILITIES = (HashingHere, PriorityHashing, KernelCopies, Holes, ContentChunks, PartialFiles, Leases)


class FileEndpoint(HashingHere, PriorityHashing, KernelCopies, Holes, ContentChunks, PartialFiles, Leases, ABC):
    """A file that can be hashed, read and written by byte ranges: the operations every sync needs.

    What a kind of file can do beyond these, it names in :attr:`capabilities` and implements
    whole (:class:`HashingHere`, :class:`PriorityHashing`, :class:`KernelCopies`,
    :class:`Holes`, :class:`ContentChunks`, :class:`PartialFiles`, :class:`Leases`). The
    engine still asks by method, never by type: a file without a capability answers with
    the capability's fallback ("unsupported", or the portable way).
    """

    #: The path or URL the user gave, for messages.
    location: str
    #: The capabilities this kind implements (the others are their fallbacks).
    capabilities: Tuple[type, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        check_declared(cls, CAPABILITIES)

    @abstractmethod
    def stat(self) -> Optional[FileInfo]:
        """Describe the file, or return None when it does not exist."""

    @abstractmethod
    def submit_hashes(self, ranges: Sequence[ByteRange], block_size: int, method: str
                      ) -> "Future[bytes]":
        """Start hashing the blocks of block-aligned ``ranges``; the future gives the digests.

        Blocks the file does not (fully) have hash what there is of them.
        """

    @abstractmethod
    def prepare(self, size: int) -> None:
        """Create the file if needed and make it exactly ``size`` bytes long."""

    @abstractmethod
    def read_ranges(self, ranges: Iterable[ByteRange]) -> Iterator[Chunk]:
        """Yield the data of ``ranges`` as chunks, in order.

        A chunk may be a view of a buffer that the next chunk reuses (a local
        file's and a remote file's both are: no copy per chunk): use or copy
        each chunk before asking for the next one.
        """

    @abstractmethod
    def write_ranges(self, ranges: Iterable[ByteRange], chunks: Iterator[Chunk]) -> int:
        """Write ``chunks`` (exactly the data of ``ranges``) in place; return bytes written."""

    @abstractmethod
    def flush(self) -> None:
        """Make written data durable (fsync)."""

    @abstractmethod
    def create_temporary(self, clone: bool) -> "FileEndpoint":
        """Create a hidden sibling to write into, as a copy of this file when ``clone``."""

    @abstractmethod
    def replace(self, other: "FileEndpoint") -> None:
        """Atomically rename this (temporary) file over ``other``."""

    @abstractmethod
    def remove_temporary(self) -> None:
        """Remove this temporary file (after a failure)."""

    def exists(self) -> bool:
        """Whether anything has the file's name (a dangling symlink of a local file does).

        The engine asks this, never the file system: a remote file's location is a URL, and a
        confined file's location need not be a path that can be opened. By default a stat.
        """
        return self.stat() is not None

    def close(self) -> None:
        """Release descriptors, connections and workers."""


    # -- checks before a sync writes: each kind makes what it can --------------------------

    def is_same_file(self, other: "FileEndpoint") -> bool:
        """Whether ``other`` is this very file (a sync onto itself); False when that cannot be told."""
        return False

    def check_readable(self) -> None:
        """Fail now, with a clear message, if the file cannot be read; by default the first read tells.

        A remote file's server checks when it first reads; a local file is opened here.
        """

    def pin(self, info: FileInfo) -> None:
        """Fail later operations if the file no longer matches ``info``.

        Remote endpoints send ``If-Match``; by default only the sync's check at the end
        (the same size and time) sees a change.
        """

    def use_mode(self, mode: int, new: bool) -> None:
        """The permissions of the files made for this one that are not clones of it (the temporary
        of a new target, of a ``--whole-file`` one): ``mode`` as it is (this file's own: it exists),
        or, ``new``, ``mode & 0o777`` less the umask of the side that makes them (the source's
        mode: a new copy never gets more than its source has, rsync's rule without ``-p``).

        By default ignored: the side's own default mode (``0o666`` less its umask).
        """


def _zeros(ranges: Sequence[ByteRange], chunk: int = 1024 * 1024) -> Iterator[Chunk]:
    """Zero bytes for ``ranges``, in chunks of one reused buffer."""
    zeros = memoryview(bytes(chunk))
    for offset, length in ranges:
        for start in range(offset, offset + length, chunk):
            yield start, zeros[: min(chunk, offset + length - start)]



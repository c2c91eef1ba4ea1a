"""The options of a file sync and of a tree sync, and their one check.

:class:`FileOptions` says how one file is synced; :class:`TreeOptions` extends
it with what only a tree has. Both check and normalise their values when made
(sizes such as ``"1M"`` become bytes, the piece size is resolved against the
block size, a bad value raises :class:`~pdiffcopy.errors.UsageError`), so that
whoever makes them (:mod:`pdiffcopy.api`, the command line, a library caller of
the engine) gets the same rules, and the engine reads checked values only.
"""

from __future__ import annotations

import os
from pdiffcopy.core.records import dataclass
from typing import Optional, Tuple

from pdiffcopy.core.blocks import DEFAULT_BLOCK_SIZE, parse_block_size
from pdiffcopy.core.compression import check_mode
from pdiffcopy.core.hashing import DEFAULT_HASH_METHOD, validate_method
from pdiffcopy.core.ratelimit import bandwidth_limit
from pdiffcopy.core.refine import resolve_piece_size
from pdiffcopy.engine.treeendpoints import MetadataOptions
from pdiffcopy.errors import UsageError

#: Most worker processes or connections a user may ask for.
MAX_CONCURRENCY = 256

#: Workers (processes, connections) when the caller names none: two keeps a
#: tree sync's listing, planning and first units overlapped on the smallest
#: machines; the command line and :func:`pdiffcopy.sync` default to the CPU count.
DEFAULT_CONCURRENCY = 2

#: The delta modes, by ``--delta`` name: chosen per file from a small sample (the default:
#: pdiffcopy.engine.autodelta), fixed blocks compared in place (files changed in place: disk
#: images, databases), or content-defined chunks (files whose bytes move: archives, logs, dumps).
DELTA_MODES = ("auto", "blocks", "chunks")
DEFAULT_DELTA = "auto"

#: Page cache policies of whole-file copies between local files; ``direct``: block devices are
#: read and written around the cache (O_DIRECT), files as with ``drop``.
CACHE_MODES = ("auto", "drop", "keep", "direct")


@dataclass(frozen=True)
class FileOptions:
    """How one file is synced; a tree sync's options (:class:`TreeOptions`) extend these.

    Checked when made: see the module's docstring.
    """

    #: Bytes, or a size such as ``"1MiB"`` (:func:`~pdiffcopy.core.blocks.parse_block_size`).
    block_size: "int | str" = DEFAULT_BLOCK_SIZE
    hash_method: str = DEFAULT_HASH_METHOD
    #: Skip the comparison and copy every block.
    whole_file: bool = False
    #: None: the CPU count.
    concurrency: Optional[int] = DEFAULT_CONCURRENCY
    #: Only compare and report; change nothing.
    dry_run: bool = False
    #: Write a temporary sibling and rename it over the target at the end.
    atomic: bool = False
    #: Page cache policy of whole-file copies between local files (auto, drop, keep or direct).
    cache: str = "auto"
    #: Most bytes per second on the network, both directions, all workers together: an int or
    #: rsync's ``--bwlimit`` syntax (``"50M"``, checked by ratelimit.bandwidth_limit); None or 0:
    #: no limit. Local files and trees ignore it. Bytes per second (0: none) once checked.
    bwlimit: "int | str | None" = None
    #: zstd on the wire: "auto" (when it pays), "always" (-z), "never" (--no-compress) or a
    #: level (--compress-level: always, at that level).
    compress: "str | int" = "auto"
    #: Changed blocks are hashed again in pieces of this size (bytes, or ``"4K"``) and only the
    #: pieces that differ move (:mod:`pdiffcopy.core.refine`); 0: off; None:
    #: :data:`~pdiffcopy.core.refine.DEFAULT_PIECE_SIZE` where it divides the block size.
    #: Bytes (0: off) once checked.
    piece_size: "int | str | None" = None
    #: Write a new (or --atomic) target into a hidden partial file that an interrupted sync
    #: keeps and the next one resumes (rsync's --partial), instead of a removed temporary.
    partial: bool = False
    #: How changes are found: "auto" (chosen per file: pdiffcopy.engine.autodelta), "blocks"
    #: (fixed blocks compared in place) or "chunks" (content-defined chunks that find moved
    #: bytes: pdiffcopy.engine.chunkdelta).
    delta: str = DEFAULT_DELTA
    #: Also turn runs of zeros (whole file system blocks) in the data written into holes
    #: (rsync's ``-S``); the source's own holes stay holes either way.
    sparse: bool = False
    #: With a digest record (``--digest-file``): read the whole target anyway, compare it with the
    #: record (blocks that differ are reported and synced) and make the record again.
    verify_whole: bool = False

    def __post_init__(self) -> None:
        # The one check. It is idempotent: dataclasses.replace() checks a checked value again.
        block_size = parse_block_size(self.block_size)
        checked = dict(
            block_size=block_size,
            piece_size=resolve_piece_size(self.piece_size, block_size),
            hash_method=validate_method(self.hash_method),
            concurrency=check_concurrency(self.concurrency),
            cache=check_cache(self.cache),
            bwlimit=bandwidth_limit(self.bwlimit),
            compress=check_mode(self.compress),
            delta=check_delta(self.delta),
            partial=bool(self.partial),
            sparse=bool(self.sparse),
            verify_whole=bool(self.verify_whole),
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # (frozen)


@dataclass(frozen=True)
class TreeOptions(FileOptions):
    """Everything a tree sync can be asked to do differently: a file's options, and these.

    Of the file options, ``cache`` is not used: big members go by ranges, never by a whole-file copy.
    """

    times: bool = False
    owner: bool = False
    checksum: bool = False
    delete: bool = False
    force: bool = False
    fsync: bool = False
    xattrs: bool = False  # -X: extended attributes
    acls: bool = False  # -A: POSIX ACLs
    numeric_ids: bool = False  # ACL entries by number between hosts, not by name
    hard_links: bool = False  # -H: names sharing a file in the source share one in the target
    #: --devices: character and block devices made as nodes (as root; skipped with a warning otherwise).
    devices: bool = False
    #: --specials: fifos and unix sockets made as nodes.
    specials: bool = False
    #: --copy-devices: a block device of a local source is copied as a regular file of its contents.
    copy_devices: bool = False
    includes: Tuple[str, ...] = ()
    excludes: Tuple[str, ...] = ()
    rules: Tuple[Tuple[str, str], ...] = ()  # rsync's (+/-, glob) in command-line order
    files_from: Optional[Tuple[str, ...]] = None  # --files-from's paths (None: every path)
    #: Make the target directory's missing parents (rsync's --mkpath); without it, as rsync, only
    #: the target directory itself is made, and its parent must exist.
    mkpath: bool = False
    #: --link-dest, --copy-dest or --compare-dest (``alternate_use``: "link", "copy" or "compare"):
    #: directories on the target's side (relative to the target) whose files are taken when they are
    #: what the source has (:meth:`~pdiffcopy.engine.treeendpoints.Alternates.take_from_alternates`).
    alternate_dirs: Tuple[str, ...] = ()
    alternate_use: str = ""
    #: --backup: what the sync replaces or deletes is kept as NAME + ``backup_suffix``, or (--backup-dir)
    #: moved into ``backup_dir`` (relative to the target) under its path; ``suffix`` is --suffix.
    backup: bool = False
    backup_dir: str = ""
    suffix: Optional[str] = None
    #: --delete-excluded: what the filters leave out of the target is deleted too (implies --delete).
    delete_excluded: bool = False
    #: --max-delete: at most this many deletions; the rest are left, and the sync exits 25.
    max_delete: Optional[int] = None
    #: -m: directories that would hold nothing once filtered are not made.
    prune_empty_dirs: bool = False
    #: Symlinks synced as symlinks; False (rsync's -r without -l): left out, with a warning.
    symlinks: bool = True
    #: rsync's transfer rules and quick check (core.treeplan.PlanOptions says what each does).
    update: bool = False
    existing: bool = False
    ignore_existing: bool = False
    size_only: bool = False
    ignore_times: bool = False
    modify_window: int = 0
    max_size: Optional[int] = None
    min_size: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alternate_dirs and self.alternate_use not in ALTERNATE_USES:
            raise UsageError(f"Invalid use of the alternate directories: {self.alternate_use!r} "
                             f"(expected link, copy or compare)")
        if len(self.alternate_dirs) > MAX_ALTERNATE_DIRS:
            raise UsageError(f"At most {MAX_ALTERNATE_DIRS} --{self.alternate_use}-dest directories, "
                             f"as in rsync (got {len(self.alternate_dirs)})")
        if any(not directory for directory in self.alternate_dirs):
            raise UsageError(f"--{self.alternate_use}-dest needs a directory")
        if isinstance(self.modify_window, bool) or not isinstance(self.modify_window, int):
            raise UsageError(f"Invalid --modify-window: {self.modify_window!r} (expected a whole number of seconds)")
        if self.max_delete is not None and (isinstance(self.max_delete, bool) or not isinstance(self.max_delete, int)
                                            or self.max_delete < 0):
            raise UsageError(f"Invalid --max-delete: {self.max_delete!r} (expected a whole number, 0 or more)")
        if self.backup and not self.backup_dir and not self.backup_suffix:
            raise UsageError("--suffix cannot be empty without --backup-dir (as in rsync)")
        if "/" in self.backup_suffix or "\0" in self.backup_suffix:
            raise UsageError(f"--suffix {self.backup_suffix!r}: a suffix cannot hold a slash")

    @property
    def backup_suffix(self) -> str:
        """What ends a backup's name: --suffix, else rsync's "~" (nothing with --backup-dir)."""
        if self.suffix is not None:
            return self.suffix
        return "" if self.backup_dir else "~"

    def backup_path(self, path: str) -> str:
        """Where the target's old version of ``path`` is kept (relative to the target)."""
        kept = f"{self.backup_dir.rstrip('/')}/{path}" if self.backup_dir else path
        return kept + self.backup_suffix

    @property
    def asked_writes(self) -> Tuple[str, ...]:
        """What this sync asks of its target that an export may refuse (core.exportconfig's REFUSABLE)."""
        asked = {"delete": self.delete, "owner": self.owner, "hard-links": self.hard_links, "xattrs": self.xattrs,
                 "acls": self.acls, "devices": self.devices or self.specials}
        return tuple(name for name, wanted in asked.items() if wanted)

    @property
    def metadata(self) -> MetadataOptions:
        return MetadataOptions(times=self.times, owner=self.owner, fsync=self.fsync, xattrs=self.xattrs,
                               acls=self.acls, numeric_ids=self.numeric_ids, sparse=self.sparse)


#: What --link-dest, --copy-dest and --compare-dest do with a file found in their directories.
ALTERNATE_USES = ("link", "copy", "compare")
#: rsync's limit on those directories.
MAX_ALTERNATE_DIRS = 20


def file_options(*, concurrency: Optional[int] = None, **values) -> FileOptions:
    """The options of a file sync (see :func:`pdiffcopy.api.sync`), checked before anything opens.

    As :class:`FileOptions`, but without ``concurrency`` a file sync takes every CPU.

    :raises UsageError: For a value that makes no sense.
    """
    return FileOptions(concurrency=concurrency, **values)


def check_concurrency(value: Optional[int]) -> int:
    """``value`` workers, or the CPU count for None.

    :raises UsageError: Outside 1 to :data:`MAX_CONCURRENCY`.
    """
    if value is None:
        return max(1, os.cpu_count() or 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise UsageError(f"Invalid concurrency: {value!r} (expected 1 to {MAX_CONCURRENCY})")
    return value


def check_cache(value: str) -> str:
    if value not in CACHE_MODES:
        raise UsageError(f"Invalid cache mode: {value!r} (expected auto, drop, keep or direct)")
    return value


def check_delta(mode: str) -> str:
    """``mode`` if it names a delta mode.

    :raises UsageError: Naming the modes there are.
    """
    if mode not in DELTA_MODES:
        raise UsageError(f"Invalid delta mode: {mode!r} (expected {', '.join(DELTA_MODES[:-1])} or {DELTA_MODES[-1]})")
    return mode


__all__ = ["ALTERNATE_USES", "CACHE_MODES", "DEFAULT_CONCURRENCY", "DEFAULT_DELTA", "DELTA_MODES",
           "MAX_ALTERNATE_DIRS", "MAX_CONCURRENCY", "FileOptions", "TreeOptions", "check_concurrency", "file_options"]

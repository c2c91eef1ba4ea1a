"""The walk of a local tree: its directories read in name order, a batch of entries at a time;
and the removal of one below a directory, at any depth (:func:`remove_all`).

:class:`~pdiffcopy.local.localtree.LocalTree` lists itself with it, and a server's tree view
sends what it finds as it comes (:class:`Directories`). Depth first without recursion, one
descriptor open per level; stale temporaries removed on the way when asked.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Callable, Iterator, List, Optional, Tuple

from pdiffcopy.core.entries import FILE, OTHER, Entry, device_target, is_device, kind_of, known_mode, shared_mode
from pdiffcopy.core.protocol import MAX_PATH_LENGTH
from pdiffcopy.engine.treeendpoints import Failure, MetadataOptions
from pdiffcopy.local.confinement import link_group
from pdiffcopy.local.descriptors import is_temporary_name
from pdiffcopy.local.sweep import remove_if_abandoned
from pdiffcopy.local.treenodes import device_as_file
from pdiffcopy.local.xattrs import read_attributes

logger = logging.getLogger(__name__)

#: Paths of at most this many characters are at most MAX_PATH_LENGTH bytes
#: (a character is at most 4 bytes in UTF-8): only longer ones are encoded to check.
SURELY_SHORT = MAX_PATH_LENGTH // 4

#: Entries a walk gathers before it hands them on (:meth:`~pdiffcopy.local.localtree.LocalTree.walk`):
#: the server sends a listing in pieces of this many, so that it holds a few
#: hundred KB of it rather than the whole (200,000 entries took 128 MiB).
WALK_BATCH_ENTRIES = 2048


def why(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else str(error)


def entry_from_stat(path: str, info: os.stat_result, target: str = "",
                    xattrs: Tuple[Tuple[str, bytes], ...] = ()) -> Entry:
    """An :class:`Entry` from an ``lstat`` result (and the attributes read for it); a device's
    target is its numbers."""
    kind = kind_of(info.st_mode)
    if kind == OTHER and is_device(info.st_mode):
        target = device_target(info.st_rdev)
    size = info.st_size if kind == FILE else 0
    sparse = kind == FILE and info.st_blocks * 512 < size
    return Entry(path, kind, size, info.st_mtime_ns, shared_mode(info.st_mode), info.st_uid, info.st_gid,
                 target, info.st_nlink, sparse, link_group(info) if kind == FILE else "", xattrs)


#: A directory a walk is in: its descriptor, its path below the tree, and the
#: names of its subdirectories still to walk (None until it has been scanned).
Frame = Tuple[int, str, Optional[List[str]]]


class Directories:
    """A walk's batches (:meth:`~pdiffcopy.local.localtree.LocalTree.walk`); :meth:`close` releases its directories.

    Closing works even before the first batch was asked for (a HEAD request,
    a client gone at once), which closing a generator that never started
    would not: the directories still to read are closed either way.
    """

    def __init__(self, batches: Iterator[Tuple[List[Entry], List[Failure]]],
                 pending: List[Frame]) -> None:
        self._batches = batches
        self._pending = pending

    def __iter__(self) -> "Directories":
        return self

    def __next__(self) -> Tuple[List[Entry], List[Failure]]:
        return next(self._batches)

    def close(self) -> None:
        self._batches.close()  # type: ignore[attr-defined]
        close_pending(self._pending)


def close_pending(pending: List[Frame]) -> None:
    """Close the descriptors of the directories a walk has not read (an abandoned walk leaks none)."""
    while pending:
        os.close(pending.pop()[0])


def walk_from(frames: List[Frame], location: str, sweep: bool = False, attributes: Optional[MetadataOptions] = None,
              devices_as_files: bool = False, descend: Optional[Callable[[str], bool]] = None
              ) -> Iterator[Tuple[List[Entry], List[Failure]]]:
    """Yield what the walk found, at most about :data:`WALK_BATCH_ENTRIES` entries at a time.

    Depth first without recursion: a frame per directory on the current
    path, with the names of its subdirectories still to list, so one
    descriptor is open per level, not per pending directory (a directory
    of thousands of subdirectories would exhaust the descriptors). The
    lists yielded are emptied and reused afterwards: a consumer takes
    what it needs from them before it asks for more. With ``descend``, only
    the subdirectories whose paths it takes are entered.
    """
    entries: List[Entry] = []
    failures: List[Failure] = []
    swept: Optional[List[str]] = [] if sweep else None
    try:
        while frames:
            fd, relative, names = frames[-1]
            if names is None:  # not scanned yet
                names = []
                for _ in scan(fd, relative, entries, failures, names, swept, attributes, devices_as_files):
                    yield entries, failures
                    entries.clear()
                    failures.clear()
                names.reverse()  # popped from the end: walked in name order
                frames[-1] = (fd, relative, names)
            if not names:
                os.close(fd)
                frames.pop()
                continue
            name = names.pop()
            path = f"{relative}/{name}" if relative else name
            if descend is not None and not descend(path):
                continue
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                continue  # deleted while listed
            except OSError as error:
                failures.append((path, f"cannot list: {why(error)}"))
                continue
            frames.append((child, path, None))
        if entries or failures:
            yield entries, failures
    finally:
        close_pending(frames)
    if swept:
        logger.info("Removed %d stale temporary file(s) left in %s by interrupted runs, e.g. %s",
                    len(swept), location, swept[0])



def scan(fd: int, relative: str, entries: List[Entry], failures: List[Failure],
          subdirectories: List[str], swept: Optional[List[str]] = None,
          attributes: Optional[MetadataOptions] = None, devices_as_files: bool = False) -> Iterator[None]:
    """Add a directory's entries to ``entries`` in name order, and the names of its
    subdirectories to ``subdirectories``; pause (yield) whenever ``entries`` holds a batch.

    In name order, so that two trees' walks come in one order, which a
    plan merges as they come (:func:`pdiffcopy.core.treestream.walk_order`):
    the names are read and sorted first, then each is looked at, so that a
    directory of a million files is held as its names, not as its entries.
    With ``swept``, remove its stale temporaries and name them there. An
    entry whose path is longer than :data:`~pdiffcopy.core.protocol.MAX_PATH_LENGTH`
    bytes is a failure of its own, not listed: no path-based call (nor
    the server's protocol) can name it; the rest of the tree goes on.
    With ``attributes``, each entry gets the extended attributes and ACLs they choose.
    With ``devices_as_files``, a block device is listed as a file of its size.
    """
    prefix = relative + "/" if relative else ""
    try:
        names = os.listdir(fd)
    except OSError as error:
        failures.append((relative, f"cannot list: {why(error)}"))
        return
    names.sort()
    new = tuple.__new__
    is_file = stat.S_ISREG
    lstat = os.lstat
    directory = f"/proc/self/fd/{fd}/"
    for name in names:
        if len(entries) >= WALK_BATCH_ENTRIES:
            yield  # the walk hands them on
        path = prefix + name
        if len(path) > SURELY_SHORT and len(os.fsencode(path)) > MAX_PATH_LENGTH:
            failures.append((relative, f"{name!r} left out: its path is longer than "
                                       f"{MAX_PATH_LENGTH} bytes"))
            continue
        if name[0] == "." and is_temporary_name(name):
            # A pdiffcopy temporary is never data: a file being written (by
            # this run or another), or left by a run that was killed.
            if swept is not None:
                sweep_temporary(fd, name, path, swept)
            continue
        try:
            info = lstat(name, dir_fd=fd)
            mode = info.st_mode
            mode = known_mode(mode) or shared_mode(mode)
            # Read by the name below the directory's descriptor, the link itself for a symlink.
            xattrs = () if attributes is None else read_attributes(directory + name, attributes)
            if is_file(mode):  # most entries: built inline, as a plain tuple is
                size = info.st_size
                entries.append(new(Entry, (path, FILE, size, info.st_mtime_ns, mode, info.st_uid,
                                           info.st_gid, "", info.st_nlink,
                                           info.st_blocks * 512 < size, link_group(info), xattrs)))
                continue
            if stat.S_ISLNK(mode):
                entries.append(entry_from_stat(path, info, os.readlink(name, dir_fd=fd), xattrs))
                continue
            if devices_as_files and stat.S_ISBLK(mode):
                entries.append(device_as_file(fd, name, path, info, xattrs))
                continue
            entries.append(entry_from_stat(path, info, xattrs=xattrs))
            if stat.S_ISDIR(mode):
                subdirectories.append(name)
        except FileNotFoundError:
            continue  # deleted while listed: it is simply not there
        except OSError as error:
            failures.append((path, f"cannot list: {why(error)}"))


def sweep_temporary(directory: int, name: str, path: str, swept: List[str]) -> None:
    """Remove a temporary file an earlier run left (:func:`~pdiffcopy.local.sweep.remove_if_abandoned`)."""
    try:
        if remove_if_abandoned(name, os.lstat(name, dir_fd=directory), directory):
            swept.append(path)
    except OSError:
        pass  # gone meanwhile, or not ours to remove: housekeeping never fails a sync


def remove_all(directory: int, name: str) -> None:
    """Remove ``name`` in ``directory`` and, if it is a directory, all below it; no symlink followed.

    Iterative (a frame per level being emptied), so a tree of any depth is
    removed: recursion stopped at Python's limit of about 1,000 levels. An
    entry that cannot be removed fails the whole call, after the rest below
    its directory is gone.
    """
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=directory)
        return
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(name, flags, dir_fd=directory)
    stack = [(directory, name, top, iter(os.listdir(top)))]
    first_error: Optional[OSError] = None
    try:
        while stack:
            parent, current, fd, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                os.close(fd)
                try:
                    os.rmdir(current, dir_fd=parent)
                except OSError as error:
                    first_error = first_error or error
                continue
            try:
                if stat.S_ISDIR(os.stat(child, dir_fd=fd, follow_symlinks=False).st_mode):
                    below = os.open(child, flags, dir_fd=fd)
                    stack.append((fd, child, below, iter(os.listdir(below))))
                else:
                    os.unlink(child, dir_fd=fd)
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError as error:
                first_error = first_error or error  # the rest still goes; the parents stay
    finally:
        for _, _, fd, _ in stack:
            os.close(fd)
    if first_error is not None:
        raise first_error


__all__ = ["WALK_BATCH_ENTRIES", "Directories", "Frame", "close_pending", "entry_from_stat", "remove_all", "scan",
           "sweep_temporary", "walk_from", "why"]

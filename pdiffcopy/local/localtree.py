"""A directory tree on a local file system (:class:`LocalTree`).

Every access is confined beneath the tree's directory, the way the server
confines requests (:mod:`pdiffcopy.local.confinement`): a directory is opened relative
to the root with ``openat2(RESOLVE_BENEATH)`` and a file by its last name
relative to that directory with ``O_NOFOLLOW``. A symlink in the target
tree, planted or swapped in, can therefore never send a write outside it,
and symlinks are listed and recreated, never followed.

Directory descriptors are cached per thread: a tree sync works through
files in path order, so most files land in a directory opened just before.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections import OrderedDict
from typing import Callable, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from pdiffcopy.engine.endpoints import FileEndpoint
from pdiffcopy.errors import FileMissing, NotAFile, PdiffcopyError
from pdiffcopy.local.descriptors import (
    clear_umask,
    process_umask,
    replace_atomically,
    temporary_name,
)
from pdiffcopy.local.confinement import PROBING_FLAGS, Root, check_regular, describe_kind, has_other_names
from pdiffcopy.core.treestops import (
    NODES_DEVICES,
    NODES_SPECIALS,
    NOT_ATTEMPTED,
    NOT_KEPT_OWNER,
    VANISHED,
    stop_cause,
)
from pdiffcopy.engine.treeendpoints import (
    BACKUP,
    COPIED_FROM_ALTERNATE,
    DELETE,
    LINKED_FROM_ALTERNATE,
    MATCHED_IN_ALTERNATE,
    REMOVED_FOR_ALTERNATE,
    LINK,
    METADATA,
    MKDIR,
    MKNOD,
    MKPATH,
    REMOVE,
    SYMLINK,
    Failure,
    Listing,
    ListingStream,
    MetadataOptions,
    Alternates,
    KeptAttributes,
    Operation,
    TreeCopies,
    TreeEndpoint,
    WalkedHere,
)
from pdiffcopy.core.entries import DIR, OTHER, Entry, kind_of
from pdiffcopy.core.treeplan import SYMLINK as SYMLINK_KIND
from pdiffcopy.local.treenodes import (
    block_device_path,
    check_device_read,
    make_node,
    replace_with_new,
    set_node_metadata,
)
from pdiffcopy.local.treedata import TreeFailure, copy_data, read_exactly, write_data
from pdiffcopy.local.treewalk import Directories, Frame, entry_from_stat, remove_all, walk_from, why
from pdiffcopy.local.writerlocks import create_held
from pdiffcopy.core.xattrs import attributes_differ
from pdiffcopy.local.xattrs import apply_attributes, read_attributes

logger = logging.getLogger(__name__)

#: Directory descriptors kept open per thread.
DIRECTORY_CACHE_SIZE = 64

_IS_ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False
#: What a tree here does not set (LocalTree.not_kept): only root gives files to other users.
_NOT_KEPT: FrozenSet[str] = frozenset() if _IS_ROOT else frozenset({NOT_KEPT_OWNER})
#: What a tree here makes of the nodes it is sent (LocalTree.makes_nodes): devices as root only.
_SPECIALS: FrozenSet[str] = frozenset({NODES_SPECIALS})
_DEVICES_AND_SPECIALS: FrozenSet[str] = frozenset({NODES_DEVICES, NODES_SPECIALS})
#: The owner of what this process creates (outside set-group-ID directories).
_CREATOR = (os.geteuid(), os.getegid()) if hasattr(os, "geteuid") else (-1, -1)


class LocalTree(TreeEndpoint):
    """The tree below a local directory (which need not exist yet)."""

    capabilities = (WalkedHere, TreeCopies, KeptAttributes, Alternates)

    #: Whether :meth:`list` removes the stale temporaries it passes (set on a sync's target).
    sweep = False

    def __init__(self, directory: str) -> None:
        self.location = directory
        self.directory = os.path.abspath(directory)
        self._root: Optional[Root] = None
        self._prefix = ""
        #: Beneath an already confined root (a server's: :meth:`below`), never to be left.
        self._beneath = False
        self._local = threading.local()
        #: Change the metadata of files with several hard links (a server
        #: refuses unless started with --write-hard-links; see confinement.refuse_hard_links).
        self.write_hard_links = True
        #: The entries to read come from a client (a server's tree; see :meth:`open_file`).
        self.entries_from_client = False
        #: The attributes a listing reads (-X, -A; :meth:`list_attributes`), or None.
        self._attributes: Optional[MetadataOptions] = None
        #: What could not be kept, one line per kind (:meth:`take_notices`).
        self._notices: Set[str] = set()
        #: A root that is a symlink is listed as the link (:meth:`describe_root_link`).
        self._root_link = False
        #: Device nodes may be made (root; a server's trusted clients): see :meth:`makes_nodes`.
        self.make_devices = _IS_ROOT
        #: Block devices are listed and read as files of their size (:meth:`list_devices_as_files`).
        self._devices_as_files = False
        #: The subdirectories the walk enters (:meth:`walk_only`); None: all.
        self._descend: Optional[Callable[[str], bool]] = None

    @classmethod
    def below(cls, root: Root, relative: str) -> "LocalTree":
        """The tree at ``relative`` beneath an already confined ``root`` (the server's)."""
        tree = cls(os.path.join(root.directory, relative))
        tree._root, tree._prefix = root, relative.strip("/")
        tree._beneath = True
        return tree

    # -- descriptors -------------------------------------------------------

    @property
    def root(self) -> Root:
        if self._root is None:
            self._root = Root(self.directory, reserve=False)
        return self._root

    def _full(self, relative: str) -> str:
        if not self._prefix:
            return relative
        return f"{self._prefix}/{relative}" if relative else self._prefix

    def _directory(self, relative: str) -> int:
        """A descriptor (``O_PATH``) of a directory of the tree, from the per-thread cache."""
        # Descriptors inherited by a forked worker stay valid there: no pid check
        # (getpid is a system call, and this runs twice per file).
        cache = getattr(self._local, "directories", None)
        if cache is None:
            cache = self._local.directories = OrderedDict()
        fd = cache.get(relative)
        if fd is not None:
            cache.move_to_end(relative)
            return fd
        if self._prefix or relative:
            fd = self.root.open(self._full(relative), os.O_PATH | os.O_DIRECTORY)
        else:
            fd = os.dup(self.root.fd)
        cache[relative] = fd
        if len(cache) > DIRECTORY_CACHE_SIZE:
            _, oldest = cache.popitem(last=False)
            owners = getattr(self._local, "owners", None)
            if owners:
                owners.pop(oldest, None)  # the number is reused by the next open
            os.close(oldest)
        return fd

    def _forget_directories(self) -> None:
        """Close the cached descriptors (a directory was removed or replaced)."""
        cache = getattr(self._local, "directories", None)
        if cache:
            for fd in cache.values():
                os.close(fd)
            cache.clear()
        owners = getattr(self._local, "owners", None)
        if owners:
            owners.clear()

    def _needs_chown(self, directory: int, entry: Entry) -> bool:
        """Whether a file or directory just made in ``directory`` needs a chown to get ``entry``'s owner.

        What this process makes is its own (effective uid), and its group is
        the effective gid or, in a set-group-ID directory (or on a file system
        mounted ``grpid``), the directory's. When the directory itself belongs
        to this process's uid and gid, both rules give the effective ids, and
        an entry with those ids needs no chown: one system call a file less.
        The directory's owner is looked up once per cached descriptor.
        """
        if (entry.uid, entry.gid) != _CREATOR:
            return True
        owners = getattr(self._local, "owners", None)
        if owners is None:
            owners = self._local.owners = {}
        mine = owners.get(directory)
        if mine is None:
            info = os.fstat(directory)
            mine = owners[directory] = (info.st_uid, info.st_gid) == _CREATOR
        return not mine

    def _parent(self, path: str) -> Tuple[int, str]:
        parent, _, name = path.rpartition("/")
        if not name or name in (".", ".."):
            raise TreeFailure(f"Invalid path {path!r}")
        return self._directory(parent), name

    def close(self) -> None:
        self._forget_directories()

    # -- listing -----------------------------------------------------------

    def root_entry(self) -> Optional[Entry]:
        """What the root itself is (following a symlink to it unless :meth:`describe_root_link`
        was called), or ``None`` when missing."""
        flags = os.O_PATH | (os.O_NOFOLLOW if self._root_link else 0)
        try:
            fd = self.root.open(self._prefix, flags) if self._prefix else \
                os.open(self.directory, flags | os.O_CLOEXEC)
            try:
                info = os.fstat(fd)
                link = os.readlink("", dir_fd=fd) if stat.S_ISLNK(info.st_mode) else ""
                # Through the descriptor's /proc name: the root itself, whatever its path becomes
                # (a single file is a tree of one: its attributes are listed as a directory's).
                xattrs = read_attributes(f"/proc/self/fd/{fd}", self._attributes, follow=True) \
                    if self._attributes is not None and kind_of(info.st_mode) != OTHER else ()
            finally:
                os.close(fd)
        except (FileNotFoundError, FileMissing):
            return None
        except (NotADirectoryError, NotAFile):  # a parent is a file: nothing here either
            return None
        return entry_from_stat("", info, link, xattrs)

    def describe_root_link(self) -> None:
        self._root_link = True

    def list(self) -> Listing:
        root, directories = self.walk()
        entries: List[Entry] = []
        failures: List[Failure] = []
        for found, failed in directories:
            entries.extend(found)
            failures.extend(failed)
        return Listing(root, entries, failures)

    def stream(self) -> ListingStream:
        """The walk (:meth:`walk`), whose entries come in :func:`~pdiffcopy.core.treeplan.walk_order`."""
        root, directories = self.walk()
        return ListingStream(root, directories, True, directories.close)

    def walk(self) -> Tuple[Optional[Entry], "Directories"]:
        """The tree's root entry, and what :meth:`list` finds, one batch at a time.

        The root is looked at now (its errors are raised here); the
        directories are read as the iterator is consumed, so a listing can be
        sent while it is made (the server's tree endpoint) instead of held
        whole. The tree must stay open until the iterator is done; a consumer
        that stops early closes the iterator.
        """
        root = self._root_or_none()
        frames: List[Frame] = []
        if root is not None and root.kind == DIR:
            frames.append((os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=self._directory("")), "", None))
        return root, Directories(walk_from(frames, self.location, self.sweep, self._attributes,
                                           self._devices_as_files, self._descend), frames)

    def _root_or_none(self) -> Optional[Entry]:
        try:
            return self.root_entry()
        except PdiffcopyError:
            raise
        except OSError as error:
            raise TreeFailure(f"Cannot open {self.location}: {why(error)}") from None

    # -- reading -----------------------------------------------------------

    def open_file(self, entry: Entry) -> int:
        """Open a listed regular file for reading, never through a symlink.

        The open cannot block on a FIFO (:data:`PROBING_FLAGS`), and only a
        regular file is read. For a server's tree, whose client names the
        entries it wants ("listed" is its claim), the kind is checked first
        too, with ``fstatat``, which opens nothing: opening some devices has
        effects. A tree we listed ourselves skips that (3 us a file, measured
        here, on a 4 us open): only a swap since the listing can put a
        device there.
        """
        try:
            directory, name = self._parent(entry.path)
            if self.entries_from_client:
                mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
                if not stat.S_ISREG(mode):
                    raise NotAFile(f"Not a regular file: {entry.path} is {describe_kind(mode)}")
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | PROBING_FLAGS, dir_fd=directory)
        except FileNotFoundError:
            raise TreeFailure(VANISHED) from None
        if not (self._devices_as_files and check_device_read(fd, entry)):
            check_regular(fd, entry.path)
        return fd

    def read_files(self, entries: Sequence[Entry]) -> Iterator[Tuple[Entry, Optional[bytes], str]]:
        for entry in entries:
            try:
                fd = self.open_file(entry)
            except (OSError, PdiffcopyError) as error:
                yield entry, None, _message(error)
                continue
            try:
                data = read_exactly(fd, entry.size)
            except (OSError, TreeFailure) as error:
                yield entry, None, _message(error)
                continue
            finally:
                os.close(fd)
            yield entry, data, ""

    # -- writing -----------------------------------------------------------

    def write_files(self, files: Iterable[Tuple[Entry, bytes]], options: MetadataOptions,
                    fresh: bool = False) -> List[Failure]:
        failures: List[Failure] = []
        written: List[str] = []
        stopped = False
        for entry, data in files:
            if stopped:  # the rest would fail the same way: not tried, but said (a server reads them on)
                failures.append((entry.path, NOT_ATTEMPTED))
                continue
            try:
                self._write_file(entry, options,
                                 lambda fd, e=entry, d=data: write_data(fd, e, d, options.sparse), fresh)
                written.append(entry.path)
            except (OSError, PdiffcopyError) as error:
                failures.append((entry.path, _message(error)))
                stopped = bool(stop_cause(failures[-1][1])[0])  # a full or read-only file system
        if options.fsync:
            failures += self._flush_directories(written)
        return failures

    def copy_files_from(self, source: "LocalTree", entries: Iterable[Entry],
                        options: MetadataOptions, compare: bool = False, fresh: bool = False
                        ) -> Tuple[List[Failure], int, int]:
        """Copy files from another local tree, by the kernel where it can.

        :param compare: Write only the files whose content differs (the others
                        only get their metadata); for files whose times differ.
        :param fresh: The files do not exist in this tree yet (see :meth:`_write_file`).
        :returns: The failures, the number of bytes written and of files written.
        """
        failures: List[Failure] = []
        written = files = 0
        sizes: Dict[str, int] = {}
        stopped = False
        for entry in entries:
            if stopped:  # the rest would fail the same way
                failures.append((entry.path, NOT_ATTEMPTED))
                continue
            try:
                source_fd = source.open_file(entry)
            except (OSError, PdiffcopyError) as error:
                failures.append((entry.path, _message(error)))
                continue
            try:
                if compare and self._same_content(entry, source_fd):
                    self.set_metadata(entry, options)
                    continue
                # Counted as written: the data, not a sparse file's holes nor the zeros -S leaves out.
                copied = self._write_file(entry, options,
                                          lambda fd, e=entry, s=source_fd: copy_data(s, fd, e, options.sparse),
                                          fresh)
                written += copied
                files += 1
                sizes[entry.path] = copied
            except (OSError, PdiffcopyError) as error:
                failures.append((entry.path, _message(error)))
                stopped = bool(stop_cause(failures[-1][1])[0])  # a full or read-only file system
            finally:
                os.close(source_fd)
        if options.fsync:
            unflushed = self._flush_directories(list(sizes))
            failures += unflushed
            files -= len(unflushed)
            written -= sum(sizes[path] for path, _ in unflushed)
        return failures, written, files

    def _flush_directories(self, paths: List[str]) -> List[Failure]:
        """Flush the directories holding ``paths`` (once each); the paths whose directory failed.

        After a create or a rename, only this makes the name itself durable.
        """
        members: Dict[str, List[str]] = {}
        for path in paths:
            members.setdefault(path.rpartition("/")[0], []).append(path)
        failures: List[Failure] = []
        for parent, names in members.items():
            try:
                # The cached descriptors are O_PATH, which cannot be flushed.
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                             dir_fd=self._directory(parent))
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except (FileNotFoundError, FileMissing):
                continue  # removed later in the same batch: its parent's flush records that
            except (OSError, PdiffcopyError) as error:
                failures += [(path, f"cannot flush its directory: {_message(error)}") for path in names]
        return failures

    def same_content(self, entry: Entry, data: bytes) -> bool:
        """Whether the tree's file at ``entry.path`` holds exactly ``data``."""
        try:
            fd = self.open_file(entry)
        except (OSError, PdiffcopyError):
            return False
        try:
            return read_exactly(fd, len(data), strict=False) == data
        except (OSError, TreeFailure):
            return False
        finally:
            os.close(fd)

    def _same_content(self, entry: Entry, source_fd: int) -> bool:
        wanted = read_exactly(source_fd, entry.size)
        os.lseek(source_fd, 0, os.SEEK_SET)
        return self.same_content(entry, wanted)

    def _write_file(self, entry: Entry, options: MetadataOptions, fill, fresh: bool = False):
        """Write a file as a temporary sibling, set its metadata, rename it into place; return what ``fill`` did.

        A ``fresh`` file (nothing had its name) is written under its name
        directly, created exclusively, and removed again if anything fails:
        a rename per file is a fifth of the cost of copying a small one, and
        an interrupted run leaves nothing behind either way (a tree sync stops
        between units, never inside this method; killed outright, it leaves a
        file with a newer time than the source's, which the next run's quick
        check sees).
        """
        directory, name = self._parent(entry.path)
        if fresh:
            created = False
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             entry.permissions & 0o777, dir_fd=directory)
                created = True
                try:
                    filled = fill(fd)
                    self._set_metadata_fd(fd, entry, options, created=directory)
                    if options.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                return filled
            except FileExistsError:
                if created:
                    raise
                # Something appeared under the name since the listing: replace it safely.
            except BaseException:
                if created:
                    _unlink_quietly(name, directory)
                raise
        temporary = temporary_name(name)
        try:
            # Opened inside the try: an interrupt lands right after a call
            # returns, and the clean-up below must cover the file just made.
            fd = create_held(temporary, entry.permissions & 0o777, dir_fd=directory)
            try:
                filled = fill(fd)
                self._set_metadata_fd(fd, entry, options, created=directory)
                if options.fsync:  # before the rename: the name never points at unflushed data
                    os.fsync(fd)
            finally:
                os.close(fd)
            # Unflushed: the batch flushes each directory once (_flush_directories).
            replace_atomically(temporary, name, directory, directory, flush=False)
        except BaseException:
            _unlink_quietly(temporary, directory)  # not created, or already renamed: fine
            raise
        return filled

    def _set_metadata_fd(self, fd: int, entry: Entry, options: MetadataOptions, created: Optional[int] = None,
                         current: Optional[os.stat_result] = None) -> None:
        """Owner, attributes, permissions and times of an open file.

        A file this process ``created`` (the descriptor of the directory it
        was created in) got its permissions from ``open``: chmod is needed
        only for what the umask took away and for set-id and sticky bits
        (which open does not set and chown clears), or after its ACL was set
        (the chmod makes the ACL's mask the mode's group bits, as the
        source's is). Its owner is this process's, so chown is needed only
        for another (:meth:`_needs_chown`). An existing file's ``current``
        stat, when the caller has it, spares the chown and chmod that would
        change nothing.
        """
        chowned = False
        if options.owner and _IS_ROOT:
            if created is not None:
                chowned = self._needs_chown(created, entry)
            else:
                chowned = current is None or (current.st_uid, current.st_gid) != (entry.uid, entry.gid)
            if chowned:
                os.fchown(fd, entry.uid, entry.gid)  # before chmod: chown clears set-id bits
        if options.attributes:
            apply_attributes(fd, entry.xattrs, options, self._notices)
        if created is not None:
            chmod = options.acls or bool(entry.permissions & (0o7000 | process_umask()))
        else:
            # A chown clears the set-id bits: those must be set again.
            chmod = current is None or options.acls or stat.S_IMODE(current.st_mode) != entry.permissions \
                or (chowned and entry.permissions & 0o6000)
        if chmod:
            os.fchmod(fd, entry.permissions)
        if options.times:
            os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))

    def set_metadata(self, entry: Entry, options: MetadataOptions) -> None:
        """Set permissions (and times, owner) of an existing entry without following it.

        The path ``""`` is the tree's own directory (rsync -a sets it too).
        """
        if not entry.path:
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._directory(""))
            try:
                self._set_metadata_fd(fd, entry, options, current=os.fstat(fd))
            finally:
                os.close(fd)
            return
        directory, name = self._parent(entry.path)
        if entry.kind == OTHER:
            set_node_metadata(directory, name, entry, options, self._notices, _IS_ROOT, self._check_links)
            return
        if entry.kind == SYMLINK_KIND:
            if options.owner and _IS_ROOT:
                os.chown(name, entry.uid, entry.gid, dir_fd=directory, follow_symlinks=False)
            if options.attributes:
                self._set_link_attributes(directory, name, entry, options)
            if options.times:
                os.utime(name, ns=(entry.mtime_ns, entry.mtime_ns), dir_fd=directory,
                         follow_symlinks=False)
            return
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | PROBING_FLAGS
        if entry.kind == DIR:
            flags |= os.O_DIRECTORY
        elif kind_of(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode) != entry.kind:
            # Checked before opening: a device named as a file is never opened.
            raise TreeFailure(f"is no longer a {entry.kind}")
        try:
            fd = os.open(name, flags, dir_fd=directory)
        except PermissionError:
            # Unreadable (mode 000 and not root): O_PATH cannot chmod, so set by name;
            # the name was just listed as this kind, not as a symlink.
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            try:
                self._check_links(_check_kind(fd, entry))
                if options.attributes:
                    apply_attributes(f"/proc/self/fd/{fd}", entry.xattrs, options, self._notices)
                os.chmod(f"/proc/self/fd/{fd}", entry.permissions)
                if options.times:
                    os.utime(f"/proc/self/fd/{fd}", ns=(entry.mtime_ns, entry.mtime_ns))
            finally:
                os.close(fd)
            return
        try:
            current = _check_kind(fd, entry)
            self._check_links(current)
            self._set_metadata_fd(fd, entry, options, current=current)
        finally:
            os.close(fd)

    def _set_link_attributes(self, directory: int, name: str, entry: Entry, options: MetadataOptions) -> None:
        """A symlink's own attributes, through the /proc name of an O_PATH descriptor of the link.

        Following that name reaches the link itself, never what it points at
        (Linux keeps only security.* and trusted.* on a symlink).
        """
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
        try:
            _check_kind(fd, entry)
            apply_attributes(f"/proc/self/fd/{fd}", entry.xattrs, options, self._notices, symlink=True)
        finally:
            os.close(fd)

    def list_attributes(self, options: MetadataOptions) -> None:
        self._attributes = options if options.attributes else None

    def take_notices(self) -> List[str]:
        notices = sorted(self._notices)
        self._notices.clear()
        return notices

    def not_kept(self) -> FrozenSet[str]:
        return _NOT_KEPT

    def makes_nodes(self) -> FrozenSet[str]:
        return _DEVICES_AND_SPECIALS if self.make_devices else _SPECIALS

    def list_devices_as_files(self) -> bool:
        self._devices_as_files = True
        return True

    def walk_only(self, descend: Callable[[str], bool]) -> None:
        self._descend = descend

    def _check_links(self, info: os.stat_result) -> None:
        """Refuse a metadata change of a file with several hard links, unless allowed.

        Its other names, maybe outside the tree, would change too.
        """
        if has_other_names(info) and not self.write_hard_links:
            raise TreeFailure(f"has {info.st_nlink} hard links: its metadata is left alone "
                              f"(the server does not change such files in place)")

    # -- operations --------------------------------------------------------

    def apply(self, operations: Sequence[Operation], options: MetadataOptions) -> List[Failure]:
        failures: List[Failure] = []
        named: List[str] = []  # entries made, replaced or removed: their directories change
        stopped = False
        for operation in operations:
            if stopped:  # the rest would fail the same way
                failures.append((operation.entry.path, NOT_ATTEMPTED))
                continue
            try:
                self._apply(operation, options)
                if operation.name != METADATA and operation.entry.path:
                    named.append(operation.entry.path)
            except (OSError, PdiffcopyError) as error:
                failures.append((operation.entry.path, _message(error)))
                stopped = bool(stop_cause(failures[-1][1])[0])  # a full or read-only file system
        if options.fsync and named:
            failures += self._flush_directories(named)
        return failures

    def _apply(self, operation: Operation, options: MetadataOptions) -> None:
        entry = operation.entry
        if operation.name == METADATA:
            self.set_metadata(entry, options)
            return
        if not entry.path and operation.name in (MKDIR, MKPATH, DELETE):
            self._root_itself(operation.name)
            return
        if operation.name == MKPATH:
            raise TreeFailure("mkpath makes the tree's own directory only")
        directory, name = self._parent(entry.path)
        if operation.name == MKDIR:
            made = True
            try:
                # Writable by us until the directory metadata step sets the real mode.
                os.mkdir(name, entry.permissions | 0o700, dir_fd=directory)
            except FileExistsError:
                info = os.stat(name, dir_fd=directory, follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode):
                    raise TreeFailure("exists and is not a directory") from None
                made = False
            if options.owner and _IS_ROOT and (not made or self._needs_chown(directory, entry)):
                os.chown(name, entry.uid, entry.gid, dir_fd=directory, follow_symlinks=False)
        elif operation.name == SYMLINK:
            replace_with_new(directory, name, lambda temporary: os.symlink(entry.target, temporary,
                                                                           dir_fd=directory))
            self.set_metadata(entry, options)
        elif operation.name == MKNOD:
            make_node(directory, name, entry, self.make_devices)
            self.set_metadata(entry, options)
        elif operation.name == LINK:
            self._link(entry.target, directory, name)
        elif operation.name == BACKUP:
            self._back_up(directory, name, entry.target)
        elif operation.name == DELETE:
            if entry.kind == DIR:
                os.rmdir(name, dir_fd=directory)
                self._forget_directories()
            else:
                os.unlink(name, dir_fd=directory)
        elif operation.name == REMOVE:
            remove_all(directory, name)
            self._forget_directories()
        else:
            raise TreeFailure(f"Unknown operation {operation.name!r}")

    def _link(self, leader: str, directory: int, name: str) -> None:
        """Make ``name`` in ``directory`` another name of the regular file at ``leader`` (-H).

        The leader is opened beneath the root without following a symlink and
        linked through its descriptor, so no symlink swapped in can make the
        link reach a file elsewhere; the new name is made as a temporary and
        renamed over the old one, so the name is never missing.
        """
        leader_directory, leader_name = self._parent(leader)
        try:
            source = os.open(leader_name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=leader_directory)
        except FileNotFoundError:
            raise TreeFailure(f"cannot link to {leader!r}: it is missing") from None
        try:
            info = os.fstat(source)
            if not stat.S_ISREG(info.st_mode):
                raise TreeFailure(f"cannot link to {leader!r}: it is {describe_kind(info.st_mode)}, "
                                  f"not a regular file")
            try:
                present = os.stat(name, dir_fd=directory, follow_symlinks=False)
                if (present.st_dev, present.st_ino) == (info.st_dev, info.st_ino):
                    return  # already a name of that file (a rename would then do nothing)
            except FileNotFoundError:
                pass
            # linkat(2) of a descriptor by its /proc name, AT_SYMLINK_FOLLOW: the file opened
            # above, whatever its name is now (AT_EMPTY_PATH would need a capability).
            replace_with_new(directory, name, lambda temporary: os.link(
                f"/proc/self/fd/{source}", temporary, dst_dir_fd=directory, follow_symlinks=True))
        finally:
            os.close(source)

    def _back_up(self, directory: int, name: str, kept: str) -> None:
        """Give what has ``name`` (not a directory) the other name ``kept`` (relative to the tree, maybe
        out of it: beneath a server's root only), replacing an older backup; nothing there, nothing to keep."""
        try:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(info.st_mode):
            raise TreeFailure("is a directory: only files, symlinks and special files are kept as backups")
        parent, _, kept_name = kept.rpartition("/")
        keeper = self._alternate_tree(parent or ".")
        try:
            failures = keeper.apply([Operation(MKPATH, Entry("", DIR, 0, 0, 0o40755))], MetadataOptions())
            if failures:
                raise TreeFailure(f"cannot make the backup directory {parent}: {failures[0][1]}")
            kept_directory, kept_name = keeper._parent(kept_name)
            try:
                replace_with_new(kept_directory, kept_name, lambda temporary: os.link(
                    name, temporary, src_dir_fd=directory, dst_dir_fd=kept_directory, follow_symlinks=False))
            except OSError as error:
                if error.errno != errno.EXDEV or not stat.S_ISREG(info.st_mode):
                    raise
                self._copy_as_backup(directory, name, kept_directory, kept_name, info)
        finally:
            keeper.close()

    @staticmethod
    def _copy_as_backup(directory: int, name: str, kept_directory: int, kept_name: str,
                        info: os.stat_result) -> None:
        """A backup on another file system: the file's data, mode and times copied there."""
        source = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
        try:
            entry = entry_from_stat(kept_name, info)

            def make(temporary: str) -> None:
                target = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 stat.S_IMODE(info.st_mode), dir_fd=kept_directory)
                try:
                    copy_data(source, target, entry)
                    os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
                finally:
                    os.close(target)
            replace_with_new(kept_directory, kept_name, make)
        finally:
            os.close(source)

    def _root_itself(self, name: str) -> None:
        """Make the tree's directory (with MKPATH its missing parents too, with MKDIR only the
        last one, as rsync does), or remove it once it is empty."""
        self._forget_directories()
        try:
            if not self._prefix:
                if name == MKPATH:
                    os.makedirs(self.directory, exist_ok=True)
                elif name == MKDIR:
                    _make_directory(self.directory)
                else:
                    os.rmdir(self.directory)
                return
            parts = self._prefix.split("/")
            parent = os.dup(self.root.fd)
            try:
                for part in parts[:-1]:
                    if name == MKPATH:
                        _make_directory(part, parent)
                    following = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
                    os.close(parent)
                    parent = following
                if name == DELETE:
                    os.rmdir(parts[-1], dir_fd=parent)
                else:
                    _make_directory(parts[-1], parent)
            finally:
                os.close(parent)
        except FileNotFoundError:
            if name == MKDIR:
                raise TreeFailure("its parent directory does not exist (--mkpath makes it)") from None
            raise

    def sweep_while_listing(self) -> None:
        self.sweep = True

    def enter_worker(self) -> None:
        # No umask in a worker, so new files get their modes without a chmod each.
        clear_umask()

    def walks_here(self) -> bool:
        return True

    def can_copy_files_from(self, other: TreeEndpoint) -> bool:
        return isinstance(other, LocalTree)

    # -- alternate directories (--link-dest, --copy-dest, --compare-dest) ----

    def takes_from_alternates(self) -> bool:
        return True

    def take_from_alternates(self, entries: Sequence[Entry], existing: Set[str], directories: Sequence[str],
                             use: str, options: MetadataOptions, dry_run: bool = False
                             ) -> Tuple[Dict[str, str], int, List[Failure]]:
        trees = [self._alternate_tree(directory) for directory in directories]
        taken: Dict[str, str] = {}
        failures: List[Failure] = []
        copied_bytes = 0
        try:
            for entry in entries:
                try:
                    done, copied = self._take_from_alternate(entry, entry.path in existing, trees, use, options,
                                                             dry_run)
                except (OSError, PdiffcopyError) as error:
                    failures.append((entry.path, _message(error)))
                    continue
                if done:
                    taken[entry.path] = done
                    copied_bytes += copied
        finally:
            for tree in trees:
                tree.close()
        return taken, copied_bytes, failures

    def _alternate_tree(self, directory: str) -> "LocalTree":
        """The tree at ``directory``, relative to this one's: beneath a server's root, never outside it."""
        if not self._beneath:  # (lexically: the target may not exist yet)
            return LocalTree(os.path.normpath(os.path.join(self.directory, directory)))
        relative = os.path.normpath(os.path.join(self._prefix, directory))
        if os.path.isabs(directory) or relative == ".." or relative.startswith("../"):
            raise TreeFailure(f"{directory}: outside the served directory")
        return LocalTree.below(self.root, "" if relative == "." else relative)

    def _take_from_alternate(self, entry: Entry, exists: bool, trees: Sequence["LocalTree"], use: str,
                             options: MetadataOptions, dry_run: bool) -> Tuple[str, int]:
        """What :meth:`take_from_alternates` does with one file: (what was done or "", bytes copied)."""
        differing: Optional[Tuple["LocalTree", int]] = None  # a file that differs in its attributes only
        opened: List[int] = []
        try:
            for tree in trees:
                fd = tree._open_alternate(entry)
                if fd is None:
                    continue
                opened.append(fd)
                info = os.fstat(fd)
                if info.st_size != entry.size or info.st_mtime_ns != entry.mtime_ns:
                    continue
                if _same_attributes(fd, info, entry, options):
                    if dry_run:
                        return (MATCHED_IN_ALTERNATE if use == "compare" else
                                LINKED_FROM_ALTERNATE if use == "link" else COPIED_FROM_ALTERNATE), 0
                    if use == "compare":
                        if exists:
                            directory, name = self._parent(entry.path)
                            os.unlink(name, dir_fd=directory)
                            return REMOVED_FOR_ALTERNATE, 0
                        return MATCHED_IN_ALTERNATE, 0
                    if use == "link" and self._link_alternate(fd, info, entry):
                        return LINKED_FROM_ALTERNATE, 0
                    return COPIED_FROM_ALTERNATE, self._copy_alternate(fd, entry, exists, options)
                if differing is None:
                    differing = (tree, fd)
            if differing is None:
                return "", 0
            if dry_run:
                return COPIED_FROM_ALTERNATE, 0
            return COPIED_FROM_ALTERNATE, self._copy_alternate(differing[1], entry, exists, options)
        finally:
            for fd in opened:
                os.close(fd)

    def _open_alternate(self, entry: Entry) -> Optional[int]:
        """This tree's regular file at ``entry.path``, opened for reading, or None."""
        try:
            directory, name = self._parent(entry.path)
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | PROBING_FLAGS, dir_fd=directory)
        except (OSError, PdiffcopyError):
            return None  # missing (the directory too), not a file, beyond a symlink: nothing to take
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def _link_alternate(self, fd: int, info: os.stat_result, entry: Entry) -> bool:
        """Make ``entry.path`` another name of the open file; False where the file system refuses
        (another file system, a limit on links: the file is copied instead, as rsync does)."""
        directory, name = self._parent(entry.path)
        try:
            present = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if (present.st_dev, present.st_ino) == (info.st_dev, info.st_ino):
                return True
        except FileNotFoundError:
            pass
        try:
            replace_with_new(directory, name, lambda temporary: os.link(
                f"/proc/self/fd/{fd}", temporary, dst_dir_fd=directory, follow_symlinks=True))
        except OSError as error:
            if error.errno in (errno.EXDEV, errno.EMLINK, errno.EPERM):
                return False
            raise
        return True

    def _copy_alternate(self, fd: int, entry: Entry, exists: bool, options: MetadataOptions) -> int:
        return self._write_file(entry, options, lambda target: copy_data(fd, target, entry, options.sparse),
                                fresh=not exists)

    def file_endpoint(self, path: str) -> FileEndpoint:
        from pdiffcopy.local.confinedfile import ConfinedFile

        if self._devices_as_files:
            directory, name = self._parent(path)
            device = block_device_path(directory, name, os.path.join(self.root.directory, self._full(path)))
            if device is not None:  # --copy-devices: the node below the root, listed as not a symlink
                from pdiffcopy.local.localdevice import LocalDevice

                return LocalDevice(device)
        # Beneath the root, like every other access of the tree (docs/trees.rst).
        return ConfinedFile(self.root, self._full(path))


def _make_directory(name: str, directory: Optional[int] = None) -> None:
    """Make the directory ``name`` (in ``directory``); one that is there is fine."""
    try:
        os.mkdir(name, 0o777, dir_fd=directory)
    except FileExistsError:
        if not stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
            raise TreeFailure("exists and is not a directory") from None


def _same_attributes(fd: int, info: os.stat_result, entry: Entry, options: MetadataOptions) -> bool:
    """Whether an open file has ``entry``'s permissions, and its owner and attributes as far as
    ``options`` keep them: rsync's "identical in all preserved attributes"."""
    if stat.S_IMODE(info.st_mode) != entry.permissions:
        return False
    if options.owner and (info.st_uid, info.st_gid) != (entry.uid, entry.gid):
        return False
    return not options.attributes or not attributes_differ(
        read_attributes(f"/proc/self/fd/{fd}", options, follow=True), entry.xattrs)


def _unlink_quietly(name: str, directory: int) -> None:
    try:
        os.unlink(name, dir_fd=directory)
    except OSError:
        pass


def _message(error: BaseException) -> str:
    """A failure's reason in one line (the path is reported next to it)."""
    if isinstance(error, OSError):
        return why(error)
    return str(error)


def _check_kind(fd: int, entry: Entry) -> os.stat_result:
    info = os.fstat(fd)
    if kind_of(info.st_mode) != entry.kind:
        raise TreeFailure(f"is no longer a {entry.kind}")
    return info


__all__ = ["LocalTree"]

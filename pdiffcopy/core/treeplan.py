"""Directory trees, the pure part: what a tree sync must do (entries: core/entries.py, filters: core/filters.py).

Nothing here touches a file system or a network. A tree is a list of
:class:`Entry` (one per file, directory, symlink or special file below the
tree's root, paths relative to it); :func:`plan_tree` compares a source
listing with a target listing and returns a :class:`TreePlan`: the
directories to make, the files to copy or check, the symlinks to set, the
metadata to fix and the entries to delete, in an order that is safe to run.
The same plan drives a sync, a dry run (``-n``) and the itemised ``--diff``.
"""

from __future__ import annotations

import stat

from pdiffcopy.core.records import dataclass, field
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from pdiffcopy.core.entries import (
    BLOCK_DEVICE,
    CHAR_DEVICE,
    DIR,
    FILE,
    OTHER,
    SYMLINK,
    Entry,
    device_numbers,
    is_device,
    kind_of,
    node_type,
)
from pdiffcopy.core.filters import PathFilter, ancestors, is_under
from pdiffcopy.core.xattrs import attributes_differ

#: Why a file in the target is rewritten or checked.
REASON_NEW = "new"
REASON_SIZE = "size"  # sizes differ: the content must change
REASON_TIME = "time"  # same size, other mtime: compare the content, move what differs
REASON_CONTENT = "content"  # --checksum: compare the content whatever the times say
REASON_TYPE = "type"  # something else (a symlink, a special file) stands in the way
#: The target's file has other names that must not change with it: a new file takes this name.
REASON_SHARED = "shared"


@dataclass(frozen=True)
class PlanOptions:
    """What counts as a difference, and what to do about extra target entries."""

    checksum: bool = False  # compare every same-size file by content
    times: bool = False  # -t: keep modification times
    owner: bool = False  # -o: keep user and group
    delete: bool = False  # remove target entries the source does not have
    #: -X/-A: the listings carry extended attributes and ACLs, and an entry whose differ is fixed.
    attributes: bool = False
    hard_links: bool = False  # -H: names sharing a file in the source share one in the target
    #: --devices: character and block devices made as nodes (the target can); skipped otherwise.
    devices: bool = False
    #: --specials: fifos and unix sockets made as nodes; skipped otherwise.
    specials: bool = False
    #: Symlinks made as symlinks; skipped otherwise (rsync's -r without -l).
    symlinks: bool = True
    #: rsync's transfer rules: -u skips a file newer in the target; --existing makes nothing new;
    #: --ignore-existing leaves what the target has alone; --size-only takes same-size files for
    #: the same (their metadata is still fixed); -I compares every file by content.
    update: bool = False
    existing: bool = False
    ignore_existing: bool = False
    size_only: bool = False
    ignore_times: bool = False
    #: --modify-window: times within this many seconds are the same; 0 (rsync's default) compares
    #: whole seconds; below 0, nanoseconds too.
    modify_window: int = 0
    #: --max-size, --min-size: files larger, or smaller, are left alone (None: no bound).
    max_size: Optional[int] = None
    min_size: Optional[int] = None


@dataclass(frozen=True)
class FileAction:
    """A regular file to create, rewrite or compare (``reason`` says which)."""

    # Slots, not a __dict__ each: a plan holds one per file to copy (a million for a million new files).
    __slots__ = ("source", "target", "reason")

    source: Entry
    target: Optional[Entry]
    reason: str

    @property
    def path(self) -> str:
        return self.source.path


@dataclass(frozen=True)
class LinkAction:
    """A name to make another name of the file at ``leader`` (-H), once that file is in place.

    ``leader`` is the path of its hard-link group's first name that the filters
    keep, which is copied like any file; ``target`` is what has the name now.
    """
    __slots__ = ("source", "leader", "target")

    source: Entry
    leader: str
    target: Optional[Entry]

    @property
    def path(self) -> str:
        return self.source.path

    def operation(self) -> "Operation":
        """The :data:`LINK` operation that makes it (the leader's path travels as the entry's target)."""
        return Operation(LINK, self.source._replace(target=self.leader))


@dataclass(frozen=True)
class MetadataFix:
    """Metadata to set on an entry whose content is right (or a directory)."""
    __slots__ = ("source", "changes")

    source: Entry
    changes: Tuple[str, ...]  # "mode", "time", "owner", "xattrs"


@dataclass
class TreePlan:
    """What a tree sync does, in the order it does it.

    1. :attr:`removals` of target entries in the way of a source entry of
       another type, then :attr:`directories` to make (parents first);
    2. :attr:`files`, :attr:`symlinks` and :attr:`nodes` (in parallel; the files largest first);
    3. :attr:`metadata` of files and symlinks, then :attr:`deletions`
       (files, then directories deepest first);
    4. :attr:`links` (-H), once the files of 2 and 3 are in place (before
       the directories of :attr:`deletions`);
    5. :attr:`directory_metadata`, deepest first, after everything inside
       them has changed.
    """

    directories: List[Entry] = field(default_factory=list)
    files: List[FileAction] = field(default_factory=list)
    symlinks: List[Tuple[Entry, Optional[Entry]]] = field(default_factory=list)
    #: -D: devices, fifos and sockets to make (or make again: another type or numbers), and
    #: what the target has at their paths.
    nodes: List[Tuple[Entry, Optional[Entry]]] = field(default_factory=list)
    metadata: List[MetadataFix] = field(default_factory=list)
    directory_metadata: List[MetadataFix] = field(default_factory=list)
    removals: List[Entry] = field(default_factory=list)
    deletions: List[Entry] = field(default_factory=list)
    extraneous: List[Entry] = field(default_factory=list)  # left alone (no --delete)
    unchanged: int = 0
    specials: List[Entry] = field(default_factory=list)  # devices, fifos, sockets skipped with a warning
    hard_links: List[Entry] = field(default_factory=list)  # copied as separate files (no -H)
    links: List[LinkAction] = field(default_factory=list)  # -H: names linked to their group's first
    blocked: List[Tuple[Entry, str]] = field(default_factory=list)  # cannot be synced

    @property
    def bytes_to_copy(self) -> int:
        return sum(action.source.size for action in self.files)

    @property
    def empty(self) -> bool:
        return not (self.directories or self.files or self.symlinks or self.nodes or self.metadata
                    or self.directory_metadata or self.removals or self.deletions or self.links)


def same_time(source_ns: int, target_ns: int, window: int) -> bool:
    """Whether two modification times are the same for --modify-window ``window``.

    Within ``window`` seconds; below 0, to the nanosecond. At 0 (the default) whole seconds
    where either time has none below them (a file system that keeps seconds only, FAT or
    ext3, or a copy made on one), and to the nanosecond where both have: rsync's default takes
    whole seconds always, and misses a file rewritten at its size within the second it was synced.
    """
    if source_ns == target_ns:
        return True
    if window < 0 or window == 0 and source_ns % 1_000_000_000 and target_ns % 1_000_000_000:
        return False
    return abs(source_ns // 1_000_000_000 - target_ns // 1_000_000_000) <= window


def _metadata_changes(source: Entry, target: Entry, options: PlanOptions) -> Tuple[str, ...]:
    changes = []
    if source.kind != SYMLINK and source.permissions != target.permissions:
        changes.append("mode")
    if options.times and not same_time(source.mtime_ns, target.mtime_ns, options.modify_window):
        changes.append("time")
    if options.owner and (source.uid, source.gid) != (target.uid, target.gid):
        changes.append("owner")
    if options.attributes and attributes_differ(source.xattrs, target.xattrs):
        changes.append("xattrs")
    return tuple(changes)


_QUICK_KINDS = (FILE, SYMLINK)


def plan_tree(source: Sequence[Entry], target: Optional[Sequence[Entry]],
              options: PlanOptions = PlanOptions(),
              path_filter: Optional[PathFilter] = None) -> TreePlan:
    """Compare two listings and return what turns the target into the source.

    :param source: The source tree's entries (any order).
    :param target: The target tree's entries, or ``None`` when it does not exist yet.
    :param options: What to compare and whether to delete.
    :param path_filter: Includes and excludes; excluded target entries are never touched.
    """
    path_filter = path_filter or PathFilter()
    wanted = path_filter.apply(source)
    # Each wanted path is taken out as it is planned: what stays is the target's extraneous entries.
    existing: Dict[str, Entry] = {e.path: e for e in (target or ())}
    plan = TreePlan()
    removed: Set[str] = set()  # target directories removed to make way: their contents go too
    groups: Dict[str, _Group] = {}  # -H: by link, the group's first name; only linked files kept
    wanted.sort()  # by path (the first field): parents before children; a list of its own, sorted in place
    for entry in wanted:
        current = existing.pop(entry.path, None)
        _plan_entry(plan, entry, current, options, removed, groups, plan.directory_metadata)
    _plan_extraneous(plan, existing.values(), target or (), options, path_filter, removed)
    plan.files.sort(key=lambda a: a.source.size, reverse=True)
    # Deepest first: setting a parent's time before its children change would not last.
    plan.directory_metadata.sort(key=lambda fix: fix.source.depth, reverse=True)
    return plan


def _plan_entry(plan: TreePlan, entry: Entry, current: Optional[Entry], options: PlanOptions,
                removed: Set[str], groups: Dict[str, "_Group"], directory_fixes: List[MetadataFix]) -> bool:
    """Plan one wanted source entry against what the target has at its path (``current``).

    A directory's metadata fix goes to ``directory_fixes``. Returns whether the
    entry's directory changes (a name made, replaced or removed in it): with -t its
    time is set again afterwards.
    """
    if removed and is_under(entry.parent, removed):
        current = None
    # The common case first: a single-linked file or a symlink whose
    # kind, size, time and mode match, and owner and attributes if asked.
    elif current is not None and entry[1:3] == current[1:3] and entry.mode == current.mode \
            and (entry.mtime_ns == current.mtime_ns or same_time(entry.mtime_ns, current.mtime_ns,
                                                                 options.modify_window)) \
            and entry.kind in _QUICK_KINDS and entry.target == current.target and entry.nlink == 1 \
            and not (options.checksum or options.ignore_times) \
            and (not options.owner or entry[5:7] == current[5:7]) and entry.xattrs == current.xattrs:
        plan.unchanged += 1
        return False
    if entry.kind == FILE and (options.max_size is not None and entry.size > options.max_size
                               or options.min_size is not None and entry.size < options.min_size):
        return False  # --max-size, --min-size: left alone, as rsync's
    if current is None and options.existing:
        return False  # --existing: nothing new is made (nor what a new directory holds)
    if current is not None and options.ignore_existing and entry.kind != DIR:
        return False  # --ignore-existing: what the target has stays as it is
    if options.update and current is not None and current.kind == FILE == entry.kind \
            and current.mtime_ns > entry.mtime_ns \
            and not same_time(entry.mtime_ns, current.mtime_ns, options.modify_window):
        return False  # -u: newer in the target
    if entry.kind == OTHER and not makes_node(entry, options) or entry.kind == SYMLINK and not options.symlinks:
        plan.specials.append(entry)
        return False
    touched = False
    if current is not None and current.kind != entry.kind:
        if current.kind == DIR:
            removed.add(current.path)
        plan.removals.append(current)
        current = None
        touched = True
    if entry.kind == DIR:
        if current is None:
            plan.directories.append(entry)
            touched = True
        changes = ("mode", "time", "owner") if current is None else \
            _metadata_changes(entry, current, options)
        changes = tuple(c for c in changes if c != "time" or options.times)
        changes = tuple(c for c in changes if c != "owner" or options.owner)
        directory_fixes.append(MetadataFix(entry, changes))
    elif entry.kind == OTHER:
        if current is None or not same_node(entry, current):
            plan.nodes.append((entry, current))
            return True
        changes = _metadata_changes(entry, current, options)
        if changes:
            plan.metadata.append(MetadataFix(entry, changes))
        else:
            plan.unchanged += 1
    elif entry.kind == SYMLINK:
        if current is None or current.target != entry.target:
            plan.symlinks.append((entry, current))
            return True
        changes = tuple(c for c in _metadata_changes(entry, current, options) if c != "owner")
        if changes:
            plan.metadata.append(MetadataFix(entry, changes))
        else:
            plan.unchanged += 1
    else:
        linked = options.hard_links and bool(entry.link)
        if linked and entry.link in groups:
            return _plan_follower(plan, entry, current, groups[entry.link]) or touched
        if entry.nlink > 1 and not linked:
            plan.hard_links.append(entry)
        reason = _file_reason(entry, current, options)
        changes = () if current is None else _metadata_changes(entry, current, options)
        # Same size: the content may match, and only the metadata would change, in place.
        if reason in (None, REASON_TIME, REASON_CONTENT) and current is not None \
                and not _keeps_its_file(entry, current, options, groups, changes):
            reason = REASON_SHARED
        if linked:  # the group's first name: copied like any file, the others linked to it
            groups[entry.link] = _Group(entry.path, reason is not None,
                                        current.link if current is not None else "")
        if reason is not None:
            plan.files.append(FileAction(entry, current, reason))
            return True
        if changes:
            plan.metadata.append(MetadataFix(entry, changes))
        else:
            plan.unchanged += 1
    return touched


def root_fix(source: Entry, target: Entry, options: PlanOptions) -> Optional[MetadataFix]:
    """What a sync changes on the target's root directory itself (path ``""``), or None."""
    changes = _metadata_changes(source, target, options)
    return MetadataFix(source._replace(path=""), changes) if changes else None


def makes_node(entry: Entry, options: PlanOptions) -> bool:
    """Whether a sync with ``options`` makes the :data:`OTHER` entry as a node: a device with
    ``devices`` when its numbers are known, a fifo or a socket with ``specials``."""
    if is_device(entry.mode):
        return options.devices and device_numbers(entry.target) is not None
    return options.specials and node_type(entry.mode) != ""


def same_node(entry: Entry, current: Entry) -> bool:
    """Whether ``current`` is the node ``entry`` describes: of its type, and a device of its numbers."""
    return current.kind == OTHER and stat.S_IFMT(current.mode) == stat.S_IFMT(entry.mode) \
        and (not is_device(entry.mode) or device_numbers(current.target) == device_numbers(entry.target))


def node_label(entry: Entry) -> Tuple[str, str]:
    """A node's kind for a line of ``--diff`` (at most 7 characters) and what it is."""
    kind = node_type(entry.mode) or "other"
    if kind in (CHAR_DEVICE, BLOCK_DEVICE):
        return "device", f"{kind} {entry.target or '?'}"
    return kind, kind


#: In a plan's groups (-H), the key prefix of a target file's link group that a source group
#: changes in place; the value's ``leader`` is that source group's link.
_CLAIMED = "target "


class _Group(NamedTuple):
    """A hard-link group met in the source (-H): its first name, and what the others need."""

    leader: str
    rewritten: bool  # the leader gets a new file: every other name must be linked again
    target_link: str  # the target leader's link group ("" when it has one name or none)


def _plan_follower(plan: TreePlan, entry: Entry, current: Optional[Entry], group: _Group) -> bool:
    """A name of a group whose first name is already planned: linked to it, unless it already is."""
    if not group.rewritten and group.target_link and current is not None \
            and current.link == group.target_link:
        plan.unchanged += 1  # one file with the leader in the target: its metadata is the leader's
        return False
    plan.links.append(LinkAction(entry, group.leader, current))
    return True


def _keeps_its_file(entry: Entry, current: Entry, options: PlanOptions, groups: Dict[str, "_Group"],
                    changes: Tuple[str, ...]) -> bool:
    """Whether the target's file at ``entry``'s name may stay, with ``changes`` made in place.

    A change to a file with several names shows in every name. That is right
    only when the source has this name as one of a file with as many names;
    and with -H a target file serves one of the source's groups only. A link
    broken in the source, or names the source does not share, get a new file
    here, as rsync's copy through a temporary gives them.
    """
    if not current.link:
        return True
    if options.hard_links and entry.link:
        claimant = groups.setdefault(_CLAIMED + current.link, _Group(entry.link, False, current.link))
        if claimant.leader != entry.link:
            return False
    return not changes or (bool(entry.link) and entry.nlink == current.nlink)


def _file_reason(entry: Entry, current: Optional[Entry], options: PlanOptions) -> Optional[str]:
    if current is None:
        return REASON_NEW
    if current.size != entry.size:
        return REASON_SIZE
    if options.checksum or options.ignore_times:
        return REASON_CONTENT
    if not options.size_only and not same_time(entry.mtime_ns, current.mtime_ns, options.modify_window):
        return REASON_TIME
    return None


def _plan_extraneous(plan: TreePlan, unmatched: Iterable[Entry], target: Sequence[Entry],
                     options: PlanOptions, path_filter: PathFilter, removed: Set[str]) -> None:
    """The target's entries the source does not have (``unmatched``): deleted or reported."""
    unmatched = sorted(unmatched)  # by path: parents before children
    pruned = set() if path_filter.delete_excluded else \
        {e.path for e in target if e.kind == DIR and path_filter.excluded(e.path, True)}
    extra: List[Entry] = []
    for entry in unmatched:
        if entry.parent and is_under(entry.parent, removed):
            continue
        if entry.kind == DIR and entry.parent and is_under(entry.parent, pruned):
            pruned.add(entry.path)
        if path_filter.protects(entry.path, entry.kind == DIR, pruned):
            continue
        extra.append(entry)
    # A directory holding a protected (excluded) entry must stay.
    keep: Set[str] = set()
    for entry in unmatched:
        if path_filter.protects(entry.path, entry.kind == DIR, pruned):
            keep.update(ancestors(entry.path))
    extra = [e for e in extra if e.path not in keep]
    if options.delete:
        files = [e for e in extra if e.kind != DIR]
        directories = sorted((e for e in extra if e.kind == DIR), key=lambda e: e.depth, reverse=True)
        plan.deletions = files + directories
    else:
        plan.extraneous = extra


@dataclass(frozen=True)
class Difference:
    """One line of ``--diff`` or ``--dry-run``: what differs at a path and how."""

    change: str  # "new", "changed", "replace", "delete", "extraneous", "skip"
    kind: str
    path: str
    details: str = ""

    def render(self) -> str:
        name = (printable(self.path) or ".") + ("/" if self.kind == DIR else "")  # the root: "./", as rsync's
        text = f"{self.change:<10} {self.kind:<7} {name}"
        return f"{text}  ({self.details})" if self.details else text


class TransferItem(str):
    """One line of :func:`transfer_listing`, as rsync's ``-v`` prints it, that also says what it is.

    :ivar path: The path below the root.
    :ivar change: ``"delete"``, ``"directory"``, ``"file"``, ``"symlink"``, ``"link"`` (a hard link) or ``"node"``.
    :ivar detail: A symlink's target or a hard link's leader, else "".
    """

    path: str
    change: str
    detail: str

    def __new__(cls, line: str, path: str, change: str, detail: str = "") -> "TransferItem":
        item = super().__new__(cls, line)
        item.path, item.change, item.detail = path, change, detail
        return item


def transfer_listing(plan: TreePlan) -> List[TransferItem]:
    """What a sync of ``plan`` changes, a line per path in path order, as rsync's ``-v`` lists it.

    The directories it makes (``NAME/``), the files it copies or updates, the symlinks
    (``NAME -> TARGET``) and hard links (``NAME => LEADER``) it makes, and
    ``deleting NAME`` for what it deletes or replaces. Changes of metadata alone are not listed.
    """
    items: List[TransferItem] = []
    for entry in plan.removals + plan.deletions:
        items.append(TransferItem(f"deleting {printable(entry.path)}{'/' if entry.kind == DIR else ''}",
                                  entry.path, "delete"))
    items += [TransferItem(printable(entry.path) + "/", entry.path, "directory") for entry in plan.directories]
    items += [TransferItem(printable(action.source.path), action.source.path, "file") for action in plan.files]
    items += [TransferItem(f"{printable(entry.path)} -> {printable(entry.target or '')}", entry.path, "symlink",
                           entry.target or "") for entry, _ in plan.symlinks]
    items += [TransferItem(f"{printable(link.path)} => {printable(link.leader)}", link.path, "link", link.leader)
              for link in plan.links]
    items += [TransferItem(printable(entry.path), entry.path, "node") for entry, _ in plan.nodes]
    items.sort(key=lambda item: item.path)
    return items


def describe_plan(plan: TreePlan, content_differs: Optional[Dict[str, bool]] = None
                  ) -> List[Difference]:
    """The itemised differences of a plan, in path order.

    :param content_differs: By path, the result of content comparisons made
                            for files whose reason is ``time`` or ``content``;
                            a file known to match is then a metadata change only.
    """
    content_differs = content_differs or {}
    lines: List[Difference] = []
    for entry in plan.removals:
        lines.append(Difference("replace", entry.kind, entry.path, "type differs"))
    for entry in plan.directories:
        lines.append(Difference("new", DIR, entry.path))
    for action in plan.files:
        source, target = action.source, action.target
        if action.reason == REASON_NEW:
            lines.append(Difference("new", FILE, source.path, f"{source.size} bytes"))
            continue
        assert target is not None
        how = []
        if source.size != target.size:
            how.append(f"size {target.size} -> {source.size}")
        if source.mtime_ns != target.mtime_ns:
            how.append("time")
        differs = content_differs.get(source.path)
        if differs or action.reason == REASON_SIZE:
            how.append("content")
        if source.permissions != target.permissions:
            how.append(f"mode {target.permissions:04o} -> {source.permissions:04o}")
        if action.reason == REASON_SHARED:
            how.append("a file of its own")
        if not how:
            if differs is False:
                continue  # compared by content (--checksum) and the same: no difference
            how = ["content unknown"]
        lines.append(Difference("changed", FILE, source.path, ", ".join(how)))
    for entry, current in plan.symlinks:
        lines.append(Difference("new" if current is None else "changed", SYMLINK, entry.path,
                                f"-> {entry.target}"))
    for entry, current in plan.nodes:
        kind, what = node_label(entry)
        lines.append(Difference("new" if current is None else "changed", kind, entry.path, what))
    for link in plan.links:
        lines.append(Difference("new" if link.target is None else "changed", FILE, link.path,
                                f"hard link to {printable(link.leader)}"))
    for fix in plan.metadata + [f for f in plan.directory_metadata
                                if f.changes and f.source not in plan.directories]:
        lines.append(Difference("changed", fix.source.kind, fix.source.path, ", ".join(fix.changes)))
    for entry in plan.deletions:
        lines.append(Difference("delete", entry.kind, entry.path))
    for entry in plan.extraneous:
        lines.append(Difference("extraneous", entry.kind, entry.path))
    for entry in plan.specials:
        lines.append(Difference("skip", node_label(entry)[0], entry.path,
                                f"{node_label(entry)[1]}: not a file, directory or symlink"))
    lines.sort(key=lambda d: d.path)
    return lines


def printable(path: str) -> str:
    """A path for one line of output: control characters and undecodable bytes escaped.

    A name with a newline must not look like two lines, and bytes that are
    not UTF-8 (kept as surrogate escapes) cannot be printed as they are.
    """
    if path.isprintable():
        return path
    out = []
    for char in path:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte
            out.append(f"\\x{code - 0xDC00:02x}")
        elif not char.isprintable():
            out.append(repr(char)[1:-1] if code < 0x10000 else char)
        elif char == "\\":
            out.append("\\\\")
        else:
            out.append(char)
    return "".join(out)


def removal_order(entries: Iterable[Entry]) -> Tuple[List[Entry], List[Entry]]:
    """Split entries to delete into the two phases that cannot race.

    :returns: (everything but directories, to remove in parallel;
              directories, deepest first, to remove one after another).
    """
    entries = list(entries)
    files = [e for e in entries if e.kind != DIR]
    directories = sorted((e for e in entries if e.kind == DIR), key=lambda e: e.depth, reverse=True)
    return files, directories


__all__ = [
    "DIR", "FILE", "OTHER", "SYMLINK", "Difference", "Entry", "FileAction", "LinkAction", "MetadataFix",
    "PathFilter", "PlanOptions", "TreePlan", "describe_plan", "is_under", "kind_of", "plan_tree",
    "TransferItem", "transfer_listing",
    "printable",
    "removal_order",
    "root_fix",
    "same_time",
    "Failure",
    "MKDIR",
    "MKPATH",
    "MKNOD",
    "makes_node",
    "same_node",
    "METADATA",
    "DELETE",
    "REMOVE",
    "BACKUP",
    "LINK",
    "OPERATIONS",
    "Operation",
]


#: A path (relative to the tree's root) and why it failed, in one line.
Failure = Tuple[str, str]

#: Operations of :meth:`~pdiffcopy.engine.treeendpoints.TreeEndpoint.apply`.
MKDIR = "mkdir"  # make the directory (its permissions too); an existing one is fine
#: Make the tree's own directory (the root entry only) and its missing parents (--mkpath); a
#: MKDIR of the root, as rsync's, needs its parent to exist.
MKPATH = "mkpath"
# SYMLINK (the entry kind above, the same word): make or replace a symlink pointing at entry.target
#: Make or replace (in one rename) the device, fifo or socket the entry describes: its type is
#: the mode's, a device's numbers are in entry.target (-D: --devices, --specials).
MKNOD = "mknod"
METADATA = "metadata"  # set permissions, and times/owner as the options say
DELETE = "delete"  # remove a file, symlink or special file, or an empty directory
REMOVE = "remove"  # remove whatever is there, a whole directory tree included
#: Make entry.path another name of the regular file at entry.target (a path in the same
#: tree), replacing what has the name in one step (-H/--hard-links).
LINK = "link"
#: Keep what has the name entry.path (not a directory) as entry.target, a path relative to the
#: tree that may lead out of it (--backup-dir), replacing an older backup: before a change (--backup).
BACKUP = "backup"
OPERATIONS = (MKDIR, SYMLINK, METADATA, DELETE, REMOVE, LINK, MKPATH, MKNOD, BACKUP)


@dataclass(frozen=True)
class Operation:
    """One change :meth:`~pdiffcopy.engine.treeendpoints.TreeEndpoint.apply` makes, described by the source's entry."""

    name: str
    entry: Entry

    def to_wire(self) -> list:
        return [self.name, self.entry.to_wire()]

    @classmethod
    def from_wire(cls, value: Sequence) -> "Operation":
        name, entry = value
        if name not in OPERATIONS:
            raise ValueError(f"unknown operation {name!r}")
        return cls(str(name), Entry.from_wire(entry))

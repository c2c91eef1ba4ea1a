"""Directory trees, the pure part: entries, filters, and what a tree sync must do.

Nothing here touches a file system or a network. A tree is a list of
:class:`Entry` (one per file, directory, symlink or special file below the
tree's root, paths relative to it); :func:`plan_tree` compares a source
listing with a target listing and returns a :class:`TreePlan`: the
directories to make, the files to copy or check, the symlinks to set, the
metadata to fix and the entries to delete, in an order that is safe to run.
The same plan drives a sync, a dry run (``-n``) and the itemised ``--diff``.
"""

from __future__ import annotations

import base64
import re
import stat
from pdiffcopy.core.records import dataclass, field
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from pdiffcopy.core.xattrs import attributes_differ

FILE = "file"
DIR = "dir"
SYMLINK = "symlink"
OTHER = "other"  # fifos, sockets, devices: listed, never copied

#: Why a file in the target is rewritten or checked.
REASON_NEW = "new"
REASON_SIZE = "size"  # sizes differ: the content must change
REASON_TIME = "time"  # same size, other mtime: compare the content, move what differs
REASON_CONTENT = "content"  # --checksum: compare the content whatever the times say
REASON_TYPE = "type"  # something else (a symlink, a special file) stands in the way


def kind_of(mode: int) -> str:
    """The :data:`FILE` / :data:`DIR` / :data:`SYMLINK` / :data:`OTHER` kind of an ``st_mode``."""
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISDIR(mode):
        return DIR
    if stat.S_ISLNK(mode):
        return SYMLINK
    return OTHER


#: One int object per distinct ``st_mode`` (bounded: modes are few in practice):
#: a listing's entries share them instead of holding a 28-byte int each.
_SHARED_MODES: Dict[int, int] = {}
_MAX_SHARED_MODES = 4096


def shared_mode(mode: int) -> int:
    """``mode`` itself, or an equal int object already held by other entries."""
    shared = _SHARED_MODES.get(mode)
    if shared is not None:
        return shared
    if len(_SHARED_MODES) < _MAX_SHARED_MODES:
        _SHARED_MODES[mode] = mode
    return mode


#: The shared int equal to a mode, or None: :func:`shared_mode`'s common case as one C call,
#: for the loops that make an entry per file (``known_mode(m) or shared_mode(m)``).
known_mode = _SHARED_MODES.get


class Entry(NamedTuple):
    """One thing below a tree's root, as ``lstat`` saw it (symlinks are never followed).

    ``path`` is relative to the root, ``/``-separated, without a leading or
    trailing slash; names that are not UTF-8 keep their bytes as
    surrogate escapes (:func:`os.fsdecode`).
    """

    path: str
    kind: str
    size: int
    mtime_ns: int
    mode: int  # the whole st_mode; permissions are mode & 0o7777
    uid: int = 0
    gid: int = 0
    target: str = ""  # what a symlink points at
    nlink: int = 1
    sparse: bool = False  # fewer blocks allocated than the size needs
    #: Shared by the names of one hard-linked file in one listing (-H/--hard-links); "" otherwise.
    link: str = ""
    #: Extended attributes and ACLs (-X/-A): sorted (name, value) pairs; empty when not asked for.
    xattrs: Tuple[Tuple[str, bytes], ...] = ()

    # A named tuple, not a dataclass: a listing makes 60,000 of them and a
    # tuple is built several times faster.

    @property
    def permissions(self) -> int:
        return stat.S_IMODE(self.mode)

    @property
    def parent(self) -> str:
        return self.path.rpartition("/")[0]

    @property
    def depth(self) -> int:
        return self.path.count("/")

    def to_wire(self) -> list:
        """A compact JSON-ready form (the listing of 60,000 files stays small).

        Ten values; twelve when the entry has a link group or attributes: then the
        link and the attributes as ``[name, base64 value]`` pairs.
        """
        plain = [*self[:9], int(self.sparse)]
        if not self.link and not self.xattrs:
            return plain
        return [*plain, self.link, [[name, base64.b64encode(value).decode("ascii")] for name, value in self.xattrs]]

    @classmethod
    def from_wire(cls, value: Sequence) -> "Entry":
        path, kind, size, mtime_ns, mode, uid, gid, target, nlink, sparse = value[:10]
        link, xattrs = (value[10], value[11]) if len(value) > 10 else ("", ())
        if kind not in (FILE, DIR, SYMLINK, OTHER):
            raise ValueError(f"unknown entry kind {kind!r}")
        return cls(str(path), kind, int(size), int(mtime_ns), int(mode), int(uid), int(gid),
                   str(target), int(nlink), bool(sparse), str(link),
                   tuple((str(name), base64.b64decode(data, validate=True)) for name, data in xattrs))


#: The characters that make a pattern a glob; a regex option given one that
#: does not compile (``--exclude-regex '*.tmp'``) is most likely a glob meant for --exclude.
_GLOB_CHARS = frozenset("*?[")

#: rsync's rule prefixes in an --exclude-from file: "+ PATTERN" and "- PATTERN".
INCLUDE, EXCLUDE = "+", "-"


def glob_to_regex(pattern: str) -> Tuple["re.Pattern[str]", bool]:
    """rsync's glob as a regex over a relative path, and whether it matches directories only.

    A leading ``/`` anchors the pattern to the tree's root; otherwise it
    matches the end of the path at a name boundary (so a pattern without
    ``/`` matches the last name at any depth, and ``sub/*.o`` matches
    ``sub/a.o`` and ``x/sub/a.o``, as in rsync). A trailing ``/`` matches
    directories only, ``*`` and ``?`` never cross ``/``, ``**`` does,
    ``[...]`` is a character class (``[!...]`` negated) and a trailing
    ``/***`` matches a directory and everything in it.
    """
    dir_only = pattern.endswith("/") and pattern != "/"
    body = pattern.rstrip("/") if dir_only else pattern
    anchored = body.startswith("/")
    body = body.lstrip("/")
    subtree = body.endswith("/***")
    if subtree:
        body = body[:-4]
    out = []
    i = 0
    while i < len(body):
        char = body[i]
        if body.startswith("**", i):
            out.append(".*")
            i += 2
            while i < len(body) and body[i] == "*":
                i += 1
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "\\" and i + 1 < len(body):
            i += 1
            out.append(re.escape(body[i]))
        elif char == "[" and _class_end(body, i) > 0:
            end = _class_end(body, i)
            inner = body[i + 1:end]
            if inner[:1] == "!":
                inner = "^" + inner[1:]
            out.append("[" + inner.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    regex = ("^" if anchored else "(?:^|/)") + "".join(out) + ("(?:/.*)?$" if subtree else "$")
    return re.compile(regex, re.DOTALL), dir_only and not subtree


def _class_end(body: str, start: int) -> int:
    """Where the ``[...]`` opened at ``start`` closes (a ``]`` first in it is literal), or -1."""
    first = start + 1
    if body[first:first + 1] in ("!", "^"):
        first += 1
    return body.find("]", first + 1)


class PathFilter:
    """rsync's ``--include``/``--exclude`` globs, ``--files-from``, and ``-i``/``--exclude-regex`` regexes.

    The glob rules are tried first, in the order given, and the first one that
    matches decides (rsync's rule); a path no glob matches falls to the
    regexes. The regexes are searched (not anchored: ``^`` and ``$`` anchor)
    in the path as it is, and in a directory's path also with a trailing
    slash, so ``--exclude-regex '^build/'`` excludes the directory build and everything in
    it. An excluded directory is not entered. With regex includes, a file or
    symlink is taken only when one of them (or a glob include) matches;
    directories are entered regardless and made only when they match or hold
    something taken. With ``files_from`` only the listed paths, everything
    below a listed directory and the directories on their way are taken.
    """

    def __init__(self, includes: Iterable[str] = (), excludes: Iterable[str] = (),
                 rules: Iterable[Tuple[str, str]] = (), files_from: Optional[Iterable[str]] = None) -> None:
        self.includes = [self._compile(text, "include") for text in includes]
        self.excludes = [self._compile(text, "exclude") for text in excludes]
        self.rules = [(action, *glob_to_regex(pattern)) for action, pattern in rules]
        self.files_from: Optional[Set[str]] = None
        self.files_from_parents: Set[str] = set()
        if files_from is not None:
            self.files_from = {p for p in (normalise_listed(text) for text in files_from) if p}
            for path in self.files_from:
                self.files_from_parents.update(_ancestors(path))

    @staticmethod
    def _compile(text: str, what: str) -> "re.Pattern[str]":
        try:
            return re.compile(text)
        except re.error as error:
            if _GLOB_CHARS & set(text):  # the regex error ("nothing to repeat") would mislead
                raise ValueError(f"The {what} regex {text!r} looks like a glob: use --{what} {text!r} "
                                 f"(-i/-e and --{what}-regex take regular expressions)") from None
            raise ValueError(f"Invalid {what} regex {text!r}: {error}") from None

    @property
    def active(self) -> bool:
        return bool(self.includes or self.excludes or self.rules) or self.files_from is not None

    @staticmethod
    def _matches(patterns: List["re.Pattern[str]"], path: str, is_dir: bool) -> bool:
        return any(p.search(path) or (is_dir and p.search(path + "/")) for p in patterns)

    def _rule(self, path: str, is_dir: bool) -> Optional[str]:
        """The action of the first glob rule that matches, or None."""
        for action, regex, dir_only in self.rules:
            if (is_dir or not dir_only) and regex.search(path):
                return action
        return None

    def excluded(self, path: str, is_dir: bool) -> bool:
        action = self._rule(path, is_dir)
        if action is not None:
            return action == EXCLUDE
        return self._matches(self.excludes, path, is_dir)

    def included(self, path: str, is_dir: bool) -> bool:
        if not self.includes:
            return True
        action = self._rule(path, is_dir)
        if action is not None:
            return action == INCLUDE
        return self._matches(self.includes, path, is_dir)

    def listed(self, path: str) -> bool:
        """Whether ``files_from`` takes ``path``: listed, below a listed path, or on the way to one."""
        if self.files_from is None:
            return True
        return path in self.files_from_parents or is_under(path, self.files_from)

    def apply(self, entries: Iterable[Entry]) -> List[Entry]:
        """The entries the filters let through (see the class description)."""
        if not self.active:
            return list(entries)
        pruned: Set[str] = set()
        taken: List[Entry] = []
        for entry in sorted(entries, key=lambda e: e.path):
            parent = entry.parent
            if parent and is_under(parent, pruned):
                if entry.kind == DIR:
                    pruned.add(entry.path)
                continue
            is_dir = entry.kind == DIR
            if self.excluded(entry.path, is_dir) or not self.listed(entry.path):
                if is_dir:
                    pruned.add(entry.path)
                continue
            taken.append(entry)
        if not self.includes:
            return taken
        # With includes: keep what matches, and the directories on its way.
        wanted = [e for e in taken if e.kind != DIR and self.included(e.path, False)]
        needed: Set[str] = set()
        for entry in taken:
            if entry.kind == DIR and self.included(entry.path, True):
                needed.add(entry.path)
        for entry in wanted:
            needed.update(_ancestors(entry.path))
        for path in list(needed):
            needed.update(_ancestors(path))
        chosen = {e.path for e in wanted}  # a set: "in" a list made this quadratic in the files
        return [e for e in taken if (e.kind == DIR and e.path in needed)
                or (e.kind != DIR and e.path in chosen)]

    def protects(self, path: str, is_dir: bool, parents_pruned: Set[str]) -> bool:
        """Whether a target entry is outside what the filters select (and so never deleted)."""
        if path.rpartition("/")[0] and is_under(path.rpartition("/")[0], parents_pruned):
            return True
        if self.excluded(path, is_dir) or not self.listed(path):
            return True
        return bool(self.includes) and not self.included(path, is_dir)


def normalise_listed(text: str) -> str:
    """A --files-from line as a relative path: no leading ``./`` or ``/``, no trailing ``/``."""
    path = text.strip("/")
    while path.startswith("./"):
        path = path[2:].lstrip("/")
    return "" if path == "." else path


def _ancestors(path: str) -> List[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def is_under(directory: str, prefixes: Set[str]) -> bool:
    """Whether ``directory`` is one of ``prefixes`` or below one."""
    if not prefixes:  # the usual case; walking up costs the depth, per entry of a deep tree
        return False
    while directory:
        if directory in prefixes:
            return True
        directory = directory.rpartition("/")[0]
    return False


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
    2. :attr:`files` and :attr:`symlinks` (in parallel; the files largest first);
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
    metadata: List[MetadataFix] = field(default_factory=list)
    directory_metadata: List[MetadataFix] = field(default_factory=list)
    removals: List[Entry] = field(default_factory=list)
    deletions: List[Entry] = field(default_factory=list)
    extraneous: List[Entry] = field(default_factory=list)  # left alone (no --delete)
    unchanged: int = 0
    specials: List[Entry] = field(default_factory=list)  # skipped with a warning
    hard_links: List[Entry] = field(default_factory=list)  # copied as separate files (no -H)
    links: List[LinkAction] = field(default_factory=list)  # -H: names linked to their group's first
    blocked: List[Tuple[Entry, str]] = field(default_factory=list)  # cannot be synced

    @property
    def bytes_to_copy(self) -> int:
        return sum(action.source.size for action in self.files)

    @property
    def empty(self) -> bool:
        return not (self.directories or self.files or self.symlinks or self.metadata
                    or self.directory_metadata or self.removals or self.deletions or self.links)


def _metadata_changes(source: Entry, target: Entry, options: PlanOptions) -> Tuple[str, ...]:
    changes = []
    if source.kind != SYMLINK and source.permissions != target.permissions:
        changes.append("mode")
    if options.times and source.mtime_ns != target.mtime_ns:
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
    elif current is not None and entry[1:5] == current[1:5] and entry.kind in _QUICK_KINDS \
            and entry.target == current.target and entry.nlink == 1 \
            and not options.checksum and (not options.owner or entry[5:7] == current[5:7]) \
            and entry.xattrs == current.xattrs:
        plan.unchanged += 1
        return False
    if entry.kind == OTHER:
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
        if linked:  # the group's first name: copied like any file, the others linked to it
            groups[entry.link] = _Group(entry.path, reason is not None,
                                        current.link if current is not None else "")
        if reason is not None:
            plan.files.append(FileAction(entry, current, reason))
            return True
        assert current is not None
        changes = _metadata_changes(entry, current, options)
        if changes:
            plan.metadata.append(MetadataFix(entry, changes))
        else:
            plan.unchanged += 1
    return touched


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


def _file_reason(entry: Entry, current: Optional[Entry], options: PlanOptions) -> Optional[str]:
    if current is None:
        return REASON_NEW
    if current.size != entry.size:
        return REASON_SIZE
    if options.checksum:
        return REASON_CONTENT
    if current.mtime_ns != entry.mtime_ns:
        return REASON_TIME
    return None


def _plan_extraneous(plan: TreePlan, unmatched: Iterable[Entry], target: Sequence[Entry],
                     options: PlanOptions, path_filter: PathFilter, removed: Set[str]) -> None:
    """The target's entries the source does not have (``unmatched``): deleted or reported."""
    unmatched = sorted(unmatched)  # by path: parents before children
    pruned = {e.path for e in target if e.kind == DIR and path_filter.excluded(e.path, True)}
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
            keep.update(_ancestors(entry.path))
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
        name = printable(self.path) + ("/" if self.kind == DIR else "")
        text = f"{self.change:<10} {self.kind:<7} {name}"
        return f"{text}  ({self.details})" if self.details else text


def transfer_listing(plan: TreePlan) -> List[str]:
    """What a sync of ``plan`` changes, a line per path in path order, as rsync's ``-v`` lists it.

    The directories it makes (``NAME/``), the files it copies or updates, the symlinks
    (``NAME -> TARGET``) and hard links (``NAME => LEADER``) it makes, and
    ``deleting NAME`` for what it deletes or replaces. Changes of metadata alone are not listed.
    """
    lines: List[Tuple[str, str]] = []
    for entry in plan.removals + plan.deletions:
        lines.append((entry.path, f"deleting {printable(entry.path)}{'/' if entry.kind == DIR else ''}"))
    lines += [(entry.path, printable(entry.path) + "/") for entry in plan.directories]
    lines += [(action.source.path, printable(action.source.path)) for action in plan.files]
    lines += [(entry.path, f"{printable(entry.path)} -> {printable(entry.target or '')}")
              for entry, _ in plan.symlinks]
    lines += [(link.path, f"{printable(link.path)} => {printable(link.leader)}") for link in plan.links]
    lines.sort(key=lambda line: line[0])
    return [line for _, line in lines]


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
        if not how:
            if differs is False:
                continue  # compared by content (--checksum) and the same: no difference
            how = ["content unknown"]
        lines.append(Difference("changed", FILE, source.path, ", ".join(how)))
    for entry, current in plan.symlinks:
        lines.append(Difference("new" if current is None else "changed", SYMLINK, entry.path,
                                f"-> {entry.target}"))
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
        lines.append(Difference("skip", OTHER, entry.path, "not a file, directory or symlink"))
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
    "transfer_listing",
    "printable",
    "removal_order",
    "Failure",
    "MKDIR",
    "MKPATH",
    "METADATA",
    "DELETE",
    "REMOVE",
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
METADATA = "metadata"  # set permissions, and times/owner as the options say
DELETE = "delete"  # remove a file, symlink or special file, or an empty directory
REMOVE = "remove"  # remove whatever is there, a whole directory tree included
#: Make entry.path another name of the regular file at entry.target (a path in the same
#: tree), replacing what has the name in one step (-H/--hard-links).
LINK = "link"
OPERATIONS = (MKDIR, SYMLINK, METADATA, DELETE, REMOVE, LINK, MKPATH)


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

"""A tree plan made as the two listings come, in pieces: memory flat in the number of files.

Both trees' walks give each directory's entries sorted by name, a directory
after another in depth-first order of their paths (:func:`walk_order`), so
the source and the target listings merge as rsync's incremental recursion
does: an entry is planned when both sides have passed its place, and then
forgotten. :class:`StreamPlanner` hands on :class:`~pdiffcopy.core.treeplan.TreePlan`
pieces of a bounded size, each safe to run once those before it have run:

* a directory is made in the piece that plans it, before what it holds;
* a directory's metadata fix comes in the first piece after the walk has
  left its subtree (children before parents), and waits on a stack of the
  directories still open: bounded by the depth times the subdirectories of one directory;
* a hard-link group (-H) is remembered by its first name only for files
  with more than one link;
* deletions (--delete) come in the last piece, once both walks have
  ended: a source directory that could not be listed is only known then
  (a server sends its failures last), and its target contents would look
  extraneous. Only the target's unmatched entries are kept until then.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

from pdiffcopy.core.treeplan import (
    DIR,
    Entry,
    MetadataFix,
    PathFilter,
    PlanOptions,
    TreePlan,
    _Group,
    _plan_entry,
    _plan_extraneous,
    is_under,
)

#: Actions in one piece of a streamed plan (the runner forks its workers once per piece).
PIECE_ACTIONS = 20000

#: The first piece holds this fraction of :data:`PIECE_ACTIONS`; each next one twice its predecessor's.
FIRST_PIECE_FRACTION = 8


def walk_order(path: str) -> Tuple[str, str]:
    """The sort key of a path in a walk's order: its directory in depth-first order, then its name.

    A directory's entries come together, sorted by name; the directories come
    in the order of their paths compared name by name (``a``, ``a/b``, ``a-c``:
    ``/`` as the lowest character).
    """
    parent, _, name = path.rpartition("/")
    return parent.replace("/", "\0"), name


def in_walk_order(entries: Iterable[Entry]) -> List[Entry]:
    """Entries listed in no particular order, sorted in :func:`walk_order` (held whole: the fallback)."""
    return sorted(entries, key=lambda entry: walk_order(entry.path))


def filtered(entries: Iterable[Entry], path_filter: PathFilter) -> Iterator[Entry]:
    """The entries the filters let through, as they come (in walk order).

    :meth:`PathFilter.apply`'s result without its includes (which keep a
    directory for what it turns out to hold: see :meth:`StreamPlanner.plan`).
    """
    if not path_filter.active:
        return iter(entries)
    return _filtered(entries, path_filter)


def _filtered(entries: Iterable[Entry], path_filter: PathFilter) -> Iterator[Entry]:
    pruned: Set[str] = set()  # excluded directories: nothing below them is taken
    for entry in entries:
        path = entry.path
        is_dir = entry.kind == DIR
        parent = path.rpartition("/")[0]
        if pruned and parent and is_under(parent, pruned):
            if is_dir:
                pruned.add(path)
            continue
        if not path_filter.takes(path, is_dir):
            if is_dir:
                pruned.add(path)
            continue
        yield entry


class _OpenDirectory:
    """A source directory planned whose subtree the walk has not left: its fix waits."""

    __slots__ = ("path", "key", "fix", "touched")

    def __init__(self, fix: MetadataFix) -> None:
        self.path = fix.source.path
        self.key = self.path.replace("/", "\0")
        self.fix = fix
        self.touched = False


class StreamPlanner:
    """Plans a tree sync from two listings in walk order, a bounded piece at a time.

    Once :attr:`finished` (the last piece), :attr:`wanted` says how many source
    entries the filters let through.
    """

    def __init__(self, options: PlanOptions, path_filter: Optional[PathFilter] = None,
                 piece_actions: Optional[int] = None) -> None:
        self.options = options
        self.path_filter = path_filter or PathFilter()
        self.piece_actions = piece_actions or PIECE_ACTIONS
        self.wanted = 0
        #: True once the last piece is handed on (both listings read to their ends).
        self.finished = False

    def plan(self, source: Iterable[Entry], target: Optional[Iterable[Entry]]) -> Iterator[TreePlan]:
        """Yield the plan in pieces; the last holds the deletions (or the extraneous entries).

        :param source: The source tree's entries, in :func:`walk_order`.
        :param target: The target tree's entries in walk order, or ``None`` when it does not exist yet.
        """
        options = self.options
        path_filter = self.path_filter
        if path_filter.holds_whole:
            # An include (or -m) keeps a directory for what is found below it later: held whole to decide.
            wanted: Iterator[Entry] = iter(in_walk_order(path_filter.apply(source)))
        else:
            wanted = filtered(source, path_filter)
        theirs = iter(target if target is not None else ())
        piece = TreePlan()
        removed: Set[str] = set()
        groups: Dict[str, _Group] = {}
        unmatched: List[Entry] = []  # the target's entries the source has not: extraneous or protected
        refix: Dict[str, Entry] = {}  # -t --delete: source directories whose target loses entries
        open_directories: List[_OpenDirectory] = []  # the top is the next to close
        by_path: Dict[str, _OpenDirectory] = {}
        block: Optional[str] = None  # the directory whose entries the source walk gives now
        block_directory: Optional[_OpenDirectory] = None
        block_subdirectories: List[_OpenDirectory] = []
        fixes: List[MetadataFix] = []
        keep_refix = options.delete and options.times

        def close_until(parent: Optional[str]) -> None:
            """Close the open directories the walk has left, before it enters ``parent`` (None: the end)."""
            open_directories.extend(reversed(block_subdirectories))
            block_subdirectories.clear()
            key = None if parent is None else parent.replace("/", "\0")
            while open_directories:
                top = open_directories[-1]
                if key is not None and (top.path == parent or parent.startswith(top.path + "/")
                                        or top.key > key):
                    break
                open_directories.pop()
                del by_path[top.path]
                if top.fix.changes or (options.times and top.touched):
                    piece.directory_metadata.append(top.fix)

        def take(entry: Entry, current: Optional[Entry]) -> None:
            nonlocal block, block_directory
            parent = entry.path.rpartition("/")[0]
            if parent != block:
                close_until(parent)
                block = parent
                block_directory = by_path.get(parent)
            self.wanted += 1
            if _plan_entry(piece, entry, current, options, removed, groups, fixes) and block_directory:
                block_directory.touched = True
            if fixes:
                directory = _OpenDirectory(fixes.pop())
                block_subdirectories.append(directory)
                by_path[directory.path] = directory

        def extra(entry: Entry) -> None:
            unmatched.append(entry)
            if keep_refix:
                parent = entry.path.rpartition("/")[0]
                directory = by_path.get(parent)
                if directory is not None:
                    refix[parent] = directory.fix.source

        def size(plan: TreePlan) -> int:
            return len(plan.files) + len(plan.directories) + len(plan.symlinks) + len(plan.metadata) + \
                len(plan.nodes) + len(plan.links) + len(plan.removals) + len(plan.directory_metadata)

        # walk_order inline: two calls per entry are a tenth of a no-change sync's planning. A path
        # both trees have (most, when little changed) needs no key: the same path is the same place.
        ours = next(wanted, None)
        current = next(theirs, None)
        current_key = None
        taken = 0
        # The first pieces are smaller, growing to the bound: the workers start copying
        # after a short listing, and each piece is planned while the one before it runs.
        bound = max(1, self.piece_actions // FIRST_PIECE_FRACTION)
        check_every = next_check = min(256, bound)
        while ours is not None:
            if current is None:
                take(ours, None)
            elif current.path == ours.path:
                take(ours, current)
                current = next(theirs, None)
                current_key = None
            else:
                parent, _, name = ours.path.rpartition("/")
                our_key = (parent.replace("/", "\0"), name)
                while current is not None:
                    if current_key is None:
                        parent, _, name = current.path.rpartition("/")
                        current_key = (parent.replace("/", "\0"), name)
                    if current_key >= our_key:
                        break
                    extra(current)
                    current = next(theirs, None)
                    current_key = None
                if current is not None and current_key == our_key:
                    take(ours, current)
                    current = next(theirs, None)
                    current_key = None
                else:
                    take(ours, None)
            ours = next(wanted, None)
            taken += 1
            if taken == next_check:  # not every entry: a piece may pass its bound a little
                next_check += check_every
                if size(piece) >= bound:
                    yield piece
                    piece = TreePlan()
                    bound = min(bound * 2, self.piece_actions)
        while current is not None:
            extra(current)
            current = next(theirs, None)
        close_until(None)
        _plan_extraneous(piece, unmatched, unmatched, options, path_filter, removed)
        unmatched.clear()  # the extraneous entries are the piece's now; the list goes
        if piece.deletions and refix:
            # Set again after the deletions changed their times (no change of their own: a dry run lists none).
            gone = {entry.path for entry in piece.deletions}
            parents = {entry.parent for entry in piece.deletions} - gone
            piece.directory_metadata += sorted(
                (MetadataFix(refix[path], ()) for path in parents if path in refix),
                key=lambda fix: fix.source.depth, reverse=True)
        self.finished = True
        yield piece


__all__ = ["PIECE_ACTIONS", "StreamPlanner", "filtered", "in_walk_order", "walk_order"]

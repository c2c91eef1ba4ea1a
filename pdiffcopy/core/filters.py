"""Which paths a tree sync takes: rsync's filter rules, globs, and --files-from lists.

Pure: the rules are compiled once and asked per path; nothing here touches a
file system. :func:`~pdiffcopy.core.treeplan.plan_tree` asks a :class:`PathFilter`.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Set, Tuple

from pdiffcopy.core.entries import DIR, Entry

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
    ``/***`` matches a directory and everything in it. A leading ``**/`` of a
    pattern that is not anchored may stand for no directory (``**/*.o``
    matches ``x.o``); anywhere else ``**/`` stands for one directory or more.
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
    if not anchored and body.startswith("**/"):
        out.append("(?:.*/)?")  # rsync: a leading **/ may stand for no directory at all
        i = 3
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


def glob_escape(name: str) -> str:
    """``name`` as a glob that matches it alone (its ``*``, ``?``, ``[`` and ``\\`` escaped)."""
    return re.sub(r"([*?\[\\])", r"\\\1", name)


def _class_end(body: str, start: int) -> int:
    """Where the ``[...]`` opened at ``start`` closes (a ``]`` first in it is literal), or -1."""
    first = start + 1
    if body[first:first + 1] in ("!", "^"):
        first += 1
    return body.find("]", first + 1)


class PathFilter:
    """rsync's ``--include``/``--exclude`` globs, ``--files-from``, and ``--include-regex``/``--exclude-regex`` regexes.

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
                 rules: Iterable[Tuple[str, str]] = (), files_from: Optional[Iterable[str]] = None,
                 protected: Iterable[str] = (), delete_excluded: bool = False, prune_empty: bool = False) -> None:
        self.includes = [self._compile(text, "include") for text in includes]
        self.excludes = [self._compile(text, "exclude") for text in excludes]
        self.rules = [(action, *glob_to_regex(pattern)) for action, pattern in rules]
        #: rsync's protect rules (P GLOB): target paths never deleted, whatever the source has.
        self.protected = [glob_to_regex(pattern) for pattern in protected]
        #: --delete-excluded: what the globs and regexes leave out is no longer protected from --delete.
        self.delete_excluded = delete_excluded
        #: -m: :meth:`apply` drops the directories that would hold nothing.
        self.prune_empty = prune_empty
        self.files_from: Optional[Set[str]] = None
        self.files_from_parents: Set[str] = set()
        #: The listed paths and their parents met so far (:meth:`takes`), and those of them excluded.
        self.met: Set[str] = set()
        self.met_excluded: Set[str] = set()
        if files_from is not None:
            self.files_from = {p for p in (normalise_listed(text) for text in files_from) if p}
            for path in self.files_from:
                self.files_from_parents.update(ancestors(path))

    @staticmethod
    def _compile(text: str, what: str) -> "re.Pattern[str]":
        try:
            return re.compile(text)
        except re.error as error:
            if _GLOB_CHARS & set(text):  # the regex error ("nothing to repeat") would mislead
                raise ValueError(f"The {what} regex {text!r} looks like a glob: use --{what} {text!r} "
                                 f"(--include-regex and --exclude-regex take regular expressions)") from None
            raise ValueError(f"Invalid {what} regex {text!r}: {error}") from None

    @property
    def active(self) -> bool:
        return bool(self.includes or self.excludes or self.rules or self.prune_empty) or self.files_from is not None

    @property
    def holds_whole(self) -> bool:
        """Whether :meth:`apply` must see the whole listing: what a directory holds decides it."""
        return bool(self.includes) or self.prune_empty

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

    def takes(self, path: str, is_dir: bool) -> bool:
        """Whether the filters take ``path`` (its parents taken): listed, and not excluded.

        With ``files_from`` a listed path (or a parent of one) is remembered as met,
        for :meth:`missing`.
        """
        if self.files_from is None:
            return not self.excluded(path, is_dir)
        if path in self.files_from or path in self.files_from_parents:
            self.met.add(path)
            if self.excluded(path, is_dir):
                self.met_excluded.add(path)
                return False
            return True
        return self.listed(path) and not self.excluded(path, is_dir)

    def missing(self) -> List[str]:
        """The --files-from paths the source did not have (once its walk is over), in order;
        one below an excluded directory is not missing, only left out."""
        if self.files_from is None:
            return []
        return sorted(path for path in self.files_from - self.met
                      if not is_under(path.rpartition("/")[0], self.met_excluded))

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
            if not self.takes(entry.path, is_dir):
                if is_dir:
                    pruned.add(entry.path)
                continue
            taken.append(entry)
        if self.includes:
            taken = self._with_included(taken)
        return _without_empty_directories(taken) if self.prune_empty else taken

    def _with_included(self, taken: List[Entry]) -> List[Entry]:
        # With includes: keep what matches, and the directories on its way.
        wanted = [e for e in taken if e.kind != DIR and self.included(e.path, False)]
        needed: Set[str] = set()
        for entry in taken:
            if entry.kind == DIR and self.included(entry.path, True):
                needed.add(entry.path)
        for entry in wanted:
            needed.update(ancestors(entry.path))
        for path in list(needed):
            needed.update(ancestors(path))
        chosen = {e.path for e in wanted}  # a set: "in" a list made this quadratic in the files
        return [e for e in taken if (e.kind == DIR and e.path in needed)
                or (e.kind != DIR and e.path in chosen)]

    def protects(self, path: str, is_dir: bool, parents_pruned: Set[str]) -> bool:
        """Whether a target entry is outside what the filters select (and so never deleted)."""
        if path.rpartition("/")[0] and is_under(path.rpartition("/")[0], parents_pruned):
            return True
        if (self.excluded(path, is_dir) and not self.delete_excluded) or not self.listed(path):
            return True
        if any((is_dir or not dir_only) and regex.search(path) for regex, dir_only in self.protected):
            return True
        return bool(self.includes) and not self.delete_excluded and not self.included(path, is_dir)


def _without_empty_directories(entries: List[Entry]) -> List[Entry]:
    """``entries`` less the directories nothing but directories (or nothing) is below: rsync's -m."""
    needed: Set[str] = set()
    for entry in entries:
        if entry.kind != DIR:
            needed.update(ancestors(entry.path))
    return [entry for entry in entries if entry.kind != DIR or entry.path in needed]


def normalise_listed(text: str) -> str:
    """A --files-from line as a relative path, as rsync reads it: no leading ``/``, no empty
    or ``.`` component (``./a//b/`` is ``a/b``)."""
    return "/".join(part for part in text.split("/") if part not in ("", "."))


def split_at_marker(text: str) -> Tuple[str, str]:
    """A --files-from line cut at rsync's relative-path marker ``/./``: (the directory below the
    source it is read from, the path it has there and in the target), both normalised.

    ``from/./dir`` is ``from/dir`` synced as ``dir``; a line without a marker is read from the
    source itself (``""``). A leading ``./`` marks nothing off.
    """
    head, marker, tail = "/".join(part for part in text.split("/") if part).partition("/./")
    if not marker:
        return "", normalise_listed(text)
    return normalise_listed(head), normalise_listed(tail)


def files_from_roots(lines: Iterable[str]) -> Dict[str, Tuple[str, ...]]:
    """--files-from's lines grouped by the directory below the source each is read from
    (:func:`split_at_marker`), in the order first seen."""
    roots: Dict[str, List[str]] = {}
    for line in lines:
        head, path = split_at_marker(line)
        roots.setdefault(head, []).append(path)
    return {head: tuple(paths) for head, paths in roots.items()}


def ancestors(path: str) -> List[str]:
    """The directories above ``path``, top first (``a/b/c``: ``a``, ``a/b``)."""
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


__all__ = ["EXCLUDE", "INCLUDE", "PathFilter", "files_from_roots", "glob_escape", "glob_to_regex", "is_under",
           "normalise_listed", "split_at_marker"]

"""rsync's ``-i``/``--itemize-changes``: one line per change of a tree plan, in rsync's 11-letter code.

``YXcstpoguax PATH``: Y is the update (``>`` a file received, ``<`` sent to a
server, ``c`` made here, ``h`` a hard link, ``.`` attributes only, ``*`` a
message such as ``*deleting``); X the kind (``f`` file, ``d`` directory,
``L`` symlink, ``D`` device, ``S`` special file); then what differs: the
checksum, size, time, permissions, owner, group, (``u``, unused here), ACL
and extended attributes, a dot for what does not, ``+`` throughout for
something new. Pure: the lines of a plan, as rsync prints them.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from pdiffcopy.core.entries import DIR, FILE, OTHER, SYMLINK, Entry, is_device
from pdiffcopy.core.treeplan import REASON_CONTENT, MetadataFix, PlanOptions, TreePlan, printable, same_time
from pdiffcopy.core.xattrs import ACL_NAMES, attributes_differ

_KINDS = {FILE: "f", DIR: "d", SYMLINK: "L"}
_NEW = "+" * 9


def _kind(entry: Entry) -> str:
    if entry.kind == OTHER:
        return "D" if is_device(entry.mode) else "S"
    return _KINDS[entry.kind]


def _name(entry: Entry) -> str:
    if not entry.path:
        return "./"
    return printable(entry.path) + ("/" if entry.kind == DIR else "")


def _split_attributes(entry: Entry) -> Tuple[tuple, tuple]:
    acls = tuple(pair for pair in entry.xattrs if pair[0] in ACL_NAMES)
    return acls, tuple(pair for pair in entry.xattrs if pair[0] not in ACL_NAMES)


def _flags(source: Entry, target: Optional[Entry], options: PlanOptions, content: bool = False) -> str:
    """The nine letters after YX: what differs between an entry and the target's."""
    if target is None:
        return _NEW
    source_acls, source_xattrs = _split_attributes(source)
    target_acls, target_xattrs = _split_attributes(target)
    letters = [
        "c" if content else ".",
        "s" if source.kind == FILE and source.size != target.size else ".",
        "t" if options.times and _times_differ(source, target, options.modify_window) else ".",
        "p" if source.kind != SYMLINK and source.permissions != target.permissions else ".",
        "o" if options.owner and source.uid != target.uid else ".",
        "g" if options.owner and source.gid != target.gid else ".",
        ".",
        "a" if options.attributes and attributes_differ(source_acls, target_acls) else ".",
        "x" if options.attributes and attributes_differ(source_xattrs, target_xattrs) else ".",
    ]
    return "".join(letters)


def _times_differ(source: Entry, target: Entry, window: int) -> bool:
    """As the quick check sees a file's times; a symlink's, a directory's and a node's as rsync's
    letters show them (whole seconds, but with a window below 0)."""
    if source.kind == FILE:
        return not same_time(source.mtime_ns, target.mtime_ns, window)
    if window < 0:
        return source.mtime_ns != target.mtime_ns
    return abs(source.mtime_ns // 1_000_000_000 - target.mtime_ns // 1_000_000_000) > window


def _fix_flags(fix: MetadataFix) -> str:
    """A metadata fix's letters, from the changes it names (the target's entry is not kept)."""
    changes = set(fix.changes)
    return "".join(["..", "t" if "time" in changes else ".", "p" if "mode" in changes else ".",
                    "o" if "owner" in changes else ".", "g" if "owner" in changes else ".", ".",
                    ".", "x" if "xattrs" in changes else "."])


def itemized_lines(plan: TreePlan, options: PlanOptions, sent: bool = False, root_made: bool = False,
                   currents: Optional[dict] = None) -> List[str]:
    """The itemized lines of ``plan``, in path order.

    :param sent: Files go to a server (``<``), not received here (``>``).
    :param root_made: The target's root directory is made by this plan (``cd+++++++++ ./``).
    :param currents: The target's entries by path, for the letters of metadata fixes (optional:
                     without, they come from the changes the fix names).
    """
    arrow = "<" if sent else ">"
    lines: List[Tuple[str, str]] = []
    if root_made:
        lines.append(("", "cd" + _NEW + " ./"))
    for entry in plan.directories:
        lines.append((entry.path, "cd" + _NEW + " " + _name(entry)))
    for action in plan.files:
        lines.append((action.path, arrow + "f" + _flags(action.source, action.target, options,
                                                          content=action.reason == REASON_CONTENT)
                      + " " + _name(action.source)))
    for entry, current in plan.symlinks:
        lines.append((entry.path, "cL" + (_NEW if current is None else "c" + _flags(entry, current, options)[1:])
                      + f" {_name(entry)} -> {printable(entry.target)}"))
    for entry, current in plan.nodes:
        lines.append((entry.path, "c" + _kind(entry) + _flags(entry, current, options) + " " + _name(entry)))
    for link in plan.links:
        lines.append((link.path, "hf" + _NEW + f" {_name(link.source)} => {printable(link.leader)}"))
    for fix in plan.metadata + [fix for fix in plan.directory_metadata if fix.changes]:
        if fix.source.kind == DIR and fix.source.path and fix.source in plan.directories:
            continue  # made above
        current = (currents or {}).get(fix.source.path)
        flags = _flags(fix.source, current, options) if current is not None else _fix_flags(fix)
        lines.append((fix.source.path, "." + _kind(fix.source) + flags + " " + _name(fix.source)))
    for entry in plan.deletions:
        lines.append((entry.path, "*deleting   " + _name(entry)))
    lines.sort(key=lambda pair: pair[0])
    return [line for _, line in lines]


__all__ = ["itemized_lines"]

"""Extended attributes and POSIX ACLs (``-X``/``-A``), the pure part: which names, and ACLs between hosts.

Nothing here touches a file system: :mod:`pdiffcopy.local.xattrs` reads and
writes the attributes and looks user and group names up.

``-X`` takes the ``user.``, ``security.`` and ``trusted.`` namespaces; ``-A``
takes the two ACL attributes, ``system.posix_acl_access`` and
``system.posix_acl_default`` (rsync keeps ACLs apart from ``-X`` the same way).
Other ``system.`` attributes belong to the file system and are never copied.

An ACL attribute's value is, in the kernel, a binary list of entries naming
users and groups by number. Numbers mean nothing on another host, so a
listing carries the ACL in a portable text instead (:func:`acl_to_text`),
one entry per line, ``TAG:NAME:ID:PERMS``:

* ``TAG`` is ``user``, ``group``, ``mask`` or ``other``;
* ``NAME`` and ``ID`` are empty for the owner, owning group, mask and other
  entries; a named user or group has its number in ``ID`` and its name in
  ``NAME`` (empty with ``--numeric-ids``, or when the listing host has no name for it);
* ``PERMS`` is ``rwx`` with ``-`` for a missing permission.

The side that applies an ACL maps a name to its own number, and keeps the
number when it does not know the name (rsync's rule); with ``--numeric-ids``
only numbers count.
"""

from __future__ import annotations

import struct
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

ACL_ACCESS = "system.posix_acl_access"
ACL_DEFAULT = "system.posix_acl_default"
ACL_NAMES = (ACL_ACCESS, ACL_DEFAULT)

#: The namespaces ``-X`` syncs; the first two only root may read or write.
PRIVILEGED_PREFIXES = ("security.", "trusted.")
XATTR_PREFIXES = ("user.", *PRIVILEGED_PREFIXES)

#: The kernel's ACL attribute format (linux/posix_acl_xattr.h): a version, then 8-byte entries.
ACL_VERSION = 2
_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
#: An owner/owning group/mask/other entry's number in the kernel's format.
_NO_ID = 0xFFFFFFFF
_TAG_WORDS = {USER_OBJ: "user", USER: "user", GROUP_OBJ: "group", GROUP: "group", MASK: "mask",
              OTHER: "other"}
_NAMED = (USER, GROUP)
_MAX_ID = 0xFFFFFFFF


class AclEntry(NamedTuple):
    """One entry of an ACL; ``name`` is ``""`` when only the number is known (or wanted)."""

    tag: int
    perm: int
    id: int = _NO_ID
    name: str = ""


def selects(name: str, xattrs: bool, acls: bool, privileged: bool = True) -> bool:
    """Whether an attribute ``name`` is synced with ``-X`` (``xattrs``) and ``-A`` (``acls``).

    :param privileged: Whether ``security.`` and ``trusted.`` count (a server
                       takes them from trusted clients only).
    """
    if name in ACL_NAMES:
        return acls
    if not xattrs or not name.startswith(XATTR_PREFIXES):
        return False
    return privileged or not name.startswith(PRIVILEGED_PREFIXES)


def namespace(name: str) -> str:
    """What to call an attribute's kind in a warning: ``user.*``, ``trusted.*``, ``ACLs``..."""
    if name in ACL_NAMES:
        return "ACLs"
    return name.partition(".")[0] + ".*"


def decode_acl(value: bytes) -> List[AclEntry]:
    """The entries of a kernel ACL attribute value.

    :raises ValueError: For a value not in the kernel's format.
    """
    if len(value) < _HEADER.size or (len(value) - _HEADER.size) % _ENTRY.size:
        raise ValueError("an ACL attribute of an unexpected length")
    if _HEADER.unpack_from(value)[0] != ACL_VERSION:
        raise ValueError("an ACL attribute of an unknown version")
    entries = []
    for tag, perm, number in _ENTRY.iter_unpack(value[_HEADER.size:]):
        if tag not in _TAG_WORDS:
            raise ValueError(f"an ACL entry with the unknown tag {tag:#x}")
        entries.append(AclEntry(tag, perm, number if tag in _NAMED else _NO_ID))
    return entries


def encode_acl(entries: Iterable[AclEntry]) -> bytes:
    """A kernel ACL attribute value (entries sorted by tag and number, as the kernel wants them)."""
    ordered = sorted(entries, key=lambda e: (e.tag, e.id))
    return _HEADER.pack(ACL_VERSION) + b"".join(_ENTRY.pack(e.tag, e.perm, e.id) for e in ordered)


def _perm_text(perm: int) -> str:
    return "".join(letter if perm & bit else "-" for letter, bit in (("r", 4), ("w", 2), ("x", 1)))


def acl_to_text(value: bytes, name_of: Optional[Callable[[int, int], Optional[str]]]) -> bytes:
    """A kernel ACL value in the portable text of this module's description.

    :param name_of: ``(tag, number)`` to a user or group name, or ``None``
                    (also for ``--numeric-ids``: no names at all).
    :raises ValueError: For a value not in the kernel's format.
    """
    lines = []
    for entry in decode_acl(value):
        name = ""
        number = ""
        if entry.tag in _NAMED:
            number = str(entry.id)
            found = name_of(entry.tag, entry.id) if name_of else None
            if found and _plain_name(found):
                name = found
        lines.append(f"{_TAG_WORDS[entry.tag]}:{name}:{number}:{_perm_text(entry.perm)}\n")
    return "".join(lines).encode("utf-8")


def _plain_name(name: str) -> bool:
    return ":" not in name and "\n" not in name and name.isprintable()


def parse_acl_text(text: bytes) -> List[AclEntry]:
    """The entries of an ACL in the portable text, names and numbers as written.

    :raises ValueError: For anything else (a client's value is checked here before the kernel sees it).
    """
    try:
        lines = text.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise ValueError("an ACL that is not UTF-8 text") from None
    if lines[-1] != "":
        raise ValueError("an ACL whose last line does not end")
    entries = []
    for line in lines[:-1]:
        fields = line.split(":")
        if len(fields) != 4:
            raise ValueError(f"an ACL entry {line[:40]!r} not of the form TAG:NAME:ID:PERMS")
        word, name, number, perms = fields
        if len(perms) != 3 or any(c not in ("-", letter) for c, letter in zip(perms, "rwx")):
            raise ValueError(f"an ACL entry {line[:40]!r} with permissions other than rwx")
        perm = sum(bit for c, bit in zip(perms, (4, 2, 1)) if c != "-")
        if not number:
            if name:
                raise ValueError(f"an ACL entry {line[:40]!r} with a name and no number")
            tag = {"user": USER_OBJ, "group": GROUP_OBJ, "mask": MASK, "other": OTHER}.get(word)
            if tag is None:
                raise ValueError(f"an ACL entry {line[:40]!r} with an unknown tag")
            entries.append(AclEntry(tag, perm))
            continue
        tag = {"user": USER, "group": GROUP}.get(word)
        if tag is None or not number.isdigit() or not number.isascii() or int(number) >= _MAX_ID:
            raise ValueError(f"an ACL entry {line[:40]!r} with a bad tag or number")
        entries.append(AclEntry(tag, perm, int(number), name))
    return entries


def acl_from_text(text: bytes, id_of: Optional[Callable[[int, str], Optional[int]]]) -> bytes:
    """The kernel ACL value of a portable text, names mapped to this host's numbers.

    :param id_of: ``(tag, name)`` to a local number, or ``None`` when the
                  name is unknown (the number sent is kept); ``None`` itself
                  for ``--numeric-ids``.
    :raises ValueError: For text not in the portable form.
    """
    entries = []
    for entry in parse_acl_text(text):
        if entry.name and id_of is not None:
            local = id_of(entry.tag, entry.name)
            if local is not None:
                entry = entry._replace(id=local)
        entries.append(entry)
    return encode_acl(entries)


def _same_acl(ours: bytes, theirs: bytes) -> bool:
    """Whether two portable ACLs say the same: named entries match by name where both have one, else by number."""
    try:
        left, right = parse_acl_text(ours), parse_acl_text(theirs)
    except ValueError:
        return False
    if len(left) != len(right):
        return False
    unmatched = list(right)
    for entry in left:  # a few entries each: pairing them one by one costs nothing
        match = next((other for other in unmatched if _same_entry(entry, other)), None)
        if match is None:
            return False
        unmatched.remove(match)
    return True


def _same_entry(a: AclEntry, b: AclEntry) -> bool:
    if (a.tag, a.perm) != (b.tag, b.perm):
        return False
    return a.name == b.name if a.name and b.name else a.id == b.id


def attributes_differ(source: Tuple[Tuple[str, bytes], ...], target: Tuple[Tuple[str, bytes], ...]) -> bool:
    """Whether two listed entries' attributes differ (ACLs compared by :func:`_same_acl`)."""
    if source == target:
        return False
    ours: Dict[str, bytes] = dict(source)
    theirs: Dict[str, bytes] = dict(target)
    if ours.keys() != theirs.keys():
        return True
    for name, value in ours.items():
        if value != theirs[name] and not (name in ACL_NAMES and _same_acl(value, theirs[name])):
            return True
    return False


__all__ = ["ACL_ACCESS", "ACL_DEFAULT", "ACL_NAMES", "AclEntry", "acl_from_text", "acl_to_text",
           "attributes_differ", "decode_acl", "encode_acl", "namespace", "parse_acl_text", "selects"]

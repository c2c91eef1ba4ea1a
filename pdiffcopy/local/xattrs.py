"""Extended attributes and ACLs of local files (``-X``/``-A``): read for a listing, applied through a descriptor.

Which attributes, and the portable text of an ACL, are :mod:`pdiffcopy.core.xattrs`'s.
Attributes are applied through a descriptor opened with ``O_NOFOLLOW`` (or,
for a symlink, the ``/proc/self/fd`` name of an ``O_PATH`` descriptor, which
reaches the link itself and never what it points at), never by a path that a
swapped-in symlink could redirect: the race rsync 3.5.0 fixed in this step.

What the target cannot keep (a file system without attributes: ``ENOTSUP``;
``security.*``/``trusted.*`` without root: ``EPERM``) is a notice, one per
kind, and the data still syncs.
"""

from __future__ import annotations

import errno
import functools
import grp
import os
import pwd
from typing import Callable, Dict, Optional, Set, Tuple, Union

from pdiffcopy.core.xattrs import ACL_NAMES, USER, acl_from_text, acl_to_text, namespace
from pdiffcopy.engine.treeendpoints import MetadataOptions
from pdiffcopy.errors import PdiffcopyError

#: A descriptor, or a ``/proc/self/fd/N`` name that reaches exactly one file.
Handle = Union[int, str]

#: Errors that mean "this kind of attribute cannot be kept here", not "this file failed".
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP)
_NOT_PERMITTED = (errno.EPERM, errno.EACCES)


@functools.lru_cache(maxsize=4096)
def _name_of(tag: int, number: int) -> Optional[str]:
    try:
        return pwd.getpwuid(number).pw_name if tag == USER else grp.getgrgid(number).gr_name
    except (KeyError, OverflowError):
        return None


@functools.lru_cache(maxsize=4096)
def _id_of(tag: int, name: str) -> Optional[int]:
    try:
        return pwd.getpwnam(name).pw_uid if tag == USER else grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def read_attributes(path: str, choice: MetadataOptions, follow: bool = False) -> Tuple[Tuple[str, bytes], ...]:
    """The chosen attributes of ``path`` (a ``/proc/self/fd/N/name`` path), sorted, ACLs as portable text.

    :param follow: Follow a final symlink (a ``/proc/self/fd/N`` of the tree's root).
    :raises OSError: When they cannot be read (a file system without
                     attributes has none: no error).
    """
    try:
        names = os.listxattr(path, follow_symlinks=follow)
    except OSError as error:
        if error.errno in _UNSUPPORTED:
            return ()
        raise
    found = []
    for name in names:
        if not choice.wants_attribute(name):
            continue
        try:
            value = os.getxattr(path, name, follow_symlinks=follow)
        except OSError as error:
            if error.errno == errno.ENODATA:
                continue  # removed since listed
            raise
        if name in ACL_NAMES:
            try:
                value = acl_to_text(value, None if choice.numeric_ids else _name_of)
            except ValueError:
                continue  # not an ACL the kernel's format describes: nothing portable to send
        found.append((name, value))
    found.sort()
    return tuple(found)


def apply_attributes(handle: Handle, wanted: Tuple[Tuple[str, bytes], ...], choice: MetadataOptions,
                     notices: Set[str], symlink: bool = False) -> None:
    """Make the chosen attributes of the file at ``handle`` exactly ``wanted`` (as listed).

    Attributes ``wanted`` lacks are removed, within the chosen namespaces
    (as rsync -X does). Values are written only where they differ.

    :param notices: Collects one line per kind of attribute the target cannot keep.
    :param symlink: The file is a symlink: Linux keeps no ``user.*`` on one
                    (EPERM), which is then no notice.
    :raises PdiffcopyError: For an ACL not in the portable text (a failure of this file).
    :raises OSError: For any other error (a failure of this file).
    """
    desired: Dict[str, bytes] = {}
    for name, value in wanted:
        if choice.wants_attribute(name):
            try:
                desired[name] = acl_from_text(value, None if choice.numeric_ids else _id_of) \
                    if name in ACL_NAMES else value
            except ValueError as error:  # a client's, or a listing of a later version
                raise PdiffcopyError(f"invalid ACL in {name}: {error}") from None
    try:
        present = [name for name in os.listxattr(handle) if choice.wants_attribute(name)]
    except OSError as error:
        if error.errno in _UNSUPPORTED:
            if desired:
                notices.add(UNSUPPORTED_NOTICE)
            return
        raise

    def attempt(name: str, change: Callable[[], None]) -> None:
        try:
            change()
        except OSError as error:
            if error.errno == errno.ENODATA:
                return
            if error.errno in _UNSUPPORTED or error.errno in _NOT_PERMITTED:
                if not (symlink and error.errno in _NOT_PERMITTED and name.startswith("user.")):
                    notices.add(_notice(namespace(name), error))
                return
            raise

    for name, value in desired.items():
        if name in present:
            try:
                if os.getxattr(handle, name) == value:
                    continue
            except OSError:
                pass  # set it anyway: that says what is wrong
        attempt(name, lambda n=name, v=value: os.setxattr(handle, n, v))
    for name in present:
        if name not in desired:
            attempt(name, lambda n=name: os.removexattr(handle, n))


def _notice(what: str, error: OSError) -> str:
    if error.errno in _UNSUPPORTED:
        # One line whichever kinds the file system refuses: it is one fact about it.
        return UNSUPPORTED_NOTICE
    return f"{what} not kept: not permitted ({os.strerror(error.errno)}); root may set them"


UNSUPPORTED_NOTICE = "extended attributes or ACLs not kept: the target's file system does not support them"


__all__ = ["Handle", "apply_attributes", "read_attributes"]

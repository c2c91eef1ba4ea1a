"""A tree's devices, fifos and sockets (``-D``), and its block devices read as files (``--copy-devices``).

:class:`~pdiffcopy.local.localtree.LocalTree` makes nodes and sets their metadata here, by
name below a directory's descriptor: a node is never opened (opening a device can have
effects, a fifo can block, a socket cannot be opened at all); its metadata is set through an
``O_PATH`` descriptor, which reaches the node without calling its driver.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable, Optional, Set

from pdiffcopy.core.entries import FILE, OTHER, Entry, device_numbers, is_device, node_type, shared_mode
from pdiffcopy.engine.treeendpoints import MetadataOptions
from pdiffcopy.errors import NotAFile, PdiffcopyError
from pdiffcopy.local import devices
from pdiffcopy.local.descriptors import replace_atomically, temporary_name
from pdiffcopy.local.xattrs import apply_attributes

#: The permissions a node is made with, until its metadata is set: a device node made by root
#: is nobody else's to open before it has its owner and mode.
_NEW_NODE_PERMISSIONS = 0o600


class NodeFailure(PdiffcopyError):
    """A node could not be made or changed (one path's failure; the batch goes on)."""


def replace_with_new(directory: int, name: str, make: Callable[[str], None]) -> None:
    """Make a new entry under a temporary name beside ``name`` (``make(temporary)``) and rename it
    over ``name`` in one step: the name is never missing, and a failure leaves no temporary."""
    temporary = temporary_name(name)
    try:
        make(temporary)
        replace_atomically(temporary, name, directory, directory, flush=False)
    except BaseException:
        try:
            os.unlink(temporary, dir_fd=directory)
        except OSError:
            pass  # not made, or already renamed
        raise


def make_node(directory: int, name: str, entry: Entry, devices_allowed: bool) -> None:
    """Make the node ``entry`` describes as ``name`` in ``directory``, replacing in one rename
    whatever else (not a directory) has the name.

    :param devices_allowed: Whether device nodes may be made here (root; a server's trusted clients).
    :raises NodeFailure: For an entry that is no node, or a device that may not be made.
    :raises OSError: When the kernel refuses.
    """
    kind = node_type(entry.mode)
    if entry.kind != OTHER or not kind:
        raise NodeFailure("is not a device, a fifo or a socket")
    rdev = 0
    if is_device(entry.mode):
        numbers = device_numbers(entry.target)
        if numbers is None:
            raise NodeFailure("its device numbers are not known")
        if not devices_allowed:
            raise NodeFailure("device nodes are not made here (root makes them, for clients it trusts)")
        rdev = os.makedev(*numbers)
    replace_with_new(directory, name, lambda temporary: os.mknod(
        temporary, stat.S_IFMT(entry.mode) | _NEW_NODE_PERMISSIONS, rdev, dir_fd=directory))


def set_node_metadata(directory: int, name: str, entry: Entry, options: MetadataOptions, notices: Set[str],
                      may_chown: bool, check_links: Callable[[os.stat_result], None]) -> None:
    """Set a node's owner (``may_chown`` and -o), attributes, permissions and time (-t), by an
    ``O_PATH`` descriptor of the name: the node itself, never opened.

    :raises NodeFailure: When the name is no longer a node of the entry's type.
    """
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    try:
        info = os.fstat(fd)
        if stat.S_IFMT(info.st_mode) != stat.S_IFMT(entry.mode):
            raise NodeFailure(f"is no longer a {node_type(entry.mode) or entry.kind}")
        check_links(info)
        # Through the descriptor's /proc name, which leads to the node whatever its name is now.
        proc = f"/proc/self/fd/{fd}"
        if options.owner and may_chown and (info.st_uid, info.st_gid) != (entry.uid, entry.gid):
            os.chown(proc, entry.uid, entry.gid)  # before the mode: a chown clears set-id bits
        if options.attributes:
            apply_attributes(proc, entry.xattrs, options, notices)
        os.chmod(proc, entry.permissions)
        if options.times:
            os.utime(proc, ns=(entry.mtime_ns, entry.mtime_ns))
    finally:
        os.close(fd)


def device_as_file(directory: int, name: str, path: str, info: os.stat_result,
                   xattrs: tuple = ()) -> Entry:
    """The entry of a block device listed as a regular file (``--copy-devices``): the device's
    size (``BLKGETSIZE64``), the node's permissions, owner and time.

    :raises OSError: When the device cannot be opened or sized.
    """
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=directory)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISBLK(opened.st_mode) or opened.st_rdev != info.st_rdev:
            raise OSError(errno.ENODEV, "replaced while listed")
        size = devices.device_size(fd)
    finally:
        os.close(fd)
    return Entry(path, FILE, size, info.st_mtime_ns, shared_mode(stat.S_IFREG | stat.S_IMODE(info.st_mode)),
                 info.st_uid, info.st_gid, "", 1, False, "", xattrs)


def check_device_read(fd: int, entry: Entry) -> bool:
    """Whether ``fd`` (open for reading) is a block device read as ``entry`` (``--copy-devices``), of
    the listed size; False for anything else but a block device (the caller's checks apply).

    :raises NotAFile: (After closing ``fd``) for a block device whose size is no longer the entry's.
    """
    if not stat.S_ISBLK(os.fstat(fd).st_mode):
        return False
    try:
        size = devices.device_size(fd)
    except OSError:
        os.close(fd)
        raise
    if size != entry.size:
        os.close(fd)
        raise NotAFile(f"changed while copying (the device holds {size} bytes, listed {entry.size})")
    return True


def block_device_path(directory: int, name: str, full: str) -> Optional[str]:
    """``full`` when ``name`` in ``directory`` is a block device (not followed), else None."""
    try:
        mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
    except OSError:
        return None
    return full if stat.S_ISBLK(mode) else None


__all__ = ["NodeFailure", "block_device_path", "check_device_read", "device_as_file", "make_node",
           "set_node_metadata"]

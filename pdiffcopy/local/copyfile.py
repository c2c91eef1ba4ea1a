"""A drop-in :func:`shutil.copyfile` that lets the file server do the copying.

speedcopy's idea: when both files live on the same network share, the data
need not cross the network twice (down to the client and back up); the client
can ask the server to copy it. :func:`copyfile` has the contract of
:func:`shutil.copyfile` (same arguments, same return value, same exceptions)
and picks the cheapest way it finds:

- on Linux, when both files are on the same CIFS/SMB mount, the CIFS
  ``CIFS_IOC_COPYCHUNK_FILE`` ioctl (an SMB server-side copy);
- otherwise the engine of :mod:`pdiffcopy.local.fastcopy`: a reflink, then
  ``copy_file_range`` (which the CIFS and NFS 4.2 clients also turn into a
  server-side copy, and XFS and btrfs into a clone), ``sendfile``, and a
  pipelined read/write loop;
- on Windows, ``CopyFile2``, which negotiates server-side copy (ODX or SMB
  copychunk) by itself.

:func:`patch_copyfile` replaces :func:`shutil.copyfile` with it, which also
speeds up :func:`shutil.copy`, :func:`shutil.copy2` and :func:`shutil.copytree`
(they call ``copyfile`` through the module); :func:`unpatch_copyfile` puts the
original back.

Which path each copy took is logged at DEBUG level on the logger
``pdiffcopy.copyfile``; setting :data:`DEBUG_VARIABLE` to ``1`` also prints
those messages to standard error.

What could be tested where this was written (a Linux kernel without an SMB
client): the file system detection, the fallbacks, and that the copychunk
ioctl on a file that is not on CIFS is refused and the copy falls back
cleanly. The copychunk success path and ``CopyFile2`` were not run.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat as stat_module
import sys
import threading
import types
from typing import Any, Callable, Union

from pdiffcopy.local import fastcopy, libc

#: The logger that says which path each copy took.
LOGGER = logging.getLogger("pdiffcopy.copyfile")

#: Environment variable: set to ``1`` to print the path of every copy to stderr.
DEBUG_VARIABLE = "PDIFFCOPY_COPYFILE_DEBUG"

#: Environment variable: ``copychunk`` tries the CIFS ioctl even where the file
#: system does not look like CIFS (for a mount the detection misses, and for
#: tests); ``fastcopy`` never tries it; unset (or anything else) decides by the
#: file system. The fast paths themselves follow
#: :data:`pdiffcopy.local.fastcopy.METHOD_VARIABLE`.
METHOD_VARIABLE = "PDIFFCOPY_COPYFILE_METHOD"

#: ``statfs`` magic numbers of the Linux CIFS client: ``CIFS_SUPER_MAGIC`` and
#: ``SMB2_SUPER_MAGIC`` (fs/smb/client/cifsglob.h); which one a mount reports
#: depends on the kernel and the dialect.
CIFS_MAGICS = frozenset({0xFF534D42, 0xFE534D42})

#: File system type names of the CIFS client in /proc/self/mountinfo.
CIFS_TYPES = frozenset({"cifs", "smb3"})


def _ioctl_write_number(kind: int, number: int, size: int) -> int:
    """Linux's ``_IOW(kind, number, size)``: an ioctl that passes data to the kernel."""
    direction_write = 1
    return (direction_write << 30) | (size << 16) | (kind << 8) | number


#: ``CIFS_IOC_COPYCHUNK_FILE = _IOW(0xCF, 3, int)`` (fs/smb/client/cifs_ioctl.h):
#: called on the target with the source's descriptor, the server copies the
#: whole source into the target.
CIFS_IOC_COPYCHUNK_FILE = _ioctl_write_number(0xCF, 3, 4)

#: errno values with which the copychunk ioctl means "not here": not a CIFS
#: file (ENOTTY), different shares or servers (EXDEV), a server without
#: server-side copy (EOPNOTSUPP), or files it will not copy (EINVAL).
COPYCHUNK_REFUSALS = frozenset({
    errno.ENOTTY, errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS,
})

#: ``CopyFile2`` flag: copy an encrypted file even where the target cannot be
#: encrypted, as :func:`shutil.copyfile` (which only copies data) would.
COPY_FILE_ALLOW_DECRYPTED_DESTINATION = 0x00000008

PathLike = Union[str, bytes, "os.PathLike[Any]"]

_original_copyfile: Callable[..., Any] = shutil.copyfile
_debug_handler: logging.Handler | None = None
_cifs_devices: dict[int, bool] = {}
_lock = threading.Lock()


# --------------------------------------------------------------------------- public API

def copyfile(src: PathLike, dst: PathLike, *, follow_symlinks: bool = True) -> PathLike:
    """Copy the data of ``src`` to ``dst``, as :func:`shutil.copyfile` does, but faster.

    :param src: The file to copy (a path or an :class:`os.DirEntry`).
    :param dst: The path of the copy; an existing file is overwritten.
    :param follow_symlinks: When false and ``src`` is a symbolic link, make
                            ``dst`` a link to the same place instead.
    :returns: ``dst``.
    :raises shutil.SameFileError: When ``src`` and ``dst`` are the same file.
    :raises shutil.SpecialFileError: When either is a named pipe.
    :raises IsADirectoryError: When ``dst`` is a directory.
    :raises FileNotFoundError: When ``src`` or the directory of ``dst`` is missing.
    :raises OSError: When reading or writing fails, like :func:`shutil.copyfile`.
    """
    sys.audit("shutil.copyfile", src, dst)
    debug = _debug_enabled()
    # One stat per path serves both of shutil's checks (it stats each twice).
    source_info, target_info = _stat(src), _stat(dst)
    if source_info is not None and target_info is not None and (
            os.path.samestat(source_info, target_info)):
        raise shutil.SameFileError(f"{src!r} and {dst!r} are the same file")
    for path, info in ((src, source_info), (dst, target_info)):
        if info is not None and stat_module.S_ISFIFO(info.st_mode):
            raise shutil.SpecialFileError(f"`{_name(path)!s}` is a named pipe")
    if not follow_symlinks and os.path.islink(src):
        link: Any = os.fspath(src)  # str or bytes, whichever the caller gave
        os.symlink(os.readlink(link), dst)
        _log(debug, "symlink", src, dst)
        return dst
    if os.name == "nt":
        _copyfile_windows(src, dst, debug)
        return dst
    if source_info is not None and stat_module.S_ISDIR(source_info.st_mode):
        # What open(src, "rb") raises in shutil; os.open would accept a directory.
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), _name(src))
    # Plain descriptors rather than Python file objects: a few microseconds less
    # per copy, which shows at 1 MiB, and nothing here needs buffering.
    source_fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            target_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except IsADirectoryError as error:
            # As shutil does (bpo-43219): "dst/" naming a missing directory.
            if not os.path.exists(dst):
                raise FileNotFoundError(f"Directory does not exist: {dst!s}") from error
            raise
        try:
            method = copy_open_files(source_fd, target_fd)
        finally:
            os.close(target_fd)
    finally:
        os.close(source_fd)
    _log(debug, method, src, dst)
    return dst


def copy_open_files(source_fd: int, target_fd: int) -> str:
    """Copy all of one open file into another, empty one, letting a server copy where it can.

    :param source_fd: The source, open for reading.
    :param target_fd: The target, open for writing and empty.
    :returns: The method used: ``"copychunk"`` or one of :data:`pdiffcopy.local.fastcopy.METHODS`.
    :raises OSError: When copying fails.
    """
    source, target = os.fstat(source_fd), os.fstat(target_fd)
    choice = os.environ.get(METHOD_VARIABLE, "")
    wanted = choice == "copychunk" or (
        choice != "fastcopy" and source.st_dev == target.st_dev and is_cifs(source_fd, source.st_dev))
    if wanted and cifs_copychunk(source_fd, target_fd):
        return "copychunk"
    # Like shutil.copyfile: no flush, and a file that changes while it is copied
    # is copied as far as it goes rather than refused.
    return fastcopy.copy_into(source_fd, target_fd, source.st_size, detect_changes=False,
                              source_stat=source, target_device=target.st_dev)


def patch_copyfile() -> None:
    """Make :func:`shutil.copyfile` (and so ``copy``, ``copy2``, ``copytree``) use :func:`copyfile`."""
    shutil.copyfile = copyfile  # type: ignore[assignment]


def unpatch_copyfile() -> None:
    """Put the original :func:`shutil.copyfile` back."""
    shutil.copyfile = _original_copyfile


def is_patched() -> bool:
    """Whether :func:`shutil.copyfile` is :func:`copyfile` right now."""
    return shutil.copyfile is copyfile


# --------------------------------------------------------------------------- CIFS

def filesystem_magic(fd: int) -> int | None:
    """The ``f_type`` magic number ``fstatfs`` reports for an open file.

    Python's :func:`os.fstatvfs` leaves it out, so this calls libc with ctypes.

    :param fd: Any open file descriptor.
    :returns: The magic number (e.g. ``0xEF53`` for ext4), or ``None`` where it
              cannot be asked for (no ctypes, not Linux).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fstatfs = libc.function("fstatfs")
        if fstatfs is None:
            return None
        # struct statfs starts with f_type (a long on Linux); 256 bytes is more
        # than the whole struct on every architecture.
        buffer = (ctypes.c_long * 32)()
        if fstatfs(fd, ctypes.byref(buffer)) != 0:
            return None
    except (ImportError, OSError, AttributeError):
        return None
    return buffer[0] & 0xFFFFFFFF


def mount_type(fd: int) -> str | None:
    """The file system type of an open file, from ``/proc/self/mountinfo``.

    The mount is the one whose device number (``major:minor``) is the file's
    ``st_dev``, which is unique per mounted file system, network ones included.

    :param fd: Any open file descriptor.
    :returns: The type, e.g. ``"ext4"`` or ``"cifs"``, or ``None`` if not found.
    """
    device = os.fstat(fd).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) > 3 and fields[2] == wanted and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:
        pass  # not Linux, or /proc is not mounted
    return None


def is_cifs(fd: int, device: int | None = None) -> bool:
    """Whether an open file lives on a CIFS/SMB mount (remembered per device).

    :param fd: Any open file descriptor.
    :param device: The file's ``st_dev``, if the caller has it already.
    :returns: True for the Linux CIFS client's files.
    """
    if device is None:
        device = os.fstat(fd).st_dev
    with _lock:
        known = _cifs_devices.get(device)
    if known is None:
        magic = filesystem_magic(fd)
        known = magic in CIFS_MAGICS if magic is not None else mount_type(fd) in CIFS_TYPES
        with _lock:
            _cifs_devices[device] = known
    return known


def same_cifs_mount(source_fd: int, target_fd: int) -> bool:
    """Whether two open files are on the same CIFS/SMB mount, where copychunk can work.

    :param source_fd: The source, open.
    :param target_fd: The target, open.
    :returns: True when both are on one CIFS mount.
    """
    device = os.fstat(source_fd).st_dev
    return device == os.fstat(target_fd).st_dev and is_cifs(source_fd, device)


def cifs_copychunk(source_fd: int, target_fd: int) -> bool:
    """Ask the SMB server to copy the whole source into the target (server-side copy).

    :param source_fd: The source, open for reading, on a CIFS mount.
    :param target_fd: The target, open for writing, on the same mount.
    :returns: True when the server copied the file; False when the kernel or the
              server refused (not CIFS, different shares, no server-side copy),
              and the caller should copy another way.
    :raises OSError: For real failures (no space, I/O errors, permissions).
    """
    try:
        fcntl.ioctl(target_fd, CIFS_IOC_COPYCHUNK_FILE, source_fd)
    except OSError as error:
        if error.errno in COPYCHUNK_REFUSALS:
            LOGGER.debug("copychunk refused: %s", error.strerror or error)
            return False
        raise
    return os.fstat(target_fd).st_size == os.fstat(source_fd).st_size


# --------------------------------------------------------------------------- Windows

def _copyfile_windows(src: PathLike, dst: PathLike, debug: bool) -> None:
    """Copy with ``CopyFile2``, which does server-side copies on SMB shares by itself."""
    if os.path.isdir(dst):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", os.fsdecode(os.fspath(dst)))
    try:
        copy_file2 = _load_copy_file2()
    except (AttributeError, OSError):  # before Windows 8: no CopyFile2
        _original_copyfile(src, dst)
        _log(debug, "shutil", src, dst)
        return
    result = copy_file2(os.fsdecode(os.fspath(src)), os.fsdecode(os.fspath(dst)))
    if result < 0:
        import ctypes

        # HRESULT_FROM_WIN32 keeps the Win32 error code in the low 16 bits;
        # WinError turns it into the matching OSError subclass.
        facility_win32 = 7
        code = result & 0xFFFF if (result >> 16) & 0x1FFF == facility_win32 else result
        raise ctypes.WinError(code)  # type: ignore[attr-defined]
    _log(debug, "CopyFile2", src, dst)


def _load_copy_file2() -> Callable[[str, str], int]:
    import ctypes
    from ctypes import wintypes

    class ExtendedParameters(ctypes.Structure):
        # COPYFILE2_EXTENDED_PARAMETERS (winbase.h)
        _fields_ = [
            ("dwSize", wintypes.DWORD),
            ("dwCopyFlags", wintypes.DWORD),
            ("pfCancel", ctypes.POINTER(wintypes.BOOL)),
            ("pProgressRoutine", ctypes.c_void_p),
            ("pvCallbackContext", ctypes.c_void_p),
        ]

    function = ctypes.windll.kernel32.CopyFile2  # type: ignore[attr-defined]
    function.argtypes = [wintypes.LPCWSTR, wintypes.LPCWSTR, ctypes.POINTER(ExtendedParameters)]
    function.restype = ctypes.c_long  # an HRESULT, checked by the caller

    def copy(source: str, target: str) -> int:
        parameters = ExtendedParameters(ctypes.sizeof(ExtendedParameters),
                                        COPY_FILE_ALLOW_DECRYPTED_DESTINATION, None, None, None)
        return function(source, target, ctypes.byref(parameters))

    return copy


# --------------------------------------------------------------------------- debugging

def _debug_enabled() -> bool:
    """Whether copies are logged; installs a stderr handler when the variable asks."""
    global _debug_handler
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        if _debug_handler is None:
            with _lock:
                if _debug_handler is None:
                    handler = logging.StreamHandler(sys.stderr)
                    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
                    LOGGER.addHandler(handler)
                    LOGGER.setLevel(logging.DEBUG)
                    _debug_handler = handler
        return True
    return LOGGER.isEnabledFor(logging.DEBUG)


def _stat(path: PathLike) -> os.stat_result | None:
    # What shutil looks at: the file behind any symbolic link, None if missing.
    try:
        return path.stat() if isinstance(path, os.DirEntry) else os.stat(path)
    except (OSError, ValueError):
        return None


def _log(debug: bool, method: str, src: PathLike, dst: PathLike) -> None:
    if debug:
        LOGGER.debug("copyfile(%r, %r): %s", _name(src), _name(dst), method)


def _name(path: Any) -> Any:
    return path.path if isinstance(path, os.DirEntry) else path


__all__ = [
    "CIFS_IOC_COPYCHUNK_FILE",
    "CIFS_MAGICS",
    "DEBUG_VARIABLE",
    "LOGGER",
    "METHOD_VARIABLE",
    "cifs_copychunk",
    "copy_open_files",
    "copyfile",
    "filesystem_magic",
    "is_cifs",
    "is_patched",
    "mount_type",
    "patch_copyfile",
    "same_cifs_mount",
    "unpatch_copyfile",
]


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`copyfile`.

    The package attribute ``pdiffcopy.copyfile`` is this module as soon as it
    has been imported (the import system sets it), so ``pdiffcopy.copyfile(src,
    dst)``, the spelling speedcopy users expect, only works if the module
    itself can be called.
    """

    def __call__(self, src: PathLike, dst: PathLike, *, follow_symlinks: bool = True) -> PathLike:
        return copyfile(src, dst, follow_symlinks=follow_symlinks)


sys.modules[__name__].__class__ = _CallableModule

"""Block devices a server exports by name (``--device NAME=PATH[:rw]``), and only those.

Confinement (:mod:`pdiffcopy.local.confinement`) refuses every device node beneath
``--root``, and keeps refusing it: a node or a symlink to ``/dev/...`` that somebody
placed there is never opened. A device is served only when the operator names it: the
export's NAME is a URL path of its own (``http://HOST:PORT/NAME``), looked up before
the root, and its PATH is opened as a :class:`ExportedDevice` (a
:class:`~pdiffcopy.local.localdevice.LocalDevice` that refuses writes unless the export
is writable). Over ssh the one path the client named is exported under its own path,
with the ssh user's rights (:func:`ssh_export`).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.protocol import RESERVED_NAME
from pdiffcopy.core.records import dataclass
from pdiffcopy.errors import AccessDenied, PdiffcopyError, UsageError
from pdiffcopy.local import devices
from pdiffcopy.local.descriptors import fast_paths_enabled
from pdiffcopy.local.localdevice import LocalDevice

#: What a NAME may be: one path component of plain characters, not hidden (no temporary's
#: or partial file's name, not the reserved name), so that it reads the same in a URL.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+@-]{0,254}")

#: The suffixes of PATH that say how it is exported (read-only without one).
WRITABLE_SUFFIX, READ_ONLY_SUFFIX = ":rw", ":ro"


@dataclass(frozen=True)
class DeviceExport:
    """A block device the server serves: at the URL path ``name``, the device node ``path``."""

    name: str
    path: str
    writable: bool = False


def parse_device_option(value: str) -> DeviceExport:
    """``NAME=PATH``, ``NAME=PATH:ro`` or ``NAME=PATH:rw`` as an export (its device not looked at yet).

    :raises UsageError: For anything else, with a line that says what is expected.
    """
    name, equals, path = value.partition("=")
    writable = path.endswith(WRITABLE_SUFFIX)
    if writable or path.endswith(READ_ONLY_SUFFIX):
        path = path[: -len(WRITABLE_SUFFIX)]
    if not equals or not path:
        raise UsageError(f"--device {value}: expected NAME=PATH (read-only) or NAME=PATH:rw")
    if not NAME_PATTERN.fullmatch(name) or name == RESERVED_NAME:
        raise UsageError(f"--device {value}: the NAME {name!r} must be one path component of letters, digits "
                         f"and _.+@- (not starting with . or -)")
    return DeviceExport(name, path, writable)


def check_exports(exports: Sequence[DeviceExport], root: str) -> None:
    """Refuse, before the server starts, what would make an export ambiguous or useless.

    :raises UsageError: For a NAME given twice, a NAME that also exists under ``root`` (the
            export would hide it), a PATH that is not a block device, or one this user
            cannot open as asked (read, or also write for ``:rw``).
    """
    seen: Dict[str, DeviceExport] = {}
    for export in exports:
        option = f"--device {export.name}={export.path}"
        if export.name in seen:
            raise UsageError(f"{option}: the NAME {export.name} is given twice")
        seen[export.name] = export
        if os.path.lexists(os.path.join(root, export.name)):
            raise UsageError(f"{option}: {export.name} also exists under --root {root}; choose another NAME")
        for flags in (os.O_RDONLY, os.O_WRONLY) if export.writable else (os.O_RDONLY,):
            try:
                os.close(devices.open_device(export.path, flags))
            except PdiffcopyError as error:
                raise UsageError(f"{option}: {error}") from None


def ssh_export(typed_path: str, home: str) -> Optional[DeviceExport]:
    """The export of the path a client named over ssh, when it is a block device (else None).

    Served under its own path below "/" (the ssh server's root), so the client's URL is the
    one it would use for a file; writable as far as the ssh user's rights go. Only this
    path: every other device node below "/" stays refused.
    """
    from pdiffcopy.core.sshform import SshLocation

    absolute = os.path.normpath(SshLocation(None, "", typed_path).absolute_path(home))
    if not devices.is_block_device(absolute):
        return None
    return DeviceExport(absolute.lstrip("/"), absolute, writable=True)


class ExportedDevice(LocalDevice):
    """The device of an export, as the server's views open it: writes refused unless it is writable.

    Messages name the export (the path the client asked for), not the device node.
    """

    def __init__(self, export: DeviceExport) -> None:
        super().__init__(export.path)
        self.export = export
        self.location = export.name

    def _open(self, flags: int, mode: int = 0o666) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR) and not self.export.writable:
            raise AccessDenied(f"{self.export.name} is exported read-only: writing it is refused")
        with self._named():
            return super()._open(flags, mode)

    def hash_ranges(self, ranges: Sequence[ByteRange], block_size: int, method: str) -> bytes:
        with self._named():
            return super().hash_ranges(ranges, block_size, method)

    def data_map(self, offset: int, length: int) -> List[ByteRange]:
        with self._named():
            return super().data_map(offset, length)

    @contextlib.contextmanager
    def _named(self):
        """Its errors name the export, as its client asked for it: never the device node."""
        try:
            yield
        except PdiffcopyError as error:
            error.args = (str(error).replace(self.export.path, self.export.name),)
            raise

    def check_writable(self) -> None:
        """Refuse a lease (a writer's first request) on a read-only export, or on a device in use.

        The kernel's exclusive claim is taken and given back at once: refused while the device
        is mounted, part of a volume group, or claimed by a local writer (a local pdiffcopy).
        """
        if not self.export.writable:
            raise AccessDenied(f"{self.export.name} is exported read-only: writing it is refused")
        with self._named():
            os.close(devices.claim(self.export.path))


def drop_cached(fd: int, offset: int, length: int) -> None:
    """Drop a device's pages just read from the page cache (advice: a failure changes nothing;
    not with the fast paths off, whose kill switch covers ``posix_fadvise``)."""
    if not fast_paths_enabled():
        return
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


class Exports:
    """The exports of one server, by NAME."""

    def __init__(self, exports: Iterable[DeviceExport] = ()) -> None:
        self.by_name: Dict[str, DeviceExport] = {export.name: export for export in exports}

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def find(self, path: str) -> Optional[DeviceExport]:
        """The export a request's path names (compared once cleaned: ``./NAME``, ``NAME/``), if any."""
        if not self.by_name or path.startswith("/"):
            return None  # (an absolute path is refused as such by the root)
        cleaned = "/".join(part for part in path.split("/") if part not in ("", "."))
        return self.by_name.get(cleaned)

    def open(self, path: str) -> Optional[ExportedDevice]:
        export = self.find(path)
        return ExportedDevice(export) if export is not None else None


__all__ = ["DeviceExport", "ExportedDevice", "Exports", "NAME_PATTERN", "check_exports", "drop_cached",
           "parse_device_option", "ssh_export"]

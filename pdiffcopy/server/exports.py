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
from typing import Dict, List, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.exportconfig import NAME_PATTERN, ExportRules, parse_config
from pdiffcopy.core.protocol import RESERVED_NAME
from pdiffcopy.core.records import dataclass
from pdiffcopy.errors import AccessDenied, PdiffcopyError, UsageError
from pdiffcopy.local import devices
from pdiffcopy.local.confinement import Root
from pdiffcopy.local.descriptors import fast_paths_enabled
from pdiffcopy.local.localdevice import LocalDevice

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


def load_config(file_name: str) -> Tuple[ExportRules, ...]:
    """The exports ``--config`` names, each path checked as the server will use it.

    :raises UsageError: One line: the file, the export and what is wrong (a path that does
            not exist, is neither a directory nor a block device, or a device this user
            cannot open as the export asks).
    """
    return read_config(file_name)[1]


def read_config(file_name: str) -> Tuple[str, Tuple[ExportRules, ...]]:
    """The text of ``--config`` and its exports (:func:`load_config`): a reload hands the
    workers the very text that was checked, not the file, which may change again."""
    try:
        with open(file_name, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"Cannot read --config {file_name}: {getattr(error, 'strerror', None) or error}") from None
    exports = parse_config(text, file_name)
    for rules in exports:
        where = f"{file_name}: [export.{rules.name}]"
        if devices.is_block_device(rules.path):
            for flags in (os.O_RDONLY,) if rules.read_only else (os.O_RDONLY, os.O_WRONLY):
                try:
                    os.close(devices.open_device(rules.path, flags))
                except PdiffcopyError as error:
                    raise UsageError(f"{where}: {error}") from None
        elif not os.path.isdir(rules.path):
            problem = ("is neither a directory nor a block device" if os.path.lexists(rules.path)
                       else "does not exist")
            raise UsageError(f"{where}: path {rules.path} {problem}")
    return text, exports


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


class Export:
    """One export, as a request reaches it: its rules, and its directory (a confined
    :class:`~pdiffcopy.local.confinement.Root`) or its block device.

    ``name`` is the first component of its URLs' paths; the ``--root`` shorthand's export
    has the empty name, and its URLs are the paths below the root as they always were.
    """

    def __init__(self, rules: ExportRules, device: Optional[DeviceExport] = None, index: int = 0,
                 serve_anyone: bool = False) -> None:
        self.name = rules.name
        self.rules = rules
        self.device = device
        self.root: Optional[Root] = None if device is not None else Root(rules.path)
        #: The hex SHA-256 of each token that opens it, and of each client certificate.
        self.digests = frozenset(digest for _, digest in rules.tokens)
        self.certificates = frozenset(digest for _, digest in rules.certificates)
        #: Without a token or certificate: only the server's own user and root on its host
        #: (``--insecure``: anyone).
        self.owner_only = not rules.tokens and not rules.certificates and not serve_anyone
        self.open_to_anyone = not rules.tokens and not rules.certificates and serve_anyone
        #: Its slot in the shared counts of requests in progress (``max_connections``).
        self.index = index

    def __repr__(self) -> str:
        return f"Export({self.name!r}, {self.rules.path!r})"

    @property
    def shown(self) -> str:
        """How messages name it."""
        return f"the export {self.name}" if self.name else "the root"

    def refuse_writes(self) -> None:
        """Refuse a write to a read-only export, before anything is touched.

        :raises AccessDenied: Naming the export (a client's message shows its URL there).
        """
        raise AccessDenied(f"{self.name or 'The root'} is exported read-only: writing it is refused")

    def directory(self, path: str) -> Root:
        """Its root directory, to open ``path`` below it; a device export has none.

        :raises AccessDenied: For a device: it is written in place, never replaced, and has no entries.
        """
        if self.root is None:
            raise AccessDenied(f"Cannot use {path} as a file of a directory: it is a block device, "
                               f"updated in place and never replaced")
        return self.root


class ExportTable:
    """The exports of one server: found by the first component of a request's path.

    With ``--config`` every URL path starts with an export's name. The ``--root``
    shorthand has one export without a name (``default``), and its ``--device`` exports
    are names looked up before it, as they always were.
    """

    def __init__(self, exports: Sequence[Export], default: Optional[Export] = None) -> None:
        self.by_name: Dict[str, Export] = {export.name: export for export in exports}
        self.default = default
        self.everything: Tuple[Export, ...] = (*([default] if default else []), *exports)
        #: Every token's hex SHA-256, and the name the config gives it.
        self.token_names: Dict[str, str] = {digest: name for export in self.everything
                                            for name, digest in export.rules.tokens}
        #: Every client certificate's hex SHA-256, and its name.
        self.certificate_names: Dict[str, str] = {digest: name for export in self.everything
                                                  for name, digest in export.rules.certificates}
        self.any_owner_only = any(export.owner_only for export in self.everything)
        self.any_open_to_anyone = any(export.open_to_anyone for export in self.everything)

    def __len__(self) -> int:
        return len(self.everything)

    def locate(self, path: str) -> Tuple[Optional[Export], str]:
        """The export ``path`` (a request's, as sent) names and the path within it, or (None, path).

        A device is found by its exact name (``./NAME``, ``NAME/`` too); a directory export by
        its name as the first component; the shorthand's root takes every other path whole.
        """
        if path.startswith("/"):
            return self.default, path  # (refused as absolute by the root, or found in no export)
        first, _, rest = path.partition("/")
        export = self.by_name.get(first)
        if export is not None and export.device is None:
            return export, rest
        if self.by_name:
            cleaned = "/".join(part for part in path.split("/") if part not in ("", "."))
            device = self.by_name.get(cleaned)
            if device is not None:
                return device, ""
        return self.default, path

    def opened_by(self, digest: Optional[str], certificate: Optional[str], address: str) -> List[str]:
        """The names of the exports a client at ``address`` with a token and a client certificate
        (their hex SHA-256) may use, or that need neither (a client asking was admitted to those)."""
        return [export.name for export in self.by_name.values()
                if (digest in export.digests or certificate in export.certificates
                    or not (export.digests or export.certificates)) and export.rules.allows_address(address)]


def config_table(exports: Sequence[ExportRules], slots: Dict[str, int], serve_anyone: bool) -> ExportTable:
    """The table of a config file's exports; ``slots`` gives each name its place in the
    shared counts of requests in progress, the same one in every generation of the file."""
    return ExportTable([Export(rules, _device_of(rules), slots[rules.name], serve_anyone) for rules in exports])


def _device_of(rules: ExportRules) -> Optional[DeviceExport]:
    """The device an export's path names, if it is one (else the export is a directory)."""
    if not devices.is_block_device(rules.path):
        return None
    return DeviceExport(rules.name, rules.path, writable=not rules.read_only)


__all__ = ["DeviceExport", "Export", "ExportTable", "ExportedDevice", "NAME_PATTERN", "check_exports", "config_table",
           "drop_cached", "load_config", "read_config", "parse_device_option", "ssh_export"]

"""The digest record of a target (``--digest-file``): its block digests as the last sync left it.

blocksync-fast's idea: a sync that keeps the target's digests need not read the target
again, and a device target costs as much to read as the source. The record says what it
stands for, so that a sync can check it before relying on it
(:class:`~pdiffcopy.engine.recorded.DigestRecord`):

- the target's identity: for a block device its ``st_rdev``, size, what it is (a loop
  device's backing file, a device-mapper device's uuid), the boot it was seen in and its
  write and discard counters (``/sys/dev/block/MAJ:MIN/stat``), which move whenever anything
  writes it through the block layer; for a regular file its device, inode, size, mtime and
  ctime;
- the block size, the hash method and the source's size it was made with;
- what the source was (a thin volume's pool, id and creation time, for ``--changed-since``).

The file: a first line ``PDIFFCOPY-DIGESTS 1``, a line of JSON (the header), the digests
(one per block, in order, fixed width), and the SHA-256 of all before it. It is read a
segment at a time (``pread``: never a list of every digest) and written whole into a
temporary beside it, flushed, then renamed over it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Iterable, Optional, Sequence

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.core.hashing import digest_size
from pdiffcopy.engine.recorded import DigestRecord
from pdiffcopy.errors import StorageError, storage_error
from pdiffcopy.local import devices
from pdiffcopy.local.descriptors import replace_atomically, temporary_name

MAGIC = b"PDIFFCOPY-DIGESTS 1\n"
#: The SHA-256 at the end of the record, over everything before it.
CHECKSUM_BYTES = 32

#: The fields of a device's identity that say which device it is (another one: another target).
_DEVICE_NAMES = ("rdev", "backing", "dm_uuid")
#: The fields that move when it is written: sectors, not requests (a flush, ``fsync``, is a
#: write request of no sector, and changes nothing).
_DEVICE_WRITES = ("sectors_written", "sectors_discarded")


def _sysfs(rdev: int, name: str) -> Optional[str]:
    try:
        with open(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/{name}") as handle:
            return handle.read().strip()
    except OSError:
        return None


def boot_id() -> str:
    """This boot's id: a device's counters start again at every boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def target_identity(path: str) -> Optional[dict]:
    """What identifies the target at ``path`` now and moves when it is written; None when it is missing.

    :raises PdiffcopyError: When it cannot be looked at.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise storage_error(error, f"stat {path}") from None
    if stat.S_ISREG(info.st_mode):
        return {"kind": "file", "dev": info.st_dev, "ino": info.st_ino, "size": info.st_size,
                "mtime_ns": info.st_mtime_ns, "ctime_ns": info.st_ctime_ns}
    if not stat.S_ISBLK(info.st_mode):
        return {"kind": "other"}
    rdev = info.st_rdev
    fd = devices.open_device(path, os.O_RDONLY)
    try:
        size = devices.device_size(fd)
    finally:
        os.close(fd)
    fields = (_sysfs(rdev, "stat") or "").split()
    counted = [int(fields[index]) if len(fields) > index else -1 for index in (6, 13)]
    backing = _sysfs(rdev, "loop/backing_file")
    if backing is not None:  # a loop device keeps its number and counters when attached to another file
        try:
            backed = os.stat(backing)
            backing = f"{backing} ({backed.st_dev}:{backed.st_ino}, offset {_sysfs(rdev, 'loop/offset')})"
        except OSError:
            pass
    identity = {"kind": "device", "rdev": f"{os.major(rdev)}:{os.minor(rdev)}", "size": size,
                "backing": backing, "dm_uuid": _sysfs(rdev, "dm/uuid"), "boot_id": boot_id()}
    identity.update(zip(_DEVICE_WRITES, counted))
    return identity


def identity_mismatch(recorded: dict, now: Optional[dict], target: str, record: str) -> Optional[str]:
    """Why the target ``now`` is not the one the record saw (one line), or None when it is."""
    if now is None:
        return f"{target} does not exist, and the digest record {record} says what it held"
    if recorded.get("kind") != now["kind"] or now["kind"] == "other" or \
            any(recorded.get(name) != now.get(name) for name in (
                _DEVICE_NAMES if now["kind"] == "device" else ("dev", "ino"))):
        return f"The digest record {record} was made for another target than {target}"
    if now["kind"] == "device":
        if recorded.get("boot_id") != now["boot_id"]:
            return (f"The digest record {record} was made before this machine last started, and a device's "
                    f"write counters start again at boot: they cannot tell whether {target} was written since")
        if recorded.get("size") != now["size"]:
            return f"{target} was resized since the digest record {record} was made"
        if any(recorded.get(name) != now[name] or now[name] < 0 for name in _DEVICE_WRITES):
            return (f"{target} was written since the digest record {record} was made (its write counters "
                    f"moved)")
        return None
    if any(recorded.get(name) != now[name] for name in ("size", "mtime_ns", "ctime_ns")):
        return f"{target} was modified since the digest record {record} was made (its size or times changed)"
    return None


class DigestFile(DigestRecord):
    """The digest record at ``path`` of the local target at ``target``.

    :param changed_since: For ``--changed-since``: the source's ranges that may differ from
                          the snapshot the record was made from, and that snapshot's origin
                          (:class:`~pdiffcopy.local.thindelta.ChangedSince`).
    :param source_origin: What the source of this sync is (a thin volume's origin), recorded
                          for the next ``--changed-since``.
    """

    def __init__(self, path: str, target: str, changed_since=None, source_origin: Optional[dict] = None) -> None:
        self.location = path
        self.target = target
        self.changes = changed_since
        self.source_origin = source_origin
        self.header: Optional[dict] = None
        self.damage: Optional[str] = None
        self._fd: Optional[int] = None
        self._data_offset = 0
        self._width = 0
        self._loaded = False

    # -- reading ---------------------------------------------------------------

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            fd = os.open(self.location, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as error:
            raise storage_error(error, f"read the digest record {self.location}") from None
        self._fd = fd
        try:
            self.header, self.damage = self._parse(fd)
        except OSError as error:
            raise storage_error(error, f"read the digest record {self.location}") from None

    def _parse(self, fd: int) -> "tuple[Optional[dict], Optional[str]]":
        damaged = f"{self.location} is not a pdiffcopy digest record, or is damaged"
        with os.fdopen(os.dup(fd), "rb") as handle:
            if handle.read(len(MAGIC)) != MAGIC:
                return None, damaged + " (its first line)"
            line = handle.readline(65536)
            try:
                header = json.loads(line)
                width = digest_size(header["hash_method"])
                blocks = int(header["blocks"])
            except (ValueError, KeyError, TypeError):
                return None, damaged + " (its header)"
            self._data_offset, self._width = len(MAGIC) + len(line), width
            expected = self._data_offset + blocks * width + CHECKSUM_BYTES
            if os.fstat(fd).st_size != expected:
                return None, damaged + f" (it has {os.fstat(fd).st_size} bytes, its header says {expected})"
            handle.seek(0)
            checksum = hashlib.sha256()
            left = expected - CHECKSUM_BYTES
            while left:
                piece = handle.read(min(left, 8 * 1024 * 1024))
                if not piece:
                    return None, damaged + " (it is shorter than it says)"
                checksum.update(piece)
                left -= len(piece)
            if handle.read(CHECKSUM_BYTES) != checksum.digest():
                return None, damaged + " (its checksum)"
        return header, None

    def exists(self) -> bool:
        self._load()
        return self._fd is not None

    def mismatch(self, size: int, block_size: int, method: str) -> Optional[str]:
        self._load()
        if self.damage is not None or self.header is None:
            return self.damage or f"{self.location} does not exist"
        header = self.header
        if (header.get("block_size"), header.get("hash_method")) != (block_size, method):
            return (f"The digest record {self.location} holds {header.get('block_size')}-byte blocks hashed with "
                    f"{header.get('hash_method')}, and this sync uses {block_size}-byte blocks and {method} "
                    f"(give -b and -m as then)")
        if header.get("blocks") != -(-size // block_size):
            return f"{self.location} is not a pdiffcopy digest record, or is damaged (its count of blocks)"
        if header.get("size") != size:
            return (f"The digest record {self.location} was made from a source of {header.get('size')} bytes, and "
                    f"this one has {size}")
        reason = identity_mismatch(header.get("target") or {}, target_identity(self.target), self.target,
                                   self.location)
        if reason is None and self.changes is not None and \
                not same_origin(header.get("source"), self.changes.old_origin):
            reason = (f"The digest record {self.location} was not made from {self.changes.old_name}, the snapshot "
                      f"--changed-since counts the changes from (it was made from "
                      f"{_origin_text(header.get('source'))})")
        return reason

    def digests(self, first_block: int, count: int) -> bytes:
        assert self._fd is not None, "digests are read from a record there is"
        length = count * self._width
        data = os.pread(self._fd, length, self._data_offset + first_block * self._width)
        if len(data) != length:
            raise StorageError(f"The digest record {self.location} ended early (changed while in use?)")
        return data

    def changed_ranges(self) -> Optional[Sequence[ByteRange]]:
        return None if self.changes is None else self.changes.ranges

    # -- writing -----------------------------------------------------------------

    def save(self, size: int, block_size: int, method: str, digests: Iterable[bytes]) -> None:
        """Write the record anew: into a temporary beside it, flushed, then renamed over it.

        :param digests: Every block's digest in order, in pieces of any length (a segment's each).
        """
        directory, name = os.path.split(os.path.abspath(self.location))
        temporary = os.path.join(directory, temporary_name(name))
        blocks = -(-size // block_size) if size else 0
        header = {"format": 1, "block_size": block_size, "hash_method": method, "size": size,
                  "blocks": blocks, "target": target_identity(self.target),
                  "source": self.source_origin}
        line = json.dumps(header, sort_keys=True).encode() + b"\n"
        try:
            with open(temporary, "wb") as handle:
                checksum = hashlib.sha256(MAGIC + line)
                handle.write(MAGIC + line)
                written = 0
                for piece in digests:
                    checksum.update(piece)
                    handle.write(piece)
                    written += len(piece)
                if written != blocks * digest_size(method):
                    raise StorageError(f"Cannot write the digest record {self.location}: {written} bytes of "
                                       f"digests for {blocks} blocks")
                handle.write(checksum.digest())
                handle.flush()
                os.fsync(handle.fileno())
            self.close()
            replace_atomically(temporary, self.location)
        except BaseException as error:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            if isinstance(error, OSError):
                raise storage_error(error, f"write the digest record {self.location}") from None
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def same_origin(recorded: Optional[dict], origin: dict) -> bool:
    """Whether the recorded source is the thin volume ``origin``: the same pool, id and creation time
    (its name may differ: ``/dev/vg/lv`` and ``/dev/mapper/vg-lv`` are one volume)."""
    keys = ("kind", "pool", "thin_id", "created")
    return bool(recorded) and all(recorded.get(key) == origin.get(key) for key in keys)


def _origin_text(origin: Optional[dict]) -> str:
    if not origin:
        return "a source that is not a thin volume"
    return origin.get("name") or json.dumps(origin, sort_keys=True)


__all__ = ["DigestFile", "boot_id", "identity_mismatch", "same_origin", "target_identity"]

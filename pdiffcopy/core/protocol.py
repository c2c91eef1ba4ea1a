"""Names and limits the client and the server share: the protocol's constants and names.

They live apart from both ends so that the HTTP client does not import the
server's lease store, nor the batch codec the file system helpers, to learn
a header's name or a length (the layers of docs/design.rst).
"""

import itertools
import os
import re

#: Bytes moved per read or write system call: writes into new files of 128 KiB
#: to 1 MiB are several times faster than 4 MiB ones (docs/benchmarks.rst,
#: "Local copies").
TRANSFER_CHUNK_SIZE = 1024 * 1024

#: The first path component reserved for the server's API (``/.pdiffcopy/...``);
#: no file of that name at the top of the root can be read or written.
RESERVED_NAME = ".pdiffcopy"

#: Longest relative path accepted (Linux's PATH_MAX).
MAX_PATH_LENGTH = 4096

#: The request header that carries a lease's id.
LEASE_HEADER = "X-Pdiffcopy-Lease"

#: The request header that asks the server not to follow a symlink in the
#: file's last name (value ``1``): a tree's member is a file only if it is
#: one, as a local tree opens it with O_NOFOLLOW; a plain file URL follows a
#: symlink that stays beneath the root.
NO_FOLLOW_HEADER = "X-Pdiffcopy-No-Follow"

#: The header of a server's answers naming the rules (the generation of its exports) the
#: request was admitted under; a client sends the first it got back with the rest of its
#: sync, which then finishes under those rules though the server reloads meanwhile.
RULES_HEADER = "X-Pdiffcopy-Rules"

#: The header naming the sync a request belongs to: a random id per run of a client, so the
#: server's transfer log has one line per file or tree synced (echoed where it keeps one).
SYNC_HEADER = "X-Pdiffcopy-Sync"

#: The environment variable holding the shared secret, read by the command
#: line only (server and client): the library takes ``token=``.
TOKEN_VARIABLE = "PDIFFCOPY_TOKEN"

_TEMPORARY_NAME = re.compile(r"^\..+\.pdiffcopy-([0-9a-f]{12})$", re.DOTALL)

#: What ends the name of a partial file (:func:`partial_name`).
PARTIAL_SUFFIX = ".pdiffcopy-partial"

_PARTIAL_NAME = re.compile(r"^\..+" + re.escape(PARTIAL_SUFFIX) + "$", re.DOTALL)

#: This process's serials of temporary names: a counter (one ``getrandom``
#: per small file of a tree showed in profiles) from a random start, so that
#: processes of the same id on two hosts naming temporaries in one directory
#: (a push names the server's) rarely meet; the exclusive create catches it
#: when they do. A forked child goes on from its parent's count under its own id.
_temporary_serials = itertools.count(int.from_bytes(os.urandom(3), "big"))  # (secrets would load OpenSSL)


def temporary_name(name: str) -> str:
    """A hidden sibling name for writing ``name`` atomically (``.name.pdiffcopy-xxxx``).

    Every temporary pdiffcopy makes, anywhere, is named here, so that
    :func:`is_temporary_name` and the leftovers sweep know them all. The 12
    hex digits hold the process id (above a 24-bit serial), so a later run
    can tell a temporary of a dead process
    (:func:`pdiffcopy.local.sweep.is_stale_temporary`).
    """
    return f".{name}.pdiffcopy-{unique_suffix(next(_temporary_serials))}"


def unique_suffix(serial: int) -> str:
    """The 12 hex digits of a temporary name: this process's id, then 24 bits of ``serial``."""
    return f"{((os.getpid() << 24) | (serial & 0xFFFFFF)) & 0xFFFFFFFFFFFF:012x}"


def partial_name(name: str) -> str:
    """The hidden sibling a ``--partial`` sync writes ``name`` into (``.name.pdiffcopy-partial``).

    One stable name per target, with no process id in it: an interrupted
    run leaves the file there, and the next ``--partial`` run to the same
    target finds it and moves only what it lacks (rsync's ``--partial``).
    It is a temporary like the others (:func:`is_temporary_name`): never
    listed, copied or deleted as data, swept when untouched for a day.
    """
    return f".{name}{PARTIAL_SUFFIX}"


def written_name(name: str) -> str:
    """The name a temporary (:func:`temporary_name`, :func:`partial_name`) is written for;
    any other name as it is."""
    if _TEMPORARY_NAME.match(name) or _PARTIAL_NAME.match(name):
        return name[1:name.rindex(".pdiffcopy-")]
    return name


def is_partial_name(name: str) -> bool:
    """Whether ``name`` (a last path component) is one :func:`partial_name` makes."""
    return bool(_PARTIAL_NAME.match(name))


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` (a last path component) is one :func:`temporary_name` or :func:`partial_name` makes."""
    return bool(_TEMPORARY_NAME.match(name) or _PARTIAL_NAME.match(name))


__all__ = ["LEASE_HEADER", "MAX_PATH_LENGTH", "NO_FOLLOW_HEADER", "PARTIAL_SUFFIX", "RESERVED_NAME", "RULES_HEADER",
           "SYNC_HEADER", "TOKEN_VARIABLE", "TRANSFER_CHUNK_SIZE", "is_partial_name", "is_temporary_name",
           "partial_name", "temporary_name", "unique_suffix", "written_name"]

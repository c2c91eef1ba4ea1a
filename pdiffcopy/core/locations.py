"""What a SOURCE or TARGET argument is: a URL, rsync's remote form (HOST:PATH), or a local path.

Pure: no I/O (what a name means, never what is there). The forms are told apart here once; :mod:`pdiffcopy.core.sshform`
takes the remote form apart, and :mod:`pdiffcopy.api` resolves each kind.
"""

from __future__ import annotations

import os
import re
from typing import Tuple
from urllib.parse import quote, unquote_to_bytes, urlsplit

#: A URL's scheme and ``://``: any scheme, so that ``ftp://host/file`` is refused as an
#: unsupported URL instead of being taken for a local path or a host.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

#: rsync's rule for its remote forms: a colon with no slash before it (``./a:b`` and
#: ``/x/a:b`` are local paths).
_REMOTE_PREFIX = re.compile(r"^[^/:]+:")


def is_url(location: str) -> bool:
    """Whether a SOURCE or TARGET argument is a URL (``scheme://...``), not a local path."""
    return bool(_SCHEME.match(location))


def looks_remote(location: str) -> bool:
    """Whether ``location`` is in rsync's remote form (``host:path``, ``host::module``), not a URL."""
    return not is_url(location) and _REMOTE_PREFIX.match(location) is not None


def quote_path(path: str) -> str:
    """``path`` percent-encoded for a URL, byte for byte (file names keep their bytes both ways)."""
    return quote(os.fsencode(path), safe="/")


def last_name(location: str) -> str:
    """The last component of a path or URL (percent-decoded, bytes kept as file names keep them)."""
    if is_url(location):
        return os.fsdecode(unquote_to_bytes(urlsplit(location).path.rstrip("/").rpartition("/")[2]))
    return os.path.basename(location.rstrip("/"))


def parent_location(location: str) -> str:
    """The directory holding a path or URL (the inverse of :func:`join_location`)."""
    if is_url(location):
        return location.rstrip("/").rpartition("/")[0] + "/"
    return os.path.dirname(location.rstrip("/")) or "."


def join_location(directory: str, name: str) -> str:
    """``directory/name`` for a path or a URL (the name percent-encoded)."""
    if is_url(directory):
        return directory.rstrip("/") + "/" + quote_path(name)
    return os.path.join(directory, name)


def tree_locations(source: str, target: str) -> Tuple[str, str]:
    """rsync's convention for a directory SOURCE: ``SRC/`` syncs the contents of SRC into TARGET,
    ``SRC`` syncs the directory itself into TARGET (as TARGET/SRC).

    :returns: The source and target tree locations to sync.
    """
    name = last_name(source)
    if source.endswith("/") or name in ("", ".", ".."):  # "." has no name to go by
        return source.rstrip("/") + "/", target
    return source + "/", join_location(target, name)


__all__ = ["is_url", "join_location", "last_name", "looks_remote", "parent_location", "quote_path", "tree_locations"]

"""URLs of files and trees on a pdiffcopy server: split into server and path, and paths quoted back.

A path is percent-decoded to bytes and then to ``str`` as file names are
(:func:`os.fsdecode`), so a name that is not UTF-8 keeps its bytes both ways.
"""

from __future__ import annotations

import os
from typing import Tuple
from urllib.parse import unquote_to_bytes, urlsplit

from pdiffcopy.errors import UsageError


def split_server_url(url: str) -> Tuple[str, str]:
    """Split a URL on a pdiffcopy server into (base URL, path relative to the server's root).

    The path is percent-decoded to bytes and then to ``str`` as file names
    are (:func:`os.fsdecode`), so a name that is not UTF-8 keeps its bytes;
    it has no leading slash and may be empty (the root) or end with one.

    :raises UsageError: For a URL that does not point at a server.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise UsageError(f"Invalid URL {url!r}: {error}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise UsageError(f"Unsupported URL {url!r}: expected http://HOST:PORT/path or https://...")
    if not parts.hostname:
        raise UsageError(f"Invalid URL {url!r}: expected http://HOST:PORT/path")
    if parts.query or parts.fragment:
        raise UsageError(f"Invalid URL {url!r}: a query or fragment is not a file name")
    path = os.fsdecode(unquote_to_bytes(parts.path)).lstrip("/")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    base = f"{parts.scheme.lower()}://{host}" + (f":{port}" if port else "")
    return base, path


def parse_url(url: str) -> Tuple[str, str]:
    """Split a file URL into (base URL, path relative to the server's root).

    :raises UsageError: For a URL that does not name a file on a server.
    """
    base, path = split_server_url(url)
    if not path or path.endswith("/"):
        raise UsageError(f"Invalid URL {url!r}: it names no file (expected http://HOST:PORT/path)")
    return base, path

"""What a SOURCE or TARGET argument is: a URL, rsync's remote form (HOST:PATH), or a local path.

Pure: no I/O. The forms are told apart here once; :mod:`pdiffcopy.core.sshform`
takes the remote form apart, and :mod:`pdiffcopy.api` resolves each kind.
"""

from __future__ import annotations

import re

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


__all__ = ["is_url", "looks_remote"]

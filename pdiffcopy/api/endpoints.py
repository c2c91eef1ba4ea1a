"""Endpoints made from what the caller names: a path, a device or a URL (dependency inversion).

The engine works on endpoints and never builds one (docs/design.rst): a local path becomes
a :class:`~pdiffcopy.local.localfile.LocalFile` (or a device's
:class:`~pdiffcopy.local.localdevice.LocalDevice`, or a tree's
:class:`~pdiffcopy.local.localtree.LocalTree`), an ``http(s)://`` URL a remote one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from pdiffcopy.core.locations import is_url
from pdiffcopy.core.ratelimit import bandwidth_limit
from pdiffcopy.engine.forkshared import Throttle
from pdiffcopy.errors import UsageError

if TYPE_CHECKING:
    from pdiffcopy.engine.endpoints import FileEndpoint
    from pdiffcopy.engine.treeendpoints import TreeEndpoint


def check_locations(source: str, target: str) -> None:
    """Refuse two URLs: this process moves the bytes, so one side must be on this machine.

    :raises UsageError: When both are URLs.
    """
    if is_url(source) and is_url(target):
        raise UsageError("SOURCE and TARGET cannot both be URLs; one must be a local path")


def bwlimit_bucket(bwlimit: "int | str | None", shared: bool = False) -> Optional[Throttle]:
    """The one token bucket every connection of a sync takes its bytes from (``--bwlimit``); None: no limit.

    :param bwlimit: Bytes per second, or rsync's syntax (``"50M"``).
    :param shared: In shared memory, for a tree sync's worker processes (make it before they fork).
    :raises UsageError: For a limit :func:`~pdiffcopy.core.ratelimit.bandwidth_limit` refuses.
    """
    rate = bandwidth_limit(bwlimit)
    return Throttle(rate, shared=shared) if rate else None


def wire_settings(*, token: Optional[str], concurrency: int, timeout: Optional[float], ca_file: Optional[str],
                  bwlimit: "int | str | None", compress: "str | int") -> dict:
    """The keyword arguments of :func:`file_endpoint` for one file sync: one ``--bwlimit`` bucket for all."""
    return dict(token=token, concurrency=concurrency, timeout=timeout, ca_file=ca_file,
                rate_limit=bwlimit_bucket(bwlimit), compress=compress)


def file_endpoint(location: str, *, token: Optional[str] = None, concurrency: int = 1,
                  timeout: Optional[float] = None, ca_file: Optional[str] = None,
                  rate_limit: Optional[Throttle] = None, compress: "str | int" = "auto") -> "FileEndpoint":
    """The endpoint of one file: a :class:`~pdiffcopy.transport.remote.RemoteFile` for a URL, else a local file.

    For a URL the server is asked once, here, whether it is a pdiffcopy 1.0.1 server (then the
    endpoint is a :class:`~pdiffcopy.transport.legacyremote.LegacyRemoteFile`); the answer
    serves the endpoint's first ``stat()``, whose errors it also keeps for then.

    :param token: The server's shared secret (None: send none).
    :param concurrency: Connections the remote file may open at once.
    :param rate_limit: For a URL: the bucket of ``--bwlimit`` (:func:`bwlimit_bucket`), shared with
                       the sync's other endpoint. A local file moves nothing over a network:
                       it ignores it, as rsync does.
    :param compress: For a URL: ``-z``'s mode or level, as :func:`sync` takes it.
    :raises UsageError: For a path that names no file or a URL that names no server.
    """
    if is_url(location):
        from pdiffcopy.transport.legacyremote import remote_file
        from pdiffcopy.transport.httpclient import DEFAULT_TIMEOUT

        # One request decides: a file of a pdiffcopy 1.0.1 server speaks its old API.
        return remote_file(location, token=token, concurrency=concurrency,
                           timeout=timeout or DEFAULT_TIMEOUT, ca_file=ca_file,
                           rate_limit=rate_limit, compress=compress)
    from pdiffcopy.local.localdevice import endpoint_for

    if not location or location.endswith("/"):
        raise UsageError(f"Not a file name: {location!r}")
    return endpoint_for(location)


def tree_endpoint(location: str, *, token: Optional[str] = None, concurrency: int = 1,
                  timeout: Optional[float] = None, ca_file: Optional[str] = None,
                  rate_limit: Optional[Throttle] = None, compress: "str | int" = "auto") -> "TreeEndpoint":
    """The endpoint of a directory tree: a :class:`~pdiffcopy.transport.remotetree.RemoteTree` for a URL, else local.

    ``rate_limit`` (shared: :func:`bwlimit_bucket` with ``shared=True``) and ``compress`` as for
    :func:`file_endpoint`.
    """
    if is_url(location):
        from pdiffcopy.transport.httpclient import DEFAULT_TIMEOUT
        from pdiffcopy.transport.remotetree import RemoteTree

        return RemoteTree(location, token=token, concurrency=concurrency,
                          timeout=timeout or DEFAULT_TIMEOUT, ca_file=ca_file,
                          rate_limit=rate_limit, compress=compress)
    from pdiffcopy.local.localtree import LocalTree

    return LocalTree(location)


__all__ = ["bwlimit_bucket", "check_locations", "file_endpoint", "tree_endpoint", "wire_settings"]

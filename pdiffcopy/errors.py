"""One exception tree for the whole program.

Every error a user can cause or meet derives from :class:`PdiffcopyError`. Each
class says who failed and carries what the boundaries need: the command line
prints ``str(error)`` as one line and exits with :attr:`~PdiffcopyError.exit_code`;
the server answers with :attr:`~PdiffcopyError.http_status` and a JSON body.
"""

from __future__ import annotations

from typing import Optional


class PdiffcopyError(Exception):
    """Base class of every error pdiffcopy reports to a user."""

    #: Exit status of the command line for this kind of error.
    exit_code = 1
    #: HTTP status the server answers with for this kind of error.
    http_status = 500


class UsageError(PdiffcopyError):
    """The user asked for something that makes no sense (a bad option value)."""

    exit_code = 2
    http_status = 400


class BadRequest(UsageError):
    """A request to the server is malformed or out of bounds."""


class ClientTooSlow(BadRequest):
    """A client sent its request (or read its answer) slower than the server allows."""

    http_status = 408


class RangeNotSatisfiable(BadRequest):
    """A byte range lies outside the file."""

    http_status = 416

    def __init__(self, message: str, size: Optional[int] = None) -> None:
        super().__init__(message)
        #: The file's current size, when known: the server's 416 says it in
        #: ``Content-Range: bytes */SIZE`` (RFC 9110, section 15.5.17).
        self.size = size


class PayloadTooLarge(BadRequest):
    """A request body is larger than the operation allows."""

    http_status = 413


class AccessDenied(PdiffcopyError):
    """A path leads outside the server's root, or the file system refused access."""

    http_status = 403


class ForeignUser(AccessDenied):
    """A token-less server was asked by another user than its own (or root)."""


class AuthenticationFailed(PdiffcopyError):
    """The request carried no token or the wrong one."""

    http_status = 401


class FileMissing(PdiffcopyError):
    """A file that must exist does not."""

    http_status = 404


class NotAFile(PdiffcopyError):
    """A path names a directory or something else that is not a regular file."""

    http_status = 409


class Conflict(PdiffcopyError):
    """The file changed under us (a changing source, a precondition that failed)."""

    http_status = 412


class Locked(PdiffcopyError):
    """Another client is writing the file (it holds the write lease, or a lock on a local file)."""

    http_status = 423


class PartialTransfer(PdiffcopyError):
    """Some paths of a tree failed; the others were synced (rsync's exit status 23)."""

    exit_code = 23


class StorageError(PdiffcopyError):
    """Reading or writing a file failed (I/O error, no space left, ...)."""

    http_status = 507


class RemoteError(PdiffcopyError):
    """The server could not be reached, answered an error, or went away."""

    http_status = 502


class ServerBusy(RemoteError):
    """The server is doing as much of this kind of work as it allows; ask again later.

    The server answers 503 with a ``Retry-After`` header; the client waits
    and retries a bounded number of times before it gives up with this error.
    """

    http_status = 503

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        #: Seconds the client should wait before asking again.
        self.retry_after = retry_after


class RemoteProtocolError(RemoteError):
    """The server refused a request as malformed (400, 416): the two ends disagree on the protocol.

    The user asked for nothing wrong (that would be a :class:`UsageError`,
    found before any request); this client and that server do not agree on
    what a request may say (an older or stricter server, a hash method it
    does not accept), so it exits as a failure, not as bad usage.
    """


class SshFailed(RemoteError):
    """The ssh client could not reach or log in to the host (rsync passes on ssh's status, 255)."""

    exit_code = 255


class RemoteProgramMissing(RemoteError):
    """pdiffcopy is not installed (or not found) on the host reached over ssh (rsync's 127)."""

    exit_code = 127


class SshStartFailed(RemoteError):
    """The server started over ssh did not hand over, or in another protocol version
    (rsync's 5: error starting the client-server protocol)."""

    exit_code = 5


class VerificationFailed(PdiffcopyError):
    """After a sync, the target's digest differs from the source's."""

    exit_code = 3


class Unsupported(PdiffcopyError):
    """An endpoint was asked for an optional capability it does not have (see :mod:`pdiffcopy.engine.endpoints`).

    The engine asks first (``can_copy_from``) and falls back; seeing this is a bug.
    """


def describe_os_error(error: OSError, what: str) -> str:
    """Turn an :class:`OSError` into a short sentence naming the file.

    :param error: The error raised by the operating system.
    :param what: What was being done, e.g. ``"read /srv/a.img"``.
    :returns: ``"Cannot read /srv/a.img: No space left on device"``.
    """
    reason = error.strerror or str(error)
    return f"Cannot {what}: {reason}"


def storage_error(error: OSError, what: str) -> PdiffcopyError:
    """Map an :class:`OSError` to the matching :class:`PdiffcopyError` subclass.

    :param error: The error raised by the operating system.
    :param what: What was being done, e.g. ``"open /srv/a.img"``.
    :returns: An exception to raise, with a one-line message.
    """
    import errno

    message = describe_os_error(error, what)
    if error.errno == errno.ENOENT:
        return FileMissing(message)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.EXDEV, errno.ELOOP):
        return AccessDenied(message)
    if error.errno in (errno.EISDIR, errno.ENOTDIR):
        return NotAFile(message)
    if error.errno == errno.EEXIST:
        return Conflict(message)
    return StorageError(message)

"""One exception tree for the whole program.

Every error a user can cause or meet derives from :class:`PdiffcopyError`. Each
class says who failed and carries what the boundaries need: the command line
prints ``str(error)`` as one line and exits with :attr:`~PdiffcopyError.exit_code`;
the server answers with :attr:`~PdiffcopyError.http_status` and a JSON body.

The exit statuses are rsync's wherever rsync has one for the same failure
(its man page, "EXIT VALUES"); the command's ``--help`` and docs/api.rst
list them all.
"""

from __future__ import annotations

from typing import Optional


class PdiffcopyError(Exception):
    """Base class of every error pdiffcopy reports to a user."""

    #: Exit status of the command line for this kind of error: 1 for a failure rsync has no
    #: status for (pdiffcopy 1.0.1 exited with 1 for every failure).
    exit_code = 1
    #: HTTP status the server answers with for this kind of error.
    http_status = 500
    #: What that status means in the server's API document (set on the kinds it answers with).
    served_as = ""


class UsageError(PdiffcopyError):
    """The user asked for something that makes no sense (a bad option value): rsync's 1."""

    exit_code = 1
    http_status = 400


class BadRequest(UsageError):
    """A request to the server is malformed or out of bounds."""

    served_as = "Malformed or out-of-bounds request"


class ClientTooSlow(BadRequest):
    """A client sent its request (or read its answer) slower than the server allows."""

    http_status = 408
    served_as = "The request body came too slowly; the connection is closed"


class RangeNotSatisfiable(BadRequest):
    """A byte range lies outside the file."""

    http_status = 416
    served_as = "A byte range or offset lies outside the file"

    def __init__(self, message: str, size: Optional[int] = None) -> None:
        super().__init__(message)
        #: The file's current size, when known: the server's 416 says it in
        #: ``Content-Range: bytes */SIZE`` (RFC 9110, section 15.5.17).
        self.size = size


class PayloadTooLarge(BadRequest):
    """A request body is larger than the operation allows."""

    http_status = 413
    served_as = "The request body is larger than the operation allows"


class AccessDenied(PdiffcopyError):
    """A path leads outside the server's root, or the file system refused access
    (rsync's 3: errors selecting input/output files)."""

    exit_code = 3

    http_status = 403
    served_as = "Path outside the root or reserved, or access refused"


class ForeignUser(AccessDenied):
    """A token-less server was asked by another user than its own (or root)."""


class AuthenticationFailed(PdiffcopyError):
    """The request carried no token or the wrong one (rsync's 5, as for a daemon's "auth failed")."""

    exit_code = 5

    http_status = 401
    served_as = "Missing or wrong token"


class FileMissing(PdiffcopyError):
    """A file that must exist does not (rsync's 3: errors selecting input/output files)."""

    exit_code = 3

    http_status = 404
    served_as = "The file or a directory on its path does not exist"


class NotAFile(PdiffcopyError):
    """A path names a directory or something else that is not a regular file, or a tree's
    SOURCE or TARGET is not a directory (rsync's 3: errors selecting input/output files)."""

    exit_code = 3

    http_status = 409
    served_as = "Not a regular file, or a non-directory on the path"


class Conflict(PdiffcopyError):
    """The file changed under us (a changing source, a precondition that failed).

    Its status is rsync's 23, a partial transfer: a source that changes under rsync
    fails its verification and the file is not transferred.
    """

    exit_code = 23

    http_status = 412
    served_as = "If-Match failed, or the file exists already"


class Locked(PdiffcopyError):
    """Another client is writing the file (it holds the write lease, or a lock on a local file)."""

    http_status = 423
    served_as = "Another client holds the file's write lease"


class PartialTransfer(PdiffcopyError):
    """Some paths of a tree failed; the others were synced (rsync's exit status 23)."""

    exit_code = 23


class DeletionsStopped(PdiffcopyError):
    """--max-delete left some deletions undone; all else was synced (rsync's 25)."""

    exit_code = 25


class VanishedFiles(PartialTransfer):
    """Source files listed at the start were gone when read; all else was synced (rsync's 24)."""

    exit_code = 24


class StorageError(PdiffcopyError):
    """Reading or writing a file failed (I/O error, no space left, ...): rsync's 11, file I/O."""

    exit_code = 11

    http_status = 507
    served_as = "Reading or writing failed: no space left, an I/O error"


class RemoteError(PdiffcopyError):
    """The server could not be reached, answered an error, or went away: rsync's 10, socket I/O."""

    exit_code = 10
    http_status = 502


class ServerFailed(RemoteError):
    """The server answered that it failed (an error of its own, a 500): no status of its own, 1."""

    exit_code = 1


class RemoteTimeout(RemoteError):
    """The server did not answer within the timeout (rsync's 30: timeout in data send/receive)."""

    exit_code = 30


class RemoteDataError(RemoteError):
    """The server's answer is not what the protocol says: malformed, damaged, other ranges than
    asked (rsync's 12: error in the protocol data stream)."""

    exit_code = 12


class CannotListen(PdiffcopyError):
    """The server cannot listen on its address (a busy port): rsync's daemon exits 10, socket I/O."""

    exit_code = 10


class ServerBusy(RemoteError):
    """The server is doing as much of this kind of work as it allows; ask again later.

    The server answers 503 with a ``Retry-After`` header; the client waits
    and retries a bounded number of times before it gives up with this error:
    rsync's 5, as when a daemon's "max connections" are reached.
    """

    exit_code = 5
    http_status = 503
    served_as = "Too many hash requests at once: retry after Retry-After seconds"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        #: Seconds the client should wait before asking again.
        self.retry_after = retry_after


class RemoteProtocolError(RemoteError):
    """The server refused a request as malformed (400, 416): the two ends disagree on the protocol.

    The user asked for nothing wrong (that would be a :class:`UsageError`,
    found before any request); this client and that server do not agree on
    what a request may say (an older or stricter server, a hash method it
    does not accept), so it exits as rsync's 2, protocol incompatibility, not as
    bad usage. So does a pdiffcopy 1.0.1 server asked for what its API lacks, and
    a remote pdiffcopy over ssh of another protocol version.
    """

    exit_code = 2


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
    """After a sync, the target's digest differs from the source's.

    rsync's 23, a partial transfer: a file that fails rsync's verification twice
    is "not transferred", and a tree's file that fails ours is one of its failed paths.
    """

    exit_code = 23


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

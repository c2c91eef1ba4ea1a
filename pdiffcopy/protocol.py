"""Names and limits the client and the server share: the protocol's constants, no code.

They live apart from both ends so that the HTTP client does not import the
server's lease store, nor the batch codec the file system helpers, to learn
a header's name or a length (the layers of docs/design.rst).
"""

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

#: The environment variable holding the shared secret, read by the command
#: line only (server and client): the library takes ``token=``.
TOKEN_VARIABLE = "PDIFFCOPY_TOKEN"

__all__ = ["LEASE_HEADER", "MAX_PATH_LENGTH", "NO_FOLLOW_HEADER", "RESERVED_NAME", "TOKEN_VARIABLE"]

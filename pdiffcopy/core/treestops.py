"""How a tree sync's failures say that the target takes no more writes, and what it will not set.

Apart from the wire format (core/treewire.py), so that a local tree sync, which
never encodes a batch, does not import it.
"""

from __future__ import annotations

import errno
import os
from typing import Tuple

#: What a target may say it will not set of what a sync sends (a server's listing header
#: ``Pdiffcopy-Not-Kept``, :meth:`LocalTree.not_kept`): user and group, and security.* and
#: trusted.* attributes. A plan leaves such differences out (they are no changes).
NOT_KEPT_OWNER = "owner"
NOT_KEPT_XATTRS = "xattrs"

#: The nodes a target may say it makes (a server's listing header ``Pdiffcopy-Tree-Nodes``,
#: :meth:`LocalTree.makes_nodes`): character and block devices (root only, as rsync's
#: ``--devices``), fifos and unix sockets (``--specials``: any user).
NODES_DEVICES = "devices"
NODES_SPECIALS = "specials"

#: The failure of a file a write did not try (a write's answer, a local tree's batch): an earlier
#: file met a :func:`stop_cause`, which every later write would meet too.
NOT_ATTEMPTED = "not written: writing stopped at an earlier file"

#: The failure of a listed source file that was gone when the sync came to read it (rsync's
#: "file has vanished"): a sync whose only failures are these exits 24, as rsync's.
VANISHED = "vanished from the source before it was copied"

#: How a failure shows that the target takes no more writes, and what a sync then says of it.
_STOP_CAUSES = ((os.strerror(errno.ENOSPC), "The target file system is full"),
                (os.strerror(errno.EDQUOT), "The target file system is full"),
                (os.strerror(errno.EROFS), "The target file system is read-only"))


def stop_cause(message: str) -> Tuple[str, str]:
    """``(cause, strerror)`` when a failure's ``message`` says the target takes no more writes (full,
    over its quota, read-only), else ``("", "")``."""
    for error, cause in _STOP_CAUSES:
        if error in message:
            return cause, error
    return "", ""


__all__ = ["VANISHED", "NODES_DEVICES", "NODES_SPECIALS", "NOT_ATTEMPTED", "NOT_KEPT_OWNER", "NOT_KEPT_XATTRS",
           "stop_cause"]

"""rsync's ``[USER@]HOST:PATH`` form and the hand-over line of the serve-over-ssh mode.

Both ends of a sync over ssh share this: the client tells a remote location
from a local path and reads the line that the server started on the other
host writes on its standard output (docs/protocol.rst, "Serving over ssh").
"""

from __future__ import annotations

import re
from typing import Optional

from pdiffcopy.core.locations import looks_remote
from pdiffcopy.core.records import dataclass

from pdiffcopy.errors import UsageError

#: The version of the hand-over between the client and the server it starts over ssh.
#: Raised when either side would misread the other's line or the way it is served.
SSH_PROTOCOL_VERSION = 1

#: The first field of the hand-over line: what the client looks for among whatever a
#: login script prints before it.
HANDSHAKE_MARK = "pdiffcopy-serve-over-ssh"

#: The hidden option that starts the serve-over-ssh mode on the remote host.
SERVE_OPTION = "--serve-over-ssh"

#: With it, ``--direct``'s mode: TLS on the address the ssh connection came in on, at this
#: port (0: any free one), instead of the Unix socket.
DIRECT_OPTION = "--serve-direct"

#: With it, the path the client named (as typed: relative ones are from the home): served as
#: that block device if it is one, every other device node staying refused.
SERVE_DEVICE_OPTION = "--serve-device"

#: A client's ``ca_file`` that starts with it pins one certificate instead of naming a CA
#: bundle: the SHA-256 (hex) of its DER form follows, as ``--direct``'s hand-over gives it.
PINNED_CERTIFICATE_PREFIX = "pin-sha256:"

#: rsync's remote forms: a colon with no slash before it (rsync's own rule:
#: ``./a:b`` and ``/x/a:b`` are local paths).
_REMOTE_FORM = re.compile(r"^(?:(?P<user>[^/:@]+)@)?(?P<host>\[[^/\]]+\]|[^/:\[\]]+):(?P<path>.*)$", re.DOTALL)


@dataclass(frozen=True)
class SshLocation:
    """A ``[USER@]HOST:PATH`` argument, taken apart."""

    user: Optional[str]
    host: str
    #: As given: relative (to the remote home), absolute, ``~/...`` or empty (the home).
    path: str

    @property
    def destination(self) -> str:
        """What ssh is given as its destination: ``[USER@]HOST``."""
        host = self.host[1:-1] if self.host.startswith("[") else self.host
        return f"{self.user}@{host}" if self.user else host

    @property
    def typed(self) -> str:
        """The argument as the user typed it (what messages call it)."""
        return f"{self.user}@{self.host}:{self.path}" if self.user else f"{self.host}:{self.path}"

    def absolute_path(self, home: str) -> str:
        """The remote path, relative ones (and ``~/``) taken from ``home``, as rsync does."""
        path = self.path
        if path == "~" or path.startswith("~/"):
            path = path[1:].lstrip("/")
        if path.startswith("/"):
            return path
        home = home.rstrip("/")
        return f"{home}/{path}" if path else f"{home}/"


def parse_ssh_location(location: str) -> Optional[SshLocation]:
    """``location`` as ``[USER@]HOST:PATH``, or None for a local path or a URL.

    :raises UsageError: For rsync's daemon form ``HOST::MODULE`` (there is no pdiffcopy
                        daemon of that kind: name the file by its path on that host),
                        and for a form with an empty host or user.
    """
    if not looks_remote(location):
        return None
    found = _REMOTE_FORM.match(location)
    if found is not None and found.group("path").startswith(":") and not found.group("host").startswith("["):
        raise UsageError(f"{location}: rsync's HOST::MODULE (rsync daemon) form has no pdiffcopy "
                         f"counterpart; write HOST:PATH (over ssh) or a server's URL")
    if found is None or not found.group("host").strip("[]"):
        raise UsageError(f"{location}: expected [USER@]HOST:PATH (for a local name with a colon, "
                         f"write ./{location})")
    if found.group("host").startswith("-") or (found.group("user") or "").startswith("-"):
        # ssh would read it as an option (-oProxyCommand=...), not as a host.
        raise UsageError(f"{location}: a host name cannot start with '-'")
    return SshLocation(found.group("user"), found.group("host"), found.group("path"))


def handshake_line(*, version: str, token: str, home: str, socket: Optional[str] = None,
                   address: Optional[str] = None, port: Optional[int] = None,
                   fingerprint: Optional[str] = None) -> str:
    """The one line the serve-over-ssh mode writes on stdout once it listens.

    Its Unix ``socket``; or, for ``--direct``, the ``address`` and ``port`` it listens on
    with TLS and the SHA-256 ``fingerprint`` (hex) of its one-time certificate.
    """
    fields = {HANDSHAKE_MARK: SSH_PROTOCOL_VERSION, "version": version, "socket": socket,
              "address": address, "port": port, "fingerprint": fingerprint, "token": token, "home": home}
    import json

    return json.dumps({name: value for name, value in fields.items() if value is not None},
                      separators=(",", ":"))


def read_handshake(line: str) -> Optional[dict]:
    """The fields of a hand-over line, or None when ``line`` is not one (a login script's chatter)."""
    text = line.strip()
    if not text.startswith("{") or HANDSHAKE_MARK not in text:
        return None
    import json

    try:
        fields = json.loads(text)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) and HANDSHAKE_MARK in fields else None


__all__ = ["DIRECT_OPTION", "HANDSHAKE_MARK", "PINNED_CERTIFICATE_PREFIX", "SERVE_DEVICE_OPTION", "SERVE_OPTION",
           "SSH_PROTOCOL_VERSION",
           "SshLocation", "handshake_line", "looks_remote", "parse_ssh_location", "read_handshake"]

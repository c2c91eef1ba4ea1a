"""A server's exports as its ``--config`` file names them: parsed and checked, nothing opened.

The file is TOML, one table per export (rsync calls them modules)::

    [export.vms]
    path = "/srv/vms"
    read_only = false                      # default true: writable only on purpose
    tokens = ["ops:sha256:9f86d0...08"]    # NAME:sha256:HEX of the token, never the token
    certificates = ["ci:sha256:3a7f...c2"] # NAME:sha256:HEX of a client certificate (--client-ca)
    allow = ["10.0.0.0/8", "127.0.0.1/32"] # client networks (default: all)
    max_connections = 20                   # requests at once (default: no limit)
    trust_clients = false                  # owners and set-id bits from clients
    refuse = ["delete"]                    # what clients may not do to its files

Everything here is pure: the server (:mod:`pdiffcopy.server.exports`) looks at the
paths and opens them. Every mistake is one line that names the file, the export and
the key, so that a reload with a broken file can be refused in one line too.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from pdiffcopy.core.records import dataclass
from pdiffcopy.errors import UsageError

#: What an export's (or a token's) name may be: one path component of plain characters,
#: not hidden, so that it reads the same in a URL and in a log line.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+@-]{0,254}")

#: A token as the file lists it: its name, the hash function and the hash of the token.
TOKEN_PATTERN = re.compile(r"(?P<name>[A-Za-z0-9_][A-Za-z0-9_.+@-]{0,63}):sha256:(?P<digest>[0-9a-fA-F]{64})")

#: What an export may refuse (``refuse = [...]``), as rsync's ``refuse options``: a
#: client's writes that would do it are refused, and a push that says it will is refused
#: before it copies anything.
REFUSABLE = {
    "delete": "delete what the source does not have (--delete)",
    "owner": "set owners and groups (-o, -g, -a)",
    "hard-links": "make hard links (-H)",
    "xattrs": "write extended attributes (-X)",
    "acls": "write ACLs (-A)",
    "devices": "make device nodes and special files (-D, --devices, --specials)",
}

#: The keys an export's table may have.
EXPORT_KEYS = ("path", "read_only", "tokens", "certificates", "allow", "max_connections", "trust_clients",
               "refuse")


@dataclass(frozen=True)
class ExportRules:
    """One export of the config file: where it is and who may do what there."""

    name: str
    path: str
    read_only: bool = True
    #: (token name, lowercase hex SHA-256 of the token), in the file's order.
    tokens: Tuple[Tuple[str, str], ...] = ()
    #: (name, lowercase hex SHA-256 of a client certificate, DER), as tokens are.
    certificates: Tuple[Tuple[str, str], ...] = ()
    #: The client networks served; empty: all.
    allow: Tuple[Any, ...] = ()
    max_connections: Optional[int] = None
    trust_clients: bool = False
    #: Names of :data:`REFUSABLE`.
    refuse: Tuple[str, ...] = ()

    def allows_address(self, address: str) -> bool:
        """Whether a client at ``address`` may use the export (always, without ``allow``)."""
        if not self.allow:
            return True
        try:
            client = ipaddress.ip_address(address.partition("%")[0])
        except ValueError:
            return False
        if isinstance(client, ipaddress.IPv6Address) and client.ipv4_mapped is not None:
            client = client.ipv4_mapped
        return any(client in network for network in self.allow)


def parse_config(text: str, source: str) -> Tuple[ExportRules, ...]:
    """The exports of a config file's ``text`` (``source`` names it in errors).

    :raises UsageError: One line: the file, the export and what is wrong there.
    """
    try:
        import tomllib  # type: ignore[import-not-found]
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{source}: not valid TOML: {error}") from None
    unknown = sorted(set(document) - {"export"})
    if unknown:
        raise UsageError(f"{source}: unknown table or key {unknown[0]!r} (expected [export.NAME] tables)")
    exports = document.get("export")
    if not isinstance(exports, dict) or not exports:
        raise UsageError(f"{source}: no export: name at least one as [export.NAME] with a path")
    parsed = tuple(_export(name, table, source) for name, table in exports.items())
    _check_token_names(parsed, source)
    return parsed


def _export(name: str, table: Any, source: str) -> ExportRules:
    where = f"{source}: [export.{name}]"
    if not NAME_PATTERN.fullmatch(name) or name.startswith(".pdiffcopy"):
        raise UsageError(f"{where}: the name must be one path component of letters, digits and _.+@- "
                         f"(not starting with . or -)")
    if not isinstance(table, dict):
        raise UsageError(f"{where}: expected a table of keys, not a value")
    unknown = sorted(set(table) - set(EXPORT_KEYS))
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(EXPORT_KEYS)})")
    path = table.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise UsageError(f"{where}: path must be an absolute path (a directory, or a block device)")
    return ExportRules(
        name=name,
        path=path,
        read_only=_boolean(table, "read_only", True, where),
        tokens=tuple(_token(value, where) for value in _strings(table, "tokens", where)),
        certificates=tuple(_certificate(value, where) for value in _strings(table, "certificates", where)),
        allow=tuple(_network(value, where) for value in _strings(table, "allow", where)),
        max_connections=_positive(table, "max_connections", where),
        trust_clients=_boolean(table, "trust_clients", False, where),
        refuse=tuple(_refusal(value, where) for value in _strings(table, "refuse", where)),
    )


def _boolean(table: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be true or false, not {value!r}")
    return value


def _positive(table: Mapping[str, Any], key: str, where: str) -> Optional[int]:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: {key} must be a whole number of at least 1, not {value!r}")
    return value


def _strings(table: Mapping[str, Any], key: str, where: str) -> List[str]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise UsageError(f"{where}: {key} must be a list of strings")
    return value


def _token(value: str, where: str) -> Tuple[str, str]:
    match = TOKEN_PATTERN.fullmatch(value)
    if match is None:
        shown = value if ":sha256:" in value else "(hidden: it may be a token)"
        raise UsageError(f"{where}: a token must be NAME:sha256:HEX, the SHA-256 of the token in hex "
                         f"(printf %s TOKEN | sha256sum), not {shown}")
    return match["name"], match["digest"].lower()


def _certificate(value: str, where: str) -> Tuple[str, str]:
    match = TOKEN_PATTERN.fullmatch(value)
    if match is None:
        raise UsageError(f"{where}: a certificate must be NAME:sha256:HEX, the SHA-256 of the certificate in hex "
                         f"(openssl x509 -in CERT -noout -fingerprint -sha256), not {value!r}")
    return match["name"], match["digest"].lower()


def _network(value: str, where: str):
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise UsageError(f"{where}: allow: {value!r} is not a network (ADDRESS or ADDRESS/BITS)") from None


def _refusal(value: str, where: str) -> str:
    if value not in REFUSABLE:
        raise UsageError(f"{where}: refuse: {value!r} is not one of {', '.join(sorted(REFUSABLE))}")
    return value


def _check_token_names(exports: Tuple[ExportRules, ...], source: str) -> None:
    """One name per token (or certificate) and one token per name: a log line's token name
    must say which was used."""
    name_of: Dict[str, str] = {}
    digest_of: Dict[str, str] = {}
    for export in exports:
        for kind, listed in (("token", export.tokens), ("certificate", export.certificates)):
            for name, digest in listed:
                if name_of.setdefault(f"{kind} {digest}", name) != name:
                    raise UsageError(f"{source}: [export.{export.name}]: one {kind} is named both "
                                     f"{name_of[f'{kind} {digest}']!r} and {name!r}; give it one name")
                if digest_of.setdefault(name, f"{kind} {digest}") != f"{kind} {digest}":
                    raise UsageError(f"{source}: [export.{export.name}]: two tokens or certificates are named "
                                     f"{name!r}; give each its own name")


__all__ = ["EXPORT_KEYS", "ExportRules", "NAME_PATTERN", "REFUSABLE", "TOKEN_PATTERN", "parse_config"]

"""Reloading the exports on SIGHUP, without dropping a sync in flight.

The server's main process rereads ``--config`` on SIGHUP (``systemctl reload``). A file with
a mistake is refused in one line and the rules in force stay. A good one becomes the next
*generation* of the exports: the main process writes the text it checked to a snapshot in a
private directory and raises the generation number, which every worker process shares; each
worker reads the snapshot at its next request. Nothing restarts and no connection drops.

A sync finishes under the rules it started with. Every answer carries a ticket
(:data:`~pdiffcopy.core.protocol.RULES_HEADER`) naming the generation its request was
admitted under, signed with a secret of this server and bound to the client's token and
address; the client sends the first ticket it got back with every later request of its sync,
which is admitted under that generation for up to :data:`OLD_RULES_SECONDS` after the
generation was replaced. A request without a ticket (curl, a client of before) is admitted
under the rules in force.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from pdiffcopy.core.exportconfig import ExportRules, parse_config
from pdiffcopy.engine.forkshared import SharedInts
from pdiffcopy.errors import UsageError
from pdiffcopy.local.descriptors import replace_atomically
from pdiffcopy.server.exports import ExportTable, config_table, read_config

logger = logging.getLogger(__name__)

#: Seconds a replaced generation keeps admitting the syncs that started under it: long
#: enough for a big image over a slow link; a token taken out of the file by a reload
#: is refused to new syncs at once, and to the ones in flight after this (a restart cuts
#: them all).
OLD_RULES_SECONDS = 12 * 3600

#: Exports a server may name over its lifetime, reloads included: each name keeps its
#: place in the shared counts of requests in progress (``max_connections``).
MAX_EXPORT_SLOTS = 4096


def first_slots(exports: Sequence[ExportRules]) -> Dict[str, int]:
    """The places of a config file's exports in the shared counts (0 is the shorthand's root)."""
    return {rules.name: index for index, rules in enumerate(exports, start=1)}


class ExportGenerations:
    """The exports in force, and the ones syncs in flight started under (made before the fork)."""

    def __init__(self, first: ExportTable, directory: Optional[str] = None,
                 slots: Optional[Dict[str, int]] = None, serve_anyone: bool = False) -> None:
        """:param directory: Where the snapshots go; None: the exports never change (the shorthand)."""
        self.directory = directory
        self.serve_anyone = serve_anyone
        #: The generation in force, shared by every process.
        self.current = SharedInts([1])
        self._secret = secrets.token_bytes(32)
        self._tables: Dict[int, ExportTable] = {1: first}
        #: The wall-clock time each generation came into force (its predecessor was replaced).
        self._since: Dict[int, float] = {1: time.time()}
        #: The main process's: the place of every name ever exported.
        self._slots: Dict[str, int] = dict(slots or {})

    @property
    def reloadable(self) -> bool:
        return self.directory is not None

    @property
    def slot_count(self) -> int:
        """The places in the shared counts of requests in progress, one per export ever named."""
        return MAX_EXPORT_SLOTS if self.reloadable else len(self._tables[1]) + 1

    def admitting(self, ticket: Optional[str], digest: Optional[str], address: str) -> Tuple[int, ExportTable]:
        """The generation a request is admitted under, and its exports: the ticket's while it
        is valid and its rules still serve syncs in flight, else the one in force."""
        current = self.current.value
        if ticket and self.directory is not None:
            generation = self._generation_of(ticket, digest, address)
            if generation is not None and generation < current:
                table = self._still_serving(generation)
                if table is not None:
                    return generation, table
        table = self._tables.get(current)
        if table is None:
            table = self._load(current)
        return current, table

    def ticket(self, generation: int, digest: Optional[str], address: str) -> str:
        """The ticket an answer carries: its generation, signed for this token and address."""
        return f"{generation}.{self._signature(generation, digest, address)}"

    def _signature(self, generation: int, digest: Optional[str], address: str) -> str:
        message = f"{generation} {digest or '-'} {address}".encode("utf-8", "replace")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]

    def _generation_of(self, ticket: str, digest: Optional[str], address: str) -> Optional[int]:
        number, _, signature = ticket.partition(".")
        if not number.isdigit() or len(number) > 9 or number != str(int(number)):
            return None  # (one spelling per generation: the one this server signs)
        generation = int(number)
        if not hmac.compare_digest(signature, self._signature(generation, digest, address)):
            return None
        return generation

    def _still_serving(self, generation: int) -> Optional[ExportTable]:
        """The table of a replaced generation, while it still serves its syncs."""
        try:
            table = self._tables.get(generation) or self._load(generation)
            replaced = self._since.get(generation + 1)
            if replaced is None:
                self._load(generation + 1)
                replaced = self._since[generation + 1]
        except (OSError, ValueError, KeyError, UsageError):
            return None  # (forgotten: older than OLD_RULES_SECONDS)
        if time.time() - replaced > OLD_RULES_SECONDS:
            return None
        return table

    def _snapshot_name(self, generation: int) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, f"exports-{generation}.json")

    def _load(self, generation: int) -> ExportTable:
        """A generation's exports, from the snapshot the main process wrote."""
        with open(self._snapshot_name(generation), encoding="utf-8") as handle:
            snapshot = json.load(handle)
        table = config_table(parse_config(snapshot["config"], snapshot["source"]), snapshot["slots"],
                             self.serve_anyone)
        self._tables[generation] = table
        self._since[generation] = snapshot["since"]
        self._forget_old()
        return table

    def _forget_old(self) -> None:
        """Drop the tables of generations that no longer serve anything."""
        now = time.time()
        for generation in list(self._tables):
            replaced = self._since.get(generation + 1)
            if replaced is not None and now - replaced > OLD_RULES_SECONDS:
                del self._tables[generation]

    def reload(self, file_name: str,
               check: Callable[[Tuple[ExportRules, ...]], None]) -> Tuple[int, Tuple[ExportRules, ...]]:
        """Reread ``file_name`` and put its exports in force (in the main process).

        :param check: Refuses what the server would refuse at start (raising UsageError).
        :returns: The new generation and its exports.
        :raises UsageError: One line saying what is wrong; the generation in force stays.
        """
        if self.directory is None:
            raise UsageError("Nothing to reload: this server has no --config")
        text, exports = read_config(file_name)
        check(exports)
        slots = dict(self._slots)
        for rules in exports:
            slots.setdefault(rules.name, len(slots) + 1)
        if len(slots) >= MAX_EXPORT_SLOTS:
            raise UsageError(f"{file_name}: more than {MAX_EXPORT_SLOTS - 1} exports named since the server "
                             f"started; restart it to start counting again")
        generation = self.current.value + 1
        snapshot = {"generation": generation, "since": time.time(), "source": file_name, "config": text,
                    "slots": slots}
        descriptor, temporary = tempfile.mkstemp(dir=self.directory, prefix=".snapshot-")
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                json.dump(snapshot, handle)
            replace_atomically(temporary, self._snapshot_name(generation), flush=False)  # (in memory: dies with us)
        except BaseException:
            os.unlink(temporary)
            raise
        self._slots = slots
        with self.current.get_lock():
            self.current.value = generation
        return generation, exports


def make_snapshot_directory(parent: str) -> str:
    """The private directory of the snapshots, inside the server's own (the lease table's)."""
    directory = os.path.join(parent, "exports")
    os.makedirs(directory, 0o700, exist_ok=True)
    return directory


__all__ = ["ExportGenerations", "MAX_EXPORT_SLOTS", "OLD_RULES_SECONDS", "first_slots", "make_snapshot_directory"]

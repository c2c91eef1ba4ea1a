"""What every view of the server shares: its configuration and the state made once per application.

:func:`~pdiffcopy.server.app.create_app` makes a :class:`ServerState` and keeps it in the
application; the blueprints' views (files, trees, the legacy API) reach it with
:func:`server_state`, so that they can be plain functions of their own modules.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from flask import Flask, current_app, g

from pdiffcopy.core.hashing import accepted_methods
from pdiffcopy.core.protocol import RESERVED_NAME
from pdiffcopy.engine.forkshared import Throttle
from pdiffcopy.core.exportconfig import ExportRules
from pdiffcopy.server.leasetable import LeaseTable
from pdiffcopy.server.exports import DeviceExport, Export, ExportTable, config_table
from pdiffcopy.server.audit import TransferLog, make_transfer_directory
from pdiffcopy.server.generations import ExportGenerations, first_slots, make_snapshot_directory
from pdiffcopy.server.metrics import RequestMetrics, RequestTally, ServerMetrics
from pdiffcopy.server.slots import FairSlots

#: The prefix of the server's own endpoints.
API_PREFIX = f"/{RESERVED_NAME}"

#: Requests per worker process that do work at once: the hash jobs are
#: bounded by half of it (:data:`MAX_CONCURRENT_HASHES`). Transfers wait on
#: the network and hashing releases the GIL, so a few per process keep a
#: client's hashing and transfer connections (and other clients') all served.
#: The request threads themselves are many more (``guard.REQUEST_THREADS``),
#: so that slow clients holding some cannot starve the others.
THREADS_PER_WORKER = 8

#: Hash requests one worker process runs at once. Half its request threads:
#: hashing is CPU and disk bound, so more of it at once would not finish
#: sooner, and the other half stays free for the reads, writes and control
#: requests of the syncs in progress (a sync that has hashed must be able to
#: transfer, or a crowd of new syncs would starve it).
MAX_CONCURRENT_HASHES = max(1, THREADS_PER_WORKER // 2)

#: Seconds a hash request waits for one of those slots before it is refused
#: with 503. Hashing a 64 MiB segment from the page cache takes tens of
#: milliseconds, so an ordinary burst (one client's first requests) is
#: absorbed, while a crowd is told to come back instead of queueing.
HASH_SLOT_WAIT_SECONDS = 0.5

#: The Retry-After of a 503, in seconds: long enough for a few segments to
#: be hashed, short enough that a refused client loses little time.
HASH_RETRY_AFTER_SECONDS = 1

#: Hash slots of a worker process one client address may hold while other
#: clients want some too: half, so a client keeping many hash requests in
#: flight (slow methods, 1 KiB blocks) leaves the other half to everybody else.
#: Per process: with W worker processes a client holds at most W times this.
MAX_HASHES_PER_CLIENT = max(1, MAX_CONCURRENT_HASHES // 2)

#: Seconds a client counts as wanting hash slots after its last hash request:
#: a few times the Retry-After, so a refused client waiting to ask again
#: still holds the others to their share.
HASH_CONTENTION_SECONDS = 5 * HASH_RETRY_AFTER_SECONDS

#: Where the application keeps its :class:`ServerState`.
STATE_KEY = "pdiffcopy.server"


@dataclass
class ServerConfig:
    """What the application needs to know."""

    root: str
    token: Optional[str] = None
    #: Without a token, serve everyone who can connect (``--insecure``); else only the
    #: clients that :attr:`owner_uid` and root run on this host (docs/service.rst).
    serve_anyone: bool = False
    #: The user a token-less server serves: the one running it.
    owner_uid: int = field(default_factory=os.geteuid)
    #: The hash methods accepted (:func:`~pdiffcopy.core.hashing.accepted_methods`).
    hash_methods: Tuple[str, ...] = field(default_factory=accepted_methods)
    #: Clients may set owners and setuid/setgid bits (``--trust-clients``).
    trust_clients: bool = False
    #: Clients may change files with several hard links in place (``--write-hard-links``).
    write_hard_links: bool = False
    #: Where the write leases live (default: a new temporary directory, made
    #: before gunicorn forks its workers, so that they all share it).
    lease_directory: Optional[str] = None
    #: The directory of the metrics of all worker processes
    #: (:func:`pdiffcopy.server.metrics.make_directory`); None: this process's only.
    metrics_directory: Optional[str] = None
    #: The port of ``--metrics-listen``: requests arriving there get the
    #: metrics without the token, and nothing else.
    metrics_port: Optional[int] = None
    #: Serve the API of pdiffcopy 1.0.1's clients (``--legacy-api``); else refuse it with a hint.
    legacy_api: bool = False
    #: ``--max-rate``: most bytes per second of file data served and received, for all
    #: clients and worker processes together (None: no limit).
    max_rate: Optional[int] = None
    #: ``--device NAME=PATH[:rw]``: the block devices served by NAME (checked at start).
    devices: Tuple[DeviceExport, ...] = ()
    #: ``--config``: the exports, each at ``/NAME/...``; empty: the one-export shorthand,
    #: ``root`` (with ``token`` and ``trust_clients``) at ``/...`` and ``devices`` by name.
    export_rules: Tuple[ExportRules, ...] = ()


@dataclass
class ServerState:
    """What an application makes once, before gunicorn forks its workers (or per worker, as said)."""

    config: ServerConfig
    #: What is served, by name (every file is opened beneath one export's directory): the
    #: exports in force, and those of before a reload that syncs in flight still use.
    generations: ExportGenerations
    #: Per worker process: every child gets its own copy, with all its slots free.
    hash_slots: FairSlots
    #: Shared by every worker process.
    leases: LeaseTable
    metrics: ServerMetrics
    #: ``--max-rate``, in shared memory: one cap for every worker process.
    rate_limit: Optional[Throttle]
    #: The transfers in progress, shared by every worker process, one log line each.
    transfers: TransferLog

    @classmethod
    def start(cls, config: ServerConfig) -> "ServerState":
        leases = LeaseTable(config.lease_directory)
        return cls(
            config=config,
            generations=export_generations(config, leases),
            hash_slots=FairSlots(MAX_CONCURRENT_HASHES, MAX_HASHES_PER_CLIENT, HASH_CONTENTION_SECONDS),
            leases=leases,
            metrics=ServerMetrics(config.metrics_directory),
            # A bucket per worker would let N workers move N times the rate.
            rate_limit=Throttle(config.max_rate, shared=True) if config.max_rate else None,
            transfers=TransferLog(make_transfer_directory(leases.directory)),
        )

    def install(self, app: Flask) -> None:
        app.extensions[STATE_KEY] = self
        app.extensions["pdiffcopy.server.metrics"] = self.metrics  # for gunicorn's child_exit hook (service.py)


def export_generations(config: ServerConfig, leases: LeaseTable) -> ExportGenerations:
    """The exports of ``config``; with a config file, reloadable (their snapshots beside the leases)."""
    if not config.export_rules:
        return ExportGenerations(export_table(config))
    return ExportGenerations(export_table(config), make_snapshot_directory(leases.directory),
                             first_slots(config.export_rules), config.serve_anyone)


def export_table(config: ServerConfig) -> ExportTable:
    """The exports of ``config``: its config file's, or the shorthand's root and devices.

    The shorthand's one token (if any) opens all of them, named ``token`` in the logs.
    """
    if config.export_rules:
        return config_table(config.export_rules, first_slots(config.export_rules), config.serve_anyone)
    tokens = (("token", hashlib.sha256(config.token.encode()).hexdigest()),) if config.token else ()
    root = Export(ExportRules("", config.root, read_only=False, tokens=tokens, trust_clients=config.trust_clients),
                  serve_anyone=config.serve_anyone)
    devices = [Export(ExportRules(device.name, device.path, read_only=not device.writable, tokens=tokens),
                      device, index, config.serve_anyone)
               for index, device in enumerate(config.devices, start=1)]
    return ExportTable(devices, default=root)


def request_metrics() -> RequestMetrics:
    """The metrics as the current request counts them: its export's labels, its tally."""
    made = g.get("request_metrics")
    if made is None:
        made = g.request_metrics = server_state().metrics.of_request(export_label(), RequestTally())
    return made


def export_label() -> str:
    """The metrics' ``export`` label of the current request: a config file's export by name; empty
    for the ``--root`` shorthand, its ``--device`` exports (whose names the metrics never told)
    and the server's own requests."""
    export = g.get("export")
    if export is None or g.exports.default is not None:
        return ""
    return export.name


def server_state() -> ServerState:
    """The state of the application handling the current request."""
    return current_app.extensions[STATE_KEY]

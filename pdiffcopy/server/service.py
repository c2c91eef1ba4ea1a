"""Running the server: gunicorn started from Python, listen addresses, start-up checks."""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

from pdiffcopy.core.addresses import is_loopback
from pdiffcopy.errors import CannotListen, UsageError
from pdiffcopy.core.protocol import TOKEN_VARIABLE

if TYPE_CHECKING:
    from pdiffcopy.core.exportconfig import ExportRules
    from pdiffcopy.server.exports import DeviceExport
    from pdiffcopy.server.generations import ExportGenerations

logger = logging.getLogger(__name__)

#: Default listen address: loopback only, so a server started by accident
#: exposes nothing; the original pdiffcopy's port.
DEFAULT_LISTEN = "127.0.0.1:8080"

#: Seconds a worker may take to finish its requests on shutdown; short, so
#: Ctrl-C stops the server promptly.
GRACEFUL_TIMEOUT = 5

#: Seconds an idle keep-alive connection stays open; the client reuses its
#: connections between the hashing and transfer phases.
KEEPALIVE_SECONDS = 30


def parse_listen_address(value: str) -> Tuple[str, int]:
    """Parse ``PORT``, ``HOST:PORT`` or ``[IPv6]:PORT``.

    :returns: (host, port); the host defaults to 127.0.0.1.
    :raises UsageError: For anything else.
    """
    text = (value or "").strip()
    host, port_text = "127.0.0.1", text
    if text.startswith("["):
        closing = text.find("]")
        if closing < 0 or text[closing + 1 : closing + 2] != ":":
            raise UsageError(f"Invalid listen address: {value!r} (expected [IPv6]:PORT)")
        host, port_text = text[1:closing], text[closing + 2 :]
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
        if ":" in host:
            raise UsageError(f"Invalid listen address: {value!r} (write IPv6 as [ADDRESS]:PORT)")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535 or not host:
        raise UsageError(f"Invalid listen address: {value!r} (expected PORT, HOST:PORT or [IPv6]:PORT)")
    return host, int(port_text)


@dataclass
class ServerOptions:
    """Everything the ``pdiffcopy`` server command takes."""

    listen: str = DEFAULT_LISTEN
    root: str = "."
    token: Optional[str] = None
    insecure: bool = False
    workers: Optional[int] = None
    log_level: str = "info"
    certfile: Optional[str] = None
    keyfile: Optional[str] = None
    #: ``--hash-methods``: a comma-separated list or ``all``; None for the default.
    hash_methods: Optional[str] = None
    trust_clients: bool = False
    write_hard_links: bool = False
    #: ``--metrics-listen``: a second address answering only the metrics, without the token.
    metrics_listen: Optional[str] = None
    #: ``--legacy-api``: serve pdiffcopy 1.0.1's clients too.
    legacy_api: bool = False
    #: ``--max-rate``: most bytes per second of file data, all clients and workers together.
    max_rate: Optional[int] = None
    #: Listen on this Unix socket (made mode 0600) instead of ``listen``: the serve-over-ssh
    #: mode, which also skips the sweep of the root (there it is "/").
    unix_socket: Optional[str] = None
    #: A listening socket's descriptor to serve instead of binding ``listen`` or ``unix_socket``
    #: (serve-over-ssh binds its socket before it imports the server).
    listen_descriptor: Optional[int] = None
    #: Called with gunicorn's arbiter once the server listens, before the workers start.
    when_ready: Optional[Callable] = None
    #: Seconds the workers get to finish their requests on shutdown.
    graceful_timeout: int = GRACEFUL_TIMEOUT
    #: Wraps the application's WSGI callable (before gunicorn forks): a middleware.
    wrap_app: Optional[Callable] = None
    #: ``--device NAME=PATH[:rw]``, as given: the block devices served by NAME (checked at start).
    devices: Sequence[str] = ()
    #: ``--config``: the file naming the exports (instead of ``root``, ``token`` and ``devices``).
    config: Optional[str] = None
    #: ``--client-ca``: the CA bundle client certificates are verified with (they open the
    #: exports that list them, as tokens do).
    client_ca: Optional[str] = None
    #: Exports made already (serve-over-ssh's named device), not checked against the root:
    #: such an export is the entry of the root it names.
    exports: Sequence["DeviceExport"] = ()


def run_server(options: ServerOptions) -> None:
    """Serve ``options.root`` until SIGINT or SIGTERM.

    :raises UsageError: For a bad address, a missing root, or a public
                        address without a token (unless ``insecure``).
    """
    host, port = parse_listen_address(options.listen)
    from pdiffcopy.server.exports import check_exports, load_config, parse_device_option

    export_rules = load_config(options.config) if options.config else ()
    root = "" if options.config else os.path.abspath(options.root)
    if not options.config and not os.path.isdir(root):
        raise UsageError(f"Root directory does not exist: {root}")
    if options.unix_socket:
        host = "localhost"  # (not listened on: the socket's mode keeps others out)
    refuse_open_exports(host, export_rules, options)
    if not is_loopback(host) and not options.insecure:
        if not options.config and not options.token:
            raise UsageError(f"Refusing to listen on {host} without a token: anyone on the network could read "
                             f"and write {root}. Set ${TOKEN_VARIABLE} or --token-file, or pass --insecure.")
    if bool(options.certfile) != bool(options.keyfile):
        raise UsageError("TLS needs both --certfile and --keyfile")
    for name in (options.certfile, options.keyfile):
        if name and not os.access(name, os.R_OK):
            raise UsageError(f"Cannot read {name}")
    if options.certfile:
        check_certificate(options.certfile, options.keyfile)
    check_client_ca(options, export_rules)
    exports = [parse_device_option(value) for value in options.devices]
    check_exports(exports, root)
    exports += options.exports
    if options.listen_descriptor is not None:
        bind = f"fd://{options.listen_descriptor}"
    elif options.unix_socket:
        bind = f"unix:{options.unix_socket}"
    else:
        check_address_free(host, port)
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    binds = [bind]
    metrics_port = None
    if options.metrics_listen:
        metrics_host, metrics_port = parse_listen_address(options.metrics_listen)
        # The application tells the metrics address by the port a request came in on.
        if metrics_port in (0, port):
            raise UsageError(f"--metrics-listen needs a port of its own (not 0, not {port} of --listen)")
        check_address_free(metrics_host, metrics_port)
        binds.append(f"[{metrics_host}]:{metrics_port}" if ":" in metrics_host else
                     f"{metrics_host}:{metrics_port}")
    workers = options.workers or os.cpu_count() or 2
    from pdiffcopy.core.hashing import accepted_methods

    hash_methods = accepted_methods(options.hash_methods)
    from gunicorn.app.base import BaseApplication

    from pdiffcopy.server.guard import MAX_CONNECTIONS, REQUEST_THREADS

    from pdiffcopy.server.metrics import SCRAPE_PATH, make_directory

    # Before the application (and prometheus-client) is loaded, and before gunicorn forks.
    metrics_directory = make_directory()
    from pdiffcopy.server.app import ServerConfig, create_app
    from pdiffcopy.server.context import STATE_KEY

    app = create_app(ServerConfig(root=root, token=options.token, serve_anyone=options.insecure,
                                  trust_clients=options.trust_clients,
                                  write_hard_links=options.write_hard_links, hash_methods=hash_methods,
                                  metrics_directory=metrics_directory, metrics_port=metrics_port,
                                  legacy_api=options.legacy_api, max_rate=options.max_rate,
                                  devices=tuple(exports), export_rules=export_rules))
    metrics = app.extensions["pdiffcopy.server.metrics"]
    transfers = app.extensions[STATE_KEY].transfers
    main_process = os.getpid()
    # Before the directory goes (atexit runs the last registered first): the lines of the
    # transfers left, unfinished unless their client ended them.
    atexit.register(lambda: transfers.finish_all() if os.getpid() == main_process else None)
    if options.wrap_app:
        app.wsgi_app = options.wrap_app(app.wsgi_app)  # type: ignore[method-assign]
    if options.config:
        log_exports(options.config, export_rules, options.insecure)
    elif not options.token and options.insecure:
        logger.warning("No token and --insecure: every local user (and anyone who can reach %s) may read "
                       "and write %s", bind, root)
    elif not options.token and not options.unix_socket:
        logger.info("No token: serving only uid %d and root on this host (set $%s to share the server)",
                    os.geteuid(), TOKEN_VARIABLE)
    for export in exports:
        logger.info("Serving the block device %s at /%s (%s)", export.path, export.name,
                    "writable" if export.writable else "read-only")
    if options.legacy_api and options.token:
        logger.warning("--legacy-api with a token: pdiffcopy 1.0.1 clients cannot send it, so their "
                       "requests are refused (401)")
    settings = {
        "bind": binds,
        "workers": workers,
        # gthread with handshakes and headers read in the event loop and paced
        # body reads and answer writes: see pdiffcopy/server/guard.py and
        # docs/service.rst, "Hostile clients and timeouts".
        "worker_class": "pdiffcopy.server.guard.GuardedThreadWorker",
        "threads": REQUEST_THREADS,
        "worker_connections": MAX_CONNECTIONS,
        "graceful_timeout": options.graceful_timeout,
        "keepalive": KEEPALIVE_SECONDS,
        # A worker busy with a long hash still heartbeats from its main thread.
        "timeout": 120,
        "loglevel": options.log_level,
        "errorlog": "-",
        "accesslog": None,
        "preload_app": True,
        "proc_name": "pdiffcopy-server",
        # gunicorn >= 25.1 opens a control socket at one fixed path per user,
        # which several pdiffcopy servers on one host would fight over.
        "control_socket_disable": True,
        # A worker that died runs no hash jobs any more: drop its live gauge.
        "child_exit": lambda _arbiter, worker: metrics.worker_exited(worker.pid),
    }
    if options.certfile:
        settings.update(certfile=options.certfile, keyfile=options.keyfile)
    if options.client_ca:
        import ssl

        # Optional: a client may still come with a token; one that sends a certificate the CA
        # did not sign fails the handshake.
        settings.update(ca_certs=options.client_ca, cert_reqs=ssl.CERT_OPTIONAL)
    if options.unix_socket or options.when_ready:
        def when_ready(arbiter) -> None:
            if options.unix_socket:
                # gunicorn binds with its umask setting (0: any local user could connect).
                os.chmod(options.unix_socket, 0o600)
            if options.when_ready:
                options.when_ready(arbiter)

        settings["when_ready"] = when_ready

    settings["logger_class"] = server_logger_class()

    generations = app.extensions[STATE_KEY].generations

    class Application(BaseApplication):  # gunicorn's documented embedding API
        def load_config(self) -> None:
            for key, value in settings.items():
                if key in self.cfg.settings:  # older gunicorns lack some settings
                    self.cfg.set(key, value)

        def load(self):
            return app

        def run(self) -> None:
            from gunicorn.arbiter import Arbiter

            class ServerArbiter(Arbiter):
                def handle_hup(self) -> None:
                    # Not gunicorn's reload, which restarts every worker and so cuts the syncs
                    # in flight after graceful_timeout: the workers stay, the exports change.
                    reload_exports(options, host, generations)

            try:
                ServerArbiter(self).run()
            except RuntimeError as error:  # (as BaseApplication.run)
                raise CannotListen(str(error)) from None

    answer_protocol_errors_in_json()
    from pdiffcopy.local.descriptors import raise_open_file_limit

    # Every connection is a descriptor (up to guard.MAX_CONNECTIONS per worker), and tree
    # walks hold one per level; the workers inherit the limit.
    raise_open_file_limit()
    if not options.unix_socket and options.listen_descriptor is None:  # (serve-over-ssh's "/")
        for directory in [root] if root else [rules.path for rules in export_rules]:
            if os.path.isdir(directory):  # (not a device export's)
                sweep_root(directory)
    scheme = "https" if options.certfile else "http"
    logger.info("Serving %s on %s://%s with %d workers", root or f"the exports of {options.config}", scheme,
                bind, workers)
    if options.max_rate:
        logger.info("File data limited to %d bytes per second, all clients together", options.max_rate)
    if metrics_port is not None:
        logger.info("Metrics without the token on %s://%s%s", scheme, binds[1], SCRAPE_PATH)
    Application().run()


def refuse_open_exports(host: str, export_rules: Sequence["ExportRules"], options: ServerOptions) -> None:
    """Refuse an export without tokens on an address others can reach, unless ``--insecure``.

    :raises UsageError: Naming the export (at start, and for a reload).
    """
    if is_loopback(host) or options.insecure:
        return
    open_exports = [rules.name for rules in export_rules if not rules.tokens and not rules.certificates]
    if open_exports:
        raise UsageError(f"Refusing to listen on {host} with the export {open_exports[0]} without tokens: "
                         f"anyone on the network could use it. List its tokens in {options.config}, or pass "
                         f"--insecure.")


def reload_exports(options: ServerOptions, host: str, generations: "ExportGenerations") -> None:
    """SIGHUP: put the exports of ``--config`` as it is now in force, or refuse it in one line."""
    if not generations.reloadable:
        logger.info("SIGHUP: nothing to reload without --config; the server goes on as it was")
        return
    try:
        generation, export_rules = generations.reload(
            options.config, lambda rules: refuse_open_exports(host, rules, options))
    except UsageError as error:
        logger.error("Reload refused, the exports stay as they were: %s", error)
        return
    except OSError as error:
        logger.error("Reload refused, the exports stay as they were: cannot save them: %s", error.strerror or error)
        return
    logger.info("Reloaded %s: its exports are in force from now on (generation %d); syncs in flight "
                "finish under the ones they started with", options.config, generation)
    log_exports(options.config, export_rules, options.insecure)


def log_exports(config: str, exports: Sequence["ExportRules"], insecure: bool) -> None:
    """One line per export: what it serves, to whom, and how."""
    for rules in exports:
        access = (f"{len(rules.tokens)} token(s), {len(rules.certificates)} certificate(s)" if rules.certificates else
                  f"{len(rules.tokens)} token(s)" if rules.tokens else
                  "no token: anyone who can connect" if insecure else "no token: only this user and root")
        limits = [f"from {', '.join(map(str, rules.allow))}"] if rules.allow else []
        if rules.max_connections:
            limits.append(f"at most {rules.max_connections} requests at once")
        if rules.refuse:
            limits.append(f"refusing {', '.join(rules.refuse)}")
        logger.info("Export %s: %s, %s, %s%s", rules.name, rules.path, "read-only" if rules.read_only else "writable",
                    access, "".join(f", {limit}" for limit in limits))
    if insecure and any(not rules.tokens and not rules.certificates for rules in exports):
        logger.warning("--insecure: the exports without tokens in %s serve every local user (and anyone who can "
                       "reach the server)", config)


def check_client_ca(options: ServerOptions, export_rules: Sequence["ExportRules"]) -> None:
    """Refuse, before the server listens, client certificates that could not be checked.

    :raises UsageError: For ``--client-ca`` without TLS, without ``--config``, or not a CA
            bundle; and for an export that lists certificates without ``--client-ca``.
    """
    listing = [rules.name for rules in export_rules if rules.certificates]
    if not options.client_ca:
        if listing:
            raise UsageError(f"The export {listing[0]} lists client certificates: give --client-ca, the CA "
                             f"bundle they are verified with")
        return
    if not options.certfile:
        raise UsageError("--client-ca needs TLS: --certfile and --keyfile")
    if not options.config:
        raise UsageError("--client-ca needs --config: its exports list the certificates that open them")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_verify_locations(cafile=options.client_ca)
    except ssl.SSLError as error:
        raise UsageError(f"--client-ca {options.client_ca}: not a CA bundle (PEM): {error.reason or error}") from None
    except OSError as error:
        raise UsageError(f"Cannot read --client-ca {options.client_ca}: {error.strerror or error}") from None


def check_certificate(certfile: str, keyfile: str) -> None:
    """Load the certificate and its key as the workers will, before anything listens.

    gunicorn loads them in each worker after forking: a bad pair killed every
    worker with a traceback, and the server exited 3 after saying it served.

    :raises UsageError: Saying what is wrong with which file (swapped, another key's...).
    """
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
        return
    except ssl.SSLError as error:
        reason = error.reason
    except OSError as error:
        raise UsageError(f"Cannot read --certfile {certfile} or --keyfile {keyfile}: "
                         f"{error.strerror or error}") from None

    def holds(name: str, marker: str) -> bool:
        try:
            with open(name, encoding="ascii", errors="replace") as handle:
                return marker in handle.read(1 << 20)
        except OSError:
            return False

    certificate_in = {name: holds(name, "-----BEGIN CERTIFICATE-----") for name in (certfile, keyfile)}
    key_in = {name: holds(name, "PRIVATE KEY-----") for name in (certfile, keyfile)}  # RSA, EC, ENCRYPTED...
    if not certificate_in[certfile] and certificate_in[keyfile] and key_in[certfile]:
        problem = "swapped: --certfile holds the key and --keyfile the certificate"
    elif not certificate_in[certfile]:
        problem = f"no certificate (PEM) in --certfile {certfile}"
    elif not key_in[keyfile] and not key_in[certfile]:
        problem = f"no private key (PEM) in --keyfile {keyfile}"
    elif reason == "KEY_VALUES_MISMATCH":
        problem = f"--keyfile {keyfile} is not the key of that certificate"
    else:
        problem = f"they cannot be loaded ({reason or 'not a PEM certificate and key'})"
    raise UsageError(f"TLS: --certfile {certfile}, --keyfile {keyfile}: {problem}")


def server_logger_class() -> type:
    """gunicorn's logger, writing through this process's logging: one format for every line.

    gunicorn gives its loggers handlers and a format of their own (``[time] [pid]
    [LEVEL]``); where the process has a handler (the command line's, with its format),
    gunicorn's records go to it instead. Its debug lines are left out: its settings one a
    line and each request's line, which the application logs with its status and time.
    """
    from gunicorn.glogging import Logger

    class ServerLogger(Logger):
        def setup(self, cfg) -> None:
            super().setup(cfg)
            self.error_log.setLevel(max(self.error_log.level, logging.INFO))
            if not logging.getLogger().handlers:
                return  # (nowhere else to write: a program that set up no logging)
            for log in (self.error_log, self.access_log):
                for handler in list(log.handlers):
                    if getattr(handler, "_gunicorn", False):
                        log.removeHandler(handler)
                log.propagate = True

    return ServerLogger


def sweep_root(root: str) -> int:
    """Remove the stale temporaries (of pushes whose client was killed, say) below ``root``.

    Before the workers start, so none of this server's writes is in flight;
    bounded by :data:`~pdiffcopy.local.sweep.SWEEP_MAX_ENTRIES` and
    :data:`~pdiffcopy.local.sweep.SWEEP_MAX_SECONDS`.
    """
    from pdiffcopy.local.sweep import sweep_stale_temporaries

    removed = sweep_stale_temporaries(root, recursive=True)
    if removed:
        logger.info("Removed %d stale temporary file(s) below %s left by interrupted runs", removed, root)
    return removed


def check_address_free(host: str, port: int) -> None:
    """Fail at once, in one line, when the address cannot be listened on (a busy port).

    gunicorn would log an error and retry for five seconds before giving up.
    The probe binds as gunicorn does, with SO_REUSEADDR, so a port whose old
    connections linger in TIME_WAIT still counts as free.

    :raises CannotListen: Naming the address and the reason.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        hint = " (is another server running there?)" if error.errno == errno.EADDRINUSE else ""
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise CannotListen(f"Cannot listen on {shown}: {error.strerror or error}{hint}") from None


def answer_protocol_errors_in_json() -> None:
    """Make gunicorn's own error answers JSON ``{"error", "status"}`` like the application's.

    gunicorn refuses some requests before the application sees them: a
    malformed request line or header (400), a request line or headers that
    are too long (414, 431). It writes those answers with
    ``gunicorn.util.write_error`` as HTML; replacing that one function (in
    the master, before the workers fork) gives every error a client can
    provoke the same JSON shape. A gunicorn without it keeps its HTML.
    """
    from gunicorn import util

    original = getattr(util, "write_error", None)
    if original is None or getattr(original, "pdiffcopy", False) \
            or not hasattr(util, "write_nonblock"):
        return

    def write_error(sock, status_int: int, reason: str, mesg: str) -> None:
        from pdiffcopy.server.requests import one_line

        message = one_line(f"{reason}: {mesg}" if mesg else reason)[:1000]
        body = json.dumps({"error": message, "status": status_int}).encode("ascii") + b"\n"
        head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        util.write_nonblock(sock, head.encode("latin-1") + body)

    write_error.pdiffcopy = True  # type: ignore[attr-defined]
    util.write_error = write_error

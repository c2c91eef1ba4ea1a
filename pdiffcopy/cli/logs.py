"""The command's log: its levels, its one format, and the locations named as the user typed them.

The levels follow rsync's: ``-q`` leaves only the errors, the default adds the
warnings and the one-line summary, ``-v`` also tells about the files (a tree
sync lists the paths it changes, :mod:`pdiffcopy.cli.treecli`; a ``--stats``
line ends it), and ``-vv`` adds the internals: phase timings, the engine's
choices, the ssh command and the remote server's own log.
"""

from __future__ import annotations

import logging
import sys

#: One format for every log line, coloured or not, the client's and the server's
#: (gunicorn's lines included, :class:`pdiffcopy.server.service.ServerLogger`).
LOG_FORMAT = "%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"

#: The ``-v`` count from which the internals are shown (DEBUG), the remote server's log too.
DEBUG_VERBOSITY = 2


def log_level(verbosity: int) -> int:
    """The level of ``-v`` count less ``-q`` count: ERROR, INFO (also for ``-v``: what it adds is
    not log lines) or DEBUG."""
    if verbosity < 0:
        return logging.ERROR
    return logging.DEBUG if verbosity >= DEBUG_VERBOSITY else logging.INFO


def setup_logging(verbosity: int, summary: bool = True, json_lines: bool = False) -> None:
    """Log to stderr at :func:`log_level`; without ``summary`` (``--json``), what INFO adds is left out.

    On a terminal coloredlogs colours the lines; elsewhere (pipes, files,
    services) colours are no use and plain logging spares the import (~40 ms
    of every run). ``json_lines`` (the server's ``--log-format json``): one
    JSON object a line (:class:`JsonLines`).
    """
    level = log_level(verbosity)
    if not summary and level == logging.INFO:
        level = logging.WARNING
    if json_lines:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLines())
        logging.basicConfig(level=level, handlers=[handler])
        logging.getLogger().setLevel(level)
    elif sys.stderr.isatty():
        import coloredlogs

        coloredlogs.install(level=level, fmt=LOG_FORMAT, stream=sys.stderr)
    else:
        logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
        logging.getLogger().setLevel(level)
    # Keep third-party chatter out of normal output.
    logging.getLogger("urllib3").setLevel(max(level, logging.WARNING))


class JsonLines(logging.Formatter):
    """A log record as one JSON object: ``time``, ``level``, ``logger``, ``pid``, ``message``;
    a transfer's line (:mod:`pdiffcopy.server.audit`) adds ``"event": "transfer"`` and its fields."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime
        import json

        line = {"time": datetime.datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "pid": record.process,
                "message": record.getMessage()}
        transfer = getattr(record, "transfer", None)
        if isinstance(transfer, dict):
            line["event"] = "transfer"
            line.update(transfer)
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line)  # (ASCII: a name that is not UTF-8 stays an escape, not an error)


class NamedAsTyped(logging.Filter):
    """Name a ``HOST:PATH``'s forwarded URL as the user typed it in every line meant for the user.

    The engine logs what it works on, which over ssh is a loopback URL that means
    nothing to the user; the lines below INFO are the internals, which keep it.

    :param session: The :class:`~pdiffcopy.transport.sshlaunch.SshSession`.
    """

    def __init__(self, session) -> None:
        super().__init__()
        self.session = session

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.INFO:
            message = record.getMessage()
            shown = self.session.shown_message(message)
            if shown != message:
                record.msg, record.args = shown, None
        return True

    def __enter__(self) -> "NamedAsTyped":
        for handler in logging.getLogger().handlers:
            handler.addFilter(self)
        return self

    def __exit__(self, *exc_info) -> None:
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self)


__all__ = ["DEBUG_VERBOSITY", "JsonLines", "LOG_FORMAT", "NamedAsTyped", "log_level", "setup_logging"]

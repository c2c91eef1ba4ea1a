"""The command line: options, the token, what SOURCE and TARGET mean, reports, progress, benchmark."""

from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``pdiffcopy`` command with ``argv``; return its exit status.

    ``from pdiffcopy.cli import main``, as with pdiffcopy 1.0.1. With ``argv`` None
    it reads this process's arguments and raises :exc:`SystemExit` with the status,
    as :func:`sys.exit` does: a caller (a test harness) catches it and goes on. The
    command itself lives in :mod:`pdiffcopy.cli.command` (imported here on first
    call: cheap start-up).
    """
    from pdiffcopy.cli.command import main as run

    return run(argv)


def console_main() -> None:
    """The ``pdiffcopy`` console script and ``python -m pdiffcopy``: run, then end the process.

    Only here may a sync end the process without the interpreter's teardown
    (:func:`pdiffcopy.cli.command.console_main`); :func:`main` always returns or raises.
    """
    from pdiffcopy.cli.command import console_main as run

    run()


__all__ = ["main", "console_main"]

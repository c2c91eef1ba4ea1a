"""The command line: options, the token, what SOURCE and TARGET mean, reports, progress, benchmark."""

from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``pdiffcopy`` command with ``argv`` (None: this process's arguments, then exit).

    ``from pdiffcopy.cli import main``, as with pdiffcopy 1.0.1; the command itself
    lives in :mod:`pdiffcopy.cli.command` (imported here on first call: cheap start-up).
    """
    from pdiffcopy.cli.command import main as run

    return run(argv)


__all__ = ["main"]

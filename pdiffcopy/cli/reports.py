"""What the command prints besides its log: the stats line, and whether to draw progress."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Tuple



def wants_stats(args: argparse.Namespace) -> bool:
    """Whether to end with the stats line: --stats or -v (as rsync's -v prints its summary)."""
    return bool(args.stats or args.verbose)


def print_stats(moved: int, files: Optional[int], seconds: float, remote: bool,
                wire_before: Tuple[int, int] = (0, 0)) -> None:
    """Print rsync's --stats figures on one line of stdout.

    :param moved: Bytes moved (sent, received or written) to bring the target up to date.
    :param files: Files copied or updated (tree syncs), or None (a single file).
    :param seconds: Elapsed time of the whole sync.
    :param remote: Whether a server took part: then the bytes on the wire are shown, counted
                   by :func:`pdiffcopy.api.wire_totals` since ``wire_before``.
    """
    from pdiffcopy.cli.humanize import format_size

    parts = [f"stats: moved {moved} bytes" + ("" if files is None else
                                                 f" in {files} file{'' if files == 1 else 's'}")]
    from pdiffcopy.api import wire_totals

    sent, received = (now - before for now, before in zip(wire_totals(), wire_before))
    if remote and (sent or received):
        parts.append(f"{sent} bytes sent and {received} bytes received on the wire")
    seconds = max(seconds, 1e-6)
    parts += [f"{seconds:.2f} s", f"{format_size(round(moved / seconds), binary=True)}/s"]  # no "0.5 bytes"
    sys.stdout.write(", ".join(parts) + "\n")
    sys.stdout.flush()


def show_progress(args: argparse.Namespace) -> bool:
    """Whether to draw the progress line: on a terminal unless -q or --no-progress; always with -P."""
    if args.no_progress:
        return False
    return args.progress or (not args.quiet and sys.stderr.isatty())


__all__ = ["print_stats", "show_progress", "wants_stats"]

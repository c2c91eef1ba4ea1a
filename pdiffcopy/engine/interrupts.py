"""Ctrl-C and the clean-up signals held back while a file is made and handed over.

A sync that makes a temporary removes it when it is interrupted, but only
once the temporary is in its hands: a signal that raises between the
file's making and the moment its maker's ``try`` holds it leaves the file
behind. :func:`held_back` acts on such a signal at the end of the block
instead, and :func:`let_through` lets it raise at once inside that block
where the code cleans up by itself (a long copy into the new file), so
that Ctrl-C is never deaf for long.

Only the main thread runs Python's signal handlers; elsewhere both are no-ops.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Dict, Iterator, Optional

#: Ctrl-C, and what the command line treats like it (cli.CLEAN_UP_SIGNALS).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Holding:
    depth = 0  # nested held_back blocks
    open = 0  # nested let_through blocks inside them
    pending: Optional[int] = None
    handlers: Dict[int, object] = {}


def _act_on(signum: int) -> None:
    """Do what the handler in place before :func:`held_back` would have done."""
    handler = _Holding.handlers.get(signum, signal.SIG_DFL)
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _hold(signum, frame) -> None:
    if _Holding.open:
        _act_on(signum)
    elif _Holding.pending is None:
        _Holding.pending = signum


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def held_back() -> Iterator[None]:
    """Stop signals arriving inside the block are acted on when it ends (Ctrl-C raises there)."""
    if not _in_main_thread():
        yield
        return
    if _Holding.depth == 0:
        _Holding.handlers = {signum: signal.signal(signum, _hold) for signum in STOP_SIGNALS}
    _Holding.depth += 1
    try:
        yield
    finally:
        _Holding.depth -= 1
        if _Holding.depth == 0:
            for signum, handler in _Holding.handlers.items():
                signal.signal(signum, handler)
            pending, _Holding.pending = _Holding.pending, None
            if pending is not None:
                _act_on(pending)


@contextlib.contextmanager
def let_through() -> Iterator[None]:
    """Inside :func:`held_back`: stop signals act at once again (one held back already, on entry)."""
    if not _in_main_thread() or _Holding.depth == 0:
        yield
        return
    _Holding.open += 1
    try:
        pending, _Holding.pending = _Holding.pending, None
        if pending is not None:
            _act_on(pending)
        yield
    finally:
        _Holding.open -= 1


__all__ = ["STOP_SIGNALS", "held_back", "let_through"]

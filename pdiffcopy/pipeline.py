"""The names 2.0 documented as ``pdiffcopy.pipeline``, kept for their callers.

The file job itself is :mod:`pdiffcopy.engine.filejob`; :func:`sync` is
:func:`pdiffcopy.api.sync`. This module sits beside the api, above the engine,
so that the engine never imports upwards.
"""

from pdiffcopy.api import sync
from pdiffcopy.engine.filejob import Progress, SyncResult, run_sync

__all__ = ["Progress", "SyncResult", "run_sync", "sync"]

"""The C library, loaded once for the whole package: the few calls Python's os module lacks.

``sync_file_range`` and ``fallocate`` (:mod:`~pdiffcopy.local.descriptors`,
:mod:`~pdiffcopy.local.fastcopy`), ``fstatfs`` (:mod:`~pdiffcopy.local.copyfile`) and
the ``openat2`` system call (:mod:`~pdiffcopy.local.confinement`). A function the
platform lacks (not Linux, no libc) is None, and every caller has a fallback.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import ctypes


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    import ctypes  # (on the first C call: a run that makes none spares its import)

    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # no C library to load (Windows: no CDLL(None))
        return None


@functools.lru_cache(maxsize=None)
def function(name: str, *argtypes: type) -> Optional[Callable[..., int]]:
    """The C function ``name``, its arguments typed as ``argtypes`` (none given: as ctypes guesses); None if missing.

    Typed once: a function is looked up with the same ``argtypes`` everywhere.
    """
    library = _library()
    found = getattr(library, name, None) if library is not None else None
    if found is not None and argtypes:
        found.argtypes = list(argtypes)
        import ctypes

        found.restype = ctypes.c_int
    return found


def sync_file_range() -> Optional[Callable[..., int]]:
    """``sync_file_range(fd, offset, length, flags)``, or None."""
    import ctypes

    return function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def fallocate() -> Optional[Callable[..., int]]:
    """``fallocate(fd, mode, offset, length)``, or None."""
    import ctypes

    return function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def last_error(path: Optional[str] = None) -> OSError:
    """The :class:`OSError` of the errno the last C call left (``use_errno``)."""
    import ctypes

    number = ctypes.get_errno()
    return OSError(number, os.strerror(number)) if path is None else OSError(number, os.strerror(number), path)


def call(c_function: Callable[..., int], *args: int) -> None:
    """Call a C function that returns 0 on success.

    :raises OSError: With the function's errno, when it returns anything else.
    """
    if c_function(*args) != 0:
        raise last_error()

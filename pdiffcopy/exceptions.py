"""Kept for programs that import it: the exception tree is :mod:`pdiffcopy.errors`."""

from pdiffcopy.errors import *  # noqa: F401,F403

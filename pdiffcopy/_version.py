"""The version, in a module of its own: every layer may read it without importing the package's API."""

__version__ = "2.0.0"

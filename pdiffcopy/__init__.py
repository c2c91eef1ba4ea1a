"""pdiffcopy: fast, safe delta synchronisation of very large files.

The public API mirrors the command line::

    from pdiffcopy import sync
    result = sync("http://storage1:8080/db/big.ibd", "/srv/db/big.ibd", block_size="1MiB")
    print(result.similarity, result.bytes_moved)

Everything heavier than this module is imported lazily, so that ``import
pdiffcopy`` (and the command line's start-up) stays cheap.
"""

from pdiffcopy._version import __version__

__all__ = ["__version__", "sync", "sync_tree", "SyncResult", "Progress", "PdiffcopyError", "copyfile",
           "patch_copyfile", "unpatch_copyfile"]


def __getattr__(name: str):
    # Lazy exports: the client, server and their dependencies load on first use.
    if name in ("sync", "sync_tree"):
        from pdiffcopy import api

        return getattr(api, name)
    if name in ("SyncResult", "Progress"):
        from pdiffcopy.engine import filejob

        return getattr(filejob, name)
    if name in ("patch_copyfile", "unpatch_copyfile"):
        from pdiffcopy import copyfile as copyfile_module

        return getattr(copyfile_module, name)
    if name == "copyfile":
        # The module is callable with shutil.copyfile's signature (see copyfile.py).
        import importlib

        return importlib.import_module("pdiffcopy.local.copyfile")
    if name == "PdiffcopyError":
        from pdiffcopy.errors import PdiffcopyError

        return PdiffcopyError
    raise AttributeError(f"module 'pdiffcopy' has no attribute {name!r}")

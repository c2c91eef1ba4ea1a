"""Sphinx configuration of the pdiffcopy documentation.

Build it (warnings are errors) with::

    sphinx-build -W -b html docs docs/_build/html
"""

import os
import sys

# Make the package importable for autodoc even when it is not installed
# (an editable install or tox's docs environment finds it anyway).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import pdiffcopy  # noqa: E402

project = "pdiffcopy"
author = "The pdiffcopy authors"
copyright = "2026, The pdiffcopy authors"  # as in LICENSE

#: The full version, including alpha/beta/rc tags, from the package itself.
release = pdiffcopy.__version__
#: The short X.Y version.
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]

master_doc = "index"
exclude_patterns = ["_build"]
language = "en"

# Document members in the order the source defines them, which is the order a
# reader meets them in (sync() before its result, the base exception first).
autodoc_member_order = "bysource"
# Type hints already appear in the signatures; repeating them in the
# descriptions would only add noise.
autodoc_typehints = "signature"

html_theme = "alabaster"
html_theme_options = {
    "description": "Fast, safe delta synchronisation of very large files",
    "fixed_sidebar": True,
}
html_static_path = []

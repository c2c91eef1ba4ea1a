#!/usr/bin/env bash
# Install the ORIGINAL pdiffcopy 1.0.1 from PyPI, with its client and server extras,
# into its own virtualenv so that it never mixes with the pdiffcopy being developed here.
#
# Usage: benchmarks/setup_original.sh [VENV_DIR]   (default: benchmarks/.venv-original)
#        PYTHON=python3.11 benchmarks/setup_original.sh   to choose the interpreter.
# Prints the path of the installed `pdiffcopy` program on its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-original}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# The constraints file pins the dependency versions verified with pdiffcopy 1.0.1 on
# Python 3.11 (see the comments in it).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --constraint "$here/original-constraints.txt" 'pdiffcopy[client,server]==1.0.1'
# Import both halves once so that a broken dependency fails here, not in the middle of a run.
# (From /, so that a pdiffcopy in the working directory, such as this repository's, is not the one imported.)
(cd / && "$venv/bin/python" -c 'import pdiffcopy.client, pdiffcopy.server')
echo "$venv/bin/pdiffcopy"

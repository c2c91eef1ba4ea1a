#!/usr/bin/env bash
# Build blocksync-fast, device_bench.py's block-device competitor, from source into
# benchmarks/.blocksync-fast (git-ignored):
#
#   blocksync-fast (C)  github.com/nethappen/blocksync-fast  commit a25fcfcd (see BLOCKSYNC_FAST_COMMIT)
#
# Usage: benchmarks/setup_blocksync_fast.sh [TOOLS_DIR]     (default: benchmarks/.blocksync-fast)
#
# The source is taken from BLOCKSYNC_FAST_SRC when set (a source tree, or a git directory whose
# pinned commit is archived), else from TOOLS_DIR/src when it holds one, else by a shallow git
# clone of the pinned commit. It needs libgcrypt >= 1.9 and optionally xxHash >= 0.8 (Debian:
# apt-get install build-essential pkg-config libgcrypt20-dev libxxhash-dev), and is built
# with ./configure && make, as its README says. The binary lands in TOOLS_DIR/bin/blocksync-fast.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tools="${1:-$here/.blocksync-fast}"
REPO=https://github.com/nethappen/blocksync-fast
BLOCKSYNC_FAST_COMMIT=a25fcfc
src="$tools/src"
mkdir -p "$tools/bin"

if [ -n "${BLOCKSYNC_FAST_SRC:-}" ]; then
    rm -rf "$src" && mkdir -p "$src"
    if [ -f "$BLOCKSYNC_FAST_SRC/configure" ]; then
        cp -a "$BLOCKSYNC_FAST_SRC/." "$src/"
    else  # a git directory (a bare mirror, or a checkout's .git)
        git --git-dir="$BLOCKSYNC_FAST_SRC" archive "$BLOCKSYNC_FAST_COMMIT" | tar -x -C "$src"
    fi
elif [ ! -f "$src/configure" ]; then
    rm -rf "$src"
    git clone --quiet "$REPO" "$src" && git -C "$src" checkout --quiet "$BLOCKSYNC_FAST_COMMIT" || {
        echo "cannot fetch blocksync-fast: put its source in $src or set BLOCKSYNC_FAST_SRC" >&2
        exit 1
    }
fi

cd "$src"
# The generated files come in the archive; their times make make want to regenerate them.
touch aclocal.m4 configure Makefile.in config.h.in 2>/dev/null || true
./configure --quiet >/dev/null
make --quiet -j"$(nproc)" >/dev/null
cp src/blocksync-fast "$tools/bin/blocksync-fast"
"$tools/bin/blocksync-fast" --version 2>/dev/null | head -1 || true
echo "built $tools/bin/blocksync-fast"

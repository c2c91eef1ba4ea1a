#!/usr/bin/env bash
# Build the two tree-copy competitors of tree_bench.py from source, into benchmarks/.tree-tools
# (git-ignored):
#
#   psync    (Go)   github.com/hweidner/psync    commit 3f9e42aaa932da365862abffad1827996cab6071
#   parsync  (Rust) github.com/Saphereye/parsync  commit 3d576d1e8030fdca0e23ebf43b1774cb110e1f6e
#                   (version 0.4.0: copy/sync/delete subcommands, -t THREADS, FICLONE /
#                   copy_file_range fast paths, SFTP remotes)
#
# Usage: benchmarks/setup_tree_tools.sh [TOOLS_DIR]     (default: benchmarks/.tree-tools)
#
# Sources are looked for in TOOLS_DIR/src/psync and TOOLS_DIR/src/parsync. When one is missing,
# the script tries a shallow git clone of the pinned commit; machines without access to
# GitHub must put the source tree there by other means (a checkout of the commit above). The
# parsync build fetches its crates from crates.io with cargo (ssh2 builds libssh2 from its
# crate and needs libssl-dev and pkg-config: apt-get install libssl-dev pkg-config).
# Either tool that cannot be built is reported and skipped; tree_bench.py then lists it as
# "not built" and quotes the issue's figures for it instead.
#
# Binaries land in TOOLS_DIR/bin/psync and TOOLS_DIR/bin/parsync. Go and cargo are taken from
# PATH, /usr/local/go/bin and ~/.cargo/bin.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tools="${1:-$here/.tree-tools}"
mkdir -p "$tools/src" "$tools/bin"
export PATH="$PATH:/usr/local/go/bin:$HOME/.cargo/bin"

PSYNC_REPO=https://github.com/hweidner/psync
PSYNC_COMMIT=3f9e42aaa932da365862abffad1827996cab6071
PARSYNC_REPO=https://github.com/Saphereye/parsync
PARSYNC_COMMIT=3d576d1e8030fdca0e23ebf43b1774cb110e1f6e

status=0

fetch() {  # fetch NAME REPO COMMIT: make sure $tools/src/NAME holds the source
    local name="$1" repo="$2" commit="$3" dir="$tools/src/$1"
    if [ -d "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
        return 0
    fi
    echo "== $name: no source in $dir; trying git clone of $repo at $commit" >&2
    rm -rf "$dir"
    if timeout 60 git clone --quiet --filter=blob:none "$repo" "$dir" 2>/dev/null \
        && git -C "$dir" checkout --quiet "$commit" 2>/dev/null; then
        return 0
    fi
    rm -rf "$dir"
    echo "== $name: NOT BUILT: no source (put a checkout of $repo at $commit into $dir)" >&2
    return 1
}

# ---------------------------------------------------------------- psync (Go, no dependencies)
if fetch psync "$PSYNC_REPO" "$PSYNC_COMMIT"; then
    if ! command -v go >/dev/null; then
        echo "== psync: NOT BUILT: no go compiler" >&2
        status=1
    elif (cd "$tools/src/psync" && GOFLAGS=-mod=mod GOPROXY=off GOTOOLCHAIN=local \
            go build -trimpath -o "$tools/bin/psync" .); then
        echo "== psync: built $tools/bin/psync" >&2
    else
        echo "== psync: NOT BUILT: go build failed" >&2
        status=1
    fi
else
    status=1
fi

# ---------------------------------------------------------------- parsync (Rust, crates.io)
if fetch parsync "$PARSYNC_REPO" "$PARSYNC_COMMIT"; then
    if ! command -v cargo >/dev/null; then
        echo "== parsync: NOT BUILT: no cargo" >&2
        status=1
    # Offline first (crates already in ~/.cargo/registry), then with the registry.
    elif (cd "$tools/src/parsync" && { cargo build --release --offline --quiet 2>/dev/null \
            || cargo build --release --quiet; }) \
        && cp "$tools/src/parsync/target/release/parsync" "$tools/bin/parsync"; then
        echo "== parsync: built $tools/bin/parsync" >&2
    else
        echo "== parsync: NOT BUILT: cargo build failed (see above)" >&2
        status=1
    fi
else
    status=1
fi

ls -l "$tools/bin" >&2
exit $status

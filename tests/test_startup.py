"""Start-up: a quiet tree sync imports only what it needs (a no-change sync of a small tree is mostly start-up).

And the block size's usual spellings, read without humanfriendly, mean what
humanfriendly reads them as.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from humanfriendly import parse_size

from pdiffcopy.core.blocks import parse_block_size

#: Run pdiffcopy's command in this interpreter, then name the modules it imported.
RUN_AND_LIST = """
import runpy, sys
sys.argv = ["pdiffcopy"] + sys.argv[1:]
try:
    runpy.run_module("pdiffcopy", run_name="__main__")
except SystemExit as exit:
    assert not exit.code, exit.code
print(" ".join(sorted(sys.modules)))
"""


def imported_by(*args: str) -> set:
    done = subprocess.run([sys.executable, "-c", RUN_AND_LIST, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_a_quiet_local_tree_sync_does_not_import_humanfriendly(tmp_path):
    (tmp_path / "src" / "d").mkdir(parents=True)
    (tmp_path / "src" / "d" / "file").write_bytes(b"contents\n")
    for _ in range(2):  # a copy, then a no-change sync
        modules = imported_by("-a", "-q", "--no-progress", f"{tmp_path / 'src'}/", str(tmp_path / "dst"))
        assert (tmp_path / "dst" / "d" / "file").read_bytes() == b"contents\n"
        assert "humanfriendly" not in modules
        assert not any(name.split(".")[0] in ("requests", "urllib3", "flask") for name in modules)


@pytest.mark.parametrize("text", ["1MiB", "1mib", "1 MiB", "5K", "5k", "64KiB", "128KIB", "4M", "8 k", "1048576",
                                  "5KB", "1MB", "1.5M"])
def test_block_sizes_mean_what_humanfriendly_reads(text):
    binary = not text.upper().endswith(("KB", "MB", "GB", "TB"))
    assert parse_block_size(text) == int(parse_size(text, binary=binary))

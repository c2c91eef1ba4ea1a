"""Start-up: a small local sync imports only what it needs and forks nothing (it is mostly start-up).

And the block size's usual spellings, read without humanfriendly, mean what
humanfriendly reads them as; the package's own @dataclass and the shared
counters of forked workers do what the standard ones did.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import List

import pytest
from humanfriendly import format_size, format_timespan, parse_size

from pdiffcopy.cli import humanize
from pdiffcopy.core import records
from pdiffcopy.core.blocks import parse_block_size
from pdiffcopy.engine.forkshared import SharedInts

#: Run pdiffcopy's command in this interpreter as ``python -m pdiffcopy`` does; when it exits (its own
#: way: atexit's functions run), print how many processes it forked and the modules it imported.
RUN_AND_LIST = """
import atexit, os, runpy, sys
forks = []
os.register_at_fork(before=lambda: forks.append(1))
atexit.register(lambda: print(len(forks), " ".join(sorted(sys.modules)), flush=True))
sys.argv = ["pdiffcopy"] + sys.argv[1:]
runpy.run_module("pdiffcopy", run_name="__main__")
"""

#: What a quiet local tree sync never needs: the server, the HTTP client and its sockets, TLS,
#: OpenSSL's hashes, the human sizes, multiprocessing (its import alone takes ~6 ms), pickle (only
#: for forked processes), the standard dataclasses (with inspect, ~20 ms), shutil (with bz2 and lzma).
NEVER_IMPORTED = ("flask", "gunicorn", "werkzeug", "requests", "urllib3", "http", "socket", "ssl", "hashlib",
                  "_hashlib", "secrets", "json", "humanfriendly", "coloredlogs", "multiprocessing", "pickle",
                  "dataclasses", "inspect", "shutil", "bz2", "lzma", "subprocess", "tempfile", "zstandard")


def run_listing(*args: str, before: str = ""):
    """Run the command with ``args`` (``before``: Python run first); (forks, modules imported)."""
    done = subprocess.run([sys.executable, "-c", before + RUN_AND_LIST, *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    forks, _, names = done.stdout.strip().rpartition("\n")[2].partition(" ")
    assert names, f"no listing printed at exit: {done.stdout!r}"
    return int(forks), set(names.split())


def make_tree(root, files: int) -> None:
    for index in range(files):
        directory = root / f"d{index % 3}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"file{index}").write_bytes(b"contents %d\n" % index)


@pytest.mark.measures
def test_a_quiet_local_tree_sync_imports_only_what_it_needs(tmp_path):
    make_tree(tmp_path / "src", 3)
    quiet = ("-a", "-q", "--no-progress", f"{tmp_path / 'src'}/", str(tmp_path / "dst"))
    _, copied = run_listing(*quiet)
    assert (tmp_path / "dst" / "d1" / "file1").read_bytes() == b"contents 1\n"
    _, unchanged = run_listing(*quiet)
    for modules in (copied, unchanged):
        imported = sorted(name for name in NEVER_IMPORTED if name in modules)
        assert not imported, f"a quiet local tree sync imported {imported}"
        assert "pdiffcopy.engine.treesync" in modules  # (the listing is of a real tree sync)
    assert "ctypes" not in unchanged  # (a copy may call into libc; a no-change sync does not)
    # Not quiet: the summary line's sizes and times are humanfriendly's, without importing it.
    (tmp_path / "src" / "d0" / "new").write_bytes(b"new\n")
    _, told = run_listing(*quiet[:1], *quiet[2:])
    assert not [name for name in ("humanfriendly", "coloredlogs") if name in told]


@pytest.mark.parametrize("size", [0, 1, 2, 999, 1000, 1023, 1024, 1025, 1536, 10 ** 6, 2 ** 20 - 1, 2 ** 20,
                                  5 * 2 ** 30 + 12345, 7 * 10 ** 15, 2 ** 70, 3 * 2 ** 80, 1.0, 0.5, 1023.75,
                                  123456.789, 2 ** 40 * 1.005])
def test_sizes_are_written_as_humanfriendly_writes_them(size):
    for binary in (True, False):
        assert humanize.format_size(size, binary=binary) == format_size(size, binary=binary)


@pytest.mark.parametrize("seconds", [0, 0.001, 0.004, 0.005, 0.01, 0.5, 0.999, 0.9951, 1, 1.0, 1.004, 2, 9.999,
                                     59.99, 59.996, 60, 61.5, 3600, 90061.25])
def test_times_are_written_as_humanfriendly_writes_them(seconds):
    assert humanize.format_timespan(seconds) == format_timespan(seconds)


@pytest.mark.measures
def test_a_small_local_tree_sync_forks_nothing_and_a_big_one_lists_in_two_processes(tmp_path):
    make_tree(tmp_path / "src", 20)
    quiet = ("-a", "-q", "--no-progress", f"{tmp_path / 'src'}/", str(tmp_path / "dst"))
    assert run_listing(*quiet)[0] == 0  # a copy
    (tmp_path / "src" / "d0" / "file0").write_bytes(b"changed\n")
    (tmp_path / "dst" / "d2" / "extra").write_bytes(b"not in the source\n")
    assert run_listing(*quiet)[0] == 0  # an update
    # A source past SMALL_TREE_ENTRIES: the target's walk is forked, and the sync the same.
    (tmp_path / "src" / "d1" / "file1").write_bytes(b"changed too\n")
    forks, _ = run_listing(*quiet[:-2], "--delete", *quiet[-2:],
                           before="import pdiffcopy.engine.treelisting as listing; listing.SMALL_TREE_ENTRIES = 4\n")
    assert forks == 1
    assert (tmp_path / "dst" / "d0" / "file0").read_bytes() == b"changed\n"
    assert (tmp_path / "dst" / "d1" / "file1").read_bytes() == b"changed too\n"
    assert not (tmp_path / "dst" / "d2" / "extra").exists()
    assert sorted(p.name for p in (tmp_path / "dst").rglob("*")) == \
        sorted(p.name for p in (tmp_path / "src").rglob("*"))


@pytest.mark.measures
def test_a_file_pull_and_push_import_only_what_they_need(server, unique, tmp_path):
    """Not the server's modules, not OpenSSL's hashes (xxh3 is the default), not the standard
    dataclasses nor humanfriendly (its summary line is printed: not quiet)."""
    import hashlib

    from pdiffcopy.transport.legacyremote import LEGACY_METHODS

    assert LEGACY_METHODS == frozenset(hashlib.algorithms_guaranteed) - {"shake_128", "shake_256"}
    data = os.urandom(3 * 1024 * 1024)
    (server.root / unique).write_bytes(data)
    local = tmp_path / "local.img"
    local.write_bytes(data[:1000] + b"changed" + data[1007:])
    _, pulled = run_listing("--no-progress", server.url(unique), str(local))
    assert local.read_bytes() == data
    local.write_bytes(data[::-1])
    _, pushed = run_listing("--no-progress", str(local), server.url(unique))
    assert (server.root / unique).read_bytes() == data[::-1]
    for modules in (pulled, pushed):
        imported = [name for name in ("hashlib", "_hashlib", "dataclasses", "inspect", "humanfriendly",
                                      "coloredlogs", "flask", "gunicorn", "werkzeug", "requests", "urllib3")
                    if name in modules]
        assert not imported, f"a file sync with a server imported {imported}"
        assert "pdiffcopy.transport.remote" in modules


def test_shared_ints_count_exactly_across_forked_processes():
    counters = SharedInts([0, 100])
    children: List[int] = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            code = 1
            try:
                for _ in range(3000):
                    with counters.get_lock():  # a read, then a write: lost without the lock
                        counters[0] = counters[0] + 1
                        counters.value = counters.value  # (value is the first)
                counters[1] -= 1
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    for pid in children:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert (counters.value, counters[1], len(counters)) == (12000, 96, 2)


@records.dataclass(frozen=True)
class _Frozen:
    size: int
    name: str = "x"
    tags: list = records.field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", int(self.size))


@records.dataclass(frozen=True)
class _FrozenMore(_Frozen):
    extra: bool = False


@records.dataclass
class _Mutable:
    count: int = 0


def test_records_are_dataclasses_as_the_package_uses_them():
    first = _Frozen("5")
    assert first.size == 5 and first.name == "x" and first.tags == [] and first.tags is not _Frozen(1).tags
    assert repr(first) == "_Frozen(size=5, name='x', tags=[])"
    assert first == _Frozen(5) and first != _Frozen(6)
    assert hash(_Frozen(5, tags=())) == hash(_Frozen("5", "x", ()))
    assert first != _FrozenMore(5)  # another class, as dataclasses compare them
    with pytest.raises(AttributeError):
        first.size = 6
    more = _FrozenMore(1, "y", extra=True)
    assert (more.size, more.name, more.tags, more.extra) == (1, "y", [], True)
    assert records.replace(more, size="7") == _FrozenMore(7, "y", [], True)  # __post_init__ ran again
    # The standard module's functions take them too (tests and the server's views use them).
    assert dataclasses.is_dataclass(more)
    assert [field.name for field in dataclasses.fields(_FrozenMore)] == ["size", "name", "tags", "extra"]
    assert dataclasses.replace(more, name="z") == _FrozenMore(1, "z", [], True)
    mutable = _Mutable()
    mutable.count += 1
    assert mutable == _Mutable(1)
    with pytest.raises(TypeError):
        hash(mutable)  # compared by value and mutable: unhashable, as dataclasses make it
    with pytest.raises(TypeError):
        records.dataclass(type("Bad", (), {"__annotations__": {"a": "int", "b": "int"}, "a": 1}))


@pytest.mark.parametrize("text", ["1MiB", "1mib", "1 MiB", "5K", "5k", "64KiB", "128KIB", "4M", "8 k", "1048576",
                                  "5KB", "1MB", "1.5M"])
def test_block_sizes_mean_what_humanfriendly_reads(text):
    binary = not text.upper().endswith(("KB", "MB", "GB", "TB"))
    assert parse_block_size(text) == int(parse_size(text, binary=binary))


#: Start the hash processes of a local file as a sync that may cut chunks does (argv[1]: "1" or "0");
#: print whether each process, and this one, has the chunker loaded once the processes are idle.
CHUNKER_IN_POOL = """
import sys, time
from pdiffcopy.local.localfile import LocalFile
import startup_probe
pool = LocalFile(sys.argv[2]).start_hash_pool(2, cuts_likely=sys.argv[1] == "1")
# The loads are not waited for by design: give both processes time to finish theirs (up to
# 10 s on a loaded machine when they should, 0.5 s to show that they do not).
deadline = time.monotonic() + (10 if sys.argv[1] == "1" else 0.5)
while True:
    time.sleep(0.1)
    loaded = {pool.submit(startup_probe.chunker_loaded).result() for _ in range(8)}
    if time.monotonic() > deadline or loaded == {(True,)}:
        break
print(sorted(loaded), "pyfastcdc" in sys.modules)
pool.shutdown()
"""


@pytest.mark.measures
@pytest.mark.parametrize("cuts_likely,expected", [("1", "[(True,)] False"), ("0", "[(False,)] False")])
def test_the_hash_processes_load_the_chunker_early_only_when_a_cut_is_likely(tmp_path, cuts_likely, expected):
    (tmp_path / "startup_probe.py").write_text(
        "import os, sys\n"
        "def chunker_loaded():\n"
        "    return ('pyfastcdc' in sys.modules,)\n")
    (tmp_path / "file").write_bytes(b"x")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    output = subprocess.run([sys.executable, "-c", CHUNKER_IN_POOL, cuts_likely, str(tmp_path / "file")],
                            capture_output=True, text=True, env=env, timeout=60)
    assert output.returncode == 0, output.stderr
    # Each process loaded it (or none did); the sync's own process never pays for it.
    assert output.stdout.strip() == expected

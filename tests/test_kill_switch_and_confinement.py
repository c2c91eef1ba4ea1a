"""One local file (issue 11, item 2): one kill switch for every fast path, one temporary name, confinement.

The kill switch is checked where it matters, in the system calls a real run
makes (``strace -f``): with ``PDIFFCOPY_NO_FASTPATH=1`` no process of a
local sync, a tree sync or a server may try ``copy_file_range``,
``sendfile``, ``FICLONE``, ``openat2``, ``fadvise`` or ``sync_file_range``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import List

import pytest

from conftest import http_get, pdiffcopy_command, random_bytes, run_cli, start_server
import pdiffcopy
from pdiffcopy.local import descriptors, sweep
from pdiffcopy.errors import AccessDenied, NotAFile
from pdiffcopy.local.confinedfile import ConfinedFile
from pdiffcopy.local.localfile import LocalFile
from pdiffcopy.local.confinement import Root

#: System calls that are fast paths: none of them may be tried with the kill switch on.
FAST_CALLS = ("copy_file_range", "sendfile", "openat2", "fadvise64", "sync_file_range")

#: A tree member from this size on goes through the block delta (treerunner.DELTA_MIN_SIZE).
BIG_MEMBER = 9 * 1024 * 1024

KILL_SWITCH = {"PDIFFCOPY_NO_FASTPATH": "1"}


def strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    return subprocess.run(["strace", "-f", "-qq", "-o", os.devnull, "true"], capture_output=True).returncode == 0


needs_strace = pytest.mark.skipif(not strace_works(), reason="strace is missing or may not trace here")


def traced(command: List[str], trace: Path) -> List[str]:
    """``command`` under ``strace -f`` (the syscalls of :data:`FAST_CALLS` and ioctl) as trace lines."""
    return ["strace", "-f", "-qq", "-o", str(trace), "-e", f"trace={','.join(FAST_CALLS)},ioctl", *command]


def fast_calls(trace: Path) -> List[str]:
    """The lines of a trace that are fast paths (FICLONE among the ioctls)."""
    lines = trace.read_text().splitlines()
    pattern = re.compile(r"\b(" + "|".join(FAST_CALLS) + r")\(")
    return [line for line in lines if pattern.search(line) or "FICLONE" in line or "0x40049409" in line]


def run_traced(tmp_path: Path, *args: str, env_extra=None) -> List[str]:
    trace = tmp_path / "trace"
    env = dict(os.environ)
    env.update(env_extra or {})
    done = subprocess.run(traced(pdiffcopy_command(*args), trace), capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return fast_calls(trace)


def make_tree(base: Path) -> None:
    (base / "d").mkdir(parents=True)
    (base / "d" / "small").write_bytes(random_bytes(300_000, 1))
    (base / "big").write_bytes(random_bytes(BIG_MEMBER, 2))
    (base / "link").symlink_to("big")


@needs_strace
@pytest.mark.parametrize("how", ["new", "delta", "atomic"])
def test_the_kill_switch_stops_every_fast_path_of_a_local_sync(tmp_path, how):
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    data = random_bytes(3_000_000)
    source.write_bytes(data)
    if how != "new":
        target.write_bytes(data[:1_000_000] + bytes(2_000_000))
    extra = ["--atomic"] if how == "atomic" else []
    assert run_traced(tmp_path, *extra, str(source), str(target), env_extra=KILL_SWITCH) == []
    assert target.read_bytes() == data


@needs_strace
def test_the_kill_switch_stops_every_fast_path_of_a_tree_sync(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    make_tree(source)
    # Without the switch the same run does use fast paths (the trace does see them).
    assert run_traced(tmp_path, f"{source}/", f"{target}/") != []
    shutil.rmtree(target)
    assert run_traced(tmp_path, f"{source}/", f"{target}/", env_extra=KILL_SWITCH) == []
    # A changed big member goes through the block delta and its temporary.
    with open(source / "big", "r+b") as handle:
        handle.seek(5_000_000)
        handle.write(b"changed")
    assert run_traced(tmp_path, f"{source}/", f"{target}/", env_extra=KILL_SWITCH) == []
    assert (target / "big").read_bytes() == (source / "big").read_bytes()
    assert os.readlink(target / "link") == "big"


@needs_strace
def test_the_kill_switch_stops_every_fast_path_of_a_server(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    data = random_bytes(3_000_000)
    (root / "file.img").write_bytes(data)
    trace = tmp_path / "server-trace"
    server = start_server(root, tmp_path / "server.log", env_extra=KILL_SWITCH,
                          wrapper=traced([], trace))
    try:
        local = tmp_path / "local.img"
        done = run_cli(server.url("file.img"), str(local))
        assert done.returncode == 0, done.stderr
        local.write_bytes(data[:2_000_000] + bytes(1_000_000))
        for extra in ([], ["--atomic"]):
            done = run_cli(*extra, str(local), server.url("file.img"))
            assert done.returncode == 0, done.stderr
    finally:
        # The whole group: strace and the server under it.
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=15)
    assert fast_calls(trace) == []


def _fast_paths_in_a_new_process(value, code: str = "") -> str:
    """What a new Python process started with the kill switch at ``value`` (None: unset) prints."""
    import sys

    env = {key: item for key, item in os.environ.items() if key != "PDIFFCOPY_NO_FASTPATH"}
    if value is not None:
        env["PDIFFCOPY_NO_FASTPATH"] = value
    program = "from pdiffcopy.local import descriptors\nprint(descriptors.fast_paths_enabled())\n" + code
    completed = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True,
                               timeout=60)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.split()


def test_fast_paths_are_judged_in_one_place():
    for value, enabled in ((None, True), ("1", False), ("yes", False), ("0", True), ("", True)):
        assert _fast_paths_in_a_new_process(value) == [str(enabled)]


def test_the_kill_switch_is_read_once_per_process_and_inherited_by_forks():
    # Flipped after the first use: the process and a worker forked after it keep the first answer.
    flip_then_fork = (
        "import os\n"
        "if os.environ.pop('PDIFFCOPY_NO_FASTPATH', None) is None:\n"
        "    os.environ['PDIFFCOPY_NO_FASTPATH'] = '1'\n"
        "print(descriptors.fast_paths_enabled(), flush=True)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    print(descriptors.fast_paths_enabled(), flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(child, 0)\n")
    assert _fast_paths_in_a_new_process(None, flip_then_fork) == ["True"] * 3
    assert _fast_paths_in_a_new_process("1", flip_then_fork) == ["False"] * 3


@pytest.mark.parametrize("switch", ["", "1"])
def test_a_confined_file_stays_beneath_its_root_with_and_without_the_kill_switch(tmp_path, kill_switch,
                                                                                 switch):
    kill_switch(switch)
    root_dir, outside = tmp_path / "root", tmp_path / "outside"
    (root_dir / "d").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    (root_dir / "d" / "file").write_bytes(b"inside")
    (root_dir / "out").symlink_to(outside / "secret")
    (root_dir / "outdir").symlink_to(outside, target_is_directory=True)
    (root_dir / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(root_dir / "fifo")
    root = Root(str(root_dir), reserve=False)
    assert b"".join(bytes(chunk) for _, chunk in ConfinedFile(root, "d/file").read_ranges([(0, 6)])) \
        == b"inside"
    for name in ("out", "outdir/secret", "../outside/secret"):
        with pytest.raises((AccessDenied, NotAFile)):
            list(ConfinedFile(root, name).read_ranges([(0, 6)]))
    with pytest.raises(NotAFile):
        list(ConfinedFile(root, "fifo").read_ranges([(0, 1)]))
    # Writing through a symlinked directory never creates anything outside.
    with pytest.raises(AccessDenied):
        ConfinedFile(root, "outdir/new").prepare(10)
    assert sorted(os.listdir(outside)) == ["secret"]


@pytest.mark.parametrize("switch", ["", "1"])
def test_the_server_refuses_a_symlink_out_of_its_root_with_and_without_the_kill_switch(tmp_path, switch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret outside the root")
    (root / "link").symlink_to(outside / "secret")
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    server = start_server(root, tmp_path / "server.log", env_extra={"PDIFFCOPY_NO_FASTPATH": switch})
    try:
        for name in ("link", "linkdir/secret"):
            status, _, body = http_get(server.url(name))
            assert status == 403, (name, body)
            assert b"secret outside" not in body
            status, _, body = http_get(f"{server.base}/.pdiffcopy/hashes/{name}?method=sha256"
                                       f"&block_size=4096&offset=0&length=4096")
            assert status == 403, (name, body)
        done = run_cli(str(tmp_path / "outside" / "secret"), server.url("linkdir/new"))
        assert done.returncode != 0
        assert not (outside / "new").exists()
    finally:
        server.stop()


#: System calls that put a name in place: their first name must be a temporary the sweep knows.
RENAME_CALLS = ("rename", "renameat", "renameat2")


def renamed_names(trace: Path) -> List[str]:
    """The last components of every name that was renamed over another (successful calls only)."""
    names = []
    for line in trace.read_text().splitlines():
        match = re.search(r"\brename(?:at2?)?\((?:-?\w+, )?\"((?:[^\"\\]|\\.)*)\"", line)
        if match and "= 0" in line.rpartition(")")[2]:
            names.append(match.group(1).encode().decode("unicode_escape").rpartition("/")[2])
    return names


@needs_strace
def test_every_temporary_any_path_makes_is_one_the_sweep_recognises(tmp_path):
    """Whatever renames a file into place (local and atomic syncs, a tree's small and big files and
    symlinks, a server's clone and rename) names the temporary so that the leftovers sweep finds it."""
    trace = tmp_path / "trace"
    calls = f"trace={','.join(RENAME_CALLS)}"
    source, target = tmp_path / "source", tmp_path / "target"
    make_tree(source)
    subprocess.run(["cp", "-a", str(source), str(target)], check=True)
    with open(source / "big", "r+b") as handle:  # a big member through the block delta, --atomic
        handle.seek(5_000_000)
        handle.write(b"changed")
    (source / "d" / "small").write_bytes(b"changed")  # a small member replaced by a temporary
    (source / "link").unlink()
    (source / "link").symlink_to("d/small")  # a symlink replaced by a temporary
    (source / "one.img").write_bytes(random_bytes(2_000_000, 3))
    runs = [["--atomic", f"{source}/", f"{target}/"], ["--atomic", str(source / "one.img"), str(tmp_path / "one.img")],
            [str(source / "one.img"), str(tmp_path / "new.img")]]
    names: List[str] = []
    for args in runs:
        subprocess.run(["strace", "-f", "-qq", "-o", str(trace), "-e", calls, *pdiffcopy_command(*args)],
                       check=True, capture_output=True, timeout=120)
        names += renamed_names(trace)
    root = tmp_path / "root"
    root.mkdir()
    (root / "file.img").write_bytes(random_bytes(2_000_000, 4))
    server_trace = tmp_path / "server-trace"
    server = start_server(root, tmp_path / "server.log",
                          wrapper=["strace", "-f", "-qq", "-o", str(server_trace), "-e", calls])
    try:
        done = run_cli("--atomic", str(source / "one.img"), server.url("file.img"))
        assert done.returncode == 0, done.stderr
    finally:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=15)
    names += renamed_names(server_trace)
    assert len(names) >= 6, names  # the small file, the big one, the symlink, two atomic syncs, the server
    assert [name for name in names if not descriptors.is_temporary_name(name)] == []
    # And the sweep takes each of them for a leftover once it is old (and its maker gone).
    for name in set(names):
        info = os.stat_result((0o100600, 0, 0, 1, 0, 0, 0, 0, 0, 0))
        assert sweep.is_stale_temporary(name, info, now=sweep.STALE_TEMPORARY_SECONDS + 1)


def test_one_temporary_name_generator(tmp_path):
    """Temporary names come from protocol.temporary_name alone (the client names the server's
    temporaries, so the scheme is the protocol's): no module keeps a copy of its own."""
    makers = [path.name for path in package_modules()
              if re.search(r"""f["']\.\{[^}]*\}\.pdiffcopy-""", path.read_text())]
    assert makers == ["protocol.py"]
    first, second = descriptors.temporary_name("x"), descriptors.temporary_name("x")
    assert first != second and descriptors.is_temporary_name(first)


def package_modules() -> List[Path]:
    """Every module of the package, in its subpackages too."""
    return sorted(Path(pdiffcopy.__file__).parent.rglob("*.py"))


def calls_in_package(call: str) -> List[str]:
    """The package's modules that make the call ``call`` (a source scan)."""
    return [path.name for path in package_modules() if call in path.read_text()]


def test_one_umask_reader_and_one_range_copy_loop():
    # Reading the umask means setting it: one reader, once (descriptors.process_umask).
    assert calls_in_package("os.umask(") == ["descriptors.py"]
    # Range copies (a delta's blocks, a tree's files) go through descriptors.copy_available;
    # fastcopy's whole-file engine has its own steps (progress, cache window).
    assert calls_in_package("os.copy_file_range(") == ["descriptors.py", "fastcopy.py"]


def test_libc_is_loaded_in_one_place():
    # local/libc.py loads it once for every platform call, prctl included.
    package = Path(pdiffcopy.__file__).parent
    loaders = [path.relative_to(package).as_posix() for path in package_modules() if "CDLL(" in path.read_text()]
    assert loaders == ["local/libc.py"]


@pytest.mark.parametrize("switch", ["", "1"])
@pytest.mark.parametrize("length", [0, 1, 5000, 3 * 1024 * 1024 + 7])
def test_the_copy_loop_copies_what_there_is(tmp_path, kill_switch, switch, length):
    kill_switch(switch)
    data = random_bytes(length)
    (tmp_path / "source").write_bytes(data)
    source = os.open(tmp_path / "source", os.O_RDONLY)
    target = os.open(tmp_path / "target", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        # One byte more than there is: the copy says how much there was.
        assert descriptors.copy_available(source, target, 0, length + 1, probe_last_byte=True) == length
        assert descriptors.copy_available(source, target, 0, length + 100) == length
        if length:
            descriptors.copy_range(source, target, 0, length)
            with pytest.raises(EOFError):
                descriptors.copy_range(source, target, 0, length + 1)
    finally:
        os.close(source)
        os.close(target)
    assert (tmp_path / "target").read_bytes() == data


def test_the_servers_file_views_open_files_only_through_a_confined_local_file():
    """One implementation of a file on this machine: the views call LocalFile.below, not Root."""
    views = Path(pdiffcopy.__file__).parent / "server"
    # The file views of today's API and of 1.0.1's, what parses their requests, what streams their bytes.
    for module in ("app.py", "files.py", "legacyapi.py", "requests.py", "streaming.py"):
        source = (views / module).read_text()
        assert re.findall(r"root\.(open\w*)\(", source) == [], module
        for call in ("os.replace(", "os.unlink(", "copy_into(", "os.open("):
            assert call not in source, (module, call)
    assert "ConfinedFile(" in (views / "requests.py").read_text()  # served(), which every view asks


def test_every_atomic_replace_goes_through_one_helper():
    assert calls_in_package("os.replace(") == ["descriptors.py"]
    assert calls_in_package("os.rename(") == []


def test_a_server_serves_a_symlink_inside_its_root_and_clones_and_renames_temporaries(server, tmp_path, unique):
    """The views, now on LocalFile.below, keep their behaviour: a symlink staying inside is served,
    an atomic push clones and renames beneath the root, a missing file is a 404."""
    data = random_bytes(1_500_000, 5)
    (server.root / unique).write_bytes(data)
    (server.root / (unique + ".link")).symlink_to(unique)
    status, _, body = http_get(server.url(unique + ".link"))
    assert (status, body) == (200, data)
    status, _, body = http_get(f"{server.base}/.pdiffcopy/stat/{unique}.link")
    assert status == 200 and b'"size":1500000' in body.replace(b" ", b"")
    assert http_get(server.url(unique + ".missing"))[0] == 404
    changed = data[:700_000] + b"changed" + data[700_007:]
    (tmp_path / "local").write_bytes(changed)
    done = run_cli("--atomic", str(tmp_path / "local"), server.url(unique))
    assert done.returncode == 0, done.stderr
    assert (server.root / unique).read_bytes() == changed
    assert [name for name in os.listdir(server.root) if descriptors.is_temporary_name(name)] == []


def test_one_refusal_set():
    """FIFOs, devices and the like (describe_kind, check_regular) and hard links (has_other_names)
    are judged in confinement.py alone; the file views, LocalFile and LocalTree ask it."""
    assert calls_in_package("st_nlink > 1") == ["confinement.py"]
    assert calls_in_package("def describe_kind(") == ["confinement.py"]
    assert calls_in_package("def refuse_hard_links(") == ["confinement.py"]


def test_a_confined_file_is_a_class_of_its_own(tmp_path):
    # One class per case: a plain path's LocalFile and below()'s confined one never
    # ask which they are (no `_root is None` branches).
    from pdiffcopy.local import localfile

    confined = ConfinedFile(Root(str(tmp_path), reserve=False), "a")
    assert isinstance(confined, LocalFile) and type(confined) is not LocalFile
    assert "_root is None" not in Path(localfile.__file__).read_text()


def _open_deleted(path: Path) -> List[str]:
    """This process's descriptors that lead to ``path`` after it was replaced."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link == f"{path} (deleted)":
            found.append(name)
    return found


def _eventually(condition, seconds: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_big_replaced_file_is_closed_behind_the_rename(tmp_path):
    """Replacing a big file hands its last descriptors to a closer (freeing its blocks can
    wait on the device); they are closed all the same, and the new version has the name."""
    target, work = tmp_path / "target", tmp_path / ".target.new"
    target.write_bytes(b"o" * (descriptors.CLOSE_SOON_BYTES + 1))
    work.write_bytes(b"new")
    old, new = LocalFile(str(target)), LocalFile(str(work))
    old._reader()  # the old version is open for reading, as while copies are made from it
    assert _open_deleted(target) == []
    new.replace(old)
    assert target.read_bytes() == b"new"
    assert _eventually(lambda: _open_deleted(target) == []), _open_deleted(target)
    old.close()
    new.close()


def test_a_forked_child_closes_what_it_hands_to_the_closer(tmp_path):
    """A child forked after the parent's closer started has no closer thread of its own
    until it starts one: a descriptor handed over there must still be closed."""
    descriptors.close_soon(os.open(os.devnull, os.O_RDONLY))  # the parent's closer runs
    path = tmp_path / "file"
    path.write_bytes(b"x")
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open(path, os.O_RDONLY)
            descriptors.close_soon(fd)
            os.unlink(path)
            os._exit(0 if _eventually(lambda: _open_deleted(path) == []) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

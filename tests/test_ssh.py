"""``[USER@]HOST:PATH`` over ssh, against a real OpenSSH sshd on 127.0.0.1 with throwaway keys.

The sshd listens on two ports: on the first, sessions have a PATH without
pdiffcopy (the tests name it with --remote-pdiffcopy, as rsync's --rsync-path);
on the second, this venv's bin/ is on the PATH and HOME is a directory of the
test's. Both put the remote server's temporaries in a directory of the test's
(TMPDIR), where the clean-up is checked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import free_port, pdiffcopy_command, random_bytes, run_cli

SSHD = "/usr/sbin/sshd"
#: The pdiffcopy the remote side runs: this venv's.
REMOTE_PDIFFCOPY = str(Path(sys.executable).parent / "pdiffcopy")
#: Seconds the remote side may take to stop and clean up once its client is gone.
CLEAN_UP_SECONDS = 5.0


@dataclass
class Sshd:
    port: int
    #: The port whose sessions find pdiffcopy on their PATH and have ``home`` as HOME.
    path_port: int
    key: Path
    home: Path
    remote_tmp: Path
    process: subprocess.Popen

    def rsh(self, port=None, key=None) -> str:
        return (f"ssh -p {port or self.port} -i {key or self.key} -o BatchMode=yes -o LogLevel=ERROR "
                f"-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null")


def _wait_for_port(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.02)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """An sshd on two free ports of 127.0.0.1, logging in root with a throwaway key."""
    if not os.path.exists(SSHD) or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH (sshd, ssh, ssh-keygen) is not installed")
    if os.geteuid() != 0:
        pytest.skip("the test sshd logs in as its own user only as root")
    base = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / name)], check=True)
    shutil.copy(base / "user_key.pub", base / "authorized_keys")
    # A $TMPDIR as long as users' are (pytest's own base is 35 bytes): the server's socket
    # directory must still go inside it, not to /tmp (the clean-up tests look there).
    home, remote_tmp = base / "home", base / "remote-tmp-as-long-as-users"
    home.mkdir()
    remote_tmp.mkdir()
    port, path_port = free_port(), free_port()
    (base / "sshd_config").write_text(f"""\
ListenAddress 127.0.0.1:{port}
ListenAddress 127.0.0.1:{path_port}
HostKey {base / 'host_key'}
AuthorizedKeysFile {base / 'authorized_keys'}
PermitRootLogin prohibit-password
StrictModes no
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PidFile none
AllowTcpForwarding yes
AllowStreamLocalForwarding yes
SetEnv TMPDIR={remote_tmp} PATH=/usr/bin:/bin
Match LocalPort {path_port}
    SetEnv TMPDIR={remote_tmp} PATH={Path(REMOTE_PDIFFCOPY).parent}:/usr/bin:/bin HOME={home}
""")
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege separation directory
    log = open(base / "sshd.log", "w")
    process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(base / "sshd_config")], stdout=log, stderr=log)
    _wait_for_port(path_port, process)
    if process.poll() is not None:
        pytest.skip(f"sshd cannot run here: {(base / 'sshd.log').read_text().strip()[-300:]}")
    yield Sshd(port, path_port, base / "user_key", home, remote_tmp, process)
    process.terminate()
    process.wait(10)
    log.close()


def over_ssh(sshd: Sshd, *args: str, remote=REMOTE_PDIFFCOPY, rsh=None, timeout: float = 60):
    """Run pdiffcopy with -e naming the test sshd's port and key."""
    extra = ["--remote-pdiffcopy", remote] if remote else []
    return run_cli("--no-progress", "-e", rsh or sshd.rsh(), *extra, *args, timeout=timeout)


def one_line_error(completed: subprocess.CompletedProcess) -> str:
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    return lines[0]


def serve_processes() -> set:
    """Ids of the live serve-over-ssh processes of this venv's pdiffcopy (other checkouts' are not ours)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    words = handle.read().split(b"\0")
            except OSError:
                continue
            if b"--serve-over-ssh" in words and REMOTE_PDIFFCOPY.encode() in b" ".join(words):
                found.add(int(entry))
    return found


def wait_until(condition, seconds: float = CLEAN_UP_SECONDS) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def remote_leftovers(sshd: Sshd) -> list:
    return sorted(p.name for p in sshd.remote_tmp.iterdir())


# -- syncs ---------------------------------------------------------------------------------

def test_push_then_pull_a_file(sshd, tmp_path):
    data = random_bytes(3 * 1024 * 1024 + 5, seed=21)
    (tmp_path / "src").write_bytes(data)
    pushed = over_ssh(sshd, "--stats", str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/pushed")
    assert pushed.returncode == 0, pushed.stderr
    assert (tmp_path / "pushed").read_bytes() == data
    assert f"127.0.0.1:{tmp_path}/pushed" in pushed.stderr  # named as given, not by the forwarded URL
    changed = bytearray(data)
    changed[1000:1010] = b"0123456789"
    (tmp_path / "pushed").write_bytes(bytes(changed))
    pulled = over_ssh(sshd, f"root@127.0.0.1:{tmp_path}/pushed", str(tmp_path / "src"))
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "src").read_bytes() == bytes(changed)
    assert "1 of 4 blocks differed" in pulled.stderr, pulled.stderr
    assert wait_until(lambda: not serve_processes() and not remote_leftovers(sshd)), remote_leftovers(sshd)


def test_trees_with_delete_both_ways(sshd, tmp_path):
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "a").write_bytes(b"a" * 5000)
    (source / "sub" / "b").write_bytes(random_bytes(200_000, seed=3))
    os.symlink("a", source / "link")
    remote = tmp_path / "remote"
    (remote / "old").mkdir(parents=True)
    (remote / "old" / "gone").write_bytes(b"x")
    pushed = over_ssh(sshd, "-a", "-v", "--delete", f"{source}/", f"127.0.0.1:{remote}/")
    assert pushed.returncode == 0, pushed.stderr
    # The summary names the target as given, not by the forwarded URL.
    summary = [line for line in pushed.stderr.splitlines() if "Synchronised" in line]
    assert len(summary) == 1 and f"127.0.0.1:{remote}" in summary[0] and "http" not in summary[0], summary
    assert sorted(str(p.relative_to(remote)) for p in remote.rglob("*")) == ["a", "link", "sub", "sub/b"]
    assert (remote / "sub" / "b").read_bytes() == (source / "sub" / "b").read_bytes()
    assert os.readlink(remote / "link") == "a"
    assert (remote / "a").stat().st_mtime_ns == (source / "a").stat().st_mtime_ns
    (remote / "new").write_bytes(b"new")
    local = tmp_path / "local"
    (local / "stale").mkdir(parents=True)
    pulled = over_ssh(sshd, "-a", "--delete", f"127.0.0.1:{remote}/", f"{local}/")
    assert pulled.returncode == 0, pulled.stderr
    assert sorted(str(p.relative_to(local)) for p in local.rglob("*")) == ["a", "link", "new", "sub", "sub/b"]


def test_remote_path_finds_pdiffcopy_and_relative_paths_are_from_home(sshd, tmp_path):
    (tmp_path / "src").write_bytes(b"to the home directory")
    pushed = over_ssh(sshd, str(tmp_path / "src"), "127.0.0.1:in-home", remote=None,
                      rsh=sshd.rsh(port=sshd.path_port))
    assert pushed.returncode == 0, pushed.stderr
    assert (sshd.home / "in-home").read_bytes() == b"to the home directory"
    pulled = over_ssh(sshd, "127.0.0.1:~/in-home", str(tmp_path / "back"), remote=None,
                      rsh=sshd.rsh(port=sshd.path_port))
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "back").read_bytes() == b"to the home directory"


def test_remote_server_listens_on_a_private_socket_and_hands_the_token_over_privately(sshd):
    """The serve-over-ssh mode by itself: its hand-over line, its socket's modes, its end with stdin."""
    env = dict(os.environ, TMPDIR=str(sshd.remote_tmp))
    env.pop("PDIFFCOPY_TOKEN", None)
    process = subprocess.Popen([REMOTE_PDIFFCOPY, "--serve-over-ssh"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        import json

        handover = json.loads(process.stdout.readline())
        assert handover["pdiffcopy-serve-over-ssh"] == 1 and len(handover["token"]) >= 32
        directory = os.path.dirname(handover["socket"])
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(handover["socket"]).st_mode)
        assert stat.S_IMODE(os.stat(handover["socket"]).st_mode) == 0o600
        for pid in serve_processes():
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                assert handover["token"].encode() not in handle.read()
        with socket.socket(socket.AF_UNIX) as client:  # without the token: refused
            client.connect(handover["socket"])
            client.sendall(b"GET /.pdiffcopy/stat/etc/hostname HTTP/1.0\r\n\r\n")
            assert client.recv(100).split(b" ")[1] == b"401"
    finally:
        process.stdin.close()
        status = process.wait(CLEAN_UP_SECONDS)
    assert status == 0, process.stderr.read()
    assert not os.path.exists(directory)
    assert process.stdout.read() == b""  # nothing but the hand-over on the channel


#: Run as the remote program: pdiffcopy whose first import of Flask takes SLOW_FLASK_SECONDS longer.
SLOW_FLASK_SECONDS = 3.0
SLOW_FLASK_SERVER = f"""
import importlib.abc, importlib.machinery, sys, time

class SlowFlask(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "flask":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):  # the import itself, not a look-up of whether it is there
            time.sleep({SLOW_FLASK_SECONDS})
            run(module)

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, SlowFlask())
sys.argv = ["pdiffcopy", "--serve-over-ssh"]
from pdiffcopy.cli import main
main()
"""


def test_the_hand_over_comes_before_the_server_modules_are_loaded(sshd):
    """The client forwards and starts its work while the remote imports Flask and gunicorn."""
    import json

    env = dict(os.environ, TMPDIR=str(sshd.remote_tmp))
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", SLOW_FLASK_SERVER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        handover = json.loads(process.stdout.readline())
        assert time.monotonic() - started < SLOW_FLASK_SECONDS
        with socket.socket(socket.AF_UNIX) as client:  # queued until the workers run, then answered
            client.connect(handover["socket"])
            client.sendall(b"GET /.pdiffcopy/stat/etc/hostname HTTP/1.0\r\n\r\n")
            assert client.recv(100).split(b" ")[1] == b"401"
        assert time.monotonic() - started >= SLOW_FLASK_SECONDS
    finally:
        process.stdin.close()
        status = process.wait(CLEAN_UP_SECONDS + SLOW_FLASK_SECONDS)
    assert status == 0, process.stderr.read()
    assert not remote_leftovers(sshd)


def test_a_killed_remote_servers_leftovers_are_swept_by_the_next_one(sshd, tmp_path):
    """A remote server killed by SIGKILL cannot clean up: the next serve-over-ssh start does."""
    (tmp_path / "src").write_bytes(random_bytes(2 * 1024 * 1024, seed=7))
    before = serve_processes()
    client = subprocess.Popen(pdiffcopy_command("--no-progress", "--bwlimit", "512K", "-e", sshd.rsh(),
                                                "--remote-pdiffcopy", REMOTE_PDIFFCOPY, str(tmp_path / "src"),
                                                f"127.0.0.1:{tmp_path}/dst"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: serve_processes() - before and remote_leftovers(sshd)
                          and any(p.name.startswith(".dst.") for p in tmp_path.iterdir()), 20), \
            remote_leftovers(sshd)
        killed = serve_processes() - before
        socket_dir = sshd.remote_tmp / remote_leftovers(sshd)[0]
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        _, errors = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode not in (0, None)
    assert "Traceback" not in errors, errors
    assert wait_until(lambda: not (killed & serve_processes()))
    # Left behind: the socket directory, the push's temporary, the /dev/shm directories.
    assert socket_dir.exists()
    assert any(p.name.startswith(".dst.") for p in tmp_path.iterdir())
    (tmp_path / "other").write_bytes(b"another sync")
    again = over_ssh(sshd, str(tmp_path / "other"), f"127.0.0.1:{tmp_path}/other-copy")
    assert again.returncode == 0, again.stderr
    assert not socket_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "other-copy", "src"]
    assert not [name for name in os.listdir("/dev/shm")
                if any(name.startswith(f"pdiffcopy-{kind}-{pid}-") for pid in killed
                       for kind in ("leases", "metrics"))]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_killed_client_leaves_nothing_on_the_remote(sshd, tmp_path, signum):
    (tmp_path / "src").write_bytes(random_bytes(2 * 1024 * 1024, seed=5))
    before = serve_processes()
    client = subprocess.Popen(pdiffcopy_command("--no-progress", "--bwlimit", "512K", "-e", sshd.rsh(),
                                                "--remote-pdiffcopy", REMOTE_PDIFFCOPY, str(tmp_path / "src"),
                                                f"127.0.0.1:{tmp_path}/dst"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # Mid-transfer: the remote server is up and the target's temporary is being written.
        assert wait_until(lambda: serve_processes() - before and remote_leftovers(sshd)
                          and any(p.name.startswith(".dst.") for p in tmp_path.iterdir()), 20), \
            remote_leftovers(sshd)
        ours = serve_processes() - before
        socket_dir = sshd.remote_tmp / remote_leftovers(sshd)[0]
        assert (socket_dir / "socket").exists()
        client.send_signal(signum)
        # TERM and HUP unwind as Ctrl-C does: the requests under way end first (seconds,
        # at this rate), the temporary is removed, then the session is closed.
        assert client.wait(30) == (-signal.SIGKILL if signum == signal.SIGKILL else 20)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert wait_until(lambda: not (ours & serve_processes()) and not remote_leftovers(sshd)), \
        (ours & serve_processes(), remote_leftovers(sshd))
    assert not socket_dir.exists()
    # The push's temporary too: the remote removes what its one client's syncs left unfinished.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# -- errors --------------------------------------------------------------------------------

def test_ssh_that_cannot_connect_says_what_ssh_says(sshd, tmp_path):
    (tmp_path / "src").write_bytes(b"data")
    completed = over_ssh(sshd, str(tmp_path / "src"), "127.0.0.1:dst", rsh=sshd.rsh(port=free_port()))
    assert completed.returncode == 255
    assert "Connection refused" in one_line_error(completed)


def test_ssh_that_cannot_log_in_says_what_ssh_says(sshd, tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "stranger")], check=True)
    (tmp_path / "src").write_bytes(b"data")
    completed = over_ssh(sshd, str(tmp_path / "src"), "127.0.0.1:dst", rsh=sshd.rsh(key=tmp_path / "stranger"))
    assert completed.returncode == 255
    assert "Permission denied" in one_line_error(completed)


#: pdiffcopy 1.0.1, which PyPI's ``pip install pdiffcopy`` brings (tests/test_compat_101.py).
ORIGINAL_PDIFFCOPY = Path(__file__).parent.parent / "benchmarks" / ".venv-original" / "bin" / "pdiffcopy"


@pytest.mark.parametrize("remote", [None, "/nonexistent/bin/pdiffcopy"])
def test_missing_remote_pdiffcopy_says_how_to_install_it(sshd, tmp_path, remote):
    """Not ``pip install pdiffcopy`` (PyPI's 1.0.1, without the server extra): this version, with it."""
    from pdiffcopy import __version__

    (tmp_path / "src").write_bytes(b"data")
    completed = over_ssh(sshd, str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/dst", remote=remote)
    assert completed.returncode == 127, completed.stderr
    line = one_line_error(completed)
    assert f"pdiffcopy {__version__}" in line and f"'pdiffcopy[server]=={__version__}'" in line, line
    assert "pip install pdiffcopy " not in line and "pip install pdiffcopy," not in line, line
    assert "--remote-pdiffcopy" in line
    assert not (tmp_path / "dst").exists()


@pytest.mark.skipif(not ORIGINAL_PDIFFCOPY.exists(), reason="pdiffcopy 1.0.1 is not installed in benchmarks/")
def test_a_remote_pdiffcopy_1_0_1_is_told_apart_and_how_to_install_this_version(sshd, tmp_path):
    from pdiffcopy import __version__

    (tmp_path / "src").write_bytes(b"data")
    completed = over_ssh(sshd, str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/dst", remote=str(ORIGINAL_PDIFFCOPY))
    assert completed.returncode == 2, completed.stderr  # a protocol incompatibility, as rsync's 2
    line = one_line_error(completed)
    assert "too old to serve over ssh" in line and f"'pdiffcopy[server]=={__version__}'" in line, line


# -- HOST:PATH named as the user typed it ----------------------------------------------------

def test_the_summary_names_a_relative_remote_path_as_typed(sshd, tmp_path):
    (tmp_path / "src").write_bytes(b"to the home directory")
    pushed = over_ssh(sshd, str(tmp_path / "src"), "127.0.0.1:typed-name", remote=None,
                      rsh=sshd.rsh(port=sshd.path_port))
    assert pushed.returncode == 0, pushed.stderr
    assert f"Synchronised {tmp_path / 'src'} to 127.0.0.1:typed-name: " in pushed.stderr, pushed.stderr
    pulled = over_ssh(sshd, "127.0.0.1:~/typed-name", str(tmp_path / "back"), remote=None,
                      rsh=sshd.rsh(port=sshd.path_port))
    assert pulled.returncode == 0, pulled.stderr
    assert f"Synchronised 127.0.0.1:~/typed-name to {tmp_path / 'back'}: " in pulled.stderr, pulled.stderr
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "f").write_bytes(b"in a tree")
    tree = over_ssh(sshd, str(tmp_path / "tree"), "127.0.0.1:", remote=None, rsh=sshd.rsh(port=sshd.path_port))
    assert tree.returncode == 0, tree.stderr
    assert f"Synchronised {tmp_path / 'tree'}/ to 127.0.0.1:tree: " in tree.stderr, tree.stderr


def test_a_missing_remote_directory_is_named_as_typed_not_by_the_temporary(sshd, tmp_path):
    (tmp_path / "src").write_bytes(b"data")
    typed = f"127.0.0.1:{tmp_path}/missing-dir/x"
    completed = over_ssh(sshd, str(tmp_path / "src"), typed)
    assert completed.returncode == 3, completed.stderr  # rsync: errors selecting files
    line = one_line_error(completed)
    assert typed.rpartition("/")[0] in line and "directory" in line and "does not exist" in line, line
    assert ".x.pdiffcopy" not in line and "http" not in line, line


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_servers_error_names_the_path_as_typed(sshd, tmp_path, direction):
    """Not ``tmp/...`` (relative to the remote server's root) for ``HOST:/tmp/...``."""
    (tmp_path / "src").write_bytes(b"data")
    (tmp_path / "plain").write_bytes(b"a file, not a directory")
    typed = f"127.0.0.1:{tmp_path}/plain/y"
    arguments = (str(tmp_path / "src"), typed) if direction == "push" else (typed, str(tmp_path / "copy"))
    completed = over_ssh(sshd, *arguments)
    assert completed.returncode != 0, completed.stderr
    line = one_line_error(completed)
    assert typed in line and "Not a directory" in line, line
    assert f" {str(tmp_path)[1:]}" not in line and "http" not in line, line


def test_notices_name_the_remote_side_as_typed(sshd, tmp_path):
    """A notice logged by the engine (here: a push's sweep of a temporary left by a killed run)."""
    (tmp_path / "src").write_bytes(b"data")
    stale = tmp_path / ".dst.pdiffcopy-0123456789ab"
    stale.write_bytes(b"left by a killed run")
    completed = over_ssh(sshd, str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/dst")
    assert completed.returncode == 0, completed.stderr
    assert not stale.exists()
    assert f"Removed 1 stale temporary file(s) left beside 127.0.0.1:{tmp_path}/dst" in completed.stderr, \
        completed.stderr
    assert "http" not in completed.stderr, completed.stderr


# -- what -v and -q print over ssh ---------------------------------------------------------

def test_verbose_over_ssh_tells_about_the_files_not_the_remote_server(sshd, tmp_path):
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "f").write_bytes(b"in a tree")
    pushed = over_ssh(sshd, "-v", f"{source}/", f"127.0.0.1:{tmp_path}/dst/")
    assert pushed.returncode == 0, pushed.stderr
    assert [line for line in pushed.stdout.splitlines() if not line.startswith("stats:")] == ["sub/", "sub/f"]
    assert "Current configuration" not in pushed.stderr and "gunicorn" not in pushed.stderr, pushed.stderr
    assert len(pushed.stderr.splitlines()) == 1, pushed.stderr  # the summary
    quiet = over_ssh(sshd, "-q", f"{source}/", f"127.0.0.1:{tmp_path}/quiet/")
    assert quiet.returncode == 0, quiet.stderr
    assert (quiet.stdout, quiet.stderr) == ("", "")
    debug = over_ssh(sshd, "-vv", f"{source}/", f"127.0.0.1:{tmp_path}/debug/")
    assert debug.returncode == 0, debug.stderr
    assert "Starting the remote server" in debug.stderr and "127.0.0.1: " in debug.stderr  # the remote's log
    assert "Current configuration" not in debug.stderr, debug.stderr


@pytest.mark.parametrize("size", [4, 20 * 1024 * 1024])  # the second is hashed while ssh logs in
def test_other_protocol_version_names_both(sshd, tmp_path, size):
    fake = tmp_path / "old-pdiffcopy"
    fake.write_text("#!/bin/sh\necho 'Welcome to the host'\n"
                    "echo '{\"pdiffcopy-serve-over-ssh\": 99, \"version\": \"9.0.0\", \"socket\": \"/x\", "
                    "\"token\": \"t\", \"home\": \"/\"}'\nexec cat >/dev/null\n")
    fake.chmod(0o755)
    (tmp_path / "src").write_bytes(random_bytes(size, seed=34))
    started = time.monotonic()
    completed = over_ssh(sshd, str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/dst", remote=str(fake))
    assert completed.returncode == 2, completed.stderr
    line = one_line_error(completed)
    assert "9.0.0" in line and "version 99" in line and "version 1" in line, line
    assert not (tmp_path / "dst").exists()
    # The session ended at once: no hashing process held ssh's stdin open (ssh is killed
    # after sshlaunch.CLOSE_TIMEOUT when its stdin does not close).
    assert time.monotonic() - started < 4, completed.stderr


def test_remote_path_not_permitted_gives_the_servers_error(sshd, tmp_path):
    (tmp_path / "src").write_bytes(b"data")
    completed = over_ssh(sshd, str(tmp_path / "src"), "127.0.0.1:/.pdiffcopy/x")
    assert completed.returncode == 3, completed.stderr
    line = one_line_error(completed)
    assert "127.0.0.1 (over ssh): Path reserved for the server" in line, line
    missing = over_ssh(sshd, f"127.0.0.1:{tmp_path}/nothing", str(tmp_path / "dst"))
    assert missing.returncode == 3 and f"127.0.0.1:{tmp_path}/nothing" in one_line_error(missing)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("remote_side", [True, False])
def test_a_regex_given_to_e_gets_a_hint(tmp_path, remote_side):
    (tmp_path / "src").write_bytes(b"data")
    target = "127.0.0.1:dst" if remote_side else str(tmp_path / "dst")
    completed = run_cli("-e", r"\.log$", str(tmp_path / "src"), target)
    assert completed.returncode == 1
    assert "--exclude-regex" in one_line_error(completed)
    assert not (tmp_path / "dst").exists()


def test_rsh_command_is_split_as_a_shell_would(sshd, tmp_path):
    (tmp_path / "src").write_bytes(b"data")
    # A quoted word with a space: the key's file name.
    spaced = tmp_path / "my key"
    shutil.copy(sshd.key, spaced)
    spaced.chmod(0o600)
    rsh = sshd.rsh(key=shlex.quote(str(spaced)))
    completed = over_ssh(sshd, str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/dst", rsh=rsh)
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "dst").read_bytes() == b"data"


# -- telling HOST:PATH from a local path (rsync's rule) ------------------------------------

@pytest.mark.parametrize("location,destination,path", [
    ("host:x", "host", "x"), ("user@host:/srv/a", "user@host", "/srv/a"), ("host:", "host", ""),
    ("[::1]:dir/", "::1", "dir/"), ("host:/a::b", "host", "/a::b"),
])
def test_remote_forms_are_taken_apart(location, destination, path):
    from pdiffcopy.core.sshform import parse_ssh_location

    found = parse_ssh_location(location)
    assert (found.destination, found.path) == (destination, path)


@pytest.mark.parametrize("location", ["./a:b", "/x/a:b", "a/b:c", "http://host:80/x", "plain"])
def test_local_paths_and_urls_are_not_remote(location):
    from pdiffcopy.core.sshform import parse_ssh_location

    assert parse_ssh_location(location) is None


@pytest.mark.parametrize("given,home,absolute", [
    ("rel/x", "/home/u", "/home/u/rel/x"), ("~/x", "/home/u/", "/home/u/x"), ("", "/home/u", "/home/u/"),
    ("/abs", "/home/u", "/abs"),
])
def test_relative_remote_paths_are_from_the_home(given, home, absolute):
    from pdiffcopy.core.sshform import SshLocation

    assert SshLocation(None, "h", given).absolute_path(home) == absolute


def test_a_host_that_ssh_would_take_for_an_option_is_refused(tmp_path):
    (tmp_path / "src").write_bytes(b"data")
    completed = subprocess.run(pdiffcopy_command("-e", "ssh", "--", "src", "-oProxyCommand=touch owned:x"),
                               cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1
    assert "cannot start with '-'" in one_line_error(completed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_dropped_link_fails_the_sync_in_one_line_and_leaves_nothing_on_the_remote(sshd, tmp_path):
    """The ssh connection dies mid-transfer (its client process killed): both ends give up cleanly."""
    (tmp_path / "src").write_bytes(random_bytes(2 * 1024 * 1024, seed=6))
    before = serve_processes()
    client = subprocess.Popen(pdiffcopy_command("--no-progress", "--bwlimit", "512K", "-e", sshd.rsh(),
                                                "--remote-pdiffcopy", REMOTE_PDIFFCOPY, str(tmp_path / "src"),
                                                f"127.0.0.1:{tmp_path}/dst"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: serve_processes() - before
                          and any(p.name.startswith(".dst.") for p in tmp_path.iterdir()), 20)
        ours = serve_processes() - before
        with open(f"/proc/{client.pid}/task/{client.pid}/children") as handle:
            children = [int(pid) for pid in handle.read().split()]
        master = [pid for pid in children if b"ControlMaster=yes" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(master) == 1, children
        os.kill(master[0], signal.SIGKILL)
        _, errors = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode not in (0, None)
    lines = [line for line in errors.splitlines() if line.strip()]
    assert len(lines) == 1 and "127.0.0.1 (over ssh)" in lines[0], errors  # not the forwarded port
    assert "Traceback" not in errors and "Unexpected error" not in errors, errors
    assert wait_until(lambda: not (ours & serve_processes()) and not remote_leftovers(sshd)), \
        (ours & serve_processes(), remote_leftovers(sshd))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_pulled_file_named_like_a_temporary_is_not_removed(sshd, tmp_path):
    """The remote removes its client's unfinished temporaries, never one it was only asked to read."""
    name = ".other.pdiffcopy-0123456789ab"  # another sync's temporary, pulled by hand
    (tmp_path / name).write_bytes(b"someone else's data")
    pulled = over_ssh(sshd, f"127.0.0.1:{tmp_path}/{name}", str(tmp_path / "copy"))
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "copy").read_bytes() == b"someone else's data"
    assert wait_until(lambda: not remote_leftovers(sshd))
    assert (tmp_path / name).read_bytes() == b"someone else's data"


def test_the_library_reaches_host_path_too(sshd, tmp_path):
    from pdiffcopy import sync, sync_tree

    data = random_bytes(300_000, seed=8)
    (tmp_path / "src").write_bytes(data)
    result = sync(str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/pushed", rsh=sshd.rsh(),
                  remote_pdiffcopy=REMOTE_PDIFFCOPY)
    assert result.bytes_moved == len(data) and (tmp_path / "pushed").read_bytes() == data
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "f").write_bytes(b"in a tree")
    sync_tree(f"127.0.0.1:{tmp_path}/tree", str(tmp_path / "pulled"), rsh=sshd.rsh(),
              remote_pdiffcopy=REMOTE_PDIFFCOPY)
    assert (tmp_path / "pulled" / "sub" / "f").read_bytes() == b"in a tree"
    assert not serve_processes() and not remote_leftovers(sshd)  # closed before returning


# -- hashing the local file while ssh logs in -----------------------------------------------

#: Above pdiffcopy.api.PREHASH_MIN_BYTES: one segment of 1 MiB blocks.
PREHASHED_SIZE = 20 * 1024 * 1024


def test_the_local_file_is_hashed_while_ssh_logs_in(sshd, tmp_path):
    data = random_bytes(PREHASHED_SIZE, seed=31)
    (tmp_path / "remote").write_bytes(data)
    changed = bytearray(data)
    changed[5_000_000:5_000_010] = b"0123456789"
    (tmp_path / "local").write_bytes(bytes(changed))
    pulled = over_ssh(sshd, "-vv", f"127.0.0.1:{tmp_path}/remote", str(tmp_path / "local"))
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "local").read_bytes() == data
    assert "1 of 20 blocks differed" in pulled.stderr, pulled.stderr
    assert "digests made while ssh logged in: 1 used, 0 not trusted" in pulled.stderr, pulled.stderr


def test_a_local_file_changed_while_ssh_logs_in_is_hashed_again(sshd, tmp_path):
    data = random_bytes(PREHASHED_SIZE, seed=32)
    (tmp_path / "src").write_bytes(data)
    (tmp_path / "dst").write_bytes(data)
    # An ssh that changes the source (in place, the same size) once it has long been hashed.
    wrapper = tmp_path / "ssh-that-changes-the-source"
    wrapper.write_text(f"#!/bin/sh\nsleep 1\nprintf changed | dd of={tmp_path}/src bs=1 seek=7000000 "
                       f"conv=notrunc 2>/dev/null\nexec ssh \"$@\"\n")
    wrapper.chmod(0o755)
    pushed = over_ssh(sshd, "-vv", str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/dst",
                      rsh=f"{wrapper} {sshd.rsh().split(' ', 1)[1]}")
    assert pushed.returncode == 0, pushed.stderr
    assert (tmp_path / "src").read_bytes()[7_000_000:7_000_007] == b"changed"
    assert (tmp_path / "dst").read_bytes() == (tmp_path / "src").read_bytes()
    assert "digests made while ssh logged in: 0 used, 1 not trusted" in pushed.stderr, pushed.stderr


def test_the_library_hashes_the_local_file_while_ssh_logs_in(sshd, tmp_path, caplog):
    from pdiffcopy import sync

    data = random_bytes(PREHASHED_SIZE, seed=33)
    (tmp_path / "src").write_bytes(data)
    (tmp_path / "dst").write_bytes(data[:-1] + b"!")
    with caplog.at_level("DEBUG", logger="pdiffcopy.local.prehash"):
        result = sync(str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/dst", rsh=sshd.rsh(),
                      remote_pdiffcopy=REMOTE_PDIFFCOPY)
    assert result.changed_blocks == 1 and (tmp_path / "dst").read_bytes() == data
    assert "1 used, 0 not trusted" in caplog.text, caplog.text


# -- --direct ------------------------------------------------------------------------------

def test_direct_push_and_pull_go_over_tls_straight_to_the_server(sshd, tmp_path):
    data = random_bytes(3 * 1024 * 1024 + 11, seed=22)
    (tmp_path / "src").write_bytes(data)
    pushed = over_ssh(sshd, "--direct", "-vv", str(tmp_path / "src"), f"127.0.0.1:{tmp_path}/pushed")
    assert pushed.returncode == 0, pushed.stderr
    assert (tmp_path / "pushed").read_bytes() == data
    assert "https://127.0.0.1:" in pushed.stderr  # -vv names the connections' URL: TLS, not the tunnel
    changed = bytearray(data)
    changed[2_000_000:2_000_004] = b"edit"
    (tmp_path / "pushed").write_bytes(bytes(changed))
    port = free_port()
    pulled = over_ssh(sshd, "--direct-port", str(port), "-vv", f"127.0.0.1:{tmp_path}/pushed", str(tmp_path / "src"))
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "src").read_bytes() == bytes(changed)
    assert f"https://127.0.0.1:{port}" in pulled.stderr, pulled.stderr
    assert "1 of 4 blocks differed" in pulled.stderr, pulled.stderr
    assert wait_until(lambda: not serve_processes() and not remote_leftovers(sshd)), remote_leftovers(sshd)


def test_direct_server_needs_its_certificate_and_its_token(sshd):
    """The --direct server by itself: a client pinning another certificate refuses it; no token, no data."""
    import hashlib
    import json

    from pdiffcopy.core.sshform import PINNED_CERTIFICATE_PREFIX
    from pdiffcopy.errors import RemoteError
    from pdiffcopy.transport.httpclient import Connection

    env = dict(os.environ, TMPDIR=str(sshd.remote_tmp), SSH_CONNECTION="127.0.0.1 50000 127.0.0.1 22")
    env.pop("PDIFFCOPY_TOKEN", None)
    process = subprocess.Popen([REMOTE_PDIFFCOPY, "--serve-over-ssh", "--serve-direct", "0"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        handover = json.loads(process.stdout.readline())
        assert "socket" not in handover and handover["address"] == "127.0.0.1"
        base = f"https://127.0.0.1:{handover['port']}"
        pin = PINNED_CERTIFICATE_PREFIX + handover["fingerprint"]
        wrong = PINNED_CERTIFICATE_PREFIX + hashlib.sha256(b"another certificate").hexdigest()
        with pytest.raises(RemoteError, match="certificate is not the one"):
            Connection(base, 10, wrong).open()

        def status(token=None) -> int:
            connection = Connection(base, 10, pin)
            try:
                http = connection.open()
                http.request("GET", "/.pdiffcopy/stat/etc/hostname",
                             headers={"Authorization": f"Bearer {token}"} if token else {})
                return http.getresponse().status
            finally:
                connection.close()

        assert status() == 401
        assert status("not-the-token") in (401, 403)
        assert status(handover["token"]) == 200
    finally:
        process.stdin.close()
        exit_status = process.wait(CLEAN_UP_SECONDS)
    assert exit_status == 0, process.stderr.read()
    assert not remote_leftovers(sshd)  # the certificate and its key went with the directory


def test_direct_on_a_busy_port_is_one_line(sshd, tmp_path):
    (tmp_path / "src").write_bytes(b"data")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        completed = over_ssh(sshd, "--direct-port", str(busy.getsockname()[1]), str(tmp_path / "src"),
                             f"127.0.0.1:{tmp_path}/dst")
    assert completed.returncode != 0
    line = one_line_error(completed)
    assert "cannot listen on 127.0.0.1 port" in line and "Address already in use" in line, line
    assert not (tmp_path / "dst").exists()
    assert wait_until(lambda: not remote_leftovers(sshd))


def test_direct_is_refused_without_a_host_path(tmp_path):
    (tmp_path / "src").write_bytes(b"data")
    completed = run_cli("--direct", str(tmp_path / "src"), str(tmp_path / "dst"))
    assert completed.returncode == 1  # a usage error
    assert "--direct is for a [USER@]HOST:PATH" in one_line_error(completed)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_a_small_answer_leaves_in_one_write(sshd, tmp_path):
    """Headers and body in one write: two let sshd send two packets, the second waiting ~40 ms
    for the client's delayed ACK (sshd sets no TCP_NODELAY without a tty)."""
    import json

    trace = tmp_path / "trace"
    env = dict(os.environ, TMPDIR=str(sshd.remote_tmp))
    process = subprocess.Popen(["strace", "-f", "-qq", "-s", "65536", "-e", "trace=sendto,write", "-o", str(trace),
                                REMOTE_PDIFFCOPY, "--serve-over-ssh"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        handover = json.loads(process.stdout.readline())
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(handover["socket"])
            client.sendall(f"GET /.pdiffcopy/stat/etc/hostname HTTP/1.1\r\nHost: x\r\n"
                           f"Authorization: Bearer {handover['token']}\r\n\r\n".encode())
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                answer += client.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        process.stdin.close()
        process.wait(CLEAN_UP_SECONDS * 3)
    calls = [line for line in trace.read_text(errors="replace").splitlines() if "HTTP/1.1 200" in line]
    assert len(calls) == 1, calls
    assert "\\r\\n\\r\\n{" in calls[0], calls[0]  # the JSON body follows the headers in the same call


def test_compression_judges_the_link_behind_the_tunnel_of_another_host(sshd, tmp_path):
    """The forwarded port is loopback; HOST is not: --compress auto must weigh the link, not stay plain."""
    from pdiffcopy.core.sshform import parse_ssh_location
    from pdiffcopy.transport.compressionpolicy import Compression
    from pdiffcopy.transport.sshlaunch import SshSession

    # "elsewhere" reaches the test sshd (ssh's HostName), as a host name would reach another machine.
    rsh = sshd.rsh() + " -o HostName=127.0.0.1"
    with SshSession(parse_ssh_location(f"elsewhere:{tmp_path}"), rsh=rsh, remote_program=REMOTE_PDIFFCOPY) as session:
        assert session.base.startswith("http://127.0.0.1:")
        assert Compression("auto", session.url).judges_the_link
    with SshSession(parse_ssh_location(f"127.0.0.1:{tmp_path}"), rsh=sshd.rsh(),
                    remote_program=REMOTE_PDIFFCOPY) as session:
        assert not Compression("auto", session.url).judges_the_link  # this machine: no link to spare


def test_direct_small_answers_do_not_wait_for_a_delayed_ack(sshd):
    """Over --direct's TLS, an answer in two writes (two TLS records) waited ~40 ms for the
    client's delayed ACK, every time: 20 small requests took about a second."""
    import json

    from pdiffcopy.core.sshform import PINNED_CERTIFICATE_PREFIX
    from pdiffcopy.transport.httpclient import Connection

    env = dict(os.environ, TMPDIR=str(sshd.remote_tmp), SSH_CONNECTION="127.0.0.1 50000 127.0.0.1 22")
    process = subprocess.Popen([REMOTE_PDIFFCOPY, "--serve-over-ssh", "--serve-direct", "0"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        handover = json.loads(process.stdout.readline())
        connection = Connection(f"https://127.0.0.1:{handover['port']}", 10,
                                PINNED_CERTIFICATE_PREFIX + handover["fingerprint"])
        http = connection.open()

        def stat() -> None:
            http.request("GET", "/.pdiffcopy/stat/etc/hostname",
                         headers={"Authorization": f"Bearer {handover['token']}"})
            answer = http.getresponse()
            answer.read()
            assert answer.status == 200

        stat()  # (the workers are up)
        started = time.monotonic()
        for _ in range(20):
            stat()
        elapsed = time.monotonic() - started
        connection.close()
    finally:
        process.stdin.close()
        process.wait(CLEAN_UP_SECONDS)
    assert elapsed < 0.4, f"20 small requests took {elapsed:.2f} s"


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")
def test_benchmark_of_an_ssh_source_compares_with_rsync_over_the_same_ssh(sshd, tmp_path):
    """-B with HOST:PATH as SOURCE: rsync reaches it as pdiffcopy does (rsync -e RSH HOST:PATH)."""
    data = random_bytes(2 * 1024 * 1024, seed=35)
    (tmp_path / "src").write_bytes(data)
    completed = over_ssh(sshd, "-B", "2", f"127.0.0.1:{tmp_path}/src", str(tmp_path / "dst"))
    assert completed.returncode == 0, completed.stderr
    rows = [line.strip("|").split("|") for line in completed.stdout.splitlines()
            if re.match(r"^\|\s*\d+\s*\|", line)]
    assert len(rows) == 2, completed.stdout
    assert all(re.fullmatch(r"\d+\.\d\d s", row[-1].strip()) for row in rows), completed.stdout  # not "n/a"
    assert (tmp_path / "dst").read_bytes() == data


def test_several_sources_over_one_ssh_session(sshd, tmp_path):
    """``pdiffcopy a dir/ HOST:dest/`` and back: one remote server for every HOST:PATH."""
    source = tmp_path / "src"
    (source / "dir" / "sub").mkdir(parents=True)
    (source / "a").write_bytes(b"a" * 3000)
    (source / "dir" / "sub" / "b").write_bytes(random_bytes(100_000, seed=5))
    remote = tmp_path / "remote"
    pushed = over_ssh(sshd, "-a", f"{source}/a", f"{source}/dir/", f"127.0.0.1:{remote}/")
    assert pushed.returncode == 0, pushed.stderr
    assert sorted(str(p.relative_to(remote)) for p in remote.rglob("*")) == ["a", "sub", "sub/b"]
    assert "http" not in pushed.stderr
    back = tmp_path / "back"
    pulled = over_ssh(sshd, "-a", f"127.0.0.1:{remote}/a", f"127.0.0.1:{remote}/sub", f"{back}/")
    assert pulled.returncode == 0, pulled.stderr
    assert sorted(str(p.relative_to(back)) for p in back.rglob("*")) == ["a", "sub", "sub/b"]
    assert (back / "sub" / "b").read_bytes() == (source / "dir" / "sub" / "b").read_bytes()
    both = over_ssh(sshd, f"127.0.0.1:{remote}/a", f"{source}/a", f"127.0.0.1:{remote}/x/")
    assert both.returncode != 0 and "both be remote" in one_line_error(both)

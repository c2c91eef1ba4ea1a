"""Bad input and faults: every one ends in a clear one-line error and changes nothing.

Each command-line test checks three things: the exit status, that stderr says
what went wrong in exactly one log line (and never shows a traceback), and
that no file was changed, created or left half-written. The server tests send
raw HTTP and check that every malformed or hostile request is answered with
a 4xx status and a JSON ``{"error": ...}`` body, never a 500, and that
nothing outside the root is touched.
"""

from __future__ import annotations

import ctypes
import http.client
import http.server
import io
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Optional

import pytest
from conftest import free_port, pdiffcopy_command, random_bytes, start_server

from pdiffcopy import sync
from pdiffcopy.errors import FileMissing, NotAFile, RemoteDataError, RemoteError, ServerBusy, ServerFailed, UsageError

#: The token the ``token_server`` fixture requires.
TOKEN = "s3cret-token"

#: Every line the command writes to stderr is a log line of this shape.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+\[\d+\] [A-Z]+ ")

BLOCK = 4096


# -- helpers -----------------------------------------------------------------


def cli(*args: str, cwd=None, env_extra: Optional[Dict[str, str]] = None, timeout: float = 60,
        preexec_fn=None) -> subprocess.CompletedProcess:
    """Run pdiffcopy without $PDIFFCOPY_TOKEN; the result also carries ``.seconds``."""
    env = dict(os.environ)
    env.pop("PDIFFCOPY_TOKEN", None)
    env.update(env_extra or {})
    started = time.monotonic()
    completed = subprocess.run(pdiffcopy_command(*args), capture_output=True, text=True, env=env,
                               cwd=cwd, timeout=timeout, preexec_fn=preexec_fn)
    completed.seconds = time.monotonic() - started  # type: ignore[attr-defined]
    return completed


def error_message(stderr: str) -> str:
    """Check that stderr holds exactly one error, as one log line, and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    strays = [line for line in lines if not LOG_LINE.match(line)]
    assert not strays, f"stderr has lines that are not log lines: {strays!r}\n{stderr}"
    errors = [line for line in lines if " ERROR " in line]
    assert len(errors) == 1, stderr
    assert errors[0] == lines[-1], stderr
    message = errors[0].split(" ERROR ", 1)[1].strip()
    assert message, stderr
    return message


def assert_fails(completed: subprocess.CompletedProcess, status: Optional[int],
                 *fragments: str) -> str:
    """A failure with ``status`` (any non-zero status for None) and one clear error line."""
    assert completed.returncode != 0, (completed.stdout, completed.stderr)
    if status is not None:
        assert completed.returncode == status, completed.stderr
    message = error_message(completed.stderr)
    for fragment in fragments:
        assert fragment.lower() in message.lower(), f"{fragment!r} not in {message!r}"
    return message


def snapshot(*directories: Path) -> dict:
    """Every entry below ``directories``: type, size, mode, mtime and ctime (or link target).

    Not the content: any write moves the ctime, which no one can set back, and the
    server's shared root holds hundreds of MiB by the time a full run gets here.
    """
    state = {}
    for directory in directories:
        directory = Path(directory)
        if not directory.exists():
            continue
        for path in sorted(directory.rglob("*")):
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                state[str(path)] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                state[str(path)] = ("file", info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns,
                                    stat.S_IMODE(info.st_mode))
            else:
                state[str(path)] = ("other", stat.S_IFMT(info.st_mode))
    return state


def temporaries(directory: Path):
    return sorted(p.name for p in Path(directory).iterdir() if ".pdiffcopy-" in p.name)


def raw_request(port: int, method: str, target: str, headers=None, body=None, token=None):
    """One request sent verbatim (no path normalisation); returns (status, headers, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        all_headers = dict(headers or {})
        if token:
            all_headers["Authorization"] = f"Bearer {token}"
        connection.request(method, target, body=body, headers=all_headers)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def assert_json_error(status: int, headers, body: bytes, expected) -> str:
    """A 4xx answer (``expected``: a status or a tuple of them) with a JSON error body."""
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert status in expected, (status, body[:300])
    assert 400 <= status < 500, (status, body[:300])
    assert headers.get("Content-Type", "").startswith("application/json"), (headers, body[:300])
    document = json.loads(body)
    assert isinstance(document.get("error"), str) and document["error"].strip(), document
    assert "\n" not in document["error"]
    return document["error"]


def session_processes(session_id: int):
    """(pid, state, command) of every process still in the session ``session_id``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                text = handle.read()
        except OSError:
            continue  # gone meanwhile
        command = text[text.find("(") + 1 : text.rfind(")")]
        fields = text[text.rfind(")") + 2 :].split()
        # fields: state ppid pgrp session ...
        if int(fields[3]) == session_id and fields[0] != "Z":
            found.append((int(entry), fields[0], command))
    return found


def wait_for_port(port: int, process: subprocess.Popen, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} after {seconds} s")


def port_is_closed(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


_libc = ctypes.CDLL(None, use_errno=True)
_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _drop_file_capabilities() -> None:
    """In the child before exec: root loses the right to ignore file permissions."""
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if _libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            os._exit(97)


def permissions_apply() -> bool:
    """Whether a child with :func:`_drop_file_capabilities` is refused a mode-000 file."""
    probe = Path(f"/tmp/pdiffcopy-probe-{os.getpid()}")
    probe.write_bytes(b"x")
    try:
        probe.chmod(0)
        drop = _drop_file_capabilities if os.geteuid() == 0 else None
        completed = subprocess.run([sys.executable, "-c", f"open({str(probe)!r}).read()"],
                                   preexec_fn=drop, capture_output=True, timeout=30)
        return completed.returncode == 1 and b"PermissionError" in completed.stderr
    finally:
        probe.unlink()


# -- missing, unreadable and wrong kinds of files -----------------------------------


@pytest.mark.parametrize("target_exists", [False, True], ids=["no-target", "old-target"])
def test_missing_local_source(tmp_path, target_exists):
    target = tmp_path / "target.img"
    if target_exists:
        target.write_bytes(b"old contents")
    before = snapshot(tmp_path)
    completed = cli(str(tmp_path / "missing.img"), str(target))
    assert_fails(completed, 3, "does not exist", "missing.img")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("target_exists", [False, True], ids=["no-target", "old-target"])
def test_missing_remote_source(server, tmp_path, unique, target_exists):
    target = tmp_path / "target.img"
    if target_exists:
        target.write_bytes(b"old contents")
    before = snapshot(tmp_path, server.root)
    completed = cli(server.url(unique), str(target))
    assert_fails(completed, 3, "does not exist", unique)
    assert snapshot(tmp_path, server.root) == before


def test_missing_remote_source_via_api(server, tmp_path, unique):
    with pytest.raises(FileMissing):
        sync(server.url(unique), str(tmp_path / "target.img"), block_size=BLOCK, concurrency=2)
    assert not (tmp_path / "target.img").exists()
    assert temporaries(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads mode-000 files: "
                    "test_unreadable_files_without_root_privileges covers this as root")
@pytest.mark.parametrize("which", ["source", "target"])
def test_unreadable_files_as_normal_user(tmp_path, which):
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    source.write_bytes(random_bytes(3 * BLOCK))
    target.write_bytes(random_bytes(5 * BLOCK + 1, seed=5))
    (source if which == "source" else target).chmod(0)
    before = snapshot(tmp_path)
    completed = cli("-b", str(BLOCK), str(source), str(target))
    assert_fails(completed, 3, "permission denied", (source if which == "source" else target).name)
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="only root has capabilities to drop; "
                    "test_unreadable_files_as_normal_user covers this")
@pytest.mark.parametrize("which", ["source", "target", "source-new-target"])
def test_unreadable_files_without_root_privileges(tmp_path, which):
    """As root: run the client without CAP_DAC_OVERRIDE, so mode 000 really refuses access."""
    if not permissions_apply():
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here (no CAP_SETPCAP?)")
    source, target = tmp_path / "source.img", tmp_path / "target.img"
    source.write_bytes(random_bytes(3 * BLOCK))
    if which != "source-new-target":
        # Another size than the source's: a sync that resizes the target before it
        # finds the source unreadable has changed it.
        target.write_bytes(random_bytes(5 * BLOCK + 1, seed=5))
    unreadable = target if which == "target" else source
    unreadable.chmod(0)
    before = snapshot(tmp_path)
    completed = cli("-b", str(BLOCK), str(source), str(target), preexec_fn=_drop_file_capabilities)
    assert_fails(completed, 3, "permission denied", unreadable.name)
    assert snapshot(tmp_path) == before


def test_directory_source_onto_a_file_is_refused(tmp_path):
    """A directory SOURCE is a tree sync (tests/test_tree.py); onto a file it cannot be."""
    (tmp_path / "somedir").mkdir()
    (tmp_path / "target.img").write_bytes(b"a file")
    before = snapshot(tmp_path)
    completed = cli(str(tmp_path / "somedir"), str(tmp_path / "target.img"))
    assert_fails(completed, 3, "not a directory", "target.img")
    assert snapshot(tmp_path) == before


def test_file_source_goes_into_a_local_target_directory(tmp_path):
    (tmp_path / "source.img").write_bytes(random_bytes(BLOCK))
    (tmp_path / "somedir").mkdir()
    (tmp_path / "somedir" / "inside").write_bytes(b"keep")
    completed = cli(str(tmp_path / "source.img"), str(tmp_path / "somedir"))
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "somedir" / "source.img").read_bytes() == (tmp_path / "source.img").read_bytes()
    assert (tmp_path / "somedir" / "inside").read_bytes() == b"keep"


def test_remote_directory_source_onto_a_file_is_refused(server, tmp_path, unique):
    (server.root / unique).mkdir()
    (tmp_path / "target.img").write_bytes(b"a file")
    before = snapshot(tmp_path, server.root)
    completed = cli(server.url(unique), str(tmp_path / "target.img"))
    assert_fails(completed, 3, "not a directory", "target.img")
    assert snapshot(tmp_path, server.root) == before


def test_file_source_goes_into_a_remote_target_directory(server, tmp_path, unique):
    (tmp_path / "source.img").write_bytes(random_bytes(BLOCK))
    (server.root / unique).mkdir()
    (server.root / unique / "inside").write_bytes(b"keep")
    completed = cli(str(tmp_path / "source.img"), server.url(unique))
    assert completed.returncode == 0, completed.stderr
    assert (server.root / unique / "source.img").read_bytes() == (tmp_path / "source.img").read_bytes()
    assert (server.root / unique / "inside").read_bytes() == b"keep"


def test_directory_errors_via_api(tmp_path):
    (tmp_path / "source.img").write_bytes(random_bytes(BLOCK))
    (tmp_path / "somedir").mkdir()
    with pytest.raises(NotAFile):
        sync(str(tmp_path / "somedir"), str(tmp_path / "target.img"), concurrency=1)
    with pytest.raises(NotAFile):
        sync(str(tmp_path / "source.img"), str(tmp_path / "somedir"), concurrency=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somedir", "source.img"]


@pytest.mark.parametrize("how", ["same-path", "hard-link", "symlink", "dot-path"])
def test_source_and_target_are_the_same_file(tmp_path, how):
    source = tmp_path / "file.img"
    source.write_bytes(random_bytes(3 * BLOCK))
    target = {"same-path": source, "dot-path": tmp_path / "." / "file.img",
              "hard-link": tmp_path / "hard.img", "symlink": tmp_path / "soft.img"}[how]
    if how == "hard-link":
        os.link(source, target)
    elif how == "symlink":
        target.symlink_to(source)
    before = snapshot(tmp_path)
    completed = cli("-b", str(BLOCK), str(source), str(target))
    assert_fails(completed, 1, "same file")
    assert snapshot(tmp_path) == before


def test_push_into_missing_remote_directory(server, tmp_path, unique):
    """The server answers an error (404: no such directory); nothing appears anywhere."""
    (tmp_path / "source.img").write_bytes(random_bytes(2 * BLOCK))
    before = snapshot(tmp_path, server.root)
    completed = cli(str(tmp_path / "source.img"), server.url(f"no-such-dir-{unique}/file.img"))
    assert_fails(completed, 3, server.url(f"no-such-dir-{unique}"), "does not exist")
    assert snapshot(tmp_path, server.root) == before


# -- bad arguments ------------------------------------------------------------------

BAD_URLS = [
    ("http://", 1),
    ("https://", 1),
    ("http://127.0.0.1:1/", None),       # the server's root (a tree); nobody listens
    ("http://host:notaport/x", 1),
    ("http://127.0.0.1:99999/x", 1),     # port out of range
    ("http://[::1/x", 1),                # broken IPv6 literal
    ("http://127.0.0.1:1/x?y=1", 1),     # a query is not a file name
    ("ftp://x/y", None),                 # not a URL pdiffcopy speaks: a clear error either way
]


@pytest.mark.parametrize("url,status", BAD_URLS, ids=[u for u, _ in BAD_URLS])
def test_bad_url_as_source(tmp_path, url, status):
    before = snapshot(tmp_path)
    completed = cli(url, str(tmp_path / "target.img"), cwd=tmp_path)
    message = assert_fails(completed, status)
    assert url.split("?")[0].rstrip("/")[:12].lower() in message.lower()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("url,status", [BAD_URLS[0], BAD_URLS[3], BAD_URLS[-1]],
                         ids=["http://", "notaport", "ftp"])
def test_bad_url_as_target(tmp_path, url, status):
    (tmp_path / "source.img").write_bytes(random_bytes(BLOCK))
    before = snapshot(tmp_path)
    completed = cli(str(tmp_path / "source.img"), url, cwd=tmp_path)
    message = assert_fails(completed, status)
    assert url[:7].lower() in message.lower()
    assert snapshot(tmp_path) == before


def test_bad_url_leaves_no_hashing_process_behind(tmp_path):
    """A URL refused while the sync is set up must not leak the hashing processes.

    (Leaked process pools make the interpreter print an 'Exception ignored ...
    Traceback' at exit, so the command line's one-line error gets a traceback.)
    """
    (tmp_path / "source.img").write_bytes(b"x")
    script = (
        "import multiprocessing, sys\n"
        "from pdiffcopy import sync\n"
        "from pdiffcopy.errors import UsageError\n"
        "for source, target in ((sys.argv[1], 'http://127.0.0.1:1/'), (sys.argv[1], 'http://h:x/y'),"
        " ('http://127.0.0.1:1/', sys.argv[2]), (sys.argv[1], sys.argv[2] + '/')):\n"
        "    try:\n"
        "        sync(source, target, concurrency=2)\n"
        "    except UsageError:\n"
        "        pass\n"
        "    else:\n"
        "        sys.exit('no UsageError for %s %s' % (source, target))\n"
        "    print(len(multiprocessing.active_children()))\n"
    )
    completed = subprocess.run([sys.executable, "-c", script, str(tmp_path / "source.img"),
                                str(tmp_path / "target.img")], capture_output=True, text=True,
                               timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["0", "0", "0", "0"], \
        "hashing processes still running after sync() raised UsageError"


def test_both_urls(server, tmp_path, unique):
    (server.root / unique).write_bytes(b"data")
    before = snapshot(server.root)
    completed = cli(server.url(unique), server.url(unique + ".copy"))
    assert_fails(completed, 1, "both", "url")
    assert snapshot(server.root) == before


@pytest.mark.parametrize("arguments", [["one"], ["-B", "1"]], ids=["one", "benchmark-without-paths"])
def test_wrong_number_of_paths(tmp_path, arguments):
    # Without paths the command starts a server: give it a harmless address just in case.
    completed = cli(*arguments, "--root", str(tmp_path), cwd=tmp_path, timeout=30) \
        if arguments == ["-B", "1"] else cli(*arguments, cwd=tmp_path, timeout=30)
    assert_fails(completed, 1)
    assert list(tmp_path.iterdir()) == []


def test_several_missing_sources_make_nothing(tmp_path):
    """Three paths are two SOURCEs and a TARGET, as in rsync: none there, each is named, and
    TARGET is not made."""
    completed = cli("one", "two", "three", cwd=tmp_path, timeout=30)
    assert completed.returncode == 3 and "one" in completed.stderr and "two" in completed.stderr
    assert "Traceback" not in completed.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["0", "-5", "abc", "100G", "", "1023", "1e3"])
def test_bad_block_size(tmp_path, value):
    (tmp_path / "source.img").write_bytes(random_bytes(3 * BLOCK))
    (tmp_path / "target.img").write_bytes(random_bytes(3 * BLOCK, seed=3))
    before = snapshot(tmp_path)
    completed = cli(f"--block-size={value}", str(tmp_path / "source.img"),
                    str(tmp_path / "target.img"))
    assert_fails(completed, 1, "block size", repr(value))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("value", [0, -5, "abc", "100G", True, 1023, 300 * 1024 * 1024])
def test_bad_block_size_via_api(tmp_path, value):
    (tmp_path / "source.img").write_bytes(b"x")
    with pytest.raises(UsageError, match="block size"):
        sync(str(tmp_path / "source.img"), str(tmp_path / "target.img"), block_size=value)
    assert not (tmp_path / "target.img").exists()


@pytest.mark.parametrize("method", ["nosuch", "md6", "xxh3_256", "SHA-1 "])
def test_unknown_hash_method(server, tmp_path, unique, method):
    (tmp_path / "source.img").write_bytes(random_bytes(3 * BLOCK))
    (tmp_path / "target.img").write_bytes(random_bytes(3 * BLOCK, seed=3))
    before = snapshot(tmp_path)
    completed = cli("-m", method, str(tmp_path / "source.img"), str(tmp_path / "target.img"))
    assert_fails(completed, 1, "unknown hash method", method.strip())
    assert snapshot(tmp_path) == before
    with pytest.raises(UsageError, match="hash method"):
        sync(str(tmp_path / "source.img"), server.url(unique), hash_method=method)
    assert not (server.root / unique).exists()


@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_bad_concurrency(tmp_path, value):
    (tmp_path / "source.img").write_bytes(b"x")
    completed = cli(f"--concurrency={value}", str(tmp_path / "source.img"), str(tmp_path / "t.img"))
    assert completed.returncode == 1
    assert "Traceback" not in completed.stderr and "concurrency" in completed.stderr
    assert not (tmp_path / "t.img").exists()


# -- servers that are not there or answer errors ----------------------------------------


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_server_not_running_fails_fast(tmp_path, direction):
    port = free_port()  # nothing listens here
    url = f"http://127.0.0.1:{port}/file.img"
    (tmp_path / "local.img").write_bytes(random_bytes(2 * BLOCK))
    before = snapshot(tmp_path)
    local = str(tmp_path / "local.img")
    args = (url, str(tmp_path / "new.img")) if direction == "pull" else (local, url)
    completed = cli("--timeout", "30", *args)
    assert_fails(completed, 10, f"127.0.0.1:{port}", "connect")
    assert completed.seconds < 10, f"took {completed.seconds:.1f} s to notice a closed port"
    assert snapshot(tmp_path) == before


class _ErrorHandler(http.server.BaseHTTPRequestHandler):
    mode = "500-html"

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.mode == "500-html":
            status, kind, body = 500, "text/html", b"<html><h1>Internal Server Error</h1>\n</html>"
        elif self.mode == "503-json":
            status, kind, body = 503, "application/json", b'{"error": "Down for maintenance"}'
        else:  # a web server that is not pdiffcopy: 200 and HTML for everything
            status, kind, body = 200, "text/html", b"<html><body>Welcome to nginx!</body></html>"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = do_DELETE = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def error_server(request):
    """A local HTTP server answering every request the way ``request.param`` says."""
    handler = type("Handler", (_ErrorHandler,), {"mode": request.param})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("error_server,fragment,status", [
    ("500-html", "500", ServerFailed.exit_code),
    ("503-json", "Down for maintenance", ServerBusy.exit_code),
    ("not-pdiffcopy", "pdiffcopy", RemoteDataError.exit_code),
], indirect=["error_server"], ids=["500-html", "503-json", "not-pdiffcopy"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_server_answering_errors(error_server, fragment, status, direction, tmp_path):
    (tmp_path / "local.img").write_bytes(random_bytes(2 * BLOCK))
    before = snapshot(tmp_path)
    url, local = f"{error_server}/file.img", str(tmp_path / "local.img")
    args = (url, str(tmp_path / "new.img")) if direction == "pull" else (local, url)
    completed = cli("--timeout", "20", *args)
    assert_fails(completed, status, fragment)
    assert completed.seconds < 15
    assert snapshot(tmp_path) == before


def test_garbage_speaking_server(tmp_path):
    """Something that is not HTTP at all listens on the port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def serve():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            with connection:
                connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        before = snapshot(tmp_path)
        completed = cli("--timeout", "20", f"http://127.0.0.1:{listener.getsockname()[1]}/f.img",
                        str(tmp_path / "new.img"))
        assert_fails(completed, RemoteDataError.exit_code, "127.0.0.1")
        assert completed.seconds < 15
        assert snapshot(tmp_path) == before
    finally:
        stop.set()
        thread.join()
        listener.close()


# -- tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", TOKEN[:-1]],
                         ids=["missing", "wrong", "longer", "shorter"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_wrong_or_missing_token(token_server, tmp_path, unique, direction, token):
    remote = token_server.root / unique
    local = tmp_path / "local.img"
    if direction == "pull":
        remote.write_bytes(random_bytes(3 * BLOCK))
        args = (token_server.url(unique), str(local))
    else:
        local.write_bytes(random_bytes(3 * BLOCK))
        remote.write_bytes(random_bytes(3 * BLOCK, seed=4))
        args = (str(local), token_server.url(unique))
    before = snapshot(tmp_path, token_server.root)
    env = {"PDIFFCOPY_TOKEN": token} if token else None
    completed = cli("-b", str(BLOCK), *args, env_extra=env)
    message = assert_fails(completed, 5, "token")
    assert TOKEN not in message
    assert snapshot(tmp_path, token_server.root) == before


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_right_token_from_environment_works(token_server, tmp_path, unique, direction):
    data = random_bytes(5 * BLOCK + 3, seed=11)
    remote, local = token_server.root / unique, tmp_path / "local.img"
    if direction == "pull":
        remote.write_bytes(data)
        args = (token_server.url(unique), str(local))
    else:
        local.write_bytes(data)
        args = (str(local), token_server.url(unique))
    completed = cli("-b", str(BLOCK), *args, env_extra={"PDIFFCOPY_TOKEN": TOKEN})
    assert completed.returncode == 0, completed.stderr
    assert "Traceback" not in completed.stderr
    assert (local if direction == "pull" else remote).read_bytes() == data


def test_right_token_from_file_works(token_server, tmp_path, unique):
    data = random_bytes(2 * BLOCK, seed=12)
    (token_server.root / unique).write_bytes(data)
    (tmp_path / "token").write_text(TOKEN + "\n")
    completed = cli("--token-file", str(tmp_path / "token"), token_server.url(unique),
                    str(tmp_path / "local.img"))
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "local.img").read_bytes() == data


def test_missing_token_file(token_server, tmp_path, unique):
    (token_server.root / unique).write_bytes(b"data")
    completed = cli("--token-file", str(tmp_path / "nope"), token_server.url(unique),
                    str(tmp_path / "local.img"))
    assert_fails(completed, 1, "token file", "nope")
    assert not (tmp_path / "local.img").exists()


@pytest.mark.parametrize("authorization",
                         [None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x"])
def test_raw_request_without_the_token_is_refused(token_server, unique, authorization):
    (token_server.root / unique).write_bytes(b"secret data")
    headers = {"Authorization": authorization} if authorization else {}
    for method, target in (("GET", f"/{unique}"), ("GET", f"/.pdiffcopy/stat/{unique}"),
                           ("POST", f"/.pdiffcopy/resize/{unique}?size=0")):
        status, response_headers, body = raw_request(token_server.port, method, target, headers)
        message = assert_json_error(status, response_headers, body, 401)
        assert "token" in message.lower()
        assert b"secret data" not in body
    assert (token_server.root / unique).read_bytes() == b"secret data"
    status, _, body = raw_request(token_server.port, "GET", f"/{unique}", token=TOKEN)
    assert (status, body) == (200, b"secret data")


# -- paths outside the root -------------------------------------------------------------------


@pytest.fixture
def outside(server, unique):
    """A file and a directory next to (outside) the server's root, and symlinks to them inside."""
    parent = server.root.parent
    outside_file = parent / f"outside-{unique}"
    outside_file.write_bytes(b"must not change " * 100)
    outside_dir = parent / f"outside-dir-{unique}"
    outside_dir.mkdir()
    (server.root / f"link-{unique}").symlink_to(outside_file)
    (server.root / f"linkdir-{unique}").symlink_to(outside_dir, target_is_directory=True)
    names = {
        "dotdot": f"../outside-{unique}",
        "encoded": f"%2e%2e/outside-{unique}",
        "encoded-upper": f"%2E%2E/outside-{unique}",
        "nested": f"linkdir-{unique}/../../outside-{unique}",
        "symlink": f"link-{unique}",
        "symlinked-dir": f"linkdir-{unique}/new-{unique}",
        "dotdot-new": f"../new-{unique}",
    }
    yield parent, outside_file, outside_dir, names
    for path in (outside_file, parent / f"new-{unique}", outside_dir / f"new-{unique}",
                 server.root / f"link-{unique}", server.root / f"linkdir-{unique}"):
        if os.path.lexists(path):
            path.unlink()
    outside_dir.rmdir()


OUTSIDE_KINDS = ["dotdot", "encoded", "encoded-upper", "symlink", "symlinked-dir", "dotdot-new"]


def outside_state(parent: Path, unique: str) -> dict:
    """The entries next to the root that the ``outside`` fixture made (or that must not appear)."""
    state = {name: sorted(os.listdir(parent / name)) for name in (f"outside-dir-{unique}",)}
    for name in (f"outside-{unique}", f"new-{unique}"):
        path = parent / name
        state[name] = (path.read_bytes(), os.stat(path).st_mtime_ns) if path.exists() else None
    return state


@pytest.mark.parametrize("kind", OUTSIDE_KINDS)
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_client_path_outside_root(server, tmp_path, unique, outside, direction, kind):
    parent, outside_file, outside_dir, names = outside
    if direction == "pull" and kind in ("symlinked-dir", "dotdot-new"):
        pytest.skip("nothing to pull: these name files that do not exist")
    url = f"{server.base}/{names[kind]}"
    local = tmp_path / "local.img"
    if direction == "push":
        local.write_bytes(random_bytes(2 * BLOCK, seed=21))
    before_outside = outside_state(parent, unique)
    before_local = snapshot(tmp_path)
    args = (url, str(local)) if direction == "pull" else (str(local), url)
    completed = cli("-b", str(BLOCK), *args)
    assert_fails(completed, 3, "outside the root")
    assert outside_state(parent, unique) == before_outside
    assert outside_file.read_bytes() == b"must not change " * 100
    assert list(outside_dir.iterdir()) == []
    assert snapshot(tmp_path) == before_local


ENDPOINTS = {
    "GET": ("GET", "/{path}", {}, None),
    "HEAD": ("HEAD", "/{path}", {}, None),
    "GET-range": ("GET", "/{path}", {"Range": "bytes=0-9"}, None),
    "PATCH": ("PATCH", "/{path}",
              {"Content-Range": "bytes 0-4/*", "Content-Type": "application/octet-stream"},
              b"EVIL!"),
    "hashes": ("GET", "/.pdiffcopy/hashes/{path}?method=md5&block_size=1024&offset=0&length=1024",
               {}, None),
    "stat": ("GET", "/.pdiffcopy/stat/{path}", {}, None),
    "resize": ("POST", "/.pdiffcopy/resize/{path}?size=4096", {}, None),
    "resize-shrink": ("POST", "/.pdiffcopy/resize/{path}?size=0", {}, None),
    "fsync": ("POST", "/.pdiffcopy/fsync/{path}", {}, None),
    "datamap": ("GET", "/.pdiffcopy/datamap/{path}?offset=0&length=1024", {}, None),
    "punch": ("POST", "/.pdiffcopy/punch/{path}", {"Content-Type": "application/octet-stream"},
              b"\0" * 8 + b"\4" + b"\0" * 7),
}


@pytest.mark.parametrize("kind", OUTSIDE_KINDS + ["nested"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_raw_request_outside_root(server, unique, outside, endpoint, kind):
    parent, outside_file, outside_dir, names = outside
    method, template, headers, body = ENDPOINTS[endpoint]
    before = outside_state(parent, unique)
    status, response_headers, answer = raw_request(
        server.port, method, template.format(path=names[kind]), headers, body)
    if method == "HEAD":
        assert status == 403, status
    else:
        message = assert_json_error(status, response_headers, answer, 403)
        assert "outside the root" in message.lower()
    assert b"must not change" not in answer
    assert outside_state(parent, unique) == before
    assert outside_file.read_bytes() == b"must not change " * 100
    assert list(outside_dir.iterdir()) == []
    assert not (parent / f"new-{unique}").exists()


@pytest.mark.parametrize("endpoint", ["GET", "stat", "resize"])
def test_raw_request_absolute_path_stays_inside(server, unique, outside, endpoint):
    """``//abs/path`` must never reach the file at /abs/path."""
    parent, outside_file, _, _ = outside
    method, template, headers, body = ENDPOINTS[endpoint]
    before = outside_state(parent, unique)
    status, response_headers, answer = raw_request(
        server.port, method, template.format(path=str(outside_file)), headers, body)
    assert_json_error(status, response_headers, answer, (403, 404, 405))
    assert b"must not change" not in answer
    assert outside_state(parent, unique) == before


# -- malformed requests ---------------------------------------------------------------------

FILE_SIZE = 10 * 1024 + 5

#: The hash endpoint, with its query string to be completed.
HASHES = "/.pdiffcopy/hashes/{f}?"
#: A multipart PATCH body's Content-Type.
MULTIPART = {"Content-Type": "multipart/byteranges; boundary=xyz"}
#: 5000 digits: past the 4300 that int() converts, yet within a header's 8 KiB.
HUGE = "9" * 5000

MALFORMED = [
    # Range headers
    ("range-not-a-number", "GET", "/{f}", {"Range": "bytes=abc"}, None, 400),
    ("range-backwards", "GET", "/{f}", {"Range": "bytes=5-2"}, None, 400),
    # (an unknown unit such as items=0-1 is ignored, not refused: test_http_standards.py)
    ("range-empty", "GET", "/{f}", {"Range": "bytes="}, None, 400),
    ("range-dashes", "GET", "/{f}", {"Range": "bytes=--"}, None, 400),
    ("range-three-parts", "GET", "/{f}", {"Range": "bytes=1-2-3"}, None, 400),
    ("range-empty-item", "GET", "/{f}", {"Range": "bytes=0-1,,4-5"}, None, 400),
    ("range-negative-start", "GET", "/{f}", {"Range": "bytes=-5-10"}, None, 400),
    ("range-superscript", "GET", "/{f}", {"Range": "bytes=\u00b2-5"}, None, 400),
    ("range-past-end", "GET", "/{f}", {"Range": f"bytes={FILE_SIZE}-"}, None, 416),
    ("range-far-past-end", "GET", "/{f}", {"Range": "bytes=99999999-99999999999"}, None, 416),
    ("range-empty-suffix", "GET", "/{f}", {"Range": "bytes=-0"}, None, 416),
    ("range-huge-number", "GET", "/{f}", {"Range": f"bytes={HUGE}-"}, None, (400, 416)),
    ("range-huge-suffix", "GET", "/{f}", {"Range": f"bytes=0-0,-{HUGE}"}, None, (400, 416)),
    # hash requests
    ("hashes-block-size-abc", "GET", HASHES + "method=md5&block_size=abc&offset=0&length=1024",
     {}, None, 400),
    ("hashes-block-size-zero", "GET", HASHES + "method=md5&block_size=0&offset=0&length=1024",
     {}, None, 400),
    ("hashes-block-size-tiny", "GET", HASHES + "method=md5&block_size=512&offset=0&length=1024",
     {}, None, 400),
    ("hashes-block-size-huge", "GET",
     HASHES + "method=md5&block_size=99999999999999&offset=0&length=1024", {}, None, 400),
    ("hashes-negative-offset", "GET",
     HASHES + "method=md5&block_size=1024&offset=-1024&length=1024", {}, None, 400),
    ("hashes-unaligned-offset", "GET",
     HASHES + "method=md5&block_size=1024&offset=100&length=1024", {}, None, 400),
    ("hashes-offset-past-end", "GET",
     HASHES + "method=md5&block_size=1024&offset=1048576&length=1024", {}, None, 416),
    ("hashes-negative-length", "GET", HASHES + "method=md5&block_size=1024&offset=0&length=-1",
     {}, None, 400),
    ("hashes-float-length", "GET", HASHES + "method=md5&block_size=1024&offset=0&length=1.5",
     {}, None, 400),
    ("hashes-huge-length", "GET",
     HASHES + "method=md5&block_size=1024&offset=0&length=99999999999999999999999", {}, None, 400),
    ("hashes-superscript-offset", "GET",
     HASHES + "method=md5&block_size=1024&offset=%C2%B2&length=1024", {}, None, 400),
    ("hashes-circled-length", "GET",
     HASHES + "method=md5&block_size=1024&offset=0&length=%E2%91%A0", {}, None, 400),
    ("hashes-unknown-method", "GET",
     HASHES + "method=nosuch&block_size=1024&offset=0&length=1024", {}, None, 400),
    ("hashes-no-method", "GET", HASHES + "block_size=1024&offset=0&length=1024", {}, None, 400),
    ("hashes-no-parameters", "GET", "/.pdiffcopy/hashes/{f}", {}, None, 400),
    # hash requests for several ranges (a Range header)
    ("hashes-range-open", "GET", HASHES + "method=md5&block_size=1024",
     {"Range": "bytes=0-"}, None, 400),
    ("hashes-range-suffix", "GET", HASHES + "method=md5&block_size=1024",
     {"Range": "bytes=-100"}, None, 400),
    ("hashes-range-unaligned", "GET", HASHES + "method=md5&block_size=1024",
     {"Range": "bytes=0-1023,100-2000"}, None, 400),
    ("hashes-range-backwards", "GET", HASHES + "method=md5&block_size=1024",
     {"Range": "bytes=2048-1024"}, None, 400),
    ("hashes-range-garbage", "GET", HASHES + "method=md5&block_size=1024",
     {"Range": "bytes=a-b"}, None, 400),
    ("hashes-range-past-end", "GET", HASHES + "method=md5&block_size=1024",
     {"Range": "bytes=0-1023,1048576-1049599"}, None, 416),
    ("hashes-range-too-long", "GET", HASHES + "method=md5&block_size=1024",
     {"Range": "bytes=0-4294967295"}, None, 400),
    ("hashes-range-huge-number", "GET", HASHES + "method=md5&block_size=1024",
     {"Range": f"bytes=0-{HUGE}"}, None, 400),
    # resize
    ("resize-no-size", "POST", "/.pdiffcopy/resize/{f}", {}, None, 400),
    ("resize-size-abc", "POST", "/.pdiffcopy/resize/{f}?size=abc", {}, None, 400),
    ("resize-negative", "POST", "/.pdiffcopy/resize/{f}?size=-1", {}, None, 400),
    ("resize-absurd", "POST", "/.pdiffcopy/resize/{f}?size=9999999999999999999", {}, None, 400),
    ("resize-superscript", "POST", "/.pdiffcopy/resize/{f}?size=%C2%B9%C2%B2", {}, None, 400),
    # PATCH
    ("patch-no-content-range", "PATCH", "/{f}", {"Content-Type": "application/octet-stream"},
     b"abc", 400),
    ("patch-garbage-content-range", "PATCH", "/{f}", {"Content-Range": "garbage"}, b"abc", 400),
    ("patch-backwards-content-range", "PATCH", "/{f}", {"Content-Range": "bytes 5-3/*"},
     b"abc", 400),
    ("patch-length-mismatch", "PATCH", "/{f}", {"Content-Range": "bytes 0-9/*"}, b"abc", 400),
    ("patch-straddling-end", "PATCH", "/{f}",
     {"Content-Range": f"bytes {FILE_SIZE - 1}-{FILE_SIZE + 1}/*"}, b"abc", 416),
    ("patch-at-end", "PATCH", "/{f}", {"Content-Range": f"bytes {FILE_SIZE}-{FILE_SIZE + 2}/*"},
     b"abc", 416),
    ("patch-far-beyond-end", "PATCH", "/{f}",
     {"Content-Range": "bytes 1099511627776-1099511627778/*"}, b"abc", 416),
    ("patch-huge-content-range", "PATCH", "/{f}", {"Content-Range": f"bytes 0-{HUGE}/*"},
     b"abc", (400, 416)),
    ("patch-multipart-huge-content-range", "PATCH", "/{f}", MULTIPART,
     b"\r\n--xyz\r\nContent-Range: bytes 0-" + b"9" * 1000 + b"/*\r\n\r\nabc\r\n--xyz--\r\n",
     (400, 416)),
    ("patch-multipart-no-boundary", "PATCH", "/{f}", {"Content-Type": "multipart/byteranges"},
     b"abc", 400),
    ("patch-multipart-garbage", "PATCH", "/{f}", MULTIPART, b"this is not multipart\r\n", 400),
    ("patch-multipart-truncated", "PATCH", "/{f}", MULTIPART,
     b"\r\n--xyz\r\nContent-Range: bytes 0-2/*\r\n", 400),
    ("patch-multipart-no-content-range", "PATCH", "/{f}", MULTIPART,
     b"\r\n--xyz\r\nContent-Type: application/octet-stream\r\n\r\nabc\r\n--xyz--\r\n", 400),
    ("patch-multipart-beyond-end", "PATCH", "/{f}", MULTIPART,
     f"\r\n--xyz\r\nContent-Range: bytes {FILE_SIZE}-{FILE_SIZE + 2}/*\r\n\r\nabc\r\n--xyz--\r\n"
     .encode(), 416),
    # other
    ("stat-missing", "GET", "/.pdiffcopy/stat/{f}.missing", {}, None, 404),
    ("get-missing", "GET", "/{f}.missing", {}, None, 404),
    ("patch-missing", "PATCH", "/{f}.missing", {"Content-Range": "bytes 0-2/*"}, b"abc", 404),
    ("nul-byte", "GET", "/{f}%00x", {}, None, 400),
    ("reserved-name", "GET", "/.pdiffcopy/no-such-endpoint/{f}", {}, None, (403, 404)),
    ("method-not-allowed", "DELETE", "/{f}", {}, None, 405),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[case[0] for case in MALFORMED])
def test_malformed_request(server, unique, case):
    _, method, template, headers, body, expected = case
    path = server.root / unique
    data = random_bytes(FILE_SIZE, seed=31)
    path.write_bytes(data)
    names_before, stat_before = sorted(os.listdir(server.root)), os.stat(path)
    status, response_headers, answer = raw_request(server.port, method, template.format(f=unique),
                                                   headers, body)
    assert status != 500, answer
    assert_json_error(status, response_headers, answer, expected)
    assert sorted(os.listdir(server.root)) == names_before
    assert os.stat(path).st_mtime_ns == stat_before.st_mtime_ns
    assert path.read_bytes() == data


@pytest.mark.parametrize("announced,sent",
                         [(100, 50), (100, 0), (3 * 1024 * 1024, 1024 * 1024 + 7)])
def test_patch_with_short_body(server, unique, announced, sent):
    """The client sends less than its Content-Length and then stops sending."""
    path = server.root / unique
    data = random_bytes(4 * 1024 * 1024, seed=32)
    path.write_bytes(data)
    offset = 1000
    head = (f"PATCH /{unique} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Type: application/octet-stream\r\n"
            f"Content-Range: bytes {offset}-{offset + announced - 1}/*\r\n"
            f"Content-Length: {announced}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(head + b"Z" * sent)
        connection.shutdown(socket.SHUT_WR)
        answer = b""
        while True:
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    status = int(status_line.split()[1])
    header_block, _, body = rest.partition(b"\r\n\r\n")
    headers = http.client.parse_headers(io.BytesIO(header_block + b"\r\n\r\n"))
    assert status != 500
    assert_json_error(status, headers, body, 400)
    after = path.read_bytes()
    assert len(after) == len(data), "the file's size changed"
    # Nothing outside the announced range may change.
    assert after[:offset] == data[:offset]
    assert after[offset + announced :] == data[offset + announced :]


# -- a server that dies mid-transfer ------------------------------------------------------

BIG = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def big_data():
    return os.urandom(BIG)


def _first_block_written(directory: Path) -> bool:
    """Whether a hidden temporary below ``directory`` already has transferred data."""
    for name in temporaries(directory):
        try:
            with open(directory / name, "rb") as handle:
                if handle.read(4096).strip(b"\0"):
                    return True
        except FileNotFoundError:
            pass
    return False


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_server_killed_mid_transfer(tmp_path, big_data, direction):
    root, local_dir = tmp_path / "root", tmp_path / "local"
    root.mkdir()
    local_dir.mkdir()
    server = start_server(root, tmp_path / "server.log")
    try:
        if direction == "pull":
            (root / "big.img").write_bytes(big_data)
            args = (server.url("big.img"), str(local_dir / "big.img"))
            watched, target = local_dir, local_dir / "big.img"
        else:
            (local_dir / "big.img").write_bytes(big_data)
            args = (str(local_dir / "big.img"), server.url("big.img"))
            watched, target = root, root / "big.img"
        env = dict(os.environ)
        env.pop("PDIFFCOPY_TOKEN", None)
        started = time.monotonic()
        client = subprocess.Popen(pdiffcopy_command("-c", "1", "--timeout", "30", *args),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env)
        killed = False
        while client.poll() is None and time.monotonic() - started < 60:
            if _first_block_written(watched):
                os.killpg(server.process.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.001)
        try:
            _, stderr = client.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            client.kill()
            client.communicate()
            pytest.fail("the client did not give up within 30 s of the server's death")
        elapsed = time.monotonic() - started
        assert killed, f"the transfer finished before the server could be killed: {stderr}"
        assert client.returncode == RemoteError.exit_code, stderr
        error_message(stderr)
        assert elapsed < 30
        assert not target.exists(), "a half-written target appeared under its name"
        if direction == "pull":
            assert temporaries(local_dir) == [], "the temporary file was left behind"
        assert [p.name for p in local_dir.iterdir() if not p.name.startswith(".")] == \
            (["big.img"] if direction == "push" else [])
    finally:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


# -- starting and stopping the server ----------------------------------------------------


@pytest.mark.parametrize("address", ["0.0.0.0", "[::]"])
def test_public_listen_without_token_is_refused(tmp_path, address):
    port = free_port()
    completed = cli("--root", str(tmp_path), "--listen", f"{address}:{port}", timeout=30)
    assert_fails(completed, 1, "token", "--insecure")
    assert port_is_closed(port)


def test_insecure_lifts_the_refusal(tmp_path):
    (tmp_path / "file.img").write_bytes(b"hello")
    port = free_port()
    env = dict(os.environ)
    env.pop("PDIFFCOPY_TOKEN", None)
    with open(tmp_path / "server.log", "wb") as log:
        process = subprocess.Popen(
            pdiffcopy_command("--root", str(tmp_path), "--listen", f"0.0.0.0:{port}", "--insecure",
                              "-c", "1"),
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_port(port, process)
        status, _, body = raw_request(port, "GET", "/file.img")
        assert (status, body) == (200, b"hello")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert "Traceback" not in (tmp_path / "server.log").read_text()


@pytest.mark.parametrize("root", ["missing", "file"])
def test_server_with_bad_root(tmp_path, root):
    path = tmp_path / "no-such-dir"
    if root == "file":
        path = tmp_path / "a-file"
        path.write_bytes(b"x")
    port = free_port()
    completed = cli("--root", str(path), "--listen", f"127.0.0.1:{port}", timeout=30)
    assert_fails(completed, 1, "root", str(path))
    assert port_is_closed(port)
    assert not (tmp_path / "no-such-dir").exists()


@pytest.mark.parametrize("listen", ["127.0.0.1:notaport", "127.0.0.1:70000", "::1:80", "[::1]80"])
def test_server_with_bad_listen_address(tmp_path, listen):
    completed = cli("--root", str(tmp_path), "--listen", listen, timeout=30)
    assert_fails(completed, 1, "listen address")


@pytest.mark.parametrize("signal_number,to_group", [
    (signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True),
], ids=["SIGTERM", "SIGINT", "SIGINT-to-group"])
def test_server_stops_on_signal(tmp_path, unique, signal_number, to_group):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / unique).write_bytes(b"data")
    server = start_server(tmp_path / "root", tmp_path / "server.log")
    session = server.process.pid  # started with start_new_session: the pid is the session id
    try:
        status, _, body = raw_request(server.port, "GET", f"/{unique}")
        assert (status, body) == (200, b"data")
        assert len(session_processes(session)) >= 2, "expected a master and its workers"
        if to_group:
            os.killpg(session, signal_number)  # what Ctrl-C in a terminal does
        else:
            server.process.send_signal(signal_number)
        returncode = server.process.wait(timeout=20)
        assert returncode == 0
        deadline = time.monotonic() + 10
        while session_processes(session) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_processes(session) == [], "processes of the server outlived it"
        assert port_is_closed(server.port)
    finally:
        if server.process.poll() is None:
            os.killpg(session, signal.SIGKILL)
            server.process.wait()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log

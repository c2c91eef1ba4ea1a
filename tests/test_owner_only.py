"""A server started without a token serves its own user and root, nobody else (issue 38, item 1).

Loopback is not a trust boundary on a multi-user host: any local user can
connect to 127.0.0.1. The tests try, as another uid, what a token-less
server would let them do: read a 0600 file, list a tree, replace a file,
and 1.0.1's API; on 127.0.0.1 and on [::1]. The other user is a forked
child that dropped to ``nobody`` (setresuid, no groups) and then uses the
real HTTP client and plain HTTP requests, as setpriv would run them.
"""

from __future__ import annotations

import http.client
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import START_TIMEOUT, Server, free_port, pdiffcopy_command, run_cli, start_server

from test_legacy_api import needs_original, run_original

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def as_user(uid: int, work, *args):
    """Run ``work(*args)`` in a forked child that dropped to ``uid`` (no groups); return its result."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 0
        try:
            os.close(reader)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            try:
                result = ("ok", work(*args))
            except BaseException as error:  # noqa: B036 - the parent judges it
                result = ("error", f"{type(error).__name__}: {error}")
            with os.fdopen(writer, "wb") as handle:
                pickle.dump(result, handle)
        except BaseException:  # noqa: B036
            status = 1
        os._exit(status)
    os.close(writer)
    with os.fdopen(reader, "rb") as handle:
        data = handle.read()
    os.waitpid(pid, 0)
    assert data, "the child acting as another user died"
    return pickle.loads(data)


def plain_request(host: str, port: int, method: str, path: str, body: bytes = None, headers=None):
    """(status, body) of one request."""
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def start_server_on(root: Path, log: Path, host: str, extra=()) -> Server:
    """A token-less server on ``host`` (``::1`` or ``127.0.0.1``)."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "PDIFFCOPY_TOKEN"}
    shown = f"[{host}]" if ":" in host else host
    handle = open(log, "wb")
    process = subprocess.Popen([*pdiffcopy_command("--root", str(root), "--listen", f"{shown}:{port}",
                                                   "-c", "2", *extra)],
                               stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(root=root, port=port, process=process, log=log)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log.read_text()}")
        try:
            with socket.socket(family) as probe:
                probe.settimeout(0.5)
                probe.connect((host, port))
                return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"server did not start: {log.read_text()}")


def make_root(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "secret").write_bytes(b"root's secret\n")
    os.chmod(root / "secret", 0o600)
    (root / "tree").mkdir()
    (root / "tree" / "a.txt").write_bytes(b"a" * 1000)
    return root


@pytest.fixture(scope="module", params=["127.0.0.1", "::1"])
def lone_server(request, tmp_path_factory):
    if request.param == "::1" and not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    root = make_root(tmp_path_factory.mktemp("owner-only-root"))
    running = start_server_on(root, tmp_path_factory.mktemp("owner-only-log") / "server.log", request.param,
                              extra=("--legacy-api",))
    running.host = request.param  # type: ignore[attr-defined]
    yield running
    running.stop()


def url_of(server, name: str) -> str:
    host = f"[{server.host}]" if ":" in server.host else server.host
    return f"http://{host}:{server.port}/{name}"


@pytest.fixture
def shared_tmp():
    """A directory below /tmp that other users may enter (pytest's own are 0700)."""
    place = Path(tempfile.mkdtemp(prefix="pdiffcopy-owner-only-"))
    os.chmod(place, 0o755)
    yield place
    shutil.rmtree(place, ignore_errors=True)


def a_place_for(uid: int, shared: Path) -> Path:
    """A directory the other user may read and write."""
    place = shared / "theirs"
    place.mkdir()
    os.chown(place, uid, uid)
    return place


@needs_root
def test_another_user_cannot_read_a_file(lone_server):
    status, body = as_user(NOBODY, lambda: plain_request(lone_server.host, lone_server.port, "GET", "/secret"))[1]
    assert status == 403
    assert b"root's secret" not in body
    assert b"own user" in body  # the refusal says why


@needs_root
def test_another_user_cannot_read_through_the_api_or_list(lone_server):
    for path in ("/.pdiffcopy/stat/secret", "/.pdiffcopy/openapi.json", "/.pdiffcopy/metrics",
                 "/.pdiffcopy/tree/tree", "/info?filename=" + str(lone_server.root / "secret")):
        kind, (status, body) = as_user(NOBODY, plain_request, lone_server.host, lone_server.port, "GET", path)
        assert kind == "ok"
        assert status == 403, (path, status, body[:200])
        assert b"a.txt" not in body and b"root's secret" not in body


@needs_root
def test_another_user_cannot_pull_a_file_or_a_tree(lone_server, shared_tmp):
    from pdiffcopy.api import sync, sync_tree

    # As root first: the modules a sync imports on its way are then loaded (the other user
    # could not read this interpreter's library).
    sync(url_of(lone_server, "secret"), str(shared_tmp / "warm-up"))
    sync_tree(url_of(lone_server, "tree/"), str(shared_tmp / "warm-up-tree"))
    place = a_place_for(NOBODY, shared_tmp)
    kind, message = as_user(NOBODY, sync, url_of(lone_server, "secret"), str(place / "stolen"))
    assert kind == "error" and "own user" in message
    kind, message = as_user(NOBODY, sync_tree, url_of(lone_server, "tree/"), str(place / "tree"))
    assert kind == "error"
    assert os.listdir(place) == [] or not any((place / "tree").rglob("a.txt"))


@needs_root
def test_another_user_cannot_replace_a_file(lone_server, shared_tmp):
    from pdiffcopy.api import sync

    place = a_place_for(NOBODY, shared_tmp)
    mine = place / "mine.txt"
    mine.write_bytes(b"nobody's version\n")
    sync(str(mine), url_of(lone_server, "scratch"))  # as root: see above
    kind, message = as_user(NOBODY, sync, str(mine), url_of(lone_server, "secret"))
    assert kind == "error" and "own user" in message
    assert (lone_server.root / "secret").read_bytes() == b"root's secret\n"
    status, _ = as_user(NOBODY, plain_request, lone_server.host, lone_server.port, "POST",
                        "/.pdiffcopy/resize/secret?size=0")[1]
    assert status == 403
    assert (lone_server.root / "secret").read_bytes() == b"root's secret\n"


@needs_root
def test_the_owner_needs_no_token(lone_server, tmp_path):
    target = tmp_path / "copy"
    done = run_cli(url_of(lone_server, "secret"), str(target))
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == b"root's secret\n"


def test_a_user_reaches_their_own_server(tmp_path):
    """As whoever runs the tests (root or not): their own token-less server serves them."""
    root = make_root(tmp_path / "root")
    running = start_server(root, tmp_path / "server.log")
    try:
        status, body = plain_request("127.0.0.1", running.port, "GET", "/secret")
        assert status == 200 and body == b"root's secret\n"
    finally:
        running.stop()


@needs_root
def test_a_server_run_by_another_user_refuses_root_s_neighbours(shared_tmp, tmp_path):
    """A non-root owner: the owner and root get in, a third user does not."""
    owner, third = NOBODY, NOBODY - 1  # nobody and (on Debian) nogroup's uid are both unused for logins
    root = shared_tmp / "owned"
    make_root(root)
    for path in [root, *root.rglob("*")]:
        os.chown(path, owner, owner)
    port = free_port()
    log = tmp_path / "server.log"
    env = {key: value for key, value in os.environ.items() if key != "PDIFFCOPY_TOKEN"}
    command = ["setpriv", f"--reuid={owner}", f"--regid={owner}", "--clear-groups",
               *pdiffcopy_command("--root", str(root), "--listen", f"127.0.0.1:{port}", "-c", "1")]
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    running = Server(root=root, port=port, process=process, log=log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                pytest.skip(f"cannot run the server as uid {owner} here: {log.read_text()[-300:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        assert as_user(owner, plain_request, "127.0.0.1", port, "GET", "/secret")[1][0] == 200
        assert plain_request("127.0.0.1", port, "GET", "/secret")[0] == 200  # root
        assert as_user(third, plain_request, "127.0.0.1", port, "GET", "/secret")[1][0] == 403
    finally:
        running.stop()


@needs_root
def test_insecure_serves_everyone_and_says_so(tmp_path):
    root = make_root(tmp_path / "root")
    running = start_server(root, tmp_path / "server.log", extra=("--insecure",))
    try:
        assert as_user(NOBODY, plain_request, "127.0.0.1", running.port, "GET", "/secret")[1][0] == 200
        assert "every local user" in running.log.read_text()
    finally:
        running.stop()


@needs_root
def test_a_token_server_still_serves_any_user_with_the_token(token_server):
    (token_server.root / "shared").write_bytes(b"shared\n")
    headers = {"Authorization": f"Bearer {token_server.token}"}
    status, body = as_user(NOBODY, plain_request, "127.0.0.1", token_server.port, "GET", "/shared",
                           None, headers)[1]
    assert (status, body) == (200, b"shared\n")


@needs_original
def test_an_old_client_as_the_owner_still_syncs(lone_server, tmp_path):
    if ":" in lone_server.host:
        pytest.skip("1.0.1's client cannot parse an IPv6 URL")
    target = tmp_path / "secret"
    done = run_original(url_of(lone_server, "")[:-1] + f"{lone_server.root}/secret", str(target), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == b"root's secret\n"


@needs_root
def test_an_old_client_as_another_user_is_refused(lone_server):
    query = "/info?filename=" + str(lone_server.root / "secret")
    kind, (status, body) = as_user(NOBODY, plain_request, lone_server.host, lone_server.port, "GET", query)
    assert status == 403 and b"size" not in body


def test_the_peer_lookup_names_the_owner_of_each_end():
    """Both ways of asking the kernel (sock_diag, then /proc/net) name the connecting socket's uid."""
    from pdiffcopy.local import peers

    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        if family == socket.AF_INET6 and not ipv6_loopback():
            continue
        with socket.socket(family) as listener:
            listener.bind((host, 0))
            listener.listen(1)
            client = socket.socket(family)
            client.connect(listener.getsockname()[:2])
            accepted, _ = listener.accept()
            with accepted:
                assert peers.peer_uid(accepted) == os.geteuid()
                assert peers.peer_uid_from_proc(accepted.getsockname(), accepted.getpeername(),
                                                family) == os.geteuid()
                # Once the peer closed its end, the kernel keeps no owner for it (it says uid 0,
                # root, with no inode): nobody is named, or a closed connection would pass for root.
                client.close()
                time.sleep(0.05)
                assert peers.peer_uid(accepted) is None
                assert peers.peer_uid_from_proc(accepted.getsockname(), accepted.getpeername(), family) is None
    left, right = socket.socketpair()
    with left, right:
        assert peers.peer_uid(left) == os.geteuid()
    assert sys.platform.startswith("linux")

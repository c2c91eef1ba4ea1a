"""A killed client's write lease ends with its connections (issue 38).

An in-place push takes the server's write lease on its target. A client killed with
``kill -9`` never ends it; the server sees its connections close, and the next run must
not be refused for the minute the lease would otherwise live. A lease whose holder is
still connected keeps others out, and the refusal says how long to wait.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import pdiffcopy_command, random_bytes, run_cli, start_server

MIB = 1024 * 1024

#: Big enough that a push at --bwlimit 16M is still writing a few seconds after it starts.
SIZE = 96 * MIB


@pytest.fixture
def lease_server(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    running = start_server(root, tmp_path / "server.log")
    yield running
    running.stop()


def live_leases(server) -> int:
    """How many live-looking lease records the server's lease directory holds."""
    count = 0
    for parent in ("/dev/shm", "/tmp"):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if name.startswith(f"pdiffcopy-leases-{server.process.pid}-"):
                directory = Path(parent, name)
                for record in directory.iterdir():
                    try:
                        count += b'"id"' in record.read_bytes()
                    except OSError:
                        pass
    return count


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_push(source: Path, url: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("PDIFFCOPY_TOKEN", None)
    return subprocess.Popen(pdiffcopy_command(str(source), url, "-c", "2", *extra), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def test_a_killed_in_place_push_does_not_lock_out_the_rerun(lease_server, tmp_path):
    target = lease_server.root / "disk.img"
    target.write_bytes(random_bytes(SIZE, seed=1))
    source = tmp_path / "disk.img"
    data = random_bytes(SIZE, seed=2)
    source.write_bytes(data)
    url = lease_server.url("disk.img")
    push = start_push(source, url, "--bwlimit", "16M")
    try:
        wait_for(lambda: live_leases(lease_server) or push.poll() is not None, 30, "the push's lease")
        # Mid-transfer: its first changed bytes are on the server.
        with open(target, "rb") as handle:
            wait_for(lambda: handle.seek(0) == 0 and handle.read(MIB) == data[:MIB] or push.poll() is not None,
                     30, "the push to write")
        assert push.poll() is None, push.stderr.read().decode()
        os.killpg(push.pid, signal.SIGKILL)
        push.wait()
    finally:
        if push.poll() is None:
            os.killpg(push.pid, signal.SIGKILL)
            push.wait()
    assert target.read_bytes() != data  # killed before the end
    started = time.monotonic()
    rerun = run_cli(str(source), url, "-c", "2")
    took = time.monotonic() - started
    assert rerun.returncode == 0, rerun.stderr
    assert target.read_bytes() == data
    # Not the lease's minute: the rerun's own sync (1 to 2 s here) and at most the wait for a
    # failing write of the killed run (leases.DEAD_HOLDER_WAIT_SECONDS), with room for a busy machine.
    assert took < 10, took
    assert "Locked" not in rerun.stderr and "lease" not in rerun.stderr


def test_a_connected_holders_lease_holds_and_the_refusal_says_how_long(lease_server, tmp_path):
    target = lease_server.root / "disk.img"
    target.write_bytes(random_bytes(4 * MIB, seed=1))
    source = tmp_path / "disk.img"
    source.write_bytes(random_bytes(4 * MIB, seed=2))
    holder = http.client.HTTPConnection("127.0.0.1", lease_server.port, timeout=10)
    try:
        holder.request("POST", "/.pdiffcopy/lease/disk.img")
        answer = holder.getresponse()
        assert answer.status == 200, answer.read()
        answer.read()  # the connection stays open: the holder is alive
        refused = run_cli(str(source), lease_server.url("disk.img"), "-c", "2")
        assert refused.returncode != 0
        message = refused.stderr.strip().splitlines()[-1]
        assert "Traceback" not in refused.stderr
        assert re.search(r"within \d+ s", message), message
        # A write without the lease is refused too, and says so as well.
        holder_free = http.client.HTTPConnection("127.0.0.1", lease_server.port, timeout=10)
        holder_free.request("PATCH", "/disk.img", body=b"x", headers={"Content-Range": "bytes 0-0/*"})
        patched = holder_free.getresponse()
        body = patched.read().decode()
        holder_free.close()
        assert patched.status == 423, body
        assert re.search(r"within \d+ s", body), body
    finally:
        holder.close()
    # The holder's connection is closed: its lease ends with it.
    rerun = run_cli(str(source), lease_server.url("disk.img"), "-c", "2")
    assert rerun.returncode == 0, rerun.stderr
    assert target.read_bytes() == source.read_bytes()


class FakeHost:
    """The connections a LeaseTable is told about: the request's, and those open now."""

    def __init__(self):
        self.current = None
        self.open = set()

    def attach(self, leases):
        leases.request_connection = lambda: self.current
        leases.open_connections = lambda: set(self.open)


def test_a_lease_ends_with_its_holders_connections_but_not_before_its_writes(tmp_path):
    from pdiffcopy.errors import Locked
    from pdiffcopy.server.leasetable import LeaseTable

    leases, host = LeaseTable(str(tmp_path)), FakeHost()
    host.attach(leases)
    (tmp_path / "file").write_bytes(b"x")
    info = os.stat(tmp_path / "file")
    host.current, host.open = "holder-1", {"holder-1", "holder-2"}
    lease = leases.acquire(info, "file")
    host.current = "holder-2"
    leases.renew(info, lease, "file")
    host.open = {"holder-2"}  # one of its connections closed: still there
    with pytest.raises(Locked, match=r"within \d+ s"):
        leases.acquire(info, "file")
    writing = leases.writing(info, lease, "file")
    writing.__enter__()
    host.open = set()  # every connection closed, but a write of it still runs
    started = time.monotonic()
    with pytest.raises(Locked, match=r"within \d+ s"):
        leases.acquire(info, "file")
    assert time.monotonic() - started >= 1.5  # it waited for that write to end
    writing.__exit__(None, None, None)
    host.current, host.open = "next", {"next"}
    assert leases.acquire(info, "file") != lease  # gone: taken over at once


def test_a_lease_whose_connections_are_unknown_lasts_its_time_and_says_how_long(tmp_path):
    from pdiffcopy.errors import Locked
    from pdiffcopy.server.leasetable import LEASE_SECONDS, LeaseTable

    leases = LeaseTable(str(tmp_path))
    leases.open_connections = lambda: None  # cannot tell
    (tmp_path / "file").write_bytes(b"x")
    info = os.stat(tmp_path / "file")
    leases.acquire(info, "file")
    with pytest.raises(Locked, match=rf"within {LEASE_SECONDS} s"):
        leases.acquire(info, "file")
    with pytest.raises(Locked, match=rf"within {LEASE_SECONDS} s"):
        with leases.writing(info, None, "file"):
            pass


def test_a_connection_the_server_closed_keeps_its_holder_alive_one_the_client_closed_does_not(tmp_path):
    import ipaddress
    import socket

    from pdiffcopy.server.leasetable import LeaseTable
    from pdiffcopy.server import holds

    leases = LeaseTable(str(tmp_path))
    holds.watch_leases(leases)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        def pair():
            client = socket.create_connection(listener.getsockname())
            served, _ = listener.accept()
            here, there = served.getsockname(), served.getpeername()
            text = holds.connection_text(((ipaddress.ip_address(here[0]), here[1]),
                                          (ipaddress.ip_address(there[0]), there[1])))
            return client, served, text

        client, served, idle = pair()
        served.close()  # the server ends an idle keep-alive connection: its client may live on
        assert idle in leases.open_connections()
        client.close()
        client, served, killed = pair()
        client.close()  # the client's end closes first: a killed client's does
        time.sleep(0.05)  # its end reaches the server's side before that one closes too
        served.close()
        assert killed not in leases.open_connections()
        client, served, alive = pair()
        assert alive in leases.open_connections()
        client.close()
        served.close()
    finally:
        listener.close()



def test_a_holder_one_read_of_the_tcp_table_skips_is_not_taken_for_gone(tmp_path, monkeypatch):
    """The kernel's table, read while other connections come and go, can skip one that stays open:
    neither a lease nor a temporary's writer lock is let go on one such miss."""
    import ipaddress
    import socket

    from pdiffcopy.errors import Locked
    from pdiffcopy.local import tcptable, writerlocks
    from pdiffcopy.server import holds
    from pdiffcopy.server.leasetable import LeaseTable

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    try:
        here, there = served.getsockname(), served.getpeername()
        mine = ((ipaddress.ip_address(here[0]), here[1]), (ipaddress.ip_address(there[0]), there[1]))
        real_rows, skip = tcptable.rows, []

        def rows_skipping_it_once(*args):
            rows = list(real_rows(*args))
            if skip:
                skip.pop()
                return [row for row in rows if (row.local, row.remote) != mine]
            return rows

        monkeypatch.setattr(tcptable, "rows", rows_skipping_it_once)
        # A lease its holder took on this connection: another client is refused.
        (tmp_path / "leases").mkdir()
        leases = LeaseTable(str(tmp_path / "leases"))
        holds.watch_leases(leases)
        leases.request_connection = lambda: holds.connection_text(mine)
        target = tmp_path / "target"
        target.write_bytes(b"x")
        info = os.stat(target)
        leases.acquire(info, "target")
        leases.request_connection = lambda: None
        skip.append(1)
        with pytest.raises(Locked):
            leases.acquire(info, "target")
        # A temporary's writer lock kept for this connection: still kept after a tick.
        keeper = writerlocks.HoldKeeper(60, tick=3600)
        keeper.open_connections = holds.open_connections
        temporary = tmp_path / "t.pdiffcopy-0001"
        temporary.write_bytes(b"x")
        fd = os.open(temporary, os.O_RDONLY)
        keeper.keep(writerlocks.hold_descriptor(fd), mine)
        os.close(fd)
        skip.append(1)
        keeper.expire()
        assert len(keeper) == 1
    finally:
        client.close()
        served.close()
        listener.close()

"""Block devices through a server: exported by ``--device NAME=PATH[:rw]`` and only so.

Real gunicorn servers on 127.0.0.1 (``start_server``) and loop devices over files in the
test's directory (the ``loop_devices`` fixture detaches them, also on failure); bytes are
checked by reading the devices.
"""

from __future__ import annotations

import glob
import http.client
import json
import os
import subprocess
import time

import pytest

from conftest import (
    device_bytes,
    free_port,
    held_lease,
    http_get,
    one_line_error,
    pdiffcopy_command,
    random_bytes,
    run_cli,
    start_server,
)
from pdiffcopy.local.descriptors import data_extents

MiB = 1024 * 1024




def writes_of(device: str) -> int:
    """The device's completed writes since boot (its sysfs counters): unchanged means nothing was written."""
    rdev = os.stat(device).st_rdev
    with open(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/stat") as handle:
        return int(handle.read().split()[4])




@pytest.fixture
def serve(tmp_path):
    """``serve(*exports)``: a server of an empty root in the test's directory with ``--device`` each."""
    started = []

    def start(*exports: str, root=None):
        root = root or tmp_path / "root"
        root.mkdir(exist_ok=True)
        arguments = [word for export in exports for word in ("--device", export)]
        server = start_server(root, tmp_path / f"server-{len(started)}.log", extra=arguments)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def request(server, method: str, path: str, body: bytes = b"", headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


# -- pull ------------------------------------------------------------------------------------

def test_a_device_pulls_to_a_file_and_to_a_device(loop_devices, serve, tmp_path):
    data = random_bytes(8 * MiB, seed=41)
    source, _ = loop_devices.new("source.img", 8 * MiB, data)
    server = serve(f"vm1={source}")
    copy = tmp_path / "copy.img"
    done = run_cli(server.url("vm1"), str(copy))
    assert done.returncode == 0, done.stderr
    assert copy.read_bytes() == data
    old = bytearray(data)
    old[3 * MiB : 3 * MiB + 10] = bytes(10)
    target, _ = loop_devices.new("target.img", 8 * MiB, bytes(old))
    done = run_cli("--stats", server.url("vm1"), target)
    assert done.returncode == 0, done.stderr
    assert device_bytes(target, 8 * MiB) == data
    assert "1 of 8 blocks differed" in done.stderr, done.stderr


def bytes_read(device: str) -> int:
    """The bytes the device has read since boot (its sysfs counters: sectors read x 512)."""
    rdev = os.stat(device).st_rdev
    with open(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/stat") as handle:
        return int(handle.read().split()[2]) * 512


def test_a_pulled_sparse_backed_device_is_read_only_where_it_holds_data(loop_devices, serve, tmp_path):
    """The server hashes and maps an exported device by its own data map: its holes are never read."""
    size, pieces = 256 * MiB, [(0, 2 * MiB), (100 * MiB, 3 * MiB), (255 * MiB, MiB)]
    backing = tmp_path / "source.img"
    with open(backing, "wb") as handle:
        handle.truncate(size)
        for index, (offset, length) in enumerate(pieces):
            handle.seek(offset)
            handle.write(random_bytes(length, seed=90 + index))
    mapped = sum(length for _, length in pieces)
    source = loop_devices.over(backing)
    server = serve(f"vm1={source}")
    for name in ("copy.img", "again.img"):  # a new file, then an old copy with one block changed
        copy = tmp_path / name
        if name == "again.img":
            copy.write_bytes(backing.read_bytes())
            with open(copy, "r+b") as handle:
                handle.seek(100 * MiB + 5)
                handle.write(b"changed")
        before = bytes_read(source)
        done = run_cli(server.url("vm1"), str(copy))
        read = bytes_read(source) - before
        assert done.returncode == 0, done.stderr
        # Each extent hashed once and, where it differs, sent once (some read ahead around them):
        # never the 250 MiB of holes.
        assert read <= 3 * mapped, (name, read, done.stderr)
        assert subprocess.run(["cmp", source, str(copy)]).returncode == 0


def test_the_server_reports_a_device_with_its_size_and_write_counters(loop_devices, serve):
    data = random_bytes(2 * MiB, seed=42)
    source, _ = loop_devices.new("source.img", 2 * MiB, data)
    server = serve(f"vm1={source}")
    status, _, body = http_get(server.base + "/.pdiffcopy/stat/vm1")
    assert status == 200, body
    answer = json.loads(body)
    assert (answer["type"], answer["size"]) == ("device", 2 * MiB), answer
    tag = answer["etag"]
    # If-Match of range reads and hashes holds while nothing writes the device...
    status, headers, body = request(server, "GET", "/vm1", headers={"Range": "bytes=0-99", "If-Match": tag})
    assert (status, body, headers["ETag"]) == (206, data[:100], tag)
    hashes = "/.pdiffcopy/hashes/vm1?method=sha256&block_size=1048576&offset=0&length=2097152"
    assert request(server, "GET", hashes, headers={"If-Match": tag})[0] == 200
    # ...and fails once something did: a device's mtime does not tell, its counters do.
    with open(source, "r+b") as handle:
        handle.write(b"changed")
        handle.flush()
        os.fsync(handle.fileno())
    assert json.loads(http_get(server.base + "/.pdiffcopy/stat/vm1")[2])["etag"] != tag
    assert request(server, "GET", "/vm1", headers={"Range": "bytes=0-99", "If-Match": tag})[0] == 412
    assert request(server, "GET", hashes, headers={"If-Match": tag})[0] == 412


# -- push ------------------------------------------------------------------------------------

def test_a_file_and_a_device_push_to_a_writable_device(loop_devices, serve, tmp_path):
    target, backing = loop_devices.new("target.img", 8 * MiB)
    server = serve(f"disk={target}:rw")
    data = random_bytes(8 * MiB, seed=43)
    image = tmp_path / "image"
    image.write_bytes(data)
    done = run_cli(str(image), server.url("disk"))
    assert done.returncode == 0, done.stderr
    assert device_bytes(target, 8 * MiB) == data
    changed = bytearray(data)
    changed[5 * MiB : 5 * MiB + 10] = b"0123456789"
    source, _ = loop_devices.new("source.img", 8 * MiB, bytes(changed))
    done = run_cli("--stats", source, server.url("disk"))
    assert done.returncode == 0, done.stderr
    assert device_bytes(target, 8 * MiB) == bytes(changed)
    assert "1 of 8 blocks differed" in done.stderr, done.stderr
    assert os.path.getsize(backing) == 8 * MiB  # never resized


@pytest.mark.parametrize("option", ["--atomic", "--partial"])
def test_replacing_a_remote_device_is_refused_with_nothing_written(loop_devices, serve, tmp_path, option):
    target, _ = loop_devices.new("target.img", 4 * MiB, b"old")
    server = serve(f"disk={target}:rw")
    (tmp_path / "image").write_bytes(random_bytes(4 * MiB, seed=44))
    writes = writes_of(target)
    done = run_cli(option, str(tmp_path / "image"), server.url("disk"))
    assert f"{option} cannot be used with" in one_line_error(done)
    assert device_bytes(target, 3) == b"old" and writes_of(target) == writes
    assert os.listdir(server.root) == []


def test_a_smaller_remote_device_is_refused_with_nothing_written(loop_devices, serve, tmp_path):
    target, _ = loop_devices.new("target.img", 2 * MiB, b"old")
    server = serve(f"disk={target}:rw")
    (tmp_path / "image").write_bytes(random_bytes(3 * MiB, seed=45))
    writes = writes_of(target)
    done = run_cli(str(tmp_path / "image"), server.url("disk"))
    assert "is smaller than the source" in one_line_error(done)
    assert device_bytes(target, 3) == b"old" and writes_of(target) == writes


def test_a_larger_remote_device_keeps_its_tail_and_says_so(loop_devices, serve, tmp_path):
    tail = random_bytes(2 * MiB, seed=46)
    target, _ = loop_devices.new("target.img", 4 * MiB, tail, offset=2 * MiB)
    server = serve(f"disk={target}:rw")
    data = random_bytes(2 * MiB, seed=47)
    (tmp_path / "image").write_bytes(data)
    done = run_cli(str(tmp_path / "image"), server.url("disk"))
    assert done.returncode == 0, done.stderr
    assert "left as they were" in done.stderr, done.stderr
    assert device_bytes(target, 4 * MiB) == data + tail


def test_a_read_only_export_refuses_every_write(loop_devices, serve, tmp_path):
    target, _ = loop_devices.new("target.img", 2 * MiB, b"old")
    server = serve(f"disk={target}")
    (tmp_path / "image").write_bytes(random_bytes(2 * MiB, seed=48))
    writes = writes_of(target)
    done = run_cli(str(tmp_path / "image"), server.url("disk"))
    assert "disk is exported read-only" in one_line_error(done)
    for method, path, headers in (
            ("PATCH", "/disk", {"Content-Range": "bytes 0-2/*", "Content-Type": "application/octet-stream"}),
            ("POST", "/.pdiffcopy/resize/disk?size=3", {}),
            ("POST", "/.pdiffcopy/punch/disk", {"Content-Type": "application/octet-stream"}),
            ("POST", "/.pdiffcopy/lease/disk", {})):
        body = b"new" if method == "PATCH" else (bytes(16) if "punch" in path else b"")
        status, _, answer = request(server, method, path, body, headers)
        assert status == 403, (path, status, answer)
        assert b"read-only" in answer and b"\n" not in answer.strip(), answer
    assert device_bytes(target, 3) == b"old" and writes_of(target) == writes


def test_a_device_is_never_replaced_or_renamed_over(loop_devices, serve):
    target, _ = loop_devices.new("target.img", 2 * MiB, b"old")
    server = serve(f"disk={target}:rw")
    (server.root / ".x.pdiffcopy-000000000001").write_bytes(b"new")
    status, _, answer = request(server, "POST", "/.pdiffcopy/rename/.x.pdiffcopy-000000000001?to=disk")
    assert status == 403, answer
    status, _, answer = request(server, "POST", "/.pdiffcopy/resize/disk?size=" + str(3 * MiB))
    assert status == 416, answer  # a device keeps its size
    assert device_bytes(target, 3) == b"old" and not (server.root / "disk").exists()


# -- confinement -----------------------------------------------------------------------------

def test_device_nodes_and_symlinks_placed_below_the_root_stay_refused(loop_devices, serve, tmp_path):
    planted, _ = loop_devices.new("planted.img", 2 * MiB, b"secret")
    exported, _ = loop_devices.new("exported.img", 2 * MiB)
    root = tmp_path / "root"
    root.mkdir()
    rdev = os.stat(planted).st_rdev
    os.mknod(root / "node", 0o600 | 0o060000, rdev)  # S_IFBLK
    os.symlink(planted, root / "link")
    os.symlink("../root/node", root / "inside-link")
    server = serve(f"disk={exported}:rw", root=root)
    writes = writes_of(planted)
    (tmp_path / "image").write_bytes(random_bytes(2 * MiB, seed=49))
    for name in ("node", "link", "inside-link"):
        status, _, body = http_get(server.url(name))
        assert status in (403, 409) and b"secret" not in body, (name, status, body)
        pulled = run_cli(server.url(name), str(tmp_path / f"pulled-{name}"))
        assert pulled.returncode != 0 and "Traceback" not in pulled.stderr, pulled.stderr
        pushed = run_cli(str(tmp_path / "image"), server.url(name))
        assert pushed.returncode != 0 and "Traceback" not in pushed.stderr, pushed.stderr
        status, _, body = request(server, "POST", f"/.pdiffcopy/lease/{name}")
        assert status in (403, 409), (name, status, body)
    assert device_bytes(planted, 6) == b"secret" and writes_of(planted) == writes


def test_the_metrics_and_the_root_listing_name_no_device(loop_devices, serve):
    exported, _ = loop_devices.new("exported.img", 2 * MiB)
    server = serve(f"disk={exported}")
    assert http_get(server.url("disk"))[0] == 200  # served (and counted)
    for path in ("/.pdiffcopy/metrics", "/.pdiffcopy/tree/"):
        status, _, body = http_get(server.base + path)
        assert status == 200, (path, body)
        assert b"/dev/" not in body and b"disk" not in body, (path, body[:500])


@pytest.mark.parametrize("problem", ["clash", "not a device", "missing", "bad name", "no path"])
def test_a_bad_export_is_refused_at_start_with_one_line(loop_devices, tmp_path, problem):
    device, _ = loop_devices.new("device.img", MiB)
    root = tmp_path / "root"
    root.mkdir()
    (root / "vm1").write_bytes(b"a file")
    (tmp_path / "plain").write_bytes(b"not a device")
    export, expected = {
        "clash": (f"vm1={device}", "vm1 also exists under --root"),
        "not a device": (f"disk={tmp_path / 'plain'}", "Not a block device"),
        "missing": (f"disk={tmp_path / 'missing'}:rw", "No such file or directory"),
        "bad name": (f"../x={device}", "must be one path component"),
        "no path": ("disk", "expected NAME=PATH"),
    }[problem]
    done = subprocess.run(pdiffcopy_command("--root", str(root), "--listen", f"127.0.0.1:{free_port()}",
                                            "--device", export), capture_output=True, text=True, timeout=60)
    assert expected in one_line_error(done), done.stderr


# -- two writers -----------------------------------------------------------------------------

def test_a_push_to_a_device_another_client_leases_is_refused(loop_devices, serve, tmp_path):
    target, _ = loop_devices.new("target.img", 2 * MiB, b"old")
    server = serve(f"disk={target}:rw")
    (tmp_path / "image").write_bytes(random_bytes(2 * MiB, seed=50))
    writes = writes_of(target)
    with held_lease(server, "disk"):
        done = run_cli(str(tmp_path / "image"), server.url("disk"))
        assert "being written by another client" in one_line_error(done)
    assert device_bytes(target, 3) == b"old" and writes_of(target) == writes


def _lease_held(server) -> bool:
    for name in glob.glob(f"/dev/shm/pdiffcopy-leases-{server.process.pid}-*/rdev-*") + \
            glob.glob(f"/tmp/pdiffcopy-leases-{server.process.pid}-*/rdev-*"):
        try:
            with open(name) as handle:
                if '"id"' in handle.read():
                    return True
        except OSError:
            pass
    return False


def test_two_pushes_to_one_device_never_mix(loop_devices, serve, tmp_path):
    size = 16 * MiB
    target, _ = loop_devices.new("target.img", size)
    server = serve(f"disk={target}:rw")
    first, second = random_bytes(size, seed=51), random_bytes(size, seed=52)
    (tmp_path / "first").write_bytes(first)
    (tmp_path / "second").write_bytes(second)
    slow = subprocess.Popen(pdiffcopy_command("--no-progress", "--bwlimit", "2M", str(tmp_path / "first"),
                                              server.url("disk")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _lease_held(server) and time.monotonic() < deadline and slow.poll() is None:
            time.sleep(0.05)
        assert _lease_held(server), "the first push never took its lease"
        done = run_cli(str(tmp_path / "second"), server.url("disk"))
        assert "being written by another client" in one_line_error(done)
        _, errors = slow.communicate(timeout=120)
    finally:
        if slow.poll() is None:
            slow.kill()
            slow.wait()
    assert slow.returncode == 0, errors
    assert device_bytes(target, size) == first


def test_a_pull_of_a_device_into_an_existing_file_may_use_the_chunked_delta(loop_devices, serve, tmp_path):
    data = random_bytes(8 * MiB, seed=53)
    source, _ = loop_devices.new("source.img", 8 * MiB, data)
    server = serve(f"vm1={source}")
    copy = tmp_path / "copy.img"
    copy.write_bytes(data[:MiB] + b"inserted" + data[MiB:-8])  # shifted: only chunks find it again
    done = run_cli("--stats", "--delta", "chunks", server.url("vm1"), str(copy))
    assert done.returncode == 0, done.stderr
    assert copy.read_bytes() == data


def test_with_sparse_a_push_keeps_a_thin_remote_device_thin(loop_devices, serve, tmp_path):
    size = 16 * MiB
    target, backing = loop_devices.new("target.img", size, random_bytes(size, seed=54))  # all allocated
    server = serve(f"disk={target}:rw")
    image = tmp_path / "image"
    with open(image, "wb") as handle:  # data at the start, a hole after it
        handle.write(random_bytes(MiB, seed=55))
        handle.truncate(size)
    done = run_cli("-S", str(image), server.url("disk"))
    assert done.returncode == 0, done.stderr
    assert device_bytes(target, size) == image.read_bytes()
    os.sync()
    assert os.stat(backing).st_blocks * 512 <= 4 * MiB, os.stat(backing).st_blocks * 512


def test_archive_mode_syncs_a_remote_device_s_bytes_and_leaves_its_node_alone(loop_devices, serve, tmp_path):
    target, _ = loop_devices.new("target.img", 2 * MiB)
    server = serve(f"disk={target}:rw")
    data = random_bytes(2 * MiB, seed=56)
    image = tmp_path / "image"
    image.write_bytes(data)
    os.chmod(image, 0o640)
    node = os.stat(target)
    done = run_cli("-a", str(image), server.url("disk"))
    assert done.returncode == 0, done.stderr
    assert "is a block device: its bytes are synced, not its metadata" in done.stderr, done.stderr
    assert device_bytes(target, 2 * MiB) == data
    assert (os.stat(target).st_mode, os.stat(target).st_uid) == (node.st_mode, node.st_uid)
    pulled = tmp_path / "pulled"
    done = run_cli("-a", server.url("disk"), str(pulled))
    assert done.returncode == 0, done.stderr
    assert pulled.read_bytes() == data


def test_archive_mode_syncs_a_local_device_s_bytes_both_ways(loop_devices, tmp_path):
    data = random_bytes(2 * MiB, seed=57)
    device, _ = loop_devices.new("device.img", 2 * MiB, data)
    copy = tmp_path / "copy"
    done = run_cli("-a", device, str(copy))
    assert done.returncode == 0, done.stderr
    assert copy.read_bytes() == data
    changed = random_bytes(2 * MiB, seed=58)
    copy.write_bytes(changed)
    done = run_cli("-a", str(copy), device)
    assert done.returncode == 0, done.stderr
    assert device_bytes(device, 2 * MiB) == changed


def test_requests_past_a_device_s_end_are_refused_never_a_server_error(loop_devices, serve):
    device, backing = loop_devices.new("device.img", MiB, b"old")
    server = serve(f"disk={device}:rw")
    end = MiB
    for method, path, body, headers in (
            ("GET", f"/.pdiffcopy/hashes/disk?method=sha256&block_size=4096&offset={end + 4096}&length=4096", b"",
             {}),
            ("PATCH", "/disk", b"x", {"Content-Range": f"bytes {end}-{end}/*",
                                      "Content-Type": "application/octet-stream"}),
            ("POST", "/.pdiffcopy/punch/disk", (end - 4096).to_bytes(8, "little") + (8192).to_bytes(8, "little"),
             {"Content-Type": "application/octet-stream"}),
            ("GET", "/disk", b"", {"Range": f"bytes={end}-{end + 10}"}),
            ("POST", "/.pdiffcopy/chunks/disk?average=65536", (0).to_bytes(8, "little") +
             (end + 1).to_bytes(8, "little"), {"Content-Type": "application/octet-stream"})):
        status, _, answer = request(server, method, path, body, headers)
        assert status == 416, (method, path, status, answer)
    status, _, answer = request(server, "GET", f"/.pdiffcopy/datamap/disk?offset=0&length={1 << 40}")
    # The device's own map (its backing file's), within the device: nothing past its end.
    with open(backing, "rb") as handle:
        mapped = data_extents(handle.fileno(), 0, end)
    assert mapped and mapped[-1][0] + mapped[-1][1] <= end
    assert status == 200 and answer == b"".join(start.to_bytes(8, "little") + size.to_bytes(8, "little")
                                                for start, size in mapped), answer
    assert device_bytes(device, 3) == b"old"

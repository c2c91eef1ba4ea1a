"""Block devices over ssh: ``pdiffcopy /dev/loopA HOST:/dev/loopB`` and back, against the real
sshd of tests/test_ssh.py, and the serve-over-ssh server's rule that only the device the client
named is served (every other device node below "/" stays refused)."""

from __future__ import annotations

import json
import os
import socket
import subprocess


from conftest import device_bytes, pdiffcopy_command, random_bytes
from test_ssh import over_ssh, serve_processes, sshd, wait_until  # noqa: F401 (sshd: the fixture)

MiB = 1024 * 1024




def test_a_device_pushes_to_a_device_over_ssh_and_back(sshd, loop_devices, tmp_path):  # noqa: F811
    data = random_bytes(8 * MiB, seed=61)
    source, _ = loop_devices.new("source.img", 8 * MiB, data)
    old = bytearray(data)
    old[2 * MiB : 2 * MiB + 10] = bytes(10)
    target, backing = loop_devices.new("target.img", 8 * MiB, bytes(old))
    pushed = over_ssh(sshd, "--stats", source, f"127.0.0.1:{target}")
    assert pushed.returncode == 0, pushed.stderr
    assert device_bytes(target, 8 * MiB) == data
    assert "1 of 8 blocks differed" in pushed.stderr, pushed.stderr
    assert os.path.getsize(backing) == 8 * MiB
    with open(target, "r+b") as handle:  # changed there: pulled back into the source
        handle.seek(5 * MiB)
        handle.write(b"0123456789")
    back, _ = loop_devices.new("back.img", 8 * MiB, data)
    pulled = over_ssh(sshd, "--stats", f"127.0.0.1:{target}", back)
    assert pulled.returncode == 0, pulled.stderr
    assert device_bytes(back, 8 * MiB) == device_bytes(target, 8 * MiB)
    assert "1 of 8 blocks differed" in pulled.stderr, pulled.stderr
    assert wait_until(lambda: not serve_processes())


def test_a_remote_device_pulls_to_a_file_over_ssh(sshd, loop_devices, tmp_path):  # noqa: F811
    data = random_bytes(4 * MiB + 4096, seed=62)
    device, _ = loop_devices.new("device.img", 4 * MiB + 4096, data)
    copy = tmp_path / "copy.img"
    pulled = over_ssh(sshd, f"127.0.0.1:{device}", str(copy))
    assert pulled.returncode == 0, pulled.stderr
    assert copy.read_bytes() == data


def test_replacing_a_remote_device_over_ssh_is_refused_with_nothing_written(sshd, loop_devices,  # noqa: F811
                                                                               tmp_path):
    target, _ = loop_devices.new("target.img", 2 * MiB, b"old")
    (tmp_path / "image").write_bytes(random_bytes(2 * MiB, seed=63))
    done = over_ssh(sshd, "--atomic", str(tmp_path / "image"), f"127.0.0.1:{target}")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "--atomic cannot be used with" in lines[0], done.stderr
    assert f"127.0.0.1:{target}" in lines[0]  # named as typed, not by the forwarded URL
    assert device_bytes(target, 3) == b"old"


def _unix_request(socket_path: str, token: str, method: str, path: str):
    """One HTTP/1.1 request over the serve-over-ssh server's Unix socket: (status, body)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(30)
        connection.connect(socket_path)
        connection.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                           f"Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while True:
            data = connection.recv(65536)
            if not data:
                break
            answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_over_ssh_only_the_named_device_is_served(loop_devices, tmp_path):
    named, _ = loop_devices.new("named.img", 2 * MiB, b"named")
    other, _ = loop_devices.new("other.img", 2 * MiB, b"other")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    server = subprocess.Popen(pdiffcopy_command("--serve-over-ssh", f"--serve-device={named}"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        fields = json.loads(server.stdout.readline())
        token, socket_path = fields["token"], fields["socket"]
        status, body = _unix_request(socket_path, token, "GET", f"/.pdiffcopy/stat{named}")
        assert status == 200 and json.loads(body)["type"] == "device", body
        status, body = _unix_request(socket_path, token, "GET", named)
        assert status == 200 and body[:5] == b"named", body[:100]
        for method, path in (("GET", other), ("POST", f"/.pdiffcopy/lease{other}"),
                             ("GET", f"/.pdiffcopy/hashes{other}?method=sha256&block_size=4096&offset=0&length=4096")):
            status, body = _unix_request(socket_path, token, method, path)
            assert status == 409 and not body.startswith(b"other"), (path, status, body)
        status, body = _unix_request(socket_path, token, "GET", f"/.pdiffcopy/stat{other}")
        assert json.loads(body)["type"] == "other", body  # a device node there, never served as one
    finally:
        server.stdin.close()
        server.wait(30)


def test_a_device_named_by_a_symlink_from_the_remote_home_is_served(sshd, loop_devices, tmp_path):  # noqa: F811
    target, _ = loop_devices.new("target.img", 2 * MiB)
    link = sshd.home / "vm-disk"
    os.symlink(target, link)
    try:
        data = random_bytes(2 * MiB, seed=64)
        (tmp_path / "image").write_bytes(data)
        pushed = over_ssh(sshd, str(tmp_path / "image"), "127.0.0.1:vm-disk", remote=None,
                          rsh=sshd.rsh(port=sshd.path_port))
        assert pushed.returncode == 0, pushed.stderr
        assert device_bytes(target, 2 * MiB) == data
        assert os.path.islink(link)  # written through, never replaced
    finally:
        os.unlink(link)

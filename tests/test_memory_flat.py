"""Memory flat in a sparse file's size (issue 37): a 1 TiB image holding a few MiB costs what an 8 GiB one does.

A file's digests were cut into one object per block and all kept to the end: a 1 TiB sparse
file's million blocks took the client to 330-360 MiB where an 8 GiB one needs about 25. Each
run here is a child process (its peak RSS from wait4, as ``/usr/bin/time -v`` gives it; the
server's from its processes' VmHWM), into a new file and into an identical copy, locally,
pulled and pushed; the large file's peaks must stay within 1.5 times the small one's, and
every copy must have the source's bytes and holes. benchmarks/sparse_memory.py measures the
same up to 8 TiB (docs/devices.rst, "Memory flat in the device's size").
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from conftest import pdiffcopy_command, start_server

#: These measure this machine (``-m "not measures"`` leaves them out).
pytestmark = pytest.mark.measures

GIB = 1024 ** 3
SMALL, LARGE = 8 * GIB, 1024 * GIB
#: The issue's bound: the large file's peak over the small one's.
MAX_RATIO = 1.5
#: Data pieces, each at a seeded, page-aligned place in its own stretch of the file.
PIECES, PIECE = 8, 1024 * 1024


def make_sparse(path: Path, size: int, seed: int = 37) -> None:
    """A sparse file of ``size`` bytes holding PIECES pieces of random data, the same bytes at every size."""
    rng = random.Random(seed)
    with open(path, "wb") as handle:
        handle.truncate(size)
        for index in range(PIECES):
            stretch = size // PIECES
            handle.seek(index * stretch + rng.randrange((stretch - PIECE) // 4096) * 4096)
            handle.write(rng.randbytes(PIECE))


def data_map(path: Path) -> List[Tuple[int, int]]:
    """The (offset, length) data extents of a file, by SEEK_DATA and SEEK_HOLE."""
    extents, position = [], 0
    with open(path, "rb") as handle:
        fd, size = handle.fileno(), os.fstat(handle.fileno()).st_size
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:  # only a hole remains
                break
            position = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, position - start))
    return extents


def assert_same(source: Path, target: Path) -> None:
    """The target has the source's size, data map and bytes (read at the data only: holes are zeros)."""
    assert target.stat().st_size == source.stat().st_size
    extents = data_map(source)
    assert data_map(target) == extents
    with open(source, "rb") as ours, open(target, "rb") as theirs:
        for offset, length in extents:
            assert os.pread(ours.fileno(), length, offset) == os.pread(theirs.fileno(), length, offset)


def client_peak_kib(*args: str) -> int:
    """Run the client as a child; its peak RSS in KiB (wait4's, its hashing processes included)."""
    child = subprocess.Popen(pdiffcopy_command("-q", *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = child.stdout.read() if child.stdout else b""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, output.decode(errors="replace")
    return usage.ru_maxrss


def server_peak_kib(pid: int) -> int:
    """The largest VmHWM (peak RSS) of the processes of a server's session."""
    peak = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) != pid:
                    continue
                with open(f"/proc/{entry}/status") as handle:
                    for line in handle:
                        if line.startswith("VmHWM:"):
                            peak = max(peak, int(line.split()[1]))
            except (OSError, ValueError):
                continue
    return peak


def peaks(directory: Path, size: int, mode: str) -> Tuple[int, Optional[int]]:
    """Sync a sparse file of ``size`` into a new file, then into that identical copy;
    the client's and the server's peaks in KiB (no server: None), every copy checked."""
    directory.mkdir()
    source, target = directory / "source.img", directory / "target.img"
    make_sparse(source, size)
    server = start_server(directory, directory / "server.log") if mode != "local" else None
    try:
        client = 0
        for _case in ("new", "nochange"):
            if server is None:
                client = max(client, client_peak_kib(str(source), str(target)))
            elif mode == "pull":
                client = max(client, client_peak_kib(server.url(source.name), str(target)))
            else:
                client = max(client, client_peak_kib(str(source), server.url(target.name)))
            assert_same(source, target)
        return client, (server_peak_kib(server.process.pid) if server is not None else None)
    finally:
        if server is not None:
            server.stop()
        source.unlink()
        target.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", ["local", "pull", "push"])
def test_a_1_tib_sparse_file_costs_the_memory_of_an_8_gib_one(tmp_path, mode):
    small_client, small_server = peaks(tmp_path / "small", SMALL, mode)
    large_client, large_server = peaks(tmp_path / "large", LARGE, mode)
    assert large_client <= MAX_RATIO * small_client, (
        f"client peak {large_client // 1024} MiB for 1 TiB, {small_client // 1024} MiB for 8 GiB")
    if small_server is not None and large_server is not None:
        assert large_server <= MAX_RATIO * small_server, (
            f"server peak {large_server // 1024} MiB for 1 TiB, {small_server // 1024} MiB for 8 GiB")

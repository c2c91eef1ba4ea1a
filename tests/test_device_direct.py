"""A block device's page cache footprint: ``--cache direct`` (O_DIRECT) and the default (dropped after use).

The cache of a block device lives as long as someone has it open: at its last close the kernel
empties it. A host's volumes are held open (by their VMs, by udev), so here a holder keeps both
devices open while they are synced and measured, and ``mincore`` on a mapping of each tells
which of its pages are resident (``benchmarks/pagecache.py``: util-linux's ``fincore`` sizes
its mapping by ``st_size``, which is 0 for a device). Loop devices over files in the test's
directory; the ``loop_devices`` fixture detaches them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from pathlib import Path

import pytest

from conftest import device_bytes, random_bytes, run_cli, start_server

MiB = 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")


def _pagecache():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "pagecache.py"
    spec = importlib.util.spec_from_file_location("pdiffcopy_bench_pagecache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pagecache = _pagecache()




@contextlib.contextmanager
def held_open(*devices: str):
    """Keep ``devices`` open (so their cache outlives the sync's close), their cache empty to start."""
    fds = [os.open(device, os.O_RDONLY) for device in devices]
    try:
        for device in devices:
            pagecache.drop(device)
        yield
    finally:
        for fd in fds:
            os.close(fd)


class PeakResident:
    """The most of each device's pages seen in the cache at once, polled while a sync runs."""

    def __init__(self, *devices: str) -> None:
        self.devices = devices
        self.peak = {device: 0 for device in devices}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            for device in self.devices:
                self.peak[device] = max(self.peak[device], pagecache.resident_bytes(device))

    def __enter__(self) -> "PeakResident":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def odd_devices(loop_devices, size: int, target: str):
    """A source device of ``size`` bytes (a multiple of 512, not of the page) with random data,
    and a target: ``changed`` (100 bytes at unaligned offsets in 10 % of its 1 MiB blocks) or
    ``zeroed``."""
    data = random_bytes(size, seed=37) if size <= 64 * MiB else os.urandom(size)  # (randbytes: at most 256 MiB - 1)
    source, _ = loop_devices.new("source.img", size, data)
    if target == "zeroed":
        old = b""
    else:
        changed = bytearray(data)
        for block in range(0, size // MiB, 10):
            position = block * MiB + 1234 + block * 7
            changed[position : position + 100] = bytes(100)
        changed[size - 300 :] = bytes(300)  # the device's last, partial page too
        old = bytes(changed)
    target_device, _ = loop_devices.new("target.img", size, old)
    return data, source, target_device


@pytest.mark.parametrize("target", ["changed", "zeroed"])
@pytest.mark.parametrize("sparse", [[], ["-S"]], ids=["dense", "sparse"])
def test_a_direct_sync_of_an_odd_sized_device_is_byte_equal(loop_devices, target, sparse):
    size = 24 * MiB + 3 * 512
    data, source, target_device = odd_devices(loop_devices, size, target)
    if sparse:  # zeros to discard: runs of them between the data, at unaligned edges
        data = bytearray(data)
        for start in range(MiB + 1000, size - 64 * 1024, 3 * MiB + 512):
            data[start : start + 40 * 1024] = bytes(40 * 1024)
        data = bytes(data)
        with open(source, "r+b") as handle:
            handle.write(data)
    done = run_cli("--cache", "direct", *sparse, source, target_device)
    assert done.returncode == 0, done.stderr
    assert device_bytes(target_device, size) == data


def test_a_direct_sync_from_a_device_to_a_file_and_back_is_byte_equal(loop_devices, tmp_path):
    size = 8 * MiB + 512
    data, source, target_device = odd_devices(loop_devices, size, "zeroed")
    copy = tmp_path / "copy.img"
    done = run_cli("--cache", "direct", source, str(copy))
    assert done.returncode == 0, done.stderr
    assert copy.read_bytes() == data
    done = run_cli("--cache", "direct", str(copy), target_device)
    assert done.returncode == 0, done.stderr
    assert device_bytes(target_device, size) == data


def test_a_direct_sync_puts_none_of_the_devices_pages_in_the_cache(loop_devices):
    size = 48 * MiB + 512
    data, source, target_device = odd_devices(loop_devices, size, "changed")
    with held_open(source, target_device):
        with PeakResident(source, target_device) as seen:
            done = run_cli("--cache", "direct", source, target_device)
        assert done.returncode == 0, done.stderr
        after = {device: pagecache.resident_bytes(device) for device in (source, target_device)}
    assert after == {source: 0, target_device: 0}
    # While it ran: at most the partial pages at the edges of unaligned writes, in passing.
    assert max(seen.peak.values()) <= 1 * MiB, seen.peak
    assert device_bytes(target_device, size) == data


def test_by_default_a_device_sync_keeps_its_cache_footprint_bounded(loop_devices):
    size = 256 * MiB
    data, source, target_device = odd_devices(loop_devices, size, "zeroed")
    with held_open(source, target_device):
        with PeakResident(source, target_device) as seen:
            done = run_cli(source, target_device)
        assert done.returncode == 0, done.stderr
        after = {device: pagecache.resident_bytes(device) for device in (source, target_device)}
    # Dropped as it goes (what was read and written), not only at the end.
    assert max(seen.peak.values()) <= 96 * MiB, seen.peak
    assert after == {source: 0, target_device: 0}
    assert device_bytes(target_device, size) == data


def test_cache_keep_leaves_what_a_device_sync_read_in_the_cache(loop_devices):
    size = 16 * MiB
    data, source, target_device = odd_devices(loop_devices, size, "changed")
    with held_open(source, target_device):
        done = run_cli("--cache", "keep", source, target_device)
        assert done.returncode == 0, done.stderr
        kept = pagecache.resident_bytes(source)
    assert kept == size
    assert device_bytes(target_device, size) == data


def test_a_device_a_server_exports_leaves_none_of_its_pages_in_the_cache(loop_devices, tmp_path):
    """Hashed and read by the server for a pull, and then dropped: the host's cache is its VMs'."""
    size = 64 * MiB
    data = random_bytes(size, seed=95)
    source, _ = loop_devices.new("source.img", size, data)
    root = tmp_path / "root"
    root.mkdir()
    server = start_server(root, tmp_path / "server.log", extra=("--device", f"vm1={source}"))
    try:
        copy = tmp_path / "copy.img"
        copy.write_bytes(data[: size // 2] + bytes(size // 2))  # half to hash and match, half to send
        with held_open(source):
            done = run_cli(server.url("vm1"), str(copy))
            assert done.returncode == 0, done.stderr
            left = pagecache.resident_bytes(source)
    finally:
        server.stop()
    assert copy.read_bytes() == data
    assert left == 0

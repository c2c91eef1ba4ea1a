"""Benchmark mode (``-B COUNT``): mutate a local target, resync it, compare with rsync.

Each round overwrites a growing share of the target's blocks with random
bytes at seeded random positions, resynchronises it from the source and
times that; when rsync is installed and the source is a local file, the same
mutated target is also brought up to date by ``rsync --inplace
--no-whole-file`` pulling from an rsync daemon that the benchmark starts on
127.0.0.1. At the end a table sums it up.
"""

from __future__ import annotations

import filecmp
import logging
import os
import random
import shutil
import socket
import tempfile
import time
from typing import List, Optional

from property_manager import PropertyManager, lazy_property, required_property

from pdiffcopy.core.blocks import parse_block_size
from pdiffcopy.core.locations import is_url
from pdiffcopy.errors import StorageError, UsageError
from pdiffcopy.api import sync

logger = logging.getLogger(__name__)

#: Seed of the first round's mutation; round N uses SEED + N, so runs repeat exactly.
SEED = 20200301

#: Seconds to wait for the rsync daemon to accept connections.
DAEMON_START_TIMEOUT = 10.0


def deltas(rounds: int) -> List[int]:
    """The share of blocks (in %) each round mutates: evenly spaced up to 100 %."""
    return [round(100 * index / rounds) for index in range(1, rounds + 1)]


def measured_delta(moved: int, size: int) -> int:
    """The share of a file (in %, rounded) that a sync moved; 0 for an empty file."""
    return round(100 * moved / size) if size else 0


def mutate(path: str, block_size: int, percentage: float, seed: int) -> int:
    """Overwrite ``percentage`` % of the blocks of ``path`` with random bytes.

    :returns: The number of blocks overwritten.
    """
    size = os.path.getsize(path)
    blocks = -(-size // block_size)
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(blocks), round(blocks * percentage / 100)))
    with open(path, "r+b") as handle:
        for block in chosen:
            offset = block * block_size
            handle.seek(offset)
            handle.write(rng.randbytes(min(block_size, size - offset)))
    return len(chosen)


class RsyncDaemon(PropertyManager):
    """An rsync daemon on 127.0.0.1 serving one directory read-only, run through executor."""

    @required_property
    def directory(self) -> str:  # type: ignore[empty-body]
        """The directory to serve as the module ``files``."""

    @lazy_property
    def port(self) -> int:
        """A free TCP port on 127.0.0.1."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    @lazy_property
    def workspace(self) -> str:
        """A private directory for the daemon's configuration."""
        return tempfile.mkdtemp(prefix="pdiffcopy-rsyncd-")

    def url(self, name: str) -> str:
        """The rsync URL of a file in the served directory."""
        return f"rsync://127.0.0.1:{self.port}/files/{name}"

    def start(self) -> None:
        """Write the configuration and start ``rsync --daemon --no-detach``."""
        from executor import ExternalCommand

        config = os.path.join(self.workspace, "rsyncd.conf")
        with open(config, "w") as handle:
            # Run as the calling user: as root, rsyncd would otherwise drop to
            # "nobody" and could not read a private directory.
            handle.write(f"use chroot = no\nport = {self.port}\naddress = 127.0.0.1\n"
                         f"uid = {os.getuid()}\ngid = {os.getgid()}\n"
                         f"pid file = {self.workspace}/rsyncd.pid\n"
                         f"[files]\npath = {self.directory}\nread only = yes\n")
        self.command = ExternalCommand("rsync", "--daemon", "--no-detach", f"--config={config}",
                                       asynchronous=True, check=False, silent=True)
        self.command.start()
        deadline = time.monotonic() + DAEMON_START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise StorageError("The rsync daemon did not start")

    def stop(self) -> None:
        """Stop the daemon and remove its configuration."""
        command = getattr(self, "command", None)
        if command is not None and command.is_running:
            command.terminate()
        shutil.rmtree(self.workspace, ignore_errors=True)


def time_rsync(source: str, target: str, rsh: Optional[str] = None) -> float:
    """Seconds ``rsync --inplace --no-whole-file`` takes to update ``target`` from ``source``.

    :param source: An rsync daemon's URL (:meth:`RsyncDaemon.url`), or a ``HOST:PATH`` reached
                   with ``rsh`` (rsync's ``-e``; None: ssh), as pdiffcopy reached it.
    """
    from executor import ExternalCommandFailed, execute

    over_ssh = () if source.startswith("rsync://") else ("-e", rsh or "ssh")
    started = time.monotonic()
    try:
        execute("rsync", *over_ssh, "--inplace", "--no-whole-file", "--ignore-times", source, target,
                silent=True, capture_stderr=True)
    except ExternalCommandFailed as error:
        reason = (error.command.stderr or b"").decode(errors="replace").strip().splitlines()
        raise StorageError(f"rsync failed: {reason[0] if reason else error}") from None
    return time.monotonic() - started


#: The rounds table's columns: what the round did, then what was measured.
ROUND_COLUMNS = ["Round", "Blocks mutated", "Data moved", "Of the file", "pdiffcopy", "rsync"]

#: Printed under the rounds table: what "Data moved" counts, which can be far less than was mutated.
MOVED_NOTE = ("Data moved: the bytes pdiffcopy sent or copied into the target; not the source's holes, nor data "
              "the target already held elsewhere (the chunked delta copies it within the target)")


def run_benchmark(source: str, target: str, rounds: int, rsync_source: Optional[str] = None,
                  rsh: Optional[str] = None, **options) -> List[dict]:
    """Run ``rounds`` mutate-and-resync rounds and print an overview.

    :param source: Path or URL of the source file.
    :param target: Local path of the target (created by a first sync if missing).
    :param rounds: How many rounds, at evenly spaced similarity.
    :param rsync_source: The ``HOST:PATH`` that ``source`` (a URL) was reached at over ssh: rsync
                         is compared on it, over ``rsh`` (rsync's ``-e``) as pdiffcopy used it.
    :param options: Options for :func:`~pdiffcopy.api.sync`.
    :returns: One dict per round: mutated (the % of blocks mutated), delta (the % of the file that
              moved), bytes moved, seconds, rsync seconds or None.
    :raises UsageError: When ``target`` is a URL.
    """
    from humanfriendly import format_size, format_timespan
    from humanfriendly.tables import format_pretty_table

    if is_url(target):
        raise UsageError("--benchmark mutates TARGET, so TARGET must be a local file")
    block_size = parse_block_size(options.get("block_size") or "1MiB")
    if not os.path.exists(target):
        logger.info("Creating %s with a first sync", target)
        sync(source, target, **options)
    logging.getLogger("executor").setLevel(logging.WARNING)
    daemon = None
    rsync_from: Optional[str] = None
    skipped = ""
    if shutil.which("rsync") is None:
        skipped = "rsync is not installed"
    elif rsync_source is not None:
        rsync_from = rsync_source
    elif is_url(source):
        skipped = "rsync cannot read a pdiffcopy server's URL (a HOST:PATH source it reaches over ssh)"
    else:
        daemon = RsyncDaemon(directory=os.path.dirname(os.path.abspath(source)))
        daemon.start()
        rsync_from = daemon.url(os.path.basename(source))
    scratch = os.path.join(os.path.dirname(os.path.abspath(target)),
                           f".{os.path.basename(target)}.rsync-benchmark")
    results = []
    try:
        for index, mutated in enumerate(deltas(rounds)):
            mutate(target, block_size, mutated, SEED + index)
            rsync_seconds: Optional[float] = None
            if rsync_from is not None:
                shutil.copyfile(target, scratch)
            result = sync(source, target, **options)
            if rsync_from is not None:
                rsync_seconds = time_rsync(rsync_from, scratch, rsh)
                if not filecmp.cmp(target, scratch, shallow=False):  # (the target is the source's copy now)
                    raise StorageError("rsync left a target that differs from the source")
            # The delta is what moved, not what was mutated: a target that
            # differed from the source before round 1 moves whole in it.
            measured = measured_delta(result.bytes_moved, result.size)
            results.append(dict(mutated=mutated, delta=measured, moved=result.bytes_moved,
                                seconds=result.seconds, rsync=rsync_seconds))
            logger.info("Round %d of %d: %d%% of the blocks mutated, %s moved (%d%% of the file) in %s",
                        index + 1, rounds, mutated, format_size(result.bytes_moved, binary=True), measured,
                        format_timespan(result.seconds))
    finally:
        if daemon is not None:
            daemon.stop()
        if os.path.exists(scratch):
            os.unlink(scratch)
    rows = [[str(index + 1), f"{r['mutated']}%", format_size(r["moved"], binary=True), f"{r['delta']}%",
             f"{r['seconds']:.2f} s", f"{r['rsync']:.2f} s" if r["rsync"] is not None else "not run"]
            for index, r in enumerate(results)]
    print(format_pretty_table(rows, ROUND_COLUMNS))
    print(MOVED_NOTE)
    if skipped:
        print(f"rsync: not run: {skipped}")
    if not is_url(source):
        compare_copies(source, scratch, options)
    return results


def _copy_tools(options: dict):
    """The whole-file copiers compared for a local source: (name, function(source, target))."""
    from executor import execute

    def ours(source: str, target: str) -> None:
        sync(source, target, **dict(options, whole_file=True))

    tools = [("pdiffcopy -W", ours), ("shutil.copyfile", shutil.copyfile),
             ("cp", lambda source, target: execute("cp", source, target, silent=True))]
    if shutil.which("rsync"):
        tools.append(("rsync --whole-file", lambda source, target: execute(
            "rsync", "--whole-file", source, target, silent=True)))
    return tools


def compare_copies(source: str, scratch: str, options: dict) -> List[dict]:
    """Time whole-file copies of ``source`` into a new file, ours next to shutil, cp and rsync.

    Each tool copies once untimed (a warm-up: this machine's memory and cache
    effects hit the first run hardest) and once timed; every copy is checked
    against the source. pdiffcopy also flushes its copy to disk and verifies
    it, which the others do not.

    :returns: One dict per tool: name, seconds and MB/s.
    """
    from humanfriendly.tables import format_pretty_table

    size = os.path.getsize(source)
    results = []
    try:
        for name, copy in _copy_tools(options):
            seconds = 0.0
            for _attempt in ("warm-up", "timed"):  # the last one counts
                if os.path.exists(scratch):
                    os.unlink(scratch)
                started = time.monotonic()
                copy(source, scratch)
                seconds = time.monotonic() - started
                if not filecmp.cmp(source, scratch, shallow=False):
                    raise StorageError(f"{name} made a copy that differs from the source")
            results.append(dict(tool=name, seconds=seconds, rate=size / max(seconds, 1e-9) / 1e6))
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    baseline = next(r["seconds"] for r in results if r["tool"] == "shutil.copyfile")
    rows = [[r["tool"], f"{r['seconds']:.3f} s", f"{r['rate']:.0f} MB/s",
             f"{baseline / max(r['seconds'], 1e-9):.2f}x"] for r in results]
    print(format_pretty_table(rows, ["Whole-file copy", "Time", "Rate", "Gain over shutil"]))
    return results

"""What the server spends per file of a tree, seen in the system calls of a real one (``strace -f``).

The metrics of a multi-process server check the worker's pid on every
count (a ``getpid``); counted per file, that was more of a pushed small
file's server time than parsing its header. Bytes are counted a batch at
a time, and the count still comes out right.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import pytest

from conftest import random_bytes, run_cli, start_server
from test_kill_switch_and_confinement import needs_strace

#: These measure this machine (``-m "not measures"`` leaves them out).
pytestmark = pytest.mark.measures

FILES = 200


def calls_so_far(trace) -> int:
    return len(re.findall(r"\bgetpid\(\)", trace.read_text()))


@needs_strace
def test_a_push_counts_its_bytes_a_batch_at_a_time(tmp_path):
    source, root, trace = tmp_path / "src", tmp_path / "root", tmp_path / "trace"
    source.mkdir()
    root.mkdir()
    sizes = 0
    for index in range(FILES):
        data = random_bytes(100 + index, seed=index)
        (source / f"f{index:03d}").write_bytes(data)
        sizes += len(data)
    server = start_server(root, tmp_path / "server.log",
                          wrapper=("strace", "-f", "-qq", "-e", "trace=getpid", "-o", str(trace)))
    try:
        time.sleep(0.3)  # the workers' start-up calls are done
        before = calls_so_far(trace)
        done = run_cli("-a", "-q", f"{source}/", f"{server.base}/dst/")
        assert done.returncode == 0, done.stderr
        with urllib.request.urlopen(f"{server.base}/.pdiffcopy/metrics", timeout=30) as answer:
            metrics = answer.read().decode()
        time.sleep(0.2)  # strace writes its log as the calls return
        during = calls_so_far(trace) - before
    finally:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=30)
    assert sorted(os.listdir(root / "dst")) == sorted(os.listdir(source))
    received = re.search(r'^pdiffcopy_received_bytes_total\{export=""\} (\S+)$', metrics, re.MULTILINE)
    assert received and float(received.group(1)) == sizes
    assert during < FILES // 4, f"{during} getpid calls for {FILES} files"

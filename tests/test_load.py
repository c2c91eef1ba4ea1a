"""Load: 16 clients syncing different files against one server at once, plus a slow one.

Every client must succeed and its target verify; a client trickling a PATCH
body a few bytes at a time must not stop the others, which finish in
bounded time while it is still trickling. The aggregate throughput is
printed (``pytest -s``); ``benchmarks/load.py`` runs the same load by hand.

CI runs 16 x 64 MiB (about 10 s on 2 cores); ``PDIFFCOPY_LOAD_SIZE`` (MiB)
scales it down on slower machines.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

#: These measure this machine (``-m "not measures"`` leaves them out).
pytestmark = pytest.mark.measures

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "load.py"

CLIENTS = 16
SIZE = int(os.environ.get("PDIFFCOPY_LOAD_SIZE", "64")) * 1024 * 1024

#: Seconds the whole load may take: a hang fails, a slow machine passes.
DEADLINE = 60


def load_module():
    spec = importlib.util.spec_from_file_location("pdiffcopy_load_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.load
@pytest.mark.parametrize("workers", [1, 2], ids=["1-worker", "2-workers"])
def test_sixteen_clients_and_a_slow_one(tmp_path, workers, monkeypatch):
    # The server cuts a trickling body off after its stall grace (30 s; see
    # pdiffcopy/server/guard.py): longer than the load here, so the slow client
    # holds its thread the whole time, as this test wants.
    monkeypatch.setenv("PDIFFCOPY_STALL_GRACE", str(2 * DEADLINE))
    load = load_module()
    result = load.run_load(tmp_path, clients=CLIENTS, size=SIZE, workers=workers,
                           slow_client=True, deadline=DEADLINE)
    print(f"\n{workers} worker(s): {result.report()}")
    failed = [(run.source.name, run.returncode, run.stderr[-500:])
              for run in result.clients if not run.verified]
    assert failed == []
    assert {run.direction for run in result.clients} == {"pull", "push"}
    assert result.wall_seconds < DEADLINE
    # The slow client was still trickling, unanswered, when the last sync ended:
    # it held a worker thread the whole time, and the others went past it.
    assert result.slow_client_bytes > 0
    assert not result.slow_client_answered
    assert "Traceback" not in result.server_log

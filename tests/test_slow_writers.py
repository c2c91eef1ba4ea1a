"""Writers of one file that are slow (a shaped link, --bwlimit) never lock each other out.

A push sends its ranges over several connections at once; on a slow link each
PATCH body takes seconds. The shaped-link benchmark found pushes of new files at
200 Mbit refused with 423 ("being written by another client") after two seconds:
every write took the file's lease lock exclusively before holding it shared for
its body, so it waited for any slower write to end.
"""

import http.client
import json
import threading
import time

from conftest import random_bytes
from pdiffcopy.server.leasetable import LOCK_WAIT_SECONDS

SLOW_BODY = 1024 * 1024
SLOW_STEP = 64 * 1024
#: The slow body takes about 3.2 s (well above LOCK_WAIT_SECONDS), at 320 KiB/s: far above
#: the server's minimum rate for a body, so the guard never cuts it.
STEP_SECONDS = 0.2


def patch(server, path, offset, data, pace=None, started=None):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.putrequest("PATCH", f"/{path}")
    connection.putheader("Content-Range", f"bytes {offset}-{offset + len(data) - 1}/*")
    connection.putheader("Content-Type", "application/octet-stream")
    connection.putheader("Content-Length", str(len(data)))
    connection.endheaders()
    for start in range(0, len(data), SLOW_STEP if pace else len(data)):
        connection.send(data[start:start + (SLOW_STEP if pace else len(data))])
        if started is not None:
            started.set()
        if pace:
            time.sleep(pace)
    response = connection.getresponse()
    answer = response.status, response.read()
    connection.close()
    return answer


def test_a_fast_write_is_not_refused_while_a_slow_one_runs(server, unique):
    assert SLOW_BODY // SLOW_STEP * STEP_SECONDS > LOCK_WAIT_SECONDS + 1
    target = server.root / unique
    target.write_bytes(bytes(2 * SLOW_BODY))
    slow_data, fast_data = random_bytes(SLOW_BODY, seed=1), random_bytes(4096, seed=2)
    started, results = threading.Event(), {}
    slow = threading.Thread(target=lambda: results.update(
        slow=patch(server, unique, 0, slow_data, pace=STEP_SECONDS, started=started)))
    slow.start()
    try:
        assert started.wait(10)
        time.sleep(0.3)  # the slow body is being read by now
        status, body = patch(server, unique, SLOW_BODY, fast_data)
        assert status == 200, body
        assert json.loads(body)["written"] == len(fast_data)
    finally:
        slow.join(30)
    assert results["slow"][0] == 200, results["slow"]
    data = target.read_bytes()
    assert data[:SLOW_BODY] == slow_data and data[SLOW_BODY:SLOW_BODY + 4096] == fast_data

"""Why a rank is gone, told apart (issue 24, Why 4: a clean ``Publisher.close()`` was logged as
"closed it, no heartbeat, or frame over limit"): a publisher that closes says so
(``wire.Close``); a connection closed by a stopped process is a missed heartbeat; one closed
while its process runs is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from test_coordinator import Harness, chunk
from test_publisher import FakeDaemon, _publisher, endpoint, make_daemon  # noqa: F401

from slotsync.protocol import wire
from slotsync.protocol.wire import Error


def _close_msg() -> wire.ToDaemon:
    return wire.decode_to_daemon(wire.encode(wire.Close("Publisher.close()")))


def test_a_rank_whose_publisher_closes_is_gone_for_that_reason_and_told_to_the_others():
    h = Harness()
    h.register_all()
    h.begin(0)
    h.send(0, chunk(0, 0, 0))
    h.send(1, _close_msg())
    st = h.coord.status(now=h.now)
    r1 = st["ranks"][1]
    assert not r1["alive"], st
    assert r1["gone_why"] == "its publisher closed the connection (Publisher.close())", r1
    err = h.last(0)
    assert isinstance(err, Error) and err.phase == "rank_gone", err
    assert "is gone: its publisher closed the connection (Publisher.close())" in err.message
    assert "heartbeat" not in err.message and "frame" not in err.message
    # the connection's close, seen next, changes nothing
    h.run(h.table.on_connection_gone(b"id-1", h.now, "its connection closed (...)"))
    assert h.coord.status(now=h.now)["ranks"][1]["gone_why"] == r1["gone_why"]


def test_publisher_close_says_goodbye(make_daemon: Callable[..., FakeDaemon],  # noqa: F811
                                      endpoint: str) -> None:  # noqa: F811
    daemon = make_daemon()
    with _publisher(endpoint) as pub:
        pub.register()
    deadline = time.monotonic() + 10
    while not daemon.of_type(wire.Close) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [c.reason for c in daemon.of_type(wire.Close)] == ["Publisher.close()"]


def test_the_close_of_a_stopped_process_is_a_missed_heartbeat_and_of_a_running_one_is_not():
    from slotsync.daemon.service.liveness import closed_why, process_state

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # (just after the fork a loaded machine may show it in D, reading its interpreter)
        deadline = time.monotonic() + 30
        while process_state(p.pid) not in ("R", "S") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert process_state(p.pid) in ("R", "S")
        running = closed_why(p.pid, process_state(p.pid), 10.0, 8192)
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(p.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped = closed_why(p.pid, process_state(p.pid), 10.0, 8192)
    finally:
        p.kill()
        p.wait()
    assert stopped == (f"it answered no heartbeat within liveness_s=10 s: its process (pid "
                       f"{p.pid}) is stopped (SIGSTOP, job control or a debugger)")
    assert running.startswith(f"its connection closed without a Close message while its "
                              f"process (pid {p.pid}) is still running (so not for missed "
                              "heartbeats)"), running
    assert "8192 bytes" in running and "answered no heartbeat" not in running
    assert process_state(p.pid) == ""  # (gone)

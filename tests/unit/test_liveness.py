"""Unit tests of the I/O-free liveness pieces (issue 15): the connection book that maps the
daemon's connections to socket identities and processes, the heartbeat options, the
rejected-message rate limiter."""

from __future__ import annotations

import pytest

from slotsync.daemon.logs import RateLimiter
from slotsync.daemon.service.liveness import ConnectionBook
from slotsync.protocol.liveness import heartbeat_options, peer_pid


def test_book_maps_a_closed_connection_and_an_exited_process_to_identities():
    b = ConnectionBook()
    assert b.seen(b"r0", 10, 100) == [] and b.seen(b"r1", 11, 101) == []
    assert b.disconnected(10) == [b"r0"]
    assert b.disconnected(10) == []  # (once)
    assert b.exited(101) == [b"r1"] and b.pids() == set()


def test_book_a_new_identity_on_a_reused_fd_means_the_old_one_is_gone():
    b = ConnectionBook()
    b.seen(b"r0", 10, 100)
    assert b.seen(b"r9", 10, 900) == [b"r0"]  # (libzmq reuses fds of closed connections)
    assert b.disconnected(10) == [b"r9"]


def test_book_a_reconnect_under_the_same_identity_moves_it_to_the_new_fd():
    b = ConnectionBook()
    b.seen(b"r0", 10, 100)
    b.seen(b"r0", 12, 0)  # (no pid on this message: the known one is kept)
    assert b.disconnected(10) == []  # the old connection's close says nothing now
    assert b.exited(100) == [b"r0"]


def test_heartbeats_close_a_silent_connection_within_liveness_s():
    o = heartbeat_options(10.0)
    assert o["HEARTBEAT_IVL"] + o["HEARTBEAT_TIMEOUT"] <= 10_000
    assert o["HEARTBEAT_TTL"] == 10_000
    assert heartbeat_options(0.1)["HEARTBEAT_IVL"] >= 25


def test_peer_pid_from_libzmq_peer_address():
    assert peer_pid("localhost:0:0:4242") == 4242
    assert peer_pid("127.0.0.1") == 0 and peer_pid(None) == 0 and peer_pid("") == 0


def test_rate_limiter_logs_a_burst_then_one_summary_per_interval():
    r = RateLimiter(burst=3, interval_s=60)
    logged = [r.allow("pid 7", t * 0.001) for t in range(20_000)]
    assert sum(logged) == 3  # 20,000 junk frames: 3 lines, not 20,009
    assert r.due(59.0) == [] and r.next_due() == 60.0
    assert r.due(60.0) == [("pid 7", 19_997)]
    assert r.due(61.0) == [] and r.next_due() is None
    assert r.allow("pid 7", 200.0)  # a new interval logs again


def test_rate_limiter_is_per_peer_and_bounded():
    r = RateLimiter(burst=1, interval_s=60, max_keys=2)
    assert r.allow("a", 0) and r.allow("b", 0) and not r.allow("a", 1)
    assert r.allow("c", 2)  # a third key evicts the oldest interval, summarised early
    assert r.due(3) == [("a", 1)]
    assert not r.allow("c", 4)


def test_rate_limiter_checks_its_arguments():
    with pytest.raises(ValueError, match="burst must be >= 1"):
        RateLimiter(burst=0)


def test_peer_watch_reports_a_process_that_exits_once():
    import asyncio
    import subprocess
    import sys

    from slotsync.daemon.service.liveness import PeerWatch

    async def main() -> list[int]:
        ended: list[int] = []
        w = PeerWatch(ended.append, poll_s=0.05)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
        w.watch(child.pid)
        w.watch(child.pid)  # (once)
        assert not await w.exits_within(child.pid, 0.01)
        assert await w.exits_within(child.pid, 30)
        child.wait()
        await asyncio.sleep(0.05)
        await w.close()
        return ended

    assert len(asyncio.run(main())) == 1

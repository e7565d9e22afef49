"""Publisher settings the ranks of a slot must share are declared in the begin and checked
before the pause (issue 24, daemon/core/begin_agreement.py); the publisher declares only what its
daemon compares (``Registered.begin_settings``).

Driven through the scripted engine and harness of test_coordinator.py (no sockets, no clock).
"""

from __future__ import annotations

from test_coordinator import Harness, chunk

from slotsync.protocol import wire
from slotsync.protocol.rank.session import PublisherSession
from slotsync.protocol.topology import EngineSlot
from slotsync.protocol.wire import Begin, Error, Registered

MIB = 1 << 20


def test_ranks_that_disagree_on_staging_bytes_are_refused_before_the_pause():
    """Before: found only at chunk 0, after the pause (the engine stayed paused and needed a
    full update). Now every rank is told, once all have begun, naming the setting, both
    values and the ranks; the engine was never paused nor started."""
    h = Harness(size=4)
    h.register_all()
    assert all(h.last(r).begin_settings == ["staging_bytes"] for r in range(4))
    staging = [512 * MIB, 512 * MIB, 256 * MIB, 512 * MIB]
    for r in range(4):
        h.send(r, Begin(0, "v1", staging_bytes=staging[r]))
        h.send(r, chunk(0, 0, r))  # (a chunk each: the pause waits only for the begins)
        if r < 3:
            assert not any(isinstance(m, Error) for m in h.replies[r]), r
    for r in range(4):
        err = next(m for m in h.replies[r] if isinstance(m, Error))
        assert isinstance(err, Error) and err.phase == "begin" and err.update_id == 0, err
        assert "disagree on staging_bytes" in err.message, err.message
        assert f"rank 2 begins update 0 with staging_bytes={256 * MIB}" in err.message
        assert f"rank(s) [0, 1] with staging_bytes={512 * MIB}" in err.message
    assert "pause" not in h.engine.calls and "start_weight_update" not in h.engine.calls
    assert not h.coord.engine.needs_full_update
    # the next round, agreeing, goes through
    h.round(1)
    assert h.ended[-1].outcome == "success"


def test_undeclared_settings_and_rank_local_mode_are_not_compared():
    """A begin without the setting (a publisher older than the daemon: 0) is not compared;
    the rest agree, so the round goes through."""
    h = Harness(size=2)
    h.register_all()
    h.send(0, Begin(0, "v", staging_bytes=MIB))
    h.send(1, Begin(0, "v"))
    for k in range(2):
        for r in range(2):
            h.send(r, chunk(0, k, r))
    for r in range(2):
        h.send(r, wire.Commit(0, 2))
    assert h.ended[-1].outcome == "success", h.ended[-1].error


def test_publisher_declares_only_the_settings_its_daemon_compares():
    """Wire compatibility: a daemon that lists no ``begin_settings`` (older) gets a Begin
    without them (its ``forbid_unknown_fields`` would refuse one); a begin sent again after a
    restarted daemon's refusal declares them too; the field is omitted when 0."""
    s = PublisherSession(0, EngineSlot(0, 2), {"staging_bytes": 64 * MIB})
    s.registration(Registered(0, 0, 2, 0))  # an older daemon: no begin_settings
    b = s.begin("v")
    assert b.staging_bytes == 0 and b"staging_bytes" not in wire.encode(b)
    s.end()
    s.registration(Registered(0, 0, 2, 1, begin_settings=["staging_bytes"]))
    b = s.begin("v")
    assert wire.decode_to_daemon(wire.encode(b)).staging_bytes == 64 * MIB
    again, _ = s.rebegin()
    assert again.staging_bytes == 64 * MIB

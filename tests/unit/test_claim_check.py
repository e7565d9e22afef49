"""Without an engine table, a slot claim whose engine has fewer workers than the slot is
refused at registration, before the slot is locked to it, naming both numbers and the URL;
the right claim registers afterwards (issue 24, daemon/core/claim_check.py). Before, the wrong
claim registered, held the slot, and locked the right claim out until its begin failed.

Driven through the scripted engine of test_coordinator.py (no sockets, no clock), with engine
results routed through the table as the daemon's executor does.
"""

from __future__ import annotations

from test_coordinator import URL, EngineCall, Harness, reg

from slotsync.daemon.families import SlotTable
from slotsync.protocol.wire import Error, Registered


class TableHarness(Harness):
    """``Harness`` with claim checks on, engine results going through the table."""

    def __init__(self, workers: int) -> None:
        super().__init__(size=workers)
        self.table = SlotTable(check_claims=True)

    def engine_result(self, call: EngineCall, ok: bool, result: object, error: str) -> list:
        return self.table.on_engine_result(call.slot, call.call_id, ok, result, error,
                                           self.now)


def test_a_dense_claim_over_a_smaller_engine_is_refused_and_does_not_lock_the_slot():
    h = TableHarness(workers=2)
    h.engine.hold = True  # the answer comes after every rank registered
    for r in range(4):  # a dense default of 4 GPUs per engine; the engine has 2 workers
        h.send(r, reg(r, 0, 4))
    assert not h.replies  # held: no reply before the engine answered
    assert h.table.slots[(0, 4)].state == "registering"
    assert [c.route for c in h.pending_calls] == ["get_world_size"]  # one for all held
    h.engine.hold = False
    h.run([h.pending_calls.pop()])
    for r in range(4):
        err = h.last(r)
        assert isinstance(err, Error) and err.phase == "register", err
        assert f"engine {URL} has 2 workers" in err.message, err.message
        assert "claim slot [0, 4) of 4 ranks" in err.message, err.message
    assert h.table.slots == {}  # nothing kept: the slot is not locked
    for r in range(2):  # the right claim
        h.send(r, reg(r, 0, 2))
    assert all(isinstance(h.last(r), Registered) for r in range(2))
    assert list(h.table.slots) == [(0, 2)]
    h.round(0)
    assert h.ended[-1].outcome == "success", h.ended[-1].error
    assert "pause" in h.engine.calls
    assert h.engine.calls.count("get_world_size") == 3  # (2 claim checks + the begin probe)


def test_a_claim_the_engine_fits_or_cannot_answer_registers():
    h = TableHarness(workers=2)
    h.engine.fail[("get_world_size", 0)] = "connection refused"  # unreachable: the begin tells
    h.send(0, reg(0, 0, 2))
    assert isinstance(h.last(0), Registered)
    h.send(1, reg(1, 0, 2))  # (the slot has a rank: no second check)
    assert isinstance(h.last(1), Registered) and h.engine.calls == ["get_world_size"]

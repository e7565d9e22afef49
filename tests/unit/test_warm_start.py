"""Warm start (issue 27 C, daemon/warm_start.py): a slot's first begin's version, server-info
and init calls are made once every rank registered, so that the first round starts at its
per-round probe; whatever fails there is asked again, and refused, by the begin as before."""

from __future__ import annotations

from test_coordinator import ASKED, PROBES, Harness, chunk, reg

from slotsync.daemon.slot_table import SlotTable
from slotsync.daemon.update import Timeouts
from slotsync.protocol.wire import Ack, Commit, Error

INIT = "init_weight_transfer_engine"
ROUND = [*PROBES, "pause", "start_weight_update", "update_weights", "update_weights",
         "finish_weight_update", "resume"]


def warm_harness(size: int = 2) -> Harness:
    h = Harness(size=size)
    h.table = SlotTable(Timeouts(10, 10, 10), warm_start=True)
    return h


def test_a_complete_slot_is_warmed_and_its_first_round_starts_at_the_probe() -> None:
    h = warm_harness()
    h.send(0, reg(0))
    assert h.engine.calls == []  # (one rank of two: nothing yet)
    h.send(1, reg(1))
    assert h.engine.calls == [*ASKED, INIT]
    assert h.engine.bodies[-1] == {"init_info": {"packed": True}}
    assert h.coord.engine.initialized and h.coord.engine.kind == "vllm"
    h.round(0)
    assert h.engine.calls == [*ASKED, INIT, *ROUND]
    assert h.ended[-1].outcome == "success" and h.engine.version == "v0"
    h.round(1)
    assert h.engine.calls[len(ASKED) + 1 + len(ROUND):] == ROUND  # (later rounds as before)


def test_an_unsupported_version_is_not_initialised_and_the_begin_refuses_it() -> None:
    h = warm_harness()
    h.engine.vllm_version = "0.25.0"
    h.register_all()
    assert h.engine.calls == ASKED  # no init of an engine the daemon cannot drive
    assert not h.coord.engine.initialized and h.coord.engine.vllm_version is None
    h.begin(0)
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    assert h.engine.calls == [*ASKED, *ASKED]  # asked again, refused before the pause
    err = h.last(0)
    assert isinstance(err, Error) and "0.25.0" in err.message and not h.engine.paused


def test_a_failed_warm_start_leaves_the_first_begin_to_ask_again() -> None:
    h = warm_harness()
    h.engine.fail[("server_info", 0)] = "HTTP 503: starting"
    h.register_all()
    assert h.engine.calls == ASKED and not h.coord.engine.initialized
    h.round(0)
    assert h.engine.calls == [*ASKED, *ASKED, *PROBES, INIT, *ROUND[len(PROBES):]]
    assert h.ended[-1].outcome == "success"


def test_a_failed_init_makes_the_begin_check_the_replies_and_init_again() -> None:
    h = warm_harness()
    h.engine.fail[(INIT, 0)] = "HTTP 500: Worker failed with error 'boom'"
    h.register_all()
    assert h.engine.calls == [*ASKED, INIT] and h.coord.engine.replies_suspect
    h.round(0)
    # (an init is always preceded by the version stage again: update.begin_step)
    assert h.engine.calls[len(ASKED) + 1:] == [
        *PROBES, *ASKED, "check_replies", INIT, *ROUND[len(PROBES):]]
    assert h.ended[-1].outcome == "success"


def test_a_begin_during_the_warm_start_waits_for_it_then_makes_its_own_stages() -> None:
    h = warm_harness()
    h.engine.hold = True
    h.register_all()
    assert [c.route for c in h.pending_calls] == ASKED
    h.begin(0)
    for r in range(2):
        h.send(r, chunk(0, 0, r))
        h.send(r, chunk(0, 1, r))
    assert [c.route for c in h.pending_calls] == ASKED  # the begin waits
    h.engine.hold = False
    while h.pending_calls:
        call = h.pending_calls.pop(0)
        h.run(h.coord.on_engine_result(call.call_id, *h.engine.answer(call), h.now))
    for r in range(2):
        h.send(r, Commit(0, 2))
    # the begin came while the warm start asked: it takes the warm start's answers (no
    # version asked twice) and makes the init itself, after its probe
    assert h.engine.calls == [*ASKED, *PROBES, INIT, *ROUND[len(PROBES):]]
    assert [(m.phase, m.index) for m in h.replies[0] if isinstance(m, Ack)] == [
        ("begin", -1), ("chunk", 0), ("chunk", 1), ("commit", -1)]


def test_an_engine_declared_sglang_is_not_warmed() -> None:
    h = warm_harness()
    h.send(0, reg(0))
    h.coord.engine.declare_kind("sglang")  # (as the engine table's kind = "sglang" does)
    h.send(1, reg(1))
    assert h.engine.calls == []

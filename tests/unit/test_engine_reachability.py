"""A dead engine is shown as unreachable, with what the daemon last saw of it and when, not as
"paused" with a last update of "0.00s" (issue 24, Why 4: a fresh-user trial's `slotsync
status` while an engine process was dead)."""

from __future__ import annotations

from test_coordinator import URL, Harness, _send_round

from slotsync.cli.status import render_table

REFUSED = f"update_weights: cannot reach {URL}: Connection refused"


def _died_mid_update() -> Harness:
    """Round 0 succeeds (1 s, ending at t=1); round 1's first chunk finds the engine gone
    (t=10): the daemon last saw it paused, mid-update."""
    h = Harness()
    h.register_all()
    _send_round(h, 0, [("a", "b")])  # (at t=0: instant)
    h.coord.last_success = (1.0, 1.0)  # (the harness's clock does not move inside a round)
    h.now = 10.0
    h.engine.fail[("update_weights", 1)] = REFUSED
    _send_round(h, 1, [("a", "b")])
    return h


def test_a_dead_engine_is_unreachable_with_what_was_last_seen_not_paused():
    h = _died_mid_update()
    st = h.coord.status(now=30.0)
    assert st["engine_unreachable"] == REFUSED
    assert st["engine_unreachable_s"] == 20.0 and st["engine_last_answer_s"] == 20.0
    assert st["engine_paused"] is True  # (what the daemon last saw: the update had paused it)
    assert st["last_success_duration_s"] == 1.0 and st["last_success_s"] == 29.0
    table = render_table({"version": "x", "endpoint": "e", "slots": [st]})
    row = table.splitlines()[2]
    assert "unreachable for 20s; last seen paused, 20s ago" in row, table
    assert "0.00s" not in row and "1.00s (29s ago)" in row, table
    assert "LAST SUCCESS" in table.splitlines()[1]


def test_an_engine_that_answers_again_is_reachable():
    h = _died_mid_update()
    h.now = 40.0
    _send_round(h, 2, [("a", "b")])  # (its process is back: every call answers)
    st = h.coord.status(now=41.0)
    assert st["engine_unreachable"] is None and st["engine_unreachable_s"] is None
    assert st["engine_last_answer_s"] == 1.0
    row = render_table({"version": "x", "endpoint": "e", "slots": [st]}).splitlines()[2]
    assert "unreachable" not in row and "serving" in row, row


def test_an_engine_never_reached_says_so_and_no_update_duration():
    h = Harness()
    h.register_all()
    h.engine.fail[("version", 0)] = f"version: cannot reach {URL}: Connection refused"
    h.engine.fail[("server_info", 0)] = f"server_info: cannot reach {URL}: Connection refused"
    h.now = 5.0
    h.begin(0)
    st = h.coord.status(now=8.0)
    assert st["last_outcome"] == "failed" and st["last_success_duration_s"] is None
    row = render_table({"version": "x", "endpoint": "e", "slots": [st]}).splitlines()[2]
    assert "unreachable for 3s; never answered" in row, row
    assert "0.00s" not in row, row

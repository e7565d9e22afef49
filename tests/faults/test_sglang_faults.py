"""slotsyncd and an SGLang engine when things go wrong (issue 26 D): a 400 on a chunk, the
engine dying mid-chunk (a scheduler exception kills SGLang), a restarted engine, a failed
pause, a refused flush, a session someone left open, a version or layout the daemon refuses,
a declared SGLang URL that serves vLLM. Each leaves the engine as the guarantees say (paused
after a failure past the pause, serving after one before it) and the next round lands. The
SGLang-code engine, trainer ranks in spawned processes: ``tests/sglang_rounds.py``."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from engines import EngineBox  # noqa: E402
from sglang_rounds import (  # noqa: E402
    TP,
    assert_landed,
    ok_rounds,
    sglang_box,
    table,
)
from spawned_ranks import rounds, run_ranks  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


@pytest.mark.parametrize("status", [400, 500])
def test_a_failed_chunk_leaves_the_engine_paused_and_the_next_round_loads_everything(
        fresh_sgl, status):
    """A chunk SGLang refuses (400: its scheduler's refusal) or a route that raised (500:
    Starlette's bare 'Internal Server Error')."""
    fresh_sgl.request("POST", "/_slotsync/fault", {"route": "update_weights_from_tensor",
                                                   "after": 1, "times": 1, "status": status,
                                                   "message": "injected refusal"})
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP)
        for r in range(TP):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and f"HTTP {status}" in e["message"], e
        assert fresh_sgl.stats()["paused"] is True  # I4: never resumed on torn weights
        assert d.status()["slots"][0]["needs_full_update"] is True
        ev = run_ranks(d, fresh_sgl.url, True, [{"rounds": 1, "first_round": 2}] * TP)
        ok_rounds(ev, 1, fresh_sgl)
        assert_landed(fresh_sgl, 2)


def test_an_engine_that_dies_mid_chunk_is_restarted_and_taken_as_a_new_session(fresh_sgl):
    """A scheduler exception kills SGLang (the connection is reset): the round fails; the
    engine restarted at the same URL serves its checkpoint, and the next round, a full one,
    lands."""
    fresh_sgl.request("POST", "/_slotsync/fault", {"route": "update_weights_from_tensor",
                                                   "after": 1, "exit": True})
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_sgl.url, False, [{"rounds": 1}] * TP)
        for r in range(TP):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and e["phase"] == "engine", e
        assert "Connection reset" in e["message"], e  # (SGLang kills itself: no answer)
        deadline = time.monotonic() + 30
        while fresh_sgl.alive() and time.monotonic() < deadline:
            time.sleep(0.1)  # (it SIGKILLs itself once its ranks are reaped)
        assert not fresh_sgl.alive()
        fresh_sgl.start_again()
        ev = run_ranks(d, fresh_sgl.url, False, [{"rounds": 1, "first_round": 2}] * TP)
        ok_rounds(ev, 1)
        assert_landed(fresh_sgl, 2)


def test_a_restart_between_rounds_is_seen_and_the_round_is_full(fresh_sgl):
    with DaemonProcess() as d:
        ok_rounds(run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP), 1)
        fresh_sgl.kill()
        fresh_sgl.start_again()
        ok_rounds(run_ranks(d, fresh_sgl.url, True, [{"rounds": 1, "first_round": 2}] * TP), 1)
        assert_landed(fresh_sgl, 2)
        assert "engine_session_new" in d.log_tail() or d.status()["slots"][0][
            "updates_succeeded"] == 2


def test_a_partial_round_after_a_restart_is_refused_before_the_pause(fresh_sgl):
    """Issue 35 item 13: after a restart the slot needs a full update; a round whose ranks
    leave a tensor out (their begins' manifests say so) is refused at the begin, naming the
    tensor -- before the pause, so the restarted engine keeps serving its checkpoint, with no
    weight touched (it was refused only at the commit, after the pause and every chunk,
    leaving the engine paused on torn weights). The full round after it lands."""
    with DaemonProcess() as d:
        ok_rounds(run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP), 1)
        fresh_sgl.kill()
        fresh_sgl.start_again()
        before = fresh_sgl.stats()["counts"]
        ev = run_ranks(d, fresh_sgl.url, True, [
            {"rounds": 1, "first_round": 2, "omit": {2: ["lm_head.weight"]}}] * TP)
        for r in range(TP):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and e["phase"] == "begin", e
            assert "needs a full update" in e["message"], e
            assert "leave out 1 of the 6 tensor names" in e["message"], e
            assert "lm_head.weight" in e["message"], e
        stats = fresh_sgl.stats()
        c = {k: stats["counts"][k] - before[k] for k in before}
        assert c["pause_count"] == 0 and c["update_count"] == 0, c  # never paused
        assert stats["paused"] is False and stats["engine_paused"] is False, stats
        assert fresh_sgl.weight_version() != "v2"
        assert d.status()["slots"][0]["needs_full_update"] is True
        ok_rounds(run_ranks(d, fresh_sgl.url, True, [{"rounds": 1, "first_round": 3}] * TP), 1)
        assert_landed(fresh_sgl, 3)


def test_a_failed_pause_fails_the_round_before_any_weight_and_generation_goes_on(fresh_sgl):
    before = fresh_sgl.stats()["counts"]
    fresh_sgl.request("POST", "/_slotsync/fault", {"route": "pause_generation", "times": 1,
                                                   "status": 500})
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP)
        for r in range(TP):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and "pause" in e["message"], e
        stats = fresh_sgl.stats()
        c = {k: stats["counts"][k] - before[k] for k in before}
        assert c["update_count"] == 0 and c["begin_count"] == 0, c
        # the daemon resumes what it may have paused (SGLang reports no pause state)
        assert stats["paused"] is False and c["continue_count"] >= 1, (stats, c)
        assert d.status()["slots"][0]["needs_full_update"] is False


def test_a_flush_refused_while_requests_run_fails_the_round_with_no_weight_touched(tmp_path):
    """``pause_mode = "abort"`` flushes after the pause; a flush SGLang refuses (requests
    still running in the simulator: 400) fails the round before the session."""
    box = sglang_box("0.5.23")
    try:
        box.request("POST", "/_slotsync/fault", {"route": "flush_cache", "times": 1,
                                                 "status": 400, "message": "not idle"})
        with DaemonProcess(args=table(tmp_path, box.url, kind="sglang",
                                      pause_mode="abort")) as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * TP)
            (e,) = rounds(ev, 0)
            assert e["status"] == "error" and "not idle" in e["message"], e
            assert box.stats()["counts"]["update_count"] == 0
            assert box.stats()["paused"] is False
            ok_rounds(run_ranks(d, box.url, True, [{"rounds": 1, "first_round": 2}] * TP), 1)
            assert_landed(box, 2)
    finally:
        box.close()


@pytest.mark.parametrize("version", ["0.5.23", "0.5.21"])
def test_a_retract_pause_with_requests_running_is_flushed_and_the_round_lands(tmp_path,
                                                                             version):
    """Issue 35 item 11: ``pause_mode = "retract"`` while requests run. SGLang's own
    ``pause_generation`` moves them to the waiting queue, where they stay while paused, and
    SGLang's own ``SchedulerFlushWrapper`` and ``Scheduler.flush_cache`` / ``is_fully_idle``
    answer the daemon's flush (the SGLang-code engine compiles them from SGLang's source:
    ``engine/sglang/scheduler_code.py``). A flush that waits for idle (``?timeout=30``, the
    old request) counts the waiting queue and can only time out, failing every round; the
    flush SGLang's code allows after a retract pause flushes at once. The round lands, the
    cache is flushed once, and the requests run again after ``continue_generation``."""
    box = sglang_box(version)
    try:
        assert box.request("POST", "/_slotsync/requests", {"start": 3})[1]["running"] == 3
        with DaemonProcess(args=table(tmp_path, box.url, kind="sglang",
                                      pause_mode="retract")) as d:
            t0 = time.monotonic()
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * TP)
            took = time.monotonic() - t0
            ok_rounds(ev, 1, box)
            assert_landed(box, 1)
        stats = box.stats()
        assert stats["scheduler_rules"] == "sglang", stats  # SGLang's code, not the mirror
        c = stats["counts"]
        assert (c["pause_count"], c["flush_count"], c["flush_refused"]) == (1, 1, 0), c
        assert stats["requests"]["running"] == 3 and stats["requests"]["aborted"] == 0, stats
        assert not stats["flush_pending"] and not stats["engine_paused"], stats
        print(f"retract round with 3 requests running on {version}: {took:.2f} s")
    finally:
        box.close()


def test_a_session_someone_left_open_is_ended_and_the_round_lands(fresh_sgl):
    """A daemon killed between begin and end leaves SGLang's session open; the next begin
    answers 400 'already open': the daemon ends it and begins once more."""
    assert fresh_sgl.request("POST", "/begin_weight_update", {})[0] == 200
    with DaemonProcess() as d:
        ok_rounds(run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP), 1)
        assert_landed(fresh_sgl, 1)


@pytest.mark.parametrize(("sglang", "words"), [
    ({"reported_version": "0.5.22"}, "0.5.22"),
    ({"dp_size": 2}, "dp_size 2"),
    ({"pp_size": 2}, "pp_size 2"),
], ids=["version", "dp", "pp"])
def test_what_the_daemon_cannot_drive_is_refused_before_the_pause(sglang, words):
    box = EngineBox(TP, impl_name="sglang", sglang={"sglang_version": "0.5.23", **sglang})
    try:
        with DaemonProcess() as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * TP)
            for r in range(TP):
                (e,) = rounds(ev, r)
                assert e["status"] == "error" and e["phase"] == "begin", e
                assert words in e["message"], e["message"]
        stats = box.stats()
        assert stats["counts"]["pause_count"] == 0 and stats["paused"] is False, stats
    finally:
        box.close()


def test_a_declared_sglang_url_that_serves_vllm_is_refused_naming_both(tmp_path, engine_box):
    """The engine table says SGLang; the URL serves vLLM's code (or the reference engine):
    refused before the pause."""
    with DaemonProcess(args=table(tmp_path, engine_box.url, kind="sglang")) as d:
        ev = run_ranks(d, engine_box.url, True, [{"rounds": 1}] * TP)
        (e,) = rounds(ev, 0)
        assert e["status"] == "error" and 'declared kind = "sglang"' in e["message"], e

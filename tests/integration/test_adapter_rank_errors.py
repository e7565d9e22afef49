"""One rank's own failure in an adapter round, end to end (issue 36, the fresh-user trial's
findings): two rank processes calling ``Publisher.publish_adapter``
(``tests/adapter_trainer.py``) -> a real ``slotsyncd`` with long deadlines (120 s) -> the
reference engine with LoRA on.

* Rank 1's call raises a local ``ValueError`` (its part holds a base-model weight, or a
  tensor of a dtype the wire has not), before or after rank 0 began the round; rank 1 keeps
  its connection (a trainer that goes on). Rank 0's ``publish_adapter`` fails at once (far
  inside the daemon's 120 s begin deadline), with the daemon's error naming rank 1 and its
  exception, ``code "rank_aborted"``; the engine gets no load; the next round lands. Also
  when rank 0 starts (registers) only after the daemon failed rank 1's aborted round: it is
  told that round's id, and its begin of it fails at once.
* Rank 1 registers and exits before rank 0 began (rank 0 registered before, or starts only
  after): rank 0's round fails with ``code "rank_gone"`` naming rank 1, within the daemon's
  ``liveness_s`` (10 s), not its 120 s begin deadline.
* Rank 0 is sent SIGTERM (its handler raises ``SystemExit``) while it waits for the round
  that waits for rank 1's begin: its traceback says it waited for ``Ack(adapter_begin)`` and
  that the daemon waited for the adapter begin of rank 1; rank 1, beginning later, is told
  at once that rank 0 aborted, and why.

Red on main: rank 0 timed out after its own 30 s ("slotsyncd is waiting for the adapter
begin (begin_timeout_s) of rank(s) 1", ``code ""``): rank 1's error had sent nothing; a
base weight was not refused at the rank; rank 0's SIGTERM traceback named nothing it waited
for. Red before the fix of the late start: rank 0 was told the next id past the aborted
round, opened a round of its own and got ``rank_timeout`` after 120 s (its own 30 s timeout
here); an exited rank 1 was waited for until begin_timeout_s likewise.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from adapter_e2e import (  # noqa: E402
    KEY,
    assert_nothing_left,
    assert_ok,
    error_of,
    lora_route_calls,
    run_rounds,
    served,
    slot_status,
    start,
    unload_all,
    vllm_family_box,
)
from adapter_trainer import BAD_DTYPE, BASE_WEIGHT  # noqa: E402
from engines import EngineBox  # noqa: E402
from rank_pool import RankPool  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.protocol import errors  # noqa: E402

pytestmark = pytest.mark.slow

LONG = ["--begin-timeout-s", "120", "--chunk-timeout-s", "120", "--engine-timeout-s", "30"]
"""Deadlines far above what the tests wait: an error that comes, comes from a rank's abort."""
PROMPT_S = 60.0
"""A rank told within this of the failing rank's error was not told by the 120 s deadline."""


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    p = RankPool(2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def box() -> Iterator[EngineBox]:
    b = vllm_family_box("reference")
    yield b
    b.close()


def _result(run, rank: int, k: int = 1) -> dict:
    (e,) = [x for x in run.rounds(rank) if x["round"] == k]
    return e


# (rank 1's error: a base weight in its part, or a dtype the wire has not)
# (rank0_started_later: rank 0 registers only once the daemon failed rank 1's aborted round)
CASES = [("rank0_began", "base_weight", f"adapter tensor {BASE_WEIGHT!r} is a base-model "
          "weight"), ("rank1_failed", "dtype", f"adapter tensor {BAD_DTYPE!r}: "),
         ("rank0_started_later", "base_weight", f"adapter tensor {BASE_WEIGHT!r} is a "
          "base-model weight")]


@pytest.mark.parametrize("first, bad, words", CASES, ids=[c[0] for c in CASES])
def test_a_local_error_on_one_rank_fails_the_others_at_once(pool, box, first, bad, words,
                                                            tmp_path: Path) -> None:
    unload_all(box)
    go = tmp_path / "go"
    with DaemonProcess(args=LONG) as d:
        calls = lora_route_calls(box)
        bad, good = {"version": 1, "bad": bad}, {"version": 1}
        # the later of the two waits for the file the test makes once the first acted
        extra = [{}, {"close_after_file": str(done := tmp_path / "done")}]  # (rank 1 keeps
        # its connection until rank 0 is told: a closed one would fail it as "rank 1 is gone")
        if first == "rank0_began":
            scripts = [[good], [{**bad, "wait_for_file": str(go)}]]
        elif first == "rank1_failed":
            scripts = [[{**good, "wait_for_file": str(go)}], [bad]]
        else:
            scripts, extra[0] = [[good], [bad]], {"register_after_file": str(go)}
        run = start(pool, d, box, scripts, extra=extra)
        went: list[float] = []

        def watch() -> None:
            if run.rounds(0) and not done.exists():
                done.touch()
            if go.exists():
                return
            if first == "rank0_began":
                try:
                    a = slot_status(d, KEY)["adapter_round"] or {}
                except KeyError:  # (no slot until a rank registered: a loaded machine's
                    return        # ranks may take longer than the first look, 0.1 s)
                ready = a.get("ranks_begun") == [0]
            elif first == "rank0_started_later":  # (the daemon failed rank 1's round)
                ready = slot_status(d, KEY)["adapter_rounds_failed"] == 1
            else:
                ready = any(e["event"] == "round" for e in run.events[1])
            if ready:
                went.append(time.monotonic())
                go.touch()

        run.wait(PROMPT_S + 30, watch=watch)
        e1 = _result(run, 1)
        assert e1["error_type"] == "ValueError" and e1["message"].startswith(words), e1
        e0 = error_of(run, 0)  # (the daemon's error, not rank 0's own timeout)
        assert e0["code"] == errors.RANK_ABORTED and e0["phase"] == "adapter_begin", e0
        assert (f"rank 1 aborted adapter round {e0['update_id']} before its begin: "
                f"ValueError: {words}" in e0["message"]), e0
        told_after = run.round_time(0, 1) - went[0]
        assert told_after < PROMPT_S, told_after  # (not the 120 s begin deadline)
        assert lora_route_calls(box) == calls and served(box) == set()  # no engine call
        s = slot_status(d, KEY)
        assert s["adapter_round"] is None and s["adapter_rounds_failed"] == 1
        assert_nothing_left(d, run)
        # the ranks' update ids are still the daemon's: the next round lands
        run = run_rounds(pool, d, box, {"version": 1})
        assert [e["served_name"] for e in assert_ok(run, d, 1)] == ["math@v1"]
    unload_all(box)


def test_a_sigterm_while_the_round_waits_for_another_rank_names_it(pool, box,
                                                                   tmp_path: Path) -> None:
    unload_all(box)
    go = tmp_path / "go"
    with DaemonProcess(args=LONG) as d:
        calls = lora_route_calls(box)
        run = start(pool, d, box, [[{"version": 1}], [{"version": 1, "wait_for_file": str(go)}]],
                    extra=[{"sigterm_exits": True}, {}])
        termed: list[float] = []

        def on_event(r: int, ev: dict) -> None:
            if r == 0 and ev["event"] == "waiting" and ev["phase"] == "adapter_begin":
                os.kill(run.pid(0), signal.SIGTERM)
                termed.append(time.monotonic())

        def watch() -> None:  # (rank 1 begins once rank 0 reported its interrupt)
            if not go.exists() and any(e["event"] == "round" for e in run.events[0]):
                go.touch()

        run.wait(PROMPT_S + 30, on_event=on_event, watch=watch)
        assert termed, run.events
        e0 = _result(run, 0)
        assert e0["error_type"] == "SystemExit" and e0["phase"] == "interrupted", e0
        tb = e0["message"]
        assert "rank 0: interrupted (SystemExit) while publish_adapter waited for " \
            "Ack(adapter_begin) for update" in tb, tb
        assert "slotsyncd is waiting for the adapter begin (begin_timeout_s) of rank(s) 1 " \
            "(adapter round" in tb, tb
        e1 = error_of(run, 1)
        assert e1["code"] == errors.RANK_ABORTED, e1
        assert "rank 0 aborted adapter round" in e1["message"] and \
            "SystemExit: 143 (rank 0: interrupted" in e1["message"], e1
        assert "of rank(s) 1" in e1["message"], e1
        assert run.round_time(1, 1) - termed[0] < PROMPT_S
        assert lora_route_calls(box) == calls and served(box) == set()
        assert_nothing_left(d, run)
    unload_all(box)


@pytest.mark.parametrize("rank0", ["registered", "starts_later"])
def test_a_rank_that_exited_before_its_peer_began_fails_the_round_within_liveness_s(
        pool, box, rank0, tmp_path: Path) -> None:
    """Rank 1 registers and closes its publisher (its trainer raised and exited) before rank
    0 began; rank 0 registered at the start, or only once the daemon saw rank 1 gone (then
    its registration releases the slot for a new job). Rank 0's round fails with
    ``rank_gone`` naming rank 1 within liveness_s (10 s), not at the 120 s begin deadline
    (nor at rank 0's own 30 s timeout)."""
    unload_all(box)
    go = tmp_path / "go"
    with DaemonProcess(args=LONG) as d:
        calls = lora_route_calls(box)
        if rank0 == "registered":
            scripts, extra = [[{"version": 1, "wait_for_file": str(go)}], []], [{}, {}]
        else:
            scripts, extra = [[{"version": 1}], []], [{"register_after_file": str(go)}, {}]
        run = start(pool, d, box, scripts, extra=extra)
        went: list[float] = []

        def watch() -> None:  # (rank 0 goes on once the daemon saw rank 1 gone)
            if go.exists():
                return
            ranks = {r["rank"]: r for r in slot_status(d, KEY)["ranks"]}
            if 1 in ranks and not ranks[1]["alive"]:
                went.append(time.monotonic())
                go.touch()

        run.wait(PROMPT_S + 30, watch=watch)
        assert went, run.events
        e0 = error_of(run, 0)  # (the daemon's error, not rank 0's own timeout)
        assert e0["code"] == errors.RANK_GONE and e0["phase"] == "adapter_begin", e0
        assert "rank 1" in e0["message"] and "is gone" in e0["message"], e0
        assert "liveness_s" in e0["message"], e0
        assert run.round_time(0, 1) - went[0] < PROMPT_S  # (not the 120 s begin deadline)
        assert lora_route_calls(box) == calls and served(box) == set()
        s = slot_status(d, KEY)
        assert s["adapter_round"] is None and s["adapter_rounds_failed"] == 1
        assert_nothing_left(d, run)
        run = run_rounds(pool, d, box, {"version": 1})  # (a new rank 1: the next round lands)
        assert [e["served_name"] for e in assert_ok(run, d, 1)] == ["math@v1"]
    unload_all(box)

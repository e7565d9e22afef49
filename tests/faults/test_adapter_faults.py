"""Adapter rounds when things go wrong (issue 36 D, "Faults, both engines"), end to end: two
rank processes calling ``Publisher.publish_adapter`` (``tests/adapter_trainer.py``) -> a real
``slotsyncd`` with short deadlines -> the vLLM-code engine (vLLM 0.32's LoRA routes and worker
LoRA manager, ``"host"``: rows split over both ranks) or the SGLang-code engine (SGLang
0.5.23's LoRA code on 2 TP ranks, ``"device"``: rank 1 holds the adapter, rank 0 sends
``{}``). Each fault is injected where the issue names it:

* a load the engine refuses (400, the engines' fault tables on their load routes);
* the engine dying mid-load (vLLM: its process exits once the workers got the load; SGLang:
  TP rank 1 raises after rank 0 answered, which kills SGLang), then a restart;
* a rank SIGKILLed after its ``AdapterBegin``, before or after its ``AdapterData``;
* a version not above the one served; LoRA off; a rank above ``max_lora_rank``;
* a base-weight round and an adapter round on one slot at once (the later is refused).

After each: every surviving rank is told by the daemon (not its own timeout), naming the
round, the cause (the dead rank, the flag to set) and the version that stays served; the
engine holds exactly the previous version (sha256 of each tensor as it read them) and
nothing of the failed one; no load call went out where the refusal comes "before any
call"; nothing is left in ``/dev/shm`` nor mapped by the daemon; the next round lands.
The restart between rounds (vLLM reloads from the folder, SGLang marks lost):
``tests/integration/test_adapter_rounds_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from adapter_e2e import (  # noqa: E402
    FAST,
    adapters_of,
    assert_holds,
    assert_nothing_left,
    assert_ok,
    error_of,
    family_of,
    folders,
    lora_route_calls,
    lora_state,
    run_rounds,
    served,
    sglang_box,
    slot_status,
    start,
    unload_all,
    vllm_family_box,
)
from engines import EngineBox  # noqa: E402
from rank_pool import RankPool  # noqa: E402
from state_readers import wait_for  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402

pytestmark = pytest.mark.slow

FAMILIES = [pytest.param("vllm", id="vllm-code", marks=pytest.mark.vllm),
            pytest.param("sglang", id="sglang", marks=pytest.mark.sglang)]
LOAD_ROUTE = {"vllm": "load_lora_adapter", "sglang": "load_lora_adapter_from_tensors"}


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    p = RankPool(3)
    yield p
    p.close()


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineBox]]:
    """The module's engines, started when a test first needs one."""
    made: dict[str, EngineBox] = {}
    yield made
    for b in made.values():
        b.close()


@pytest.fixture(params=FAMILIES)
def box(request: pytest.FixtureRequest, engines: dict[str, EngineBox]) -> Iterator[EngineBox]:
    fam = request.param
    if fam not in engines:
        engines[fam] = vllm_family_box("vllm") if fam == "vllm" else sglang_box()
    b = engines[fam]
    unload_all(b)
    yield b
    unload_all(b)


def step(box: EngineBox, version: int, **kw) -> dict:
    """One adapter round of ``version``: rows over both ranks on vLLM; on SGLang rank 1
    holds every tensor (the rank the faults kill is the one whose memory is read)."""
    layout = {"layout": "one", "holder": 1} if box.is_sglang else {}
    return {"version": version, **layout, **kw}


def worker_reads(box: EngineBox) -> list[object]:
    """What each worker (TP rank) has read of adapters: vLLM's worker LoRA managers' count
    of folders read (``loads``; their caches keep unloaded adapters, so a count is what
    tells that nothing new was read), SGLang's TP ranks' names held."""
    state = lora_state(box)
    if box.is_sglang:
        return [sorted(state["ranks"].get(f"tp{r}", {})) for r in range(2)]
    return [w["loads"] for w in state["workers"]]


def assert_previous_served(d, box: EngineBox, version: int) -> None:
    """``math@v<version>`` is what the engine lists and every worker holds (the trainer's
    bytes); the daemon's ``/status`` says so; nothing else is held."""
    name = f"math@v{version}"
    assert served(box) == {name}
    assert_holds(box, name, family_of(box), version)
    assert adapters_of(d) == [(name, "served")]


def assert_told(e: dict, round_text: str, *words: str) -> None:
    """A rank's error is the daemon's, names the slot, the round and ``words``."""
    assert e["slot"] == (0, 2) and e["fatal"] is True, e
    assert f"adapter round {e['update_id']} ({round_text})" in e["message"], e
    for w in words:
        assert w in e["message"], (w, e["message"])


# ------------------------------------------------------------------------------ engine faults


def test_a_load_the_engine_refuses_leaves_the_previous_version_served(pool, box):
    """v1 served; the engine answers v2's load with a 400: both ranks are told with the
    engine's text and "math@v1 stays served"; the engine lists and holds v1, no worker read
    anything of v2 (nothing half loaded); the daemon removed v2's folder (vLLM); nothing is left in
    ``/dev/shm``. v2 published again lands."""
    fam = family_of(box)
    with DaemonProcess(args=FAST) as d:
        assert_ok(run_rounds(pool, d, box, step(box, 1)), d, 1)
        box.request("POST", "/_slotsync/fault", {"route": LOAD_ROUTE[fam], "status": 400,
                                                 "message": "refused by the test"})
        reads = worker_reads(box)
        run = run_rounds(pool, d, box, step(box, 2))
        for r in (0, 1):
            e = error_of(run, r)
            assert e["phase"] == "adapter_data", e
            assert_told(e, "math@v2", "refused by the test", "(math@v1 stays served)")
        assert_previous_served(d, box, 1)
        assert worker_reads(box) == reads
        assert wait_for(lambda: folders(d) == ([] if box.is_sglang else ["math@v1"]), 10), (
            folders(d))
        assert_nothing_left(d, run)
        run = run_rounds(pool, d, box, step(box, 2))
        assert [e["served_name"] for e in assert_ok(run, d, 1)] == ["math@v2"]
        assert_holds(box, "math@v2", fam, 2)


def test_the_engine_dying_mid_load(pool, box):
    """v1 served; the engine dies during v2's load (vLLM: the process exits once its workers
    got the load, unanswered; SGLang: TP rank 1 raises after TP rank 0 answered, so the
    load's reply may be a success -- then the daemon's call proving every TP rank's copy
    fails).
    Both ranks are told, naming v2, that the engine did not answer and that what it serves
    is checked at its next answer (red before: "(math@v1 stays served)", of an engine that
    had died); no Ack(adapter_data) went out; their memory is freed. The engine started
    again holds nothing: the next round, v3, lands (vLLM: v1 loaded again from its folder
    first -- by the daemon's idle watch or by the round --, then v3, then v1 unloaded;
    SGLang: v1 marked lost, said so), and v2's folder is gone."""
    fam = family_of(box)
    fault = ({"route": LOAD_ROUTE[fam], "workers": [1], "message": "TP rank 1 died"}
             if box.is_sglang else {"route": LOAD_ROUTE[fam], "exit": True, "hang_s": 0.3})
    with DaemonProcess(args=FAST) as d:
        assert_ok(run_rounds(pool, d, box, step(box, 1)), d, 1)
        box.request("POST", "/_slotsync/fault", fault)
        run = run_rounds(pool, d, box, step(box, 2))
        for r in (0, 1):
            e = error_of(run, r)
            assert e["phase"] == "adapter_data", e
            assert_told(e, "math@v2", "did not answer", "what it serves is checked at its "
                        "next answer; it served math@v1 before this round")
            assert "stays served" not in e["message"], e
            # (SGLang: the proving call fails, or the load's reply is lost with the engine)
            assert ("(asked to prove its copies done)" in e["message"]
                    or "(asked to load it)" in e["message"]), e
        assert wait_for(lambda: not box.alive(), 30), "the engine did not die"
        assert_nothing_left(d, run)
        box.start_again()
        run = run_rounds(pool, d, box, step(box, 3))
        assert [e["served_name"] for e in assert_ok(run, d, 1)] == ["math@v3"]
        assert_holds(box, "math@v3", fam, 3)
        assert wait_for(lambda: served(box) == {"math@v3"}, 30), served(box)
        assert wait_for(lambda: adapters_of(d) == [("math@v3", "served")], 10), adapters_of(d)
        log = d.log_tail(30000)
        if box.is_sglang:  # (the new engine: v3 loaded, nothing to unload)
            assert "adapter_lost" in log, log
            assert lora_route_calls(box) == {"load_lora_adapter_from_tensors": 1}
        else:  # (the new engine: v1 again, v3, v1's unload)
            assert "adapter_reloaded" in log, log
            assert lora_route_calls(box) == {"load_lora_adapter": 2, "unload_lora_adapter": 1}
            assert wait_for(lambda: folders(d) == ["math@v1", "math@v3"], 10), folders(d)
        assert_nothing_left(d, run)


# ------------------------------------------------------------------------------ rank faults


@pytest.mark.parametrize("when", ["before_data", "after_data"])
def test_a_rank_killed_mid_adapter(pool, box, when, tmp_path: Path):
    """v1 served. In v2's round rank 1 sends its ``AdapterBegin`` and is SIGKILLed before
    its ``AdapterData`` (while rank 0's is in), or after it (rank 0 sends its own once the
    daemon saw rank 1 die: had it come first, the round could go on with the dead rank's
    memory, read intact or failing checked): rank 0 is told by the daemon, naming rank 1
    and its pid; no load goes out; v1 stays served and held, no worker read anything new;
    nothing of the dead rank's part is left in ``/dev/shm`` nor mapped by the daemon. New
    processes for both ranks publish v2."""
    fam = family_of(box)
    go = tmp_path / "go"
    with DaemonProcess(args=FAST) as d:
        assert_ok(run_rounds(pool, d, box, step(box, 1)), d, 1)
        calls, reads = lora_route_calls(box), worker_reads(box)
        s0 = step(box, 2, **({"hold_data_until": str(go)} if when == "after_data" else {}))
        s1 = step(box, 2, **{f"stall_{when}": 30})
        run = start(pool, d, box, [[s0], [s1]])

        def on_event(r: int, ev: dict) -> None:
            if r == 1 and ev["event"] == "stalling" and 1 not in run.killed:
                run.kill(1)

        def watch() -> None:  # (rank 0's data goes once the daemon saw rank 1 die)
            if 1 in run.killed and not go.exists() and not all(
                    x["alive"] for x in slot_status(d, (0, 2))["ranks"]):
                go.touch()

        run.wait(60, on_event=on_event, watch=watch)
        assert 1 in run.killed, run.events
        e = error_of(run, 0)
        assert e["phase"] == "adapter_data" and e["missing_ranks"] == [1], e
        assert_told(e, "math@v2", f"rank 1 (pid {run.pid(1)} on", "is gone",
                    "(math@v1 stays served)")
        assert lora_route_calls(box) == calls  # (no load, no unload)
        assert_previous_served(d, box, 1)
        assert worker_reads(box) == reads
        assert slot_status(d, (0, 2))["adapter_round"] is None
        assert_nothing_left(d, run)
        if not box.is_sglang:
            assert folders(d) == ["math@v1"]
        run = run_rounds(pool, d, box, step(box, 2))
        assert [e["served_name"] for e in assert_ok(run, d, 1)] == ["math@v2"]
        assert_holds(box, "math@v2", fam, 2)


# ------------------------------------------------------------------------------ refusals


def test_a_version_not_above_the_served_one_is_refused_before_any_engine_call(pool, box):
    """v2 served; the ranks publish v1: refused at the begin, naming both versions and what
    to do, with no call to the engine at all (the daemon's count of its engine calls
    unchanged). v2 again: refused after the read-only calls that list what the engine
    holds, with no load or unload (the engine's count of its LoRA routes unchanged)."""
    with DaemonProcess(args=FAST) as d:
        assert_ok(run_rounds(pool, d, box, step(box, 2)), d, 1)
        calls, engine_calls = lora_route_calls(box), slot_status(d, (0, 2))["engine_calls"]
        run = run_rounds(pool, d, box, step(box, 1))
        for r in (0, 1):
            e = error_of(run, r)
            assert e["phase"] == "adapter_begin", e
            assert_told(e, "math@v1", "'math' version 1 is a version older than version 2",
                        "serves as math@v2", "publish a version above 2",
                        "(math@v2 stays served)")
        assert slot_status(d, (0, 2))["engine_calls"] == engine_calls  # (none at all)
        # the same version: refused once the engine's list showed it still holds it (a
        # restarted engine that lost it may be given it again), before any load
        run = run_rounds(pool, d, box, step(box, 2))
        for r in (0, 1):
            e = error_of(run, r)
            assert e["phase"] == "adapter_begin", e
            assert_told(e, "math@v2", "'math' version 2 is the same version as version 2")
        asked = {k: v - engine_calls.get(k, 0)
                 for k, v in slot_status(d, (0, 2))["engine_calls"].items()}
        assert {k for k, v in asked.items() if v} <= {"version", "server_info", "models"}, asked
        assert lora_route_calls(box) == calls
        assert_previous_served(d, box, 2)
        assert_nothing_left(d, run)


def test_a_rank_above_max_lora_rank_is_refused_before_any_load(pool, box):
    """r=32 against ``--max-lora-rank`` 16 (vLLM) / 8 (SGLang): refused at the begin
    naming the flag, no load or unload call; nothing served."""
    with DaemonProcess(args=FAST) as d:
        calls = lora_route_calls(box)
        run = run_rounds(pool, d, box, step(box, 1, r=32))
        for r in (0, 1):
            e = error_of(run, r)
            assert e["phase"] == "adapter_begin", e
            assert_told(e, "math@v1", "--max-lora-rank", "32")
        assert lora_route_calls(box) == calls and served(box) == set()
        assert adapters_of(d) == []
        assert_nothing_left(d, run)


@pytest.mark.parametrize("fam", FAMILIES)
def test_an_engine_without_lora_is_refused_before_any_load(pool, fam):
    """An engine started without ``--enable-lora``: refused at the begin, naming the flag;
    the engine's load route never called."""
    box = vllm_family_box("vllm", lora={}) if fam == "vllm" else sglang_box(
        lora={"sglang_version": "0.5.23"})
    try:
        with DaemonProcess(args=FAST) as d:
            run = run_rounds(pool, d, box, step(box, 1))
            for r in (0, 1):
                e = error_of(run, r)
                assert e["phase"] == "adapter_begin", e
                assert_told(e, "math@v1", "does not serve LoRA adapters", "--enable-lora",
                            "(no version of 'math' is served)")
            assert not any(lora_route_calls(box).values()), lora_route_calls(box)
            assert_nothing_left(d, run)
    finally:
        box.close()


# ------------------------------------------------------------------------------ overlap


@pytest.mark.parametrize("first", ["adapter", "base"])
def test_a_base_round_and_an_adapter_round_never_overlap(pool, box, first):
    """v1 served. Rank 0 opens a round (an adapter round of v2, or a base-weight round);
    rank 1 calls the other kind a second later. The daemon refuses the later one at once,
    saying which round is in flight and to publish after it (the core's choice: refused,
    not held); the first fails, naming rank 1 (whose publisher then closed; else at the
    begin deadline). No engine call
    changed anything: v1 is served and held, the engine is not paused; nothing is left in
    ``/dev/shm``."""
    adapter, base = step(box, 2), {"kind": "base", "version": 2}
    firsts = {"adapter": adapter, "base": base}
    later = {**(base if first == "adapter" else adapter), "delay_s": 1.0}
    with DaemonProcess(args=FAST) as d:
        assert_ok(run_rounds(pool, d, box, step(box, 1)), d, 1)
        calls = lora_route_calls(box)
        run = start(pool, d, box, [[firsts[first]], [later]])
        run.wait(60)
        e1, e0 = error_of(run, 1), error_of(run, 0)
        assert e0["missing_ranks"] == [1] and f"rank 1 (pid {run.pid(1)} on" in e0["message"]
        if first == "adapter":
            assert e1["phase"] == "begin", e1
            assert f"adapter round {e0['update_id']} (math@v2) is in flight" in e1["message"]
            assert "a base-weight update never overlaps an adapter round" in e1["message"]
            assert e0["phase"] == "adapter_begin", e0
            assert_told(e0, "math@v2", "(math@v1 stays served)")
        else:
            assert e1["phase"] == "adapter_begin", e1
            assert f"base-weight update {e0['update_id']} is in flight" in e1["message"], e1
            assert "an adapter round never overlaps it" in e1["message"], e1
            assert f"update {e0['update_id']}" in e0["message"], e0
        assert lora_route_calls(box) == calls
        assert_previous_served(d, box, 1)
        assert box.is_paused() is False
        assert_nothing_left(d, run)

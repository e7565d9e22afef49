"""The idle watch of an engine's adapters (issue 36 findings; ``daemon/core/adapters/watch.py``)
and what goes with it, through the I/O-free slot table: the scripted engine of
``test_adapter_rounds`` answers each call, the watch's tick is ``SlotTable.adapter_watch``.

Red on the old code: ``SlotTable.adapter_watch`` did not exist (a restarted engine was found
only at the next round's begin, ``/status`` said ``served`` until then); a restarted daemon
adopted no folder (``AdapterLedger.reconcile`` adopted names without one) and nothing swept
the folders it found; an adapter round after a worker's failed load sent its load without
checking the executor's replies; a base round whose probe found a new session marked lost an
SGLang version loaded since the restart; a load the engine did not answer said "(v1 stays
served)" (``test_adapter_rounds``' no-answer cases)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from test_adapter_rounds import INFO, LoraEngine, LoraHarness, started, whole_parts
from test_coordinator import chunk

from slotsync.daemon.core.actions import EngineCall
from slotsync.daemon.core.update import Timeouts
from slotsync.protocol.wire import Begin, Commit

FOLDER = "/adapters/slot-0-2/math@v1"
WORKER_FAILED = "load_lora_adapter: HTTP 500: Worker failed with error 'no such folder'"


def tick(h: LoraHarness) -> list[str]:
    """One tick of the watch, its calls run through the engine (held ones kept); returns
    the routes the tick asked."""
    actions = h.table.adapter_watch(h.now)
    routes = [a.route for a in actions if isinstance(a, EngineCall)]
    h.run(actions)
    return routes


def states(h: LoraHarness) -> list[tuple[str, str]]:
    return [(a["served_name"], a["state"]) for a in h.coord.status()["adapters"]]


def served_v1(kind: str = "vllm", **kw) -> LoraHarness:
    """v1 served by a slot of two ranks, the engine's list read once (the watch's first
    look), so that each test's ticks start from an engine the watch knows."""
    h = started(kind=kind, **kw)
    h.adapter_round(0, version=1, **({"parts": whole_parts()} if kind == "sglang" else {}))
    assert states(h) == [("math@v1", "served")]
    return h


def events(h: LoraHarness, name: str) -> list[dict]:
    return [e.fields for e in h.events if e.event == name]


# ------------------------------------------------------------------------------ ticks


def test_a_tick_lists_an_idle_engine_and_probes_it_once_its_weight_version_is_known():
    h = started()
    assert tick(h) == ["models"]  # (the first look: what the engine holds)
    assert tick(h) == []  # (no adapter in the ledger: nothing to watch)
    h.adapter_round(0, version=1)
    assert tick(h) == ["models"]  # (no weight version known: the list alone)
    h.round(1)  # a base round: the daemon saw the engine's weight version
    assert tick(h) == ["models", "weight_info"]
    assert h.coord.status()["adapter_watch_calls"] == {"models": 3, "weight_info": 1}
    assert "models" not in h.coord.status()["engine_calls"] or (
        h.coord.status()["engine_calls"]["models"] == 2)  # (the rounds' own, not the watch's)


def test_the_watch_is_off_at_zero():
    h = served_v1(timeouts=Timeouts(10, 10, 10, adapter_watch_s=0))
    h.engine.restart()
    calls = len(h.engine.calls)
    assert tick(h) == [] and len(h.engine.calls) == calls
    assert states(h) == [("math@v1", "served")]


def test_no_look_while_a_round_or_any_call_of_the_slot_is_out():
    h = served_v1()
    h.engine.hold = True
    for r in range(2):
        h.send(r, Begin(1, "w1"))  # a base round: its probe is out
    assert h.coord.current is not None and tick(h) == []
    h.answer_pending()
    for r in range(2):
        h.send(r, chunk(1, 0, r))
    for r in range(2):
        h.send(r, Commit(1, 1))
    assert h.coord.current is None and h.ended[-1].outcome == "success"
    h.adapter_round(2, version=2, data=False)  # an adapter round waiting for its data
    assert h.acks(0)[-1] == ("adapter_begin", "host") and tick(h) == []


# ------------------------------------------------------------------------------ answers


def test_a_restarted_vllm_engine_is_reloaded_from_the_folder_without_a_round():
    h = served_v1()
    h.engine.restart()  # (it lists nothing now)
    h.engine.hold = True
    assert tick(h) == ["models"]
    h.answer_until("load_lora_adapter")  # the list answered: the reload is out
    assert states(h) == [("math@v1", "reloading")]
    h.answer_pending()
    assert states(h) == [("math@v1", "served")] and set(h.engine.loras) == {"math@v1"}
    assert h.engine.bodies[-1] == {"lora_name": "math@v1", "load_inplace": False,
                                   "lora_path": FOLDER}
    (reloaded,) = events(h, "adapter_reloaded")
    assert reloaded["served_name"] == "math@v1" and reloaded["folder"] == FOLDER
    assert tick(h) == ["models"] and events(h, "adapter_reloaded") == [reloaded]  # (once)


def test_a_restarted_sglang_engine_shows_lost_without_a_round():
    h = served_v1("sglang")
    h.engine.restart()
    loads = h.engine.calls.count("load_lora_adapter")
    assert tick(h) == ["models"]
    assert states(h) == [("math@v1", "lost")]
    (lost,) = events(h, "adapter_lost")
    assert "publish version 1 of 'math' again" in lost["why"]
    assert h.engine.calls.count("load_lora_adapter") == loads  # (the daemon has no copy)
    assert h.coord.status()["adapters"][0]["error"] == lost["why"]
    tick(h)
    assert len(events(h, "adapter_lost")) == 1  # (said once)


def test_an_engine_that_does_not_answer_is_unreachable_not_lost():
    h = served_v1("sglang")
    h.engine.fail[("models", h.engine.calls.count("models"))] = (
        "models: cannot reach http://engine:8000: Connection refused")
    assert tick(h) == ["models"]
    s = h.coord.status()
    assert states(h) == [("math@v1", "served")] and "Connection refused" in s[
        "engine_unreachable"]
    assert events(h, "adapter_lost") == []


def test_an_engine_left_paused_is_only_seen_to_answer():
    """A failed base round left the engine paused (or maybe mid-update): the next base
    round, a full one, checks it; the watch asks its list only to see whether it answers
    (a refused connection meanwhile lets that round's probe see a restart) and changes no
    adapter, whatever the list says."""
    h = served_v1()
    h.coord.engine.paused = True
    h.engine.restart()
    loads = h.engine.calls.count("load_lora_adapter")
    assert tick(h) == ["models"]
    assert states(h) == [("math@v1", "served")]
    assert h.engine.calls.count("load_lora_adapter") == loads
    h.engine.fail[("models", h.engine.calls.count("models"))] = (
        "models: cannot reach http://engine:8000: Connection refused")
    tick(h)
    assert h.coord.status()["engine_unreachable"] and states(h) == [("math@v1", "served")]


def test_a_new_weight_version_is_a_restart_and_is_taken_once():
    """The begin's probe rule: a weight version other than the one the daemon last saw is a
    new engine session, even where the engine still lists the name (e.g. loaded again at
    its start from the daemon's folder): the ledger is reconciled as after a restart, once;
    the base round's probe still sees the new session (the engine's facts are its own)."""
    h = served_v1()
    h.round(1)
    h.engine.restart()
    h.engine.loras["math@v1"] = {"lora_name": "math@v1", "lora_path": FOLDER}
    assert tick(h) == ["models", "weight_info"]
    assert events(h, "adapter_watch_restart")[0]["weight_version"] == "default"
    assert h.engine.calls[-1] == "load_lora_adapter"  # reloaded: "already loaded" is served
    assert states(h) == [("math@v1", "served")]
    loads = h.engine.calls.count("load_lora_adapter")
    tick(h)
    assert h.engine.calls.count("load_lora_adapter") == loads  # (taken once)
    h.round(2)  # (its probe sees the new session itself: initialised again, a full update)
    assert h.engine.calls.count("init_weight_transfer_engine") == 2
    assert h.coord.engine.version == "v2" and states(h) == [("math@v1", "served")]
    h.engine.restart()  # (again: "default" once more, after "v2" this time)
    h.engine.loras["math@v1"] = {"lora_name": "math@v1", "lora_path": FOLDER}
    tick(h)
    assert [e["last_seen"] for e in events(h, "adapter_watch_restart")] == ["v1", "v2"]


def test_a_watch_answer_that_comes_after_a_round_began_is_dropped():
    """The engine restarted; the watch's list is out when an adapter round begins. The round
    does not wait for it; the list's answer changes nothing (the ledger still says served,
    no reload goes out from it); the round's own list reloads v1, once."""
    h = served_v1()
    h.engine.restart()
    h.engine.hold = True
    assert tick(h) == ["models"]
    (watch_call,) = h.pending_calls
    h.adapter_round(1, version=2, data=False)
    assert [c.route for c in h.pending_calls] == ["models", "version", "server_info"]
    h.pending_calls.remove(watch_call)
    h.run(h.coord.on_engine_result(watch_call.call_id, *h.engine.answer(watch_call), h.now))
    assert states(h) == [("math@v1", "served")] and h.pending_calls[-1].route != (
        "load_lora_adapter")
    h.answer_pending()
    assert h.acks(0)[-1] == ("adapter_begin", "host")
    assert h.engine.calls.count("load_lora_adapter") == 2  # v1 at round 0, again once
    assert len(events(h, "adapter_reloaded")) == 1


def test_a_round_waits_for_the_watchs_reload():
    h = served_v1()
    h.engine.restart()
    h.engine.hold = True
    tick(h)
    reload = h.answer_until("load_lora_adapter")
    h.adapter_round(1, version=2, data=False)
    assert [c.route for c in h.pending_calls] == ["load_lora_adapter"]  # (no info call yet)
    h.pending_calls.remove(reload)
    h.engine.hold = False
    h.run(h.coord.on_engine_result(reload.call_id, *h.engine.answer(reload), h.now))
    assert h.engine.calls[-3:] == INFO and h.acks(0)[-1] == ("adapter_begin", "host")


def test_an_sglang_version_loaded_after_a_restart_stays_served_after_the_next_base_round():
    """Red before: a base round whose probe found a new session marked every served version
    lost (``AdapterLedger.restarted``), v2 too, which the engine had loaded after its restart;
    now the engine's list says what it lost."""
    h = served_v1("sglang")
    h.engine = SglangEngine(**vars(h.engine))
    h.round(1)
    h.engine.restart()
    h.adapter_round(2, version=2, parts=whole_parts(2))
    assert states(h) == [("math@v2", "served")]
    h.round(3)
    assert states(h) == [("math@v2", "served")]


@dataclass
class SglangEngine(LoraEngine):
    """The scripted engine as SGLang for base rounds too (no init body: SGLang's client
    answers the init step itself, ``sglang/routes.py``)."""

    def answer(self, call: EngineCall) -> tuple[bool, object, str]:
        if call.route == "init_weight_transfer_engine" and call.body is None:
            call = dataclasses.replace(call, body={"init_info": {"packed": True}})
        return super().answer(call)


# ------------------------------------------------------------------------------ adoption


def fresh_daemon(loras: dict, kind: str = "vllm", **kw) -> LoraHarness:
    """A daemon that started now (its ledger empty, ``adapter_dir`` ``/adapters``) beside an
    engine holding ``loras`` (name -> its load body)."""
    h = LoraHarness(2, **kw)
    h.table.adapter_root = "/adapters/"
    h.register_all()
    h.coord.adapter_root = h.table.adapter_root
    h.coord.engine.declare_kind(kind)
    h.engine.sglang = kind == "sglang"
    h.engine.loras.update(loras)
    return h


def test_a_restarted_daemon_adopts_what_the_engine_loaded_from_its_folders():
    h = fresh_daemon({"math@v3": {"lora_path": "/adapters/slot-0-2/math@v3"},
                      "code@v1": {"lora_path": "/elsewhere/code@v1"},
                      "mine": {"lora_path": "/adapters/slot-0-2/mine"}})
    h.hold_sweeps = True
    assert tick(h) == ["models"]
    assert states(h) == [("code@v1", "served"), ("math@v3", "served")]
    entries = h.coord.adapters.entries
    assert entries["math@v3"].folder == "/adapters/slot-0-2/math@v3"
    assert entries["code@v1"].folder == ""  # (not the daemon's folder)
    (sweep,) = h.sweeps
    assert sweep.slot == (0, 2) and sweep.keep == {"/adapters/slot-0-2/math@v3"}
    # a round waits for the sweep (no folder it writes is ever swept)
    h.adapter_round(0, version=4, data=False)
    assert "version" not in h.engine.calls
    h.run(h.table.on_adapter_swept((0, 2), sweep.call_id, h.now))
    assert h.engine.calls[-3:] == INFO and h.acks(0)[-1] == ("adapter_begin", "host")


def test_an_adopted_version_is_reloaded_from_its_folder_after_a_restart():
    h = fresh_daemon({"math@v3": {"lora_path": "/adapters/slot-0-2/math@v3"}})
    tick(h)
    h.engine.restart()
    tick(h)
    assert h.engine.bodies[-1] == {"lora_name": "math@v3", "load_inplace": False,
                                   "lora_path": "/adapters/slot-0-2/math@v3"}
    assert states(h) == [("math@v3", "served")]
    assert len(h.sweeps) == 1  # (once per slot)


def test_a_rounds_begin_adopts_the_folder_too_and_it_is_retired_as_the_daemons_own():
    """With the watch off the round's own list adopts v3 with its folder; v4 replaces it,
    v5 replaces v4, and v3's folder goes then (one version kept), as a folder it wrote."""
    h = fresh_daemon({"math@v3": {"lora_path": "/adapters/slot-0-2/math@v3"}},
                     timeouts=Timeouts(10, 10, 10, adapter_watch_s=0))
    assert tick(h) == []
    h.adapter_round(0, version=4)
    assert h.acks(0)[-1] == ("adapter_data", "math@v4") and set(h.engine.loras) == {"math@v4"}
    assert [e["served_name"] for e in events(h, "adapter_found")] == ["math@v3"]
    assert "adopted" in events(h, "adapter_found")[0]["why"] and h.removed == []
    h.adapter_round(1, version=5)
    assert h.removed == ["/adapters/slot-0-2/math@v3"]


def test_the_first_look_at_an_sglang_engine_adopts_without_a_folder():
    h = fresh_daemon({"math@v2": {"lora_name": "math@v2"}}, kind="sglang")
    tick(h)
    assert states(h) == [("math@v2", "served")]
    assert h.coord.adapters.entries["math@v2"].folder == ""
    assert h.sweeps[0].keep == frozenset()


# ------------------------------------------------------------------------------ replies


@dataclass
class StaleEngine(LoraEngine):
    """A scripted engine whose executor replies can be out of step (``stale``: the check
    reads an earlier call's reply, vLLM gh-58242)."""

    stale: bool = False

    def answer(self, call: EngineCall) -> tuple[bool, object, str]:
        if call.route == "check_replies" and self.stale:
            self.calls.append(call.route)
            return True, {"results": ["None", "1"]}, ""
        return super().answer(call)


def stale_harness() -> LoraHarness:
    h = LoraHarness(2)
    h.engine = StaleEngine(world_size=2)
    h.register_all()
    h.coord.engine.declare_kind("vllm")
    return h


def test_the_next_adapter_load_after_a_workers_failure_checks_the_replies_first():
    """Red before: the load went out with the replies in doubt (a failed load on one of the
    engine's workers, vLLM gh-58242: ``note_reply_trouble``)."""
    h = started()
    h.adapter_round(0, version=1)
    h.engine.fail[("load_lora_adapter", 1)] = WORKER_FAILED
    h.adapter_round(1, version=2)
    assert h.coord.engine.replies_suspect
    at = len(h.engine.calls)
    h.adapter_round(2, version=2)
    assert h.engine.calls[at:] == [*INFO, "check_replies", "load_lora_adapter",
                                   "unload_lora_adapter"]
    assert not h.coord.engine.replies_suspect and h.acks(0)[-1] == ("adapter_data", "math@v2")


def test_replies_out_of_step_fail_the_adapter_round_until_the_engine_restarted():
    h = stale_harness()
    h.round(0)  # (the daemon knows the engine's weight version)
    h.adapter_round(1, version=1)
    h.engine.fail[("load_lora_adapter", 1)] = WORKER_FAILED
    h.adapter_round(2, version=2)
    h.engine.stale = True
    h.adapter_round(3, version=2, data=False)
    err = h.error(0, 3)
    assert err.phase == "adapter_begin" and "executor replies are out of step" in err.message
    assert "(math@v1 stays served)" in err.message
    assert h.engine.calls.count("load_lora_adapter") == 2  # (v1, the failed v2: no more)
    h.engine.loras.clear()  # (whatever it lists, an engine out of step is only seen to answer)
    assert tick(h) == ["models"] and states(h) == [("math@v1", "served")]
    assert h.engine.calls[-1] == "models"  # (no reload, no check)
    h.engine.loras["math@v1"] = {"lora_name": "math@v1", "lora_path": FOLDER}
    h.adapter_round(4, version=2, data=False)  # the same engine: refused again
    assert "out of step" in h.error(0, 4).message
    assert "weight_info" in h.engine.calls[-5:]  # (its probe: no new session)
    h.engine.restart()
    h.engine.stale = False
    h.adapter_round(5, version=2)
    assert h.acks(0)[-1] == ("adapter_data", "math@v2")  # the probe saw the new process
    assert h.coord.engine.out_of_step is None and "engine_session_new" in [
        e.event for e in h.events]


def test_the_watch_checks_the_replies_before_it_looks():
    h = started()
    h.adapter_round(0, version=1)
    h.coord.engine.replies_suspect = True
    assert tick(h) == ["check_replies"]
    assert not h.coord.engine.replies_suspect
    assert tick(h) == ["models"]


def test_the_watch_finds_replies_out_of_step_and_says_so_once():
    h = stale_harness()
    h.adapter_round(0, version=1)
    h.coord.engine.replies_suspect = True
    h.engine.stale = True
    assert tick(h) == ["check_replies"]
    assert h.coord.engine.out_of_step and len(events(h, "engine_replies_out_of_step")) == 1
    assert tick(h) == ["models"] and len(events(h, "engine_replies_out_of_step")) == 1


# ------------------------------------------------------------------------------ the service


async def test_the_sweep_removes_only_a_previous_daemons_unneeded_folders_of_that_slot(
        tmp_path):
    """``AdapterIO.sweep`` (the ``SweepAdapterFolders`` action): of the folders found at
    start, those of the slot not kept and not written since by this daemon; never a temp
    folder (removed at start anyway), never another slot's."""
    from slotsync.daemon.service.adapter_io import TEMP_PREFIX, AdapterIO

    root = tmp_path / "adapters"
    for slot in ("slot-0-2", "slot-2-4"):
        for name in ("math@v1", "math@v2", "math@v3", f"{TEMP_PREFIX}math@v4"):
            (root / slot / name).mkdir(parents=True)
    io = AdapterIO(root)
    io.prepare()
    mine = root / "slot-0-2"
    io.written.add(str(mine / "math@v3"))  # (published again since the start)
    gone = await io.sweep((0, 2), frozenset({str(mine / "math@v2")}))
    assert gone == [str(mine / "math@v1")]
    assert sorted(p.name for p in mine.iterdir()) == ["math@v2", "math@v3"]
    assert sorted(p.name for p in (root / "slot-2-4").iterdir()) == [
        "math@v1", "math@v2", "math@v3"]
    io.close(set())


async def test_the_timer_ticks_at_once_then_every_interval():
    import asyncio
    import contextlib

    from slotsync.daemon.service.adapter_watch import AdapterWatchTimer

    ticks: list[float] = []
    ran: list[list] = []
    clock = iter(range(100))

    async def execute(actions: list) -> None:
        ran.append(actions)

    timer = AdapterWatchTimer(0.01, lambda now: ticks.append(now) or [now], execute,
                              lambda: float(next(clock)))
    task = asyncio.create_task(timer.run())
    while len(ticks) < 3:
        await asyncio.sleep(0.005)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert ticks[:3] == [0.0, 1.0, 2.0] and ran[:3] == [[0.0], [1.0], [2.0]]


def test_a_looks_answer_for_a_slot_removed_meanwhile_is_no_ones():
    """A declared slot's first look is out when an engine table reload removes the slot
    (no rank registered): its answer goes to no coordinator (before the executor's check
    it raised KeyError in the call's task, and a slot made again under that key would have
    taken it for its own call of the same id)."""
    import asyncio
    import time
    from types import SimpleNamespace

    from slotsync.daemon.families import Families, SlotTable
    from slotsync.daemon.logs import RateLimiter
    from slotsync.daemon.service.executor import ActionExecutor
    from slotsync.daemon.service.mid_update_record import MidUpdateRecord

    class Held(Families):
        def __init__(self) -> None:
            super().__init__()
            self.asked, self.go = asyncio.Event(), asyncio.Event()

        def client_for(self, engine, url):
            return url, lambda *a: SimpleNamespace(connection_errors=0)

        async def call(self, client, route, body, engine):
            self.asked.set()
            await self.go.wait()
            return {"data": []}

    async def main() -> None:
        fams = Held()
        table = SlotTable(families=fams)
        table.set_engine_table({(0, 2): "http://engine:8000"})
        ex = ActionExecutor(table, MidUpdateRecord(None), SimpleNamespace(
            observe_request=lambda *a: None, slot_event=lambda *a: None),
            lambda *a: asyncio.sleep(0), RateLimiter(1, 1.0), 1.0, lambda: None,
            time.monotonic, fams)
        await ex.execute(table.adapter_watch(time.monotonic()))
        await fams.asked.wait()  # (the look is out)
        table.set_engine_table({})
        assert table.slots == {}
        fams.go.set()
        await asyncio.gather(*ex.tasks)  # (raised KeyError before)

    asyncio.run(main())

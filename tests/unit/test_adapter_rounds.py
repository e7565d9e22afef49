"""Adapter rounds through the I/O-free slot table (issue 36 D; ``daemon/core/adapters/``): a
scripted engine with vLLM's (or SGLang's) LoRA routes answers each ``EngineCall``, the
harness writes no folder (``AdapterFiles`` answered with a path), and each test reads as the
ranks' messages and the engine's call log. Red on the old code: ``AdapterBegin`` had no
route in the slot table (the modules did not exist)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from adapter_ranks import A, B, begin, laid_out, part, two_rank_parts
from test_coordinator import Harness, ScriptedEngine, chunk, ident, reg
from test_third_family import ToyFamily

from slotsync.daemon.core.actions import (
    AdapterFiles,
    EngineCall,
    RemoveAdapterFiles,
    Reply,
    SlotEvent,
    SweepAdapterFolders,
    UpdateEnded,
)
from slotsync.daemon.core.update import Timeouts
from slotsync.daemon.families import Families
from slotsync.daemon.sglang.family import SGLANG
from slotsync.daemon.vllm.family import VLLM
from slotsync.protocol import wire
from slotsync.protocol.wire import Ack, Begin, Commit, Error

INFO = ["version", "server_info", "models"]
LORA_INFO = {"vllm_config": {"lora_config": {"max_lora_rank": 16, "max_loras": 2}},
             "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}}


@dataclass
class LoraEngine(ScriptedEngine):
    """The scripted vLLM engine of test_coordinator with its LoRA routes: ``loras`` the
    names it serves; ``lora_info`` its dev-mode /server_info; ``sglang``: it is SGLang."""

    loras: dict[str, object] = field(default_factory=dict)
    lora_info: object = field(default_factory=lambda: LORA_INFO)
    sglang: bool = False

    def answer(self, call: EngineCall) -> tuple[bool, object, str]:
        r = call.route
        if r in ("version", "server_info") and self.sglang:
            self.calls.append(r)
            nth = self.calls.count(r) - 1
            if (r, nth) in self.fail:
                return False, None, self.fail[(r, nth)]
            info = {"version": "0.5.23", "tp_size": self.world_size, "dp_size": 1,
                    "enable_lora": True, "max_loras_per_batch": 4, "max_lora_rank": 16}
            return True, (info if r == "version" else None), ""
        if r == "server_info" and not self.sglang:
            self.server_info = self.lora_info
        if r not in ("models", "load_lora_adapter", "unload_lora_adapter"):
            return super().answer(call)
        self.calls.append(r)
        self.bodies.append(call.body)
        nth = self.calls.count(r) - 1
        if (r, nth) in self.fail:
            error = self.fail[(r, nth)]
            if r == "load_lora_adapter" and "registered anyway" in error:
                self.loras[call.body["lora_name"]] = call.body
            return False, None, error
        if r == "models":  # (root: the path it was loaded from, as vLLM's card gives it)
            return True, {"data": [{"id": "base", "parent": None}] + [
                {"id": n, "parent": "base", "root": b.get("lora_path", "__tensor__")
                 if isinstance(b, dict) else ""} for n, b in self.loras.items()]}, ""
        name = call.body["lora_name"]
        if r == "load_lora_adapter":
            if name in self.loras:
                return False, None, f"HTTP 400: The lora adapter '{name}' has already been loaded."
            self.loras[name] = call.body
            return True, None, ""
        if name not in self.loras:
            return False, None, f"HTTP 404: The lora adapter '{name}' cannot be found."
        del self.loras[name]
        return True, None, ""

    def restart(self) -> None:
        super().restart()
        self.loras.clear()


class LoraHarness(Harness):
    """``Harness`` with a ``LoraEngine``, the folders answered (``folders``: written,
    ``removed``: removed) and the log events kept."""

    def __init__(self, size: int = 2, families: Families | None = None, **kw) -> None:
        super().__init__(size=size, **kw)
        if families is not None:
            self.table.families = families
        self.engine = LoraEngine(world_size=size)
        self.folders: list[str] = []
        self.removed: list[str] = []
        self.events: list[SlotEvent] = []
        self.files_fail = ""
        self.sweeps: list[SweepAdapterFolders] = []  # (the idle watch's: answered unless held)
        self.hold_sweeps = False

    def take(self, a: object) -> list:
        """The adapter round's own actions (folders written or refused by ``files_fail``,
        removed, sweeps answered unless ``hold_sweeps``, log events kept); the others as
        ``Harness`` takes them."""
        if isinstance(a, AdapterFiles):
            folder = f"/adapters/slot-0-{self.size}/{a.plan.served_name}"
            ok = not self.files_fail
            self.folders += [folder] if ok else []
            return self.table.on_adapter_files(a.slot, a.call_id, ok, folder if ok else "",
                                               self.files_fail, self.now)
        if isinstance(a, RemoveAdapterFiles):
            self.removed.append(a.folder)
        elif isinstance(a, SweepAdapterFolders):
            self.sweeps.append(a)
            if not self.hold_sweeps:
                return self.table.on_adapter_swept(a.slot, a.call_id, self.now)
        elif isinstance(a, SlotEvent):
            self.events.append(a)
        else:
            return super().take(a)
        return []

    def answer_until(self, route: str) -> EngineCall:
        """Answer held calls one by one (the calls they lead to held too) until one to
        ``route`` is held; returns it (still held)."""
        while True:
            found = [c for c in self.pending_calls if c.route == route]
            if found:
                return found[0]
            c = self.pending_calls.pop(0)
            self.run(self.coord.on_engine_result(c.call_id, *self.engine.answer(c), self.now))

    def answer_pending(self) -> None:
        """Answer the calls held so far (and those they lead to), in order."""
        self.engine.hold = False
        calls, self.pending_calls = self.pending_calls, []
        for c in calls:
            self.run(self.coord.on_engine_result(c.call_id, *self.engine.answer(c), self.now))

    def adapter_round(self, update_id: int, version: int, data: bool = True,
                      handles: dict | None = None, parts: dict | None = None) -> None:
        parts = parts or two_rank_parts(version)
        for r in range(self.size):
            self.send(r, begin(update_id, parts.get(r, []), version=version))
        if not data:
            return
        for r in range(self.size):
            n = len(laid_out(parts.get(r, [])))
            h = (handles or {}).get(r, wire.ShmHandle(f"lora-{r}", 0, n) if n else None)
            self.send(r, wire.AdapterData(update_id, h))

    def acks(self, rank: int) -> list[tuple[str, str]]:
        return [(m.phase, m.transport or m.served_name) for m in self.replies.get(rank, [])
                if isinstance(m, Ack)]

    def errors(self, rank: int) -> list[Error]:
        return [m for m in self.replies.get(rank, []) if isinstance(m, Error)]

    def error(self, rank: int, update_id: int) -> Error:
        """The first error of round ``update_id`` to ``rank``."""
        return next(m for m in self.errors(rank) if m.update_id == update_id)

    def event(self, name: str) -> SlotEvent:
        return next(e for e in reversed(self.events) if e.event == name)


def started(size: int = 2, kind: str = "vllm", **kw) -> LoraHarness:
    h = LoraHarness(size, **kw)
    h.register_all()
    h.coord.engine.declare_kind(kind)
    h.engine.sglang = kind == "sglang"
    return h


def test_vllm_round_acks_begin_with_host_writes_the_folder_loads_then_unloads_the_old():
    h = started()
    h.adapter_round(0, version=1)
    assert h.engine.calls == [*INFO, "load_lora_adapter"]  # (nothing to unload: the first)
    for r in range(2):
        assert h.acks(r) == [("adapter_begin", "host"), ("adapter_data", "math@v1")]
    assert h.folders == ["/adapters/slot-0-2/math@v1"]
    assert h.engine.bodies[-1] == {"lora_name": "math@v1", "load_inplace": False,
                                   "lora_path": "/adapters/slot-0-2/math@v1"}
    loaded = h.event("adapter_loaded").fields
    assert loaded["served_name"] == "math@v1" and loaded["seconds"] >= 0
    (entry,) = h.coord.status()["adapters"]
    assert entry == {"lora_name": "math", "version": 1, "served_name": "math@v1",
                     "state": "served", "nbytes": 4 * 16 * 4 + 16 * 4 * 4, "loaded_at": 0.0,
                     "error": None}
    # version 2: loaded beside version 1, then version 1 unloaded; its folder kept a round
    h.adapter_round(1, version=2)
    assert h.engine.calls[4:] == [*INFO, "load_lora_adapter", "unload_lora_adapter"]
    assert set(h.engine.loras) == {"math@v2"} and h.removed == []
    assert [e["served_name"] for e in h.coord.status()["adapters"]] == ["math@v2"]
    h.adapter_round(2, version=3)
    assert h.removed == ["/adapters/slot-0-2/math@v1"]  # (v2's goes after v4's round)
    assert h.coord.status()["adapter_rounds_succeeded"] == 3
    # the base round takes the next update id: they share one sequence
    h.round(3)
    assert h.ended[-1].outcome == "success"


def whole_parts(version: int = 1) -> dict:
    """lora_A and lora_B whole, one on each rank (what the SGLang stand-in payload of this
    branch takes; the SGLang helper's writes split tensors too)."""
    parts = two_rank_parts(version)
    return {0: [parts[0][0]], 1: [part(B, (16, 4), (0, 16), version)]}


def test_sglang_round_acks_begin_with_device_and_loads_from_the_ranks_handles():
    h = started(kind="sglang")
    h.adapter_round(0, version=1, parts=whole_parts(), data=False)
    h.engine.hold = True  # (the load's answer proves TP rank 0's copies only)
    for r in range(2):
        n = len(laid_out(whole_parts()[r]))
        h.send(r, wire.AdapterData(0, wire.ShmHandle(f"lora-{r}", 0, n)))
    h.answer_until("prove_adapter_copies")
    assert h.acks(0) == [("adapter_begin", "device")]  # the ranks' memory may still be read
    h.answer_pending()
    assert h.engine.calls == [*INFO, "load_lora_adapter", "prove_adapter_copies"]
    assert h.engine.bodies[-1] == {"action": "checksum", "skip_tensor_list": [""],
                                   "selector": "target"}
    assert h.acks(0) == [("adapter_begin", "device"), ("adapter_data", "math@v1")]
    assert h.folders == []  # (SGLang reads the ranks' memory)
    body = h.engine.bodies[-2]
    assert body["lora_name"] == "math@v1" and len(body["serialized_named_tensors"]) == 2
    assert set(body["expected_checksums"]) == {A, B}
    h.adapter_round(1, version=2, parts=whole_parts(2))
    assert h.engine.calls[-3:] == ["load_lora_adapter", "prove_adapter_copies",
                                   "unload_lora_adapter"]
    assert set(h.engine.loras) == {"math@v2"}
    # a tensor split over ranks: refused by the family before any engine call
    calls = len(h.engine.calls)
    h.adapter_round(2, version=3)
    assert "is split over ranks" in h.error(0, 2).message and len(h.engine.calls) == calls


@pytest.mark.parametrize("why, setup, words, calls", [
    ("lora off", lambda h: setattr(h.engine, "lora_info", {"vllm_config": {}}),
     "does not serve LoRA adapters: start the vLLM server with the flag --enable-lora", INFO),
    # (vLLM's own rule, PEFTHelper.validate_legal, asked of the family with /server_info)
    ("rank", lambda h: setattr(h.engine, "lora_info", {"vllm_config": {"lora_config": {
        "max_lora_rank": 2}}}), "its LoRA rank 4 is above the server's max_lora_rank 2 "
     "(restart the vLLM server with --max-lora-rank 8,", INFO[:2]),
])
def test_refused_by_the_engines_limits_before_any_call_that_changes_it(why, setup, words,
                                                                       calls):
    h = started()
    setup(h)
    h.adapter_round(0, version=1, data=False)
    assert h.engine.calls == calls  # (reads only)
    for r in range(2):
        (err,) = h.errors(r)
        assert err.phase == "adapter_begin" and words in err.message, err.message
        assert "no version of 'math' is served" in err.message
    assert h.coord.status()["adapters"] == [] and h.coord.adapter_round is None


def test_an_older_version_is_refused_naming_both_with_no_engine_call():
    h = started()
    h.adapter_round(0, version=3)
    calls = list(h.engine.calls)
    h.adapter_round(1, version=2, data=False)
    assert h.engine.calls == calls  # refused before any engine call
    err = h.errors(0)[-1]
    assert ("adapter 'math' version 2 is a version older than version 3, which engine "
            "http://engine:8000 serves as math@v3" in err.message)
    assert "math@v3 stays served" in err.message


def test_an_engine_over_several_nodes_is_refused_not_yet():
    h = LoraHarness()
    relayed = b"peer:node1/" + ident(1)
    h.run(h.table.on_message(ident(0), reg(0), h.now))
    h.run(h.table.on_message(relayed, reg(1), h.now))
    h.coord.engine.declare_kind("vllm")
    parts = two_rank_parts()
    h.run(h.table.on_message(ident(0), begin(0, parts[0]), h.now))
    out = h.table.on_message(relayed, begin(0, parts[1]), h.now)
    errs = [a.msg for a in out if isinstance(a, Reply) and isinstance(a.msg, Error)]
    assert len(errs) == 2 and h.engine.calls == []
    assert "not built yet" in errs[0].message and "rank(s) 1 relayed" in errs[0].message


def test_a_family_without_adapters_is_refused_with_a_clear_text():
    toy = ToyFamily()
    h = started(families=Families((VLLM, SGLANG, toy)), kind="vllm")
    h.coord.engine.declare_kind("toy")
    h.adapter_round(0, version=1, data=False)
    assert "is Toy, into which slotsyncd loads no LoRA adapters" in h.errors(0)[0].message
    assert h.engine.calls == []


def test_base_and_adapter_rounds_never_overlap_on_a_slot():
    h = started()
    h.engine.hold = True  # the adapter round's info calls stay out
    h.adapter_round(0, version=1, data=False)
    h.send(0, Begin(1, "w"))
    err = h.errors(0)[-1]
    assert err.phase == "begin" and "adapter round 0 (math@v1) is in flight" in err.message
    h.answer_pending()
    for r in range(2):
        n = len(laid_out(two_rank_parts()[r]))
        h.send(r, wire.AdapterData(0, wire.ShmHandle(f"lora-{r}", 0, n)))
    assert h.acks(1)[-1] == ("adapter_data", "math@v1")
    # a base round in flight refuses an adapter begin
    h.engine.hold = True
    h.send(0, Begin(1, "w"))
    h.send(1, Begin(1, "w"))
    h.send(0, begin(2, two_rank_parts(2)[0], version=2))
    assert "base-weight update 1 is in flight" in h.errors(0)[-1].message
    # an adapter round's last call (the unload after its ack) holds a base round's calls
    h2 = started()
    h2.adapter_round(0, version=1)
    h2.engine.hold = True
    h2.adapter_round(1, version=2, data=False)
    h2.answer_until("models")
    h2.answer_pending()
    h2.engine.hold = True
    for r in range(2):
        n = len(laid_out(two_rank_parts(2)[r]))
        h2.send(r, wire.AdapterData(1, wire.ShmHandle(f"lora-{r}", 0, n)))
    (load,) = h2.pending_calls  # (held)
    h2.pending_calls.clear()
    h2.run(h2.coord.on_engine_result(load.call_id, *h2.engine.answer(load), h2.now))
    assert h2.acks(0)[-1] == ("adapter_data", "math@v2")
    (unload,) = h2.pending_calls  # (the unload of v1, after the ack: held)
    assert unload.route == "unload_lora_adapter"
    for r in range(2):
        h2.send(r, Begin(2, "w"))  # accepted: the round answered its ranks
    assert h2.errors(0) == [] and h2.pending_calls == [unload]  # the base round waits
    h2.answer_pending()
    at = len(h2.engine.calls) - h2.engine.calls[::-1].index("unload_lora_adapter") - 1
    assert h2.engine.calls[at + 1:at + 3] == ["get_world_size", "weight_info"]  # then
    assert h2.coord.current is not None  # (it pauses once a chunk is in)


STAYS = "(math@v1 stays served)"
UNANSWERED = ("did not answer (asked to load it)", "(what it serves is checked at its next "
              "answer; it served math@v1 before this round)")


@pytest.mark.parametrize("error, words", [
    ("load_lora_adapter: HTTP 500: worker failed to read the folder",
     ("vLLM refused the adapter (HTTP 500): worker failed to read the folder", STAYS)),
    ("load_lora_adapter: HTTP 404: Not Found",  # (the route missing: vLLM's words, explained)
     ("start the vLLM server with the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
      STAYS)),
    # no answer (the engine may have died: a timeout, a refused or reset connection): what it
    # serves is not told (red before: "(math@v1 stays served)" after the engine died)
    ("load_lora_adapter: no answer within 120 s (registered anyway)",
     ("no answer within 120 s", *UNANSWERED)),
    ("load_lora_adapter: cannot reach http://engine:8000: Connection reset by peer "
     "(registered anyway)", ("cannot reach http://engine:8000", *UNANSWERED)),
])
def test_a_failed_load_leaves_the_previous_version_served_and_nothing_half_loaded(error,
                                                                                  words):
    h = started()
    h.adapter_round(0, version=1)
    h.engine.fail[("load_lora_adapter", 1)] = error
    h.adapter_round(1, version=2)
    assert h.engine.calls[-2:] == ["load_lora_adapter", "unload_lora_adapter"]  # undone
    assert h.engine.bodies[-1] == {"lora_name": "math@v2"}
    assert set(h.engine.loras) == {"math@v1"}  # never both, never v2 alone
    for r in range(2):
        err = h.errors(r)[-1]
        assert err.phase == "adapter_data", err
        for w in words:
            assert w in err.message, (w, err.message)
        assert (STAYS in err.message) == (STAYS in words), err.message
    assert h.removed == ["/adapters/slot-0-2/math@v2"]
    assert [(e["served_name"], e["state"]) for e in h.coord.status()["adapters"]] == [
        ("math@v1", "served")]
    assert "math@v2" in h.event("adapter_failed").fields["adapter"]
    h.adapter_round(2, version=2)  # the same version again: loads now
    assert set(h.engine.loras) == {"math@v2"}


def test_a_load_whose_undo_fails_is_unloaded_before_the_next_round():
    h = started()
    h.engine.fail[("load_lora_adapter", 0)] = "no answer within 120 s (registered anyway)"
    h.engine.fail[("unload_lora_adapter", 0)] = "unload_lora_adapter: cannot reach engine"
    h.adapter_round(0, version=1)
    assert "its unload failed too" in h.errors(0)[-1].message
    assert h.coord.adapters.stray == {"math@v1": "/adapters/slot-0-2/math@v1"}
    assert h.removed == []  # (the engine may still read it)
    h.adapter_round(1, version=1)
    assert h.engine.calls[5:] == [*INFO, "unload_lora_adapter", "load_lora_adapter"]
    assert set(h.engine.loras) == {"math@v1"} and h.coord.adapters.stray == {}


def test_a_rank_gone_or_silent_fails_the_round_naming_it():
    h = started()
    parts = two_rank_parts()
    h.send(0, begin(0, parts[0]))
    h.send(1, begin(0, parts[1]))
    h.run(h.table.on_connection_gone(ident(1), h.now, "its process (pid 7) exited"))
    err = h.errors(0)[-1]
    assert err.phase == "adapter_data" and err.missing_ranks == [1]
    assert "rank 1 (pid 0) is gone: its process (pid 7) exited" in err.message
    assert "load_lora_adapter" not in h.engine.calls
    h2 = started(timeouts=Timeouts(5, 7, 10))
    h2.send(0, begin(0, parts[0]))
    h2.now = 5.0
    h2.run(h2.table.poll(h2.now))
    err = h2.errors(1)[-1]
    assert err.phase == "adapter_begin" and err.missing_ranks == [1]
    assert "adapter begin (begin_timeout_s) of rank(s) [1]" in err.message
    h2.adapter_round(1, version=1, data=False)
    h2.send(0, wire.AdapterData(1, wire.ShmHandle("lora-0", 0, len(laid_out(parts[0])))))
    assert h2.table.next_deadline() == 5.0 + 7
    h2.now = 12.0
    h2.run(h2.table.poll(h2.now))
    assert "adapter data (chunk_timeout_s) of rank(s) [1]" in h2.errors(0)[-1].message


def test_a_bad_handle_or_a_malformed_frame_fails_the_round():
    h = started()
    cuda = wire.CudaIpcHandle("torch.Tensor", (8,), (1,), 0, "torch.storage.UntypedStorage",
                              "uint8", 0, b"x" * 8, 8, 0, False, b"y" * 8, 0, None, False)
    h.adapter_round(0, version=1, handles={1: cuda})
    assert "rank 1 sent a CudaIpcHandle for its adapter part; it must be a shared-memory " \
        "handle" in h.errors(0)[-1].message
    h.adapter_round(1, version=1, handles={0: wire.ShmHandle("lora-0", 0, 8)})
    assert "covers 8 bytes, but its part" in h.error(1, 1).message
    h.adapter_round(2, version=1, data=False)
    err = wire.ProtocolError("bad", kind="adapter_data", field="handle", update_id=2)
    h.run(h.table.on_bad_message(ident(1), err, h.now))
    assert h.errors(0)[-1].phase == "adapter_data"
    assert "rank 1 sent a adapter_data message" in h.errors(0)[-1].message
    assert "load_lora_adapter" not in h.engine.calls


def test_a_restarted_vllm_engine_gets_its_adapters_again_from_their_folders():
    """Between adapter rounds: the next round's list misses the served version; it is loaded
    again from its kept folder before that round's begin is acknowledged."""
    h = started()
    h.adapter_round(0, version=1)
    h.engine.restart()
    h.adapter_round(1, version=2)
    # (the reload of v1 goes out with the begin's ack; the load of v2 waits for it)
    assert h.engine.calls[4:] == [*INFO, "load_lora_adapter", "load_lora_adapter",
                                  "unload_lora_adapter"]
    assert h.engine.bodies[-3] == {"lora_name": "math@v1", "load_inplace": False,
                                   "lora_path": "/adapters/slot-0-2/math@v1"}
    assert h.event("adapter_reloaded").fields["served_name"] == "math@v1"
    assert set(h.engine.loras) == {"math@v2"}


def test_a_restart_found_by_the_base_rounds_probe_reloads_before_its_commit_ack():
    h = started()
    h.adapter_round(0, version=1)
    h.round(1)
    h.engine.restart()
    h.engine.hold = True
    h.round(2)  # the probe sees weight version "default": a new session
    while h.pending_calls:
        c = h.pending_calls.pop(0)
        before = len([m for m in h.replies[0] if isinstance(m, Ack) and m.phase == "commit"])
        if c.route == "load_lora_adapter":
            assert before == 1  # round 2's commit ack waits for the adapter
        h.engine.hold = c.route != "load_lora_adapter"
        h.run(h.coord.on_engine_result(c.call_id, *h.engine.answer(c), h.now))
        h.engine.hold = True
    assert [m.phase for m in h.replies[0] if isinstance(m, Ack)][-1] == "commit"
    assert set(h.engine.loras) == {"math@v1"}
    assert any(isinstance(e, UpdateEnded) for e in h.ended)


def test_a_restarted_sglang_engine_marks_its_adapters_lost_and_takes_them_again():
    h = started(kind="sglang")
    h.adapter_round(0, version=1, parts=whole_parts())
    assert h.acks(0)[-1] == ("adapter_data", "math@v1")
    h.engine.restart()
    h.adapter_round(1, version=1, parts=whole_parts(), data=False)  # the same version again
    lost = h.event("adapter_lost").fields
    assert lost["served_name"] == "math@v1" and "publish version 1" in lost["why"]
    assert h.acks(0)[-1] == ("adapter_begin", "device")
    assert h.coord.status()["adapters"][0]["state"] == "lost"


def test_chunks_of_a_base_round_still_work_after_an_adapter_round():
    h = started()
    h.adapter_round(0, version=1)
    for r in range(2):
        h.send(r, Begin(1, "w1"))
    for r in range(2):
        h.send(r, chunk(1, 0, r))
    for r in range(2):
        h.send(r, Commit(1, 1))
    assert h.ended[-1].outcome == "success" and set(h.engine.loras) == {"math@v1"}


def test_a_query_during_an_adapter_round_names_what_it_waits_for():
    h = started(timeouts=Timeouts(30, 40, 50))
    h.send(0, begin(0, two_rank_parts()[0]))
    h.now = 10.0
    h.send(0, wire.Query(0))
    w = h.replies[0][-1]
    assert isinstance(w, wire.Waiting) and w.phase == "adapter_begin" and w.missing_ranks == [1]
    assert "adapter begin (begin_timeout_s) of rank(s) 1 (adapter round 0 (math@v1) of slot " \
        "[0, 2)); 30 s, 20 s left" in w.text


def test_the_next_job_on_the_engine_takes_over_its_adapters():
    """An undeclared slot released after its job went keeps what the engine holds: the next
    job's slot on the same engine adopts it (the version order, the folders in use)."""
    h = started()
    h.adapter_round(0, version=2)
    for r in range(2):
        h.run(h.table.on_connection_gone(ident(r), h.now, "its process exited"))
    h.now = 1000.0
    h.run(h.table.poll(h.now))
    assert h.table.slots == {} and h.table.adapter_folders_in_use() == {
        "/adapters/slot-0-2/math@v2"}
    h.register_all()
    h.adapter_round(1, version=1, data=False)
    assert "version 1 is a version older than version 2" in h.error(0, 1).message


def test_a_rank_that_aborts_fails_the_round_and_a_forced_drop_ends_one():
    h = started()
    h.adapter_round(0, version=1, data=False)
    h.send(1, wire.Abort(0, "SlotsyncTimeout: no Ack(adapter_data) within 30 s"))
    err = h.error(0, 0)
    assert err.phase == "adapter_data" and "rank 1 aborted adapter round 0: SlotsyncTimeout" \
        in err.message and "load_lora_adapter" not in h.engine.calls
    h.adapter_round(1, version=1, data=False)  # a round waiting for its data
    with pytest.raises(RuntimeError, match="has update 1 in flight"):
        h.table.drop((0, 2), h.now)
    h.run(h.table.drop((0, 2), h.now, force=True))
    assert "dropped by the operator" in h.error(1, 1).message and h.table.slots == {}


def test_a_rank_registering_while_a_round_waits_for_its_begin_is_told_that_rounds_id():
    """Ranks of one job start at different times: rank 1 registers and begins adapter round
    0 before rank 0 registered. Rank 0's ``Registered.next_update_id`` is 0 (the round that
    waits for it, as during a base round's begins), its begin joins the round, and the
    slot's next id moves on once the round ended. (Red before: the begin moved the next id
    on at once, rank 0 was told 1 and its begin refused as "a second round".)"""
    h = LoraHarness(2)
    h.send(1, reg(1, 0, 2))
    h.coord.engine.declare_kind("vllm")
    parts = two_rank_parts(1)
    h.send(1, begin(0, parts[1], version=1))
    h.send(0, reg(0, 0, 2))
    assert h.replies[0][-1].next_update_id == 0
    h.send(0, begin(0, parts[0], version=1))
    for r in range(2):
        h.send(r, wire.AdapterData(0, wire.ShmHandle(f"lora-{r}", 0, len(laid_out(parts[r])))))
    for r in range(2):
        assert h.acks(r) == [("adapter_begin", "host"), ("adapter_data", "math@v1")], (
            h.replies[r])
    assert h.coord.next_update_id == 1
    h.send(0, reg(0, 0, 2))  # (a later registration: the next round's id)
    assert h.replies[0][-1].next_update_id == 1


def test_a_load_failed_on_one_worker_makes_the_next_base_round_check_the_replies_first():
    """vLLM's MultiprocExecutor raises at the first failing worker and leaves the others'
    replies queued (gh-58242, daemon/vllm/adapters.py): a failed load whose error names a
    worker's failure, on an engine of several workers, puts the replies in doubt, so the
    next base round checks them before its first executor call (as after a weight call)."""
    h = started()
    h.adapter_round(0, version=1)
    h.engine.fail[("load_lora_adapter", 1)] = (
        "load_lora_adapter: HTTP 500: Worker failed with error 'no such folder'")
    h.adapter_round(1, version=2)
    assert h.coord.engine.replies_suspect
    before = len(h.engine.calls)
    for r in range(2):
        h.send(r, Begin(2, "w1"))
    assert "check_replies" in h.engine.calls[before:], h.engine.calls[before:]


def test_a_rank_that_registers_after_the_others_began_joins_their_round():
    """Ranks start at different times: rank 1 registers after rank 0 began adapter round 0.
    Its ``Registered`` must give it round 0's id, as a base-weight round's id stays the
    slot's next update id until it ends; before the fix it said 1 (the id past the round the
    first begin opened), and rank 1's begin was refused ("adapter round 0 ... is in flight
    ...; refusing a second round 1"), which failed the round (the H200 run of
    tests/gpu/test_gpu_adapters.py)."""
    h = LoraHarness(2)
    h.send(0, reg(0, 0, 2, packed=h.packed))
    h.coord.engine.declare_kind("vllm")
    parts = two_rank_parts(1)
    h.send(0, begin(0, parts[0]))
    h.send(1, reg(1, 0, 2, packed=h.packed))
    (registered,) = h.replies[1]
    assert isinstance(registered, wire.Registered) and registered.next_update_id == 0
    h.send(1, begin(registered.next_update_id, parts[1]))
    for r in range(2):
        n = len(laid_out(parts[r]))
        h.send(r, wire.AdapterData(0, wire.ShmHandle(f"lora-{r}", 0, n)))
    for r in range(2):
        assert h.acks(r) == [("adapter_begin", "host"), ("adapter_data", "math@v1")], (
            h.errors(r))
    # and the next round, base or adapter, takes the id after it
    h.send(0, reg(0, 0, 2, packed=h.packed))
    assert h.replies[0][-1].next_update_id == 1

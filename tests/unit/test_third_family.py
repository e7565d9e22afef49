"""A third engine family, defined here only (issue 34 B): "toy", an engine whose steps have
other routes (``/toy/...``), whose chunk payload is its own JSON and whose replies come before
its copies finished, so a chunk is acked only once a later call proves it (a fence of its own).
A slot drives it through a full round -- register, begin, chunks, commit, acks -- through
``SlotTable`` with the families injected from this test; nothing under ``daemon/core`` knows
it (the commit adding this file touches no source file)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec
from test_coordinator import chunk, ident, reg

from slotsync.daemon.core.actions import EngineCall, Reply, UpdateEnded
from slotsync.daemon.core.aggregation import MergedChunk, check_chunk
from slotsync.daemon.core.family import MergeFacts, VersionVerdict
from slotsync.daemon.core.update import Timeouts
from slotsync.daemon.families import Families, SlotTable
from slotsync.daemon.vllm.family import VLLM
from slotsync.protocol.wire import Ack, Begin, Commit, Error

URL = "http://toy:9000"
ROUTES = {  # the daemon's step -> the toy engine's route
    "version": "/toy/about", "server_info": None, "get_world_size": "/toy/workers",
    "weight_info": "/toy/weights", "is_sleeping": "/toy/asleep", "init_weight_transfer_engine":
    "/toy/hello", "pause": "/toy/hold", "start_weight_update": "/toy/open",
    "update_weights": "/toy/load", "prove_copies": "/toy/load",
    "finish_weight_update": "/toy/close", "resume": "/toy/go"}


class ToyFence:
    """Every chunk is proven by the next successful load or the close."""

    def __init__(self) -> None:
        self.unproven: list[int] = []
        self.sent: set[int] = set()

    def proves(self, route: str) -> bool:
        return route in ("update_weights", "prove_copies", "finish_weight_update")

    def on_send(self, call_id: int) -> None:
        self.sent.add(call_id)

    def on_chunk_reply(self, call_id: int, index: int, due: list[int]) -> list[int]:
        proven = self.on_proof(call_id)
        self.unproven += due
        return proven

    def on_proof(self, call_id: int) -> list[int]:
        proven, self.unproven = self.unproven, []
        return proven

    def waiting(self) -> bool:
        return bool(self.unproven)


class ToyFamily:
    name, display = "toy", "Toy"
    pause_modes, asks_draft_support = False, False
    reads_memory = frozenset({"update_weights", "prove_copies"})

    def step_body(self, route: str, packed: bool | None) -> Any:
        return {"hello": True} if route == "init_weight_transfer_engine" else None

    def rank_local_refusal(self, u, engine, engine_url) -> str:
        return "the toy engine has no rank-local mode"

    def pause_refusal(self, u, engine, engine_url) -> str:
        return "the toy engine loads no draft" if u.draft else ""

    def session_open(self, error: str) -> bool:
        return "toy session open" in error

    def fence(self, engine) -> ToyFence:
        return ToyFence()

    def merge(self, index: int, got: Mapping[int, Any], facts: MergeFacts, u) -> MergedChunk:
        ref = check_chunk(index, got, {r: facts.gpu_uuids[r] for r in got}, packed=facts.packed,
                          transport=facts.transport, world_size=facts.world_size)
        body = {"chunk": index, "names": ref.names, "ranks": sorted(got)}
        return MergedChunk(index, body, len(ref.names), sum(ref.tensor_sizes),
                           msgspec.json.encode(body))

    def chunk_body(self, merged: MergedChunk) -> Any:
        return {"toy": msgspec.Raw(merged.update_info_json)}


class ToyFamilies(Families):
    """The daemon's families plus the toy one, which answers the version stage itself."""

    def __init__(self) -> None:
        super().__init__((VLLM, TOY))

    def version_answer(self, engine, u, route, result, slot, size, engine_url):
        if engine.kind == "toy":
            if route == "version" and result.get("toy") != 1:
                return VersionVerdict(fail=f"engine {engine_url} is no toy engine")
            engine.vllm_version = "toy-1"  # (the version the begin's version stage asks for)
            return VersionVerdict(merge=route == "version")
        return super().version_answer(engine, u, route, result, slot, size, engine_url)


TOY = ToyFamily()


class ToyEngine:
    """Answers the toy routes; keeps its state and the requests it got."""

    def __init__(self, workers: int = 2) -> None:
        self.workers, self.held, self.open, self.version = workers, False, False, "base"
        self.requests: list[str] = []
        self.loaded: list[dict] = []

    def answer(self, call: EngineCall) -> tuple[bool, Any, str]:
        route = ROUTES[call.route]
        if route is None:
            return True, None, ""
        self.requests.append(route)
        if route == "/toy/about":
            return True, {"toy": 1}, ""
        if route == "/toy/workers":
            return True, {"world_size": self.workers}, ""
        if route == "/toy/weights":
            return True, {"weight_version": self.version}, ""
        if route == "/toy/asleep":
            return True, {"is_sleeping": False}, ""
        if route == "/toy/hold":
            self.held = True
        elif route == "/toy/open":
            assert self.held
            self.open = True
        elif route == "/toy/load":
            assert self.open
            if call.route == "update_weights":
                self.loaded.append(json.loads(msgspec.json.encode(call.body))["toy"])
        elif route == "/toy/close":
            self.open, self.version = False, call.body["weight_version"]
        elif route == "/toy/go":
            self.held = False
        return True, {}, ""


def test_a_slot_drives_a_third_family_through_a_full_round():
    table = SlotTable(Timeouts(10, 10, 10), families=ToyFamilies())
    table.set_engine_table({(0, 2): URL}, None, {(0, 2): ("toy", "in_place")})
    engine = ToyEngine()
    replies: dict[int, list] = {}
    ended: list[UpdateEnded] = []

    def run(actions: list) -> None:
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            if isinstance(a, Reply):
                replies.setdefault(int(a.identity.decode().split("-")[1]), []).append(a.msg)
            elif isinstance(a, UpdateEnded):
                ended.append(a)
            elif isinstance(a, EngineCall):
                ok, result, error = engine.answer(a)
                coord = next(iter(table.slots.values()))
                queue += coord.on_engine_result(a.call_id, ok, result, error, 0.0)

    def send(rank: int, msg: Any) -> None:
        run(table.on_message(ident(rank), msg, 0.0))

    for r in range(2):
        send(r, reg(r, url=URL))
    for r in range(2):
        send(r, Begin(0, "v1"))
    for k in range(3):
        for r in range(2):
            send(r, chunk(0, k, r))
    for r in range(2):
        send(r, Commit(0, 3))

    # each chunk's load, then (no later chunk yet: the ranks here send one at a time) a load
    # of nothing that proves it, as the fence asks
    assert engine.requests == [
        "/toy/about", "/toy/workers", "/toy/weights", "/toy/asleep", "/toy/hello",
        "/toy/hold", "/toy/open", *["/toy/load"] * 6, "/toy/close", "/toy/go"]
    assert [c["chunk"] for c in engine.loaded] == [0, 1, 2]
    assert not engine.held and engine.version == "v1"
    for r in range(2):
        assert not any(isinstance(m, Error) for m in replies[r]), replies[r]
        acks = [(m.phase, m.index) for m in replies[r] if isinstance(m, Ack)]
        assert acks == [("begin", -1), ("chunk", 0), ("chunk", 1), ("chunk", 2),
                        ("commit", -1)]
    assert [e.outcome for e in ended] == ["success"]
    status = next(iter(table.slots.values())).status()
    assert status["engine_kind"] == "toy" and status["engine_calls"]["update_weights"] == 3
    assert status["engine_calls"]["prove_copies"] == 3

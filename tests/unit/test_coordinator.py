"""Unit tests of the I/O-free slot coordinator: design.md invariants I1–I8, no sockets, no clock.

A scripted engine answers each ``EngineCall`` like vLLM (tracking its own state), so each test
reads as a sequence of rank events and checks the actions and the engine's call log.

Invariants (design.md) and the tests that hold them:
I1 one update per engine, one start + one finish: test_happy_round_order_and_acks,
   test_second_update_refused_while_one_in_flight_and_stale_id;
I2 complete and consistent chunks only: test_chunk_waits_for_every_rank_...,
   test_ranks_whose_manifests_differ_are_refused_before_the_pause,
   test_mismatch_found_ahead_fails_only_when_no_engine_call_is_in_flight,
   test_dtype_mismatch_rejected_before_engine_sees_it, test_world_size_mismatch_...;
I3 acks after the engine consumed: test_chunk_waits_for_every_rank_and_acks_only_after_...;
I4 pause before start, no resume after failure: test_happy_round_order_and_acks,
   test_engine_500_on_chunk_k_..., test_daemon_stop_fails_update_and_leaves_engine_paused;
I5 deadlines name what is missing: test_*_deadline_*;
I6 no unpickling, no torch in the daemon: tests/unit/test_vllm_pickle.py;
I7 state keyed by update id: test_late_engine_result_of_failed_update_is_dropped, stale ids;
I8 version only with a successful finish: test_dtype_mismatch_..., test_engine_500_....
I9 the daemon's view of the engine is the engine's (issue 14):
   test_failure_while_the_pause_is_in_flight_resumes_the_engine,
   test_pause_that_timed_out_is_checked_and_a_paused_engine_resumed (defect 2),
   test_engine_restarted_between_rounds_is_initialised_again_and_needs_a_full_update,
   test_connection_lost_since_the_last_round_counts_as_a_possible_restart (defect 3),
   test_update_with_no_chunk_from_any_rank_is_refused_at_commit_before_the_engine_is_touched
   (defect 4), test_update_leaving_out_names_of_the_last_one_is_reported,
   test_omitted_names_refuse_fails_before_the_finish,
   test_restoring_update_covers_the_last_successful_update_not_every_name_ever_seen
   (defect 5), test_gpu_uuid_set_is_checked_before_the_pause (defect 6),
   test_engine_found_sleeping_needs_a_full_update_and_is_left_paused (defect 7), and vLLM's
   executor replies (gh-58242): test_failed_finish_recovers_starting_first_so_replies_stay_in_step,
   test_replies_out_of_step_are_found_and_the_engine_must_be_restarted,
   test_engine_restarted_before_the_daemon_clears_a_recorded_out_of_step,
   test_start_that_reached_no_worker_leaves_the_engine_intact.

Over ~500 lines on purpose: it holds one thing, the coordinator's invariant tests, grouped by
invariant, with the one scripted engine they share (issue 16).
"""

from __future__ import annotations

import base64
import json
import pickle
from dataclasses import dataclass, field

import msgspec
import pytest

from slotsync.daemon.core.coordinator import (
    EngineCall,
    Reply,
    SlotCoordinator,
    SlotEvent,
    SlotState,
    Timeouts,
    UpdateEnded,
)
from slotsync.daemon.families import SlotTable
from slotsync.protocol.wire import (
    NOT_REGISTERED,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Begin,
    Chunk,
    Commit,
    Error,
    Register,
    Registered,
    ShmHandle,
    logical_gpu_uuid,
)

URL = "http://engine:8000"
PROBES = ["get_world_size", "weight_info", "is_sleeping"]  # every begin's first stage (I9)
# the engine's vLLM version and DP layout are asked together (daemon/vllm/versions.py,
# daemon/vllm/dp_layout.py):
# first at the first begin, later ones do not
ASKED = ["version", "server_info"]
FIRST = [*ASKED, *PROBES]
BEGIN_ROUTES = frozenset({*FIRST, "init_weight_transfer_engine", "pause", "finish_recover",
                          "start_weight_update"})


def ident(rank: int) -> bytes:
    return f"id-{rank}".encode()


def reg(rank: int, start: int = 0, size: int = 2, url: str = URL, packed: bool = True,
        version: int = PROTOCOL_VERSION, uuid: str | None = None) -> Register:
    return Register(version, rank, uuid or logical_gpu_uuid(rank - start), start, size, url,
                    packed, "shm")


def chunk(update_id: int, index: int, rank: int, packed: bool = True, dtype: str = "float32",
          names: tuple[str, ...] = ("a", "b")) -> Chunk:
    shapes = [[2, 2] for _ in names]
    sizes = [16 if dtype == "float32" else 8 for _ in names]
    if packed:
        handles = [ShmHandle(f"seg-{rank}", 0, sum(sizes))]
    else:
        handles = [ShmHandle(f"seg-{rank}", 64 * i, s) for i, s in enumerate(sizes)]
    return Chunk(update_id, index, list(names), [dtype] * len(names), shapes, sizes, handles)


def rpc_answer(body: object, worker: int) -> object:
    """Worker ``worker``'s reply to vLLM's dev-mode ``POST /collective_rpc`` ``body`` as the
    router sends it back: ``check_health`` -> None; ``__getattribute__("rpc_rank")`` on the
    ``WorkerWrapperBase`` -> its rank, ``str()``'d."""
    assert isinstance(body, dict), body
    if body["method"] == "check_health":
        return None
    assert body == {"method": "__getattribute__", "args": ["rpc_rank"]}, body
    return str(worker)


@dataclass
class ScriptedEngine:
    """Answers EngineCalls like a vLLM server: keeps paused/active state and a call log."""

    world_size: int = 2
    calls: list[str] = field(default_factory=list)
    fail: dict[tuple[str, int], str] = field(default_factory=dict)  # (route, nth) -> error
    hold: bool = False  # keep calls unanswered (engine hanging)
    paused: bool = False
    active: bool = False
    version: str = "default"
    asleep: bool = False  # executor sleeping (vLLM /sleep level >= 1)
    packed: bool | None = None  # set by init (None: a fresh process, never initialised)
    bodies: list = field(default_factory=list)
    vllm_version: str = "0.32.0"  # GET /version
    # GET /server_info?config_format=json (None: what the client returns for a 404)
    server_info: object = None

    def restart(self) -> None:
        """A new engine process at the same URL: its checkpoint's weights, no session, not
        paused, never initialised, version "default"."""
        self.paused = self.active = self.asleep = False
        self.packed = None
        self.version = "default"

    def answer(self, call: EngineCall) -> tuple[bool, object, str]:
        self.calls.append(call.route)
        self.bodies.append(call.body)
        nth = sum(1 for c in self.calls if c == call.route) - 1
        if (call.route, nth) in self.fail:
            if call.route == "update_weights":
                self.active = False  # vLLM: any update failure ends the session
            return False, None, self.fail[(call.route, nth)]
        r = call.route
        if r == "version":  # vLLM's GET /version
            return True, {"version": self.vllm_version}, ""
        if r == "server_info":
            return True, self.server_info, ""
        if r == "get_world_size":
            return True, {"world_size": self.world_size}, ""
        if r == "weight_info":
            return True, {"weight_version": self.version}, ""
        if r == "is_sleeping":  # vLLM 0.32 EngineCore.is_sleeping: paused or asleep
            return True, {"is_sleeping": self.paused or self.asleep}, ""
        if r == "is_paused":
            return True, {"is_paused": self.paused}, ""
        if r == "check_replies":  # /collective_rpc: what vLLM's router answers the method
            return True, {"results": [rpc_answer(call.body, w)
                                      for w in range(self.world_size)]}, ""
        if r == "init_weight_transfer_engine":
            self.packed = call.body["init_info"]["packed"]
        if r == "pause":
            self.paused = True
        elif r == "resume":
            self.paused = False
        elif r == "start_weight_update":
            if self.active:
                return False, None, "HTTP 500: already active"
            self.active = True
        elif r in ("finish_weight_update", "finish_recover"):
            if not self.active:
                return False, None, "HTTP 500: no active update"
            self.active = False
            if call.body:
                self.version = call.body["weight_version"]
        elif r == "update_weights":
            assert self.active and self.paused
            if self.packed is None:  # vLLM 0.33: packed False until init; bare assert
                self.active = False
                return False, None, "HTTP 500: Call to collective_rpc method failed: "
        return True, {"message": "ok"}, ""


class Harness:
    """Feeds events to one coordinator and runs engine calls through a ScriptedEngine."""

    def __init__(self, size: int = 2, packed: bool = True, timeouts: Timeouts | None = None,
                 chunks_in_flight: int = 3):
        self.table = SlotTable(timeouts or Timeouts(10, 10, 10),
                               chunks_in_flight=chunks_in_flight)
        self.engine = ScriptedEngine(world_size=size)
        self.now = 0.0
        self.replies: dict[int, list] = {}
        self.ended: list[UpdateEnded] = []
        self.pending_calls: list[EngineCall] = []
        self.size = size
        self.packed = packed

    @property
    def coord(self) -> SlotCoordinator:
        return next(iter(self.table.slots.values()))

    def run(self, actions: list) -> None:
        """Carry out ``actions`` and the actions they lead to, in order (:meth:`take`)."""
        queue = list(actions)
        while queue:
            queue += self.take(queue.pop(0))

    def take(self, a: object) -> list:
        """One action: a ``Reply`` kept for its rank (the number ending its identity), an
        ``UpdateEnded`` kept, an ``EngineCall`` answered by the scripted engine (held in
        ``pending_calls`` while ``engine.hold``); others ignored. Returns the actions it
        leads to. Harnesses of other actions take theirs and hand the rest here."""
        if isinstance(a, Reply):
            rank = int(a.identity.decode().split("-")[-1])
            self.replies.setdefault(rank, []).append(a.msg)
        elif isinstance(a, UpdateEnded):
            self.ended.append(a)
        elif isinstance(a, EngineCall):
            if self.engine.hold:
                self.pending_calls.append(a)
                return []
            ok, res, err = self.engine.answer(a)
            return self.engine_result(a, ok, res, err)
        return []

    def engine_result(self, call: EngineCall, ok: bool, result: object, error: str) -> list:
        """The engine's answer to ``call`` handed to its coordinator."""
        return self.coord.on_engine_result(call.call_id, ok, result, error, self.now)

    def send(self, rank: int, msg) -> None:
        self.run(self.table.on_message(ident(rank), msg, self.now))

    def register_all(self) -> None:
        for r in range(self.size):
            self.send(r, reg(r, 0, self.size, packed=self.packed))

    def last(self, rank: int):
        return self.replies[rank][-1]

    def begin(self, update_id: int = 0, version: str = "v") -> None:
        """Every rank of the slot sends Begin."""
        for r in range(self.size):
            self.send(r, Begin(update_id, version))

    def round(self, update_id: int, n_chunks: int = 2, version: str | None = None) -> None:
        v = version or f"v{update_id}"
        for r in range(self.size):
            self.send(r, Begin(update_id, v))
        for k in range(n_chunks):
            for r in range(self.size):
                self.send(r, chunk(update_id, k, r, self.packed))
        for r in range(self.size):
            self.send(r, Commit(update_id, n_chunks))


def test_happy_round_order_and_acks():
    h = Harness()
    h.register_all()
    assert all(isinstance(h.last(r), Registered) for r in range(2))
    h.round(0, n_chunks=2, version="step-1")
    # I1 + I4: paused before start, one start, one finish, resume last
    assert h.engine.calls == [
        *FIRST, "init_weight_transfer_engine", "pause", "start_weight_update",
        "update_weights", "update_weights", "finish_weight_update", "resume",
    ]
    assert h.engine.version == "step-1" and not h.engine.paused
    for r in range(2):
        kinds = [(m.phase, m.index) for m in h.replies[r] if isinstance(m, Ack)]
        assert kinds == [("begin", -1), ("chunk", 0), ("chunk", 1), ("commit", -1)]
    assert h.coord.last_version == "step-1"  # I8
    assert h.coord.state is SlotState.IDLE
    assert h.ended[-1].outcome == "success" and h.ended[-1].chunks == 2
    # init only once across rounds (init_info packed flag sent)
    assert h.engine.bodies[len(FIRST)] == {"init_info": {"packed": True}}
    h.round(1)
    assert h.engine.calls.count("init_weight_transfer_engine") == 1
    # each round probes the engine (world size, session, sleep: I9), then pauses it
    # (and asks the vLLM version no more: it is known)
    assert h.engine.calls[12:17] == [*PROBES, "pause", "start_weight_update"]
    assert h.engine.calls.count("start_weight_update") == 2
    assert h.engine.calls.count("finish_weight_update") == 2


def test_chunks_sent_before_the_begin_is_acknowledged_wait_for_the_engines_start():
    """Ranks send chunks right after their begin, without waiting for its ack: they are held
    (and merged) while the engine is paused and started, and go out the moment
    ``/start_weight_update`` returns, after the begin's acks (I4: never before the start). A
    chunk from a rank that has not begun fails the update, before any engine call."""
    h = Harness()
    # (a declared kind: an engine of unknown kind has its chunks merged once its version
    # stage told vLLM from SGLang, daemon/families.py)
    h.register_all()
    h.coord.engine.declare_kind("vllm")
    h.engine.hold = True  # the begin's calls stay unanswered until released below
    h.send(0, Begin(0, "v"))
    h.send(0, chunk(0, 0, 0))  # before rank 1 has even begun
    h.send(1, Begin(0, "v"))
    h.send(1, chunk(0, 0, 1))
    for r in range(2):
        h.send(r, chunk(0, 1, r))
    assert "update_weights" not in [c.route for c in h.pending_calls]
    assert all(not any(isinstance(m, Ack) for m in h.replies[r]) for r in range(2))
    assert 0 in h.coord.current.merged and 1 in h.coord.current.merged  # merged meanwhile
    h.engine.hold = False
    while h.pending_calls:  # answer the begin's calls one by one, as the engine would
        call = h.pending_calls.pop(0)
        h.run(h.coord.on_engine_result(call.call_id, *h.engine.answer(call), h.now))
    assert h.engine.calls == [*FIRST, "init_weight_transfer_engine", "pause",
                              "start_weight_update", "update_weights", "update_weights"]
    for r in range(2):
        assert [(m.phase, m.index) for m in h.replies[r] if isinstance(m, Ack)] == [
            ("begin", -1), ("chunk", 0), ("chunk", 1)]
        h.send(r, Commit(0, 2))
    assert h.ended[-1].outcome == "success" and h.engine.version == "v"

    h2 = Harness()
    h2.register_all()
    h2.send(0, Begin(0, "v"))
    h2.send(1, chunk(0, 0, 1))
    err = h2.last(1)
    assert isinstance(err, Error) and "rank 1 sent chunk 0 before its begin" in err.message
    assert "pause" not in h2.engine.calls  # the engine was never paused


def test_chunk_waits_for_every_rank_and_acks_only_after_engine_consumed():
    h = Harness()
    h.register_all()
    h.begin()
    h.send(0, chunk(0, 0, 0))
    assert "update_weights" not in h.engine.calls  # I2: rank 1 has not sent chunk 0
    assert not any(isinstance(m, Ack) and m.phase == "chunk" for m in h.replies[0])
    h.engine.hold = True
    h.send(1, chunk(0, 0, 1))
    assert [c.route for c in h.pending_calls] == ["update_weights"]
    # I3: no chunk ack while the engine has not returned
    assert not any(isinstance(m, Ack) and m.phase == "chunk" for m in h.replies[0])
    h.engine.hold = False
    call = h.pending_calls.pop()
    ok, res, err = h.engine.answer(call)
    h.run(h.coord.on_engine_result(call.call_id, ok, res, err, h.now))
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "chunk"


def _answer_held(h: Harness) -> None:
    """Answer the oldest held engine call and feed its result back."""
    call = h.pending_calls.pop(0)
    ok, res, err = h.engine.answer(call)
    h.run(h.coord.on_engine_result(call.call_id, ok, res, err, h.now))


def _answer_begin(h: Harness) -> None:
    """Answer the held begin-stage calls (the pause waits for a first chunk) until the engine
    has started; the chunks' calls stay held."""
    while h.pending_calls and h.pending_calls[0].route in BEGIN_ROUTES:
        _answer_held(h)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_chunk_sent_ahead_is_merged_while_the_engine_loads_the_previous_one(monkeypatch,
                                                                            in_flight):
    import slotsync.daemon.vllm.family as chunk_window  # (vLLM's merge, at merge-ahead)

    merges: list[int] = []
    merged: dict[int, bytes] = {}  # the update_info JSON text, made at merge time
    real = chunk_window.merge_chunk

    def traced(idx, *a, **k):
        m = real(idx, *a, **k)
        merges.append(idx)
        merged[idx] = m.update_info_json
        return m

    monkeypatch.setattr(chunk_window, "merge_chunk", traced)
    h = Harness(packed=False, chunks_in_flight=in_flight)
    h.register_all()
    h.begin()
    h.engine.hold = True
    for k in range(2):  # ranks run one chunk ahead of their acks (the publisher's window)
        for r in range(2):
            h.send(r, chunk(0, k, r, packed=False))
    _answer_begin(h)  # (the first chunk let the pause and start go out)
    # chunk 1 merged while chunk 0's call is still in flight; with 2 in flight its call is
    # already out too, waiting at the engine behind chunk 0
    assert [c.route for c in h.pending_calls] == ["update_weights"] * in_flight
    assert [c.index for c in h.pending_calls] == list(range(in_flight))
    assert merges == [0, 1]
    assert not any(isinstance(m, Ack) and m.phase == "chunk" for m in h.replies[0])  # I3
    h.engine.hold = False
    _answer_held(h)  # chunk 0 returns: ack 0 (and with 1 in flight, chunk 1's call goes out)
    if in_flight == 2:
        _answer_held(h)
    for r in range(2):
        kinds = [(m.phase, m.index) for m in h.replies[r] if isinstance(m, Ack)]
        assert kinds == [("begin", -1), ("chunk", 0), ("chunk", 1)]
    assert merges == [0, 1]  # nothing merged twice
    for r in range(2):
        h.send(r, Commit(0, 2))
    assert h.coord.last_version == "v" and h.engine.calls.count("update_weights") == 2
    # each call carried the text encoded at merge time (no encoding when the call goes out)
    sent = [b["update_info"] for c, b in zip(h.engine.calls, h.engine.bodies, strict=True)
            if c == "update_weights"]
    assert all(isinstance(t, msgspec.Raw) for t in sent)
    assert [bytes(t) for t in sent] == [merged[0], merged[1]]


def _chunk_acks(h: Harness, rank: int) -> list[int]:
    return [m.index for m in h.replies[rank] if isinstance(m, Ack) and m.phase == "chunk"]


def _chunks_held_at_the_engine(n: int) -> Harness:
    """Update 0 begun with 2 in flight; every rank sent chunks 0..n-1; the engine holds its
    calls (``h.pending_calls``)."""
    h = Harness(chunks_in_flight=2)
    h.register_all()
    h.begin()
    h.engine.hold = True
    for k in range(n):
        for r in range(2):
            h.send(r, chunk(0, k, r))
    _answer_begin(h)
    return h


def test_chunks_in_flight_bounds_the_calls_and_acks_stay_in_index_order():
    h = _chunks_held_at_the_engine(3)
    # three chunks complete, two calls out: the third waits for a free place
    assert [c.index for c in h.pending_calls] == [0, 1]
    # chunk 1's call returns first (two HTTP requests may overtake each other): no ack yet,
    # since chunk 0 is still at the engine and acks go in index order
    second = h.pending_calls.pop(1)
    h.run(h.coord.on_engine_result(second.call_id, *h.engine.answer(second), h.now))
    assert _chunk_acks(h, 0) == [] and [c.index for c in h.pending_calls] == [0, 2]
    for r in range(2):
        h.send(r, Commit(0, 3))
    assert "finish_weight_update" not in h.engine.calls  # I1: not before every chunk returned
    h.engine.hold = False
    _answer_held(h)  # chunk 0: acks 0 and 1 together
    assert _chunk_acks(h, 0) == [0, 1] and _chunk_acks(h, 1) == [0, 1]
    assert "finish_weight_update" not in h.engine.calls  # chunk 2 still at the engine
    _answer_held(h)
    assert _chunk_acks(h, 0) == [0, 1, 2]
    assert h.engine.calls[-2:] == ["finish_weight_update", "resume"]
    assert h.coord.state is SlotState.IDLE and h.coord.last_version == "v"


def test_failed_chunk_with_another_in_flight_fails_at_once_and_the_next_begin_waits_for_it():
    h = _chunks_held_at_the_engine(2)
    first, second = h.pending_calls
    h.pending_calls.clear()
    h.engine.fail[("update_weights", 0)] = "HTTP 500: boom"
    h.run(h.coord.on_engine_result(first.call_id, *h.engine.answer(first), h.now))
    for r in range(2):  # every rank told at once, not after chunk 1's call returned
        assert isinstance(h.last(r), Error) and "boom" in h.last(r).message
    assert h.coord.state is SlotState.FAILED
    assert h.coord.status()["current_update"] is None
    calls_before = list(h.engine.calls)
    h.engine.hold = False
    h.begin(update_id=1)
    # chunk 1's call of the failed update is still at the engine: the next update's pause /
    # recovery / start wait for it (a request could otherwise overtake it on the way)
    assert h.engine.calls == calls_before
    assert h.coord.next_deadline() is None  # bounded by the HTTP client's timeout instead
    h.run(h.coord.on_engine_result(second.call_id, False, None, "HTTP 500: no active update",
                                   h.now))
    # (the engine is initialised again, so the process about to be initialised is asked its
    # vLLM version first)
    assert h.engine.calls[len(calls_before):] == [*PROBES, *ASKED,
                                                  "init_weight_transfer_engine"]
    for r in range(2):  # the pause waits for a first chunk
        h.send(r, chunk(1, 0, r))
    assert h.engine.calls[len(calls_before) + 6:] == [
        "pause", "finish_recover", "start_weight_update", "update_weights"]
    assert all(any(isinstance(m, Ack) and m.phase == "begin" and m.update_id == 1
                   for m in h.replies[r]) for r in range(2))


def test_chunks_in_flight_must_be_at_least_one():
    with pytest.raises(ValueError, match="chunks_in_flight"):
        SlotCoordinator(0, 2, chunks_in_flight=0)


def test_mismatch_found_ahead_fails_only_when_no_engine_call_is_in_flight():
    h = Harness()
    h.register_all()
    h.begin()
    h.engine.hold = True
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    h.send(0, chunk(0, 1, 0, dtype="float32"))
    h.send(1, chunk(0, 1, 1, dtype="float16"))  # chunk 1 is inconsistent, found ahead
    assert h.coord.state is SlotState.UPDATING  # chunk 0 still loading: no failure yet (I1)
    assert not any(isinstance(m, Error) for m in h.replies[0])
    h.engine.hold = False
    _answer_held(h)
    assert h.engine.calls.count("update_weights") == 1  # I2: chunk 1 never reached it
    for r in range(2):
        err = h.last(r)
        assert isinstance(err, Error) and "chunk 1" in err.message and "dtype_names" in err.message
    assert h.coord.state is SlotState.FAILED and "resume" not in h.engine.calls


def as_sent(body: dict) -> dict:
    """The body as VllmClient puts it on the wire (msgspec JSON) and vLLM parses it: bytes
    (``ipc_handles_pickled``) become standard base64 text."""
    return json.loads(msgspec.json.encode(body))


def test_merged_update_info_carries_every_uuid_packed():
    h = Harness(size=2, packed=True)
    h.register_all()
    h.round(0, n_chunks=1)
    body = h.engine.bodies[h.engine.calls.index("update_weights")]
    info = as_sent(body)["update_info"]
    assert info["names"] == ["a", "b"] and info["tensor_sizes"] == [16, 16]
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"], validate=True))
    assert set(handles) == {logical_gpu_uuid(0), logical_gpu_uuid(1)}
    args = handles[logical_gpu_uuid(1)]  # reduce_tensor's 15 slots; a flat uint8 buffer
    assert len(args) == 15 and tuple(args[1]) == (32,) and str(args[5]) == "torch.uint8"
    assert args[7:10] == (b"slotsync.shm:seg-1", 32, 0)


def test_merged_update_info_unpacked_one_dict_per_tensor():
    h = Harness(size=2, packed=False)
    h.register_all()
    h.round(0, n_chunks=1)
    info = as_sent(h.engine.bodies[h.engine.calls.index("update_weights")])["update_info"]
    assert "tensor_sizes" not in info
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"], validate=True))
    assert len(handles) == 2 and all(set(d) == {logical_gpu_uuid(0), logical_gpu_uuid(1)}
                                     for d in handles)
    args = handles[1][logical_gpu_uuid(0)]  # the tensor's own dtype and shape
    assert len(args) == 15 and tuple(args[1]) == (2, 2) and str(args[5]) == "torch.float32"
    assert args[7:10] == (b"slotsync.shm:seg-0", 16, 64)


def test_dtype_mismatch_rejected_before_engine_sees_it():
    h = Harness()
    h.register_all()
    h.begin()
    h.send(0, chunk(0, 0, 0, dtype="float32"))
    h.send(1, chunk(0, 0, 1, dtype="float16"))
    assert "update_weights" not in h.engine.calls
    for r in range(2):
        err = h.last(r)
        assert isinstance(err, Error) and err.phase == "chunk"
        assert "dtype_names" in err.message and "[1]" in err.message
    # I4: engine stays paused, not resumed, marked for a full update
    assert h.engine.paused and "resume" not in h.engine.calls
    assert h.coord.state is SlotState.FAILED and h.coord.engine.needs_full_update
    assert h.coord.last_version is None  # I8


def test_ranks_whose_manifests_differ_are_refused_before_the_pause():
    """Issue 17: ranks that will send different tensors (their begins' manifests differ) are
    refused before the engine is touched beyond the probes, naming the first tensor position
    where the lists part; the same manifests pass."""
    from slotsync.protocol.manifest import manifest_of

    ours = [("a", "float32", (2, 2)), ("b", "float32", (2, 2))]
    theirs = [("a", "float32", (2, 2)), ("b", "float16", (2, 2)), ("c", "bool", (1,))]
    h = Harness()
    h.register_all()
    h.send(0, Begin(0, "v", manifest=manifest_of(ours)))
    h.send(1, Begin(0, "v", manifest=manifest_of(theirs)))
    assert "pause" not in h.engine.calls and not h.engine.paused
    for r in range(2):
        err = h.last(r)
        assert isinstance(err, Error) and err.phase == "begin", err
        assert err.tensor_index == 1, err
        assert "rank 1 begins update 0 with tensors that differ from rank 0's from tensor #1"\
            in err.message and "rank 1 sends 3 tensors, rank 0 2" in err.message, err.message
        assert "same tensors" in err.message
    assert not h.coord.engine.needs_full_update  # the engine's weights were never touched
    # the next update, with agreeing manifests (and one rank without: not compared), goes on
    h.send(0, Begin(1, "v1", manifest=manifest_of(ours)))
    h.send(1, Begin(1, "v1"))
    for r in range(2):
        h.send(r, chunk(1, 0, r))
    assert "pause" in h.engine.calls
    for r in range(2):
        h.send(r, Commit(1, 1))
    assert h.coord.last_version == "v1"


def test_engine_500_on_chunk_k_every_rank_gets_error_engine_not_resumed():
    h = Harness()
    h.register_all()
    h.engine.fail[("update_weights", 1)] = "HTTP 500: boom on chunk 1"
    h.round(0, n_chunks=3)
    for r in range(2):
        errs = [m for m in h.replies[r] if isinstance(m, Error)]
        err = errs[0]  # one fatal error per rank; later sends are told the update failed
        assert err.fatal and err.phase == "engine" and "boom on chunk 1" in err.message
        assert err.update_id == 0 and err.slot == [0, 2]
        assert all(not e.fatal and "already failed" in e.message for e in errs[1:])
    assert "resume" not in h.engine.calls and "finish_weight_update" not in h.engine.calls
    assert h.engine.paused
    assert h.ended[-1].outcome == "failed"
    # next round recovers: finish (tolerated failure), then a full start/update/finish/resume
    h.engine.calls.clear()
    h.round(1, n_chunks=1)
    assert h.engine.calls == [
        *PROBES, *ASKED, "init_weight_transfer_engine", "pause", "finish_recover",
        "start_weight_update", "update_weights", "finish_weight_update", "resume",
    ]
    assert h.coord.state is SlotState.IDLE and h.coord.last_version == "v1"


def test_full_update_after_a_failure_covers_what_successful_updates_loaded():
    """I4: after a failed update the engine resumes only once an update has loaded every name
    that earlier *successful* updates loaded; names only a failed update loaded are not
    demanded."""
    h = Harness()
    h.register_all()
    h.round(0, n_chunks=1)  # a, b
    h.engine.fail[("update_weights", 2)] = "HTTP 500: boom"  # update 1's chunk 1
    h.begin(1)
    for k, names in enumerate((("x", "y"), ("a", "b"))):
        for r in range(2):
            h.send(r, chunk(1, k, r, names=names))
    assert h.ended[-1].outcome == "failed" and h.coord.engine.needs_full_update

    def update(uid: int, names: tuple[str, ...]) -> object:
        h.begin(uid)
        for r in range(2):
            h.send(r, chunk(uid, 0, r, names=names))
        for r in range(2):
            h.send(r, Commit(uid, 1))
        return h.last(0)

    err = update(2, ("a",))
    assert isinstance(err, Error) and "misses 1 of the 2 tensor names the last successful " \
        "update loaded: b;" in err.message, err
    assert h.engine.paused and "resume" not in h.engine.calls[-3:]
    ok = update(3, ("b", "a"))  # x and y, loaded only by the failed update, are not needed
    assert isinstance(ok, Ack) and ok.phase == "commit" and not h.engine.paused


def test_recovery_finish_clears_split_engine():
    # The engine is still active (e.g. some workers kept their session): recovery finish works.
    h = Harness()
    h.register_all()
    h.begin()
    h.send(0, chunk(0, 0, 0))  # a first chunk: the engine is paused and started
    h.send(0, Abort(0, "trainer crashed"))
    assert all(isinstance(h.last(r), Error) and h.last(r).phase == "abort" for r in range(2))
    assert h.engine.active  # start happened, no finish
    h.round(1, n_chunks=1)
    assert h.engine.calls.count("finish_recover") == 1 and not h.engine.active
    assert h.coord.last_version == "v1"


def test_missing_rank_chunk_deadline_names_rank():
    h = Harness(timeouts=Timeouts(begin_s=5, chunk_s=3, commit_s=30))
    h.register_all()
    h.begin()
    h.send(0, chunk(0, 0, 0))
    assert h.coord.next_deadline() == pytest.approx(3.0)
    h.now = 2.9
    h.run(h.table.poll(h.now))
    assert not isinstance(h.last(0), Error)
    h.now = 3.0
    h.run(h.table.poll(h.now))
    for r in range(2):
        err = h.last(r)
        assert isinstance(err, Error) and err.phase == "chunk" and err.missing_ranks == [1]
        assert "chunk 0" in err.message and "[1]" in err.message
    assert h.coord.current is None and h.coord.next_deadline() is None


def test_chunk_sent_during_the_begin_waits_for_the_other_ranks_from_the_engines_start():
    """A chunk that arrived while the engine was being paused and started (slowly here) gives
    the other ranks ``chunk_s`` from the start's return, not from its arrival (I5)."""
    h = Harness(timeouts=Timeouts(begin_s=50, chunk_s=3, commit_s=30))
    h.register_all()
    h.engine.hold = True
    h.begin()
    h.send(0, chunk(0, 0, 0))  # at t=0, while the begin's calls run
    h.now = 10.0  # the engine took 10 s to pause and start
    h.engine.hold = False
    while h.pending_calls:
        call = h.pending_calls.pop(0)
        h.run(h.coord.on_engine_result(call.call_id, *h.engine.answer(call), h.now))
    assert h.coord.next_deadline() == pytest.approx(13.0)
    h.now = 12.9
    h.run(h.table.poll(h.now))
    assert h.coord.current is not None
    h.now = 13.0
    h.run(h.table.poll(h.now))
    err = h.last(1)
    assert isinstance(err, Error) and err.phase == "chunk" and err.missing_ranks == [1]


def test_begin_deadline_names_missing_rank():
    h = Harness(timeouts=Timeouts(begin_s=5, chunk_s=3, commit_s=30))
    h.register_all()
    h.send(0, Begin(0, "v"))
    h.now = 5.0
    h.run(h.table.poll(h.now))
    assert isinstance(h.last(0), Error) and h.last(0).missing_ranks == [1]


def test_no_deadline_while_engine_call_in_flight():
    h = Harness(timeouts=Timeouts(1, 1, 1))
    h.register_all()
    h.engine.hold = True
    h.send(0, Begin(0, "v"))
    h.send(1, Begin(0, "v"))
    assert h.coord.next_deadline() is None  # the HTTP client's timeout bounds the engine


def test_commit_deadline_when_rank_stalls_after_chunks():
    h = Harness(timeouts=Timeouts(5, 5, 7))
    h.register_all()
    for r in range(2):
        h.send(r, Begin(0, "v"))
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    h.send(0, Commit(0, 1))
    h.now = 7.0
    h.run(h.table.poll(h.now))
    assert isinstance(h.last(1), Error) and h.last(1).missing_ranks == [1]


def test_commit_before_every_chunk_arrived_fails():
    h = Harness()
    h.register_all()
    for r in range(2):
        h.send(r, Begin(0, "v"))
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    h.send(0, Commit(0, 2))  # it sent only one chunk
    err = h.last(1)
    assert isinstance(err, Error) and err.phase == "commit" and "committed 2 chunks but sent 1" \
        in err.message
    assert "finish_weight_update" not in h.engine.calls


def test_chunk_after_commit_fails():
    h = Harness()
    h.register_all()
    for r in range(2):
        h.send(r, Begin(0, "v"))
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    h.send(0, Commit(0, 1))
    h.send(0, chunk(0, 1, 0))
    assert isinstance(h.last(1), Error) and "after commit" in h.last(1).message


def test_second_update_refused_while_one_in_flight_and_stale_id():
    h = Harness()
    h.register_all()
    h.send(0, Begin(0, "v"))
    h.send(0, Begin(1, "w"))
    err = h.last(0)
    assert isinstance(err, Error) and not err.fatal and "refusing a second update" in err.message
    assert "start_weight_update" not in h.engine.calls  # rank 1 has not begun yet
    h.send(1, Begin(0, "v"))
    for k in range(1):
        for r in range(2):
            h.send(r, chunk(0, k, r))
    assert h.engine.calls.count("start_weight_update") == 1  # I1
    for r in range(2):
        h.send(r, Commit(0, 1))
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "commit"
    h.send(0, Begin(0, "again"))  # I7: an id of an earlier round
    assert isinstance(h.last(0), Error) and "stale update id 0" in h.last(0).message


def test_version_disagreement_fails():
    h = Harness()
    h.register_all()
    h.send(0, Begin(0, "v1"))
    h.send(1, Begin(0, "v2"))
    assert isinstance(h.last(1), Error) and "'v2'" in h.last(1).message


def test_world_size_mismatch_refused_before_start():
    h = Harness()
    h.engine.world_size = 4
    h.register_all()
    h.begin()
    assert "start_weight_update" not in h.engine.calls
    assert "world size 4" in h.last(0).message


def test_engine_restarted_with_another_world_size_is_refused_before_the_pause():
    """The world size is probed at every begin (I9): an engine restarted with another layout
    between two rounds is refused with the engine still serving."""
    h = Harness()
    h.register_all()
    h.round(0)
    h.engine.restart()
    h.engine.world_size = 4
    h.engine.calls.clear()
    h.begin(1)
    assert "pause" not in h.engine.calls and not h.engine.paused
    assert "world size 4" in h.last(0).message


def test_registration_conflicts():
    t = SlotTable()
    a = t.on_message(ident(0), reg(0, url="http://a:1"), 0.0)
    assert isinstance(a[0].msg, Registered)
    b = t.on_message(ident(1), reg(1, url="http://b:2"), 0.0)
    assert isinstance(b[0].msg, Error)
    assert "http://b:2" in b[0].msg.message and "http://a:1" in b[0].msg.message
    c = t.on_message(ident(1), reg(1, version=PROTOCOL_VERSION + 1), 0.0)
    assert "protocol version mismatch" in c[0].msg.message
    assert f"speaks {PROTOCOL_VERSION + 1}" in c[0].msg.message
    d = t.on_message(ident(1), reg(1, url="http://a:1", uuid=logical_gpu_uuid(0)), 0.0)
    assert "already held by rank 0" in d[0].msg.message
    e = t.on_message(ident(3), reg(3, start=1, size=4), 0.0)
    assert "overlaps" in e[0].msg.message
    f = t.on_message(ident(9), Begin(0, "v"), 0.0)
    assert "has not registered" in f[0].msg.message
    # the refusals name the message's update id (a publisher that sent chunks after a begin a
    # restarted daemon refused tells them from its new update's replies), none for others
    assert (f[0].msg.code, f[0].msg.update_id) == (NOT_REGISTERED, 0)
    g = t.on_message(ident(9), chunk(4, 0, 9), 0.0)
    assert (g[0].msg.code, g[0].msg.update_id) == (NOT_REGISTERED, 4)
    assert t.on_message(ident(9), Commit(4, 1), 0.0)[0].msg.update_id == 4


def test_begin_waits_for_slot_registration_then_starts():
    h = Harness(timeouts=Timeouts(begin_s=5, chunk_s=5, commit_s=5))
    h.send(0, reg(0))
    h.send(0, Begin(0, "v"))
    assert not h.engine.calls  # the slot is incomplete: nothing touches the engine yet
    h.send(1, reg(1))
    assert "pause" not in h.engine.calls  # rank 1 has not begun: generation goes on
    h.send(1, Begin(0, "v"))
    assert "pause" not in h.engine.calls  # no chunk yet: nothing to load
    h.send(1, chunk(0, 0, 1))
    assert h.engine.calls[-2:] == ["pause", "start_weight_update"]
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "begin"


def test_engine_is_paused_only_once_every_rank_has_begun():
    """A rank that never begins fails the begin at its deadline with the engine serving;
    one refused at registration fails it at once, naming the rank."""
    h = Harness(timeouts=Timeouts(begin_s=5, chunk_s=5, commit_s=5))
    h.register_all()
    h.send(0, Begin(0, "v"))
    assert "pause" not in h.engine.calls and not h.engine.paused
    h.now = 6.0
    h.run(h.table.poll(h.now))
    err = h.last(0)
    assert isinstance(err, Error) and err.phase == "begin" and err.missing_ranks == [1]
    assert not h.engine.paused and not h.coord.engine.needs_full_update
    h.send(0, Begin(1, "w"))
    h.send(1, reg(1, url="http://elsewhere:1"))  # refused: the slot's engine is another
    err = h.last(0)
    assert isinstance(err, Error) and "http://elsewhere:1" in err.message
    assert not h.engine.paused and "pause" not in h.engine.calls


def test_begin_deadline_names_unregistered_rank():
    h = Harness(timeouts=Timeouts(begin_s=5, chunk_s=5, commit_s=5))
    h.send(0, reg(0))
    h.send(0, Begin(0, "v"))
    h.now = 5.0
    h.run(h.table.poll(h.now))
    err = h.last(0)
    assert isinstance(err, Error) and err.missing_ranks == [1] and not h.engine.calls


def test_late_engine_result_of_failed_update_is_dropped():
    h = Harness(timeouts=Timeouts(1, 1, 1))
    h.register_all()
    h.begin()
    h.engine.hold = True
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    _answer_begin(h)
    call = h.pending_calls.pop()
    assert call.route == "update_weights"
    h.send(0, Abort(0, "x"))
    assert h.coord.on_engine_result(call.call_id, True, {}, "", h.now) == []


def test_daemon_stop_fails_update_and_leaves_engine_paused():
    h = Harness()
    h.register_all()
    h.begin()
    h.send(0, chunk(0, 0, 0))  # the engine is paused and started
    h.run(h.table.shutdown(h.now, "SIGTERM"))
    assert all(h.last(r).phase == "shutdown" for r in range(2))
    assert h.engine.paused and h.coord.engine.needs_full_update
    # an update that had not touched the engine yet leaves it serving
    h2 = Harness()
    h2.register_all()
    h2.begin()
    h2.run(h2.table.shutdown(h2.now, "SIGTERM"))
    assert all(h2.last(r).phase == "shutdown" for r in range(2))
    assert not h2.engine.paused and not h2.coord.engine.needs_full_update


def test_reregistration_during_update_fails_it():
    h = Harness()
    h.register_all()
    h.begin()
    h.send(1, reg(1))
    assert any(isinstance(m, Error) and "re-registered" in m.message for m in h.replies[0])
    assert isinstance(h.last(1), Registered) and h.last(1).next_update_id == 1


def test_unrecorded_session_on_engine_is_ended_and_start_retried_once():
    h = Harness()
    h.engine.active = True  # e.g. a daemon restarted without its state dir
    h.register_all()
    h.round(0, n_chunks=1)
    assert h.engine.calls[:10] == [
        *FIRST, "init_weight_transfer_engine", "pause", "start_weight_update",
        "finish_recover", "start_weight_update",
    ]
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "commit"


def test_conflicting_registration_fails_a_waiting_begin_for_every_rank():
    h = Harness(size=3)
    h.send(0, reg(0, size=3))
    h.send(1, reg(1, size=3))
    h.send(0, Begin(0, "v"))
    h.send(2, reg(2, size=3, url="http://other:1"))
    for r in (0, 1, 2):
        err = h.last(r)
        assert isinstance(err, Error) and "http://other:1" in err.message, (r, err)
    assert not h.engine.calls


def test_mismatch_of_name_counts_names_the_missing_tensor():
    h = Harness()
    h.register_all()
    h.begin()
    h.send(0, chunk(0, 0, 0, names=("a", "lm_head.weight", "c")))
    h.send(1, chunk(0, 0, 1, names=("a", "c")))
    err = next(m for m in h.replies[0] if isinstance(m, Error))
    assert "2 entries instead of 3 (without 'lm_head.weight')" in err.message, err.message


def test_mismatch_names_differing_ranks_but_none_missing():
    h = Harness()
    h.register_all()
    h.begin()
    h.send(0, chunk(0, 0, 0, names=("a", "b")))
    h.send(1, chunk(0, 0, 1, names=("a", "c")))
    err = h.last(0)
    assert err.missing_ranks == [] and "rank(s) [1]" in err.message


def test_reregistration_of_a_rank_that_had_not_begun_keeps_the_update():
    h = Harness()
    h.register_all()
    h.send(0, Begin(0, "v"))  # rank 1's old process never began
    h.send(1, reg(1))  # its new process registers
    assert h.coord.current is not None
    h.send(1, Begin(0, "v"))
    h.send(1, chunk(0, 0, 1))
    assert isinstance(h.last(1), Ack) and h.last(1).phase == "begin"


def test_new_job_with_another_engine_resets_the_slot():
    t = SlotTable()
    for r in range(2):
        t.on_message(ident(r), reg(r, url="http://old:1"), 0.0)
    # the old job is gone; the new job's rank 1 comes first, with another engine URL
    a = t.on_message(b"new-1", reg(1, url="http://new:2"), 0.0)
    assert isinstance(a[0].msg, Registered)
    c = t.coordinator((0, 2))
    assert c.engine_url == "http://new:2" and sorted(c.ranks) == [1]
    assert "slot reset" in c.last_error
    b = t.on_message(b"new-0", reg(0, url="http://new:2"), 0.0)
    assert isinstance(b[0].msg, Registered)
    # the old rank 0 connection is forgotten
    f = t.on_message(ident(0), Begin(0, "v"), 0.0)
    assert isinstance(f[0].msg, Error) and "has not registered" in f[0].msg.message


def _send_round(h: Harness, uid: int, chunks: list[tuple[str, ...]]) -> None:
    for r in range(h.size):
        h.send(r, Begin(uid, f"v{uid}"))
    for k, names in enumerate(chunks):
        for r in range(h.size):
            h.send(r, chunk(uid, k, r, h.packed, names=names))
    for r in range(h.size):
        h.send(r, Commit(uid, len(chunks)))


def test_after_a_failure_only_an_update_covering_every_known_tensor_resumes_the_engine():
    """I4: a failed update leaves half-loaded weights; an update that sends fewer tensors than
    the slot's successful updates did (even none at all) must not resume the engine."""
    h = Harness()
    h.register_all()
    _send_round(h, 0, [("a", "b"), ("c",)])
    assert h.coord.last_version == "v0"
    h.engine.fail[("update_weights", 3)] = "HTTP 500: boom"  # 2nd chunk of round 1
    _send_round(h, 1, [("a", "b"), ("c",)])
    assert h.coord.state is SlotState.FAILED and h.engine.paused
    h.engine.calls.clear()
    _send_round(h, 2, [("a", "b")])  # "c" missing: loaded, but not finished nor resumed
    err = h.last(0)
    assert isinstance(err, Error) and err.phase == "commit" and "full update" in err.message
    assert "misses 1 of the 3 tensor names the last successful update loaded: c;" in err.message
    assert "finish_weight_update" not in h.engine.calls and "resume" not in h.engine.calls
    assert h.coord.state is SlotState.FAILED and h.coord.last_version == "v0"
    _send_round(h, 3, [("c",), ("b", "a")])  # every tensor again, any order: recovers
    assert h.coord.state is SlotState.IDLE and h.coord.last_version == "v3"
    assert not h.engine.paused


def test_rank_sending_more_chunks_than_another_committed_fails_at_once():
    """A rank with extra tensors is named at once, not found by a deadline blaming the rank
    that already committed."""
    for order in ("commit_first", "extra_first"):
        h = Harness(timeouts=Timeouts(100, 100, 100))
        h.register_all()
        for r in range(2):
            h.send(r, Begin(0, "v"))
        for r in range(2):
            h.send(r, chunk(0, 0, r))
        if order == "commit_first":
            h.send(0, Commit(0, 1))
            h.send(1, chunk(0, 1, 1))
            want = "rank 1 sent chunk 1 but rank 0 committed 1 chunks"
        else:
            h.send(1, chunk(0, 1, 1))
            h.send(0, Commit(0, 1))
            want = "rank 0 committed 1 chunks but rank 1 already sent 2"
        for r in range(2):
            err = h.last(r)
            assert isinstance(err, Error) and want in err.message, err
            assert "same staging_bytes" in err.message
        assert h.coord.state is SlotState.FAILED


def test_two_slots_cannot_feed_one_engine():
    """I1: one engine per slot; a second slot naming the same URL is refused at registration."""
    table = SlotTable(Timeouts(10, 10, 10))
    assert isinstance(table.on_message(ident(0), reg(0, 0, 2), 0.0)[0].msg, Registered)
    out = table.on_message(ident(7), reg(7, 7, 2, url=URL + "/"), 0.0)
    err = out[0].msg
    assert isinstance(err, Error) and err.phase == "register"
    assert "already feeds" in err.message and "[0, 2)" in err.message
    assert (7, 9) not in table.slots
    # another engine for that slot is fine
    assert isinstance(table.on_message(ident(7), reg(7, 7, 2, url="http://other:8000"),
                                       0.0)[0].msg, Registered)


# ---------------------------------------------------------------- issue 14: what vLLM does


class EventLog(Harness):
    """A Harness that also keeps the SlotEvents (log lines) the coordinator emits."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events: list[SlotEvent] = []

    def run(self, actions: list) -> None:
        self.events += [a for a in actions if isinstance(a, SlotEvent)]
        queue = [a for a in actions if not isinstance(a, SlotEvent)]
        while queue:
            a = queue.pop(0)
            if isinstance(a, EngineCall) and not self.engine.hold:
                ok, res, err = self.engine.answer(a)
                out = self.coord.on_engine_result(a.call_id, ok, res, err, self.now)
                self.events += [x for x in out if isinstance(x, SlotEvent)]
                queue += [x for x in out if not isinstance(x, SlotEvent)]
            else:
                super().run([a])


def test_failure_while_the_pause_is_in_flight_resumes_the_engine():
    """Defect 2 of issue 14: an update that fails while /pause is in flight (here a rank
    aborts) left the engine paused while /status said idle, engine_paused=false. Now the
    daemon asks /is_paused once the pause returned and resumes the engine (no weight update
    had started: its weights are intact)."""
    h = EventLog()
    h.register_all()
    h.begin()
    h.engine.hold = True
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    pause = h.pending_calls.pop(0)
    assert pause.route == "pause"
    h.send(1, Abort(0, "input error"))
    assert "engine is resumed if the pause reached it" in h.last(0).message
    assert h.coord.state is SlotState.RECOVERING
    assert h.coord.status()["engine_paused"] is True  # it may be: the check will tell
    h.engine.hold = False
    h.run(h.coord.on_engine_result(pause.call_id, *h.engine.answer(pause), h.now))
    assert h.engine.calls[-3:] == ["pause", "is_paused", "resume"]
    assert not h.engine.paused
    st = h.coord.status()
    assert st["state"] == "idle" and st["engine_paused"] is False
    assert st["needs_full_update"] is False
    assert [e.event for e in h.events] == ["engine_resumed_after_failure"]
    h.round(1)  # a partial update is fine: the weights were never touched
    assert h.coord.last_version == "v1"


def test_pause_that_timed_out_is_checked_and_a_paused_engine_resumed():
    """The pause's own failure (a timeout: it may have reached the engine) is checked too; a
    failed update that had started leaves the engine paused and failed instead (I4)."""
    h = Harness()
    h.register_all()
    real = h.engine.answer

    late = {"pause": True}

    def late_pause(call):  # the first pause lands, but its answer comes after the deadline
        if call.route == "pause" and late.pop("pause", False):
            h.engine.calls.append("pause")
            h.engine.paused = True
            return False, None, "pause: no answer within 2.5 s"
        return real(call)

    h.engine.answer = late_pause
    h.begin()
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    assert h.last(0).phase == "engine" and "no answer" in h.last(0).message
    assert h.engine.calls[-2:] == ["is_paused", "resume"] and not h.engine.paused
    assert h.coord.state is SlotState.IDLE and not h.coord.engine.needs_full_update
    h.engine.calls.clear()
    h.engine.fail[("update_weights", 0)] = "HTTP 500: boom"
    h.round(1, n_chunks=1)
    assert "is_paused" not in h.engine.calls and "resume" not in h.engine.calls
    assert h.engine.paused and h.coord.state is SlotState.FAILED


def test_engine_restarted_between_rounds_is_initialised_again_and_needs_a_full_update():
    """Defect 3 of issue 14: an engine restarted at the same URL between rounds was not
    initialised again (vLLM's packed flag is False until init: its next packed update fails
    with a bare AssertionError). The begin's /weight_info probe now sees the restart."""
    h = EventLog()
    h.register_all()
    _send_round(h, 0, [("a", "b"), ("c",)])
    h.engine.restart()
    h.engine.calls.clear()
    _send_round(h, 1, [("a", "b")])  # partial: must not resume a restarted engine
    err = h.last(0)
    assert isinstance(err, Error) and "needs a full update" in err.message
    assert "misses 1 of the 3" in err.message and "c;" in err.message
    # the new session's vLLM version is asked again (the cached one was the old process's)
    assert h.engine.calls[:6] == [*PROBES, *ASKED, "init_weight_transfer_engine"]
    assert [e.event for e in h.events] == ["engine_session_new"]
    assert "'default'" in h.events[0].fields["why"] and "'v0'" in h.events[0].fields["why"]
    _send_round(h, 2, [("a", "b"), ("c",)])
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "commit"
    assert h.coord.last_version == "v2" and not h.engine.paused


def test_engine_restarted_with_another_model_takes_its_full_update():
    """An engine restarted with another model (no tensor name in common with the last update
    the daemon loaded): the update that loads every chunk finishes, logged as
    engine_model_changed, and its names are the ones the next full update must cover. Without
    a restart, or with names in common, a partial update is still refused (above)."""
    h = EventLog()
    h.register_all()
    _send_round(h, 0, [("a", "b"), ("c",)])
    h.engine.restart()
    _send_round(h, 1, [("x", "y")])
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "commit", h.last(0)
    assert [e.event for e in h.events] == ["engine_session_new", "engine_model_changed"]
    assert h.coord.last_version == "v1" and not h.engine.paused
    assert h.coord.engine.last_ok_names == {"x", "y"}
    h.engine.restart()
    _send_round(h, 2, [("x",)])  # restarted again, a name in common: still a full update
    err = h.last(0)
    assert isinstance(err, Error) and "needs a full update" in err.message, err
    assert "misses 1 of the 2" in err.message and h.engine.paused


def _manifest_round(h: Harness, uid: int, chunks: list[tuple[str, ...]],
                    dtype: str = "float32", begin_only: bool = False) -> None:
    """``_send_round`` whose begins carry the manifest of what the chunks will hold;
    ``begin_only``: the begins and the first chunk (the pause waits for one), no more."""
    from slotsync.protocol.manifest import manifest_of

    m = manifest_of([(n, dtype, [2, 2]) for names in chunks for n in names])
    for r in range(h.size):
        h.send(r, Begin(uid, f"v{uid}", manifest=m))
    for k, names in enumerate(chunks):
        for r in range(h.size):
            h.send(r, chunk(uid, k, r, h.packed, dtype=dtype, names=names))
        if begin_only:
            return
    for r in range(h.size):
        h.send(r, Commit(uid, len(chunks)))


def test_a_partial_round_after_a_restart_is_refused_at_its_begin_from_the_manifest():
    """Issue 35 item 13 (vLLM; the rule is the core's, every family's): after a restart the
    slot needs a full update, and a round whose begins' manifests leave out a name the last
    update loaded is refused at the begin, before the pause -- not at the commit, after the
    pause and every chunk, which left the restarted engine paused on torn weights. The
    refusal names what is missing (at most 20 names, then a count)."""
    h = EventLog()
    h.register_all()
    names = tuple(f"t{i:02d}" for i in range(30))
    _manifest_round(h, 0, [names[:15], names[15:]])
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "commit"
    h.engine.restart()
    h.engine.calls.clear()
    _manifest_round(h, 1, [names[:4]], begin_only=True)
    for r in range(2):
        (err,) = [m for m in h.replies[r] if isinstance(m, Error) and m.update_id == 1
                  and m.phase == "begin"]
    assert "needs a full update" in err.message and "leave out 26 of the 30" in err.message
    assert "t04, t05" in err.message and "t23 and 6 more" in err.message, err.message
    assert "pause" not in h.engine.calls and not h.engine.paused  # (the engine serves on)
    assert h.coord.engine.needs_full_update
    # a full round with a dtype changed passes the begin (the same names and shapes) and lands
    _manifest_round(h, 2, [names[:15], names[15:]], dtype="float16")
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "commit", h.last(0)
    assert h.coord.last_version == "v2" and not h.engine.paused


def test_a_restarted_engine_with_another_model_is_not_refused_at_the_begin():
    """A manifest sharing no name with the last update, on a new engine session: perhaps
    another model (``engine_model_changed``), left to the commit as before; without a
    restart the same manifest is refused at the begin (the engine needs a full update after
    a failed one)."""
    h = EventLog()
    h.register_all()
    _manifest_round(h, 0, [("a", "b"), ("c",)])
    h.engine.restart()
    _manifest_round(h, 1, [("x", "y")])
    assert isinstance(h.last(0), Ack) and h.last(0).phase == "commit", h.last(0)
    h.engine.fail[("update_weights", 3)] = "HTTP 500: boom"  # (round 2's chunk)
    _manifest_round(h, 2, [("x", "y")])
    assert h.engine.paused and h.coord.engine.needs_full_update
    h.engine.calls.clear()
    _manifest_round(h, 3, [("a",)], begin_only=True)
    err = h.replies[0][-1]
    assert isinstance(err, Error) and err.phase == "begin", err
    assert "leave out 2 of the 2" in err.message and "x, y" in err.message, err.message
    assert "pause" not in h.engine.calls


def test_connection_lost_since_the_last_round_counts_as_a_possible_restart():
    """A refused or reset connection since the last round: the engine is initialised again;
    the weight version the daemon finished proves it is the same process (no full update);
    an engine that reports 'default' cannot be told apart and is treated as new."""
    h = Harness()
    h.register_all()
    _send_round(h, 0, [("a", "b")])
    h.coord.on_connection_lost(h.now)
    h.engine.calls.clear()
    _send_round(h, 1, [("a",)])  # partial, but the engine is the same: fine
    assert h.coord.last_version == "v1" and h.last(0).omitted_names == ["b"]
    # (a restart suspected: the vLLM version is asked again, before the probe)
    assert h.engine.calls[:6] == [*FIRST, "init_weight_transfer_engine"]
    h2 = Harness()
    h2.register_all()
    h2.engine.fail[("update_weights", 0)] = "HTTP 500: boom"
    _send_round(h2, 0, [("a", "b")])  # no success yet: the engine still says "default"
    h2.engine.fail.clear()
    _send_round(h2, 1, [("a", "b")])
    assert h2.coord.last_version == "v1"
    h2.engine.restart()
    h2.coord.on_connection_lost(h2.now)
    h2.engine.calls.clear()
    _send_round(h2, 2, [("a", "b")])
    assert h2.coord.last_version == "v2"  # (v1 was finished: its version proves nothing lost)
    assert "init_weight_transfer_engine" in h2.engine.calls


def test_update_with_no_chunk_from_any_rank_is_refused_at_commit_before_the_engine_is_touched():
    """Defect 4 of issue 14: every rank committing zero chunks paused, started, finished and
    resumed the engine and moved its weight version with no weights loaded."""
    h = Harness()
    h.register_all()
    h.round(0, n_chunks=1)
    h.engine.calls.clear()
    h.begin(1)
    for r in range(2):
        h.send(r, Commit(1, 0))
    for r in range(2):
        err = h.last(r)
        assert isinstance(err, Error) and err.phase == "commit", err
        assert "has no chunks" in err.message and "ranks [0, 1]" in err.message
        assert "nothing to load" in err.message and "the engine was not paused" in err.message
    assert not set(h.engine.calls) & {"pause", "start_weight_update", "finish_weight_update"}
    assert h.engine.version == "v0" and h.coord.last_version == "v0"
    assert h.coord.state is SlotState.IDLE and not h.engine.paused


def test_update_leaving_out_names_of_the_last_one_is_reported():
    """Defect 5 of issue 14 (warn): a successful update that omits a name the previous one
    loaded (a tied lm_head.weight) succeeds, and vLLM keeps that tensor's old values: the
    commit ack (PublishStats), a log line and UpdateEnded (the metric) say so."""
    h = EventLog()
    h.register_all()
    _send_round(h, 0, [("a", "lm_head.weight"), ("c",)])
    _send_round(h, 1, [("a",), ("c",)])
    ack = h.last(0)
    assert isinstance(ack, Ack) and ack.phase == "commit"
    assert ack.omitted_names == ["lm_head.weight"] and ack.omitted_count == 1
    assert h.ended[-1].outcome == "success" and h.ended[-1].omitted_names == 1
    ev = [e for e in h.events if e.event == "omitted_names"]
    assert len(ev) == 1 and ev[0].fields["names"] == "lm_head.weight" and ev[0].warning
    _send_round(h, 2, [("a",), ("c",)])  # compared with the last successful update only
    assert h.last(0).omitted_count == 0 and h.ended[-1].omitted_names == 0


def test_omitted_names_refuse_fails_before_the_finish():
    h = Harness()
    h.table = SlotTable(Timeouts(10, 10, 10), omitted_names="refuse")
    h.register_all()
    _send_round(h, 0, [("a", "lm_head.weight")])
    h.engine.calls.clear()
    _send_round(h, 1, [("a",)])
    err = h.last(0)
    assert isinstance(err, Error) and err.phase == "commit"
    assert "leaves out 1 tensor names" in err.message and "lm_head.weight" in err.message
    assert "finish_weight_update" not in h.engine.calls and h.engine.paused
    assert h.coord.state is SlotState.FAILED
    with pytest.raises(ValueError, match="omitted_names"):
        SlotCoordinator(0, 2, omitted_names="ignore")


def test_restoring_update_covers_the_last_successful_update_not_every_name_ever_seen():
    """Defect 5 of issue 14: after a failure the full-update rule wanted every name loaded
    since the daemon started, so a model that legitimately stopped sending one kept its
    engine paused until the daemon restarted."""
    h = Harness()
    h.register_all()
    _send_round(h, 0, [("a", "b"), ("old",)])
    _send_round(h, 1, [("a", "b")])  # "old" is gone from the model (a warning)
    h.engine.fail[("update_weights", 3)] = "HTTP 500: boom"
    _send_round(h, 2, [("a", "b")])
    assert h.coord.state is SlotState.FAILED
    _send_round(h, 3, [("b",)])
    err = h.last(0)
    assert isinstance(err, Error) and "misses 1 of the 2 tensor names" in err.message
    assert "a;" in err.message and "old" not in err.message  # names what is missing
    _send_round(h, 4, [("a", "b")])
    assert h.coord.last_version == "v4" and not h.engine.paused


def test_gpu_uuid_set_is_checked_before_the_pause():
    """Defect 6 of issue 14: only the count was compared with /get_world_size; a wrong UUID
    surfaced after the pause, as vLLM's 'IPC handle not found'. Known UUIDs (the engine
    table's, or the reference engine's report) are now compared as a set first."""
    other = "0aaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    h = Harness()
    h.table.set_engine_table({(0, 2): URL}, {(0, 2): (logical_gpu_uuid(0), other)})
    h.register_all()
    h.round(0, n_chunks=1)
    err = next(m for m in h.replies[1] if isinstance(m, Error))
    assert err.phase == "begin" and err.fatal
    assert f"rank(s) 1 ({logical_gpu_uuid(1)})" in err.message and other in err.message
    assert "engine table declares" in err.message
    assert "pause" not in h.engine.calls and not h.engine.paused
    h2 = Harness()
    real = h2.engine.answer

    def with_uuids(call):
        ok, res, err = real(call)
        if call.route == "get_world_size":
            res = {**res, "gpu_uuids": [logical_gpu_uuid(1), "GPU-" + other.upper()]}
        return ok, res, err

    h2.engine.answer = with_uuids
    h2.register_all()
    h2.round(0, n_chunks=1)
    err = next(m for m in h2.replies[0] if isinstance(m, Error))
    assert "engine http://engine:8000 reports" in err.message
    assert "pause" not in h2.engine.calls
    h3 = Harness()  # matching, any order: the update goes through
    h3.table.set_engine_table({(0, 2): URL}, {(0, 2): (logical_gpu_uuid(1), logical_gpu_uuid(0))})
    h3.register_all()
    h3.round(0, n_chunks=1)
    assert h3.coord.last_version == "v0"


def test_engine_found_sleeping_needs_a_full_update_and_is_left_paused():
    """Defect 7 of issue 14: vLLM's /sleep?level=2 discards the weights, and the daemon never
    noticed a sleep it did not send: it resumed such an engine after a partial update. Now
    /is_sleeping at the begin requires a full update, and the engine is left paused for
    vLLM's own full /wake_up to resume."""
    h = Harness()
    h.register_all()
    _send_round(h, 0, [("a", "b")])
    h.engine.asleep = h.engine.paused = True  # /sleep?level=2, then /wake_up?tags=weights
    _send_round(h, 1, [("a",)])
    err = h.last(0)
    assert isinstance(err, Error) and "needs a full update" in err.message
    assert h.coord.status()["engine_sleeping"] is True
    _send_round(h, 2, [("a", "b")])
    ack = h.last(0)
    assert isinstance(ack, Ack) and ack.phase == "commit" and ack.resumed is False
    assert h.engine.paused and h.engine.calls[-1] == "finish_weight_update"
    st = h.coord.status()
    assert st["state"] == "idle" and st["engine_paused"] and not st["needs_full_update"]
    h.engine.asleep = h.engine.paused = False  # /wake_up?tags=kv_cache: vLLM resumes it
    _send_round(h, 3, [("a",)])
    ack = h.last(0)
    assert ack.resumed is True and ack.omitted_names == ["b"]
    assert not h.engine.paused and h.coord.status()["engine_sleeping"] is False


@dataclass
class MultiprocEngine:
    """A vLLM engine of several workers as its MultiprocExecutor answers (vLLM 0.32
    ``collective_rpc``): every worker runs every executor call and queues its reply; the
    executor reads the replies in rank order and raises at the first failure, leaving the
    later workers' replies queued for the next call to read as its own (vLLM gh-58242).
    ``fail[(route, nth)] = {worker: message}`` makes those workers fail that call (inside
    the weight transfer engine's hook for finish: the worker stays in its session)."""

    workers: int = 2
    calls: list[str] = field(default_factory=list)
    fail: dict[tuple[str, int], dict[int, str]] = field(default_factory=dict)
    paused: bool = False
    version: str = "default"
    packed: list = field(default_factory=list)
    active: list = field(default_factory=list)
    queues: list = field(default_factory=list)
    hold: bool = False
    rpc_body: object = None

    def __post_init__(self):
        self.restart()

    def restart(self) -> None:
        self.paused = False
        self.version = "default"
        self.packed = [None] * self.workers
        self.active = [False] * self.workers
        self.queues = [[] for _ in range(self.workers)]

    def unread(self) -> list[int]:
        return [len(q) for q in self.queues]

    def _worker(self, w: int, route: str, inject: str | None) -> tuple[bool, object]:
        if route == "init_weight_transfer_engine":
            self.packed[w] = True
            return True, None
        if route == "collective_rpc":
            return True, rpc_answer(self.rpc_body, w)
        if route == "start_weight_update":
            if self.active[w]:
                return False, "start_weight_update called while a weight update is already active"
            if inject:
                return False, inject
            self.active[w] = True
            return True, None
        if route == "update_weights":
            if not self.active[w]:
                return False, "start_weight_update must be called before update_weights."
            if inject or self.packed[w] is None:
                self.active[w] = False
                return False, inject or ""
            return True, None
        if route in ("finish_weight_update", "finish_recover"):
            if not self.active[w]:
                return False, "finish_weight_update called without a matching start_weight_update."
            if inject:
                return False, inject  # raised in the hook: still active
            self.active[w] = False
            return True, None
        raise AssertionError(route)

    def answer(self, call: EngineCall) -> tuple[bool, object, str]:
        r = call.route
        self.calls.append(r)
        nth = sum(1 for c in self.calls if c == r) - 1
        if r == "version":  # vLLM's GET /version (API server)
            return True, {"version": "0.32.0"}, ""
        if r == "server_info":  # (the client's None for a 404: no layout to read)
            return True, None, ""
        if r == "get_world_size":
            return True, {"world_size": self.workers}, ""
        if r == "weight_info":
            return True, {"weight_version": self.version}, ""
        if r == "is_sleeping":
            return True, {"is_sleeping": self.paused}, ""
        if r == "is_paused":
            return True, {"is_paused": self.paused}, ""
        if r == "pause":
            self.paused = True
            return True, {"status": "paused"}, ""
        if r == "resume":
            self.paused = False
            return True, {"status": "resumed"}, ""
        route = "collective_rpc" if r == "check_replies" else r
        self.rpc_body = call.body
        inject = self.fail.get((r, nth), {})
        for w in range(self.workers):
            self.queues[w].append(self._worker(w, route, inject.get(w)))
        results = []
        for w in range(self.workers):  # MultiprocExecutor.collective_rpc's get_response
            ok, res = self.queues[w].pop(0)
            if not ok:
                return False, None, (f"HTTP 500: Call to collective_rpc method failed: Worker "
                                     f"failed with error '{res}', please check the stack "
                                     "trace above for the root cause")
            results.append(res)
        if r == "finish_weight_update" and call.body:
            self.version = call.body["weight_version"]
        return True, ({"results": results} if r == "check_replies" else {"message": "ok"}), ""


def _multiproc_harness(workers: int = 2) -> Harness:
    h = Harness(size=workers)
    h.engine = MultiprocEngine(workers)
    h.register_all()
    return h


def test_failed_finish_recovers_starting_first_so_replies_stay_in_step():
    """Worker 1's finish fails in its hook (it stays in its session), worker 0 finished. A
    recovery that finishes first fails on worker 0 before worker 1's reply is read: that
    reply stays queued and every later call reads the one before (vLLM gh-58242). Starting
    first keeps them in step: worker 1 says "already active", then finish, start again."""
    h = _multiproc_harness()
    h.engine.fail[("finish_weight_update", 0)] = {1: "finalize_layerwise_reload: boom"}
    h.round(0, n_chunks=1)
    assert h.ended[-1].outcome == "failed" and h.engine.unread() == [0, 0]
    h.engine.calls.clear()
    h.engine.fail.clear()
    h.round(1, n_chunks=1)
    assert h.coord.last_version == "v1" and h.engine.version == "v1"
    assert h.engine.calls == [*PROBES, *ASKED, "check_replies", "init_weight_transfer_engine",
                              "pause",
                              "start_weight_update", "check_replies", "finish_recover",
                              "start_weight_update", "update_weights",
                              "finish_weight_update", "resume"]
    assert h.engine.unread() == [0, 0] and not any(h.engine.active)


def test_replies_out_of_step_are_found_and_the_engine_must_be_restarted():
    """Every worker fails chunk 0 (say, a payload none can read): worker 0's error is raised,
    worker 1's stays queued. The next round's first executor call is the check: it reads
    the stale error, so the daemon knows every later call would read another's reply. It
    says so before the pause and keeps refusing until the engine restarted; then a full
    update recovers it."""
    h, err = _round_after_a_queued_reply({0: "boom", 1: "boom"})
    assert "gh-58242" in err.message
    h.engine.calls.clear()
    h.round(3, n_chunks=1)
    assert h.engine.calls == PROBES and "out of step" in h.last(0).message
    assert h.coord.status()["state"] == "failed"
    h.engine.restart()
    h.coord.on_connection_lost(h.now)  # (the restart broke the pooled connections)
    h.round(4, n_chunks=1)
    assert h.coord.last_version == "v4" and h.engine.unread() == [0, 0]
    assert h.coord.engine.out_of_step is None


def _round_after_a_queued_reply(fails: dict[int, str]) -> tuple[Harness, Error]:
    """Round 1's chunk fails on the workers in ``fails`` (worker -> error) and leaves worker
    1's reply queued; round 2 is refused before the pause by the replies check alone.
    Returns the harness and round 2's Error to rank 0."""
    h = _multiproc_harness()
    h.round(0, n_chunks=1)
    h.engine.fail[("update_weights", 1)] = fails
    h.round(1, n_chunks=1)
    assert h.engine.unread() == [0, 1] and h.coord.engine.replies_suspect
    h.engine.calls.clear()
    h.engine.fail.clear()
    h.round(2, n_chunks=1)
    err = next(m for m in h.replies[0] if isinstance(m, Error) and m.update_id == 2)
    assert "replies are out of step" in err.message and "Restart the engine" in err.message
    assert h.engine.calls == [*PROBES, *ASKED, "check_replies"]  # nothing else reached it
    return h, err


def test_a_stale_success_reply_is_not_taken_for_the_check():
    """Worker 0 fails chunk 0 (say, its rank already gave back that memory), worker 1 loads
    it: worker 1's reply -- a success, null like check_health's -- stays queued. The check
    must not take it for its own: it asks each worker's rank (``rpc_rank``), which no
    earlier call answers, so the stale null shows and the round is refused before the
    pause (on check_health alone the round went on with every reply one call late)."""
    h, _ = _round_after_a_queued_reply({0: "[Errno 2] No such file or directory"})
    assert h.coord.last_version == "v0" and h.coord.status()["state"] == "failed"


def test_start_that_reached_no_worker_leaves_the_engine_intact():
    """A start refused before any worker saw it (no per-worker error on an engine of several
    workers): no session began anywhere, so the engine is resumed and needs nothing special;
    one that a worker failed leaves it paused and needing a full update."""
    h = Harness()
    h.register_all()
    h.round(0, n_chunks=1)
    h.engine.fail[("start_weight_update", 1)] = (
        "HTTP 500: Call to collective_rpc method failed: Weight transfer not configured")
    h.round(1, n_chunks=1)
    assert h.ended[-1].outcome == "failed"
    assert not h.engine.paused and h.coord.state is SlotState.IDLE
    assert not h.coord.engine.needs_full_update and not h.coord.engine.mid_update
    h2 = _multiproc_harness()
    h2.round(0, n_chunks=1)
    h2.engine.fail[("start_weight_update", 1)] = {1: "CUDA out of memory"}
    h2.round(1, n_chunks=1)
    assert h2.engine.paused and h2.coord.state is SlotState.FAILED
    assert h2.coord.engine.mid_update and h2.coord.engine.recover_first


def test_restarted_daemon_sends_no_finish_into_a_serving_engine():
    """A daemon killed during a begin (its record says in flight) before it paused anything:
    the restarted daemon finds the engine serving. No worker can hold a session then, so it
    sends no finish -- on an engine of several workers that finish would fail on worker 0
    first and leave the others' replies queued (vLLM gh-58242). The update is a full one."""
    h = _multiproc_harness()
    h.coord.restore_mid_update(URL, 7, "step-7", "in_flight")
    assert h.coord.mid_update_state()[0] == "failed" and h.coord.engine.paused
    h.round(8, n_chunks=1)
    assert "finish_recover" not in h.engine.calls and h.engine.unread() == [0, 0]
    assert h.coord.last_version == "v8" and not h.engine.paused
    assert h.coord.mid_update_state() is None


def test_replies_out_of_step_survive_a_daemon_restart_until_the_engine_restarts():
    """The durable record keeps 'out of step': a restarted daemon must not drive an engine
    whose replies are still shifted. An engine the daemon left paused that serves again was
    restarted: a new session, and the full update goes through."""
    h = _multiproc_harness()
    h.round(0, n_chunks=1)
    h.engine.fail[("update_weights", 1)] = {0: "boom", 1: "boom"}
    h.round(1, n_chunks=1)
    h.engine.fail.clear()
    h.engine.calls.clear()
    h.round(2, n_chunks=1)
    assert h.coord.mid_update_state()[0] == "out_of_step"
    h2 = _multiproc_harness()  # a restarted daemon, the same broken engine
    h2.engine = h.engine
    h2.coord.restore_mid_update(URL, 2, "", "out_of_step")
    h2.engine.calls.clear()
    h2.round(3, n_chunks=1)
    err = next(m for m in h2.replies[0] if isinstance(m, Error) and m.update_id == 3)
    # (a new daemon first meets the engine: it asks its vLLM version, then probes)
    assert "out of step" in err.message and h2.engine.calls == FIRST
    h2.engine.restart()  # comes up serving, version "default" as before: still recognised
    h2.round(4, n_chunks=1)
    assert h2.coord.last_version == "v4" and h2.engine.unread() == [0, 0]
    assert h2.coord.mid_update_state() is None


def test_engine_restarted_before_the_daemon_clears_a_recorded_out_of_step():
    """The engine was restarted while the daemon was down, after the previous daemon recorded
    its replies out of step: it serves at the first begin, so it is a new process and the full
    update goes through (before, the record's out-of-step refusal stayed until the engine was
    restarted a second time; fresh-user trial of issue 17)."""
    h = _multiproc_harness()
    h.round(0, n_chunks=1)
    h.engine.fail[("update_weights", 1)] = {0: "boom", 1: "boom"}
    h.round(1, n_chunks=1)
    h.engine.fail.clear()
    h.round(2, n_chunks=1)
    assert h.coord.mid_update_state()[0] == "out_of_step"
    h.engine.restart()  # restarted while no daemon ran
    h2 = _multiproc_harness()
    h2.engine = h.engine
    h2.coord.restore_mid_update(URL, 2, "", "out_of_step")
    h2.round(3, n_chunks=1)
    assert not [m for m in h2.replies[0] if isinstance(m, Error)], h2.replies[0]
    assert h2.coord.last_version == "v3" and h2.coord.mid_update_state() is None


# ---------------------------------------------------------------- liveness and slot lifecycle
# (issue 15: a daemon outlives many jobs; ranks that are gone must not hold their slot, and an
# update that needs a gone rank fails at once instead of at a deadline)


def preg(rank: int, pid: int, start: int = 0, size: int = 2, url: str = URL,
         host: str = "node-a") -> Register:
    """A registration from process ``pid`` on ``host``."""
    return Register(PROTOCOL_VERSION, rank, logical_gpu_uuid(rank - start), start, size, url,
                    True, "shm", host, pid)


def _errors(h: Harness, rank: int) -> list[Error]:
    return [m for m in h.replies.get(rank, []) if isinstance(m, Error)]


def test_rank_gone_mid_update_fails_it_at_once_naming_rank_and_pid():
    h = Harness(timeouts=Timeouts(100, 100, 100))
    for r in range(2):
        h.run(h.table.on_message(ident(r), preg(r, 200 + r), 0.0, peer_pid=200 + r))
    h.begin(0)
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    assert "start_weight_update" in h.engine.calls
    h.now = 1.0
    h.run(h.table.on_connection_gone(ident(1), 1.0, "its process (pid 201) exited"))
    err = _errors(h, 0)[-1]
    assert "rank 1 (pid 201 on node-a) is gone: its process (pid 201) exited" in err.message
    assert err.phase == "rank_gone" and err.missing_ranks == [1]
    assert h.coord.engine.needs_full_update and h.coord.engine.paused  # I4: started, stays paused
    assert "resume" not in h.engine.calls and h.ended[-1].outcome == "failed"
    ranks = {r["rank"]: r for r in h.coord.status(2.0)["ranks"]}
    assert ranks[1]["alive"] is False and ranks[1]["pid"] == 201 and ranks[1]["gone_s"] == 1.0
    assert ranks[0]["alive"] is True and ranks[0]["last_seen_s"] == 2.0


def test_rank_gone_after_its_commit_lets_the_update_finish():
    h = Harness()
    h.register_all()
    h.begin(0)
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    h.engine.hold = True  # the finish is in flight when rank 1 goes
    for r in range(2):
        h.send(r, Commit(0, 1))
    assert [c.route for c in h.pending_calls] == ["finish_weight_update"]
    h.run(h.table.on_connection_gone(ident(1), 0.0, "its connection closed"))
    assert h.coord.current is not None  # it needs nothing more from rank 1
    h.engine.hold = False
    while h.pending_calls:
        call = h.pending_calls.pop(0)
        ok, res, err = h.engine.answer(call)
        h.run(h.coord.on_engine_result(call.call_id, ok, res, err, 0.0))
    assert h.ended[-1].outcome == "success" and not h.engine.paused


def test_begin_with_a_gone_rank_fails_after_gone_s_not_at_the_begin_deadline():
    h = Harness(timeouts=Timeouts(100, 100, 100, gone_s=5))
    h.register_all()
    h.run(h.table.on_connection_gone(ident(1), 0.0, "its connection closed"))
    h.now = 1.0
    h.send(0, Begin(0, "v"))
    assert h.table.next_deadline() == 6.0  # (not the begin deadline, 101)
    h.run(h.table.poll(5.9))
    assert _errors(h, 0) == []
    h.run(h.table.poll(6.0))
    err = _errors(h, 0)[-1]
    assert "rank 1" in err.message and "is gone: its connection closed" in err.message
    assert "no new process of it registered within 5 s" in err.message
    assert err.missing_ranks == [1] and "pause" not in h.engine.calls  # generation went on


def test_begin_with_a_gone_rank_waits_for_its_new_process():
    # a restarted job: rank 0's new process begins before rank 1's registered
    h = Harness(timeouts=Timeouts(100, 100, 100, gone_s=5))
    h.register_all()
    for r in range(2):
        h.run(h.table.on_connection_gone(ident(r), 0.0, "its process exited"))
    h.send(0, reg(0))
    h.send(0, Begin(0, "v0"))
    h.now = 2.0
    h.send(1, reg(1))
    h.send(1, Begin(0, "v0"))
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    for r in range(2):
        h.send(r, Commit(0, 1))
    assert h.ended[-1].outcome == "success"


def test_a_message_from_a_rank_seen_gone_brings_it_back():
    # (a connection closed by a heartbeat timeout reconnects under the same identity)
    h = Harness()
    h.register_all()
    h.run(h.table.on_connection_gone(ident(1), 0.0, "its connection closed"))
    assert [i.rank for i in h.coord.gone_ranks()] == [1]
    h.send(1, Begin(0, "v0"))  # (a rank that is heard from again lives)
    assert h.coord.gone_ranks() == []
    h.send(0, Begin(0, "v0"))
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    for r in range(2):
        h.send(r, Commit(0, 1))
    assert h.ended[-1].outcome == "success"


def test_slot_of_a_gone_job_is_released_after_slot_release_s():
    t = SlotTable(slot_release_s=30)
    for r in range(3):
        t.on_message(ident(r), preg(r, 300 + r, size=3), 0.0, peer_pid=300 + r)
    for r in range(2):
        t.on_connection_gone(ident(r), 4.0 + r, f"its process (pid {300 + r}) exited")
    assert t.poll(100.0) == [] and (0, 3) in t.slots  # rank 2 lives: never released
    t.on_connection_gone(ident(2), 110.0, "its connection closed")
    assert t.next_deadline() == 140.0
    assert t.poll(139.0) == [] and (0, 3) in t.slots
    ev = t.poll(140.0)
    assert [e.event for e in ev if isinstance(e, SlotEvent)] == ["slot_released"]
    assert t.slots == {} and t.connected_ranks() == 0
    assert "2 (pid 302: its connection closed)" in ev[0].fields["ranks"]
    # the slot is free: a job with another topology registers
    a = t.on_message(ident(7), preg(0, 400, size=2), 141.0, peer_pid=400)
    assert isinstance(a[-1].msg, Registered)


def test_wrong_topology_job_gone_then_the_right_one_registers_at_once():
    # issue 15 #1: 3 ranks for a 2-GPU engine fail; the relaunch with 2 ranks was refused
    # ("... which slot [0, 3) already feeds") until the daemon restarted
    t = SlotTable(slot_release_s=600)
    for r in range(3):
        t.on_message(ident(r), preg(r, 300 + r, size=3), 0.0, peer_pid=300 + r)
    refused = t.on_message(ident(10), preg(0, 500, size=2), 1.0, peer_pid=500)
    msg = refused[-1].msg
    assert isinstance(msg, Error) and "which slot [0, 3) already feeds" in msg.message
    assert "its live ranks: 0 (pid 300 on node-a), 1 (pid 301 on node-a), 2 (pid 302" in (
        msg.message)
    for r in range(3):
        t.on_connection_gone(ident(r), 2.0, f"its process (pid {300 + r}) exited")
    ok = t.on_message(ident(10), preg(0, 500, size=2), 3.0, peer_pid=500)
    assert [e.event for e in ok if isinstance(e, SlotEvent)] == ["slot_released"]
    assert isinstance(ok[-1].msg, Registered) and set(t.slots) == {(0, 2)}
    t.on_message(ident(11), preg(1, 501, size=2), 3.0, peer_pid=501)
    assert t.slots[(0, 2)].state is SlotState.IDLE


def test_engine_left_mid_update_by_a_dead_job_needs_a_full_update_from_the_next_job():
    h = Harness(timeouts=Timeouts(100, 100, 100))
    h.table.slot_release_s = 5
    for r in range(2):
        h.run(h.table.on_message(ident(r), preg(r, 200 + r), 0.0, peer_pid=200 + r))
    h.round(0, n_chunks=1)  # names a, b loaded
    h.begin(1)
    for r in range(2):
        h.send(r, chunk(1, 0, r))
    for r in range(2):  # the job is killed mid-update
        h.run(h.table.on_connection_gone(ident(r), 1.0, "its process exited"))
    assert h.coord.engine.needs_full_update and h.coord.engine.paused
    h.run(h.table.poll(6.0))
    assert h.table.slots == {} and URL in h.table.released
    assert [d[1] for d in h.table.mid_update_engines()] == [URL]  # (kept in the durable record)
    # the next job, another topology of the same engine, adopts what is known of it
    h.engine.world_size = 1
    a = h.table.on_message(ident(5), preg(0, 600, size=1), 7.0, peer_pid=600)
    assert isinstance(a[-1].msg, Registered)
    c = h.table.slots[(0, 1)]
    assert c.engine.needs_full_update and c.engine.paused and c.engine.last_ok_names == {"a", "b"}
    assert c.state is SlotState.FAILED and h.table.released == {}


def test_second_process_claiming_a_live_rank_is_refused_naming_both_pids():
    h = Harness()
    for r in range(2):
        h.run(h.table.on_message(ident(r), preg(r, 200 + r), 0.0, peer_pid=200 + r))
    h.begin(0)
    out = h.table.on_message(b"id-0-other", preg(0, 999, host="node-b"), 0.0, peer_pid=999)
    msg = out[-1].msg
    assert isinstance(msg, Error) and "rank 0 is already registered by pid 200 on node-a" in (
        msg.message) and "pid 999 on node-b claims it too" in msg.message
    assert h.coord.current is not None  # the live holder's update goes on
    h.send(0, chunk(0, 0, 0))
    h.send(1, chunk(0, 0, 1))
    for r in range(2):
        h.send(r, Commit(0, 1))
    assert h.ended[-1].outcome == "success"
    # once the first process is gone, a restarted rank 0 registers
    h.run(h.table.on_connection_gone(ident(0), 1.0, "its process (pid 200) exited"))
    again = h.table.on_message(b"id-0-other", preg(0, 999, host="node-b"), 2.0, peer_pid=999)
    assert isinstance(again[-1].msg, Registered)


def test_operator_drop_refused_during_an_update_unless_forced():
    h = Harness()
    h.register_all()
    with pytest.raises(KeyError, match=r"no slot \[4, 6\) \(slots: \[0, 2\)\)"):
        h.table.drop((4, 6), 0.0)
    h.begin(0)
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    with pytest.raises(RuntimeError, match="update 0 in flight; drop it with force"):
        h.table.drop((0, 2), 0.0)
    h.run(h.table.drop((0, 2), 0.0, force=True))
    assert "dropped by the operator" in _errors(h, 0)[-1].message
    assert h.table.slots == {} and h.table.connected_ranks() == 0
    assert h.table.released[URL].engine.needs_full_update  # started: the next job updates fully


def test_engine_a_dead_job_left_paused_stays_failed_in_metrics_and_status_after_release():
    # (fresh-user trial: the released slot vanished from status, its exit code and
    # slotsync_slots{state="failed"}, while the engine stayed paused)
    from prometheus_client import generate_latest

    from slotsync.cli.status import render_table
    from slotsync.daemon.service.metrics import Metrics

    h = Harness(timeouts=Timeouts(100, 100, 100))
    h.table.slot_release_s = 1
    m = Metrics("test")
    m.watch(h.table)
    h.register_all()
    h.begin(0)
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    for r in range(2):
        h.run(h.table.on_connection_gone(ident(r), 0.0, "its process exited"))
    h.run(h.table.poll(2.0))
    assert h.table.slots == {}
    assert 'slotsync_slots{state="failed"} 1.0' in generate_latest(m.registry).decode()
    doc = {"version": "x", "endpoint": "e", "slots": [], "released_engines": [
        {"engine_url": URL, "slot": [0, 2], "engine_paused": True, "needs_full_update": True,
         "last_error": "slot [0, 2) update 0 failed in rank_gone"}]}
    table = render_table(doc)
    assert "[0,2)" in table and "released" in table and "failed" in table and "paused" in table

"""The coordinator driving an SGLang engine, I/O-free (issue 26 A, C): each daemon step goes
through the real dialect (``sglang_routes.plan`` / ``answer``) to a scripted SGLang server
whose route rules are SGLang's (docs/sglang-contract.md 2: sessions and their 400s on
0.5.21+, none on 0.5.20, the version only through ``/update_weight_version``, no
``/version``). Kind detection, the lifecycle per version and pause mode, refusals before the
pause, the buffer fence (acks only once a later call proves a chunk's copies), a session left
open, and a failed chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from test_coordinator import chunk, ident, reg

from slotsync.daemon.core.actions import EngineCall, Reply, UpdateEnded
from slotsync.daemon.core.coordinator import SlotState
from slotsync.daemon.core.update import Timeouts
from slotsync.daemon.families import SlotTable
from slotsync.daemon.sglang.routes import EMPTY_UPDATE, Dialect, answer, plan
from slotsync.protocol.wire import Ack, Begin, Commit, Error

pytest.importorskip("msgspec")

URL = "http://sglang:30000"


@dataclass
class ScriptedSglang:
    """Answers SGLang HTTP requests as SGLang 0.5.20 / 0.5.21 / 0.5.23 do (the rules of
    docs/sglang-contract.md 2), and the daemon's steps as ``SglangClient`` turns them into
    those requests; an engine of unknown kind is asked as vLLM is (``/version``: 404)."""

    version: str = "0.5.23"
    tp_size: int = 2
    dp_size: int = 1
    pp_size: int = 1
    paused: bool = False
    session: bool = False
    weight_version: str = "default"
    requests: list[str] = field(default_factory=list)  # "POST /path" in order
    bodies: list[Any] = field(default_factory=list)
    fail: dict[str, str] = field(default_factory=dict)  # path -> 400 message (once)
    hold: bool = False
    loads: int = 0

    @property
    def sessions(self) -> bool:
        return self.version != "0.5.20"

    def server_info(self) -> dict:
        return {"version": self.version, "tp_size": self.tp_size, "dp_size": self.dp_size,
                "pp_size": self.pp_size, "enable_dp_attention": False,
                "weight_version": self.weight_version, "tokenizer_worker_num": 1}

    def http(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        empty = isinstance(body, dict) and body.get("serialized_named_tensors") == [
            EMPTY_UPDATE] * self.tp_size  # (a proving call: daemon/sglang/fence.py)
        self.requests.append(f"{method} {path.split('?')[0]}" + (" (none)" if empty else ""))
        self.bodies.append(body)
        p = path.split("?")[0]
        if p in self.fail:
            return 400, {"success": False, "message": self.fail.pop(p)}
        if p == "/server_info":
            return 200, self.server_info()
        if p == "/model_info":
            return 200, {"weight_version": self.weight_version}
        if p == "/pause_generation":
            self.paused = True
            return 200, {"status": "ok"}
        if p == "/continue_generation":
            self.paused = False
            return 200, {"status": "ok"}
        if p == "/flush_cache":
            return 200, None
        if p == "/begin_weight_update" and self.sessions:
            if self.session:
                return 400, {"success": False, "message": "a weight-update session is already "
                             "open; call end_weight_update() first"}
            self.session = True
            return 200, {"success": True}
        if p == "/end_weight_update" and self.sessions:
            if not self.session:
                return 400, {"success": False, "message": "no weight-update session is open; "
                             "call begin_weight_update() first"}
            self.session = False
            return 200, {"success": True}
        if p == "/update_weights_from_tensor":
            if self.sessions and not self.session:
                return 400, {"success": False, "message": "update_weights_from_tensor must "
                             "run between begin_weight_update() and end_weight_update()"}
            assert body["flush_cache"] is False and body["abort_all_requests"] is False
            assert len(body["serialized_named_tensors"]) == self.tp_size
            self.loads += 1
            return 200, {"success": True, "message": "Success"}
        if p == "/update_weight_version":
            assert body["abort_all_requests"] is False
            self.weight_version = body["new_version"]
            return 200, {"success": True}
        return 404, {"detail": "Not Found"}

    def step(self, call: EngineCall, kind: str | None) -> tuple[bool, Any, str]:
        """The daemon's step ``call`` as the executor would run it for an engine of ``kind``."""
        if kind != "sglang":  # asked as vLLM is (daemon/families.py): /version, /server_info
            # (and, taken for vLLM, vLLM's probes: 404 here)
            path = {"version": "/version", "server_info": "/server_info"}.get(
                call.route, f"/{call.route}")
            status, reply = self.http("GET", path, None)
            return (True, reply, "") if status == 200 else (
                False, None, f"{call.route}: HTTP {status}: Not Found")
        replies = []
        body = call.body
        if call.route == "update_weights":  # (msgspec.Raw of the merged body)
            import msgspec
            body = msgspec.json.decode(bytes(body))
        for req in plan(call.route, body, Dialect(self.version, self.pause_mode)):
            status, reply = self.http(req.method, req.path, req.body)
            if status >= 400:
                msg = reply.get("message") if isinstance(reply, dict) else str(reply)
                if req.tolerated and req.tolerated in msg:
                    replies.append(None)
                    continue
                return False, None, f"{call.route}: HTTP {status}: SGLang: {msg}"
            replies.append(reply)
        return True, answer(call.route, replies), ""

    pause_mode: str = "in_place"


class Harness:
    """One slot of ``size`` ranks whose engine is a ``ScriptedSglang``."""

    def __init__(self, version: str = "0.5.23", declare: bool = False, size: int = 2,
                 pause_mode: str = "in_place", chunks_in_flight: int = 1) -> None:
        self.table = SlotTable(Timeouts(10, 10, 10), chunks_in_flight=chunks_in_flight)
        if declare:
            self.table.set_engine_table({(0, size): URL}, None,
                                        {(0, size): ("sglang", pause_mode)})
        self.engine = ScriptedSglang(version, tp_size=size, pause_mode=pause_mode)
        self.size, self.now = size, 0.0
        self.replies: dict[int, list] = {}
        self.ended: list[UpdateEnded] = []
        self.held: list[EngineCall] = []

    @property
    def coord(self):
        return next(iter(self.table.slots.values()))

    def run(self, actions: list) -> None:
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            if isinstance(a, Reply):
                self.replies.setdefault(int(a.identity.decode().split("-")[1]), []).append(a.msg)
            elif isinstance(a, UpdateEnded):
                self.ended.append(a)
            elif isinstance(a, EngineCall):
                if self.engine.hold:
                    self.held.append(a)
                    continue
                ok, res, err = self.engine.step(a, self.coord.engine.kind)
                queue += self.coord.on_engine_result(a.call_id, ok, res, err, self.now)

    def release(self) -> None:
        """Answer one held call (the oldest)."""
        call = self.held.pop(0)
        ok, res, err = self.engine.step(call, self.coord.engine.kind)
        self.run(self.coord.on_engine_result(call.call_id, ok, res, err, self.now))

    def send(self, rank: int, msg) -> None:
        self.run(self.table.on_message(ident(rank), msg, self.now))

    def register_all(self) -> None:
        for r in range(self.size):
            self.send(r, reg(r, 0, self.size, url=URL))

    def round(self, update_id: int, n_chunks: int = 2) -> None:
        for r in range(self.size):
            self.send(r, Begin(update_id, f"v{update_id}"))
        for k in range(n_chunks):
            for r in range(self.size):
                self.send(r, chunk(update_id, k, r))
        for r in range(self.size):
            self.send(r, Commit(update_id, n_chunks))

    def acks(self, rank: int = 0) -> list[tuple[str, int]]:
        return [(m.phase, m.index) for m in self.replies.get(rank, []) if isinstance(m, Ack)]


UPDATE, PROVE = "POST /update_weights_from_tensor", "POST /update_weights_from_tensor (none)"
# (this harness answers at once: after each chunk's reply the next chunk has not come yet, so
# the daemon proves the loaded one with an update of no tensor, daemon/sglang/fence.py)
ROUND_0523 = ["POST /pause_generation", "POST /begin_weight_update", UPDATE, PROVE, UPDATE,
              PROVE, "POST /end_weight_update", "POST /update_weight_version",
              "POST /continue_generation"]


def test_an_undeclared_sglang_engine_is_detected_and_driven_through_a_session():
    h = Harness("0.5.23")
    h.register_all()
    h.round(0)
    assert h.acks() == [("begin", -1), ("chunk", 0), ("chunk", 1), ("commit", -1)]
    assert h.coord.engine.kind == "sglang" and h.coord.engine.sglang_version == "0.5.23"
    # asked as vLLM first (GET /version: 404), then SGLang's own steps
    assert h.engine.requests[:2] == ["GET /version", "GET /server_info"]
    assert h.engine.requests[2:4] == ["GET /server_info", "GET /model_info"]  # the probe
    assert h.engine.requests[4:] == ROUND_0523
    assert h.engine.bodies[4] == {"mode": "in_place"}  # the default: no flush needed
    assert h.engine.weight_version == "v0" and not h.engine.paused and not h.engine.session
    assert h.coord.state is SlotState.IDLE and h.ended[-1].outcome == "success"
    h.engine.requests.clear()
    h.round(1)  # later rounds: the probe, then the lifecycle (no version stage)
    assert h.engine.requests == ["GET /server_info", "GET /model_info", *ROUND_0523]


def test_sglang_0_5_20_has_no_session_and_its_replies_prove_their_own_chunk():
    h = Harness("0.5.20", declare=True)
    h.register_all()
    h.engine.hold = True
    for r in range(2):
        h.send(r, Begin(0, "v0"))
    for k in range(2):
        for r in range(2):
            h.send(r, chunk(0, k, r))
    while h.held and h.held[0].route != "update_weights":
        h.release()
    h.release()  # chunk 0's reply: on 0.5.20 it proves chunk 0 (freed before the barrier)
    assert ("chunk", 0) in h.acks()
    h.engine.hold = False
    while h.held:
        h.release()
    for r in range(2):
        h.send(r, Commit(0, 2))
    assert h.acks()[-1] == ("commit", -1)
    assert "POST /begin_weight_update" not in h.engine.requests
    assert "POST /end_weight_update" not in h.engine.requests
    assert h.engine.weight_version == "v0"


def test_on_0_5_21_a_chunk_is_acknowledged_only_once_a_later_call_proves_it():
    """SGLang 0.5.21+ answers a chunk before TP ranks other than 0 freed (and so synced) its
    tensors: chunk k's region goes back only after the reply of a call sent after k's reply
    arrived -- chunk k+1's, the end's, or a proving call (daemon/sglang/fence.py)."""
    h = Harness("0.5.21", declare=True)
    h.register_all()
    for r in range(2):
        h.send(r, Begin(0, "v0"))
    for r in range(2):
        h.send(r, chunk(0, 0, r))
    # chunk 0 loaded, no chunk 1 yet: a proving call (an update of no tensor) went out, and
    # only its reply acknowledged chunk 0
    reqs = h.engine.requests
    i = reqs.index(UPDATE)
    assert reqs[i + 1] == PROVE  # one pickled [] per TP rank, load_format null
    assert h.acks() == [("begin", -1), ("chunk", 0)]
    h.engine.hold = True
    for r in range(2):
        h.send(r, chunk(0, 1, r))
    h.release()  # chunk 1's reply: it proves chunk 0 only (done above), not itself
    assert h.acks() == [("begin", -1), ("chunk", 0)]
    for r in range(2):
        h.send(r, Commit(0, 2))
    h.release()  # the end: proves chunk 1
    assert h.acks()[-1] == ("chunk", 1)
    h.engine.hold = False
    while h.held:
        h.release()
    assert h.acks() == [("begin", -1), ("chunk", 0), ("chunk", 1), ("commit", -1)]


def three_chunks_at_the_engine() -> Harness:
    """SGLang 0.5.23, ``chunks_in_flight`` 3: an update whose three chunks' calls are all out
    at once, unanswered (``Harness.held``), the begin's stages answered."""
    h = Harness("0.5.23", declare=True, chunks_in_flight=3)
    h.register_all()
    for r in range(2):
        h.send(r, Begin(0, "v0"))
    h.engine.hold = True
    for k in range(3):
        for r in range(2):
            h.send(r, chunk(0, k, r))
    while h.held[0].route != "update_weights":  # the begin's stages
        h.release()
    return h


def test_with_chunks_in_flight_a_reply_proves_only_chunks_answered_before_it_was_sent():
    h = three_chunks_at_the_engine()
    assert [c.route for c in h.held] == ["update_weights"] * 3  # all three out at once
    h.release()
    h.release()
    h.release()  # none was sent after another's reply: nothing is proven yet
    assert h.acks() == [("begin", -1)]
    assert [c.route for c in h.held] == ["prove_copies"]
    h.release()
    assert h.acks() == [("begin", -1), ("chunk", 0), ("chunk", 1), ("chunk", 2)]


@pytest.mark.parametrize(("mode", "version", "flush"), [
    ("in_place", "0.5.23", False), ("retract", "0.5.23", True), ("abort", "0.5.23", True),
    ("retract", "0.5.20", False), ("abort", "0.5.20", True)])
def test_the_pause_mode_decides_the_flush(mode, version, flush):
    h = Harness(version, declare=True, pause_mode=mode)
    h.register_all()
    h.round(0)
    assert h.acks()[-1] == ("commit", -1)
    i = h.engine.requests.index("POST /pause_generation")
    assert h.engine.bodies[i] == {"mode": mode}
    assert (h.engine.requests[i + 1] == "POST /flush_cache") is flush


@pytest.mark.parametrize(("change", "words"), [
    ({"version": "0.5.22"}, ["0.5.22", "0.5.20, 0.5.21, 0.5.23"]),
    ({"version": "0.6.0.dev1"}, ["0.6.0.dev1"]),
    ({"dp_size": 2}, ["dp_size 2", "one server per replica"]),
    ({"pp_size": 2}, ["pp_size 2"]),
    ({"tp_size": 4}, ["tp_size 4", "2 ranks"]),
])
def test_what_sglang_cannot_take_is_refused_before_the_pause(change, words):
    h = Harness()
    h.register_all()
    for k, v in change.items():
        setattr(h.engine, k, v)
    h.round(0)
    err = [m for m in h.replies[0] if isinstance(m, Error)][0]
    assert err.phase == "begin", err
    for w in words:
        assert w in err.message, err.message
    assert "POST /pause_generation" not in h.engine.requests and not h.engine.paused


def test_a_declared_sglang_engine_that_answers_as_vllm_is_refused_naming_both():
    h = Harness(declare=True)
    h.register_all()
    h.engine.server_info = lambda: {"vllm_config": {}}  # vLLM's dev-mode /server_info
    h.round(0)
    err = [m for m in h.replies[0] if isinstance(m, Error)][0]
    assert 'declared kind = "sglang"' in err.message and "vllm_config" in err.message
    assert not h.engine.paused


def test_a_session_left_open_is_ended_and_the_update_begins_again():
    h = Harness("0.5.23", declare=True)
    h.register_all()
    h.engine.session = True  # a daemon that died mid-update left it open
    h.round(0)
    assert h.acks()[-1] == ("commit", -1)
    reqs = h.engine.requests
    i = reqs.index("POST /begin_weight_update")
    assert reqs[i:i + 3] == ["POST /begin_weight_update", "POST /end_weight_update",
                             "POST /begin_weight_update"]


def test_a_failed_chunk_leaves_the_engine_paused_and_the_next_round_ends_the_session_first():
    h = Harness("0.5.23", declare=True)
    h.register_all()
    h.engine.fail["/update_weights_from_tensor"] = "boom"
    h.round(0)
    err = [m for m in h.replies[0] if isinstance(m, Error)][0]
    assert "SGLang update_weights failed" in err.message and "boom" in err.message
    assert h.engine.paused and "POST /continue_generation" not in h.engine.requests  # I4
    assert h.coord.state is SlotState.FAILED and h.coord.engine.needs_full_update
    h.engine.requests.clear()
    h.round(1)
    assert h.acks()[-1] == ("commit", -1)
    # (the probe; the version asked again before the engine is initialised again; then the
    # pause, the end of the session the failed update left open, and a new one)
    assert h.engine.requests[:6] == ["GET /server_info", "GET /model_info", "GET /server_info",
                                     "POST /pause_generation", "POST /end_weight_update",
                                     "POST /begin_weight_update"]
    assert not h.engine.paused and h.engine.weight_version == "v1"


def test_a_restarted_sglang_server_is_a_new_session_and_must_take_every_tensor():
    """A server restarted at the URL reports its checkpoint's weight version ("default"):
    the probe tells (I9), and a round that leaves out tensors the last one loaded is refused
    rather than resume on a mix of old and new weights."""
    h = Harness("0.5.23", declare=True)
    h.register_all()
    h.round(0)
    h.engine.weight_version = "default"
    h.engine.requests.clear()
    for r in range(2):
        h.send(r, Begin(1, "v1"))
    for r in range(2):
        h.send(r, chunk(1, 0, r, names=("a",)))  # leaves out "b"
    for r in range(2):
        h.send(r, Commit(1, 1))
    err = [m for m in h.replies[0] if isinstance(m, Error)][0]
    assert "needs a full update" in err.message and "loaded: b" in err.message, err.message
    assert h.engine.paused  # not resumed on an incomplete model (I4)


def test_a_flush_that_fails_fails_the_round_before_any_weight_and_resumes_the_engine():
    """SGLang's /flush_cache answers 400 while requests run; the round fails in its pause,
    with no weight touched, and the daemon continues the generation it paused (SGLang reports
    no pause state: the engine check's answer is 'paused', sglang_routes.STEP_ANSWERS)."""
    h = Harness("0.5.23", declare=True, pause_mode="abort")
    h.register_all()
    h.engine.fail["/flush_cache"] = "Cache not flushed: requests are running"
    h.round(0)
    err = [m for m in h.replies[0] if isinstance(m, Error)][0]
    assert "pause" in err.message and "requests are running" in err.message, err.message
    assert h.engine.loads == 0 and "POST /begin_weight_update" not in h.engine.requests
    assert h.engine.requests[-1] == "POST /continue_generation" and not h.engine.paused
    assert not h.coord.engine.needs_full_update


def test_a_failed_updates_error_waits_until_no_chunk_call_can_still_read_the_ranks_memory():
    """Chunks 1 and 2 are queued at SGLang behind chunk 0, which fails: a rank told at once
    frees its staging memory, and SGLang, mapping it for chunk 1, raises in its scheduler --
    which kills the whole server. So the ranks are told once those calls returned."""
    h = three_chunks_at_the_engine()
    h.engine.fail["/update_weights_from_tensor"] = "refused"
    h.release()  # chunk 0: 400
    assert h.ended and h.ended[-1].outcome == "failed"  # (the update failed: metrics, log)
    assert not any(isinstance(m, Error) for m in h.replies[0])  # ... the ranks not told yet
    h.release()  # chunk 1 returned
    assert not any(isinstance(m, Error) for m in h.replies[0])
    h.send(1, Commit(0, 3))  # rank 1 commits the failed update: its answer waits too
    assert not any(isinstance(m, Error) for m in h.replies[1])
    h.release()  # chunk 2: the last that could read their memory
    assert [m for m in h.replies[0] if isinstance(m, Error)][0].phase == "engine"
    assert len([m for m in h.replies[1] if isinstance(m, Error)]) == 2  # (and the commit's)


def test_status_names_the_engine_kind_version_and_pause_mode():
    """``/status`` and ``slotsync status`` say the slot's engine is SGLang, which release and
    which pause mode (issue 26); an engine of unknown kind says null."""
    from slotsync.cli import status as status_cli

    h = Harness("0.5.21", pause_mode="retract", declare=True)
    h.register_all()
    doc = h.coord.status()
    assert doc["engine_kind"] == "sglang" and doc["engine_sglang_version"] is None
    h.round(0)
    doc = h.coord.status()
    assert (doc["engine_kind"], doc["engine_sglang_version"], doc["engine_pause_mode"]) == (
        "sglang", "0.5.21", "retract")
    table = status_cli.render_table({"slots": [doc]})
    assert f"{URL} (SGLang 0.5.21)" in table, table
    h = Harness()  # (not declared: unknown until its first begin)
    h.register_all()
    assert h.coord.status()["engine_kind"] is None


def test_a_declared_vllm_url_that_serves_sglang_is_refused_saying_what_to_declare():
    h = Harness("0.5.23")
    h.table.set_engine_table({(0, 2): URL}, None, {(0, 2): ("vllm", "in_place")})
    h.register_all()
    h.round(0)
    err = [m for m in h.replies[0] if isinstance(m, Error)][0]
    assert err.phase == "begin" and 'declares kind = "vllm"' in err.message, err.message
    assert 'declare kind = "sglang"' in err.message and not h.engine.paused


def test_a_rank_local_round_is_refused_before_the_pause_in_sglangs_words():
    """A rank-local (expert-parallel) round is vLLM's mode: on an SGLang engine it is refused
    before the pause, saying why in SGLang's terms (issue 34: the family answers; before, the
    coordinator told it vLLM's list-form requirement)."""
    h = Harness()
    h.register_all()
    from test_rank_local import lbegin, lchunk

    for r in range(h.size):
        h.send(r, lbegin(0, r, [f"w{r}"]))
    for r in range(h.size):
        h.send(r, lchunk(0, 0, r, [f"w{r}"]))
    err = [m for m in h.replies[0] if isinstance(m, Error)][0]
    assert err.phase == "begin", err
    assert "rank-local" in err.message and "is SGLang" in err.message, err.message
    assert "POST /pause_generation" not in h.engine.requests and not h.engine.paused


def test_an_engine_taken_for_vllm_that_answers_as_sglang_is_told_again_in_the_same_begin():
    """Issue 35 item 15: the daemon drove a vLLM engine at the URL, now an SGLang one serves
    there. vLLM's probes answer 404: the kind is asked again (once), and the round runs in
    SGLang's routes, as a new engine session."""
    h = Harness("0.5.23")
    h.register_all()
    engine = h.coord.engine
    engine.kind, engine.vllm_version, engine.version = "vllm", "0.32.0", "v7"
    engine.initialized = True
    h.round(0)
    assert h.ended[-1].outcome == "success", h.ended[-1].error
    assert (engine.kind, engine.sglang_version, engine.vllm_version) == ("sglang", "0.5.23",
                                                                        None)
    assert h.engine.requests[:7] == [
        "GET /get_world_size", "GET /weight_info", "GET /is_sleeping",  # (vLLM's: 404)
        "GET /version", "GET /server_info",  # (the kind, asked again)
        "GET /server_info", "GET /model_info"]  # (SGLang's probe)
    assert h.engine.requests[7:] == ROUND_0523
    assert h.engine.weight_version == "v0"


def test_a_dropped_declared_slot_asks_its_engines_kind_again():
    """Issue 35 item 15: ``slotsync slots drop`` keeps a declared slot and what the daemon
    knows of its engine, but the next begin asks the engine's kind again."""
    h = Harness("0.5.23")
    h.table.set_engine_table({(0, 2): URL})  # (declared, without a kind)
    h.register_all()
    h.round(0)
    assert h.coord.engine.kind == "sglang"
    h.table.drop((0, 2), h.now)
    assert h.coord.engine.known_kind is None
    assert h.coord.state is SlotState.REGISTERING
    h.engine.requests.clear()
    h.register_all()
    h.round(1)
    assert h.ended[-1].outcome == "success", h.ended[-1].error
    assert h.engine.requests[:2] == ["GET /version", "GET /server_info"]
    assert h.coord.engine.kind == "sglang"


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "not-declared"])
def test_each_entry_comes_from_the_rank_on_its_tp_ranks_gpu(declared):
    """Issue 35 item 12: ranks 0 and 1 on each other's GPU. With ``gpu_uuids`` declared (in
    TP-rank order) entry i of every chunk is the chunk of the rank whose GPU is TP rank i's
    (its region, its UUID): SGLang rebuilds an entry on the GPU its UUID names. Without
    them the daemon cannot know, and entry i is slot rank i's (docs/sglang.md section 1)."""
    import base64

    from slotsync.protocol.wire import logical_gpu_uuid

    uuids = (logical_gpu_uuid(0), logical_gpu_uuid(1))
    h = Harness("0.5.23", declare=True)
    h.table.set_engine_table({(0, 2): URL}, {(0, 2): uuids} if declared else None,
                             {(0, 2): ("sglang", "in_place")})
    for r in range(2):
        h.send(r, reg(r, 0, 2, url=URL, uuid=uuids[1 - r]))
    h.round(0)
    assert h.acks()[-1] == ("commit", -1)
    loads = [b["serialized_named_tensors"] for b in h.engine.bodies
             if isinstance(b, dict) and b.get("serialized_named_tensors", [EMPTY_UPDATE])[0]
             not in (EMPTY_UPDATE, base64.b64encode(EMPTY_UPDATE).decode())]
    assert len(loads) == 2  # (two chunks)
    for entries in loads:
        for tp, entry in enumerate(entries):
            raw = base64.b64decode(entry)
            rank = 1 - tp if declared else tp  # the rank whose chunk entry tp carries
            assert f"seg-{rank}".encode() in raw and uuids[1 - rank].encode() in raw, (tp, raw)


def test_the_tp_order_follows_the_declared_gpus_only_when_they_are_the_ranks():
    from slotsync.daemon.sglang.merge import tp_order

    ranks = {4: "u1", 5: "u0", 6: "u2"}
    assert tp_order(ranks, ("u0", "u1", "u2")) == [5, 4, 6]
    assert tp_order(ranks, None) == [4, 5, 6]
    assert tp_order(ranks, ("u0", "u1", "u9")) == [4, 5, 6]  # (refused at the pause)
    assert tp_order(ranks, ("u0", "u1")) == [4, 5, 6]

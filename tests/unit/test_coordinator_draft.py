"""Unit tests of the coordinator's draft-model sessions (issue 18 C): no sockets, no clock.

The scripted engine of ``test_coordinator`` learns vLLM 0.32's draft routes
(``gpu_worker.py`` ``start_draft_weight_update`` / ``_start_weight_update(is_draft=True)``:
one session at a time per worker, "already active"; ``_set_draft_weight_update_target``: an
engine without a draft model refuses) and keeps the one weight version vLLM keeps
(``AsyncLLM.finish_weight_update`` sets it only when given).
"""

from __future__ import annotations

from dataclasses import dataclass

from test_coordinator import Harness, ScriptedEngine, chunk

from slotsync.daemon.core.coordinator import EngineCall, SlotState
from slotsync.protocol.wire import Ack, Begin, Chunk, Commit, Error

NO_DRAFT = ("HTTP 500: Draft model weight update requested, but no draft model is "
            "configured.")
"""vLLM 0.32 ``Worker._set_draft_weight_update_target``'s refusal, as the daemon reads it."""

MAIN = ("a", "b")
DRAFT = ("d",)


@dataclass
class DraftEngine(ScriptedEngine):
    """``ScriptedEngine`` with vLLM's draft routes; ``has_draft``: a draft model is set up."""

    has_draft: bool = True
    says_draft: bool | None = None  # what supports_draft_weight_updates answers (has_draft)
    draft_sessions: int = 0

    def answer(self, call: EngineCall) -> tuple[bool, object, str]:
        r = call.route
        if r == "draft_support":  # /collective_rpc: vLLM's router writes str(result)
            assert call.body == {"method": "supports_draft_weight_updates"}
            self.calls.append(r)
            self.bodies.append(call.body)
            says = self.has_draft if self.says_draft is None else self.says_draft
            return True, {"results": [str(says)] * self.world_size}, ""
        if r not in ("start_draft_weight_update", "finish_draft_weight_update"):
            return super().answer(call)
        self.calls.append(r)
        self.bodies.append(call.body)
        nth = sum(1 for c in self.calls if c == r) - 1
        if (r, nth) in self.fail:
            return False, None, self.fail[(r, nth)]
        if r == "start_draft_weight_update":
            if not self.has_draft:
                return False, None, NO_DRAFT
            if self.active:
                return False, None, "HTTP 500: already active"
            self.active = True
            self.draft_sessions += 1
            return True, {"message": "Draft weight update started"}, ""
        if not self.active:
            return False, None, "HTTP 500: no active update"
        self.active = False  # (no weight_version: the engine keeps the main finish's)
        assert not call.body
        return True, {"message": "Weight update finished"}, ""


def harness() -> Harness:
    h = Harness()
    h.engine = DraftEngine(world_size=2)
    h.register_all()
    return h


def dchunk(update_id: int, index: int, rank: int) -> Chunk:
    c = chunk(update_id, index, rank, names=DRAFT)
    c.draft = True
    return c


def draft_round(h: Harness, uid: int, main_chunks: int = 2, draft_chunks: int = 1,
                draft_names: tuple[str, ...] = DRAFT) -> None:
    """Every rank: Begin(draft=True), main chunks, draft chunks, Commit."""
    for r in range(h.size):
        h.send(r, Begin(uid, f"v{uid}", draft=True))
    for k in range(main_chunks):
        for r in range(h.size):
            h.send(r, chunk(uid, k, r, names=MAIN))
    for k in range(main_chunks, main_chunks + draft_chunks):
        for r in range(h.size):
            c = chunk(uid, k, r, names=draft_names)
            c.draft = True
            h.send(r, c)
    for r in range(h.size):
        h.send(r, Commit(uid, main_chunks + draft_chunks))


def errors(h: Harness, rank: int) -> list[Error]:
    return [m for m in h.replies.get(rank, []) if isinstance(m, Error)]


def test_draft_session_runs_after_the_main_finish_and_resume_waits_for_both():
    h = harness()
    draft_round(h, 0)
    assert h.engine.calls == [
        "version", "server_info", "get_world_size", "weight_info", "is_sleeping",
        "init_weight_transfer_engine",
        "draft_support", "pause", "start_weight_update", "update_weights", "update_weights",
        "finish_weight_update", "start_draft_weight_update", "update_weights",
        "finish_draft_weight_update", "resume"]
    finish = h.engine.bodies[h.engine.calls.index("finish_weight_update")]
    assert finish == {"weight_version": "v0"}  # the main finish sets vLLM's one version
    assert h.engine.version == "v0" and not h.engine.paused and not h.engine.active
    for r in range(2):
        assert [(m.phase, m.index) for m in h.replies[r] if isinstance(m, Ack)] == [
            ("begin", -1), ("chunk", 0), ("chunk", 1), ("chunk", 2), ("commit", -1)]
    e = h.coord.engine
    assert (e.version, e.draft.version) == ("v0", "v0")
    assert e.last_ok_names == frozenset(MAIN) and e.draft.last_ok_names == frozenset(DRAFT)
    st = h.coord.status()
    assert st["last_version"] == "v0" and st["draft_weight_version"] == "v0"
    assert st["needs_full_update_targets"] == [] and h.coord.state is SlotState.IDLE
    # a round without the draft part leaves the draft's version as it was
    h.round(1)
    assert h.coord.status()["last_version"] == "v1"
    assert h.coord.status()["draft_weight_version"] == "v0"
    assert h.engine.draft_sessions == 1


def test_draft_chunks_wait_for_the_draft_session_while_main_ones_load():
    """A draft chunk every rank sent is held until ``/start_draft_weight_update`` returned:
    it never reaches the main session."""
    h = harness()
    h.engine.hold = True
    for r in range(2):
        h.send(r, Begin(0, "v0", draft=True))
        h.send(r, chunk(0, 0, r, names=MAIN))
        h.send(r, dchunk(0, 1, r))
    while h.pending_calls:
        call = h.pending_calls.pop(0)
        if call.route == "update_weights":
            assert call.index == 0 or h.engine.draft_sessions == 1
        h.run(h.coord.on_engine_result(call.call_id, *h.engine.answer(call), h.now))
    assert h.engine.calls[-4:] == ["update_weights", "finish_weight_update",
                                   "start_draft_weight_update", "update_weights"]


def test_ranks_that_disagree_on_the_draft_part_are_refused_before_the_pause():
    h = harness()
    h.send(0, Begin(0, "v0", draft=True))
    h.send(1, Begin(0, "v0"))
    for r in range(2):
        err = errors(h, r)[-1]
        assert err.phase == "begin"
        assert "rank 1 begins update 0 without a draft part, ranks [0] with one" in err.message
    assert "pause" not in h.engine.calls and not h.engine.paused


def test_a_main_chunk_after_a_draft_chunk_is_a_clear_error():
    h = harness()
    for r in range(2):
        h.send(r, Begin(0, "v0", draft=True))
        h.send(r, chunk(0, 0, r, names=MAIN))
        h.send(r, dchunk(0, 1, r))
    h.send(0, chunk(0, 2, 0, names=MAIN))
    err = errors(h, 0)[-1]
    assert "rank 0 sent chunk 2 as a main chunk, but the draft part begins at chunk 1" in (
        err.message)
    # ranks that part at the same index: rank 1's chunk 1 is a main one, rank 0's a draft
    h1 = harness()
    for r in range(2):
        h1.send(r, Begin(0, "v0", draft=True))
        h1.send(r, chunk(0, 0, r, names=MAIN))
    h1.send(1, chunk(0, 1, 1, names=DRAFT))
    h1.send(0, dchunk(0, 1, 0))
    err = errors(h1, 0)[-1]
    assert "rank 0 began the draft part at chunk 1, but rank 1 sent chunk 1 as a main" in (
        err.message)
    assert h1.engine.calls.count("update_weights") == 1  # chunk 1 never reached the engine
    # a draft chunk in a round that declared none, and a draft part with no main chunk
    h2 = harness()
    h2.begin(0)
    h2.send(0, dchunk(0, 0, 0))
    assert "declared no draft part" in errors(h2, 0)[-1].message
    assert "pause" not in h2.engine.calls
    h3 = harness()
    for r in range(2):
        h3.send(r, Begin(0, "v0", draft=True))
    h3.send(1, dchunk(0, 0, 1))
    assert "the draft part comes after at least one main chunk" in errors(h3, 1)[-1].message
    assert "pause" not in h3.engine.calls


def check_draft_failure(h: Harness, route: str) -> None:
    """After a failure in the draft session: every rank has an Error naming the draft
    phase, the engine is paused, the draft needs a full update, the main model is recorded
    and not flagged; a round without the draft is refused before the pause; a round with
    the full draft recovers and resumes."""
    for r in range(2):
        err = errors(h, r)[0]  # (the later ones answer its commit: "already failed")
        assert err.phase == "draft" and route in err.message
        assert "its draft model needs a full update" in err.message
    e = h.coord.engine
    assert h.engine.paused and e.paused and e.draft.needs_full_update
    assert not e.needs_full_update and e.last_ok_names == frozenset(MAIN)
    assert h.coord.last_version == "v0" and h.engine.version == "v0"
    assert h.coord.state is SlotState.FAILED
    assert h.coord.status()["needs_full_update_targets"] == ["draft"]
    assert h.coord.mid_update_state() is not None  # the durable record keeps it
    pauses, seen = h.engine.calls.count("pause"), len(errors(h, 0))
    h.round(1)
    err = errors(h, 0)[seen]
    assert err.phase == "begin" and "draft model needs a full update" in err.message
    assert "has no draft part" in err.message and h.engine.calls.count("pause") == pauses
    draft_round(h, 2)
    assert h.ended[-1].outcome == "success" and not h.engine.paused
    assert not e.draft.needs_full_update and e.draft.version == "v2"
    assert h.coord.state is SlotState.IDLE


def test_failed_draft_start_leaves_only_the_draft_needing_a_full_update():
    h = harness()
    h.engine.fail[("start_draft_weight_update", 0)] = "HTTP 500: injected draft start fault"
    draft_round(h, 0)
    assert "resume" not in h.engine.calls
    check_draft_failure(h, "start_draft_weight_update")


def test_failed_draft_session_update_leaves_only_the_draft_needing_a_full_update():
    h = harness()
    h.engine.fail[("update_weights", 2)] = "HTTP 500: injected draft update fault"
    draft_round(h, 0)
    assert h.engine.calls[-2:] == ["start_draft_weight_update", "update_weights"]
    assert h.coord.engine.mid_update  # the draft session may be half-open
    check_draft_failure(h, "update_weights")
    # the recovery round ended the half-open session first (finish, tolerating the 500)
    assert "finish_recover" in h.engine.calls


def test_recovery_round_must_carry_every_draft_name():
    h = harness()
    draft_round(h, 0, draft_names=("d", "e"))
    h.engine.fail[("update_weights", 5)] = "HTTP 500: injected draft update fault"
    draft_round(h, 1, draft_names=("d", "e"))  # (its 3rd update: the draft chunk)
    assert h.coord.engine.draft.needs_full_update
    seen = len(errors(h, 0))
    draft_round(h, 2, draft_names=("d",))
    err = errors(h, 0)[seen]
    assert err.phase == "draft" and "draft model needs a full update" in err.message
    assert "misses 1 of the 2 draft tensor names" in err.message
    assert h.engine.calls.count("finish_draft_weight_update") == 1 and h.engine.paused


def test_engine_without_a_draft_model_is_refused_before_the_pause():
    """Before the pause, a round with a draft part asks the workers'
    ``supports_draft_weight_updates()`` (once per engine process): an engine without a draft
    model is named and never paused; a round without the draft part then goes through."""
    h = harness()
    h.engine.has_draft = False
    draft_round(h, 0)
    for r in range(2):
        err = errors(h, r)[0]
        assert err.phase == "begin" and "cannot load a draft model" in err.message
        assert "supports_draft_weight_updates() answered ['False', 'False']" in err.message
    assert "pause" not in h.engine.calls and not h.engine.paused
    h.round(1)
    assert h.ended[-1].outcome == "success"
    h.engine.has_draft = True
    draft_round(h, 2)
    draft_round(h, 3)
    assert h.ended[-1].outcome == "success"
    assert h.engine.calls.count("draft_support") == 2  # (asked again only after a refusal)


def test_draft_start_refused_for_want_of_a_draft_model_resumes_the_engine():
    """Should vLLM still refuse the draft start for want of a draft model (its check said
    yes), it refused before any worker's session opened: the main weights are loaded and
    recorded, nothing is half-loaded, so the engine is checked and resumed (I9) and the ranks
    are told why."""
    h = harness()
    h.engine.has_draft, h.engine.says_draft = False, True
    draft_round(h, 0)
    for r in range(2):
        err = errors(h, r)[0]
        assert err.phase == "draft" and "no draft model is configured" in err.message
        assert "the engine has no draft model to update" in err.message
    assert h.engine.calls[-2:] == ["is_paused", "resume"] and not h.engine.paused
    e = h.coord.engine
    assert not e.draft.needs_full_update and not e.needs_full_update
    assert h.coord.last_version == "v0" and h.coord.state is SlotState.IDLE
    h.round(1)
    assert h.ended[-1].outcome == "success"


def test_restarted_engine_needs_its_draft_in_full_once_the_daemon_had_loaded_one():
    h = harness()
    draft_round(h, 0)
    h.engine.restart()
    h.round(1)
    err = errors(h, 0)[0]
    assert "draft model needs a full update (a new engine session" in err.message
    assert not h.engine.paused  # refused before the pause
    draft_round(h, 2)
    assert h.ended[-1].outcome == "success" and h.coord.engine.draft.version == "v2"


def test_slotsync_status_shows_the_draft_version_and_that_it_needs_a_full_update():
    from slotsync.cli.status import render_table

    h = harness()
    draft_round(h, 0)
    h.engine.fail[("update_weights", 5)] = "HTTP 500: injected draft update fault"
    draft_round(h, 1)
    table = render_table({"slots": [h.coord.status()]})
    assert "v1 (draft v0, needs full update)" in table, table

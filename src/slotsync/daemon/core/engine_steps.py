"""The engine steps of one slot's coordinator: what goes to the engine next (I/O-free; part of
``coordinator.SlotCoordinator``, whose state it reads and moves).

``_advance`` is the driver: the engine check after a failed update first (``_maintain``:
``/is_paused``, then resume), then the update's next begin stage (``update.begin_step``, its
bodies from the engine's family), then up to ``chunks_in_flight`` ``update_weights`` calls in
index order (``chunk_window.to_send``, the bodies the family's merge made), a proving call
where the family's fence waits (``family.ChunkFence``), the draft session of a round with a
draft part, and the finish (after the omitted-names check) and resume. ``_deadline`` is the
wait on ranks in force while no engine call is out.

One update (design.md "Flow of one round"); each begin stage runs when the one before it
returned and its condition holds (``update.BEGIN_STAGES``)::

    stage    engine calls (together)                      when
    version  version, server_info (GET /version,          the vLLM version is not known, or it
             GET /server_info): the engine families       or the DP layout is refused, or a
             (refused before the pause)                   restart is suspected
    probe    get_world_size, weight_info, is_sleeping     every rank registered (each round:
                                                          world size, session, sleep, I9)
    version_again  version, server_info                   the probe found a new session
    init     init_weight_transfer_engine(packed)          the engine is not initialised: the
                                                          slot's first update, after a failure,
                                                          or the probe found a new session
    draft    draft_support (/collective_rpc               a round with a draft part, once per
             supports_draft_weight_updates)               engine process (issue 18)
    pause    pause(keep)                                  every rank began, a chunk arrived (an
                                                          update with no chunk never touches the
                                                          engine), the GPU UUIDs match (I2)
    recover  finish_recover (a 500 is expected)           the engine may hold a half-open session
    start    start_weight_update                          -> Ack(begin) to every rank

    chunk k complete on every rank ─► merge ─► update_weights ─► Ack(chunk k) to every rank
        (chunks may arrive right after their rank's Begin: they are merged meanwhile and go
        out once start returned; chunks k+1 .. k+chunks_in_flight-1 may already be at the
        engine, queued behind k)
    Commit from every rank (same count, all chunks consumed) ─► finish(version) ─► resume
      ─► Ack(commit) to every rank

    A round with a draft part (``Begin.draft``, issue 18): once every main chunk was loaded
    ─► finish(version) ─► start_draft_weight_update ─► draft chunks ─► update_weights ...
    ─► (every Commit) finish (no version) ─► resume; the engine stays paused in between
"""

from __future__ import annotations

from typing import Any

from slotsync.daemon.core import chunk_window
from slotsync.daemon.core.actions import Action, EngineCall, SlotEvent
from slotsync.daemon.core.engine_session import CHECK_REPLIES
from slotsync.daemon.core.update import (
    BEGIN_STAGES,
    SENT_EVENTS,
    STAGE_INDEX,
    Phase,
    Update,
    begin_step,
)

VERSION_ROUTES = frozenset(BEGIN_STAGES[STAGE_INDEX["version"]].routes)
"""The version stage's steps: their answers are the families' to read (``Families``)."""
PROBE_ROUTES = frozenset(BEGIN_STAGES[STAGE_INDEX["probe"]].routes)
"""The probe stage's steps (an answer unlike the engine's kind: ``Families.kind_in_doubt``)."""
KIND_ROUTES = VERSION_ROUTES | PROBE_ROUTES
"""Steps asked in the engine's kind before the pause: while the kind is in doubt
(``Update.kind_doubt``) their answers are moot, and the kind is asked again (issue 35)."""


class EngineSteps:
    """The driver half of ``SlotCoordinator`` (its attributes are the coordinator's)."""

    def _call(self, u: Update, route: str, body: Any = None, index: int = -1,
              needs_record: bool = False) -> list[Action]:
        self._call_id += 1
        call = EngineCall(self._call_id, u.update_id, route, body, self.slot, index,
                          needs_record)
        self._calls[call.call_id] = call
        event = SENT_EVENTS.get(route)
        if event is not None:
            u.on(event)
        if u.fence is not None and u.fence.proves(route):
            u.fence.on_send(call.call_id)
        self.engine_calls[route] = self.engine_calls.get(route, 0) + 1
        return [call]

    def _advance(self, now: float) -> list[Action]:
        """Issue the next engine call(s): the engine check after a failure first, then the
        update's next begin stage, then up to ``chunks_in_flight`` ``update_weights`` calls,
        then finish and resume."""
        out = self._maintain(now)
        if out or self._orphans or self._maintenance or self._reconcile or self._adapter_calls:
            return out  # (an adapter call out: an adapter round's, adapters/rounds.py)
        u = self.current
        if u is None:
            return self._advance_adapters(now)
        if not u.engine_started:
            return self._advance_begin(u, now)
        if self._calls and u.finishing:
            return []
        if u.finished:
            return self._call(u, "resume")
        ready, mismatch = chunk_window.to_send(u, len(self._calls), self.chunks_in_flight,
                                               u.sendable_until())
        if mismatch is not None:  # I2: the engine never sees an inconsistent chunk
            return self._fail(now, "chunk", str(mismatch), [])  # ranks differ; none missing
        for idx, merged in ready:  # (the body: the JSON made at merge time, EngineFamily)
            out += self._call(u, "update_weights", self.family.chunk_body(merged), idx)
        if out or self._calls:
            return out
        if u.fence is not None and u.fence.waiting() and not u.all_consumed(self.size):
            # no chunk call is out to prove the loaded ones, and the publisher may wait for
            # their regions: prove them with a call that loads nothing (family.ChunkFence)
            return self._call(u, "prove_copies", {"ranks": self.size})
        if u.draft:
            return self._advance_draft(u, now)
        if u.all_consumed(self.size):
            return self._before_finish(u, now)
        return []

    def _advance_draft(self, u: Update, now: float) -> list[Action]:
        """A round with a draft part, no call out (issue 18): the main finish once every main
        chunk was loaded, then the draft start, then (every chunk loaded and committed) the
        draft finish."""
        if u.phase is Phase.LOADING:
            if u.draft_from is not None and u.next_index == u.draft_from:
                return self._before_finish(u, now)  # the main session's finish(version)
            if u.all_consumed(self.size):
                return self._fail(
                    now, "commit", f"update {u.update_id} declared a draft part "
                    "(Begin.draft) but every rank committed without a draft chunk", [])
            return []
        if u.phase is Phase.MAIN_FINISHED:
            return self._call(u, "start_draft_weight_update", needs_record=True)
        if u.phase is Phase.DRAFT_LOADING and u.all_consumed(self.size):
            refusal = u.omitted_refusal(self.engine.draft.last_ok_names,
                                        self.engine.draft.needs_full_update,
                                        self.omitted_names, draft=True)
            if refusal:
                return self._fail(now, "commit", refusal, [])
            # no weight_version: vLLM's engine has one, the main finish set it
            return self._call(u, "finish_draft_weight_update")
        return []

    def _advance_begin(self, u: Update, now: float) -> list[Action]:
        """Issue the next begin stage whose condition holds (``update.begin_step``); first,
        once the calls of a stage whose answers put the engine's kind in doubt returned, ask
        the kind again (``_recheck_kind``)."""
        if u.kind_doubt and not self._calls:
            return self._recheck_kind(u) + self._advance_begin(u, now)
        family = self.family
        step = begin_step(u, self.engine, self.ranks, self.size, bool(self._calls),
                          self.engine_url, family)
        if step.fail:
            return self._fail(now, "begin", step.fail, [])
        if step.check:  # the first executor call after a worker's failure checks the replies
            return self._call(u, "check_replies", CHECK_REPLIES)
        out: list[Action] = []
        for route in step.stage.routes if step.stage else ():
            if route in VERSION_ROUTES:
                u.kind_asked = self.engine.kind is None  # (slotsync.daemon.families)
            out += self._call(u, route, family.step_body(route, self.packed),
                              needs_record=step.stage.needs_record)
        return out

    def _recheck_kind(self, u: Update) -> list[Action]:
        """The engine answered unlike its kind (``u.kind_doubt``: another engine at its URL,
        issue 35, e.g. a vLLM server replaced by an SGLang one): forget its kind, version
        and layout (``EngineSession.forget_kind``; a declared kind stays) and the chunks
        merged for it (none went to the engine: the start comes later), and run the begin
        from the version stage again, which tells the kind -- once per begin."""
        why, u.kind_doubt, u.kind_rechecked = u.kind_doubt, "", True
        was = self.engine.known_kind
        self.engine.forget_kind()
        u.merged = {i: m for i, m in u.merged.items() if i < u.next_send}
        u.stage, u.version_asked, u.version_404 = STAGE_INDEX["version"], False, ""
        return [SlotEvent(self.slot, "engine_kind_rechecked", {
            "engine": self.engine_url, "update_id": u.update_id, "kind_was": was,
            "why": why}, warning=False)]

    def _before_finish(self, u: Update, now: float) -> list[Action]:
        """Every chunk is loaded and every rank committed: check what the update left out of
        the slot's last successful update, then finish (I4)."""
        last = self.engine.last_ok_names
        if u.new_session and last and not last & u.names:
            # A restarted engine loaded every chunk of an update that shares no name with
            # the last one the daemon loaded: vLLM's load_weights raises on a name its model
            # lacks, so this engine holds another model; the old names say nothing about it
            # (else the full update it needs could never succeed: fresh-user trial, issue 17).
            return [SlotEvent(self.slot, "engine_model_changed", {
                "engine": self.engine_url, "update_id": u.update_id,
                "tensors": len(u.names), "last_tensors": len(last)}),
                *self._call(u, "finish_weight_update", {"weight_version": u.weight_version})]
        refusal = u.omitted_refusal(last, self.engine.needs_full_update, self.omitted_names)
        if refusal:
            return self._fail(now, "commit", refusal, [])
        u.omitted = sorted(last - u.names)
        return self._call(u, "finish_weight_update", {"weight_version": u.weight_version})

    def _maintain(self, now: float) -> list[Action]:
        """After a failed update that paused an intact engine: once its calls returned, ask
        ``/is_paused`` (the engine's answer, not the daemon's guess, I9)."""
        if not self._reconcile or self._orphans or self._maintenance:
            return []
        self._reconcile = False
        return [self._maintenance_call("is_paused")]

    def _maintenance_call(self, route: str) -> EngineCall:
        self._call_id += 1
        call = EngineCall(self._call_id, self.next_update_id - 1, route, None, self.slot)
        self._maintenance[call.call_id] = call
        self.engine_calls[route] = self.engine_calls.get(route, 0) + 1
        return call

    def _deadline(self) -> tuple[float, str, str, list[int]] | None:
        """(time, phase, what, missing ranks) of the wait in force, or None."""
        u = self.current
        if u is None:
            return self._adapter_deadline()  # (an adapter round's wait: adapters/rank_waits.py)
        if (self._calls or self._orphans or self._maintenance or self._reconcile
                or u.finishing):
            return None  # (each engine call is bounded by the HTTP client's timeout)
        return u.wait_in_force(range(self.start, self.end), self.gone_ranks(), self.timeouts)

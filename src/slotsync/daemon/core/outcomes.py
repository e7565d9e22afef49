"""How one slot's update moves on the engine's answers, and how it ends (I/O-free; part of
``coordinator.SlotCoordinator``, whose state it reads and moves).

``on_engine_result`` reads each engine call's outcome: the version stage's through the engine
families (``Families.version_answer`` / ``version_failure``: refused before the pause), the
probes' (``probe.py``), the start's (the family's chunk fence), each chunk's (ordered acks, I3),
the finish's (I8: the version is recorded only here) and the resume's; a failure fails the
update, except those the round expects (a recovering finish's 500, a start that met a session
nobody recorded). ``_fail`` ends an update in failure (what it leaves behind:
``recovery.after_failure``; its errors held while a call of it may still read the ranks'
memory: ``family.HeldErrors``), ``_complete`` in success; the engine check after a failure
answers through ``_on_maintenance_result`` (``recovery.engine_check``). ``poll`` fails an
update whose wait on ranks expired (I5), ``on_daemon_stop`` the one in flight at shutdown.
"""

from __future__ import annotations

from typing import Any

from slotsync.daemon.core import chunk_window, probe, recovery
from slotsync.daemon.core.actions import Action, EngineCall, Reply, SlotEvent, UpdateEnded
from slotsync.daemon.core.engine_session import (
    key_refusal_words,
    key_refused,
    out_of_step_found,
    replies_in_step,
)
from slotsync.daemon.core.engine_steps import KIND_ROUTES, PROBE_ROUTES, VERSION_ROUTES
from slotsync.daemon.core.update import STAGE_INDEX, PhaseEvent, Update
from slotsync.protocol import wire
from slotsync.protocol.wire import Ack, Error


class Outcomes:
    """The engine answers' and the update's end half of ``SlotCoordinator`` (its attributes
    are the coordinator's)."""

    def on_engine_result(
        self, call_id: int, ok: bool, result: Any, error: str, now: float
    ) -> list[Action]:
        """The engine call ``call_id`` returned: ``ok`` with the parsed JSON ``result``, or not
        ok with ``error`` (HTTP status and vLLM's message, or a timeout / connection error)."""
        self.engine.note_call(ok, error, now)  # (reachable or not: status, issue 24)
        if call_id in self._maintenance:
            return self._on_maintenance_result(self._maintenance.pop(call_id), ok, result,
                                               error, now)
        if call_id in self._adapter_calls:  # (an adapter round's: adapters/rounds.py)
            return self._on_adapter_result(call_id, ok, result, error, now)
        if call_id in self._watch_calls:  # (the idle watch's look: adapters/watch.py)
            return self._on_watch_result(call_id, ok, result, error, now)
        call = self._calls.pop(call_id, None)
        if call is None:
            # A call of an update that already failed (I7: its result is dropped); the last
            # one to return lets a waiting update's calls (or the engine check) go out.
            if call_id in self._orphans:
                orphan_route = self._orphans.pop(call_id)
                if not ok:
                    self.engine.note_reply_trouble(orphan_route, error, self.size)
                return self._held_errors.release(self._orphans) + self._advance(now)
            return []
        u = self.current
        assert u is not None and u.update_id == call.update_id  # else it would be an orphan
        route = call.route
        if u.kind_doubt and route in KIND_ROUTES:
            return self._advance(now)  # (moot: the kind is asked again once they returned)
        if route in PROBE_ROUTES and not u.kind_rechecked:
            # answers unlike the engine's kind: another engine at its URL? (issue 35)
            u.kind_doubt = self.families.kind_in_doubt(self.engine, route, ok, result, error,
                                                       self.engine_url)
            if u.kind_doubt:
                return self._advance(now)
        if not ok:
            self.engine.note_reply_trouble(route, error, self.size)
            if route == "check_replies":
                return self._out_of_step(u, now, error)
            if route == "version" and "HTTP " in error:  # no version: refused as unknown
                verdict = self.families.version_failure(
                    self.engine, u, error, self.engine_url,
                    any(c.route == "server_info" for c in self._calls.values()))
                if verdict.recheck and not u.kind_rechecked:
                    u.kind_doubt = verdict.recheck
                    return self._advance(now)
                if not verdict.fail:  # (SGLang has no /version: its /server_info tells)
                    return self._advance(now)
                self._failed_call = (route, error)
                return self._fail(now, "begin", verdict.fail, [])
            self._failed_call = (route, error)
            if route == "finish_recover":
                # Expected when the engine is not (or only partly) mid-update: vllm-contract.md
                # "Per-worker state": finish tolerating the 500, then a full update.
                return self._advance(now)
            if route == "resume":
                # Weights are complete and the version is recorded; the engine stays paused.
                return self._complete(now, resume_error=error)
            if (route == "start_weight_update" and not u.start_retried
                    and self.family.session_open(error)):
                # The engine holds a session nobody recorded (e.g. a daemon restarted without
                # its state dir): end it, tolerating the 500, and start once more.
                u.start_retried = True  # (phase stays starting: it may be mid-update)
                self.engine.mid_update = True
                u.stage = STAGE_INDEX["recover"]
                return self._advance(now)
            # (a refused API key says what to set, whatever the engine's kind: issue 35)
            return self._fail(now, "engine", key_refusal_words(error) if key_refused(error)
                              else f"{self.family.display} {route} failed: {error}", [])
        u.last_progress = now
        out: list[Action] = []
        if route == "check_replies":
            if not replies_in_step(result, self.size):
                return self._out_of_step(u, now, f"it answered {result!r}")
            self.engine.replies_suspect = False
        elif route in VERSION_ROUTES:  # (what they mean: the families, Families)
            verdict = self.families.version_answer(self.engine, u, route, result, self.slot,
                                                   self.size, self.engine_url)
            if verdict.recheck and not u.kind_rechecked:
                u.kind_doubt = verdict.recheck
                return self._advance(now)
            if verdict.fail:  # (before the pause: the version stages come first)
                return self._fail(now, "begin", verdict.fail, [])
            out += verdict.events
            if verdict.merge:  # (the kind is known: the chunks that waited for it)
                out += self._kind_told(u)
                chunk_window.merge_waiting(u, self.size, self._merge_facts())
        elif route == "get_world_size":
            ws = result.get("world_size") if isinstance(result, dict) else None
            if ws != self.size:
                return self._fail(
                    now,
                    "begin",
                    f"engine {self.engine_url} has world size {ws} but slot "
                    f"[{self.start}, {self.end}) has {self.size} ranks",
                    [],
                )
            self.engine.world_size = ws
            self.engine.gpu_uuids = probe.reported_uuids(result)
        elif route == "weight_info":
            out += probe.check_session(self.engine, self.slot, self.engine_url, u, result)
        elif route == "is_sleeping":
            out += probe.check_sleep(self.engine, self.slot, self.engine_url, u, result)
        elif route == "init_weight_transfer_engine":
            self.engine.initialized = True
        elif route == "draft_support":
            why = probe.draft_unsupported(result, self.size, self.engine_url, u.update_id)
            if why:  # (before the pause: the engine still serves)
                return self._fail(now, "begin", why, [])
            self.engine.draft.supported = True
        elif route == "pause":
            self.engine.paused = True
        elif route == "start_weight_update":
            u.on(PhaseEvent.STARTED)
            u.engine_started_at = now
            self.engine.mid_update = True
            u.fence = self.family.fence(self.engine)  # (SGLang's: ack once proven)
            actions: list[Action] = [
                Reply(self.ranks[r].identity, Ack(u.update_id, "begin")) for r in sorted(u.begun)
            ]
            return actions + self._advance(now)
        elif route == "update_weights":
            due = chunk_window.returned(u, call.index)
            if u.fence is not None:  # (acked once proven: family.ChunkFence)
                due = u.fence.on_chunk_reply(call.call_id, call.index, due)
            return self._chunk_acks(u, due) + self._advance(now)
        elif route == "prove_copies":
            return self._chunk_acks(u, u.fence.on_proof(call.call_id) if u.fence else []
                                    ) + self._advance(now)
        elif route == "finish_weight_update":
            if u.fence is not None:  # (the end proves every chunk's copies: ChunkFence)
                out += self._chunk_acks(u, u.fence.on_proof(call.call_id))
            u.on(PhaseEvent.FINISHED)
            self.engine.mid_update = False
            self.engine.needs_full_update = False
            self.engine.last_ok_names = frozenset(u.names)
            self.engine.last_ok_layout = u.layout
            self.last_version = u.weight_version  # I8: recorded only with a successful finish
            self.engine.version = u.weight_version  # what the engine reports from now on
            if u.draft:
                return out + self._advance(now)  # the draft session next, still paused
            if u.found_asleep:
                # vLLM resumes a sleeping engine itself once fully awake; one that someone
                # else paused is theirs to resume.
                return self._complete(now)
        elif route == "start_draft_weight_update":
            u.on(PhaseEvent.DRAFT_STARTED)
            self.engine.mid_update = True
        elif route == "finish_draft_weight_update":
            u.on(PhaseEvent.DRAFT_FINISHED)
            self.engine.mid_update = False
            d = self.engine.draft
            d.needs_full_update, d.why = False, ""
            d.last_ok_names = frozenset(u.draft_names)
            d.version = u.weight_version  # (I8, for the draft target)
            if u.found_asleep:
                return self._complete(now)
        elif route == "resume":
            self.engine.paused = False
            return self._complete(now)
        return out + self._advance(now)

    def _chunk_acks(self, u: Update, due: list[int]) -> list[Action]:
        """``Ack(chunk)`` of each of ``due`` (in index order, I3) to every rank that sent it
        (rank-local: not every rank sends every chunk)."""
        return [Reply(i.identity, Ack(u.update_id, "chunk", idx))
                for idx in due for i in self._by_rank() if u.sent_count.get(i.rank, 0) > idx]

    def _on_maintenance_result(self, call: EngineCall, ok: bool, result: Any, error: str,
                               now: float) -> list[Action]:
        if call.route == "get_world_size" and self.claims is not None:  # (claim_check.py)
            held, why = self.claims.answer(ok, result, self.slot, self.engine_url or "")
            if why:
                self.engine_url = self.claims.url_before
                return [Reply(i, Error("register", why, list(self.slot))) for i, _, _ in held]
            return [a for i, m, p in held for a in self.on_register(i, m, now, p)]
        step = recovery.engine_check(self.engine, call.route, ok, result, error, self.slot,
                                     self.engine_url, call.update_id)
        if step.note:
            self.last_error = f"{self.last_error}{step.note}"[:4000]
        out: list[Action] = [*step.events]
        if step.then:
            out.append(self._maintenance_call(step.then))
        return out + self._advance(now) if step.advance else out

    def _kind_told(self, u: Update) -> list[Action]:
        """The version stage told the engine's kind: one other than the kind it had before
        the daemon asked again (``EngineSession.former_kind``: after a drop, or answers
        unlike its kind) is another engine at the URL, a new session (issue 35); its weight
        version is the probe's baseline."""
        former, self.engine.former_kind = self.engine.former_kind, None
        kind = self.engine.known_kind
        if former is None or kind is None or former == kind:
            return []
        out = probe.new_session(self.engine, self.slot, self.engine_url, u,
                                f"engine {self.engine_url} answers as {kind} now, where it "
                                f"was {former}: another engine at its URL")
        self.engine.version, self.engine.session_suspect = None, False
        return out

    def _out_of_step(self, u: Update, now: float, answer: str) -> list[Action]:
        """The check found the executor's replies out of step: the update fails."""
        self.engine.out_of_step = out_of_step_found(self.engine_url, answer)
        return self._fail(now, "engine", self.engine.out_of_step, [])

    def _fail(self, now: float, phase: str, text: str, missing: list[int]) -> list[Action]:
        """Fail the update in flight: one Error to every rank of the slot. If it had sent
        ``/start_weight_update`` the engine stays paused and needs a full update (I4); if it
        had only paused an engine whose weights were intact (or the pause was in flight), the
        engine is checked once the update's calls returned and resumed if paused (I9)."""
        u = self.current
        if u is None:
            return []
        self.current = None
        # Late results of its calls are dropped in on_engine_result; the next update's calls
        # (and the engine check) wait for them.
        self._orphans.update({i: c.route for i, c in self._calls.items()})
        self._calls.clear()
        self.next_update_id = max(self.next_update_id, u.update_id + 1)
        failed, self._failed_call = self._failed_call, None
        fate, reconcile = recovery.after_failure(self.engine, u, failed, self.size)
        if u.draft and u.main_finished and phase in ("engine", "chunk", "commit"):
            phase = "draft"  # (issue 18: a failure in the draft session names it)
        if reconcile:
            self._reconcile = True  # after the orphans: /is_paused, then resume
        message = (f"slot [{self.start}, {self.end}) update {u.update_id} failed in {phase}: "
                   f"{text} ({fate})")
        self.last_error = message
        self._failed = (u.update_id, message)
        self.last_outcome = "failed"
        self.updates_failed += 1
        self.last_duration_s = now - u.started_at
        err = Error(phase, message, list(self.slot), u.update_id, list(missing))
        if self._pending_url is not None:
            self._reconcile = False  # (another engine from now on)
            self.set_engine_url(self._pending_url)
        actions: list[Action] = [Reply(i.identity, err) for i in self._by_rank()]
        # (held until no call of it reads their memory: SGLang's chunk calls)
        actions = self._held_errors.hold(actions, self._orphans, self.family.reads_memory)
        actions.append(UpdateEnded(self.slot, self.engine_url or "", u.update_id,
                                   u.weight_version, "failed", now - u.started_at,
                                   u.next_index, u.consumed_bytes, message))
        actions = self._adapters_after_base(u, actions, True, now)  # (a restart seen)
        return actions + self._maintain(now)

    def _complete(self, now: float, resume_error: str | None = None) -> list[Action]:
        u = self.current
        assert u is not None
        self.current = None
        self.next_update_id = max(self.next_update_id, u.update_id + 1)
        self.last_duration_s = now - u.started_at
        self.last_success = (now, self.last_duration_s)
        self.last_outcome = "success"
        self.last_error = (
            f"update {u.update_id} loaded but resume failed: {resume_error}"
            if resume_error
            else None
        )
        self.updates_ok += 1
        if self._pending_url is not None:
            self.set_engine_url(self._pending_url)
        ack = Ack(u.update_id, "commit", -1, now - u.started_at,
                  u.omitted[:wire.MAX_OMITTED_NAMES], len(u.omitted), not u.found_asleep)
        acks: list[Action] = [Reply(i.identity, ack) for i in self._by_rank()]
        if u.omitted:
            acks.append(SlotEvent(self.slot, "omitted_names", {
                "engine": self.engine_url, "update_id": u.update_id,
                "version": u.weight_version, "count": len(u.omitted),
                "names": ",".join(u.omitted[:wire.MAX_OMITTED_NAMES]),
                "why": "the slot's last successful update loaded them and this one did not: "
                       "vLLM keeps their old values"}))
        acks.append(UpdateEnded(self.slot, self.engine_url or "", u.update_id,
                                u.weight_version, "success", now - u.started_at, u.next_index,
                                u.consumed_bytes, self.last_error or "", len(u.omitted)))
        return self._adapters_after_base(u, acks, False, now)  # (restarted: adapters again)

    def poll(self, now: float) -> list[Action]:
        """Check deadlines (design.md I5); fails the update naming the missing ranks."""
        if self.current is None:
            return self._adapter_poll(now)  # (an adapter round's wait: adapters/rank_waits.py)
        d = self._deadline()
        if d is None or now < d[0]:
            return []
        _, phase, what, missing = d
        u = self.current
        assert u is not None
        if phase == "rank_gone":
            return self._fail(now, phase, "; ".join(
                f"{self.ranks[r].who} is gone: {self.ranks[r].gone_why}" for r in missing)
                + f" (no new process of it registered within {self.timeouts.gone_s:g} s, "
                "liveness_s)", missing)
        return self._fail(
            now,
            phase,
            f"deadline expired in update {u.update_id} waiting for {what} from rank(s) {missing}",
            missing,
        )

    def on_daemon_stop(self, now: float, reason: str, phase: str = "shutdown") -> list[Action]:
        """The daemon is shutting down (or an operator drops the slot: ``phase="dropped"``):
        fail the update in flight. The engine is left as it is (paused if the update paused
        it, I4): no engine check runs after this, and the durable record names the slot, so
        the next daemon recovers it as possibly mid-update."""
        if self.current is None:
            return self._adapter_stop(now, reason)
        out = self._fail(now, phase, reason, [])
        if self._reconcile:
            self._reconcile = False
            self.engine.paused = True
            self.engine.needs_full_update = True  # (a check it could not make: recover it fully)
        return [a for a in out if not isinstance(a, EngineCall)]

"""Recovering an engine a previous daemon left mid-update, and what the durable record says of
a slot (design.md I4): I/O-free rules.

* ``mid_update_state``: what the durable record (``mid_update_record.py``) holds for a slot:
  ``in_flight`` for the whole update (from its begin until it ended), ``failed`` after a failed
  update until a full update succeeds, ``out_of_step`` while the engine's executor replies are
  out of step (vLLM gh-58242), else nothing.
* ``after_failure``: what a failed update leaves behind follows from its phase
  (``update.Phase``): once ``/start_weight_update`` was sent (and may have reached a worker)
  the engine stays paused and needs a full update; if it had only paused an engine whose
  weights were intact, the engine is checked (``/is_paused``) once the update's calls returned
  and resumed if paused (I9).
* ``engine_check``: that check's answers. ``/is_paused`` true -> ``/resume``; false -> the
  engine serves; failed -> the engine may still be paused (say paused: the next begin probes
  again), and nothing more is sent until the next round. A failed ``/resume`` leaves it
  paused until the next round. The daemon's view follows the engine's answer, not its guess.
* ``restore``: a new daemon reads the record and keeps each engine named there paused and
  marked as needing a full update; the next round first ends any half-open session (finish,
  tolerating the 500) unless the probe finds the engine serving (``probe.check_sleep``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotsync.daemon.core.actions import SlotEvent
from slotsync.daemon.core.engine_session import WORKER_FAILED, EngineSession, start_reached_none
from slotsync.daemon.core.update import Update

RESTARTED_DURING_UPDATE = "the daemon restarted during this update"
"""The failure recorded for the update a previous daemon left (``SlotCoordinator._failed``)."""


def mid_update_state(current: Update | None, failed: tuple[int, str] | None,
                     next_update_id: int, engine: EngineSession) -> tuple[str, int, str] | None:
    """``(state, update_id, weight_version)`` if the engine may hold half-loaded weights:
    ``"in_flight"`` from the update's begin until it ended (resume returned),
    ``"failed"`` after a failed update until a full update succeeds; else None.

    Args:
        current: the update in flight, or None.
        failed: ``(update_id, error)`` of the slot's last failed update, or None.
        next_update_id: the id the slot's next update gets.
        engine: the slot's engine session.

    The whole update, not just start .. finish: the durable record (the adapter writes it
    when this changes) is then written while get_world_size and pause run -- it only has
    to be written before start is sent -- and cleared after the commit's acks went out,
    not between finish and resume. A daemon killed outside start .. finish leaves an
    engine that is at worst paused: recovering it as if mid-update is safe."""
    if current is not None:
        return ("in_flight", current.update_id, current.weight_version)
    uid, _ = failed if failed else (next_update_id - 1, "")
    if engine.out_of_step:
        return ("out_of_step", uid, "")  # (refused until a new session, also after us)
    if ((engine.needs_full_update or engine.draft.needs_full_update)
            and (engine.mid_update or engine.paused)):
        return ("failed", uid, "")
    return None


def after_failure(engine: EngineSession, u: Update, failed: tuple[str, str] | None,
                  size: int) -> tuple[str, bool]:
    """Update ``engine`` for the failure of update ``u`` on an engine of ``size`` workers;
    ``failed``: ``(route, error)`` of the engine call that failed it, if one did.

    Returns ``(fate, reconcile)``: the fate for the error message, and whether the engine
    must be checked with ``/is_paused`` (and resumed) once the update's calls returned.

    A round with a draft part that failed after its main session finished leaves the main
    model recorded and only the draft needing a full update (``after_draft_failure``)."""
    if u.draft and u.main_finished:
        return after_draft_failure(engine, u, failed, size)
    # a start whose failure shows no worker began a session counts as not sent
    started = u.start_sent and not (
        failed is not None and failed[0] == "start_weight_update"
        and start_reached_none(failed[1], size))
    reconcile = False
    if started:
        engine.needs_full_update = True
        engine.mid_update = True
        engine.paused = True
        # After a finish that reached the workers (some failed it, or it timed out and ran
        # on), the ones that finished hold no session: start first (a worker still in its
        # session answers "already active"; then finish and start again). Otherwise the
        # workers are still in their sessions: finish first. (Either order is right for
        # one worker; for several, the wrong one fails on worker 0 first, see
        # replies_suspect.)
        engine.recover_first = not (
            size > 1 and failed is not None and failed[0] == "finish_weight_update"
            and (WORKER_FAILED in failed[1] or "HTTP " not in failed[1]))
        fate = "the engine stays paused and needs a full update"
    elif u.pause_sent and u.weights_intact:
        reconcile = True
        engine.paused = True  # (may be: the check tells)
        fate = ("no weight update had started: the engine is resumed if the pause reached "
                "it")
    elif u.pause_sent or engine.paused:
        engine.paused = True
        fate = ("the engine stays paused and needs a full update"
                if engine.needs_full_update else "the engine stays paused")
    else:
        fate = "the engine was not paused"
    # The engine may have restarted or been swapped: re-check and re-init next time.
    engine.initialized = False
    return fate, reconcile


NO_DRAFT_MODEL = ("no draft model is configured", "no draft model config is configured",
                  "does not support draft model weight updates")
"""vLLM 0.32's refusals of ``/start_draft_weight_update`` by an engine that has no draft
model, or a transfer backend without draft updates (``gpu_worker.py``
``_set_draft_weight_update_target``, ``_start_weight_update``): raised before any worker's
session opens."""


def after_draft_failure(engine: EngineSession, u: Update, failed: tuple[str, str] | None,
                        size: int) -> tuple[str, bool]:
    """``after_failure`` for a round whose main session finished (issue 18): the main
    weights and version are recorded (not flagged again); the engine stays paused and its
    draft model needs a full update -- unless the draft start was refused because the engine
    has no draft model (``NO_DRAFT_MODEL``): then nothing is half-loaded and the engine is
    checked and resumed like one whose weights are intact. Returns ``(fate, reconcile)``."""
    engine.initialized = False
    engine.paused = True
    route, error = failed if failed is not None else ("", "")
    if (route == "start_draft_weight_update" and "HTTP " in error
            and any(t in error for t in NO_DRAFT_MODEL)):
        return (f"the engine has no draft model to update; the main weights (version "
                f"{u.weight_version!r}) are loaded"
                + ("" if u.found_asleep else ": the engine is resumed if paused"),
                not u.found_asleep)
    engine.draft.needs_full_update = True
    engine.draft.why = f"update {u.update_id}'s draft session failed"
    if u.draft_start_sent and not (route == "start_draft_weight_update"
                                   and start_reached_none(error, size)):
        engine.mid_update = True
        engine.recover_first = not (
            size > 1 and route == "finish_draft_weight_update"
            and (WORKER_FAILED in error or "HTTP " not in error))
    return (f"the engine stays paused and its draft model needs a full update; the main "
            f"weights (version {u.weight_version!r}) are loaded", False)


@dataclass(frozen=True, slots=True)
class CheckStep:
    """What follows an answer of the engine check (``engine_check``): ``events`` to log,
    ``note`` to append to the slot's ``last_error`` ('' for none), the next check call's route
    (``then``: ``"resume"``, or '' for none), and whether the slot goes on (``advance``: a
    waiting update's calls may go out)."""

    events: tuple[SlotEvent, ...] = ()
    note: str = ""
    then: str = ""
    advance: bool = False


def engine_check(engine: EngineSession, route: str, ok: bool, result: Any, error: str,
                 slot: tuple[int, int], engine_url: str | None, update_id: int) -> CheckStep:
    """The engine check's call ``route`` (``is_paused`` or ``resume``, vLLM 0.32) after failed
    update ``update_id`` returned: ``ok`` with the parsed JSON ``result``, or not ok with
    ``error``. Updates ``engine.paused`` (the rules at the top)."""
    where = {"engine": engine_url, "update_id": update_id}
    if route == "is_paused":
        if not ok:
            engine.paused = True  # unknown: say paused (the next begin probes again)
            return CheckStep(
                (SlotEvent(slot, "engine_state_unknown", {**where, "error": error}),),
                note=f"; then /is_paused failed ({error}): the engine may still be paused")
        if isinstance(result, dict) and not result.get("is_paused"):
            engine.paused = False
            return CheckStep(advance=True)
        return CheckStep(then="resume")
    if not ok:
        engine.paused = True
        return CheckStep(
            (SlotEvent(slot, "engine_resume_failed", {**where, "error": error}),),
            note=f"; then resuming the engine failed ({error}): it stays paused until the "
                 "next round", advance=True)
    engine.paused = False
    return CheckStep((SlotEvent(slot, "engine_resumed_after_failure", {
        **where, "why": "the failed update had paused the engine but not started a weight "
                        "update: its weights are intact"}, warning=False),), advance=True)


def restore(engine: EngineSession, engine_url: str, state: str) -> None:
    """The durable record names this engine with ``state`` (``in_flight``, ``failed`` or
    ``out_of_step``): keep it paused, mid-update and needing a full update; it is initialised
    again before its next update."""
    engine.mid_update = True
    engine.paused = True
    engine.needs_full_update = True
    engine.initialized = False
    engine.restored = state
    if state == "out_of_step":
        engine.out_of_step = (
            f"engine {engine_url}'s executor replies were out of step when the previous "
            "daemon stopped (vLLM gh-58242): restart the engine; the daemon then "
            "initialises it and sends a full update")


def restored_error(slot: tuple[int, int], update_id: int, weight_version: str,
                   state: str) -> str:
    """The slot's ``last_error`` after a restore: which update the previous daemon left, and
    in which ``state``."""
    version = f" ({weight_version!r})" if weight_version else ""
    what = {"in_flight": "in flight", "out_of_step": "failed with the engine's executor "
            "replies out of step"}.get(state, "failed")
    return (
        f"slot [{slot[0]}, {slot[1]}) update {update_id}{version} was {what} when the "
        "previous daemon stopped; the engine stays paused and needs a full update (the "
        "next begin checks whether it is paused)"
    )

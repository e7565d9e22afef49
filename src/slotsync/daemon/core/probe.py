"""What the begin's probe answers mean for the engine session (design.md I9): I/O-free rules.

The probe stage (``update.BEGIN_STAGES``) asks ``/get_world_size``, ``/weight_info`` and
``/is_sleeping`` every round. The coordinator (``SlotCoordinator.on_engine_result``) hands
their results here; these functions update the slot's ``EngineSession`` and the ``Update`` in
flight and return the ``SlotEvent`` an operator should read (an engine restarted, found
asleep, resumed by someone else):

* ``/weight_info``: a weight version other than the one the daemon last saw, or a refused /
  reset connection since with no version of its own to recognise, is a new engine session
  (restarted at the same URL): initialised again, and a full update if the slot ever loaded
  one (it serves its checkpoint's weights).
* ``/is_sleeping`` (vLLM 0.32: the scheduler paused, or the executor asleep at any level): an
  engine asleep or paused by someone else needs a full update (a level-2 sleep discards the
  weights) and is left paused at the end (vLLM resumes it at its full ``/wake_up``); one the
  daemon left paused that serves again was resumed by someone else or restarted.
* ``/get_world_size``: the worker GPU UUIDs next to the world size (``reported_uuids``).
"""

from __future__ import annotations

from typing import Any

from slotsync.daemon.core.actions import Action, SlotEvent
from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.update import Update
from slotsync.protocol import wire


def reported_uuids(result: Any) -> tuple[str, ...] | None:
    """The worker GPU UUIDs an engine reports next to its world size (the reference engine's
    ``/get_world_size`` extension; vLLM reports none), normalised, or None."""
    uuids = result.get("gpu_uuids") if isinstance(result, dict) else None
    if not isinstance(uuids, list) or not all(isinstance(x, str) for x in uuids):
        return None
    try:
        return tuple(wire.normalize_gpu_uuid(x) for x in uuids)
    except ValueError:
        return None


def new_session(engine: EngineSession, slot: tuple[int, int], engine_url: str, u: Update,
                why: str) -> list[Action]:
    """The engine is not the session this daemon initialised: initialise it again, ask its
    world size again (the probe did, in this stage) and require a full update (it serves
    the weights of its own checkpoint, not the last ones the daemon loaded)."""
    engine.new_process()
    u.new_session = True
    if engine.last_ok_names:
        engine.needs_full_update = True
        u.weights_intact = False
    engine.draft.stale("a new engine session: it serves its checkpoint's draft model")
    return [SlotEvent(slot, "engine_session_new", {
        "engine": engine_url, "update_id": u.update_id, "why": why,
        "full_update_needed": engine.needs_full_update})]


def check_session(engine: EngineSession, slot: tuple[int, int], engine_url: str, u: Update,
                  result: Any) -> list[Action]:
    """``/weight_info`` at the begin: is the engine the session this daemon initialised?"""
    v = result.get("weight_version") if isinstance(result, dict) else None
    v = v if isinstance(v, str) else None
    seen, suspect = engine.version, engine.session_suspect
    engine.session_suspect = False
    engine.version = v
    if seen is not None and v != seen:
        why = (f"engine {engine_url} reports weight version {v!r}, but the daemon "
               f"last saw {seen!r}: restarted at the same URL, or updated by someone else")
    elif suspect and (seen is None or seen == "default"):
        why = (f"a connection to engine {engine_url} was refused or reset since the "
               f"last round and its weight version {v!r} does not tell its session apart")
    else:
        if suspect:
            # the version the daemon saw last: the same process; initialise it again to be
            # sure (the IPC backend's init only records the packed flag)
            engine.initialized = False
        return []  # (not initialised: it is, in this begin; v is the baseline)
    return new_session(engine, slot, engine_url, u, why)


def check_sleep(engine: EngineSession, slot: tuple[int, int], engine_url: str, u: Update,
                result: Any) -> list[Action]:
    """``/is_sleeping`` at the begin (vLLM 0.32: the scheduler paused, or the executor
    asleep at any level)."""
    sleeping = bool(result.get("is_sleeping")) if isinstance(result, dict) else False
    restored, engine.restored = engine.restored, None
    if not sleeping:
        was_asleep, engine.asleep = engine.asleep, False
        if restored is not None:
            # A previous daemon's record said mid-update, but the engine serves: that
            # update never started a weight update (the daemon pauses before it starts,
            # and resumes only after a finish), or the engine restarted since. Either way
            # no worker holds a session: no finish is sent (on an engine of several
            # workers a finish that fails on worker 0 leaves the others' replies queued,
            # gh-58242). The next update stays a full one.
            engine.paused = False
            engine.mid_update = False
            serving = [SlotEvent(slot, "engine_serving_after_restart", {
                "engine": engine_url, "update_id": u.update_id,
                "record": restored, "needs_full_update": engine.needs_full_update},
                warning=False)]
            if engine.out_of_step:
                # the previous daemon left it paused with its replies out of step; serving
                # now, it was restarted (as below for this daemon's own pause)
                return serving + new_session(
                    engine, slot, engine_url, u, "the engine the previous daemon left paused "
                    "with its executor replies out of step serves again: restarted")
            return serving
        if engine.paused:
            engine.paused = False
            if was_asleep:  # left paused for vLLM's full /wake_up, which resumed it
                return [SlotEvent(slot, "engine_awake", {
                    "engine": engine_url, "update_id": u.update_id}, warning=False)]
            if engine.out_of_step:
                # an engine left paused with its replies out of step serves again: a
                # restart (nobody can repair the replies in place)
                return new_session(engine, slot, engine_url, u,
                                   "the engine the daemon left paused with its executor "
                                   "replies out of step serves again: restarted")
            # paused by this daemon (a failed update), serving now: resumed by someone
            # else, or a restarted process (the weight version tells which)
            return [SlotEvent(slot, "engine_serving_unexpectedly", {
                "engine": engine_url, "update_id": u.update_id,
                "needs_full_update": engine.needs_full_update})]
        return []
    if engine.paused and not engine.asleep:
        return []  # this daemon's own pause (a failed update): nothing new
    engine.asleep = True
    u.found_asleep = True
    u.weights_intact = False
    engine.needs_full_update = True
    engine.draft.stale("the engine was found sleeping")
    engine.paused = True
    return [SlotEvent(slot, "engine_found_sleeping", {
        "engine": engine_url, "update_id": u.update_id,
        "why": "vLLM /is_sleeping is true (asleep, or paused by someone else): a level-2 "
               "sleep discards the weights, so this update must be a full one, and the "
               "engine is left paused at the end (vLLM resumes it at its full /wake_up)"})]


def draft_unsupported(result: Any, size: int, engine_url: str | None, update_id: int) -> str:
    """Why the engine cannot take update ``update_id``'s draft part, from its workers'
    ``supports_draft_weight_updates()`` (vLLM 0.32 ``gpu_worker.py``: a weight-transfer
    backend with draft updates, ``model_runner.get_draft_model()`` not None and a
    ``speculative_config.draft_model_config``) through ``/collective_rpc``
    (``{"results": [one per worker]}``, ``size`` workers: vLLM's dev-mode router writes a
    result that is not None, a dict or a list as ``str(result)``, so ``"True"``); '' if every
    worker can."""
    results = result.get("results") if isinstance(result, dict) else None
    if isinstance(results, list) and len(results) == size and all(
            r is True or r == "True" for r in results):
        return ""
    return (f"engine {engine_url} cannot load a draft model: its workers' "
            f"supports_draft_weight_updates() answered {results!r} (vLLM needs a draft model "
            "in --speculative-config and a weight-transfer backend with draft updates), but "
            f"update {update_id} has a draft part; publish without draft=... for this engine")

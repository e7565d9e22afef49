"""One slot's ``/status`` entry (issue 24, 26): a pure function of its coordinator's state
(``SlotCoordinator.status``); the daemon's whole document is ``service/status_documents.py``'s.
The keys are the operator's interface (docs/operations.md) and stay as they are. ``c`` is a
``coordinator.SlotCoordinator`` (not imported: the coordinator imports this module).
"""

from __future__ import annotations

from typing import Any

from slotsync.daemon.core.registration import split_relayed


def _node_of(identity: bytes) -> str:
    """The node of a rank relayed from another node's daemon (issue 25), '' for this node's."""
    where = split_relayed(identity)
    return where[0] if where else ""


def slot_status(c: Any, now: float | None = None) -> dict[str, Any]:
    """One slot's ``/status`` entry; ``now``: monotonic seconds (rank ages; default the last
    time a rank was seen). ``"engine_may_be_mid_update"`` is ``c.engine.mid_update``."""
    if now is None:
        now = max([i.last_seen for i in c.ranks.values()], default=0.0)
    u = c.current
    cur = None
    if u is not None:
        calls = c.calls_in_flight()
        cur = {
            "update_id": u.update_id,
            "weight_version": u.weight_version,
            "engine_started": u.engine_started,
            "ranks_begun": sorted(u.begun),
            "chunks_received": {str(r): n for r, n in sorted(u.sent_count.items())},
            "chunks_consumed": u.next_index,
            "bytes_consumed": u.consumed_bytes,
            "ranks_committed": sorted(u.committed),
            "engine_call_in_flight": calls[0].route if calls else None,
            "engine_calls_in_flight": len(calls),
            "draft": u.draft,  # issue 18: the round has a draft part; its first chunk
            "draft_from": u.draft_from,
        }
    return {
        "slot": [c.start, c.end],
        "state": c.state.value,
        "engine_url": c.engine_url,
        "packed": c.packed,
        "transport": c.transport,
        "ranks_expected": c.size,
        "ranks_registered": sorted(c.ranks),
        "ranks": [{"rank": i.rank, "pid": i.peer_pid or i.pid, "host": i.hostname,
                   "node": _node_of(i.identity),
                   "alive": i.gone_at is None,
                   "last_seen_s": round(max(0.0, now - i.last_seen), 3),
                   "gone_s": None if i.gone_at is None else round(now - i.gone_at, 3),
                   "gone_why": i.gone_why or None} for i in c.by_rank()],
        "gpu_uuids": {str(r): i.gpu_uuid for r, i in sorted(c.ranks.items())},
        **engine_reach(c, now),
        "engine_paused": c.engine.paused,
        "needs_full_update": c.engine.needs_full_update,
        "engine_may_be_mid_update": c.engine.mid_update,
        "engine_sleeping": c.engine.asleep,
        "engine_replies_out_of_step": c.engine.out_of_step,
        "engine_weight_version": c.engine.version,
        "engine_vllm_version": c.engine.vllm_version,
        # issue 26: the family's kind or null (not known yet), SGLang's release and pause mode
        "engine_kind": c.engine.known_kind,
        "engine_sglang_version": c.engine.sglang_version,
        "engine_pause_mode": c.engine.pause_mode if c.family.pause_modes else None,
        "engine_gpu_uuids": list(c.engine.declared_gpu_uuids or c.engine.gpu_uuids or []),
        "last_update_names": len(c.engine.last_ok_names),
        # issue 18: the draft model, tracked apart from the main one
        "draft_weight_version": c.engine.draft.version,
        "draft_needs_full_update": c.engine.draft.needs_full_update,
        "last_update_draft_names": len(c.engine.draft.last_ok_names),
        "needs_full_update_targets": full_update_targets(c),
        "next_update_id": c.next_update_id,
        "current_update": cur,
        "last_version": c.last_version,
        "last_outcome": c.last_outcome,
        "last_duration_s": c.last_duration_s,
        # the last successful update's seconds and how long ago it ended (last_duration_s
        # is the last update's, a failed one's too: 0.00 for one the engine never saw)
        "last_success_duration_s": None if c.last_success is None else c.last_success[1],
        "last_success_s": None if c.last_success is None
        else round(max(0.0, now - c.last_success[0]), 3),
        "last_error": c.last_error,
        "updates_succeeded": c.updates_ok,
        "updates_failed": c.updates_failed,
        "engine_calls": dict(c.engine_calls),
        # issue 36: the idle watch's looks at the engine's adapters (adapters/watch.py)
        "adapter_watch_calls": dict(c.adapter_watch_calls),
        # issue 36: the engine's LoRA adapters (core/adapters/ledger.py), the round in flight
        "adapters": c.adapters.status(),
        "adapter_round": adapter_round(c.adapter_round),
        "adapter_last_error": c.adapter_last_error,
        "adapter_rounds_succeeded": c.adapter_rounds_ok,
        "adapter_rounds_failed": c.adapter_rounds_failed,
    }


def adapter_round(a: Any) -> dict[str, Any] | None:
    """The adapter round in flight (``adapters.round.AdapterRound``), None: none."""
    if a is None:
        return None
    return {"update_id": a.update_id, "adapter": a.lora, "phase": a.phase.value,
            "transport": a.transport or None, "ranks_begun": sorted(a.begins),
            "ranks_data": sorted(a.data), "failing": a.failure is not None}


def engine_reach(c: Any, now: float) -> dict[str, Any]:
    """Whether the slot's engine answered its last call (issue 24: a dead engine was shown as
    "paused", the daemon's last view of it): ``engine_unreachable`` the connection error of
    the calls since it last answered (None while it answers), ``engine_unreachable_s`` how
    long that has lasted and ``engine_last_answer_s`` how long ago it last answered (None:
    never); seconds, from ``now`` (monotonic). The other ``engine_*`` keys stay what the
    daemon saw at that last answer."""
    e = c.engine

    def ago(t: float | None) -> float | None:
        return None if t is None else round(max(0.0, now - t), 3)

    return {"engine_unreachable": e.unreachable or None,
            "engine_unreachable_s": ago(e.unreachable_since),
            "engine_last_answer_s": ago(e.last_answer_at)}


def full_update_targets(c: Any) -> list[str]:
    """Which of the slot's engine's models the next round must carry in full: ``"main"``,
    ``"draft"`` (issue 18), both or none."""
    return [name for name, flag in (("main", c.engine.needs_full_update),
                                    ("draft", c.engine.draft.needs_full_update)) if flag]

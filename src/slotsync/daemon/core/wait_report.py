"""What the daemon is waiting for, as the answer to a rank's ``Query`` (issue 24): I/O-free.

A publisher whose own ``timeout_s`` expired asks before it raises, so that its
``SlotsyncTimeout`` names the true cause ("slotsyncd is waiting for the begin of rank(s) 2, 3
of slot [0, 4) (update 5); its begin deadline is 60 s, 41 s left") instead of asking whether
the daemon still runs. The answer reads the coordinator's state and changes nothing.
"""

from __future__ import annotations

from slotsync.daemon.core.coordinator import SlotCoordinator
from slotsync.protocol.wire import Waiting

DEADLINES = {
    "begin": ("begin_s", "begin deadline (begin_timeout_s)"),
    "chunk": ("chunk_s", "chunk deadline (chunk_timeout_s)"),
    "commit": ("commit_s", "commit deadline (commit_timeout_s)"),
    "rank_gone": ("gone_s", "wait for a new process of a gone rank (liveness_s)"),
}
"""Per wait phase (``Update.wait_in_force``): the ``Timeouts`` field and its name in words."""


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def waiting(c: SlotCoordinator | None, update_id: int | None, now: float) -> Waiting:
    """The answer to a ``Query`` about ``update_id`` (None: whatever runs) from a rank of slot
    ``c`` (None: the connection is not registered); ``now``: monotonic seconds."""
    if c is None:
        return Waiting(update_id, "slotsyncd does not know this connection: it has not "
                       "registered, or the daemon restarted since (an update in flight then "
                       "is lost; the publisher registers again at its next begin)")
    slot = f"slot [{c.start}, {c.end})"
    u = c.current
    if u is None and c.adapter_round is not None:
        return adapter_waiting(c, slot, now)
    if u is None:
        last = (f"; its last update failed: {c.last_error}"
                if c.last_outcome == "failed" and c.last_error else "")
        return Waiting(None, f"slotsyncd has no update in flight for {slot} (its next update "
                       f"is {c.next_update_id}){last}")
    which = f"update {u.update_id}"
    if update_id is not None and update_id != u.update_id:
        which += f", not update {update_id}"
    calls = c.calls_in_flight()
    if calls:
        routes = ", ".join(f"/{r}" for r in sorted({call.route for call in calls}))
        return Waiting(u.update_id, f"slotsyncd is waiting for engine {c.engine_url} to "
                       f"answer {routes} ({which} of {slot}); each engine call is bounded by "
                       "the daemon's engine_timeout_s", phase="engine")
    d = c.wait_in_force()
    if d is None:  # (an engine check, a late call of a failed update, or the finish)
        return Waiting(u.update_id, f"slotsyncd is waiting for engine {c.engine_url} "
                       f"({which} of {slot}): its earlier calls or its finish",
                       phase="engine")
    deadline, phase, what, missing = d
    field, name = DEADLINES[phase]
    limit = float(getattr(c.timeouts, field))
    left = max(0.0, deadline - now)
    if phase == "rank_gone":
        gone = "; ".join(f"{c.ranks[r].who}: {c.ranks[r].gone_why}" for r in missing
                         if r in c.ranks)
        text = (f"slotsyncd is waiting for a new process of gone rank(s) {_ranks(missing)} "
                f"of {slot} ({which}; {gone})")
    else:
        unregistered = [r for r in missing if r not in c.ranks]
        not_yet = (f"; rank(s) {_ranks(unregistered)} have not registered"
                   if unregistered else "")
        text = (f"slotsyncd is waiting for the {what} of rank(s) {_ranks(missing)} of {slot} "
                f"({which}){not_yet}")
    return Waiting(u.update_id, f"{text}; its {name} is {limit:g} s, {left:.0f} s left",
                   phase, list(missing), limit, round(left, 3))


def adapter_waiting(c: SlotCoordinator, slot: str, now: float) -> Waiting:
    """What an adapter round in flight (issue 36) waits for: its ranks' begins or data
    (with the deadline), or the engine (its calls, the folder)."""
    a = c.adapter_round
    which = f"adapter round {a.update_id} ({a.lora}) of {slot}"
    d = c.wait_in_force()
    if d is None:
        return Waiting(a.update_id, f"slotsyncd is waiting for engine {c.engine_url} "
                       f"({which}): its calls, or the adapter's folder; each is bounded by "
                       "engine_timeout_s or adapter_load_timeout_s", phase="engine")
    deadline, phase, what, missing = d
    limit = c.timeouts.begin_s if phase == "adapter_begin" else c.timeouts.chunk_s
    left = max(0.0, deadline - now)
    return Waiting(a.update_id, f"slotsyncd is waiting for the {what} of rank(s) "
                   f"{_ranks(missing)} ({which}); {limit:g} s, {left:.0f} s left", phase,
                   list(missing), limit, round(left, 3))

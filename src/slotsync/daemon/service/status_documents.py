"""The JSON documents the daemon serves and announces: ``/status`` (the daemon's, with each
slot's entry: ``core/slot_status.py``) and the one-line ``STATUS=`` systemd shows. Pure
functions of the core's state; the keys are the operator's interface (docs/operations.md) and
stay as they are.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from slotsync.daemon.core.coordinator import SlotState
from slotsync.daemon.core.slot_status import engine_reach, slot_status

if TYPE_CHECKING:
    from slotsync.daemon.core.slot_table import SlotTable


def daemon_status(table: SlotTable, version: str, endpoint: str, started_at: float,
                  now: float) -> dict[str, Any]:
    """The ``/status`` document: daemon facts and every slot's state. ``started_at``: wall-clock
    seconds since the epoch; ``now``: monotonic seconds."""
    slots = [slot_status(c, now) for _, c in sorted(table.slots.items())]
    wall = time.time()
    for s in slots:  # (issue 36: the core keeps monotonic times; the operator reads unix)
        for a in s["adapters"]:
            if a["loaded_at"] is not None:
                a["loaded_at"] = round(wall - (now - a["loaded_at"]), 3)
    return {
        "version": version,
        "endpoint": endpoint,
        "uptime_s": round(time.time() - started_at, 3),
        "ranks_connected": table.connected_ranks(),
        "slots": slots,
        # engines of released slots that a later job must update fully (by engine URL)
        "released_engines": [
            {"engine_url": url, "slot": list(c.slot), **engine_reach(c, now),
             "engine_paused": c.engine.paused,
             "needs_full_update": c.engine.needs_full_update,
             "draft_needs_full_update": c.engine.draft.needs_full_update,
             "last_error": c.last_error}
            for url, c in sorted(table.released.items())],
    }


def status_line(table: SlotTable, last_update: str) -> str:
    """One line for systemd's ``STATUS=``: slots, ranks, updates and the last update."""
    slots = table.slots.values()
    failed = sum(c.state is SlotState.FAILED for c in slots)
    line = (f"{len(table.slots)} slots, {table.connected_ranks()} ranks, "
            f"{table.updates_in_flight()} updating, {failed} failed")
    return line + (f"; last: {last_update}" if last_update else "")

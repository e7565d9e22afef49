"""The idle watch's timer (issue 36): a thin adapter around the core's tick.

Every ``adapter_watch_s`` seconds (``Config.adapter_watch_s``; 0: off, no task) it hands the
slot table a tick (``SlotTable.adapter_watch``: each slot's engine whose ledger holds
adapters, or whose list was never read, is looked at when idle; ``core/adapters/watch.py``
says what a look is and what its answers do) and runs the calls it returns through the
executor; their answers come back through the executor's result path
(``SlotTable.on_engine_result``), as every engine call's. The first tick runs at once, so a
restarted daemon learns what its engines hold at its start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from slotsync.daemon.core.actions import Action


class AdapterWatchTimer:
    """Ticks the core's adapter watch.

    Args:
        interval_s: seconds between ticks (> 0).
        tick: the core's tick (``SlotTable.adapter_watch``), given monotonic seconds.
        execute: runs the actions a tick returns (``ActionExecutor.execute``).
        now: the monotonic clock.
    """

    def __init__(self, interval_s: float, tick: Callable[[float], list[Action]],
                 execute: Callable[[list[Action]], Awaitable[None]],
                 now: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._tick, self._execute, self._now = tick, execute, now

    async def run(self) -> None:
        """Tick now, then every ``interval_s`` seconds, until cancelled."""
        while True:
            actions = self._tick(self._now())
            if actions:
                await self._execute(actions)
            await asyncio.sleep(self.interval_s)

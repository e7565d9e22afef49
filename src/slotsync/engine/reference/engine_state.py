"""The reference engine's engine-level state (vLLM's API-server, engine-core and executor
side), I/O-free: pause flag, weight version, sleeping tags, counters, faults.

Rules, from vLLM 0.32 (``EngineCore.sleep / wake_up / is_sleeping``, ``Executor.sleep /
wake_up``, ``v1/executor/abstract.py``):

* ``/sleep?level=L`` pauses the scheduler; from level 1 the workers sleep (unless the
  weights already do) and every tag of ``SLEEP_TAGS`` sleeps;
* ``/wake_up?tags=`` drops ``scheduling`` from the tags (it only resumes); the workers wake
  when no tags (everything) or only sleeping tags are named, and something sleeps; the
  scheduler resumes once nothing sleeps;
* ``/is_sleeping`` is "paused or any tag asleep" (a plain ``/pause`` makes it true).

The HTTP front (``slotsync.engine.reference.server``) asks these methods what to do and does it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slotsync.engine.faults import Fault, FaultTable

SLEEP_TAGS = frozenset(("weights", "kv_cache"))
"""vLLM 0.32 ``v1/executor/abstract.py SLEEP_TAGS``."""


@dataclass
class EngineState:
    """Engine-level state (vLLM's API-server, engine-core and executor side): pause flag,
    weight version, sleeping tags, counters, faults."""

    paused: bool = False
    weight_version: str = "default"
    packed: bool = False
    init_count: int = 0
    pause_count: int = 0
    resume_count: int = 0
    shutdown_count: int = 0
    sleeping_tags: set[str] = field(default_factory=set)
    fault_table: FaultTable = field(default_factory=FaultTable)
    baseline: dict[str, str] | None = None

    @property
    def faults(self) -> list[Fault]:
        """The injected faults."""
        return self.fault_table.faults

    @property
    def route_counts(self) -> dict[str, int]:
        """Calls per route name."""
        return self.fault_table.route_counts

    def match_fault(self, route: str) -> Fault | None:
        """Count one call of ``route``; return the fault that fires on it, if any."""
        return self.fault_table.match(route)

    @property
    def sleeping(self) -> bool:
        """``EngineCore.is_sleeping``: paused or any tag asleep."""
        return self.paused or bool(self.sleeping_tags)

    def pause(self) -> dict[str, str]:
        """``/pause``: the scheduler pauses; returns vLLM's answer ``{"status": "paused"}``."""
        self.paused = True
        self.pause_count += 1
        return {"status": "paused"}

    def resume(self) -> dict[str, str]:
        """``/resume``: the scheduler resumes; returns vLLM's answer ``{"status": "resumed"}``."""
        self.paused = False
        self.resume_count += 1
        return {"status": "resumed"}

    def workers_sleep(self, level: int) -> bool:
        """``/sleep?level=``: pause the scheduler; whether the workers must sleep now (from
        level 1, unless the weights already sleep). Call :meth:`slept` once they did."""
        self.paused = True
        return level >= 1 and "weights" not in self.sleeping_tags

    def slept(self) -> None:
        """The workers slept: every tag of ``SLEEP_TAGS`` sleeps."""
        self.sleeping_tags |= SLEEP_TAGS

    def tags_to_wake(self, tags: list[str] | None) -> tuple[bool, list[str] | None]:
        """``/wake_up?tags=``: (whether the workers wake, the tags they wake: None for all).
        ``scheduling`` is not a worker tag; an unknown tag wakes nothing."""
        t = tags
        if t is not None and "scheduling" in t:
            t = [x for x in t if x != "scheduling"]
        st = self.sleeping_tags
        return (t is None or bool(t)) and bool(st) and all(x in st for x in (t or ())), t

    def woke(self, tags: list[str] | None) -> None:
        """The workers woke ``tags`` (None: all)."""
        self.sleeping_tags = self.sleeping_tags - set(tags) if tags else set()

    def settle_awake(self) -> bool:
        """After a wake: the scheduler resumes once nothing sleeps; returns whether awake."""
        awake = not self.sleeping_tags
        if awake:
            self.paused = False
        return awake

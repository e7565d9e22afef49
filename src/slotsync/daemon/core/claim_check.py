"""A slot claim checked against its engine before the slot is locked to it (pure, no I/O;
issue 24).

Without an engine table the daemon learns the slots from the ranks' claims (``Register``'s
``slot_start`` / ``slot_size``). Ranks that claim a wrong slot first -- a dense default
(``gpus_per_engine``) over a non-dense layout -- would register, hold the slot and lock out
the ranks that claim the real one (overlapping slots, or one engine fed by two slots), until
their begin found the engine's world size unlike the slot's. So the first registrations of an
undeclared slot are held (no reply yet) while the daemon asks the engine's
``/get_world_size`` (the same route the begin's probe asks). An engine with fewer workers
than the slot has ranks is refused to every held rank, naming both numbers and the URL, and
the slot is not kept (``SlotTable`` drops a slot left without ranks), so the right claim can
register at once. Any other answer, or none (the engine unreachable: the begin will say so),
lets the held registrations through, each checked as any other (``SlotCoordinator``). An
engine with more workers than the slot is refused by the begin, before the pause, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slotsync.protocol.wire import Register


@dataclass
class ClaimCheck:
    """The claim check of one undeclared slot: the registrations held, and the engine URL
    whose worker count was checked (None: none yet)."""

    held: list[tuple[bytes, Register, int]] = field(default_factory=list)
    checked_url: str | None = None
    url_before: str | None = None  # the slot's engine URL before the check set it

    def needed(self, msg: Register, registered: bool) -> bool:
        """Whether registration ``msg`` waits for the check: the slot has no registered rank
        (``registered`` False) and its engine's worker count was not checked."""
        return not registered and msg.engine_url != self.checked_url

    def hold(self, identity: bytes, msg: Register, peer_pid: int) -> bool:
        """Hold ``msg`` (from ``identity``, kernel pid ``peer_pid``) until the answer; True
        when it is the first held, so the caller asks the engine."""
        self.held.append((identity, msg, peer_pid))
        return len(self.held) == 1

    def answer(self, ok: bool, result: Any, slot: tuple[int, int], url: str
               ) -> tuple[list[tuple[bytes, Register, int]], str]:
        """The engine at ``url`` answered ``/get_world_size`` (``ok`` with JSON ``result``, or
        not ok). Returns the held registrations (cleared here) and why they are refused ('':
        let them through; the URL then counts as checked)."""
        held, self.held = self.held, []
        ws = result.get("world_size") if ok and isinstance(result, dict) else None
        size = slot[1] - slot[0]
        if isinstance(ws, int) and not isinstance(ws, bool) and 0 < ws < size:
            ranks = sorted(m.rank for _, m, _ in held)
            return held, (
                f"engine {url} has {ws} workers (/get_world_size: world size {ws}) but rank(s) "
                f"{ranks} claim slot [{slot[0]}, {slot[1]}) of {size} ranks: a slot is one "
                "engine's GPUs, one rank per worker (check the engines' layout: "
                "gpus_per_engine, or give the daemon an engine table); the slot is not kept, "
                "so the ranks of the right slot can register")
        self.checked_url = url
        return held, ""

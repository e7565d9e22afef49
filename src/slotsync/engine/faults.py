"""Test-only fault injection shared by both engine implementations (``POST /_slotsync/fault``).

A fault names a route (the URL path without ``/``, e.g. ``update_weights``); the route's
next ``after`` calls pass and the ``times`` calls after that fail. ``workers: null`` fails the
call before any worker sees it (the reference engine answers with ``status`` at the HTTP
layer; the vLLM-code engine raises what vLLM's ``AsyncLLM`` would raise); a list of worker
indices makes those workers raise ``RuntimeError(message)`` inside the call. ``hang_s`` delays
the faulted answer by that many seconds; with ``workers: null`` and a ``status`` below 400 the
call then proceeds normally (a pure delay). ``exit: true`` makes the engine process die
where the fault fires (after ``hang_s``), without answering: the routes that take it say
where (issue 36: an adapter load dying mid-load). ``{"clear": true}`` removes every fault.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FAULT_FIELDS = frozenset({"route", "after", "status", "workers", "hang_s", "times", "message",
                          "exit"})


@dataclass
class Fault:
    """One injected fault (see the module docstring).

    Attributes:
        route: route name without ``/``.
        after: calls of the route that pass before the fault fires.
        status: HTTP status of a ``workers: null`` fault (below 400: a pure delay).
        workers: worker indices that raise inside the call, or None (before any worker).
        hang_s: seconds to wait before the faulted answer, or None.
        times: how many calls fail.
        message: the error text (default ``injected fault on <route> (call <k>)``).
        exit: the engine process dies where the fault fires (the routes that take it).
        seen, fired: calls of the route counted so far / calls that failed.
    """

    route: str
    after: int = 0
    status: int = 500
    workers: list[int] | None = None
    hang_s: float | None = None
    times: int = 1
    message: str | None = None
    exit: bool = False
    seen: int = 0
    fired: int = 0

    def text(self) -> str:
        """The error message this fault raises."""
        return self.message or f"injected fault on {self.route} (call {self.seen})"


@dataclass
class FaultTable:
    """The faults of one engine and how often each route was called."""

    faults: list[Fault] = field(default_factory=list)
    route_counts: dict[str, int] = field(default_factory=dict)

    def match(self, route: str) -> Fault | None:
        """Count one call of ``route``; return the fault that fires on it, if any."""
        self.route_counts[route] = self.route_counts.get(route, 0) + 1
        for f in self.faults:
            if f.route != route or f.fired >= f.times:
                continue
            f.seen += 1
            if f.seen > f.after:
                f.fired += 1
                return f
        return None

    def as_json(self) -> list[dict[str, Any]]:
        """Every fault as a dict (the ``faults`` of ``/_slotsync/stats``)."""
        return [asdict(f) for f in self.faults]

    def apply(self, body: Any, world_size: int) -> list[dict[str, Any]]:
        """Apply one ``POST /_slotsync/fault`` body: add a fault or clear them all.

        Returns:
            The faults now held (``{"faults": ...}`` of the answer).

        Raises:
            ValueError: not an object, no ``route``, unknown fields, bad values, or worker
                indices outside ``[0, world_size)`` (the route answers 400 with the text).
        """
        if not isinstance(body, dict):
            raise ValueError("Request body must be a JSON object")
        if body.get("clear"):
            self.faults.clear()
            return []
        if not isinstance(body.get("route"), str):
            raise ValueError("Missing 'route' in request body")
        unknown = sorted(set(body) - FAULT_FIELDS)
        if unknown:
            raise ValueError(f"unknown fault fields {unknown}")
        try:
            f = Fault(
                route=body["route"].lstrip("/"),
                after=int(body.get("after", 0)),
                status=int(body.get("status", 500)),
                workers=None if body.get("workers") is None else [int(i) for i in body["workers"]],
                hang_s=None if body.get("hang_s") is None else float(body["hang_s"]),
                times=int(body.get("times", 1)),
                message=body.get("message"),
                exit=bool(body.get("exit", False)),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad fault: {e}") from None
        if f.workers is not None and any(not 0 <= i < world_size for i in f.workers):
            raise ValueError(f"workers must be in [0, {world_size})")
        self.faults.append(f)
        return self.as_json()

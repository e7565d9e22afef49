"""Test-only fault injection of the SGLang engines (``POST /_slotsync/fault``): the shared
fault table (``slotsync.engine.faults``) with the SGLang engines' ``exit``, and what a fault
does to the call of the route it names.

The body is the reference engine's (``route``, ``after``, ``times``, ``status``, ``workers``,
``hang_s``, ``message``; ``{"clear": true}``) plus ``"exit": true``. ``route`` is a route
name (``update_weights_from_tensor``, ``pause_generation``, ...). ``hang_s`` delays the call
(after validation); ``exit`` kills the engine on that call as a scheduler exception would;
``workers: [i, ...]`` makes those ranks raise inside the call (an exception on a rank: the
engine dies after the other ranks ran it; on a route that calls no rank, at once);
``workers: null`` with ``status >= 400`` answers instead of the call: ``{"success": false,
"message"}`` with that status on the routes that answer so (the weight routes;
``update_weight_version`` prefixes ``Failed to update weight version:``), ``{"success":
false, "error_message", "loaded_adapters": null}`` on the LoRA routes, plain text on
``flush_cache``, a bare 500 ``Internal Server Error`` elsewhere (or for status 500
anywhere: an exception escaping the route).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from slotsync.engine.faults import Fault, FaultTable
from slotsync.engine.sglang.http import internal_error, success_body
from slotsync.engine.sglang.scheduler import Scheduler

SUCCESS_ROUTES = frozenset({"update_weights_from_tensor", "begin_weight_update",
                            "end_weight_update", "update_weight_version"})
"""Routes whose answer is ``{"success", "message"}`` (a fault with a status answers so)."""
LORA_ROUTES = frozenset({"load_lora_adapter_from_tensors", "unload_lora_adapter"})
"""Routes whose answer is ``msgspec_to_builtins(LoRAUpdateOutput)``: ``{"rid": null,
"http_worker_ipc": null, "success": false, "error_message", "loaded_adapters": null}`` for a
fault with a status (issue 36)."""
RANK_ROUTES = frozenset({"update_weights_from_tensor", "begin_weight_update",
                         "end_weight_update", *LORA_ROUTES, "weights_checker"})
"""Routes that call the TP ranks (a ``workers`` fault raises inside them there; elsewhere it
is an exception on a rank all the same: the engine dies)."""


@dataclass
class SglangFault(Fault):
    """A fault of ``/_slotsync/fault`` with the SGLang engines' ``exit`` (die on the call)."""

    exit: bool = False


class SglangFaultTable(FaultTable):
    """``FaultTable`` accepting ``"exit": true`` (see the module docstring)."""

    def apply(self, body: Any, world_size: int) -> list[dict[str, Any]]:
        exit_ = False
        if isinstance(body, dict) and "exit" in body:
            body = dict(body)
            exit_ = bool(body.pop("exit"))
        faults = super().apply(body, world_size)
        if isinstance(body, dict) and not body.get("clear") and self.faults:
            self.faults[-1] = SglangFault(**{**asdict(self.faults[-1]), "exit": exit_})
            faults = self.as_json()
        return faults


async def injected(table: FaultTable, scheduler: Scheduler, request: web.Request,
                   route: str) -> tuple[web.Response | None, dict[int, str] | None]:
    """``route``'s injected fault from ``table`` (module docstring): (answer instead of the
    call, rank injections), each None when the fault asks for none; an ``exit`` fault, or a
    ``workers`` fault on a route that calls no rank, kills the engine (``scheduler.die``)."""
    f = table.match(route)
    if f is None:
        return None, None
    if f.hang_s:
        await asyncio.sleep(f.hang_s)
    msg = f.text()
    if getattr(f, "exit", False):
        await scheduler.die(request, f"RuntimeError: {msg}")
    if f.workers is not None:
        if route not in RANK_ROUTES:
            await scheduler.die(request, f"TP rank {f.workers[0]}: RuntimeError: {msg}")
        return None, {i: msg for i in f.workers}
    if f.status < 400:
        return None, None
    if f.status == 500:
        return internal_error(), None
    if route == "update_weight_version":  # the route catches it (L1549-1556)
        return success_body(False, f"Failed to update weight version: {msg}",
                            status=f.status), None
    if route in SUCCESS_ROUTES:
        return success_body(False, msg, status=f.status), None
    if route in LORA_ROUTES:
        return web.json_response({"rid": None, "http_worker_ipc": None, "success": False,
                                  "error_message": msg, "loaded_adapters": None},
                                 status=f.status), None
    if route == "flush_cache":
        return web.Response(status=f.status, text=msg), None
    return internal_error(), None

"""HTTP front of the reference engine: vLLM 0.33's weight-transfer routes over N workers.

Routes, bodies, status codes and error shapes follow ``shared/vllm-contract.md`` (vLLM 0.33
``vllm/entrypoints/rl/online/api_router.py``). Each weight route fans out to every worker
(vLLM's ``collective_rpc``): every worker runs the call even when another one fails, and keeps
its own "update active" flag, so a failed chunk can leave the engine split exactly as vLLM's
would. Worker errors come back as HTTP 500::

    {"error": {"message": "Call to collective_rpc method failed: <msg>",
               "type": "InternalServerError", "param": null, "code": 500}}

with ``<msg>`` wrapped as ``Worker failed with error '<msg>', please check the stack trace
above for the root cause`` when the engine has more than one worker (the first failing worker
in rank order is reported). Pause/resume errors use ``{"error": "<str>"}``; a missing body key
is 400 ``{"detail": "Missing '<key>' in request body"}`` (FastAPI ``HTTPException``).

The engine always accepts ``ipc_handles_pickled``: it stands in for a vLLM server launched with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend":"ipc"}'``.

Test-only control routes (not part of vLLM), under ``/_slotsync/``:

``GET /_slotsync/stats``
    ``{"world_size": N, "paused": bool, "weight_version": str, "packed": bool,
    "init_count": int, "pause_count": int, "resume_count": int, "shutdown_count": int,
    "route_counts": {route: int}, "faults": [fault, ...],
    "workers": [{"index", "gpu_uuid", "device", "active", "servable", "packed", "init_count",
    "start_count", "finish_count", "update_count", "bytes_loaded", "load_seconds",
    "sync_seconds", "packed_maps", "num_weights"}, ...]}`` (``load_seconds``: seconds inside
    ``update_weights``; ``sync_seconds``: of those, waiting for the device's copies;
    ``packed_maps``: packed buffers mapped anew rather than found mapped).

``POST /_slotsync/fault``
    ``{"route": "<route name without '/'>", "after": k, "status": 500, "workers": [i, ...] |
    null, "hang_s": float | null, "times": 1, "message": str | null}`` adds a fault: the
    route's next ``k`` calls pass, the ``times`` calls after that fail. ``workers: null``
    fails at the HTTP layer with ``status`` before any fan-out (no worker sees the call);
    a list makes those workers raise inside the call (the engine ends split). ``hang_s``
    sleeps that many seconds before the faulted answer; with ``workers: null`` and a
    ``status`` below 400 the call then proceeds normally (a pure delay). ``{"clear": true}``
    removes every fault. Answers ``{"faults": [...]}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from slotsync.engine.pool import CollectiveRpcError, WorkerPool

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class Fault:
    """One injected fault (see the module docstring, ``POST /_slotsync/fault``)."""

    route: str
    after: int = 0
    status: int = 500
    workers: list[int] | None = None
    hang_s: float | None = None
    times: int = 1
    message: str | None = None
    seen: int = 0
    fired: int = 0


@dataclass
class EngineState:
    """Engine-level state (vLLM's API-server side): pause flag, weight version, counters."""

    paused: bool = False
    weight_version: str = "default"
    packed: bool = False
    init_count: int = 0
    pause_count: int = 0
    resume_count: int = 0
    shutdown_count: int = 0
    route_counts: dict[str, int] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    baseline: dict[str, str] | None = None

    def match_fault(self, route: str) -> Fault | None:
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


def _err500(message: str, status: int = 500) -> web.Response:
    return web.json_response(
        {
            "error": {
                "message": message,
                "type": "InternalServerError",
                "param": None,
                "code": status,
            }
        },
        status=status,
    )


def _detail(status: int, detail: Any) -> web.Response:
    return web.json_response({"detail": detail}, status=status)


class _UpdateBody(msgspec.Struct):
    """``/update_weights`` body: ``update_info`` kept as JSON text (other keys ignored)."""

    update_info: msgspec.Raw = msgspec.Raw(b"null")


_UPDATE_BODY = msgspec.json.Decoder(_UpdateBody)


async def _read_json(request: web.Request) -> dict[str, Any] | web.Response:
    """The body as a dict (``{}`` when empty), or a 400 response like vLLM's."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _detail(400, "Invalid JSON format")
    if not isinstance(body, dict):
        return _detail(400, "Request body must be a JSON object")
    return body


class EngineApp:
    """The aiohttp application over one :class:`WorkerPool`."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.state = EngineState()
        # vLLM's server (uvicorn) sets no body limit; aiohttp's default of 1 MiB would refuse
        # an unpacked chunk of a few thousand tensors on 8 GPUs.
        self.app = web.Application(
            middlewares=[self._log_middleware], client_max_size=1 << 30
        )
        self.app["engine"] = self
        r = self.app.router
        r.add_post("/init_weight_transfer_engine", self.init_weight_transfer_engine)
        r.add_post("/start_weight_update", self.start_weight_update)
        r.add_post("/update_weights", self.update_weights)
        r.add_post("/finish_weight_update", self.finish_weight_update)
        r.add_post("/shutdown_weight_transfer_engine", self.shutdown_weight_transfer_engine)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_get("/get_world_size", self.get_world_size)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/weight_checker", self.weight_checker)
        r.add_get("/_slotsync/stats", self.stats)
        r.add_post("/_slotsync/fault", self.fault)
        self.app.on_cleanup.append(self._cleanup)

    async def _cleanup(self, _app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.pool.close)

    @web.middleware
    async def _log_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            print(
                f"[slotsync.engine] {request.method} {request.path_qs} -> {status} ({ms:.1f} ms)",
                file=sys.stderr,
                flush=True,
            )

    # -- fault helpers ---------------------------------------------------------------------

    async def _apply_fault(
        self, route: str, error_shape: str = "collective"
    ) -> tuple[web.Response | None, dict[int, str] | None]:
        """Returns (response to send instead, worker injections) for this call of ``route``."""
        f = self.state.match_fault(route)
        if f is None:
            return None, None
        if f.hang_s:
            await asyncio.sleep(f.hang_s)
        msg = f.message or f"injected fault on {route} (call {f.seen})"
        if f.workers is None:
            if f.status < 400:
                return None, None
            if error_shape == "plain":
                return web.json_response({"error": msg}, status=f.status), None
            return _err500(f"Call to collective_rpc method failed: {msg}", f.status), None
        return None, {i: msg for i in f.workers}

    async def _fanout(
        self,
        route: str,
        method: str,
        kwargs: dict[str, Any] | None = None,
        per_worker: list[dict[str, Any]] | None = None,
    ) -> list[Any] | web.Response:
        early, inject = await self._apply_fault(route)
        if early is not None:
            return early
        try:
            return await self.pool.collective_rpc(method, kwargs, per_worker, inject)
        except CollectiveRpcError as e:
            return _err500(e.api_message())

    # -- vLLM routes -----------------------------------------------------------------------

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        """``POST /init_weight_transfer_engine`` ``{"init_info": {"packed": bool}}``."""
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        init_info = body.get("init_info")
        if init_info is None:
            return _detail(400, "Missing 'init_info' in request body")
        res = await self._fanout(
            "init_weight_transfer_engine", "init_weight_transfer_engine", {"init_info": init_info}
        )
        if isinstance(res, web.Response):
            return res
        self.state.packed = bool(init_info.get("packed", False))
        self.state.init_count += 1
        return web.json_response({"message": "Weight transfer initialized"})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        """``POST /start_weight_update`` (body ignored)."""
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        res = await self._fanout("start_weight_update", "start_weight_update")
        if isinstance(res, web.Response):
            return res
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        """``POST /update_weights`` ``{"update_info": {...}}`` or a list of N of them (one per
        worker rank).

        One ``update_info`` for every worker travels to them as its JSON text, checked here
        for syntax only: each worker decodes it itself, in parallel, instead of this process
        decoding it and pickling it again for the workers (an update_info of a few hundred
        tensors took ~0.2 ms of the front's time that way)."""
        raw = await request.read()
        try:
            top = _UPDATE_BODY.decode(raw) if raw.strip() else _UpdateBody()
        except msgspec.ValidationError:
            return _detail(400, "Request body must be a JSON object")
        except msgspec.DecodeError:
            return _detail(400, "Invalid JSON format")
        text = bytes(top.update_info)
        if text == b"null":
            return _detail(400, "Missing 'update_info' in request body")
        if not text.startswith(b"["):
            res = await self._fanout("update_weights", "update_weights",
                                     {"update_info_json": text})
            if isinstance(res, web.Response):
                return res
            return web.json_response({"message": "Weights updated"})
        update_info = json.loads(text)
        per_worker = None
        if isinstance(update_info, list):
            if len(update_info) != self.pool.world_size:
                self.state.match_fault("update_weights")
                return _err500(
                    "Call to collective_rpc method failed: update_info list has "
                    f"{len(update_info)} entries, world size is {self.pool.world_size}"
                )
            per_worker = [{"update_info": u} for u in update_info]
        res = await self._fanout(
            "update_weights", "update_weights", {"update_info": update_info}, per_worker
        )
        if isinstance(res, web.Response):
            return res
        return web.json_response({"message": "Weights updated"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        """``POST /finish_weight_update`` with optional ``{"weight_version": str}``; the
        version is recorded only when every worker finished."""
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        res = await self._fanout("finish_weight_update", "finish_weight_update")
        if isinstance(res, web.Response):
            return res
        version = body.get("weight_version")
        if version is not None:
            self.state.weight_version = str(version)
        return web.json_response({"message": "Weight update finished"})

    async def shutdown_weight_transfer_engine(self, request: web.Request) -> web.Response:
        """``POST /shutdown_weight_transfer_engine``; 500 during an active update."""
        res = await self._fanout(
            "shutdown_weight_transfer_engine", "shutdown_weight_transfer_engine"
        )
        if isinstance(res, web.Response):
            return res
        self.state.shutdown_count += 1
        return web.json_response({"message": "Weight transfer engine shut down"})

    async def pause(self, request: web.Request) -> web.Response:
        """``POST /pause?mode=abort|wait|keep`` (default ``abort``) -> ``{"status": "paused"}``."""
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _detail(
                422,
                [
                    {
                        "type": "literal_error",
                        "loc": ["query", "mode"],
                        "msg": "Input should be 'abort', 'wait' or 'keep'",
                        "input": mode,
                        "ctx": {"expected": "'abort', 'wait' or 'keep'"},
                    }
                ],
            )
        early, _ = await self._apply_fault("pause", "plain")
        if early is not None:
            return early
        self.state.paused = True
        self.state.pause_count += 1
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        """``POST /resume`` -> ``{"status": "resumed"}``."""
        early, _ = await self._apply_fault("resume", "plain")
        if early is not None:
            return early
        self.state.paused = False
        self.state.resume_count += 1
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        """``GET /is_paused`` -> ``{"is_paused": bool}``."""
        early, _ = await self._apply_fault("is_paused", "plain")
        if early is not None:
            return early
        return web.json_response({"is_paused": self.state.paused})

    async def get_world_size(self, request: web.Request) -> web.Response:
        """``GET /get_world_size`` -> ``{"world_size": N}`` (N workers; one DP rank)."""
        early, _ = await self._apply_fault("get_world_size")
        if early is not None:
            return early
        return web.json_response({"world_size": self.pool.world_size})

    async def weight_info(self, request: web.Request) -> web.Response:
        """``GET /weight_info`` -> ``{"weight_version": str}`` (``"default"`` at first)."""
        early, _ = await self._apply_fault("weight_info")
        if early is not None:
            return early
        return web.json_response({"weight_version": self.state.weight_version})

    async def weight_checker(self, request: web.Request) -> web.Response:
        """``POST /weight_checker``.

        * ``{"action": "checksum"}`` -> ``{"checksums": {gpu_uuid: {name: sha256 hex}}}``
          (``slotsync.engine.checksum.tensor_checksum`` of each worker's weights); also kept
          as the stored baseline.
        * ``{"action": "compare", "baseline": {name: hex}?}`` -> ``{"match": bool,
          "mismatches": [{"gpu_uuid", "name", "expected", "actual"}]}``, every worker against
          the given baseline (or the stored one); ``actual`` is null for a missing name.
        * ``{"action": "reset"}`` -> ``{"status": "reset"}``: forgets the stored baseline.
        """
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        action = body.get("action")
        if action is None:
            return _detail(400, "Missing 'action' in request body")
        if action not in ("checksum", "compare", "reset"):
            return _detail(400, f"Unknown action {action!r}: use checksum, compare or reset")
        if action == "reset":
            self.state.baseline = None
            return web.json_response({"status": "reset"})
        baseline = body.get("baseline") if action == "compare" else None
        if action == "compare" and baseline is None:
            baseline = self.state.baseline
            if baseline is None:
                return _detail(400, "compare needs a 'baseline' (or an earlier checksum)")
        if baseline is not None and not isinstance(baseline, dict):
            return _detail(400, "'baseline' must be an object {name: hex}")
        res = await self._fanout("weight_checker", "checksums")
        if isinstance(res, web.Response):
            return res
        sums = {w.gpu_uuid: r for w, r in zip(self.pool.workers, res, strict=True)}
        if action == "checksum":
            self.state.baseline = dict(res[0]) if res else {}
            return web.json_response({"checksums": sums})
        assert baseline is not None
        mismatches = [
            {"gpu_uuid": u, "name": name, "expected": want, "actual": got.get(name)}
            for u, got in sums.items()
            for name, want in baseline.items()
            if got.get(name) != want
        ]
        return web.json_response({"match": not mismatches, "mismatches": mismatches})

    # -- test-only control routes ----------------------------------------------------------

    async def stats(self, request: web.Request) -> web.Response:
        """``GET /_slotsync/stats`` (shape in the module docstring)."""
        try:
            workers = await self.pool.collective_rpc("stats")
        except CollectiveRpcError as e:
            return _err500(e.api_message())
        s = self.state
        return web.json_response(
            {
                "world_size": self.pool.world_size,
                "paused": s.paused,
                "weight_version": s.weight_version,
                "packed": s.packed,
                "init_count": s.init_count,
                "pause_count": s.pause_count,
                "resume_count": s.resume_count,
                "shutdown_count": s.shutdown_count,
                "route_counts": s.route_counts,
                "faults": [asdict(f) for f in s.faults],
                "workers": workers,
            }
        )

    async def fault(self, request: web.Request) -> web.Response:
        """``POST /_slotsync/fault``: add one fault, or ``{"clear": true}``."""
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        if body.get("clear"):
            self.state.faults.clear()
            return web.json_response({"faults": []})
        if not isinstance(body.get("route"), str):
            return _detail(400, "Missing 'route' in request body")
        allowed = {"route", "after", "status", "workers", "hang_s", "times", "message"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            return _detail(400, f"unknown fault fields {unknown}")
        try:
            f = Fault(
                route=body["route"].lstrip("/"),
                after=int(body.get("after", 0)),
                status=int(body.get("status", 500)),
                workers=None if body.get("workers") is None else [int(i) for i in body["workers"]],
                hang_s=None if body.get("hang_s") is None else float(body["hang_s"]),
                times=int(body.get("times", 1)),
                message=body.get("message"),
            )
        except (TypeError, ValueError) as e:
            return _detail(400, f"bad fault: {e}")
        if f.workers is not None and any(not 0 <= i < self.pool.world_size for i in f.workers):
            return _detail(400, f"workers must be in [0, {self.pool.world_size})")
        self.state.faults.append(f)
        return web.json_response({"faults": [asdict(x) for x in self.state.faults]})

"""HTTP front of the reference engine: vLLM's weight-transfer routes over N workers.

Routes, bodies, status codes and error shapes follow vLLM 0.32's own router and exception
handlers (``vllm/entrypoints/rl/online/api_router.py``,
``vllm/entrypoints/serve/dev/sleep/api_router.py``,
``vllm/entrypoints/serve/exception_handling/``), checked against them by
``test_vllm_engine.py`` (``--impl vllm`` runs that code). Each weight route fans out to
every worker (vLLM's ``collective_rpc``): every worker runs the call even when another one
fails, and keeps its own "update active" flag, so a failed chunk can leave the engine split
exactly as vLLM's would. Worker errors come back as HTTP 500::

    {"error": {"message": "Call to collective_rpc method failed: <msg>",
               "type": "InternalServerError", "param": null, "code": 500}}

with ``<msg>`` wrapped as ``Worker failed with error '<msg>', please check the stack trace
above for the root cause`` when the engine (with ``--data-parallel-size D``: each DP replica,
its own engine core and executor in vLLM) has more than one worker (the first failing worker
in rank order is reported; unlike vLLM's ``MultiprocExecutor``, every worker's reply of each
call is read, see ``slotsync.engine.vllm.server``). ``/weight_checker``'s worker errors say
``Call to compute_weight_checksums method failed``.

Connections: after a 500 of a route whose error vLLM raises through Starlette's
``ServerErrorMiddleware`` (the weight routes, ``/weight_checker``, ``/weight_info``,
``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/get_world_size``) the connection is closed
after the response, as uvicorn does there; the pause / resume / is_paused routes catch their
errors (``{"error": "Failed to pause generation: ..."}``) and 400s go through vLLM's handlers,
so those keep the connection. A 400 has vLLM's shape ``{"error": {"message": ..., "type":
"Bad Request", "param": "body.<key>" | "query.<key>" | null, "code": 400}}``.

Sleep (vLLM 0.32 ``EngineCore.sleep / wake_up / is_sleeping``): ``/sleep?level=0|1|2&mode=``
pauses the scheduler, from level 1 the weights sleep (level 2 discards them: every byte 0xFF
after the wake); ``/wake_up?tags=weights|kv_cache|scheduling`` resumes the scheduler only
once nothing sleeps; ``/is_sleeping`` is "paused or sleeping" (a plain ``/pause`` makes it
true).

``POST /collective_rpc`` (vLLM's dev-mode RPC router) runs ``check_health`` on every worker
(``{"results": [null, ...]}``); any other method fails as on vLLM's ``Worker``.

The engine always accepts ``ipc_handles_pickled``: it stands in for a vLLM server launched with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend":"ipc"}'``. ``GET /get_world_size`` also answers
``"gpu_uuids"``: each worker's GPU UUID in global order (a test-engine extension; vLLM does not
report them; the daemon only cross-checks its engine table with it).

Data parallelism (``--data-parallel-size D``, as one ``vllm serve --data-parallel-size D``):
the ``--workers`` are D replicas of TP; worker ``i`` is TP rank ``i % TP`` of replica ``i //
TP``. Every route still fans out to every worker (vLLM's ``DPLBAsyncMPClient`` sends each
utility call to every engine core); ``/get_world_size`` answers D x TP with ``include_dp``
(default), TP without; ``/collective_rpc`` answers replica 0's TP results only (the client
returns engine 0's); a list-form ``update_info`` is indexed by the global index.

LoRA adapters (issue 36, ``--enable-lora``; ``slotsync.engine.reference.lora``): vLLM's
``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` and ``/v1/models``, its dev-mode
``/server_info`` with ``lora_config`` only, and the test-only ``/_slotsync/lora`` and
``/_slotsync/lora/use``.

Test-only control routes (not part of vLLM), under ``/_slotsync/``:

``GET /_slotsync/stats``
    ``{"impl": "reference", "world_size": N, "paused": bool, "weight_version": str,
    "packed": bool, "init_count": int, "pause_count": int, "resume_count": int,
    "shutdown_count": int, "sleeping": bool, "sleeping_tags": [str], "route_counts": {route:
    int}, "faults": [fault, ...], "workers": [{"index", "gpu_uuid", "device", "active",
    "servable", "packed", "init_count", "start_count", "finish_count", "update_count",
    "bytes_loaded", "load_seconds", "sync_seconds", "packed_maps", "num_weights",
    "sleep_level", "receive", "has_draft"}, ...]}``; with ``--draft-model`` each worker adds
    ``"draft_session", "draft_start_count", "draft_num_weights", "draft_checksums": {name:
    sha256 hex} | "<why not servable>"`` (issue 18) (``load_seconds``: seconds inside
    ``update_weights``; ``sync_seconds``: of those, waiting for the device's copies;
    ``packed_maps``: packed buffers mapped anew rather than found mapped).

``POST /_slotsync/fault``
    ``{"route": "<route name without '/'>", "after": k, "status": 500, "workers": [i, ...] |
    null, "hang_s": float | null, "times": 1, "message": str | null}`` adds a fault
    (``slotsync.engine.faults``): the route's next ``k`` calls pass, the ``times`` calls after
    that fail. ``workers: null`` fails at the HTTP layer with ``status`` before any fan-out (no
    worker sees the call), with the text vLLM's ``AsyncLLM`` would raise; a list makes those
    workers raise inside the call (the engine ends split). ``hang_s`` sleeps that many seconds
    before the faulted answer; with ``workers: null`` and a ``status`` below 400 the call then
    proceeds normally (a pure delay). ``{"clear": true}`` removes every fault. Answers
    ``{"faults": [...]}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from slotsync.engine.http_shapes import (
    CLOSE_AFTER,
    PAUSE_MODES,
    UPDATE_BODY,
    UpdateBody,
    bad_request,
    detail,
    err500,
    include_dp,
    missing,
    pause_mode,
    read_json,
    read_required,
    sleep_level,
    update_info_shape,
)
from slotsync.engine.lora_flags import LoraOptions
from slotsync.engine.pool import CollectiveRpcError
from slotsync.engine.reference.engine_state import SLEEP_TAGS, EngineState
from slotsync.engine.reference.lora import LoraFront
from slotsync.engine.reference.worker import WorkerPool

__all__ = ["PAUSE_MODES", "SLEEP_TAGS", "CollectiveRpcError", "EngineApp", "EngineState",
           "WorkerPool"]


RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
"""A list-form ``update_info``'s entries as their JSON texts (not decoded)."""


EMULATED_VLLM_VERSION = "0.32.0"
"""The vLLM version the reference engine answers ``GET /version`` with by default (the one
whose router and worker it follows; ``python -m slotsync.engine --vllm-version``)."""


class EngineApp:
    """The aiohttp application over one :class:`WorkerPool`; ``vllm_version``: what
    ``GET /version`` says (any text: tests pose as other versions, or as garbage)."""

    def __init__(self, pool: WorkerPool, vllm_version: str = EMULATED_VLLM_VERSION,
                 lora: LoraOptions | None = None, base_model: str = "") -> None:
        self.pool = pool
        self.vllm_version = vllm_version
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
        r.add_post("/start_draft_weight_update", self.start_draft_weight_update)
        r.add_post("/update_weights", self.update_weights)
        r.add_post("/finish_weight_update", self.finish_weight_update)
        r.add_post("/shutdown_weight_transfer_engine", self.shutdown_weight_transfer_engine)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_get("/get_world_size", self.get_world_size)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/weight_checker", self.weight_checker)
        r.add_post("/sleep", self.sleep)
        r.add_post("/wake_up", self.wake_up)
        r.add_get("/is_sleeping", self.is_sleeping)
        r.add_post("/collective_rpc", self.collective_rpc)
        r.add_get("/version", self.version)
        r.add_get("/_slotsync/stats", self.stats)
        r.add_post("/_slotsync/fault", self.fault)
        # LoRA adapters, /v1/models and /server_info (issue 36): reference/lora.py
        LoraFront(self, lora or LoraOptions(), base_model or "slotsync-reference").attach(r)
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
            if resp.get(CLOSE_AFTER) and request.transport is not None:
                # uvicorn after an exception raised through ServerErrorMiddleware: the
                # response goes out as usual (no "Connection: close"), then the transport
                # closes -- a client reusing the connection finds it reset
                transport = request.transport
                await resp.prepare(request)
                await resp.write_eof()
                transport.close()
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
        self, route: str, utility: str = "collective_rpc", plain: str | None = None
    ) -> tuple[web.Response | None, dict[int, str] | None]:
        """Returns (response to send instead, worker injections) for this call of ``route``.

        ``utility``: the engine-core method vLLM's error names; ``plain``: the route catches
        its errors itself and answers ``{"error": "<plain>: Call to <utility> method failed:
        <msg>"}`` (vLLM's pause / resume / is_paused), keeping the connection."""
        f = self.state.match_fault(route)
        if f is None:
            return None, None
        if f.hang_s:
            await asyncio.sleep(f.hang_s)
        msg = f.text()
        if f.workers is None:
            if f.status < 400:
                return None, None
            text = f"Call to {utility} method failed: {msg}"
            if plain is not None:
                return web.json_response({"error": f"{plain}: {text}"}, status=f.status), None
            return err500(text, f.status), None
        return None, {i: msg for i in f.workers}

    async def _fanout(
        self,
        route: str,
        method: str,
        kwargs: dict[str, Any] | None = None,
        per_worker: list[dict[str, Any]] | None = None,
        utility: str = "collective_rpc",
    ) -> list[Any] | web.Response:
        """``route``'s fault, then ``method`` on every worker: their results, or the 500."""
        early, inject = await self._apply_fault(route, utility)
        if early is not None:
            return early
        return await self._rpc(method, kwargs, per_worker, inject, utility)

    async def _rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                   per_worker: list[dict[str, Any]] | None = None,
                   inject: dict[int, str] | None = None,
                   utility: str = "collective_rpc") -> list[Any] | web.Response:
        """``method`` on every worker: their results, or vLLM's 500 naming ``utility``."""
        try:
            return await self.pool.collective_rpc(method, kwargs, per_worker, inject)
        except CollectiveRpcError as e:
            return err500(e.api_message(utility))

    async def _read_then_fanout(self, request: web.Request,
                                route: str) -> dict[str, Any] | web.Response:
        """Read the body (vLLM's 400s), then run the worker method named ``route`` on every
        worker: the body, or the error response."""
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        res = await self._fanout(route, route)
        return res if isinstance(res, web.Response) else body

    async def _plain(self, route: str, utility: str, answer: Callable[[], dict[str, Any]],
                     plain: str | None = None) -> web.Response:
        """A route that runs no worker call: ``route``'s fault, else ``answer()``'s body
        (``plain``: see :meth:`_apply_fault`)."""
        early, _ = await self._apply_fault(route, utility, plain)
        return early if early is not None else web.json_response(answer())

    # -- vLLM routes -----------------------------------------------------------------------

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        """``POST /init_weight_transfer_engine`` ``{"init_info": {"packed": bool}}``."""
        got = await read_required(request, "init_info")
        if isinstance(got, web.Response):
            return got
        _, init_info = got
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
        got = await self._read_then_fanout(request, "start_weight_update")
        if isinstance(got, web.Response):
            return got
        return web.json_response({"message": "Weight update started"})

    async def start_draft_weight_update(self, request: web.Request) -> web.Response:
        """``POST /start_draft_weight_update`` (body ignored; issue 18): vLLM 0.32
        ``api_router.py``'s route -> ``collective_rpc("start_draft_weight_update")``; a
        worker's refusal (a session active, no draft model) is the same 500 as a start's."""
        got = await self._read_then_fanout(request, "start_draft_weight_update")
        if isinstance(got, web.Response):
            return got
        return web.json_response({"message": "Draft weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        """``POST /update_weights`` ``{"update_info": {...}}`` or a list of them indexed by
        global worker rank (vLLM 0.32 ``Worker.update_weights``: worker ``i`` takes entry
        ``data_parallel_index * world_size + rank`` = its global index ``i``; a list too
        short fails on the workers past its end with ``IndexError: list index out of
        range``, extra entries are ignored). Each worker parses and loads its own entry
        only (the same rules as the dict form); an entry with no names loads nothing, as
        vLLM's IPC engine does with it.

        One ``update_info`` for every worker travels to them as its JSON text, checked here
        for syntax only: each worker decodes it itself, in parallel, instead of this process
        decoding it and pickling it again for the workers; a list's entries travel the same
        way, each to its own worker."""
        raw = await request.read()
        try:
            top = UPDATE_BODY.decode(raw) if raw.strip() else UpdateBody()
        except msgspec.ValidationError:
            return bad_request("Request body must be a JSON object", "body")
        except msgspec.DecodeError:
            return bad_request("Invalid JSON format", "body")
        text = bytes(top.update_info)
        if text == b"null":
            return missing("update_info")
        kwargs: dict[str, Any] | None = {"update_info_json": text}
        per_worker = None
        if not text.startswith(b"{"):  # not an object: a list of them, or vLLM's 400
            entries = RAW_LIST.decode(text) if text.startswith(b"[") else None
            if entries is None or any(not bytes(e).startswith(b"{") for e in entries):
                refused = update_info_shape(json.loads(text))
                assert refused is not None
                return refused
            # each worker gets its own entry's JSON text and decodes it itself
            n = self.pool.world_size
            kwargs, per_worker = None, [
                {"update_info_json": bytes(entries[i])} if i < len(entries)
                else {"missing_rank": True} for i in range(n)]
        res = await self._fanout("update_weights", "update_weights", kwargs, per_worker)
        if isinstance(res, web.Response):
            return res
        return web.json_response({"message": "Weights updated"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        """``POST /finish_weight_update`` with optional ``{"weight_version": str}``; the
        version is recorded only when every worker finished."""
        body = await self._read_then_fanout(request, "finish_weight_update")
        if isinstance(body, web.Response):
            return body
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
        return web.json_response({"message": "Weight transfer shut down"})

    async def pause(self, request: web.Request) -> web.Response:
        """``POST /pause?mode=abort|wait|keep`` (default ``abort``) -> ``{"status": "paused"}``."""
        mode = pause_mode(request)
        if isinstance(mode, web.Response):
            return mode
        return await self._plain("pause", "pause_scheduler", self.state.pause,
                                 "Failed to pause generation")

    async def resume(self, request: web.Request) -> web.Response:
        """``POST /resume`` -> ``{"status": "resumed"}``."""
        return await self._plain("resume", "resume_scheduler", self.state.resume,
                                 "Failed to resume generation")

    async def is_paused(self, request: web.Request) -> web.Response:
        """``GET /is_paused`` -> ``{"is_paused": bool}``."""
        return await self._plain("is_paused", "is_scheduler_paused",
                                 lambda: {"is_paused": self.state.paused},
                                 "Failed to fetch pause status")

    async def get_world_size(self, request: web.Request) -> web.Response:
        """``GET /get_world_size?include_dp=true|false`` -> ``{"world_size": N, "gpu_uuids":
        [...]}``: as vLLM 0.32's route, ``parallel_config.world_size_across_dp`` (every
        worker, D x TP) with ``include_dp`` (the default), ``world_size`` (one DP replica's
        TP) without; a value pydantic cannot read as a bool is vLLM's 400.

        ``gpu_uuids`` is a test-engine extension vLLM does not have: every worker's GPU UUID
        in global order (``dp_index * TP + rank``), whatever ``include_dp`` says; the daemon
        uses it only as a cross-check of its engine table (``daemon/core/probe.py``
        ``reported_uuids``)."""
        dp = include_dp(request)
        if isinstance(dp, web.Response):
            return dp
        size = self.pool.world_size if dp else self.pool.tp_size
        return await self._plain("get_world_size", "collective_rpc",
                                 lambda: {"world_size": size,
                                          "gpu_uuids": self.pool.gpu_uuids})

    async def version(self, request: web.Request) -> web.Response:
        """``GET /version`` -> ``{"version": VLLM_VERSION}``, as vLLM 0.32's
        ``serve/instrumentator/basic.py`` ``show_version`` (no engine call), with the
        version this engine poses as; a fault on ``version`` answers instead (tests: a
        server that gives no version)."""
        return await self._plain("version", "show_version",
                                 lambda: {"version": self.vllm_version})

    async def weight_info(self, request: web.Request) -> web.Response:
        """``GET /weight_info`` -> ``{"weight_version": str}`` (``"default"`` at first)."""
        return await self._plain("weight_info", "get_weight_version",
                                 lambda: {"weight_version": self.state.weight_version})

    async def weight_checker(self, request: web.Request) -> web.Response:
        """``POST /weight_checker`` (the reference engine's shapes; vLLM's differ, see
        ``slotsync.engine.checksum.checksums_by_worker``).

        * ``{"action": "checksum"}`` -> ``{"checksums": {gpu_uuid: {name: sha256 hex}}}``
          (``slotsync.engine.checksum.tensor_checksum`` of each worker's weights); also kept
          as the stored baseline.
        * ``{"action": "compare", "baseline": {name: hex}?}`` -> ``{"match": bool,
          "mismatches": [{"gpu_uuid", "name", "expected", "actual"}]}``, every worker against
          the given baseline (or the stored one); ``actual`` is null for a missing name.
        * ``{"action": "reset"}`` -> ``{"status": "reset"}``: forgets the stored baseline
          (vLLM's zeroes every weight).
        """
        got = await read_required(request, "action")
        if isinstance(got, web.Response):
            return got
        body, action = got
        if action not in ("checksum", "compare", "reset"):
            return bad_request(f"Unknown action {action!r}: use checksum, compare or reset",
                               "body.action")
        if action == "reset":
            self.state.baseline = None
            return web.json_response({"status": "reset"})
        baseline = body.get("baseline") if action == "compare" else None
        if action == "compare" and baseline is None:
            baseline = self.state.baseline
            if baseline is None:
                return bad_request("action='compare' requires a 'baseline' object")
        if baseline is not None and not isinstance(baseline, dict):
            return bad_request("'baseline' must be an object {name: hex}", "body.baseline")
        res = await self._fanout("weight_checker", "checksums",
                                 utility="compute_weight_checksums")
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

    # -- sleep (vLLM 0.32 EngineCore.sleep / wake_up / is_sleeping, Executor.sleep) -----------

    async def sleep(self, request: web.Request) -> web.Response:
        """``POST /sleep?level=0|1|2&mode=`` -> ``{"status": "sleeping", "level": L}``: pause
        the scheduler, then from level 1 put the workers to sleep (unless already asleep);
        level 2 discards the weights."""
        level = sleep_level(request)
        if isinstance(level, web.Response):
            return level
        mode = pause_mode(request)
        if isinstance(mode, web.Response):
            return mode
        early, inject = await self._apply_fault("sleep", "sleep")
        if early is not None:
            return early
        if self.state.workers_sleep(level):
            res = await self._rpc("sleep", {"level": level}, inject=inject, utility="sleep")
            if isinstance(res, web.Response):
                return res
            self.state.slept()
        return web.json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        """``POST /wake_up?tags=...`` (repeatable; none: everything) -> ``{"status": "awake" |
        "sleeping", "tags": [...] | null}``: wake those tags (``scheduling`` only resumes);
        the scheduler resumes once nothing sleeps. An unknown tag wakes nothing (vLLM logs
        a warning)."""
        tags: list[str] | None = request.query.getall("tags", []) or None
        early, inject = await self._apply_fault("wake_up", "wake_up")
        if early is not None:
            return early
        wake, t = self.state.tags_to_wake(tags)
        if wake:
            res = await self._rpc("wake_up", {"tags": t}, inject=inject, utility="wake_up")
            if isinstance(res, web.Response):
                return res
            self.state.woke(t)
        awake = self.state.settle_awake()
        return web.json_response({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        """``GET /is_sleeping`` -> ``{"is_sleeping": bool}``: paused or any tag asleep (vLLM
        0.32 ``EngineCore.is_sleeping``)."""
        return await self._plain("is_sleeping", "is_sleeping",
                                 lambda: {"is_sleeping": self.state.sleeping})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        """``POST /collective_rpc`` ``{"method": str, "args": [...], "kwargs": {...}}`` (vLLM's
        dev-mode RPC router) -> ``{"results": [one per worker]}``. Only vLLM ``Worker``
        methods the reference worker has run (``check_health``); another name fails on every
        worker as vLLM's ``getattr(worker, method)`` does."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return bad_request(f"JSON decode error: {e}")
        if not isinstance(body, dict):
            return bad_request("Request body must be a JSON object")
        method = body.get("method")
        if method is None:
            return bad_request("Missing 'method' in request body")
        res = await self._fanout("collective_rpc", "rpc", {
            "method": method, "args": list(body.get("args", [])),
            "kwargs": dict(body.get("kwargs", {}))})
        if isinstance(res, web.Response):
            return res
        # Several DP replicas: vLLM 0.32's DPLBAsyncMPClient runs the call on every engine
        # core and answers engine 0's results only (``call_utility_async``).
        return web.json_response({"results": [
            r if r is None or isinstance(r, dict | list) else str(r)
            for r in res[:self.pool.tp_size]]})

    # -- test-only control routes ----------------------------------------------------------

    async def stats(self, request: web.Request) -> web.Response:
        """``GET /_slotsync/stats`` (shape in the module docstring)."""
        try:
            workers = await self.pool.collective_rpc("stats")
        except CollectiveRpcError as e:
            return err500(e.api_message(), close=False)
        s = self.state
        return web.json_response(
            {
                "impl": "reference",
                "world_size": self.pool.world_size,
                "data_parallel_size": self.pool.data_parallel_size,
                "paused": s.paused,
                "weight_version": s.weight_version,
                "packed": s.packed,
                "init_count": s.init_count,
                "pause_count": s.pause_count,
                "resume_count": s.resume_count,
                "shutdown_count": s.shutdown_count,
                "sleeping": s.sleeping,
                "sleeping_tags": sorted(s.sleeping_tags),
                "route_counts": s.route_counts,
                "faults": s.fault_table.as_json(),
                "workers": [{**w, "dp_index": w["index"] // self.pool.tp_size,
                             "tp_rank": w["index"] % self.pool.tp_size} for w in workers],
            }
        )

    async def fault(self, request: web.Request) -> web.Response:
        """``POST /_slotsync/fault``: add one fault, or ``{"clear": true}``."""
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return detail(400, "Invalid JSON format")
        try:
            faults = self.state.fault_table.apply(body, self.pool.world_size)
        except ValueError as e:
            return detail(400, str(e))
        return web.json_response({"faults": faults})

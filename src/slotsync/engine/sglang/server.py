"""HTTP front of the SGLang engines (``python -m slotsync.engine --impl sglang`` and
``--impl sglang-reference``): SGLang's weight-sync routes over N TP-rank worker processes.

One module for both impls: the routes, their bodies, replies, status codes and per-version
rules are here and in ``slotsync.engine.sglang.state`` / ``slotsync.engine.sglang.http`` /
``slotsync.engine.sglang.server_info``, the calls queued for the scheduler and its driving of
the TP ranks in ``slotsync.engine.sglang.scheduler``, the test-only faults in
``slotsync.engine.sglang.faults``; the impls differ in the payload parser the ranks use
(``slotsync.engine.sglang.payload``) and in whose validation and auth helpers check the
bodies (SGLang's own, or slotsync's mirror of them).
Paths are inside the SGLang wheel; "L<a> / L<b> / L<c>" is the line in 0.5.23 / 0.5.21 /
0.5.20 (docs/sglang-contract.md).

Routes (``srt/entrypoints/http_server.py``):

``POST /pause_generation`` ``{"mode": "abort"|"retract"|"in_place"}`` (default ``abort``)
    L1831 / L1740 / L1710: always ``200 {"message": "Generation paused successfully.",
    "status": "ok"}``. ``abort`` aborts every request at the tokenizer and never tells the
    scheduler; the other modes go to the scheduler (``retract``: running requests back to
    the waiting queue; ``in_place``: left running) and the route returns once that message
    is queued, not when the scheduler acted (tokenizer_manager.py L2267-2280).
``POST /continue_generation`` ``{"torch_empty_cache": bool}``
    L1844 / L1753 / L1723: ``200 {"message": "Generation continued successfully.",
    "status": "ok"}``.
``POST /begin_weight_update`` ``{"selector": "target"|"draft"|"all"}``, ``POST /end_weight_update``
    ``{}``, 0.5.21+ (L1458, L1473 / L1400, L1415; 0.5.20: 404): ``{"success", "message"}``, 200 or
    400 with the session texts of ``state.py`` (``SESSION_OPEN``, ``NO_SESSION``).
``POST /update_weights_from_tensor``
    L1436 / L1378 / L1395, body ``UpdateWeightsFromTensorReqInput``: ``200 {"success": true,
    "message": "Success"}`` (+ `` Weight version updated to X.`` with ``weight_version``),
    ``400 {"success": false, "message": ...}`` for the scheduler's refusals
    (``SESSION_REQUIRED`` outside a session on 0.5.21+; ``FLUSH_REFUSED`` on 0.5.23 when the
    flush after a successful load is refused -- the weights *are* loaded). In order
    (tokenizer_control_mixin.py L563-599 / L559 / L507): the DP assertion (a bare 500
    ``Internal Server Error``, connection closed, for ``dp_size > 1`` without attention DP),
    ``abort_all_requests``, the payload normalization, then -- if not paused -- the writer
    side of ``model_update_lock`` (waits for every running request), then the scheduler
    (one call at a time, in arrival order): every TP rank deserializes *its own* entry and
    loads it (``slotsync.engine.sglang.worker``); the flush and version steps of the version
    (``SglangState.after_load``); the TP barrier (every rank answered); then, on 0.5.21+,
    the ranks free the received tensors and the reply goes out once rank 0 has (0.5.20: each
    rank freed before answering, so before the barrier: contract 5.2).
``GET /model_info``
    L812 / L790 / L760: ``weight_version`` and the model's fields (answered by the
    tokenizer alone, never waits for the scheduler).
``POST /update_weight_version`` ``{"new_version": str, "abort_all_requests": true}``
    L1527 / L1469 / L1456: aborts every request first unless told ``false``; ``200
    {"success": true, "message": "Weight version updated to X", "new_version": "X"}``.
``GET /server_info``
    L863 / L841 / L818: the flat server arguments (``tp_size``, ``dp_size``, ``pp_size``,
    ``enable_dp_attention``, ``weight_version`` (the startup one), ``tokenizer_worker_num``,
    ...; 0.5.23 ``attn_dp_size``), ``launch_command``, ``startup_time`` (this process's
    measured start phases: differs per start), ``internal_states`` (one per DP rank, asked
    from the scheduler: waits behind a running update), ``version`` and, 0.5.21+,
    ``"frontend": "python"``.
``GET|POST /flush_cache?timeout=T``
    L1025 / L987 / L990: plain text, 200 ``Cache flushed. ...`` or 400 (``Flush cache
    failed.``, ``Another flush_cache is already in progress.``, ``Timed out waiting for idle
    state.``); ``T > 0`` waits up to ``T`` seconds for the scheduler to be idle
    (``SchedulerFlushWrapper``, flush_wrapper.py).
``GET /health``, ``GET /health_generate``
    L721-800 (0.5.23): SGLang generates one token (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
    defaults to true) and answers 200 once the scheduler produced output, checked every
    1 s; while the tokenizer is paused nothing comes out: 503 after
    ``$SGLANG_HEALTH_CHECK_TIMEOUT`` s (default 20).

No ``/version`` (SGLang has none: 404), no vLLM route. Unknown routes answer Starlette's
``404 {"detail": "Not Found"}``.

A scheduler exception -- anything a rank raises, or the flush ``assert`` of 0.5.20 / 0.5.21
-- kills the engine as SGLang's does (``slotsync.engine.sglang.scheduler``): the connection
of the call is reset (RST), every rank is killed, then the front SIGKILLs itself.

Test-only routes (not SGLang's), under ``/_slotsync/``, no auth:

``GET /_slotsync/stats``
    ``{"impl", "pid", "sglang_version", "helpers", "free_received", "frees_before_barrier",
    "world_size", "tp_size", "dp_size", "pp_size",
    "paused" (the tokenizer's flag), "engine_paused" (the scheduler's), "pause_mode",
    "weight_version" (``/model_info``'s), "scheduler_weight_version", "session_open",
    "session_selector", "requests": {"held", "waiting", "running", "finished", "aborted"},
    "flush_pending", "scheduler_rules" (``"sglang"``: SGLang's own pause, idle rule and flush
    wrapper, ``scheduler_code.py``; ``"mirror"``: ``state.py``'s),
    "counts": {"pause_count", "continue_count", "begin_count", "end_count", "update_count",
    "flush_count", "flush_refused", "abort_all_count", "version_updates"},
    "route_counts", "faults", "startup_time", "workers": [{"index", "tp_rank", "gpu_uuid",
    "pid", "device", "parser", "uuid_standin", "sglang_file", "copy_stream",
    "copy_sleep_cycles", "active" (the session is open: replicated on every rank),
    "begin_count", "end_count", "post_load_count", "load_calls", "update_count",
    "release_count", "bytes_loaded", "load_seconds", "num_weights", "held_tensors",
    "last_error", "rebuilt_on" ({device index: tensors}: where the rank's UUID lookup put
    the tensors it received; CPU only)}, ...]}``.
``POST /_slotsync/fault``
    the reference engine's fault body plus ``"exit": true`` (``slotsync.engine.sglang.faults``
    says what each fault does). Answers ``{"faults": [...]}``.
``POST /_slotsync/checksums``
    ``{"tp<r>": {name: sha256 hex}}`` per rank (``slotsync.engine.checksum.tensor_checksum``).
``POST /_slotsync/requests``
    the generation simulator: ``{"start": n}`` (requests arrive), ``{"finish": n | null}``
    (running ones finish; 409 while the scheduler is paused); answers the ``requests``
    counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from slotsync.engine.http_shapes import CLOSE_AFTER
from slotsync.engine.pool import WorkerPool
from slotsync.engine.sglang.faults import SglangFaultTable, injected
from slotsync.engine.sglang.http import (
    BodyValidator,
    SchemaHelpers,
    auth_level,
    internal_error,
    method_not_allowed,
    not_found,
    success_body,
    unauthorized,
)
from slotsync.engine.sglang.scheduler import Scheduler
from slotsync.engine.sglang.server_info import (
    ServerConfig,
    internal_state,
    model_info,
    server_info,
)
from slotsync.engine.sglang.state import (
    FLUSH_FAILED_TEXT,
    FLUSH_OK_TEXT,
    SglangState,
    SglangVersion,
)

HEALTH_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
"""http_server.py L218: seconds ``/health`` waits for output (default 20)."""


class SglangEngineApp:
    """The aiohttp application over one :class:`WorkerPool` of TP ranks.

    Args:
        pool: the TP-rank workers (``slotsync.engine.sglang.worker``), rank order.
        version: the SGLang version this engine poses as.
        helpers: whose validation / auth helpers check the requests.
        parser: the payload parser's front half (``normalize``).
        config: the start options.
        startup_time: ``/server_info``'s ``startup_time`` (measured at start).
        free_received: ``"version"``: the TP ranks free the received tensors where
            ``version`` does (``frees_before_barrier``); ``"after-barrier"`` (tests): after
            the TP barrier whatever the version -- a 0.5.20 engine freeing as 0.5.21+ does,
            whose replies then no longer prove every rank's copies (the GPU garbage test's
            negative control, issue 26 E).
        scheduler_code: ``scheduler_code.load()``'s factory: SGLang's own pause, idle rule,
            flush and flush wrapper (the SGLang-code engine); None: the mirror in
            ``state.py`` / ``scheduler.py``.
    """

    def __init__(self, pool: WorkerPool, version: SglangVersion, helpers: SchemaHelpers,
                 parser: Any, config: ServerConfig, startup_time: dict[str, Any],
                 free_received: str = "version",
                 scheduler_code: Callable[[SglangState], Any] | None = None) -> None:
        if free_received not in ("version", "after-barrier"):
            raise ValueError(f"free_received must be 'version' or 'after-barrier', not "
                             f"{free_received!r}")
        self.pool = pool
        self.version = version
        self.free_received = free_received
        self.frees_before_barrier = (version.frees_before_barrier
                                     and free_received == "version")
        self.helpers = helpers
        self.parser = parser
        self.config = config
        self.startup_time = startup_time
        self.state = SglangState(version, weight_version=config.weight_version,
                                 fault_table=SglangFaultTable())
        self.validator = BodyValidator(version, helpers)
        self.structs = self.validator.structs
        self.scheduler = Scheduler(
            pool, self.state, self.frees_before_barrier,
            scheduler_code(self.state) if scheduler_code is not None else None)
        # SGLang (uvicorn) sets no body limit; aiohttp's default of 1 MiB would refuse a
        # chunk of a few thousand tensors on 8 ranks
        self.app = web.Application(middlewares=[self._middleware], client_max_size=1 << 30)
        r = self.app.router
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        if version.sessions:
            r.add_post("/begin_weight_update", self.begin_weight_update)
            r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)  # deprecated alias, L802
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)  # deprecated alias, L853
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/_slotsync/stats", self.stats)
        r.add_post("/_slotsync/fault", self.fault)
        r.add_post("/_slotsync/checksums", self.checksums)
        r.add_post("/_slotsync/requests", self.requests)
        from slotsync.engine.sglang.lora_front import install as install_lora

        self.lora = install_lora(self)  # (the LoRA routes: the SGLang-code engine only)
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)

    # -- plumbing --------------------------------------------------------------------------

    async def _startup(self, _app: web.Application) -> None:
        await self.scheduler.start()

    async def _cleanup(self, _app: web.Application) -> None:
        self.scheduler.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.pool.close)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500
        try:
            if not request.path.startswith("/_slotsync/"):
                decision = self.helpers.decide_auth(
                    method=request.method, path=request.path,
                    authorization_header=request.headers.get("Authorization"),
                    api_key=self.config.api_key, admin_api_key=self.config.admin_api_key,
                    auth_level=auth_level(request.path))
                if not decision.allowed:
                    resp: web.StreamResponse = unauthorized(decision.error_status_code)
                    status = resp.status
                    return resp
            try:
                resp = await handler(request)
            except web.HTTPNotFound:
                resp = not_found()
            except web.HTTPMethodNotAllowed:
                resp = method_not_allowed()
            status = resp.status
            if resp.get(CLOSE_AFTER) and request.transport is not None:
                transport = request.transport  # uvicorn after an exception escaped a route
                await resp.prepare(request)
                await resp.write_eof()
                transport.close()
            return resp
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            print(f"[slotsync.engine] {request.method} {request.path_qs} -> {status} "
                  f"({ms:.1f} ms)", file=sys.stderr, flush=True)

    async def _fault(self, request: web.Request, route: str
                     ) -> tuple[web.Response | None, dict[int, str] | None]:
        """``route``'s injected fault: (answer instead of the call, rank injections)."""
        return await injected(self.state.fault_table, self.scheduler, request, route)

    async def _validated(self, request: web.Request, cls: type, route: str
                         ) -> tuple[Any, dict[int, str] | None] | web.Response:
        """The validated body and the rank injections, or the answer to send instead (a
        validation 400 or a fault)."""
        obj = await self.validator.read(request, cls, "/" + route)
        if isinstance(obj, web.Response):
            return obj
        early, inject = await self._fault(request, route)
        return early if early is not None else (obj, inject)

    # -- SGLang's routes -------------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``POST /pause_generation`` (module docstring)."""
        got = await self._validated(request, self.structs.pause, "pause_generation")
        if isinstance(got, web.Response):
            return got
        obj, _ = got
        self.state.tokenizer_pause(obj.mode)
        if obj.mode != "abort":
            mode = obj.mode

            async def scheduler_pause() -> None:
                self.scheduler.pause(mode)

            self.scheduler.dispatch(scheduler_pause, request)  # sent, not awaited (L2270-2271)
        await self.scheduler.notify()
        return web.json_response({"message": "Generation paused successfully.",
                                  "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``POST /continue_generation``: the scheduler resumes, the held requests go in."""
        got = await self._validated(request, self.structs.cont, "continue_generation")
        if isinstance(got, web.Response):
            return got
        self.state.tokenizer_continue()

        async def scheduler_continue() -> None:
            self.state.scheduler_continue()

        await self.scheduler.dispatch(scheduler_continue, request)
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def _session_call(self, fn: Callable[[], Awaitable[tuple[bool, str]]],
                            request: web.Request) -> web.Response:
        """``_weight_update_session_call`` (tokenizer_control_mixin.py L471-483): straight to
        the scheduler while paused, else behind the writer lock."""
        if not self.state.is_pause:
            await self.scheduler.writer_lock()
        ok, message = await self.scheduler.dispatch(fn, request)
        return success_body(ok, message)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """``POST /begin_weight_update`` (0.5.21+): open the session (weight_updater.py
        L309-321 / L290-302)."""
        got = await self._validated(request, self.structs.begin, "begin_weight_update")
        if isinstance(got, web.Response):
            return got
        obj, inject = got
        return await self._session_call(lambda: self.scheduler.begin(obj.selector, inject),
                                        request)

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """``POST /end_weight_update`` (0.5.21+): close the session (L323-335 / L304-316)."""
        got = await self._validated(request, self.structs.end, "end_weight_update")
        if isinstance(got, web.Response):
            return got
        _, inject = got
        return await self._session_call(lambda: self.scheduler.end(inject), request)

    def _dp_ok(self) -> bool:
        """The tokenizer's DP assertion (``SglangVersion.dp_attention_resolves``): true DP
        replicas are refused, attention DP passes (0.5.23 resolves it to ``dp_size`` 1)."""
        return self.config.dp_size == 1 or self.config.enable_dp_attention

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_tensor`` (module docstring)."""
        got = await self._validated(request, self.structs.update, "update_weights_from_tensor")
        if isinstance(got, web.Response):
            return got
        obj, inject = got
        if not self._dp_ok():
            print(f"[slotsync.engine] AssertionError: {self.version.dp_message}",
                  file=sys.stderr, flush=True)
            return internal_error()
        if obj.abort_all_requests:
            self.state.abort_all()
            await self.scheduler.notify()
        entries = self.parser.normalize(obj.serialized_named_tensors)
        if not self.state.is_pause:
            await self.scheduler.writer_lock()
        load_target = getattr(obj, "selector", "all") != "draft"
        success, message = await self.scheduler.dispatch(
            lambda: self.scheduler.update(entries, obj.load_format, load_target,
                                          obj.weight_version, obj.flush_cache, inject),
            request)
        if success and obj.weight_version is not None:
            self.state.set_weight_version(obj.weight_version)
            message += f" Weight version updated to {obj.weight_version}."
        return success_body(success, message)

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /model_info`` (L812 / L790 / L760)."""
        early, _ = await self._fault(request, "model_info")
        if early is not None:
            return early
        return web.json_response(model_info(self.config, self.version,
                                            self.state.weight_version))

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """``POST /update_weight_version`` (L1527-1556 / L1469 / L1456)."""
        got = await self._validated(request, self.structs.version, "update_weight_version")
        if isinstance(got, web.Response):
            return got
        obj, _ = got
        if obj.abort_all_requests:
            self.state.abort_all()
            await self.scheduler.notify()

        async def record() -> None:  # handle_update_weight_version (scheduler.py L5630)
            self.state._record_version(obj.new_version)

        await self.scheduler.dispatch(record, request)
        self.state.set_weight_version(obj.new_version)
        return web.json_response({"success": True,
                                  "message": f"Weight version updated to {obj.new_version}",
                                  "new_version": obj.new_version})

    async def server_info(self, request: web.Request) -> web.Response:
        """``GET /server_info`` (module docstring); ``internal_states`` waits for the
        scheduler."""
        early, _ = await self._fault(request, "server_info")
        if early is not None:
            return early

        async def internal() -> dict[str, Any]:  # asked from the scheduler
            return internal_state(self.config, self.version, self.state)

        state = await self.scheduler.dispatch(internal, request)
        return web.json_response(server_info(self.config, self.version, self.startup_time,
                                             state))

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``GET|POST /flush_cache?timeout=T`` (module docstring)."""
        raw = request.query.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            return self.validator.error(request, "/flush_cache", [{
                "type": "float_parsing", "loc": ("query", "timeout"),
                "msg": "Input should be a valid number, unable to parse string as a number",
                "input": raw}])
        if timeout < 0:
            return self.validator.error(request, "/flush_cache", [{
                "type": "greater_than_equal", "loc": ("query", "timeout"),
                "msg": "Input should be greater than or equal to 0", "input": raw,
                "ctx": {"ge": 0.0}}])
        early, _ = await self._fault(request, "flush_cache")
        if early is not None:
            return early
        got = await self.scheduler.dispatch(lambda: self.scheduler.flush(timeout), request)
        if isinstance(got, asyncio.Future):
            got = await got
        ok, message = got
        if ok:
            return web.Response(text=FLUSH_OK_TEXT)
        return web.Response(status=400, text=message or FLUSH_FAILED_TEXT)

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health`` (module docstring)."""
        early, _ = await self._fault(request, "health")
        if early is not None:
            return early
        timeout = float(os.environ.get(HEALTH_TIMEOUT_ENV, "20"))
        tic = time.monotonic()
        while time.monotonic() < tic + timeout:
            await asyncio.sleep(min(1.0, timeout))
            if not self.state.is_pause and not self.state.engine_paused:
                return web.Response(status=200)
        return web.Response(status=503)

    # -- test-only routes ------------------------------------------------------------------

    async def stats(self, request: web.Request) -> web.Response:
        """``GET /_slotsync/stats`` (module docstring)."""
        workers = await self.pool.collective_rpc("stats")
        s = self.state
        session = s.session
        return web.json_response({
            "impl": self.config.impl, "pid": os.getpid(), "sglang_version": self.version.name,
            "helpers": self.helpers.origin, "free_received": self.free_received,
            "frees_before_barrier": self.frees_before_barrier,
            "world_size": self.pool.world_size,
            "tp_size": self.config.tp_size, "dp_size": self.config.dp_size,
            "pp_size": self.config.pp_size, "paused": s.is_pause,
            "engine_paused": s.engine_paused, "pause_mode": s.pause_mode,
            "weight_version": s.weight_version,
            "scheduler_weight_version": s.scheduler_weight_version,
            "session_open": session is not None,
            "session_selector": session.selector if session is not None else None,
            "requests": asdict(s.requests),
            "flush_pending": self.scheduler.flush_waiter is not None,
            "scheduler_rules": "sglang" if self.scheduler.code is not None else "mirror",
            "counts": dict(s.counts), "route_counts": s.fault_table.route_counts,
            "faults": s.fault_table.as_json(), "startup_time": self.startup_time,
            "workers": [{**w, "active": session is not None} for w in workers],
        })

    async def fault(self, request: web.Request) -> web.Response:
        """``POST /_slotsync/fault`` (module docstring)."""
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"detail": "Invalid JSON format"}, status=400)
        try:
            faults = self.state.fault_table.apply(body, self.pool.world_size)
        except ValueError as e:
            return web.json_response({"detail": str(e)}, status=400)
        return web.json_response({"faults": faults})

    async def checksums(self, request: web.Request) -> web.Response:
        """``POST /_slotsync/checksums`` -> ``{"tp<r>": {name: sha256 hex}}``."""
        sums = await self.pool.collective_rpc("checksums")
        return web.json_response({f"tp{i}": s for i, s in enumerate(sums)})

    async def requests(self, request: web.Request) -> web.Response:
        """``POST /_slotsync/requests`` (module docstring)."""
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"detail": "Invalid JSON format"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"detail": "Request body must be a JSON object"},
                                     status=400)
        if "start" in body:
            self.state.start_requests(int(body["start"]))
        if "finish" in body:
            n = body["finish"]
            try:
                self.state.finish_requests(None if n is None else int(n))
            except RuntimeError as e:
                return web.json_response({"detail": str(e)}, status=409)
        await self.scheduler.notify()
        return web.json_response(asdict(self.state.requests))


async def serve(engine: SglangEngineApp, host: str, port: int, uds: str | None,
                where: str) -> None:
    """Bind (TCP or Unix socket), say so once bound, serve until SIGTERM / SIGINT."""
    runner = web.AppRunner(engine.app, access_log=None)
    await runner.setup()
    try:
        site = web.UnixSite(runner, uds) if uds else web.TCPSite(runner, host, port)
        await site.start()
        print(f"[slotsync.engine] serving {where} (world size {engine.pool.world_size}, "
              f"impl {engine.config.impl}, SGLang {engine.version.name})", file=sys.stderr,
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()

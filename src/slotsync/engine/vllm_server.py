"""HTTP front of the vLLM-code engine (``python -m slotsync.engine --impl vllm``).

The routes are vLLM's own: a FastAPI app that includes vLLM 0.32's RL router
(``vllm.entrypoints.rl.online.api_router.router``: pause / resume / is_paused, the weight
transfer routes, ``/weight_info``, ``/weight_checker``, ``/get_world_size``) and its sleep router
(``vllm.entrypoints.serve.dev.sleep.api_router.router``: ``/sleep``, ``/wake_up``,
``/is_sleeping``) and dev-mode RPC router (``vllm.entrypoints.serve.dev.rpc.api_router``:
``POST /collective_rpc``), with vLLM's exception handlers
(``vllm.entrypoints.serve.exception_handling.register.init_exception_handler``), served by
vLLM's own ``vllm.entrypoints.launchers.launcher.serve_http`` (uvicorn, ``NoSignalServer``,
its SIGINT / SIGTERM handling and engine watchdog) with the arguments vLLM's
``api_server/entry.py build_and_serve`` passes by default (``timeout_keep_alive =
VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, vLLM's h11 limits, access log on). So a failed weight call
is a 500 raised through Starlette's ``ServerErrorMiddleware``, after which uvicorn closes the
connection, exactly as ``vllm serve`` does.

``app.state.engine_client`` is :class:`VllmEngineClient`, a stand-in for vLLM 0.32's
``AsyncLLM`` (``vllm/v1/engine/async_llm.py``) over the engine core and executor it drives:

* every engine-core call is a *utility call* run one at a time, in arrival order (the engine
  core's busy loop; an ``asyncio.Lock`` here), and its failure reaches the router as
  ``Exception(f"Call to {utility} method failed: {error}")`` (``EngineCoreProc.
  _invoke_utility_method`` + ``core_client`` ``future.set_exception(Exception(msg))``);
  ``collective_rpc`` calls are utility ``collective_rpc``, checksums
  ``compute_weight_checksums``, pause ``pause_scheduler``, and so on;
* the executor (:class:`ExecutorStandIn`) fans each call out to every worker process (every
  worker runs every call even when another fails) and reports errors as vLLM's executors do:
  with one worker the worker's own error (``UniProcExecutor``), with several
  ``RuntimeError(f"Worker failed with error '{msg}', please check the stack trace above for
  the root cause")`` for the first failing worker in rank order (``MultiprocExecutor``);
* ``MultiprocExecutor.collective_rpc``'s ``get_response`` (vLLM 0.32
  ``v1/executor/multiproc_executor.py:433-449``) reads the workers' replies in rank order and
  raises at the first failure *without reading the later workers' replies*; those stay in
  their queues and are read by the next calls (which then see a stale reply). With
  ``replies="vllm"`` (the default) the stand-in does the same; ``replies="all"`` reads every
  reply of each call (the reference engine's behaviour), for comparison;
* pause mirrors ``EngineCoreProc.pause_scheduler`` with no requests in flight: the scheduler
  state, then ``collective_rpc("synchronize_device")`` and, with ``clear_cache``,
  ``reset_mm_cache`` / ``reset_encoder_cache`` on the workers; sleep / wake_up / is_sleeping
  mirror ``EngineCore.sleep / wake_up / is_sleeping`` and ``Executor.sleep / wake_up``
  (``sleeping_tags``); in 0.32 ``is_sleeping`` is ``scheduler paused or executor sleeping``,
  so a plain ``/pause`` makes ``/is_sleeping`` true.

Test-only control routes, same shapes as the reference engine's (``slotsync.engine.server``):
``GET /_slotsync/stats`` and ``POST /_slotsync/fault`` (``slotsync.engine.faults``). A
``workers: null`` fault makes the client stand-in raise what ``AsyncLLM`` would (``Exception
("Call to <utility> method failed: <message>")``; another ``status`` than 500 becomes a FastAPI
``HTTPException`` of that status) before any worker sees the call, so vLLM's router and
handlers answer it (and close the connection after a 500); pause / resume / is_paused catch
it themselves (``{"error": "Failed to pause generation: ..."}``). A ``workers: [i]`` fault
raises inside vLLM's weight transfer engine on worker ``i`` (``slotsync.engine.vllm_worker``).
``hang_s`` delays the call inside the engine core (later calls queue behind it, as behind a
stuck utility call). ``/get_world_size`` reads the config without the engine core; its faults
are applied by an ASGI middleware (hang, then a 500 raised through vLLM's handlers).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from slotsync.engine.faults import Fault, FaultTable
from slotsync.engine.pool import WorkerPool

T = TypeVar("T")
logger = logging.getLogger("slotsync.engine.vllm")

WORKER_FAILED = (
    "Worker failed with error '{msg}', please check the stack trace above for the root cause"
)
"""vLLM 0.32 ``MultiprocExecutor.collective_rpc``'s error for a failing worker."""

_UNPAUSED, _PAUSED_NEW, _PAUSED_ALL = "UNPAUSED", "PAUSED_NEW", "PAUSED_ALL"


class WorkerCallError(Exception):
    """A worker's error as ``UniProcExecutor`` propagates it (one worker): ``str()`` is the
    worker's own ``str(exception)``."""


class ExecutorStandIn:
    """The executor behind the engine core: ``collective_rpc`` over the worker pool with
    vLLM's reply handling, and ``Executor.sleep / wake_up / discard`` bookkeeping
    (``sleeping_tags``, vLLM 0.32 ``v1/executor/abstract.py``).

    Args:
        pool: the worker processes.
        replies: ``"vllm"``: read replies as ``MultiprocExecutor`` does (stop at the first
            failure; later workers' replies stay queued for the next calls); ``"all"``: read
            every reply of each call.
    """

    def __init__(self, pool: WorkerPool, replies: str = "vllm") -> None:
        if replies not in ("vllm", "all"):
            raise ValueError(f"replies must be 'vllm' or 'all', not {replies!r}")
        self.pool = pool
        self.replies = replies
        self.unread: list[collections.deque[asyncio.Future]] = [
            collections.deque() for _ in pool.workers
        ]
        self.sleeping_tags: set[str] = set()

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self.pool.world_size

    @property
    def is_sleeping(self) -> bool:
        """``Executor.is_sleeping``: any sleeping tag."""
        return bool(self.sleeping_tags)

    async def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                             inject: dict[int, str] | None = None) -> list[Any]:
        """Run ``method`` on every worker; their results in rank order.

        Raises:
            WorkerCallError: one worker, and it failed.
            RuntimeError: several workers, one failed (``WORKER_FAILED`` of the first
                failing reply read).
        """
        futs = await self.pool.submit(method, kwargs, inject=inject)
        if len(futs) == 1:  # UniProcExecutor: the worker method runs in the engine core
            ok, payload = await futs[0]
            if not ok:
                raise WorkerCallError(payload)
            return [payload]
        for q, f in zip(self.unread, futs, strict=True):
            q.append(f)
        results: list[Any] = []
        failed: str | None = None
        for q in self.unread:
            if failed is not None and self.replies == "vllm":
                break  # get_response raised: later workers' replies stay unread
            ok, payload = await q.popleft()
            if not ok and failed is None:
                failed = str(payload)
            results.append(payload)
        if failed is not None:
            raise RuntimeError(WORKER_FAILED.format(msg=failed))
        return results

    def unread_replies(self) -> list[int]:
        """Replies each worker sent (or will send) that no call has read yet."""
        return [len(q) for q in self.unread]

    async def sleep(self, level: int, inject: dict[int, str] | None = None) -> None:
        """``Executor.sleep(level)``."""
        from vllm.v1.executor.abstract import SLEEP_TAGS

        if "weights" in self.sleeping_tags:
            logger.warning("Executor is already sleeping.")
            return
        await self.collective_rpc("sleep", {"level": level}, inject)
        self.sleeping_tags |= SLEEP_TAGS

    async def wake_up(self, tags: list[str] | None,
                      inject: dict[int, str] | None = None) -> None:
        """``Executor.wake_up(tags)``."""
        if not self.is_sleeping:
            logger.warning("Executor is not sleeping.")
            return
        if tags:
            for tag in tags:
                if tag not in self.sleeping_tags:
                    logger.warning("Tag %s is not in sleeping tags %s", tag,
                                   self.sleeping_tags)
                    return
        await self.collective_rpc("wake_up", {"tags": tags}, inject)
        if tags:
            for tag in tags:
                self.sleeping_tags.remove(tag)
        else:
            self.sleeping_tags.clear()


class VllmEngineClient:
    """Stand-in for vLLM 0.32's ``AsyncLLM`` as the RL and sleep routers use it (see the
    module docstring). ``vllm_config`` is a real ``VllmConfig`` whose parallel config has
    ``tensor_parallel_size`` = the number of workers (``/get_world_size``).

    Args:
        pool: the worker processes (``slotsync.engine.vllm_worker``).
        replies: see :class:`ExecutorStandIn`.
    """

    def __init__(self, pool: WorkerPool, replies: str = "vllm") -> None:
        from vllm.config import ParallelConfig, VllmConfig
        from vllm.config.weight_transfer import WeightTransferConfig

        self.pool = pool
        self.executor = ExecutorStandIn(pool, replies)
        self.vllm_config = VllmConfig(
            parallel_config=ParallelConfig(tensor_parallel_size=pool.world_size),
            weight_transfer_config=WeightTransferConfig(backend="ipc"),
        )
        self.faults = FaultTable()
        self.pause_state = _UNPAUSED
        self.weight_version = "default"
        self.packed = False
        self.counts = {k: 0 for k in ("init_count", "pause_count", "resume_count",
                                      "shutdown_count", "sleep_count", "wake_count")}
        self._core = asyncio.Lock()  # the engine core runs one utility call at a time
        self._closed = False

    # -- engine core plumbing -----------------------------------------------------------

    async def _utility(self, route: str | None, utility: str,
                       work: Callable[[dict[int, str] | None], Awaitable[T]]) -> T:
        """Run ``work`` as engine-core utility ``utility`` (one at a time, arrival order),
        after the fault of ``route`` if one fires. Shielded: the engine core finishes a call
        whose HTTP client went away."""
        fault = self.faults.match(route) if route else None
        task = asyncio.ensure_future(self._run_utility(utility, fault, work))
        return await asyncio.shield(task)

    async def _run_utility(self, utility: str, fault: Fault | None,
                           work: Callable[[dict[int, str] | None], Awaitable[T]]) -> T:
        async with self._core:
            inject = None
            if fault is not None:
                if fault.hang_s:
                    await asyncio.sleep(fault.hang_s)
                if fault.workers is None:
                    if fault.status >= 400:
                        text = f"Call to {utility} method failed: {fault.text()}"
                        if fault.status == 500:
                            raise Exception(text)
                        from fastapi import HTTPException

                        raise HTTPException(status_code=fault.status, detail=text)
                else:
                    inject = {i: fault.text() for i in fault.workers}
            try:
                return await work(inject)
            except Exception as e:  # EngineCoreProc._invoke_utility_method + core_client
                raise Exception(f"Call to {utility} method failed: {e}") from None

    async def _finish_pause(self, clear_cache: bool, inject: dict[int, str] | None) -> None:
        """``EngineCore._finish_pause``: the workers synchronize; with ``clear_cache`` the
        caches are reset (``reset_mm_cache`` / ``reset_encoder_cache`` on every worker)."""
        await self.executor.collective_rpc("synchronize_device", inject=inject)
        if clear_cache:
            await self.executor.collective_rpc("reset_mm_cache")
            await self.executor.collective_rpc("reset_encoder_cache")

    async def _pause_scheduler(self, mode: str, clear_cache: bool,
                               inject: dict[int, str] | None) -> None:
        """``EngineCoreProc.pause_scheduler`` with nothing in flight (completes at once)."""
        from typing import get_args

        from vllm.v1.engine import PauseMode

        if mode not in get_args(PauseMode):
            raise ValueError(f"Invalid pause mode: {mode}")
        self.pause_state = _PAUSED_ALL if mode == "keep" else _PAUSED_NEW
        await self._finish_pause(clear_cache, inject)

    # -- AsyncLLM: pause / resume -------------------------------------------------------

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """``AsyncLLM.pause_generation``: utility ``pause_scheduler``, then 20 ms."""

        async def work(inject: dict[int, str] | None) -> None:
            await self._pause_scheduler(mode, clear_cache, inject)

        await self._utility("pause", "pause_scheduler", work)
        self.counts["pause_count"] += 1
        await asyncio.sleep(0.02)

    async def resume_generation(self) -> None:
        """``AsyncLLM.resume_generation``: utility ``resume_scheduler``."""

        async def work(inject: dict[int, str] | None) -> None:
            self.pause_state = _UNPAUSED

        await self._utility("resume", "resume_scheduler", work)
        self.counts["resume_count"] += 1

    async def is_paused(self) -> bool:
        """``AsyncLLM.is_paused``: utility ``is_scheduler_paused``."""

        async def work(inject: dict[int, str] | None) -> bool:
            return self.pause_state != _UNPAUSED

        return await self._utility("is_paused", "is_scheduler_paused", work)

    # -- AsyncLLM: weight transfer ------------------------------------------------------

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple = (), kwargs: dict | None = None,
                             _route: str | None = "collective_rpc") -> list[Any]:
        """``AsyncLLM.collective_rpc``: utility ``collective_rpc`` over every worker (vLLM's
        dev-mode ``POST /collective_rpc`` calls it with the body's ``method`` / ``args`` /
        ``kwargs``; a method the host does not define runs on vLLM's ``Worker`` object, e.g.
        ``check_health``). Faults: route ``collective_rpc`` (``/weight_checker``'s reset
        counts as that route too). ``timeout`` is not applied.

        Raises:
            Exception: ``Call to collective_rpc method failed: ...``.
        """
        kw = dict(kwargs or {})
        if args:
            kw["_args"] = list(args)

        async def work(inject: dict[int, str] | None) -> list[Any]:
            return await self.executor.collective_rpc(method, kw, inject)

        return await self._utility(_route, "collective_rpc", work)

    async def init_weight_transfer_engine(self, request: Any) -> None:
        """``AsyncLLM.init_weight_transfer_engine(WeightTransferInitRequest)``."""
        await self.collective_rpc("init_weight_transfer_engine",
                                  kwargs={"init_info": request.init_info},
                                  _route="init_weight_transfer_engine")
        info = request.init_info if isinstance(request.init_info, dict) else {}
        self.packed = bool(info.get("packed", False))
        self.counts["init_count"] += 1

    async def shutdown_weight_transfer_engine(self) -> None:
        """``AsyncLLM.shutdown_weight_transfer_engine``."""
        await self.collective_rpc("shutdown_weight_transfer_engine",
                                  _route="shutdown_weight_transfer_engine")
        self.counts["shutdown_count"] += 1

    async def start_weight_update(self) -> None:
        """``AsyncLLM.start_weight_update``."""
        await self.collective_rpc("start_weight_update", _route="start_weight_update")

    async def start_draft_weight_update(self) -> None:
        """``AsyncLLM.start_draft_weight_update`` (no draft model here: vLLM's error)."""
        await self.collective_rpc("start_draft_weight_update",
                                  _route="start_draft_weight_update")

    async def update_weights(self, request: Any) -> None:
        """``AsyncLLM.update_weights(request=WeightTransferUpdateRequest)``."""
        await self.collective_rpc("update_weights", kwargs={"update_info": request.update_info},
                                  _route="update_weights")

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``AsyncLLM.finish_weight_update``: the collective, then (a second utility call)
        the version."""
        await self.collective_rpc("finish_weight_update", _route="finish_weight_update")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        """``AsyncLLM.update_weight_version``: utility ``set_weight_version``."""

        async def work(inject: dict[int, str] | None) -> None:
            self.weight_version = new_version

        await self._utility(None, "set_weight_version", work)

    async def get_weight_version(self) -> str:
        """``AsyncLLM.get_weight_version``: utility ``get_weight_version`` (``"default"`` until
        a finish with a version)."""

        async def work(inject: dict[int, str] | None) -> str:
            return self.weight_version

        return await self._utility("weight_info", "get_weight_version", work)

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        """``AsyncLLM.compute_weight_checksums``: utility ``compute_weight_checksums``, one
        dict per worker."""

        async def work(inject: dict[int, str] | None) -> list[dict[str, str]]:
            return await self.executor.collective_rpc("compute_weight_checksums",
                                                      inject=inject)

        return await self._utility("weight_checker", "compute_weight_checksums", work)

    # -- AsyncLLM: sleep ----------------------------------------------------------------

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """``AsyncLLM.sleep`` -> ``EngineCore.sleep``: pause the scheduler (caches cleared
        from level 1), then from level 1 ``Executor.sleep(level)``."""

        async def work(inject: dict[int, str] | None) -> None:
            await self._pause_scheduler(mode, level >= 1, None)
            if level >= 1:
                await self.executor.sleep(level, inject)

        await self._utility("sleep", "sleep", work)
        self.counts["sleep_count"] += 1

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """``AsyncLLM.wake_up`` -> ``EngineCore.wake_up``: wake the executor's tags
        (``"scheduling"`` removed); resume the scheduler only once nothing sleeps. Returns
        whether the engine is fully awake."""

        async def work(inject: dict[int, str] | None) -> bool:
            t = tags
            if t is not None and "scheduling" in t:
                t = [x for x in t if x != "scheduling"]
            if t is None or t:
                await self.executor.wake_up(t, inject)
            fully_awake = not self.executor.is_sleeping
            if fully_awake:
                self.pause_state = _UNPAUSED
            return fully_awake

        awake = await self._utility("wake_up", "wake_up", work)
        self.counts["wake_count"] += 1
        return awake

    async def is_sleeping(self) -> bool:
        """``EngineCore.is_sleeping``: scheduler paused or executor sleeping."""

        async def work(inject: dict[int, str] | None) -> bool:
            return self.pause_state != _UNPAUSED or self.executor.is_sleeping

        return await self._utility("is_sleeping", "is_sleeping", work)

    async def release_kv_cache_memory(self) -> None:
        """``EngineCore.release_kv_cache_memory`` with nothing in flight."""

        async def work(inject: dict[int, str] | None) -> None:
            if self.pause_state == _UNPAUSED:
                raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
            if self.executor.is_sleeping:
                raise RuntimeError(
                    "release_kv_cache_memory() requires all executor memory to be resident"
                )
            self.executor.sleeping_tags |= {"kv_cache"}

        await self._utility("release_kv_cache_memory", "release_kv_cache_memory", work)

    # -- engine lifecycle (serve_http's watchdog and shutdown) --------------------------

    @property
    def errored(self) -> bool:
        """True once a worker process died (vLLM: the engine is dead; the server exits)."""
        return any(not w.process.is_alive() for w in self.pool.workers)

    @property
    def is_running(self) -> bool:
        """False once a worker process died."""
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        """As ``AsyncLLM.is_stopped``."""
        return self.errored

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the worker processes (serve_http runs it on SIGINT / SIGTERM). Idempotent."""
        if not self._closed:
            self._closed = True
            self.pool.close()

    # -- test-only control --------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """``GET /_slotsync/stats`` (the reference engine's shape, plus ``impl``,
        ``sleeping``, ``sleeping_tags``, ``unread_replies``). Asks the workers directly (not
        through the engine core or the executor's reply queues)."""
        answers = await asyncio.gather(*await self.pool.submit("stats"))
        workers = [p if ok else {"index": i, "error": str(p)}
                   for i, (ok, p) in enumerate(answers)]
        return {
            "impl": "vllm",
            "world_size": self.pool.world_size,
            "paused": self.pause_state != _UNPAUSED,
            "weight_version": self.weight_version,
            "packed": self.packed,
            **self.counts,
            "sleeping": self.pause_state != _UNPAUSED or self.executor.is_sleeping,
            "sleeping_tags": sorted(self.executor.sleeping_tags),
            "unread_replies": self.executor.unread_replies(),
            "route_counts": self.faults.route_counts,
            "faults": self.faults.as_json(),
            "workers": workers,
        }


class _RouteFaults:
    """Pure ASGI middleware applying faults to ``/get_world_size`` (which reads the config
    and calls no engine-core method): ``hang_s``, then a ``status`` >= 400 raises
    ``Exception`` (500 through vLLM's handlers, connection closed)."""

    ROUTES = frozenset({"/get_world_size"})

    def __init__(self, app: Any, client: VllmEngineClient) -> None:
        self.app = app
        self.client = client

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope.get("path") in self.ROUTES:
            f = self.client.faults.match(scope["path"].lstrip("/"))
            if f is not None:
                if f.hang_s:
                    await asyncio.sleep(f.hang_s)
                if f.workers is None and f.status >= 400:
                    raise Exception(f.text())
        await self.app(scope, receive, send)


def build_app(client: VllmEngineClient, log_error_stack: bool = False) -> Any:
    """The FastAPI app: vLLM's RL, sleep and dev-mode RPC (``POST /collective_rpc``) routers,
    vLLM's exception handlers, the test-only ``/_slotsync/`` routes. ``app.state.args``
    carries ``log_error_stack`` (read by vLLM's handlers)."""
    from fastapi import FastAPI
    from vllm.entrypoints.rl.online.api_router import router as rl_router
    from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc_router
    from vllm.entrypoints.serve.dev.sleep.api_router import router as sleep_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI()
    app.include_router(rl_router)
    app.include_router(sleep_router)
    app.include_router(rpc_router)
    app.state.engine_client = client
    app.state.args = argparse.Namespace(log_error_stack=log_error_stack)
    init_exception_handler(app)
    app.add_middleware(_RouteFaults, client=client)

    @app.get("/_slotsync/stats")
    async def slotsync_stats() -> JSONResponse:
        return JSONResponse(await client.stats())

    @app.post("/_slotsync/fault")
    async def slotsync_fault(raw_request: Request) -> JSONResponse:
        try:
            body = await raw_request.json()
        except ValueError:
            return JSONResponse({"detail": "Invalid JSON format"}, status_code=400)
        try:
            faults = client.faults.apply(body, client.pool.world_size)
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=400)
        return JSONResponse({"faults": faults})

    return app


async def serve(app: Any, client: VllmEngineClient, host: str, port: int,
                uds: str | None, where: str) -> None:
    """Bind (``create_server_socket`` / ``create_server_unix_socket``, vLLM's), serve with
    vLLM's ``serve_http`` until SIGINT / SIGTERM (it then calls ``client.shutdown``), print
    the ``serving`` line once uvicorn listens."""
    from vllm import envs
    from vllm.entrypoints.launchers.launcher import (
        create_server_socket,
        create_server_unix_socket,
        serve_http,
    )

    sock = create_server_unix_socket(uds) if uds else create_server_socket(
        (host, port), reuse_port=False)

    async def announce() -> None:
        while not getattr(getattr(app.state, "server", None), "started", False):
            await asyncio.sleep(0.05)
        print(f"[slotsync.engine] serving {where} (world size {client.pool.world_size}, "
              "impl vllm)", file=sys.stderr, flush=True)

    announcer = asyncio.create_task(announce())
    try:
        shutdown = await serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=False,
            host=host,
            port=port,
            log_level="info",
            access_log=True,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=None,
            ssl_certfile=None,
            ssl_ca_certs=None,
            ssl_cert_reqs=0,
            ssl_ciphers=None,
            h11_max_incomplete_event_size=None,
            h11_max_header_count=None,
        )
        await shutdown
    finally:
        announcer.cancel()
        sock.close()
        client.shutdown()

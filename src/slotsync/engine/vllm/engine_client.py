"""Stand-in for vLLM 0.32's ``AsyncLLM`` (``vllm/v1/engine/async_llm.py``) over the engine
core and executor it drives, as the vLLM-code engine's routers use it
(``app.state.engine_client``, ``slotsync.engine.vllm.server``).

* every engine-core call is a *utility call* run one at a time, in arrival order (the engine
  core's busy loop; an ``asyncio.Lock`` here), and its failure reaches the router as
  ``Exception(f"Call to {utility} method failed: {error}")`` (``EngineCoreProc.
  _invoke_utility_method`` + ``core_client`` ``future.set_exception(Exception(msg))``);
  ``collective_rpc`` calls are utility ``collective_rpc``, checksums
  ``compute_weight_checksums``, pause ``pause_scheduler``, and so on;
* the executor is ``slotsync.engine.vllm.executor.ExecutorStandIn``;
* pause mirrors ``EngineCoreProc.pause_scheduler`` with no requests in flight: the scheduler
  state, then ``collective_rpc("synchronize_device")`` and, with ``clear_cache``,
  ``reset_mm_cache`` / ``reset_encoder_cache`` on the workers; sleep / wake_up / is_sleeping
  mirror ``EngineCore.sleep / wake_up / is_sleeping`` and ``Executor.sleep / wake_up``
  (``sleeping_tags``); in 0.32 ``is_sleeping`` is ``scheduler paused or executor sleeping``,
  so a plain ``/pause`` makes ``/is_sleeping`` true;
* test-only faults (``slotsync.engine.faults``): a ``workers: null`` fault raises what
  ``AsyncLLM`` would (``Exception("Call to <utility> method failed: <message>")``; another
  ``status`` than 500 becomes a FastAPI ``HTTPException`` of that status) before any worker
  sees the call; a ``workers: [i]`` fault raises inside vLLM's weight transfer engine on
  worker ``i``; ``hang_s`` delays the call inside the engine core (later calls queue behind
  it, as behind a stuck utility call).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from slotsync.engine.faults import Fault, FaultTable
from slotsync.engine.lora_flags import LoraOptions
from slotsync.engine.pool import WorkerPool
from slotsync.engine.vllm.executor import ExecutorStandIn
from slotsync.engine.vllm.lora import LoraClientMixin

T = TypeVar("T")

_UNPAUSED, _PAUSED_NEW, _PAUSED_ALL = "UNPAUSED", "PAUSED_NEW", "PAUSED_ALL"


class VllmEngineClient(LoraClientMixin):
    """Stand-in for vLLM 0.32's ``AsyncLLM`` as the RL and sleep routers use it (see the
    module docstring). ``vllm_config`` is a real ``VllmConfig`` whose parallel config has
    ``tensor_parallel_size`` = the number of workers (``/get_world_size``).

    With ``pool.data_parallel_size`` D > 1 it stands in for the ``AsyncLLM`` of ``vllm serve
    --data-parallel-size D``: the parallel config has ``tensor_parallel_size`` = workers / D
    and ``data_parallel_size`` = D (so vLLM's ``/get_world_size`` answers D x TP with
    ``include_dp=true``, TP without), and the executor is
    ``slotsync.engine.vllm.dp.DPExecutorStandIn`` (every call on every DP engine core, as
    ``DPLBAsyncMPClient``).

    ``parallel_config`` (``--parallel-config``): more ``ParallelConfig`` fields, set by vLLM's
    own constructor (and validation) over the two above, as ``vllm serve``'s data-parallel
    flags set them on one node of a larger deployment (e.g. ``data_parallel_size`` = every DP
    rank of it, ``data_parallel_hybrid_lb``): what vLLM's ``/get_world_size`` and
    ``/server_info`` report; the executor still runs this server's own replicas.

    Args:
        pool: the worker processes (``slotsync.engine.vllm.worker``).
        replies: see :class:`ExecutorStandIn`.
        parallel_config: ``ParallelConfig`` fields over the defaults above, or None.
        lora: ``--enable-lora`` and its limits (issue 36: ``vllm_config.lora_config`` and
            the adapter calls, ``slotsync.engine.vllm.lora``); ``model_path``: the served
            model's name (``/v1/models``).
    """

    def __init__(self, pool: WorkerPool, replies: str = "vllm",
                 parallel_config: dict[str, Any] | None = None,
                 lora: LoraOptions | None = None, model_path: str = "") -> None:
        from vllm.config import ParallelConfig, VllmConfig
        from vllm.config.weight_transfer import WeightTransferConfig

        self.pool = pool
        dp = getattr(pool, "data_parallel_size", 1)
        if dp > 1:
            from slotsync.engine.vllm.dp import DPExecutorStandIn

            self.executor: Any = DPExecutorStandIn(pool, replies)
        else:
            self.executor = ExecutorStandIn(pool, replies)
        fields: dict[str, Any] = {"tensor_parallel_size": pool.world_size // dp,
                                  "data_parallel_size": dp, **(parallel_config or {})}
        self.vllm_config = VllmConfig(
            parallel_config=ParallelConfig(**fields),
            weight_transfer_config=WeightTransferConfig(backend="ipc"),
        )
        self.init_lora(model_path or "slotsync-vllm-code", lora or LoraOptions())
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
        """``AsyncLLM.start_draft_weight_update``: ``collective_rpc`` of vLLM's
        ``Worker.start_draft_weight_update`` (the worker's draft model is
        ``--draft-model``'s; without one, vLLM's error)."""
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
                                                      inject=inject, every_engine=True)

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
            "data_parallel_size": getattr(self.pool, "data_parallel_size", 1),
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

"""HTTP front of the vLLM-code engine (``python -m slotsync.engine --impl vllm``).

The routes are vLLM's own: a FastAPI app that includes vLLM 0.32's RL router
(``vllm.entrypoints.rl.online.api_router.router``: pause / resume / is_paused, the weight
transfer routes, ``/weight_info``, ``/weight_checker``, ``/get_world_size``) and its sleep router
(``vllm.entrypoints.serve.dev.sleep.api_router.router``: ``/sleep``, ``/wake_up``,
``/is_sleeping``) and dev-mode RPC router (``vllm.entrypoints.serve.dev.rpc.api_router``:
``POST /collective_rpc``) and basic router (``vllm.entrypoints.serve.instrumentator.basic``:
``GET /version``, the installed vllm's own) and dev-mode server-info router
(``vllm.entrypoints.serve.dev.server_info.api_router``: ``GET /server_info``, the client's
``vllm_config`` as ``app.state.vllm_config``, as ``vllm serve`` sets it; only its
``system_env`` part, ``vllm.collect_env.get_env_info()`` -- pip, nvidia-smi and more, about 4 s
per process on CPU -- is a stand-in that says so, since the daemon reads only
``vllm_config``), with vLLM's exception handlers
(``vllm.entrypoints.serve.exception_handling.register.init_exception_handler``), served by
vLLM's own ``vllm.entrypoints.launchers.launcher.serve_http`` (uvicorn, ``NoSignalServer``,
its SIGINT / SIGTERM handling and engine watchdog) with the arguments vLLM's
``api_server/entry.py build_and_serve`` passes by default (``timeout_keep_alive =
VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, vLLM's h11 limits, access log on). So a failed weight call
is a 500 raised through Starlette's ``ServerErrorMiddleware``, after which uvicorn closes the
connection, exactly as ``vllm serve`` does. vLLM's own middleware goes on as ``vllm serve``'s
``build_app`` puts it (``serve/middleware/register.py`` ``init_entrypoints_middleware``, after
the exception handlers): with ``VLLM_API_KEY`` in the engine's environment (what vLLM reads
when ``--api-key`` is not given) that is vLLM's ``AuthenticationMiddleware``, which answers
``401 {"error": "Unauthorized"}`` on ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` without
``Authorization: Bearer <key>`` -- and leaves every weight-transfer route open (issue 35).

``app.state.engine_client`` is ``slotsync.engine.vllm.engine_client.VllmEngineClient``, a
stand-in for vLLM 0.32's ``AsyncLLM`` over the engine core and the executor
(``slotsync.engine.vllm.executor.ExecutorStandIn``); both are re-exported here.

LoRA adapters (issue 36, ``slotsync.engine.vllm.lora``): vLLM's own LoRA router
(``serve/lora/api_router.py``, with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) and models router
over its own ``OpenAIServingModels``; the workers load folders with vLLM's own
``LRUCacheWorkerLoRAManager``.

Test-only control routes, same shapes as the reference engine's
(``slotsync.engine.reference.server``):
``GET /_slotsync/stats`` and ``POST /_slotsync/fault`` (``slotsync.engine.faults``). A
``workers: null`` fault makes the client stand-in raise what ``AsyncLLM`` would (``Exception
("Call to <utility> method failed: <message>")``; another ``status`` than 500 becomes a FastAPI
``HTTPException`` of that status) before any worker sees the call, so vLLM's router and
handlers answer it (and close the connection after a 500); pause / resume / is_paused catch
it themselves (``{"error": "Failed to pause generation: ..."}``). A ``workers: [i]`` fault
raises inside vLLM's weight transfer engine on worker ``i`` (``slotsync.engine.vllm.worker``).
``hang_s`` delays the call inside the engine core (later calls queue behind it, as behind a
stuck utility call). ``/get_world_size`` reads the config without the engine core; its faults
are applied by an ASGI middleware (hang, then a 500 raised through vLLM's handlers), and so
are ``/version``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from slotsync.engine.vllm.engine_client import VllmEngineClient
from slotsync.engine.vllm.executor import WORKER_FAILED, ExecutorStandIn, WorkerCallError

__all__ = ["WORKER_FAILED", "ExecutorStandIn", "VllmEngineClient", "WorkerCallError",
           "build_app", "serve"]


class _RouteFaults:
    """Pure ASGI middleware applying faults to ``/get_world_size`` and ``/version`` (which
    call no engine-core method): ``hang_s``, then a ``status`` >= 400 raises
    ``Exception`` (500 through vLLM's handlers, connection closed)."""

    ROUTES = frozenset({"/get_world_size", "/version"})

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


SYSTEM_ENV_STANDIN = {"slotsync_engine": "vllm.collect_env.get_env_info() not run (the "
                      "vLLM-code engine's stand-in: seconds of pip and nvidia-smi per process, "
                      "and slotsyncd reads only vllm_config)"}
"""What this engine's ``/server_info`` answers as ``system_env``."""


def build_app(client: VllmEngineClient, log_error_stack: bool = False) -> Any:
    """The FastAPI app: vLLM's RL, sleep, dev-mode RPC (``POST /collective_rpc``) and
    server-info (``GET /server_info``) routers, vLLM's exception handlers, the test-only
    ``/_slotsync/`` routes. ``app.state.args`` carries ``log_error_stack`` (read by vLLM's
    handlers), ``app.state.vllm_config`` the client's (read by ``/server_info``)."""
    from fastapi import FastAPI
    from vllm.entrypoints.rl.online.api_router import router as rl_router
    from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc_router
    from vllm.entrypoints.serve.dev.server_info import api_router as server_info_api
    from vllm.entrypoints.serve.dev.sleep.api_router import router as sleep_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.instrumentator.basic import router as basic_router
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    app = FastAPI()
    app.include_router(rl_router)
    app.include_router(sleep_router)
    app.include_router(rpc_router)
    # vLLM's own GET /version (and /load, /kv_event_sources): the installed vllm's version
    app.include_router(basic_router)
    # vLLM's dev-mode GET /server_info (the daemon reads the DP layout: daemon/vllm/dp_layout.py)
    server_info_api._get_system_env_info_cached = lambda: dict(SYSTEM_ENV_STANDIN)
    app.include_router(server_info_api.router)
    app.state.engine_client = client
    app.state.vllm_config = client.vllm_config
    app.state.args = argparse.Namespace(log_error_stack=log_error_stack)
    init_exception_handler(app)
    # vLLM's own middleware, as vllm serve's build_app adds it: CORS, and its
    # AuthenticationMiddleware when VLLM_API_KEY is set (--api-key's stand-in, read by vLLM)
    init_entrypoints_middleware(argparse.Namespace(
        allowed_origins=[], allow_credentials=False, allowed_methods=["*"],
        allowed_headers=["*"], api_key=None, enable_request_id_headers=False,
        middleware=[]), app, ())
    app.add_middleware(_RouteFaults, client=client)
    # issue 36: vLLM's LoRA and models routers over its OpenAIServingModels (engine/vllm/lora.py)
    from slotsync.engine.vllm.lora import attach as attach_lora

    attach_lora(app, client)

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

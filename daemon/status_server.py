"""The daemon's HTTP status server (aiohttp): ``/healthz``, ``/status`` (JSON), ``/metrics``.

Binds loopback by default; it reports state and never changes it.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slotsync.daemon.metrics import Metrics


class StatusServer:
    """Serves ``status()`` (a JSON-able dict) and the metrics registry.

    Args:
        host, port: bind address; port 0 picks a free port (see ``port`` after ``start``).
        status: returns the ``/status`` document.
        metrics: the daemon's metrics.
    """

    def __init__(self, host: str, port: int, status: Callable[[], dict], metrics: Metrics):
        self.host = host
        self.port = port
        self._status = status
        self._metrics = metrics
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/status", self._status_route)
        app.router.add_get("/metrics", self._metrics_route)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server  # the asyncio server: read back the bound port when port=0
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _status_route(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    async def _metrics_route(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

"""The daemon's HTTP status server (aiohttp): ``/healthz``, ``/status`` (JSON), ``/metrics``,
and one operator action, ``POST /slots/drop``.

Binds loopback by default. The GET routes report state and never change it; ``/slots/drop``
(``slotsync slots drop``) is answered only for a client on a loopback address, whatever the
bind address: it changes what the daemon holds.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slotsync.daemon.service.metrics import Metrics


class StatusServer:
    """Serves ``status()`` (a JSON-able dict) and the metrics registry.

    Args:
        host, port: bind address; port 0 picks a free port (see ``port`` after ``start``).
        status: returns the ``/status`` document.
        metrics: the daemon's metrics.
    """

    def __init__(self, host: str, port: int, status: Callable[[], dict], metrics: Metrics,
                 drop: Callable[[tuple[int, int], bool], Awaitable[dict]] | None = None):
        self.host = host
        self.port = port
        self._status = status
        self._metrics = metrics
        self._drop = drop
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/status", self._status_route)
        app.router.add_get("/metrics", self._metrics_route)
        app.router.add_post("/slots/drop", self._drop_route)
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

    async def _drop_route(self, request: web.Request) -> web.Response:
        """``POST /slots/drop`` with ``{"slot": [start, end], "force": false}``: 200 with the
        outcome, 400 for a bad body, 403 off loopback, 404 for no such slot, 409 when an update
        runs (without ``force``), 503 without a drop handler."""
        try:
            loopback = ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            return web.json_response({"error": f"slot drop is answered on loopback only, not "
                                      f"for {request.remote}"}, status=403)
        if self._drop is None:
            return web.json_response({"error": "this daemon takes no drop"}, status=503)
        try:
            body = await request.json()
            start, end = (int(x) for x in body["slot"])
            force = bool(body.get("force", False))
            if not 0 <= start < end:
                raise ValueError(f"empty or negative slot [{start}, {end})")
        except (ValueError, TypeError, KeyError) as e:
            return web.json_response({"error": f'body must be {{"slot": [start, end], '
                                      f'"force": false}}: {e}'}, status=400)
        try:
            return web.json_response(await self._drop((start, end), force))
        except KeyError as e:
            return web.json_response({"error": e.args[0]}, status=404)
        except RuntimeError as e:
            return web.json_response({"error": str(e)}, status=409)

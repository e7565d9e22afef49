"""A stand-in engine in the test's own event loop: an aiohttp app on a free loopback port
whose handler the test writes (to script what ``/get_world_size`` and the other routes
answer). Shared by the integration tests that drive an in-process ``Daemon`` (issue 24:
three copies of these lines; :func:`serving` for a block, issue 36's adapter tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web


async def serve_engine(handler: Callable[[web.Request], Awaitable[web.Response]],
                       method: str = "*", path: str = "/{route}") -> tuple[web.AppRunner, str]:
    """Serve ``handler`` for ``method`` ``path`` on 127.0.0.1 (a free port); returns the
    runner (``await runner.cleanup()`` when done) and the base URL."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@asynccontextmanager
async def serving(handler: Callable[[web.Request], Awaitable[web.Response]],
                  method: str = "*", path: str = "/{route}") -> AsyncIterator[str]:
    """:func:`serve_engine` for the block: its base URL; the runner cleaned up after it."""
    runner, url = await serve_engine(handler, method, path)
    try:
        yield url
    finally:
        await runner.cleanup()

"""Without an engine table, a wrong slot claim is refused at registration against a real
daemon (issue 24, daemon/core/claim_check.py): its engine reports fewer workers than the slot, the
ranks are told both numbers and the URL, and the right claim registers at once after."""

from __future__ import annotations

import asyncio

import zmq
from aiohttp import web
from fake_http_engine import serve_engine
from test_daemon_liveness import Rank

from slotsync.daemon.service.config import Config
from slotsync.daemon.service.server import Daemon
from slotsync.protocol import wire


async def test_a_claim_larger_than_its_engine_is_refused_then_the_right_one_registers(
        tmp_path):
    asked: list[str] = []

    async def vllm(request: web.Request) -> web.Response:  # a 1-worker engine
        asked.append(request.path)
        return web.json_response({"world_size": 1})

    runner, url = await serve_engine(vllm, "GET", "/get_world_size")
    d = Daemon(Config(runtime_dir=str(tmp_path / "rt"), status_port=-1))
    await d.start()
    ctx = zmq.Context()
    ranks: list[Rank] = []
    try:
        def register(rank: int, size: int) -> wire.FromDaemon:
            ranks.append(Rank(ctx, d.endpoint, rank, size=size, url=url))
            return ranks[-1].reply

        err = await asyncio.to_thread(register, 0, 2)  # a dense default of 2 GPUs per engine
        assert isinstance(err, wire.Error) and err.phase == "register", err
        assert f"engine {url} has 1 workers" in err.message, err.message
        assert "claim slot [0, 2) of 2 ranks" in err.message, err.message
        assert asked == ["/get_world_size"]
        ok = await asyncio.to_thread(register, 0, 1)  # the right claim: not locked out
        assert isinstance(ok, wire.Registered) and (ok.slot_start, ok.slot_size) == (0, 1), ok
    finally:
        for r in ranks:
            r.close()
        ctx.destroy(linger=0)
        await d.stop()
        await runner.cleanup()

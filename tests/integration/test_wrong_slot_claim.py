"""Without an engine table, a wrong slot claim is refused at registration against a real
daemon (issue 24, daemon/core/claim_check.py): its engine reports fewer workers than the slot, the
ranks are told both numbers and the URL, and the right claim registers at once after."""

from __future__ import annotations

import asyncio

from aiohttp import web
from fake_http_engine import serving
from in_process_daemon import running_daemon

from slotsync.protocol import wire


async def test_a_claim_larger_than_its_engine_is_refused_then_the_right_one_registers(
        tmp_path):
    asked: list[str] = []

    async def vllm(request: web.Request) -> web.Response:  # a 1-worker engine
        asked.append(request.path)
        return web.json_response({"world_size": 1})

    async with (serving(vllm, "GET", "/get_world_size") as url,
                running_daemon(tmp_path) as rig):
        def register(rank: int, size: int) -> wire.FromDaemon:
            return rig.register(rank, size=size, url=url).reply

        err = await asyncio.to_thread(register, 0, 2)  # a dense default of 2 GPUs per engine
        assert isinstance(err, wire.Error) and err.phase == "register", err
        assert f"engine {url} has 1 workers" in err.message, err.message
        assert "claim slot [0, 2) of 2 ranks" in err.message, err.message
        assert asked == ["/get_world_size"]
        ok = await asyncio.to_thread(register, 0, 1)  # the right claim: not locked out
        assert isinstance(ok, wire.Registered) and (ok.slot_start, ok.slot_size) == (0, 1), ok

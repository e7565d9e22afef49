"""A registered rank's malformed message against a real slotsyncd (issue 24): every rank of
the slot is told at once, naming the rank, the message kind and the field, instead of the
update going on to fail later with another cause or at a deadline."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web
from fake_http_engine import serving
from in_process_daemon import Rank, running_daemon

from slotsync.protocol import wire


async def test_a_malformed_chunk_fails_the_update_at_once_naming_rank_kind_and_field(tmp_path):
    # a 2-worker "engine" that answers /get_world_size (the registration's claim check) and
    # nothing else: the begin's next call stays out, so the update is in flight, the engine
    # never paused, when the bad chunk arrives
    routes: list[str] = []
    never = asyncio.Event()

    async def vllm(request: web.Request) -> web.Response:
        routes.append(request.path)
        if request.path == "/get_world_size" and routes.count(request.path) == 1:
            return web.json_response({"world_size": 2})
        await never.wait()
        return web.json_response({})

    async with serving(vllm) as url, running_daemon(tmp_path) as rig:
        def conversation() -> list[wire.FromDaemon]:
            ranks = [Rank(rig.ctx, rig.d.endpoint, r, size=2, url=url) for r in (0, 1)]
            try:
                assert all(isinstance(r.reply, wire.Registered) for r in ranks)
                for r in ranks:
                    r.s.send(wire.encode(wire.Begin(0, "v")))
                ranks[1].s.send(msgspec.msgpack.encode({
                    "type": "chunk", "update_id": 0, "index": 0, "names": [], "dtype_names": [],
                    "shapes": [], "tensor_sizes": [], "handles": []}))
                got = []
                for r in ranks:
                    assert r.s.poll(20_000), "no reply: the malformed chunk was dropped"
                    got.append(wire.decode_from_daemon(r.s.recv()))
                return got
            finally:
                for r in ranks:
                    r.close()

        try:
            for err in await asyncio.to_thread(conversation):
                assert isinstance(err, wire.Error) and err.update_id == 0, err
                assert err.phase == "chunk", err
                assert "rank 1 sent a chunk message" in err.message, err.message
                assert "(field 'names')" in err.message, err.message
            assert "/pause" not in routes
        finally:
            never.set()  # (the engine's held answer: before the daemon stops)

"""The daemon's vLLM client against the reference engine's routes (real HTTP)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")  # the reference engine's workers need torch

from slotsync.daemon.vllm.client import EngineError, VllmClient, error_message  # noqa: E402
from slotsync.engine.launcher import free_port  # noqa: E402


async def test_round_of_routes_and_errors(engine):
    seen = []
    c = VllmClient(engine.url, timeout_s=10, observe=lambda r, s, ok: seen.append((r, ok)))
    try:
        assert (await c.call("get_world_size"))["world_size"] == 2
        await c.call("init_weight_transfer_engine", {"init_info": {"packed": True}})
        assert (await c.call("pause"))["status"] == "paused"
        assert (await c.call("is_paused"))["is_paused"] is True
        await c.call("start_weight_update")
        with pytest.raises(EngineError) as ei:
            await c.call("start_weight_update")
        assert ei.value.status == 500 and "already active" in ei.value.message
        await c.call("finish_weight_update", {"weight_version": "v7"})
        assert (await c.call("weight_info"))["weight_version"] == "v7"
        with pytest.raises(EngineError, match="finish_weight_update: HTTP 500"):
            await c.call("finish_weight_update")
        await c.call("resume")
        with pytest.raises(EngineError) as ei:
            await c.call("update_weights", {})
        assert ei.value.status == 400 and "update_info" in ei.value.message
    finally:
        await c.close()
    assert ("get_world_size", True) in seen and ("start_weight_update", False) in seen


async def test_hanging_engine_hits_timeout(engine):
    engine.request("POST", "/_slotsync/fault", {"route": "pause", "hang_s": 3, "status": 200})
    c = VllmClient(engine.url, timeout_s=0.5)
    try:
        with pytest.raises(EngineError, match="no answer within 0.5 s"):
            await c.call("pause")
    finally:
        await c.close()
        engine.request("POST", "/_slotsync/fault", {"clear": True})


async def test_unreachable_engine():
    c = VllmClient(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    try:
        with pytest.raises(EngineError) as ei:
            await c.call("get_world_size")
        assert ei.value.status == 0 and "cannot reach" in ei.value.message
    finally:
        await c.close()


def test_error_message_shapes():
    assert error_message({"error": {"message": "m"}}, "") == "m"
    assert error_message({"error": "paused failed"}, "") == "paused failed"
    assert error_message({"detail": "Missing 'x'"}, "") == "Missing 'x'"
    assert error_message(None, "plain text") == "plain text"


class _ClosingServer:
    """A raw HTTP/1.1 server that answers like vLLM behind uvicorn where the daemon can tell:
    a 500 for ``/finish_weight_update``, 200 otherwise, keep-alive headers either way; a
    connection that carried a 500 is dead afterwards (uvicorn closes it right after the
    response): the next request written on it is dropped with a reset. Deterministic stand-in
    for the race the daemon lost against vLLM (the reset arrives before the FIN is seen)."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[int, str]] = []  # (connection number, path)
        self.server = None

    async def start(self) -> str:
        import asyncio

        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer) -> None:
        import socket
        import struct

        self.connections += 1
        conn, dead = self.connections, False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split()[1]
                length = next((int(x.split(":")[1]) for x in lines
                               if x.lower().startswith("content-length:")), 0)
                if length:
                    await reader.readexactly(length)
                if dead:  # the client wrote on a connection the server had closed
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.close()
                    return
                self.requests.append((conn, path))
                failed = path == "/finish_weight_update"
                body = (b'{"error": {"message": "Call to collective_rpc method failed: x", '
                        b'"type": "InternalServerError", "param": null, "code": 500}}'
                        if failed else b'{"message": "ok"}')
                status = b"500 Internal Server Error" if failed else b"200 OK"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
                dead = failed
        except Exception:  # noqa: BLE001 - client went away
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def test_call_after_a_500_uses_a_fresh_connection():
    """Defect 1 of issue 14: after vLLM's 500 (uvicorn closes that connection) the recovery
    finish is followed by a start; on the pooled dead connection it failed with "Connection
    reset by peer". Now a 5xx retires the pooled connections."""
    srv = _ClosingServer()
    url = await srv.start()
    c = VllmClient(url, timeout_s=5)
    try:
        await c.call("pause")
        with pytest.raises(EngineError) as ei:
            await c.call("finish_recover")
        assert ei.value.status == 500
        await c.call("start_weight_update")  # a POST: never retried, so it must go out fresh
        assert srv.requests[-1][1] == "/start_weight_update"
        assert srv.requests[-1][0] != srv.requests[-2][0]  # another connection than the 500's
        assert c.connection_errors == 0
    finally:
        await c.close()
        await srv.stop()


async def test_probe_retried_once_after_connection_error(engine):
    """A connection error on an idempotent probe (a GET) is retried once on a fresh connection
    and counted (a possible engine restart); a POST is not retried."""
    c = VllmClient(engine.url, timeout_s=5)
    try:
        assert (await c.call("get_world_size"))["world_size"] == 2
        fails = {"n": 0}
        real = c._session.request

        def flaky(*a, **kw):  # the first attempt finds a reset connection (engine restarted)
            if not fails["n"]:
                fails["n"] += 1
                raise __import__("aiohttp").ClientOSError(104, "Connection reset by peer")
            return real(*a, **kw)

        c._session.request = flaky  # noqa: SLF001
        assert (await c.call("weight_info"))["weight_version"]
        assert c.connection_errors == 1
        c._session.request = flaky
        fails["n"] = 0
        with pytest.raises(EngineError) as ei:
            await c.call("resume")
        assert ei.value.status == 0 and "reset" in ei.value.message
        assert c.connection_errors == 2
    finally:
        await c.close()


@pytest.mark.vllm
async def test_recovery_after_a_vllm_500_on_vllms_own_server():
    """Issue 14 defect 1, against vLLM's own router, exception handlers and uvicorn: a
    worker's failure is a 500 raised through Starlette's ServerErrorMiddleware, after which
    uvicorn closes the connection. The recovery finish (500 again) and the start after it
    must both get answers from the engine, not "Connection reset by peer"."""
    from engines import start_engine, vllm_importable

    why = vllm_importable()
    if why:
        pytest.skip(f"vllm cannot be imported: {why}")
    with start_engine(1, impl_name="vllm") as eng:
        c = VllmClient(eng.url, timeout_s=30)
        try:
            await c.call("init_weight_transfer_engine", {"init_info": {"packed": True}})
            await c.call("pause")
            await c.call("start_weight_update")
            eng.request("POST", "/_slotsync/fault", {"route": "update_weights",
                                                     "workers": [0]})
            with pytest.raises(EngineError) as ei:  # a bare chunk fails on the worker
                await c.call("update_weights", {"update_info": {
                    "names": [], "dtype_names": [], "shapes": [],
                    "ipc_handles_pickled": "gAR9lC4=", "tensor_sizes": []}})
            assert ei.value.status == 500
            for _ in range(5):  # the daemon's recovery, round after round
                with pytest.raises(EngineError) as ei:
                    await c.call("finish_recover")
                assert ei.value.status == 500 and "without a matching" in ei.value.message
                await c.call("start_weight_update")
                await c.call("finish_weight_update", {"weight_version": "v"})
            assert c.connection_errors == 0
            assert (await c.call("weight_info"))["weight_version"] == "v"
        finally:
            await c.close()

"""The daemon's vLLM client against the reference engine's routes (real HTTP)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")  # the reference engine's workers need torch

from slotsync.daemon.vllm_client import EngineError, VllmClient, error_message  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine, free_port  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    with ReferenceEngine(workers=2) as eng:
        yield eng


async def test_round_of_routes_and_errors(engine):
    seen = []
    c = VllmClient(engine.url, timeout_s=10, observe=lambda r, s, ok: seen.append((r, ok)))
    try:
        assert await c.call("get_world_size") == {"world_size": 2}
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

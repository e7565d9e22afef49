"""Reference engine (slotsync.engine) against vLLM 0.33's weight-transfer contract.

One 2-worker CPU engine serves the whole module (each worker process imports torch, so
engines are expensive on a small machine); ``clean`` brings it back to a known state before
each test. Handles are the CPU shared-memory stand-in (``ShmHandle``), pickled by the daemon's
own writer (``slotsync.daemon.vllm.ipc_pickle``), keyed by each worker's logical GPU UUID.

Over ~500 lines on purpose: it holds one thing, the reference engine's contract tests, on the
one module-scoped engine they share (issue 16).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from shm_payloads import (
    Segments,
    bytes_of,
    packed_info,
    sample_tensors,
    unpacked_info,
)

from slotsync.engine.checksum import tensor_checksum
from slotsync.engine.launcher import EngineStartError, ReferenceEngine
from slotsync.protocol.wire import ShmHandle, logical_gpu_uuid

ALREADY_ACTIVE = "start_weight_update called while a weight update is already active"
FINISH_NO_START = "finish_weight_update called without a matching start_weight_update"


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def stats(eng: ReferenceEngine) -> dict[str, Any]:
    status, body = eng.request("GET", "/_slotsync/stats")
    assert status == 200, body
    return body


def err_message(body: Any) -> str:
    return body["error"]["message"]


def checksums(eng: ReferenceEngine) -> dict[str, dict[str, str]]:
    status, body = eng.request("POST", "/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------


# (fixture ``engine``, a reference engine with two workers: tests/conftest.py)


@pytest.fixture
def eng(engine: ReferenceEngine) -> ReferenceEngine:
    """The module's engine, with no faults, no active update, resumed, unpacked."""
    engine.request("POST", "/_slotsync/fault", {"clear": True})
    engine.request("POST", "/finish_weight_update")  # tolerate 500 (nothing active)
    assert not any(w["active"] for w in stats(engine)["workers"])
    engine.request("POST", "/resume")
    status, _ = engine.request("POST", "/init_weight_transfer_engine", {"init_info": {}})
    assert status == 200
    return engine


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_fresh_engine_reports_defaults(engine: ReferenceEngine) -> None:
    # world_size exactly as vLLM's; gpu_uuids: the one sanctioned extension
    assert engine.request("GET", "/get_world_size") == (
        200, {"world_size": 2, "gpu_uuids": [logical_gpu_uuid(0), logical_gpu_uuid(1)]})
    assert engine.request("GET", "/get_world_size?include_dp=false")[1]["world_size"] == 2
    assert engine.request("GET", "/weight_info") == (200, {"weight_version": "default"})
    assert engine.request("GET", "/is_paused") == (200, {"is_paused": False})
    assert engine.request("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    s = stats(engine)
    assert [w["gpu_uuid"] for w in s["workers"]] == [logical_gpu_uuid(0), logical_gpu_uuid(1)]
    assert engine.gpu_uuids == [logical_gpu_uuid(0), logical_gpu_uuid(1)]


def test_start_finish_state_machine(eng: ReferenceEngine) -> None:
    assert eng.request("POST", "/start_weight_update") == (
        200,
        {"message": "Weight update started"},
    )
    status, body = eng.request("POST", "/start_weight_update")
    assert status == 500
    assert body["error"]["type"] == "InternalServerError" and body["error"]["code"] == 500
    assert body["error"]["param"] is None
    msg = err_message(body)
    assert msg.startswith("Call to collective_rpc method failed: Worker failed with error '")
    assert ALREADY_ACTIVE in msg and "Call finish_weight_update first." in msg
    assert msg.endswith("please check the stack trace above for the root cause")
    status, body = eng.request("POST", "/finish_weight_update", {"weight_version": "step-1"})
    assert (status, body) == (200, {"message": "Weight update finished"})
    assert eng.request("GET", "/weight_info") == (200, {"weight_version": "step-1"})
    status, body = eng.request("POST", "/finish_weight_update", {"weight_version": "bad"})
    assert status == 500 and FINISH_NO_START in err_message(body)
    assert eng.request("GET", "/weight_info") == (200, {"weight_version": "step-1"})
    status, body = eng.request("POST", "/update_weights", {"update_info": {"names": []}})
    assert status == 500
    assert "start_weight_update must be called before update_weights" in err_message(body)
    w = stats(eng)["workers"]
    assert all(x["start_count"] >= 1 and x["finish_count"] >= 1 for x in w)


def test_pause_resume(eng: ReferenceEngine) -> None:
    assert eng.request("POST", "/pause?mode=keep") == (200, {"status": "paused"})
    assert eng.request("GET", "/is_paused") == (200, {"is_paused": True})
    assert eng.request("POST", "/resume") == (200, {"status": "resumed"})
    assert eng.request("GET", "/is_paused") == (200, {"is_paused": False})
    # vLLM's validation handler: 400 (not FastAPI's 422), param "query.mode"
    status, body = eng.request("POST", "/pause?mode=sideways")
    assert status == 400 and body["error"]["param"] == "query.mode"
    assert body["error"]["type"] == "Bad Request"
    assert body["error"]["message"].startswith("1 validation error:\n  {'type': 'literal_error'")
    s = stats(eng)
    assert s["pause_count"] >= 1 and s["resume_count"] >= 1


def missing_key_400(key: str) -> tuple[int, dict]:
    """vLLM 0.32's answer to a body without its ``Body(embed=True)`` key (pydantic's error as
    vLLM's validation handler formats it; test_vllm_engine.py checks vLLM's own)."""
    err = {"type": "missing", "loc": f"body.{key}", "msg": "Field required", "input": "None"}
    return 400, {"error": {"message": f"1 validation error:\n  {err}", "type": "Bad Request",
                           "param": f"body.{key}", "code": 400}}


def test_bad_bodies_are_400(eng: ReferenceEngine) -> None:
    assert eng.request("POST", "/update_weights", {}) == missing_key_400("update_info")
    assert eng.request("POST", "/init_weight_transfer_engine", {}) == missing_key_400(
        "init_info")
    status, body = eng.request("POST", "/init_weight_transfer_engine", {"init_info": {"x": 1}})
    assert status == 500 and "unexpected keyword argument 'x'" in err_message(body)
    assert "Invalid init_info for IPCWeightTransferEngine: " in err_message(body)
    # /update_weights forwards update_info's JSON text to the workers: the front still
    # answers 400 for a body that is not JSON or not an object
    for raw, want in ((b'{"update_info": {"names": [}}', "Invalid JSON format"),
                      (b"[1, 2]", "Request body must be a JSON object"),
                      (b'{"update_info": null}', missing_key_400("update_info")[1])):
        req = urllib.request.Request(eng.url + "/update_weights", data=raw, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(e.value.read())
        assert e.value.code == 400
        assert body == want if isinstance(want, dict) else body["error"]["message"] == want
    assert eng.request("POST", "/start_weight_update")[0] == 200
    # neither an object nor a list: FastAPI's 400 for vLLM's ``dict | list[dict]`` before any
    # worker sees it (issue 18; test_dp_engines.py compares it with vLLM's), session kept
    status, body = eng.request("POST", "/update_weights", {"update_info": "names"})
    assert status == 400 and body["error"]["param"] == "body.update_info", body
    assert body["error"]["message"].startswith("2 validation errors:\n  {'type': 'dict_type'")
    assert all(w["active"] for w in stats(eng)["workers"])


def test_unpacked_shm_update_end_to_end(eng: ReferenceEngine, segs: Segments) -> None:
    tensors = sample_tensors(1)
    assert eng.request("POST", "/start_weight_update")[0] == 200
    info = unpacked_info(tensors, eng.gpu_uuids, segs)
    assert eng.request("POST", "/update_weights", {"update_info": info}) == (
        200,
        {"message": "Weights updated"},
    )
    # parameters are on the meta device until finish
    status, body = eng.request("POST", "/weight_checker", {"action": "checksum"})
    assert status == 500 and "Cannot copy out of meta tensor; no data!" in err_message(body)
    assert err_message(body).startswith("Call to compute_weight_checksums method failed: ")
    assert eng.request("POST", "/finish_weight_update", {"weight_version": "u1"})[0] == 200
    assert eng.request("GET", "/weight_info")[1] == {"weight_version": "u1"}
    want = {n: tensor_checksum(t) for n, t in tensors.items()}
    sums = checksums(eng)
    assert set(sums) == set(eng.gpu_uuids)
    for u in eng.gpu_uuids:
        assert {n: sums[u][n] for n in want} == want
    status, body = eng.request("POST", "/weight_checker", {"action": "compare", "baseline": want})
    assert (status, body) == (200, {"match": True, "mismatches": []})
    bad = {**want, "model.norm.weight": "0" * 64}
    status, body = eng.request("POST", "/weight_checker", {"action": "compare", "baseline": bad})
    assert status == 200 and body["match"] is False
    assert {m["gpu_uuid"] for m in body["mismatches"]} == set(eng.gpu_uuids)
    assert eng.request("POST", "/weight_checker", {"action": "reset"})[0] == 200
    w = stats(eng)["workers"]
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(x["bytes_loaded"] >= nbytes and x["servable"] for x in w)


def test_packed_shm_update_reuses_buffer(eng: ReferenceEngine, segs: Segments) -> None:
    """Two chunks through one buffer per worker, overwritten between chunks (the engine
    clones each tensor out before answering)."""
    assert (
        eng.request("POST", "/init_weight_transfer_engine", {"init_info": {"packed": True}})[0]
        == 200
    )
    assert stats(eng)["packed"] is True
    tensors = sample_tensors(2)
    items = list(tensors.items())
    chunks = [dict(items[:2]), dict(items[2:])]
    cap = 4096
    bufs = {u: segs.put(b"", size=cap) for u in eng.gpu_uuids}
    assert eng.request("POST", "/start_weight_update")[0] == 200
    before = {w["index"]: w["update_count"] for w in stats(eng)["workers"]}
    for chunk in chunks:
        data = b"".join(bytes_of(t) for t in chunk.values())
        for shm in bufs.values():
            shm.buf[: len(data)] = data
        by_uuid = {u: ShmHandle(segment=shm.name, offset=0, nbytes=cap) for u, shm in bufs.items()}
        status, body = eng.request(
            "POST", "/update_weights", {"update_info": packed_info(chunk, by_uuid)}
        )
        assert status == 200, body
    for shm in bufs.values():  # scribble: must not affect what was loaded
        shm.buf[:cap] = b"\xff" * cap
    assert eng.request("POST", "/finish_weight_update", {"weight_version": "p1"})[0] == 200
    want = {n: tensor_checksum(t) for n, t in tensors.items()}
    status, body = eng.request("POST", "/weight_checker", {"action": "compare", "baseline": want})
    assert (status, body) == (200, {"match": True, "mismatches": []})
    after = {w["index"]: w["update_count"] for w in stats(eng)["workers"]}
    assert all(after[i] - before[i] == 2 for i in after)


def test_packed_chunk_seen_before_is_loaded_from_its_plan(eng: ReferenceEngine, segs: Segments
                                                         ) -> None:
    """Rounds re-send the same chunks: from the second in-place load on, a worker copies a
    chunk out through the plan it remembered (no per-tensor parse or checks), and still
    loads the new bytes; a chunk that differs in any list, or lacks the worker's UUID, takes
    the full checks and fails as before."""
    eng.request("POST", "/init_weight_transfer_engine", {"init_info": {"packed": True}})
    cap = 4096
    bufs = {u: segs.put(b"", size=cap) for u in eng.gpu_uuids}
    by_uuid = {u: ShmHandle(segment=shm.name, offset=0, nbytes=cap) for u, shm in bufs.items()}

    def one_round(seed: int, info_of=packed_info) -> tuple[int, Any]:
        tensors = sample_tensors(seed)
        data = b"".join(bytes_of(t) for t in tensors.values())
        for shm in bufs.values():
            shm.buf[: len(data)] = data
        assert eng.request("POST", "/start_weight_update")[0] == 200
        status, body = eng.request(
            "POST", "/update_weights", {"update_info": info_of(tensors, by_uuid)}
        )
        if status == 200:
            assert eng.request("POST", "/finish_weight_update")[0] == 200
            want = {n: tensor_checksum(t) for n, t in tensors.items()}
            assert all(s == want for s in checksums(eng).values())
        return status, body

    def planned() -> list[int]:
        return [w["planned_chunks"] for w in stats(eng)["workers"]]

    def from_text() -> list[int]:  # found by the JSON text of its lists, not decoding them
        return [w["planned_from_text"] for w in stats(eng)["workers"]]

    one_round(10)  # creates or reshapes the weights (general path) in a fresh engine
    one_round(11)  # in place: the plan is remembered
    before, before_text = planned(), from_text()
    assert one_round(12)[0] == 200  # planned, and the new bytes land (checksums above)
    assert [a - b for a, b in zip(planned(), before, strict=True)] == [1, 1]
    assert [a - b for a, b in zip(from_text(), before_text, strict=True)] == [1, 1]

    def bad_sizes(t: dict, h: dict) -> dict:
        info = packed_info(t, h)
        info["tensor_sizes"] = [n + 1 for n in info["tensor_sizes"]]
        return info

    status, body = one_round(13, bad_sizes)
    assert status == 500 and "tensor_sizes says" in err_message(body), body

    u0 = eng.gpu_uuids[0]
    status, body = one_round(14, lambda t, h: packed_info(t, {u0: h[u0]}))
    assert status == 500 and "IPC handle not found for GPU UUID" in err_message(body), body
    eng.request("POST", "/finish_weight_update")  # worker 0 stayed active
    before = planned()
    assert one_round(15)[0] == 200
    assert [a - b for a, b in zip(planned(), before, strict=True)] == [1, 1]


def test_per_rank_update_info_list(eng: ReferenceEngine, segs: Segments) -> None:
    tensors = {"w": torch.arange(6, dtype=torch.float16).reshape(2, 3)}
    infos = [unpacked_info(tensors, [u], segs) for u in eng.gpu_uuids]
    assert eng.request("POST", "/start_weight_update")[0] == 200
    assert eng.request("POST", "/update_weights", {"update_info": infos})[0] == 200
    assert eng.request("POST", "/finish_weight_update")[0] == 200
    assert all(s["w"] == tensor_checksum(tensors["w"]) for s in checksums(eng).values())


def test_missing_uuid_splits_engine(eng: ReferenceEngine, segs: Segments) -> None:
    u0, u1 = eng.gpu_uuids
    tensors = {"w": torch.ones(3)}
    assert eng.request("POST", "/start_weight_update")[0] == 200
    status, body = eng.request(
        "POST", "/update_weights", {"update_info": unpacked_info(tensors, [u0], segs)}
    )
    assert status == 500
    msg = err_message(body)
    assert f"IPC handle not found for GPU UUID {u1}. Available UUIDs: ['{u0}']" in msg
    active = {w["gpu_uuid"]: w["active"] for w in stats(eng)["workers"]}
    assert active == {u0: True, u1: False}  # split: the failing worker ended its session
    status, body = eng.request("POST", "/start_weight_update")
    assert status == 500 and ALREADY_ACTIVE in err_message(body)
    # start succeeded on worker 1 and failed on worker 0: now both are active
    assert all(w["active"] for w in stats(eng)["workers"])
    assert eng.request("POST", "/finish_weight_update")[0] == 200


def test_worker_fault_on_chunk_k_then_recovery(eng: ReferenceEngine, segs: Segments) -> None:
    status, _ = eng.request(
        "POST",
        "/_slotsync/fault",
        {"route": "update_weights", "after": 1, "workers": [1], "message": "boom on chunk 1"},
    )
    assert status == 200
    uuids = eng.gpu_uuids
    t0, t1 = {"a": torch.zeros(2)}, {"b": torch.ones(2)}
    assert eng.request("POST", "/start_weight_update")[0] == 200
    ok = eng.request("POST", "/update_weights", {"update_info": unpacked_info(t0, uuids, segs)})
    assert ok[0] == 200
    status, body = eng.request(
        "POST", "/update_weights", {"update_info": unpacked_info(t1, uuids, segs)}
    )
    assert status == 500 and "boom on chunk 1" in err_message(body)
    assert [w["active"] for w in stats(eng)["workers"]] == [True, False]
    # daemon-style recovery: finish tolerating the 500 from the reset worker, then full redo
    status, body = eng.request("POST", "/finish_weight_update", {"weight_version": "x"})
    assert status == 500 and FINISH_NO_START in err_message(body)
    assert eng.request("GET", "/weight_info")[1]["weight_version"] != "x"
    assert not any(w["active"] for w in stats(eng)["workers"])
    assert eng.request("POST", "/start_weight_update")[0] == 200
    for t in (t0, t1):
        info = unpacked_info(t, uuids, segs)
        assert eng.request("POST", "/update_weights", {"update_info": info})[0] == 200
    assert eng.request("POST", "/finish_weight_update", {"weight_version": "r2"})[0] == 200
    assert eng.request("GET", "/weight_info")[1] == {"weight_version": "r2"}
    sums = checksums(eng)
    assert all(s["b"] == tensor_checksum(t1["b"]) for s in sums.values())


def test_http_level_faults(eng: ReferenceEngine) -> None:
    before = [w["start_count"] for w in stats(eng)["workers"]]
    eng.request("POST", "/_slotsync/fault", {"route": "start_weight_update", "status": 503})
    status, body = eng.request("POST", "/start_weight_update")
    assert status == 503 and body["error"]["type"] == "Service Unavailable"
    assert [w["start_count"] for w in stats(eng)["workers"]] == before  # no fan-out
    assert not any(w["active"] for w in stats(eng)["workers"])
    eng.request("POST", "/_slotsync/fault", {"route": "pause", "message": "cannot pause"})
    assert eng.request("POST", "/pause?mode=keep") == (500, {
        "error": "Failed to pause generation: Call to pause_scheduler method failed: "
                 "cannot pause"})
    assert eng.request("POST", "/pause?mode=keep")[0] == 200  # times=1
    eng.request(
        "POST", "/_slotsync/fault", {"route": "get_world_size", "hang_s": 0.3, "status": 200}
    )
    t = time.monotonic()
    assert eng.request("GET", "/get_world_size")[1]["world_size"] == 2
    assert time.monotonic() - t >= 0.3


def test_update_info_validation(eng: ReferenceEngine, segs: Segments) -> None:
    tensors = {"w": torch.ones(2, 2)}
    info = unpacked_info(tensors, eng.gpu_uuids, segs)
    cases = [
        ({**info, "shapes": []}, "`shapes` should be of the same size as `names`"),
        ({**info, "extra": 1}, "unexpected keyword argument 'extra'"),
        ({k: v for k, v in info.items() if k != "ipc_handles_pickled"}, "must be provided"),
        # the handle's own layout (slots 1-5) disagrees with update_info (vLLM itself would
        # load the handle's tensor and ignore update_info's shapes when unpacked)
        ({**info, "shapes": [[3, 3]]}, "update_info says torch.float32 [3, 3]"),
    ]
    for bad, text in cases:
        assert eng.request("POST", "/start_weight_update")[0] == 200
        status, body = eng.request("POST", "/update_weights", {"update_info": bad})
        assert status == 500 and text in err_message(body), body
        assert not any(w["active"] for w in stats(eng)["workers"])  # session ended
    # packed flag says packed, chunk is unpacked
    eng.request("POST", "/init_weight_transfer_engine", {"init_info": {"packed": True}})
    assert eng.request("POST", "/start_weight_update")[0] == 200
    status, body = eng.request("POST", "/update_weights", {"update_info": info})
    assert status == 500 and "`tensor_sizes` is required when packed=True" in err_message(body)


def test_shutdown_refused_during_update(eng: ReferenceEngine) -> None:
    assert eng.request("POST", "/start_weight_update")[0] == 200
    assert eng.request("POST", "/shutdown_weight_transfer_engine")[0] == 500
    assert eng.request("POST", "/finish_weight_update")[0] == 200
    assert eng.request("POST", "/shutdown_weight_transfer_engine")[0] == 200


def test_model_engine_is_strict(tmp_path: Path, segs: Segments) -> None:
    """One worker with --model: unknown names and shape mismatches fail; the 500 message is
    not wrapped in 'Worker failed with error' (world size 1)."""
    from safetensors.torch import save_file

    model = {"w": torch.arange(4, dtype=torch.float32), "b": torch.zeros(2, dtype=torch.bfloat16)}
    save_file(model, str(tmp_path / "m.safetensors"))
    with ReferenceEngine(workers=1, model=tmp_path / "m.safetensors") as eng:
        sums = checksums(eng)[eng.gpu_uuids[0]]
        assert sums == {n: tensor_checksum(t) for n, t in model.items()}
        uuids = eng.gpu_uuids
        for tensors, text in (
            ({"nope": torch.ones(4)}, "unknown weight name 'nope'"),
            ({"w": torch.ones(5)}, "model has torch.float32 [4]"),
        ):
            assert eng.request("POST", "/start_weight_update")[0] == 200
            info = unpacked_info(tensors, uuids, segs)
            status, body = eng.request("POST", "/update_weights", {"update_info": info})
            assert status == 500
            assert err_message(body).startswith("Call to collective_rpc method failed: ")
            assert text in err_message(body) and "Worker failed" not in err_message(body)
        new_w = torch.full((4,), 7.0)
        assert eng.request("POST", "/start_weight_update")[0] == 200
        info = unpacked_info({"w": new_w}, uuids, segs)
        assert eng.request("POST", "/update_weights", {"update_info": info})[0] == 200
        assert eng.request("POST", "/finish_weight_update")[0] == 200
        assert checksums(eng)[uuids[0]]["w"] == tensor_checksum(new_w)


def test_launcher_reports_startup_failure(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="exited with code"):
        ReferenceEngine(workers=1, model=tmp_path / "missing.safetensors", startup_timeout_s=60)


def test_checksum_is_device_and_stride_independent() -> None:
    t = torch.randn(3, 4)
    assert tensor_checksum(t) == tensor_checksum(t.t().contiguous().t())
    assert tensor_checksum(t.to(torch.bfloat16)) != tensor_checksum(t)
    assert len(tensor_checksum(t)) == 64


def test_update_weights_sent_together_each_load_and_answer_their_own(
        eng: ReferenceEngine, segs: Segments) -> None:
    """Calls that arrive while the workers are still busy are queued behind the running one
    (the daemon keeps two ``/update_weights`` in flight): every chunk loads and every answer
    reaches its own request."""
    from concurrent.futures import ThreadPoolExecutor

    assert eng.request("POST", "/init_weight_transfer_engine",
                       {"init_info": {"packed": True}})[0] == 200
    chunks = [{f"layer.{k}.w": torch.full((64, 64), float(k))} for k in range(6)]
    infos = []
    for chunk in chunks:
        data = b"".join(bytes_of(t) for t in chunk.values())
        by_uuid = {u: ShmHandle(segment=segs.put(data).name, offset=0, nbytes=len(data))
                   for u in eng.gpu_uuids}
        infos.append(packed_info(chunk, by_uuid))
    assert eng.request("POST", "/start_weight_update")[0] == 200
    before = {w["index"]: w["update_count"] for w in stats(eng)["workers"]}
    with ThreadPoolExecutor(len(infos)) as pool:
        answers = list(pool.map(
            lambda info: eng.request("POST", "/update_weights", {"update_info": info}), infos))
    assert answers == [(200, {"message": "Weights updated"})] * len(infos)
    assert eng.request("POST", "/finish_weight_update", {"weight_version": "q"})[0] == 200
    want = {n: tensor_checksum(t) for c in chunks for n, t in c.items()}
    status, body = eng.request("POST", "/weight_checker", {"action": "compare", "baseline": want})
    assert (status, body) == (200, {"match": True, "mismatches": []})
    after = {w["index"]: w["update_count"] for w in stats(eng)["workers"]}
    assert all(after[i] - before[i] == len(infos) for i in after)


def test_worker_pool_matches_queued_answers_to_their_calls() -> None:
    """Three calls written to the workers before the first answered: each gets its own
    answer, a failing one fails alone; a worker that dies fails every call still waiting."""
    import asyncio

    from slotsync.engine.reference.server import CollectiveRpcError, WorkerPool
    from slotsync.engine.reference.worker import WorkerSpec

    pool = WorkerPool([WorkerSpec(i, "cpu", logical_gpu_uuid(i), None) for i in range(2)],
                      startup_timeout_s=90)
    try:
        async def three() -> list:
            return await asyncio.gather(
                pool.collective_rpc("stats"),
                pool.collective_rpc("update_weights", {"update_info": {}}),  # no session
                pool.collective_rpc("checksums"),
                return_exceptions=True)

        first, second, third = asyncio.run(three())
        assert [w["index"] for w in first] == [0, 1]
        assert isinstance(second, CollectiveRpcError)
        assert "start_weight_update must be called before update_weights" in str(second)
        assert third == [{}, {}]

        async def dies() -> list:
            pool.workers[1].process.kill()
            return await asyncio.gather(pool.collective_rpc("stats"),
                                        pool.collective_rpc("stats"), return_exceptions=True)

        for r in asyncio.run(dies()):
            assert isinstance(r, CollectiveRpcError) and "worker 1 is gone" in str(r)
    finally:
        pool.close()


# --------------------------------------------------------------------------------------------
# behaving like vLLM where the daemon can tell (test_vllm_engine.py checks vLLM's own)
# --------------------------------------------------------------------------------------------


def _keepalive(eng: ReferenceEngine):
    import http.client

    return http.client.HTTPConnection(eng.host, eng.port, timeout=60)


def _on(conn, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"null")


def test_connection_closed_after_a_weight_route_500_kept_otherwise(eng: ReferenceEngine) -> None:
    """As uvicorn under vLLM's handlers: after a 500 raised through ServerErrorMiddleware the
    server closes the connection; after a 400 or a pause/resume route's own 500 it stays."""
    import http.client

    conn = _keepalive(eng)
    try:
        assert _on(conn, "POST", "/update_weights", {})[0] == 400
        assert _on(conn, "GET", "/is_paused") == (200, {"is_paused": False})
        eng.request("POST", "/_slotsync/fault", {"route": "resume", "message": "nope"})
        assert _on(conn, "POST", "/resume") == (500, {
            "error": "Failed to resume generation: Call to resume_scheduler method failed: nope"})
        assert _on(conn, "GET", "/is_paused")[0] == 200
        status, body = _on(conn, "POST", "/finish_weight_update")  # nothing active: 500
        assert status == 500 and FINISH_NO_START in err_message(body)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            _on(conn, "GET", "/is_paused")
    finally:
        conn.close()
    for fault, path in (({"route": "start_weight_update"}, "/start_weight_update"),
                        ({"route": "weight_info", "status": 500}, "/weight_info")):
        conn = _keepalive(eng)
        try:
            eng.request("POST", "/_slotsync/fault", fault)
            assert _on(conn, "POST" if "start" in path else "GET", path)[0] == 500
            with pytest.raises((ConnectionError, http.client.HTTPException)):
                _on(conn, "GET", "/is_paused")
        finally:
            conn.close()


def test_payload_of_the_other_shape_fails_with_a_bare_assert(eng: ReferenceEngine,
                                                             segs: Segments) -> None:
    """vLLM 0.32 ipc_engine.receive_weights: ``tensor_sizes`` is checked first when packed,
    then a bare ``assert isinstance(ipc_handles, dict / list)`` (empty message)."""
    tensors = {"w": torch.ones(4)}
    data = bytes_of(tensors["w"])
    by_uuid = {u: ShmHandle(segment=segs.put(data).name, offset=0, nbytes=len(data))
               for u in eng.gpu_uuids}
    wrap = ("Call to collective_rpc method failed: Worker failed with error '{}', please "
            "check the stack trace above for the root cause")
    # an engine restarted without init (packed False) given a packed chunk
    assert eng.request("POST", "/start_weight_update")[0] == 200
    status, body = eng.request("POST", "/update_weights",
                               {"update_info": packed_info(tensors, by_uuid)})
    assert (status, err_message(body)) == (500, wrap.format(""))
    assert not any(w["active"] for w in stats(eng)["workers"])
    # packed engine: unpacked chunk -> tensor_sizes first, then the dict assert
    eng.request("POST", "/init_weight_transfer_engine", {"init_info": {"packed": True}})
    info = unpacked_info(tensors, eng.gpu_uuids, segs)
    assert eng.request("POST", "/start_weight_update")[0] == 200
    status, body = eng.request("POST", "/update_weights", {"update_info": info})
    assert (status, err_message(body)) == (500, wrap.format(
        "`tensor_sizes` is required when packed=True"))
    assert eng.request("POST", "/start_weight_update")[0] == 200
    status, body = eng.request("POST", "/update_weights",
                               {"update_info": {**info, "tensor_sizes": [16]}})
    assert (status, err_message(body)) == (500, wrap.format(""))


def test_packed_offsets_must_be_aligned(eng: ReferenceEngine, segs: Segments) -> None:
    """vLLM's packed consumer views each tensor in the buffer before cloning it: a tensor
    whose byte offset is not a multiple of its element size fails with torch's message."""
    eng.request("POST", "/init_weight_transfer_engine", {"init_info": {"packed": True}})
    tensors = {"a": torch.ones(5, dtype=torch.bfloat16), "b": torch.ones(2, dtype=torch.int32)}
    data = b"".join(bytes_of(t) for t in tensors.values())
    by_uuid = {u: ShmHandle(segment=segs.put(data).name, offset=0, nbytes=len(data))
               for u in eng.gpu_uuids}
    assert eng.request("POST", "/start_weight_update")[0] == 200
    status, body = eng.request("POST", "/update_weights",
                               {"update_info": packed_info(tensors, by_uuid)})
    assert status == 500
    assert ("self.storage_offset() must be divisible by 4 to view Byte as Int (different "
            "element sizes), but got 10") in err_message(body)


def test_update_info_list_is_indexed_by_worker_rank(eng: ReferenceEngine, segs: Segments
                                                    ) -> None:
    """vLLM 0.32 Worker.update_weights takes ``update_info[rank]``: extra entries are
    ignored, a missing one fails that worker only (IndexError)."""
    tensors = {"w": torch.arange(3, dtype=torch.float32)}
    infos = [unpacked_info(tensors, [u], segs) for u in eng.gpu_uuids]
    assert eng.request("POST", "/start_weight_update")[0] == 200
    assert eng.request("POST", "/update_weights", {"update_info": [*infos, infos[0]]})[0] == 200
    status, body = eng.request("POST", "/update_weights", {"update_info": infos[:1]})
    assert status == 500 and "Worker failed with error 'list index out of range'" in \
        err_message(body)
    assert [w["active"] for w in stats(eng)["workers"]] == [True, False]


def test_shutdown_texts_are_vllms(eng: ReferenceEngine) -> None:
    assert eng.request("POST", "/start_weight_update")[0] == 200
    status, body = eng.request("POST", "/shutdown_weight_transfer_engine")
    assert status == 500
    assert "Cannot release a trainer connection during a weight update" in err_message(body)
    assert eng.request("POST", "/finish_weight_update")[0] == 200
    assert eng.request("POST", "/shutdown_weight_transfer_engine") == (
        200, {"message": "Weight transfer shut down"})


def test_sleep_wake_and_is_sleeping(eng: ReferenceEngine, segs: Segments) -> None:
    """vLLM 0.32 EngineCore semantics (see test_vllm_engine.py for vLLM's own): sleep
    pauses first; is_sleeping = paused or asleep; a partial wake does not resume; level 2
    discards the weights."""
    tensors = sample_tensors(21)
    assert eng.request("POST", "/start_weight_update")[0] == 200
    info = unpacked_info(tensors, eng.gpu_uuids, segs)
    assert eng.request("POST", "/update_weights", {"update_info": info})[0] == 200
    assert eng.request("POST", "/finish_weight_update")[0] == 200
    before = checksums(eng)
    assert eng.request("POST", "/pause?mode=keep")[0] == 200
    assert eng.request("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert eng.request("POST", "/resume")[0] == 200
    assert eng.request("POST", "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
    assert eng.request("GET", "/is_paused") == (200, {"is_paused": True})
    assert eng.request("POST", "/wake_up") == (200, {"status": "awake", "tags": None})
    assert checksums(eng) == before
    assert eng.request("POST", "/sleep?level=2&mode=keep")[0] == 200
    assert stats(eng)["sleeping_tags"] == ["kv_cache", "weights"]
    assert eng.request("POST", "/wake_up?tags=weights") == (
        200, {"status": "sleeping", "tags": ["weights"]})
    assert eng.request("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert eng.request("GET", "/is_paused") == (200, {"is_paused": True})
    assert eng.request("POST", "/wake_up?tags=kv_cache") == (
        200, {"status": "awake", "tags": ["kv_cache"]})
    assert eng.request("GET", "/is_paused") == (200, {"is_paused": False})
    after = checksums(eng)
    assert all(after[u][n] != before[u][n] for u in before for n in tensors)
    assert eng.request("POST", "/sleep?level=0")[0] == 200
    assert eng.request("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert eng.request("POST", "/wake_up?tags=scheduling") == (
        200, {"status": "awake", "tags": ["scheduling"]})
    assert eng.request("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    status, body = eng.request("POST", "/sleep?level=3")
    assert status == 400 and body["error"]["param"] == "query.level"


def test_restart_forgets_version_and_pause_one_worker_bare_assert(tmp_path: Path,
                                                                  segs: Segments) -> None:
    """A restarted engine answers weight version "default", is not paused and has packed
    False; with one worker the bare assert's message is vLLM's stripped
    ``Call to collective_rpc method failed:``."""
    with ReferenceEngine(workers=1, startup_timeout_s=90) as one:
        assert one.request("POST", "/init_weight_transfer_engine",
                           {"init_info": {"packed": True}})[0] == 200
        assert one.request("POST", "/start_weight_update")[0] == 200
        assert one.request("POST", "/finish_weight_update", {"weight_version": "v9"})[0] == 200
        assert one.request("POST", "/pause?mode=keep")[0] == 200
        one.stop()
        one.start()  # the same port, a new process
        assert one.request("GET", "/weight_info") == (200, {"weight_version": "default"})
        assert one.request("GET", "/is_paused") == (200, {"is_paused": False})
        data = bytes_of(torch.ones(2))
        by_uuid = {one.gpu_uuids[0]: ShmHandle(segs.put(data).name, 0, len(data))}
        assert one.request("POST", "/start_weight_update")[0] == 200
        status, body = one.request("POST", "/update_weights",
                                   {"update_info": packed_info({"w": torch.ones(2)}, by_uuid)})
        assert (status, err_message(body)) == (500, "Call to collective_rpc method failed:")


@pytest.mark.parametrize("impl", ["reference", "vllm"])
def test_a_missing_model_file_is_a_usage_error_before_any_worker_starts(tmp_path, impl,
                                                                       run_module) -> None:
    """``--model`` naming no file: exit 2 with the path, not a worker's traceback later."""
    missing = tmp_path / "nope.safetensors"
    run = run_module([sys.executable, "-m", "slotsync.engine", "--impl", impl,
                      "--workers", "1", "--model", str(missing)])
    assert run.returncode == 2, run.stderr[-800:]
    assert f"--model {missing}: no such file" in run.stderr
    assert "Traceback" not in run.stderr
    run = run_module([sys.executable, "-m", "slotsync.engine", "--workers", "1",
                      "--model", str(tmp_path)])
    assert run.returncode == 2 and f"--model {tmp_path}: not a file" in run.stderr

"""The vLLM-code engine (``python -m slotsync.engine --impl vllm``) against vLLM's own code.

Its routes are vLLM 0.32's own router and exception handlers under vLLM's uvicorn launcher,
and each worker runs vLLM's ``gpu_worker.Worker`` weight-update methods,
``IPCWeightTransferEngine`` and layerwise reload (``slotsync.engine.vllm.worker``). These tests
assert what that code does -- where it differs from ``shared/vllm-contract.md``, the test says
so. Handles are shared-memory exports (``slotsync.protocol.rank.export.ShmSegment``) merged by the
daemon's own ``merge_chunk``.

One 2-worker CPU engine (``--executor-replies all``: every worker's reply of each call is
read, so one test's failures do not shift the next test's answers) serves most tests; a
second one with vLLM's own reply handling shows what ``MultiprocExecutor`` does after a
failure.

Over ~500 lines on purpose: it holds one thing, the vLLM-code engine's tests, on the one module-
scoped engine they share (issue 16).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
pytest.importorskip("vllm.entrypoints.rl.online.api_router")
pytest.importorskip("vllm.v1.worker.gpu_worker")
pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
torch = pytest.importorskip("torch")

from slotsync.daemon.vllm.merge import merge_chunk  # noqa: E402
from slotsync.engine.checksum import checksums_by_worker, tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402
from slotsync.protocol.rank.export import ShmSegment  # noqa: E402
from slotsync.protocol.wire import Chunk, logical_gpu_uuid  # noqa: E402

pytestmark = pytest.mark.vllm

UP = "model.layers.0.mlp.up_proj.weight"
SCALE = "model.layers.0.mlp.up_proj.scale"  # a second parameter of UP's layer
NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"
ALREADY_ACTIVE = "start_weight_update called while a weight update is already active"
NO_START = "finish_weight_update called without a matching start_weight_update."
WRAP = "Call to collective_rpc method failed: Worker failed with error '{}', please check " \
       "the stack trace above for the root cause"


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The model's four tensors (names above), values from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {
        UP: torch.randn(4, 3, generator=g),
        SCALE: torch.randn(2, generator=g),
        NORM: torch.randn(5, generator=g).to(torch.bfloat16),
        EMBED: torch.randint(-100, 100, (2, 2, 2), generator=g).to(torch.int32),
    }


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).split(".")[-1]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("vllm-model") / "m.safetensors"
    save_file(model_tensors(0), str(path))
    return path


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[ReferenceEngine]:
    with ReferenceEngine(workers=2, impl="vllm", model=model_path, executor_replies="all",
                         startup_timeout_s=300) as eng:
        yield eng


class Segments:
    """Shared-memory segments a test exports from (unlinked at teardown)."""

    def __init__(self) -> None:
        self.segs: list[ShmSegment] = []

    def new(self, size: int, rank: int = 0) -> ShmSegment:
        seg = ShmSegment(size, rank=rank)
        self.segs.append(seg)
        return seg

    def close(self) -> None:
        for s in self.segs:
            s.close_and_unlink()


@pytest.fixture
def segs() -> Iterator[Segments]:
    s = Segments()
    yield s
    s.close()


def request(eng: ReferenceEngine, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One call on a fresh connection (vLLM closes a connection after a 500)."""
    return eng.request(method, path, body)


def stats(eng: ReferenceEngine) -> dict[str, Any]:
    status, body = request(eng, "GET", "/_slotsync/stats")
    assert status == 200, body
    return body


def active(eng: ReferenceEngine) -> list[bool]:
    return [w["active"] for w in stats(eng)["workers"]]


def message(body: Any) -> str:
    return body["error"]["message"]


def sums(eng: ReferenceEngine) -> dict[str, dict[str, str]]:
    status, body = request(eng, "POST", "/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return checksums_by_worker(body)


def want_sums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in tensors.items()}


def update_info(tensors: dict[str, torch.Tensor], uuids: list[str], segs: Segments, *,
                packed: bool, seg_of_rank: dict[int, ShmSegment] | None = None) -> dict:
    """One chunk as the daemon builds it: every rank exports ``tensors`` into shared memory
    (packed: back to back in one region -- ``seg_of_rank``'s, reused, else a new one;
    unpacked: one region per tensor), then ``merge_chunk`` merges the ranks' ``Chunk``\\ s;
    the body is what ``VllmClient`` sends (msgspec JSON), decoded."""
    names = list(tensors)
    dts = [dtype_name(t) for t in tensors.values()]
    shapes = [list(t.shape) for t in tensors.values()]
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    chunks = {}
    for rank in range(len(uuids)):
        if packed:
            data = torch.cat([raw(t) for t in tensors.values()])
            seg = (seg_of_rank or {}).get(rank) or segs.new(max(len(data), 1), rank)
            assert seg.tensor is not None
            seg.tensor[: len(data)] = data
            handles = [seg.handle(0, seg.size)]  # one export of the whole buffer
        else:
            handles = []
            for t in tensors.values():
                seg = segs.new(t.numel() * t.element_size(), rank)
                assert seg.tensor is not None
                seg.tensor[:] = raw(t)
                handles.append(seg.handle())
        chunks[rank] = Chunk(1, 0, names, dts, shapes, sizes, handles)
    merged = merge_chunk(0, chunks, dict(enumerate(uuids)), packed=packed, transport="shm",
                         world_size=len(uuids))
    return json.loads(msgspec.json.encode(merged.update_info))


def init(eng: ReferenceEngine, packed: bool) -> None:
    status, body = request(eng, "POST", "/init_weight_transfer_engine",
                           {"init_info": {"packed": packed}})
    assert status == 200, body


def full_update(eng: ReferenceEngine, segs: Segments, tensors: dict[str, torch.Tensor],
                version: str = "full", packed: bool = False) -> None:
    init(eng, packed)
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    info = update_info(tensors, eng.gpu_uuids, segs, packed=packed)
    status, body = request(eng, "POST", "/update_weights", {"update_info": info})
    assert status == 200, body
    status, body = request(eng, "POST", "/finish_weight_update", {"weight_version": version})
    assert status == 200, body


@pytest.fixture
def eng(engine: ReferenceEngine, segs: Segments) -> ReferenceEngine:
    """The module's engine with no faults, no update active on any worker, serving (awake,
    resumed) and every weight in place (a full update if a test left one unloaded)."""
    request(engine, "POST", "/_slotsync/fault", {"clear": True})
    request(engine, "POST", "/wake_up")
    request(engine, "POST", "/finish_weight_update")  # tolerate 500s: nothing active
    if any(active(engine)):
        request(engine, "POST", "/finish_weight_update")
    assert not any(active(engine))
    if not all(w["servable"] for w in stats(engine)["workers"]):
        full_update(engine, segs, model_tensors(0), "restored")
    assert request(engine, "POST", "/resume")[0] == 200
    init(engine, False)
    return engine


def raw_conn(eng: ReferenceEngine) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(eng.host, eng.port, timeout=60)


def on(conn: http.client.HTTPConnection, method: str, path: str,
       body: Any = None) -> tuple[int, Any]:
    """One request on a kept-alive connection."""
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"null")


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_routes_answer_as_vllms_router(engine: ReferenceEngine) -> None:
    """Shapes and defaults of vLLM's own routes (first test: the engine is fresh)."""
    assert request(engine, "GET", "/get_world_size") == (200, {"world_size": 2})
    assert request(engine, "GET", "/get_world_size?include_dp=false") == (200, {"world_size": 2})
    assert request(engine, "GET", "/weight_info") == (200, {"weight_version": "default"})
    assert request(engine, "GET", "/is_paused") == (200, {"is_paused": False})
    assert request(engine, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    s = stats(engine)
    assert s["impl"] == "vllm" and s["world_size"] == 2 and s["paused"] is False
    assert [w["gpu_uuid"] for w in s["workers"]] == [logical_gpu_uuid(0), logical_gpu_uuid(1)]
    assert all(w["servable"] and not w["active"] and w["num_weights"] == 4
               for w in s["workers"])
    # vLLM's checksums: one flat dict keyed dp0:pp0:pcp0:tp<i>:<name>, sha256 of raw bytes
    status, body = request(engine, "POST", "/weight_checker", {"action": "checksum"})
    assert status == 200
    want = want_sums(model_tensors(0))
    assert body["checksums"] == {f"dp0:pp0:pcp0:tp{i}:{n}": h for i in range(2)
                                 for n, h in want.items()}
    assert checksums_by_worker(body) == {"tp0": want, "tp1": want}
    baseline = {f"dp0:pp0:pcp0:tp{i}:{n}": h for i in range(2) for n, h in want.items()}
    assert request(engine, "POST", "/weight_checker",
                   {"action": "compare", "baseline": baseline}) == (
        200, {"match": True, "mismatches": []})
    status, body = request(engine, "POST", "/weight_checker",
                           {"action": "compare", "baseline": {**baseline, "x": "0"}})
    assert (status, body) == (200, {"match": False, "mismatches": ["x"]})
    # 400s: vLLM's validation handler (not FastAPI's default 422 / {"detail": ...})
    status, body = request(engine, "POST", "/update_weights", {})
    assert status == 400 and body["error"]["type"] == "Bad Request"
    assert body["error"]["param"] == "body.update_info" and body["error"]["code"] == 400
    status, body = request(engine, "POST", "/weight_checker", {"action": "compare"})
    assert status == 400 and "requires a 'baseline'" in message(body)
    status, body = request(engine, "POST", "/pause?mode=sideways")
    assert status == 400 and body["error"]["param"] == "query.mode"
    status, body = request(engine, "POST", "/sleep?level=3")
    assert status == 400 and body["error"]["param"] == "query.level"
    # not a vLLM route
    assert request(engine, "POST", "/_slotsync/fault", {"route": 1})[0] == 400


def test_connection_closed_after_a_500_kept_after_a_400(eng: ReferenceEngine) -> None:
    """vLLM raises a failed weight call through Starlette's ServerErrorMiddleware and uvicorn
    closes the connection; a 400 (validation handler) and the pause route's own 500 (it
    catches the error) keep it."""
    conn = raw_conn(eng)
    try:
        assert on(conn, "POST", "/update_weights", {})[0] == 400
        assert on(conn, "GET", "/get_world_size") == (200, {"world_size": 2})  # still open
        request(eng, "POST", "/_slotsync/fault", {"route": "pause", "message": "no pause"})
        status, body = on(conn, "POST", "/pause?mode=keep")
        assert status == 500
        assert body == {"error": "Failed to pause generation: Call to pause_scheduler method "
                                 "failed: no pause"}
        assert on(conn, "GET", "/get_world_size")[0] == 200  # still open
        status, body = on(conn, "POST", "/finish_weight_update")  # nothing active
        assert status == 500 and message(body) == WRAP.format(NO_START)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            on(conn, "GET", "/get_world_size")  # uvicorn closed it after the 500
    finally:
        conn.close()


def test_per_worker_state_machine_and_split(eng: ReferenceEngine, segs: Segments) -> None:
    u0, u1 = eng.gpu_uuids
    assert request(eng, "POST", "/start_weight_update") == (
        200, {"message": "Weight update started"})
    status, body = request(eng, "POST", "/start_weight_update")
    assert status == 500 and message(body) == WRAP.format(
        ALREADY_ACTIVE + ". Call finish_weight_update first.")
    assert body["error"]["type"] == "InternalServerError" and body["error"]["param"] is None
    # layerwise reload: between start and finish the parameters are on the meta device
    assert [w["servable"] for w in stats(eng)["workers"]] == [False, False]
    status, body = request(eng, "POST", "/weight_checker", {"action": "checksum"})
    assert status == 500 and "Call to compute_weight_checksums method failed" in message(body)
    assert "meta tensor" in message(body)
    assert request(eng, "POST", "/finish_weight_update", {"weight_version": "s1"}) == (
        200, {"message": "Weight update finished"})
    assert request(eng, "GET", "/weight_info")[1] == {"weight_version": "s1"}
    status, body = request(eng, "POST", "/finish_weight_update", {"weight_version": "bad"})
    assert status == 500 and message(body) == WRAP.format(NO_START)
    assert request(eng, "GET", "/weight_info")[1] == {"weight_version": "s1"}
    status, body = request(eng, "POST", "/update_weights", {"update_info": {"names": []}})
    assert status == 500
    assert message(body) == WRAP.format("start_weight_update must be called before "
                                        "update_weights.")
    # split: the chunk lacks worker 1's UUID; only worker 1 ends its session
    new = {NORM: torch.full((5,), 3.0, dtype=torch.bfloat16)}
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    info = update_info(new, [u0], segs, packed=False)
    status, body = request(eng, "POST", "/update_weights", {"update_info": info})
    assert status == 500
    assert message(body) == WRAP.format(
        f"IPC handle not found for GPU UUID {u1}. Available UUIDs: ['{u0}']")
    assert active(eng) == [True, False]
    # next start fails on the worker still active, opens a session on the other
    status, body = request(eng, "POST", "/start_weight_update")
    assert status == 500 and ALREADY_ACTIVE in message(body)
    assert active(eng) == [True, True]
    # finish succeeds everywhere -- yet only worker 0 has the chunk: vLLM's layerwise
    # reload put worker 1's old kernel tensors back ("Failed to load weights")
    assert request(eng, "POST", "/finish_weight_update")[0] == 200
    got = sums(eng)
    assert got["tp0"][NORM] == tensor_checksum(new[NORM]) != got["tp1"][NORM]
    # and the other way: split again, then finish fails on the worker that failed
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    info = update_info(new, [u0], segs, packed=False)
    assert request(eng, "POST", "/update_weights", {"update_info": info})[0] == 500
    status, body = request(eng, "POST", "/finish_weight_update")
    assert status == 500 and message(body) == WRAP.format(NO_START)
    assert active(eng) == [False, False]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_update_from_shared_memory_lands(eng: ReferenceEngine, segs: Segments,
                                         packed: bool) -> None:
    """Two chunks built by the daemon's merge_chunk from shared-memory exports load through
    vLLM's receive path (packed: one export of one buffer per rank, overwritten between the
    chunks: vLLM's PackedBufferImporter keeps the mapping, which aliases the segment, and
    clones each tensor out before answering)."""
    tensors = model_tensors(7)
    # (packed: each tensor's byte offset must be a multiple of its element size, see
    # test_packed_tensor_at_a_misaligned_offset_fails: EMBED's 32 bytes before NORM's 10)
    chunks = [{UP: tensors[UP], SCALE: tensors[SCALE]},
              {EMBED: tensors[EMBED], NORM: tensors[NORM]}]
    init(eng, packed)
    assert stats(eng)["packed"] is packed
    bufs = {r: segs.new(4096, r) for r in range(2)} if packed else None
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    for chunk in chunks:
        info = update_info(chunk, eng.gpu_uuids, segs, packed=packed, seg_of_rank=bufs)
        assert ("tensor_sizes" in info) is packed
        status, body = request(eng, "POST", "/update_weights", {"update_info": info})
        assert (status, body) == (200, {"message": "Weights updated"}), body
    if bufs:
        for seg in bufs.values():  # scribble: what was loaded must not change
            assert seg.tensor is not None
            seg.tensor.fill_(0xEE)
    assert request(eng, "POST", "/finish_weight_update", {"weight_version": "p"})[0] == 200
    assert sums(eng) == {"tp0": want_sums(tensors), "tp1": want_sums(tensors)}
    assert [w["update_count"] >= 2 for w in stats(eng)["workers"]] == [True, True]


def test_packed_tensor_at_a_misaligned_offset_fails(eng: ReferenceEngine,
                                                    segs: Segments) -> None:
    """vLLM's packed consumer views each tensor in place before cloning it
    (``packed_tensor.unpack_tensor``: ``tensor.contiguous().view(dtype)`` on a uint8 slice),
    so a tensor whose byte offset in the chunk is not a multiple of its element size fails
    torch's view check -- and that is the layout vLLM's own producer writes (back to back,
    no padding; ``tensor_sizes`` cannot express padding). A chunk must be ordered so that
    every offset is aligned."""
    init(eng, True)
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    new = model_tensors(5)
    info = update_info({NORM: new[NORM], EMBED: new[EMBED]}, eng.gpu_uuids, segs, packed=True)
    status, body = request(eng, "POST", "/update_weights", {"update_info": info})
    assert (status, message(body)) == (500, WRAP.format(
        "self.storage_offset() must be divisible by 4 to view Byte as Int (different element "
        "sizes), but got 10"))
    assert active(eng) == [False, False]


def test_payload_of_the_other_shape_fails_with_vllms_bare_assert(
        eng: ReferenceEngine, segs: Segments) -> None:
    """An engine restarted without /init_weight_transfer_engine has packed=False: a packed
    chunk then hits vLLM's ``assert isinstance(update_info.ipc_handles, list)`` -- an
    AssertionError without a message (vLLM 0.32 ipc_engine.receive_weights)."""
    tensors = {NORM: torch.full((5,), 2.0, dtype=torch.bfloat16)}
    init(eng, False)
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    packed_info = update_info(tensors, eng.gpu_uuids, segs, packed=True)
    status, body = request(eng, "POST", "/update_weights", {"update_info": packed_info})
    assert (status, message(body)) == (500, WRAP.format(""))
    assert active(eng) == [False, False]  # the failure ended both sessions
    # packed engine: an unpacked chunk lacks tensor_sizes (checked before the assert) ...
    init(eng, True)
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    unpacked = update_info(tensors, eng.gpu_uuids, segs, packed=False)
    status, body = request(eng, "POST", "/update_weights", {"update_info": unpacked})
    assert (status, message(body)) == (500, WRAP.format(
        "`tensor_sizes` is required when packed=True"))
    # ... and with tensor_sizes, a handle list fails the dict assert
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    status, body = request(eng, "POST", "/update_weights",
                           {"update_info": {**unpacked, "tensor_sizes": [10]}})
    assert (status, message(body)) == (500, WRAP.format(""))
    # unknown key: parse_update_info's wrapped TypeError
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    status, body = request(eng, "POST", "/update_weights",
                           {"update_info": {**unpacked, "extra": 1}})
    assert status == 500 and "Invalid update_info for IPCWeightTransferEngine: " in message(body)
    assert "unexpected keyword argument 'extra'" in message(body)


def test_chunk_without_some_weights_keeps_or_garbles_them(eng: ReferenceEngine,
                                                          segs: Segments) -> None:
    """What vLLM's layerwise reload does with an update that omits weights (vLLM 0.32
    ``model_loader/reload/layerwise.py finalize_layerwise_processing``): a layer none of
    whose weights came keeps its old values ("Failed to load weights": the kernel tensors
    are placed back); a layer that got only some of its weights is processed anyway
    ("Delayed processing"), and the missing ones come from ``torch.empty_strided``:
    uninitialized memory (NaN here, the engine has torch fill it). Only a full update is
    safe to resume on."""
    full_update(eng, segs, model_tensors(0), "base")
    before = sums(eng)
    new = model_tensors(3)
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    info = update_info({UP: new[UP], NORM: new[NORM]}, eng.gpu_uuids, segs, packed=False)
    assert request(eng, "POST", "/update_weights", {"update_info": info})[0] == 200
    assert request(eng, "POST", "/finish_weight_update")[0] == 200
    after = sums(eng)
    nan = tensor_checksum(torch.full((2,), float("nan")))
    for w in ("tp0", "tp1"):
        assert after[w][UP] == tensor_checksum(new[UP])
        assert after[w][NORM] == tensor_checksum(new[NORM])
        assert after[w][EMBED] == before[w][EMBED]  # layer not loaded: old values back
        assert after[w][SCALE] == nan  # its layer loaded only UP: uninitialized
    full_update(eng, segs, model_tensors(0), "base")


def test_failed_chunk_then_full_update_recovers(eng: ReferenceEngine, segs: Segments) -> None:
    """The daemon's recovery from a split (vllm-contract.md "Per-worker state"): a fault in
    worker 1's receive_weights on chunk 1 ends its session (vLLM's Worker.update_weights);
    finish fails there; a full start / update / finish then lands on both -- although worker
    1's layerwise reload still holds chunk 0's buffered weights of the failed session."""
    request(eng, "POST", "/_slotsync/fault",
            {"route": "update_weights", "after": 1, "workers": [1], "message": "boom"})
    new = model_tensors(11)
    chunks = [{UP: new[UP]}, {SCALE: new[SCALE], NORM: new[NORM], EMBED: new[EMBED]}]
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    info = update_info(chunks[0], eng.gpu_uuids, segs, packed=False)
    assert request(eng, "POST", "/update_weights", {"update_info": info})[0] == 200
    info = update_info(chunks[1], eng.gpu_uuids, segs, packed=False)
    status, body = request(eng, "POST", "/update_weights", {"update_info": info})
    assert (status, message(body)) == (500, WRAP.format("boom"))
    assert active(eng) == [True, False]
    status, body = request(eng, "POST", "/finish_weight_update", {"weight_version": "x"})
    assert status == 500 and message(body) == WRAP.format(NO_START)
    assert request(eng, "GET", "/weight_info")[1]["weight_version"] != "x"
    assert active(eng) == [False, False]
    assert [w["servable"] for w in stats(eng)["workers"]] == [True, False]
    assert request(eng, "POST", "/start_weight_update")[0] == 200
    for chunk in chunks:
        info = update_info(chunk, eng.gpu_uuids, segs, packed=False)
        assert request(eng, "POST", "/update_weights", {"update_info": info})[0] == 200
    assert request(eng, "POST", "/finish_weight_update", {"weight_version": "r"})[0] == 200
    assert sums(eng) == {"tp0": want_sums(new), "tp1": want_sums(new)}
    assert request(eng, "GET", "/weight_info")[1] == {"weight_version": "r"}


def test_slotsync_faults_travel_vllms_error_paths(eng: ReferenceEngine) -> None:
    before = [w["start_count"] for w in stats(eng)["workers"]]
    # workers: null -> what AsyncLLM raises, before any worker sees the call
    request(eng, "POST", "/_slotsync/fault", {"route": "start_weight_update", "message": "m"})
    status, body = request(eng, "POST", "/start_weight_update")
    assert (status, message(body)) == (500, "Call to collective_rpc method failed: m")
    assert [w["start_count"] for w in stats(eng)["workers"]] == before
    assert active(eng) == [False, False]
    # workers: [0] -> inside vLLM's engine hook: the session does not open on worker 0
    request(eng, "POST", "/_slotsync/fault",
            {"route": "start_weight_update", "workers": [0], "message": "hook"})
    status, body = request(eng, "POST", "/start_weight_update")
    assert (status, message(body)) == (500, WRAP.format("hook"))
    assert active(eng) == [False, True]
    assert request(eng, "POST", "/start_weight_update")[0] == 500  # worker 1 still active
    assert active(eng) == [True, True]
    # workers: [1] on finish -> vLLM's Worker.finish_weight_update leaves the flag set
    request(eng, "POST", "/_slotsync/fault",
            {"route": "finish_weight_update", "workers": [1], "message": "fin"})
    status, body = request(eng, "POST", "/finish_weight_update")
    assert (status, message(body)) == (500, WRAP.format("fin"))
    assert active(eng) == [False, True]
    assert request(eng, "POST", "/finish_weight_update")[0] == 500  # worker 0: no start
    assert active(eng) == [False, False]
    # init: inside parse_init_info
    request(eng, "POST", "/_slotsync/fault",
            {"route": "init_weight_transfer_engine", "workers": [1], "message": "ini"})
    status, body = request(eng, "POST", "/init_weight_transfer_engine", {"init_info": {}})
    assert (status, message(body)) == (500, WRAP.format("ini"))
    # routes that catch their errors; a pure delay; another status
    request(eng, "POST", "/_slotsync/fault", {"route": "is_paused", "message": "ip"})
    assert request(eng, "GET", "/is_paused") == (
        500, {"error": "Failed to fetch pause status: Call to is_scheduler_paused method "
                       "failed: ip"})
    request(eng, "POST", "/_slotsync/fault",
            {"route": "get_world_size", "hang_s": 0.2, "status": 200})
    assert request(eng, "GET", "/get_world_size") == (200, {"world_size": 2})
    request(eng, "POST", "/_slotsync/fault", {"route": "get_world_size", "message": "gws"})
    status, body = request(eng, "GET", "/get_world_size")
    assert (status, message(body)) == (500, "gws")
    request(eng, "POST", "/_slotsync/fault", {"route": "weight_info", "status": 503,
                                              "message": "busy"})
    status, body = request(eng, "GET", "/weight_info")
    assert (status, message(body)) == (503, "Call to get_weight_version method failed: busy")
    s = stats(eng)
    assert s["route_counts"]["start_weight_update"] >= 3
    assert all(f["fired"] == f["times"] for f in s["faults"])
    assert request(eng, "POST", "/_slotsync/fault", {"clear": True}) == (200, {"faults": []})
    assert request(eng, "POST", "/_slotsync/fault", {"route": "x", "workers": [2]})[0] == 400


def test_sleep_wake_and_is_sleeping(eng: ReferenceEngine, segs: Segments) -> None:
    """vLLM 0.32 EngineCore.sleep / wake_up / is_sleeping: sleep pauses the scheduler first;
    is_sleeping is "scheduler paused or executor sleeping" (so a plain /pause makes it
    true); a partial wake (tags=weights) does not resume; level 2 discards the weights."""
    full_update(eng, segs, model_tensors(0), "base")
    before = sums(eng)
    assert request(eng, "POST", "/pause?mode=keep")[0] == 200
    assert request(eng, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert request(eng, "POST", "/resume")[0] == 200
    assert request(eng, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    # level 1 keeps the weights
    assert request(eng, "POST", "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
    assert request(eng, "GET", "/is_paused") == (200, {"is_paused": True})
    assert request(eng, "POST", "/wake_up") == (200, {"status": "awake", "tags": None})
    assert request(eng, "GET", "/is_paused") == (200, {"is_paused": False})
    assert sums(eng) == before
    # level 2 discards them; a partial wake keeps the engine paused and sleeping
    assert request(eng, "POST", "/sleep?level=2&mode=keep")[0] == 200
    assert stats(eng)["sleeping_tags"] == ["kv_cache", "weights"]
    assert request(eng, "POST", "/wake_up?tags=weights") == (
        200, {"status": "sleeping", "tags": ["weights"]})
    assert request(eng, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert request(eng, "GET", "/is_paused") == (200, {"is_paused": True})
    assert request(eng, "POST", "/wake_up?tags=kv_cache") == (
        200, {"status": "awake", "tags": ["kv_cache"]})
    assert request(eng, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert request(eng, "GET", "/is_paused") == (200, {"is_paused": False})
    after = sums(eng)
    for w in ("tp0", "tp1"):
        assert all(after[w][n] != before[w][n] for n in before[w])
    # level 0 pauses scheduling only; tags=scheduling resumes it
    assert request(eng, "POST", "/sleep?level=0")[0] == 200
    assert stats(eng)["sleeping_tags"] == []
    assert request(eng, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert request(eng, "POST", "/wake_up?tags=scheduling") == (
        200, {"status": "awake", "tags": ["scheduling"]})
    assert request(eng, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    full_update(eng, segs, model_tensors(0), "base")


def test_multiproc_executor_leaves_later_replies_unread(model_path: Path) -> None:
    """vLLM 0.32 MultiprocExecutor.collective_rpc (v1/executor/multiproc_executor.py
    ``get_response``) reads the workers' replies in rank order and raises at the first
    failure: the replies of the workers after it are never read there, and the next call
    reads them instead of its own. Here a second start fails on both workers; worker 1's
    failure reply is then what the (successful) finish reports."""
    with ReferenceEngine(workers=2, impl="vllm", model=model_path,
                         startup_timeout_s=300) as eng:
        assert request(eng, "POST", "/start_weight_update")[0] == 200
        status, body = request(eng, "POST", "/start_weight_update")
        assert status == 500 and ALREADY_ACTIVE in message(body)
        assert stats(eng)["unread_replies"] == [0, 1]  # worker 1's "already active"
        status, body = request(eng, "POST", "/finish_weight_update", {"weight_version": "v"})
        assert status == 500 and ALREADY_ACTIVE in message(body)  # a stale reply
        assert active(eng) == [False, False]  # the finish ran on both workers
        assert request(eng, "GET", "/weight_info")[1] == {"weight_version": "default"}
        assert stats(eng)["unread_replies"] == [0, 1]  # the lag stays
        assert request(eng, "POST", "/start_weight_update")[0] == 200  # reads the finish's
        # another failure on both: two replies behind; vLLM's dev-mode /collective_rpc with
        # check_health (vLLM's Worker.check_health returns None) first reads a stale success,
        # then the stale error of the start
        status, body = request(eng, "POST", "/start_weight_update")
        assert status == 500 and ALREADY_ACTIVE in message(body)
        assert stats(eng)["unread_replies"] == [0, 2]
        rpc = {"method": "check_health"}
        assert request(eng, "POST", "/collective_rpc", rpc) == (200, {"results": [None, None]})
        status, body = request(eng, "POST", "/collective_rpc", rpc)
        assert status == 500 and message(body) == WRAP.format(
            ALREADY_ACTIVE + ". Call finish_weight_update first.")
        # each worker's rpc_rank (WorkerWrapperBase, as vLLM's WorkerProc holds it): no other
        # call answers it, so the stale success (check_health's null) shows -- the daemon's
        # replies check (engine_session.CHECK_REPLIES)
        ranks = {"method": "__getattribute__", "args": ["rpc_rank"]}
        assert request(eng, "POST", "/collective_rpc", ranks) == (200, {"results": ["0", None]})


def test_impl_vllm_refuses_without_model_or_vllm(tmp_path: Path, run_module) -> None:
    cmd = [sys.executable, "-m", "slotsync.engine", "--impl", "vllm", "--workers", "1"]
    out = run_module(cmd)
    assert out.returncode == 2 and "--impl vllm needs --model" in out.stderr
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no vllm here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "m.safetensors").write_bytes(b"")  # (a file: --model is checked first)
    # (a new interpreter: the fake vllm must be what it imports)
    out = subprocess.run([*cmd, "--model", str(tmp_path / "m.safetensors")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--impl vllm needs vllm" in out.stderr and "no vllm here" in out.stderr


# --------------------------------------------------------------------------------------------
# the reference engine answers as vLLM's code does
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["reference", "vllm"],
                ids=["receive=reference", "receive=vllm"])
def ref_engine(model_path: Path, request: pytest.FixtureRequest) -> Iterator[ReferenceEngine]:
    """The reference engine with this model, receiving with its own code or (``--receive
    vllm``) with vLLM's IPCWeightTransferEngine.update_weights."""
    with ReferenceEngine(workers=2, model=model_path, receive=request.param,
                         startup_timeout_s=120) as eng:
        yield eng


def _run_step(eng: ReferenceEngine, fault: dict | None, method: str, path: str,
              body: Any) -> tuple[int, Any, bool]:
    """(status, body, closed): the call on a kept-alive connection, then whether the server
    closed that connection after answering."""
    if fault is not None:
        assert request(eng, "POST", "/_slotsync/fault", fault)[0] == 200
    conn = raw_conn(eng)
    try:
        status, got = on(conn, method, path, body)
        try:
            on(conn, "GET", "/get_world_size")
            closed = False
        except (ConnectionError, http.client.HTTPException):
            closed = True
    finally:
        conn.close()
    if path.startswith("/get_world_size") and isinstance(got, dict):
        got.pop("gpu_uuids", None)  # the reference engine's extension
    return status, got, closed


def test_reference_engine_answers_as_vllm_does(eng: ReferenceEngine, ref_engine: ReferenceEngine,
                                               segs: Segments) -> None:
    """The same calls -- bad bodies, the state machine, payloads of the wrong shape, a
    missing GPU UUID, a rank list too short, shutdown, pause / sleep / wake, injected faults
    -- give the same status, body and connection handling on both engines."""
    uuids = eng.gpu_uuids
    assert ref_engine.gpu_uuids == uuids
    t = model_tensors(13)
    unpacked = update_info(t, uuids, segs, packed=False)
    packed = update_info({UP: t[UP], SCALE: t[SCALE]}, uuids, segs, packed=True)
    misaligned = update_info({NORM: t[NORM], EMBED: t[EMBED]}, uuids, segs, packed=True)
    only_u0 = update_info({NORM: t[NORM]}, uuids[:1], segs, packed=False)
    per_rank = [update_info({NORM: t[NORM]}, [u], segs, packed=False) for u in uuids]
    steps: list[tuple[str, dict | None, str, str, Any]] = [
        ("world size", None, "GET", "/get_world_size?include_dp=true", None),
        ("paused", None, "GET", "/is_paused", None),
        ("sleeping", None, "GET", "/is_sleeping", None),
        ("no update_info", None, "POST", "/update_weights", {}),
        ("no init_info", None, "POST", "/init_weight_transfer_engine", {}),
        ("bad mode", None, "POST", "/pause?mode=sideways", None),
        ("level 3", None, "POST", "/sleep?level=3", None),
        ("level -1", None, "POST", "/sleep?level=-1", None),
        ("level x", None, "POST", "/sleep?level=x", None),
        ("init bad key", None, "POST", "/init_weight_transfer_engine",
         {"init_info": {"x": 1}}),
        ("init", None, "POST", "/init_weight_transfer_engine", {"init_info": {}}),
        ("start", None, "POST", "/start_weight_update", None),
        ("start again", None, "POST", "/start_weight_update", None),
        ("checksum on meta", None, "POST", "/weight_checker", {"action": "checksum"}),
        ("finish", None, "POST", "/finish_weight_update", None),
        ("finish again", None, "POST", "/finish_weight_update", None),
        ("update, no start", None, "POST", "/update_weights", {"update_info": unpacked}),
        ("start", None, "POST", "/start_weight_update", None),
        ("packed to unpacked", None, "POST", "/update_weights", {"update_info": packed}),
        ("init packed", None, "POST", "/init_weight_transfer_engine",
         {"init_info": {"packed": True}}),
        ("start", None, "POST", "/start_weight_update", None),
        ("unpacked to packed", None, "POST", "/update_weights", {"update_info": unpacked}),
        ("start", None, "POST", "/start_weight_update", None),
        ("list + sizes to packed", None, "POST", "/update_weights",
         {"update_info": {**unpacked, "tensor_sizes": [48, 8, 10, 32]}}),
        ("start", None, "POST", "/start_weight_update", None),
        ("misaligned", None, "POST", "/update_weights", {"update_info": misaligned}),
        ("init unpacked", None, "POST", "/init_weight_transfer_engine",
         {"init_info": {"packed": False}}),
        ("start", None, "POST", "/start_weight_update", None),
        ("uuid missing", None, "POST", "/update_weights", {"update_info": only_u0}),
        ("start split", None, "POST", "/start_weight_update", None),
        ("finish split", None, "POST", "/finish_weight_update", None),
        ("start", None, "POST", "/start_weight_update", None),
        ("list too short", None, "POST", "/update_weights", {"update_info": per_rank[:1]}),
        ("finish split", None, "POST", "/finish_weight_update", None),
        ("start", None, "POST", "/start_weight_update", None),
        ("rank list", None, "POST", "/update_weights", {"update_info": [*per_rank, {}]}),
        ("shutdown in update", None, "POST", "/shutdown_weight_transfer_engine", None),
        ("finish", None, "POST", "/finish_weight_update", {"weight_version": "p1"}),
        ("version", None, "GET", "/weight_info", None),
        ("check_health", None, "POST", "/collective_rpc", {"method": "check_health"}),
        ("rpc no method", None, "POST", "/collective_rpc", {"args": []}),
        ("rpc not an object", None, "POST", "/collective_rpc", [1]),
        ("rpc unknown", None, "POST", "/collective_rpc", {"method": "nope"}),
        ("shutdown", None, "POST", "/shutdown_weight_transfer_engine", None),
        ("pause", None, "POST", "/pause?mode=keep", None),
        ("paused is sleeping", None, "GET", "/is_sleeping", None),
        ("resume", None, "POST", "/resume", None),
        ("sleep 2", None, "POST", "/sleep?level=2&mode=keep", None),
        ("wake weights", None, "POST", "/wake_up?tags=weights", None),
        ("still sleeping", None, "GET", "/is_sleeping", None),
        ("still paused", None, "GET", "/is_paused", None),
        ("wake unknown", None, "POST", "/wake_up?tags=bogus", None),
        ("wake kv", None, "POST", "/wake_up?tags=kv_cache", None),
        ("awake", None, "GET", "/is_paused", None),
        ("pause fault", {"route": "pause", "message": "f1"}, "POST", "/pause?mode=keep", None),
        ("resume fault", {"route": "resume", "message": "f2"}, "POST", "/resume", None),
        ("is_paused fault", {"route": "is_paused", "message": "f3"}, "GET", "/is_paused",
         None),
        ("start fault", {"route": "start_weight_update", "message": "f4"}, "POST",
         "/start_weight_update", None),
        ("version fault", {"route": "weight_info", "status": 503, "message": "f5"}, "GET",
         "/weight_info", None),
        ("start", None, "POST", "/start_weight_update", None),
        ("worker fault", {"route": "update_weights", "workers": [1], "message": "f6"},
         "POST", "/update_weights", {"update_info": unpacked}),
        ("finish after", None, "POST", "/finish_weight_update", None),
        ("start", None, "POST", "/start_weight_update", None),
        ("full update", None, "POST", "/update_weights", {"update_info": unpacked}),
        ("finish", None, "POST", "/finish_weight_update", {"weight_version": "p2"}),
        ("version", None, "GET", "/weight_info", None),
    ]
    request(ref_engine, "POST", "/_slotsync/fault", {"clear": True})
    request(ref_engine, "POST", "/finish_weight_update")
    request(ref_engine, "POST", "/resume")
    theirs = [_run_step(eng, *s[1:]) for s in steps]
    ours = [_run_step(ref_engine, *s[1:]) for s in steps]
    for (label, *_), a, b in zip(steps, theirs, ours, strict=True):
        assert b == a, f"step {label!r}: vLLM {a}, reference {b}"
    assert checksums_by_worker({"checksums": {f"dp0:pp0:pcp0:tp{i}:{n}": h for i in range(2)
                                              for n, h in want_sums(t).items()}}) == \
        sums(eng)
    ref = checksums_by_worker(request(ref_engine, "POST", "/weight_checker",
                                      {"action": "checksum"})[1])
    assert ref == {u: want_sums(t) for u in uuids}

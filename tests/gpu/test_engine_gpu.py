"""Reference engine with real CUDA IPC handles (needs a CUDA GPU; skipped otherwise).

A separate producer process (standing in for a trainer rank) puts tensors on cuda:0 and exports
them with ``torch.multiprocessing.reductions.reduce_tensor``; the test turns the exported args
into ``CudaIpcHandle`` records, pickles them with the daemon's writer, and an engine with two
workers on cuda:0 (two logical GPU UUIDs sharing the GPU) maps and loads them, unpacked and
packed. Checksums must equal the producer's. The engine tests run twice: receiving with the
reference engine's own code and with vLLM's (``--receive vllm``, from the installed vllm or
the ``build/vllm-shim`` of ``tools/vllm_shim.py``; skipped when neither imports).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from slotsync.daemon.vllm.ipc_pickle import b64, pickle_packed, pickle_unpacked
from slotsync.engine.checksum import tensor_checksum
from slotsync.engine.launcher import ReferenceEngine
from slotsync.protocol.wire import CudaIpcHandle, logical_gpu_uuid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def handle_record(t: torch.Tensor) -> dict[str, Any]:
    """``reduce_tensor(t)[1]`` as the keyword arguments of ``CudaIpcHandle`` (field order of
    ``rebuild_cuda_tensor``, torch 2.x)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (
        tensor_cls, size, stride, storage_offset, storage_cls, dtype, device, ipc_handle,
        storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
        ref_counter_offset, event_handle, event_sync_required,
    ) = args  # fmt: skip
    return {
        "tensor_class": _qualname(tensor_cls),
        "size": tuple(size),
        "stride": tuple(stride),
        "storage_offset": int(storage_offset),
        "storage_class": _qualname(storage_cls),
        "dtype": str(dtype).split(".")[-1],
        "device": int(device),
        "ipc_handle": bytes(ipc_handle),
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "requires_grad": bool(requires_grad),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": None if event_handle is None else bytes(event_handle),
        "event_sync_required": bool(event_sync_required),
    }


def producer_main(conn: Connection) -> None:
    """Trainer-rank stand-in: export tensors (unpacked) and one packed buffer, keep them alive
    until told to stop, then ``ipc_collect``."""
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 32, generator=g).to(
            torch.bfloat16
        ),
        "model.norm.weight": torch.randn(32, generator=g),
    }
    cuda = {n: t.cuda().contiguous() for n, t in tensors.items()}
    packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in cuda.values()])
    torch.cuda.synchronize()
    conn.send(
        {
            "names": list(cuda),
            "dtype_names": [str(t.dtype).split(".")[-1] for t in cuda.values()],
            "shapes": [list(t.shape) for t in cuda.values()],
            "tensor_sizes": [t.numel() * t.element_size() for t in cuda.values()],
            "checksums": {n: tensor_checksum(t) for n, t in cuda.items()},
            "gpu_uuid": str(torch.cuda.get_device_properties(0).uuid),
            "unpacked": [handle_record(t) for t in cuda.values()],
            "packed": handle_record(packed),
        }
    )
    conn.recv()  # until the engine finished with the memory
    del cuda, packed
    torch.cuda.ipc_collect()
    conn.send("bye")


@pytest.fixture(scope="module")
def exported() -> Iterator[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer_main, args=(child,), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        pytest.fail("producer did not export its tensors in time")
    yield parent.recv()
    parent.send("stop")
    parent.poll(30)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


@pytest.mark.parametrize("packed", [False, True])
def test_cuda_ipc_load_two_logical_workers(exported: dict[str, Any], packed: bool,
                                           receive: tuple[str, dict[str, str]]) -> None:
    uuids = [logical_gpu_uuid(0), logical_gpu_uuid(1)]
    meta = {k: exported[k] for k in ("names", "dtype_names", "shapes")}
    if packed:
        h = CudaIpcHandle(**exported["packed"])
        info = {
            **meta,
            "tensor_sizes": exported["tensor_sizes"],
            "ipc_handles_pickled": b64(pickle_packed({u: h for u in uuids})),
        }
    else:
        hs = [CudaIpcHandle(**r) for r in exported["unpacked"]]
        info = {**meta, "ipc_handles_pickled": b64(pickle_unpacked(uuids, [hs, hs]))}
    with ReferenceEngine(
        workers=2, device="cuda", cuda_devices=[0, 0], gpu_uuids=uuids, startup_timeout_s=180,
        receive=receive[0], env=receive[1],
    ) as eng:
        init = {"init_info": {"packed": packed}}
        assert eng.request("POST", "/init_weight_transfer_engine", init)[0] == 200
        assert eng.request("POST", "/start_weight_update")[0] == 200
        status, body = eng.request("POST", "/update_weights", {"update_info": info})
        assert status == 200, body
        assert eng.request("POST", "/finish_weight_update", {"weight_version": "g1"})[0] == 200
        want = exported["checksums"]
        status, body = eng.request(
            "POST", "/weight_checker", {"action": "compare", "baseline": want}
        )
        assert (status, body) == (200, {"match": True, "mismatches": []})


@pytest.mark.parametrize("packed", [False, True])
def test_vllm_impl_on_cuda_two_logical_workers(exported: dict[str, Any], packed: bool,
                                               tmp_path: Path) -> None:
    """``--impl vllm`` on CUDA: vLLM's gpu_worker.Worker, IPCWeightTransferEngine (real
    rebuild_cuda_tensor, PackedBufferImporter) and layerwise reload on cuda:0, two logical
    GPU UUIDs (each worker's get_device_properties(0).uuid stood in for). Needs the vllm
    package (not the shim)."""
    pytest.importorskip("vllm.v1.worker.gpu_worker")
    from safetensors.torch import save_file

    from slotsync.engine.checksum import checksums_by_worker

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    model = {n: torch.zeros(shape, dtype=dtypes[d]) for n, d, shape in
             zip(exported["names"], exported["dtype_names"], exported["shapes"], strict=True)}
    save_file(model, str(tmp_path / "m.safetensors"))
    uuids = [logical_gpu_uuid(0), logical_gpu_uuid(1)]
    meta = {k: exported[k] for k in ("names", "dtype_names", "shapes")}
    if packed:
        info = {**meta, "tensor_sizes": exported["tensor_sizes"], "ipc_handles_pickled":
                b64(pickle_packed({u: CudaIpcHandle(**exported["packed"]) for u in uuids}))}
    else:
        hs = [CudaIpcHandle(**r) for r in exported["unpacked"]]
        info = {**meta, "ipc_handles_pickled": b64(pickle_unpacked(uuids, [hs, hs]))}
    with ReferenceEngine(workers=2, device="cuda", cuda_devices=[0, 0], gpu_uuids=uuids,
                         impl="vllm", model=tmp_path / "m.safetensors",
                         startup_timeout_s=300) as eng:
        init = {"init_info": {"packed": packed}}
        assert eng.request("POST", "/init_weight_transfer_engine", init)[0] == 200
        assert eng.request("POST", "/start_weight_update")[0] == 200
        status, body = eng.request("POST", "/update_weights", {"update_info": info})
        assert status == 200, body
        assert eng.request("POST", "/finish_weight_update", {"weight_version": "g"})[0] == 200
        status, body = eng.request("POST", "/weight_checker", {"action": "checksum"})
        assert status == 200, body
        assert checksums_by_worker(body) == {"tp0": exported["checksums"],
                                             "tp1": exported["checksums"]}


def test_default_uuid_is_the_real_one(exported: dict[str, Any],
                                      receive: tuple[str, dict[str, str]]) -> None:
    """Without --gpu-uuids a CUDA worker answers to torch's UUID of its device (vLLM's
    receive path then looks it up itself: nothing is stood in for)."""
    real = exported["gpu_uuid"]
    hs = [CudaIpcHandle(**r) for r in exported["unpacked"]]
    info = {
        **{k: exported[k] for k in ("names", "dtype_names", "shapes")},
        "ipc_handles_pickled": b64(pickle_unpacked([real], [hs])),
    }
    with ReferenceEngine(workers=1, device="cuda", startup_timeout_s=180,
                         receive=receive[0], env=receive[1]) as eng:
        assert eng.gpu_uuids == [real]
        assert eng.request("POST", "/init_weight_transfer_engine", {"init_info": {}})[0] == 200
        assert eng.request("POST", "/start_weight_update")[0] == 200
        status, body = eng.request("POST", "/update_weights", {"update_info": info})
        assert status == 200, body
        assert eng.request("POST", "/finish_weight_update")[0] == 200
        sums = eng.request("POST", "/weight_checker", {"action": "checksum"})[1]["checksums"]
        assert sums == {real: dict(sorted(exported["checksums"].items()))}


def chunks_producer_main(conn: Connection, n: int, numel: int) -> None:
    """A rank with ``n`` one-tensor chunks in ``n`` regions of one block (the publisher's
    staging with n regions). Commands: ``("fill", value)`` fills region k with ``value + k``
    and answers a fresh export per region (update_info fields) and the expected checksums;
    ``("scribble",)`` overwrites every region; ``("stop",)`` releases and exits."""
    torch.cuda.set_device(0)
    block = torch.empty(n * numel, dtype=torch.float32, device="cuda")
    regions = [block[k * numel:(k + 1) * numel] for k in range(n)]
    while True:
        cmd = conn.recv()
        if cmd[0] == "fill":
            for k, r in enumerate(regions):
                r.fill_(cmd[1] + k)
            torch.cuda.synchronize()
            conn.send(([handle_record(r.view(torch.uint8)) for r in regions],
                       {f"w.{k}": tensor_checksum(r) for k, r in enumerate(regions)}))
        elif cmd[0] == "scribble":
            block.fill_(-1.0)
            torch.cuda.synchronize()
            conn.send("ok")
        else:
            break
    del regions, block
    torch.cuda.ipc_collect()
    conn.send("bye")


def test_queued_chunks_overlap_yet_each_answer_waits_for_its_copy() -> None:
    """Chunks written to a worker back to back (the daemon's chunks_in_flight): once a chunk
    is planned, the worker prepares and launches the next one before it waits for the copy of
    the one before, yet answers each only after its copy is done -- the producer overwrites
    every region as soon as the answers are in, and the weights keep the chunks' values."""
    import asyncio

    from slotsync.engine.reference.server import WorkerPool
    from slotsync.engine.reference.worker import WorkerSpec
    from slotsync.protocol.rank import gather

    if not gather.available():
        pytest.skip("the deferred wait is the scatter kernel's (needs Triton)")
    n, numel = 6, 4 << 20  # six 16 MiB chunks
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=chunks_producer_main, args=(child, n, numel), daemon=True)
    proc.start()
    uuid = logical_gpu_uuid(0)
    pool = WorkerPool([WorkerSpec(0, "cuda:0", uuid, None)], startup_timeout_s=180)
    try:
        def infos(value: float) -> tuple[list[dict], dict[str, str]]:
            conn.send(("fill", value))
            records, sums = conn.recv()
            return [{
                "names": [f"w.{k}"], "dtype_names": ["float32"], "shapes": [[numel]],
                "tensor_sizes": [numel * 4],
                "ipc_handles_pickled": b64(pickle_packed({uuid: CudaIpcHandle(**rec)})),
            } for k, rec in enumerate(records)], sums

        async def one_round(value: float, together: bool) -> dict[str, str]:
            chunks, sums = infos(value)
            await pool.collective_rpc("start_weight_update")
            calls = [pool.collective_rpc("update_weights", {"update_info": c}) for c in chunks]
            if together:
                assert await asyncio.gather(*calls) == [[numel * 4]] * n
                conn.send(("scribble",))  # every answer is in: the regions are ours again
                assert conn.recv() == "ok"
            else:
                for c in calls:
                    await c
            await pool.collective_rpc("finish_weight_update")
            return sums

        async def rounds() -> None:
            await pool.collective_rpc("init_weight_transfer_engine",
                                      {"init_info": {"packed": True}})
            await one_round(1.0, False)  # creates the weights
            await one_round(10.0, False)  # loads in place, keeps each chunk's plan
            want = await one_round(100.0, True)  # planned: prepared while the last copy runs
            (got,) = await pool.collective_rpc("checksums")
            assert got == want
            (stats,) = await pool.collective_rpc("stats")
            assert stats["scattered_chunks"] == n and stats["overlapped_chunks"] >= 1, stats

        asyncio.run(rounds())
    finally:
        pool.close()
        conn.send(("stop",))
        conn.poll(30)
        proc.join(30)
        if proc.is_alive():
            proc.kill()

"""FSDP2 on CUDA (issue 17 B): a ``fully_shard`` model on cuda:0 under NCCL publishes
``FSDP2Source(model).iter_sharded()`` through slotsyncd into a reference engine on the same
GPU, so each DTensor is all-gathered by NCCL straight into the CUDA staging region (queued on
the current stream, covered by the staging buffer's events) and exported from there; the
workers' checksums (both receive paths, vLLM's ``IPCWeightTransferEngine`` through the shim
included) equal the unsharded model's.

One rank: NCCL refuses two ranks of one communicator on one GPU, and machines with several GPUs
were not lent when this was written; the gather runs over a mesh of one, which still drives
``export.gather_shard``'s NCCL path into the region. Skips without a GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402
from slotsync.protocol.wire import logical_gpu_uuid  # noqa: E402

pytestmark = pytest.mark.gpu

STAGING_BYTES = 1 << 20  # several chunks per round; the 2 MiB embedding goes as its own chunk


def make_model() -> Any:
    torch.manual_seed(99)
    return torch.nn.Sequential(
        torch.nn.Embedding(4099, 256).to(torch.bfloat16),  # 2 MiB: larger than a region
        torch.nn.Linear(256, 257),
        torch.nn.LayerNorm(257),
        torch.nn.Linear(257, 3),
    )


def _rank(port: int, endpoint: str, url: str, packed: bool, q: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from slotsync.integrations.fsdp import FSDP2Source
    from slotsync.testing.ranks import rank_publisher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        model = make_model().cuda()
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
        source = FSDP2Source(model)
        assert all(isinstance(t, DTensor) for _, t in source.iter_sharded())
        with rank_publisher(endpoint, 0, (0, 1), url, device="cuda:0", packed=packed,
                            staging_bytes=STAGING_BYTES, staging_buffers=2,
                            timeout_s=120.0) as pub:
            pub.register()
            for k in (1, 2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.to_local().mul_(2)
                pub.publish(source.iter_sharded(), f"fsdp-cuda-{k}")
        dist.destroy_process_group()
        q.put(None)
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(traceback.format_exc())


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_fsdp2_on_cuda_gathers_into_staging_and_lands(packed, receive):
    from slotsync.testing.ports import free_port

    path, env = receive
    with ReferenceEngine(workers=1, device="cuda", gpu_uuids=[logical_gpu_uuid(0)],
                         cuda_devices=[0], receive=path, env=env) as eng, DaemonProcess() as d:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_rank, args=(free_port(), d.endpoint, eng.url, packed, q))
        p.start()
        err = q.get(timeout=240)
        p.join(30)
        assert err is None, f"{err}\n{d.log_tail()}"
        with torch.no_grad():
            want = {n: tensor_checksum(t.detach() * 4) for n, t in make_model().named_parameters()}
        _, body = eng.request("POST", "/weight_checker", {"action": "checksum"})
        (sums,) = body["checksums"].values()
        assert {n: sums[n] for n in want} == want
        assert eng.request("GET", "/weight_info")[1]["weight_version"] == "fsdp-cuda-2"

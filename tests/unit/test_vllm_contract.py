"""Contract test: the daemon's bodies as vLLM 0.33 itself parses them.

Runs only where vLLM is importable (``pip install vllm==0.33.0``; marked ``vllm``). The
daemon's ``init_weight_transfer_engine`` and ``update_weights`` bodies go through
``IPCWeightTransferEngine.parse_init_info`` / ``parse_update_info`` — vLLM's own validation,
unpickling of ``ipc_handles_pickled`` included (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
"""

from __future__ import annotations

import json
import math
import os

import msgspec
import pytest

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
ipc = pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
torch = pytest.importorskip("torch")

from slotsync.daemon.vllm.merge import merge_chunk  # noqa: E402
from slotsync.protocol.wire import Chunk, CudaIpcHandle  # noqa: E402

pytestmark = pytest.mark.vllm

U0 = "8a1e2c3d-4b5f-6789-abcd-ef0123456789"
U1 = "9b2f3d4e-5c60-789a-bcde-f01234567890"


def engine_stub():
    # parse_* only read the class's dataclass types; no GPU, no vLLM config needed.
    return object.__new__(ipc.IPCWeightTransferEngine)


def handle(nbytes: int, dtype: str = "uint8", size=None, device: int = 0) -> CudaIpcHandle:
    size = size or (nbytes,)
    stride = tuple(math.prod(size[i + 1:]) for i in range(len(size)))
    return CudaIpcHandle("torch.Tensor", size, stride, 0,
                         "torch.storage.TypedStorage", dtype, device, b"\x07" * 66, nbytes, 0,
                         False, b"/torch_1_2", 0, b"\x09" * 64, True)


def chunks(packed: bool) -> dict[int, Chunk]:
    names, dts, shapes, sizes = ["a.weight", "b.bias"], ["bfloat16", "float32"], [[4, 2], [3]], \
        [16, 12]
    out = {}
    for r in range(2):
        if packed:
            hs = [handle(28, device=r)]
        else:
            hs = [handle(16, "bfloat16", (4, 2), r), handle(12, "float32", (3,), r)]
        out[r] = Chunk(0, 0, names, dts, shapes, sizes, hs)
    return out


def test_init_info_parses():
    info = engine_stub().parse_init_info({"packed": True})
    assert getattr(info, "packed", True) is True


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_update_info_parses_and_unpickles(packed):
    merged = merge_chunk(0, chunks(packed), {0: U0, 1: U1}, packed=packed, transport="cuda",
                         world_size=2)
    # what vLLM's server hands its engine: the daemon's JSON body (msgspec writes the pickle's
    # bytes as base64 text), decoded by a standard JSON parser
    body = json.loads(msgspec.json.encode({"update_info": merged.update_info}))
    parsed = engine_stub().parse_update_info(body["update_info"])
    assert parsed.names == ["a.weight", "b.bias"]
    hs = parsed.ipc_handles
    per_tensor = [hs] if packed else hs
    for d in per_tensor:
        assert set(d) == {U0, U1}
        args = d[U1]
        assert len(args) == 15 and args[0] is torch.Tensor and args[6] == 1
        assert isinstance(args[1], torch.Size) and args[4] is torch.storage.TypedStorage

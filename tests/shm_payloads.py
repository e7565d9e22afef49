"""Shared-memory payloads for the engine tests (``tests/integration/test_engine.py``,
``test_vllm_shim.py``): segments a test writes tensors into, and vLLM's ``update_info`` for
an unpacked or a packed chunk built on them with the daemon's own pickle writer
(``slotsync.daemon.vllm.ipc_pickle``). The ``segs`` fixture is in ``conftest.py``."""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Any

import torch

from slotsync.daemon.vllm.ipc_pickle import b64, pickle_packed, pickle_unpacked
from slotsync.protocol.wire import ShmHandle


def bytes_of(t: torch.Tensor) -> bytes:
    """The tensor's elements as bytes (contiguous, native byte order)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def dtype_name(t: torch.Tensor) -> str:
    """The dtype as vLLM's ``dtype_names`` spells it (``bfloat16``)."""
    return str(t.dtype).split(".")[-1]


class Segments:
    """Shared-memory segments created by a test (closed and unlinked at teardown)."""

    def __init__(self) -> None:
        self.segs: list[shared_memory.SharedMemory] = []

    def put(self, data: bytes, size: int | None = None) -> shared_memory.SharedMemory:
        shm = shared_memory.SharedMemory(create=True, size=max(1, size or len(data)))
        shm.buf[: len(data)] = data
        self.segs.append(shm)
        return shm

    def close(self) -> None:
        for s in self.segs:
            s.close()
            s.unlink()


def unpacked_info(
    tensors: dict[str, torch.Tensor], uuids: list[str], segs: Segments
) -> dict[str, Any]:
    """update_info for an unpacked chunk: one segment per (tensor, worker)."""
    by_rank: list[list[ShmHandle]] = [[] for _ in uuids]
    for t in tensors.values():
        data = bytes_of(t)
        for handles in by_rank:
            handles.append(ShmHandle(segment=segs.put(data).name, offset=0, nbytes=len(data)))
    dtype_names = [dtype_name(t) for t in tensors.values()]
    shapes = [list(t.shape) for t in tensors.values()]
    return {
        "names": list(tensors),
        "dtype_names": dtype_names,
        "shapes": shapes,
        "ipc_handles_pickled": b64(pickle_unpacked(uuids, by_rank, dtype_names=dtype_names,
                                                   shapes=shapes)),
    }


def packed_info(tensors: dict[str, torch.Tensor], by_uuid: dict[str, ShmHandle]) -> dict[str, Any]:
    """update_info for a packed chunk whose buffer handles are ``by_uuid``."""
    return {
        "names": list(tensors),
        "dtype_names": [dtype_name(t) for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "tensor_sizes": [t.numel() * t.element_size() for t in tensors.values()],
        "ipc_handles_pickled": b64(pickle_packed(by_uuid)),
    }


def sample_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # (in this order every tensor's byte offset in a packed chunk is a multiple of its
    # element size, as vLLM's packed consumer needs: test_packed_offsets_must_be_aligned)
    up = torch.randn(4, 3, generator=g)
    norm = torch.randn(5, generator=g).to(torch.bfloat16)
    embed = torch.randint(-100, 100, (2, 2, 2), generator=g).to(torch.int32)
    return {
        "model.layers.0.mlp.up_proj.weight": up,
        "model.embed_tokens.weight": embed,
        "model.norm.weight": norm,
    }

"""Stand-ins for a rank's CUDA exports, for benchmarks without a GPU (``bench control``,
``bench profile-chunk``): the argument tuples ``torch.multiprocessing.reductions.reduce_tensor``
returns, which ``export.handle_from_reduce_args`` turns into ``wire.CudaIpcHandle`` records.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from slotsync.bench.model import TensorSpec

__all__ = ["FakeExports"]


class FakeExports:
    """Synthetic ``reduce_tensor(t)[1]`` tuples, standing in for real CUDA exports.

    Every export gets a fresh ref-counter offset (torch allocates one per export), so neither
    system can hit a cache a real round would miss; packed, one export per round serves every
    chunk, as the publisher sends it.

    Args:
        rank: the rank whose exports these stand for (fills the handle bytes).
    """

    def __init__(self, rank: int) -> None:
        import torch

        self.torch = torch
        self.rank = rank
        self.counter = 0
        self.ipc = bytes([rank % 256]) * 66  # torch: 64-byte cudaIpcMemHandle + framing
        self.ref = f"/torch_{os.getpid()}_{rank}_ref".encode()
        self.event = bytes([(rank + 1) % 256]) * 64

    def args(self, shape: Sequence[int], dtype: Any, nbytes: int, offset: int) -> tuple:
        """One export's 15 ``reduce_tensor`` arguments: a tensor of ``shape`` and ``dtype``
        (a torch dtype) at ``offset`` bytes of a storage of ``nbytes`` bytes."""
        self.counter += 1
        stride = []
        acc = 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= d
        t = self.torch
        # New bytes objects per export, as torch's _share_cuda_ returns: pickle's memo must
        # not share them across handles (it would, for one reused object).
        tag = self.counter.to_bytes(4, "little")
        return (t.Tensor, t.Size(shape), tuple(reversed(stride)), 0, t.storage.TypedStorage,
                dtype, 0, self.ipc[:-4] + tag, nbytes, offset, False, self.ref + b"",
                self.counter * 8, self.event[:-4] + tag, True)

    def round(self, chunks: list[list[TensorSpec]], packed: bool, staging_bytes: int,
              staging_buffers: int = 1) -> list[list[tuple]]:
        """Every chunk's exports for one round, as ``CudaStagingBuffer`` makes them: packed
        with one region, the one export of the region that every chunk of the update sends;
        with two, a fresh export per chunk of alternating halves of one block (same CUDA
        memory handle, tensor offset 0 or ``cap``); unpacked, one per tensor."""
        if not packed:
            return [self.chunk(c) for c in chunks]
        cap = max(staging_bytes, *(sum(s.nbytes for s in c) for c in chunks))
        if staging_buffers == 1:
            one = [self.args((cap,), self.torch.uint8, cap, 0)]
            return [one for _ in chunks]
        out = []
        for k in range(len(chunks)):
            a = list(self.args((cap,), self.torch.uint8, cap * staging_buffers, 0))
            a[3] = (k % staging_buffers) * cap  # the region's offset in the block
            if k:
                a[7] = out[0][0][7]  # one block: one CUDA IPC memory handle
            out.append([tuple(a)])
        return out

    def chunk(self, specs: list[TensorSpec]) -> list[tuple]:
        """An unpacked chunk's exports: one per tensor."""
        t = self.torch
        out, off = [], 0
        for s in specs:
            out.append(self.args(s.shape, getattr(t, s.dtype), s.nbytes, off))
            off += s.nbytes
        return out

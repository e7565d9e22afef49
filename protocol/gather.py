"""Gather many CUDA tensors into one flat buffer with a single kernel launch.

Packing a chunk into the staging region is one copy of its bytes, but done through torch it
costs per-tensor Python: each source must be viewed flat and reinterpreted before
``torch.cat`` takes it (~3.5 µs per tensor on the H200 host, 22 ms for the 6,291 tensors of
``slotsync bench gpu``'s round, more than the copy itself). Here the per-tensor work is
reading ``data_ptr()``: a table of (source address, destination offset, length) goes to the
GPU and one Triton kernel copies every piece, reading each source through its address.

Used by ``export.plan_pack`` when Triton is importable (it ships with CUDA builds of torch)
and every source is a contiguous tensor on the buffer's device whose address and size are
multiples of 8 bytes; otherwise the caller takes the ``torch.cat`` path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

_BLOCK = 2048  # int64 elements (16 KiB) per program and loop step
_MAX_PROGRAMS_PER_TENSOR = 64


@functools.cache
def _kernel():  # noqa: ANN202 - a Triton JIT function
    """Compile lazily: importing this module must work without Triton (CPU installs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_i64(table_ptr, dst_ptr, BLOCK: tl.constexpr):  # noqa: N803 - Triton style
        # program (t, j): tensor t, steps j, j + G, j + 2G, ... of BLOCK elements
        t = tl.program_id(0)
        j = tl.program_id(1)
        g = tl.num_programs(1)
        src = tl.load(table_ptr + 3 * t).to(tl.pointer_type(tl.int64))
        off = tl.load(table_ptr + 3 * t + 1)
        n = tl.load(table_ptr + 3 * t + 2)
        for start in range(j * BLOCK, n, g * BLOCK):
            idx = start + tl.arange(0, BLOCK)
            mask = idx < n
            tl.store(dst_ptr + off + idx, tl.load(src + idx, mask=mask), mask=mask)

    return gather_i64


@functools.cache
def available() -> bool:
    """Whether Triton can be imported (CUDA builds of torch bring it) and the environment
    does not set ``SLOTSYNC_GATHER=0`` (which keeps the ``torch.cat`` path, for comparison)."""
    if os.environ.get("SLOTSYNC_GATHER", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def gather_table(ptrs: Sequence[int], sizes: Sequence[int], device: torch.device
                 ) -> torch.Tensor | None:
    """The kernel's table for sources at ``ptrs`` of ``sizes`` bytes laid back to back from
    offset 0: int64, shape ``(k, 3)`` (address, offset and length in 8-byte words, one row
    per non-empty source), on ``device``. None unless every non-empty source's address and
    size is a multiple of 8 (then the caller copies another way).

    Built with a few tensor operations, not a Python loop: chunks hold thousands of tensors.
    """
    p = torch.tensor(ptrs, dtype=torch.int64)
    n = torch.tensor(sizes, dtype=torch.int64)
    keep = n > 0
    if not bool(keep.all()):
        p, n = p[keep], n[keep]
    if bool(((p | n) & 7).any()):
        return None
    words = n // 8
    offsets = torch.cumsum(words, 0) - words
    return torch.stack((p, offsets, words), dim=1).to(device)


def gather_into(dst: torch.Tensor, table: torch.Tensor, largest: int) -> None:
    """Copy every source of ``table`` (``gather_table``) into ``dst``, a flat int64 CUDA
    tensor (8-byte words), on the current stream; ``largest``: the longest source in bytes.
    The sources must stay alive until the stream has run the copy."""
    words = largest // 8
    per_tensor = max(1, min(_MAX_PROGRAMS_PER_TENSOR, -(-words // _BLOCK)))
    _kernel()[(table.shape[0], per_tensor)](table, dst, BLOCK=_BLOCK, num_warps=8)

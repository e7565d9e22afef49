"""Gather many CUDA tensors into one flat buffer, or scatter one buffer into many tensors,
with a single kernel launch.

Packing a chunk into the staging region is one copy of its bytes, but done through torch it
costs per-tensor Python: each source must be viewed flat and reinterpreted before
``torch.cat`` takes it (a few µs per tensor: for thousands of tensors, more than the copy
itself; ``BENCHMARKS.md``). Here the per-tensor work is
reading ``data_ptr()``: a table of (source address, destination offset, length) goes to the
GPU and one Triton kernel copies every piece, reading each source through its address.

Used by ``export.plan_pack`` when Triton is importable (it ships with CUDA builds of torch)
and every source is a contiguous tensor on the buffer's device whose address and size are
multiples of 8 bytes; otherwise the caller takes the ``torch.cat`` path. The reference
engine scatters a packed chunk into its weights the same way (``scatter_from``), with the
table of a chunk it has seen before kept on the GPU.
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
    def copy_pieces_i64(table_ptr, buf_ptr, SCATTER: tl.constexpr,  # noqa: N803 - Triton style
                        BLOCK: tl.constexpr):
        # program (t, j): tensor t, steps j, j + G, j + 2G, ... of BLOCK elements; gather
        # copies tensor t into the buffer at its offset, scatter the other way round
        t = tl.program_id(0)
        j = tl.program_id(1)
        g = tl.num_programs(1)
        ptr = tl.load(table_ptr + 3 * t).to(tl.pointer_type(tl.int64))
        off = tl.load(table_ptr + 3 * t + 1)
        n = tl.load(table_ptr + 3 * t + 2)
        for start in range(j * BLOCK, n, g * BLOCK):
            idx = start + tl.arange(0, BLOCK)
            mask = idx < n
            if SCATTER:
                tl.store(ptr + idx, tl.load(buf_ptr + off + idx, mask=mask), mask=mask)
            else:
                tl.store(buf_ptr + off + idx, tl.load(ptr + idx, mask=mask), mask=mask)

    return copy_pieces_i64


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


_TABLES: dict[tuple, torch.Tensor | None] = {}  # see gather_table
_MAX_TABLES = 512


def gather_table(ptrs: Sequence[int], sizes: Sequence[int], device: torch.device
                 ) -> torch.Tensor | None:
    """The kernel's table for tensors at ``ptrs`` of ``sizes`` bytes laid back to back from
    offset 0 of a buffer: int64, shape ``(k, 3)`` (address, offset and length in 8-byte
    words, one row per non-empty tensor), on ``device``. None unless every non-empty
    tensor's address and size is a multiple of 8 (then the caller copies another way).

    Built with a few tensor operations, not a Python loop: chunks hold thousands of tensors.
    A table is a function of its arguments and the kernels only read it, so the last
    ``_MAX_TABLES`` are kept: each round publishes the same tensors (a model's parameters
    stay where they are), and its chunks' tables are then found, not built and uploaded.
    """
    key = (device, tuple(ptrs), tuple(sizes))
    table = _TABLES.get(key, False)
    if table is False:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        table = _TABLES[key] = build_table(ptrs, sizes, device)
    return table


def build_table(ptrs: Sequence[int], sizes: Sequence[int], device: torch.device
                ) -> torch.Tensor | None:
    """``gather_table`` without its cache, for a caller that keeps the table itself."""
    p = torch.tensor(ptrs, dtype=torch.int64)
    n = torch.tensor(sizes, dtype=torch.int64)
    keep = n > 0
    if not bool(keep.all()):
        p, n = p[keep], n[keep]
    if bool(((p | n) & 7).any()):
        return None
    words = n // 8
    offsets = torch.cumsum(words, 0) - words
    table = torch.stack((p, offsets, words), dim=1)
    # From pinned memory without blocking: a copy from pageable memory waits for the
    # stream, i.e. for the chunk still being packed, which is what the caller overlaps.
    # (torch's pinned allocator keeps the memory until the copy ran.)
    if torch.device(device).type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def gather_into(dst: torch.Tensor, table: torch.Tensor, largest: int) -> None:
    """Copy every tensor of ``table`` (``gather_table``) into ``dst``, a flat int64 CUDA
    tensor (8-byte words), on the current stream; ``largest``: the longest tensor in bytes.
    The tensors must stay alive until the stream has run the copy."""
    _launch(dst, table, largest, scatter=False)


def scatter_from(src: torch.Tensor, table: torch.Tensor, largest: int) -> None:
    """The reverse of ``gather_into``: copy each piece of ``src`` (flat int64 CUDA, 8-byte
    words) to the tensor at its row's address, on the current stream."""
    _launch(src, table, largest, scatter=True)


def warm_up(device: torch.device, *, scatter: bool) -> None:
    """Compile the kernel for ``device`` now (Triton compiles on first launch, ~0.5 s), with
    a launch that copies nothing, so that no chunk pays for it."""
    buf = torch.zeros(1, dtype=torch.int64, device=device)
    table = torch.tensor([[buf.data_ptr(), 0, 0]], dtype=torch.int64, device=device)
    _launch(buf, table, 8, scatter=scatter)
    torch.cuda.synchronize(device)


def _launch(buf: torch.Tensor, table: torch.Tensor, largest: int, *, scatter: bool) -> None:
    words = largest // 8
    per_tensor = max(1, min(_MAX_PROGRAMS_PER_TENSOR, -(-words // _BLOCK)))
    _kernel()[(table.shape[0], per_tensor)](table, buf, SCATTER=scatter, BLOCK=_BLOCK,
                                            num_warps=8)

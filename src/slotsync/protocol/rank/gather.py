"""Gather many CUDA tensors into one flat buffer, or scatter one buffer into many tensors,
with a single kernel launch.

Packing a chunk into the staging region is one copy of its bytes, but done through torch it
costs per-tensor Python: each source must be viewed flat and reinterpreted before
``torch.cat`` takes it (a few µs per tensor: for thousands of tensors, more than the copy
itself; ``BENCHMARKS.md``). Here the per-tensor work is
reading ``data_ptr()``: a table of (source address, destination offset, length) goes to the
GPU and one Triton kernel copies every piece, reading each source through its address.

The table's rows are *pieces* of at most ``PIECE_BYTES``, not whole tensors: a chunk mixes
tensors of a few KiB with ones of hundreds of MiB (an embedding), and a grid of one program
row per tensor left the largest tensor's tail to a few dozen programs while the rest of the
GPU idled. Equal pieces keep every SM busy to the end (issue 27; ``slotsync bench gather``
measures the kernels against one flat copy of the same bytes, BENCHMARKS.md). Telling Triton
that a table is 16-byte aligned, for 16-byte accesses, was measured too and gained nothing.

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

PIECE_BYTES = 64 << 10
"""Longest piece one program copies (bytes; a multiple of 8). Of 64 KiB, 256 KiB and 1 MiB
pieces the smallest copied fastest on an H200 (BENCHMARKS.md, issue 27): a 1 GiB chunk is
~16,400 programs, and each program's three table reads stay small beside its copy."""
_PIECE_WORDS = PIECE_BYTES // 8
_BLOCK = 2048  # int64 elements (16 KiB) per loop step of one program


@functools.cache
def _kernel():  # noqa: ANN202 - a Triton JIT function
    """Compile lazily: importing this module must work without Triton (CPU installs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_pieces_i64(table_ptr, buf_ptr, SCATTER: tl.constexpr,  # noqa: N803 - Triton style
                        BLOCK: tl.constexpr):
        # program p: piece p of the table; gather copies it from its address into the
        # buffer at its offset, scatter the other way round
        p = tl.program_id(0).to(tl.int64)
        ptr = tl.load(table_ptr + 3 * p).to(tl.pointer_type(tl.int64))
        off = tl.load(table_ptr + 3 * p + 1)
        n = tl.load(table_ptr + 3 * p + 2)
        for start in range(0, n, BLOCK):
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
    offset 0 of a buffer (``piece_rows``), on ``device``. None unless every non-empty
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


def _tensor_rows(ptrs: Sequence[int], sizes: Sequence[int]) -> torch.Tensor | None:
    """One row per non-empty tensor, on the CPU: int64 ``(tensors, 4)`` (address in bytes,
    offset in the buffer and length in 8-byte words, pieces); None unless every non-empty
    tensor's address and size is a multiple of 8 bytes."""
    p = torch.tensor(ptrs, dtype=torch.int64)
    n = torch.tensor(sizes, dtype=torch.int64)
    keep = n > 0
    if not bool(keep.all()):
        p, n = p[keep], n[keep]
    if bool(((p | n) & 7).any()):
        return None
    words = n // 8
    counts = (words + _PIECE_WORDS - 1) // _PIECE_WORDS  # pieces per tensor (>= 1)
    return torch.stack((p, torch.cumsum(words, 0) - words, words, counts), dim=1)


def _pieces(tensor_rows: torch.Tensor, pieces: int) -> torch.Tensor:
    """``tensor_rows`` (``_tensor_rows``, on any device) cut into ``pieces`` rows of at most
    ``PIECE_BYTES``: int64 ``(pieces, 3)`` on the same device, without waiting for it."""
    dev = tensor_rows.device
    p, off, words, counts = tensor_rows.unbind(1)
    of = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts,
                                 output_size=pieces)
    first = torch.cumsum(counts, 0) - counts  # each tensor's first piece
    start = (torch.arange(pieces, device=dev) - first[of]) * _PIECE_WORDS  # words in
    return torch.stack((p[of] + start * 8, off[of] + start,
                        torch.clamp(words[of] - start, max=_PIECE_WORDS)), dim=1)


def piece_rows(ptrs: Sequence[int], sizes: Sequence[int]) -> torch.Tensor | None:
    """The table on the CPU: int64 ``(pieces, 3)``, one row per piece (its address in bytes,
    its offset in the buffer and its length, both in 8-byte words), each non-empty tensor
    (address ``ptrs[i]``, ``sizes[i]`` bytes, laid back to back from word 0 of the buffer)
    cut into pieces of at most ``PIECE_BYTES``; None unless every non-empty tensor's address
    and size is a multiple of 8 bytes."""
    rows = _tensor_rows(ptrs, sizes)
    return None if rows is None else _pieces(rows, int(rows[:, 3].sum()))


def build_table(ptrs: Sequence[int], sizes: Sequence[int], device: torch.device
                ) -> torch.Tensor | None:
    """``gather_table`` without its cache, for a caller that keeps the table itself."""
    rows = _tensor_rows(ptrs, sizes)
    if rows is None:
        return None
    pieces = int(rows[:, 3].sum())
    if torch.device(device).type != "cuda":
        return _pieces(rows, pieces).to(device)
    # One row per tensor goes to the GPU, which cuts the pieces itself. Uploading the cut
    # table instead (~50x larger, pinned) made the first round of a new chunk size ~0.9 s
    # slower on an H200 (issue 27, docs/bench/issue27-h200-runs.txt), though building it
    # alone costs ~1 ms. From pinned memory without blocking: a copy from pageable memory
    # waits for the stream, i.e. for the chunk still being packed, which is what the caller
    # overlaps. (torch's pinned allocator keeps the memory until the copy ran; the cutting is
    # queued on the stream behind it.)
    return _pieces(rows.pin_memory().to(device, non_blocking=True), pieces)


def gather_into(dst: torch.Tensor, table: torch.Tensor) -> None:
    """Copy every piece of ``table`` (``gather_table``) into ``dst``, a flat int64 CUDA
    tensor (8-byte words), on the current stream. The tensors must stay alive until the
    stream has run the copy."""
    _launch(dst, table, scatter=False)


def scatter_from(src: torch.Tensor, table: torch.Tensor) -> None:
    """The reverse of ``gather_into``: copy each piece of ``src`` (flat int64 CUDA, 8-byte
    words) to the address of its row, on the current stream."""
    _launch(src, table, scatter=True)


def warm_up(device: torch.device, *, scatter: bool) -> None:
    """Compile the kernel for ``device`` now (Triton compiles on first launch, ~0.5 s), with
    a launch that copies nothing, so that no chunk pays for it."""
    buf = torch.zeros(1, dtype=torch.int64, device=device)
    table = torch.tensor([[buf.data_ptr(), 0, 0]], dtype=torch.int64, device=device)
    _launch(buf, table, scatter=scatter)
    torch.cuda.synchronize(device)


def _launch(buf: torch.Tensor, table: torch.Tensor, *, scatter: bool) -> None:
    if table.shape[0]:
        _kernel()[(table.shape[0],)](table, buf, SCATTER=scatter, BLOCK=_BLOCK, num_warps=8)

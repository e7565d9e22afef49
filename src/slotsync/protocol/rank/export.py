"""Trainer side: turning tensors into the handle records of ``slotsync.protocol.wire``.

Two transports:

* ``cuda``: a CUDA IPC handle (``CudaIpcHandle``), the 15 fields of
  ``torch.multiprocessing.reductions.reduce_tensor(t)[1]`` as typed data. The vLLM worker on
  the same GPU maps the memory (vllm-contract.md "update_info for the IPC backend").
* ``shm``: a POSIX shared-memory segment (``ShmHandle``), the CPU stand-in that only the
  reference engine reads; lets the whole path run without a GPU.

``plan_pack`` / ``pack_into`` lay a packed chunk out in vLLM's packed layout (vLLM 0.27-0.33
``packed_tensor.py``): each tensor's raw bytes, ``t.contiguous().view(-1).view(torch.uint8)``,
back to back from offset 0, with ``tensor_sizes[i]`` giving tensor ``i``'s bytes. The
staging memory they pack into is ``slotsync.protocol.rank.staging``, which imports this module
(never the other way round: its buffers import from there, or from ``slotsync.protocol``).

A source may be a DTensor (an FSDP2 parameter, ``torch.distributed.fsdp.fully_shard``): the
chunk then takes ``plan_sharded``'s path, where each FSDP2 shard is all-gathered straight into
the region (``sharded.gather_shard``) instead of ``full_tensor()`` followed by a copy.
``ShmSegment`` lives in ``shm_segment.py`` and the DTensor gathers in ``sharded.py``; both
still import from here.

This module imports torch; the daemon never imports it (design.md I6).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import reduce_tensor

from slotsync.protocol.rank import gather
from slotsync.protocol.rank.sharded import (
    dtensor_type,
    gather_shard,
    is_dtensor,
    materialize,
    shard_kind,
)
from slotsync.protocol.rank.shm_segment import ShmSegment
from slotsync.protocol.wire import (
    DTYPE_SIZES,
    STORAGE_CLASSES,
    TENSOR_CLASSES,
    CudaIpcHandle,
    normalize_gpu_uuid,
)

__all__ = [
    "PackPlan",
    "PackStep",
    "PackedLayout",
    "ShmSegment",
    "copy_width",
    "cuda_ipc_handle",
    "dtype_name",
    "gpu_uuid_of",
    "handle_from_reduce_args",
    "is_dtensor",
    "materialize",
    "nbytes_of",
    "pack_into",
    "plan_pack",
    "raw_bytes",
    "run_pack",
]

log = logging.getLogger(__name__)

POLL_EVERY = 64
"""``plan_pack`` calls its ``poll`` once per this many tensors (a short stretch of layout work)."""



def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's spelling of a dtype (``str(t.dtype).split(".")[-1]``, e.g. ``"bfloat16"``).

    Raises:
        ValueError: the dtype is not one ``wire.DTYPE_SIZES`` allows.
    """
    name = DTYPE_NAME_MEMO.get(dtype)
    if name is None:
        name = str(dtype).split(".")[-1]
        if name not in DTYPE_SIZES:
            raise ValueError(f"dtype {dtype} is not supported (allowed: {sorted(DTYPE_SIZES)})")
        DTYPE_NAME_MEMO[dtype] = name
    return name


DTYPE_NAME_MEMO: dict[torch.dtype, str] = {}
"""Every dtype ``dtype_name`` accepted so far -> its name. Hot per-tensor loops read it inline
(a call per tensor costs as much as the lookup) and call ``dtype_name`` on a miss."""


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_ALLOWED_CLASS_NAMES: dict[tuple[type, type], tuple[str, str]] = {}
"""(tensor class, storage class) -> their allowed qualified names, for every pair
``handle_from_reduce_args`` accepted so far (one export per tensor: unpacked, every tensor of
every round passes there)."""

_DIMS_MEMO: dict[object, tuple[int, ...]] = {}
"""A size or stride seen by ``handle_from_reduce_args`` -> the same dims as a tuple of ints
(a ``torch.Size`` and the equal tuple of ints are one key). Bounded by ``_DIMS_MEMO_MAX``."""

_DIMS_MEMO_MAX = 65536


def _dims(xs: object) -> tuple[int, ...]:
    """``xs`` (a ``torch.Size``, a tuple or list of ints) as a tuple of ints, memoized."""
    try:
        dims = _DIMS_MEMO.get(xs)
    except TypeError:  # unhashable (a list): converted every time
        return tuple(int(d) for d in xs)  # type: ignore[attr-defined]
    if dims is None:
        dims = tuple(int(d) for d in xs)  # type: ignore[attr-defined]
        if len(_DIMS_MEMO) >= _DIMS_MEMO_MAX:
            _DIMS_MEMO.clear()
        _DIMS_MEMO[xs] = dims
    return dims


def _class_names(tensor_cls: type, storage_cls: type) -> tuple[str, str]:
    """Qualified names of a tensor and a storage class, checked against the wire's
    allow-lists.

    Raises:
        ValueError: a class outside the allow-lists.
    """
    key = (tensor_cls, storage_cls)
    names = _ALLOWED_CLASS_NAMES.get(key)
    if names is None:
        tensor_class, storage_class = _qualified(tensor_cls), _qualified(storage_cls)
        if tensor_class not in TENSOR_CLASSES:
            raise ValueError(
                f"tensor class {tensor_class} is not allowed (allowed: {TENSOR_CLASSES})"
            )
        if storage_class not in STORAGE_CLASSES:
            raise ValueError(
                f"storage class {storage_class} is not allowed (allowed: {STORAGE_CLASSES})"
            )
        names = _ALLOWED_CLASS_NAMES[key] = (tensor_class, storage_class)
    return names


def handle_from_reduce_args(args: Sequence[object]) -> CudaIpcHandle:
    """Build a ``CudaIpcHandle`` from ``reduce_tensor(t)[1]`` of a CUDA tensor.

    ``args`` is torch 2.x's 15-tuple: (tensor class, size, stride, storage offset in
    elements, storage class, dtype, device index, CUDA IPC memory handle bytes, storage bytes,
    storage byte offset, requires_grad, ref-counter handle, ref-counter offset, event handle,
    event_sync_required) -- see ``rebuild_cuda_tensor``.

    Unpacked, the publisher calls this once per tensor and chunk, so the parts that repeat
    across tensors (the classes' names and allow-list check, the dtype's name, each distinct
    size and stride as a tuple of ints) are looked up, not recomputed, and the record is built
    positionally (the saving: BENCHMARKS.md, "Unpacked control plane on this 2-core machine").

    Raises:
        ValueError: not 15 fields, or a class / dtype outside the wire's allow-lists.
    """
    if len(args) != 15:
        raise ValueError(
            f"reduce_tensor returned {len(args)} fields, expected the 15 of rebuild_cuda_tensor "
            "(torch 2.x); is the tensor on a CUDA device?"
        )
    (tensor_cls, size, stride, storage_offset, storage_cls, dtype, device, ipc_handle,
     storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    tensor_class, storage_class = _class_names(tensor_cls, storage_cls)  # type: ignore[arg-type]
    return CudaIpcHandle(
        tensor_class,  # type: ignore[arg-type]
        _dims(size),
        _dims(stride),
        int(storage_offset),  # type: ignore[call-overload]
        storage_class,  # type: ignore[arg-type]
        DTYPE_NAME_MEMO.get(dtype) or dtype_name(dtype),  # type: ignore[arg-type]
        int(device),  # type: ignore[call-overload]
        bytes(ipc_handle),  # type: ignore[call-overload]
        int(storage_size_bytes),  # type: ignore[call-overload]
        int(storage_offset_bytes),  # type: ignore[call-overload]
        bool(requires_grad),
        bytes(ref_counter_handle),  # type: ignore[call-overload]
        int(ref_counter_offset),  # type: ignore[call-overload]
        None if event_handle is None else bytes(event_handle),  # type: ignore[call-overload]
        bool(event_sync_required),
    )


def cuda_ipc_handle(t: torch.Tensor) -> CudaIpcHandle:
    """Export CUDA tensor ``t`` as a CUDA IPC handle record.

    The caller must keep ``t`` (its storage) alive and unchanged until the engine has consumed
    it (design.md I3); torch's IPC ref counter then frees it via ``torch.cuda.ipc_collect()``.

    Raises:
        ValueError: ``t`` is not on a CUDA device, or its dtype is not supported.
    """
    if not t.is_cuda:
        raise ValueError(f"cuda_ipc_handle needs a CUDA tensor, got one on {t.device}")
    return handle_from_reduce_args(reduce_tensor(t)[1])


def release_unconsumed(handle: CudaIpcHandle) -> None:
    """Give back the reference that an export holds on its block for a consumer, for an
    export no consumer will map.

    torch counts each ``reduce_tensor`` export in a shared-memory counter that the consumer
    decrements when it releases its mapping (or at once, when it finds the block mapped
    already); a block whose storage dies with a count above zero waits in torch's IPC limbo
    until ``torch.cuda.ipc_collect()`` finds it released -- for an export never mapped, for
    the life of the process (each failed packed update would keep its whole staging block).
    The publisher calls this, when an update fails, for the exports of the
    chunks the engine never acknowledged: those it never mapped are freed, and one it mapped
    before failing is freed while mapped but no longer read (the update failed; the engine
    reloads everything in the next, full update).

    Uses torch's consumer call ``UntypedStorage._release_ipc_counter`` (torch 2.x,
    ``torch/multiprocessing/reductions.py``), as the consumer would.
    """
    torch.UntypedStorage._release_ipc_counter(
        handle.ref_counter_handle, handle.ref_counter_offset, device=handle.device
    )


def gpu_uuid_of(device: torch.device | int | str | None = None) -> str:
    """The GPU UUID of a CUDA device in torch's format (no ``GPU-`` prefix).

    ``str(torch.cuda.get_device_properties(i).uuid)``, normalized; ``device=None`` means the
    current device. This is the key vLLM looks handles up by.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """
    if device is None:
        index = torch.cuda.current_device()
    else:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"gpu_uuid_of needs a CUDA device, got {dev}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    return normalize_gpu_uuid(str(torch.cuda.get_device_properties(index).uuid))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 tensor (vLLM packed layout:
    ``t.contiguous().view(-1).view(torch.uint8)``); bool and bfloat16 reinterpret bit-exactly.
    Shape ``(t.numel() * t.element_size(),)``. A DTensor is materialized first
    (``materialize``: its global bytes, a collective)."""
    flat = materialize(t).detach().contiguous().view(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (``numel * element_size``), ignoring any storage beyond it."""
    return t.numel() * t.element_size()


class PackedLayout(NamedTuple):
    """Metadata of one packed chunk, in vLLM ``update_info`` order (names, dtype_names,
    shapes, tensor_sizes). ``tensor_sizes`` are in bytes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    tensor_sizes: list[int]


class PackStep(NamedTuple):
    """One step of a chunk that holds DTensors (``plan_sharded``), run in chunk order.

    ``kind``: ``"copy"`` (a run of plain tensors: ``sources`` are their flat views in the
    copy dtype, copied into ``dst``, the run's bytes of the buffer in that dtype), or, for one
    DTensor (``sources == (dtensor,)``, ``dst`` its ``nbytes`` bytes of the buffer, uint8):
    ``"gather"`` (placements ``(Shard(0),)`` on a 1-D mesh: ``gather_shard``), ``"local"``
    (``(Replicate(),)``: a copy of the local tensor) or ``"full"`` (any other placement:
    ``full_tensor()`` then a copy). ``buf`` is the whole uint8 buffer, ``offset`` the step's
    first byte in it."""

    kind: str
    offset: int
    nbytes: int
    dst: torch.Tensor
    sources: tuple[torch.Tensor, ...]
    buf: torch.Tensor


class PackPlan(NamedTuple):
    """A packed chunk ready to copy: its ``layout``, ``total`` bytes, ``dst`` (bytes
    ``[0, total)`` of the buffer, viewed as the copy dtype; None for an empty chunk) and the
    flat sources in that dtype, in order (zero-byte tensors left out).

    With ``table`` (CUDA with Triton, see ``gather``), ``srcs`` are the tensors themselves,
    held so they outlive the copy, and one kernel copies them by address, piece by piece.

    With ``steps`` (a chunk holding DTensors, ``plan_sharded``), ``srcs`` is empty and
    ``run_pack`` runs the steps in order instead; ``dst`` is uint8."""

    layout: PackedLayout
    total: int
    dst: torch.Tensor | None
    srcs: list[torch.Tensor]
    table: torch.Tensor | None = None
    steps: list[PackStep] | None = None


# Widest integer type a byte copy can move per element. The batched copy kernels move one
# element per thread and instruction, so copying uint8 views runs far below the memory's
# bandwidth; the same bytes as int64 are 8x fewer elements.
_COPY_WIDTHS: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8),
)


def copy_width(sizes: Sequence[int], ptrs: Sequence[int]) -> tuple[int, torch.dtype]:
    """The widest ``(bytes, integer dtype)`` that divides every byte count in ``sizes`` and
    every address in ``ptrs`` (so each region can be viewed, and copied, as that dtype)."""
    for w, dt in _COPY_WIDTHS:
        if all(n % w == 0 for n in sizes) and all(p % w == 0 for p in ptrs):
            return w, dt
    return 1, torch.uint8


def as_width(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Flat contiguous ``t`` reinterpreted as ``dtype`` (bit-exact; the caller checked the
    alignment with ``copy_width``)."""
    return t if t.dtype == dtype else t.view(dtype)


@torch.no_grad()  # views of parameters, recording no autograd history
def plan_pack(buf: torch.Tensor, named_tensors: Sequence[tuple[str, torch.Tensor]],
              sizes: Sequence[int] | None = None,
              poll: Callable[[], None] | None = None) -> PackPlan:
    """Lay the tensors out back to back from offset 0 of uint8 ``buf`` (vLLM packed layout)
    without copying anything yet: the publisher plans chunk k+1 while the engine still reads
    chunk k, and copies (``run_pack``) once the buffer is free.

    Raises:
        ValueError: ``buf`` is not a flat uint8 tensor large enough, or a dtype is unsupported.

    ``sizes`` (each tensor's bytes) may be passed when the caller already computed them.
    ``poll`` is called every ``POLL_EVERY`` tensors (the publisher sends the previous chunk
    from there as soon as its copy is done, instead of after this whole layout).

    A chunk that holds a DTensor is planned by ``plan_sharded`` (collectives at ``run_pack``).
    """
    dt_cls = dtensor_type()
    if dt_cls is not None and any(issubclass(c, dt_cls)
                                  for c in set(map(type, (t for _, t in named_tensors)))):
        # never the gather table or torch.cat below: they read a DTensor's local memory
        return plan_sharded(buf, named_tensors, sizes, poll)
    layout = PackedLayout([n for n, _ in named_tensors], [], [], [])
    dtype_names, shapes = layout.dtype_names, layout.shapes
    # Attribute reads only, in comprehensions over blocks of POLL_EVERY tensors: on the
    # gather path (CUDA with Triton) this is all the per-tensor work of packing a chunk.
    dev = buf.get_device() if buf.is_cuda and gather.available() else None
    ptrs: list[int] | None = [] if dev is not None else None
    tensors = [t for _, t in named_tensors]
    for lo in range(0, len(tensors), POLL_EVERY):
        if poll is not None and lo:
            poll()
        part = tensors[lo : lo + POLL_EVERY]
        # (dtype_name's memo read inline: a call per tensor costs as much as the read)
        dtype_names += [DTYPE_NAME_MEMO.get(t.dtype) or dtype_name(t.dtype) for t in part]
        shapes += [list(t.shape) for t in part]
        if ptrs is not None:
            if all(t.get_device() == dev and t.is_contiguous() for t in part):
                ptrs += [t.data_ptr() for t in part]
            else:
                ptrs = None
    if sizes is None:
        layout.tensor_sizes.extend(nbytes_of(t) for _, t in named_tensors)
    else:
        layout.tensor_sizes.extend(sizes)
    total = sum(layout.tensor_sizes)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < total:
        raise ValueError(
            f"pack_into needs a flat uint8 buffer of at least {total} bytes, got "
            f"{buf.dtype} of shape {tuple(buf.shape)}"
        )
    if ptrs is not None and buf.data_ptr() % 8 == 0:
        table = gather.gather_table(ptrs, layout.tensor_sizes, buf.device)
        if table is not None:
            if table.shape[0] == 0:
                return PackPlan(layout, total, None, [])
            # the tensors ride along in srcs so that they outlive the kernel
            return PackPlan(layout, total, buf[:total].view(torch.int64), tensors, table)
    flats = [(t if t.is_contiguous() else t.contiguous()).view(-1) for _, t in named_tensors]
    if 0 in layout.tensor_sizes:
        flats = [f for f, n in zip(flats, layout.tensor_sizes, strict=True) if n]
    if not flats:
        return PackPlan(layout, total, None, [])
    # Every offset is a sum of earlier sizes, so sizes and the buffer's base decide alignment.
    w, wide = copy_width(layout.tensor_sizes, [buf.data_ptr(), *(f.data_ptr() for f in flats)])
    try:
        srcs = [as_width(f, wide) for f in flats]
    except RuntimeError:  # a storage whose base is not aligned: plain bytes
        wide = torch.uint8
        srcs = [as_width(f, wide) for f in flats]
    return PackPlan(layout, total, buf[:total].view(wide), srcs)


@torch.no_grad()
def run_pack(plan: PackPlan) -> None:
    """Do the copies of ``plan`` (across devices as needed). The caller synchronizes CUDA
    before handing out a handle."""
    if plan.dst is None:
        return
    if plan.steps is not None:
        for step in plan.steps:
            run_step(step)
        return
    if plan.table is not None:
        gather.gather_into(plan.dst, plan.table)
        return
    _copy_into(plan.dst, plan.srcs)


def _copy_into(dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
    """Copy flat ``srcs`` back to back into flat ``dst`` (same dtype, ``dst`` exactly as long
    as all of them)."""
    dev = dst.device
    if all(x.device == dev for x in srcs):
        # One concatenation into the buffer: a few batched kernel launches and no view of the
        # buffer per tensor (with thousands of tensors per chunk, per-tensor work dominates).
        torch.cat(list(srcs), out=dst)
    else:  # sources on another device: one copy each
        pieces = dst.split([s.numel() for s in srcs])
        for d, src in zip(pieces, srcs, strict=True):
            d.copy_(src)


# --------------------------------------------------------------------------------------------
# DTensor sources (FSDP2): the collectives and why they cannot deadlock are in sharded.py
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def plan_sharded(buf: torch.Tensor, named_tensors: Sequence[tuple[str, torch.Tensor]],
                 sizes: Sequence[int] | None = None,
                 poll: Callable[[], None] | None = None) -> PackPlan:
    """``plan_pack`` for a chunk that holds DTensors (mixed with plain tensors or not): the
    same layout (vLLM packed: each tensor's GLOBAL bytes back to back from offset 0; a
    DTensor's dtype and shape are its global ones), as ``PackStep``s that ``run_pack`` runs in
    order: each run of plain tensors is one ``torch.cat`` (``"copy"``), each DTensor one step
    of ``shard_kind``. Plain-tensor-only chunks keep ``plan_pack``'s fast paths (the gather
    table of ``gather``, one ``torch.cat``); no DTensor reaches them.

    Nothing is copied here and no collective runs (``run_pack`` does).

    Raises:
        ValueError: as ``plan_pack`` (a buffer too small, an unsupported dtype).
    """
    layout = PackedLayout([n for n, _ in named_tensors], [], [], [])
    dt_cls = dtensor_type()
    tensors = [t for _, t in named_tensors]
    for lo in range(0, len(tensors), POLL_EVERY):
        if poll is not None and lo:
            poll()
        part = tensors[lo : lo + POLL_EVERY]
        layout.dtype_names.extend(DTYPE_NAME_MEMO.get(t.dtype) or dtype_name(t.dtype)
                                  for t in part)
        layout.shapes.extend(list(t.shape) for t in part)
    layout.tensor_sizes.extend([nbytes_of(t) for t in tensors] if sizes is None else sizes)
    total = sum(layout.tensor_sizes)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < total:
        raise ValueError(
            f"pack_into needs a flat uint8 buffer of at least {total} bytes, got "
            f"{buf.dtype} of shape {tuple(buf.shape)}"
        )
    steps: list[PackStep] = []
    run: list[torch.Tensor] = []
    run_at = run_bytes = 0

    def flush() -> None:
        if not run:
            return
        flats = [(f if f.is_contiguous() else f.contiguous()).view(-1) for f in run]
        w, wide = copy_width([f.numel() * f.element_size() for f in flats],
                             [buf.data_ptr() + run_at, *(f.data_ptr() for f in flats)])
        try:
            srcs = tuple(as_width(f, wide) for f in flats)
        except RuntimeError:  # a storage whose base is not aligned: plain bytes
            wide = torch.uint8
            srcs = tuple(as_width(f, wide) for f in flats)
        dst = buf[run_at : run_at + run_bytes].view(wide)
        steps.append(PackStep("copy", run_at, run_bytes, dst, srcs, buf))
        run.clear()

    offset = 0
    for t, n in zip(tensors, layout.tensor_sizes, strict=True):
        if dt_cls is not None and isinstance(t, dt_cls):
            flush()
            if n:
                steps.append(PackStep(shard_kind(t), offset, n, buf[offset : offset + n],
                                      (t,), buf))
        elif n:
            if not run:
                run_at, run_bytes = offset, 0
            run.append(t.detach())
            run_bytes += n
        offset += n
    flush()
    if not steps:
        return PackPlan(layout, total, None, [])
    return PackPlan(layout, total, buf[:total], [], steps=steps)


def run_step(step: PackStep) -> None:
    """Run one ``PackStep`` (see its kinds). ``"gather"`` and ``"full"`` are collectives over
    the DTensor's mesh."""
    if step.kind == "copy":
        _copy_into(step.dst, step.sources)
        return
    (t,) = step.sources
    if step.kind == "gather":
        gather_shard(t, step.buf, step.offset)
    elif step.kind == "local":
        step.dst.copy_(raw_bytes(t.to_local()))  # type: ignore[attr-defined]
    else:
        step.dst.copy_(raw_bytes(t.full_tensor()))  # type: ignore[attr-defined]


def pack_into(buf: torch.Tensor, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> PackedLayout:
    """Copy each tensor's raw bytes into uint8 ``buf`` back to back from offset 0 (vLLM packed
    layout) and return the chunk's metadata: ``plan_pack`` then ``run_pack``.

    Raises:
        ValueError: ``buf`` is not a flat uint8 tensor large enough, or a dtype is unsupported.
    """
    plan = plan_pack(buf, named_tensors)
    run_pack(plan)
    return plan.layout

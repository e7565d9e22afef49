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
staging memory they pack into is ``slotsync.protocol.staging`` (its names still import from
here).

A source may be a DTensor (an FSDP2 parameter, ``torch.distributed.fsdp.fully_shard``): the
chunk then takes ``plan_sharded``'s path, where each FSDP2 shard is all-gathered straight into
the region (``gather_shard``) instead of ``full_tensor()`` followed by a copy.

This module imports torch; the daemon never imports it (design.md I6).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import reduce_tensor

from slotsync.protocol import gather
from slotsync.protocol.wire import (
    DTYPE_SIZES,
    STORAGE_CLASSES,
    TENSOR_CLASSES,
    CudaIpcHandle,
    ShmHandle,
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

SHM_PREFIX = "slotsync-"
"""Every segment this module creates is ``/dev/shm/slotsync-<pid>-r<rank>-<n>``."""

_segment_counter = itertools.count()


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


def handle_from_reduce_args(args: Sequence[object]) -> CudaIpcHandle:
    """Build a ``CudaIpcHandle`` from ``reduce_tensor(t)[1]`` of a CUDA tensor.

    ``args`` is torch 2.x's 15-tuple: (tensor class, size, stride, storage offset in
    elements, storage class, dtype, device index, CUDA IPC memory handle bytes, storage bytes,
    storage byte offset, requires_grad, ref-counter handle, ref-counter offset, event handle,
    event_sync_required) -- see ``rebuild_cuda_tensor``.

    Raises:
        ValueError: not 15 fields, or a class / dtype outside wire.py's allow-lists.
    """
    if len(args) != 15:
        raise ValueError(
            f"reduce_tensor returned {len(args)} fields, expected the 15 of rebuild_cuda_tensor "
            "(torch 2.x); is the tensor on a CUDA device?"
        )
    (tensor_cls, size, stride, storage_offset, storage_cls, dtype, device, ipc_handle,
     storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    tensor_class = _qualified(tensor_cls)  # type: ignore[arg-type]
    storage_class = _qualified(storage_cls)  # type: ignore[arg-type]
    if tensor_class not in TENSOR_CLASSES:
        raise ValueError(f"tensor class {tensor_class} is not allowed (allowed: {TENSOR_CLASSES})")
    if storage_class not in STORAGE_CLASSES:
        raise ValueError(
            f"storage class {storage_class} is not allowed (allowed: {STORAGE_CLASSES})"
        )
    return CudaIpcHandle(
        tensor_class=tensor_class,  # type: ignore[arg-type]
        size=tuple(int(d) for d in size),  # type: ignore[attr-defined]
        stride=tuple(int(d) for d in stride),  # type: ignore[attr-defined]
        storage_offset=int(storage_offset),  # type: ignore[call-overload]
        storage_class=storage_class,  # type: ignore[arg-type]
        dtype=dtype_name(dtype),  # type: ignore[arg-type]
        device=int(device),  # type: ignore[call-overload]
        ipc_handle=bytes(ipc_handle),  # type: ignore[call-overload]
        storage_size_bytes=int(storage_size_bytes),  # type: ignore[call-overload]
        storage_offset_bytes=int(storage_offset_bytes),  # type: ignore[call-overload]
        requires_grad=bool(requires_grad),
        ref_counter_handle=bytes(ref_counter_handle),  # type: ignore[call-overload]
        ref_counter_offset=int(ref_counter_offset),  # type: ignore[call-overload]
        event_handle=None if event_handle is None else bytes(event_handle),  # type: ignore[call-overload]
        event_sync_required=bool(event_sync_required),
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


def dtensor_type() -> type | None:
    """torch's ``DTensor`` class once ``torch.distributed.tensor`` is imported, else None (then
    no DTensor can exist, and this module never imports torch.distributed for a plain tensor)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return None if mod is None else getattr(mod, "DTensor", None)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter is one)."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def materialize(t: torch.Tensor) -> torch.Tensor:
    """A full local tensor of ``t``'s global value (same dtype and global shape) for a DTensor,
    else ``t`` itself. As vLLM 0.32's ``materialize_full_tensor`` (``weight_transfer/base.py``),
    but only for DTensors.

    A DTensor is gathered over its mesh (a collective: every rank of the mesh must call it for
    the same tensors in the same order): an FSDP2 ``Shard(0)`` one by ``gather_shard`` into a
    fresh buffer (uint8, so also the dtypes Gloo's own ``full_tensor()`` refuses, e.g.
    ``float8_e4m3fn``), a replicated one is its local tensor, any other ``full_tensor()``.
    """
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        kind = shard_kind(t)
        if kind == "local":
            return t.to_local()  # type: ignore[attr-defined]
        if kind == "full":
            return t.full_tensor()  # type: ignore[attr-defined]
        world = t.device_mesh.size()  # type: ignore[attr-defined]
        dim0 = t.shape[0]
        nbytes = nbytes_of(t)
        span = world * -(-dim0 // world) * (nbytes // dim0) if dim0 else 0
        local = t.to_local()  # type: ignore[attr-defined]
        buf = torch.empty(span, dtype=torch.uint8, device=local.device)
        gather_shard(t, buf, 0)
        return buf[:nbytes].view(t.dtype).view(t.shape)


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
    held so they outlive the copy, and one kernel copies them by address; ``largest`` is the
    longest source in bytes.

    With ``steps`` (a chunk holding DTensors, ``plan_sharded``), ``srcs`` is empty and
    ``run_pack`` runs the steps in order instead; ``dst`` is uint8."""

    layout: PackedLayout
    total: int
    dst: torch.Tensor | None
    srcs: list[torch.Tensor]
    table: torch.Tensor | None = None
    largest: int = 0
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
            return PackPlan(layout, total, buf[:total].view(torch.int64), tensors, table,
                            max(layout.tensor_sizes))
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
        gather.gather_into(plan.dst, plan.table, plan.largest)
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
# DTensor sources (FSDP2): gathered straight into the buffer
# --------------------------------------------------------------------------------------------
#
# Collective order, and why it cannot deadlock. Each "gather" / "full" step is a collective
# over the DTensor's mesh, so every rank of an FSDP group must run the same steps in the same
# order. They do: a step is chosen from global facts only (placements, mesh, global shape and
# dtype: the same on every rank), the sources iterate the same names in the same order on
# every rank (``FSDP2Source.iter_sharded``: ``named_parameters()``), and the publisher runs
# the chunks' copies in chunk order (``pipeline.ChunkPipeline``) and each chunk's steps in
# tensor order. The sequence of collectives is then the sequence of sharded tensors, whatever
# the chunk boundaries (even with different ``staging_bytes`` per rank).
#
# Waiting for a free region cannot close a cycle with a gather: before a rank waits for the
# ack that frees the region of chunk j, it has sent every earlier chunk
# (``ChunkPipeline.send_chunk`` sends the pending chunk first), unless the region was already
# free (``queue_first``: then it does not wait at all). The ack it waits for is of chunk
# ``j - regions``, and an ack needs only the chunks up to it from every rank of the rank's own
# engine slot, the engine's load and the daemon: never a rank's progress on chunk j or later.
# So the ranks blocked furthest behind always get their acks and reach the gather, whether the
# FSDP group's ranks sit in one engine slot or in several (each slot's acks depend only on its
# own ranks' earlier chunks). A rank that fails mid-update (an error, an abort) leaves its
# peers in the collective until the process group's own timeout, as any collective does.


def shard_kind(t: torch.Tensor) -> str:
    """How ``plan_sharded`` copies DTensor ``t``: ``"gather"`` for placements ``(Shard(0),)``
    on a 1-D mesh (FSDP2's default, ``fully_shard``) of a tensor with at least one dimension,
    ``"local"`` for ``(Replicate(),)`` on a 1-D mesh, else ``"full"`` (``Shard(1)``, a 2-D
    HSDP mesh, ``Partial``, a strided shard: ``full_tensor()`` then a copy -- correct, but a
    temporary of the whole tensor and one copy more)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = t.placements  # type: ignore[attr-defined]
    if t.device_mesh.ndim == 1 and len(placements) == 1:  # type: ignore[attr-defined]
        (p,) = placements
        if type(p) is Shard and p.dim == 0 and t.dim() >= 1:
            return "gather"
        if type(p) is Replicate:
            return "local"
    return "full"


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


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: object) -> None:
    import torch.distributed as dist

    # torch 2.13 names it all_gather_single (all_gather_into_tensor warns); earlier: the old name
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


@torch.no_grad()
def gather_shard(t: torch.Tensor, buf: torch.Tensor, offset: int) -> None:
    """All-gather DTensor ``t`` (placements ``(Shard(0),)`` on a 1-D mesh, ``shard_kind``
    ``"gather"``) straight into bytes ``[offset, offset + t.nbytes)`` of flat uint8 ``buf``:
    one collective over the mesh's group, ``all_gather_into_tensor`` of uint8 views (any
    dtype, bf16, fp8 and bool included, over Gloo too; and no alignment needed, which vLLM's
    packed layout does not give), no ``full_tensor()`` temporary, no second copy.

    FSDP2 shards dim 0 with ``torch.chunk`` semantics (``fully_shard``; DTensor's ``Shard``
    too): each of the mesh's ``W`` ranks holds ``ceil(dim0 / W)`` rows but the last ones fewer
    or none. Each rank pads its shard to ``ceil(dim0 / W)`` rows; the gather writes the real
    rows first, in rank order, and the pad after them: ``W * ceil(dim0 / W) - dim0`` rows
    past the tensor's end, which land in the bytes of the tensors after it in the chunk (the
    caller writes those afterwards: ``run_pack`` runs a chunk's steps in order) or in unused
    bytes of ``buf``. Where that tail would run past ``buf`` (or the shard sits on another
    device than ``buf``) it gathers into a temporary and copies the tensor's bytes.

    On CUDA the collective is queued as copies are (``async_op=False``: the current stream
    waits for it), so the staging buffer's event recorded after ``run_pack``
    (``CudaStagingBuffer.launch``, ``ready``/``copied``) covers it.

    Raises:
        ValueError: the local shard does not have the rows ``torch.chunk`` gives this rank
            (the DTensor is not FSDP2's even-or-chunked layout).
    """
    mesh = t.device_mesh  # type: ignore[attr-defined]
    world = mesh.size()
    dim0 = t.shape[0]
    nbytes = nbytes_of(t)
    if nbytes == 0:
        return
    rows = -(-dim0 // world)
    row_bytes = nbytes // dim0
    local = t.to_local().detach()  # type: ignore[attr-defined]
    me = mesh.get_local_rank()
    want = max(0, min(rows, dim0 - me * rows))
    if local.shape[0] != want:
        raise ValueError(
            f"DTensor of global shape {tuple(t.shape)} has {local.shape[0]} rows on mesh rank "
            f"{me} of {world}, but torch.chunk gives it {want}: not an FSDP2 Shard(0) layout")
    flat = raw_bytes(local)
    shard = rows * row_bytes
    if flat.numel() != shard:  # uneven: pad to the common shard size
        padded = torch.empty(shard, dtype=torch.uint8, device=flat.device)
        padded[: flat.numel()].copy_(flat)
        padded[flat.numel():].zero_()
        flat = padded
    span = world * shard
    group = mesh.get_group()
    if flat.device == buf.device and offset + span <= buf.numel():
        _all_gather(buf[offset : offset + span], flat, group)
    else:
        tmp = torch.empty(span, dtype=torch.uint8, device=flat.device)
        _all_gather(tmp, flat, group)
        buf[offset : offset + nbytes].copy_(tmp[:nbytes])


def pack_into(buf: torch.Tensor, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> PackedLayout:
    """Copy each tensor's raw bytes into uint8 ``buf`` back to back from offset 0 (vLLM packed
    layout) and return the chunk's metadata: ``plan_pack`` then ``run_pack``.

    Raises:
        ValueError: ``buf`` is not a flat uint8 tensor large enough, or a dtype is unsupported.
    """
    plan = plan_pack(buf, named_tensors)
    run_pack(plan)
    return plan.layout


# --------------------------------------------------------------------------------------------
# POSIX shared memory
# --------------------------------------------------------------------------------------------


class ShmSegment:
    """A POSIX shared-memory segment owned (created and unlinked) by the publisher.

    Named ``slotsync-<pid>-r<rank>-<n>`` (a file under ``/dev/shm``), with a uint8 torch view
    ``tensor`` of shape ``(size,)`` over it. The reader opens it by name; the segment must stay
    until the reader acknowledged (design.md I3).

    Args:
        size: bytes, >= 0 (a 0-byte request still creates a 1-byte segment; POSIX needs one).
        rank: the owner's global rank, used in the name.

    Raises:
        OSError: the segment cannot be created (e.g. ``/dev/shm`` missing), or is larger than
            the free space of ``/dev/shm`` (tmpfs creates it sparse; the first write beyond
            that space would kill the process with SIGBUS).
    """

    def __init__(self, size: int, *, rank: int = 0) -> None:
        if size < 0:
            raise ValueError(f"shared-memory segment size must be >= 0, got {size}")
        self.size = size
        real = max(size, 1)
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            st = None  # no /dev/shm to ask: SharedMemory says what is wrong
        if st is not None and real > st.f_bavail * st.f_frsize:
            raise OSError(errno.ENOSPC, f"/dev/shm has {st.f_bavail * st.f_frsize} bytes free, "
                          f"a segment of {real} bytes does not fit")
        while True:
            name = f"{SHM_PREFIX}{os.getpid()}-r{rank}-{next(_segment_counter)}"
            try:
                self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
                    name=name, create=True, size=real
                )
                break
            except FileExistsError:  # left over by a dead process with our pid
                continue
        self.name: str = self._shm.name.lstrip("/")
        self.tensor: torch.Tensor | None = torch.frombuffer(
            self._shm.buf, dtype=torch.uint8, count=real
        )[:size]
        log.debug("created shared-memory segment %s (%d bytes)", self.name, size)

    def handle(self, offset: int = 0, nbytes: int | None = None) -> ShmHandle:
        """A handle for bytes ``[offset, offset + nbytes)`` of this segment (default: to the end).

        Raises:
            ValueError: the range is outside the segment, or the segment is closed.
        """
        if self._shm is None:
            raise ValueError(f"shared-memory segment {self.name} is closed")
        if nbytes is None:
            nbytes = self.size - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) is outside segment {self.name} "
                f"of {self.size} bytes"
            )
        return ShmHandle(segment=self.name, offset=offset, nbytes=nbytes)

    @property
    def closed(self) -> bool:
        """Whether ``close_and_unlink`` ran."""
        return self._shm is None

    def close_and_unlink(self) -> None:
        """Drop the torch view, unmap and remove the segment. Idempotent.

        Any other torch view of ``tensor`` the caller kept must be gone first, or the unmap
        fails with ``BufferError`` (the name is still unlinked).
        """
        shm, self._shm = self._shm, None
        if shm is None:
            return
        self.tensor = None  # release the buffer export before closing the mapping
        try:
            shm.close()
        except BufferError:
            log.warning("segment %s still has a view; unlinking without unmapping", self.name)
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        log.debug("unlinked shared-memory segment %s", self.name)

    def __del__(self) -> None:  # last resort; the publisher closes explicitly
        try:
            self.close_and_unlink()
        except Exception:  # noqa: BLE001 - never raise from __del__
            pass


_STAGING_NAMES = ("CudaStagingBuffer", "ShmStagingBuffer", "StagingBuffer")


def __getattr__(name: str) -> object:
    """The staging buffers moved to ``slotsync.protocol.staging`` (issue 16); imported from
    here lazily, since that module imports this one."""
    if name in _STAGING_NAMES:
        from slotsync.protocol import staging

        return getattr(staging, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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

This module imports torch; the daemon never imports it (design.md I6).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
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
    "PackedLayout",
    "ShmSegment",
    "copy_width",
    "cuda_ipc_handle",
    "dtype_name",
    "gpu_uuid_of",
    "handle_from_reduce_args",
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


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 tensor (vLLM packed layout:
    ``t.contiguous().view(-1).view(torch.uint8)``); bool and bfloat16 reinterpret bit-exactly.
    Shape ``(t.numel() * t.element_size(),)``."""
    flat = t.detach().contiguous().view(-1)
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


class PackPlan(NamedTuple):
    """A packed chunk ready to copy: its ``layout``, ``total`` bytes, ``dst`` (bytes
    ``[0, total)`` of the buffer, viewed as the copy dtype; None for an empty chunk) and the
    flat sources in that dtype, in order (zero-byte tensors left out).

    With ``table`` (CUDA with Triton, see ``gather``), ``srcs`` are the tensors themselves,
    held so they outlive the copy, and one kernel copies them by address; ``largest`` is the
    longest source in bytes."""

    layout: PackedLayout
    total: int
    dst: torch.Tensor | None
    srcs: list[torch.Tensor]
    table: torch.Tensor | None = None
    largest: int = 0


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
    """
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
    if plan.table is not None:
        gather.gather_into(plan.dst, plan.table, plan.largest)
        return
    dev = plan.dst.device
    if all(x.device == dev for x in plan.srcs):
        # One concatenation into the buffer: a few batched kernel launches and no view of the
        # buffer per tensor (with thousands of tensors per chunk, per-tensor work dominates).
        torch.cat(plan.srcs, out=plan.dst)
    else:  # sources on another device: one copy each
        pieces = plan.dst.split([s.numel() for s in plan.srcs])
        for d, src in zip(pieces, plan.srcs, strict=True):
            d.copy_(src)


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

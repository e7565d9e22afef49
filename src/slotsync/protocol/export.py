"""Trainer side: turning tensors into the handle records of ``slotsync.protocol.wire``.

Two transports:

* ``cuda``: a CUDA IPC handle (``CudaIpcHandle``), the 15 fields of
  ``torch.multiprocessing.reductions.reduce_tensor(t)[1]`` as typed data. The vLLM worker on
  the same GPU maps the memory (vllm-contract.md "update_info for the IPC backend").
* ``shm``: a POSIX shared-memory segment (``ShmHandle``), the CPU stand-in that only the
  reference engine reads; lets the whole path run without a GPU.

A ``StagingBuffer`` holds one packed chunk in vLLM's packed layout (vLLM 0.27-0.33
``packed_tensor.py``): each tensor's raw bytes, ``t.contiguous().view(-1).view(torch.uint8)``,
back to back from offset 0, with ``tensor_sizes[i]`` giving tensor ``i``'s bytes.

This module imports torch; the daemon never imports it (design.md I6).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from abc import ABC, abstractmethod
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
    Handle,
    ShmHandle,
    normalize_gpu_uuid,
)

__all__ = [
    "CudaStagingBuffer",
    "PackPlan",
    "PackedLayout",
    "ShmSegment",
    "ShmStagingBuffer",
    "StagingBuffer",
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
"""``plan_pack`` calls its ``poll`` once per this many tensors (~0.1 ms of layout)."""

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
    the life of the process (measured on the H200: each failed packed update kept its whole
    staging block). The publisher calls this, when an update fails, for the exports of the
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


# --------------------------------------------------------------------------------------------
# staging buffers
# --------------------------------------------------------------------------------------------


class StagingBuffer(ABC):
    """Reusable uint8 staging memory for packed chunks: ``slots`` regions of ``capacity``
    bytes each, so that a rank fills chunk k+1 into one region while the engine still reads
    earlier chunks from the others (``slots >= 2``).

    Per chunk: ``plan`` lays the chunk out in a region (CPU only), ``fill`` copies it in -- only
    once the chunk that last used that region was acknowledged (design.md I3) -- and ``handle``
    gives the handle to send. ``end_update`` runs when the update ends (commit acknowledged,
    aborted or failed).

    Raises:
        ValueError: ``capacity`` or ``slots`` is not positive.
    """

    def __init__(self, capacity: int, slots: int = 1) -> None:
        if capacity <= 0:
            raise ValueError(f"staging buffer capacity must be positive, got {capacity} bytes")
        if slots <= 0:
            raise ValueError(f"staging buffer slots must be positive, got {slots}")
        self.capacity = capacity
        self.slots = slots
        self.used = [0] * slots  # bytes of the chunk last filled into each region

    @property
    @abstractmethod
    def tensor(self) -> torch.Tensor:
        """All regions: uint8, shape ``(slots * capacity,)``."""

    def region(self, slot: int) -> torch.Tensor:
        """Region ``slot``: uint8, shape ``(capacity,)``."""
        return self.tensor[slot * self.capacity : (slot + 1) * self.capacity]

    def plan(self, named_tensors: Sequence[tuple[str, torch.Tensor]], slot: int = 0,
             sizes: Sequence[int] | None = None,
             poll: Callable[[], None] | None = None) -> PackPlan:
        """Lay a chunk out in region ``slot`` without copying (see ``plan_pack``; ``sizes``:
        each tensor's bytes, if the caller has them; ``poll``: called now and then).

        Raises:
            ValueError: the tensors need more than ``capacity`` bytes (names the sizes), or a
                dtype is unsupported.
        """
        if sizes is None:
            sizes = [nbytes_of(t) for _, t in named_tensors]
        total = sum(sizes)
        if total > self.capacity:
            raise ValueError(
                f"chunk of {len(named_tensors)} tensors needs {total} bytes but the staging "
                f"buffer holds {self.capacity} bytes"
            )
        return plan_pack(self.region(slot), named_tensors, sizes, poll)

    def fill(self, chunk: Sequence[tuple[str, torch.Tensor]] | PackPlan, slot: int = 0
             ) -> PackedLayout:
        """Copy a chunk (its tensors, or a ``plan`` made for the same ``slot``) into region
        ``slot`` back to back from its offset 0; return its metadata.

        Raises:
            ValueError: as ``plan``.
        """
        plan = chunk if isinstance(chunk, PackPlan) else self.plan(chunk, slot)
        self.launch(plan, slot)
        self.ready(slot)
        return plan.layout

    def launch(self, plan: PackPlan, slot: int = 0) -> None:
        """Start ``fill``'s copies (a ``plan`` made for ``slot``) without waiting for them
        (CUDA: queued on the current stream), so the caller can lay out the next chunk
        meanwhile; ``ready(slot)`` must run before the region's ``handle`` is handed out.
        Copies into different regions may be queued back to back."""
        run_pack(plan)
        self.used[slot] = plan.total

    def ready(self, slot: int | None = None) -> None:  # noqa: B027 - optional hook
        """Wait until the copies launched into region ``slot`` (None: every region) are done
        (CPU copies are done when ``launch`` returns)."""

    def copied(self, slot: int | None = None) -> bool:
        """Whether the copies launched into region ``slot`` (None: every region) are done,
        without waiting (CPU copies are)."""
        return True

    @abstractmethod
    def handle(self, slot: int = 0) -> Handle:
        """The handle to send for the chunk just filled into region ``slot``."""

    def end_update(self) -> None:  # noqa: B027 - optional hook
        """The update ended: drop what was exported for it (CUDA: the exports)."""

    @abstractmethod
    def close(self) -> None:
        """Free the buffer. Idempotent."""


class ShmStagingBuffer(StagingBuffer):
    """Staging memory in one POSIX shared-memory segment (CPU transport), kept for the
    publisher's life; a chunk's handle covers bytes ``[0, used)`` of its region.

    Raises:
        OSError: the segment cannot be created.
    """

    def __init__(self, capacity: int, *, rank: int = 0, slots: int = 1) -> None:
        super().__init__(capacity, slots)
        self.segment = ShmSegment(capacity * slots, rank=rank)

    @property
    def tensor(self) -> torch.Tensor:
        t = self.segment.tensor
        if t is None:
            raise ValueError(f"staging segment {self.segment.name} is closed")
        return t

    def handle(self, slot: int = 0) -> ShmHandle:
        return self.segment.handle(slot * self.capacity, self.used[slot])

    def close(self) -> None:
        self.segment.close_and_unlink()


class CudaStagingBuffer(StagingBuffer):
    """Staging memory in GPU memory (CUDA IPC transport), allocated per update as one block.

    The reference-count discipline is that of vLLM 0.33's packed importer
    (``packed_tensor.PackedBufferImporter``): torch pairs one ``reduce_tensor`` export with one
    release on the consumer side, and vLLM caches its mapping keyed by the handle's args,
    rebuilding (then dropping the old entry) when the args change and releasing at
    ``/finish_weight_update``.

    * ``slots=1``: the region is exported once, whole, at the first chunk of an update, and
      every chunk of the update sends that handle (vLLM's own producer); the importer maps it
      once and releases it at finish.
    * ``slots>=2``: each chunk sends a fresh export of its region (a view of the one block).
      The args change every chunk, so the importer rebuilds -- while its previous entry still
      holds the block, so torch's consumer finds the storage in its cache: no new mapping, and
      the new export's count is released at once. The first export is released when the
      mapping is dropped at finish. One mapping per update, every export balanced.

    ``end_update`` drops the exports *and* the storage: torch keeps each export's bookkeeping
    (an interprocess event and a ref-counter slot) until the storage dies, so exporting one
    long-lived storage every round would grow without bound. The next update allocates again
    -- the caching allocator hands back the same block once the engine released it, and a
    block the engine still maps (a failed update) waits in torch's limbo until
    ``torch.cuda.ipc_collect()`` finds it released, instead of being reused under the engine's
    feet.

    Args:
        capacity: bytes of each region (uint8).
        device: the CUDA device (the rank's own GPU).
        slots: regions (1; 2 or more: the next chunk is filled while earlier ones load).
    """

    def __init__(self, capacity: int, device: torch.device | int | str, slots: int = 1) -> None:
        super().__init__(capacity, slots)
        self.device = torch.device(device) if not isinstance(device, int) else torch.device(
            "cuda", device
        )
        if self.device.type != "cuda":
            raise ValueError(f"CudaStagingBuffer needs a CUDA device, got {self.device}")
        self._tensor: torch.Tensor | None = None
        # per region, recorded after its last launch: the publisher waits for chunk k's copy
        # only, while chunk k+1's copy is queued behind it in another region
        self._launched: list[torch.cuda.Event | None] = [None] * slots
        self._export: CudaIpcHandle | None = None  # slots=1: this update's one export
        self._closed = False
        self.exports = 0  # reduce_tensor calls so far

    @property
    def tensor(self) -> torch.Tensor:
        if self._closed:
            raise ValueError("CUDA staging buffer is closed")
        if self._tensor is None:
            self._tensor = torch.empty(
                self.capacity * self.slots, dtype=torch.uint8, device=self.device
            )
        return self._tensor

    def launch(self, plan: PackPlan, slot: int = 0) -> None:
        super().launch(plan, slot)
        event = self._launched[slot]
        if event is None:
            event = self._launched[slot] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))

    def ready(self, slot: int | None = None) -> None:
        # The consumer is another process: the copies must be done before the handle goes
        # out (vLLM's producer synchronizes; a consumer that finds the storage in torch's IPC
        # cache does not wait on the export's event).
        if slot is None:
            torch.cuda.synchronize(self.device)
            return
        event = self._launched[slot]
        if event is not None:
            event.synchronize()

    def copied(self, slot: int | None = None) -> bool:
        events = self._launched if slot is None else [self._launched[slot]]
        return all(e is None or e.query() for e in events)

    def handle(self, slot: int = 0) -> CudaIpcHandle:
        if self.slots == 1:
            if self._export is None:
                self._export = cuda_ipc_handle(self.region(0))
                self.exports += 1
            return self._export
        self.exports += 1
        return cuda_ipc_handle(self.region(slot))

    def end_update(self) -> None:
        self._export = None
        self._tensor = None

    def close(self) -> None:
        self.end_update()
        self._closed = True

"""A publisher's exports: its staging memory (packed) and per-chunk exports (unpacked), and
what they hold during an update (``ExportLedger``).

Packed: one ``StagingBuffer`` of ``regions`` regions, created on first use and allocated per
update (CUDA) or kept for the publisher's life (shm); a tensor larger than a region goes as a
packed chunk of its own that exports its own memory (``oversize``). Unpacked: CUDA tensors
exported as they are (a contiguous copy on the rank's device where needed), or one
shared-memory segment per chunk with the tensors back to back; both are kept until the
commit's ack (design.md I3).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from slotsync.protocol import wire
from slotsync.protocol.rank import gather
from slotsync.protocol.rank.export import (
    PackedLayout,
    ShmSegment,
    cuda_ipc_handle,
    dtype_name,
    materialize,
    nbytes_of,
    pack_into,
    raw_bytes,
)
from slotsync.protocol.rank.export_ledger import ExportLedger
from slotsync.protocol.rank.staging import CudaStagingBuffer, ShmStagingBuffer, StagingBuffer

__all__ = ["ChunkExporter"]

log = logging.getLogger(__name__)


class ChunkExporter:
    """Exports one rank's chunks.

    Args:
        transport: ``"cuda"`` or ``"shm"``.
        device: the rank's device (cuda: its GPU).
        rank: the rank (names its shared-memory segments).
        capacity: bytes of each staging region (``staging_bytes``).
        regions: staging regions (``staging_buffers``).
    """

    def __init__(self, transport: str, device: torch.device, rank: int, capacity: int,
                 regions: int) -> None:
        self.transport = transport
        self.device = device
        self.rank = rank
        self.capacity = capacity
        self.regions = regions
        self.segments: list[ShmSegment] = []  # every segment we own (for close)
        self.ledger = ExportLedger(self.segments)  # what the open update exported
        self._staging: StagingBuffer | None = None

    def staging(self) -> StagingBuffer:
        """The staging buffer, created on first use.

        Raises:
            OSError: the shared-memory segment cannot be created.
        """
        if self._staging is None:
            buf: StagingBuffer
            if self.transport == "cuda":
                buf = CudaStagingBuffer(self.capacity, self.device, self.regions)
            else:
                buf = ShmStagingBuffer(self.capacity, rank=self.rank, regions=self.regions)
                self.segments.append(buf.segment)
            self._staging = buf
        return self._staging

    def warm_up(self, packed: bool) -> None:
        """Compile the packed copy kernel for the rank's GPU now (``gather.warm_up``: Triton's
        import and compile, or its on-disk cache, ~0.5 s once per process), so that the first
        publish does not pay it inside the engine's pause (issue 27 C). Only for a packed
        publisher on CUDA with Triton; a failure is logged, not raised: the kernel is then
        compiled, or refused, at the first chunk as before."""
        if not (packed and self.transport == "cuda" and gather.available()):
            return
        try:
            gather.warm_up(self.device, scatter=False)
        except Exception as e:  # noqa: BLE001 - only an early start of later work
            log.warning("rank %d: could not compile the packed copy kernel ahead of the first "
                        "publish (%s: %s); it is compiled at the first chunk instead",
                        self.rank, type(e).__name__, e)

    def allocate(self) -> None:
        """Allocate this update's staging memory (before the begin, so that a size that does
        not fit fails before the engine is paused).

        Raises:
            MemoryError: the regions cannot be allocated (names their size and the device).
        """
        try:
            self.staging().tensor  # noqa: B018 - allocates (CUDA: once per update)
        except (RuntimeError, OSError) as e:  # torch.OutOfMemoryError is a RuntimeError
            total = self.capacity * self.regions
            where = self.device if self.transport == "cuda" else "/dev/shm"
            raise MemoryError(
                f"cannot allocate {self.regions} staging region(s) of "
                f"{self.capacity} bytes ({total} bytes) on {where}: {e} (lower "
                "staging_bytes or staging_buffers)") from None

    def unpacked(
        self, items: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[PackedLayout, list[wire.Handle]]:
        """Unpacked export: one handle per tensor, kept alive until the commit's ack."""
        handles: list[wire.Handle] = []
        if self.transport == "cuda":
            layout = PackedLayout([], [], [], [])
            for name, t in items:
                e = materialize(t).detach()  # a DTensor: its full tensor (issue 17)
                if e.device != self.device:
                    e = e.to(self.device)
                e = e.contiguous()
                layout.names.append(name)
                layout.dtype_names.append(dtype_name(e.dtype))
                layout.shapes.append([int(d) for d in e.shape])
                layout.tensor_sizes.append(nbytes_of(e))
                self.ledger.pinned.append(e)
                handles.append(cuda_ipc_handle(e))
            torch.cuda.synchronize(self.device)
            return layout, handles
        # shm: one segment per chunk, the tensors back to back, one handle per tensor
        total = sum(nbytes_of(t) for _, t in items)
        seg = ShmSegment(total, rank=self.rank)
        self.ledger.segment(seg)
        assert seg.tensor is not None
        layout = pack_into(seg.tensor, items)
        off = 0
        for n in layout.tensor_sizes:
            handles.append(seg.handle(off, n))
            off += n
        return layout, handles

    def oversize(self, index: int, name: str, t: torch.Tensor) -> tuple[PackedLayout, wire.Handle]:
        """Packed chunk ``index`` of one tensor larger than a staging region (issue 17): its
        layout and one handle covering exactly the tensor's bytes, in vLLM's packed layout
        (a flat uint8 buffer: vLLM 0.33 ``packed_tensor.packed_ipc_consumer`` slices
        ``packed[:sum(tensor_sizes)]`` and views each piece as its dtype).

        * CUDA: the tensor's own memory, no staging copy: ``export.raw_bytes(t)`` (a flat
          uint8 view; a copy only if ``t`` is not contiguous, or is on another device, which
          is first copied to the rank's GPU), exported with ``cuda_ipc_handle`` once the
          device's queued work is done (the engine reads it from another process).
        * shm: a segment of its own holding the tensor's bytes (CPU memory cannot be exported
          in place: one copy).

        Either is held in the ledger until the chunk's ack or the update's end
        (``ExportLedger.hold``). The staging buffer must then hand out a fresh export for
        its next chunk (``StagingBuffer.after_oversize``; the pipeline calls it).

        Raises:
            ValueError: an unsupported dtype.
            OSError: the segment cannot be created (shm; e.g. ``/dev/shm`` too small).
        """
        name_of_dtype = dtype_name(t.dtype)
        shape = [int(d) for d in t.shape]
        if self.transport == "cuda":
            src = t if t.device == self.device else t.detach().to(self.device)
            raw = raw_bytes(src)
            torch.cuda.synchronize(self.device)
            n = raw.numel()
            handle: wire.Handle = cuda_ipc_handle(raw)
            self.ledger.hold(index, raw)
        else:
            raw = raw_bytes(t)
            n = raw.numel()
            seg = ShmSegment(n, rank=self.rank)
            self.ledger.hold(index, seg)  # (unlinked by the ledger, also if the copy fails)
            assert seg.tensor is not None
            seg.tensor.copy_(raw)
            del raw
            handle = seg.handle(0, n)
        return PackedLayout([name], [name_of_dtype], [shape], [n]), handle

    def end_update(self, succeeded: bool, acked_early: set[int]) -> None:
        """The update ended: settle the ledger (``ExportLedger.end``), drop the staging
        memory's exports and, on CUDA, free exported blocks whose consumers have released
        them (``torch.cuda.ipc_collect()``: vLLM's own producer calls it after finish;
        vllm-contract.md)."""
        self.ledger.end(succeeded, acked_early)
        if self._staging is not None:
            self._staging.end_update()
        if self.transport == "cuda":
            torch.cuda.ipc_collect()

    def close(self) -> None:
        """Free the staging memory and unlink every segment left. Idempotent."""
        self.ledger.pinned.clear()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        for seg in self.segments:
            seg.close_and_unlink()
        self.segments.clear()

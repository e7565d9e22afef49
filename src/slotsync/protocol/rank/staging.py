"""Staging memory for packed chunks: reusable uint8 *regions* a rank copies a chunk into, in
vLLM's packed layout (vLLM 0.27-0.33 ``packed_tensor.py``), and exports as one handle.

A staging *region* is one chunk's share of the staging memory; it is never called a slot (an
engine slot is a GPU range of an engine). Which region a chunk uses and when it may be refilled
is the publisher session's rule (``session.py``); this module only holds the memory.

This module imports torch; the daemon never imports it (design.md I6).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from slotsync.protocol.rank.export import (
    PackedLayout,
    PackPlan,
    ShmSegment,
    cuda_ipc_handle,
    nbytes_of,
    plan_pack,
    run_pack,
)
from slotsync.protocol.wire import CudaIpcHandle, Handle, ShmHandle

__all__ = ["CudaStagingBuffer", "ShmStagingBuffer", "StagingBuffer"]


class StagingBuffer(ABC):
    """Reusable uint8 staging memory for packed chunks: ``regions`` regions of ``capacity``
    bytes each, so that a rank fills chunk k+1 into one region while the engine still reads
    earlier chunks from the others (``regions >= 2``).

    Per chunk: ``plan`` lays the chunk out in a region (CPU only), ``fill`` copies it in -- only
    once the chunk that last used that region was acknowledged (design.md I3) -- and ``handle``
    gives the handle to send. ``end_update`` runs when the update ends (commit acknowledged,
    aborted or failed).

    Raises:
        ValueError: ``capacity`` or ``regions`` is not positive.
    """

    def __init__(self, capacity: int, regions: int = 1) -> None:
        if capacity <= 0:
            raise ValueError(f"staging buffer capacity must be positive, got {capacity} bytes")
        if regions <= 0:
            raise ValueError(f"staging buffer regions must be positive, got {regions}")
        self.capacity = capacity
        self.regions = regions
        self.used = [0] * regions  # bytes of the chunk last filled into each region

    @property
    @abstractmethod
    def tensor(self) -> torch.Tensor:
        """All regions: uint8, shape ``(regions * capacity,)``."""

    def region(self, index: int) -> torch.Tensor:
        """Region ``index``: uint8, shape ``(capacity,)``."""
        return self.tensor[index * self.capacity : (index + 1) * self.capacity]

    def plan(self, named_tensors: Sequence[tuple[str, torch.Tensor]], region: int = 0,
             sizes: Sequence[int] | None = None,
             poll: Callable[[], None] | None = None) -> PackPlan:
        """Lay a chunk out in region ``region`` without copying (see ``plan_pack``; ``sizes``:
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
        return plan_pack(self.region(region), named_tensors, sizes, poll)

    def fill(self, chunk: Sequence[tuple[str, torch.Tensor]] | PackPlan, region: int = 0
             ) -> PackedLayout:
        """Copy a chunk (its tensors, or a ``plan`` made for the same ``region``) into region
        ``region`` back to back from its offset 0; return its metadata.

        Raises:
            ValueError: as ``plan``.
        """
        plan = chunk if isinstance(chunk, PackPlan) else self.plan(chunk, region)
        self.launch(plan, region)
        self.ready(region)
        return plan.layout

    def launch(self, plan: PackPlan, region: int = 0) -> None:
        """Start ``fill``'s copies (a ``plan`` made for ``region``) without waiting for them
        (CUDA: queued on the current stream), so the caller can lay out the next chunk
        meanwhile; ``ready(region)`` must run before the region's ``handle`` is handed out.
        Copies into different regions may be queued back to back."""
        run_pack(plan)
        self.used[region] = plan.total

    def ready(self, region: int | None = None) -> None:  # noqa: B027 - optional hook
        """Wait until the copies launched into region ``region`` (None: every region) are done
        (CPU copies are done when ``launch`` returns)."""

    def copied(self, region: int | None = None) -> bool:
        """Whether the copies launched into region ``region`` (None: every region) are done,
        without waiting (CPU copies are)."""
        return True

    @abstractmethod
    def handle(self, region: int = 0) -> Handle:
        """The handle to send for the chunk just filled into region ``region``."""

    def after_oversize(self) -> None:  # noqa: B027 - optional hook
        """A chunk with an export of its own (a tensor larger than a region, issue 17) was
        just sent: the next chunk from this buffer must carry a fresh export (CUDA, one
        region: see ``CudaStagingBuffer``). Shared memory is not reference-counted: no-op."""

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

    def __init__(self, capacity: int, *, rank: int = 0, regions: int = 1) -> None:
        super().__init__(capacity, regions)
        self.segment = ShmSegment(capacity * regions, rank=rank)

    @property
    def tensor(self) -> torch.Tensor:
        t = self.segment.tensor
        if t is None:
            raise ValueError(f"staging segment {self.segment.name} is closed")
        return t

    def handle(self, region: int = 0) -> ShmHandle:
        return self.segment.handle(region * self.capacity, self.used[region])

    def close(self) -> None:
        self.segment.close_and_unlink()


class CudaStagingBuffer(StagingBuffer):
    """Staging memory in GPU memory (CUDA IPC transport), allocated per update as one block.

    The reference-count discipline is that of vLLM 0.33's packed importer
    (``packed_tensor.PackedBufferImporter``): torch pairs one ``reduce_tensor`` export with one
    release on the consumer side, and vLLM caches its mapping keyed by the handle's args,
    rebuilding (then dropping the old entry) when the args change and releasing at
    ``/finish_weight_update``.

    * ``regions=1``: the region is exported once, whole, at the first chunk of an update, and
      every chunk of the update sends that handle (vLLM's own producer); the importer maps it
      once and releases it at finish.
    * ``regions>=2``: each chunk sends a fresh export of its region (a view of the one block).
      The args change every chunk, so the importer rebuilds -- while its previous entry still
      holds the block, so torch's consumer finds the storage in its cache: no new mapping, and
      the new export's count is released at once. The first export is released when the
      mapping is dropped at finish. One mapping per update, every export balanced.

    Oversize chunks (a tensor larger than a region goes as a chunk of its own that exports the
    tensor's own memory, ``ChunkExporter.oversize``) come between staging chunks, and the
    importer has one slot: the oversize export's args replace the staging entry, dropping
    (releasing) its mapping. The rule, for any number of regions: **the first staging chunk
    after an oversize chunk carries an export made after that oversize chunk**
    (``after_oversize``).

    * ``regions=1``: without the rule the next chunk would send the update's one export again;
      its args differ from the oversize entry's, so the importer rebuilds that export a second
      time and later releases it again -- two releases for one ``reduce_tensor``, the count
      driven below zero and the staging block never reclaimable. With it, ``after_oversize``
      forgets the export and the next ``handle`` makes a new one: each export is rebuilt once
      and released once (the first when the oversize entry replaced it, the new one when the
      next entry or finish replaces it).
    * ``regions>=2``: every staging chunk carries a fresh export already, so the rule holds by
      construction. After the oversize entry dropped the staging mapping, no storage of the
      block is left in torch's consumer cache, so the next export maps the block anew and its
      count is released when its own entry is dropped; the dropped mapping had released the
      first export's count. Still balanced; ``after_oversize`` does nothing more.

    ``end_update`` drops the exports *and* the storage: torch keeps each export's bookkeeping
    (an interprocess event and a ref-counter entry) until the storage dies, so exporting one
    long-lived storage every round would grow without bound. The next update allocates again
    -- the caching allocator hands back the same block once the engine released it, and a
    block the engine still maps (a failed update) waits in torch's limbo until
    ``torch.cuda.ipc_collect()`` finds it released, instead of being reused under the engine's
    feet.

    Args:
        capacity: bytes of each region (uint8).
        device: the CUDA device (the rank's own GPU).
        regions: regions (1; 2 or more: the next chunk is filled while earlier ones load).
    """

    def __init__(self, capacity: int, device: torch.device | int | str, regions: int = 1) -> None:
        super().__init__(capacity, regions)
        self.device = torch.device(device) if not isinstance(device, int) else torch.device(
            "cuda", device
        )
        if self.device.type != "cuda":
            raise ValueError(f"CudaStagingBuffer needs a CUDA device, got {self.device}")
        self._tensor: torch.Tensor | None = None
        # per region, recorded after its last launch: the publisher waits for chunk k's copy
        # only, while chunk k+1's copy is queued behind it in another region
        self._launched: list[torch.cuda.Event | None] = [None] * regions
        self._export: CudaIpcHandle | None = None  # regions=1: this update's one export
        self._closed = False
        self.exports = 0  # reduce_tensor calls so far

    @property
    def tensor(self) -> torch.Tensor:
        if self._closed:
            raise ValueError("CUDA staging buffer is closed")
        if self._tensor is None:
            self._tensor = torch.empty(
                self.capacity * self.regions, dtype=torch.uint8, device=self.device
            )
        return self._tensor

    def launch(self, plan: PackPlan, region: int = 0) -> None:
        super().launch(plan, region)
        event = self._launched[region]
        if event is None:
            event = self._launched[region] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))

    def ready(self, region: int | None = None) -> None:
        # The consumer is another process: the copies must be done before the handle goes
        # out (vLLM's producer synchronizes; a consumer that finds the storage in torch's IPC
        # cache does not wait on the export's event).
        if region is None:
            torch.cuda.synchronize(self.device)
            return
        event = self._launched[region]
        if event is not None:
            event.synchronize()

    def copied(self, region: int | None = None) -> bool:
        events = self._launched if region is None else [self._launched[region]]
        return all(e is None or e.query() for e in events)

    def handle(self, region: int = 0) -> CudaIpcHandle:
        if self.regions == 1:
            if self._export is None:
                self._export = cuda_ipc_handle(self.region(0))
                self.exports += 1
            return self._export
        self.exports += 1
        return cuda_ipc_handle(self.region(region))

    def after_oversize(self) -> None:
        self._export = None  # regions=1: the next handle is a fresh export (see the class)

    def end_update(self) -> None:
        self._export = None
        self._tensor = None

    def close(self) -> None:
        self.end_update()
        self._closed = True

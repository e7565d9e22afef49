"""The export-lifetime ledger of one publisher: which exports of the open update the engine
has consumed, and what to give back or free when the update ends (design.md I3).

* CUDA exports sent with a chunk are "due" until that chunk's ack (the engine mapped them);
  after an update that did not succeed, the ones never acknowledged are given back
  (``export.release_unconsumed``), else their block would stay allocated for the life of the
  process.
* Unpacked exports (contiguous CUDA copies, shared-memory segments) live until the commit's
  ack, then are dropped (segments unlinked).
* A packed chunk of one tensor larger than a staging region (issue 17) exports memory of its
  own -- the tensor's bytes on CUDA (a copy only where the tensor was on another device or not
  contiguous), a segment of its own on shm -- held per chunk (``hold``) until that chunk's
  ack, or the update's end: the engine has cloned the bytes by its ack (vLLM's packed
  consumer clones, ``packed_tensor.packed_ipc_consumer``). A CUDA block the consumer still
  maps after that waits in torch's IPC limbo (``ipc_collect``); a segment may be unlinked
  while mapped (the mapping stays valid, the name goes).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from slotsync.protocol import wire
from slotsync.protocol.rank.export import ShmSegment, release_unconsumed

__all__ = ["ExportLedger"]


class ExportLedger:
    """What one publisher exported for its open update.

    Args:
        owned_segments: every shared-memory segment the publisher owns (its finalizer frees
            what is left there); an update's segments are added and removed here.
    """

    def __init__(self, owned_segments: list[ShmSegment]) -> None:
        self._owned = owned_segments
        self._by_chunk: dict[int, list[wire.CudaIpcHandle]] = {}  # until the chunk's ack
        self._consumed: set[tuple[bytes, int]] = set()  # (ref-counter handle, offset)
        self.pinned: list[torch.Tensor] = []  # unpacked CUDA exports, until commit's ack
        self._segments: list[ShmSegment] = []  # unpacked shm, until commit's ack
        # oversize packed chunks: their own memory (a tensor or a segment), until their ack
        self._held: dict[int, torch.Tensor | ShmSegment] = {}

    def sent(self, index: int, handles: Iterable[wire.Handle]) -> None:
        """Chunk ``index`` went out with ``handles``: its CUDA exports are due."""
        cuda = [h for h in handles if isinstance(h, wire.CudaIpcHandle)]
        if cuda:
            self._by_chunk[index] = cuda

    def acked(self, index: int) -> None:
        """Chunk ``index`` was acknowledged: the engine mapped its exports."""
        for h in self._by_chunk.pop(index, ()):
            self._consumed.add((h.ref_counter_handle, h.ref_counter_offset))
        held = self._held.pop(index, None)
        if held is not None:
            self._drop(held)

    def hold(self, index: int, memory: torch.Tensor | ShmSegment) -> None:
        """Oversize packed chunk ``index`` exports ``memory`` (the CUDA tensor whose bytes the
        handle covers, or its own segment): kept until the chunk's ack or the update's end,
        then dropped (a segment unlinked)."""
        if isinstance(memory, ShmSegment):
            self._owned.append(memory)
        self._held[index] = memory

    @property
    def held(self) -> int:
        """Oversize chunks whose memory is still held."""
        return len(self._held)

    def _drop(self, memory: torch.Tensor | ShmSegment) -> None:
        if isinstance(memory, ShmSegment):
            memory.close_and_unlink()
            if memory in self._owned:
                self._owned.remove(memory)

    def segment(self, seg: ShmSegment) -> None:
        """An unpacked chunk's shared-memory segment, kept until the update ends."""
        self._owned.append(seg)
        self._segments.append(seg)

    def end(self, succeeded: bool, acked_early: Iterable[int] = ()) -> None:
        """The update ended. If it did not succeed, give back each CUDA export never
        acknowledged once (``acked_early``: chunks whose ack was read but not yet awaited:
        mapped too). Then drop the pinned copies and the oversize chunks' memory, and unlink
        the update's segments (a failed update's too: design.md I3)."""
        if not succeeded:
            done = self._consumed  # mapped by the engine, or given back below
            for index in acked_early:
                done.update((h.ref_counter_handle, h.ref_counter_offset)
                            for h in self._by_chunk.get(index, ()))
            for handles in self._by_chunk.values():
                for h in handles:
                    key = (h.ref_counter_handle, h.ref_counter_offset)
                    if key not in done:  # (one export may serve several chunks)
                        done.add(key)
                        release_unconsumed(h)
        self._by_chunk.clear()
        self._consumed.clear()
        self.pinned.clear()
        for memory in self._held.values():
            self._drop(memory)
        self._held.clear()
        for seg in self._segments:
            seg.close_and_unlink()
            if seg in self._owned:
                self._owned.remove(seg)
        self._segments.clear()

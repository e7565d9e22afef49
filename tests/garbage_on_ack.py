"""A trainer rank that overwrites each chunk's exported memory with garbage the instant the
publisher reads that chunk's ``Ack`` (issue 26 C's GPU test, tests/gpu/test_gpu_sglang.py).

The ``Ack`` of chunk ``k`` hands chunk ``k``'s memory back to the publisher (design.md I3): a
packed chunk's staging region may be refilled from then on (``pipeline.ChunkPipeline``: region
``region_of(k, regions)`` is refilled once chunk ``k``'s ack is taken); an unpacked chunk's
tensors are the trainer's to change. So an engine whose copies out of that memory were still
running when the ack came would load garbage, and its checksums would differ from the
trainers'. The daemon's SGLang fence (``daemon/sglang/fence.py``) exists to make that
impossible; this rank checks it does.

Where: every reply the publisher reads goes through ``PublisherSession.receive``
(``protocol/rank/session.py``), the awaited ack and the ones that come early alike, before the
pipeline can take it; :func:`install` wraps that method in this process only (the rank's,
not ``publisher.py``): after a chunk ``Ack`` of the open update it fills the chunk's memory
with ``0xFF`` bytes (NaN as a float, an invalid ``bool``) on the rank's GPU and waits for the
fill (``torch.cuda.synchronize``), then puts ``{"event": "garbage", "rank", "index", "bytes",
"lag_s"}`` on the results queue (``lag_s``: seconds from the chunk's send, when
``ExportLedger.sent`` ran, to its ack). The chunk's memory:

* packed: its staging region, ``StagingBuffer.region(region_of(k, regions))``, whole (the
  buffers are found by wrapping ``StagingBuffer.__init__``; GPU memory on CUDA, the shared
  memory segment on the CPU transport);
* unpacked: the memory the chunk exported. ``ExportLedger.sent(k, handles)`` runs right
  after ``ChunkExporter.unpacked``: on CUDA it appended the chunk's tensors to
  ``ledger.pinned`` (one per handle: its last ``len(handles)`` entries), on the CPU transport
  the chunk's own segment to ``ledger._segments`` (its last entry).

On the CPU transport the engine's copies are done when it answers, so there the hook only
shows its own machinery works (tests/integration/test_sglang_garbage.py); the GPU is where it
tests the fence.

:func:`garbage_rank` is ``trainer_script.run_rank`` with the hook installed first
(``spawned_ranks.run_ranks(..., target=garbage_rank)``).
"""

from __future__ import annotations

import time
from typing import Any

GARBAGE = 0xFF
"""The byte every overwritten byte becomes."""


def install(rank: int, results: Any) -> None:
    """Install the hook of the module docstring in this (rank) process."""
    import torch

    from slotsync.protocol import wire
    from slotsync.protocol.rank.export_ledger import ExportLedger
    from slotsync.protocol.rank.session import PublisherSession, region_of
    from slotsync.protocol.rank.staging import StagingBuffer

    buffers: list[StagingBuffer] = []
    # unpacked chunk index -> its memory: its CUDA tensors, or its shared-memory segment
    # (the segment, not a view of it: a view would keep it from being unmapped)
    exported: dict[int, list[torch.Tensor] | Any] = {}
    sent_at: dict[int, float] = {}  # chunk index -> time.monotonic() of its send

    real_init = StagingBuffer.__init__

    def init(self: StagingBuffer, *args: Any, **kw: Any) -> None:
        real_init(self, *args, **kw)
        buffers.append(self)

    real_sent = ExportLedger.sent

    def sent(self: ExportLedger, index: int, handles: Any) -> None:
        handles = list(handles)
        real_sent(self, index, handles)
        sent_at[index] = time.monotonic()
        if handles and all(isinstance(h, wire.CudaIpcHandle) for h in handles) \
                and len(self.pinned) >= len(handles):
            exported[index] = list(self.pinned[-len(handles):])
        elif handles and all(isinstance(h, wire.ShmHandle) for h in handles) \
                and self._segments and self._segments[-1].tensor is not None \
                and self._segments[-1].name == handles[0].segment:
            exported[index] = self._segments[-1]

    real_receive = PublisherSession.receive

    def receive(self: PublisherSession, msg: Any, awaited: Any = None) -> Any:
        outcome = real_receive(self, msg, awaited)
        if (isinstance(msg, wire.Ack) and msg.phase == "chunk"
                and msg.update_id == self.update_id and msg.index is not None):
            spoil(msg.index)
        return outcome

    def spoil(index: int) -> None:
        lag = time.monotonic() - sent_at.pop(index, float("nan"))
        memory = exported.pop(index, None)
        if isinstance(memory, list):
            tensors = memory
        elif memory is not None:  # a segment
            tensors = [] if memory.tensor is None else [memory.tensor]
        elif buffers and _live(buffers[-1]):
            buf = buffers[-1]
            tensors = [buf.region(region_of(index, buf.regions))]
        else:
            tensors = []
        nbytes = 0
        for t in tensors:
            t.view(-1).view(torch.uint8).fill_(GARBAGE)
            nbytes += t.numel() * t.element_size()
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        del tensors, memory
        results.put({"event": "garbage", "rank": rank, "index": index, "bytes": nbytes,
                     "lag_s": lag})

    StagingBuffer.__init__ = init  # type: ignore[method-assign]
    ExportLedger.sent = sent  # type: ignore[method-assign]
    PublisherSession.receive = receive  # type: ignore[method-assign]


def _live(buf: Any) -> bool:
    """Whether a staging buffer holds memory now (CUDA: allocated for the open update;
    shared memory: not closed)."""
    if hasattr(buf, "_tensor"):
        return buf._tensor is not None
    return getattr(buf.segment, "tensor", None) is not None


def garbage_rank(rank: int, endpoint: str, slot: tuple[int, int], engine_url: str,
                 packed: bool, script: dict, results: Any) -> None:
    """``trainer_script.run_rank`` (same arguments) with :func:`install` applied first."""
    from trainer_script import run_rank

    install(rank, results)
    run_rank(rank, endpoint, slot, engine_url, packed, script, results)

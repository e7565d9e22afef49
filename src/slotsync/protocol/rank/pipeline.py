"""A publisher's copy pipeline: which chunk's copy is launched, which chunk is sent and which
ack is awaited, in what order. No socket here: it sends and waits through a ``Channel``
(``DaemonWaits`` in a ``Publisher``; a fake in tests/unit/test_pipeline.py).

Rules (each one a test in tests/unit/test_pipeline.py; tests/unit/test_publisher.py pins them end to
end):

* Packed, chunk ``k`` is copied into staging region ``k % regions`` (``session.region_of``)
  and that region is refilled only after the ack of chunk ``k - regions``
  (``session.unacked_before_copy``): design.md I3.
* A packed chunk's handle is sent only once its copy is done (the engine reads the region
  from another process).
* ``pipelined`` (``publish``): chunk ``k``'s copy is launched and chunk ``k + 1`` laid out
  (CPU work) before chunk ``k`` is sent; chunk ``k`` goes out from within that layout as soon
  as its copy is done, else after it. When chunk ``k + 1``'s region is already free (the acks
  that free it have arrived), its copy is queued before chunk ``k`` is sent, so the GPU copies
  back to back; otherwise chunk ``k`` is sent first and then the ack awaited (the engine must
  not wait for chunk ``k`` while the publisher waits for an ack).
* Not pipelined (``send_chunk``): lay out, copy, send at once.
* Packed, a chunk of one tensor larger than a staging region (``chunking.cut`` gives such a
  tensor a chunk of its own) uses no region: the pending chunk is sent first, then at most
  ``unacked_before_copy`` chunks are left unacknowledged, and it goes out with an export of
  its own (``ChunkExporter.oversize``: the tensor's own memory on CUDA, its own segment on
  shm), held until its ack; the staging buffer's next chunk carries a fresh export
  (``StagingBuffer.after_oversize``, the rule in ``staging.CudaStagingBuffer``).
* Unpacked: export, then wait until at most ``max_unacked`` chunks are unacknowledged, send.
* Acks are taken oldest first; the begin's ack is settled before any chunk's ack is awaited.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from slotsync.protocol import wire
from slotsync.protocol.rank.chunk_export import ChunkExporter
from slotsync.protocol.rank.export import PackedLayout, nbytes_of
from slotsync.protocol.rank.session import (
    Awaited,
    PublisherSession,
    SentChunk,
    region_of,
    unacked_before_copy,
)

__all__ = ["Channel", "ChunkPipeline"]

log = logging.getLogger("slotsync.protocol.rank.publisher")  # (the log lines stay the publisher's)


class Channel(Protocol):
    """How the pipeline talks to the daemon (``waits.DaemonWaits``)."""

    def send(self, msg: wire.ToDaemon | wire.OutgoingChunk) -> None:
        """Send one message (after handling replies that arrived)."""

    def drain(self) -> None:
        """Handle replies that arrived, never waiting."""

    def wait(self, awaited: Awaited) -> wire.FromDaemon:
        """Block until the ``awaited`` reply came."""


class ChunkPipeline:
    """The chunks of the open update between copy and ack.

    Args:
        session: the update state machine (chunk indices, acks, the begin's state).
        exporter: the staging memory and exports (``chunk_export.ChunkExporter``).
        packed: vLLM packed transfer (staging regions) or unpacked (one handle per tensor).
        channel: sends and waits.
        await_begin: settles the begin's ack if it is still due (``Publisher._await_begin``:
            registers again and resends when a restarted daemon refused it).
        rank: the trainer rank (log lines).
    """

    def __init__(self, session: PublisherSession, exporter: ChunkExporter, packed: bool,
                 channel: Channel, await_begin: Callable[[], None], rank: int) -> None:
        self.session = session
        self.exporter = exporter
        self.packed = packed
        self.channel = channel
        self.await_begin = await_begin
        self.rank = rank
        # packed chunk whose copy is launched but not yet sent: (index, layout, region)
        self.pending: tuple[int, PackedLayout, int] | None = None
        self.export_s = 0.0  # seconds laying out, copying and exporting since the last reset

    def send_chunk(self, items: list[tuple[str, torch.Tensor]], max_unacked: int,
                   sizes: list[int] | None = None, *, pipelined: bool = False) -> int:
        """Export and send one chunk, first waiting until at most ``max_unacked`` earlier
        chunks are unacknowledged (packed: also until its staging region is free). Returns its
        index; its ack is awaited later (``wait_unacked``).

        ``pipelined`` (``publish``: names already checked): a packed chunk's copy is only
        launched; it is sent by the next call, after that call laid its own chunk out while
        the GPU copied this one (``send_pending``), or by ``commit``. When that next chunk's
        region is already free, its copy is queued before the pending chunk is sent, so that
        the GPU copies chunk after chunk while the CPU waits, exports and sends.

        Raises:
            RuntimeError: no update is open.
            ValueError: no tensors, or (not ``pipelined``) duplicate names.
        """
        s = self.session
        s.require_open()
        if not items:
            raise ValueError("a chunk needs at least one tensor")
        if not pipelined:
            names = [n for n, _ in items]
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"duplicate tensor names in one chunk: {dup}")
        index = s.num_chunks
        t0 = time.perf_counter()
        if self.packed:
            staging = self.exporter.staging()
            if len(items) == 1 and (nbytes_of(items[0][1]) if sizes is None
                                    else sizes[0]) > staging.capacity:
                return self._send_oversize(index, items[0], max_unacked)
            region = region_of(index, staging.regions)
            # CPU: overlaps the engine's load of earlier chunks and the pending chunk's copy
            plan = staging.plan(items, region, sizes,
                                poll=self.send_if_copied if pipelined else None)
            self.export_s += time.perf_counter() - t0
            # The region is free once the chunk that last used it, index - regions, was
            # acknowledged. With the pending chunk (index - 1) not yet sent, that is at most
            # regions - 2 chunks unacknowledged; if acks already arrived say so, this chunk's
            # copy is queued behind the pending one's. Else the pending chunk goes out first,
            # and then we wait (the engine must not wait for it while we do).
            keep = unacked_before_copy(max_unacked, staging.regions)
            queue_first = (pipelined and staging.regions > 1 and self.pending is not None
                           and self.wait_unacked(keep - 1, block=False))
            if not queue_first:
                self.send_pending()
                self.wait_unacked(keep)
            t0 = time.perf_counter()
            staging.launch(plan, region)
            self.export_s += time.perf_counter() - t0
            if queue_first:
                self.send_pending()  # waits for its own region's copy only
            t0 = time.perf_counter()
            self.pending = (index, plan.layout, region)
            s.add_chunk(plan.total)
            self.export_s += time.perf_counter() - t0
            if not pipelined:
                self.send_pending()
            return index
        if s.begin_refused is not None:
            self.await_begin()
        t0 = time.perf_counter()
        layout, handles = self.exporter.unpacked(items)
        self.export_s += time.perf_counter() - t0
        self.wait_unacked(max_unacked)
        s.add_chunk(sum(layout.tensor_sizes))
        self._send_chunk_message(s.require_open(), index, layout, handles)
        return index

    def _send_oversize(self, index: int, item: tuple[str, torch.Tensor],
                       max_unacked: int) -> int:
        """Packed chunk ``index`` of one tensor larger than a staging region: send the
        pending chunk, wait until at most ``unacked_before_copy`` chunks are unacknowledged
        (bounds the memory held), export the tensor's own bytes and send them; the staging
        buffer's next chunk gets a fresh export. Returns ``index``."""
        s = self.session
        staging = self.exporter.staging()
        self.send_pending()
        self.wait_unacked(unacked_before_copy(max_unacked, staging.regions))
        if s.begin_refused is not None:
            self.await_begin()
        t0 = time.perf_counter()
        layout, handle = self.exporter.oversize(index, *item)
        s.add_chunk(layout.tensor_sizes[0])
        self.export_s += time.perf_counter() - t0
        self._send_chunk_message(s.require_open(), index, layout, [handle])
        staging.after_oversize()
        return index

    def send_if_copied(self) -> None:
        """While the next chunk is laid out: send the pending chunk if its copy is done,
        without waiting for it."""
        if self.pending is None:
            return
        self.channel.drain()  # (reads acks, or an Error, that arrived)
        if self.exporter.staging().copied(self.pending[2]):
            self.send_pending()

    def send_pending(self) -> None:
        """Send the packed chunk whose copy was launched last, once the copy is done: the
        region's handle is handed out only then (the engine reads it from another process)."""
        if self.pending is None:
            return
        if self.session.begin_refused is not None:
            self.await_begin()  # a restarted daemon refused the begin: register again first
        index, layout, region = self.pending
        self.pending = None
        t0 = time.perf_counter()
        staging = self.exporter.staging()
        staging.ready(region)
        handles: list[wire.Handle] = [staging.handle(region)]
        self.export_s += time.perf_counter() - t0
        self._send_chunk_message(self.session.require_open(), index, layout, handles)

    def _send_chunk_message(self, uid: int, index: int, layout: PackedLayout,
                            handles: list[wire.Handle]) -> None:
        t0 = time.perf_counter()
        sent = SentChunk(index, *layout, handles, self.session.chunk_is_draft(index))
        chunk = self.session.chunk_message(sent)
        self.export_s += time.perf_counter() - t0
        self.channel.send(chunk)
        self.session.chunk_sent(sent)
        self.exporter.ledger.sent(index, handles)

    def wait_unacked(self, keep: int, *, block: bool = True) -> bool:
        """Wait for chunk acks, oldest first, until at most ``keep`` chunks are unacked.
        With ``block=False``, take only the acks that already arrived; returns whether at
        most ``keep`` are unacked. (The begin's ack comes before any chunk's: awaited first.)"""
        s = self.session
        if not block:
            self.channel.drain()
        elif len(s.unacked) > keep:
            self.await_begin()
        while True:
            taken, due = s.take_acked(keep)
            for index in taken:
                self.exporter.ledger.acked(index)  # the engine mapped them
                log.debug("rank %d: update %s chunk %d acknowledged", self.rank, s.update_id,
                          index)
            if due is None:
                return True
            if not block:
                return False
            self.channel.wait(Awaited("chunk", s.update_id, due))
            s.chunk_acked(due)

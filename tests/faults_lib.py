"""A raw wire client for the fault suite's protocol-abuse scenarios (``test_faults.py``).

* :class:`WireRank`: a raw ZeroMQ DEALER speaking ``slotsync.protocol.wire`` directly, for
  protocol abuse (two begins, commit before chunks, chunk after commit, stale ids, fuzz).
* :func:`shm_chunks`: a shared-memory segment and the ``Chunk`` fields that describe it, for
  hand-built wire messages.

The suite's other helpers moved out (issue 16): the rank-process pool to ``rank_pool.py``, the
results table to ``reliability_rows.py``, engine and daemon readers to ``state_readers.py``,
``/proc`` and ``/dev/shm`` readers to ``slotsync.testing.procfs``.
"""

from __future__ import annotations

import time
from typing import Any

from slotsync.protocol import wire
from slotsync.protocol.rank.link import DaemonLink


class WireRank(DaemonLink):
    """A raw DEALER socket to the daemon (no Publisher; ``protocol.link``): sends any frame
    (``send``, ``send_frames``), reads replies."""

    def recv(self, timeout_s: float = 5.0) -> Any:
        """The next reply, decoded, or None after ``timeout_s``."""
        return super().recv(timeout_s)

    def recv_until(self, pred, timeout_s: float = 10.0) -> Any:
        """Replies until one satisfies ``pred`` (returned) or the time is up (None)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            m = self.recv(left)
            if m is not None and pred(m):
                return m
        return None

    def register(self, rank: int, slot: tuple[int, int], engine_url: str, packed: bool,
                 version: int = wire.PROTOCOL_VERSION) -> Any:
        # Like the publisher: a rank still held by the previous job's process (closing its
        # connection right now) is retried for a few seconds.
        deadline = time.monotonic() + 10.0
        while True:
            self.send(wire.Register(version, rank, wire.logical_gpu_uuid(rank - slot[0]),
                                    slot[0], slot[1], engine_url, packed, "shm"))
            reply = self.recv()
            if not (isinstance(reply, wire.Error) and reply.code == wire.RANK_HELD
                    and time.monotonic() < deadline):
                return reply
            time.sleep(0.2)


def shm_chunks(names_tensors, packed: bool, rank: int):
    """Export ``[(name, tensor)]`` into one shared-memory segment; returns ``(segment,
    Chunk field dict without update_id/index)`` for hand-built wire messages."""
    from slotsync.protocol.rank.export import ShmSegment, pack_into

    total = sum(t.numel() * t.element_size() for _, t in names_tensors)
    seg = ShmSegment(total, rank=rank)
    layout = pack_into(seg.tensor, names_tensors)
    if packed:
        handles = [seg.handle(0, total)]
    else:
        handles, off = [], 0
        for n in layout.tensor_sizes:
            handles.append(seg.handle(off, n))
            off += n
    return seg, dict(names=layout.names, dtype_names=layout.dtype_names, shapes=layout.shapes,
                     tensor_sizes=layout.tensor_sizes, handles=handles)

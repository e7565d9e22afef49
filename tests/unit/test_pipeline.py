"""The copy pipeline's ordering rules (``protocol/rank/pipeline.py``) without a socket: a fake
channel stands in for the daemon, shared-memory staging for the GPU. Each test fails if the
order of copies, sends and ack waits breaks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slotsync.protocol import wire
from slotsync.protocol.rank.chunk_export import ChunkExporter
from slotsync.protocol.rank.pipeline import ChunkPipeline
from slotsync.protocol.rank.session import MAX_UNACKED_CHUNKS, Awaited, PublisherSession
from slotsync.protocol.rank.staging import StagingBuffer
from slotsync.protocol.topology import EngineSlot

NEXT = 3
Event = tuple[str, int]


class FakeChannel:
    """The daemon as the pipeline sees it. ``prompt``: a chunk's ack has arrived by the next
    ``drain`` after it was sent; else acks come only when awaited."""

    def __init__(self, session: PublisherSession, events: list[Event], prompt: bool) -> None:
        self.session, self.events, self.prompt = session, events, prompt
        self.arrived: list[int] = []

    def send(self, msg: wire.ToDaemon | wire.OutgoingChunk) -> None:
        assert isinstance(msg, wire.OutgoingChunk)
        assert msg.update_id == NEXT
        self.events.append(("send", msg.index))
        if self.prompt:
            self.arrived.append(msg.index)

    def drain(self) -> None:
        for index in self.arrived:
            self.session.receive(wire.Ack(update_id=NEXT, phase="chunk", index=index))
        self.arrived.clear()

    def wait(self, awaited: Awaited) -> wire.FromDaemon:
        assert awaited.phase == "chunk" and awaited.update_id == NEXT
        self.events.append(("wait", awaited.index))
        return wire.Ack(update_id=NEXT, phase="chunk", index=awaited.index)


def _pipeline(exporters: list[ChunkExporter], packed: bool, regions: int, prompt: bool,
              monkeypatch: pytest.MonkeyPatch) -> tuple[ChunkPipeline, list[Event]]:
    """A pipeline of one open update (id ``NEXT``), 64-byte staging regions (one tensor per
    chunk), tracing layouts, copies, sends, ack waits and the begin's settling."""
    session = PublisherSession(0, EngineSlot(0, 1))
    session.registration(wire.Registered(protocol_version=wire.PROTOCOL_VERSION, rank=0,
                                         slot_start=0, slot_size=1, next_update_id=NEXT))
    session.begin("v")
    exporter = ChunkExporter("shm", torch.device("cpu"), 0, 64, regions)
    exporters.append(exporter)
    if packed:
        exporter.allocate()
    events: list[Event] = []
    plan, launch = StagingBuffer.plan, StagingBuffer.launch

    def traced_plan(self: Any, items: Any, *a: Any, **kw: Any) -> Any:
        events.append(("plan", _index(items[0][0])))
        return plan(self, items, *a, **kw)

    def traced_launch(self: Any, p: Any, region: int = 0) -> None:
        k = _index(p.layout.names[0])
        # design.md I3: a region is refilled only once its previous chunk was acknowledged
        assert region == k % regions
        assert k < regions or (k - regions not in session.unacked
                               and ("send", k - regions) in events), (k, events)
        events.append(("launch", k))
        launch(self, p, region)

    def await_begin() -> None:
        if session.begin_due():
            events.append(("begin settled", -1))
            session.begin_settled()

    monkeypatch.setattr(StagingBuffer, "plan", traced_plan)
    monkeypatch.setattr(StagingBuffer, "launch", traced_launch)
    channel = FakeChannel(session, events, prompt)
    return ChunkPipeline(session, exporter, packed, channel, await_begin, 0), events


def _index(name: str) -> int:
    return int(name.split(".")[1])


def _tensors(n: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"t.{i}.w", torch.full((16,), float(i))) for i in range(n)]


def _publish(pipe: ChunkPipeline, n: int, ahead: int) -> None:
    """What ``Publisher.publish`` does with the pipeline: every chunk pipelined, then the
    commit's ``send_pending`` and ``wait_unacked(0)``."""
    for name, t in _tensors(n):
        pipe.send_chunk([(name, t)], ahead, [t.numel() * 4], pipelined=True)
    pipe.send_pending()
    pipe.wait_unacked(0)


HEAD = [("plan", 0), ("launch", 0), ("plan", 1)]


@pytest.mark.parametrize(("regions", "prompt", "expected"), [
    # every region free: each copy is queued before the previous chunk is sent
    (4, True, HEAD + [("launch", 1), ("send", 0), ("plan", 2), ("launch", 2), ("send", 1),
                      ("send", 2)]),
    # chunk 2 reuses chunk 0's region, whose ack arrived: still queued first
    (2, True, HEAD + [("launch", 1), ("send", 0), ("plan", 2), ("launch", 2), ("send", 1),
                      ("send", 2)]),
    # chunk 0's ack is late: chunk 1 goes out, then the ack is awaited, then the copy
    (2, False, HEAD + [("launch", 1), ("send", 0), ("plan", 2), ("send", 1),
                       ("begin settled", -1), ("wait", 0), ("launch", 2), ("send", 2),
                       ("wait", 1), ("wait", 2)]),
    # one region: send, the ack, then the next copy
    (1, False, HEAD + [("send", 0), ("begin settled", -1), ("wait", 0), ("launch", 1),
                       ("plan", 2), ("send", 1), ("wait", 1), ("launch", 2), ("send", 2),
                       ("wait", 2)]),
], ids=["4 regions", "2 regions, acks prompt", "2 regions, acks late", "1 region"])
def test_packed_copy_send_ack_order(exporters: list[ChunkExporter],
                                    monkeypatch: pytest.MonkeyPatch, regions: int,
                                    prompt: bool, expected: list[Event]) -> None:
    """Chunk k's copy is launched and chunk k+1 laid out before chunk k is sent; chunk k+1's
    copy is queued before chunk k's send only when its region is already free."""
    pipe, events = _pipeline(exporters, True, regions, prompt, monkeypatch)
    _publish(pipe, 3, regions - 1)
    if prompt:  # (the acks were taken without waiting)
        events[:] = [e for e in events if e[0] not in ("wait", "begin settled")]
    assert events == expected
    assert pipe.pending is None and not pipe.session.unacked


def test_not_pipelined_chunk_is_laid_out_copied_and_sent_at_once(
        exporters: list[ChunkExporter], monkeypatch: pytest.MonkeyPatch) -> None:
    """``send_chunk``: no chunk is left pending for the next call."""
    pipe, events = _pipeline(exporters, True, 4, False, monkeypatch)
    pipe.send_chunk(_tensors(1), max_unacked=0)
    assert events == [("plan", 0), ("launch", 0), ("send", 0)]
    assert pipe.pending is None
    pipe.wait_unacked(0)
    assert events[3:] == [("begin settled", -1), ("wait", 0)]


def test_the_begin_is_settled_before_any_chunk_ack_is_awaited(
        exporters: list[ChunkExporter], monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, events = _pipeline(exporters, False, 1, False, monkeypatch)
    _publish(pipe, 4, MAX_UNACKED_CHUNKS - 1)
    first_wait = next(i for i, e in enumerate(events) if e[0] == "wait")
    assert ("begin settled", -1) in events[:first_wait]


def test_unpacked_keeps_at_most_max_unacked_chunks_in_flight(
        exporters: list[ChunkExporter], monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpacked, chunk k is sent once at most ``MAX_UNACKED_CHUNKS - 1`` earlier chunks are
    unacknowledged (``publish``'s ``ahead``); the oldest ack is awaited first."""
    pipe, events = _pipeline(exporters, False, 1, False, monkeypatch)
    _publish(pipe, 4, MAX_UNACKED_CHUNKS - 1)
    events[:] = [e for e in events if e[0] != "begin settled"]
    assert events == [("send", 0), ("send", 1), ("wait", 0), ("send", 2), ("wait", 1),
                      ("send", 3), ("wait", 2), ("wait", 3)]


def test_a_chunk_needs_a_tensor_and_distinct_names(
        exporters: list[ChunkExporter], monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, _ = _pipeline(exporters, True, 2, True, monkeypatch)
    with pytest.raises(ValueError, match="at least one tensor"):
        pipe.send_chunk([], 0)
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="duplicate tensor names"):
        pipe.send_chunk([("a", t), ("a", t)], 0)

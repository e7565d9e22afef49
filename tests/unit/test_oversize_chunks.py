"""A tensor larger than a staging region (issue 17 C), at the pipeline and exporter level: a
fake channel stands in for the daemon (as in tests/unit/test_pipeline.py).

* shm: the oversize chunk's handle is a segment of its own holding exactly the tensor's bytes,
  unlinked once the chunk is acknowledged, and also when the update fails before that;
* CUDA (its calls faked on CPU): the handle exports the tensor's own memory (no staging
  copy), and the first staging chunk after an oversize chunk carries a fresh export, so that
  vLLM's own one-slot importer (``packed_tensor.PackedBufferImporter``) rebuilds -- and so
  releases -- every export exactly once (the rule in ``staging.CudaStagingBuffer``);
* ``inputs.checked`` has no size limit any more.
"""

from __future__ import annotations

import glob
import itertools
import os
from typing import Any

import msgspec
import pytest
import torch

from slotsync.protocol import wire
from slotsync.protocol.rank import chunk_export, inputs, staging
from slotsync.protocol.rank.chunk_export import ChunkExporter
from slotsync.protocol.rank.pipeline import ChunkPipeline
from slotsync.protocol.rank.session import Awaited, PublisherSession
from slotsync.protocol.rank.staging import CudaStagingBuffer, StagingBuffer
from slotsync.protocol.topology import EngineSlot

NEXT = 5
CAPACITY = 64  # bytes per staging region: a (16,) float32 tensor fills one


class Channel:
    """The daemon as the pipeline sees it: records every chunk; acks come when awaited, or
    never (``ack=False``: the update is left to fail)."""

    def __init__(self, ack: bool = True) -> None:
        self.ack = ack
        self.chunks: list[wire.OutgoingChunk] = []

    def send(self, msg: wire.ToDaemon | wire.OutgoingChunk) -> None:
        assert isinstance(msg, wire.OutgoingChunk)
        self.chunks.append(msg)

    def drain(self) -> None:
        pass

    def wait(self, awaited: Awaited) -> wire.FromDaemon:
        assert self.ack, "this test's daemon never acknowledges"
        return wire.Ack(update_id=NEXT, phase="chunk", index=awaited.index)


def _pipeline(exporters: list[ChunkExporter], regions: int, channel: Channel,
              transport: str = "shm") -> ChunkPipeline:
    session = PublisherSession(0, EngineSlot(0, 1))
    session.registration(wire.Registered(protocol_version=wire.PROTOCOL_VERSION, rank=0,
                                         slot_start=0, slot_size=1, next_update_id=NEXT))
    session.begin("v")
    exporter = ChunkExporter(transport, torch.device("cpu"), 0, CAPACITY, regions)
    exporters.append(exporter)

    def await_begin() -> None:
        if session.begin_due():
            session.begin_settled()

    return ChunkPipeline(session, exporter, True, channel, await_begin, 0)


def _small(i: int) -> tuple[str, torch.Tensor]:
    return f"small.{i}", torch.full((16,), float(i))  # 64 bytes: fits a region


def _big() -> tuple[str, torch.Tensor]:
    return "big", torch.arange(100, dtype=torch.bfloat16).reshape(4, 25)  # 200 bytes


def _segments() -> list[str]:
    return glob.glob(f"/dev/shm/slotsync-{os.getpid()}-*")


def _read(h: wire.ShmHandle) -> bytes:
    with open(f"/dev/shm/{h.segment}", "rb") as f:
        f.seek(h.offset)
        return f.read(h.nbytes)


def _send(pipe: ChunkPipeline, items: list[tuple[str, torch.Tensor]], regions: int) -> None:
    """What ``Publisher.publish`` does: one chunk per item (pipelined), then the commit's
    ``send_pending`` and ``wait_unacked(0)``."""
    for name, t in items:
        pipe.send_chunk([(name, t)], regions - 1, [t.numel() * t.element_size()],
                        pipelined=True)
    pipe.send_pending()
    pipe.wait_unacked(0)


@pytest.mark.parametrize("regions", [1, 4])
def test_shm_oversize_chunk_is_its_own_segment_unlinked_at_its_ack(
        exporters: list[ChunkExporter], regions: int) -> None:
    channel = Channel()
    pipe = _pipeline(exporters, regions, channel)
    pipe.exporter.allocate()
    staging_segment = pipe.exporter.staging().segment.name  # type: ignore[attr-defined]
    name, big = _big()
    before = set(_segments())
    pipe.send_chunk([_small(0)], regions - 1, [64], pipelined=True)
    pipe.send_chunk([(name, big)], regions - 1, [200], pipelined=True)
    # sent (the pending chunk 0 went first), not yet acknowledged: its segment is there
    assert [c.index for c in channel.chunks] == [0, 1]
    c = channel.chunks[1]
    assert (c.names, c.dtype_names, c.shapes, c.tensor_sizes) == (
        ["big"], ["bfloat16"], [[4, 25]], [200])
    (h,) = c.handles
    assert isinstance(h, wire.ShmHandle)
    assert h.segment != staging_segment and (h.offset, h.nbytes) == (0, 200)
    assert _read(h) == big.view(torch.uint8).numpy().tobytes()
    assert set(_segments()) - before == {f"/dev/shm/{h.segment}"}
    pipe.send_chunk([_small(2)], regions - 1, [64], pipelined=True)
    pipe.send_pending()
    pipe.wait_unacked(0)
    assert pipe.exporter.ledger.held == 0
    assert set(_segments()) == before  # unlinked at its ack; the staging segment stays
    assert channel.chunks[2].handles[0].segment == staging_segment


def test_shm_oversize_segment_unlinked_when_the_update_fails(
        exporters: list[ChunkExporter]) -> None:
    channel = Channel(ack=False)
    pipe = _pipeline(exporters, 4, channel)
    pipe.exporter.allocate()
    before = set(_segments())
    name, big = _big()
    pipe.send_chunk([(name, big)], 3, [200], pipelined=True)
    assert len(set(_segments()) - before) == 1 and pipe.exporter.ledger.held == 1
    pipe.exporter.end_update(False, pipe.session.end())  # the update failed: no ack came
    assert set(_segments()) == before and pipe.exporter.ledger.held == 0


def test_shm_oversize_segment_unlinked_when_the_copy_fails(
        exporters: list[ChunkExporter], monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure between creating the segment and sending it (here: the copy) leaves the
    segment to the ledger, which unlinks it when the update ends (design.md I3)."""
    pipe = _pipeline(exporters, 1, Channel())
    pipe.exporter.allocate()
    before = set(_segments())
    monkeypatch.setattr(chunk_export, "raw_bytes", _NotCopyable)
    with pytest.raises(TypeError):
        pipe.send_chunk([_big()], 0, [200], pipelined=True)
    assert len(set(_segments()) - before) == 1
    pipe.exporter.end_update(False, pipe.session.end())
    assert set(_segments()) == before


class _NotCopyable:
    """Stands in for ``raw_bytes(t)``: the right size, but copying it raises (TypeError)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._n = t.numel() * t.element_size()

    def numel(self) -> int:
        return self._n


def test_unpacked_has_no_size_limit() -> None:
    """``inputs.checked`` lets any size through (it took a limit and refused larger tensors,
    saying "raise staging_bytes")."""
    big = torch.zeros(1 << 16)
    assert [(n, b) for n, _, b in inputs.checked([("big", big)])] == [("big", 1 << 18)]


# -- CUDA, its calls faked on CPU ----------------------------------------------------------


class FakeCuda:
    """``cuda_ipc_handle`` on CPU: each call is one export (``reduce_tensor``) with a new
    ref-counter slot, remembering which memory it covers."""

    def __init__(self) -> None:
        self.counter = itertools.count(1)
        self.covers: dict[int, tuple[int, int]] = {}  # ref-counter offset -> (address, bytes)

    def handle(self, t: torch.Tensor) -> wire.CudaIpcHandle:
        slot = next(self.counter)
        n = t.numel() * t.element_size()
        self.covers[slot] = (t.data_ptr(), n)
        block = t.untyped_storage().data_ptr().to_bytes(8, "little") * 8 + b"\0\0"
        return wire.CudaIpcHandle("torch.Tensor", (t.numel(),), (1,), t.storage_offset(),
                                  "torch.storage.TypedStorage", "uint8", 0, block,
                                  t.untyped_storage().nbytes(), 0, False, b"/torch_1", slot,
                                  b"\x09" * 64, True)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(chunk_export, "cuda_ipc_handle", fake.handle)
    monkeypatch.setattr(staging, "cuda_ipc_handle", fake.handle)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    # the staging block on CPU, its copies done at once
    monkeypatch.setattr(CudaStagingBuffer, "launch", StagingBuffer.launch)
    monkeypatch.setattr(CudaStagingBuffer, "ready", lambda self, region=None: None)
    monkeypatch.setattr(CudaStagingBuffer, "copied", lambda self, region=None: True)
    return fake


def _cuda_pipeline(exporters: list[ChunkExporter], regions: int,
                   channel: Channel) -> ChunkPipeline:
    pipe = _pipeline(exporters, regions, channel, transport="shm")
    buf = CudaStagingBuffer(CAPACITY, "cuda:0", regions)
    buf._tensor = torch.empty(CAPACITY * regions, dtype=torch.uint8)  # (CPU stand-in)
    pipe.exporter._staging = buf
    pipe.exporter.transport = "cuda"
    return pipe


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
def test_cuda_oversize_chunk_exports_the_tensors_own_bytes(
        exporters: list[ChunkExporter], fake_cuda: FakeCuda, contiguous: bool) -> None:
    channel = Channel()
    pipe = _cuda_pipeline(exporters, 1, channel)
    name, big = _big()
    if not contiguous:
        big = big.t()  # needs a contiguous copy first (raw_bytes)
    pipe.send_chunk([(name, big)], 0, [200], pipelined=True)
    (c,) = channel.chunks
    (h,) = c.handles
    assert isinstance(h, wire.CudaIpcHandle) and h.dtype == "uint8" and h.size == (200,)
    address, n = fake_cuda.covers[h.ref_counter_offset]
    assert n == 200 == sum(c.tensor_sizes)
    staging_block = pipe.exporter.staging().tensor.data_ptr()
    assert address != staging_block  # never a staging copy
    if contiguous:
        assert address == big.data_ptr()  # the tensor's own memory
    assert pipe.exporter.ledger.held == 1  # held until the ack
    pipe.wait_unacked(0)
    assert pipe.exporter.ledger.held == 0


class ImporterModel:
    """vLLM 0.33's consumer, run on the handles the pipeline sent: its own
    ``PackedBufferImporter`` (one slot keyed by the handle's args) with
    ``rebuild_cuda_tensor`` counting the rebuilds of each export (ref-counter slot). torch
    pairs one release with one rebuild, so an export rebuilt twice is released twice."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from torch.multiprocessing import reductions
        from vllm.distributed.weight_transfer.packed_tensor import PackedBufferImporter

        self.rebuilds: dict[int, int] = {}

        def rebuild(*args: Any) -> torch.Tensor:
            slot = args[12]  # ref_counter_offset
            self.rebuilds[slot] = self.rebuilds.get(slot, 0) + 1
            return torch.empty(0)

        monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
        self.importer = PackedBufferImporter()

    def consume(self, chunks: list[wire.OutgoingChunk]) -> None:
        for c in chunks:
            args = list(msgspec.structs.astuple(c.handles[0]))
            args[6] = 0  # (packed_ipc_consumer: list_args[6] = device_index)
            self.importer.rebuild(args)
        self.importer.close()  # finish_weight_update


@pytest.mark.vllm
@pytest.mark.parametrize("regions", [1, 2, 4])
def test_staging_chunk_after_an_oversize_chunk_carries_a_fresh_export(
        exporters: list[ChunkExporter], fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch,
        regions: int) -> None:
    """small, small, BIG, small, small, BIG, BIG, small: every export is rebuilt exactly once
    by vLLM's importer. With one region, the chunks before an oversize chunk share one export
    (vLLM's producer) and the first one after it carries a new one; without that rule the
    old export would be rebuilt (and released) a second time."""
    channel = Channel()
    pipe = _cuda_pipeline(exporters, regions, channel)
    name, big = _big()
    seq = [_small(0), _small(1), (name, big), _small(3), _small(4), ("big2", big.clone()),
           ("big3", big.clone()), _small(7)]
    _send(pipe, seq, regions)
    slots = [c.handles[0].ref_counter_offset for c in channel.chunks]  # type: ignore[union-attr]
    if regions == 1:
        assert slots[0] == slots[1] and slots[3] == slots[4]  # vLLM's producer: one export
        assert len({slots[0], slots[2], slots[3], slots[5], slots[6], slots[7]}) == 6
    else:
        assert len(set(slots)) == len(slots)  # a fresh export per chunk
    model = ImporterModel(monkeypatch)
    model.consume(channel.chunks)
    assert set(model.rebuilds) == set(slots)
    assert all(n == 1 for n in model.rebuilds.values()), model.rebuilds


@pytest.mark.vllm
def test_without_the_fresh_export_rule_vllms_importer_rebuilds_an_export_twice(
        exporters: list[ChunkExporter], fake_cuda: FakeCuda,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure the rule prevents, shown with vLLM's importer: one region, the update's
    one export sent again after an oversize chunk is rebuilt twice (two releases)."""
    monkeypatch.setattr(CudaStagingBuffer, "after_oversize", lambda self: None)
    channel = Channel()
    pipe = _cuda_pipeline(exporters, 1, channel)
    _send(pipe, [_small(0), _big(), _small(2)], 1)
    model = ImporterModel(monkeypatch)
    model.consume(channel.chunks)
    assert sorted(model.rebuilds.values()) == [1, 2]

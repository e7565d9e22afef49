"""``Publisher.publish_adapter`` with FSDP2 DTensors (issue 36 A): each of 3 Gloo ranks of one
engine slot sends its ``Shard(0)`` rows, and the parts the daemon receives tile every tensor
and carry its bytes (uneven shards, a rank with no rows of a tensor leaving it out); other
placements, and a mesh that is not the slot's ranks, are refused naming the tensor.

The ranks are spawned as in test_fsdp_pack.py (``tests/gloo_ranks.py``); a ROUTER in this
process (``tests/router_thread.py``) answers them as a daemon would, remembering which rank
sent what.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import pytest
from router_thread import RouterThread, read_shm

from slotsync.protocol import wire

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

from gloo_ranks import WORLD, full_alike, sharded, spawn_ranks  # noqa: E402

ENGINE = "http://127.0.0.1:8000"
CONFIG = {"r": 2, "target_modules": ["q_proj"]}
SPECS = [  # (name, shape, dtype): Shard(0) over 3 ranks
    ("base_model.model.l0.q_proj.lora_A.weight", (5, 3), torch.float32),   # 2 + 2 + 1 rows
    ("base_model.model.l0.q_proj.lora_B.weight", (1, 7), torch.bfloat16),  # 1 + 0 + 0
    ("base_model.model.l1.q_proj.lora_A.weight", (4, 5), torch.float16),   # 2 + 2 + 0
    ("base_model.model.l1.q_proj.lora_B.weight", (9, 2), torch.bfloat16),  # 3 + 3 + 3
]


def _fulls() -> dict[str, Any]:
    return {name: full_alike(shape, dtype, seed=200 + i)
            for i, (name, shape, dtype) in enumerate(SPECS)}


class RankedDaemon(RouterThread):
    """A ROUTER that registers ranks, acks their adapter messages ('host') and keeps each
    rank's begin and the bytes of its part (read while the rank holds them)."""

    def __init__(self, endpoint: str) -> None:
        self.begins: dict[int, wire.AdapterBegin] = {}
        self.parts: dict[int, bytes] = {}
        self._rank_of: dict[bytes, int] = {}
        super().__init__(endpoint)

    def answer(self, ident: bytes, msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Register):
            self._rank_of[ident] = msg.rank
            return [wire.Registered(rank=msg.rank, slot_start=msg.slot_start,
                                    slot_size=msg.slot_size, next_update_id=1)]
        if isinstance(msg, wire.AdapterBegin):
            self.begins[self._rank_of[ident]] = msg
            return [wire.Ack(update_id=msg.update_id, phase="adapter_begin", transport="host")]
        if isinstance(msg, wire.AdapterData):
            if isinstance(msg.handle, wire.ShmHandle):
                self.parts[self._rank_of[ident]] = read_shm(msg.handle)
            return [wire.Ack(update_id=msg.update_id, phase="adapter_data",
                             served_name="math@v1")]
        return []


def _refusal(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "not refused"


def _publish_shards(endpoint: str, rank: int) -> dict[str, Any]:
    """One Gloo rank: publish its Shard(0) rows; try the layouts that are refused."""
    from torch.distributed.tensor import Replicate, Shard, init_device_mesh

    from slotsync.protocol.rank.publisher import Publisher

    mesh = init_device_mesh("cpu", (WORLD,))
    fulls = _fulls()
    tensors = {name: sharded(full, mesh, Shard(0)) for name, full in fulls.items()}
    out: dict[str, Any] = {}
    with Publisher(endpoint, rank, (0, WORLD), ENGINE, transport="shm", timeout_s=60) as pub:
        stats = pub.publish_adapter("math", tensors, CONFIG, 1)
        out["served"], out["tensors"] = stats.served_name, stats.tensors
        name, full = next(iter(fulls.items()))
        for key, placement in (("replicate", Replicate()), ("shard1", Shard(1))):
            bad = {name: sharded(full, mesh, placement)}
            out[key] = _refusal(lambda bad=bad: pub.publish_adapter("math", bad, CONFIG, 2))
        out["rows_for_dtensor"] = _refusal(lambda: pub.publish_adapter(
            "math", {name: tensors[name]}, CONFIG, 2, rows={name: (0, (5, 3))}))
    if rank == 0:  # (a slot of rank 0 alone: the mesh spans ranks 0-2)
        with Publisher(endpoint, 0, (0, 1), ENGINE, transport="shm", timeout_s=60) as pub:
            out["mesh_not_slot"] = _refusal(lambda: pub.publish_adapter(
                "math", {name: tensors[name]}, CONFIG, 2))
    return out


def test_fsdp2_shards_tile_every_tensor_and_other_layouts_are_refused(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"
    daemon = RankedDaemon(endpoint)
    try:
        results = spawn_ranks(functools.partial(_publish_shards, endpoint))
    finally:
        daemon.close()
    assert [r["served"] for r in results] == ["math@v1"] * WORLD
    assert [r["tensors"] for r in results] == [4, 3, 2]  # (empty shards left out)
    assert sorted(daemon.begins) == list(range(WORLD))
    for name, full in _fulls().items():
        raw = full.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        row_bytes = len(raw) // full.shape[0]
        held = []
        for rank, begin in daemon.begins.items():
            offsets, _ = wire.part_offsets(begin.tensors)
            for t, off in zip(begin.tensors, offsets, strict=True):
                if t.name == name:
                    got = daemon.parts[rank][off : off + t.nbytes]
                    assert t.shape == list(full.shape) and t.dtype == str(full.dtype)[6:]
                    assert t.sha256 == hashlib.sha256(got).hexdigest(), (name, rank)
                    held.append((t.row_start, t.row_stop, got))
        held.sort()
        rows = [(a, b) for a, b, _ in held]
        assert rows[0][0] == 0 and rows[-1][1] == full.shape[0], (name, rows)
        assert all(rows[i][1] == rows[i + 1][0] for i in range(len(rows) - 1)), (name, rows)
        assert b"".join(g for *_, g in held) == raw, name
        assert all(len(g) == (b - a) * row_bytes for a, b, g in held)
    for r in results:
        assert "placements (Replicate(),)" in r["replicate"] and "to_local()" in r["replicate"]
        assert "placements (Shard(dim=1),)" in r["shard1"], r["shard1"]
        assert "FSDP2's (Shard(0),) on a 1-D mesh" in r["shard1"]
        assert "is a DTensor, which says its own rows" in r["rows_for_dtensor"]
    assert "is sharded over ranks [0, 1, 2], but this rank's engine slot" in \
        results[0]["mesh_not_slot"]

"""Engine-slot topology: coordinators, node locality, ranks outside every slot."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotsync.protocol.topology import EngineSlot, SlotTopology, TopologyError


def test_engine_slot_basics() -> None:
    s = EngineSlot(8, 4)
    assert (s.start, s.end, s.count) == (8, 12, 4)
    assert list(s.ranks) == [8, 9, 10, 11]
    assert s.coordinator == 8
    assert 8 in s and 11 in s and 12 not in s and 7 not in s
    assert str(s) == "[8, 12)"


@pytest.mark.parametrize("start,count", [(0, 0), (0, -2), (-1, 2)])
def test_engine_slot_rejects_bad_values(start: int, count: int) -> None:
    with pytest.raises(TopologyError):
        EngineSlot(start, count)


def test_tp4_cp2_ep8_one_engine_of_8_has_one_coordinator() -> None:
    """design.md's example: trainer TP=4, CP=2, DP=1, EP=8 on 8 GPUs, one 8-GPU engine."""
    topo = SlotTopology(world_size=8, gpus_per_node=8, engines=[(0, 8)])
    assert topo.slots == (EngineSlot(0, 8),)
    assert all(topo.slot_of(r) == EngineSlot(0, 8) for r in range(8))
    coordinators = [r for r in range(8) if topo.is_coordinator(r)]
    assert coordinators == [0]
    # Rank 4 is TP rank 0 of the second TP group (TP ranks are 0,1,2,3,0,1,2,3) but is not
    # the slot's coordinator; "TP rank 0" would have picked two ranks in one slot.
    tp = 4
    assert 4 % tp == 0 and not topo.is_coordinator(4)
    tp_rank0 = [r for r in range(8) if r % tp == 0]
    assert tp_rank0 == [0, 4]
    assert len({topo.slot_of(r) for r in tp_rank0}) == 1  # both in the same slot


def test_four_engines_of_two() -> None:
    topo = SlotTopology(world_size=8, gpus_per_node=8, gpus_per_engine=2)
    assert [str(s) for s in topo.slots] == ["[0, 2)", "[2, 4)", "[4, 6)", "[6, 8)"]
    assert [r for r in range(8) if topo.is_coordinator(r)] == [0, 2, 4, 6]
    assert topo.coordinators == (0, 2, 4, 6)
    assert topo.slot_of(5) == EngineSlot(4, 2)


def test_two_nodes_engines_of_eight() -> None:
    topo = SlotTopology(world_size=16, gpus_per_node=8, gpus_per_engine=8)
    assert topo.slots == (EngineSlot(0, 8), EngineSlot(8, 8))
    assert [r for r in range(16) if topo.is_coordinator(r)] == [0, 8]
    assert topo.node_of(7) == 0 and topo.node_of(8) == 1
    assert topo.slot_of(15) == EngineSlot(8, 8)


def test_explicit_engines_equal_dense_default() -> None:
    dense = SlotTopology(16, 8, gpus_per_engine=8)
    explicit = SlotTopology(16, 8, engines=[(8, 8), (0, 8)])  # any order; stored sorted
    assert dense.slots == explicit.slots


def test_an_engine_over_two_nodes_is_one_slot_with_a_part_on_each() -> None:
    """docs/multi-node.md's engine: TP=16 over two 8-GPU nodes is one slot [0, 16), its
    coordinator rank 0, ranks 0-7 on node 0 and 8-15 on node 1 (the engine table's nodes)."""
    topo = SlotTopology(16, 8, gpus_per_engine=16)
    assert topo.slots == (EngineSlot(0, 16),)
    assert topo.coordinators == (0,)
    assert topo.slot_of(12) == EngineSlot(0, 16) and topo.node_of(12) == 1
    assert topo.node_parts(topo.slots[0]) == [(0, 0, 8), (1, 8, 16)]
    # DP replicas of TP=16 over four nodes: two slots of two whole nodes each
    dp = SlotTopology(32, 8, gpus_per_engine=16)
    assert [dp.node_parts(s) for s in dp.slots] == [[(0, 0, 8), (1, 8, 16)],
                                                    [(2, 16, 24), (3, 24, 32)]]
    # four workers on each of two nodes (vLLM --nnodes 2 with 4 visible GPUs each)
    half = SlotTopology(16, 8, engines=[(0, 4), (4, 8), (12, 4)])
    assert half.node_parts((4, 8)) == [(0, 4, 8), (1, 8, 12)]
    assert half.node_parts(EngineSlot(0, 4)) == [(0, 0, 4)]


@pytest.mark.parametrize("engines,text", [
    ([(4, 10)], r"\[4, 14\) covers nodes 0\.\.1 with unequal numbers of ranks \(node 0: 4, "
                r"node 1: 6"),
    ([(4, 16)], r"\[4, 20\) covers nodes 0\.\.2 .*node 0: 4, node 1: 8, node 2: 4"),
])
def test_a_slot_over_nodes_with_unequal_parts_is_refused(engines, text) -> None:
    """vLLM and SGLang --nnodes N run world_size / N workers on each node: a slot that puts
    another number of ranks on one of its nodes matches no engine."""
    with pytest.raises(TopologyError, match=text + r".*same number of workers on each"):
        SlotTopology(world_size=24, gpus_per_node=8, engines=engines)


def test_rank_outside_every_slot() -> None:
    topo = SlotTopology(world_size=8, gpus_per_node=8, engines=[(0, 4)])
    assert topo.slot_of(3) == EngineSlot(0, 4)
    with pytest.raises(TopologyError, match=r"rank 5 is outside every engine slot.*\[0, 4\)"):
        topo.slot_of(5)
    with pytest.raises(TopologyError, match="rank 5"):
        topo.is_coordinator(5)
    assert not topo.has_slot(5)


def test_dense_remainder_ranks_have_no_slot() -> None:
    topo = SlotTopology(world_size=8, gpus_per_node=8, gpus_per_engine=3)
    assert [str(s) for s in topo.slots] == ["[0, 3)", "[3, 6)"]
    with pytest.raises(TopologyError, match="rank 7"):
        topo.slot_of(7)


def test_rank_outside_world() -> None:
    topo = SlotTopology(8, 8, gpus_per_engine=8)
    for bad in (-1, 8):
        with pytest.raises(TopologyError, match=f"rank {bad} is outside the world"):
            topo.slot_of(bad)


def test_overlapping_slots_rejected() -> None:
    with pytest.raises(TopologyError, match=r"\[0, 4\) and \[2, 6\) overlap"):
        SlotTopology(8, 8, engines=[(0, 4), (2, 4)])


def test_slot_beyond_world_rejected() -> None:
    with pytest.raises(TopologyError, match=r"\[4, 12\) reaches past the world size 8"):
        SlotTopology(8, 16, engines=[(4, 8)])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(world_size=0, gpus_per_node=8, gpus_per_engine=1),
        dict(world_size=8, gpus_per_node=0, gpus_per_engine=1),
        dict(world_size=8, gpus_per_node=8, gpus_per_engine=0),
        dict(world_size=8, gpus_per_node=8, engines=[(0, 0)]),
        dict(world_size=8, gpus_per_node=8),  # neither engines nor gpus_per_engine
        dict(world_size=8, gpus_per_node=8, engines=[(0, 8)], gpus_per_engine=8),  # both
    ],
)
def test_bad_arguments_rejected(kwargs: dict) -> None:
    with pytest.raises(TopologyError):
        SlotTopology(**kwargs)


def test_topology_error_is_value_error() -> None:
    assert issubclass(TopologyError, ValueError)


def test_wire_and_topology_do_not_import_torch() -> None:
    code = (
        "import sys, slotsync.protocol, slotsync.protocol.wire, slotsync.protocol.topology;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@st.composite
def dense_layouts(draw: st.DrawFn) -> tuple[int, int, int]:
    per_engine = draw(st.integers(1, 8))
    engines_per_node = draw(st.integers(1, 4))
    gpus_per_node = per_engine * engines_per_node
    nodes = draw(st.integers(1, 4))
    return nodes * gpus_per_node, gpus_per_node, per_engine


@given(dense_layouts())
def test_dense_every_rank_in_exactly_one_slot(layout: tuple[int, int, int]) -> None:
    world, per_node, per_engine = layout
    topo = SlotTopology(world, per_node, gpus_per_engine=per_engine)
    for r in range(world):
        holding = [s for s in topo.slots if r in s]
        assert holding == [topo.slot_of(r)]
        slot = holding[0]
        assert slot.coordinator == min(slot.ranks)
        assert topo.is_coordinator(r) == (r == min(slot.ranks))
        assert topo.node_of(slot.start) == topo.node_of(slot.end - 1)
    assert sum(s.count for s in topo.slots) == world
    assert len(topo.coordinators) == len(topo.slots) == world // per_engine

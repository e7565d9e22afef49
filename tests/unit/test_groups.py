"""Per-slot Gloo groups: created collectively by every rank, in the same order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slotsync.protocol.rank.groups import new_slot_groups
from slotsync.protocol.topology import SlotTopology

WORLD = 4


def _worker(rank: int, init_file: str, result_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    try:
        topo = SlotTopology(WORLD, gpus_per_node=WORLD, gpus_per_engine=2)
        group = new_slot_groups(topo, rank)
        assert group is not None
        dist.barrier(group=group)
        t = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        slot = topo.slot_of(rank)
        Path(result_dir, f"rank{rank}").write_text(
            f"{int(t.item())} {sum(slot.ranks)} {dist.get_world_size(group)}"
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_slot_groups_reduce_over_own_slot_only(tmp_path: Path) -> None:
    from spawned_ranks import rank_context

    rank_context()  # the ranks fork from the warm forkserver (torch imported once, issue 35)
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="forkserver",
    )
    for rank in range(WORLD):
        got, want, size = map(int, (tmp_path / f"rank{rank}").read_text().split())
        assert got == want, f"rank {rank}: all_reduce gave {got}, slot sum is {want}"
        assert size == 2
    # slots [0, 2) and [2, 4): sums 1 and 5


def test_one_rank_slots_get_no_group(tmp_path: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'init1'}", rank=0, world_size=1
    )
    try:
        topo = SlotTopology(1, gpus_per_node=1, gpus_per_engine=1)
        assert new_slot_groups(topo, 0) is None
        with pytest.raises(ValueError, match="topology is for 2 ranks"):
            new_slot_groups(SlotTopology(2, 2, gpus_per_engine=1), 0)
    finally:
        dist.destroy_process_group()

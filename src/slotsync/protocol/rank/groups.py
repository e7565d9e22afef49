"""Trainer-side per-slot process groups (torch.distributed), for a barrier or a reduction over
exactly the ranks that feed one engine (design.md "Topology rules").

``torch.distributed.new_group`` is collective over the default group: every rank must call it
for every group, in the same order, even for groups it is not in. So every rank walks the same
slot list (``SlotTopology.slots``, sorted by start) and creates each multi-rank slot's group;
one-rank slots need no group.
"""

from __future__ import annotations

import torch.distributed as dist

from slotsync.protocol.topology import SlotTopology, TopologyError

__all__ = ["new_slot_groups"]


def new_slot_groups(
    topology: SlotTopology, rank: int, backend: str = "gloo"
) -> dist.ProcessGroup | None:
    """Create every multi-rank slot's process group; return the one of ``rank``'s slot.

    Must be called by every rank of the default process group (it is collective), with the
    same ``topology``.

    Args:
        topology: the job's engine slots; its ``world_size`` must equal the default group's.
        rank: this process's global rank.
        backend: backend of the new groups (``"gloo"`` for CPU barriers).

    Returns:
        The group over ``rank``'s slot, or ``None`` if the slot has one rank or ``rank`` is in
        no slot.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TopologyError: the topology's world size differs from the default group's.
    """
    if not dist.is_initialized():
        raise RuntimeError("new_slot_groups needs torch.distributed initialized first")
    world = dist.get_world_size()
    if world != topology.world_size:
        raise TopologyError(
            f"topology is for {topology.world_size} ranks but the default process group has "
            f"{world}"
        )
    mine: dist.ProcessGroup | None = None
    for slot in topology.slots:
        if slot.count == 1:
            continue
        group = dist.new_group(ranks=list(slot.ranks), backend=backend)
        if rank in slot:
            mine = group
    return mine

"""Engine slots: which trainer ranks feed which vLLM engine, and who coordinates each.

An engine spans a contiguous range of GPUs, its **engine slot** ``[start, end)`` in global-rank
space (one trainer rank per GPU, ranks numbered node by node). The rules (design.md "Topology
rules"):

* slots come from the engines' real layout, a list of ``(offset, count)`` per engine; the dense
  default is ``count = gpus_per_engine``, ``offset = i * count``;
* the **slot coordinator** is the lowest global rank of the slot -- never "TP rank 0" of the
  trainer's layout, which can name several ranks in one slot;
* a slot lies within one node, or covers several nodes with **the same number of ranks on
  each** (an engine over several nodes, docs/multi-node.md): vLLM ``--nnodes N`` runs
  ``world_size / N`` workers on every node (vLLM 0.32 ``ParallelConfig.local_world_size``),
  SGLang 0.5.23 ``--nnodes N`` ``tp_size / N`` (``entrypoints/engine.py``
  ``_calculate_rank_ranges``); with ranks numbered node by node, a slot over three
  nodes or more therefore covers whole nodes. Each rank still publishes to its own node's
  daemon (CUDA IPC handles open only on the node that made them); the engine table lists
  each node's ranks (``node_parts``);
* ranks outside every slot are told so (``slot_of`` raises).

This module is pure Python (no torch): the daemon may import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["EngineSlot", "SlotTopology", "TopologyError"]


class TopologyError(ValueError):
    """An engine layout that breaks a topology rule, or a rank that belongs to no slot."""


@dataclass(frozen=True, order=True)
class EngineSlot:
    """One engine's GPU range ``[start, start + count)`` in global-rank space.

    Attributes:
        start: lowest global rank of the slot (>= 0).
        count: number of ranks (= GPUs = the engine's world size), > 0.

    Raises:
        TopologyError: ``start < 0`` or ``count <= 0``.
    """

    start: int
    count: int

    def __post_init__(self) -> None:
        if self.start < 0:
            raise TopologyError(f"engine slot start must be >= 0, got {self.start}")
        if self.count <= 0:
            raise TopologyError(
                f"engine slot at offset {self.start} must have a positive GPU count, "
                f"got {self.count}"
            )

    @property
    def end(self) -> int:
        """One past the slot's highest rank."""
        return self.start + self.count

    @property
    def ranks(self) -> range:
        """The slot's global ranks, ascending."""
        return range(self.start, self.end)

    @property
    def coordinator(self) -> int:
        """The slot coordinator: the lowest global rank of the slot."""
        return self.start

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and self.start <= rank < self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def _fmt_slots(slots: Iterable[EngineSlot]) -> str:
    return ", ".join(str(s) for s in slots) or "(none)"


def _node_parts(s: EngineSlot, gpus_per_node: int) -> list[tuple[int, int, int]]:
    """``(node, start, end)`` of each node ``s`` covers, ranks numbered node by node."""
    first, last = s.start // gpus_per_node, (s.end - 1) // gpus_per_node
    return [(n, max(s.start, n * gpus_per_node), min(s.end, (n + 1) * gpus_per_node))
            for n in range(first, last + 1)]


class SlotTopology:
    """The engine slots of one training job, validated against the topology rules.

    Args:
        world_size: number of trainer ranks (= GPUs), > 0.
        gpus_per_node: GPUs per node, > 0; rank ``r`` lives on node ``r // gpus_per_node``.
        engines: explicit engine layout, one ``(offset, count)`` pair (or ``EngineSlot``) per
            engine, in any order; stored sorted by offset.
        gpus_per_engine: dense default when ``engines`` is not given: engine ``i`` is
            ``(i * gpus_per_engine, gpus_per_engine)``.
        num_engines: number of dense engines (default ``world_size // gpus_per_engine``);
            ranks past the last engine belong to no slot.

    Raises:
        TopologyError: non-positive sizes or counts; both or neither of ``engines`` and
            ``gpus_per_engine``; slots that overlap, reach past ``world_size``, or cover
            several nodes with unequal numbers of ranks on them. Each message names the
            offending slots.
    """

    def __init__(
        self,
        world_size: int,
        gpus_per_node: int,
        engines: Sequence[tuple[int, int] | EngineSlot] | None = None,
        *,
        gpus_per_engine: int | None = None,
        num_engines: int | None = None,
    ) -> None:
        if world_size <= 0:
            raise TopologyError(f"world_size must be positive, got {world_size}")
        if gpus_per_node <= 0:
            raise TopologyError(f"gpus_per_node must be positive, got {gpus_per_node}")
        if (engines is None) == (gpus_per_engine is None):
            raise TopologyError("give exactly one of engines=[(offset, count), ...] or "
                                "gpus_per_engine=N")
        if engines is None:
            assert gpus_per_engine is not None
            if gpus_per_engine <= 0:
                raise TopologyError(f"gpus_per_engine must be positive, got {gpus_per_engine}")
            n = world_size // gpus_per_engine if num_engines is None else num_engines
            if n < 0:
                raise TopologyError(f"num_engines must be >= 0, got {n}")
            slots = [EngineSlot(i * gpus_per_engine, gpus_per_engine) for i in range(n)]
        else:
            if num_engines is not None:
                raise TopologyError("num_engines applies to the dense default only")
            slots = [e if isinstance(e, EngineSlot) else EngineSlot(*e) for e in engines]
        slots.sort()

        for s in slots:
            if s.end > world_size:
                raise TopologyError(
                    f"engine slot {s} reaches past the world size {world_size} "
                    f"(ranks 0..{world_size - 1})"
                )
            parts = _node_parts(s, gpus_per_node)
            if len({end - start for _, start, end in parts}) > 1:
                split = ", ".join(f"node {n}: {end - start}" for n, start, end in parts)
                raise TopologyError(
                    f"engine slot {s} covers nodes {parts[0][0]}..{parts[-1][0]} with unequal "
                    f"numbers of ranks ({split}; {gpus_per_node} GPUs per node): an engine over "
                    "several nodes runs the same number of workers on each (vLLM and SGLang "
                    "--nnodes N: world size / N per node); align the slot with the nodes"
                )
        for a, b in zip(slots, slots[1:], strict=False):
            if b.start < a.end:
                raise TopologyError(
                    f"engine slots {a} and {b} overlap (ranks {b.start}..{min(a.end, b.end) - 1})"
                )

        self._world_size = world_size
        self._gpus_per_node = gpus_per_node
        self._slots: tuple[EngineSlot, ...] = tuple(slots)
        self._by_rank: dict[int, EngineSlot] = {r: s for s in slots for r in s.ranks}

    @property
    def world_size(self) -> int:
        """Number of trainer ranks."""
        return self._world_size

    @property
    def gpus_per_node(self) -> int:
        """GPUs (= ranks) per node."""
        return self._gpus_per_node

    @property
    def slots(self) -> tuple[EngineSlot, ...]:
        """Every engine slot, sorted by start rank."""
        return self._slots

    @property
    def coordinators(self) -> tuple[int, ...]:
        """Each slot's coordinator rank, in slot order."""
        return tuple(s.coordinator for s in self._slots)

    def slot_of(self, rank: int) -> EngineSlot:
        """The slot holding ``rank``.

        Raises:
            TopologyError: ``rank`` is outside ``[0, world_size)`` or in no engine slot; the
                message lists the slots.
        """
        self._check_rank(rank)
        try:
            return self._by_rank[rank]
        except KeyError:
            raise TopologyError(
                f"rank {rank} is outside every engine slot (slots: {_fmt_slots(self._slots)}); "
                "it feeds no engine and must not publish"
            ) from None

    def has_slot(self, rank: int) -> bool:
        """Whether ``rank`` belongs to an engine slot (no error for ranks in none)."""
        return rank in self._by_rank

    def is_coordinator(self, rank: int) -> bool:
        """Whether ``rank`` is its slot's coordinator (lowest rank).

        Raises:
            TopologyError: as ``slot_of``.
        """
        return self.slot_of(rank).coordinator == rank

    def node_parts(self, slot: EngineSlot | tuple[int, int]) -> list[tuple[int, int, int]]:
        """The nodes ``slot`` (an ``EngineSlot`` or ``(start, count)``) covers, as
        ``(node index, start rank, end rank)`` in rank order: one entry for a slot within one
        node; for an engine over several nodes, the ``nodes`` of its engine-table entry
        (docs/multi-node.md: ``{node = NAME, ranks = [start, end]}`` each)."""
        s = slot if isinstance(slot, EngineSlot) else EngineSlot(*slot)
        return _node_parts(s, self._gpus_per_node)

    def node_of(self, rank: int) -> int:
        """The node index of ``rank`` (``rank // gpus_per_node``).

        Raises:
            TopologyError: ``rank`` outside ``[0, world_size)``.
        """
        self._check_rank(rank)
        return rank // self._gpus_per_node

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self._world_size:
            raise TopologyError(f"rank {rank} is outside the world [0, {self._world_size})")

    def __repr__(self) -> str:
        return (
            f"SlotTopology(world_size={self._world_size}, gpus_per_node={self._gpus_per_node}, "
            f"slots=[{_fmt_slots(self._slots)}])"
        )

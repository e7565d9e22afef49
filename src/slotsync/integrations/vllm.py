"""slotsync as a vLLM weight-transfer backend: ``SlotsyncTrainerInitInfo``.

vLLM 0.32-0.33's trainer-side API (``vllm/distributed/weight_transfer/{base,factory}.py``)
builds a sender from an init info whose class names the backend::

    engine = WeightTransferTrainerFactory.trainer_init(
        SlotsyncTrainerInitInfo(rank=rank, packed=True),       # was IPCTrainerInitInfo(...)
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=ModuleSource(model))
    for step in ...:
        engine.send_weights(weight_version=str(step))          # every rank
    engine.shutdown()

Importing this module registers the backend ``"slotsync"`` with
``WeightTransferTrainerFactory`` (once: importing or reloading it again is harmless).

What changes against vLLM's own ``IPCTrainerWeightTransferEngine`` (vLLM 0.33
``ipc_engine.py``): it all-gathers every chunk's handles with ``all_gather_object`` over the
*default* process group plus a barrier, assuming that group is exactly one engine's colocated
ranks, and rank 0 drives the engine. Here every rank publishes its own copy to the node's
slotsyncd (``Publisher``) and runs no collective at all; the daemon merges the handles of the
ranks of each engine slot, whatever the trainer's groups are, and is the one party that drives
the engine's pause / start / update / finish / resume, records the weight version and
recovers a failed update. So ``trainer_init`` does **not** call the client's
``init_weight_transfer_engine`` (the daemon owns the engine session); the client is read for
its ``base_url`` only.

The source (a ``WeightSource``) is iterated through the first of: ``iter_sharded()``
(``slotsync.integrations.fsdp.FSDP2Source``: DTensors the publisher gathers straight into its
staging regions), ``iter_full()`` (vLLM 0.33), ``iter(source)`` (vLLM 0.32). Its
``metadata()`` gives the update's manifest (``protocol.manifest``), so ranks that would send
different tensors are refused before the engine is paused, and iteration is checked against it
element by element (vLLM's rule: "must agree with iteration element for element").

Speculative-decoding draft models (issue 18): vLLM 0.32's trainer API has no way to send them
(``TrainerWeightTransferEngine.send_weights`` takes one source; ``HTTPVLLMWeightSyncClient``
and ``RayVLLMWeightSyncClient`` have no ``start_draft_weight_update``), so this backend sends
the main model only; a round with a draft part goes through ``Publisher.publish(...,
draft=...)`` (docs/publisher.md, "Draft models").
LoRA adapters (issue 36): vLLM 0.32's trainer API has no adapter path either (nothing in
``vllm/distributed/weight_transfer/`` names LoRA: ``send_weights`` takes one weight source and
the clients have no adapter call), so this backend sends base weights only; an adapter round
goes through its publisher, ``engine.publisher.publish_adapter(...)`` (docs/publisher.md,
"LoRA adapters").
A source whose rank holds only part of the model (expert or pipeline parallelism: vLLM 0.32's
``held_names()`` not None, vLLM 0.33's ``owned_names(rank)`` short of ``metadata``) runs in
rank-local mode (``Publisher(rank_local=True)``, docs/rank-local.md): the rank publishes only
the names it holds, in metadata order, for engine worker ``worker_rank``; the daemon sends
each worker its own rank's tensors (vLLM's list-form ``update_info``) and needs the engine
table's ``gpu_uuids`` for the worker order.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from slotsync.protocol.endpoint import default_endpoint
from slotsync.protocol.rank.export import dtype_name
from slotsync.protocol.rank.publisher import (
    DEFAULT_STAGING_BUFFERS,
    DEFAULT_STAGING_BYTES,
    Publisher,
    PublishStats,
)
from slotsync.protocol.topology import EngineSlot, SlotTopology

__all__ = ["BACKEND", "SlotsyncTrainerInitInfo", "SlotsyncTrainerWeightTransferEngine",
           "register", "resolve_slot"]

BACKEND = "slotsync"
"""The name ``WeightTransferTrainerFactory`` knows this backend by (``init_info.backend``)."""

ENDPOINT_ENV = "SLOTSYNC_ENDPOINT"
"""Environment variable naming the daemon's endpoint when ``endpoint`` is not given."""


@dataclass
class SlotsyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the slotsync backend (``backend = "slotsync"``).

    ``rank`` (keyword-only, vLLM's ``TrainerInitInfo``) is this process's GLOBAL trainer rank,
    the one engine slots are counted in (one rank per GPU, ranks numbered node by node); every
    rank is a sender of its own copy.

    Args:
        packed: vLLM's packed IPC format (chunks in staging regions); False: one handle per
            tensor. As ``IPCTrainerInitInfo.packed`` (default False); all ranks of a slot must
            agree.
        packed_buffer_size_bytes: bytes of each staging region (``Publisher.staging_bytes``;
            unpacked: the chunk limit). A tensor larger than it is sent as a chunk of its own.
        staging_buffers: staging regions (2 or more: the next chunk is copied while the engine
            loads the last one; vLLM's own producer has 1).
        endpoint: the daemon's endpoint (``ipc:///abs/path``); default ``$SLOTSYNC_ENDPOINT``,
            else ``ipc://<runtime dir>/slotsyncd.sock`` as slotsyncd's default.
        engine_url: the engine's base URL; default the client's ``base_url``
            (``HTTPVLLMWeightSyncClient``); a client without one (Ray) needs it given.
        slot: this rank's engine slot, ``(start, count)`` or an ``EngineSlot``.
        topology: the job's engine layout; the slot is ``topology.slot_of(rank)``.
            With neither: one engine per node over ``$LOCAL_WORLD_SIZE`` ranks of
            ``$WORLD_SIZE`` (torchrun's environment), or the single rank 0 of a job without
            them. The daemon checks the engine's world size (and GPU UUIDs, where declared)
            against the slot before the pause, so a wrong layout is refused there.
        device: the rank's device (default: the current CUDA device, else CPU shared memory).
        gpu_uuid: the GPU UUID to announce (default: the device's).
        timeout_s: bound on each wait for the daemon, seconds (``Publisher.timeout_s``).
        liveness_s: a daemon silent this long counts as gone, seconds.
        worker_rank: for a source that holds part of the model (rank-local mode): the global
            engine worker index this rank feeds (``Publisher.worker_rank``; default
            ``rank - slot start``).

    Raises:
        TypeError: ``rank`` missing (vLLM's dataclass).
    """

    backend: ClassVar[str] = BACKEND

    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_STAGING_BYTES
    staging_buffers: int = DEFAULT_STAGING_BUFFERS
    endpoint: str | None = None
    engine_url: str | None = None
    slot: EngineSlot | tuple[int, int] | None = None
    topology: SlotTopology | None = None
    device: torch.device | int | str | None = None
    gpu_uuid: str | None = None
    timeout_s: float = 360.0
    liveness_s: float = 10.0
    worker_rank: int | None = None  # rank-local sources: the engine worker fed (Publisher)


def resolve_slot(info: SlotsyncTrainerInitInfo,
                 environ: dict[str, str] | os._Environ[str] = os.environ) -> EngineSlot:
    """The engine slot of ``info.rank``: ``info.slot``, else ``info.topology.slot_of``, else the
    torchrun default (one engine per node over ``LOCAL_WORLD_SIZE`` ranks of ``WORLD_SIZE``).

    Raises:
        TopologyError: the rank belongs to no slot of the topology (names the rank and slots).
        ValueError: no slot, topology or torchrun environment, and the rank is not 0; or a
            malformed ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``.
    """
    if info.slot is not None:
        return info.slot if isinstance(info.slot, EngineSlot) else EngineSlot(*info.slot)
    if info.topology is not None:
        return info.topology.slot_of(info.rank)
    world, local = environ.get("WORLD_SIZE"), environ.get("LOCAL_WORLD_SIZE")
    if world and local:
        try:
            world_size, per_node = int(world), int(local)
        except ValueError:
            raise ValueError(f"WORLD_SIZE={world!r} / LOCAL_WORLD_SIZE={local!r} are not "
                             "integers; give SlotsyncTrainerInitInfo(slot=...)") from None
        return SlotTopology(world_size, per_node, gpus_per_engine=per_node).slot_of(info.rank)
    if info.rank == 0:
        return EngineSlot(0, 1)
    raise ValueError(
        f"SlotsyncTrainerInitInfo(rank={info.rank}) needs the rank's engine slot: give "
        "slot=(start, count) or topology=SlotTopology(...), or run under torchrun "
        "(WORLD_SIZE and LOCAL_WORLD_SIZE set: one engine per node)")


def _stream_of(source: object) -> Callable[[], Iterator[tuple[str, Any]]]:
    """How to iterate ``source`` each round (see the module docstring).

    Raises:
        ValueError: ``source`` is None (as vLLM's IPC trainer engine).
        TypeError: it has no ``metadata()``, or none of ``iter_sharded``, ``iter_full`` or
            ``__iter__``.
    """
    if source is None:
        raise ValueError("slotsync trainer weight transfer requires a WeightSource "
                         "(e.g. vllm.distributed.weight_transfer.ModuleSource(model))")
    kind = type(source).__name__
    if isinstance(source, torch.nn.Module):
        raise TypeError(f"the weight source is a module ({kind}), not a WeightSource: pass "
                        "vllm.distributed.weight_transfer.ModuleSource(model), or "
                        "slotsync.integrations.fsdp.FSDP2Source(model) for an FSDP2 model")
    if not callable(getattr(source, "metadata", None)):
        raise TypeError(f"the weight source {kind} has no metadata(): a WeightSource must "
                        "declare its (name, dtype, shape) list (vLLM WeightSource.metadata)")
    for method in ("iter_sharded", "iter_full"):
        fn = getattr(source, method, None)
        if callable(fn):
            return fn
    if callable(getattr(source, "__iter__", None)):
        return lambda: iter(source)  # type: ignore[call-overload]
    raise TypeError(f"the weight source {kind} has no iter_full() (vLLM 0.33 WeightSource), "
                    "no __iter__ (vLLM 0.32) and no iter_sharded(): nothing to publish")


def _metadata(source: object) -> Sequence[Any]:
    """``source.metadata``: a method in vLLM 0.32, a ``cached_property`` in 0.33."""
    m = source.metadata  # type: ignore[attr-defined]
    return m() if callable(m) else m


def _held_names(source: object, rank: int) -> frozenset[str] | None:
    """The names this rank holds when it holds only part of the model (vLLM 0.32's
    ``held_names()`` not None, or vLLM 0.33's ``owned_names(rank)`` short of the
    ``metadata`` names); None when it holds every name (then every rank sends the whole
    model).

    Raises:
        ValueError: the rank holds none of the model's names (it has nothing to send).
    """
    held = getattr(source, "held_names", None)
    mine: frozenset[str] | None = None
    if callable(held) and held() is not None:
        mine = frozenset(held())
    owned = getattr(source, "owned_names", None)
    if mine is None and callable(owned):
        names = {m.name for m in _metadata(source)}
        got = owned(rank)
        if got is not None and names - set(got):
            mine = frozenset(got)
    if mine is not None and not mine:
        raise ValueError(f"the weight source {type(source).__name__} holds no parameter on "
                         f"rank {rank}: nothing to publish (held_names/owned_names is empty)")
    return mine


def _check_ownership(source: object, rank: int) -> bool:
    """Whether ``source`` holds only part of the model on ``rank`` (rank-local mode:
    ``_held_names``). Kept under its old name (tests import it).

    Raises:
        ValueError: as ``_held_names``.
    """
    return _held_names(source, rank) is not None


class _Meta:
    """One round's ``metadata()``: the update's ``(name, dtype, shape)`` list (the begin's
    manifest) and the per-element check of iteration."""

    def __init__(self, metadata: Sequence[Any], held: frozenset[str] | None = None) -> None:
        self.held = held  # rank-local: the names this rank holds (None: all)
        self.entries = [(m.name, dtype_name(m.dtype), tuple(int(d) for d in m.shape))
                        for m in metadata if held is None or m.name in held]

    def mine(self, items: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``items`` without the names this rank does not hold (vLLM 0.32's iteration yields
        ``(name, None)`` for them, 0.33's ``iter_full`` only owned names)."""
        held = self.held
        for name, t in items:
            if held is None or name in held:
                yield name, t

    def checked(self, items: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``items`` as they come, each checked against the metadata at its position.

        Raises:
            RuntimeError: a name, dtype or shape differs from ``metadata()`` there, or the
                counts differ (the update is aborted; names the element).
        """
        n = 0
        for name, t in items:
            if n >= len(self.entries):
                raise RuntimeError(
                    f"the weight source yielded more than the {len(self.entries)} tensors its "
                    f"metadata() lists ({name!r} is extra): iteration must agree with "
                    "metadata() element for element")
            got = (name, dtype_name(t.dtype), tuple(int(d) for d in t.shape))
            if got != self.entries[n]:
                raise RuntimeError(
                    f"the weight source yielded {got} at position {n} but its metadata() "
                    f"lists {self.entries[n]}: iteration must agree with metadata() element "
                    "for element")
            n += 1
            yield name, t
        if n != len(self.entries):
            raise RuntimeError(
                f"the weight source yielded {n} tensors but its metadata() lists "
                f"{len(self.entries)} (next: {self.entries[n][0]!r}): iteration must agree "
                "with metadata() element for element")


class SlotsyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[SlotsyncTrainerInitInfo]):
    """The slotsync backend's trainer engine: one ``Publisher`` per rank (see the module
    docstring). Built by ``trainer_init``; ``publisher`` is the rank's registered publisher."""

    init_info_cls = SlotsyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource,
                 publisher: Publisher) -> None:
        super().__init__(client=client, source=source, is_sender=True)
        self.publisher = publisher
        self._stream = _stream_of(source)
        self._rounds = itertools.count(1)

    @classmethod
    def trainer_init(cls, init_info: SlotsyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        """Check the source, resolve the slot, endpoint and engine URL, and register this
        rank with slotsyncd. Runs on every rank; no collective, no engine call.

        Raises:
            TypeError: ``init_info`` is not a ``SlotsyncTrainerInitInfo``, or a source as
                ``_stream_of`` says.
            ValueError: no source; a source that holds no parameter on this rank; no engine URL;
                bad publisher arguments (``Publisher``).
            TopologyError: the rank lies in no engine slot.
            SlotsyncError: no daemon listens at the endpoint (names the socket and why), or
                it refused the registration.
        """
        if not isinstance(init_info, SlotsyncTrainerInitInfo):
            raise TypeError(f"init_info must be a SlotsyncTrainerInitInfo, got "
                            f"{type(init_info).__name__}")
        _stream_of(source)
        held = _held_names(source, init_info.rank)
        slot = resolve_slot(init_info)
        engine_url = init_info.engine_url or getattr(client, "base_url", None)
        if not engine_url:
            raise ValueError(f"no engine URL: {type(client).__name__} has no base_url; give "
                             "SlotsyncTrainerInitInfo(engine_url='http://host:port')")
        endpoint = init_info.endpoint or os.environ.get(ENDPOINT_ENV) or default_endpoint()
        publisher = Publisher(
            endpoint, init_info.rank, slot, engine_url, packed=init_info.packed,
            device=init_info.device, gpu_uuid=init_info.gpu_uuid,
            staging_bytes=init_info.packed_buffer_size_bytes,
            staging_buffers=init_info.staging_buffers, timeout_s=init_info.timeout_s,
            liveness_s=init_info.liveness_s, rank_local=held is not None,
            worker_rank=init_info.worker_rank if held is not None else None)
        try:
            publisher.register()
        except BaseException:
            publisher.close()
            raise
        assert source is not None
        return cls(client=client, source=source, publisher=publisher)

    def send_weights(self, weight_version: str | None = None) -> PublishStats:
        """Publish one round: the source's tensors, chunked, through slotsyncd into the engine;
        returns when the engine finished (and resumed). Every rank calls it; no collective.

        Args:
            weight_version: recorded by the engine on success (vLLM's
                ``/finish_weight_update``); default ``"1"``, ``"2"``, ... per call.

        Raises:
            ValueError, TypeError: bad tensors or version (``Publisher.publish``), before the
                engine is paused where they are known up front.
            RuntimeError: the source's iteration disagrees with its ``metadata()``.
            SlotsyncError, SlotsyncTimeout: the update failed (the daemon says why; the
                engine is left as ``docs/guarantees.md`` describes).
        """
        version = weight_version if weight_version is not None else str(next(self._rounds))
        held = _held_names(self.source, self.publisher.rank)
        meta = _Meta(_metadata(self.source), held)
        return self.publisher.publish(meta.checked(meta.mine(self._stream())), version,
                                      manifest=meta.entries)

    def shutdown(self) -> None:
        """Close the publisher (aborting an open update; idempotent)."""
        self.publisher.close()


def register() -> None:
    """Register ``"slotsync"`` with vLLM's ``WeightTransferTrainerFactory`` (lazily, by module
    path); a second registration (this module imported again or reloaded) is a no-op."""
    try:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, __name__, "SlotsyncTrainerWeightTransferEngine")
    except ValueError as e:  # vLLM's register_engine: "... is already registered."
        if "already registered" not in str(e):
            raise


register()

"""An FSDP2 module as a weight source whose shards the publisher gathers straight into its
staging regions (issue 17 B).

``FSDP2Source(module)`` is a vLLM-style ``WeightSource`` (vLLM 0.32-0.33
``vllm/distributed/weight_transfer/base.py``) over a module sharded with
``torch.distributed.fsdp.fully_shard``, whose parameters are DTensors sharded on dim 0 over the
FSDP mesh. It has both channels:

* ``metadata()``, ``__iter__`` and ``iter_full()``: as vLLM's ``ModuleSource``, full tensors
  (each DTensor materialized, a collective), so that any other backend can use it;
* ``iter_sharded()``: the DTensors themselves, not gathered. The slotsync backend
  (``slotsync.integrations.vllm``) publishes this: ``Publisher.publish`` then all-gathers each
  shard into the staging region it sends (``export.plan_pack``, ``export.gather_shard``), with
  no ``full_tensor()`` temporary and one copy fewer than ``full_tensor()`` + a copy into a
  send buffer.

Either way every rank of the FSDP group must iterate the same names in the same order (the
gathers are collectives): ``named_parameters()`` is that order on every rank, and the
publisher launches the gathers in that order (why this cannot deadlock, also when the group's
ranks sit in different engine slots: the comment above ``export.plan_sharded``).

Megatron-style exporters (``export_hf_weights``-like generators, which convert and gather a
model's parameters into Hugging Face names one by one) plug in the same way: a generator of
``(hf_name, tensor)`` pairs in the same order on every rank is what ``Publisher.publish`` and
``send_weights`` take. Yield full (already gathered) tensors, or DTensors sharded
``(Shard(0),)`` on a 1-D mesh to have them gathered into staging; whatever the exporter
gathers itself (TP, EP) must be done before it yields. The generator is consumed lazily, one
chunk at a time, so its tensors can be freed as soon as their chunk is copied.

Nothing here imports vLLM at import time; ``metadata()`` returns vLLM's ``ParamMeta`` when
vLLM imports, else ``ParamMeta`` below (the same fields).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from slotsync.protocol.rank.export import materialize

__all__ = ["FSDP2Source", "ParamMeta"]


@dataclass(frozen=True)
class ParamMeta:
    """Name, dtype and full (global) shape of one parameter: vLLM 0.32's ``ParamMeta``'s
    fields, for when vLLM does not import."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _param_meta_class() -> type:
    try:
        from vllm.distributed.weight_transfer.base import ParamMeta as VllmParamMeta
    except Exception:  # noqa: BLE001 - no (usable) vLLM here: our own
        return ParamMeta
    return VllmParamMeta


class FSDP2Source:
    """The parameters of an FSDP2 module (``fully_shard``), as a re-iterable weight source.

    Args:
        module: the (sharded) module; its ``named_parameters()`` are the names sent (pass a
            wrapper, or use your own generator, to rename them to the engine's names). Plain
            (unsharded) parameters pass through as they are.

    Every iteration is a fresh pass over ``module.named_parameters()``, so the source serves
    every round.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"FSDP2Source takes a torch.nn.Module, got {type(module).__name__}")
        self.module = module

    def metadata(self) -> list[Any]:
        """``ParamMeta(name, dtype, global shape)`` per parameter, in iteration order, without
        gathering anything (a DTensor's ``shape`` is its global one). vLLM's ``ParamMeta`` when
        vLLM imports, else this module's."""
        meta = _param_meta_class()
        return [meta(name, p.dtype, tuple(p.shape))
                for name, p in self.module.named_parameters()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` per parameter: each DTensor gathered
        (``export.materialize``, a collective over its mesh; dtype and global shape as the
        parameter's), a plain parameter as is (detached). vLLM 0.33's ``iter_full``."""
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                yield name, materialize(p.detach())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``iter_full()``: vLLM 0.32's ``WeightSource`` iteration (``ModuleSource``)."""
        return self.iter_full()

    def iter_sharded(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` per parameter, not gathered: DTensors as FSDP2 holds them
        (detached), for ``Publisher.publish``, which gathers each into its staging region."""
        for name, p in self.module.named_parameters():
            yield name, p.detach()

    def held_names(self) -> None:
        """vLLM's ownership hook: None, every rank holds (a shard of) every parameter."""
        return None

    def __repr__(self) -> str:
        return f"FSDP2Source({type(self.module).__name__})"

"""Test-only LoRA adapters laid out as slot ranks hand them over (issue 36): PEFT-named tensors
(``make_adapter``), each rank's part in a shared-memory segment at ``wire.part_offsets``
(``publish``), and the ``AdapterPlan`` the daemon's core would build from the ranks'
``AdapterBegin`` messages (``daemon/core/adapters/plan.py``), with each part's sha256.

Used by ``tests/unit/test_sglang_adapters.py`` and ``tests/integration/test_sglang_lora.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from lora_plans import dtype_name
from lora_plans import sha as sha256_of  # (sha256 of a tensor's C-order bytes: one helper)

from slotsync.daemon.core.adapters.plan import AdapterPart, AdapterPlan, AdapterTensorPlan
from slotsync.protocol.rank.shm_segment import ShmSegment
from slotsync.protocol.wire import AdapterTensor, ShmHandle, part_offsets, served_name

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def config(r: int = 4, modules: tuple[str, ...] | str = MODULES, **extra: Any
           ) -> dict[str, Any]:
    """A PEFT ``adapter_config.json`` (the fields SGLang's ``LoRAConfig`` reads); ``modules``
    a tuple of names or PEFT's ``"all-linear"``."""
    return {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0,
            "target_modules": modules if isinstance(modules, str) else list(modules),
            "bias": "none", "task_type": "CAUSAL_LM", **extra}


def make_adapter(seed: int = 0, *, layers: int = 2, hidden: int = 16, inter: int = 40,
                 kv: int = 8, r: int = 4, dtype: torch.dtype = torch.bfloat16
                 ) -> dict[str, torch.Tensor]:
    """A LoRA adapter of a small transformer, PEFT names
    (``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight``, ...):
    ``lora_A`` is ``(r, in)``, ``lora_B`` ``(out, r)``."""
    g = torch.Generator().manual_seed(seed)
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (hidden, hidden), "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for m in MODULES:
            where = "self_attn" if m in ATTN else "mlp"
            base = f"base_model.model.model.layers.{i}.{where}.{m}"
            d_in, d_out = dims[m]
            out[f"{base}.lora_A.weight"] = torch.randn(r, d_in, generator=g).to(dtype)
            out[f"{base}.lora_B.weight"] = torch.randn(d_out, r, generator=g).to(dtype)
    return out


def begin_tensors(tensors: Mapping[str, torch.Tensor]) -> list[AdapterTensor]:
    """One rank's ``AdapterBegin.tensors`` for whole tensors."""
    return [AdapterTensor(n, dtype_name(t), tuple(t.shape), 0, t.shape[0], sha256_of(t))
            for n, t in tensors.items()]


class Published:
    """The parts of an adapter in shared memory: ``plan``, each rank's ``handles``, the
    segments (``close`` unlinks them) and the source ``tensors``."""

    def __init__(self, plan: AdapterPlan, handles: dict[int, ShmHandle],
                 segments: dict[int, ShmSegment], tensors: dict[str, torch.Tensor]) -> None:
        self.plan, self.handles, self.segments, self.tensors = plan, handles, segments, tensors

    def close(self) -> None:
        for s in self.segments.values():
            s.close_and_unlink()
        self.segments.clear()

    def corrupt(self, name: str) -> None:
        """Flip one byte of tensor ``name`` in its holder's segment."""
        for t in self.plan.tensors:
            if t.name == name:
                p = t.parts[0]
                seg = self.segments[p.rank]
                seg.tensor[p.offset] ^= 0xFF
                return
        raise KeyError(name)


def publish(tensors: Mapping[str, torch.Tensor], holder: Mapping[str, int] | int = 0, *,
            lora_name: str = "math", version: int = 1, cfg: dict[str, Any] | None = None,
            ranks: tuple[int, ...] = (0, 1), lead: int = 0) -> Published:
    """Write each rank's part (the tensors ``holder`` gives it, in ``tensors``' order) into a
    segment at ``wire.part_offsets`` (after ``lead`` bytes), and the plan of it.

    Args:
        holder: the rank holding every tensor, or ``{name: rank}``.
        lead: bytes before the part in its segment (the handle's offset).
    """
    who = {n: holder for n in tensors} if isinstance(holder, int) else dict(holder)
    cfg = cfg or config(r=next(iter(tensors.values())).shape[0])
    by_rank: dict[int, dict[str, torch.Tensor]] = {r: {} for r in ranks}
    for n, t in tensors.items():
        by_rank[who[n]][n] = t
    handles, segments, where = {}, {}, {}
    for r, mine in by_rank.items():
        begin = begin_tensors(mine)
        offsets, total = part_offsets(begin)
        if not mine:
            continue
        seg = ShmSegment(lead + total, rank=r)
        for (n, t), off in zip(mine.items(), offsets, strict=True):
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            seg.tensor[lead + off: lead + off + raw.numel()] = raw
            where[n] = (r, off, raw.numel())
        segments[r] = seg
        handles[r] = seg.handle(lead, total)
    plan_tensors = tuple(
        AdapterTensorPlan(n, dtype_name(t), tuple(t.shape), (AdapterPart(
            where[n][0], where[n][1], where[n][2], 0, t.shape[0], sha256_of(t)),))
        for n, t in tensors.items())
    plan = AdapterPlan(lora_name, version, served_name(lora_name, version), json.dumps(cfg),
                       int(cfg["r"]), plan_tensors, tuple(ranks))
    return Published(plan, handles, segments, dict(tensors))


def split_plan(tensors: Mapping[str, torch.Tensor], name: str) -> AdapterPlan:
    """A plan whose tensor ``name`` is split over ranks 0 and 1 by rows (no memory)."""
    out = []
    for n, t in tensors.items():
        nb = t.numel() * t.element_size()
        if n == name:
            half = t.shape[0] // 2
            row = nb // t.shape[0]
            parts = (AdapterPart(0, 0, half * row, 0, half, "0" * 64),
                     AdapterPart(1, 0, nb - half * row, half, t.shape[0], "1" * 64))
        else:
            parts = (AdapterPart(0, 0, nb, 0, t.shape[0], sha256_of(t)),)
        out.append(AdapterTensorPlan(n, dtype_name(t), tuple(t.shape), parts))
    return AdapterPlan("math", 1, "math@v1", json.dumps(config()), 4, tuple(out), (0, 1))

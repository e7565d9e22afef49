"""SGLang's LoRA adapters (issue 36 B), minimal: the core helper's stand-in with the
signatures the SGLang helper's module has (the lead merges that one over this).

SGLang 0.5.23 ``POST /load_lora_adapter_from_tensors {lora_name, config_dict,
serialized_named_tensors: [one pickle per TP rank], load_format, expected_checksums}`` and
``POST /unload_lora_adapter {lora_name}`` (``srt/entrypoints/http_server.py``,
``managers/io_struct.py``). This stand-in writes each TP rank's entry unpacked from the
ranks' shared-memory handles (the CPU stand-in) with ``tensor_pickle``, and refuses a tensor
split over ranks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from slotsync.daemon.core.adapters.plan import AdapterPlan, LoraLimits
from slotsync.daemon.sglang.tensor_pickle import rank_entry_unpacked
from slotsync.protocol.wire import Handle, ShmHandle

SGLANG_LORA_FLAGS: tuple[tuple[str, str], ...] = (
    ("enabled", "--enable-lora"),
    ("max_loras", "--max-loras-per-batch"),
    ("max_lora_rank", "--max-lora-rank"),
)
"""``LoraLimits.flags`` of an SGLang server (``server_args.py``)."""


def lora_limits(server_info: Any) -> LoraLimits:
    """What the server whose ``GET /server_info`` (its flat arguments) answered can hold."""
    info = server_info if isinstance(server_info, dict) else {}
    if not info.get("enable_lora"):
        return LoraLimits(False, flags=SGLANG_LORA_FLAGS)
    n, r = info.get("max_loras_per_batch"), info.get("max_lora_rank")
    return LoraLimits(True, n if isinstance(n, int) else 0, r if isinstance(r, int) else 0,
                      SGLANG_LORA_FLAGS)


def refusal(plan: AdapterPlan) -> str:
    """Why this stand-in cannot write ``plan``'s body, or '': a tensor split over ranks."""
    split = [t.name for t in plan.tensors if t.whole is None]
    return (f"adapter {plan.served_name}: tensor {split[0]!r} is split over ranks; SGLang's "
            "payload takes each tensor from one rank" if split else "")


def load_body(plan: AdapterPlan, handles: Mapping[int, Handle | None],
              gpu_uuids: Mapping[int, str], tp_size: int) -> dict[str, Any]:
    """``/load_lora_adapter_from_tensors``'s body: one unpacked pickle per TP rank (TP rank
    ``t`` reads on the GPU of the slot's ``t``-th rank), each tensor a shared-memory view of
    the rank that holds it.

    Raises:
        ValueError: a split tensor, or a handle that is not a ``ShmHandle``.
    """
    why = refusal(plan)
    if why:
        raise ValueError(why)
    views: list[Handle] = []
    for t in plan.tensors:
        part, h = t.parts[0], handles.get(t.parts[0].rank)
        if not isinstance(h, ShmHandle):
            raise ValueError("this daemon writes SGLang adapter payloads from shared memory "
                             "only")
        views.append(ShmHandle(h.segment, h.offset + part.offset, part.nbytes))
    names = [t.name for t in plan.tensors]
    dtypes = [t.dtype for t in plan.tensors]
    shapes = [list(t.shape) for t in plan.tensors]
    uuids = [gpu_uuids[r] for r in sorted(gpu_uuids)][:tp_size]
    return {"lora_name": plan.served_name, "config_dict": json.loads(plan.config_json),
            "serialized_named_tensors": [rank_entry_unpacked(views, u, names, dtypes, shapes)
                                         for u in uuids],
            "load_format": None, "pinned": False}


def unload_body(served_name: str) -> dict[str, Any]:
    """``/unload_lora_adapter``'s body (``UnloadLoRAAdapterReqInput``)."""
    return {"lora_name": served_name}


def served_adapters(models_json: Any) -> set[str]:
    """The adapters in ``GET /v1/models`` (cards with a ``parent``: 0.5.23
    ``http_server.py`` ``available_models``)."""
    data = models_json.get("data") if isinstance(models_json, dict) else None
    return {c["id"] for c in data or () if isinstance(c, dict)
            and isinstance(c.get("id"), str) and c.get("parent") is not None}

"""The adapter ``slotsync bench lora`` moves, and the disk path's save.

Shapes (:data:`QWEN3_8B`, :data:`SMALL`): a LoRA adapter on ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj`` and ``down_proj`` of every layer, PEFT
names (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` ``(r, in)``,
``...lora_B.weight`` ``(out, r)``), bfloat16. Qwen3-8B (Hugging Face ``Qwen/Qwen3-8B``
``config.json``): hidden 4096, intermediate 12288, 32 attention heads and 8 KV heads of 128,
36 layers; at rank 32 that is 87.3 M parameters.

The engine's model (:func:`stub_model`): only layer 0's seven linear modules, at their full
shapes, zeros -- what the engines check an adapter against when they read its folder (the
reference engine: every module's last name among the model's 2-D modules, and the shapes of
the modules the model has; the vLLM-code engine: vLLM's ``LoRAModel.from_local_checkpoint``
against the model's module names). Neither path reads the base weights otherwise.

:func:`save_like_peft` is the disk path's save: what PEFT's ``PeftModel.save_pretrained``
writes (``peft/peft_model.py``: ``safe_save_file(output_state_dict, ..., metadata={"format":
"pt"})`` of ``get_peft_model_state_dict``, then ``peft_config.save_pretrained``: the config as
``adapter_config.json``), no ``fsync`` (neither does PEFT).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODULES = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
           ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
           ("mlp", "down_proj"))


@dataclass(frozen=True)
class Shapes:
    """A decoder's linear-module shapes and the adapter's rank."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    r: int

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``{"model.layers.N.<block>.<proj>": (out_features, in_features)}``, layer by
        layer in :data:`MODULES` order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        per = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
               "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        return {f"model.layers.{n}.{block}.{proj}": per[proj]
                for n in range(self.layers) for block, proj in MODULES}

    def adapter_bytes(self, itemsize: int = 2) -> int:
        """Bytes of the adapter's tensors (bfloat16: 2 bytes an element)."""
        return itemsize * self.r * sum(o + i for o, i in self.module_shapes().values())

    def tensor_count(self) -> int:
        return 2 * self.layers * len(MODULES)


QWEN3_8B = Shapes("Qwen3-8B", hidden=4096, intermediate=12288, heads=32, kv_heads=8,
                  head_dim=128, layers=36, r=32)
SMALL = Shapes("small (Qwen3-like)", hidden=256, intermediate=768, heads=4, kv_heads=2,
               head_dim=64, layers=4, r=8)


def peft_config(shapes: Shapes) -> str:
    """The adapter's PEFT ``adapter_config.json`` text (``LoraConfig.to_dict()``'s fields the
    engines read), keys sorted: what every rank sends and the disk path saves."""
    return json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": shapes.r,
        "lora_alpha": 2 * shapes.r, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [proj for _, proj in MODULES], "inference_mode": True,
        "base_model_name_or_path": f"slotsync-bench/{shapes.name}"}, sort_keys=True)


def adapter_tensors(shapes: Shapes, seed: int = 0, device: Any = "cpu") -> dict[str, Any]:
    """The adapter's tensors, bfloat16 on ``device``, random (``seed``; the same on every
    rank), PEFT names in :meth:`Shapes.module_shapes` order, ``lora_A`` before ``lora_B``."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for module, (o, i) in shapes.module_shapes().items():
        for kind, shape in (("lora_A", (shapes.r, i)), ("lora_B", (o, shapes.r))):
            t = (torch.randn(*shape, generator=g) * 0.01).to(torch.bfloat16)
            out[f"base_model.model.{module}.{kind}.weight"] = t.to(device)
    return out


def rank_rows(tensors: dict[str, Any], index: int, ranks: int
              ) -> tuple[dict[str, Any], dict[str, tuple[int, tuple[int, ...]]]]:
    """Slot rank ``index``'s part (of ``ranks``): every tensor's rows ``[index n / ranks,
    (index + 1) n / ranks)`` (``publish_adapter``'s ``rows``); one rank: everything whole."""
    if ranks == 1:
        return dict(tensors), {}
    part, rows = {}, {}
    for name, t in tensors.items():
        n = t.shape[0]
        a, b = index * n // ranks, (index + 1) * n // ranks
        part[name], rows[name] = t[a:b], (a, tuple(t.shape))
    return part, rows


def save_like_peft(folder: Path, tensors: dict[str, Any], config_json: str) -> None:
    """The disk path's save (module docstring): ``folder/adapter_model.safetensors`` with
    safetensors' ``save_file`` (which copies each tensor to the host first) and
    ``folder/adapter_config.json``."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(config_json, encoding="utf-8")


def stub_model(path: Path, shapes: Shapes) -> Path:
    """The engine's model (module docstring): layer 0's linear modules of ``shapes`` as zeros,
    bfloat16, under Hugging Face names, in the safetensors file ``path``; returns it."""
    import torch
    from safetensors.torch import save_file

    save_file({f"{m}.weight": torch.zeros(o, i, dtype=torch.bfloat16)
               for m, (o, i) in shapes.module_shapes().items()
               if m.startswith("model.layers.0.")}, str(path))
    return path

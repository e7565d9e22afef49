"""Test helpers for LoRA adapter rounds (issue 36): a PEFT-named adapter for a tiny Llama,
its tensors split by rows over ranks as ``wire.AdapterBegin`` parts lay them out behind each
rank's handle (``wire.part_offsets``), and the ``AdapterPlan`` of those parts (what the
daemon's core builds from the ranks' begins).

Torch is used here only (the daemon never imports it)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from slotsync.daemon.core.adapters.plan import AdapterPart, AdapterPlan, AdapterTensorPlan
from slotsync.protocol.wire import AdapterTensor, part_offsets, served_name

TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
"""A Llama small enough to build and serve on a loaded 2-core CPU: head size 32, one KV head
(vLLM 0.32's CPU attention takes head sizes 32, 64, ..., 512: ``cpu_attn.py``
``get_supported_head_sizes``; a head size of 16 kills the engine core at the first step)."""

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(cfg: dict[str, Any] = TINY_LLAMA) -> dict[str, tuple[int, int]]:
    """``{"model.layers.i.<block>.<proj>": (out_features, in_features)}`` of a Llama's
    linear modules (Hugging Face ``LlamaForCausalLM`` names)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
           "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
           "mlp.down_proj": (h, inter)}
    return {f"model.layers.{i}.{k}": v for i in range(cfg["num_hidden_layers"])
            for k, v in per.items()}


def peft_config(r: int = 8, alpha: int = 16, targets: tuple[str, ...] = TARGETS,
                **extra: Any) -> dict[str, Any]:
    """A PEFT ``LoraConfig`` as ``adapter_config.json`` holds it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
            "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets),
            "base_model_name_or_path": "tiny-llama", "inference_mode": True, **extra}


def lora_tensors(r: int = 8, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 cfg: dict[str, Any] = TINY_LLAMA,
                 targets: tuple[str, ...] = TARGETS) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors for ``cfg``'s linear modules in ``targets``:
    ``base_model.model.<module>.lora_A.weight`` (r, in) and ``.lora_B.weight`` (out, r),
    random (``seed``), both nonzero (so that an adapter changes the output)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for module, (o, i) in module_shapes(cfg).items():
        if module.rsplit(".", 1)[-1] not in targets:
            continue
        out[f"base_model.model.{module}.lora_A.weight"] = (
            torch.randn(r, i, generator=g) * 0.1).to(dtype)
        out[f"base_model.model.{module}.lora_B.weight"] = (
            torch.randn(o, r, generator=g) * 0.1).to(dtype)
    return out


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in C order."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sha(t: torch.Tensor) -> str:
    """sha256 hex of a tensor's bytes (what a rank sends for its part)."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).split(".")[-1]


def split_plan(tensors: dict[str, torch.Tensor], config: dict[str, Any], *, lora_name: str =
               "math", version: int = 1, ranks: int = 1
               ) -> tuple[AdapterPlan, dict[int, bytes], dict[int, list[AdapterTensor]]]:
    """Split every tensor with at least ``ranks`` rows by rows over ranks ``0..ranks-1``
    (rank k: rows ``[k n / ranks, (k+1) n / ranks)``; a smaller one whole on rank 0); lay
    each rank's part out as ``wire.part_offsets`` says. Returns the plan, each rank's buffer
    (its handle's bytes) and each rank's ``AdapterTensor`` list (its begin's tensors)."""
    begins: dict[int, list[AdapterTensor]] = {k: [] for k in range(ranks)}
    pieces: dict[int, list[torch.Tensor]] = {k: [] for k in range(ranks)}
    for name, t in tensors.items():
        n = t.shape[0]
        cuts = ([(0, 0, n)] if n < ranks else
                [(k, k * n // ranks, (k + 1) * n // ranks) for k in range(ranks)])
        for k, a, b in cuts:
            part = t[a:b]
            begins[k].append(AdapterTensor(name, dtype_name(t), list(t.shape), a, b, sha(part)))
            pieces[k].append(part)
    buffers: dict[int, bytes] = {}
    where: dict[tuple[str, int], tuple[int, AdapterTensor]] = {}
    for k in range(ranks):
        offsets, end = part_offsets(begins[k])
        buf = bytearray(end)
        for off, at, part in zip(offsets, begins[k], pieces[k], strict=True):
            data = tensor_bytes(part)
            buf[off:off + len(data)] = data
            where[(at.name, k)] = (off, at)
        buffers[k] = bytes(buf)
    plans = []
    for name, t in tensors.items():
        parts = sorted(
            (AdapterPart(k, off, at.nbytes, at.row_start, at.row_stop, at.sha256)
             for (nm, k), (off, at) in where.items() if nm == name),
            key=lambda p: p.row_start)
        plans.append(AdapterTensorPlan(name, dtype_name(t), tuple(t.shape), tuple(parts)))
    text = json.dumps(config)
    plan = AdapterPlan(lora_name, version, served_name(lora_name, version), text,
                       int(config["r"]), tuple(plans), tuple(range(ranks)))
    return plan, buffers, begins


def reader(buffers: dict[int, bytes]):
    """``read(rank, offset, nbytes)`` over the ranks' buffers (``write_adapter_folder``)."""
    def read(rank: int, offset: int, nbytes: int) -> memoryview:
        return memoryview(buffers[rank])[offset:offset + nbytes]
    return read


def llama_weights(seed: int = 0, dtype: torch.dtype = torch.float32,
                  cfg: dict[str, Any] = TINY_LLAMA) -> list[tuple[str, torch.Tensor]]:
    """Random base weights of a Llama under Hugging Face names (``model.embed_tokens``,
    each layer's norms and linear modules, ``model.norm``, ``lm_head``): the model an
    engine of ``slotsync.engine`` holds for adapter tests (``tests/engines.py``
    ``start_engine(named=...)``)."""
    g = torch.Generator().manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", torch.randn(v, h, generator=g))]
    for i in range(cfg["num_hidden_layers"]):
        out.append((f"model.layers.{i}.input_layernorm.weight", torch.ones(h)))
        out.append((f"model.layers.{i}.post_attention_layernorm.weight", torch.ones(h)))
        out += [(f"{m}.weight", torch.randn(*s, generator=g) * 0.05)
                for m, s in module_shapes(cfg).items() if m.startswith(f"model.layers.{i}.")]
    out += [("model.norm.weight", torch.ones(h)),
            ("lm_head.weight", torch.randn(v, h, generator=g))]
    return [(n, t.to(dtype)) for n, t in out]

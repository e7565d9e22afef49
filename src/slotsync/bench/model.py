"""Tensor names and shapes of the benchmark's rounds (no tensors are allocated here).

``qwen3_moe_specs`` lists Qwen3-30B-A3B's checkpoint in Hugging Face names, from its published
``config.json``: hidden 2048, 48 layers, 128 experts, moe_intermediate 768, 32 query heads and
4 key/value heads of head_dim 128, vocab 151936, per-head ``q_norm``/``k_norm``, untied
embeddings. 48 layers give 18,867 tensors and 61.1 GB in bfloat16 — the "61 GB per GPU" of
the published slime/vime figures, where every rank of a colocated 8-GPU engine publishes the
whole model in HF format.

``chunk_specs`` cuts a list into chunks with the publisher's own rule (``protocol.chunking``),
so the benchmark's chunks are the publisher's chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slotsync.protocol.chunking import cut
from slotsync.protocol.wire import DTYPE_SIZES


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a round: HF name, shape, dtype name (vLLM spelling)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements (``wire.DTYPE_SIZES``: the wire's own sizes)."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class Qwen3MoeConfig:
    """The fields of Qwen3-30B-A3B's ``config.json`` that fix its tensor shapes."""

    hidden: int = 2048
    layers: int = 48
    experts: int = 128
    moe_intermediate: int = 768
    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 151936
    tie_embeddings: bool = False


def qwen3_moe_specs(cfg: Qwen3MoeConfig | None = None) -> list[TensorSpec]:
    """Every tensor of a Qwen3-MoE checkpoint in HF order (embeddings, layers, norm, head).

    Per layer: q/k/v/o projections, q_norm/k_norm (head_dim), two RMSNorms, the router
    (``mlp.gate``, experts x hidden) and gate/up/down projections of every expert.
    """
    c = cfg or Qwen3MoeConfig()
    h, hd = c.hidden, c.head_dim
    out = [TensorSpec("model.embed_tokens.weight", (c.vocab, h))]
    for i in range(c.layers):
        p = f"model.layers.{i}"
        out += [
            TensorSpec(f"{p}.self_attn.q_proj.weight", (c.q_heads * hd, h)),
            TensorSpec(f"{p}.self_attn.k_proj.weight", (c.kv_heads * hd, h)),
            TensorSpec(f"{p}.self_attn.v_proj.weight", (c.kv_heads * hd, h)),
            TensorSpec(f"{p}.self_attn.o_proj.weight", (h, c.q_heads * hd)),
            TensorSpec(f"{p}.self_attn.q_norm.weight", (hd,)),
            TensorSpec(f"{p}.self_attn.k_norm.weight", (hd,)),
            TensorSpec(f"{p}.input_layernorm.weight", (h,)),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (h,)),
            TensorSpec(f"{p}.mlp.gate.weight", (c.experts, h)),
        ]
        for e in range(c.experts):
            q = f"{p}.mlp.experts.{e}"
            out += [
                TensorSpec(f"{q}.gate_proj.weight", (c.moe_intermediate, h)),
                TensorSpec(f"{q}.up_proj.weight", (c.moe_intermediate, h)),
                TensorSpec(f"{q}.down_proj.weight", (h, c.moe_intermediate)),
            ]
    out.append(TensorSpec("model.norm.weight", (h,)))
    if not c.tie_embeddings:
        out.append(TensorSpec("lm_head.weight", (c.vocab, h)))
    return out


def uniform_specs(count: int, shape: tuple[int, ...] = (768, 2048)) -> list[TensorSpec]:
    """``count`` tensors of one shape (default: one Qwen3-30B-A3B expert projection, 3 MiB in
    bf16), named like expert weights; for the tensor-count sweep."""
    return [TensorSpec(f"model.layers.{i // 384}.mlp.experts.{(i // 3) % 128}."
                       f"{('gate_proj', 'up_proj', 'down_proj')[i % 3]}.weight.{i}", shape)
            for i in range(count)]


def chunk_specs(
    specs: list[TensorSpec], staging_bytes: int, *, allow_oversize: bool = True
) -> list[list[TensorSpec]]:
    """Greedy in-order chunks of at most ``staging_bytes`` bytes (as ``Publisher.publish``).

    With ``allow_oversize`` a tensor larger than ``staging_bytes`` travels alone in its own
    chunk (what slime's and vime's bucketing do, and ``Publisher`` since issue 17;
    Qwen3-30B-A3B's embeddings and lm_head are 593.5 MiB each, over a 512 MiB bucket).

    Raises:
        ValueError: a tensor is larger than ``staging_bytes`` and ``allow_oversize`` is off.
    """
    if not allow_oversize:
        for s in specs:
            if s.nbytes > staging_bytes:
                raise ValueError(
                    f"tensor {s.name} is {s.nbytes} bytes, over the {staging_bytes}-byte chunk")
    return list(cut(specs, _nbytes, staging_bytes))


def _nbytes(s: TensorSpec) -> int:
    return s.nbytes

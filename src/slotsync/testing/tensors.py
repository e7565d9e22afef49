"""Synthetic weights that test ranks publish (moved from ``tests/trainer_script.py``, issue
16; the engines under test load a model of the same names, dtypes and shapes)."""

from __future__ import annotations

import torch


def make_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Round ``seed``'s weights, on the CPU, the same for every rank of a round: ``[(name,
    tensor)]`` of six tensors, 97,440 bytes in all, covering bfloat16, float32, float16 and
    bool, 1-D and 2-D (names as a transformer's: ``layers.<i>....weight``, ``lm_head.weight``).
    """
    g = torch.Generator().manual_seed(seed)
    return [
        ("layers.0.attn.qkv.weight", torch.randn(64, 48, generator=g).to(torch.bfloat16)),
        ("layers.0.mlp.up.weight", torch.randn(128, 64, generator=g)),
        ("layers.0.norm.weight", torch.randn(64, generator=g).to(torch.float16)),
        ("layers.1.mlp.up.weight", torch.randn(128, 64, generator=g)),
        ("layers.1.mask", torch.rand(32, generator=g) > 0.5),
        ("lm_head.weight", torch.randn(100, 64, generator=g)),
    ]


def make_draft_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Round ``seed``'s speculative-decoding draft model (issue 18), on the CPU: three float32
    tensors, 98,304 bytes. Two share a name (and shape) with ``make_tensors``' main model but
    hold other values, so that checksums tell which model a chunk landed in."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return [
        ("layers.0.mlp.up.weight", torch.randn(128, 64, generator=g)),
        ("fc.weight", torch.randn(64, 128, generator=g)),
        ("lm_head.weight", torch.randn(128, 64, generator=g)),
    ]

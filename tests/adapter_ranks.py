"""What the adapter-round tests share (issue 36): a rank's ``AdapterBegin`` built by hand
from real bytes (the rank side's ``Publisher.publish_adapter`` is tested on its own), the
PEFT config they carry, and the parts of one tensor split over ranks."""

from __future__ import annotations

import hashlib
import json

from slotsync.protocol import wire

CONFIG = json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                     "peft_type": "LORA", "bias": "none"}, sort_keys=True)
A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def tensor_bytes(name: str, rows: tuple[int, int], cols: int, version: int = 1,
                 itemsize: int = 4) -> bytes:
    """Deterministic bytes of rows ``[rows)`` of tensor ``name`` (``cols`` columns of
    ``itemsize`` bytes), different per version."""
    seed = hashlib.sha256(f"{name}/{version}".encode()).digest()
    whole = (seed * (1 + (rows[1] * cols * itemsize) // len(seed)))
    return whole[rows[0] * cols * itemsize:rows[1] * cols * itemsize]


def part(name: str, shape: tuple[int, int], rows: tuple[int, int], version: int = 1,
         dtype: str = "float32") -> tuple[wire.AdapterTensor, bytes]:
    """One tensor's part: its ``AdapterTensor`` and its bytes."""
    data = tensor_bytes(name, rows, shape[1], version)
    return (wire.AdapterTensor(name, dtype, list(shape), rows[0], rows[1],
                               hashlib.sha256(data).hexdigest()), data)


def begin(update_id: int, parts: list[tuple[wire.AdapterTensor, bytes]], version: int = 1,
          lora_name: str = "math", config: str = CONFIG) -> wire.AdapterBegin:
    return wire.AdapterBegin(update_id, lora_name, version, config, [t for t, _ in parts])


def laid_out(parts: list[tuple[wire.AdapterTensor, bytes]]) -> bytes:
    """A rank's part as its handle carries it: tensors back to back at
    ``wire.part_offsets``."""
    offsets, total = wire.part_offsets([t for t, _ in parts])
    buf = bytearray(total)
    for off, (_, data) in zip(offsets, parts, strict=True):
        buf[off:off + len(data)] = data
    return bytes(buf)


def two_rank_parts(version: int = 1) -> dict[int, list[tuple[wire.AdapterTensor, bytes]]]:
    """Ranks 0 and 1 of a slot: lora_A (4 x 16) whole on rank 0; lora_B (16 x 4) split in
    rows, [0, 10) on rank 0 and [10, 16) on rank 1."""
    return {0: [part(A, (4, 16), (0, 4), version), part(B, (16, 4), (0, 10), version)],
            1: [part(B, (16, 4), (10, 16), version)]}

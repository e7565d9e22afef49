"""Content checksums of tensors, shared by the reference engine and the demo's trainers.

Both sides call :func:`tensor_checksum` on their copy of a weight; equal strings mean equal
bytes (same dtype, same shape-independent byte sequence in row-major order).
"""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """SHA-256 (64 lowercase hex chars) of ``t``'s raw bytes.

    The tensor is detached, moved to CPU and made contiguous (row-major) first, so the result
    depends only on dtype and element values, not on the device or strides. Shape is not
    hashed: a ``[2, 3]`` and a ``[6]`` tensor with the same elements hash alike.

    Args:
        t: any dense tensor, any dtype (bfloat16 and float8 included), any device.
    """
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()

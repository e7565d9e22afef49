"""Content checksums of tensors, shared by the engines, the demo's trainers and the tests.

Both sides call :func:`tensor_checksum` on their copy of a weight; equal strings mean equal
bytes (same dtype, same shape-independent byte sequence in row-major order). It is the digest
vLLM's ``/weight_checker`` computes too (vLLM 0.32 ``model_loader/weight_checksum.py
compute_tensor_digests``: sha256 of ``weight.detach().cpu().contiguous().view(-1)
.view(torch.uint8)``). :func:`checksums_by_worker` reads either engine's ``/weight_checker``
answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

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


def checksums_by_worker(body: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """``{worker key: {weight name: sha256 hex}}`` from a ``/weight_checker``
    ``{"action": "checksum"}`` answer of either engine.

    * Reference engine: ``{"checksums": {gpu_uuid: {name: hex}}}``; worker key = the worker's
      GPU UUID.
    * vLLM (and the vLLM-code engine): ``{"checksums": {"dp0:pp0:pcp0:tp<i>:<name>": hex}}``
      (vLLM 0.32 ``Worker.compute_weight_checksums``, one flat dict over every worker); worker
      key = ``"tp<i>"`` when the DP, PP and PCP ranks are 0, else the whole
      ``"dp<d>:pp<p>:pcp<c>:tp<t>"`` prefix.

    Raises:
        KeyError: no ``checksums``.
        ValueError: a flat key without vLLM's four-part prefix.
    """
    sums = body["checksums"]
    if all(isinstance(v, Mapping) for v in sums.values()):
        return {str(k): {str(n): str(h) for n, h in v.items()} for k, v in sums.items()}
    out: dict[str, dict[str, str]] = {}
    for key, digest in sums.items():
        parts = str(key).split(":", 4)
        if len(parts) != 5 or not (parts[0].startswith("dp") and parts[1].startswith("pp")
                                   and parts[2].startswith("pcp") and parts[3].startswith("tp")):
            raise ValueError(f"checksum key {key!r} is not 'dp<d>:pp<p>:pcp<c>:tp<t>:<name>'")
        worker = parts[3] if parts[:3] == ["dp0", "pp0", "pcp0"] else ":".join(parts[:4])
        out.setdefault(worker, {})[parts[4]] = str(digest)
    return out

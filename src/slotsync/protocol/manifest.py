"""An update's tensor manifest: a 4-byte digest of each tensor's name, dtype and shape, in
send order (``wire.Begin.manifest``; no torch here).

Every rank of a slot must send the same tensors in the same order (design.md I2). The daemon
finds out at the first chunk that differs -- after the engine was paused. A rank that knows
its whole list up front (a list or mapping given to ``Publisher.publish``, or a vLLM
``WeightSource``'s ``metadata()``) sends its manifest with the begin instead; the daemon
compares the slot's manifests before the pause and names the first tensor (by position) where
they part (``first_difference``), and each rank's error names its own tensor there. Both
producer and consumer must use ``manifest_of``: ``DIGEST_BYTES`` bytes per tensor,
``blake2b`` of ``"<name>\\0<dtype name>\\0<dims, comma-separated>"``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

__all__ = ["DIGEST_BYTES", "first_difference", "manifest_of"]

DIGEST_BYTES = 4
"""Bytes of each tensor's entry (a chance of 2**-32 that two different tensors look alike)."""


def manifest_of(entries: Iterable[tuple[str, str, Sequence[int]]]) -> bytes:
    """The manifest of ``(name, dtype name, shape)`` entries in send order (dtype names as
    vLLM spells them, ``wire.DtypeName``; shapes in elements): ``DIGEST_BYTES`` per entry."""
    return b"".join(
        hashlib.blake2b(f"{name}\0{dtype}\0{','.join(map(str, shape))}".encode(),
                        digest_size=DIGEST_BYTES).digest()
        for name, dtype, shape in entries)


def first_difference(a: bytes, b: bytes) -> int:
    """The position of the first tensor where manifests ``a`` and ``b`` differ (the shorter
    one's length when one is a prefix of the other); -1 when they are equal."""
    if a == b:
        return -1
    n = min(len(a), len(b)) // DIGEST_BYTES
    lo, hi = 0, n  # the first differing entry lies in [lo, hi] (hi: a prefix)
    while lo < hi:  # binary search on prefixes: bytes comparisons run in C
        mid = (lo + hi) // 2
        if a[: (mid + 1) * DIGEST_BYTES] == b[: (mid + 1) * DIGEST_BYTES]:
            lo = mid + 1
        else:
            hi = mid
    return lo

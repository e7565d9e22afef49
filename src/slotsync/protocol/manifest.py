"""An update's tensor manifest: the tensor count and a digest of the names, dtypes and shapes
a rank will send, in order (``wire.Begin.manifest``; no torch here).

Every rank of a slot must send the same tensors in the same order (design.md I2). The daemon
finds out at the first chunk that differs -- after the engine was paused. A rank that knows
its whole list up front (a list or mapping given to ``Publisher.publish``, or a vLLM
``WeightSource``'s ``metadata()``) sends its manifest with the begin instead, and the daemon
refuses ranks whose manifests differ before the pause. Both producer and consumer must use
``manifest_of``: the format is ``"<count>:<first 32 hex digits of a SHA-256>"``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

__all__ = ["manifest_of", "describe"]


def manifest_of(entries: Iterable[tuple[str, str, Sequence[int]]]) -> str:
    """The manifest of ``(name, dtype name, shape)`` entries in send order (dtype names as
    vLLM spells them, ``wire.DtypeName``; shapes in elements)."""
    h = hashlib.sha256()
    count = 0
    for name, dtype, shape in entries:
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\n".encode())
        count += 1
    return f"{count}:{h.hexdigest()[:32]}"


def describe(manifest: str) -> str:
    """``"311 tensors (manifest 1a2b3c4d)"`` for an error message."""
    count, _, digest = manifest.partition(":")
    return f"{count} tensors (manifest {digest[:8]})"

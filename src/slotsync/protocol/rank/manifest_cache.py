"""The begin's manifest (``manifest.manifest_of``) from a digest per tensor kept across rounds.

A trainer publishes the same tensors, with the same names, dtypes and shapes, every round.
Computing the manifest afresh -- vLLM's dtype name and an int tuple per tensor, then a
``blake2b`` per tensor -- is ~10 ms for 6,291 tensors (Qwen3-30B-A3B, 16 layers) on the
critical path before the begin (issue 27: part of the 23 ms a packed round lost since
f836d34). ``DigestCache`` keys each tensor's ``DIGEST_BYTES`` on ``(name, dtype, shape)`` as
given (a ``torch.dtype`` or vLLM's name; a ``torch.Size`` or any int sequence), so a round
whose tensors did not change costs one dictionary lookup per tensor and produces exactly the
bytes ``manifest_of`` would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from slotsync.protocol.manifest import manifest_of

__all__ = ["DigestCache"]


class DigestCache:
    """Each ``(name, dtype, shape)``'s ``DIGEST_BYTES``-byte manifest entry, remembered.

    Args:
        entry_of: turns one ``(name, dtype, shape)`` into ``manifest_of``'s input
            ``(name, vLLM dtype name, int shape)``; raises ValueError for an unsupported
            dtype (the error propagates, nothing is remembered).
        max_entries: the cache is emptied when a manifest would take it over this many
            entries (names that change every round must not grow it without bound); at least
            the current manifest's length is kept.
    """

    def __init__(self, entry_of: Callable[[tuple[str, Any, Sequence[int]]],
                                          tuple[str, str, tuple[int, ...]]],
                 max_entries: int = 1 << 20) -> None:
        self._entry_of = entry_of
        self._max = max_entries
        self._digests: dict[tuple[str, Any, tuple[int, ...]], bytes] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def manifest(self, manifest: Sequence[tuple[str, Any, Sequence[int]]]) -> bytes:
        """``manifest_of`` of ``manifest``'s entries, in order (``DIGEST_BYTES`` each).

        Raises:
            ValueError: an unsupported dtype (from ``entry_of``).
        """
        digests = self._digests
        if len(digests) + len(manifest) > max(self._max, len(manifest)):
            digests.clear()
        get = digests.get
        out = []
        for name, dtype, shape in manifest:
            key = (name, dtype, shape if isinstance(shape, tuple) else tuple(shape))
            d = get(key)
            if d is None:
                d = digests[key] = manifest_of((self._entry_of((name, dtype, shape)),))
            out.append(d)
        return b"".join(out)

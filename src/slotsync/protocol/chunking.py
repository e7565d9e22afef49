"""The one chunking rule, and the bound of a chunk message's encoded size (no torch here).

Every rank of a slot must cut identical chunks from the same names and sizes (design.md I2),
so there is one rule, used by ``Publisher.publish``, its message-size pre-check,
``slotsync.bench.model.chunk_specs`` and the tests' trainer script: greedy, in iteration
order, a tensor starts a new chunk when it would take a non-empty chunk over ``limit`` bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from slotsync.protocol import wire

__all__ = ["MessageBound", "cut", "cuts_before"]

_T = TypeVar("_T")


def cuts_before(size: int, n: int, nonempty: bool, limit: int) -> bool:
    """Whether a tensor of ``n`` bytes starts a new chunk after ``size`` bytes of a chunk
    (``nonempty``: the chunk holds a tensor already) whose limit is ``limit`` bytes."""
    return nonempty and size + n > limit


def cut(items: Iterable[_T], size_of: Callable[[_T], int], limit: int) -> Iterator[list[_T]]:
    """The chunks of ``items`` (lazily, in order) under ``cuts_before``; ``size_of(item)``
    gives an item's bytes. A single item over ``limit`` makes a chunk of its own (callers
    that refuse such items check them first)."""
    chunk: list[_T] = []
    size = 0
    for item in items:
        n = size_of(item)
        if cuts_before(size, n, bool(chunk), limit):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += n
    if chunk:
        yield chunk


class MessageBound:
    """An upper bound of each chunk message's encoded size (msgpack, ``wire.OutgoingChunk``),
    from lengths only: the message's own fields, and per tensor beyond its name's UTF-8 bytes
    the name's header, its dtype name and size and, per dimension, its shape; a handle record
    (CUDA: ~270 bytes plus its size and stride tuples; shm: ~60), one per chunk packed, one
    per tensor unpacked. A few hundred bytes per message and a few dozen per tensor above
    the real size.

    Args:
        transport: ``"cuda"`` or ``"shm"``.
        packed: vLLM packed transfer (one handle per chunk) or unpacked (one per tensor).
    """

    CHUNK_BYTES, TENSOR_BYTES, DIM_BYTES = 128, 32, 9
    HANDLE_BYTES = {"cuda": 384, "shm": 96}

    def __init__(self, transport: str, packed: bool) -> None:
        handle = self.HANDLE_BYTES[transport]
        self.per_chunk = self.CHUNK_BYTES + (handle if packed else 0)
        self.per_dim = self.DIM_BYTES * (1 if packed or transport == "shm" else 3)
        self.per_tensor = self.TENSOR_BYTES + (0 if packed else handle)

    def worst(self, count: int) -> int:
        """The bound of one message of ``count`` tensors of the longest names and most
        dimensions the wire allows, in bytes."""
        worst = 4 * wire.MAX_NAME_CHARS + self.per_tensor + self.per_dim * wire.MAX_DIMS
        return self.per_chunk + worst * count

    def check(self, items: Iterable[tuple[str, int, int]], limit: int, cap: int) -> None:
        """Refuse a chunk whose message would exceed ``cap`` bytes (the daemon's
        ``max_message_bytes``), cutting ``items`` (``(name, dims, bytes)`` in publish order)
        into chunks of at most ``limit`` bytes as ``publish`` does.

        Raises:
            ValueError: names the chunk, its tensor count and both sizes.
        """
        index, count, size, bound = 0, 0, 0, self.per_chunk
        for name, dims, n in items:
            if cuts_before(size, n, bool(count), limit):
                index, count, size, bound = index + 1, 0, 0, self.per_chunk
            size += n
            count += 1
            bound += (len(name) if name.isascii() else len(name.encode())) + self.per_tensor \
                + self.per_dim * dims
            if bound > cap:
                raise ValueError(
                    f"chunk {index} of this update would encode to about {bound} bytes or more "
                    f"({count}+ tensors: their names, shapes and handles), over the daemon's "
                    f"max_message_bytes of {cap}: raise the daemon's --max-message-bytes (or "
                    "send fewer tensors per chunk: a smaller staging_bytes)"
                )

"""Hold Python's cyclic garbage collector off while an update is on the wire.

Why: a trainer process holds hundreds of thousands of objects (the model, the optimizer, the
framework). A round of ``Publisher.publish`` allocates some tens of thousands more that live
as long as the round (the checked ``(name, tensor, bytes)`` triples, each chunk's byte views,
its messages) and so outlive the collector's young generations. Every few rounds they tip
CPython's threshold for a full collection, which walks every object of the process -- finding
nothing to free -- while the engine is paused waiting for the next chunk. That was the
"every third round is slow" of issue 27 (``slotsync bench gpu``, 512 MiB x 4 regions; a full
collection of the bench's rank process is 15-300 ms, see BENCHMARKS.md).

Reference counting still frees everything that is not in a cycle while collections are held;
the collection the round postponed runs at the process's next allocations after it, outside
the engine's pause. Megatron-LM's ``--manual-gc`` takes the same approach for a training step.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

__all__ = ["collections_held", "held_during"]

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_holders = 0  # threads inside collections_held() that found the collector enabled


@contextlib.contextmanager
def collections_held() -> Iterator[None]:
    """Disable the cyclic collector for the ``with`` body if it is enabled; enable it again
    when the last holder leaves (nested and concurrent holders -- several publishers in one
    process -- count). A collector disabled before the first holder entered stays disabled
    and untouched; one that another thread disables while a holder is inside is enabled again
    when the last holder leaves (the collector has one switch for the whole process)."""
    global _holders
    with _lock:
        if _holders == 0 and not gc.isenabled():
            held = False
        else:
            held = True
            _holders += 1
            gc.disable()
    try:
        yield
    finally:
        if held:
            with _lock:
                _holders -= 1
                if _holders == 0:
                    gc.enable()


def held_during(method: Callable[P, T]) -> Callable[P, T]:
    """Decorator: run ``method`` inside ``collections_held()``."""

    @functools.wraps(method)
    def held(*args: P.args, **kwargs: P.kwargs) -> T:
        with collections_held():
            return method(*args, **kwargs)

    return held

"""The worker's end of the pool's pipe (``slotsync.engine.pool``), for both worker kinds.

The protocol: once at start the worker sends ``("ready", {"gpu_uuid": str, "device": str})``
or ``("err", traceback text)``; then it answers each ``(method, kwargs)`` request, in order,
with ``("ok", result)`` or ``("err", str(exception))`` -- what vLLM's ``WorkerProc`` sends back
(``str(output)``; an ``AssertionError`` without a message gives ``""``) -- until
``("exit", {})`` (answered ``("ok", None)``) or until the parent goes away.

Used by the reference worker (``slotsync.engine.reference.worker``) and the vLLM-code worker
(``slotsync.engine.vllm.worker``).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar


class _Started(Protocol):
    gpu_uuid: str
    device: Any


S = TypeVar("S", bound=_Started)


def start_worker(conn: Connection, build: Callable[[], S]) -> S | None:
    """A worker process's start: SIGTERM once the parent dies (even by SIGKILL), then
    ``build()`` the worker's state and send ``("ready", {"gpu_uuid", "device"})``, or
    ``("err", traceback)`` and None when ``build`` raised."""
    from slotsync.testing.processes import die_with_parent
    from slotsync.testing.vllm_notices import hide_triton_notice_if_asked

    die_with_parent()  # SIGTERM when the engine's front dies, even by SIGKILL
    hide_triton_notice_if_asked()  # the front has shown vLLM's Triton notice: not once a worker
    try:
        state = build()
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return None
    conn.send(("ready", {"gpu_uuid": state.gpu_uuid, "device": str(state.device)}))
    return state


def next_request(conn: Connection) -> tuple[str, dict[str, Any]] | None:
    """The next ``(method, kwargs)`` (``exit`` included: the caller answers it, after any
    answer it still holds); None once the parent is gone (or on Ctrl-C)."""
    try:
        method, kwargs = conn.recv()
    except (EOFError, OSError, KeyboardInterrupt):
        return None
    return method, kwargs


def failure(index: int, method: str, e: Exception) -> tuple[str, Any]:
    """The answer to a call that raised ``e`` (``("err", str(e))``, vLLM's ``WorkerProc``:
    any ``Exception`` becomes a FAILURE reply), after printing its traceback to stderr, each
    line prefixed ``[worker <index>]``. Call it inside the ``except`` block."""
    tb = traceback.format_exc().rstrip().replace("\n", f"\n[worker {index}] ")
    print(f"[worker {index}] {method} failed: {tb}", file=sys.stderr, flush=True)
    return ("err", str(e))

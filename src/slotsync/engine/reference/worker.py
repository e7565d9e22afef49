"""One reference-engine worker process: serve a :class:`WorkerState` over the pool's pipe.

The parent process (``slotsync.engine.reference.server`` through ``slotsync.engine.pool``) talks to
the
worker over one ``multiprocessing`` pipe (``slotsync.engine.worker_pipe``): it sends
``(method, kwargs)`` and receives ``("ok", result)`` or ``("err", message)``, one answer per
request, in order. A packed chunk is answered only once its copies on the device are done
(vLLM synchronizes before answering), but when the next request is already waiting the worker
prepares it -- decode, map, launch its copy behind the first -- before it waits for the first
chunk's copy: the CPU work of one chunk overlaps the device's copy of the one before
(``overlapped_chunks``).

The state machine is ``slotsync.engine.reference.worker_state`` (re-exported here: ``WorkerSpec``,
``WorkerState``, ``worker_device`` and the error texts), the payload parser
``slotsync.engine.reference.payload`` (``parse_update_info``, ``ParsedUpdate``), the weights and the
receive path ``slotsync.engine.reference.weight_loader``. :class:`WorkerPool` is the shared
pool (``slotsync.engine.pool``) with :func:`worker_main` as its workers' entry point: the
reference engine's front starts its workers with it.
"""

from __future__ import annotations

import cProfile
import os
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from slotsync.engine import pool
from slotsync.engine.reference.payload import ParsedUpdate, parse_update_info
from slotsync.engine.reference.worker_state import (
    FINISH_INACTIVE_MSG,
    NOT_SERVABLE_MSG,
    SHUTDOWN_ACTIVE_MSG,
    START_ACTIVE_MSG,
    UPDATE_INACTIVE_MSG,
    WorkerSpec,
    WorkerState,
)
from slotsync.engine.worker_device import worker_device
from slotsync.engine.worker_pipe import failure, next_request, start_worker

__all__ = [
    "FINISH_INACTIVE_MSG", "NOT_SERVABLE_MSG", "SHUTDOWN_ACTIVE_MSG", "START_ACTIVE_MSG",
    "UPDATE_INACTIVE_MSG", "ParsedUpdate", "WorkerPool", "WorkerSpec", "WorkerState",
    "parse_update_info", "worker_device", "worker_main",
]


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process (multiprocessing, spawn context).

    Sends ``("ready", {"gpu_uuid", "device"})`` or ``("err", traceback)`` once, then serves
    ``(method, kwargs)`` requests until ``("exit", {})`` or until the parent goes away.
    """
    state = start_worker(conn, lambda: WorkerState(spec))
    if state is None:
        return
    # SLOTSYNC_PROFILE_DIR (``slotsync bench gpu --profile``): cProfile every update_weights
    # call and write engine-worker-<index>.prof there when the worker exits.
    prof_dir = os.environ.get("SLOTSYNC_PROFILE_DIR")
    prof = cProfile.Profile() if prof_dir else None
    try:
        _serve(state, spec, conn, prof)
    finally:
        if prof is not None and prof_dir:
            prof.dump_stats(os.path.join(prof_dir, f"engine-worker-{spec.index}.prof"))


def _serve(state: WorkerState, spec: WorkerSpec, conn: Connection,
           prof: cProfile.Profile | None) -> None:
    """Answer requests in order. ``held``: the answer of an ``update_weights`` whose copy
    still runs on the device; it goes out once that copy is done -- at once when no request
    is waiting, else after the next ``update_weights`` was prepared and launched."""
    held: tuple[str, Any] | None = None
    while True:
        if held is not None and not conn.poll(0):
            state.wait_copies()
            conn.send(held)
            held = None
        request = next_request(conn)
        if request is None:
            return
        method, kwargs = request
        deferrable = method == "update_weights" and not kwargs.get("inject")
        if held is not None and not deferrable:  # nothing else runs before it is answered
            state.wait_copies()
            conn.send(held)
            held = None
        if method == "exit":
            conn.send(("ok", None))
            return
        before = state.copies_pending
        state.defer_copy_wait = deferrable
        try:
            fn = getattr(state, method)
            if prof is not None and method == "update_weights":
                result = prof.runcall(fn, **kwargs)
            else:
                result = fn(**kwargs)
            answer: tuple[str, Any] = ("ok", result)
        except Exception as e:
            answer = failure(spec.index, method, e)
        finally:
            state.defer_copy_wait = False
        launched = state.copies_pending > before
        if held is not None:  # the previous chunk's answer first, once its copy is done
            state.wait_copies(keep=1 if launched else 0)
            conn.send(held)
            held = None
        if launched:
            held = answer
        else:
            state.wait_copies()
            conn.send(answer)


class WorkerPool(pool.WorkerPool):
    """The reference engine's workers: :class:`slotsync.engine.pool.WorkerPool` with
    :func:`worker_main` as each worker's entry point (``target``: another, for tests)."""

    def __init__(self, specs: Sequence[WorkerSpec], startup_timeout_s: float = 300.0,
                 target: pool.WorkerMain = worker_main, data_parallel_size: int = 1,
                 preload: Sequence[str] = ()) -> None:
        super().__init__(specs, target, startup_timeout_s=startup_timeout_s,
                         data_parallel_size=data_parallel_size, preload=preload)

"""The executor behind the vLLM-code engine's engine core (``slotsync.engine.vllm.engine_client``):
``collective_rpc`` over the worker processes with vLLM's reply handling.

Rules, from vLLM 0.32 (``v1/executor/uniproc_executor.py``, ``multiproc_executor.py``,
``abstract.py``):

* every worker runs every call, even when another one fails;
* errors: with one worker the worker's own error (``UniProcExecutor``), with several
  ``RuntimeError(f"Worker failed with error '{msg}', please check the stack trace above for
  the root cause")`` for the first failing worker in rank order (``MultiprocExecutor``);
* ``MultiprocExecutor.collective_rpc``'s ``get_response`` (``multiproc_executor.py:433-449``)
  reads the workers' replies in rank order and raises at the first failure *without reading
  the later workers' replies*; those stay in their queues and are read by the next calls
  (which then see a stale reply). With ``replies="vllm"`` (the default) the stand-in does the
  same; ``replies="all"`` reads every reply of each call (the reference engine's behaviour);
* ``Executor.sleep / wake_up`` keep ``sleeping_tags``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from slotsync.engine.pool import WorkerPool

logger = logging.getLogger("slotsync.engine.vllm")

WORKER_FAILED = (
    "Worker failed with error '{msg}', please check the stack trace above for the root cause"
)
"""vLLM 0.32 ``MultiprocExecutor.collective_rpc``'s error for a failing worker."""


class WorkerCallError(Exception):
    """A worker's error as ``UniProcExecutor`` propagates it (one worker): ``str()`` is the
    worker's own ``str(exception)``."""


class ExecutorStandIn:
    """The executor behind the engine core: ``collective_rpc`` over the worker pool with
    vLLM's reply handling, and ``Executor.sleep / wake_up / discard`` bookkeeping
    (``sleeping_tags``, vLLM 0.32 ``v1/executor/abstract.py``).

    Args:
        pool: the worker processes.
        replies: ``"vllm"``: read replies as ``MultiprocExecutor`` does (stop at the first
            failure; later workers' replies stay queued for the next calls); ``"all"``: read
            every reply of each call.
    """

    def __init__(self, pool: WorkerPool, replies: str = "vllm") -> None:
        if replies not in ("vllm", "all"):
            raise ValueError(f"replies must be 'vllm' or 'all', not {replies!r}")
        self.pool = pool
        self.replies = replies
        self.unread: list[collections.deque[asyncio.Future]] = [
            collections.deque() for _ in pool.workers
        ]
        self.sleeping_tags: set[str] = set()

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self.pool.world_size

    @property
    def is_sleeping(self) -> bool:
        """``Executor.is_sleeping``: any sleeping tag."""
        return bool(self.sleeping_tags)

    async def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                             inject: dict[int, str] | None = None,
                             every_engine: bool = False) -> list[Any]:
        """Run ``method`` on every worker; their results in rank order. ``every_engine``:
        no effect (one engine core; ``slotsync.engine.vllm.dp`` has several).

        Raises:
            WorkerCallError: one worker, and it failed.
            RuntimeError: several workers, one failed (``WORKER_FAILED`` of the first
                failing reply read).
        """
        futs = await self.pool.submit(method, kwargs, inject=inject)
        if len(futs) == 1:  # UniProcExecutor: the worker method runs in the engine core
            ok, payload = await futs[0]
            if not ok:
                raise WorkerCallError(payload)
            return [payload]
        for q, f in zip(self.unread, futs, strict=True):
            q.append(f)
        results: list[Any] = []
        failed: str | None = None
        for q in self.unread:
            if failed is not None and self.replies == "vllm":
                break  # get_response raised: later workers' replies stay unread
            ok, payload = await q.popleft()
            if not ok and failed is None:
                failed = str(payload)
            results.append(payload)
        if failed is not None:
            raise RuntimeError(WORKER_FAILED.format(msg=failed))
        return results

    def unread_replies(self) -> list[int]:
        """Replies each worker sent (or will send) that no call has read yet."""
        return [len(q) for q in self.unread]

    async def sleep(self, level: int, inject: dict[int, str] | None = None) -> None:
        """``Executor.sleep(level)``."""
        from vllm.v1.executor.abstract import SLEEP_TAGS

        if "weights" in self.sleeping_tags:
            logger.warning("Executor is already sleeping.")
            return
        await self.collective_rpc("sleep", {"level": level}, inject)
        self.sleeping_tags |= SLEEP_TAGS

    async def wake_up(self, tags: list[str] | None,
                      inject: dict[int, str] | None = None) -> None:
        """``Executor.wake_up(tags)``."""
        if not self.is_sleeping:
            logger.warning("Executor is not sleeping.")
            return
        if tags:
            for tag in tags:
                if tag not in self.sleeping_tags:
                    logger.warning("Tag %s is not in sleeping tags %s", tag,
                                   self.sleeping_tags)
                    return
        await self.collective_rpc("wake_up", {"tags": tags}, inject)
        if tags:
            for tag in tags:
                self.sleeping_tags.remove(tag)
        else:
            self.sleeping_tags.clear()

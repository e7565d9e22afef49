"""Data-parallel engine cores behind one API server, for the vLLM-code engine
(``python -m slotsync.engine --impl vllm --data-parallel-size D``).

One ``vllm serve --data-parallel-size D --tensor-parallel-size TP`` runs D engine cores, each
with its own executor over TP workers, behind one ``AsyncLLM`` whose client is a
``DPLBAsyncMPClient`` (internal load balancing; vLLM 0.32 ``v1/engine/core_client.py``
``make_async_mp_client``). The rules mirrored here, from that client:

* every utility call goes to every engine core (``DPLBAsyncMPClient.call_utility_async`` =
  ``call_utility_all_async``: ``asyncio.gather`` over ``core_engines``) and answers **engine
  0's** result only -- so ``collective_rpc`` (``POST /collective_rpc``) returns the TP results
  of DP replica 0, not D x TP;
* a failure in any engine core fails the call with that core's own error (``Exception("Call
  to <utility> method failed: <msg>")``, the core's executor having wrapped ``<msg>`` as
  ``MultiprocExecutor`` does when it has several workers); ``gather`` raises the first
  failure in time, and the other cores still run the call;
* ``compute_weight_checksums`` concatenates every core's per-worker dicts
  (``compute_weight_checksums_async``); the keys do not collide because each worker's
  prefix is ``dp<data_parallel_index>:pp<p>:pcp<c>:tp<t>:`` (``gpu_worker.py``
  ``_weight_checksum_prefix``).

Worker ``i`` (global order, the order of ``--gpu-uuids``) is TP rank ``i % TP`` of DP replica
``i // TP``: the index vLLM's ``Worker.update_weights`` takes from a list-form
``update_info`` (``data_parallel_index * world_size + rank``).

Kept as one engine-core lock (``VllmEngineClient``): calls reach every core in arrival order,
as they do in vLLM; the cores' separate busy loops are not modelled.
"""

from __future__ import annotations

import asyncio
from typing import Any

from slotsync.engine.pool import WorkerPool
from slotsync.engine.vllm.executor import ExecutorStandIn


class WorkerGroup:
    """The workers of one DP replica, as an :class:`ExecutorStandIn` uses a pool.

    Args:
        pool: every worker of the engine.
        indices: this replica's global worker indices (``range(d * TP, (d + 1) * TP)``).
    """

    def __init__(self, pool: WorkerPool, indices: range) -> None:
        self.pool = pool
        self.indices = indices
        self.workers = [pool.workers[i] for i in indices]

    @property
    def world_size(self) -> int:
        """Workers of this replica (TP)."""
        return len(self.workers)

    async def submit(self, method: str, kwargs: dict[str, Any] | None = None,
                     per_worker: list[dict[str, Any]] | None = None,
                     inject: dict[int, str] | None = None) -> list[asyncio.Future]:
        """``WorkerPool.submit`` to this replica's workers only (``inject``: global
        indices)."""
        return await self.pool.submit(method, kwargs, per_worker, inject, only=self.indices)


class DPExecutorStandIn:
    """D engine cores' executors (one :class:`ExecutorStandIn` per DP replica) with the
    interface of one, fanned out as ``DPLBAsyncMPClient`` does (module docstring).

    Args:
        pool: the engine's workers, ``pool.data_parallel_size`` replicas of ``pool.tp_size``.
        replies: see :class:`ExecutorStandIn`.
    """

    def __init__(self, pool: WorkerPool, replies: str = "vllm") -> None:
        tp = pool.tp_size
        self.pool = pool
        self.engines = [
            ExecutorStandIn(WorkerGroup(pool, range(d * tp, (d + 1) * tp)), replies)  # type: ignore[arg-type]
            for d in range(pool.data_parallel_size)
        ]

    @property
    def world_size(self) -> int:
        """Every worker of every replica (D x TP)."""
        return self.pool.world_size

    @property
    def is_sleeping(self) -> bool:
        """Any replica's executor has a sleeping tag."""
        return any(e.is_sleeping for e in self.engines)

    @property
    def sleeping_tags(self) -> set[str]:
        """The union of the replicas' sleeping tags (assigning sets every replica's)."""
        out: set[str] = set()
        for e in self.engines:
            out |= e.sleeping_tags
        return out

    @sleeping_tags.setter
    def sleeping_tags(self, tags: set[str]) -> None:
        for e in self.engines:
            e.sleeping_tags = set(tags)

    def unread_replies(self) -> list[int]:
        """Every worker's unread replies, global order."""
        return [n for e in self.engines for n in e.unread_replies()]

    async def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                             inject: dict[int, str] | None = None,
                             every_engine: bool = False) -> list[Any]:
        """``method`` on every replica (``gather``): replica 0's results, or with
        ``every_engine`` every replica's, concatenated in global order.

        Raises:
            WorkerCallError, RuntimeError: the first replica failure in time (as
                :meth:`ExecutorStandIn.collective_rpc` raises it).
        """
        per_engine = await asyncio.gather(
            *(e.collective_rpc(method, kwargs, inject) for e in self.engines))
        if every_engine:
            return [r for results in per_engine for r in results]
        return per_engine[0]

    async def sleep(self, level: int, inject: dict[int, str] | None = None) -> None:
        """``Executor.sleep(level)`` on every replica."""
        await asyncio.gather(*(e.sleep(level, inject) for e in self.engines))

    async def wake_up(self, tags: list[str] | None,
                      inject: dict[int, str] | None = None) -> None:
        """``Executor.wake_up(tags)`` on every replica."""
        await asyncio.gather(*(e.wake_up(tags, inject) for e in self.engines))

"""SGLang's scheduler, for the SGLang engines' HTTP front: control calls one at a time, in
arrival order, over the TP-rank worker processes, and the weight-update handlers that drive
the ranks.

The front (``slotsync.engine.sglang.server``) is SGLang's tokenizer side: it validates and
authenticates the bodies, keeps the pause flag, takes the writer side of
``model_update_lock`` (:meth:`Scheduler.writer_lock`) and queues each call here
(:meth:`Scheduler.dispatch`); the scheduler runs them in order (SGLang's scheduler event loop,
``srt/managers/scheduler.py``), asks ``slotsync.engine.sglang.state`` what the rules say, and
calls every TP rank (``slotsync.engine.sglang.worker``) through the shared pool
(``slotsync.engine.pool``), the TP barrier being every rank's answer (:meth:`Scheduler.ranks`).
Paths are inside the SGLang wheel; "L<a> / L<b> / L<c>" is the line in 0.5.23 / 0.5.21 /
0.5.20 (docs/sglang-contract.md).

A scheduler exception -- anything a rank raises (a refused global, an unknown GPU UUID, too
few entries, a misaligned bucket tensor, an unknown ``load_format``, a name the model lacks),
or the flush ``assert`` of 0.5.20 / 0.5.21 -- kills the engine as SGLang's
``run_scheduler_process`` (scheduler.py L6370-6373: SIGQUIT to the parent) and the
tokenizer's ``running_phase_sigquit_handler`` (tokenizer_manager.py L4072-4082:
``kill_process_tree``, the server SIGKILLs itself) do: the connection of the call is reset
(RST), every rank is killed, then the front SIGKILLs itself (:meth:`Scheduler.die`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from slotsync.engine.pool import WorkerPool
from slotsync.engine.sglang.scheduler_code import SglangSchedulerCode
from slotsync.engine.sglang.state import FLUSH_BUSY, FLUSH_TIMED_OUT, SglangState


class SchedulerDied(Exception):
    """A scheduler exception: the engine dies of it (module docstring)."""


class Scheduler:
    """SGLang's scheduler over one :class:`WorkerPool` of TP ranks (module docstring).

    Args:
        pool: the TP-rank workers, rank order.
        state: the engine-level state (shared with the front).
        frees_before_barrier: the ranks free the received tensors before answering (0.5.20),
            else rank 0 frees them after the TP barrier, before the reply (0.5.21+).
        code: SGLang's own pause, idle rule, flush and flush wrapper
            (``slotsync.engine.sglang.scheduler_code``, the SGLang-code engine), or None for
            the mirror of them in ``SglangState`` and here.
    """

    def __init__(self, pool: WorkerPool, state: SglangState, frees_before_barrier: bool,
                 code: SglangSchedulerCode | None = None) -> None:
        self.pool = pool
        self.state = state
        self.frees_before_barrier = frees_before_barrier
        self.code = code
        self.flush_waiter: asyncio.Future | None = None
        """A flush waiting for the scheduler to be idle (``SchedulerFlushWrapper``)."""
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._changed: asyncio.Condition | None = None
        self._dying = False

    async def start(self) -> None:
        """Start the scheduler loop (on the front's event loop)."""
        self._queue = asyncio.Queue()
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        """Cancel the scheduler loop."""
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        """SGLang's scheduler: control requests one at a time, in arrival order; any
        exception in a handler kills the engine."""
        assert self._queue is not None
        while True:
            if self.code is not None and self.code.pending():
                # SGLang's loop calls check_pending every turn (scheduler.py L2261)
                try:
                    fn, fut, request = await asyncio.wait_for(self._queue.get(), 0.02)
                except TimeoutError:
                    self.code.check_pending()
                    continue
            else:
                fn, fut, request = await self._queue.get()
            try:
                result = await fn()
            except Exception as e:  # noqa: BLE001 - every scheduler exception is fatal
                await self.die(request, str(e) if isinstance(e, SchedulerDied)
                               else f"{type(e).__name__}: {e}")
                return
            if not fut.done():
                fut.set_result(result)
            if self.code is not None:
                self.code.check_pending()
            await self.notify()

    def dispatch(self, fn: Callable[[], Awaitable[Any]], request: web.Request | None
                 ) -> asyncio.Future:
        """Queue ``fn`` for the scheduler (in order); the future of its result."""
        assert self._queue is not None
        fut = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((fn, fut, request))
        return fut

    async def notify(self) -> None:
        """Requests or the scheduler changed: wake the writer-lock waiters and a pending
        flush."""
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def writer_lock(self) -> None:
        """``model_update_lock.writer_lock``: wait until no generate request runs or waits."""
        assert self._changed is not None
        async with self._changed:
            await self._changed.wait_for(lambda: self.state.requests.inflight == 0)

    async def die(self, request: web.Request | None, why: str) -> None:
        """Die as SGLang's server does on a scheduler exception (module docstring)."""
        if self._dying:
            return
        self._dying = True
        print(f"[slotsync.engine] Scheduler hit an exception: {why}", file=sys.stderr,
              flush=True)
        print("[slotsync.engine] SIGQUIT received. It usually means one child failed. "
              "(kill_process_tree: every rank, then this process)", file=sys.stderr,
              flush=True)
        transport = request.transport if request is not None else None
        if transport is not None:
            sock = transport.get_extra_info("socket")
            try:  # linger 0: close() sends RST, the client sees a reset (TCP)
                if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                    struct.pack("ii", 1, 0))
            except OSError:
                pass
            transport.abort()
            await asyncio.sleep(0.05)  # (abort closes the socket on the next loop turns)
        for w in self.pool.workers:
            if w.process.is_alive():
                w.process.kill()
        for w in self.pool.workers:
            w.process.join(5)
        os.kill(os.getpid(), signal.SIGKILL)

    async def ranks(self, method: str, kwargs: dict[str, Any] | None = None,
                    inject: dict[int, str] | None = None) -> list[Any]:
        """``method`` on every rank; their results in rank order (the TP barrier).

        Raises:
            SchedulerDied: a rank raised (or is gone).
        """
        futs = await self.pool.submit(method, kwargs, inject=inject)
        answers = await asyncio.gather(*futs)
        for i, (ok, payload) in enumerate(answers):
            if not ok:
                raise SchedulerDied(f"TP rank {i}: {payload}")
        return [p for _, p in answers]

    # -- the weight-update handlers (run through dispatch) ---------------------------------

    async def begin(self, selector: str, inject: dict[int, str] | None) -> tuple[bool, str]:
        """Open the session (weight_updater.py L309-321 / L290-302): (success, message)."""
        refused = self.state.begin(selector)
        if refused is not None:
            return False, refused
        if selector != "draft":  # _select_runners: no draft runner here
            await self.ranks("begin_weight_update", inject=inject)
        self.state.opened(selector)
        return True, "Success"

    async def end(self, inject: dict[int, str] | None) -> tuple[bool, str]:
        """Close the session (L323-335 / L304-316): (success, message)."""
        refused = self.state.end()
        if refused is not None:
            return False, refused
        session = self.state.session
        assert session is not None
        if session.selector != "draft":
            await self.ranks("end_weight_update",
                             {"run_post_load": not session.loaded_weights}, inject)
        self.state.closed()
        return True, "Success"

    async def update(self, entries: Any, load_format: str | None, load_target: bool,
                     weight_version: str | None, flush_cache: bool,
                     inject: dict[int, str] | None) -> tuple[bool, str]:
        """``update_weights_from_tensor``'s scheduler half: every rank loads its own entry,
        then the version's flush and version steps, the TP barrier, and (0.5.21+) rank 0
        frees the received tensors. (success, message).

        Raises:
            SchedulerDied: a rank raised (or is gone).
        """
        refused = self.state.update_refusal()
        if refused is not None:  # returns on every rank before any barrier
            return False, refused
        await self.ranks("update_weights_from_tensor", {
            "entries": entries, "load_format": load_format,
            "load_target": load_target,
            "free_before_reply": self.frees_before_barrier}, inject)
        success, message = self.state.after_load(weight_version, flush_cache)
        # the TP barrier has passed (every rank answered); 0.5.21+: the handler returns,
        # each rank frees the received tensors, rank 0 then replies
        if not self.frees_before_barrier:
            futs = await self.pool.submit("release")
            ok, why = await futs[0]
            if not ok:
                raise SchedulerDied(f"TP rank 0: {why}")
        return success, message

    def pause(self, mode: str) -> None:
        """``Scheduler.pause_generation`` (``in_place`` or ``retract``): SGLang's own code
        where the engine runs it, else ``SglangState.scheduler_pause``."""
        if self.code is not None:
            self.code.pause(mode)
        else:
            self.state.scheduler_pause(mode)

    async def flush(self, timeout: float) -> Any:
        """``SchedulerFlushWrapper.handle``: (ok, message) at once, or the future of it when
        the flush waits up to ``timeout`` seconds for the scheduler to be idle (SGLang's own
        wrapper and ``Scheduler.flush_cache`` where the engine runs them, else the mirror)."""
        if self.code is not None:
            waiter = asyncio.get_running_loop().create_future()

            def answer(ok: bool, message: str) -> None:
                self.flush_waiter = None
                if not waiter.done():
                    waiter.set_result((ok, message))

            now = self.code.flush(timeout, answer)
            if now is not None:
                return now
            self.flush_waiter = waiter
            return waiter
        if self.flush_waiter is not None:
            return False, FLUSH_BUSY
        if timeout <= 0.0 or self.state.is_fully_idle():
            return self.state.flush(), ""
        self.flush_waiter = asyncio.get_running_loop().create_future()
        asyncio.create_task(self._pending_flush(time.monotonic() + timeout))
        return self.flush_waiter

    async def _pending_flush(self, deadline: float) -> None:
        """``SchedulerFlushWrapper.check_pending``: flush once fully idle (waiting requests
        counted), or time out."""
        assert self._changed is not None and self.flush_waiter is not None
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.state.is_fully_idle()),
                    max(0.0, deadline - time.monotonic()))
                result = (self.state.flush(), "")
            except TimeoutError:
                result = (False, FLUSH_TIMED_OUT)
        waiter, self.flush_waiter = self.flush_waiter, None
        waiter.set_result(result)

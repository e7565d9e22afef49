"""Worker processes of an engine and a ``collective_rpc`` over them (both engine impls).

Each worker is one process (forked on CPU, spawned on CUDA: :func:`start_method`) serving
``(method, kwargs)`` requests over a ``multiprocessing`` pipe, one at a time, in the order
they were written; it answers each with ``("ok", result)`` or ``("err", message)``. What a
worker runs is the ``target`` its engine family hands to :class:`WorkerPool` (the reference
engine's ``slotsync.engine.reference.worker.worker_main``, the vLLM-code engine's
``slotsync.engine.vllm.worker.vllm_worker_main``, the SGLang engines'
``slotsync.engine.sglang.worker.sglang_worker_main``): this module, shared by the families,
imports none of them.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import multiprocessing as mp
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

Kwargs = dict[str, Any] | None
"""Keyword arguments of a worker call, the same for every worker."""
PerWorker = list[dict[str, Any]] | None
"""Keyword arguments per worker, in rank order (overrides ``Kwargs``)."""
Inject = dict[int, str] | None
"""``{worker index: message}``: test faults raised inside the call on those workers."""
Answer = tuple[bool, Any]
"""A worker's answer: (ok, result or error text)."""


class WorkerSpec(Protocol):
    """What the pool reads of a worker's spec (each family's spec dataclass has more)."""

    @property
    def index(self) -> int:
        """The worker's rank within the engine (0-based)."""

    @property
    def device(self) -> Any:
        """``"cpu"`` or ``"cuda:<i>"``."""

    @property
    def gpu_uuid(self) -> str | None:
        """The GPU UUID it answers to (None: on CUDA, the GPU's own)."""


WorkerMain = Callable[[Any, Connection], None]
"""A worker process's entry point, ``target(spec, conn)``: it serves the pool's pipe
(``slotsync.engine.worker_pipe``) until told to exit."""


START_METHOD_ENV = "SLOTSYNC_ENGINE_START_METHOD"
"""Overrides :func:`start_method`: ``fork``, ``spawn`` or ``forkserver``."""


def start_method(specs: Sequence[Any]) -> str:
    """How the workers of ``specs`` start: ``$SLOTSYNC_ENGINE_START_METHOD`` if set, else
    ``fork`` when every worker is on the CPU and ``spawn`` otherwise.

    Forked workers share the parent's imports (torch, and vLLM's for the vLLM-code engine:
    several seconds of CPU per worker saved, issue 24); a CUDA worker is spawned, as vLLM
    does once CUDA may be in use (``VLLM_WORKER_MULTIPROC_METHOD``).

    Raises:
        ValueError: the variable names another method.
    """
    chosen = os.environ.get(START_METHOD_ENV, "")
    if chosen:
        if chosen not in ("fork", "spawn", "forkserver"):
            raise ValueError(f"{START_METHOD_ENV}={chosen!r}: use fork, spawn or forkserver")
        return chosen
    on_cpu = all(str(getattr(s, "device", "cpu")) == "cpu" for s in specs)
    return "fork" if on_cpu else "spawn"


class CollectiveRpcError(Exception):
    """One or more workers failed a fanned-out call.

    Attributes:
        errors: ``[(worker index, message)]`` in rank order, failing workers only.
        world_size: number of workers of one engine core: the engine's workers, or with
            ``--data-parallel-size D`` those of one DP replica (TP x PP; each DP replica of
            one ``vllm serve`` is its own engine core and executor, so vLLM 0.32 wraps a
            worker's error only when that replica has several workers).
    """

    def __init__(self, errors: list[tuple[int, str]], world_size: int) -> None:
        self.errors = errors
        self.world_size = world_size
        super().__init__(self.api_message())

    def api_message(self, utility: str = "collective_rpc") -> str:
        """The ``error.message`` vLLM puts in the 500 body: ``Call to <utility> method failed:
        <msg>`` (vLLM 0.32 ``EngineCoreProc._invoke_utility_method``; ``utility`` is
        ``collective_rpc`` for the weight routes, ``compute_weight_checksums`` for
        ``/weight_checker``), ``<msg>`` wrapped ``Worker failed with error '<msg>', please
        check the stack trace above for the root cause`` with several workers
        (``MultiprocExecutor``), then stripped as vLLM's ``sanitize_message`` strips it (a
        bare ``AssertionError`` on one worker gives ``Call to collective_rpc method
        failed:``)."""
        msg = self.errors[0][1]
        if self.world_size > 1:
            msg = (
                f"Worker failed with error '{msg}', please check the stack trace above for "
                "the root cause"
            )
        return f"Call to {utility} method failed: {msg}".strip()


class _WorkerProc:
    """Parent-side end of one worker process: a socket pair speaking
    ``multiprocessing.connection``'s framing (the worker uses a plain ``Connection``), driven
    from the event loop (``send``) during the engine's life, blocking before and after.

    The worker answers requests one at a time, in the order they were written; a request may
    be written while earlier ones are still running, so that the worker finds it waiting
    (vLLM's engine core queues utility calls the same way). One reader task matches each
    answer to the oldest request still waiting for one."""

    def __init__(self, spec: WorkerSpec, ctx: mp.context.BaseContext,
                 target: WorkerMain) -> None:
        self.spec = spec
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=target, args=(spec, child), name=f"slotsync-engine-worker-{spec.index}"
        )
        self.process.daemon = True
        self.process.start()
        child.close()
        self._sock: socket.socket | None = None  # non-blocking twin of conn (send)
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._reader: asyncio.Task | None = None
        self._exit_requested = False
        self.gpu_uuid = spec.gpu_uuid or ""
        self.device = spec.device

    def wait_ready(self, deadline: float) -> None:
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"worker {self.spec.index} did not start in time")
        kind, payload = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"worker {self.spec.index} failed to start:\n{payload}")
        self.gpu_uuid = payload["gpu_uuid"]
        self.device = payload["device"]

    async def send(self, request: bytes) -> asyncio.Future:
        """Write ``request`` (``pickle.dumps((method, kwargs))``, what ``Connection.send``
        writes) without leaving the event loop; returns a future of the worker's answer
        ``(ok, result or error text)``. A worker that died is reported as an error. Requests
        must be written one at a time (the pool's send lock)."""
        loop = asyncio.get_running_loop()
        if self._sock is None:
            self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
            self._sock.setblocking(False)
            # room for a few update_infos of thousands of tensors while the worker is busy
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        fut = loop.create_future()
        n = len(request)
        # multiprocessing.connection framing: "!i" length, or -1 then "!Q" above 2 GiB
        head = struct.pack("!i", n) if n < 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        try:
            await loop.sock_sendall(self._sock, head + request if n < 65536 else head)
            if n >= 65536:
                await loop.sock_sendall(self._sock, request)
        except OSError as e:
            fut.set_result((False, f"worker {self.spec.index} is gone ({type(e).__name__})"))
            return fut
        self._waiting.append(fut)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_answers())
        return fut

    async def _read_answers(self) -> None:
        """Resolve the waiting futures with the worker's answers, oldest first."""
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                (size,) = struct.unpack("!i", await self._recv_exactly(loop, 4))
                if size == -1:
                    (size,) = struct.unpack("!Q", await self._recv_exactly(loop, 8))
                kind, payload = pickle.loads(await self._recv_exactly(loop, size))
                fut = self._waiting.popleft()
                if not fut.done():
                    fut.set_result((kind == "ok", payload))
        except (EOFError, OSError) as e:
            while self._waiting:
                fut = self._waiting.popleft()
                if not fut.done():
                    fut.set_result(
                        (False, f"worker {self.spec.index} is gone ({type(e).__name__})"))

    async def _recv_exactly(self, loop: asyncio.AbstractEventLoop, n: int) -> bytearray:
        assert self._sock is not None
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = await loop.sock_recv_into(self._sock, view[got:])
            if k == 0:
                raise EOFError
            got += k
        return buf

    def request_exit(self) -> None:
        """Stop reading answers and ask the worker to exit (without waiting for it); once."""
        if self._exit_requested:
            return
        self._exit_requested = True
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:
            if self.process.is_alive():
                self.conn.send(("exit", {}))
        except (OSError, BrokenPipeError):
            pass

    def close(self, grace_s: float = 3.0) -> None:
        """Ask the worker to exit, wait up to ``grace_s`` seconds, then terminate, then kill."""
        self.request_exit()
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class WorkerPool:
    """N worker processes (:func:`start_method`) and a ``collective_rpc`` over them.

    Calls run in the order they arrive, one at a time on each worker (vLLM's engine core
    handles utility calls in order); within a call the workers run concurrently. A call is
    written to the workers as soon as it arrives, behind the ones still running, so each
    worker starts it the moment it answers the one before.

    ``target``: each worker process's entry point, called ``target(spec, conn)``; the engine
    family that starts the pool names it (the pool knows no family).
    ``preload``: modules the workers import at start (e.g. vLLM's worker code), imported
    in this process before the workers fork from it (ignored when they are spawned).
    """

    def __init__(self, specs: Sequence[WorkerSpec], target: WorkerMain,
                 startup_timeout_s: float = 300.0,
                 data_parallel_size: int = 1, preload: Sequence[str] = ()) -> None:
        if data_parallel_size < 1 or len(specs) % data_parallel_size:
            raise ValueError(f"{len(specs)} workers cannot form {data_parallel_size} "
                             "data-parallel replicas of equal size")
        self.data_parallel_size = data_parallel_size
        """DP replicas; worker ``i`` is rank ``i % tp_size`` of replica ``i // tp_size``."""
        method = start_method(specs)
        if method == "fork":  # what every worker would import, imported once, here
            for module in preload:
                importlib.import_module(module)
        ctx = mp.get_context(method)
        self.workers = [_WorkerProc(s, ctx, target) for s in specs]
        deadline = time.monotonic() + startup_timeout_s
        try:
            for w in self.workers:
                w.wait_ready(deadline)
        except BaseException:
            self.close()
            raise
        self._send_lock = asyncio.Lock()  # every worker gets the calls in the same order

    @property
    def world_size(self) -> int:
        """Number of workers (= GPU UUIDs every handle dict must hold)."""
        return len(self.workers)

    @property
    def tp_size(self) -> int:
        """Workers per DP replica (vLLM's ``parallel_config.world_size``, TP x PP)."""
        return len(self.workers) // self.data_parallel_size

    @property
    def gpu_uuids(self) -> list[str]:
        """Each worker's GPU UUID, in rank order."""
        return [w.gpu_uuid for w in self.workers]

    async def collective_rpc(self, method: str, kwargs: Kwargs = None,
                             per_worker: PerWorker = None, inject: Inject = None) -> list[Any]:
        """Run ``method`` on every worker and return their results in rank order.

        Args:
            kwargs: keyword arguments for every worker.
            per_worker: keyword arguments per worker (overrides ``kwargs``), length N.
            inject: ``{worker index: message}`` test faults raised inside the call.

        Raises:
            CollectiveRpcError: any worker failed (after all of them ran the call).
        """
        # Shielded: a cancelled request (client gone) still writes its call to every worker
        # (the reader tasks take the answers), so every worker sees the same calls.
        results = await asyncio.shield(self._fan_out(method, kwargs, per_worker, inject))
        errors = [(i, str(p)) for i, (ok, p) in enumerate(results) if not ok]
        if errors:
            raise CollectiveRpcError(errors, self.tp_size)
        return [p for _, p in results]

    async def submit(self, method: str, kwargs: Kwargs = None, per_worker: PerWorker = None,
                     inject: Inject = None, only: range | None = None) -> list[asyncio.Future]:
        """Write one call to every worker (same arguments as :meth:`collective_rpc`) and
        return, in rank order, the futures of their answers ``(ok, result or error text)``
        without waiting for them. Shielded like :meth:`collective_rpc`: once started, the
        call reaches every worker. ``only``: just these workers (one DP replica, global
        indices; ``inject`` keys are global indices too)."""
        return await asyncio.shield(self._submit(method, kwargs, per_worker, inject, only))

    async def _fan_out(self, method: str, kwargs: Kwargs, per_worker: PerWorker,
                       inject: Inject) -> list[Answer]:
        answers = await self._submit(method, kwargs, per_worker, inject)
        return list(await asyncio.gather(*answers))

    async def _submit(self, method: str, kwargs: Kwargs, per_worker: PerWorker,
                      inject: Inject, only: range | None = None) -> list[asyncio.Future]:
        # The same request for every worker: pickle it once, not once per worker (an
        # update_info of thousands of tensors takes a while to pickle).
        shared = (pickle.dumps((method, dict(kwargs or {})), pickle.HIGHEST_PROTOCOL)
                  if per_worker is None else None)
        requests = []
        indices = range(len(self.workers)) if only is None else only
        for i in indices:
            if shared is not None and not (inject and i in inject):
                requests.append(shared)
                continue
            kw = dict(per_worker[i] if per_worker is not None else (kwargs or {}))
            if inject and i in inject:
                kw["inject"] = inject[i]
            requests.append(pickle.dumps((method, kw), pickle.HIGHEST_PROTOCOL))
        workers = [self.workers[i] for i in indices]
        async with self._send_lock:
            return [await w.send(r) for w, r in zip(workers, requests, strict=True)]

    def close(self) -> None:
        """Stop every worker (exit message, then terminate, then kill). The exit messages go
        out first, so the workers' interpreters shut down side by side."""
        for w in self.workers:
            w.request_exit()
        for w in self.workers:
            w.close()

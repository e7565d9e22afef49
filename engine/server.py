"""HTTP front of the reference engine: vLLM 0.33's weight-transfer routes over N workers.

Routes, bodies, status codes and error shapes follow ``shared/vllm-contract.md`` (vLLM 0.33
``vllm/entrypoints/rl/online/api_router.py``). Each weight route fans out to every worker
(vLLM's ``collective_rpc``): every worker runs the call even when another one fails, and keeps
its own "update active" flag, so a failed chunk can leave the engine split exactly as vLLM's
would. Worker errors come back as HTTP 500::

    {"error": {"message": "Call to collective_rpc method failed: <msg>",
               "type": "InternalServerError", "param": null, "code": 500}}

with ``<msg>`` wrapped as ``Worker failed with error '<msg>', please check the stack trace
above for the root cause`` when the engine has more than one worker (the first failing worker
in rank order is reported). Pause/resume errors use ``{"error": "<str>"}``; a missing body key
is 400 ``{"detail": "Missing '<key>' in request body"}`` (FastAPI ``HTTPException``).

The engine always accepts ``ipc_handles_pickled``: it stands in for a vLLM server launched with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend":"ipc"}'``.

Test-only control routes (not part of vLLM), under ``/_slotsync/``:

``GET /_slotsync/stats``
    ``{"world_size": N, "paused": bool, "weight_version": str, "packed": bool,
    "init_count": int, "pause_count": int, "resume_count": int, "shutdown_count": int,
    "route_counts": {route: int}, "faults": [fault, ...],
    "workers": [{"index", "gpu_uuid", "device", "active", "servable", "packed", "init_count",
    "start_count", "finish_count", "update_count", "bytes_loaded", "load_seconds",
    "sync_seconds", "packed_maps", "num_weights"}, ...]}`` (``load_seconds``: seconds inside
    ``update_weights``; ``sync_seconds``: of those, waiting for the device's copies;
    ``packed_maps``: packed buffers mapped anew rather than found mapped).

``POST /_slotsync/fault``
    ``{"route": "<route name without '/'>", "after": k, "status": 500, "workers": [i, ...] |
    null, "hang_s": float | null, "times": 1, "message": str | null}`` adds a fault: the
    route's next ``k`` calls pass, the ``times`` calls after that fail. ``workers: null``
    fails at the HTTP layer with ``status`` before any fan-out (no worker sees the call);
    a list makes those workers raise inside the call (the engine ends split). ``hang_s``
    sleeps that many seconds before the faulted answer; with ``workers: null`` and a
    ``status`` below 400 the call then proceeds normally (a pure delay). ``{"clear": true}``
    removes every fault. Answers ``{"faults": [...]}``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import multiprocessing as mp
import os
import pickle
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from slotsync.engine.worker import WorkerSpec, worker_main

PAUSE_MODES = ("abort", "wait", "keep")


class CollectiveRpcError(Exception):
    """One or more workers failed a fanned-out call.

    Attributes:
        errors: ``[(worker index, message)]`` in rank order, failing workers only.
        world_size: number of workers of the engine.
    """

    def __init__(self, errors: list[tuple[int, str]], world_size: int) -> None:
        self.errors = errors
        self.world_size = world_size
        super().__init__(self.api_message())

    def api_message(self) -> str:
        """The ``error.message`` vLLM 0.33 puts in the 500 body."""
        msg = self.errors[0][1]
        if self.world_size > 1:
            msg = (
                f"Worker failed with error '{msg}', please check the stack trace above for "
                "the root cause"
            )
        return f"Call to collective_rpc method failed: {msg}"


class _WorkerProc:
    """Parent-side end of one worker process: a socket pair speaking
    ``multiprocessing.connection``'s framing (the worker uses a plain ``Connection``), driven
    from the event loop (``send``) during the engine's life, blocking before and after.

    The worker answers requests one at a time, in the order they were written; a request may
    be written while earlier ones are still running, so that the worker finds it waiting
    (vLLM's engine core queues utility calls the same way). One reader task matches each
    answer to the oldest request still waiting for one."""

    def __init__(self, spec: WorkerSpec, ctx: mp.context.SpawnContext) -> None:
        self.spec = spec
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=worker_main, args=(spec, child), name=f"slotsync-engine-worker-{spec.index}"
        )
        self.process.daemon = True
        self.process.start()
        child.close()
        self._sock: socket.socket | None = None  # non-blocking twin of conn (send)
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._reader: asyncio.Task | None = None
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

    def close(self, grace_s: float = 3.0) -> None:
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
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class WorkerPool:
    """N worker processes (spawn context) and a ``collective_rpc`` over them.

    Calls run in the order they arrive, one at a time on each worker (vLLM's engine core
    handles utility calls in order); within a call the workers run concurrently. A call is
    written to the workers as soon as it arrives, behind the ones still running, so each
    worker starts it the moment it answers the one before.
    """

    def __init__(self, specs: list[WorkerSpec], startup_timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.workers = [_WorkerProc(s, ctx) for s in specs]
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
    def gpu_uuids(self) -> list[str]:
        """Each worker's GPU UUID, in rank order."""
        return [w.gpu_uuid for w in self.workers]

    async def collective_rpc(
        self,
        method: str,
        kwargs: dict[str, Any] | None = None,
        per_worker: list[dict[str, Any]] | None = None,
        inject: dict[int, str] | None = None,
    ) -> list[Any]:
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
            raise CollectiveRpcError(errors, self.world_size)
        return [p for _, p in results]

    async def _fan_out(self, method: str, kwargs: dict[str, Any] | None,
                       per_worker: list[dict[str, Any]] | None,
                       inject: dict[int, str] | None) -> list[tuple[bool, Any]]:
        # The same request for every worker: pickle it once, not once per worker (an
        # update_info of thousands of tensors takes a while to pickle).
        shared = (pickle.dumps((method, dict(kwargs or {})), pickle.HIGHEST_PROTOCOL)
                  if per_worker is None else None)
        requests = []
        for i in range(len(self.workers)):
            if shared is not None and not (inject and i in inject):
                requests.append(shared)
                continue
            kw = dict(per_worker[i] if per_worker is not None else (kwargs or {}))
            if inject and i in inject:
                kw["inject"] = inject[i]
            requests.append(pickle.dumps((method, kw), pickle.HIGHEST_PROTOCOL))
        async with self._send_lock:
            answers = [await w.send(r) for w, r in zip(self.workers, requests, strict=True)]
        return list(await asyncio.gather(*answers))

    def close(self) -> None:
        """Stop every worker (exit message, then terminate, then kill)."""
        for w in self.workers:
            w.close()


@dataclass
class Fault:
    """One injected fault (see the module docstring, ``POST /_slotsync/fault``)."""

    route: str
    after: int = 0
    status: int = 500
    workers: list[int] | None = None
    hang_s: float | None = None
    times: int = 1
    message: str | None = None
    seen: int = 0
    fired: int = 0


@dataclass
class EngineState:
    """Engine-level state (vLLM's API-server side): pause flag, weight version, counters."""

    paused: bool = False
    weight_version: str = "default"
    packed: bool = False
    init_count: int = 0
    pause_count: int = 0
    resume_count: int = 0
    shutdown_count: int = 0
    route_counts: dict[str, int] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    baseline: dict[str, str] | None = None

    def match_fault(self, route: str) -> Fault | None:
        """Count one call of ``route``; return the fault that fires on it, if any."""
        self.route_counts[route] = self.route_counts.get(route, 0) + 1
        for f in self.faults:
            if f.route != route or f.fired >= f.times:
                continue
            f.seen += 1
            if f.seen > f.after:
                f.fired += 1
                return f
        return None


def _err500(message: str, status: int = 500) -> web.Response:
    return web.json_response(
        {
            "error": {
                "message": message,
                "type": "InternalServerError",
                "param": None,
                "code": status,
            }
        },
        status=status,
    )


def _detail(status: int, detail: Any) -> web.Response:
    return web.json_response({"detail": detail}, status=status)


class _UpdateBody(msgspec.Struct):
    """``/update_weights`` body: ``update_info`` kept as JSON text (other keys ignored)."""

    update_info: msgspec.Raw = msgspec.Raw(b"null")


_UPDATE_BODY = msgspec.json.Decoder(_UpdateBody)


async def _read_json(request: web.Request) -> dict[str, Any] | web.Response:
    """The body as a dict (``{}`` when empty), or a 400 response like vLLM's."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _detail(400, "Invalid JSON format")
    if not isinstance(body, dict):
        return _detail(400, "Request body must be a JSON object")
    return body


class EngineApp:
    """The aiohttp application over one :class:`WorkerPool`."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.state = EngineState()
        # vLLM's server (uvicorn) sets no body limit; aiohttp's default of 1 MiB would refuse
        # an unpacked chunk of a few thousand tensors on 8 GPUs.
        self.app = web.Application(
            middlewares=[self._log_middleware], client_max_size=1 << 30
        )
        self.app["engine"] = self
        r = self.app.router
        r.add_post("/init_weight_transfer_engine", self.init_weight_transfer_engine)
        r.add_post("/start_weight_update", self.start_weight_update)
        r.add_post("/update_weights", self.update_weights)
        r.add_post("/finish_weight_update", self.finish_weight_update)
        r.add_post("/shutdown_weight_transfer_engine", self.shutdown_weight_transfer_engine)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_get("/get_world_size", self.get_world_size)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/weight_checker", self.weight_checker)
        r.add_get("/_slotsync/stats", self.stats)
        r.add_post("/_slotsync/fault", self.fault)
        self.app.on_cleanup.append(self._cleanup)

    async def _cleanup(self, _app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.pool.close)

    @web.middleware
    async def _log_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            print(
                f"[slotsync.engine] {request.method} {request.path_qs} -> {status} ({ms:.1f} ms)",
                file=sys.stderr,
                flush=True,
            )

    # -- fault helpers ---------------------------------------------------------------------

    async def _apply_fault(
        self, route: str, error_shape: str = "collective"
    ) -> tuple[web.Response | None, dict[int, str] | None]:
        """Returns (response to send instead, worker injections) for this call of ``route``."""
        f = self.state.match_fault(route)
        if f is None:
            return None, None
        if f.hang_s:
            await asyncio.sleep(f.hang_s)
        msg = f.message or f"injected fault on {route} (call {f.seen})"
        if f.workers is None:
            if f.status < 400:
                return None, None
            if error_shape == "plain":
                return web.json_response({"error": msg}, status=f.status), None
            return _err500(f"Call to collective_rpc method failed: {msg}", f.status), None
        return None, {i: msg for i in f.workers}

    async def _fanout(
        self,
        route: str,
        method: str,
        kwargs: dict[str, Any] | None = None,
        per_worker: list[dict[str, Any]] | None = None,
    ) -> list[Any] | web.Response:
        early, inject = await self._apply_fault(route)
        if early is not None:
            return early
        try:
            return await self.pool.collective_rpc(method, kwargs, per_worker, inject)
        except CollectiveRpcError as e:
            return _err500(e.api_message())

    # -- vLLM routes -----------------------------------------------------------------------

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        """``POST /init_weight_transfer_engine`` ``{"init_info": {"packed": bool}}``."""
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        init_info = body.get("init_info")
        if init_info is None:
            return _detail(400, "Missing 'init_info' in request body")
        res = await self._fanout(
            "init_weight_transfer_engine", "init_weight_transfer_engine", {"init_info": init_info}
        )
        if isinstance(res, web.Response):
            return res
        self.state.packed = bool(init_info.get("packed", False))
        self.state.init_count += 1
        return web.json_response({"message": "Weight transfer initialized"})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        """``POST /start_weight_update`` (body ignored)."""
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        res = await self._fanout("start_weight_update", "start_weight_update")
        if isinstance(res, web.Response):
            return res
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        """``POST /update_weights`` ``{"update_info": {...}}`` or a list of N of them (one per
        worker rank).

        One ``update_info`` for every worker travels to them as its JSON text, checked here
        for syntax only: each worker decodes it itself, in parallel, instead of this process
        decoding it and pickling it again for the workers (an update_info of a few hundred
        tensors took ~0.2 ms of the front's time that way)."""
        raw = await request.read()
        try:
            top = _UPDATE_BODY.decode(raw) if raw.strip() else _UpdateBody()
        except msgspec.ValidationError:
            return _detail(400, "Request body must be a JSON object")
        except msgspec.DecodeError:
            return _detail(400, "Invalid JSON format")
        text = bytes(top.update_info)
        if text == b"null":
            return _detail(400, "Missing 'update_info' in request body")
        if not text.startswith(b"["):
            res = await self._fanout("update_weights", "update_weights",
                                     {"update_info_json": text})
            if isinstance(res, web.Response):
                return res
            return web.json_response({"message": "Weights updated"})
        update_info = json.loads(text)
        per_worker = None
        if isinstance(update_info, list):
            if len(update_info) != self.pool.world_size:
                self.state.match_fault("update_weights")
                return _err500(
                    "Call to collective_rpc method failed: update_info list has "
                    f"{len(update_info)} entries, world size is {self.pool.world_size}"
                )
            per_worker = [{"update_info": u} for u in update_info]
        res = await self._fanout(
            "update_weights", "update_weights", {"update_info": update_info}, per_worker
        )
        if isinstance(res, web.Response):
            return res
        return web.json_response({"message": "Weights updated"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        """``POST /finish_weight_update`` with optional ``{"weight_version": str}``; the
        version is recorded only when every worker finished."""
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        res = await self._fanout("finish_weight_update", "finish_weight_update")
        if isinstance(res, web.Response):
            return res
        version = body.get("weight_version")
        if version is not None:
            self.state.weight_version = str(version)
        return web.json_response({"message": "Weight update finished"})

    async def shutdown_weight_transfer_engine(self, request: web.Request) -> web.Response:
        """``POST /shutdown_weight_transfer_engine``; 500 during an active update."""
        res = await self._fanout(
            "shutdown_weight_transfer_engine", "shutdown_weight_transfer_engine"
        )
        if isinstance(res, web.Response):
            return res
        self.state.shutdown_count += 1
        return web.json_response({"message": "Weight transfer engine shut down"})

    async def pause(self, request: web.Request) -> web.Response:
        """``POST /pause?mode=abort|wait|keep`` (default ``abort``) -> ``{"status": "paused"}``."""
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _detail(
                422,
                [
                    {
                        "type": "literal_error",
                        "loc": ["query", "mode"],
                        "msg": "Input should be 'abort', 'wait' or 'keep'",
                        "input": mode,
                        "ctx": {"expected": "'abort', 'wait' or 'keep'"},
                    }
                ],
            )
        early, _ = await self._apply_fault("pause", "plain")
        if early is not None:
            return early
        self.state.paused = True
        self.state.pause_count += 1
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        """``POST /resume`` -> ``{"status": "resumed"}``."""
        early, _ = await self._apply_fault("resume", "plain")
        if early is not None:
            return early
        self.state.paused = False
        self.state.resume_count += 1
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        """``GET /is_paused`` -> ``{"is_paused": bool}``."""
        early, _ = await self._apply_fault("is_paused", "plain")
        if early is not None:
            return early
        return web.json_response({"is_paused": self.state.paused})

    async def get_world_size(self, request: web.Request) -> web.Response:
        """``GET /get_world_size`` -> ``{"world_size": N}`` (N workers; one DP rank)."""
        early, _ = await self._apply_fault("get_world_size")
        if early is not None:
            return early
        return web.json_response({"world_size": self.pool.world_size})

    async def weight_info(self, request: web.Request) -> web.Response:
        """``GET /weight_info`` -> ``{"weight_version": str}`` (``"default"`` at first)."""
        early, _ = await self._apply_fault("weight_info")
        if early is not None:
            return early
        return web.json_response({"weight_version": self.state.weight_version})

    async def weight_checker(self, request: web.Request) -> web.Response:
        """``POST /weight_checker``.

        * ``{"action": "checksum"}`` -> ``{"checksums": {gpu_uuid: {name: sha256 hex}}}``
          (``slotsync.engine.checksum.tensor_checksum`` of each worker's weights); also kept
          as the stored baseline.
        * ``{"action": "compare", "baseline": {name: hex}?}`` -> ``{"match": bool,
          "mismatches": [{"gpu_uuid", "name", "expected", "actual"}]}``, every worker against
          the given baseline (or the stored one); ``actual`` is null for a missing name.
        * ``{"action": "reset"}`` -> ``{"status": "reset"}``: forgets the stored baseline.
        """
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        action = body.get("action")
        if action is None:
            return _detail(400, "Missing 'action' in request body")
        if action not in ("checksum", "compare", "reset"):
            return _detail(400, f"Unknown action {action!r}: use checksum, compare or reset")
        if action == "reset":
            self.state.baseline = None
            return web.json_response({"status": "reset"})
        baseline = body.get("baseline") if action == "compare" else None
        if action == "compare" and baseline is None:
            baseline = self.state.baseline
            if baseline is None:
                return _detail(400, "compare needs a 'baseline' (or an earlier checksum)")
        if baseline is not None and not isinstance(baseline, dict):
            return _detail(400, "'baseline' must be an object {name: hex}")
        res = await self._fanout("weight_checker", "checksums")
        if isinstance(res, web.Response):
            return res
        sums = {w.gpu_uuid: r for w, r in zip(self.pool.workers, res, strict=True)}
        if action == "checksum":
            self.state.baseline = dict(res[0]) if res else {}
            return web.json_response({"checksums": sums})
        assert baseline is not None
        mismatches = [
            {"gpu_uuid": u, "name": name, "expected": want, "actual": got.get(name)}
            for u, got in sums.items()
            for name, want in baseline.items()
            if got.get(name) != want
        ]
        return web.json_response({"match": not mismatches, "mismatches": mismatches})

    # -- test-only control routes ----------------------------------------------------------

    async def stats(self, request: web.Request) -> web.Response:
        """``GET /_slotsync/stats`` (shape in the module docstring)."""
        try:
            workers = await self.pool.collective_rpc("stats")
        except CollectiveRpcError as e:
            return _err500(e.api_message())
        s = self.state
        return web.json_response(
            {
                "world_size": self.pool.world_size,
                "paused": s.paused,
                "weight_version": s.weight_version,
                "packed": s.packed,
                "init_count": s.init_count,
                "pause_count": s.pause_count,
                "resume_count": s.resume_count,
                "shutdown_count": s.shutdown_count,
                "route_counts": s.route_counts,
                "faults": [asdict(f) for f in s.faults],
                "workers": workers,
            }
        )

    async def fault(self, request: web.Request) -> web.Response:
        """``POST /_slotsync/fault``: add one fault, or ``{"clear": true}``."""
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        if body.get("clear"):
            self.state.faults.clear()
            return web.json_response({"faults": []})
        if not isinstance(body.get("route"), str):
            return _detail(400, "Missing 'route' in request body")
        allowed = {"route", "after", "status", "workers", "hang_s", "times", "message"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            return _detail(400, f"unknown fault fields {unknown}")
        try:
            f = Fault(
                route=body["route"].lstrip("/"),
                after=int(body.get("after", 0)),
                status=int(body.get("status", 500)),
                workers=None if body.get("workers") is None else [int(i) for i in body["workers"]],
                hang_s=None if body.get("hang_s") is None else float(body["hang_s"]),
                times=int(body.get("times", 1)),
                message=body.get("message"),
            )
        except (TypeError, ValueError) as e:
            return _detail(400, f"bad fault: {e}")
        if f.workers is not None and any(not 0 <= i < self.pool.world_size for i in f.workers):
            return _detail(400, f"workers must be in [0, {self.pool.world_size})")
        self.state.faults.append(f)
        return web.json_response({"faults": [asdict(x) for x in self.state.faults]})

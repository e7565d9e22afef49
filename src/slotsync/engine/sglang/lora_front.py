"""The SGLang-code engine's LoRA routes (``--impl sglang --enable-lora``; issue 36 B): SGLang's
tokenizer side of dynamic LoRA loading, over the engine's scheduler and TP ranks.

Routes (``srt/entrypoints/http_server.py``, 0.5.23):

``POST /load_lora_adapter_from_tensors``, body ``LoadLoRAAdapterFromTensorsReqInput``
    SGLang's own ``TokenizerControlMixin.load_lora_adapter_from_tensors``
    (``srt/managers/tokenizer_control_mixin.py``, compiled by ``lora_code.py``): ``--enable-lora``
    checked ("LoRA is not enabled. ..."), the DP ``assert`` (a bare 500), the payload
    normalization, then under ``lora_update_lock`` a new ``LoRARef`` (SGLang's
    ``lora/lora_registry.py``), the scheduler call, the registration on success, the pending
    unload of a half-loaded name, the LRU eviction past ``--max-loaded-loras``. Answer
    ``msgspec_to_builtins(LoRAUpdateOutput)``: 200, or 400 when ``success`` is false.
``POST /unload_lora_adapter``, body ``UnloadLoRAAdapterReqInput``
    SGLang's ``unload_lora_adapter`` / ``_unload_lora_adapter_locked``: unregister at once,
    then wait -- without a deadline -- for every request using the adapter
    (``LoRARegistry.wait_for_unload``), holding ``lora_update_lock``; then the ranks.
``GET /v1/models``
    ``available_models``: the served model's card, then one per registered adapter
    (``id`` its name, ``root`` its path, ``__tensor__`` for one loaded from tensors,
    ``parent`` the served model).
``GET|POST /weights_checker``, body ``CheckWeightsReqInput`` (optional)
    every TP rank hashes its weights but those SGLang's ``_is_skip_weight_check`` skips
    (``utils/weight_checker.py``; ``skip_tensor_list [""]`` skips all), then the TP
    collective (every rank answers): ``{"success", "message", "ranks"}``; an action other
    than ``checksum`` is a 400. The daemon's proof that every rank copied an adapter
    (``daemon/sglang/adapters.py`` ``proving_body``).

The scheduler half (``lora_rank.py``, on every TP rank): SGLang's ``TpModelWorker`` code.
As in SGLang, **only TP rank 0's answer is awaited** (only rank 0 talks to the tokenizer,
``SchedulerIpcChannels``; no barrier on the LoRA path): the other ranks finish in the
background, and an exception on any of them kills the engine (SGLang's scheduler exception).
Later calls queue behind them on each rank, so a call that waits for every rank (the weights
checker) proves they are done.

Test-only routes: ``GET /_slotsync/lora`` -> ``{"adapters": [registered names],
"pending_unloads": [...], "ranks": {"tp<r>": {lora_name: {tensor: sha256}}}, "hashed":
[weights each rank hashed for the weights checker, so far]}`` (sha256 as SGLang's
``expected_checksums`` check computes it, of each rank's host copy); ``POST
/_slotsync/lora_requests`` ``{"start": name}`` -> ``{"rid": k}`` (a generate request using the
adapter: SGLang's ``LoRARegistry.acquire``, refused with 400 ``{"detail"}`` for a name not
loaded), ``{"finish": k}`` (``release``).

The reference impl (``--impl sglang-reference``) has no LoRA routes (404).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import msgspec
from aiohttp import web

from slotsync.engine.sglang import lora_code
from slotsync.engine.sglang.http import internal_error
from slotsync.engine.sglang.scheduler import SchedulerDied

_PRIVATE = frozenset({"rid", "http_worker_ipc"})


def _fields(obj: msgspec.Struct) -> dict[str, Any]:
    """A request struct's fields, but the IPC bookkeeping, as a plain dict (for the ranks)."""
    return {f: getattr(obj, f) for f in obj.__struct_fields__ if f not in _PRIVATE}


class LoraFront:
    """The LoRA routes of one engine (``server.SglangEngineApp``; module docstring). Made by
    :func:`install`."""

    def __init__(self, engine: Any) -> None:
        from pydantic import TypeAdapter
        from sglang.srt.lora.lora_registry import LoRARegistry
        from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

        self.engine = engine
        self.settings = engine.config.lora
        flags = SimpleNamespace(enable_lora=bool(self.settings.enable_lora),
                                max_loaded_loras=self.settings.max_loaded_loras)
        parallel = SimpleNamespace(dp_size=engine.config.dp_size, num_dp_ranks=1)
        self.s = lora_code.structs()
        self.code = lora_code.tokenizer(lambda: flags, lambda: parallel)
        self.checker = lora_code.checker()
        self.to_builtins = msgspec_to_builtins
        for cls in (self.s.LoadLoRAAdapterFromTensorsReqInput, self.s.UnloadLoRAAdapterReqInput,
                    self.s.CheckWeightsReqInput):
            engine.validator._adapters[cls] = TypeAdapter(cls)
        self.registry = LoRARegistry()
        t = SimpleNamespace(
            lora_registry=self.registry, lora_update_lock=asyncio.Lock(),
            pending_lora_unloads={}, lora_ref_cache={},
            auto_create_handle_loop=lambda: None,
            update_lora_adapter_communicator=self._communicate)
        for name, fn in lora_code.methods(self.code, lora_code.TOKENIZER_METHODS).items():
            setattr(t, name, fn.__get__(t))
        self.tokenizer = t
        self._call: tuple[web.Request | None, dict[int, str] | None] = (None, None)
        self._watchers: set[asyncio.Task] = set()
        self._requests: dict[int, str] = {}
        self._next_rid = 0

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/load_lora_adapter_from_tensors", self.load)
        router.add_post("/unload_lora_adapter", self.unload)
        router.add_get("/v1/models", self.models)
        router.add_route("GET", "/weights_checker", self.weights_checker)
        router.add_route("POST", "/weights_checker", self.weights_checker)
        router.add_get("/_slotsync/lora", self.stats)
        router.add_post("/_slotsync/lora_requests", self.lora_requests)

    # -- the scheduler side ----------------------------------------------------------------

    async def _communicate(self, obj: Any) -> list[Any]:
        """``update_lora_adapter_communicator``: the request to the scheduler; its one DP
        rank's answer, TP rank 0's (module docstring)."""
        request, inject = self._call
        self._call = (None, None)
        method = ("lora_load" if isinstance(obj, self.s.LoadLoRAAdapterFromTensorsReqInput)
                  else "lora_unload")
        fields = _fields(obj)

        async def call() -> Any:
            futs = await self.engine.pool.submit(method, {"fields": fields}, inject=inject)
            ok, payload = await futs[0]
            if not ok:
                raise SchedulerDied(f"TP rank 0: {payload}")
            for i, fut in enumerate(futs[1:], start=1):
                task = asyncio.create_task(self._watch(i, fut))
                self._watchers.add(task)
                task.add_done_callback(self._watchers.discard)
            return self.s.LoRAUpdateOutput(**payload)

        return [await self.engine.scheduler.dispatch(call, request)]

    async def _watch(self, rank: int, fut: asyncio.Future) -> None:
        """TP rank ``rank`` finishes the call in the background; its exception kills the
        engine."""
        ok, payload = await fut
        if not ok:
            await self.engine.scheduler.die(None, f"TP rank {rank}: {payload}")

    # -- SGLang's routes -------------------------------------------------------------------

    async def _body(self, request: web.Request, cls: type, route: str
                    ) -> tuple[Any, dict[int, str] | None] | web.Response:
        obj = await self.engine.validator.read(request, cls, "/" + route)
        if isinstance(obj, web.Response):
            return obj
        early, inject = await self.engine._fault(request, route)
        return early if early is not None else (obj, inject)

    def _answer(self, result: Any) -> web.Response:
        return web.json_response(self.to_builtins(result),
                                 status=200 if result.success else 400)

    async def load(self, request: web.Request) -> web.Response:
        """``POST /load_lora_adapter_from_tensors`` (module docstring)."""
        got = await self._body(request, self.s.LoadLoRAAdapterFromTensorsReqInput,
                               "load_lora_adapter_from_tensors")
        if isinstance(got, web.Response):
            return got
        obj, inject = got
        self._call = (request, inject)
        try:
            result = await self.tokenizer.load_lora_adapter_from_tensors(obj)
        except AssertionError:  # the DP assertion escapes the route: Starlette's 500
            return internal_error()
        return self._answer(result)

    async def unload(self, request: web.Request) -> web.Response:
        """``POST /unload_lora_adapter`` (module docstring)."""
        got = await self._body(request, self.s.UnloadLoRAAdapterReqInput, "unload_lora_adapter")
        if isinstance(got, web.Response):
            return got
        obj, inject = got
        self._call = (request, inject)
        try:
            result = await self.tokenizer.unload_lora_adapter(obj)
        except AssertionError:
            return internal_error()
        return self._answer(result)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` (``available_models``)."""
        served = self.engine.config.model_path
        card = {"object": "model", "owned_by": "sglang"}
        cards = [{"id": served, **card, "root": served, "parent": None, "max_model_len": None}]
        if self.settings.enable_lora:
            for ref in self.registry.get_all_adapters().values():
                cards.append({"id": ref.lora_name, **card, "root": ref.lora_path,
                              "parent": served, "max_model_len": None})
        return web.json_response({"object": "list", "data": cards})

    async def weights_checker(self, request: web.Request) -> web.Response:
        """``GET|POST /weights_checker`` (module docstring)."""
        if await request.read():
            got = await self._body(request, self.s.CheckWeightsReqInput, "weights_checker")
            if isinstance(got, web.Response):
                return got
            obj, inject = got
        else:
            obj, inject = self.s.CheckWeightsReqInput(), None
            early, inject = await self.engine._fault(request, "weights_checker")
            if early is not None:
                return early
        kwargs = {"action": obj.action, "skip_tensor_list": obj.skip_tensor_list}
        answers = await self.engine.scheduler.dispatch(
            lambda: self.engine.scheduler.ranks("lora_weights_checker", kwargs, inject),
            request)
        refused = next((a["error"] for a in answers if a.get("error")), None)
        if refused:
            return web.json_response({"success": False, "message": refused}, status=400)
        return web.json_response({"success": True, "message": "Success.", "ranks": answers})

    # -- test-only routes ------------------------------------------------------------------

    async def stats(self, request: web.Request) -> web.Response:
        """``GET /_slotsync/lora`` (module docstring)."""
        ranks = await self.engine.pool.collective_rpc("lora_checksums")
        return web.json_response({
            "adapters": sorted(self.registry.get_all_adapters()),
            "pending_unloads": sorted(self.tokenizer.pending_lora_unloads),
            "ranks": {f"tp{i}": r["adapters"] for i, r in enumerate(ranks)},
            "hashed": [r["hashed"] for r in ranks]})

    async def lora_requests(self, request: web.Request) -> web.Response:
        """``POST /_slotsync/lora_requests`` (module docstring)."""
        try:
            body = json.loads(await request.read() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"detail": "Invalid JSON format"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"detail": "Request body must be a JSON object"},
                                     status=400)
        if "start" in body:
            try:
                lora_id = await self.registry.acquire(str(body["start"]))
            except ValueError as e:
                return web.json_response({"detail": str(e)}, status=400)
            self._next_rid += 1
            self._requests[self._next_rid] = lora_id
            return web.json_response({"rid": self._next_rid})
        if "finish" in body:
            lora_id = self._requests.pop(int(body["finish"]), None)
            if lora_id is None:
                return web.json_response({"detail": f"no request {body['finish']}"},
                                         status=400)
            await self.registry.release(lora_id)
            return web.json_response({"finished": int(body["finish"])})
        return web.json_response({"detail": "say start or finish"}, status=400)


def install(engine: Any) -> LoraFront | None:
    """Add the LoRA routes to ``engine`` (``server.SglangEngineApp``; the SGLang-code engine
    only: its impl ``sglang``); None for the reference impl."""
    if engine.config.impl != "sglang":
        return None
    front = LoraFront(engine)
    front.add_routes(engine.app.router)
    return front

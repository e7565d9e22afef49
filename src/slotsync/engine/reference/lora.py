"""LoRA adapters on the reference engine (issue 36): vLLM 0.32's adapter routes and its
workers' adapter cache, with test-only routes that show what each worker loaded.

Front (:class:`LoraFront`, on :class:`slotsync.engine.reference.server.EngineApp`'s router):

``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}``
    As ``OpenAIServingModels.load_lora_adapter`` (``entrypoints/openai/models/serving.py``):
    400 when a field is empty, the name is the base model's, or the name is loaded and
    ``load_inplace`` is not set; else a ``LoRARequest`` (the name's int id, or the next one)
    goes to every worker (``add_lora``, below); a worker's ``LoRAAdapterNotFoundError`` is a
    404 ``NotFoundError``, any other worker error a 500 ``Call to add_lora method failed:
    ...`` (connection kept: vLLM returns it, nothing is raised through Starlette); 200 with
    the text ``Success: LoRA adapter '<name>' added successfully.``
``POST /v1/unload_lora_adapter {"lora_name"}``
    Removes the name from the server's table only (no worker call, as vLLM): 404 for an
    unknown name; 200 ``Success: LoRA adapter '<name>' removed successfully.``
    Both routes are a FastAPI ``404 {"detail": "Not Found"}`` when the engine runs with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=0`` (``slotsync.engine.lora_flags``).
``GET /v1/models``
    ``show_available_models``: the base model's card (``id`` and ``root`` the ``--model``
    path, ``parent`` null), then one card per loaded adapter (``id`` its name, ``root`` its
    path, ``parent`` the base model).
``GET /server_info?config_format=json``
    vLLM's dev-mode shape, with only what this engine knows: ``{"vllm_config":
    {"lora_config": null | {...}}, "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": bool,
    ...}, "system_env": {...}}`` (no ``parallel_config``: the daemon reads no DP layout).

Workers (:class:`WorkerLoras`, held by each ``WorkerState``): ``add_lora`` is
``LRUCacheWorkerLoRAManager.add_adapter`` (``lora/worker_manager.py``): an int id not cached
(or ``load_inplace``) is read from its folder first -- ``adapter_config.json`` checked as
``PEFTHelper.from_dict`` / ``validate_legal`` check it, ``adapter_model.safetensors`` read
with ``safetensors.safe_open`` as ``LoRAModel.from_local_checkpoint`` reads it (every module
one of the model's 2-D ``.weight`` modules, which the reference engine also checks each
tensor's shape against) -- then, when the cache holds ``--max-cpu-loras`` already, the least
recently used adapter is evicted. ``finish_weight_update`` (not a draft session) empties the
cache (``reset_lora_state``). Each cached adapter keeps the sha256 of every tensor as read
(``slotsync.engine.checksum.tensor_checksum``), to compare with what the trainer sent.

Test-only routes:

``GET /_slotsync/lora``
    ``{"adapters": [{"lora_name", "lora_int_id", "lora_path"}], "workers": [{"index",
    "loaded": {"<lora_int_id>": {"lora_name", "lora_path", "rank", "checksums": {tensor:
    sha256}}}, "loads", "evictions", "resets"}]}``.
``POST /_slotsync/lora/use {"lora_name"}``
    What one scheduler step of a request naming that adapter does to the workers
    (``set_active_loras`` -> ``add_adapter``): a cached adapter is touched, an evicted or
    reset one is read again from its folder. 404 for a name not loaded (vLLM's "The model
    ... does not exist."). A failed read kills the engine, as it kills vLLM's engine core
    (``execute_model`` raises): the answer is vLLM's 500 ``EngineCore encountered an
    issue``, then the process exits.

Faults (``POST /_slotsync/fault``) on routes ``load_lora_adapter`` and
``unload_lora_adapter``: ``workers: null`` answers ``status`` before any worker (a 400 in
vLLM's shape for a refused load), ``workers: [i]`` makes worker ``i`` raise inside
``add_lora``, ``exit: true`` kills the engine mid-load (the workers got the request, no
answer goes out).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from slotsync.engine.http_shapes import detail, err500, missing, read_json
from slotsync.engine.lora_flags import RUNTIME_ENV, LoraOptions
from slotsync.engine.pool import CollectiveRpcError

if TYPE_CHECKING:
    import torch

NOT_FOUND = "Loading lora {name} failed: No adapter found for {path}"
"""``str(vllm.exceptions.LoRAAdapterNotFoundError(name, path))``."""

NOT_ENABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."
"""vLLM 0.32 ``LoRAModelRunnerMixin._ensure_lora_enabled``'s error."""

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class LoraNotFound(FileNotFoundError):
    """The adapter's folder or its ``adapter_config.json`` is missing."""


def _parse_tensor_name(name: str) -> tuple[str, bool]:
    """``(module, is_lora_a)`` of a PEFT tensor name (vLLM's ``parse_fine_tuned_lora_name``
    for the standard ``base_model.model.<module>.lora_A.weight`` / ``lora_B``)."""
    parts = name.split(".")
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2] == "lora_A"
    raise ValueError(f"{name} is unsupported LoRA weight")


def _check_config(config: Any, max_lora_rank: int) -> dict[str, Any]:
    """vLLM 0.32 ``PEFTHelper.from_dict`` + ``validate_legal`` (their texts)."""
    if not isinstance(config, dict):
        raise ValueError("adapter_config.json is not a JSON object")
    missing_fields = {"r", "lora_alpha", "target_modules"} - set(config)
    if missing_fields:
        raise ValueError(f"Missing required configuration fields: {missing_fields}")
    errors = []
    if config.get("use_dora"):
        errors.append("vLLM does not yet support DoRA.")
    if config.get("lora_bias"):
        errors.append("vLLM does not support LoRA bias (lora_bias).")
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_lora_rank:
        errors.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}.")
    if config.get("bias", "none") != "none":
        errors.append("Adapter bias is not supported.")
    if errors:
        raise ValueError(" ".join(errors))
    return config


class WorkerLoras:
    """One worker's adapter cache (see the module docstring). ``weights``: the worker's
    model weights now (``{name: tensor}``; empty: any module accepted)."""

    def __init__(self, options: LoraOptions,
                 weights: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self.options = options
        self.weights = weights
        self.cache: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()
        self.loads = self.evictions = self.resets = 0

    def add(self, request: Mapping[str, Any]) -> bool:
        """``LRUCacheWorkerLoRAManager.add_adapter(lora_request)``: read it (first, so that
        a bad folder evicts nothing), evict the oldest if the cache is full, cache it; or
        touch a cached one.

        Raises:
            RuntimeError: LoRA is not enabled.
            LoraNotFound: no ``adapter_config.json`` (vLLM's ``LoRAAdapterNotFoundError``).
            ValueError: a config or a tensor vLLM would refuse.
        """
        if not self.options.enabled:
            raise RuntimeError(NOT_ENABLED)
        lora_id = int(request["lora_int_id"])
        if lora_id in self.cache and not request.get("load_inplace"):
            self.cache.move_to_end(lora_id)
            return True
        lora = self._read(str(request["lora_name"]), str(request["lora_path"]))
        self.cache.pop(lora_id, None)
        if len(self.cache) + 1 > self.options.max_cpu_loras:
            self.cache.popitem(last=False)
            self.evictions += 1
        self.cache[lora_id] = lora
        return True

    def _read(self, name: str, path: str) -> dict[str, Any]:
        """The folder as vLLM's ``_load_adapter`` reads it: its config checked, its tensors
        read and checked against the model's modules and shapes, their checksums."""
        from safetensors import safe_open

        from slotsync.engine.checksum import tensor_checksum

        try:
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
                config = _check_config(json.load(f), self.options.max_lora_rank)
        except FileNotFoundError:
            raise LoraNotFound(NOT_FOUND.format(name=name, path=path)) from None
        file = os.path.join(path, "adapter_model.safetensors")
        if not os.path.isfile(file):
            raise ValueError(f"{path} doesn't contain tensors")
        weights = self.weights()
        linear = {n.removesuffix(".weight"): w for n, w in weights.items()
                  if n.endswith(".weight") and w.dim() == 2}
        expected = {m.rsplit(".", 1)[-1] for m in linear
                    if m.rsplit(".", 1)[-1] not in ("embed_tokens", "lm_head")}
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())
            modules = [_parse_tensor_name(n)[0] for n in names]
            unexpected = [m for m in modules if weights and m.rsplit(".", 1)[-1] not in expected]
            if unexpected:
                raise ValueError(f"While loading {path}, expected target modules in "
                                 f"{expected} but received {unexpected}. Please verify that "
                                 "the loaded LoRA module is correct")
            tensors = {n: f.get_tensor(n) for n in names}
        pattern = config.get("rank_pattern") or {}
        for n, t in tensors.items():
            module, is_a = _parse_tensor_name(n)
            rank = next((r for k, r in pattern.items()
                         if module == k or module.endswith("." + k)), config["r"])
            base = linear.get(module)
            if base is None:
                continue
            want = (rank, base.shape[1]) if is_a else (base.shape[0], rank)
            if tuple(t.shape) != want:
                raise ValueError(f"LoRA tensor {n}: shape {list(t.shape)} does not fit module "
                                 f"{module} ({list(base.shape)}) at rank {rank}: want "
                                 f"{list(want)}")
        self.loads += 1
        return {"lora_name": name, "lora_path": path, "rank": config["r"],
                "checksums": {n: tensor_checksum(t) for n, t in sorted(tensors.items())}}

    def reset(self) -> None:
        """``reset_lora_state`` after a base-weight finish: every adapter leaves the cache."""
        if self.options.enabled:
            self.cache.clear()
            self.resets += 1

    def state(self) -> dict[str, Any]:
        """This worker's part of ``GET /_slotsync/lora``."""
        return {"loaded": {str(k): v for k, v in self.cache.items()}, "loads": self.loads,
                "evictions": self.evictions, "resets": self.resets}


class LoraFront:
    """The LoRA routes of one reference engine (see the module docstring)."""

    def __init__(self, engine: Any, options: LoraOptions, base_model: str) -> None:
        """``engine``: the ``reference.server.EngineApp`` (its ``pool`` and fault table)."""
        self.engine = engine
        self.options = options
        self.base_model = base_model
        self.requests: dict[str, dict[str, Any]] = {}  # name -> its LoRARequest's fields
        self.next_id = 0
        self.locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock)
        self.created = int(time.time())

    def attach(self, r: web.UrlDispatcher) -> None:
        """Add the routes to the engine's router."""
        if self.options.runtime_updating:
            r.add_post("/v1/load_lora_adapter", self.load)
            r.add_post("/v1/unload_lora_adapter", self.unload)
        else:  # (vLLM's attach_router registers nothing: FastAPI's 404)
            r.add_post("/v1/load_lora_adapter", self.absent)
            r.add_post("/v1/unload_lora_adapter", self.absent)
        r.add_get("/v1/models", self.models)
        r.add_get("/server_info", self.server_info)
        r.add_get("/_slotsync/lora", self.lora_state)
        r.add_post("/_slotsync/lora/use", self.use)

    async def absent(self, request: web.Request) -> web.Response:
        return detail(404, "Not Found")

    @staticmethod
    def _error(message: str, err_type: str, status: int) -> web.Response:
        """vLLM's ``create_error_response`` body, returned (not raised: connection kept)."""
        return web.json_response({"error": {"message": message, "type": err_type,
                                            "param": None, "code": status}}, status=status)

    async def _fault(self, route: str, utility: str
                     ) -> tuple[web.Response | None, dict[int, str] | None, float | None]:
        """``route``'s fault: (answer instead, worker injections, seconds after which the
        engine dies mid-call -- None: it does not)."""
        f = self.engine.state.match_fault(route)
        if f is None:
            return None, None, None
        if f.exit:
            return None, None, f.hang_s or 0.05
        if f.hang_s:
            await asyncio.sleep(f.hang_s)
        if f.workers is None:
            if f.status < 400:
                return None, None, None
            text = f"Call to {utility} method failed: {f.text()}" if f.status >= 500 else f.text()
            return err500(text, f.status, close=False), None, None
        return None, {i: f.text() for i in f.workers}, None

    @staticmethod
    async def _die_during(call: Any, after_s: float) -> None:
        """Start ``call`` (the workers get it), then exit ``after_s`` later, unanswered."""
        task = asyncio.ensure_future(call)
        await asyncio.sleep(after_s)
        print(f"[slotsync.engine] fault: the engine dies during an adapter load ({task})",
              file=sys.stderr, flush=True)
        os._exit(1)

    async def load(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        for key in ("lora_name", "lora_path"):
            if not isinstance(body.get(key), str):
                return missing(key)
        name, path = body["lora_name"], body["lora_path"]
        inplace = bool(body.get("load_inplace", False))
        early, inject, die_after = await self._fault("load_lora_adapter", "add_lora")
        if early is not None:
            return early
        async with self.locks[name]:
            if not name or not path:
                return self._error("Both 'lora_name' and 'lora_path' must be provided.",
                                   "InvalidUserInput", 400)
            if name == self.base_model:
                return self._error(f"The lora adapter '{name}' conflicts with a served base "
                                   "model.", "InvalidUserInput", 400)
            if not inplace and name in self.requests:
                return self._error(f"The lora adapter '{name}' has already been loaded. If "
                                   "you want to load the adapter in place, set "
                                   "'load_inplace' to True.", "InvalidUserInput", 400)
            if name in self.requests:
                lora_id = self.requests[name]["lora_int_id"]
            else:
                self.next_id += 1
                lora_id = self.next_id
            req = {"lora_name": name, "lora_int_id": lora_id, "lora_path": path,
                   "load_inplace": inplace}
            call = self.engine.pool.collective_rpc("add_lora", {"lora_request": req},
                                                   inject=inject)
            if die_after is not None:
                await self._die_during(call, die_after)
            try:
                await call
            except CollectiveRpcError as e:
                text = e.api_message("add_lora")
                not_found = NOT_FOUND.format(name=name, path=path)
                if not_found in text:
                    return self._error(not_found, "NotFoundError", 404)
                return self._error(text, "InternalServerError", 500)
            self.requests[name] = req
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("lora_name"), str):
            return missing("lora_name")
        name = body["lora_name"]
        early, _, die_after = await self._fault("unload_lora_adapter", "remove_lora")
        if die_after is not None:
            os._exit(1)
        if early is not None:
            return early
        async with self.locks[name]:
            if not name:
                return self._error("'lora_name' needs to be provided to unload a LoRA "
                                   "adapter.", "InvalidUserInput", 400)
            if name not in self.requests:
                return self._error(f"The lora adapter '{name}' cannot be found.",
                                   "NotFoundError", 404)
            del self.requests[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _card(self, name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": root, "parent": parent,
                "max_model_len": None if parent else 2048, "permission": []}

    async def models(self, request: web.Request) -> web.Response:
        cards = [self._card(self.base_model, self.base_model, None)]
        cards += [self._card(n, r["lora_path"], self.base_model)
                  for n, r in self.requests.items()]
        return web.json_response({"object": "list", "data": cards})

    async def server_info(self, request: web.Request) -> web.Response:
        config = {"lora_config": self.options.lora_config()}
        fmt = request.query.get("config_format", "text")
        return web.json_response({
            "vllm_config": config if fmt == "json" else str(config),
            "vllm_env": {RUNTIME_ENV: self.options.runtime_updating,
                         "VLLM_SERVER_DEV_MODE": True,
                         "VLLM_ALLOW_INSECURE_SERIALIZATION": True},
            "system_env": {"slotsync_engine": "the reference engine: no system_env"}})

    async def lora_state(self, request: web.Request) -> web.Response:
        try:
            workers = await self.engine.pool.collective_rpc("lora_state")
        except CollectiveRpcError as e:
            return err500(e.api_message(), close=False)
        return web.json_response({
            "adapters": [{"lora_name": n, "lora_int_id": r["lora_int_id"],
                          "lora_path": r["lora_path"]} for n, r in self.requests.items()],
            "workers": [{"index": i, **w} for i, w in enumerate(workers)]})

    async def use(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        req = self.requests.get(name) if isinstance(name, str) else None
        if req is None:
            return self._error(f"The model `{name}` does not exist.", "NotFoundError", 404)
        try:
            await self.engine.pool.collective_rpc("add_lora", {"lora_request": {
                **req, "load_inplace": False}})
        except CollectiveRpcError as e:
            print(f"[slotsync.engine] EngineCore encountered a fatal error: {e}",
                  file=sys.stderr, flush=True)
            asyncio.get_running_loop().call_later(0.2, os._exit, 1)
            return self._error(ENGINE_DEAD, "InternalServerError", 500)
        return web.json_response({"lora_name": name, "lora_int_id": req["lora_int_id"]})

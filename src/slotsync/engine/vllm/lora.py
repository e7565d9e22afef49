"""LoRA adapters on the vLLM-code engine (issue 36): vLLM 0.32's own adapter routes and
handler in the front, its own worker LoRA manager in each worker.

Front (``slotsync.engine.vllm.server.build_app``): vLLM's ``serve/lora/api_router.py``
``attach_router`` (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``: registered only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, which ``python -m slotsync.engine --impl vllm``
sets unless its environment says ``0``), vLLM's ``openai/models/api_router.py``
(``GET /v1/models``), and ``app.state.openai_serving_models``: vLLM's own
``OpenAIServingModels`` over the engine client, so its checks (400s), its ``LoRARequest``
(int ids from its counter) and its error mapping (404 for ``LoRAAdapterNotFoundError``, 500
for anything else) run as in ``vllm serve``. ``/server_info``'s ``lora_config`` is a real
``LoRAConfig`` from ``--enable-lora``, ``--max-loras``, ``--max-lora-rank``,
``--max-cpu-loras`` (:func:`lora_config`).

Engine client (:class:`LoraClientMixin`, of ``VllmEngineClient``): ``AsyncLLM.add_lora`` /
``remove_lora`` / ``list_loras`` / ``pin_lora`` as engine-core utility calls, each an
``Executor`` ``collective_rpc`` of the ``Worker`` method of that name
(``v1/executor/abstract.py``: ``all(...)`` of the workers' answers).

Workers (:func:`lora_model_runner`): the ``Worker``'s ``model_runner`` is a
``LoRAModelRunnerMixin`` (vLLM's ``add_lora``, ``remove_lora``, ``list_loras``,
``pin_lora``, ``reset_lora_state``) whose ``lora_manager`` is vLLM's own
``LRUCacheWorkerLoRAManager``: ``add_adapter`` -> ``_load_adapter`` (``PEFTHelper.
from_local_dir``, ``validate_legal``, ``LoRAModel.from_local_checkpoint``) -> the LRU of
``--max-cpu-loras`` -> ``LRUCacheLoRAModelManager.add_adapter`` / ``activate_adapter``. Its
``_adapter_manager`` is vLLM's ``LRUCacheLoRAModelManager`` made without its constructor,
which would replace the model's layers by LoRA layers and build the punica kernels' wrapper
(a real vLLM model on a GPU): the model here is ``slotsync.engine.vllm.model``'s, so the
manager holds no LoRA layer (``modules`` empty: activation copies nothing), and its
``supported_lora_modules`` are the model's 2-D ``.weight`` modules but the embeddings and the
head (what vLLM's expected set is for a Llama, its packed ``qkv_proj`` / ``gate_up_proj``
unpacked). Everything else -- the folder's reading and checks, the LRU, the registry by int
id, ``reset_lora_state`` at every base-weight ``finish_weight_update`` -- is vLLM's code.

Test-only routes (the reference engine's shapes, ``slotsync.engine.reference.lora``):
``GET /_slotsync/lora`` (the adapters vLLM's ``OpenAIServingModels`` lists, and each
worker's cache: ``{"<lora_int_id>": {"rank", "checksums": {PEFT tensor name: sha256 as
read}}}``,
``loads``, ``resets``) and ``POST /_slotsync/lora/use {"lora_name"}`` (one scheduler step of
a request of that adapter: vLLM's ``set_active_adapters`` -> ``_apply_adapters`` ->
``add_adapter`` on every worker; a failure kills the engine as vLLM's engine core dies).
Faults on routes ``load_lora_adapter`` / ``unload_lora_adapter`` (:class:`LoraRouteFaults`):
``workers: null`` answers ``status`` in vLLM's error shape before vLLM's handler,
``workers: [i]`` raises inside ``Worker.add_lora`` on worker ``i``, ``exit: true`` kills the
engine once the workers got the load.
"""

from __future__ import annotations

import asyncio
import os
import sys
import types
from typing import Any

import torch
from fastapi import Request

from slotsync.engine.lora_flags import LoraOptions

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
LORA_ROUTES = {"/v1/load_lora_adapter": "load_lora_adapter",
               "/v1/unload_lora_adapter": "unload_lora_adapter"}


def lora_config(options: LoraOptions, dtype: Any = "auto") -> Any:
    """vLLM's ``LoRAConfig`` for ``options`` (None without ``--enable-lora``); ``dtype``:
    ``lora_dtype`` (a worker resolves ``"auto"`` to its model's dtype, as
    ``LoRAConfig.verify_with_model_config`` does)."""
    if not options.enabled:
        return None
    from vllm.config.lora import LoRAConfig

    return LoRAConfig(max_loras=options.max_loras, max_lora_rank=options.max_lora_rank,
                      max_cpu_loras=options.max_cpu_loras, lora_dtype=dtype)


def _lora_modules(model: torch.nn.Module) -> list[str]:
    """The model's LoRA-capable modules as vLLM's manager names them (last component)."""
    return sorted({n.removesuffix(".weight").rsplit(".", 1)[-1]
                   for n, p in model.named_parameters()
                   if n.endswith(".weight") and p.dim() == 2}
                  - {"embed_tokens", "lm_head"})


def _model_manager(model: torch.nn.Module, config: Any, device: torch.device) -> Any:
    """vLLM's ``LRUCacheLoRAModelManager`` over ``model``, made without LoRA layers (module
    docstring): the attributes its ``__init__`` sets, with ``modules`` empty."""
    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager

    m = object.__new__(LRUCacheLoRAModelManager)
    m.model, m.supported_lora_modules = model, _lora_modules(model)
    m.adapter_type, m.lora_config, m.device = "LoRA", config, device
    m._registered_adapters = AdapterLRUCache(m.capacity, m.deactivate_adapter)
    m._active_adapters = AdapterLRUCache(m.lora_slots, m._deactivate_adapter)
    m.lora_index_to_id = [None] * m.lora_slots
    m.is_pooling_model, m._pooling_task = False, None
    m.packed_modules, m.modules, m.packed_modules_mapping = {}, {}, {}
    m._last_mapping = m._last_slot_layout = None
    m._is_moe = m._enable_mixed_moe_lora_format = m._enable_moe_shared_loras = False
    m._is_3d_moe_model = m._is_non_gated_moe = m._use_ep = False
    m.supported_modules_to_save = set()
    m._classification_head = None
    m.moe_ep_load_spec = None
    m.supports_mm = False
    return m


def lora_model_runner(model: torch.nn.Module, draft: torch.nn.Module | None,
                      options: LoraOptions, device: torch.device) -> Any:
    """The ``model_runner`` of a vLLM-code worker (``slotsync.engine.vllm.worker``): what
    the weight-update methods read (``model``, ``get_model``, ``get_draft_model``,
    ``reset_mm_cache``, ``reset_encoder_cache``) and vLLM's ``LoRAModelRunnerMixin`` over
    vLLM's ``LRUCacheWorkerLoRAManager`` (module docstring); without ``--enable-lora`` its
    ``lora_config`` is None, so ``reset_lora_state`` does nothing and ``add_lora`` raises
    vLLM's "LoRA is not enabled. Use --enable-lora to enable LoRA."."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    class Manager(LRUCacheWorkerLoRAManager):
        """vLLM's manager, counting the folders it reads and keeping the checksums of each
        adapter as read (before ``LoRALayerWeights.optimize`` scales ``lora_b`` in place)."""

        loads = 0
        read_sums: dict[int, dict[str, str]]

        def _load_adapter(self, lora_request: Any) -> Any:
            lora = super()._load_adapter(lora_request)
            self.loads += 1
            self.read_sums[lora.id] = _checksums(lora)
            return lora

    class Runner(LoRAModelRunnerMixin):
        """vLLM's LoRA mixin, counting ``reset_lora_state`` calls."""

        resets = 0

        def reset_lora_state(self) -> None:
            super().reset_lora_state()
            if self.lora_config:
                self.resets += 1

    runner = Runner()
    runner.model = model
    runner.get_model = lambda: model
    runner.get_draft_model = lambda: draft
    runner.reset_mm_cache = lambda: None
    runner.reset_encoder_cache = lambda: None
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                 torch.float32)
    runner.lora_config = lora_config(options, dtype)
    if runner.lora_config is None:
        return runner
    mgr = object.__new__(Manager)
    mgr._lora_model_cls, mgr.embedding_modules = LoRAModel, {}
    mgr._cached_dummy_lora = False
    mgr.lora_config, mgr.device = runner.lora_config, device
    mgr.max_position_embeddings = None
    embed = dict(model.named_parameters()).get("model.embed_tokens.weight")
    mgr.vocab_size = 0 if embed is None else embed.shape[0]
    mgr._adapter_manager = _model_manager(model, runner.lora_config, device)
    mgr.read_sums = {}
    runner.lora_manager = mgr
    return runner


def _checksums(lora: Any) -> dict[str, str]:
    """sha256 of each tensor of a ``LoRAModel`` as ``from_local_checkpoint`` made it, under
    its PEFT name (``base_model.model.<module>.lora_A.weight``)."""
    from slotsync.engine.checksum import tensor_checksum

    sums = {}
    for module, w in lora.loras.items():
        sums[f"base_model.model.{module}.lora_A.weight"] = tensor_checksum(w.lora_a)
        sums[f"base_model.model.{module}.lora_B.weight"] = tensor_checksum(w.lora_b)
    return dict(sorted(sums.items()))


def worker_lora_state(runner: Any) -> dict[str, Any]:
    """A worker's part of ``GET /_slotsync/lora``: each cached adapter's rank and the
    sha256 of each of its tensors as read from its folder (:func:`_checksums`)."""
    mgr = getattr(runner, "lora_manager", None)
    if mgr is None:
        return {"loaded": {}, "loads": 0, "resets": 0}
    loaded = {str(i): {"rank": lora.rank, "checksums": mgr.read_sums.get(i, {})}
              for i, lora in mgr._adapter_manager.list_adapters().items()}
    return {"loaded": loaded, "loads": mgr.loads, "resets": runner.resets}


def use_lora(runner: Any, lora_request: Any) -> None:
    """One scheduler step of a request of ``lora_request`` on this worker: vLLM's
    ``set_active_adapters`` (``_apply_adapters`` -> ``add_adapter``; no punica mapping)."""
    runner._ensure_lora_enabled()
    runner.lora_manager.set_active_adapters({lora_request}, None)


class LoraClientMixin:
    """``AsyncLLM``'s adapter calls for ``VllmEngineClient`` (module docstring), and what
    ``OpenAIServingModels`` reads of its engine client."""

    executor: Any
    faults: Any
    lora_inject: dict[int, str] | None = None
    lora_die_after: float | None = None

    def init_lora(self, model_path: str, options: LoraOptions) -> None:
        """The served model's name and config as ``OpenAIServingModels`` reads them, and
        ``vllm_config.lora_config`` (set after the ``VllmConfig``: its constructor wants a
        model config to resolve ``lora_dtype``)."""
        self.served_model = model_path
        self.model_config = types.SimpleNamespace(model=model_path, max_model_len=2048)
        self.renderer = self.input_processor = None
        self.vllm_config.lora_config = lora_config(options)  # type: ignore[attr-defined]

    async def _lora_rpc(self, utility: str, method: str, args: list[Any]) -> list[Any]:
        async def work(inject: dict[int, str] | None) -> list[Any]:
            return await self.executor.collective_rpc(method, {"_args": args}, inject)

        return await self._utility(None, utility, work)  # type: ignore[attr-defined]

    async def add_lora(self, lora_request: Any) -> bool:
        """``AsyncLLM.add_lora``: utility ``add_lora`` -> every worker's ``add_lora``."""
        inject, self.lora_inject = self.lora_inject, None
        die_after, self.lora_die_after = self.lora_die_after, None

        async def work(_: dict[int, str] | None) -> bool:
            call = self.executor.collective_rpc("add_lora", {"_args": [lora_request]}, inject)
            if die_after is not None:  # (test fault: the engine dies mid-load)
                task = asyncio.ensure_future(call)
                await asyncio.sleep(die_after)
                print(f"[slotsync.engine] fault: the engine dies during an adapter load "
                      f"({task})", file=sys.stderr, flush=True)
                os._exit(1)
            return all(await call)

        return await self._utility(None, "add_lora", work)  # type: ignore[attr-defined]

    async def remove_lora(self, lora_id: int) -> bool:
        """``AsyncLLM.remove_lora``."""
        return all(await self._lora_rpc("remove_lora", "remove_lora", [lora_id]))

    async def list_loras(self) -> set[int]:
        """``AsyncLLM.list_loras`` (the first worker's set, as ``Executor.list_loras``)."""
        return set((await self._lora_rpc("list_loras", "list_loras", []))[0])

    async def pin_lora(self, lora_id: int) -> bool:
        """``AsyncLLM.pin_lora``."""
        return all(await self._lora_rpc("pin_lora", "pin_lora", [lora_id]))


class LoraRouteFaults:
    """Pure ASGI middleware: faults of ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (module docstring)."""

    def __init__(self, app: Any, client: Any) -> None:
        self.app = app
        self.client = client

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        route = LORA_ROUTES.get(scope.get("path", "")) if scope.get("type") == "http" else None
        f = self.client.faults.match(route) if route else None
        if f is not None:
            if f.exit:
                if route == "unload_lora_adapter":
                    os._exit(1)
                self.client.lora_die_after = f.hang_s or 0.05
            else:
                if f.hang_s:
                    await asyncio.sleep(f.hang_s)
                if f.workers is not None:
                    self.client.lora_inject = {i: f.text() for i in f.workers}
                elif f.status >= 400:
                    from http import HTTPStatus

                    from fastapi.responses import JSONResponse
                    from vllm.entrypoints.serve import create_error_response

                    err = create_error_response(message=f.text(),
                                                status_code=HTTPStatus(f.status),
                                                err_type="BadRequestError"
                                                if f.status == 400 else "InternalServerError")
                    await JSONResponse(err.model_dump(), status_code=f.status)(
                        scope, receive, send)
                    return
        await self.app(scope, receive, send)


def attach(app: Any, client: Any) -> None:
    """vLLM's LoRA router (runtime updating on), its models router, its
    ``OpenAIServingModels`` as ``app.state.openai_serving_models``, the test-only routes
    and the faults' middleware."""
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.openai.models import api_router as models_api
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora import api_router as lora_api

    app.state.openai_serving_models = OpenAIServingModels(
        client, [BaseModelPath(name=client.served_model, model_path=client.served_model)])
    lora_api.attach_router(app)
    models_api.attach_router(app)
    app.add_middleware(LoraRouteFaults, client=client)

    @app.get("/_slotsync/lora")
    async def slotsync_lora() -> JSONResponse:
        models = app.state.openai_serving_models
        answers = await asyncio.gather(*await client.pool.submit("lora_state"))
        return JSONResponse({
            "adapters": [{"lora_name": n, "lora_int_id": r.lora_int_id, "lora_path": r.lora_path}
                         for n, r in models.lora_requests.items()],
            "workers": [{"index": i, **(p if ok else {"error": str(p)})}
                        for i, (ok, p) in enumerate(answers)]})

    @app.post("/_slotsync/lora/use")
    async def slotsync_lora_use(raw_request: Request) -> JSONResponse:  # (Request: global,
        # for FastAPI to resolve the annotation under ``from __future__ import annotations``)
        name = (await raw_request.json()).get("lora_name")
        req = app.state.openai_serving_models.lora_requests.get(name)
        if req is None:
            return JSONResponse({"error": {"message": f"The model `{name}` does not exist.",
                                           "type": "NotFoundError", "param": "model",
                                           "code": 404}}, status_code=404)
        try:
            await client.executor.collective_rpc("use_lora", {"_args": [req]})
        except Exception as e:  # noqa: BLE001 -- vLLM's engine core dies of any
            print(f"[slotsync.engine] EngineCore encountered a fatal error: {e}",
                  file=sys.stderr, flush=True)
            asyncio.get_running_loop().call_later(0.2, os._exit, 1)
            return JSONResponse({"error": {"message": ENGINE_DEAD, "type":
                                           "InternalServerError", "param": None,
                                           "code": 500}}, status_code=500)
        return JSONResponse({"lora_name": name, "lora_int_id": req.lora_int_id})

"""One worker of the vLLM-code engine (``python -m slotsync.engine --impl vllm``).

Each worker process holds a real ``vllm.v1.worker.gpu_worker.Worker`` made without its
constructor (``object.__new__(Worker)``) and given exactly the attributes its weight-update
methods read, and calls vLLM's own methods on it, so vLLM's per-worker state machine runs:

============================  ===================================================================
``Worker`` attribute          value
============================  ===================================================================
``vllm_config``               ``VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=
                              TP, data_parallel_size=D), weight_transfer_config=
                              WeightTransferConfig(backend="ipc"))``, then as an engine core
                              of a dense model sets it (``core.py`` ``run_engine_core``):
                              ``data_parallel_index = i // TP``,
                              ``reconfigure_for_independent_dp_rank()``
``parallel_config``           ``vllm_config.parallel_config`` (as ``WorkerBase.__init__``)
``rank``                      ``i % TP`` (the TP rank within its DP replica)
``local_rank``                the worker's global index ``i``
``weight_transfer_engine``    vLLM's ``IPCWeightTransferEngine``, made by
                              ``WeightTransferEngineFactory.create_engine`` (as
                              ``Worker.load_model``)
``_weight_update_active``,    ``False`` (as ``Worker.__init__``)
``_weight_update_is_draft``
``model_runner``              ``model``, ``get_model()``, ``get_draft_model()`` (the draft
                              model of ``--draft-model``, else None), ``reset_mm_cache()`` /
                              ``reset_encoder_cache()`` (no caches), and vLLM's
                              ``LoRAModelRunnerMixin`` (``add_lora``, ``reset_lora_state``,
                              ...) over vLLM's ``LRUCacheWorkerLoRAManager`` with
                              ``--enable-lora`` (``slotsync.engine.vllm.lora``)
``speculative_config``        with ``--draft-model``: ``draft_model_config`` (a stand-in
                              naming the file, ``dtype`` None: the config the draft session's
                              ``finalize_layerwise_reload`` gets), else None (as
                              ``WorkerBase.__init__``)
============================  ===================================================================

Draft sessions (issue 18) run vLLM's own code: ``Worker.start_draft_weight_update`` ->
``_start_weight_update(is_draft=True)`` -> ``_set_draft_weight_update_target`` (the IPC
engine's ``set_weight_update_target(draft, draft_model_config)``), the same
``update_weights`` into the draft model, and ``finish_weight_update``
(``reset_weight_update_target``; no LoRA reset for a draft session). Without a draft model it
fails as vLLM does ("Draft model weight update requested, but no draft model is
configured."). vLLM's ``compute_weight_checksums`` covers the main model only; the draft
model's digests (vLLM's ``compute_tensor_digests``, the same prefix) are in ``stats``.

vLLM code that runs for real here: ``Worker.init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``,
``shutdown_weight_transfer_engine``, ``compute_weight_checksums`` (``_weight_checksum_prefix``,
``compute_tensor_digests``), ``reset_weights`` (``zero_weights``), ``synchronize_device``;
``IPCWeightTransferEngine`` (``parse_init_info`` / ``parse_update_info``, unpickling
``ipc_handles_pickled`` under ``VLLM_ALLOW_INSECURE_SERIALIZATION``, ``receive_weights``,
``packed_ipc_consumer``, ``PackedBufferImporter``); layerwise reload
(``initialize_layerwise_reload`` at start, ``finalize_layerwise_reload`` at finish);
``default_weight_loader``; ``record_metadata_for_reloading`` (``slotsync.engine.vllm.model``).

Memory vLLM leaves uninitialized shows: the worker turns on torch's deterministic mode
(``use_deterministic_algorithms(True, warn_only=True)``, ``fill_uninitialized_memory``), so
``torch.empty*`` is filled with NaN (floating) or the largest value (integers).

Stood in for: vLLM's distributed groups in ``_weight_checksum_prefix`` (``get_tp_group`` ->
rank = ``i % TP``, ``get_pp_group`` / ``get_pcp_group`` -> rank 0), the CUDA calls of the
receive path (``slotsync.engine.cuda_standin``), and sleep: ``Worker.sleep`` / ``wake_up``
need vLLM's CuMem allocator, so :meth:`VllmWorkerHost.sleep` does what it does to the
weights -- level 1 keeps them (offloaded and restored), level 2 discards them: every weight
byte becomes ``0xFF`` (NaN for floating dtypes), what "no contents" looks like after a wake.

Fault injection (test-only ``inject="<message>"`` in a call's keyword arguments) raises
``RuntimeError(message)`` *inside* vLLM's weight transfer engine, so that vLLM's ``Worker``
reacts as it really does: in ``parse_init_info`` (init), the engine's
``start_weight_update`` hook (start: the session does not open), ``receive_weights``
(update: ``Worker.update_weights`` ends the session), the engine's ``finish_weight_update``
hook (finish: ``_weight_update_active`` stays set), ``shutdown`` (shutdown); at the entry of
any other method.

The process speaks the reference engine's worker protocol (``slotsync.engine.pool``): it
answers each ``(method, kwargs)`` with ``("ok", result)`` or ``("err", str(exception))`` --
what vLLM's ``WorkerProc.enqueue_output`` sends back (``str(output)``; an ``AssertionError``
without a message gives ``""``).
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from slotsync.engine.lora_flags import LoraOptions
from slotsync.engine.worker_pipe import failure, next_request, start_worker


@dataclass(frozen=True)
class VllmWorkerSpec:
    """What the parent tells a vLLM-code worker process at spawn.

    Attributes:
        index: the worker's global index within the engine, 0-based (``dp_index * TP +
            rank``: the order of ``--gpu-uuids`` and of a list-form ``update_info``).
        device: ``"cpu"`` or ``"cuda:<i>"``.
        gpu_uuid: torch-format GPU UUID to answer to, or None on CUDA for the real one.
        model_path: safetensors file the model is built from.
        world_size: workers of one DP replica (``tensor_parallel_size``; vLLM's
            ``parallel_config.world_size``).
        draft_model_path: safetensors file of the speculative-decoding draft model, or None
            (no draft model, as an engine without ``--speculative-config``).
        data_parallel_size: DP replicas of the engine (``--data-parallel-size``).
    """

    index: int
    device: str
    gpu_uuid: str | None
    model_path: str
    world_size: int
    data_parallel_size: int = 1
    draft_model_path: str | None = None
    lora: LoraOptions = LoraOptions()  # --enable-lora and its limits (issue 36)

    @property
    def rank(self) -> int:
        """TP rank within the DP replica (vLLM's ``Worker.rank``)."""
        return self.index % self.world_size

    @property
    def dp_index(self) -> int:
        """DP replica (vLLM's ``parallel_config.data_parallel_index``)."""
        return self.index // self.world_size


# Method -> the weight-transfer-engine attribute that raises an injected fault.
_FAULT_HOOKS = {
    "init_weight_transfer_engine": "parse_init_info",
    "start_weight_update": "start_weight_update",
    # (vLLM's _start_weight_update calls the engine's start hook for a draft session too,
    # after _set_draft_weight_update_target)
    "start_draft_weight_update": "start_weight_update",
    "update_weights": "receive_weights",
    "finish_weight_update": "finish_weight_update",
    "shutdown_weight_transfer_engine": "shutdown",
}


def _fill_discarded(t: torch.Tensor) -> None:
    """Overwrite every byte of ``t`` with 0xFF (level-2 sleep discarded the weights)."""
    if t.numel() and not t.is_meta:
        t.data.reshape(-1).view(torch.uint8).fill_(0xFF)


class VllmWorkerHost:
    """One vLLM ``Worker`` and the stand-ins around it (see the module docstring). Every
    public method is a ``collective_rpc`` target."""

    def __init__(self, spec: VllmWorkerSpec) -> None:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        # What vLLM leaves uninitialized (``torch.empty_strided`` in layerwise reload's
        # ``materialize_meta_tensor``) is filled by torch (NaN, or the largest integer), so
        # that it shows in a checksum instead of holding whatever the allocator had.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
        from slotsync.engine.worker_device import worker_device

        self.index = spec.index
        self.spec = spec
        self.device, self.gpu_uuid = worker_device(spec.device, spec.gpu_uuid)
        from slotsync.engine import cuda_standin

        cuda_standin.install(self.device, self.gpu_uuid)

        import vllm.v1.worker.gpu_worker as gpu_worker
        from vllm.config import ParallelConfig, VllmConfig
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory

        from slotsync.engine.vllm.model import load_model

        cuda_standin.patch_ipc_engine()
        # _weight_checksum_prefix reads the distributed groups' ranks: without vLLM's
        # distributed init, answer this worker's TP rank (and rank 0 of PP / PCP).
        tp = types.SimpleNamespace(rank_in_group=spec.rank)
        one = types.SimpleNamespace(rank_in_group=0)
        gpu_worker.get_tp_group = lambda: tp
        gpu_worker.get_pp_group = lambda: one
        gpu_worker.get_pcp_group = lambda: one

        self.model = load_model(spec.model_path, self.device)
        self.draft = (None if spec.draft_model_path is None
                      else load_model(spec.draft_model_path, self.device))
        parallel_config = ParallelConfig(tensor_parallel_size=spec.world_size,
                                         data_parallel_size=spec.data_parallel_size)
        if spec.data_parallel_size > 1:  # vLLM 0.32 core.py run_engine_core, a dense model
            parallel_config.data_parallel_index = spec.dp_index
            parallel_config.reconfigure_for_independent_dp_rank()
        vllm_config = VllmConfig(
            parallel_config=parallel_config,
            weight_transfer_config=WeightTransferConfig(backend="ipc"),
        )
        model, draft = self.model, self.draft
        w = object.__new__(gpu_worker.Worker)
        w.vllm_config = vllm_config
        w.parallel_config = vllm_config.parallel_config
        w.rank = spec.rank
        w.local_rank = spec.index
        from slotsync.engine.vllm.lora import lora_model_runner

        # (vLLM's LoRAModelRunnerMixin over its LRUCacheWorkerLoRAManager: engine/vllm/lora.py)
        w.model_runner = lora_model_runner(model, draft, spec.lora, self.device)
        w.speculative_config = None if draft is None else types.SimpleNamespace(
            draft_model_config=types.SimpleNamespace(model=spec.draft_model_path, dtype=None))
        w._weight_update_active = False
        w._weight_update_is_draft = False
        w.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
            vllm_config.weight_transfer_config, vllm_config, self.device, model
        )
        self.worker = w
        # vLLM's WorkerProc holds a WorkerWrapperBase (v1/executor/multiproc_executor.py
        # ``self.worker = wrapper``): /collective_rpc's method is looked up on it, and its
        # __getattr__ forwards what it lacks to the Worker. rpc_rank: the worker's rank in its
        # engine core's executor (with DP, each replica's own: its TP rank).
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        self.wrapper = object.__new__(WorkerWrapperBase)
        self.wrapper.rpc_rank, self.wrapper.global_rank = spec.rank, spec.rank
        self.wrapper.worker = w
        self._fault: str | None = None
        self._install_fault_hooks()
        self.counts = {k: 0 for k in ("init_count", "start_count", "finish_count",
                                      "update_count", "shutdown_count",
                                      "draft_start_count")}
        self.sleep_level = 0

    # -- fault injection ----------------------------------------------------------------

    def _install_fault_hooks(self) -> None:
        """Wrap the engine's hook methods (instance attributes; the class is untouched) so
        that a pending injected fault raises inside them."""
        engine = self.worker.weight_transfer_engine
        for attr in set(_FAULT_HOOKS.values()):
            real = getattr(engine, attr)

            def hooked(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                msg, self._fault = self._fault, None
                if msg is not None:
                    raise RuntimeError(msg)
                return _real(*args, **kwargs)

            setattr(engine, attr, hooked)

    @contextmanager
    def _injected(self, method: str, inject: str | None):
        """Arm ``inject`` for the hook of ``method`` (or raise it now, for methods without
        one); disarm it afterwards (a call that failed before reaching its hook)."""
        if inject is not None and method not in _FAULT_HOOKS:
            raise RuntimeError(inject)
        self._fault = inject
        try:
            yield
        finally:
            self._fault = None

    # -- vLLM Worker methods ------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: Any, inject: str | None = None) -> None:
        """vLLM's ``Worker.init_weight_transfer_engine(init_info)``."""
        with self._injected("init_weight_transfer_engine", inject):
            self.worker.init_weight_transfer_engine(init_info)
        self.counts["init_count"] += 1

    def start_weight_update(self, inject: str | None = None) -> None:
        """vLLM's ``Worker.start_weight_update()``: layerwise reload puts the parameters on
        the meta device until finish."""
        with self._injected("start_weight_update", inject):
            self.worker.start_weight_update()
        self.counts["start_count"] += 1

    def start_draft_weight_update(self, inject: str | None = None) -> None:
        """vLLM's ``Worker.start_draft_weight_update()`` (issue 18): the session's updates
        load into the draft model; without one, vLLM's error."""
        with self._injected("start_draft_weight_update", inject):
            self.worker.start_draft_weight_update()
        self.counts["draft_start_count"] += 1

    def update_weights(self, update_info: Any, inject: str | None = None) -> None:
        """vLLM's ``Worker.update_weights(update_info)`` (a dict, or a list indexed by global
        worker rank)."""
        with self._injected("update_weights", inject):
            self.worker.update_weights(update_info)
        self.counts["update_count"] += 1

    def finish_weight_update(self, inject: str | None = None) -> None:
        """vLLM's ``Worker.finish_weight_update()``."""
        with self._injected("finish_weight_update", inject):
            self.worker.finish_weight_update()
        self.counts["finish_count"] += 1

    def shutdown_weight_transfer_engine(self, inject: str | None = None) -> None:
        """vLLM's ``Worker.shutdown_weight_transfer_engine()``."""
        with self._injected("shutdown_weight_transfer_engine", inject):
            self.worker.shutdown_weight_transfer_engine()
        self.counts["shutdown_count"] += 1

    def compute_weight_checksums(self, inject: str | None = None) -> dict[str, str]:
        """vLLM's ``Worker.compute_weight_checksums()``: ``{"dp<d>:pp0:pcp0:tp<t>:<name>":
        sha256 hex of the raw bytes}`` (``d``, ``t``: this worker's DP replica and TP rank);
        fails on meta-device parameters."""
        with self._injected("compute_weight_checksums", inject):
            return self.worker.compute_weight_checksums()

    def reset_weights(self, inject: str | None = None) -> None:
        """vLLM's ``Worker.reset_weights()`` (``/weight_checker`` ``reset``): zeroes every
        weight."""
        with self._injected("reset_weights", inject):
            self.worker.reset_weights()

    def synchronize_device(self, inject: str | None = None) -> None:
        """vLLM's ``WorkerBase.synchronize_device()`` (the engine core's pause runs it)."""
        with self._injected("synchronize_device", inject):
            self.worker.synchronize_device()

    def reset_mm_cache(self, inject: str | None = None) -> None:
        """``Worker.reset_mm_cache()`` (pause with ``clear_cache``): no multimodal cache."""
        with self._injected("reset_mm_cache", inject):
            self.worker.model_runner.reset_mm_cache()

    def reset_encoder_cache(self, inject: str | None = None) -> None:
        """``Worker.reset_encoder_cache()`` (pause with ``clear_cache``): no encoder cache."""
        with self._injected("reset_encoder_cache", inject):
            self.worker.model_runner.reset_encoder_cache()

    def _draft_stats(self) -> dict[str, Any]:
        """``stats``' draft-model part (issue 18): ``has_draft``, ``draft_session`` (the
        active session targets it), ``draft_num_weights``, ``draft_checksums``."""
        if self.draft is None:
            return {"has_draft": False}
        return {
            "has_draft": True,
            "draft_session": bool(self.worker._weight_update_active
                                  and self.worker._weight_update_is_draft),
            "draft_num_weights": len(list(self.draft.parameters())),
            "draft_checksums": _draft_digests(self),
        }

    # -- stand-ins ----------------------------------------------------------------------

    def sleep(self, level: int = 1, inject: str | None = None) -> None:
        """Stand-in for ``Worker.sleep(level)`` (see the module docstring): level 2 discards
        every weight (bytes become 0xFF), level 1 keeps them."""
        with self._injected("sleep", inject):
            if level >= 2:
                with torch.no_grad():
                    for p in self.model.parameters():
                        _fill_discarded(p)
                    for p in self.draft.parameters() if self.draft is not None else ():
                        _fill_discarded(p)  # (the draft model's weights go too)
            self.sleep_level = level

    def wake_up(self, tags: list[str] | None = None, inject: str | None = None) -> None:
        """Stand-in for ``Worker.wake_up(tags)``: the weights are resident again (with
        whatever contents sleep left them)."""
        with self._injected("wake_up", inject):
            if tags is None or "weights" in tags:
                self.sleep_level = 0

    def lora_state(self, inject: str | None = None) -> dict[str, Any]:
        """This worker's adapters (``GET /_slotsync/lora``, ``engine/vllm/lora.py``)."""
        from slotsync.engine.vllm.lora import worker_lora_state

        return worker_lora_state(self.worker.model_runner)

    def use_lora(self, lora_request: Any, inject: str | None = None) -> None:
        """One scheduler step of a request of ``lora_request`` (``engine/vllm/lora.py``)."""
        from slotsync.engine.vllm.lora import use_lora

        with self._injected("use_lora", inject):
            use_lora(self.worker.model_runner, lora_request)

    def stats(self, inject: str | None = None) -> dict[str, Any]:
        """Counters for ``GET /_slotsync/stats`` (counts of successful calls)."""
        params = list(self.model.parameters())
        engine = self.worker.weight_transfer_engine
        return {
            **self._draft_stats(),
            "index": self.index,
            "dp_index": self.worker.parallel_config.data_parallel_index,
            "tp_rank": self.worker.rank,
            "gpu_uuid": self.gpu_uuid,
            "device": str(self.device),
            "active": bool(self.worker._weight_update_active),
            "servable": not any(p.is_meta for p in params),
            "packed": bool(engine.packed),
            **self.counts,
            "num_weights": len(params),
            "sleep_level": self.sleep_level,
        }


def _draft_digests(host: VllmWorkerHost) -> dict[str, str] | str:
    """The draft model's digests as vLLM's ``compute_weight_checksums`` would write them
    (``compute_tensor_digests``, this worker's prefix), or the error text (meta tensors)."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    try:
        prefix = host.worker._weight_checksum_prefix()
        return {prefix + n: d for n, d in compute_tensor_digests(host.draft).items()}
    except Exception as e:  # noqa: BLE001 -- reported, as /weight_checker would fail
        return f"{type(e).__name__}: {e}"


def _call(host: VllmWorkerHost, method: str, kwargs: dict[str, Any]) -> Any:
    """Run one request: the host's method of that name, else (``/collective_rpc`` with any
    method) what vLLM's ``WorkerProc`` runs (``getattr(self.worker, method)`` on its
    ``WorkerWrapperBase``, which forwards other names to the ``Worker``: e.g.
    ``check_health``, or ``__getattribute__("rpc_rank")``; an unknown name is its
    ``AttributeError``).
    ``_args``: positional arguments; ``inject``: a test fault, raised at once for a Worker
    method."""
    args = kwargs.pop("_args", ())
    fn = getattr(type(host), method, None)
    if fn is not None and not method.startswith("_"):
        return getattr(host, method)(*args, **kwargs)
    inject = kwargs.pop("inject", None)
    target = getattr(host.wrapper, method)
    if inject is not None:
        raise RuntimeError(inject)
    return target(*args, **kwargs)


def vllm_worker_main(spec: VllmWorkerSpec, conn: Connection) -> None:
    """Entry point of a vLLM-code worker process (multiprocessing, spawn context).

    Sends ``("ready", {"gpu_uuid", "device"})`` or ``("err", traceback)`` once, then serves
    ``(method, kwargs)`` requests in order until ``("exit", {})`` or until the parent goes.
    """
    host = start_worker(conn, lambda: VllmWorkerHost(spec))
    if host is None:
        return
    while (request := next_request(conn)) is not None:
        method, kwargs = request
        if method == "exit":
            conn.send(("ok", None))
            return
        try:
            answer: tuple[str, Any] = ("ok", _call(host, method, kwargs))
        except Exception as e:  # vLLM's WorkerProc: any Exception becomes a FAILURE reply
            answer = failure(spec.index, method, e)
        conn.send(answer)

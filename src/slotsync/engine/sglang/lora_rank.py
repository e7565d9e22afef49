"""One TP rank's LoRA adapters in the SGLang-code engine (issue 36 B): SGLang's own
``TpModelWorker``, ``ModelRunner`` and ``LoRAManager`` code (``lora_code.py``) over views of
the objects it reads, in the rank's worker process.

``load_lora_adapter_from_tensors`` runs ``TpModelWorker.load_lora_adapter_from_tensors``
(``srt/managers/tp_worker.py``): ``deserialize_own_rank`` (``monkey_patch_torch_reductions``
and ``MultiprocessingSerializer.deserialize`` of entry ``tp_rank``: ``SafeUnpickler``, the
CUDA rebuild through ``_rebuild_cuda_tensor_modified`` -- on the CPU over slotsync's
shared-memory stand-in, ``standin.py``), the ``flattened_bucket`` branch with SGLang's
``FlattenedTensorBucket``, the ``expected_checksums`` check (a mismatch raises: a scheduler
exception, the engine dies), then ``ModelRunner.load_lora_adapter_from_tensors`` ->
``LoRAManager.load_lora_adapter_from_tensors`` -> ``_load_lora_adapter_from_tensors``
(``LoRAConfig.from_dict``, ``validate_new_adapter`` with ``LoRAMemoryPool.can_support``,
then the weights). What stands in (``lora_code.py``'s docstring): ``load_lora_weights_from_tensors``
keeps a host copy of every tensor (``LoRAAdapter._process_weight``: ``loaded_weight.cpu()``;
on the CPU ``.cpu()`` is the tensor itself, so the copy is explicit), the memory pool holds
no GPU buffers (``remove_lora`` frees nothing) and ``get_parallel()`` answers the rank. The
received tensors are locals of SGLang's method: they die when it returns, as in SGLang.

``unload_lora_adapter`` runs ``TpModelWorker.unload_lora_adapter`` ->
``ModelRunner.unload_lora_adapter`` -> ``LoRAManager.unload_lora_adapter``.
:meth:`LoraRank.checksums` gives each loaded adapter's tensors' sha256, computed as SGLang's
check computes them (``tensor.detach().cpu().contiguous().flatten().view(torch.uint8)``).

Each result goes back as a plain dict (``LoRAUpdateOutput``'s fields: the struct's class is
compiled per process and does not cross the pipe).
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import torch

from slotsync.engine.sglang import lora_code


def sglang_sha256(t: torch.Tensor) -> str:
    """SGLang's ``expected_checksums`` digest of ``t`` (tp_worker.py
    ``load_lora_adapter_from_tensors``)."""
    return hashlib.sha256(
        t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


class _MemPool:
    """``LoRAMemoryPool``'s attributes ``can_support`` reads (SGLang's method, compiled), and a
    ``remove_lora`` that frees nothing (no GPU buffers here)."""

    def __init__(self, can_support: Any, max_lora_rank: int, target_modules: set[str]) -> None:
        self._can_support = can_support
        self.max_lora_rank = max_lora_rank
        self.target_modules = target_modules
        self.lora_added_tokens_size = 0

    def can_support(self, config: Any) -> bool:
        return self._can_support(self, config)

    def remove_lora(self, lora_id: str) -> None:
        return None


def _bind(obj: Any, funcs: dict[str, Any]) -> None:
    """Bind the cut methods ``funcs`` (each takes ``self``) to ``obj``."""
    for name, fn in funcs.items():
        setattr(obj, name, fn.__get__(obj))


class LoraRank:
    """One TP rank's LoRA state (module docstring).

    Args:
        tp_rank: the rank (its entry in ``serialized_named_tensors``).
        max_lora_rank: ``--max-lora-rank``.
        target_modules: ``--lora-target-modules`` (names, or ``["all"]``).
        max_loras_per_batch: ``--max-loras-per-batch``.
        vocab_size: the base model's vocabulary (``LoRAConfig.from_dict``'s
            ``base_vocab_size``).
    """

    def __init__(self, tp_rank: int, max_lora_rank: int, target_modules: list[str],
                 max_loras_per_batch: int, vocab_size: int = 32000) -> None:
        self.tp_rank = tp_rank
        parallel = SimpleNamespace(tp_rank=tp_rank, dp_size=1)
        code = lora_code.rank(lambda: parallel)
        self.structs = lora_code.structs()
        normalize = code["utils"].get_normalized_target_modules
        if "all" in target_modules:
            from sglang.srt.utils.common import SUPPORTED_LORA_TARGET_MODULES

            modules = normalize(SUPPORTED_LORA_TARGET_MODULES)
        else:
            modules = normalize(target_modules)
        # LoRAManager: the attributes its cut methods read
        m = SimpleNamespace(
            attn_dp_enabled=False, lora_refs={}, configs={}, loras={}, num_pinned_loras=0,
            max_loras_per_batch=max_loras_per_batch, base_hf_config=SimpleNamespace(
                vocab_size=vocab_size), device=torch.device("cpu"),
            memory_pool=_MemPool(code["mem_pool"].can_support, max_lora_rank, modules),
            _notify_lora_slots_updated=lambda slots: None)
        _bind(m, lora_code.methods(code["manager"], lora_code.MANAGER_METHODS))
        m.load_lora_weights_from_tensors = self._load_weights
        self.manager = m
        runner = SimpleNamespace(lora_manager=m)
        _bind(runner, lora_code.methods(code["runner"], lora_code.RUNNER_METHODS))
        worker = SimpleNamespace(model_runner=runner)
        _bind(worker, lora_code.methods(code["tp_worker"], lora_code.TP_WORKER_METHODS))
        self.worker = worker
        self.copies: dict[str, dict[str, torch.Tensor]] = {}
        """Each loaded adapter's host copies (lora_id -> {name: tensor})."""

    def _load_weights(self, lora_ref: Any, tensors: dict[str, torch.Tensor]) -> None:
        """``LoRAManager.load_lora_weights_from_tensors``'s stand-in: a host copy of each
        tensor (``LoRAAdapter._process_weight``'s ``loaded_weight.cpu()``)."""
        self.copies[lora_ref.lora_id] = {
            name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        self.manager.loras[lora_ref.lora_id] = lora_ref

    def load(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``TpModelWorker.load_lora_adapter_from_tensors`` on the request of ``fields``
        (``LoadLoRAAdapterFromTensorsReqInput``'s, ``lora_id`` set by the tokenizer).

        Raises:
            whatever SGLang's method raises (a refused global, "Invalid device_uuid", a
            misaligned bucket tensor, "[LORA-CHECK] ... MISMATCH"): the engine dies of it.
        """
        req = self.structs.LoadLoRAAdapterFromTensorsReqInput(**fields)
        result = self.worker.load_lora_adapter_from_tensors(req)
        return _plain(result)

    def unload(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``TpModelWorker.unload_lora_adapter`` (then the host copies go)."""
        req = self.structs.UnloadLoRAAdapterReqInput(**fields)
        result = self.worker.unload_lora_adapter(req)
        if result.success:
            self.copies.pop(req.lora_id, None)
        return _plain(result)

    def checksums(self) -> dict[str, dict[str, str]]:
        """``{lora_name: {tensor name: sha256}}`` of every loaded adapter's host copies."""
        names = {i: ref.lora_name for i, ref in self.manager.lora_refs.items()}
        return {names.get(i, i): {n: sglang_sha256(t) for n, t in copies.items()}
                for i, copies in self.copies.items()}


def _plain(result: Any) -> dict[str, Any]:
    """``LoRAUpdateOutput``'s fields as a plain dict (``loaded_adapters`` values are paths)."""
    return {"success": bool(result.success), "error_message": result.error_message,
            "loaded_adapters": None if result.loaded_adapters is None
            else {k: str(v) for k, v in result.loaded_adapters.items()}}

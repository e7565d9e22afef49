"""Reference-engine workers that receive through vLLM's own IPC path (``--receive vllm``).

For the GPU machine, where the vllm wheel cannot be installed but
``vllm/distributed/weight_transfer/{base,ipc_engine,packed_tensor}.py`` (plain Python) can be
made importable with ``tools/vllm_shim.py``: the reference engine's front and per-worker
state machine stay the reference engine's, and each chunk is loaded by vLLM's
``IPCWeightTransferEngine.update_weights`` -- ``parse_update_info`` (unpickling
``ipc_handles_pickled``), ``receive_weights`` (the GPU-UUID lookup, ``rebuild_cuda_tensor``,
packed: ``packed_ipc_consumer`` and the engine's ``PackedBufferImporter``), then
``torch.accelerator.synchronize()`` -- into a model whose ``load_weights`` copies each tensor
in place into the worker's weights (:class:`InPlaceLoader`). vLLM's layerwise reload is not
used (``start_weight_update`` / ``finish_weight_update`` of the engine are not called: the
reference weights are plain tensors); the session's end closes the importer, as vLLM's
``IPCWeightTransferEngine.finish_weight_update`` does (a failed chunk leaves it, as vLLM's
``Worker.update_weights`` does).

``SLOTSYNC_VLLM_SHIM=DIR`` puts ``DIR`` first on ``sys.path`` (the folder
``tools/vllm_shim.py DIR`` writes), so that its ``vllm`` package is the one imported.
The CUDA calls are stood in for exactly as in the vLLM-code engine
(``slotsync.engine.cuda_standin``): the worker's (logical) GPU UUID, and on CPU the
shared-memory rebuild and a no-op ``torch.accelerator.synchronize``.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

SHIM_ENV = "SLOTSYNC_VLLM_SHIM"


def use_shim_path() -> str | None:
    """Prepend ``$SLOTSYNC_VLLM_SHIM`` to ``sys.path`` (once), if set; returns it."""
    d = os.environ.get(SHIM_ENV)
    if d and d not in sys.path:
        sys.path.insert(0, d)
    return d or None


def receive_env(shim_dir: str | os.PathLike[str] | None = None) -> dict[str, str] | None:
    """The extra environment under which an engine subprocess can import
    ``vllm.distributed.weight_transfer.ipc_engine`` (for ``--receive vllm``): ``{}`` when
    this interpreter's own vllm has it, ``{"SLOTSYNC_VLLM_SHIM": shim_dir}`` when the shim
    folder imports, else None (tests skip then). Checked in a fresh interpreter (unless this
    one has already imported it), once per process and ``shim_dir``."""
    import subprocess

    key = os.fspath(shim_dir) if shim_dir is not None else None
    if key in _receive_envs:
        return _receive_envs[key]
    if "vllm.distributed.weight_transfer.ipc_engine" in sys.modules:
        _receive_envs[key] = {}  # this interpreter's own vllm has it: no need to ask another
        return {}
    code = "import vllm.distributed.weight_transfer.ipc_engine"
    tries: list[dict[str, str]] = [{}]
    if shim_dir is not None and os.path.isdir(shim_dir):
        tries.append({SHIM_ENV: os.fspath(shim_dir)})
    for extra in tries:
        env = {**os.environ, **extra}
        if extra:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (extra[SHIM_ENV], os.environ.get("PYTHONPATH", "")) if p)
        try:
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0:
            _receive_envs[key] = extra
            return extra
    _receive_envs[key] = None
    return None


_receive_envs: dict[str | None, dict[str, str] | None] = {}  # receive_env's answers, once each


class InPlaceLoader:
    """The "model" handed to vLLM's engine: ``load_weights(weights)`` calls ``load`` with the
    ``(name, tensor)`` list (which copies them into the worker's weights) and remembers the
    bytes it loaded."""

    def __init__(self, load: Callable[[list[tuple[str, torch.Tensor]]], int]) -> None:
        self._load = load
        self.last_bytes = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's model API: load every pair; returns the names loaded."""
        pairs = list(weights)
        self.last_bytes = self._load(pairs)
        return {n for n, _ in pairs}


class VllmReceiver:
    """vLLM's ``IPCWeightTransferEngine`` for one reference worker.

    Args:
        device: the worker's device.
        gpu_uuid: the worker's (logical) GPU UUID.
        load: copies a list of ``(name, tensor)`` into the worker's weights; returns bytes.

    Raises:
        ImportError: ``vllm.distributed.weight_transfer.ipc_engine`` cannot be imported.
    """

    def __init__(self, device: torch.device, gpu_uuid: str,
                 load: Callable[[list[tuple[str, torch.Tensor]]], int]) -> None:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        use_shim_path()
        from slotsync.engine import cuda_standin

        cuda_standin.install(device, gpu_uuid)
        from vllm.config.parallel import ParallelConfig
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        cuda_standin.patch_ipc_engine()
        self.loader = InPlaceLoader(load)
        # base.WeightTransferEngine.__init__ reads vllm_config.parallel_config / .model_config
        vllm_config = types.SimpleNamespace(parallel_config=ParallelConfig(), model_config=None)
        self.engine = IPCWeightTransferEngine(
            WeightTransferConfig(backend="ipc"), vllm_config, device, self.loader  # type: ignore[arg-type]
        )
        self.vllm_file = sys.modules[IPCWeightTransferEngine.__module__].__file__
        self.packed_maps = 0
        self._last_storage: int | None = None

    @property
    def packed(self) -> bool:
        """The engine's packed flag (set by :meth:`init`)."""
        return bool(self.engine.packed)

    def init(self, init_info: Any) -> None:
        """``parse_init_info`` + ``init_transfer_engine`` (as vLLM's
        ``Worker.init_weight_transfer_engine``).

        Raises:
            ValueError: vLLM's ``Invalid init_info for IPCWeightTransferEngine: ...``.
        """
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def update(self, update_info: Any) -> int:
        """vLLM's ``update_weights(update_info)``; returns the bytes loaded.

        Raises:
            whatever vLLM's parse / receive / load raise (``ValueError``, a bare
            ``AssertionError`` for a payload of the other shape, ...).
        """
        self.loader.last_bytes = 0
        self.engine.update_weights(update_info)
        entry = self.engine._packed_importer._entry
        if entry is not None:
            ptr = entry[1].untyped_storage().data_ptr()
            if ptr != self._last_storage:
                self.packed_maps += 1
                self._last_storage = ptr
        return self.loader.last_bytes

    def end_session(self) -> None:
        """Release the packed buffer's mapping (vLLM's ``finish_weight_update``:
        ``self._packed_importer.close()``)."""
        self.engine._packed_importer.close()
        self._last_storage = None

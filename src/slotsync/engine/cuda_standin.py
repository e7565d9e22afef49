"""Stand-ins for exactly the CUDA calls vLLM's receive path makes, in one worker process.

vLLM 0.32's IPC receive path (``ipc_engine.IPCWeightTransferEngine.receive_weights``,
``packed_tensor.packed_ipc_consumer`` / ``PackedBufferImporter.rebuild``) makes three calls that
need a GPU, or a GPU of its own:

* ``str(torch.cuda.get_device_properties(device_index).uuid)``: the worker's GPU UUID, the key
  it looks up in each ``{gpu_uuid: args}`` dict. With logical GPU UUIDs (several workers on
  one physical GPU, ``--gpu-uuids``) each worker must answer its own: :func:`install` makes
  that lookup return the worker's (logical) UUID, on CPU and on CUDA alike; every other
  property (and every other device) is the real one on CUDA.
* ``rebuild_cuda_tensor(*list_args)`` (``ipc_engine`` imports it at module level,
  ``PackedBufferImporter.rebuild`` imports it lazily from
  ``torch.multiprocessing.reductions``): on CPU only, both names are replaced by a function
  with the same 15 parameters that maps a shared-memory stand-in
  (``slotsync.engine.shm.rebuild_shm_tensor``) and hands any other tuple to torch's own
  (which then fails as it would on a machine without CUDA).
* ``torch.accelerator.synchronize()`` (``WeightTransferEngine.update_weights``, vLLM 0.32
  ``base.py``, after every chunk): without an accelerator torch raises "Cannot access
  accelerator device when none is available"; on CPU it becomes a no-op (there is nothing
  asynchronous to wait for).

Everything else -- the GPU-UUID-not-found error, the slot 6 overwrite, the importer's cache
keyed by the args, unpack / clone, ``load_weights`` -- stays vLLM's code.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from slotsync.engine.shm import is_shm_args, rebuild_shm_tensor

_REAL: dict[str, Any] = {}


class _UuidProps:
    """What ``torch.cuda.get_device_properties(i)`` answers for the worker's own device:
    ``uuid`` is the worker's (logical) GPU UUID; any other attribute comes from the real
    properties (CUDA), or raises ``AttributeError`` (CPU: there are none)."""

    def __init__(self, uuid: str, real: Any = None) -> None:
        self.uuid = uuid
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if self._real is None:
            raise AttributeError(f"CPU stand-in device properties have no {name!r}")
        return getattr(self._real, name)

    def __repr__(self) -> str:
        return f"_UuidProps(uuid={self.uuid!r}, real={self._real!r})"


def _device_index(device: Any) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index


def install(device: torch.device, gpu_uuid: str) -> None:
    """Install the stand-ins described in the module docstring for this process.

    Args:
        device: the worker's device (``cpu`` or ``cuda:<i>``).
        gpu_uuid: the torch-format GPU UUID this worker answers to (36 characters, no
            ``GPU-``); on CUDA with the device's real UUID nothing is patched for it.

    Idempotent; call it before vLLM's receive path runs (it also patches
    ``vllm.distributed.weight_transfer.ipc_engine`` when that module is imported already or
    later, see :func:`patch_ipc_engine`).
    """
    if "get_device_properties" not in _REAL:
        _REAL["get_device_properties"] = torch.cuda.get_device_properties
        _REAL["rebuild_cuda_tensor"] = torch.multiprocessing.reductions.rebuild_cuda_tensor
        _REAL["synchronize"] = torch.accelerator.synchronize
    real_props = _REAL["get_device_properties"]
    if device.type == "cuda":
        mine = device.index if device.index is not None else torch.cuda.current_device()
        if str(real_props(mine).uuid) != gpu_uuid:

            def get_device_properties(dev: Any = None) -> Any:
                idx = _device_index(dev)
                if idx is None:
                    idx = torch.cuda.current_device()
                props = real_props(idx)
                return _UuidProps(gpu_uuid, props) if idx == mine else props

            torch.cuda.get_device_properties = get_device_properties
        return

    def cpu_device_properties(dev: Any = None) -> Any:
        return _UuidProps(gpu_uuid)

    torch.cuda.get_device_properties = cpu_device_properties
    torch.multiprocessing.reductions.rebuild_cuda_tensor = rebuild_cuda_tensor
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = _no_accelerator_synchronize
    patch_ipc_engine()


def uninstall() -> None:
    """Put torch's own functions back (and ``ipc_engine.rebuild_cuda_tensor``, if loaded).
    For tests that install the stand-ins in their own process."""
    if not _REAL:
        return
    torch.cuda.get_device_properties = _REAL["get_device_properties"]
    torch.multiprocessing.reductions.rebuild_cuda_tensor = _REAL["rebuild_cuda_tensor"]
    torch.accelerator.synchronize = _REAL["synchronize"]
    mod = sys.modules.get("vllm.distributed.weight_transfer.ipc_engine")
    if mod is not None:
        mod.rebuild_cuda_tensor = _REAL["rebuild_cuda_tensor"]  # type: ignore[attr-defined]
    _REAL.clear()


def _no_accelerator_synchronize(device: Any = None) -> None:
    """CPU stand-in for ``torch.accelerator.synchronize``: nothing runs asynchronously."""


def rebuild_cuda_tensor(
    tensor_cls: Any, tensor_size: Any, tensor_stride: Any, tensor_offset: Any,
    storage_cls: Any, dtype: Any, storage_device: Any, storage_handle: Any,
    storage_size_bytes: Any, storage_offset_bytes: Any, requires_grad: Any,
    ref_counter_handle: Any, ref_counter_offset: Any, event_handle: Any,
    event_sync_required: Any,
) -> torch.Tensor:
    """CPU stand-in for ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` (same 15
    parameters): a shared-memory stand-in tuple is mapped by
    ``slotsync.engine.shm.rebuild_shm_tensor`` (aliasing the segment); any other tuple goes
    to torch's own function, which fails without CUDA as it would anywhere.

    Raises:
        whatever ``rebuild_shm_tensor`` or torch's ``rebuild_cuda_tensor`` raise.
    """
    args = (tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
            storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
            requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
            event_sync_required)
    if is_shm_args(args):
        return rebuild_shm_tensor(*args)
    return _REAL["rebuild_cuda_tensor"](*args)


def patch_ipc_engine() -> None:
    """Point ``vllm.distributed.weight_transfer.ipc_engine.rebuild_cuda_tensor`` (bound at
    its import) at the CPU stand-in, if that module is loaded. Call again after importing it;
    a no-op when :func:`install` ran for a CUDA device."""
    if torch.multiprocessing.reductions.rebuild_cuda_tensor is not rebuild_cuda_tensor:
        return
    mod = sys.modules.get("vllm.distributed.weight_transfer.ipc_engine")
    if mod is not None:
        mod.rebuild_cuda_tensor = rebuild_cuda_tensor  # type: ignore[attr-defined]

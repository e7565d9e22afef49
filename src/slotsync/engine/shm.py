"""The CPU shared-memory stand-in for a CUDA IPC handle, as the engines receive it.

The daemon writes a ``ShmHandle`` (``slotsync.protocol.wire``) into ``ipc_handles_pickled``
as a 15-tuple shaped exactly like ``torch.multiprocessing.reductions.reduce_tensor(t)[1]`` of
a CUDA tensor (``slotsync.daemon.vllm.ipc_pickle``), so that vLLM's own receive code
(``list_args = list(args); list_args[6] = device_index; rebuild_cuda_tensor(*list_args)``,
vLLM 0.32 ``ipc_engine.IPCWeightTransferEngine.receive_weights`` and
``packed_tensor.packed_ipc_consumer``) takes it unchanged:

====  ======================  ==================================================================
slot  field                   shared-memory stand-in
====  ======================  ==================================================================
0     tensor class            ``torch.Tensor``
1     size                    packed: ``torch.Size([nbytes])``; unpacked: the tensor's shape
2     stride                  contiguous strides of slot 1
3     storage offset          ``0`` (elements)
4     storage class           ``torch.storage.TypedStorage``
5     dtype                   packed: ``torch.uint8``; unpacked: the tensor's dtype
6     device index            ``0`` (the receiver overwrites it with its own)
7     storage handle          ``b"slotsync.shm:" + segment name`` (``/dev/shm/<segment>``)
8     storage size bytes      the region's byte count
9     storage offset bytes    the region's byte offset in the segment
10    requires_grad           ``False``
11    ref-counter handle      ``b""`` (nothing is reference-counted)
12    ref-counter offset      ``0``
13    event handle            ``None``
14    event_sync_required     ``False``
====  ======================  ==================================================================

:func:`rebuild_shm_tensor` is the engines' stand-in for ``rebuild_cuda_tensor`` on such a
tuple: the returned tensor *aliases* the shared memory (as a CUDA IPC mapping aliases the
producer's GPU memory), so vLLM's ``PackedBufferImporter`` -- which caches the mapping keyed by
the args and reuses it for every chunk of one export -- reads each chunk's current bytes.
Linux only (``/dev/shm``).
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

SHM_HANDLE_PREFIX = b"slotsync.shm:"
"""Slot 7 (storage handle) of a shared-memory stand-in starts with these bytes."""

SHM_DIR = "/dev/shm"


def is_shm_args(args: Any) -> bool:
    """Whether ``args`` is a 15-slot shared-memory stand-in (slot 7 starts with
    :data:`SHM_HANDLE_PREFIX`)."""
    return (
        isinstance(args, (tuple, list))
        and len(args) == 15
        and isinstance(args[7], bytes)
        and args[7].startswith(SHM_HANDLE_PREFIX)
    )


def shm_segment(args: Any) -> str:
    """The segment name in slot 7 of a shared-memory stand-in.

    Raises:
        ValueError: not a stand-in, or a name that is not a plain file name.
    """
    if not is_shm_args(args):
        raise ValueError("not a slotsync shared-memory handle")
    name = args[7][len(SHM_HANDLE_PREFIX):].decode("utf-8", "replace")
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad shared-memory segment name {name!r}")
    return name


def _map_segment(name: str) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)  # shared, read-write; stays valid after the fd is closed
    finally:
        os.close(fd)


def rebuild_shm_tensor(
    tensor_cls: type,
    tensor_size: Any,
    tensor_stride: Any,
    tensor_offset: int,
    storage_cls: type,
    dtype: torch.dtype,
    storage_device: Any,
    storage_handle: bytes,
    storage_size_bytes: int,
    storage_offset_bytes: int,
    requires_grad: bool,
    ref_counter_handle: Any,
    ref_counter_offset: Any,
    event_handle: Any,
    event_sync_required: Any,
) -> torch.Tensor:
    """``rebuild_cuda_tensor``'s signature and result for a shared-memory stand-in: a CPU
    tensor of ``dtype``, ``tensor_size`` / ``tensor_stride`` / ``tensor_offset`` (elements)
    over bytes ``[storage_offset_bytes, storage_offset_bytes + storage_size_bytes)`` of
    ``/dev/shm/<segment>``, aliasing that memory (no copy).

    As torch's ``rebuild_cuda_tensor`` (torch 2.x ``multiprocessing/reductions.py``) does:
    the storage is ``storage_size_bytes`` long, the tensor is laid over it with
    ``torch._utils._rebuild_tensor`` (which refuses a size/stride that does not fit), and a
    ``Parameter`` class gives ``Parameter(t, requires_grad)``. ``storage_device`` (slot 6,
    overwritten by the receiver) is not used: the memory is host memory.

    Raises:
        ValueError: slot 7 is not a stand-in handle, or the region lies outside the segment.
        FileNotFoundError: no such segment.
        RuntimeError: the size / stride / offset do not fit the storage (torch's own check).
    """
    args = (tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
            storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
            requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
            event_sync_required)
    name = shm_segment(args)
    size_b, off_b = int(storage_size_bytes), int(storage_offset_bytes)
    if size_b == 0:
        untyped = torch.UntypedStorage(0)
    else:
        mm = _map_segment(name)
        if off_b < 0 or size_b < 0 or off_b + size_b > len(mm):
            raise ValueError(
                f"shared memory {name!r} has {len(mm)} bytes; handle asks for "
                f"[{off_b}, {off_b + size_b})"
            )
        # frombuffer keeps a reference to the mmap: it is unmapped with the last tensor
        untyped = torch.frombuffer(mm, dtype=torch.uint8, count=size_b,
                                   offset=off_b).untyped_storage()
    t = torch._utils._rebuild_tensor(
        torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True),
        int(tensor_offset), tuple(tensor_size), tuple(tensor_stride),
    )
    if tensor_cls == torch.nn.parameter.Parameter:
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad = bool(requires_grad)
    return t


def read_shm_args(args: Any) -> torch.Tensor:
    """A copy (own memory) of the tensor a shared-memory stand-in describes (see
    :func:`rebuild_shm_tensor`, whose errors it raises)."""
    if not is_shm_args(args):
        raise ValueError("not a slotsync shared-memory handle")
    return rebuild_shm_tensor(*args).detach().clone()

"""CPU only: stand-ins for exactly the CUDA calls vLLM's *trainer* send path makes, so that
``slotsync bench vs-vllm --device cpu`` runs vLLM's own ``IPCTrainerWeightTransferEngine`` into
the reference engine's ``--receive vllm`` workers (whose receive side
``slotsync.engine.cuda_standin`` stands in for). On CUDA nothing here is used.

vLLM 0.32's trainer side (``ipc_engine.IPCTrainerWeightTransferEngine``,
``packed_tensor.packed_ipc_producer``) makes these calls that need a GPU; :func:`install`
replaces them **in those two modules only** (their module-level ``torch`` and
``reduce_tensor`` names; the rest of the process, slotsync's ``Publisher`` included, keeps
torch's own):

==========================================================  ====================================
vLLM's call                                                 stand-in
==========================================================  ====================================
``torch.accelerator.current_device_index()`` (``__init__``)  ``0``
``torch.cuda.get_device_properties(i).uuid`` (``__init__``)  the engine worker's (logical) GPU
                                                            UUID, as ``cuda_standin`` answers on
                                                            the receive side
``torch.empty(n, dtype=torch.uint8, device="cuda")``        a uint8 tensor over a POSIX
(``packed_ipc_producer``: its one IPC buffer)               shared-memory segment
                                                            (``slotsync.protocol.rank.shm_segment``),
                                                            one per size, reused by later
                                                            rounds as CUDA's caching allocator
                                                            reuses the block
``reduce_tensor(t)`` (both modules)                         ``(rebuild_cuda_tensor, args)`` with
                                                            ``args`` the 15-slot shared-memory
                                                            stand-in of ``slotsync.engine.shm``
                                                            for ``t`` (slot 7: its segment,
                                                            slots 8/9: the whole storage, slot
                                                            3: ``t.storage_offset()``), for a
                                                            tensor whose storage is a segment
                                                            made here (:meth:`Standin.empty`,
                                                            :meth:`Standin.arena`); any other
                                                            tensor is refused (``ValueError``)
``torch.cuda.current_stream().synchronize()``,              no-ops: nothing on CPU runs
``torch.cuda.synchronize()``, ``torch.cuda.ipc_collect()``  asynchronously, and nothing is
                                                            reference-counted across processes
==========================================================  ====================================

So the trainer's weights must live in shared memory on CPU too, as a GPU trainer's live in
IPC-shareable device memory: :meth:`Standin.arena` gives one segment the bench lays them out
in. Everything else -- the handle dicts keyed by GPU UUID, packing, ``tensor_sizes``, the
HTTP client, the order of calls -- stays vLLM's code. :meth:`Standin.close` unlinks every
segment made here (``/dev/shm/slotsync-<pid>-r<rank>-<n>``).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from slotsync.protocol.rank.shm_segment import ShmSegment

SHM_HANDLE_PREFIX = b"slotsync.shm:"
"""Slot 7 of a shared-memory stand-in (``slotsync.engine.shm``) starts with these bytes."""

MODULES = (
    "vllm.distributed.weight_transfer.ipc_engine",
    "vllm.distributed.weight_transfer.packed_tensor",
)
"""The two vLLM modules :func:`install` patches."""


class _Namespace:
    """``real``'s attributes, except those given as keywords (a module seen through a few
    replaced names)."""

    def __init__(self, real: Any, **replaced: Any) -> None:
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Props:
    """``torch.cuda.get_device_properties(i)`` on CPU: only ``uuid``."""

    def __init__(self, uuid: str) -> None:
        self.uuid = uuid


class _Stream:
    """``torch.cuda.current_stream()`` on CPU: ``synchronize`` does nothing."""

    def synchronize(self) -> None:
        """Nothing to wait for on CPU."""


def _nothing(*args: Any, **kwargs: Any) -> None:
    """``torch.cuda.synchronize`` / ``ipc_collect`` on CPU."""


class Standin:
    """The stand-ins of one trainer rank process (see the module docstring).

    Args:
        gpu_uuid: the (logical, torch-format) GPU UUID the engine worker answers to.
        rank: names the segments (``slotsync-<pid>-r<rank>-<n>``).
    """

    def __init__(self, gpu_uuid: str, rank: int = 0) -> None:
        self.gpu_uuid = gpu_uuid
        self.rank = rank
        self._segments: dict[int, ShmSegment] = {}  # storage data_ptr -> its segment
        self._by_size: dict[int, torch.Tensor] = {}  # empty()'s buffers, reused per size
        self.torch = _Namespace(
            torch,
            empty=self.empty,
            accelerator=_Namespace(torch.accelerator, current_device_index=lambda: 0),
            cuda=_Namespace(
                torch.cuda,
                get_device_properties=self.device_properties,
                current_stream=lambda *a, **k: _Stream(),
                synchronize=_nothing,
                ipc_collect=_nothing,
            ),
        )

    def device_properties(self, device: Any = None) -> _Props:
        """``torch.cuda.get_device_properties``: the worker's GPU UUID."""
        return _Props(self.gpu_uuid)

    def _segment(self, nbytes: int) -> torch.Tensor:
        seg = ShmSegment(nbytes, rank=self.rank)
        assert seg.tensor is not None
        self._segments[seg.tensor.untyped_storage().data_ptr()] = seg
        return seg.tensor

    def arena(self, nbytes: int) -> torch.Tensor:
        """A new uint8 tensor of ``nbytes`` over a shared-memory segment, for the trainer's
        weights (lay them out as views at offsets aligned to their element size).

        Raises:
            OSError: the segment cannot be made (``/dev/shm`` too small).
        """
        return self._segment(nbytes)

    def empty(
        self, *size: Any, dtype: torch.dtype | None = None, device: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        """``torch.empty`` as vLLM's two modules see it: ``device="cuda"`` gives a tensor over a
        shared-memory segment (the same one for the same byte count, as CUDA's caching
        allocator hands back a freed block); any other device is torch's own."""
        if device is None or torch.device(device).type != "cuda":
            return torch.empty(*size, dtype=dtype, device=device, **kwargs)
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        dt = dtype or torch.get_default_dtype()
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes not in self._by_size:
            self._by_size[nbytes] = self._segment(nbytes)
        return self._by_size[nbytes].view(dt).view(shape)

    def reduce_tensor(self, t: torch.Tensor) -> tuple[Any, tuple]:
        """``torch.multiprocessing.reductions.reduce_tensor`` for a tensor in a segment made
        here: ``(rebuild_cuda_tensor, args)``, ``args`` the 15-slot stand-in of
        ``slotsync.engine.shm`` (the receiver overwrites slot 6 and maps the rest).

        Raises:
            ValueError: ``t``'s storage is not a segment made here.
        """
        storage = t.untyped_storage()
        seg = self._segments.get(storage.data_ptr())
        if seg is None:
            raise ValueError(
                "vs-vllm CPU stand-in: vLLM's trainer path can only export tensors "
                "in shared memory made by slotsync.bench.vllm_trainer_standin"
            )
        args = (
            type(t),
            t.size(),
            t.stride(),
            t.storage_offset(),
            torch.storage.TypedStorage,
            t.dtype,
            0,
            SHM_HANDLE_PREFIX + seg.name.encode(),
            storage.nbytes(),
            0,
            t.requires_grad,
            b"",
            0,
            None,
            False,
        )
        return torch.multiprocessing.reductions.rebuild_cuda_tensor, args

    def close(self) -> None:
        """Unlink every segment made here (drop the tensors over them first). Idempotent."""
        self._by_size.clear()
        segs, self._segments = list(self._segments.values()), {}
        for seg in segs:
            seg.close_and_unlink()


def install(gpu_uuid: str, rank: int = 0) -> Standin:
    """Point vLLM's ``ipc_engine`` and ``packed_tensor`` modules (imported here) at a new
    :class:`Standin`'s ``torch`` and ``reduce_tensor``; returns it (``close`` it at the end).

    Raises:
        ImportError: vLLM's modules cannot be imported.
    """
    import importlib

    s = Standin(gpu_uuid, rank)
    for name in MODULES:
        mod = sys.modules.get(name) or importlib.import_module(name)
        mod.torch = s.torch  # type: ignore[attr-defined]
        mod.reduce_tensor = s.reduce_tensor  # type: ignore[attr-defined]
    return s

"""One TP rank's ``serialized_named_tensors`` entry of SGLang's ``POST
/load_lora_adapter_from_tensors``, written from the slot ranks' adapter handles without torch
(issue 36 B).

What SGLang reads (0.5.20 / 0.5.21 / 0.5.23, the same code in the three;
``srt/managers/tp_worker.py`` ``TpModelWorker.load_lora_adapter_from_tensors``): TP rank ``r``
unpickles entry ``r`` (``deserialize_own_rank``: ``monkey_patch_torch_reductions()`` then
``MultiprocessingSerializer.deserialize``, i.e. ``SafeUnpickler``), then

* ``load_format == "flattened_bucket"``: ``tensors = dict(FlattenedTensorBucket(
  flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]).reconstruct_tensors())``
  -- :func:`bucket_entry`, when one rank's handle holds every tensor;
* else ``tensors = data``, then ``name in tensors``, ``tensors[name]``, ``for n in tensors``
  and ``tensors.items()`` (``LoRAAdapter.initialize_weights_from_tensors``,
  ``srt/lora/lora.py``): a **dict** ``{name: tensor}`` -- :func:`dict_entry`, when several
  ranks hold whole tensors. (A list of ``(name, tensor)`` pairs, the base-weight route's
  unpacked form, would make every expected checksum "missing" and ``.items()`` raise.)

Every TP rank gets the **whole** adapter ("The LoRA code handles TP sharding internally",
tp_worker.py; ``slice_lora_a_weights`` / ``slice_lora_b_weights``): each entry names every
tensor, each rebuilt over the memory of the rank that holds it, with argument 6 the GPU UUID
of *that* rank's GPU (``gpu_uuids[rank]``), so TP rank ``r`` maps the holder's allocation
(peer to peer when it is another GPU) and ``_device_from_maybe_uuid`` finds it among the
rank's visible GPUs. A tensor split over ranks cannot be written: a CUDA tensor is one
allocation, and no allow-listed global joins two (``adapters.refusal``).

Each tensor of the dict form is a view of its rank's part: a ``torch.Tensor`` of its shape,
contiguous strides and element offset ``(storage_offset + offset) / itemsize`` over the part's
storage (CUDA), or over the part's shared-memory region (the CPU stand-in, written as
``torch_pickle._shm_tail``). The bucket's ``flattened_tensor`` is the holder's part itself
(a flat uint8 region), its metadata ``FlattenedTensorMetadata(name, shape, dtype, start_idx,
end_idx, numel)`` at the part's own offsets (``wire.part_offsets``: 256-byte aligned, not back
to back as a base-weight bucket's).

CUDA IPC reference counts (torch 2.x ``multiprocessing/reductions.py`` ``rebuild_cuda_tensor``
and ``StorageSharing.cpp``): the rank exported its part once (``reduce_tensor``: one count in
the producer's shared counter); a consumer process releases one count when its mapping dies,
and one more at once for each further rebuild of an allocation it has mapped already
(``_release_ipc_counter``). Every TP rank rebuilds every holder's allocation at least once, so
with the rank's counter in every rebuild the count would go below zero and torch's limbo would
keep the part for the producer's life. Exactly one rebuild per handle in the whole body
carries the real counter -- the first of TP rank 0's entry (``counted``), which maps it: its
release comes when TP rank 0 frees the tensors; every other carries :data:`NO_REF_COUNTER`, a
counter name no file has, whose release torch skips ("resource deletion is best effort basis",
the ``try``/``catch (c10::Error&)`` around both releases). The count then returns to zero
once, and the rank's ``del`` of its part gives the block back. When the rank may free it is
``adapters.py``'s docstring (the daemon's proof, not this count).

Refusals (``tensor_pickle.SglangPayloadError``, before anything is sent: an exception in
SGLang's scheduler kills the server): a GPU UUID SGLang would not map
(``tensor_pickle.check_uuid``); a CUDA region that is not flat uint8, or lies outside its
storage; a tensor past its region's end; a tensor whose start is not a multiple of its
dtype's itemsize -- from the storage's start (``.view(dtype)`` of the bucket; the view's
element offset of the dict form) and from the allocation's start (the address).
Only ``tensor_pickle.WRITABLE_GLOBALS`` are written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import msgspec

from slotsync.daemon.sglang.tensor_pickle import (
    _BUILD,
    _EMPTY_TUPLE,
    _FLAT_CLASS,
    _FLAT_STORAGE,
    _K_DTYPE,
    _K_END,
    _K_FLAT,
    _K_META,
    _K_NAME,
    _K_NUMEL,
    _K_SHAPE,
    _K_START,
    _METADATA,
    _NEWOBJ,
    _REBUILD,
    SglangPayloadError,
    _cuda_fits,
    _cuda_tail,
    _uuid_ops,
)
from slotsync.daemon.torch_pickle import (
    _APPENDS,
    _BIT,
    _EMPTY_DICT,
    _EMPTY_LIST,
    _GET,
    _MARK,
    _PROTO4,
    _REDUCE,
    _SETITEMS,
    _STOP,
    _contiguous_stride,
    _int,
    _layout_fragment,
    _Memo,
    _prelude,
    _shm_tail,
    _str,
)
from slotsync.protocol.wire import DTYPE_SIZES, CudaIpcHandle, Handle, ShmHandle

NO_REF_COUNTER = b"/slotsync-no-ref-counter"
"""The ref-counter handle of every rebuild but one per CUDA handle (module docstring): a
POSIX shared-memory name no process creates, so torch's ``_release_ipc_counter`` and its IPC
deleter fail to open it and skip the release."""


class TensorAt(NamedTuple):
    """One whole adapter tensor and where it lies: ``name`` (PEFT), ``dtype`` (a ``wire``
    dtype name), ``shape``, held by slot rank ``rank`` at bytes ``[offset, offset + nbytes)``
    of that rank's handle."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    rank: int
    offset: int
    nbytes: int


def check_region(rank: int, handle: Handle, tensors: Sequence[TensorAt]) -> None:
    """The tensors of ``rank`` fit its ``handle`` and start where SGLang can view them (module
    docstring).

    Raises:
        SglangPayloadError: naming the rank and the tensor.
        TypeError: ``handle`` is not a handle record.
    """
    if isinstance(handle, ShmHandle):
        have = handle.nbytes
        bases = ((0, "its shared-memory region"),
                 (handle.offset, "its shared-memory segment"))
    elif isinstance(handle, CudaIpcHandle):
        h = handle
        if h.dtype != "uint8" or len(h.size) != 1 or h.stride != (1,):
            raise SglangPayloadError(
                f"rank {rank}'s adapter handle must be a flat uint8 region (wire.AdapterData), "
                f"not {h.dtype} of size {list(h.size)}, stride {list(h.stride)}", rank=rank)
        _cuda_fits(h, f"rank {rank}'s adapter region")
        have = h.size[0]
        bases = ((h.storage_offset, "its exported storage"),
                 (h.storage_offset_bytes + h.storage_offset, "its CUDA allocation"))
    else:
        raise TypeError(f"not a handle record: {type(handle).__name__}")
    for t in tensors:
        if t.offset + t.nbytes > have:
            raise SglangPayloadError(
                f"rank {rank}'s adapter tensor {t.name!r} ends at byte {t.offset + t.nbytes} "
                f"of a region of {have} bytes", rank=rank, tensor=t.name)
        item = DTYPE_SIZES[t.dtype]
        for base, where in bases:
            if (base + t.offset) % item:
                raise SglangPayloadError(
                    f"rank {rank}'s adapter tensor {t.name!r} ({t.dtype}) starts at byte "
                    f"{base + t.offset} of {where}, not a multiple of its {item}-byte "
                    "elements: SGLang's rebuild (.view / the view's element offset) would "
                    "raise in the scheduler, which kills the server. Lay the part out at "
                    "wire.part_offsets from a 256-byte aligned buffer", rank=rank,
                    tensor=t.name)


def _tail(handle: Handle, device: bytes, counted: bool) -> bytes:
    """The opcodes after a layout: the shared-memory stand-in's tail, or the CUDA handle's
    with its real ref counter (``counted``) or :data:`NO_REF_COUNTER`."""
    if isinstance(handle, ShmHandle):
        return _shm_tail(handle, device)
    if not counted:
        handle = msgspec.structs.replace(handle, ref_counter_handle=NO_REF_COUNTER,
                                         ref_counter_offset=0)
    return _cuda_tail(handle, device)


def _metadata(tensors: Sequence[TensorAt], memo: _Memo) -> tuple[bytes, int]:
    """The bucket's ``metadata`` list (one ``FlattenedTensorMetadata`` per tensor, at its own
    offsets) and the mask of the fixed globals it uses."""
    cls = memo.put(_METADATA)
    mask = _BIT["torch.Size"]
    parts = [_EMPTY_LIST, _MARK]
    for t in tensors:
        dt = f"torch.{t.dtype}"
        mask |= _BIT[dt]
        end = t.offset + t.nbytes
        parts.append(b"".join((
            cls, _EMPTY_TUPLE, _NEWOBJ, _EMPTY_DICT, _MARK,
            _K_NAME, _str(t.name), _K_SHAPE, memo.size(tuple(t.shape)), _K_DTYPE, _GET[dt],
            _K_START, _int(t.offset), _K_END, _int(end), _K_NUMEL, _int(t.nbytes),
            _SETITEMS, _BUILD,
        )))  # fmt: skip
    parts.append(_APPENDS)
    return b"".join(parts), mask


def bucket_entry(handle: Handle, gpu_uuid: str, tensors: Sequence[TensorAt], *,
                 counted: bool) -> bytes:
    """One TP rank's entry for ``load_format="flattened_bucket"``: ``{"flattened_tensor":
    <the holder's region, uint8>, "metadata": [FlattenedTensorMetadata(name, shape, dtype,
    start_idx=offset, end_idx=offset + nbytes, numel=nbytes), ...]}``.

    Args:
        handle: the one holder's ``AdapterData.handle`` (every tensor of ``tensors`` in it).
        gpu_uuid: the GPU the holder's memory lives on (torch's format).
        tensors: every tensor of the adapter, each with its offset in ``handle``.
        counted: this rebuild carries the handle's real ref counter (TP rank 0's entry);
            else :data:`NO_REF_COUNTER` (module docstring).

    Raises:
        SglangPayloadError: a UUID SGLang would not map, or :func:`check_region`'s refusals.
        TypeError: ``handle`` is not a handle record.
    """
    device = _uuid_ops(gpu_uuid)
    rank = tensors[0].rank if tensors else -1
    check_region(rank, handle, tensors)
    if isinstance(handle, ShmHandle):
        head, mask = _layout_fragment(_FLAT_CLASS, (handle.nbytes,), (1,), 0, _FLAT_STORAGE,
                                      "uint8")
    else:
        head, mask = _layout_fragment(handle.tensor_class, handle.size, handle.stride,
                                      handle.storage_offset, handle.storage_class, "uint8")
    memo = _Memo()
    metadata, meta_mask = _metadata(tensors, memo)
    return b"".join((
        _PROTO4, _prelude(mask | meta_mask), *memo.prelude, _EMPTY_DICT, _MARK,
        _K_FLAT, _REBUILD, head, _tail(handle, device, counted), _REDUCE,
        _K_META, metadata, _SETITEMS, _STOP,
    ))  # fmt: skip


def dict_entry(handles: Mapping[int, Handle], gpu_uuids: Mapping[int, str],
               tensors: Sequence[TensorAt], *, counted: bool) -> bytes:
    """One TP rank's entry for ``load_format=None``: ``{name: tensor, ...}``, each tensor a
    contiguous view of its holder's region (module docstring). The rebuild global, each
    holder's UUID and each distinct ``torch.Size`` and stride are written once (memo).

    Args:
        handles: each holder's ``AdapterData.handle`` (slot rank -> handle).
        gpu_uuids: the GPU each holder's memory lives on (slot rank -> torch-format UUID).
        tensors: every tensor of the adapter, in the order written.
        counted: the first rebuild of each CUDA handle carries its real ref counter (TP rank
            0's entry); every other rebuild :data:`NO_REF_COUNTER`.

    Raises:
        SglangPayloadError: a holder without a handle or a UUID, a UUID SGLang would not
            map, or :func:`check_region`'s refusals.
        TypeError: a handle that is not a handle record.
    """
    memo = _Memo()
    rebuild = memo.put(_REBUILD)
    devices: dict[int, bytes] = {}
    by_rank: dict[int, list[TensorAt]] = {}
    for t in tensors:
        by_rank.setdefault(t.rank, []).append(t)
    for rank, mine in by_rank.items():
        if handles.get(rank) is None or rank not in gpu_uuids:
            raise SglangPayloadError(f"rank {rank} holds adapter tensor {mine[0].name!r} but "
                                     "sent no handle or has no GPU UUID", rank=rank,
                                     tensor=mine[0].name)
        check_region(rank, handles[rank], mine)
        devices[rank] = memo.put(_uuid_ops(gpu_uuids[rank]))
    mask = 0
    items = []
    seen: set[int] = set()
    for t in tensors:
        h = handles[t.rank]
        item = DTYPE_SIZES[t.dtype]
        shape = tuple(t.shape)
        if isinstance(h, ShmHandle):
            layout = (_FLAT_CLASS, shape, _contiguous_stride(shape), t.offset // item,
                      _FLAT_STORAGE, t.dtype)
        else:
            layout = (_FLAT_CLASS, shape, _contiguous_stride(shape),
                      (h.storage_offset + t.offset) // item, h.storage_class, t.dtype)
        ops, m = memo.layout(*layout)
        mask |= m
        real = counted and t.rank not in seen
        seen.add(t.rank)
        items.append(b"".join((_str(t.name), rebuild, ops, _tail(h, devices[t.rank], real),
                               _REDUCE)))
    return b"".join((_PROTO4, _prelude(mask), *memo.prelude, _EMPTY_DICT, _MARK, *items,
                     _SETITEMS, _STOP))

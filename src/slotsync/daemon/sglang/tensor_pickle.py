"""Writes SGLang's ``serialized_named_tensors`` entries from typed handle records, without torch.

SGLang 0.5.20 / 0.5.21 / 0.5.23 ``POST /update_weights_from_tensor`` carries
``serialized_named_tensors: List[bytes]``, one entry per TP rank in TP-rank order; TP rank
``r`` unpickles entry ``r`` only (``TpModelWorker.deserialize_own_rank``,
``srt/managers/tp_worker.py``). Over HTTP each entry is standard base64 (``Base64Bytes``,
``srt/utils/msgspec_utils.py``; the daemon's msgspec JSON encoder writes ``bytes`` that way),
then ``normalize_serialized_named_tensor_payload`` (``srt/utils/common.py``) keeps it as is
only if it starts with a PROTO opcode, and ``MultiprocessingSerializer.deserialize`` loads it
with ``SafeUnpickler``, after ``monkey_patch_torch_reductions()`` (``srt/utils/patch_torch.py``).
docs/sglang-contract.md sections 2.4 and 3 cite the lines; this module writes its section 3.5
recipe:

* packed, ``load_format="flattened_bucket"``: ``{"flattened_tensor": <uint8 1-D CUDA tensor of
  the region's bytes>, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx,
  end_idx, numel), ...]}``; the model runner's ``_update_weights_from_flattened_bucket``
  builds a ``FlattenedTensorBucket`` and loads ``reconstruct_tensors()``, which is
  ``flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)`` per tensor
  (``srt/weight_sync/tensor_bucket.py``). Offsets are bytes, tensors back to back from the
  region's start (slotsync's packed layout, ``wire.Chunk``);
* unpacked, ``load_format=None``: ``[(name, <CUDA tensor>), ...]`` for ``model.load_weights``;
* an empty bucket (a rank with nothing to load): ``flattened_tensor`` rebuilt from
  ``(torch.Tensor, torch.Size([0]), (1,), 0, TypedStorage, torch.uint8, uuid, None, 0, 0,
  False, None, 0, None, None)`` -- what torch writes for a tensor without storage; torch's
  ``rebuild_cuda_tensor`` makes an empty storage for a ``None`` handle, no IPC -- and
  ``metadata []``.

Each CUDA tensor is ``REDUCE`` of ``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified``
(what SGLang's own patched producers pickle) over torch's 15 ``rebuild_cuda_tensor``
arguments (``CudaIpcHandle``'s fields, torch 2.13 ``multiprocessing/reductions.py``), with one
change: argument 6 is the receiving GPU's UUID as a ``str`` in torch's format (lower-case
hex with dashes, no ``GPU-``: :func:`check_uuid`), which ``_device_from_maybe_uuid`` turns
into the device index of the rank's visible GPU with that UUID, or raises "Invalid
device_uuid" in the scheduler -- and an exception there kills the whole server (2.7).

The CPU shared-memory stand-in (``ShmHandle``) is written as for vLLM
(``vllm/ipc_pickle.py``'s module docstring; ``daemon/torch_pickle.py``'s ``_shm_tail``):
storage handle ``b"slotsync.shm:" + segment``, the region's byte count and byte offset,
``False``, ``b""``, ``0``, ``None``, ``False``; but with the UUID string at argument 6, so
that SGLang's ``_rebuild_cuda_tensor_modified`` maps it to a device index and then calls the
saved original, ``reductions._rebuild_cuda_tensor_original``, which
``slotsync.engine.sglang.standin`` replaces with slotsync's shared-memory rebuild.

Rules (each refusal is a :class:`SglangPayloadError` raised before anything is sent: SGLang
cannot refuse these politely, its scheduler dies):

* every pickle starts with ``PROTO 4`` (``_looks_like_pickle_payload``: else SGLang would
  base64-decode the bytes a second time);
* only the globals of :data:`WRITABLE_GLOBALS` are ever written (the contract's table 3.6:
  all in 0.5.21/0.5.23's exact ``SafeUnpickler.ALLOWED_GLOBALS``, and admitted by 0.5.20's
  module prefixes); producer strings never become code references;
* packed: each tensor's start, counted from the exported storage's start, is a multiple of
  its dtype's itemsize (``reconstruct_tensors``' ``.view(dtype)`` raises otherwise:
  "self.storage_offset() must be divisible by 4 to view Byte as Float"); the tensors fit in
  the region, the region in its storage.

The opcode helpers, fixed memo slots of the torch globals and ``_Memo`` are ``torch_pickle``'s.
Speed, as there: each pickle loads the globals it uses once into memo slots; unpacked, the
UUID, the rebuild global and each distinct ``torch.Size`` / stride are memoized too, each
distinct layout is written once per pickle and a CUDA handle's tail is one ``struct.pack``;
packed, the metadata list is written once per chunk when every rank sends the same lists
(``serialized_named_tensors``). Measured on this project's CPU box for 8 ranks x 170 bf16
tensors: packed 0.5 ms a chunk, unpacked 2.3 ms (vLLM's unpacked pickle of the same: 0.9 ms;
SGLang's is one pickle per rank, names repeated in each).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from functools import lru_cache
from itertools import accumulate
from typing import NamedTuple

from slotsync.daemon.torch_pickle import (
    _APPENDS,
    _BIT,
    _EMPTY_DICT,
    _EMPTY_LIST,
    _FALSE,
    _GET,
    _GLOBALS,
    _MARK,
    _NONE,
    _PROTO4,
    _REDUCE,
    _SETITEMS,
    _STOP,
    _TRUE,
    _TUPLE,
    _2_31,
    _after_device_format,
    _bytes_once,
    _contiguous_stride,
    _global,
    _int,
    _layout_fragment,
    _Memo,
    _prelude,
    _shm_tail,
    _str,
)
from slotsync.protocol.wire import (
    DTYPE_SIZES,
    Chunk,
    CudaIpcHandle,
    Handle,
    ShmHandle,
    normalize_gpu_uuid,
)

REBUILD_GLOBAL = "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified"
"""The rebuild function every tensor is ``REDUCE``d with (SGLang 0.5.20-0.5.23
``srt/utils/patch_torch.py``; what a producer that ran ``monkey_patch_torch_reductions``
pickles)."""

METADATA_GLOBAL = "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"
"""The packed bucket's per-tensor record (a plain ``@dataclass``, ``srt/weight_sync/
tensor_bucket.py``), built as ``cls.__new__(cls)`` + ``BUILD`` of its field dict."""

WRITABLE_GLOBALS: frozenset[str] = frozenset((REBUILD_GLOBAL, METADATA_GLOBAL, *_GLOBALS))
"""Every global this module can write (docs/sglang-contract.md table 3.6): the two SGLang
names above, ``torch.Tensor``, ``torch.nn.parameter.Parameter``, ``torch.Size``,
``torch.storage.TypedStorage`` / ``UntypedStorage`` and ``torch.<dtype>`` for each dtype of
``wire.DTYPE_SIZES``. A unit test checks them against SGLang's ``ALLOWED_GLOBALS``."""

PACKED_LOAD_FORMAT = "flattened_bucket"
"""``load_format`` of a request whose entries are :func:`rank_entry_packed`'s (unpacked:
``None``)."""

# opcodes torch_pickle has no use for (Lib/pickle.py)
_EMPTY_TUPLE = b")"
_NEWOBJ = b"\x81"  # cls.__new__(cls, *args): no copyreg global needed
_BUILD = b"b"
_TUPLE2 = b"\x86"

_REBUILD = _global(REBUILD_GLOBAL)
_METADATA = _global(METADATA_GLOBAL)
_K_FLAT, _K_META = _str("flattened_tensor"), _str("metadata")
_K_NAME, _K_SHAPE, _K_DTYPE = _str("name"), _str("shape"), _str("dtype")
_K_START, _K_END, _K_NUMEL = _str("start_idx"), _str("end_idx"), _str("numel")
_FLAT_CLASS = "torch.Tensor"
_FLAT_STORAGE = "torch.storage.TypedStorage"


class SglangPayloadError(ValueError):
    """A chunk SGLang could not digest: its scheduler would raise on it, which kills the whole
    server (docs/sglang-contract.md 2.7), so the daemon refuses it before the call.

    The message names the rank (when known) and the tensor, and why. ``rank``: the slot rank
    whose entry it is (None: not known here); ``tensor``: the tensor's name ('' none).
    """

    def __init__(self, message: str, *, rank: int | None = None, tensor: str = "") -> None:
        super().__init__(message)
        self.rank, self.tensor = rank, tensor


def check_uuid(uuid: str) -> str:
    """'' if SGLang can map ``uuid`` to a device, else why not.

    SGLang (0.5.20-0.5.23 ``srt/utils/patch_torch.py`` ``_device_from_maybe_uuid``) compares
    argument 6 with ``str(torch.cuda.get_device_properties(i).uuid)`` of every visible device:
    torch's format, 36 lower-case hex-and-dash characters without the ``GPU-`` prefix that
    ``nvidia-smi -L`` prints. Anything else matches no device and raises "Invalid
    device_uuid" in the scheduler (which kills the server). Whether the rank can *see* that
    GPU only the engine knows.
    """
    if not isinstance(uuid, str):
        return f"GPU UUID {uuid!r} is not a string"
    try:
        want = normalize_gpu_uuid(uuid)
    except ValueError as e:
        return str(e)
    if want == uuid:
        return ""
    if uuid.strip()[:4].upper() == "GPU-":
        how = "has the 'GPU-' prefix nvidia-smi prints"
    elif uuid != uuid.strip():
        how = "has white space around it"
    else:
        how = "has upper-case hex digits"
    return (f"GPU UUID {uuid!r} {how}; SGLang compares it with torch's "
            f"str(get_device_properties(i).uuid), {want!r}, and its scheduler raises "
            "'Invalid device_uuid' (patch_torch._device_from_maybe_uuid), which kills the server")


def _uuid_ops(gpu_uuid: str) -> bytes:
    why = check_uuid(gpu_uuid)
    if why:
        raise SglangPayloadError(why)
    return _str(gpu_uuid)


def _check_lists(names: Sequence[str], dtype_names: Sequence[str],
                 shapes: Sequence[Sequence[int]], tensor_sizes: Sequence[int] | None) -> None:
    """The per-tensor lists agree in length, every dtype is writable, every dim is >= 0 and
    (when given) ``tensor_sizes[i]`` is tensor ``i``'s bytes. (``wire.Chunk`` checks the same
    for decoded chunks; these functions are public, so they check again.)

    Raises:
        SglangPayloadError: naming the tensor.
    """
    n = len(names)
    lengths = {"dtype_names": len(dtype_names), "shapes": len(shapes)}
    if tensor_sizes is not None:
        lengths["tensor_sizes"] = len(tensor_sizes)
    for field, k in lengths.items():
        if k != n:
            raise SglangPayloadError(f"{field} has {k} entries, names has {n}")
    for i, (name, dtype, shape) in enumerate(zip(names, dtype_names, shapes, strict=True)):
        if dtype not in DTYPE_SIZES:
            raise SglangPayloadError(f"tensor {name!r}: dtype {dtype!r} is not one SGLang's "
                                     "allow-list admits (wire.DTYPE_SIZES)", tensor=name)
        if any(d < 0 for d in shape):
            raise SglangPayloadError(f"tensor {name!r}: negative dimension in {list(shape)}",
                                     tensor=name)
        if tensor_sizes is not None:
            want = math.prod(shape) * DTYPE_SIZES[dtype]
            if tensor_sizes[i] != want:
                raise SglangPayloadError(
                    f"tensor {name!r}: tensor_sizes says {tensor_sizes[i]} bytes but shape "
                    f"{list(shape)} of {dtype} is {want} bytes", tensor=name)


@lru_cache(maxsize=256)
def _after_device(n_ipc: int, n_ref: int, n_event: int) -> struct.Struct:
    """Struct of a CUDA handle's opcodes after argument 6 (``torch_pickle``'s format)."""
    return struct.Struct("<" + _after_device_format(n_ipc, n_ref, n_event))


def _cuda_tail(h: CudaIpcHandle, device: bytes) -> bytes:
    """A CUDA handle's opcodes after its layout: ``device`` (the UUID string's opcodes) at
    argument 6, then the record's arguments 7-14 as torch's ``reduce_tensor`` gave them
    (BININT, or LONG1 from 2 GiB on), then TUPLE."""
    size, off, rc = h.storage_size_bytes, h.storage_offset_bytes, h.ref_counter_offset
    rg, sync = (_TRUE if h.requires_grad else _FALSE,
                _TRUE if h.event_sync_required else _FALSE)
    ipc, rch, evh = h.ipc_handle, h.ref_counter_handle, h.event_handle
    if (size | off | rc) >= _2_31:  # all NonNeg (wire): LONG1 where needed, rare
        return b"".join((
            device, _bytes_once(ipc), _int(size), _int(off), rg, _bytes_once(rch), _int(rc),
            _NONE if evh is None else _bytes_once(evh), sync, _TUPLE,
        ))  # fmt: skip
    # the common case in one struct.pack call (as torch_pickle._fragment)
    if evh is None:
        return device + _after_device(len(ipc), len(rch), -1).pack(
            b"B", len(ipc), ipc, b"J", size, b"J", off, rg, b"B", len(rch), rch, b"J", rc,
            _NONE, sync, _TUPLE)
    return device + _after_device(len(ipc), len(rch), len(evh)).pack(
        b"B", len(ipc), ipc, b"J", size, b"J", off, rg, b"B", len(rch), rch, b"J", rc,
        b"B", len(evh), evh, sync, _TUPLE)


@lru_cache(maxsize=4096)
def _view_end(size: tuple[int, ...], stride: tuple[int, ...], storage_offset: int,
              dtype: str) -> int:
    """The byte just past a view's last element in its storage (0 for no element)."""
    if not all(size):
        return 0
    last = storage_offset + sum((d - 1) * s for d, s in zip(size, stride, strict=True))
    return (last + 1) * DTYPE_SIZES[dtype]


def _cuda_fits(h: CudaIpcHandle, what: str) -> None:
    """The tensor lies inside its storage, as torch's ``_rebuild_tensor`` (``set_``) requires.

    Raises:
        SglangPayloadError: it does not (``what`` names it).
    """
    end = _view_end(h.size, h.stride, h.storage_offset, h.dtype)
    if end > h.storage_size_bytes:
        raise SglangPayloadError(
            f"{what}: its CUDA handle's view ends at byte {end} of a storage of "
            f"{h.storage_size_bytes} bytes (torch's rebuild would raise)")


class _Bucket(NamedTuple):
    """The rank-independent part of a packed entry: the metadata list's opcodes for one set
    of tensor lists, and what they need."""

    mask: int  # bits of the fixed-slot torch globals the metadata uses (torch_pickle._BIT)
    prelude: bytes  # memo slots: the FlattenedTensorMetadata global, each distinct torch.Size
    metadata: bytes  # EMPTY_LIST MARK <one FlattenedTensorMetadata per tensor> APPENDS
    starts: list[int]  # byte offset of each tensor in the region, then the total


def _bucket(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]],
            tensor_sizes: Sequence[int]) -> _Bucket:
    """Checks the lists (:func:`_check_lists`) and writes the ``metadata`` list: tensor ``i``
    at bytes ``[starts[i], starts[i + 1])`` of the region, back to back from 0.

    Raises:
        SglangPayloadError: as ``_check_lists``.
    """
    _check_lists(names, dtype_names, shapes, tensor_sizes)
    starts = [0, *accumulate(tensor_sizes)]
    memo = _Memo()
    cls = memo.put(_METADATA)
    mask = _BIT["torch.Size"]
    parts = [_EMPTY_LIST, _MARK]
    for name, dtype, shape, start, end in zip(names, dtype_names, shapes, starts[:-1],
                                              starts[1:], strict=True):
        dt = f"torch.{dtype}"
        mask |= _BIT[dt]
        parts.append(b"".join((
            cls, _EMPTY_TUPLE, _NEWOBJ, _EMPTY_DICT, _MARK,
            _K_NAME, _str(name), _K_SHAPE, memo.size(tuple(shape)), _K_DTYPE, _GET[dt],
            _K_START, _int(start), _K_END, _int(end), _K_NUMEL, _int(end - start),
            _SETITEMS, _BUILD,
        )))  # fmt: skip
    parts.append(_APPENDS)
    return _Bucket(mask, b"".join(memo.prelude), b"".join(parts), starts)


def _empty_bucket(device: bytes) -> bytes:
    """A packed entry that loads nothing (contract 3.5): the empty uint8 tensor torch writes
    for a tensor without storage, ``metadata []``."""
    head, mask = _layout_fragment(_FLAT_CLASS, (0,), (1,), 0, _FLAT_STORAGE, "uint8")
    args = b"".join((head, device, _NONE, _int(0), _int(0), _FALSE, _NONE, _int(0), _NONE,
                     _NONE, _TUPLE))
    return b"".join((_PROTO4, _prelude(mask), _EMPTY_DICT, _MARK, _K_FLAT, _REBUILD, args,
                     _REDUCE, _K_META, _EMPTY_LIST, _SETITEMS, _STOP))


def _check_alignment(names: Sequence[str], dtype_names: Sequence[str], starts: Sequence[int],
                     bases: Sequence[tuple[int, str]]) -> None:
    """Every tensor's start, ``base + starts[i]`` for each ``(base, where)`` of ``bases``, is
    a multiple of its dtype's itemsize.

    Raises:
        SglangPayloadError: naming the first tensor that is not, and ``where`` (a format
            string for the offset) it starts.
    """
    for name, dtype, start in zip(names, dtype_names, starts[:-1], strict=True):
        item = DTYPE_SIZES[dtype]
        if item == 1:
            continue
        for base, where in bases:
            if (base + start) % item:
                raise SglangPayloadError(
                    f"tensor {name!r} ({dtype}) starts at byte {start} of the packed region, "
                    f"{where.format(base + start)}, not a multiple of its {item}-byte "
                    f"elements: SGLang's FlattenedTensorBucket.reconstruct_tensors "
                    f"(.view(torch.{dtype})) would raise in the scheduler, which kills the "
                    "server. Packed chunks lie back to back (the wire's layout): publish "
                    "this model with packed=False (docs/sglang.md, 'The trainer')",
                    tensor=name)


def _packed_entry(handle: Handle, device: bytes, names: Sequence[str],
                  dtype_names: Sequence[str], bucket: _Bucket) -> bytes:
    """One rank's packed entry from its region ``handle``, ``device`` (the UUID's opcodes)
    and the chunk's checked ``bucket``.

    Raises:
        SglangPayloadError: the region is not a flat uint8 buffer, the tensors do not fit in
            it, or a tensor's start is misaligned (see :func:`rank_entry_packed`).
        TypeError: ``handle`` is not a handle record.
    """
    if isinstance(handle, ShmHandle):
        head, mask = _layout_fragment(_FLAT_CLASS, (handle.nbytes,), (1,), 0, _FLAT_STORAGE,
                                      "uint8")
        flat = head + _shm_tail(handle, device)
        have = handle.nbytes
        # the stand-in's storage starts at the region (slot 9 = handle.offset)
        bases = ((handle.offset, "byte {} of its shared-memory segment"),)
    elif isinstance(handle, CudaIpcHandle):
        h = handle
        if h.dtype != "uint8" or len(h.size) != 1 or h.stride != (1,):
            raise SglangPayloadError(
                f"a flattened_bucket needs a flat uint8 region, the CUDA handle is {h.dtype} "
                f"of size {list(h.size)}, stride {list(h.stride)}")
        _cuda_fits(h, "the packed region")
        head, mask = _layout_fragment(h.tensor_class, h.size, h.stride, h.storage_offset,
                                      h.storage_class, "uint8")
        flat = head + _cuda_tail(h, device)
        have = h.size[0]
        bases = (
            # what .view(dtype) checks: the slice's offset in the rebuilt storage
            (h.storage_offset, "byte {} of the exported storage"),
            # the address: the storage's own offset in the IPC allocation (torch's blocks
            # are 512-byte aligned, so in practice the same rule)
            (h.storage_offset_bytes + h.storage_offset, "byte {} of its CUDA allocation"),
        )
    else:
        raise TypeError(f"not a handle record: {type(handle).__name__}")
    starts = bucket.starts
    if starts[-1] > have:
        i = next(i for i, end in enumerate(starts[1:]) if end > have)
        raise SglangPayloadError(
            f"tensor {names[i]!r} ends at byte {starts[i + 1]} of a packed region of {have} "
            "bytes", tensor=names[i])
    _check_alignment(names, dtype_names, starts, bases)
    return b"".join((
        _PROTO4, _prelude(mask | bucket.mask), bucket.prelude, _EMPTY_DICT, _MARK,
        _K_FLAT, _REBUILD, flat, _REDUCE, _K_META, bucket.metadata, _SETITEMS, _STOP,
    ))  # fmt: skip


def rank_entry_packed(handle: Handle | None, gpu_uuid: str, names: Sequence[str],
                      dtype_names: Sequence[str], shapes: Sequence[Sequence[int]],
                      tensor_sizes: Sequence[int]) -> bytes:
    """One TP rank's pickle for ``load_format="flattened_bucket"`` (contract 3.2, 3.5).

    Unpickles (SGLang's ``SafeUnpickler``, after ``monkey_patch_torch_reductions``) to
    ``{"flattened_tensor": t, "metadata": [FlattenedTensorMetadata(name, shape, dtype,
    start_idx, end_idx, numel), ...]}``: ``t`` a uint8 1-D tensor over the region's bytes
    (rebuilt by ``_rebuild_cuda_tensor_modified`` from 15 arguments, the UUID at 6); tensor
    ``i`` is bytes ``[start_idx, end_idx)`` of ``t``, back to back from the region's start
    (``start_idx`` = the sum of ``tensor_sizes`` before it; ``numel`` = ``end_idx -
    start_idx``, bytes, as SGLang's own bucket writes it), ``shape`` a ``torch.Size``,
    ``dtype`` a ``torch.dtype``. No tensor (``names`` empty): the empty bucket, ``handle``
    unused (may be None).

    Args:
        handle: the rank's region: a ``CudaIpcHandle`` of a 1-D contiguous uint8 tensor, or a
            ``ShmHandle`` (bytes ``[offset, offset + nbytes)`` of a segment; CPU stand-in).
        gpu_uuid: the GPU of the TP rank that will read this entry, torch's format
            (:func:`check_uuid`).
        names, dtype_names, shapes, tensor_sizes: per tensor: name, ``wire.DTYPE_SIZES``
            dtype name, shape (elements), bytes (= prod(shape) * itemsize).

    Raises:
        SglangPayloadError: a UUID SGLang would not map; lists that disagree; a region that
            is not flat uint8 or too small for the tensors, or (CUDA) outside its storage;
            the first tensor whose start, counted from the exported storage's start (CUDA:
            ``handle.storage_offset`` + start, and ``handle.storage_offset_bytes +
            handle.storage_offset`` + start from the IPC allocation; shm: ``handle.offset`` +
            start), is not a multiple of its dtype's itemsize -- SGLang's
            ``reconstruct_tensors`` ``.view(dtype)`` would raise inside the scheduler and kill
            the server.
        TypeError: ``handle`` is not a handle record.
    """
    device = _uuid_ops(gpu_uuid)
    if not names:
        _check_lists(names, dtype_names, shapes, tensor_sizes)
        return _empty_bucket(device)
    if handle is None:
        raise TypeError("a packed entry with tensors needs its region's handle")
    return _packed_entry(handle, device, names, dtype_names,
                         _bucket(names, dtype_names, shapes, tensor_sizes))


def rank_entry_unpacked(handles: Sequence[Handle], gpu_uuid: str, names: Sequence[str],
                        dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> bytes:
    """One TP rank's pickle for ``load_format=None`` (contract 3.3, 3.5): a list of
    ``(name, tensor)`` tuples, each tensor rebuilt by ``_rebuild_cuda_tensor_modified`` from
    its 15 arguments with the UUID at 6. The UUID, the rebuild global and each distinct
    ``torch.Size`` and stride are written once (memo), as in ``ipc_pickle.pickle_unpacked``.
    No tensor: ``[]``.

    Args:
        handles: one per tensor: a ``CudaIpcHandle`` (its own class, size, stride, offset and
            dtype are written; they must match ``dtype_names[i]`` / ``shapes[i]``) or a
            ``ShmHandle`` (written as a contiguous ``dtype_names[i]`` tensor of ``shapes[i]``
            over its byte range, at least that many bytes).
        gpu_uuid: as for :func:`rank_entry_packed`.
        names, dtype_names, shapes: per tensor, as for :func:`rank_entry_packed`.

    Raises:
        SglangPayloadError: a UUID SGLang would not map; lists or handles that disagree (in
            number, or a CUDA handle's dtype/shape against the lists); a region too small for
            its tensor; a CUDA view outside its storage.
        TypeError: an element of ``handles`` is not a handle record.
    """
    device = _uuid_ops(gpu_uuid)
    _check_lists(names, dtype_names, shapes, None)
    if len(handles) != len(names):
        raise SglangPayloadError(f"{len(handles)} handles for {len(names)} tensors")
    if not names:
        return _PROTO4 + _EMPTY_LIST + _STOP
    memo = _Memo()
    device = memo.put(device)
    rebuild = memo.put(_REBUILD)
    mask = 0
    items = []
    # (the per-tensor loop of an unpacked chunk, ~170 tensors x 8 ranks: each distinct layout
    # is written once, with the rebuild global in front, as ipc_pickle._rank_fragments does)
    heads: dict[tuple, bytes] = {}
    for h, name, dtype, shape in zip(handles, names, dtype_names, shapes, strict=True):
        size = tuple(shape)
        if type(h) is CudaIpcHandle:
            if h.dtype != dtype or h.size != size:
                raise SglangPayloadError(
                    f"tensor {name!r}: its CUDA handle is {h.dtype} {list(h.size)}, the chunk "
                    f"says {dtype} {list(size)}", tensor=name)
            _cuda_fits(h, f"tensor {name!r}")
            layout = (h.tensor_class, size, h.stride, h.storage_offset, h.storage_class, dtype)
            tail = _cuda_tail(h, device)
        elif type(h) is ShmHandle:
            need = math.prod(size) * DTYPE_SIZES[dtype]
            if h.nbytes < need:
                raise SglangPayloadError(
                    f"tensor {name!r}: its shared-memory region has {h.nbytes} bytes, shape "
                    f"{list(size)} of {dtype} needs {need}", tensor=name)
            layout = (_FLAT_CLASS, size, _contiguous_stride(size), 0, _FLAT_STORAGE, dtype)
            tail = _shm_tail(h, device)
        else:
            raise TypeError(f"not a handle record: {type(h).__name__}")
        head = heads.get(layout)
        if head is None:
            ops, m = memo.layout(*layout)
            mask |= m
            head = heads[layout] = rebuild + ops
        items.append(b"".join((_str(name), head, tail, _REDUCE, _TUPLE2)))
    return b"".join((_PROTO4, _prelude(mask), *memo.prelude, _EMPTY_LIST, _MARK, *items,
                     _APPENDS, _STOP))


def serialized_named_tensors(chunks: Mapping[int, Chunk], uuid_of_rank: Mapping[int, str], *,
                             packed: bool, order: Sequence[int] | None = None) -> list[bytes]:
    """The ``serialized_named_tensors`` of one ``/update_weights_from_tensor`` call: one raw
    pickle per rank, in TP-rank order: ``order`` (the slot's ranks, TP rank 0's first:
    ``merge.tp_order``), by default ascending (the slot's rank ``slot_start + r`` feeds TP
    rank ``r``, contract 6). The HTTP client sends the list as JSON, where msgspec writes
    ``bytes`` as standard base64, which SGLang's ``Base64Bytes`` decodes.

    Args:
        chunks: the chunk of each rank of the slot (slot rank -> ``wire.Chunk``). Packed:
            each with exactly one handle, its region (:func:`rank_entry_packed`); unpacked:
            one handle per tensor (:func:`rank_entry_unpacked`).
        uuid_of_rank: the GPU UUID of the TP rank each slot rank feeds (torch's format).
        packed: ``load_format="flattened_bucket"`` (True) or ``None``.
        order: the ranks of ``uuid_of_rank`` in TP-rank order (None: ascending).

    A rank with nothing to load gets ``rank_entry_packed(None, uuid, [], [], [], [])`` (or the
    unpacked ``[]``) from the caller; every rank must have its entry (fewer entries than TP
    ranks is an ``IndexError`` in SGLang's scheduler).

    Raises:
        SglangPayloadError: the chunks' ranks are not exactly ``uuid_of_rank``'s, or not
            consecutive, or ``order`` is not an order of them; two ranks name the same GPU;
            or any refusal of the per-rank writers,
            prefixed with the rank, its TP rank and the chunk index.
        TypeError: a handle that is not a handle record.
    """
    ranks = sorted(uuid_of_rank)
    if not ranks:
        raise SglangPayloadError("no rank to write an entry for")
    if sorted(chunks) != ranks:
        missing = sorted(set(ranks) - set(chunks))
        extra = sorted(set(chunks) - set(ranks))
        raise SglangPayloadError(f"chunks of ranks {sorted(chunks)} for the ranks {ranks} "
                                 f"(missing {missing}, unknown {extra})")
    if ranks[-1] - ranks[0] != len(ranks) - 1:
        raise SglangPayloadError(f"ranks {ranks} are not consecutive: entry r goes to TP rank "
                                 "r")
    if order is not None:
        if sorted(order) != ranks:
            raise SglangPayloadError(f"order {list(order)} is not an order of the ranks "
                                     f"{ranks}")
        ranks = list(order)
    seen: dict[str, int] = {}
    for rank in ranks:
        other = seen.setdefault(uuid_of_rank[rank], rank)
        if other != rank:
            raise SglangPayloadError(f"ranks {other} and {rank} both name GPU "
                                     f"{uuid_of_rank[rank]!r}", rank=rank)
    out: list[bytes] = []
    bucket: _Bucket | None = None
    lists: tuple = ()
    for tp, rank in enumerate(ranks):
        c = chunks[rank]
        try:
            if not packed:
                out.append(rank_entry_unpacked(c.handles, uuid_of_rank[rank], c.names,
                                               c.dtype_names, c.shapes))
                continue
            if len(c.handles) != 1:
                raise SglangPayloadError(
                    f"a packed chunk carries one handle (its region), this one {len(c.handles)}")
            device = _uuid_ops(uuid_of_rank[rank])
            # every rank of a slot normally sends the same lists: write their metadata once
            mine = (c.names, c.dtype_names, c.shapes, c.tensor_sizes)
            if bucket is None or mine != lists:
                bucket, lists = _bucket(*mine), mine
            out.append(_packed_entry(c.handles[0], device, c.names, c.dtype_names, bucket))
        except SglangPayloadError as e:
            raise SglangPayloadError(f"rank {rank} (TP rank {tp}), chunk {c.index}: {e}",
                                     rank=rank, tensor=e.tensor) from None
    return out

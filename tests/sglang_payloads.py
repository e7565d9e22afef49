"""Test-only writer of SGLang ``serialized_named_tensors`` entries over shared memory, for the
SGLang engines' tests (``tests/integration/test_sglang_engine.py``). Not the daemon's writer
(``slotsync.daemon.sglang.tensor_pickle``): a few opcodes, written from docs/sglang-contract.md 3.5
(its appendix's ``sgl_pickle.py``), with slotsync's shared-memory stand-in in the 15
arguments (``slotsync.engine.shm``: storage handle ``b"slotsync.shm:" + segment``, the
region's byte count and offset, ``False``, ``b""``, ``0``, ``None``, ``False``) and the
receiving rank's GPU UUID at argument 6.

* :func:`packed_entry`: ``{"flattened_tensor": <uint8 region>, "metadata":
  [FlattenedTensorMetadata, ...]}`` -- the tensors copied back to back into one segment,
  each start rounded up to ``align`` bytes (``load_format="flattened_bucket"``);
* :func:`unpacked_entry`: ``[(name, <tensor>), ...]``, one segment per tensor
  (``load_format`` null);
* :func:`empty_entry`: a bucket without tensors (the storage-less flattened tensor);
* :func:`update_body`: the ``/update_weights_from_tensor`` JSON body (standard base64).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

import torch

from slotsync.protocol.rank.shm_segment import ShmSegment

SHM_PREFIX = b"slotsync.shm:"
REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


class Segments:
    """Shared-memory segments a test wrote (closed and unlinked by :meth:`close`)."""

    def __init__(self) -> None:
        self.segs: list[ShmSegment] = []

    def new(self, size: int, rank: int = 0) -> ShmSegment:
        seg = ShmSegment(size, rank=rank)
        self.segs.append(seg)
        return seg

    def close(self) -> None:
        for s in self.segs:
            s.close_and_unlink()
        self.segs.clear()


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _bytes(b: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(b)) + b


def _int(i: int) -> bytes:
    if -(2**31) <= i < 2**31:
        return b"J" + struct.pack("<i", i)
    n = (i.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + i.to_bytes(n, "little", signed=True)


def _glob(mod: str, name: str) -> bytes:
    return b"c" + mod.encode() + b"\n" + name.encode() + b"\n"


def _tuple(items: Sequence[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _size(dims: Sequence[int]) -> bytes:
    return _glob("torch", "Size") + _tuple([_tuple([_int(d) for d in dims])]) + b"R"


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).split(".")[-1]


def _stride(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def shm_tensor_ops(seg: str | None, offset: int, nbytes: int, uuid: str, *,
                   dtype: str = "uint8", shape: Sequence[int] | None = None,
                   rebuild: tuple[str, str] = REBUILD) -> bytes:
    """``REDUCE`` of ``rebuild`` over the 15 arguments of a shared-memory tensor (``seg``
    None: a tensor without storage, as torch writes for an empty one)."""
    shape = [nbytes] if shape is None else list(shape)
    args = [_glob("torch", "Tensor"), _size(shape), _tuple([_int(s) for s in _stride(shape)]),
            _int(0), _glob("torch.storage", "TypedStorage"), _glob("torch", dtype), _str(uuid),
            b"N" if seg is None else _bytes(SHM_PREFIX + seg.encode()), _int(nbytes),
            _int(offset), b"\x89", b"N" if seg is None else _bytes(b""), _int(0), b"N",
            b"\x89"]
    return _glob(*rebuild) + _tuple(args) + b"R"


def _metadata(name: str, shape: Sequence[int], dtype: str, start: int, end: int) -> bytes:
    state = b"}(" + b"".join([
        _str("name"), _str(name), _str("shape"), _size(shape), _str("dtype"),
        _glob("torch", dtype), _str("start_idx"), _int(start), _str("end_idx"), _int(end),
        _str("numel"), _int(end - start)]) + b"u"
    return _glob(*METADATA) + b")\x81" + state + b"b"


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def packed_entry(tensors: dict[str, torch.Tensor], uuid: str, segs: Segments, *,
                 align: int = 16, start: int = 0, rank: int = 0) -> bytes:
    """A packed entry: ``tensors`` back to back from byte ``start`` of a new segment, each
    start rounded up to ``align`` (1: no padding, as SGLang's producers pack)."""
    offsets, off = [], start
    for t in tensors.values():
        off = -(-off // align) * align
        offsets.append(off)
        off += t.numel() * t.element_size()
    seg = segs.new(max(off, 1), rank)
    assert seg.tensor is not None
    for o, t in zip(offsets, tensors.values(), strict=True):
        seg.tensor[o:o + t.numel() * t.element_size()] = raw(t)
    metas = [_metadata(n, list(t.shape), dtype_name(t), o, o + t.numel() * t.element_size())
             for (n, t), o in zip(tensors.items(), offsets, strict=True)]
    return (b"\x80\x04}(" + _str("flattened_tensor")
            + shm_tensor_ops(seg.name, 0, seg.size, uuid) + _str("metadata") + b"]("
            + b"".join(metas) + b"eu.")


def unpacked_entry(tensors: dict[str, torch.Tensor], uuid: str, segs: Segments, *,
                   rank: int = 0) -> bytes:
    """An unpacked entry: ``[(name, tensor), ...]``, each tensor in a segment of its own."""
    items = []
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        seg = segs.new(max(nbytes, 1), rank)
        assert seg.tensor is not None
        seg.tensor[:nbytes] = raw(t)
        items.append(b"(" + _str(name) + shm_tensor_ops(seg.name, 0, nbytes, uuid,
                                                        dtype=dtype_name(t), shape=t.shape)
                     + b"t")
    return b"\x80\x04](" + b"".join(items) + b"e."


def empty_entry(uuid: str) -> bytes:
    """A bucket with nothing in it (a rank with nothing to load)."""
    return (b"\x80\x04}(" + _str("flattened_tensor") + shm_tensor_ops(None, 0, 0, uuid)
            + _str("metadata") + b"](eu.")


def global_entry(module: str, name: str) -> bytes:
    """An entry whose pickle names ``module.name`` (called with ``("x",)``): for refusals."""
    return b"\x80\x04" + _glob(module, name) + _tuple([_str("x")]) + b"R."


def update_body(entries: Sequence[bytes], load_format: str | None = None,
                **fields: Any) -> dict[str, Any]:
    """``/update_weights_from_tensor``'s body: ``entries`` as standard base64."""
    return {"serialized_named_tensors": [base64.b64encode(e).decode() for e in entries],
            "load_format": load_format, **fields}

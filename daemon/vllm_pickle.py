"""Writes vLLM's ``ipc_handles_pickled`` from typed handle records, without importing torch.

vLLM 0.27–0.33 (`vllm/distributed/weight_transfer/ipc_engine.py`) reads
``pickle.loads(base64.b64decode(ipc_handles_pickled))`` and expects:

* unpacked: a list with one ``{gpu_uuid: args}`` dict per tensor name;
* packed: one ``{gpu_uuid: args}`` dict for the chunk's uint8 buffer;

where ``args`` is the 15-tuple ``reduce_tensor(t)[1]`` (see ``rebuild_cuda_tensor``).

The daemon must not import torch (design.md I6), and ``pickle.dumps`` refuses to write a
global it cannot import. So this module emits the pickle opcodes itself (protocol 4, no
memo, no framing: every pickle reader accepts that). The only globals it can write are the
allow-listed torch classes and dtypes of ``slotsync.protocol.wire``; producer strings never
become code references.

Per-handle fragments are cached by value, so a packed staging buffer that is exported once and
reused across chunks is encoded once: the per-chunk cost is O(ranks) byte concatenation.

The CPU shared-memory stand-in (``ShmHandle``) is written as the plain tuple
``("slotsync.shm", segment, offset, nbytes)``, which only the reference engine understands.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping, Sequence
from functools import lru_cache

from slotsync.protocol.wire import (
    DTYPE_SIZES,
    STORAGE_CLASSES,
    TENSOR_CLASSES,
    CudaIpcHandle,
    Handle,
    ShmHandle,
)

SHM_TAG = "slotsync.shm"

# pickle opcodes (Lib/pickle.py)
_PROTO4 = b"\x80\x04"
_STOP = b"."
_MARK = b"("
_TUPLE = b"t"
_EMPTY_LIST = b"]"
_APPENDS = b"e"
_EMPTY_DICT = b"}"
_SETITEMS = b"u"
_NONE = b"N"
_TRUE = b"\x88"
_FALSE = b"\x89"
_REDUCE = b"R"


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b  # BINUNICODE


def _bytes(b: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(b)) + b  # BINBYTES


def _int(i: int) -> bytes:
    if -(2**31) <= i < 2**31:
        return b"J" + struct.pack("<i", i)  # BININT
    n = (i.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + i.to_bytes(n, "little", signed=True)  # LONG1


def _global(qualified: str) -> bytes:
    module, _, name = qualified.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def _int_tuple(xs: Sequence[int]) -> bytes:
    return _MARK + b"".join(_int(x) for x in xs) + _TUPLE


@lru_cache(maxsize=65536)
def handle_args_fragment(h: Handle) -> bytes:
    """Pickle opcodes that push one handle's args onto the unpickler's stack.

    ``CudaIpcHandle`` → the 15-tuple ``(tensor_cls, torch.Size(size), stride, offset,
    storage_cls, dtype, device, handle, storage_bytes, storage_offset_bytes, requires_grad,
    ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)``;
    ``ShmHandle`` → ``("slotsync.shm", segment, offset, nbytes)``.

    Raises:
        ValueError: a class or dtype outside the allow-list (cannot happen for records that
            passed ``wire`` validation; checked again because this writes code references).
    """
    if isinstance(h, ShmHandle):
        return _MARK + _str(SHM_TAG) + _str(h.segment) + _int(h.offset) + _int(h.nbytes) + _TUPLE
    if not isinstance(h, CudaIpcHandle):
        raise TypeError(f"not a handle record: {type(h).__name__}")
    if h.tensor_class not in TENSOR_CLASSES or h.storage_class not in STORAGE_CLASSES:
        raise ValueError("class outside the allow-list")
    if h.dtype not in DTYPE_SIZES:
        raise ValueError(f"dtype outside the allow-list: {h.dtype!r}")
    parts = [
        _MARK,
        _global(h.tensor_class),
        _global("torch.Size") + _MARK + _int_tuple(h.size) + _TUPLE + _REDUCE,
        _int_tuple(h.stride),
        _int(h.storage_offset),
        _global(h.storage_class),
        _global("torch." + h.dtype),
        _int(h.device),
        _bytes(h.ipc_handle),
        _int(h.storage_size_bytes),
        _int(h.storage_offset_bytes),
        _TRUE if h.requires_grad else _FALSE,
        _bytes(h.ref_counter_handle),
        _int(h.ref_counter_offset),
        _NONE if h.event_handle is None else _bytes(h.event_handle),
        _TRUE if h.event_sync_required else _FALSE,
        _TUPLE,
    ]
    return b"".join(parts)


@lru_cache(maxsize=4096)
def _uuid_key(uuid: str) -> bytes:
    return _str(uuid)


def _dict_fragment(by_uuid: Mapping[str, Handle]) -> bytes:
    body = b"".join(_uuid_key(u) + handle_args_fragment(h) for u, h in by_uuid.items())
    return _EMPTY_DICT + _MARK + body + _SETITEMS


def pickle_packed(by_uuid: Mapping[str, Handle]) -> bytes:
    """Pickle of one ``{gpu_uuid: args}`` dict (packed transfer), as vLLM unpickles it."""
    return _PROTO4 + _dict_fragment(by_uuid) + _STOP


def pickle_unpacked(uuids: Sequence[str], handles_by_rank: Sequence[Sequence[Handle]]) -> bytes:
    """Pickle of ``[{gpu_uuid: args}, ...]``, one dict per tensor (unpacked transfer).

    Args:
        uuids: GPU UUID of each rank, in the order of ``handles_by_rank``.
        handles_by_rank: per rank, one handle per tensor (all the same length).
    """
    keys = [_uuid_key(u) for u in uuids]
    n = len(handles_by_rank[0]) if handles_by_rank else 0
    pairs = list(zip(keys, handles_by_rank, strict=True))
    body = b"".join(
        _EMPTY_DICT
        + _MARK
        + b"".join(k + handle_args_fragment(hs[i]) for k, hs in pairs)
        + _SETITEMS
        for i in range(n)
    )
    return _PROTO4 + _EMPTY_LIST + _MARK + body + _APPENDS + _STOP


def b64(pickled: bytes) -> str:
    """Standard base64 text, as ``ipc_handles_pickled`` carries it."""
    return base64.b64encode(pickled).decode("ascii")

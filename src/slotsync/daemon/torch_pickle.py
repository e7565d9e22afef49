"""torch's tensor reductions written as pickle opcodes, without importing torch: what vLLM's
``ipc_handles_pickled`` (``daemon/vllm/ipc_pickle.py``) and SGLang's
``serialized_named_tensors`` (``daemon/sglang/tensor_pickle.py``) share.

The daemon must not import torch (design.md I6), and ``pickle.dumps`` refuses to write a
global it cannot import, so the payload writers emit the opcodes themselves (protocol 4, a
fixed memo of globals only, no framing). The only globals written are the allow-listed
torch classes and dtypes of ``slotsync.protocol.wire`` (``_GLOBALS``, each in a fixed memo
slot: a prelude loads those a pickle uses once, ``_prelude``); producer strings never become
code references. Here: the opcodes, the fixed globals, a handle's 15-tuple of
``reduce_tensor(t)[1]`` (``_fragment``, cached by value), its layout head and tails, the
shared-memory stand-in's tuple (``_shm_tail``, ``SHM_HANDLE_PREFIX``) and the per-pickle memo
of sizes and strides (``_Memo``). ``daemon/vllm/ipc_pickle.py``'s docstring says why each is
shaped so (speed, the stand-in's fields); both families import this module, neither imports
the other.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache

from slotsync.protocol.wire import (
    DTYPE_SIZES,
    STORAGE_CLASSES,
    TENSOR_CLASSES,
    CudaIpcHandle,
    Handle,
    ShmHandle,
)

SHM_HANDLE_PREFIX = b"slotsync.shm:"
"""Slot 7 (storage handle) of a shared-memory stand-in: these bytes, then the segment name."""

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


def _bytes_once(b: bytes) -> bytes:
    """BINBYTES of a value that is new with every export (not worth a cache entry)."""
    return b"B" + struct.pack("<I", len(b)) + b


@lru_cache(maxsize=4096)
def _bytes(b: bytes) -> bytes:
    # cached: values that repeat across exports (a segment's storage handle, b"")
    return _bytes_once(b)


_BININT = struct.Struct("<i")
_2_31 = 2**31


def _int(i: int) -> bytes:
    if -(2**31) <= i < 2**31:
        return b"J" + _BININT.pack(i)  # BININT
    n = (i.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + i.to_bytes(n, "little", signed=True)  # LONG1


def _global(qualified: str) -> bytes:
    module, _, name = qualified.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


# Every global this module may write, each with a fixed memo slot (< 256: 1-byte BINGET).
_GLOBALS: tuple[str, ...] = (
    *TENSOR_CLASSES, "torch.Size", *STORAGE_CLASSES, *(f"torch.{d}" for d in DTYPE_SIZES)
)
_SLOT = {g: i for i, g in enumerate(_GLOBALS)}
_GET = {g: b"h" + bytes([i]) for g, i in _SLOT.items()}  # BINGET slot
_BIT = {g: 1 << i for g, i in _SLOT.items()}
# GLOBAL, BINPUT slot, POP: loads the global once and leaves the stack as it was.
_PUT = tuple(_global(g) + b"q" + bytes([i]) + b"0" for i, g in enumerate(_GLOBALS))


def _prelude(mask: int) -> bytes:
    """Load every global whose bit is set in ``mask`` into its memo slot."""
    return b"".join(_PUT[i] for i in range(len(_GLOBALS)) if mask >> i & 1)


def _int_tuple(xs: Sequence[int]) -> bytes:
    return _MARK + b"".join(_int(x) for x in xs) + _TUPLE


@lru_cache(maxsize=16384)
def _layout_fragment(
    tensor_class: str,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    storage_offset: int,
    storage_class: str,
    dtype: str,
) -> tuple[bytes, int]:
    """The shape-dependent opcodes of a CUDA handle's args (everything before the device
    index) and the mask of the memoized globals they use. Checks the allow-lists, since
    this writes code references.

    Raises:
        ValueError: a class or dtype outside the allow-list (cannot happen for records that
            passed ``wire`` validation).
    """
    return _layout_head(tensor_class, _size_ops(size), _int_tuple(stride), storage_offset,
                        storage_class, dtype)


def _size_ops(size: tuple[int, ...]) -> bytes:
    """Opcodes that push ``torch.Size(size)``."""
    return _GET["torch.Size"] + _MARK + _int_tuple(size) + _TUPLE + _REDUCE


def _layout_head(tensor_class: str, size_ops: bytes, stride_ops: bytes, storage_offset: int,
                 storage_class: str, dtype: str) -> tuple[bytes, int]:
    """A CUDA handle's args up to its device index, from opcodes that push its
    ``torch.Size`` and stride (inline, or a memo reference), and the mask of the globals
    used. Checks the allow-lists, since this writes code references.

    Raises:
        ValueError: a class or dtype outside the allow-list.
    """
    if tensor_class not in TENSOR_CLASSES or storage_class not in STORAGE_CLASSES:
        raise ValueError("class outside the allow-list")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"dtype outside the allow-list: {dtype!r}")
    dt = f"torch.{dtype}"
    head = b"".join((
        _MARK, _GET[tensor_class], size_ops, stride_ops, _int(storage_offset),
        _GET[storage_class], _GET[dt],
    ))  # fmt: skip
    mask = _BIT[tensor_class] | _BIT["torch.Size"] | _BIT[storage_class] | _BIT[dt]
    return head, mask


def _after_device_format(n_ipc: int, n_ref: int, n_event: int) -> str:
    """``struct`` format of a CUDA handle's opcodes after its device (slot 6): BINBYTES
    handle, BININT storage bytes and offset, requires_grad, BINBYTES ref-counter handle,
    BININT its offset, BINBYTES event handle (``n_event`` bytes; -1: NONE),
    event_sync_required, TUPLE. (SGLang's writer puts a UUID string before it.)"""
    event = "c" if n_event < 0 else f"cI{n_event}s"
    return f"cI{n_ipc}scicic" + f"cI{n_ref}sci" + event + "cc"


@lru_cache(maxsize=256)
def _tail(n_ipc: int, n_ref: int, n_event: int) -> struct.Struct:
    """Struct of a CUDA handle's opcodes after its layout: BININT device, then
    ``_after_device_format``."""
    return struct.Struct("<ci" + _after_device_format(n_ipc, n_ref, n_event))


_DEVICE_0 = _int(0)


def _shm_tail(h: ShmHandle, device: bytes = _DEVICE_0) -> bytes:
    """A shared-memory stand-in's opcodes after its layout: ``device`` (opcodes pushing slot
    6: device index 0 for vLLM, which overwrites it; SGLang's writer passes the GPU UUID
    string, ``sglang/tensor_pickle.py``), storage handle ``SHM_HANDLE_PREFIX + segment``,
    the region's byte count and byte offset, requires_grad False, ref-counter handle ``b""``
    and offset 0, event handle None, event_sync_required False, then TUPLE (closing the
    15-tuple)."""
    return b"".join((
        device, _bytes(SHM_HANDLE_PREFIX + h.segment.encode()), _int(h.nbytes),
        _int(h.offset), _FALSE, _bytes(b""), _int(0), _NONE, _FALSE, _TUPLE,
    ))  # fmt: skip


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


FRAGMENT_CACHE_SIZE = 64 * 8 * 2
"""Handle fragments kept (``_fragment``): 64 ranks x 8 staging regions, twice over (two
updates' worth while one ends and the next begins)."""


@lru_cache(maxsize=FRAGMENT_CACHE_SIZE)
def _fragment(h: Handle) -> tuple[bytes, int]:
    """Pickle opcodes that push one handle's args onto the unpickler's stack, and the bit
    mask of the memoized globals they use (see ``_GLOBALS``).

    ``CudaIpcHandle`` → the 15-tuple ``(tensor_cls, torch.Size(size), stride, offset,
    storage_cls, dtype, device, handle, storage_bytes, storage_offset_bytes, requires_grad,
    ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)``;
    ``ShmHandle`` → the same 15-tuple for a flat uint8 tensor of ``nbytes`` (a packed
    buffer; see the module docstring), storage handle ``b"slotsync.shm:" + segment``.

    Raises:
        TypeError: not a handle record.
        ValueError: a class or dtype outside the allow-list.
    """
    if isinstance(h, ShmHandle):
        head, mask = _layout_fragment(
            "torch.Tensor", (h.nbytes,), (1,), 0, "torch.storage.TypedStorage", "uint8"
        )
        return head + _shm_tail(h), mask
    if not isinstance(h, CudaIpcHandle):
        raise TypeError(f"not a handle record: {type(h).__name__}")
    head, mask = _layout_fragment(
        h.tensor_class, h.size, h.stride, h.storage_offset, h.storage_class, h.dtype
    )
    dev, size, off, rc = (
        h.device, h.storage_size_bytes, h.storage_offset_bytes, h.ref_counter_offset
    )
    flags = (_TRUE if h.requires_grad else _FALSE, _TRUE if h.event_sync_required else _FALSE)
    if dev < _2_31 and size < _2_31 and off < _2_31 and rc < _2_31:  # all NonNeg (wire)
        # fast path: everything after the layout in one struct.pack call (one C call per
        # handle; the per-field Python calls were most of merge_chunk for unpacked chunks)
        ipc, rch, evh = h.ipc_handle, h.ref_counter_handle, h.event_handle
        if evh is None:
            tail = _tail(len(ipc), len(rch), -1).pack(
                b"J", dev, b"B", len(ipc), ipc, b"J", size, b"J", off, flags[0],
                b"B", len(rch), rch, b"J", rc, _NONE, flags[1], _TUPLE,
            )  # fmt: skip
        else:
            tail = _tail(len(ipc), len(rch), len(evh)).pack(
                b"J", dev, b"B", len(ipc), ipc, b"J", size, b"J", off, flags[0],
                b"B", len(rch), rch, b"J", rc, b"B", len(evh), evh, flags[1], _TUPLE,
            )  # fmt: skip
        frag = head + tail
    else:  # e.g. a staging buffer of 2 GiB or more: LONG1 where needed
        event = _NONE if h.event_handle is None else _bytes_once(h.event_handle)
        frag = b"".join((
            head, _int(dev), _bytes_once(h.ipc_handle), _int(size), _int(off), flags[0],
            _bytes_once(h.ref_counter_handle), _int(rc), event, flags[1], _TUPLE,
        ))  # fmt: skip
    return frag, mask



class _Memo:
    """Memo slots of one pickle beyond the fixed globals: objects the prelude builds once
    (``BINPUT``/``LONG_BINPUT``, then ``POP``) and the body refers to (``BINGET``/``LONG_BINGET``).
    Used by the unpacked pickle for what every handle would otherwise repeat: each rank's GPU
    UUID (the dict keys) and each distinct ``torch.Size`` and stride tuple."""

    def __init__(self) -> None:
        self.prelude: list[bytes] = []
        self.next = len(_GLOBALS)
        self.sizes: dict[tuple[int, ...], bytes] = {}
        self.strides: dict[tuple[int, ...], bytes] = {}

    def put(self, build: bytes) -> bytes:
        """Append ``build`` (opcodes that push one object) to the prelude, store the object
        in the next slot; return the opcodes that push it again."""
        i = self.next
        self.next += 1
        if i < 256:
            self.prelude.append(build + b"q" + bytes([i]) + b"0")  # BINPUT i, POP
            return b"h" + bytes([i])  # BINGET i
        self.prelude.append(build + b"r" + struct.pack("<I", i) + b"0")  # LONG_BINPUT
        return b"j" + struct.pack("<I", i)  # LONG_BINGET

    def size(self, size: tuple[int, ...]) -> bytes:
        """Opcodes that push ``torch.Size(size)`` from its memo slot (built in the prelude
        the first time this pickle needs it). The caller sets ``torch.Size``'s bit in the
        prelude mask (``_BIT``)."""
        get_size = self.sizes.get(size)
        if get_size is None:
            get_size = self.sizes[size] = self.put(_size_ops(size))
        return get_size

    def layout(
        self,
        tensor_class: str,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        storage_offset: int,
        storage_class: str,
        dtype: str,
    ) -> tuple[bytes, int]:
        """Like ``_layout_fragment``, but ``torch.Size(size)`` and ``stride`` come from memo
        slots (built once per pickle for each distinct value): the unpickler then builds
        one ``torch.Size`` per shape instead of one per handle, and the pickle is smaller.

        Raises:
            ValueError: a class or dtype outside the allow-list.
        """
        get_size = self.size(size)
        get_stride = self.strides.get(stride)
        if get_stride is None:
            get_stride = self.strides[stride] = self.put(_int_tuple(stride))
        return _layout_head(tensor_class, get_size, get_stride, storage_offset, storage_class,
                            dtype)

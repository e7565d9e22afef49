"""Writes vLLM's ``ipc_handles_pickled`` from typed handle records, without importing torch.

vLLM 0.27–0.33 (`vllm/distributed/weight_transfer/ipc_engine.py`) reads
``pickle.loads(base64.b64decode(ipc_handles_pickled))`` and expects:

* unpacked: a list with one ``{gpu_uuid: args}`` dict per tensor name;
* packed: one ``{gpu_uuid: args}`` dict for the chunk's uint8 buffer;

where ``args`` is the 15-tuple ``reduce_tensor(t)[1]`` (see ``rebuild_cuda_tensor``).

The daemon must not import torch (design.md I6), and ``pickle.dumps`` refuses to write a
global it cannot import. So this module emits the pickle opcodes itself (protocol 4, a
fixed memo of globals only, no framing: every pickle reader accepts that), from the pieces it
shares with SGLang's writer in ``daemon/torch_pickle.py`` (opcodes, globals, a handle's
fragment, ``_Memo``); the lists and dicts of vLLM's shapes are written here. The only globals
it can write are the allow-listed torch classes and dtypes of ``slotsync.protocol.wire``;
producer strings never become code references.

Speed (``slotsync bench control`` profiles this path): every global the daemon may write
(tensor and storage classes, ``torch.Size``, dtypes) has a fixed memo slot. A pickle opens with
a prelude that loads each global it uses once (``GLOBAL`` + ``BINPUT``), and the handles then
refer to them with a 2-byte ``BINGET`` -- so the unpickler resolves each class once per pickle,
not 4 times per handle (the effect on ``pickle.loads`` and size: BENCHMARKS.md).
Unpacked, the prelude also builds each rank's GPU UUID and each distinct ``torch.Size`` and
stride tuple once into further memo slots (``_Memo``), and every handle refers to them: every
engine worker unpickles the whole list, and this halves its ``pickle.loads`` and shrinks the
pickle by a quarter (an 8-rank Qwen3-30B-A3B chunk: 357 -> 272 kB), while the objects it
unpickles to are equal to those of torch's own pickle. Packed, a handle's fragment is cached
by value, so a staging buffer that is exported once and reused across chunks is encoded
once; the per-chunk cost is then O(ranks) concatenation. That cache only ever hits within
one update (on CUDA every update exports its staging block anew), so it is small: enough for
every staging region of 64 ranks; a bigger one only grew the daemon over a 1,000-round CUDA
soak (50.7 -> 65.0 MB, issue 14). For the same reason values that are new with every export
(CUDA IPC, event handles) are never put in the ``_bytes`` cache.
Unpacked, every export is fresh (no cache could hit), and the per-handle loop
(``_rank_fragments``, 8 ranks x ~170 tensors per chunk on the daemon's event loop) does the
least Python it can: the shape-dependent part (class, ``torch.Size``, stride, offset, dtype)
is cached (every tensor of one shape, every rank and every round repeat it) and kept per rank
with the rank's dict key in front, the rest of a handle is one ``struct.pack`` call, and the
rows are interleaved by C-level ``zip``/``join`` (``python -m slotsync.bench.profile_chunk``
shows the split).

The CPU shared-memory stand-in (``ShmHandle``) is written as a 15-tuple shaped exactly like
``reduce_tensor(t)[1]`` of a CUDA tensor, so that vLLM's own receive code takes it
(``list_args[6] = device_index; rebuild_cuda_tensor(*list_args)``, vLLM 0.32
``ipc_engine.receive_weights`` / ``packed_tensor.packed_ipc_consumer``): ``torch.Tensor``, the
size, contiguous stride, storage offset 0, ``torch.storage.TypedStorage``, the dtype, device 0,
storage handle ``b"slotsync.shm:" + segment`` (``SHM_HANDLE_PREFIX``), the region's byte count,
its byte offset in the segment, ``False``, ref-counter handle ``b""``, offset 0, event handle
``None``, ``False``. Packed, the region is a flat uint8 tensor of ``nbytes``; unpacked, the
tensor's own dtype and shape (``pickle_unpacked``'s ``dtype_names`` / ``shapes``). Only the
engines' stand-in for ``rebuild_cuda_tensor`` maps it (``slotsync.engine.shm``); a real CUDA
rebuild refuses it. The globals are the allow-listed ones above, as for a CUDA handle.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping, Sequence
from functools import lru_cache
from itertools import chain, repeat

from slotsync.daemon.torch_pickle import (  # (tests and the SGLang writer read some)
    _APPENDS,
    _EMPTY_DICT,
    _EMPTY_LIST,
    _FALSE,
    _MARK,
    _NONE,
    _PROTO4,
    _SETITEMS,
    _STOP,
    _TRUE,
    _TUPLE,
    _2_31,
    _contiguous_stride,
    _fragment,
    _Memo,
    _prelude,
    _shm_tail,
    _str,
)
from slotsync.protocol.wire import (
    CudaIpcHandle,
    Handle,
    ShmHandle,
)


@lru_cache(maxsize=4096)
def _uuid_key(uuid: str) -> bytes:
    return _str(uuid)


def pickle_packed(by_uuid: Mapping[str, Handle]) -> bytes:
    """Pickle of one ``{gpu_uuid: args}`` dict (packed transfer), as vLLM unpickles it."""
    mask = 0
    parts = []
    for u, h in by_uuid.items():
        frag, m = _fragment(h)
        mask |= m
        parts.append(_uuid_key(u))
        parts.append(frag)
    return b"".join(
        (_PROTO4, _prelude(mask), _EMPTY_DICT, _MARK, *parts, _SETITEMS, _STOP)
    )



def pickle_unpacked(
    uuids: Sequence[str],
    handles_by_rank: Sequence[Sequence[Handle]],
    *,
    dtype_names: Sequence[str] | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
) -> bytes:
    """Pickle of ``[{gpu_uuid: args}, ...]``, one dict per tensor (unpacked transfer).

    Each rank's GPU UUID and each distinct ``torch.Size`` / stride is written once, into the
    memo, and referred to by every handle (``_Memo``): equal values, as torch's own pickle of
    the same dicts unpickles to, built once per pickle instead of once per handle.

    Args:
        uuids: GPU UUID of each rank, in the order of ``handles_by_rank``.
        handles_by_rank: per rank, one handle per tensor (all the same length).
        dtype_names, shapes: each tensor's dtype name (``"bfloat16"``) and shape, as the
            chunk's ``update_info`` gives them. Needed for shared-memory handles, whose
            record carries only a byte range: the stand-in tuple then has the tensor's own
            dtype, shape and contiguous stride (as ``reduce_tensor`` of the tensor would).
            A CUDA handle carries its own and ignores them.

    Raises:
        ValueError: as many UUIDs as ranks are needed, and as many handles from every rank;
            shared-memory handles without ``dtype_names`` and ``shapes`` of that length; a
            class or dtype outside the allow-list.
        TypeError: an element is not a handle record.
    """
    if len(uuids) != len(handles_by_rank):
        raise ValueError(f"{len(uuids)} UUIDs for {len(handles_by_rank)} ranks")
    n = len(handles_by_rank[0]) if handles_by_rank else 0
    if any(len(hs) != n for hs in handles_by_rank):
        raise ValueError("ranks sent different numbers of handles")
    memo = _Memo()
    keys = [memo.put(_uuid_key(u)) for u in uuids]
    mask = 0
    columns = []
    for key, hs in zip(keys, handles_by_rank, strict=True):
        if hs and type(hs[0]) is ShmHandle:
            column, m = _rank_fragments_shm(key, hs, memo, dtype_names, shapes)
        else:
            column, m = _rank_fragments(key, hs, memo)
        columns.append(column)
        mask |= m
    # Tensor i's dict: EMPTY_DICT MARK, then every rank's "uuid args" (columns[r][i]), SETITEMS.
    # zip/chain/join run in C: no per-handle Python here.
    rows = zip(repeat(_EMPTY_DICT + _MARK, n), *columns, repeat(_SETITEMS, n), strict=True)
    return b"".join((
        _PROTO4, _prelude(mask), *memo.prelude, _EMPTY_LIST, _MARK,
        b"".join(chain.from_iterable(rows)), _APPENDS, _STOP,
    ))  # fmt: skip


_PUSH_BYTES = (*(b"C" + bytes([n]) for n in range(256)), b"B" + struct.pack("<I", 256))
"""Index ``n``: the opcode and length that push ``n`` bytes, up to ``wire``'s 256-byte cap on
handle byte strings (SHORT_BINBYTES below 256, BINBYTES at 256)."""


@lru_cache(maxsize=1024)
def _short_tail(n_ipc_ops: int, n_ref_ops: int, n_event_ops: int) -> struct.Struct:
    """Struct of an unpacked handle's opcodes after its layout (``_rank_fragments``):
    BININT1 device; the ``n_ipc_ops`` bytes of opcodes pushing the IPC handle (inline or
    from the memo); BININT storage bytes and offset; requires_grad; the ``n_ref_ops`` bytes
    pushing the ref-counter handle (alike); BININT its offset; the ``n_event_ops`` bytes
    pushing the event handle; event_sync_required; TUPLE."""
    return struct.Struct(f"<cB{n_ipc_ops}scicic{n_ref_ops}sci{n_event_ops}scc")


def _rank_fragments(key: bytes, hs: Sequence[Handle], memo: _Memo) -> tuple[list[bytes], int]:
    """One rank's part of an unpacked pickle: for each handle, its dict key ``key`` (opcodes
    that push the rank's GPU UUID) followed by its args; and the mask of the globals used.

    The per-handle loop of an unpacked chunk (8 ranks x ~170 tensors on the daemon's event
    loop), so it is written for speed: the layout part (``memo.layout``, shared by every
    tensor of one shape) is looked up once per distinct layout and kept with ``key`` in
    front; the rest is one ``struct.pack``, as in ``_fragment``. No ``_fragment`` cache:
    unpacked exports are fresh every round, it would never hit.

    Every worker of the engine base64-decodes and unpickles the whole list, and the front
    and the daemon move it, so the pickle is kept small where that costs little per handle:
    the device as BININT1, byte strings as SHORT_BINBYTES (``_PUSH_BYTES``), and the rank's IPC and
    ref-counter handles, when one repeats, from the memo: the first time inline, from the
    second on from a slot the prelude fills (``_Memo.put``). Every handle of a rank carries
    the same ref-counter handle (torch's shared-memory file of IPC ref counters), and tensors
    of one CUDA allocation the same IPC memory handle. The repeats then unpickle to one
    bytes object, equal to the inline one (``rebuild_cuda_tensor`` reads them by value).
    """
    out: list[bytes] = []
    append = out.append
    mask = 0
    heads: dict[tuple, bytes] = {}  # layout -> key + layout opcodes
    ipc_seen: dict[bytes, bytes] = {}  # IPC handle -> memo reference (b"": seen once)
    ref_seen: dict[bytes, bytes] = {}  # ref-counter handle -> the same
    last_rch, last_ref = None, b""  # the handle before's, and its memo reference if any
    short = _PUSH_BYTES
    pack, lens = None, None  # the tail struct's pack for the opcode lengths ``lens``
    for h in hs:
        if type(h) is not CudaIpcHandle:  # not a handle (TypeError) or shm among cuda ones
            if type(h) is ShmHandle:
                raise TypeError("a rank's handles mix transports (cuda and shm)")
            frag, m = _fragment(h)
            mask |= m
            append(key + frag)
            continue
        layout = (h.tensor_class, h.size, h.stride, h.storage_offset, h.storage_class, h.dtype)
        head = heads.get(layout)
        if head is None:
            frag, m = memo.layout(*layout)
            mask |= m
            head = heads[layout] = key + frag
        dev, size, off, rc = (
            h.device, h.storage_size_bytes, h.storage_offset_bytes, h.ref_counter_offset
        )
        ipc, rch, evh = h.ipc_handle, h.ref_counter_handle, h.event_handle
        if (size | off | rc) >= _2_31 or dev > 255:  # all NonNeg (wire); LONG1 needed: rare
            append(key + _fragment.__wrapped__(h)[0])
            continue
        got = ipc_seen.get(ipc)
        if got:
            ipc_op = got
        else:
            ipc_op = short[len(ipc)] + ipc
            if got is None:
                ipc_seen[ipc] = b""
            else:
                ipc_op = ipc_seen[ipc] = memo.put(ipc_op)
        if rch == last_rch and last_ref:
            ref_op = last_ref
        else:
            got = ref_seen.get(rch)
            if got:
                ref_op = got
            else:
                ref_op = short[len(rch)] + rch
                if got is None:
                    ref_seen[rch] = b""
                else:
                    ref_op = ref_seen[rch] = memo.put(ref_op)
            last_rch, last_ref = rch, ref_seen[rch]
        evh_op = _NONE if evh is None else short[len(evh)] + evh
        n = (len(ipc_op), len(ref_op), len(evh_op))
        if n != lens:
            lens, pack = n, _short_tail(*n).pack
        tail = pack(  # type: ignore[misc]
            b"K", dev, ipc_op, b"J", size, b"J", off, _TRUE if h.requires_grad else _FALSE,
            ref_op, b"J", rc, evh_op, _TRUE if h.event_sync_required else _FALSE, _TUPLE,
        )  # fmt: skip
        append(head + tail)
    return out, mask


def b64(pickled: bytes) -> str:
    """Standard base64 text, as ``ipc_handles_pickled`` carries it."""
    return base64.b64encode(pickled).decode("ascii")


def _rank_fragments_shm(
    key: bytes,
    hs: Sequence[Handle],
    memo: _Memo,
    dtype_names: Sequence[str] | None,
    shapes: Sequence[Sequence[int]] | None,
) -> tuple[list[bytes], int]:
    """``_rank_fragments`` for one rank's shared-memory handles: tensor ``i``'s stand-in tuple
    has ``dtype_names[i]`` and ``shapes[i]`` (contiguous stride, storage offset 0) over the
    handle's byte range (see the module docstring).

    Raises:
        ValueError: ``dtype_names`` / ``shapes`` missing or not one per handle; a dtype
            outside the allow-list.
        TypeError: a handle that is not a ``ShmHandle``.
    """
    if dtype_names is None or shapes is None:
        raise ValueError("shared-memory handles need the tensors' dtype_names and shapes")
    if len(dtype_names) != len(hs) or len(shapes) != len(hs):
        raise ValueError(
            f"{len(hs)} handles but {len(dtype_names)} dtype_names and {len(shapes)} shapes"
        )
    out: list[bytes] = []
    mask = 0
    for h, dtype, shape in zip(hs, dtype_names, shapes, strict=True):
        if type(h) is not ShmHandle:
            raise TypeError(f"not a shared-memory handle record: {type(h).__name__}")
        size = tuple(int(d) for d in shape)
        head, m = memo.layout("torch.Tensor", size, _contiguous_stride(size), 0,
                              "torch.storage.TypedStorage", dtype)
        mask |= m
        out.append(key + head + _shm_tail(h))
    return out, mask

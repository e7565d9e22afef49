"""The reference worker's weights and how a chunk lands in them: map the handles, check, copy.

This is the receive side of vLLM's IPC weight-transfer backend as one reference-engine worker
runs it (vLLM 0.33 ``distributed/weight_transfer/ipc_engine.py``: ``receive_weights``,
``packed_ipc_consumer``, ``PackedBufferImporter``; ``model.load_weights`` copying into the
parameters), with fast paths for the chunks every round re-sends: a packed chunk whose
tensors already exist is copied straight out of the mapped buffer (``_load_packed_in_place``),
and one seen before is loaded from its remembered :class:`PackedPlan` (on CUDA with Triton,
one ``gather.scatter_from`` kernel).

:class:`WeightLoader` holds no session state: vLLM's per-worker start / update / finish rules
are ``slotsync.engine.reference.worker_state.WorkerState``'s, which calls
:meth:`WeightLoader.load_update`
inside an active session. It does no process or pipe I/O; it does map memory (CUDA IPC or the
shared-memory stand-in, ``slotsync.engine.shm``) and waits for the device.

One job over ~500 lines: the receive path with its fast paths, which share the mapped buffer,
the flat views of the weights and the remembered plans (splitting them would pass those
caches between files).

Handle values (``args``) it understands, per GPU UUID:

* the 15-tuple of ``torch.multiprocessing.reductions.reduce_tensor(t)[1]`` for a CUDA tensor:
  slot 6 is overwritten with this worker's device index and ``rebuild_cuda_tensor(*args)``
  maps the producer's memory (vLLM's behaviour);
* the CPU stand-in: the same 15-tuple with storage handle ``b"slotsync.shm:" + segment``
  (slot 7), naming bytes ``[slot 9, slot 9 + slot 8)`` of POSIX shared memory
  ``/dev/shm/<segment>``, laid out as slots 1-5 say (``slotsync.engine.shm``); copied out
  with ``slotsync.engine.shm.read_shm_args``.
"""

from __future__ import annotations

import base64
import collections
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from slotsync.engine.reference.payload import (
    RAW_PACKED,
    UPDATE_INFO_KEYS,
    ParsedUpdate,
    check_args,
    decode_json,
    handles_of,
    nbytes,
    parse_update_info,
)
from slotsync.engine.shm import is_shm_args, read_shm_args
from slotsync.protocol.rank import gather
from slotsync.protocol.rank.export import copy_width

_FlatWeight = tuple[torch.dtype, list[int], dict[torch.dtype, torch.Tensor]]
"""A weight's dtype, shape and flat views of it by dtype (its own first)."""


@dataclass
class PackedPlan:
    """A packed chunk this worker already parsed, checked and loaded once, keyed by its
    ``names``. A later chunk whose ``dtype_names``, ``shapes`` and ``tensor_sizes`` equal
    these lists (as sent) passes the same checks, so it is copied out without redoing them
    per tensor (each round re-sends the same chunks).

    Attributes:
        dtype_names, shapes, tensor_sizes: the chunk's ``update_info`` lists as received.
        need: bytes of the chunk in the packed buffer.
        wide: the integer dtype the copy moves (see ``export.copy_width``).
        splits: elements of ``wide`` per non-empty tensor, in order.
        dsts: flat views of the weights in ``wide``, one per entry of ``splits`` (``None``
            in discard mode, which copies nothing).
        table: on CUDA with Triton and 8-byte words, the weights' addresses and offsets for
            ``gather.scatter_from`` (one kernel copies the chunk out); else None.
    """

    dtype_names: list
    shapes: list
    tensor_sizes: list
    need: int
    wide: torch.dtype
    splits: list[int]
    dsts: list[torch.Tensor] | None
    table: torch.Tensor | None = None


_MAX_PLANS = 4096  # distinct chunks remembered per worker (a round has tens to hundreds)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class WeightLoader:
    """One worker's weights (``{name: tensor}`` on ``device``) and the receive path into them.

    Args:
        index: the worker's rank in the engine (for error texts).
        device: the worker's device; ``gpu_uuid``: the GPU UUID whose handles it maps.
        weights: the initial weights (loaded from ``--model``, or empty).
        strict: only names and dtypes / shapes of ``weights`` are accepted (``--model``).
        discard: benchmark mode (``WorkerSpec.discard``): check, map nothing, store nothing.
    """

    def __init__(self, index: int, device: torch.device, gpu_uuid: str,
                 weights: dict[str, torch.Tensor], strict: bool, discard: bool) -> None:
        self.index = index
        self.device = device
        self.gpu_uuid = gpu_uuid
        self.device_index = device.index if device.type == "cuda" else -1
        self.weights = weights
        self.strict = strict
        self.discard = discard
        self.sync_seconds = 0.0  # waiting for the device (the copies themselves)
        self.packed_maps = 0  # packed buffers mapped anew (not found in torch's IPC cache)
        self.planned_chunks = 0  # packed chunks loaded through a remembered PackedPlan
        self.planned_from_text = 0  # of those, found by their JSON text (RawPackedUpdateInfo)
        self.scattered_chunks = 0  # of those, copied out by one gather.scatter_from kernel
        self.overlapped_chunks = 0  # prepared while the previous chunk's copy still ran
        # Set by the serve loop around an update_weights call: a scatter launched then is not
        # waited for; its event (and the buffer it reads) wait in _copies for wait_copies.
        self.defer_copy_wait = False
        self._copies: collections.deque[tuple[torch.cuda.Event, torch.Tensor]] = (
            collections.deque())
        # vLLM's PackedBufferImporter: one mapped packed buffer, keyed by its handle's args
        self._importer: tuple[tuple, torch.Tensor] | None = None
        self._flat: dict[str, _FlatWeight] = {}  # see _flat_weight
        self._plans: dict[tuple, PackedPlan] = {}  # see PackedPlan
        self._raw_plans: dict[tuple[bytes, ...], PackedPlan] = {}  # see RawPackedUpdateInfo

    def _import_packed(self, args: Any) -> torch.Tensor:
        """Map a packed buffer the way vLLM 0.33's ``PackedBufferImporter`` does: a one-slot
        cache keyed by the handle's args. Chunks that send the same export reuse the mapping;
        a new export replaces it (releasing the old one), and the session's end releases it
        -- so each export is rebuilt and released exactly once, which is what torch's
        cross-process reference count pairs with one ``reduce_tensor``."""
        if not (isinstance(args, (tuple, list)) and len(args) == 15) or is_shm_args(args):
            return self._materialize(args)  # shm stand-in (a copy): nothing is ref-counted
        list_args = list(args)
        list_args[6] = self.device_index
        key = tuple(list_args)
        if self._importer is not None and self._importer[0] == key:
            return self._importer[1]
        # Rebuild while the previous entry still holds its storage (vLLM does the same): a new
        # export of the same block then hits torch's consumer cache -- no new mapping, and
        # that export's count is released at once -- instead of mapping the block again.
        buf = self._materialize(args)
        old, self._importer = self._importer, (key, buf)
        if old is None or _storage_ptr(old[1]) != _storage_ptr(buf):
            self.packed_maps += 1
        return buf

    def load_update(self, update_info: Any, update_info_json: bytes | None,
                    packed: bool) -> int:
        """Load one chunk (``update_info`` decoded, or as JSON text in ``update_info_json``)
        of a session that is ``packed`` or not: a remembered plan, else parse, check and
        load. Returns the bytes loaded.

        Raises:
            ValueError, TypeError, AssertionError: the update_info fails vLLM's checks
                (``slotsync.engine.reference.payload``) or this worker's (handle, sizes,
                ``--model``).
        """
        n = None
        if update_info_json is not None:
            n = self._load_planned_raw(update_info_json, packed)
            if n is None:
                update_info = decode_json(update_info_json)
        if n is None:
            n = self._load_planned(update_info, packed)
        if n is None:
            parsed = parse_update_info(update_info, packed)
            n = self._check_only(parsed) if self.discard else self._load_chunk(parsed)
            self._remember(update_info, parsed, update_info_json)
        return n

    def load_pairs(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each received tensor into the weight of that name in place (a new name
        creates it, without ``--model``); returns the bytes loaded. Waits for the device's
        copies (vLLM answers after them). The unpacked (and unplanned packed) load, and with
        ``--receive vllm`` the model's ``load_weights``.

        Raises:
            ValueError: with ``--model``, an unknown name or another dtype / shape.
        """
        total = 0
        for name, t in pairs:
            cur = self.weights.get(name)
            if self.strict:
                if cur is None:
                    raise ValueError(f"unknown weight name {name!r}: not a parameter of the model")
                if cur.dtype != t.dtype or cur.shape != t.shape:
                    raise ValueError(
                        f"weight {name!r}: model has {cur.dtype} {list(cur.shape)}, update "
                        f"has {t.dtype} {list(t.shape)}"
                    )
            if cur is not None and cur.dtype == t.dtype and cur.shape == t.shape:
                cur.copy_(t)
            else:
                self.weights[name] = t.to(self.device, copy=True)
                self._flat.pop(name, None)
                self._forget_plans()  # plans hold views of the replaced weight
            total += t.numel() * t.element_size()
        if self.device.type == "cuda":
            self._synchronize()
        return total

    # -- loading ---------------------------------------------------------------------------

    def _handle_for_me(self, by_uuid: Any) -> Any:
        if not isinstance(by_uuid, dict) or self.gpu_uuid not in by_uuid:
            keys = list(by_uuid.keys()) if isinstance(by_uuid, dict) else []
            raise ValueError(
                f"IPC handle not found for GPU UUID {self.gpu_uuid}. Available UUIDs: {keys}"
            )
        return by_uuid[self.gpu_uuid]

    def _materialize(self, args: Any) -> torch.Tensor:
        """Turn one handle's ``args`` into a tensor on this worker's device."""
        if is_shm_args(args):
            return read_shm_args(args).to(self.device)
        if isinstance(args, (tuple, list)) and len(args) == 15:
            if self.device.type != "cuda":
                raise ValueError(
                    f"worker {self.index} runs on {self.device} and cannot map a CUDA IPC handle"
                )
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            list_args = list(args)
            list_args[6] = self.device_index
            return rebuild_cuda_tensor(*list_args)
        if isinstance(args, (tuple, list)) and len(args) == 2 and callable(args[0]):
            raise ValueError(
                "handle value is a (rebuild_fn, args) pair (vLLM 0.17-0.21 format); "
                "vLLM 0.27+ expects the args tuple alone"
            )
        raise ValueError(f"unrecognized IPC handle args of type {type(args).__name__}")

    @staticmethod
    def _check_sizes(p: ParsedUpdate) -> None:
        """Packed: each ``tensor_sizes`` entry must equal its shape's bytes, and each tensor's
        byte offset in the buffer must be a multiple of its element size: vLLM's packed
        consumer views every tensor in place before cloning it (vLLM 0.32
        ``packed_tensor.unpack_tensor``: ``tensor.contiguous().view(dtype)`` of a uint8
        slice), which torch refuses otherwise -- the same check, with torch's own message, on
        a meta tensor here."""
        assert p.tensor_sizes is not None
        off = 0
        for name, dt, shape, size in zip(p.names, p.dtypes, p.shapes, p.tensor_sizes,
                                         strict=True):
            want = nbytes(dt, shape)
            if size != want:
                raise ValueError(
                    f"tensor {name!r}: tensor_sizes says {size} bytes, shape {shape} of "
                    f"{dt} is {want} bytes"
                )
            if off % dt.itemsize:
                torch.empty(off + size, dtype=torch.uint8, device="meta")[off:].view(dt)
            off += size

    def _packed_buffer(self, handles: Any, need: int) -> torch.Tensor:
        """Map this worker's packed buffer (from the chunk's ``{gpu_uuid: args}``) as flat
        uint8, held for the session, checked to hold ``need`` bytes."""
        buf = self._import_packed(self._handle_for_me(handles)).reshape(-1)
        if buf.dtype != torch.uint8:
            buf = buf.view(torch.uint8)
        if need > buf.numel():
            raise ValueError(f"packed buffer has {buf.numel()} bytes, chunk needs {need}")
        return buf

    def _check_only(self, p: ParsedUpdate) -> int:
        """Discard mode: every check of a load that needs no memory; returns the chunk's
        bytes (as a load would report them) without mapping or storing anything."""
        if p.tensor_sizes is not None:  # packed
            check_args(self._handle_for_me(p.handles))
            self._check_sizes(p)
            return sum(p.tensor_sizes)
        total = 0
        for dt, shape, by_uuid in zip(p.dtypes, p.shapes, p.handles, strict=True):
            check_args(self._handle_for_me(by_uuid))
            total += nbytes(dt, shape)
        return total

    def _tensors(self, p: ParsedUpdate) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        if p.tensor_sizes is not None:  # packed: one uint8 buffer
            self._check_sizes(p)
            buf = self._packed_buffer(p.handles, sum(p.tensor_sizes))
            off = 0
            for name, dt, shape, size in zip(
                p.names, p.dtypes, p.shapes, p.tensor_sizes, strict=True
            ):
                piece = buf[off : off + size].clone()
                out.append((name, piece.view(dt).reshape(shape)))
                off += size
            return out
        for name, dt, shape, by_uuid in zip(p.names, p.dtypes, p.shapes, p.handles, strict=True):
            t = self._materialize(self._handle_for_me(by_uuid))
            if t.dtype == torch.uint8 and dt != torch.uint8:  # shm region: raw bytes
                want = nbytes(dt, shape)
                if t.numel() != want:
                    raise ValueError(
                        f"tensor {name!r}: handle covers {t.numel()} bytes, shape {shape} of "
                        f"{dt} is {want} bytes"
                    )
                t = t.view(dt).reshape(shape)
            elif t.dtype == torch.uint8 and list(t.shape) != shape:
                t = t.reshape(shape)
            if t.dtype != dt or list(t.shape) != shape:
                raise ValueError(
                    f"tensor {name!r}: handle gives {t.dtype} {list(t.shape)}, update_info "
                    f"says {dt} {shape}"
                )
            out.append((name, t))
        return out

    def _flat_weight(self, name: str) -> _FlatWeight | None:
        """``(dtype, shape, {copy dtype: flat view})`` of a contiguous weight, cached per
        name (the in-place path runs every round for thousands of tensors; a replaced weight
        drops its entry, see ``_load_chunk``)."""
        got = self._flat.get(name)
        if got is None:
            cur = self.weights.get(name)
            if cur is None or not cur.is_contiguous():
                return None
            got = self._flat[name] = (cur.dtype, list(cur.shape), {cur.dtype: cur.view(-1)})
        return got

    @staticmethod
    def _as(flat: _FlatWeight, dtype: torch.dtype) -> torch.Tensor:
        views = flat[2]
        v = views.get(dtype)
        if v is None:
            v = views[dtype] = next(iter(views.values())).view(dtype)
        return v

    def _load_planned_raw(self, text: bytes, packed: bool) -> int | None:
        """``_load_planned`` for ``update_info`` as JSON text, keyed by its lists' text."""
        if not (packed and self._raw_plans):
            return None
        try:
            raw = RAW_PACKED.decode(text)
        except msgspec.DecodeError:  # (ValidationError too) another shape: decode it all
            return None
        plan = self._raw_plans.get(raw.key())
        if plan is None:
            return None
        try:
            handles = pickle.loads(base64.b64decode(raw.ipc_handles_pickled))
        except Exception:  # noqa: BLE001 - the full parse reports it as vLLM would
            return None
        n = self._load_from_plan(plan, handles)
        if n is not None:
            self.planned_from_text += 1
        return n

    def _load_planned(self, update_info: Any, packed: bool) -> int | None:
        """Packed chunk seen before (see ``PackedPlan``): unpickle the handles, map the buffer
        and copy every tensor out in one call. Returns bytes loaded, or None when no plan
        matches (the caller then parses and checks everything)."""
        if not (packed and isinstance(update_info, dict)
                and update_info.keys() <= UPDATE_INFO_KEYS):
            return None
        names = update_info.get("names")
        if not isinstance(names, list):
            return None
        try:
            plan = self._plans.get(tuple(names))
        except TypeError:  # unhashable names: the full parse reports them
            return None
        if (plan is None or update_info.get("dtype_names") != plan.dtype_names
                or update_info.get("shapes") != plan.shapes
                or update_info.get("tensor_sizes") != plan.tensor_sizes):
            return None
        return self._load_from_plan(plan, handles_of(update_info))

    def _load_from_plan(self, plan: PackedPlan, handles: Any) -> int | None:
        """Map the chunk's buffer and copy every tensor out as ``plan`` says; None when the
        handles do not suit the plan (the caller then takes the full path)."""
        if not isinstance(handles, dict):
            return None
        if plan.dsts is None:  # discard
            check_args(self._handle_for_me(handles))
        else:
            buf = self._packed_buffer(handles, plan.need)
            if buf.data_ptr() % plan.wide.itemsize:
                return None  # this buffer's base is less aligned than the plan's: copy narrower
            src = buf[: plan.need].view(plan.wide)
            if plan.table is not None and plan.dsts:
                if self._copies:
                    self.overlapped_chunks += 1
                gather.scatter_from(src, plan.table)
                if self.defer_copy_wait:
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(self.device))
                    self._copies.append((done, src))  # src keeps the mapping until then
                else:
                    self._synchronize()  # the producer reuses its buffer after this
                self.scattered_chunks += 1
            else:
                self._copy_out(src, plan.splits, plan.dsts)
        self.planned_chunks += 1
        return plan.need

    def wait_copies(self, keep: int = 0) -> float:
        """Wait for deferred copies, oldest first, until ``keep`` are left (their chunks'
        answers may go out then: the producer reuses its buffer after it). Returns the
        seconds waited."""
        waited = 0.0
        while len(self._copies) > keep:
            done, _ = self._copies[0]
            t0 = time.perf_counter()
            done.synchronize()
            wait = time.perf_counter() - t0
            self.sync_seconds += wait
            waited += wait
            self._copies.popleft()
        return waited

    def end_session(self) -> None:
        """Release the mapped packed buffer (vLLM: ``finish_weight_update`` and a failed
        ``update_weights`` close the ``PackedBufferImporter``)."""
        self._importer = None

    @property
    def copies_pending(self) -> int:
        """Deferred copies not yet waited for."""
        return len(self._copies)

    def _synchronize(self) -> None:
        """Wait for this worker's copies (vLLM answers only once they are done)."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        self.sync_seconds += time.perf_counter() - t0

    def _forget_plans(self) -> None:
        self._plans.clear()
        self._raw_plans.clear()

    def _remember(self, update_info: dict, p: ParsedUpdate, text: bytes | None = None) -> None:
        """After a packed chunk loaded (or checked, in discard mode) in place, keep its plan
        (also under its lists' JSON ``text``, when it came as text)."""
        if p.tensor_sizes is None:
            return
        if self.discard:
            dsts, wide, splits = None, torch.uint8, []
        elif self._last_copy is None:
            return  # loaded through the general path (new or reshaped weights)
        else:
            wide, splits, dsts = self._last_copy
        if len(self._plans) >= _MAX_PLANS:
            self._forget_plans()
        table = None
        if (dsts and wide == torch.int64 and self.device.type == "cuda"
                and gather.available()):
            # kept in the plan, which _forget_plans drops with the views it points into
            table = gather.build_table([d.data_ptr() for d in dsts], [n * 8 for n in splits],
                                       self.device)
        plan = self._plans[tuple(p.names)] = PackedPlan(
            update_info["dtype_names"], update_info["shapes"], update_info["tensor_sizes"],
            sum(p.tensor_sizes), wide, splits, dsts, table,
        )
        if text is not None:
            try:
                self._raw_plans[RAW_PACKED.decode(text).key()] = plan
            except msgspec.DecodeError:
                pass  # e.g. ipc_handles instead of ipc_handles_pickled: decoded path only

    def _copy_out(self, src: torch.Tensor, splits: list[int], dsts: list[torch.Tensor]) -> None:
        """Copy consecutive pieces of ``src`` (sizes ``splits``, in elements) into ``dsts``,
        then wait for the copies: the producer may reuse its buffer once we answer."""
        if dsts:
            if src.device == dsts[0].device:
                # One call copies every piece of the buffer into its weight: no view of the
                # buffer per tensor, batched kernels (FSDP2's all-gather copy-out uses it too).
                torch.split_with_sizes_copy(src, splits, out=dsts)
            else:
                for d, piece in zip(dsts, src.split(splits), strict=True):
                    d.copy_(piece)
        if self.device.type == "cuda":
            self._synchronize()

    def _load_packed_in_place(self, p: ParsedUpdate) -> int | None:
        """Fast path for a packed chunk whose tensors all exist with the same dtype and shape
        (every round after the first): copy the bytes straight from the mapped buffer into the
        weights with one batched ``_foreach_copy_`` (no per-tensor clone, one launch group),
        as wide integers where the alignment allows. Returns bytes loaded, or None to take the
        general path."""
        assert p.tensor_sizes is not None
        flats: list[_FlatWeight] = []
        for name, dt, shape in zip(p.names, p.dtypes, p.shapes, strict=True):
            got = self._flat_weight(name)
            if got is None or got[0] != dt or got[1] != shape:
                return None
            flats.append(got)
        self._check_sizes(p)
        need = sum(p.tensor_sizes)
        buf = self._packed_buffer(p.handles, need)
        sizes = p.tensor_sizes
        if 0 in sizes:
            flats = [f for f, n in zip(flats, sizes, strict=True) if n]
            sizes = [n for n in sizes if n]
        w, wide = 1, torch.uint8
        if flats:
            ptrs = [buf.data_ptr(), *(next(iter(f[2].values())).data_ptr() for f in flats)]
            w, wide = copy_width(sizes, ptrs)
        dsts = [self._as(f, wide) for f in flats]
        splits = [n // w for n in sizes]
        self._copy_out(buf[:need].view(wide), splits, dsts)
        self._last_copy = (wide, splits, dsts)
        return need

    def _load_chunk(self, p: ParsedUpdate) -> int:
        """Copy the chunk's tensors into ``self.weights``; returns bytes loaded."""
        self._last_copy = None
        if p.tensor_sizes is not None:
            done = self._load_packed_in_place(p)
            if done is not None:
                return done
        return self.load_pairs(self._tensors(p))


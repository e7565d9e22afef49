"""One reference-engine worker: a process that owns one GPU UUID and a copy of the weights.

This is the stand-in for one vLLM ``gpu_worker.Worker`` with the IPC weight-transfer backend
(vLLM 0.33 ``vllm/v1/worker/gpu_worker.py`` and ``distributed/weight_transfer/ipc_engine.py``,
summarized in ``shared/vllm-contract.md``). It keeps vLLM's *per-worker* state machine:

* ``start_weight_update`` twice without a finish fails ("... already active ...");
* ``update_weights`` needs an active session, and **any** failure in it ends this worker's
  session (the active flag clears), exactly like vLLM's ``except BaseException`` there;
* ``finish_weight_update`` without an active session fails;
* between start and a successful finish the weights are not servable (vLLM's parameters sit on
  the meta device then), so a checksum of them fails.

The parent process (``slotsync.engine.server``) talks to the worker over one
``multiprocessing`` pipe: it sends ``(method, kwargs)`` and receives ``("ok", result)`` or
``("err", message)``, one answer per request, in order. A packed chunk is answered only once
its copies on the device are done (vLLM synchronizes before answering), but when the next
request is already waiting the worker prepares it -- decode, map, launch its copy behind the
first -- before it waits for the first chunk's copy: the CPU work of one chunk overlaps the
device's copy of the one before (``overlapped_chunks``).

``kwargs`` may carry ``inject="<message>"``: the worker then fails that call with
``RuntimeError(message)`` after the call's precondition checks, at the point where a real load
failure would happen (test-only fault injection).

Handle values (``args``) this worker understands, per GPU UUID:

* the 15-tuple of ``torch.multiprocessing.reductions.reduce_tensor(t)[1]`` for a CUDA tensor:
  slot 6 is overwritten with this worker's device index and ``rebuild_cuda_tensor(*args)``
  maps the producer's memory (vLLM's behaviour);
* the CPU stand-in: the same 15-tuple with storage handle ``b"slotsync.shm:" + segment``
  (slot 7), naming bytes ``[slot 9, slot 9 + slot 8)`` of POSIX shared memory
  ``/dev/shm/<segment>``, laid out as slots 1-5 say (``slotsync.engine.shm``); copied out
  with ``slotsync.engine.shm.read_shm_args``.

The reference engine always unpickles ``ipc_handles_pickled``: it stands in for a vLLM server
launched with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
"""

from __future__ import annotations

import base64
import collections
import cProfile
import os
import pickle
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

from slotsync.engine.checksum import tensor_checksum
from slotsync.engine.shm import is_shm_args, read_shm_args
from slotsync.protocol import gather
from slotsync.protocol.export import copy_width

# Keys of vLLM's IPCWeightTransferUpdateInfo (0.27-0.33); anything else is a TypeError there.
_UPDATE_INFO_KEYS = frozenset(
    {"names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes"}
)
# Keys of vLLM's IPC init info (0.27-0.33).
_INIT_INFO_KEYS = frozenset({"packed"})

START_ACTIVE_MSG = (
    "start_weight_update called while a weight update is already active. "
    "Call finish_weight_update first."
)
UPDATE_INACTIVE_MSG = "start_weight_update must be called before update_weights."
FINISH_INACTIVE_MSG = "finish_weight_update called without a matching start_weight_update."
SHUTDOWN_ACTIVE_MSG = "Cannot release a trainer connection during a weight update"
"""vLLM 0.32 ``Worker.shutdown_weight_transfer_engine``'s refusal during an update."""
NOT_SERVABLE_MSG = "Cannot copy out of meta tensor; no data!"
"""What vLLM's ``/weight_checker`` reports between start and a successful finish: its
``compute_tensor_digests`` reads the parameters layerwise reload put on the meta device
(torch's ``NotImplementedError`` text)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the parent tells a worker process at spawn.

    Attributes:
        index: worker rank within the engine (0-based; the position in ``--gpu-uuids``).
        device: ``"cpu"`` or ``"cuda:<i>"``.
        gpu_uuid: torch-format GPU UUID to answer to, or ``None`` on CUDA to use the real one
            (``str(torch.cuda.get_device_properties(i).uuid)``).
        model_path: safetensors file loaded as the initial weights, or ``None`` (then any
            names are accepted by updates and create entries).
        discard: benchmark mode: ``update_weights`` parses and validates ``update_info``
            exactly as usual (unpickle, lengths, this worker's GPU UUID present, handle
            shape, packed sizes) but maps no memory and stores nothing, so a control-plane
            benchmark can send synthetic handles without a GPU.
        receive: ``"reference"`` (this module's parse / map / copy, with its fast paths) or
            ``"vllm"``: every chunk goes through vLLM's own
            ``IPCWeightTransferEngine.update_weights`` (``slotsync.engine.vllm_receive``).
    """

    index: int
    device: str
    gpu_uuid: str | None
    model_path: str | None
    discard: bool = False
    receive: str = "reference"


@dataclass
class ParsedUpdate:
    """One ``update_info`` after vLLM-style validation (see :func:`parse_update_info`).

    ``handles`` is a list of ``{gpu_uuid: args}`` (one per name) when unpacked, or one
    ``{gpu_uuid: args}`` dict for the chunk's uint8 buffer when packed; ``tensor_sizes`` is
    each tensor's bytes in the packed buffer (``None`` when unpacked).
    """

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    handles: Any
    tensor_sizes: list[int] | None


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in `dtype_names`")
    return dt


def _check_dataclass_kwargs(d: Any, allowed: frozenset, what: str, cls: str) -> None:
    """Refuse a non-object or an unknown key the way vLLM 0.32's
    ``WeightTransferEngine.parse_init_info`` / ``parse_update_info`` do: the dataclass
    constructor's ``TypeError`` wrapped as ``ValueError("Invalid <what> for
    IPCWeightTransferEngine: <cls>.__init__() got an unexpected keyword argument '<key>'")``."""
    if not isinstance(d, dict):
        raise TypeError(f"{what} must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(
            f"Invalid {what} for IPCWeightTransferEngine: {cls}.__init__() got an unexpected "
            f"keyword argument '{unknown[0]}'"
        )


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize  # (torch.empty(0).element_size() cost ~2 us per tensor)


_FlatWeight = tuple[torch.dtype, list[int], dict[torch.dtype, torch.Tensor]]
"""A weight's dtype, shape and flat views of it by dtype (its own first)."""


@dataclass
class _PackedPlan:
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


_JSON = msgspec.json.Decoder()  # JSON text -> dict / list / str / int / float / bool / None


class _RawPackedUpdateInfo(msgspec.Struct, forbid_unknown_fields=True):
    """A packed ``update_info`` as JSON text, its lists left undecoded (``msgspec.Raw`` only
    finds where each ends). Byte-identical lists decode to identical values, so the four
    texts key a ``_PackedPlan`` without decoding thousands of names and shapes per chunk."""

    names: msgspec.Raw
    dtype_names: msgspec.Raw
    shapes: msgspec.Raw
    tensor_sizes: msgspec.Raw
    ipc_handles_pickled: str

    def key(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (bytes(self.names), bytes(self.dtype_names), bytes(self.shapes),
                bytes(self.tensor_sizes))


_RAW_PACKED = msgspec.json.Decoder(_RawPackedUpdateInfo)

_MAX_PLANS = 4096  # distinct chunks remembered per worker (a round has tens to hundreds)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _check_args(args: Any) -> None:
    """Discard mode: the handle value must look like one ``_materialize`` would accept."""
    if isinstance(args, (tuple, list)) and len(args) == 15:
        return
    raise ValueError(f"unrecognized IPC handle args of type {type(args).__name__}")


def _handles_of(update_info: dict) -> Any:
    """The unpickled ``ipc_handles_pickled`` (vLLM 0.33: exactly one of ``ipc_handles`` /
    ``ipc_handles_pickled``; only the pickled form travels over HTTP).

    Raises:
        ValueError: both or neither given, or ``ipc_handles`` given.
    """
    handles = update_info.get("ipc_handles")
    pickled = update_info.get("ipc_handles_pickled")
    if pickled is not None:
        if handles is not None:
            raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
        return pickle.loads(base64.b64decode(pickled))
    if handles is not None:
        raise ValueError(
            "`ipc_handles` holds live objects and only travels over Ray; over HTTP send "
            "`ipc_handles_pickled`"
        )
    raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")


def parse_update_info(update_info: Any, packed: bool) -> ParsedUpdate:
    """Validate one ``update_info`` as vLLM's IPC backend does, in its order.

    Rules, from vLLM 0.32 ``ipc_engine.py`` (``IPCWeightTransferUpdateInfo.__post_init__``,
    then ``IPCWeightTransferEngine.receive_weights``): unknown or missing keys fail
    ``parse_update_info`` (``Invalid update_info for IPCWeightTransferEngine: ...``); exactly
    one of ``ipc_handles`` / ``ipc_handles_pickled`` (standard base64 of a pickle);
    ``dtype_names`` and ``shapes`` as long as ``names``, and a handle list too. Then, packed:
    ``tensor_sizes`` is required (``ValueError("`tensor_sizes` is required when
    packed=True")``) and the handles must be one dict -- else vLLM's bare ``assert
    isinstance(update_info.ipc_handles, dict)`` fails with an empty message; unpacked: the
    handles must be a list (bare ``assert isinstance(..., list)``). Beyond vLLM, packed
    ``tensor_sizes`` must be as long as ``names`` (vLLM's ``zip`` would drop the rest).

    Raises:
        ValueError, TypeError, AssertionError: with vLLM's texts; the caller turns them into
            a 500.
    """
    _check_dataclass_kwargs(update_info, _UPDATE_INFO_KEYS, "update_info",
                            "IPCWeightTransferUpdateInfo")
    for key in ("names", "dtype_names", "shapes"):
        if key not in update_info:
            raise ValueError(
                "Invalid update_info for IPCWeightTransferEngine: IPCWeightTransferUpdateInfo"
                f".__init__() missing 1 required positional argument: '{key}'"
            )
    names = update_info["names"]
    dtype_names = update_info["dtype_names"]
    shapes = update_info["shapes"]
    handles = _handles_of(update_info)
    n = len(names)
    if len(dtype_names) != n:
        raise ValueError(
            f"`dtype_names` should be of the same size as `names`: got {len(dtype_names)} and {n}"
        )
    if len(shapes) != n:
        raise ValueError(
            f"`shapes` should be of the same size as `names`: got {len(shapes)} and {n}"
        )
    if isinstance(handles, list) and len(handles) != n:
        raise ValueError(
            f"`ipc_handles` should be of the same size as `names`: got {len(handles)} and {n}"
        )
    tensor_sizes = update_info.get("tensor_sizes")
    if packed:
        if tensor_sizes is None:
            raise ValueError("`tensor_sizes` is required when packed=True")
        if not isinstance(handles, dict):
            raise AssertionError  # vLLM: assert isinstance(update_info.ipc_handles, dict)
        if len(tensor_sizes) != n:
            raise ValueError(
                f"`tensor_sizes` should be of the same size as `names`: "
                f"got {len(tensor_sizes)} and {n}"
            )
        tensor_sizes = [int(s) for s in tensor_sizes]
    else:
        if not isinstance(handles, list):
            raise AssertionError  # vLLM: assert isinstance(update_info.ipc_handles, list)
        tensor_sizes = None
    dtypes = [_dtype(d) for d in dtype_names]
    shapes = [[int(d) for d in s] for s in shapes]
    return ParsedUpdate(list(names), dtypes, shapes, handles, tensor_sizes)


class WorkerState:
    """State of one worker: its weights and vLLM's per-worker weight-update state machine.

    Every public method is one ``collective_rpc`` target; the parent calls it with keyword
    arguments and an optional ``inject`` message (test-only fault).
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.index = spec.index
        self.device, self.gpu_uuid = worker_device(spec.device, spec.gpu_uuid)
        self.device_index = self.device.index if self.device.type == "cuda" else -1
        self.strict = spec.model_path is not None
        self.discard = spec.discard
        self.weights: dict[str, torch.Tensor] = {}
        if spec.model_path is not None:
            from safetensors.torch import load_file

            self.weights = load_file(spec.model_path, device=str(self.device))
        if self.device.type == "cuda" and gather.available():
            # Compile the copy-out kernel now (~0.5 s), not during a round's load.
            gather.warm_up(self.device, scatter=True)
        self.packed = False
        self.active = False
        self.servable = True
        self.start_count = 0
        self.finish_count = 0
        self.update_count = 0
        self.bytes_loaded = 0
        self.load_seconds = 0.0  # inside update_weights: parse, map, copy, synchronize
        self.sync_seconds = 0.0  # of which waiting for the device (the copies themselves)
        self.packed_maps = 0  # packed buffers mapped anew (not found in torch's IPC cache)
        self.planned_chunks = 0  # packed chunks loaded through a remembered _PackedPlan
        self.planned_from_text = 0  # of those, found by their JSON text (_RawPackedUpdateInfo)
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
        self._plans: dict[tuple, _PackedPlan] = {}  # see _PackedPlan
        self._raw_plans: dict[tuple[bytes, ...], _PackedPlan] = {}  # see _RawPackedUpdateInfo
        self._last_copy: tuple[torch.dtype, list[int], list[torch.Tensor]] | None = None
        self.init_count = 0
        self.sleep_level = 0
        self.receiver = None  # --receive vllm: vLLM's IPCWeightTransferEngine
        if spec.receive == "vllm":
            from slotsync.engine.vllm_receive import VllmReceiver

            self.receiver = VllmReceiver(self.device, self.gpu_uuid, self._load_pairs)

    # -- vLLM worker methods ---------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: Any, inject: str | None = None) -> None:
        """vLLM ``init_weight_transfer_engine``: ``init_info = {"packed": bool}``; an unknown
        key fails as vLLM 0.32's ``parse_init_info`` does (``Invalid init_info for
        IPCWeightTransferEngine: ...``)."""
        if self.receiver is not None:
            if inject:
                raise RuntimeError(inject)
            self.receiver.init(init_info)
            self.packed = self.receiver.packed
            self.init_count += 1
            return
        _check_dataclass_kwargs(init_info, _INIT_INFO_KEYS, "init_info",
                                "IPCWeightTransferInitInfo")
        if inject:
            raise RuntimeError(inject)
        self.packed = bool(init_info.get("packed", False))
        self.init_count += 1

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

    def start_weight_update(self, inject: str | None = None) -> None:
        """Open a session; fails if one is already active on this worker."""
        if self.active:
            raise RuntimeError(START_ACTIVE_MSG)
        if inject:
            raise RuntimeError(inject)
        self.active = True
        self.servable = False
        self.start_count += 1

    def update_weights(self, update_info: Any = None, inject: str | None = None,
                       update_info_json: bytes | None = None,
                       missing_rank: bool = False) -> int:
        """Load one chunk; returns the bytes loaded. Any failure ends the session.

        ``update_info`` comes decoded, or as JSON text in ``update_info_json`` (the server
        forwards the request's text so that each worker decodes it in parallel).
        ``missing_rank``: the request's ``update_info`` list has no entry for this worker's
        rank (vLLM 0.32 ``Worker.update_weights`` indexes it: ``IndexError``).

        Raises:
            RuntimeError: no active session, or an injected fault.
            ValueError, TypeError, AssertionError, IndexError: the update_info fails vLLM's
                checks (or is not JSON).
        """
        if not self.active:
            raise RuntimeError(UPDATE_INACTIVE_MSG)
        t0 = time.perf_counter()
        try:
            if inject:
                raise RuntimeError(inject)
            if missing_rank:
                raise IndexError("list index out of range")
            if self.receiver is not None:
                if update_info_json is not None:
                    try:
                        update_info = _JSON.decode(update_info_json)
                    except msgspec.DecodeError as e:
                        raise ValueError(f"update_info is not valid JSON: {e}") from None
                n = self.receiver.update(update_info)
                self.packed_maps = self.receiver.packed_maps
            else:
                n = self._load_update(update_info, update_info_json)
        except BaseException:
            self.active = False
            self._importer = None  # (vLLM's importer, --receive vllm, is kept, as in vLLM)
            raise
        self.update_count += 1
        self.bytes_loaded += n
        self.load_seconds += time.perf_counter() - t0
        return n

    def _load_update(self, update_info: Any, update_info_json: bytes | None) -> int:
        """The reference receive path: a remembered plan, else parse, check and load."""
        n = None
        if update_info_json is not None:
            n = self._load_planned_raw(update_info_json)
            if n is None:
                try:
                    update_info = _JSON.decode(update_info_json)
                except msgspec.DecodeError as e:
                    raise ValueError(f"update_info is not valid JSON: {e}") from None
        if n is None:
            n = self._load_planned(update_info)
        if n is None:
            parsed = parse_update_info(update_info, self.packed)
            n = self._check_only(parsed) if self.discard else self._load_chunk(parsed)
            self._remember(update_info, parsed, update_info_json)
        return n

    def _load_pairs(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
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

    def finish_weight_update(self, inject: str | None = None) -> None:
        """Close the session; fails without an active one. Weights are servable again."""
        if not self.active:
            raise RuntimeError(FINISH_INACTIVE_MSG)
        if inject:
            raise RuntimeError(inject)
        self.active = False
        self.servable = True
        self.finish_count += 1
        self._importer = None  # vLLM: finish_weight_update closes the packed importer
        if self.receiver is not None:
            self.receiver.end_session()

    def shutdown_weight_transfer_engine(self, inject: str | None = None) -> None:
        """Shut the transfer engine down; refused during an active session."""
        if self.active:
            raise RuntimeError(SHUTDOWN_ACTIVE_MSG)
        if inject:
            raise RuntimeError(inject)

    def sleep(self, level: int = 1, inject: str | None = None) -> None:
        """``/sleep?level=``'s worker part (vLLM 0.32 ``Worker.sleep``): level 2 discards the
        weights -- every byte becomes 0xFF (NaN for floating dtypes), what vLLM's weights
        hold after a level-2 sleep and a wake (no contents); level 1 keeps them (vLLM
        offloads them to CPU and restores them)."""
        if inject:
            raise RuntimeError(inject)
        if level >= 2:
            for t in self.weights.values():
                if t.numel():
                    t.reshape(-1).view(torch.uint8).fill_(0xFF)
        self.sleep_level = level

    def wake_up(self, tags: list[str] | None = None, inject: str | None = None) -> None:
        """``/wake_up``'s worker part: the weights are resident again (with the contents
        sleep left them)."""
        if inject:
            raise RuntimeError(inject)
        if tags is None or "weights" in tags:
            self.sleep_level = 0

    def rpc(self, method: str, args: list | None = None, kwargs: dict | None = None,
            inject: str | None = None) -> Any:
        """``POST /collective_rpc``'s worker part: the vLLM ``Worker`` methods this worker
        has (``check_health``: healthy while it runs, vLLM 0.32 ``gpu_worker.py``).

        Raises:
            AttributeError: another name, with vLLM's ``getattr(worker, method)`` text.
        """
        if inject:
            raise RuntimeError(inject)
        if method == "check_health":
            return None
        raise AttributeError(f"'Worker' object has no attribute '{method}'")

    # -- reference-engine extras -----------------------------------------------------------

    def checksums(self, inject: str | None = None) -> dict[str, str]:
        """``{name: tensor_checksum(weight)}`` over all weights, sorted by name."""
        if not self.servable:
            raise RuntimeError(NOT_SERVABLE_MSG)
        if inject:
            raise RuntimeError(inject)
        return {k: tensor_checksum(self.weights[k]) for k in sorted(self.weights)}

    def stats(self, inject: str | None = None) -> dict[str, Any]:
        """Counters for ``GET /_slotsync/stats`` (bytes_loaded in bytes, counts in calls)."""
        return {
            "index": self.index,
            "gpu_uuid": self.gpu_uuid,
            "device": str(self.device),
            "active": self.active,
            "servable": self.servable,
            "packed": self.packed,
            "init_count": self.init_count,
            "start_count": self.start_count,
            "finish_count": self.finish_count,
            "update_count": self.update_count,
            "bytes_loaded": self.bytes_loaded,
            "load_seconds": self.load_seconds,
            "sync_seconds": self.sync_seconds,
            "overlapped_chunks": self.overlapped_chunks,
            "packed_maps": self.packed_maps,
            "planned_chunks": self.planned_chunks,
            "planned_from_text": self.planned_from_text,
            "scattered_chunks": self.scattered_chunks,
            "num_weights": len(self.weights),
            "sleep_level": self.sleep_level,
            "receive": "vllm" if self.receiver is not None else "reference",
            "vllm_file": None if self.receiver is None else self.receiver.vllm_file,
        }

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
            want = _nbytes(dt, shape)
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
            _check_args(self._handle_for_me(p.handles))
            self._check_sizes(p)
            return sum(p.tensor_sizes)
        total = 0
        for dt, shape, by_uuid in zip(p.dtypes, p.shapes, p.handles, strict=True):
            _check_args(self._handle_for_me(by_uuid))
            total += _nbytes(dt, shape)
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
                want = _nbytes(dt, shape)
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

    def _load_planned_raw(self, text: bytes) -> int | None:
        """``_load_planned`` for ``update_info`` as JSON text, keyed by its lists' text."""
        if not (self.packed and self._raw_plans):
            return None
        try:
            raw = _RAW_PACKED.decode(text)
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

    def _load_planned(self, update_info: Any) -> int | None:
        """Packed chunk seen before (see ``_PackedPlan``): unpickle the handles, map the buffer
        and copy every tensor out in one call. Returns bytes loaded, or None when no plan
        matches (the caller then parses and checks everything)."""
        if not (self.packed and isinstance(update_info, dict)
                and update_info.keys() <= _UPDATE_INFO_KEYS):
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
        return self._load_from_plan(plan, _handles_of(update_info))

    def _load_from_plan(self, plan: _PackedPlan, handles: Any) -> int | None:
        """Map the chunk's buffer and copy every tensor out as ``plan`` says; None when the
        handles do not suit the plan (the caller then takes the full path)."""
        if not isinstance(handles, dict):
            return None
        if plan.dsts is None:  # discard
            _check_args(self._handle_for_me(handles))
        else:
            buf = self._packed_buffer(handles, plan.need)
            if buf.data_ptr() % plan.wide.itemsize:
                return None  # this buffer's base is less aligned than the plan's: copy narrower
            src = buf[: plan.need].view(plan.wide)
            if plan.table is not None and plan.dsts:
                if self._copies:
                    self.overlapped_chunks += 1
                gather.scatter_from(src, plan.table, max(plan.splits) * 8)
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

    def wait_copies(self, keep: int = 0) -> None:
        """Wait for deferred copies, oldest first, until ``keep`` are left (their chunks'
        answers may go out then: the producer reuses its buffer after it)."""
        while len(self._copies) > keep:
            done, _ = self._copies[0]
            t0 = time.perf_counter()
            done.synchronize()
            wait = time.perf_counter() - t0
            self.sync_seconds += wait
            self.load_seconds += wait
            self._copies.popleft()

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
        plan = self._plans[tuple(p.names)] = _PackedPlan(
            update_info["dtype_names"], update_info["shapes"], update_info["tensor_sizes"],
            sum(p.tensor_sizes), wide, splits, dsts, table,
        )
        if text is not None:
            try:
                self._raw_plans[_RAW_PACKED.decode(text).key()] = plan
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
        return self._load_pairs(self._tensors(p))


def worker_device(device: str, gpu_uuid: str | None) -> tuple[torch.device, str]:
    """A worker process's device (made current on CUDA) and the GPU UUID it answers to: the
    given (logical) one, else on CUDA the device's real one
    (``str(torch.cuda.get_device_properties(i).uuid)``, vLLM's lookup).

    Raises:
        ValueError: a CPU worker without a GPU UUID.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        return dev, gpu_uuid or str(torch.cuda.get_device_properties(dev).uuid)
    if gpu_uuid is None:
        raise ValueError("a CPU worker needs an explicit (logical) GPU UUID")
    return dev, gpu_uuid


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process (multiprocessing, spawn context).

    Sends ``("ready", {"gpu_uuid", "device"})`` or ``("err", traceback)`` once, then serves
    ``(method, kwargs)`` requests until ``("exit", {})`` or until the parent goes away.
    """
    from slotsync.testing.processes import die_with_parent

    die_with_parent()  # SIGTERM when the engine's front dies, even by SIGKILL
    try:
        state = WorkerState(spec)
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ready", {"gpu_uuid": state.gpu_uuid, "device": str(state.device)}))
    # SLOTSYNC_PROFILE_DIR (``slotsync bench gpu --profile``): cProfile every update_weights
    # call and write engine-worker-<index>.prof there when the worker exits.
    prof_dir = os.environ.get("SLOTSYNC_PROFILE_DIR")
    prof = cProfile.Profile() if prof_dir else None
    try:
        _serve(state, spec, conn, prof)
    finally:
        if prof is not None and prof_dir:
            prof.dump_stats(os.path.join(prof_dir, f"engine-worker-{spec.index}.prof"))


def _serve(state: WorkerState, spec: WorkerSpec, conn: Connection,
           prof: cProfile.Profile | None) -> None:
    """Answer requests in order. ``held``: the answer of an ``update_weights`` whose copy
    still runs on the device; it goes out once that copy is done -- at once when no request
    is waiting, else after the next ``update_weights`` was prepared and launched."""
    held: tuple[str, Any] | None = None
    while True:
        if held is not None and not conn.poll(0):
            state.wait_copies()
            conn.send(held)
            held = None
        try:
            method, kwargs = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        deferrable = method == "update_weights" and not kwargs.get("inject")
        if held is not None and not deferrable:  # nothing else runs before it is answered
            state.wait_copies()
            conn.send(held)
            held = None
        if method == "exit":
            conn.send(("ok", None))
            return
        before = state.copies_pending
        state.defer_copy_wait = deferrable
        try:
            fn = getattr(state, method)
            if prof is not None and method == "update_weights":
                result = prof.runcall(fn, **kwargs)
            else:
                result = fn(**kwargs)
            answer: tuple[str, Any] = ("ok", result)
        except Exception as e:
            tb = traceback.format_exc().rstrip().replace("\n", f"\n[worker {spec.index}] ")
            print(f"[worker {spec.index}] {method} failed: {tb}", file=sys.stderr, flush=True)
            answer = ("err", str(e))  # vLLM's WorkerProc: str(exception), "" for a bare assert
        finally:
            state.defer_copy_wait = False
        launched = state.copies_pending > before
        if held is not None:  # the previous chunk's answer first, once its copy is done
            state.wait_copies(keep=1 if launched else 0)
            conn.send(held)
            held = None
        if launched:
            held = answer
        else:
            state.wait_copies()
            conn.send(answer)

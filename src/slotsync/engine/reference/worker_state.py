"""One reference-engine worker's state: vLLM's per-worker weight-update state machine.

This is the stand-in for one vLLM ``gpu_worker.Worker`` with the IPC weight-transfer backend
(vLLM 0.33 ``vllm/v1/worker/gpu_worker.py`` and ``distributed/weight_transfer/ipc_engine.py``,
summarized in ``shared/vllm-contract.md``). Its rules, from vLLM (the table ``_REQUIRES`` /
``_AFTER`` below):

* ``start_weight_update`` twice without a finish fails ("... already active ...");
* ``update_weights`` needs an active session, and **any** failure in it ends this worker's
  session (the active flag clears), exactly like vLLM's ``except BaseException`` there;
* ``finish_weight_update`` without an active session fails;
* ``shutdown_weight_transfer_engine`` during an active session fails;
* between start and a successful finish the weights are not servable (vLLM's parameters sit on
  the meta device then), so a checksum of them fails.

:class:`WorkerState` takes calls and returns results (or raises vLLM's exception); it knows
no pipe or process (``slotsync.engine.reference.worker`` serves it over the pool's pipe). The
weights
and the receive path are its :class:`~slotsync.engine.reference.weight_loader.WeightLoader`; the
payload rules are ``slotsync.engine.reference.payload``'s.

A draft model (``WorkerSpec.draft_model_path``, issue 18) has its own weights
(``draft_loader``): ``start_draft_weight_update`` opens the one session a worker may hold
(vLLM 0.32 ``Worker._start_weight_update(is_draft=True)``: "already active" as for the main
start; without a draft model ``NO_DRAFT_MSG``, raised before the session opens), its updates
load into the draft model, and ``finish_weight_update`` ends it. Between a draft start and
its finish only the draft is unservable (vLLM's layerwise reload targets the draft model);
``checksums`` covers the main model only, as vLLM's ``compute_weight_checksums`` does;
``draft_checksums`` (``/_slotsync/stats``) covers the draft.

Every call takes an optional ``inject="<message>"``: the call then fails with
``RuntimeError(message)`` after its precondition checks, at the point where a real load
failure would happen (test-only fault injection).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from slotsync.engine.checksum import tensor_checksum
from slotsync.engine.lora_flags import LoraOptions
from slotsync.engine.reference.payload import decode_json, parse_init_info
from slotsync.engine.reference.weight_loader import WeightLoader
from slotsync.engine.worker_device import worker_device
from slotsync.protocol.rank import gather

START_ACTIVE_MSG = (
    "start_weight_update called while a weight update is already active. "
    "Call finish_weight_update first."
)
UPDATE_INACTIVE_MSG = "start_weight_update must be called before update_weights."
FINISH_INACTIVE_MSG = "finish_weight_update called without a matching start_weight_update."
SHUTDOWN_ACTIVE_MSG = "Cannot release a trainer connection during a weight update"
"""vLLM 0.32 ``Worker.shutdown_weight_transfer_engine``'s refusal during an update."""
NO_DRAFT_MSG = "Draft model weight update requested, but no draft model is configured."
"""vLLM 0.32 ``Worker._set_draft_weight_update_target``'s refusal (no draft model)."""
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
        receive: ``"reference"`` (``slotsync.engine.reference.weight_loader``'s parse / map / copy,
            with its fast paths) or ``"vllm"``: every chunk goes through vLLM's own
            ``IPCWeightTransferEngine.update_weights`` (``slotsync.engine.reference.vllm_receive``).
    """

    index: int
    device: str
    gpu_uuid: str | None
    model_path: str | None
    discard: bool = False
    receive: str = "reference"
    draft_model_path: str | None = None  # the draft model's safetensors file (issue 18)
    lora: LoraOptions = LoraOptions()  # --enable-lora and its limits (issue 36)


# The session rules (vLLM 0.33 ``gpu_worker.py``). A call needs this worker's session active
# (True) or not (False), else it fails with vLLM's text:
_REQUIRES: dict[str, tuple[bool, str]] = {
    "start_weight_update": (False, START_ACTIVE_MSG),
    "update_weights": (True, UPDATE_INACTIVE_MSG),
    "finish_weight_update": (True, FINISH_INACTIVE_MSG),
    "shutdown_weight_transfer_engine": (False, SHUTDOWN_ACTIVE_MSG),
}
# After the call succeeded: (active, servable). A failed update_weights ends the session
# (active False) and leaves the weights unservable.
_AFTER: dict[str, tuple[bool, bool]] = {
    "start_weight_update": (True, False),
    "finish_weight_update": (False, True),
}


class WorkerState:
    """State of one worker: its weights and vLLM's per-worker weight-update state machine.

    Every public method is one ``collective_rpc`` target; the parent calls it with keyword
    arguments and an optional ``inject`` message (test-only fault).
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.index = spec.index
        self.device, self.gpu_uuid = worker_device(spec.device, spec.gpu_uuid)
        weights: dict[str, torch.Tensor] = {}
        if spec.model_path is not None:
            from safetensors.torch import load_file

            weights = load_file(spec.model_path, device=str(self.device))
        if self.device.type == "cuda" and gather.available():
            # Compile the copy-out kernel now (~0.5 s), not during a round's load.
            gather.warm_up(self.device, scatter=True)
        self.loader = WeightLoader(self.index, self.device, self.gpu_uuid, weights,
                                   strict=spec.model_path is not None, discard=spec.discard)
        self.main_loader = self.loader
        self.draft_loader: WeightLoader | None = None
        if spec.draft_model_path is not None:
            from safetensors.torch import load_file

            self.draft_loader = WeightLoader(
                self.index, self.device, self.gpu_uuid,
                load_file(spec.draft_model_path, device=str(self.device)), strict=True,
                discard=spec.discard)
        self.draft_session = False  # the active session targets the draft model
        self.draft_servable = True
        self.draft_start_count = 0
        self.packed = False
        self.active = False
        self.servable = True
        self.start_count = 0
        self.finish_count = 0
        self.update_count = 0
        self.bytes_loaded = 0
        self.load_seconds = 0.0  # inside update_weights: parse, map, copy, synchronize
        self.init_count = 0
        self.sleep_level = 0
        self.receiver = None  # --receive vllm: vLLM's IPCWeightTransferEngine
        if spec.receive == "vllm":
            from slotsync.engine.reference.vllm_receive import VllmReceiver

            self.receiver = VllmReceiver(self.device, self.gpu_uuid, self.loader.load_pairs)
        from slotsync.engine.reference.lora import WorkerLoras

        self.loras = WorkerLoras(spec.lora, lambda: self.main_loader.weights)

    # -- the session rules (_REQUIRES, _AFTER) ---------------------------------------------

    def _require(self, call: str, inject: str | None = None) -> None:
        """``call``'s precondition (``_REQUIRES``), then the injected fault, if any."""
        needs_active, message = _REQUIRES[call]
        if self.active != needs_active:
            raise RuntimeError(message)
        if inject:
            raise RuntimeError(inject)

    def _after(self, call: str) -> None:
        """``call`` succeeded: the session and servable flags it leaves (``_AFTER``)."""
        self.active, self.servable = _AFTER[call]

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
        packed = parse_init_info(init_info)
        if inject:
            raise RuntimeError(inject)
        self.packed = packed
        self.init_count += 1

    def start_weight_update(self, inject: str | None = None) -> None:
        """Open a session; fails if one is already active on this worker."""
        self._require("start_weight_update", inject)
        self._after("start_weight_update")
        self.start_count += 1

    def start_draft_weight_update(self, inject: str | None = None) -> None:
        """vLLM's ``start_draft_weight_update``: open a session whose updates load into the
        draft model; fails if a session is active, or (``NO_DRAFT_MSG``) without a draft
        model, before the session opens."""
        needs_active, message = _REQUIRES["start_weight_update"]
        if self.active != needs_active:
            raise RuntimeError(message)
        if self.draft_loader is None:
            raise RuntimeError(NO_DRAFT_MSG)
        if inject:
            raise RuntimeError(inject)
        self.active, self.draft_session, self.draft_servable = True, True, False
        self.loader = self.draft_loader  # (vLLM: set_weight_update_target(draft, ...))
        self.draft_start_count += 1

    def _end_target(self) -> None:
        """The session ended: updates go to the main model again (vLLM
        ``reset_weight_update_target``)."""
        self.loader, self.draft_session = self.main_loader, False

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
        self._require("update_weights")
        t0 = time.perf_counter()
        try:
            if inject:
                raise RuntimeError(inject)
            if missing_rank:
                raise IndexError("list index out of range")
            if self.receiver is not None:
                if update_info_json is not None:
                    update_info = decode_json(update_info_json)
                n = self.receiver.update(update_info)
                self.loader.packed_maps = self.receiver.packed_maps
            else:
                n = self.loader.load_update(update_info, update_info_json, self.packed)
        except BaseException:
            self.active = False
            self.loader.end_session()  # (vLLM's importer, --receive vllm, is kept, as in vLLM)
            self._end_target()
            raise
        self.update_count += 1
        self.bytes_loaded += n
        self.load_seconds += time.perf_counter() - t0
        return n

    def finish_weight_update(self, inject: str | None = None) -> None:
        """Close the session; fails without an active one. Weights are servable again."""
        self._require("finish_weight_update", inject)
        if self.draft_session:
            self.active, self.draft_servable = False, True  # (the main model was untouched)
        else:
            self._after("finish_weight_update")
            self.loras.reset()  # (vLLM: model_runner.reset_lora_state(), issue 36)
        self.finish_count += 1
        self.loader.end_session()  # vLLM: finish_weight_update closes the packed importer
        self._end_target()
        if self.receiver is not None:
            self.receiver.end_session()

    def add_lora(self, lora_request: dict[str, Any], inject: str | None = None) -> bool:
        """vLLM's ``Worker.add_lora(lora_request)`` (issue 36; ``reference/lora.py``)."""
        if inject is not None:
            raise RuntimeError(inject)
        return self.loras.add(lora_request)

    def lora_state(self, inject: str | None = None) -> dict[str, Any]:
        """This worker's adapters (``GET /_slotsync/lora``)."""
        return self.loras.state()

    def shutdown_weight_transfer_engine(self, inject: str | None = None) -> None:
        """Shut the transfer engine down; refused during an active session."""
        self._require("shutdown_weight_transfer_engine", inject)

    def sleep(self, level: int = 1, inject: str | None = None) -> None:
        """``/sleep?level=``'s worker part (vLLM 0.32 ``Worker.sleep``): level 2 discards the
        weights -- every byte becomes 0xFF (NaN for floating dtypes), what vLLM's weights
        hold after a level-2 sleep and a wake (no contents); level 1 keeps them (vLLM
        offloads them to CPU and restores them)."""
        if inject:
            raise RuntimeError(inject)
        if level >= 2:
            drafts = self.draft_loader.weights.values() if self.draft_loader else ()
            for t in [*self.main_loader.weights.values(), *drafts]:
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
        has (``check_health``: healthy while it runs; ``supports_draft_weight_updates``:
        whether a draft model is set up; vLLM 0.32 ``gpu_worker.py``), and
        ``__getattribute__("rpc_rank")`` on vLLM's ``WorkerWrapperBase`` (its rank in the
        executor: here its index, which is that rank for every worker whose answer is shown,
        those of DP replica 0).

        Raises:
            AttributeError: another name, with vLLM's ``getattr(worker, method)`` text.
        """
        if inject:
            raise RuntimeError(inject)
        if method == "check_health":
            return None
        if method == "__getattribute__" and list(args or ()) == ["rpc_rank"]:
            return self.index
        if method == "supports_draft_weight_updates":  # (issue 18: a draft model is set up)
            return self.draft_loader is not None
        raise AttributeError(f"'Worker' object has no attribute '{method}'")

    # -- reference-engine extras -----------------------------------------------------------

    def checksums(self, inject: str | None = None) -> dict[str, str]:
        """``{name: tensor_checksum(weight)}`` over all weights, sorted by name."""
        if not self.servable:
            raise RuntimeError(NOT_SERVABLE_MSG)
        if inject:
            raise RuntimeError(inject)
        w = self.main_loader.weights
        return {k: tensor_checksum(w[k]) for k in sorted(w)}

    def draft_checksums(self) -> dict[str, str] | str:
        """The draft model's ``{name: tensor_checksum}``, or ``NOT_SERVABLE_MSG`` between a
        draft start and its finish (or after a failed draft session)."""
        if not self.draft_servable:
            return NOT_SERVABLE_MSG
        assert self.draft_loader is not None
        w = self.draft_loader.weights
        return {k: tensor_checksum(w[k]) for k in sorted(w)}

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
            "sync_seconds": self.loader.sync_seconds,
            "overlapped_chunks": self.loader.overlapped_chunks,
            "packed_maps": self.loader.packed_maps,
            "planned_chunks": self.loader.planned_chunks,
            "planned_from_text": self.loader.planned_from_text,
            "scattered_chunks": self.loader.scattered_chunks,
            "num_weights": len(self.main_loader.weights),
            **({"has_draft": False} if self.draft_loader is None else {
                "has_draft": True, "draft_session": self.draft_session,
                "draft_start_count": self.draft_start_count,
                "draft_num_weights": len(self.draft_loader.weights),
                "draft_checksums": self.draft_checksums()}),
            "sleep_level": self.sleep_level,
            "receive": "vllm" if self.receiver is not None else "reference",
            "vllm_file": None if self.receiver is None else self.receiver.vllm_file,
        }

    # -- deferred copies (the serve loop's overlap of one chunk's copy with the next) -------

    @property
    def defer_copy_wait(self) -> bool:
        """Set by the serve loop around an ``update_weights`` call: a scatter launched then
        is not waited for (:meth:`wait_copies` waits for it)."""
        return self.loader.defer_copy_wait

    @defer_copy_wait.setter
    def defer_copy_wait(self, value: bool) -> None:
        self.loader.defer_copy_wait = value

    def wait_copies(self, keep: int = 0) -> None:
        """Wait for deferred copies, oldest first, until ``keep`` are left (their chunks'
        answers may go out then: the producer reuses its buffer after it)."""
        other = self.draft_loader if self.loader is self.main_loader else self.main_loader
        if other is not None and other.copies_pending:
            # (a session that ended -- a failed draft update -- may have left one)
            self.load_seconds += other.wait_copies(0)
        self.load_seconds += self.loader.wait_copies(keep)

    @property
    def copies_pending(self) -> int:
        """Deferred copies not yet waited for (of both models' loaders)."""
        drafts = self.draft_loader.copies_pending if self.draft_loader is not None else 0
        return self.main_loader.copies_pending + drafts

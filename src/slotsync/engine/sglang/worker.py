"""One TP rank of an SGLang engine (``python -m slotsync.engine --impl sglang|sglang-reference``):
a worker process that holds its copy of the model and loads its own payload entry.

In SGLang each TP rank is a scheduler process with a ``TpModelWorker`` and a ``ModelRunner``;
the scheduler-level rules (session, flush, versions) are replicated on every rank and kept
once, in the front (``slotsync.engine.sglang.state``). What each rank does for itself is
here: ``update_weights_from_tensor`` deserializes entry ``tp_rank`` only (``entries`` is the
whole list, as every SGLang rank receives it) with the engine's payload parser
(``slotsync.engine.sglang.payload``: SGLang's own code, or slotsync's reference parser) and
loads it into the rank's model; ``begin_weight_update`` / ``end_weight_update`` are the
runners' (``restore_weights_before_loading`` / ``postprocess_weights``: nothing to do for an
unquantized model, counted).

Freeing the received tensors (docs/sglang-contract.md 5.2): the deserialized payload is the
only reference to the mapped memory (the shared-memory stand-in's mapping, a CUDA IPC
storage on a GPU). With ``free_before_reply`` (0.5.20: ``tp_worker.update_weights_from_tensor``
holds it as an argument temporary, dead before the scheduler's barrier) it is dropped before
this call answers; otherwise (0.5.21+: a local of the scheduler handler that holds the
barrier, weight_updater.py L241 / L226) it is kept in :attr:`SglangWorkerHost.held` until
:meth:`SglangWorkerHost.release`, which the front sends to every rank once all of them
answered (the TP barrier).

On a GPU (``--device cuda``, ``--impl sglang`` only; issue 26 E) the rank is what SGLang's
scheduler process is to the weights: its model on ``cuda:<i>``; a stream of its own made
current for the process's life, as SGLang's scheduler creates ``schedule_stream``
(``srt/managers/scheduler.py`` L1159, 0.5.23: ``device_module.Stream(priority=0)``) and runs
its whole event loop inside ``StreamContext(schedule_stream)`` (L2008) -- so the copies into
the parameters are queued on it, and freeing the received tensors (torch's IPC deleter
synchronizes the *current* stream, contract 5.2) waits for exactly those copies; the CUDA
tensors rebuilt by SGLang's ``_rebuild_cuda_tensor_modified`` over torch's own
``rebuild_cuda_tensor`` (a real CUDA IPC mapping; no CPU stand-in). SGLang maps the UUID in
each pickle to a device with ``str(torch.cuda.get_device_properties(i).uuid)``; a rank whose
UUID is not its GPU's own (several TP ranks on one GPU under logical UUIDs,
``wire.logical_gpu_uuid``) gets the one stand-in ``slotsync.engine.cuda_standin.install``:
``get_device_properties(<its device>).uuid`` answers its UUID, every other property and
device stays real. ``copy_sleep_cycles`` (tests only) queues ``torch.cuda._sleep`` on that
stream before each weight copy, and once before each LoRA adapter load (SGLang's method then
reads the trainer's memory -- its checksum check and ``.cpu()`` copies, on that stream --
only after it), so the copies finish late (the garbage tests, base weights and adapters).

The process speaks the pool's worker protocol (``slotsync.engine.pool``); an exception
answers ``("err", text)``, which the front treats as SGLang's "Scheduler hit an exception"
(the engine dies). ``inject="<message>"`` (test faults) raises ``RuntimeError(message)``
inside the call.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from slotsync.engine.worker_pipe import failure, next_request, start_worker


@dataclass(frozen=True)
class SglangWorkerSpec:
    """What the front tells a TP-rank worker at start.

    Attributes:
        index: the TP rank (= the worker's index and its entry in ``serialized_named_tensors``).
        device: ``"cpu"``, or ``"cuda:<i>"`` (``parser`` ``"sglang"`` only).
        gpu_uuid: this rank's GPU UUID (torch format); on CUDA None means the GPU's own.
        gpu_uuids: every rank's GPU UUID, in device-index order (what the rank sees; the CPU
            stand-in's devices).
        model_path: safetensors file of the model.
        parser: ``"sglang"`` (SGLang's code) or ``"reference"``.
        copy_sleep_cycles: CUDA only, tests: GPU clock cycles of ``torch.cuda._sleep``
            queued on the copy stream before each weight copy and before each LoRA load
            (0: none).
        lora: ``--enable-lora``'s settings for the rank (``max_lora_rank``,
            ``target_modules``, ``max_loras_per_batch``; ``lora_rank.LoraRank``), or None.
    """

    index: int
    device: str
    gpu_uuid: str | None
    gpu_uuids: tuple[str | None, ...]
    model_path: str
    parser: str
    copy_sleep_cycles: int = 0
    lora: dict[str, Any] | None = None


class SglangWorkerHost:
    """One TP rank (see the module docstring); every public method is a pool call."""

    def __init__(self, spec: SglangWorkerSpec) -> None:
        from safetensors.torch import load_file

        from slotsync.engine.sglang.payload import ReferenceParser, SglangCodeParser, SglangModel

        self.spec = spec
        self.index = spec.index
        self.device = torch.device(spec.device)
        self.uuid_standin = False
        self.stream: Any = None
        before_copy = None
        if self.device.type == "cuda":
            if spec.parser != "sglang":
                raise ValueError("a CUDA TP rank reads its payload with SGLang's own code "
                                 "(parser 'sglang')")
            self.gpu_uuid = self._cuda_rank(spec.gpu_uuid)
            self.parser: Any = SglangCodeParser()
            if spec.copy_sleep_cycles > 0:
                cycles = spec.copy_sleep_cycles

                def before_copy() -> None:
                    torch.cuda._sleep(cycles)  # on the current (copy) stream
        else:
            if spec.gpu_uuid is None:
                raise ValueError("a CPU TP rank needs its (logical) GPU UUID")
            self.gpu_uuid = spec.gpu_uuid
            if spec.parser == "sglang":
                from slotsync.engine.sglang.standin import install_sglang_cpu_standin

                install_sglang_cpu_standin(spec.gpu_uuids)  # for the process's life
                self.parser = SglangCodeParser()
            else:
                self.parser = ReferenceParser(spec.gpu_uuids)
        self.before_copy = before_copy
        self.model = SglangModel(load_file(spec.model_path, device=str(self.device)),
                                 before_copy)
        self.held: Any = None
        self.held_tensors = 0
        self.counts = {"begin_count": 0, "end_count": 0, "post_load_count": 0,
                       "load_calls": 0, "update_count": 0, "release_count": 0}
        self.last_error: str | None = None
        self.load_seconds = 0.0
        self.lora: Any = None  # (lora_rank.LoraRank, made at the first LoRA call)
        self.hashed = 0  # weights hashed for /weights_checker so far

    def _cuda_rank(self, gpu_uuid: str | None) -> str:
        """Set up a CUDA rank (module docstring): its device, its copy stream made current for
        the process's life, the UUID stand-in if its UUID is not the GPU's own. Returns its
        UUID."""
        from slotsync.engine.sglang.payload import use_shim_path

        use_shim_path()  # (a spawned rank has the front's sys.path already)
        torch.cuda.set_device(self.device)
        # SGLang: schedule_stream = device_module.Stream(priority=0) (scheduler.py L1159),
        # the event loop inside StreamContext(schedule_stream) (L2008)
        self.stream = torch.cuda.Stream(self.device, priority=0)
        torch.cuda.set_stream(self.stream)
        own = str(torch.cuda.get_device_properties(self.device).uuid)
        if gpu_uuid is None or gpu_uuid == own:
            return own
        from slotsync.engine import cuda_standin

        cuda_standin.install(self.device, gpu_uuid)
        self.uuid_standin = True
        return gpu_uuid

    def _inject(self, inject: str | None) -> None:
        if inject is not None:
            raise RuntimeError(inject)

    def begin_weight_update(self, inject: str | None = None) -> None:
        """The runner's ``begin_weight_update`` (``restore_weights_before_loading``)."""
        self._inject(inject)
        self.counts["begin_count"] += 1

    def end_weight_update(self, run_post_load: bool, inject: str | None = None) -> None:
        """The runner's ``end_weight_update`` (``post_load_weights`` only if nothing was
        loaded in the session, then ``postprocess_weights``)."""
        self._inject(inject)
        self.counts["end_count"] += 1
        self.counts["post_load_count"] += int(run_post_load)

    def update_weights_from_tensor(self, entries: list[bytes], load_format: str | None,
                                   load_target: bool, free_before_reply: bool,
                                   inject: str | None = None) -> int:
        """Deserialize entry ``index`` of ``entries``, load it into the model unless no
        runner is selected (``load_target`` false: ``selector="draft"`` without a draft
        model loads nothing), then free it now or hold it until :meth:`release`. Returns the
        bytes loaded.

        Raises:
            whatever SGLang's scheduler would raise (an ``IndexError`` for too few entries, a
            refused global, "Invalid device_uuid", a misaligned bucket tensor, an unknown
            ``load_format``, a name the model lacks): the engine dies of it.
        """
        from slotsync.engine.sglang.payload import update_weights_from_tensor

        self.counts["load_calls"] += 1
        t0 = time.perf_counter()
        before = self.model.bytes_loaded
        try:
            self._inject(inject)
            named_tensors = self.parser.deserialize_own_rank(entries, self.index)
            if load_target:
                update_weights_from_tensor(self.model, self.parser, named_tensors,
                                           load_format, self.device)
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.load_seconds += time.perf_counter() - t0
        self.counts["update_count"] += 1
        if free_before_reply:
            del named_tensors  # 0.5.20: dead before the barrier
        else:
            self.held = named_tensors  # 0.5.21+: until the handler returns (release)
            self.held_tensors = _count(named_tensors)
        return self.model.bytes_loaded - before

    def release(self) -> int:
        """The scheduler handler returned (after the TP barrier): drop the received
        tensors; returns how many were held."""
        n = self.held_tensors
        self.held, self.held_tensors = None, 0
        self.counts["release_count"] += 1
        return n

    # -- LoRA adapters (issue 36; lora_rank.py runs SGLang's TpModelWorker code) ----------

    def _lora(self) -> Any:
        if self.lora is None:
            if self.spec.lora is None or self.parser.name != "sglang":
                raise RuntimeError("LoRA is not enabled on this rank (--enable-lora, --impl "
                                   "sglang)")
            from slotsync.engine.sglang.lora_rank import LoraRank

            self.lora = LoraRank(self.index, **self.spec.lora)
        return self.lora

    def lora_load(self, fields: dict[str, Any], inject: str | None = None) -> dict[str, Any]:
        """``TpModelWorker.load_lora_adapter_from_tensors`` (``LoraRank.load``).

        Raises:
            whatever SGLang's method raises: the engine dies of it.
        """
        self._inject(inject)
        lora = self._lora()
        if self.before_copy is not None:
            self.before_copy()  # (tests: the reads of the trainer's memory start late)
        return lora.load(fields)

    def lora_unload(self, fields: dict[str, Any], inject: str | None = None) -> dict[str, Any]:
        """``TpModelWorker.unload_lora_adapter`` (``LoraRank.unload``)."""
        self._inject(inject)
        return self._lora().unload(fields)

    def lora_checksums(self) -> dict[str, Any]:
        """``{"adapters": LoraRank.checksums(), "hashed": weights hashed by the checker}``."""
        return {"adapters": {} if self.lora is None else self.lora.checksums(),
                "hashed": self.hashed}

    def lora_weights_checker(self, action: str, skip_tensor_list: list[str] | None,
                             inject: str | None = None) -> dict[str, Any]:
        """This rank's part of ``/weights_checker``: the sha256 of every weight SGLang's
        ``_is_skip_weight_check`` keeps (``lora_code.checker``), or ``{"error"}`` for an
        action other than ``checksum`` (SGLang: "Unsupported action=...")."""
        self._inject(inject)
        if action != "checksum":
            return {"error": f"Unsupported action={action!r}"}
        from slotsync.engine.sglang import lora_code
        from slotsync.engine.sglang.lora_rank import sglang_sha256

        checker = lora_code.checker()
        sums = {n: sglang_sha256(t) for n, t in self.model.params.items()
                if not checker._is_skip_weight_check(n, t, skip_tensor_list)}
        self.hashed += len(sums)
        return {"checksums": sums, "per_gpu_checksum": checker.overall_checksum(sums),
                "parallelism_info": {"tp_rank": self.index}}

    def checksums(self) -> dict[str, str]:
        """``{name: slotsync.engine.checksum.tensor_checksum}`` of every model tensor."""
        from slotsync.engine.checksum import tensor_checksum

        return {n: tensor_checksum(t) for n, t in self.model.params.items()}

    def stats(self) -> dict[str, Any]:
        """This rank's counters for ``/_slotsync/stats``."""
        return {
            "index": self.index, "tp_rank": self.index, "pid": os.getpid(),
            "gpu_uuid": self.gpu_uuid,
            "device": str(self.device), "parser": self.parser.name,
            "uuid_standin": self.uuid_standin,
            # (where SGLang's code came from: the installed sglang, or the shim)
            "sglang_file": getattr(sys.modules.get("sglang.srt.utils.patch_torch"),
                                   "__file__", None),
            "copy_stream": None if self.stream is None else self.stream.cuda_stream,
            "copy_sleep_cycles": self.spec.copy_sleep_cycles, **self.counts,
            "bytes_loaded": self.model.bytes_loaded, "load_seconds": self.load_seconds,
            "num_weights": len(self.model.params), "held_tensors": self.held_tensors,
            "last_error": self.last_error, "rebuilt_on": self._rebuilt_on(),
        }

    def _rebuilt_on(self) -> dict[str, int]:
        """Tensors rebuilt per device index, by SGLang's UUID lookup (the CPU stand-in's
        count) or the reference parser's mirror of it; ``{}`` on CUDA (not counted)."""
        if self.device.type == "cuda":
            return {}
        if self.parser.name == "sglang":
            from slotsync.engine.sglang.standin import installed

            standin = installed()
            counts = standin.rebuilt_on if standin is not None else {}
        else:
            counts = self.parser.rebuilt_on
        return {str(i): n for i, n in sorted(counts.items())}


def _count(named_tensors: Any) -> int:
    """How many tensors a deserialized payload holds (a bucket counts its metadata)."""
    if isinstance(named_tensors, dict):
        return len(named_tensors.get("metadata") or ()) or 1
    try:
        return len(named_tensors)
    except TypeError:
        return 1


def sglang_worker_main(spec: SglangWorkerSpec, conn: Connection) -> None:
    """Entry point of a TP-rank process: ``("ready", ...)`` or ``("err", traceback)``, then
    ``(method, kwargs)`` requests in order until ``("exit", {})`` or the parent goes."""
    host = start_worker(conn, lambda: SglangWorkerHost(spec))
    if host is None:
        return
    while (request := next_request(conn)) is not None:
        method, kwargs = request
        if method == "exit":
            conn.send(("ok", None))
            return
        fn = getattr(type(host), method, None)
        try:
            if fn is None or method.startswith("_"):
                raise AttributeError(f"no worker method {method!r}")
            answer: tuple[str, Any] = ("ok", getattr(host, method)(**kwargs))
        except Exception as e:
            failure(spec.index, method, e)  # (prints the traceback, each line prefixed)
            answer = ("err", f"{type(e).__name__}: {e}")
        conn.send(answer)

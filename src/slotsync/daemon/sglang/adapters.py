"""LoRA adapters on an SGLang engine (I/O-free; issue 36 B): what the server can hold
(:func:`lora_limits`), what SGLang cannot take (:func:`refusal`), the bodies of ``POST
/load_lora_adapter_from_tensors`` (:func:`load_body`) and ``POST /unload_lora_adapter``
(:func:`unload_body`), the adapters ``GET /v1/models`` lists (:func:`served_adapters`), and
the call that proves every TP rank has copied the ranks' memory (:func:`proving_body`).
Transport ``"device"``: SGLang maps the ranks' memory itself (CUDA IPC; the shared-memory
stand-in on the CPU). Code cited is SGLang 0.5.23 (``srt/...`` inside the wheel); the LoRA
routes, structs and receive code are the same in 0.5.20 and 0.5.21.

The route (``srt/entrypoints/http_server.py`` ``load_lora_adapter_from_tensors``, body
``managers/io_struct.py`` ``LoadLoRAAdapterFromTensorsReqInput``): ``lora_name``,
``config_dict`` (the PEFT config as JSON), ``serialized_named_tensors`` (one pickle per TP
rank, base64 over HTTP, ``adapter_pickle.py``), ``load_format`` (``"flattened_bucket"`` or
null), ``expected_checksums`` (``{name: sha256}``), ``pinned``; the answer is
``LoRAUpdateOutput`` ``{"success", "error_message", "loaded_adapters"}``, 200 or 400.

**When a rank's memory may be freed** (proved from the code, cited):

1. The tokenizer (``managers/tokenizer_control_mixin.py`` ``load_lora_adapter_from_tensors``)
   sends the request to the scheduler and answers once the scheduler's *TP rank 0* answered
   (``update_lora_adapter_communicator``: one answer per DP rank; only rank 0 of each TP group
   has a socket to the tokenizer, ``scheduler_components/ipc_channels.py``
   ``SchedulerIpcChannels.create``, ``is_rank_zero``).
2. On each TP rank, ``Scheduler.load_lora_adapter_from_tensors`` (``managers/scheduler.py``)
   calls ``TpModelWorker.load_lora_adapter_from_tensors`` (``managers/tp_worker.py``), which
   unpickles the rank's entry into ``data`` / ``tensors`` (locals), reads every tensor with
   ``.cpu()`` for ``expected_checksums``, then ``ModelRunner.load_lora_adapter_from_tensors``
   -> ``LoRAManager._load_lora_adapter_from_tensors`` (``lora/lora_manager.py``) ->
   ``load_lora_weights_from_tensors`` -> ``LoRAAdapter.initialize_weights_from_tensors`` /
   ``_process_weight`` (``lora/lora.py``), which keeps ``loaded_weight.cpu()`` of every
   layer, embedding and added-token tensor: **a copy to host memory on receipt**, not into
   the GPU pool (that is filled from these host copies when a batch first uses the adapter,
   ``mem_pool.py``). ``.cpu()`` of a CUDA tensor into pageable memory returns only when the
   copy is done; a name matching none of those kinds is never read. No reference to a
   received tensor outlives the method: the mapped storages die when it returns (torch's IPC
   deleter synchronizes the stream before it lets go). So when a TP rank's handler has
   returned, that rank no longer reads the ranks' memory -- also when the load was refused
   (the checksums were read first; validation refuses before any copy).
3. No barrier on this path: TP rank 0 replies while rank r > 0 may still be copying. **With
   tp_size 1 the load's reply proves the copies; with tp_size > 1 it proves only TP rank
   0's.** Every TP rank handles control requests one at a time in the order rank 0
   broadcast them (``scheduler_components/request_receiver.py`` ``broadcast_pyobj``), so a
   later request that passes a collective over the TP group proves every rank finished the
   load: :func:`proving_body`, ``POST /weights_checker`` with ``action "checksum"`` and
   ``skip_tensor_list [""]`` (every name contains ``""``: nothing is hashed,
   ``utils/weight_checker.py`` ``_is_skip_weight_check``), whose handler ends in
   ``torch.distributed.all_gather_object`` over the TP CPU group
   (``scheduler_components/weight_updater.py`` ``check_weights``), sent after the load's
   reply arrived. 0.5.20 has no ``skip_tensor_list``: there the proof hashes every weight
   (seconds on a large model). The rank's part goes back after that reply (or after the
   engine died: its processes are gone).

So the ``Ack(adapter_data)`` comes after the load's reply (tp_size 1) or after the proving
call's (tp_size > 1), and the rank frees its part then; a rank that frees through torch is
protected a second time by the IPC reference count (``adapter_pickle.py``: balanced).

**Checksums kill on mismatch.** ``expected_checksums`` is checked in ``TpModelWorker.
load_lora_adapter_from_tensors`` *outside* any ``try``: a mismatch raises ``RuntimeError("
[LORA-CHECK] rank<r> adapter sync MISMATCH ...")`` in the scheduler, and any scheduler
exception kills the whole server (docs/sglang-contract.md 2.7). The daemon still sends them
(``checksums=True``): a rank whose bytes changed between its digest and SGLang's read would
otherwise be served silently, while a dead engine is seen and restarted.

**Names, versions, unload.** Each version is its own adapter (``wire.served_name``): SGLang
refuses a name it holds ("Failed to load LoRA adapter <name> because it is already loaded",
``LoRAManager.validate_new_adapter``, a 400), so the new version loads beside the old one and
the old one is unloaded after. ``/unload_lora_adapter`` unregisters the name at once (new
requests naming it are refused), then waits **without a deadline** for every running request
that uses it (``lora/lora_registry.py`` ``wait_for_unload``) while holding the tokenizer's
``lora_update_lock``, which every later load and unload waits for too (sglang#32238). Under
``pause_generation(mode="in_place")`` those requests never finish, so the unload never
returns and no adapter can be loaded after it: **an adapter round never pauses the engine**,
and the daemon never sends an unload while it holds an engine paused in place (a base round
and an adapter round never overlap on a slot). An unload cut by the daemon's deadline is still
pending in SGLang ("has an incomplete unload. Retry the unload before loading it again"):
sending it again resumes the wait.

Other rules read here: ``--enable-lora`` (or ``--lora-paths``) is needed ("LoRA is not
enabled. Please set `--enable-lora` to enable LoRA."); data-parallel replicas are refused
by an ``assert`` (a 500); attention DP needs ``pinned`` adapters (``validate_new_adapter``),
which slotsync does not send; DoRA and added tokens are refused; an adapter's rank must be
``<= --max-lora-rank`` and its ``target_modules`` within ``--lora-target-modules``
(``mem_pool.py`` ``LoRAMemoryPool.can_support``); with ``--max-loaded-loras`` set, a load
past the limit makes the tokenizer unload the least recently used unpinned adapter, so the
daemon needs room for the old and the new version at once (``max_loras``).
``--max-loras-per-batch`` bounds adapters per *batch* (the GPU pool; others wait on the
host), not adapters loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from slotsync.daemon.core.adapters.plan import AdapterPlan, LoraLimits
from slotsync.daemon.sglang import versions as sglang_versions
from slotsync.daemon.sglang.adapter_pickle import TensorAt, bucket_entries, dict_entries
from slotsync.daemon.sglang.tensor_pickle import PACKED_LOAD_FORMAT, SglangPayloadError
from slotsync.protocol.wire import Handle

SGLANG_LORA_FLAGS: tuple[tuple[str, str], ...] = (
    ("enabled", "--enable-lora"),
    ("max_loras", "--max-loaded-loras"),
    ("max_lora_rank", "--max-lora-rank"),
    ("target_modules", "--lora-target-modules"),
)
"""SGLang's server flags for what ``LoraLimits`` names (``srt/arg_groups/fields/lora.py``),
``LoraLimits.flags`` of :func:`lora_limits`."""

TRANSPORT = "device"
"""The adapter round's transport for SGLang: the engine maps the ranks' memory."""

PROOF_SKIP_ALL = [""]
"""``/weights_checker``'s ``skip_tensor_list`` that skips every tensor (``"" in name``)."""

# SGLang's get_normalized_target_modules (srt/lora/utils.py): a module's last name part,
# mapped to the stacked module SGLang keeps it in
_TARGET_NAMES = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "out_proj": "out_proj",
    "embed_tokens": "embed_tokens", "vocab_emb": "embed_tokens",
    "embeddings": "embed_tokens", "word_embeddings": "embed_tokens", "lm_head": "lm_head",
    "output": "lm_head", "unembed_tokens": "lm_head",
    "q_a_proj": "fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
    "wq_b": "indexer.wq_b", "wk": "indexer.wk", "weights_proj": "indexer.weights_proj",
}


def normalized_target_modules(target_modules: Any) -> set[str]:
    """SGLang's ``get_normalized_target_modules`` (``srt/lora/utils.py``): ``"all"`` /
    ``"all-linear"`` -> ``{"all"}``; else each name's last dotted part, mapped to the stacked
    module that holds it (``q_proj`` -> ``qkv_proj``, ``up_proj`` -> ``gate_up_proj``, ...).

    Raises:
        ValueError: another string (SGLang's words).
    """
    if isinstance(target_modules, str):
        if target_modules not in ("all", "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target "
                             "module")
        return {"all"}
    out = set()
    for name in target_modules:
        base = str(name).split(".")[-1]
        out.add(_TARGET_NAMES.get(base, base))
    return out


def _int(info: Mapping[str, Any], key: str) -> int:
    v = info.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def lora_limits(server_info: Any) -> LoraLimits:
    """What the SGLang server of ``server_info`` (``GET /server_info``: the resolved flat
    server arguments) can hold (module docstring): ``enabled`` (``enable_lora``, or
    ``--lora-paths`` given with ``enable_lora`` unset), ``max_loras`` (``max_loaded_loras``;
    0: no limit set), ``max_lora_rank`` (0: not set, inferred from ``--lora-paths``)."""
    info = server_info if isinstance(server_info, Mapping) else {}
    flag = info.get("enable_lora")
    enabled = bool(flag) or (flag is None and bool(info.get("lora_paths")))
    return LoraLimits(enabled=enabled, max_loras=_int(info, "max_loaded_loras"),
                      max_lora_rank=_int(info, "max_lora_rank"), flags=SGLANG_LORA_FLAGS)


def _whole(plan: AdapterPlan) -> list[TensorAt] | str:
    """Every tensor of ``plan`` with its one holder, or why not (a tensor split over ranks)."""
    out = []
    for t in plan.tensors:
        p = t.whole
        if p is None:
            ranks = ", ".join(f"{q.rank} (rows {q.row_start}-{q.row_stop})" for q in t.parts)
            return (f"adapter {plan.lora_name!r} v{plan.version}: tensor {t.name!r} is split "
                    f"over ranks {ranks}; SGLang gives every TP rank the whole adapter "
                    "(TpModelWorker.load_lora_adapter_from_tensors; its LoRA layers shard "
                    "it themselves) and maps each tensor from one allocation, and slotsyncd "
                    "does not read device memory to join parts: publish each adapter tensor "
                    "whole from one rank (any rank; different tensors may come from "
                    "different ranks)")
        out.append(TensorAt(t.name, t.dtype, tuple(t.shape), p.rank, p.offset, p.nbytes))
    return out


def refusal(plan: AdapterPlan, server_info: Any = None) -> str:
    """'' when SGLang can take ``plan``, else why not, saying what to change. Checked before
    any call (an exception in SGLang's scheduler kills the server; a refusal there is a 400
    after the adapter round began).

    Without ``server_info``: a tensor split over ranks (:func:`_whole`), an adapter without
    tensors, a PEFT config SGLang's ``LoRAConfig`` cannot read (``lora_alpha`` missing,
    ``use_dora``). With it (``GET /server_info``): data-parallel replicas (the route's
    ``assert``), attention DP (needs pinned adapters), ``target_modules`` outside
    ``--lora-target-modules`` (``LoRAMemoryPool.can_support``). LoRA enabled, ``r`` and room
    are ``lora_limits``' (the core checks them).
    """
    if not plan.tensors:
        return f"adapter {plan.lora_name!r} v{plan.version} has no tensor"
    whole = _whole(plan)
    if isinstance(whole, str):
        return whole
    try:
        config = json.loads(plan.config_json)
    except ValueError:
        return f"adapter {plan.lora_name!r}: config_json is not JSON"
    if "lora_alpha" not in config:
        return (f"adapter {plan.lora_name!r}: its PEFT config has no 'lora_alpha', which "
                "SGLang's LoRAConfig reads (srt/lora/lora_config.py): add it")
    if config.get("use_dora"):
        return (f"adapter {plan.lora_name!r} is a DoRA adapter (use_dora), which SGLang's LoRA "
                "serving refuses (LoRAManager.validate_new_adapter)")
    try:
        wanted = normalized_target_modules(config.get("target_modules") or ())
    except ValueError as e:
        return f"adapter {plan.lora_name!r}: target_modules: {e}"
    if not isinstance(server_info, Mapping):
        return ""
    dp = _int(server_info, "dp_size") or 1
    if dp > 1:
        return ("SGLang refuses dynamic LoRA loading with data-parallel replicas (dp_size "
                f"{dp}: 'data-parallel replicas are not supported for dynamic lora loading'): "
                "run one server per replica (--dp-size 1), each its own engine slot")
    if server_info.get("enable_dp_attention") or (_int(server_info, "attn_dp_size") or 1) > 1:
        return ("SGLang with attention DP loads only pinned LoRA adapters ('DP-attention LoRA "
                "requires pinned adapters', LoRAManager.validate_new_adapter), which slotsyncd "
                "does not send: run this engine without --enable-dp-attention")
    served = server_info.get("lora_target_modules")
    if served and "all" not in wanted:
        have = normalized_target_modules(served)
        missing = sorted(wanted - have)
        if "all" not in have and missing:
            need = " ".join(sorted(have | wanted))
            return (f"adapter {plan.lora_name!r} targets {missing}, which the SGLang server "
                    f"was not started for (--lora-target-modules {sorted(have)}; "
                    "LoRAMemoryPool.can_support): restart it with --lora-target-modules "
                    f"{need} (the modules it serves and the adapter's), or "
                    "--lora-target-modules all")
    return ""


def load_body(plan: AdapterPlan, handles: Mapping[int, Handle], gpu_uuids: Mapping[int, str],
              tp_size: int, *, checksums: bool = True,
              engine_gpu_uuids: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``POST /load_lora_adapter_from_tensors`` body loading ``plan`` as
    ``plan.served_name``: one entry per TP rank (``adapter_pickle.py``; raw pickle bytes,
    which the client's msgspec JSON writes as base64), ``load_format "flattened_bucket"``
    when one rank holds every tensor, else null (a dict of tensors); ``expected_checksums``
    the ranks' sha256 of each whole tensor (``checksums``; module docstring: a mismatch kills
    the server); ``pinned`` false.

    Args:
        plan: the adapter (:func:`refusal` gave '').
        handles: each rank's ``AdapterData.handle`` (slot rank -> handle; a rank without a
            part may be absent or None).
        gpu_uuids: the GPU each rank's memory lives on (slot rank -> torch-format UUID).
        tp_size: the engine's TP ranks (entries written).
        checksums: send ``expected_checksums``.
        engine_gpu_uuids: the engine's GPUs (the engine table's ``gpu_uuids``), if declared:
            every holder's GPU must be one of them, or SGLang's UUID lookup raises "Invalid
            device_uuid" in the scheduler.

    Raises:
        SglangPayloadError: a plan :func:`refusal` refuses, ``tp_size`` < 1, a holder whose
            GPU the engine does not see, or ``adapter_pickle``'s refusals (named).
    """
    why = refusal(plan)
    if why:
        raise SglangPayloadError(why)
    if tp_size < 1:
        raise SglangPayloadError(f"tp_size {tp_size}: an SGLang engine has at least one TP "
                                 "rank")
    tensors = _whole(plan)
    assert not isinstance(tensors, str)
    holders = sorted({t.rank for t in tensors})
    if engine_gpu_uuids:
        seen = set(engine_gpu_uuids)
        for rank in holders:
            if gpu_uuids.get(rank) not in seen:
                raise SglangPayloadError(
                    f"rank {rank} holds adapter tensors on GPU {gpu_uuids.get(rank)!r}, which "
                    f"is not one of the engine's GPUs {list(engine_gpu_uuids)}: every TP rank "
                    "maps each tensor on its holder's GPU, and SGLang raises 'Invalid "
                    "device_uuid' (a dead server) for a GPU it does not see", rank=rank)
    if len(holders) == 1:
        rank = holders[0]
        handle = handles.get(rank)
        if handle is None or rank not in gpu_uuids:
            raise SglangPayloadError(f"rank {rank} holds the adapter but sent no handle or "
                                     "has no GPU UUID", rank=rank)
        first, rest = bucket_entries(handle, gpu_uuids[rank], tensors)
        load_format: str | None = PACKED_LOAD_FORMAT
    else:
        first, rest = dict_entries(handles, gpu_uuids, tensors)
        load_format = None
    expected = None
    if checksums:
        expected = {t.name: t.parts[0].sha256 for t in plan.tensors}
    return {"lora_name": plan.served_name, "config_dict": json.loads(plan.config_json),
            "serialized_named_tensors": [first] + [rest] * (tp_size - 1),
            "load_format": load_format, "expected_checksums": expected, "pinned": False}


def unload_body(served_name: str) -> dict[str, Any]:
    """The ``POST /unload_lora_adapter`` body (io_struct ``UnloadLoRAAdapterReqInput``).
    Never send it while the engine is paused in place (module docstring)."""
    return {"lora_name": served_name}


def served_adapters(models_json: Any) -> set[str]:
    """The adapter names ``GET /v1/models`` lists (``http_server.py`` ``available_models``:
    the base model's card, then one card per registered adapter, ``id`` its name and
    ``parent`` the served model's name; the base model's card has no ``parent``). An
    unreadable answer lists none."""
    data = models_json.get("data") if isinstance(models_json, Mapping) else None
    if not isinstance(data, list):
        return set()
    return {str(card["id"]) for card in data
            if isinstance(card, Mapping) and card.get("parent") and "id" in card}


def proving_body(tp_size: int, version: str | None) -> dict[str, Any] | None:
    """The ``POST /weights_checker`` body whose successful reply, sent after a load's reply
    arrived, proves every TP rank copied the ranks' memory (module docstring, point 3); None
    when the load's own reply proves it (``tp_size`` 1). On 0.5.20 (no
    ``skip_tensor_list``) it hashes every weight of every rank."""
    if tp_size <= 1:
        return None
    if sglang_versions.has(version, "checker_skip_list"):  # 0.5.21+
        return {"action": "checksum", "skip_tensor_list": PROOF_SKIP_ALL, "selector": "target"}
    return {"action": "checksum"}

"""vLLM's side of an adapter round (issue 36 C): what a vLLM server can hold, the adapter
folder the daemon writes for it, and the bodies of its LoRA routes. Pure functions (the
folder writer does file I/O, run by the service in a thread; no torch, no vLLM import).

How vLLM 0.32 takes an adapter, read in its code (``docs/lora-vllm-notes.md`` has the long
form, for ``docs/lora.md``):

* **Only from a path.** ``POST /v1/load_lora_adapter {"lora_name", "lora_path",
  "load_inplace"}`` (``entrypoints/serve/lora/api_router.py``) exists only when the server's
  environment has ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (``attach_router`` returns without
  registering it: a 404 otherwise) and loads only with ``--enable-lora`` (the worker's
  ``LoRAModelRunnerMixin._ensure_lora_enabled``). ``OpenAIServingModels.load_lora_adapter``
  (``entrypoints/openai/models/serving.py``) makes a ``LoRARequest(lora_name, lora_int_id,
  lora_path)`` and calls ``engine_client.add_lora``: every worker's
  ``LRUCacheWorkerLoRAManager.add_adapter`` -> ``_load_adapter`` reads the folder
  (``PEFTHelper.from_local_dir``: ``adapter_config.json``; ``validate_legal``: rank <=
  ``--max-lora-rank``, no bias / DoRA / ...; ``LoRAModel.from_local_checkpoint``:
  ``adapter_model.safetensors``, every module one the model has) -- so the daemon writes
  that folder (:func:`write_adapter_folder`) on a tmpfs, under a temp name then renamed,
  so that no reader ever sees half a file.
* **The folder must outlive the load.** ``Worker.finish_weight_update``
  (``v1/worker/gpu_worker.py``) calls ``model_runner.reset_lora_state()``
  (``v1/worker/lora_model_runner_mixin.py``: ``lora_manager.remove_all_adapters()``) after
  every base-weight update; an adapter leaves a worker's cache too when more than
  ``--max-cpu-loras`` are registered (``LRUCacheWorkerLoRAManager.add_adapter``:
  ``remove_oldest_adapter``). The API server still lists it, and the next step that
  schedules a request of it loads it again *from its path* (``GPUModelRunner`` ->
  ``set_active_loras`` -> ``_apply_adapters`` -> ``add_adapter``). A folder gone by then
  raises in the model runner, which kills the engine core ("EngineCore encountered a fatal
  error", ``v1/engine/core.py``). So a version's folder stays while any engine may serve a
  request of it -- after ``/v1/unload_lora_adapter`` too (next point).
* **Unload touches only the server's name table.** ``unload_lora_adapter`` deletes the name
  from ``OpenAIServingModels.lora_requests`` and calls nothing in the engine: new requests
  naming it get a 404, requests admitted before keep their ``LoRARequest`` (int id and
  path) and run to their end, re-reading the folder if it was evicted meanwhile.
* **Versioned names, not ``load_inplace``.** Each version is loaded as its own name
  (``wire.served_name``: ``math@v3``), beside the previous one, which is then unloaded. A
  new name gets a new ``lora_int_id`` (``lora_id_counter``) and a new path: the prefix
  cache keys a block by ``("lora", lora_name, lora_path)`` (``v1/core/kv_cache_utils.py``
  ``_gen_lora_extra_hash_keys``), so no block of the old version is reused (vllm#42125), and
  the worker caches key adapters by int id, so running requests of the old version keep
  the old weights to their end. ``load_inplace=True`` keeps the name's int id: the workers
  replace the weights under it (``add_adapter``: ``remove_adapter(lora.id)`` then add), so
  a running request switches version mid-sequence, and a request of the old version that
  re-reads after an eviction reloads the *old* path under the shared id, flipping every
  request of that id back; the server itself warns that prefix-cache blocks are not
  invalidated for an in-place reload from the same path.
* **No room to check.** ``--max-loras`` bounds the adapters *in one batch* (the scheduler
  never puts more together) and ``--max-cpu-loras`` the workers' cache (an LRU: loading
  one more evicts the oldest, which is re-read from its folder when asked for). Neither
  refuses a load, so :func:`lora_limits` reports ``max_loras=0`` (nothing for the core to
  check); ``--max-loras`` >= 2 lets requests of the old and the new version share a batch
  during a switch, ``--max-cpu-loras`` >= 2 x the adapters served keeps a switch from
  evicting.
* **A failed load on several workers puts the replies out of step.** ``add_lora`` is a
  ``collective_rpc``: vLLM's ``MultiprocExecutor`` raises at the first failing worker and
  leaves the later workers' replies queued for the next call (vLLM gh-58242), as for the
  weight calls; a 500 naming ``Worker failed with error`` puts the replies in doubt as a
  failed weight call does, so the next base round checks them first (``core/engine_session.py``
  ``CHECK_REPLIES``; the next adapter load does not check them yet), and what can be refused
  before the call is (:func:`refusal`, :func:`lora_limits`).
* **A restart forgets.** The name table lives in the API server process and the workers'
  caches in theirs: a restarted vLLM serves no adapter (but ``--lora-modules``), its
  ``lora_int_id`` counter starts again at 1, and its prefix cache is empty, so the daemon
  loads the served versions again from their kept folders (:func:`served_adapters` tells
  what a server lists).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slotsync.daemon.core.adapters.plan import AdapterPlan, AdapterTensorPlan, LoraLimits
from slotsync.protocol.wire import DTYPE_SIZES
from slotsync.protocol.wire.adapter import SAFETENSORS_DTYPES, file_header

RUNTIME_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
"""What vLLM's server environment needs for ``/v1/load_lora_adapter`` to exist."""

RUNTIME_UPDATING_WHY = ("vLLM 0.32 vllm/entrypoints/serve/lora/api_router.py: the routes "
                        "/v1/load_lora_adapter and /v1/unload_lora_adapter are attached only "
                        "then")
"""Where the rule comes from (``attach_router`` returns at once without it)."""

START_WITH_RUNTIME_UPDATING = (f"start the vLLM server with the environment variable "
                               f"{RUNTIME_UPDATING} ({RUNTIME_UPDATING_WHY})")
"""What to do when the server has no runtime adapter routes: a plain instruction, saying
where the setting goes (the server process's environment, not a flag) and why."""

START_WITH_ENABLE_LORA = "start the vLLM server with the flag --enable-lora"
"""What to do when the server runs without LoRA (``lora_config`` null)."""

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values ``--max-lora-rank`` takes (vLLM 0.32 ``config/lora.py`` ``MaxLoRARanks``)."""

VLLM_LORA_FLAGS: tuple[tuple[str, str], ...] = (
    ("enabled", f"{START_WITH_ENABLE_LORA} and the environment variable {RUNTIME_UPDATING}"),
    ("max_loras", "--max-loras"),
    ("max_lora_rank", "--max-lora-rank (one of "
     + ", ".join(str(r) for r in MAX_LORA_RANKS) + ")"),
)
"""``LoraLimits.flags`` of a vLLM server: the flag (or environment) that sets each limit."""

CONFIG_FILE = "adapter_config.json"
TENSORS_FILE = "adapter_model.safetensors"
TEMP_PREFIX = ".writing-"
"""Temp folders in the adapter root start with this (:func:`remove_stale_temp`)."""

COPY_SLICE = 64 << 20
"""Bytes written per step while copying a part (big slices: the file write releases the GIL
for the whole slice)."""

HASH_THREADS = 4
"""Threads taking the copied parts' sha256 while the parts are written (at most the CPUs)."""


class AdapterDataError(ValueError):
    """A rank's bytes are not what its ``AdapterBegin`` said: ``tensor`` and ``rank`` name
    the part (the message says what differs: its sha256, or its length)."""

    def __init__(self, tensor: str, rank: int, message: str) -> None:
        super().__init__(f"adapter tensor {tensor!r}, rank {rank}: {message}")
        self.tensor = tensor
        self.rank = rank


# -- what a server can hold ---------------------------------------------------------------


def _truthy(x: Any) -> bool | None:
    if isinstance(x, bool):
        return x
    if isinstance(x, str):  # (vLLM's envs give bools; a stand-in may give the text)
        return x.strip().lower() in ("1", "true")
    return None


def _positive_int(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else 0


def lora_limits(server_info: Any) -> LoraLimits:
    """What the vLLM server whose ``GET /server_info?config_format=json`` answered
    ``server_info`` (parsed JSON; None: the route is absent) can hold.

    vLLM 0.32 ``entrypoints/serve/dev/server_info/api_router.py`` ``show_server_info`` (dev
    mode, ``VLLM_SERVER_DEV_MODE=1``, as the weight-transfer routes): ``{"vllm_config":
    {..., "lora_config": null | {"max_lora_rank", "max_loras", "max_cpu_loras", ...}},
    "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": bool, ...}, "system_env": ...}``;
    ``lora_config`` is null without ``--enable-lora``.

    ``enabled``: ``lora_config`` is an object and ``vllm_env`` does not say that runtime
    updating is off (``/v1/load_lora_adapter`` would be a 404); ``flags["enabled"]`` then
    names what is missing. ``max_lora_rank``: ``--max-lora-rank``. ``max_loras`` is 0: vLLM
    refuses no load for room (see the module docstring), so there is nothing to check.
    A body in another shape (text config, no ``vllm_config``) is "not enabled", saying so.
    """
    flags = dict(VLLM_LORA_FLAGS)
    cfg = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    env = server_info.get("vllm_env") if isinstance(server_info, dict) else None
    if not isinstance(cfg, dict):
        what = ("no GET /server_info?config_format=json answer to read its LoRA limits from"
                if server_info is None else
                "a GET /server_info answer without a JSON vllm_config to read its LoRA limits "
                "from")
        flags["enabled"] = (f"{what}: start the vLLM server with the environment variables "
                            f"VLLM_SERVER_DEV_MODE=1 (for /server_info) and {RUNTIME_UPDATING} "
                            f"({RUNTIME_UPDATING_WHY}) and the flag --enable-lora")
        return LoraLimits(False, flags=tuple(flags.items()))
    lora = cfg.get("lora_config")
    runtime = _truthy(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")) if isinstance(
        env, dict) else None
    if not isinstance(lora, dict):
        if runtime is False:
            flags["enabled"] = (f"{START_WITH_ENABLE_LORA} and the environment variable "
                                f"{RUNTIME_UPDATING} ({RUNTIME_UPDATING_WHY})")
        else:
            flags["enabled"] = START_WITH_ENABLE_LORA
        return LoraLimits(False, flags=tuple(flags.items()))
    rank = _positive_int(lora.get("max_lora_rank"))
    if runtime is False:
        flags["enabled"] = START_WITH_RUNTIME_UPDATING
        return LoraLimits(False, 0, rank, tuple(flags.items()))
    return LoraLimits(True, 0, rank, tuple(flags.items()))


def config_max_rank(config: dict[str, Any]) -> int:
    """The largest LoRA rank of a PEFT config: ``r`` and every ``rank_pattern`` value, as
    vLLM 0.32 ``lora/peft_helper.py`` ``PEFTHelper.validate_legal`` compares with
    ``--max-lora-rank``."""
    ranks = [config.get("r")]
    pattern = config.get("rank_pattern")
    if isinstance(pattern, dict):
        ranks.extend(pattern.values())
    return max((r for r in ranks if isinstance(r, int) and not isinstance(r, bool)),
               default=0)


def refusal(plan: AdapterPlan, limits: LoraLimits | None = None) -> str:
    """Why a vLLM server (with ``limits``, if given) would refuse adapter ``plan``, or ''.

    The rules vLLM 0.32 applies when its workers read the folder, checked here before any
    engine call: ``PEFTHelper.from_dict`` (``r``, ``lora_alpha``, ``target_modules``
    required), ``PEFTHelper._validate_features`` / ``validate_legal`` (no ``bias`` other
    than ``"none"``, no DoRA, no ``lora_bias``, ``modules_to_save`` only ``classifier`` /
    ``score``, the largest of ``r`` and ``rank_pattern`` <= ``max_lora_rank``); and the
    dtypes the safetensors file can carry (:data:`SAFETENSORS_DTYPES`).
    """
    try:
        config = json.loads(plan.config_json)
    except ValueError as e:
        return f"adapter {plan.served_name}: config_json is not JSON: {e}"
    if not isinstance(config, dict):
        return f"adapter {plan.served_name}: config_json is not a JSON object"
    why: list[str] = []
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if missing:
        why.append(f"its adapter_config.json lacks {', '.join(missing)} (vLLM's PEFTHelper "
                   "requires them)")
    if config.get("bias", "none") != "none":
        why.append(f"bias={config.get('bias')!r}: vLLM supports no adapter bias")
    if config.get("use_dora"):
        why.append("use_dora: vLLM does not support DoRA")
    if config.get("lora_bias"):
        why.append("lora_bias: vLLM does not support LoRA bias")
    extra = [m for m in config.get("modules_to_save") or () if m not in ("classifier", "score")]
    if extra:
        why.append(f"modules_to_save {extra}: vLLM takes only classifier / score")
    rank = config_max_rank(config)
    if limits is not None and limits.max_lora_rank and rank > limits.max_lora_rank:
        fits = next((r for r in MAX_LORA_RANKS if r >= rank), None)
        why.append(f"its LoRA rank {rank} is above the server's max_lora_rank "
                   f"{limits.max_lora_rank} (" + (
                       f"restart the vLLM server with --max-lora-rank {fits}, the smallest of "
                       f"the values it takes ({', '.join(map(str, MAX_LORA_RANKS))}) that "
                       f"holds rank {rank}" if fits else
                       f"vLLM 0.32 serves ranks up to --max-lora-rank {MAX_LORA_RANKS[-1]}: "
                       "train the adapter at a lower rank") + ")")
    odd = sorted({t.dtype for t in plan.tensors if t.dtype not in SAFETENSORS_DTYPES})
    if odd:
        why.append(f"dtypes {odd} have no safetensors name vLLM reads back")
    if not why:
        return ""
    return f"vLLM cannot load adapter {plan.served_name}: " + "; ".join(why)


# -- the folder ---------------------------------------------------------------------------


def _tensor_nbytes(t: AdapterTensorPlan) -> int:
    n = DTYPE_SIZES[t.dtype]
    for d in t.shape:
        n *= d
    return n


def safetensors_header(plan: AdapterPlan) -> bytes:
    """The first bytes of ``adapter_model.safetensors`` for ``plan``: an 8-byte
    little-endian length N, then N bytes of JSON ``{"__metadata__": {"format": "pt"},
    name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}`` (offsets from the end of
    the header, the tensors back to back in plan order), padded with spaces to a multiple of
    8 bytes as the safetensors writer pads it.

    Raises:
        ValueError: a dtype without a safetensors name, or a tensor whose parts do not add
            up to its shape.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for t in plan.tensors:
        dtype = SAFETENSORS_DTYPES.get(t.dtype)
        if dtype is None:
            raise ValueError(f"adapter tensor {t.name!r}: dtype {t.dtype} has no safetensors "
                             "name vLLM reads back")
        n = _tensor_nbytes(t)
        if n != t.nbytes:
            raise ValueError(f"adapter tensor {t.name!r}: its parts hold {t.nbytes} bytes, "
                             f"its shape {list(t.shape)} of {t.dtype} {n}")
        header[t.name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


Take = Callable[[int, Path, bytes], str]
"""``take(rank, dest, header)``: hard-link that rank's part as the file ``dest``, if its
segment is exactly ``header`` followed by the part and sealed (the service's
``adapter_io.PartReader.take`` says what it checks); returns '' once linked, else why not
(then nothing was made at ``dest``)."""


def linkable(plan: AdapterPlan) -> tuple[int, bytes] | None:
    """``(rank, header)`` when one rank holds every tensor of ``plan`` whole, in an order
    whose part offsets are those of a safetensors file (``wire.adapter.file_header``, which
    gives ``header``): that rank's segment may then be the folder's
    ``adapter_model.safetensors`` itself. None otherwise (several holders, a tensor in rows,
    padding between tensors, a dtype safetensors cannot name)."""
    holders = {p.rank for t in plan.tensors for p in t.parts}
    if len(holders) != 1 or any(t.whole is None for t in plan.tensors):
        return None
    order = sorted(plan.tensors, key=lambda t: t.parts[0].offset)
    header = file_header([(t.name, t.dtype, t.shape) for t in order])
    if header is None:
        return None
    at = 0
    for t in order:
        if t.parts[0].offset != at:
            return None
        at += t.parts[0].nbytes
    return holders.pop(), header


def _check_length(tensor: str, rank: int, data: bytes | memoryview, nbytes: int
                  ) -> memoryview:
    view = memoryview(data).cast("B")
    if view.nbytes != nbytes:
        raise AdapterDataError(tensor, rank, f"read {view.nbytes} bytes, its part has {nbytes}")
    return view


def _sha256(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()  # (hashlib releases the GIL: threads hash at once)


def _copy_parts(out: Any, plan: AdapterPlan,
                read: Callable[[int, int, int], bytes | memoryview]) -> None:
    """Write every part of ``plan`` to ``out`` in order, in :data:`COPY_SLICE` slices, while
    a pool of threads takes each part's sha256; every digest is compared before this
    returns.

    Raises:
        AdapterDataError: a part's length, or its sha256 (the first in plan order).
    """
    parts = [(t.name, p) for t in plan.tensors for p in t.parts]
    workers = max(1, min(HASH_THREADS, os.cpu_count() or 1, len(parts)))
    with ThreadPoolExecutor(workers, thread_name_prefix="slotsync-sha256") as pool:
        hashed = []
        for name, p in parts:
            view = _check_length(name, p.rank, read(p.rank, p.offset, p.nbytes), p.nbytes)
            hashed.append(pool.submit(_sha256, view))
            for at in range(0, p.nbytes, COPY_SLICE):
                out.write(view[at:at + COPY_SLICE])
        for (name, p), fut in zip(parts, hashed, strict=True):
            got = fut.result()
            if got != p.sha256:
                raise AdapterDataError(name, p.rank, f"its bytes hash to sha256 {got}, the "
                                       f"rank sent {p.sha256} (its memory changed or was read "
                                       "wrong)")


def write_adapter_folder(root: Path, plan: AdapterPlan,
                         read: Callable[[int, int, int], bytes | memoryview],
                         take: Take | None = None) -> Path:
    """Write version ``plan.version`` of the adapter as the folder vLLM loads:
    ``<root>/<served_name>/adapter_config.json`` (``plan.config_json`` as the ranks sent it)
    and ``adapter_model.safetensors``. Everything is made in a temp folder in ``root``
    (:data:`TEMP_PREFIX`), then ``os.rename``\\ d to its name: a reader sees the whole folder
    or none. On any error the temp folder is removed.

    A folder of that name already there is replaced: the kept folder of a version the engine
    lost, published again (``slotsync status``: "publish that version again"; the core
    writes only a version the engine does not serve, ``gather.version_refusal``). The old
    one is renamed aside (a temp name, :func:`remove_stale_temp`'s after a crash), the new
    one renamed in, then the old one removed: the name never holds a partly written folder.

    The safetensors file, one of two ways:

    * **linked**: when one rank holds every tensor whole in a file's layout
      (:func:`linkable`) and ``take`` links that rank's segment as the file (it checks that
      the segment starts with exactly the header :func:`linkable` expects and that nobody
      can write it any more: ``adapter_io.PartReader.take``). No byte is copied or hashed
      here: the segment is the bytes the rank hashed, sealed before it was handed over.
    * **copied** otherwise (or when ``take`` says why not): :func:`safetensors_header`, then
      each tensor's bytes, its parts in row order, each from ``read(rank, offset, nbytes)``
      (the bytes of ``nbytes`` at ``offset`` of that rank's ``AdapterData`` handle); each
      part's sha256 is checked (by :data:`HASH_THREADS` threads while the bytes are written)
      before the folder gets its name.

    Returns:
        The folder (``root / plan.served_name``), the ``lora_path`` of :func:`load_body`.

    Raises:
        AdapterDataError: a copied part's bytes have another sha256 or length than its rank
            said (names the tensor and the rank).
        ValueError: see :func:`safetensors_header`.
        OSError: the files cannot be written (``root`` missing, no space).
    """
    root = Path(root)
    final = root / plan.served_name
    one = linkable(plan) if take is not None else None
    header = safetensors_header(plan) if one is None else b""  # (checks the plan first)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{plan.served_name}.", dir=root))
    try:
        (tmp / CONFIG_FILE).write_text(plan.config_json, encoding="utf-8")
        if one is None or take is None or take(one[0], tmp / TENSORS_FILE, one[1]):
            with open(tmp / TENSORS_FILE, "wb") as out:
                out.write(header or safetensors_header(plan))
                _copy_parts(out, plan, read)
        os.chmod(tmp, 0o755)  # (mkdtemp's 0700: a server run as another user reads it too)
        old = _set_aside(root, final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _set_aside(root: Path, final: Path) -> Path | None:
    """Rename an existing ``final`` (a lost version's kept folder, published again) to a
    temp name in ``root``; returns it (None: nothing there)."""
    if not os.path.lexists(final):
        return None
    old = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{final.name}.old.", dir=root))
    os.rename(final, old)  # (onto the empty folder just made: rename(2) replaces it)
    return old


def remove_adapter_folder(root: Path, served_name: str) -> bool:
    """Remove ``<root>/<served_name>`` (call it once no engine may read it again: see the
    module docstring); returns whether it was there."""
    folder = Path(root) / served_name
    if not folder.exists():
        return False
    shutil.rmtree(folder)
    return True


def remove_stale_temp(root: Path) -> list[str]:
    """Remove the temp folders a daemon killed mid-write left in ``root`` (names starting
    with :data:`TEMP_PREFIX`); returns their names. For the daemon's start, before any
    round writes."""
    root = Path(root)
    gone = []
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        if entry.name.startswith(TEMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


# -- the routes' bodies and answers ---------------------------------------------------------


def load_body(served_name: str, folder: Path | str) -> dict[str, Any]:
    """``POST /v1/load_lora_adapter``'s body (vLLM 0.32 ``serve/lora/protocol.py``
    ``LoadLoRAAdapterRequest``): the versioned name, the folder's absolute path, never in
    place (see the module docstring)."""
    return {"lora_name": served_name, "lora_path": os.path.abspath(folder),
            "load_inplace": False}


def unload_body(served_name: str) -> dict[str, Any]:
    """``POST /v1/unload_lora_adapter``'s body (``UnloadLoRAAdapterRequest``)."""
    return {"lora_name": served_name}


def served_adapters(models_json: Any) -> set[str]:
    """The adapters a vLLM server lists in ``GET /v1/models`` (parsed JSON): vLLM 0.32
    ``OpenAIServingModels.show_available_models`` lists the base models (``parent``: null)
    then one card per loaded adapter (``id``: its ``lora_name``, ``root``: its path,
    ``parent``: the base model's name). Anything else in the body is ignored."""
    data = models_json.get("data") if isinstance(models_json, dict) else None
    return {c["id"] for c in data or () if isinstance(c, dict)
            and isinstance(c.get("id"), str) and c.get("parent") is not None}


def adapter_roots(models_json: Any) -> dict[str, str]:
    """Each listed adapter's folder in ``GET /v1/models`` (parsed JSON): vLLM 0.32
    ``OpenAIServingModels.show_available_models`` gives each adapter card's ``root`` as its
    ``LoRARequest.path``, the ``lora_path`` it was loaded from (served name -> folder; a card
    without a text ``root`` is left out)."""
    data = models_json.get("data") if isinstance(models_json, dict) else None
    return {c["id"]: c["root"] for c in data or () if isinstance(c, dict)
            and isinstance(c.get("id"), str) and c.get("parent") is not None
            and isinstance(c.get("root"), str)}


def load_error_text(status: int, message: str) -> str:
    """What a failed ``/v1/load_lora_adapter`` (HTTP ``status``, the engine's ``message``)
    means, for the round's error: a 404 whose text is FastAPI's ``Not Found`` is the route
    missing (the server runs without :data:`RUNTIME_UPDATING`); a 404 from vLLM's handler
    is the folder missing (``LoRAAdapterNotFoundError``); a 400 a request vLLM refused
    (e.g. the name loaded already); a 500 a worker that could not load the folder
    (``PEFTHelper`` / ``LoRAModel`` errors, LoRA not enabled)."""
    if status == 404 and message.strip() in ("Not Found", ""):
        return (f"vLLM has no /v1/load_lora_adapter (HTTP 404): {START_WITH_RUNTIME_UPDATING}, "
                "and the flag --enable-lora")
    if status == 404:
        return f"vLLM found no adapter folder (HTTP 404): {message}"
    if "--enable-lora" in message or "LoRA is not enabled" in message:
        return f"vLLM runs without LoRA (HTTP {status}): {START_WITH_ENABLE_LORA}: {message}"
    return f"vLLM refused the adapter (HTTP {status}): {message}"

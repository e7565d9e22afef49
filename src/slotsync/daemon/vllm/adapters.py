"""vLLM's LoRA adapters (issue 36 C), minimal: the core helper's stand-in with the signatures
the vLLM helper's module has (the lead merges that one over this). Pure functions but the
folder's write and removal.

vLLM 0.32 loads an adapter only from a folder (``POST /v1/load_lora_adapter {"lora_name",
"lora_path", "load_inplace"}``, ``entrypoints/serve/lora/api_router.py``, attached with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; the worker reads it with ``PEFTHelper.from_local_dir``
and ``LoRAModel.from_local_checkpoint``, ``vllm/lora/worker_manager.py`` ``_load_adapter``):
the daemon writes ``adapter_config.json`` and ``adapter_model.safetensors`` (safetensors
written without torch) into a temp folder, then renames it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotsync.daemon.core.adapters.plan import AdapterPlan, LoraLimits

VLLM_LORA_FLAGS: tuple[tuple[str, str], ...] = (
    ("enabled", "--enable-lora (and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment)"),
    ("max_loras", "--max-loras"),
    ("max_lora_rank", "--max-lora-rank"),
)
"""``LoraLimits.flags`` of a vLLM server."""

_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
              "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
              "bool": "BOOL"}


class AdapterDataError(ValueError):
    """A rank's bytes are not what its ``AdapterBegin`` said (``tensor``, ``rank``)."""

    def __init__(self, tensor: str, rank: int, message: str) -> None:
        super().__init__(f"adapter tensor {tensor!r}, rank {rank}: {message}")
        self.tensor, self.rank = tensor, rank


def lora_limits(server_info: Any) -> LoraLimits:
    """What the server whose dev-mode ``GET /server_info?config_format=json`` answered
    ``server_info`` can hold: ``vllm_config.lora_config`` null without ``--enable-lora``
    (vLLM 0.32 ``serve/dev/server_info/api_router.py``); None (no dev mode): not enabled."""
    cfg = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    lora = cfg.get("lora_config") if isinstance(cfg, dict) else None
    if not isinstance(lora, dict):
        return LoraLimits(False, flags=VLLM_LORA_FLAGS)
    rank = lora.get("max_lora_rank")
    return LoraLimits(True, 0, rank if isinstance(rank, int) else 0, VLLM_LORA_FLAGS)


def refusal(plan: AdapterPlan, limits: LoraLimits | None = None) -> str:
    """Why vLLM cannot load ``plan``, or '': a dtype safetensors has no name for."""
    odd = sorted({t.dtype for t in plan.tensors if t.dtype not in _ST_DTYPES})
    return (f"vLLM cannot load adapter {plan.served_name}: dtypes {odd} have no safetensors "
            "name" if odd else "")


def write_adapter_folder(root: Path, plan: AdapterPlan,
                         read: Callable[[int, int, int], bytes | memoryview]) -> Path:
    """Write ``<root>/<served_name>/`` (``adapter_config.json``, ``adapter_model.safetensors``)
    from the ranks' parts (``read(rank, offset, nbytes)``), into a temp folder of ``root``
    renamed at the end; returns the folder.

    Raises:
        AdapterDataError: a part's bytes do not match its sha256.
        OSError: the folder cannot be written.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {}
    at = 0
    for t in plan.tensors:
        header[t.name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=root))
    try:
        with open(tmp / "adapter_model.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for t in plan.tensors:
                for p in t.parts:
                    data = read(p.rank, p.offset, p.nbytes)
                    if hashlib.sha256(data).hexdigest() != p.sha256:
                        raise AdapterDataError(t.name, p.rank, "its bytes do not match the "
                                               "sha256 its AdapterBegin gave")
                    f.write(data)
        (tmp / "adapter_config.json").write_text(plan.config_json)
        final = root / plan.served_name
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def remove_adapter_folder(root: Path, served_name: str) -> bool:
    """Remove ``<root>/<served_name>``; returns whether it was there."""
    folder = Path(root) / served_name
    if not folder.exists():
        return False
    shutil.rmtree(folder)
    return True


def load_body(served_name: str, folder: Path | str) -> dict[str, Any]:
    """``POST /v1/load_lora_adapter``'s body (``LoadLoRAAdapterRequest``), never in place."""
    return {"lora_name": served_name, "lora_path": os.path.abspath(folder),
            "load_inplace": False}


def unload_body(served_name: str) -> dict[str, Any]:
    """``POST /v1/unload_lora_adapter``'s body (``UnloadLoRAAdapterRequest``)."""
    return {"lora_name": served_name}


def served_adapters(models_json: Any) -> set[str]:
    """The adapters in ``GET /v1/models`` (cards with a ``parent``: vLLM 0.32
    ``OpenAIServingModels.show_available_models``)."""
    data = models_json.get("data") if isinstance(models_json, dict) else None
    return {c["id"] for c in data or () if isinstance(c, dict)
            and isinstance(c.get("id"), str) and c.get("parent") is not None}

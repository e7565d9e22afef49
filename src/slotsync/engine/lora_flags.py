"""The LoRA options of ``python -m slotsync.engine`` (issue 36), as ``vllm serve`` spells them:
``--enable-lora``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``; and whether the
server has vLLM's runtime adapter routes (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

vLLM 0.32 ``config/lora.py`` ``LoRAConfig``: ``max_lora_rank`` one of 1, 8, 16, 32, 64, 128,
256, 320, 512 (default 16), ``max_loras`` >= 1 (default 1: adapters in one batch),
``max_cpu_loras`` >= ``max_loras`` (default: ``max_loras``; the workers' adapter cache).
``entrypoints/serve/lora/api_router.py`` ``attach_router``: ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` exist only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is ``1`` or
``true``. The engines of this package stand in for a server launched with it (as with
``VLLM_SERVER_DEV_MODE=1``): unset means on; ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=0`` in the
engine's environment leaves the routes out (a 404), as vLLM does.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoraOptions:
    """A server's LoRA settings: ``enabled`` (``--enable-lora``), ``max_loras``,
    ``max_lora_rank``, ``max_cpu_loras`` (the workers' cache, LRU), ``runtime_updating``
    (the load / unload routes exist)."""

    enabled: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    runtime_updating: bool = True

    def lora_config(self) -> dict[str, Any] | None:
        """``vllm_config.lora_config`` as vLLM 0.32's ``/server_info?config_format=json``
        dumps a ``LoRAConfig`` (its fields and defaults; ``lora_dtype`` as the base model's
        dtype it resolved to), or None without ``--enable-lora``."""
        if not self.enabled:
            return None
        return {"max_lora_rank": self.max_lora_rank, "max_loras": self.max_loras,
                "fully_sharded_loras": False, "max_cpu_loras": self.max_cpu_loras,
                "lora_dtype": "auto", "target_modules": None, "default_mm_loras": None,
                "enable_tower_connector_lora": False, "specialize_active_lora": False,
                "enable_mixed_moe_lora_format": False, "enable_moe_shared_loras": False,
                "max_lora_cls_labels": None}


def runtime_updating(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the engine serves vLLM's runtime adapter routes: ``$VLLM_ALLOW_RUNTIME_
    LORA_UPDATING`` as vLLM reads it (``1`` / ``true``), on when unset (module docstring)."""
    value = (os.environ if environ is None else environ).get(RUNTIME_ENV)
    return value is None or value.strip().lower() in ("1", "true")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The LoRA options, in their own group."""
    g = p.add_argument_group("LoRA adapters (issue 36; vLLM's flags, --impl reference | vllm)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (vLLM's --enable-lora): /v1/load_lora_adapter, "
                   "/v1/unload_lora_adapter, adapters in /v1/models and /server_info's "
                   f"lora_config; {RUNTIME_ENV}=0 in the environment leaves the two "
                   "routes out, as vLLM without it")
    g.add_argument("--max-loras", type=int, default=None,
                   help="adapters in one batch (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=None,
                   help="largest LoRA rank loaded (default 16; one of "
                   + ", ".join(str(r) for r in MAX_LORA_RANKS) + ")")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters the workers cache (default --max-loras); one more evicts "
                   "the least recently used, read again from its folder when asked for")


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None
              ) -> LoraOptions:
    """The options of parsed ``args``.

    Raises:
        ValueError: a limit given without ``--enable-lora``, a rank vLLM does not take,
            ``--max-loras`` < 1 or ``--max-cpu-loras`` < ``--max-loras`` (vLLM's own checks).
    """
    given = [f for f in ("max_loras", "max_lora_rank", "max_cpu_loras")
             if getattr(args, f, None) is not None]
    if not getattr(args, "enable_lora", False):
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --enable-lora")
        return LoraOptions(runtime_updating=runtime_updating(environ))
    max_loras = args.max_loras if args.max_loras is not None else 1
    rank = args.max_lora_rank if args.max_lora_rank is not None else 16
    cpu = args.max_cpu_loras if args.max_cpu_loras is not None else max_loras
    if max_loras < 1:
        raise ValueError("--max-loras must be >= 1")
    if rank not in MAX_LORA_RANKS:
        raise ValueError(f"--max-lora-rank {rank}: vLLM takes one of {list(MAX_LORA_RANKS)}")
    if cpu < max_loras:
        raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras}).")
    return LoraOptions(True, max_loras, rank, cpu, runtime_updating(environ))

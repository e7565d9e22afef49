"""vLLM as an engine family (``core/family.py`` ``EngineFamily``; I/O-free): its begin steps'
bodies, what it refuses before the pause, how a chunk becomes its payload and when its memory
may go back (at the chunk's reply: ``/update_weights`` returns once the workers loaded it).

Its version and DP layout are read at the version stage (``slotsync.daemon.families``, with
``versions.py`` and ``dp_layout.py``); its HTTP calls are ``client.py``'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from slotsync.daemon.core.adapters.plan import AdapterPlan, LoraLimits
from slotsync.daemon.core.aggregation import MergedChunk
from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.family import MergeFacts
from slotsync.daemon.core.update import Update, stale_draft_refusal
from slotsync.daemon.vllm import adapters as vllm_adapters
from slotsync.daemon.vllm import versions as vllm_versions
from slotsync.daemon.vllm.merge import merge_chunk, merge_rank_local
from slotsync.protocol.wire import Chunk


def draft_refusal(u: Update, engine: EngineSession) -> str:
    """Why update ``u`` must not pause the engine for its draft part (issue 18), or '':
    an engine whose vLLM has no draft sessions, or a round without a draft part while the
    engine's draft model needs a full update (``update.stale_draft_refusal``): vLLM would
    resume on a draft model that is half-loaded or stale, so the round must carry the draft
    model in full."""
    return VLLM.pause_refusal(u, engine, None) or stale_draft_refusal(u, engine)


class VllmAdapters:
    """vLLM's LoRA adapters (``core/family.py`` ``AdapterSupport``; issue 36 C): the ranks'
    parts go through the host (``"host"``: the daemon reads their shared-memory copies and
    writes the folder, ``adapters.write_adapter_folder``), loaded with
    ``/v1/load_lora_adapter`` under versioned names, listed by ``GET /v1/models``; a version
    a restarted engine lost is loaded again from its kept folder (``reloadable``)."""

    transport = "host"
    reloadable = True
    load_route, unload_route, list_route = "load_lora_adapter", "unload_lora_adapter", "models"

    def limits(self, answers: Mapping[str, Any]) -> LoraLimits:
        return vllm_adapters.lora_limits(answers.get("server_info"))

    def refusal(self, plan: AdapterPlan, answers: Mapping[str, Any] | None = None) -> str:
        limits = vllm_adapters.lora_limits(answers.get("server_info")) if answers else None
        return vllm_adapters.refusal(plan, limits)

    def served(self, listing: Any) -> set[str]:
        return vllm_adapters.served_adapters(listing)

    def roots(self, listing: Any) -> dict[str, str]:
        return vllm_adapters.adapter_roots(listing)

    def load_body(self, plan: AdapterPlan, folder: str, handles: Mapping[int, Any],
                  gpu_uuids: Mapping[int, str], tp_size: int,
                  engine_gpu_uuids: Sequence[str] | None = None) -> Any:
        return vllm_adapters.load_body(plan.served_name, folder)

    def proof(self, tp_size: int, engine: EngineSession) -> None:
        return None  # (the daemon read the ranks' memory itself, before the load)

    def unload_body(self, served_name: str) -> Any:
        return vllm_adapters.unload_body(served_name)

    def explain(self, error: str) -> str:
        """``adapters.load_error_text`` for an HTTP answer (a 404 without the route: set
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; LoRA off; vLLM's refusal), else ``error``."""
        m = re.search(r"HTTP (\d+): (.*)", error, re.S)
        return vllm_adapters.load_error_text(int(m[1]), m[2]) if m else error

    def absent(self, error: str) -> bool:
        """vLLM 0.32 ``OpenAIServingModels._check_unload_lora_adapter_request``: a 404 "cannot
        be found" (or the route missing: then nothing was ever loaded)."""
        return "HTTP 404" in error

    def already_loaded(self, error: str) -> bool:
        """``_check_load_lora_adapter_request``'s 400 "has already been loaded"."""
        return "has already been loaded" in error

    def write_files(self, root: Path, plan: AdapterPlan,
                    read: Callable[[int, int, int], bytes | memoryview],
                    take: Callable[[int, Path, bytes], str] | None = None) -> Path:
        return vllm_adapters.write_adapter_folder(root, plan, read, take)

    def remove_files(self, root: Path, served_name: str) -> None:
        vllm_adapters.remove_adapter_folder(root, served_name)


class VllmFamily:
    """vLLM's rules (``EngineFamily``)."""

    name = "vllm"
    display = "vLLM"
    pause_modes = False
    asks_draft_support = True  # (vLLM 0.32 Worker.supports_draft_weight_updates)
    reads_memory: frozenset[str] = frozenset()  # (a reply means the workers loaded it)
    adapters = VllmAdapters()  # (issue 36)

    def step_body(self, route: str, packed: bool | None) -> Any:
        """``/init_weight_transfer_engine``'s ``init_info`` (the packed mode) and the draft
        probe's dev-mode ``/collective_rpc`` method; None for the other steps."""
        if route == "init_weight_transfer_engine":
            return {"init_info": {"packed": packed}}
        if route == "draft_support":
            return {"method": "supports_draft_weight_updates"}
        return None

    def rank_local_refusal(self, u: Update, engine: EngineSession,
                           engine_url: str | None) -> str:
        # (the begin's version stage ran before this one: the version is known and supported)
        missing = vllm_versions.feature_missing(engine.vllm_version, "list_update_info")
        if missing:
            return (f"rank-local mode sends {engine_url} vLLM's list-form update_info (one entry "
                    f"per worker): {missing}")
        return ""

    def pause_refusal(self, u: Update, engine: EngineSession, engine_url: str | None) -> str:
        if u.draft:  # (the version stage ran before this one: the version is known)
            missing = vllm_versions.feature_missing(engine.vllm_version, "draft_sessions")
            if missing:
                return f"update {u.update_id} has a draft part: {missing}"
        return ""

    def session_open(self, error: str) -> bool:
        return "already active" in error  # (vLLM's 4xx for a second start)

    def fence(self, engine: EngineSession) -> None:
        return None

    def merge(self, index: int, got: Mapping[int, Chunk], facts: MergeFacts,
              u: Update | None) -> MergedChunk:
        """vLLM's ``update_info`` (``merge.merge_chunk``), or its list form for a rank-local
        update ``u`` (``merge.merge_rank_local``).

        Raises:
            ChunkMismatch: as ``merge_chunk`` / ``merge_rank_local``.
        """
        if u is not None and u.rank_local:
            return merge_rank_local(index, got, u.worker_of, facts.gpu_uuids, u.fill_handles,
                                    packed=facts.packed, transport=facts.transport,
                                    world_size=facts.world_size)
        return merge_chunk(index, got, {r: facts.gpu_uuids[r] for r in got},
                           packed=facts.packed, transport=facts.transport,
                           world_size=facts.world_size)

    def chunk_body(self, merged: MergedChunk) -> Any:
        # (the JSON text made at merge time, embedded as is by the client's encoder)
        return {"update_info": msgspec.Raw(merged.update_info_json)}


VLLM = VllmFamily()

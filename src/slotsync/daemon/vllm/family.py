"""vLLM as an engine family (``core/family.py`` ``EngineFamily``; I/O-free): its begin steps'
bodies, what it refuses before the pause, how a chunk becomes its payload and when its memory
may go back (at the chunk's reply: ``/update_weights`` returns once the workers loaded it).

Its version and DP layout are read at the version stage (``slotsync.daemon.families``, with
``versions.py`` and ``dp_layout.py``); its HTTP calls are ``client.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from slotsync.daemon.core.aggregation import MergedChunk
from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.family import MergeFacts
from slotsync.daemon.core.update import Update, stale_draft_refusal
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


class VllmFamily:
    """vLLM's rules (``EngineFamily``)."""

    name = "vllm"
    display = "vLLM"
    pause_modes = False
    asks_draft_support = True  # (vLLM 0.32 Worker.supports_draft_weight_updates)
    reads_memory: frozenset[str] = frozenset()  # (a reply means the workers loaded it)

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

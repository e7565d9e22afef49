"""SGLang as an engine family (``core/family.py`` ``EngineFamily``; I/O-free; issue 26): no
init, no draft or rank-local rounds, a chunk merged into the whole
``/update_weights_from_tensor`` body (``merge.py``), its memory given back only once a later
call proves its copies (``fence.py``), a failed update's errors held while a chunk call of it
is at SGLang. Its version and layout are read at the version stage
(``slotsync.daemon.families``, with ``versions.py``); each step's requests are ``routes.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from slotsync.daemon.core.adapters.plan import AdapterPlan, LoraLimits
from slotsync.daemon.core.aggregation import ChunkMismatch, MergedChunk
from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.family import MergeFacts
from slotsync.daemon.core.update import Update
from slotsync.daemon.sglang import adapters as sglang_adapters
from slotsync.daemon.sglang import fence as sglang_fence
from slotsync.daemon.sglang import merge as sglang_merge
from slotsync.daemon.sglang.routes import SESSION_OPEN
from slotsync.protocol.wire import Chunk


def sglang_refusal(u: Update, engine: EngineSession, engine_url: str | None) -> str:
    """Why update ``u`` must not pause an SGLang engine, or '': a draft part (SGLang loads a
    draft through ``selector "draft"``, not built yet: docs/sglang-contract.md 7.6) or
    rank-local mode (vLLM's workers only)."""
    if u.draft:
        return (f"update {u.update_id} has a draft part, but engine {engine_url} is SGLang: "
                "slotsyncd loads SGLang's draft model with its main weights only (selector "
                "\"all\"); publish without draft=")
    if u.rank_local:
        return (f"update {u.update_id} is rank-local (vLLM's expert-parallel mode), but "
                f"engine {engine_url} is SGLang, whose TP rank r reads rank r's entry: "
                "publish without rank_local")
    return ""


class SglangAdapters:
    """SGLang's LoRA adapters (``core/family.py`` ``AdapterSupport``; issue 36 B): the engine
    reads the ranks' memory (``"device"``) through ``/load_lora_adapter_from_tensors``'s
    per-TP-rank pickles (``adapters.load_body``), under versioned names (SGLang refuses a
    name loaded twice), listed by ``GET /v1/models``. The daemon holds no copy: a version a
    restarted engine lost is lost (``reloadable`` False)."""

    transport = "device"
    reloadable = False
    load_route, unload_route, list_route = "load_lora_adapter", "unload_lora_adapter", "models"

    @staticmethod
    def _info(answers: Mapping[str, Any]) -> Any:
        # (the version step is GET /server_info for an engine known as SGLang; server_info
        # carries it when the kind was asked: daemon/families.py)
        return answers.get("server_info") or answers.get("version")

    def limits(self, answers: Mapping[str, Any]) -> LoraLimits:
        return sglang_adapters.lora_limits(self._info(answers))

    def refusal(self, plan: AdapterPlan, answers: Mapping[str, Any] | None = None) -> str:
        return sglang_adapters.refusal(plan, self._info(answers) if answers else None)

    def served(self, listing: Any) -> set[str]:
        return sglang_adapters.served_adapters(listing)

    def roots(self, listing: Any) -> dict[str, str]:
        return sglang_adapters.adapter_roots(listing)

    def load_body(self, plan: AdapterPlan, folder: str, handles: Mapping[int, Any],
                  gpu_uuids: Mapping[int, str], tp_size: int,
                  engine_gpu_uuids: Sequence[str] | None = None) -> Any:
        return sglang_adapters.load_body(plan, handles, gpu_uuids, tp_size,
                                         engine_gpu_uuids=engine_gpu_uuids)

    def proof(self, tp_size: int, engine: EngineSession) -> tuple[str, Any] | None:
        """``/weights_checker`` hashing nothing, past a TP collective (``adapters.proving_body``:
        the load's reply proves TP rank 0's copies only)."""
        body = sglang_adapters.proving_body(tp_size, engine.sglang_version)
        return None if body is None else ("prove_adapter_copies", body)

    def unload_body(self, served_name: str) -> Any:
        return sglang_adapters.unload_body(served_name)

    def explain(self, error: str) -> str:
        return error  # (SGLang's own words: LoRAUpdateOutput.error_message)

    def absent(self, error: str) -> bool:
        """SGLang 0.5.23 ``LoRARegistry.unregister``: "LoRA with name ... does not exist"."""
        return "does not exist" in error

    def already_loaded(self, error: str) -> bool:
        return "already loaded" in error

    def write_files(self, root: Path, plan: AdapterPlan,
                    read: Callable[[int, int, int], bytes | memoryview],
                    take: Callable[[int, Path, bytes], str] | None = None) -> Path:
        raise NotImplementedError("SGLang reads the ranks' memory: no folder")

    def remove_files(self, root: Path, served_name: str) -> None:
        return None


class SglangFamily:
    """SGLang's rules (``EngineFamily``)."""

    name = "sglang"
    display = "SGLang"
    pause_modes = True  # (routes.PAUSE_MODES, the engine table's pause_mode)
    asks_draft_support = False  # (a draft part is refused at the pause: sglang_refusal)
    reads_memory = sglang_fence.PROVING_STEPS
    adapters = SglangAdapters()  # (issue 36)

    def step_body(self, route: str, packed: bool | None) -> Any:
        return None  # (SGLang needs no init: routes.STEP_ANSWERS)

    def rank_local_refusal(self, u: Update, engine: EngineSession,
                           engine_url: str | None) -> str:
        return sglang_refusal(u, engine, engine_url)

    def pause_refusal(self, u: Update, engine: EngineSession, engine_url: str | None) -> str:
        return sglang_refusal(u, engine, engine_url)

    def session_open(self, error: str) -> bool:
        return SESSION_OPEN in error

    def fence(self, engine: EngineSession) -> sglang_fence.Fence | None:
        """A fence where SGLang's replies prove only TP rank 0's copies (0.5.21+)."""
        return sglang_fence.Fence() if sglang_fence.needed(engine.sglang_version) else None

    def merge(self, index: int, got: Mapping[int, Chunk], facts: MergeFacts,
              u: Update | None) -> MergedChunk:
        """SGLang's body (``merge.merge_chunk``: entry i from the rank on TP rank i's GPU
        where the engine table declares the GPUs, ``merge.tp_order``).

        Raises:
            ChunkMismatch: a rank-local update (vLLM's mode), or as ``merge.merge_chunk``.
        """
        if u is not None and u.rank_local:
            raise ChunkMismatch(f"chunk {index}: rank-local mode is vLLM's (its workers "
                                "load their own ranks' tensors); SGLang has no such mode")
        return sglang_merge.merge_chunk(
            index, got, {r: facts.gpu_uuids[r] for r in got}, packed=facts.packed,
            transport=facts.transport, world_size=facts.world_size,
            engine_gpu_uuids=facts.engine_gpu_uuids)

    def chunk_body(self, merged: MergedChunk) -> Any:
        # (the whole /update_weights_from_tensor body, made at merge time: merge.py)
        return msgspec.Raw(merged.update_info_json)


SGLANG = SglangFamily()

"""Which engine a slot's URL serves -- vLLM or SGLang -- and whether the daemon speaks its
version (I/O-free rules; issue 26).

The engine table may declare ``kind`` (``config.EngineEntry``); else the first begin's
``version`` stage tells: it asks ``GET /version`` and ``GET /server_info?config_format=json``
together (``update.BEGIN_STAGES``). vLLM answers the first (``{"version": ...}``); SGLang has
no ``/version`` (404) and answers the second with its flat server arguments and ``"version"``
(SGLang 0.5.20-0.5.23 ``http_server.py`` ``get_server_info``; the unknown query parameter is
ignored), which vLLM's dev-mode ``/server_info`` never looks like (``{"vllm_config", ...}``).
The two answers arrive in either order:

    /version            /server_info            kind
    200 {"version"}     anything                vllm
    404                 SGLang's arguments      sglang (its version checked from them)
    404                 not SGLang's            refused: no version (vllm_versions.answer_refusal)

Once the kind is SGLang, the executor sends every step through ``sglang_client`` (where the
``version`` step is ``GET /server_info``). A declared kind the engine's answers contradict
is refused, naming both. Complete chunks wait, unmerged, until the kind is known
(``chunk_window.MergeFacts.kind``): vLLM's and SGLang's payloads differ.
"""

from __future__ import annotations

from typing import Any

from slotsync.daemon import sglang_versions
from slotsync.daemon.engine_session import EngineSession


def sglang_version_refusal(engine: EngineSession, info: Any, slot_size: int,
                           engine_url: str) -> str:
    """Take SGLang's ``/server_info`` answer ``info`` into ``engine`` (its kind, version):
    '' when the daemon can drive it, else the refusal, kept in ``engine.version_refused`` or
    ``engine.dp_layout_refused`` (the version stage runs again at every begin while one is
    set)."""
    engine.kind = "sglang"
    text = sglang_versions.version_of(info)
    refusal = sglang_versions.check_supported(text, engine_url)
    engine.version_refused = refusal
    engine.sglang_version = sglang_versions.parse(text) if not refusal else None
    if refusal:
        return refusal
    engine.dp_layout_refused = sglang_versions.layout_refusal(info, slot_size, engine_url)
    return engine.dp_layout_refused


def vllm_answered(engine: EngineSession, engine_url: str) -> str:
    """``GET /version`` answered as vLLM does: the kind is vLLM; '' or, when the table
    declared SGLang, the refusal naming both."""
    if engine.declared_kind == "sglang":
        return (f"engine {engine_url} is declared kind = \"sglang\" in the engine table, but "
                "it answers GET /version as vLLM does: fix the table's kind (or its url)")
    engine.kind = "vllm"
    return ""


def declared_sglang_but(engine: EngineSession, engine_url: str, answer: Any) -> str:
    """The table declares SGLang but ``GET /server_info`` gave no SGLang arguments: the
    refusal, naming what came back."""
    shown = (sorted(answer)[:6] if isinstance(answer, dict) else repr(answer)[:100])
    return (f"engine {engine_url} is declared kind = \"sglang\" in the engine table, but its "
            f"GET /server_info gave no SGLang server arguments (got {shown}): it is not an "
            "SGLang server (python -m sglang.launch_server) -- a vLLM one? Fix the table's "
            "kind or url, or leave kind out for the daemon to tell")


def declared_vllm_hint(engine: EngineSession, error: str) -> str:
    """What to add to a refusal for lack of ``GET /version`` when the table declares vLLM:
    SGLang has no ``/version`` (a 404), so the engine may be SGLang."""
    if engine.declared_kind == "vllm" and "HTTP 404" in error:
        return ("; the engine table declares kind = \"vllm\", but SGLang answers GET "
                "/version with 404: if it is SGLang, declare kind = \"sglang\" (or leave "
                "kind out for the daemon to tell)")
    return ""

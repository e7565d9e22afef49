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

from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.update import Update
from slotsync.daemon.sglang import versions as sglang_versions
from slotsync.daemon.vllm import versions as vllm_versions


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


def version_failure(engine: EngineSession, u: Update, error: str, engine_url: str,
                    server_info_out: bool) -> str:
    """``GET /version`` of update ``u`` answered ``error`` (an HTTP status): '' when the
    begin goes on -- asked while the kind was unknown, a 404 is SGLang's answer, and
    ``/server_info`` (``server_info_out``: still out; then ``u.version_404`` keeps the error
    for it) tells -- else the refusal (no version: the table above)."""
    if "HTTP 404" in error and u.kind_asked:
        if engine.kind == "sglang":
            return ""  # (its /server_info told already)
        if server_info_out:
            u.version_404 = error
            return ""
    if engine.kind == "sglang":
        return declared_sglang_but(engine, engine_url, error)
    return vllm_versions.answer_refusal(error, engine_url) + declared_vllm_hint(engine, error)


def sglang_answer(engine: EngineSession, u: Update, route: str, result: Any) -> bool:
    """Whether the version stage's answer ``result`` to ``route`` is SGLang's
    ``/server_info`` to take (``SlotCoordinator._sglang_known``): the version step of an
    engine known as SGLang (``SglangClient`` asks ``/server_info``), or ``/server_info``
    asked while the kind was unknown that looks like SGLang's."""
    if route == "version":
        return engine.kind == "sglang" and not u.kind_asked
    return (route == "server_info" and u.kind_asked and engine.kind != "vllm"
            and sglang_versions.looks_like_sglang(result))


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

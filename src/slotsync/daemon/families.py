"""The engine families the daemon drives -- vLLM and SGLang -- and the rules above them: which
engine a slot's URL serves, and whether the daemon speaks its version (I/O-free rules; issue 26;
the ``Families`` of ``core/family.py``, injected into ``core.slot_table.SlotTable``).

Layer ``(families)`` of the daemon (pyproject.toml): it may import ``daemon.vllm``,
``daemon.sglang`` and ``daemon.core``; the service imports it, the core never does.

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

Once the kind is SGLang, the executor sends every step through ``SglangClient`` (where the
``version`` step is ``GET /server_info``): ``client_for``. A declared kind the engine's answers
contradict is refused, naming both. Complete chunks wait, unmerged, until the kind is known
(``MergeFacts.family``): vLLM's and SGLang's payloads differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slotsync.daemon.core import slot_table
from slotsync.daemon.core.actions import SlotEvent
from slotsync.daemon.core.engine_session import EngineSession, key_refusal_words, key_refused
from slotsync.daemon.core.family import EngineFamily, VersionVerdict
from slotsync.daemon.core.update import Update
from slotsync.daemon.engine_http import EngineHttp
from slotsync.daemon.sglang import versions as sglang_versions
from slotsync.daemon.sglang.client import SglangClient
from slotsync.daemon.sglang.family import SGLANG
from slotsync.daemon.sglang.routes import Dialect
from slotsync.daemon.vllm import dp_layout
from slotsync.daemon.vllm import versions as vllm_versions
from slotsync.daemon.vllm.client import VllmClient
from slotsync.daemon.vllm.family import VLLM


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
    for it) tells -- else the refusal (no version: the table above; a 401 or 403: the
    engine wants an API key, named as such, issue 35)."""
    if key_refused(error):
        return key_refusal_words(error)  # (the client's own words: none sent, or wrong)
    if "HTTP 404" in error and u.kind_asked:
        if engine.kind == "sglang":
            return ""  # (its /server_info told already)
        if server_info_out:
            u.version_404 = error
            return ""
    if engine.kind == "sglang":
        if engine.declared_kind == "sglang":
            return declared_sglang_but(engine, engine_url, error)
        return sglang_versions.answer_refusal(error, engine_url)
    return vllm_versions.answer_refusal(error, engine_url) + declared_vllm_hint(engine, error)


def kind_doubt(engine: EngineSession, u: Update, engine_url: str, what: str) -> str:
    """Why the version stage's answer ``what`` (an error, or an answer unlike SGLang's
    arguments) says that the engine at ``engine_url`` is no longer of the kind the daemon
    took it for (issue 35: a vLLM engine replaced by an SGLang one at the same URL, or the
    other way), or '': only for a kind the engine told (the table's declared kind is refused
    as before) and asked with that kind's routes. vLLM always has ``GET /version``
    (``serve/instrumentator/basic.py``); SGLang always has ``GET /server_info`` with its
    arguments (``http_server.py`` L863, 0.5.23)."""
    if engine.declared_kind is not None or u.kind_asked or engine.kind is None:
        return ""
    if engine.kind == "vllm" and "HTTP 404" in what:
        return (f"engine {engine_url}, a vLLM server so far, answers GET /version with 404 "
                "(SGLang has no /version): another engine at its URL?")
    if engine.kind == "sglang" and ("HTTP 404" in what or what == "not SGLang's"):
        return (f"engine {engine_url}, an SGLang server so far, gave no SGLang server "
                "arguments at GET /server_info: another engine at its URL?")
    return ""


PROBE_ROUTES = ("get_world_size", "weight_info", "is_sleeping")
"""The probe stage's steps (``update.BEGIN_STAGES``), asked in the engine's kind."""


def probe_doubt(engine: EngineSession, route: str, ok: bool, result: Any, error: str,
                engine_url: str) -> str:
    """Why probe step ``route``'s answer says the engine may not be of the kind the daemon
    took it for (``Families.kind_in_doubt``), or '': a 404 (the kind's route is not there:
    vLLM 0.27+ and the reference engine have ``/get_world_size``, ``/weight_info`` and
    ``/is_sleeping``; SGLang ``/server_info`` and ``/model_info``), or a world size that is no
    number (SGLang's ``tp_size`` missing from a ``/server_info`` that is vLLM's)."""
    if route not in PROBE_ROUTES:
        return ""
    kind = "SGLang" if engine.kind == "sglang" else "vLLM"
    if not ok and "HTTP 404" in error:
        return (f"engine {engine_url} answers the {kind} probe {route} with 404: another "
                "engine at its URL?")
    if ok and route == "get_world_size":
        ws = result.get("world_size") if isinstance(result, dict) else None
        if not isinstance(ws, int) or isinstance(ws, bool):
            return (f"engine {engine_url} answers the {kind} probe get_world_size without "
                    f"a world size ({str(result)[:100]}): another engine at its URL?")
    return ""


def sglang_answer(engine: EngineSession, u: Update, route: str, result: Any) -> bool:
    """Whether the version stage's answer ``result`` to ``route`` is SGLang's
    ``/server_info`` to take (``Families._sglang_known``): the version step of an
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


def _version_refused(engine: EngineSession, text: str | None, refusal: str) -> VersionVerdict:
    """The engine's vLLM version is unsupported or unknown (``refusal`` says which): kept in
    ``engine`` (its version stage runs again at every begin), the update fails in its begin,
    before the pause (the version stages come first)."""
    engine.vllm_version, engine.version_refused = text, refusal
    return VersionVerdict(fail=refusal)


class Families:
    """vLLM and SGLang, as the coordinator asks them (``core/family.py`` ``Families``), and
    the engine client each needs (``client_for``, for the service's executor).

    Args:
        families: the families by kind; an engine of unknown kind is asked as the first is
            (vLLM: the table above).
    """

    def __init__(self, families: tuple[EngineFamily, ...] = (VLLM, SGLANG)) -> None:
        self.by_kind = {f.name: f for f in families}
        self.default = families[0]

    def of(self, engine: EngineSession) -> EngineFamily:
        return self.by_kind.get(engine.kind or "", self.default)

    def known(self, engine: EngineSession) -> EngineFamily | None:
        kind = engine.known_kind
        return None if kind is None else self.by_kind.get(kind)

    def version_answer(self, engine: EngineSession, u: Update, route: str, result: Any,
                       slot: tuple[int, int], size: int,
                       engine_url: str | None) -> VersionVerdict:
        """The version stage's ``route`` (``version`` or ``server_info``) answered ``result``
        (the table above): SGLang's ``/server_info``, vLLM's ``/version`` (its supported
        range), or vLLM's ``/server_info`` (its DP layout, ``dp_layout.py``)."""
        if sglang_answer(engine, u, route, result):
            return self._sglang_known(engine, u, result, slot, size, engine_url)
        if route == "version":
            text = vllm_versions.version_of(result)
            refusal = (vllm_versions.check_supported(text, engine_url or "the engine")
                       or vllm_answered(engine, engine_url or ""))
            if refusal:
                return _version_refused(engine, text if isinstance(text, str) else None,
                                        refusal)
            old, engine.vllm_version = engine.vllm_version, text
            engine.version_refused = ""
            events = [] if old is None or old == text else [SlotEvent(
                slot, "engine_vllm_version_changed", {
                    "engine": engine_url, "update_id": u.update_id, "vllm_version": text,
                    "before": old}, warning=False)]  # (an engine restarted with another vLLM)
            return VersionVerdict(events=events, merge=True)
        if route == "server_info" and engine.kind != "sglang":
            if u.version_404:  # (no /version and no SGLang: the table above)
                return _version_refused(engine, None, vllm_versions.answer_refusal(
                    u.version_404, engine_url or ""))
            # (a DP layout one endpoint cannot drive: daemon/vllm/dp_layout.py)
            if dp_layout.check(engine, result, engine_url or "the engine"):
                return VersionVerdict(fail=engine.dp_layout_refused)
        return VersionVerdict()

    def _sglang_known(self, engine: EngineSession, u: Update, info: Any,
                      slot: tuple[int, int], size: int,
                      engine_url: str | None) -> VersionVerdict:
        """The engine is SGLang and ``info`` its ``/server_info``: check its version and
        layout (before the pause), then merge the chunks that waited for the kind."""
        if not sglang_versions.looks_like_sglang(info):  # (declared SGLang, answered not)
            doubt = kind_doubt(engine, u, engine_url or "", "not SGLang's")
            verdict = _version_refused(engine, None, declared_sglang_but(
                engine, engine_url or "", info) if not doubt else doubt)
            verdict.recheck = doubt
            return verdict
        first = engine.sglang_version is None and engine.kind != "sglang"
        refusal = sglang_version_refusal(engine, info, size, engine_url or "the engine")
        if refusal:
            return VersionVerdict(fail=refusal)
        events = []
        if first and engine.declared_kind is None:
            events.append(SlotEvent(slot, "engine_kind_detected", {
                "engine": engine_url, "kind": "sglang",
                "sglang_version": engine.sglang_version}, warning=False))
        return VersionVerdict(events=events, merge=True)

    def version_failure(self, engine: EngineSession, u: Update, error: str,
                        engine_url: str | None, server_info_out: bool) -> VersionVerdict:
        """``GET /version`` answered an HTTP error (``version_failure`` above): go on (no
        ``fail``), or the refusal, kept in ``engine``."""
        refusal = version_failure(engine, u, error, engine_url or "", server_info_out)
        if not refusal:
            return VersionVerdict()
        verdict = _version_refused(engine, None, refusal)
        verdict.recheck = kind_doubt(engine, u, engine_url or "", error)
        return verdict

    def kind_in_doubt(self, engine: EngineSession, route: str, ok: bool, result: Any,
                      error: str, engine_url: str | None) -> str:
        """``probe_doubt`` above (``core/family.py``'s ``Families``)."""
        return probe_doubt(engine, route, ok, result, error, engine_url or "")

    def client_for(self, engine: EngineSession, url: str
                   ) -> tuple[str, Callable[..., EngineHttp]]:
        """``(key, client class)`` of ``engine``'s HTTP client at ``url``: ``SglangClient`` for
        an SGLang engine (issue 26), else ``VllmClient`` (an engine of unknown kind is asked
        as vLLM is); the executor keeps one client per key for the daemon's life."""
        if engine.kind == "sglang":
            return f"sglang+{url}", SglangClient
        return url, VllmClient

    async def call(self, client: EngineHttp, route: str, body: Any,
                   engine: EngineSession) -> Any:
        """Run step ``route`` with ``body`` on ``client`` (SGLang's in its dialect: the
        engine's SGLang version and pause mode).

        Raises:
            EngineError: as the client's ``call``.
        """
        if isinstance(client, SglangClient):
            return await client.call(route, body, Dialect(engine.sglang_version,
                                                          engine.pause_mode))
        return await client.call(route, body)


FAMILIES = Families()
"""The daemon's engine families: vLLM (an engine of unknown kind is asked as vLLM is) and
SGLang."""


class SlotTable(slot_table.SlotTable):
    """The core's ``SlotTable`` with the daemon's engine families (``FAMILIES``) unless
    ``families=`` names others (a test's own family)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("families", FAMILIES)
        super().__init__(*args, **kwargs)

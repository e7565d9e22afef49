"""Warm start (issue 27 C): the engine calls a slot's first begin would make before its pause,
made once every rank of the slot registered, while nothing else is in flight.

A slot's first update used to ask, inside its begin, the engine's version and server info
(``update.BEGIN_STAGES`` "version": ``vllm_versions.py``, ``dp_layout.py``) and then
``/init_weight_transfer_engine`` -- on vLLM a collective RPC through the engine core, which
waits behind the scheduler's step while the engine serves. None of them touches generation
(the begin makes them before the pause), so the daemon makes them as soon as the slot is
complete: the first round then starts at its per-round probe, as every later round does.

The rules (I/O-free; ``SlotCoordinator`` makes the calls as maintenance calls, so a begin that
arrives meanwhile waits for them, and applies the answers here):

* warm only an engine met for the first time: no version known, not initialised, not declared
  SGLang (SGLang has no init; its kind is told at the begin, ``engine_kind.py``), not
  mid-update, its replies not in doubt;
* ``GET /version`` and ``GET /server_info`` together; then, only if the version is supported
  and the data-parallel layout is not refused, ``/init_weight_transfer_engine``;
* any failure or refusal stops the warm start and leaves the engine's record as it was, except
  what the begin would have recorded itself (a refused layout; a failed init's doubt about the
  workers' replies): the first begin then asks again and refuses or fails as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slotsync.daemon import dp_layout, engine_kind, vllm_versions
from slotsync.daemon.engine_session import EngineSession

__all__ = ["WarmStart", "wanted"]

FIRST_CALLS = ("version", "server_info")
INIT = "init_weight_transfer_engine"


def wanted(engine: EngineSession) -> bool:
    """Whether ``engine`` (every rank registered, nothing in flight) gets a warm start."""
    return (engine.vllm_version is None and not engine.initialized
            and engine.kind != "sglang" and engine.declared_kind != "sglang"
            and not engine.mid_update and not engine.replies_suspect
            and engine.out_of_step is None)


@dataclass
class WarmStart:
    """One engine's warm start: which calls are out (``call id -> route``) and whether it ran.

    ``tried`` is set once it began: an engine gets one warm start per daemon (a failed one is
    not retried; the begin makes the same calls)."""

    tried: bool = False
    out: dict[int, str] = field(default_factory=dict)
    _answers: dict[str, tuple[bool, Any]] = field(default_factory=dict)

    def start(self, call_ids: dict[int, str]) -> None:
        """The first calls (``FIRST_CALLS``) went out with these ids."""
        self.tried = True
        self.out.update(call_ids)
        self._answers.clear()

    def answer(self, engine: EngineSession, engine_url: str, call_id: int, ok: bool,
               result: Any, error: str, size: int) -> str | None:
        """Apply call ``call_id``'s answer to ``engine``; returns the next route to call
        (``INIT``) once both first answers are in and allow it, else None."""
        route = self.out.pop(call_id)
        if route == INIT:
            if ok:
                engine.initialized = True
            else:
                engine.note_reply_trouble(route, error, size)
            return None
        self._answers[route] = (ok, result)
        if len(self._answers) < len(FIRST_CALLS):
            return None
        (v_ok, version), (s_ok, info) = (self._answers[r] for r in FIRST_CALLS)
        if not (v_ok and s_ok):
            return None
        text = vllm_versions.version_of(version)
        if not isinstance(text, str) or vllm_versions.check_supported(text, engine_url):
            return None  # (the begin asks again and refuses, naming the version)
        if engine_kind.vllm_answered(engine, engine_url):
            return None
        if dp_layout.check(engine, info, engine_url):
            return None  # (recorded: the begin asks again and refuses before the pause)
        engine.vllm_version, engine.version_refused = text, ""
        return INIT

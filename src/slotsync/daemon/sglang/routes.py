"""What each of the daemon's engine steps is in SGLang's HTTP API (I/O-free; issue 26).

The coordinator speaks one vocabulary of engine steps -- the keys of ``vllm/client.py``'s ``ROUTES``
(``pause``, ``start_weight_update``, ``update_weights``, ...) -- and reads their answers in the
shapes vLLM gives. For an SGLang engine each step becomes zero or more SGLang requests, sent one
after the other, and their answers one answer in that shape. This module is that table
(``plan``) and the answer's reading (``answer``); ``client.py``'s ``SglangClient`` only sends.

Rules (docs/sglang-contract.md 7.4; routes of SGLang 0.5.20 / 0.5.21 / 0.5.23,
``srt/entrypoints/http_server.py``)::

    step                  SGLang requests, in order                     answer read as
    version               GET /server_info                              the server's arguments
    server_info           (none: vLLM's DP layout; SGLang's is read at   None
                          the version step, sglang_versions.layout_refusal)
    get_world_size        GET /server_info                              {"world_size": tp_size}
    weight_info           GET /model_info                               {"weight_version": ...}
    is_sleeping           (none: SGLang reports no sleep or pause)      {"is_sleeping": false}
    is_paused             (none: ditto; a paused SGLang is resumed,     {"is_paused": true}
                          continue_generation is harmless when not)
    init_weight_transfer_engine  (none: SGLang needs no init)           {}
    pause                 POST /pause_generation {"mode": M}            {}
                          then, M abort: POST /flush_cache?timeout=T;
                          M retract where flushable: POST /flush_cache
                          (200, else 400; ``flush_path``)
    finish_recover        0.5.21+: POST /end_weight_update {}           {}
    start_weight_update   0.5.21+: POST /begin_weight_update            {}
                          {"selector": "all"}
    update_weights        POST /update_weights_from_tensor (the body    {}
                          the merge wrote, daemon/sglang/merge.py)
    finish_weight_update  0.5.21+: POST /end_weight_update {}, then     {}
                          POST /update_weight_version
                          {"new_version": v, "abort_all_requests": false}
    resume                POST /continue_generation {}                  {}
    prove_copies          POST /update_weights_from_tensor with one     {}
                          empty list per TP rank (daemon/sglang/fence.py: a
                          call past the TP barrier, loading nothing)
    load_lora_adapter     POST /load_lora_adapter_from_tensors (the     {}
                          body adapters.load_body wrote)
    unload_lora_adapter   POST /unload_lora_adapter {"lora_name"}       {}
                          (adapters.unload_body; never while paused in place)
    models                GET /v1/models                                the model list
                                                                        (adapters.served_adapters)
    prove_adapter_copies  POST /weights_checker (adapters.proving_body: {}
                          a collective over the TP ranks hashing nothing)

* The weight version goes in one ``/update_weight_version`` after the session ended (the
  weights finalized), never with a chunk, so ``/model_info`` never names a version whose
  weights are incomplete; ``abort_all_requests`` is sent false, as SGLang's default (true)
  would abort the requests an ``in_place`` or ``retract`` pause kept.
* ``/end_weight_update`` as ``finish_recover`` answers 400 "no weight-update session is open"
  when none is: that is what the step expects (``TOLERATED``).
* Every other step (vLLM's draft sessions, executor checks) has no SGLang meaning:
  ``plan`` raises ``NotAnSglangStep``, which the coordinator never lets happen (drafts are
  refused for SGLang engines before the pause).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotsync.daemon.sglang import versions as sglang_versions

PAUSE_MODES = ("in_place", "retract", "abort")
"""``POST /pause_generation``'s modes (io_struct ``PauseGenerationReqInput``, 0.5.20-0.5.23).
``in_place`` (the daemon's default) keeps running requests and their KV cache, computed with
the old weights, and needs no flush; ``retract`` sends running requests back to the queue
(their KV recomputed after the update) and flushes the radix cache where SGLang can (0.5.21+);
``abort`` aborts every request and flushes."""

FLUSH_TIMEOUT_S = 30.0
"""``/flush_cache``'s own wait for the scheduler to go idle after an ``abort`` pause, seconds
(``?timeout=``; ``flush_path``)."""


def flush_path(pause_mode: str) -> str:
    """The ``/flush_cache`` request after a pause in ``pause_mode`` (``abort`` or ``retract``),
    as SGLang's code allows each (0.5.20-0.5.23: ``SchedulerFlushWrapper.handle``,
    scheduler_components/flush_wrapper.py; ``Scheduler.flush_cache``, scheduler.py L5518,
    0.5.23):

    * ``retract``: no ``timeout``. The pause leaves the scheduler paused with the running
      requests moved to its waiting queue (``pause_generation``, L5817), where they stay
      until ``continue_generation`` (the loop only ingests while paused, L2034). The wrapper's
      waiting path (``timeout`` > 0) asks ``is_fully_idle()``, which counts that queue, so it
      can only time out ("Timed out waiting for idle state.", issue 35 item 11); with
      ``timeout`` 0 it calls ``flush_cache`` at once, whose rule is
      ``is_fully_idle(ignore_waiting=self._engine_paused)``: the retracted requests are
      ignored (0.5.21+; 0.5.20 counts them and is never flushed after a retract pause,
      ``Dialect.flushes``).
    * ``abort``: ``timeout=FLUSH_TIMEOUT_S``. The tokenizer aborts every request and never
      pauses the scheduler (tokenizer_manager.py L2267-2280), which retires the aborted
      requests over its next loop turns: the wrapper's wait for ``is_fully_idle()`` is what
      lets them drain.
    """
    if pause_mode == "retract":
        return "/flush_cache"
    return f"/flush_cache?timeout={FLUSH_TIMEOUT_S:g}"

NO_SESSION = "no weight-update session is open"
"""SGLang 0.5.21+'s 400 for ``/end_weight_update`` with no session open (scheduler
``weight_updater.py`` ``end_weight_update``)."""

SESSION_OPEN = "a weight-update session is already open"
"""SGLang 0.5.21+'s 400 for ``/begin_weight_update`` while one is open: someone (a daemon
that died mid-update) left it open; the coordinator ends it and begins once more, as for
vLLM's "already active"."""


EMPTY_UPDATE = b"\x80\x04]."
"""One TP rank's entry of an update that loads nothing: the pickle of ``[]`` (protocol 4, as
``normalize_serialized_named_tensor_payload`` requires a PROTO opcode first), read with
``load_format`` null as an empty list of (name, tensor): ``model.load_weights([])``. slime
sends empty entries for ranks with nothing (docs/sglang-contract.md 3.2)."""


ADMIN_OPTIONAL_PATHS = frozenset({
    "/pause_generation", "/continue_generation", "/flush_cache", "/begin_weight_update",
    "/end_weight_update", "/update_weights_from_tensor", "/update_weight_version",
    "/load_lora_adapter_from_tensors", "/unload_lora_adapter", "/weights_checker"})
"""The paths the daemon asks that SGLang marks ``@auth_level(AuthLevel.ADMIN_OPTIONAL)``
(0.5.23 ``srt/entrypoints/http_server.py``; ``tests/unit/test_engine_key_files.py`` reads them
there). SGLang's ``decide_request_auth`` (``srt/utils/auth.py``): such a route takes the admin
key when the server has one (``--admin-api-key``; the API key is then refused there), else
the API key when it has one; every other route (``/server_info``, ``/model_info``: NORMAL)
takes the API key when the server has one, and nothing else. ``/health*`` is always open."""


def key_for(path: str, api_key: str, admin_api_key: str) -> tuple[str, str]:
    """``(key, option)`` a request to ``path`` carries (``ADMIN_OPTIONAL_PATHS``' rule):
    the admin key, else the API key, on an admin-optional route; the API key on the
    others; ``('', '')`` for none. ``option`` names the engine table's file."""
    if path in ADMIN_OPTIONAL_PATHS and admin_api_key:
        return admin_api_key, "admin_api_key_file"
    return (api_key, "api_key_file") if api_key else ("", "")


def key_hint(path: str, option: str) -> str:
    """What else may be wrong when a request to ``path`` with the key of ``option`` was
    refused: the API key on an admin-optional route of a server that has an admin key."""
    if path in ADMIN_OPTIONAL_PATHS and option == "api_key_file":
        return ("or the server was started with --admin-api-key too, and this route then "
                "takes only the admin key: set admin_api_key_file")
    return ""


def key_wanted(path: str) -> str:
    """What to set when a request to ``path`` without a key was refused."""
    if path in ADMIN_OPTIONAL_PATHS:
        return ("admin_api_key_file (the server's --admin-api-key), or api_key_file where it "
                "has only --api-key")
    return "api_key_file (the server's --api-key)"


class NotAnSglangStep(ValueError):
    """The coordinator asked for a step SGLang has no counterpart of (a bug)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One SGLang HTTP request: ``method``, ``path`` (with query), JSON ``body`` (None: none),
    and ``tolerated``: a failure whose message holds this text counts as success."""

    method: str
    path: str
    body: Any = None
    tolerated: str = ""


@dataclass(frozen=True, slots=True)
class Dialect:
    """What the requests depend on: the engine's SGLang ``version`` (``/server_info``'s;
    None before the version step) and the configured ``pause_mode``."""

    version: str | None
    pause_mode: str = "in_place"

    @property
    def sessions(self) -> bool:
        return sglang_versions.has(self.version, "sessions")

    @property
    def flushes(self) -> bool:
        """The pause flushes the radix cache (``abort``, or ``retract`` where SGLang can
        flush with requests waiting: 0.5.21+)."""
        return self.pause_mode == "abort" or (
            self.pause_mode == "retract" and sglang_versions.has(self.version,
                                                                 "retract_flushable"))


STEP_ANSWERS: dict[str, Any] = {
    "server_info": None,
    "is_sleeping": {"is_sleeping": False},
    "is_paused": {"is_paused": True},
    "init_weight_transfer_engine": {},
}
"""Steps answered without a request (the table at the top)."""


ADAPTER_PATHS: dict[str, tuple[str, str]] = {
    "load_lora_adapter": ("POST", "/load_lora_adapter_from_tensors"),
    "unload_lora_adapter": ("POST", "/unload_lora_adapter"),
    "models": ("GET", "/v1/models"),
    "prove_adapter_copies": ("POST", "/weights_checker"),
}
"""The adapter round's steps (issue 36; ``daemon/sglang/adapters.py`` writes their bodies and
reads ``models``' answer): the method and path of each, the body sent as given."""


def plan(step: str, body: Any, dialect: Dialect) -> list[Request]:
    """The SGLang requests for the daemon's ``step`` with its vLLM-shaped ``body``, in order.

    Raises:
        NotAnSglangStep: ``step`` has no SGLang counterpart.
    """
    if step in STEP_ANSWERS:
        return []
    if step in ("version", "get_world_size"):
        return [Request("GET", "/server_info")]
    if step == "weight_info":
        return [Request("GET", "/model_info")]
    if step == "pause":
        out = [Request("POST", "/pause_generation", {"mode": dialect.pause_mode})]
        if dialect.flushes:
            out.append(Request("POST", flush_path(dialect.pause_mode)))
        return out
    if step == "finish_recover":
        return ([Request("POST", "/end_weight_update", {}, tolerated=NO_SESSION)]
                if dialect.sessions else [])
    if step == "start_weight_update":
        return ([Request("POST", "/begin_weight_update", {"selector": "all"})]
                if dialect.sessions else [])
    if step == "update_weights":
        return [Request("POST", "/update_weights_from_tensor", body)]
    if step == "finish_weight_update":
        version = body.get("weight_version") if isinstance(body, dict) else None
        out = [Request("POST", "/end_weight_update", {})] if dialect.sessions else []
        if isinstance(version, str):
            out.append(Request("POST", "/update_weight_version",
                               {"new_version": version, "abort_all_requests": False}))
        return out
    if step == "resume":
        return [Request("POST", "/continue_generation", {})]
    if step == "prove_copies":
        ranks = body.get("ranks", 0) if isinstance(body, dict) else 0
        return [Request("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [EMPTY_UPDATE] * ranks, "load_format": None,
            "flush_cache": False, "abort_all_requests": False})]
    if step in ADAPTER_PATHS:
        method, path = ADAPTER_PATHS[step]
        return [Request(method, path, body if method == "POST" else None)]
    raise NotAnSglangStep(f"the daemon step {step!r} has no SGLang counterpart")


def answer(step: str, replies: list[Any]) -> Any:
    """The vLLM-shaped answer of ``step`` from its requests' parsed ``replies`` (in order)."""
    if step in STEP_ANSWERS:
        return STEP_ANSWERS[step]
    last = replies[-1] if replies else None
    if step == "version":
        return last
    if step == "get_world_size":
        tp = last.get("tp_size") if isinstance(last, dict) else None
        return {"world_size": tp}
    if step == "weight_info":
        v = last.get("weight_version") if isinstance(last, dict) else None
        return {"weight_version": v}
    if step == "models":
        return last
    return {}

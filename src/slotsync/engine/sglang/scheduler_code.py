"""SGLang's own scheduler rules for the SGLang-code engine (``--impl sglang``; issue 35 item 11):
``SchedulerFlushWrapper`` (``srt/managers/scheduler_components/flush_wrapper.py``, the whole
class) and ``Scheduler.is_fully_idle``, ``Scheduler.flush_cache``,
``Scheduler.pause_generation`` and ``Scheduler._add_request_to_queue``
(``srt/managers/scheduler.py`` L5337, L5518, L5817, L3480 in 0.5.23), run over a
:class:`SchedulerView` of the engine's generation simulator.

Neither module imports on CPU (``io_struct.py`` pulls in torchvision, ``scheduler.py`` the
whole runtime), so, as ``tests/unit/test_sglang_pickle.py`` does with old wheels' ``common.py``,
the class and the four methods are cut out of the installed SGLang's source with ``ast`` (line
numbers kept: a traceback names SGLang's file and line) and compiled with the few globals they
use: ``FlushCacheReqInput`` / ``FlushCacheReqOutput`` (io_struct.py L1855-1861: plain
``timeout_s`` / ``success``, ``message`` structs), ``DisaggregationMode`` (its three values),
``retract_all`` (frees the requests' KV: there is none here), ``current_platform`` (its
``empty_cache``), ``logger``, ``logging`` and ``time``.

What the view stands for: the running batch and the waiting queue hold one :class:`ViewReq` per
simulated request (``SglangState.requests``' counts, loaded before and stored after each
call); the engine runs no batch (``last_batch`` and ``chunked_req`` None, no overlap, one
pipeline stage, no disaggregation, no HiCache, HiSparse or LMCache, no grammar queue), so
every other term of SGLang's idle rule holds as it does on an idle server of that layout. Of
``_add_request_to_queue`` the view answers the priority check (passes), the queued-request
limit (none) and the KV prefetch (none) -- the rest, the NULL-disaggregation append to the
waiting queue, is SGLang's.

The rules that matter here (issue 35 item 11): ``pause_generation(retract)`` moves the running
requests to the waiting queue, where they stay while paused (the loop only ingests,
scheduler.py L2034); ``flush_cache`` flushes when ``is_fully_idle(ignore_waiting=
self._engine_paused)``; but the wrapper's deferred path (``/flush_cache?timeout=T``, T > 0)
asks ``is_fully_idle()`` -- waiting requests counted -- so after a retract pause with
requests it never flushes and answers "Timed out waiting for idle state." at its deadline,
while T = 0 calls ``flush_cache`` at once and succeeds.

The version the engine poses as: the code is the installed SGLang's (0.5.23 in the project's
venv). For 0.5.20, whose ``is_fully_idle`` has no ``ignore_waiting`` and whose ``flush_cache``
calls ``is_fully_idle()`` (scheduler.py L4808, L4981-4983), the view's ``is_fully_idle`` drops
the argument (``retract_flushable`` false); the wrapper is the same code in all three (0.5.20
and 0.5.21 answer through ``ipc_channels.send_to_tokenizer`` instead of ``send_output``: both
signatures are served). Where the files are not there (``SLOTSYNC_SGLANG_SHIM``'s copy has
only the receive path) :func:`load` returns None and the engine keeps its mirror
(``state.py``); ``/_slotsync/stats`` says which (``scheduler_rules``).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
import time
import typing
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from slotsync.engine.sglang.state import SglangState

SCHEDULER_FILE = "srt/managers/scheduler.py"
WRAPPER_FILE = "srt/managers/scheduler_components/flush_wrapper.py"
METHODS = ("is_fully_idle", "flush_cache", "pause_generation", "_add_request_to_queue")
"""The ``Scheduler`` methods compiled from SGLang's source."""


class SglangCodeMissing(RuntimeError):
    """SGLang's source lacks a function this module compiles (a release not read)."""


class FlushCacheReqInput:
    """io_struct.py L1855 (0.5.23): ``timeout_s``."""

    def __init__(self, *, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s


class FlushCacheReqOutput:
    """io_struct.py L1859: ``success``, ``message``."""

    def __init__(self, *, success: bool, message: str = "") -> None:
        self.success, self.message = success, message


class DisaggregationMode(Enum):
    """``srt/disaggregation/utils.py`` L150: the three values."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


def _retract_all(*, reqs: list, **_pools: Any) -> None:
    """``schedule_batch.retract_all``: releases each request's KV; the view holds none."""


class ViewReq:
    """One simulated request as the compiled methods see it (``Req``'s fields they read)."""

    def __init__(self) -> None:
        self.kv = SimpleNamespace(holds_kv=False)  # (PD-decode only)
        self.time_stats = SimpleNamespace(set_wait_queue_entry_time=lambda: None,
                                          set_retract_time=lambda: None)
        self.storage_prefetch_retry_attempts = 0
        self.storage_prefetch_last_match_len = None
        self.staged_prefetch_plan = None
        self.arrival_processed_tokens = 0

    def finished(self) -> bool:
        return False


class _Batch:
    """``ScheduleBatch``: its requests."""

    def __init__(self) -> None:
        self.reqs: list[ViewReq] = []
        self.batch_is_full = False

    def is_empty(self) -> bool:
        return not self.reqs


def _noop(*_args: Any, **_kw: Any) -> None:
    return None


class SchedulerView:
    """The ``Scheduler`` attributes the compiled methods read, for one engine (module
    docstring). ``retract_flushable``: the posed version's ``is_fully_idle`` takes
    ``ignore_waiting`` (0.5.21+)."""

    def __init__(self, compiled: dict[str, Callable[..., Any]], retract_flushable: bool
                 ) -> None:
        self._compiled = compiled
        self._retract_flushable = retract_flushable
        self.running_batch = _Batch()
        self.waiting_queue: list[ViewReq] = []
        self.chunked_req = None
        self.last_batch = None
        self.cur_batch_for_debug = None
        self.enable_overlap = False
        self.enable_overlap_mlx = False
        self.result_queue: list = []
        self.disaggregation_mode = DisaggregationMode.NULL
        self.disagg_decode_prealloc_queue = None
        self.decode_offload_manager = None
        self.enable_hisparse = False
        self.enable_hierarchical_cache = False
        self.enable_lmcache = False
        self.hisparse_coordinator = None
        self.draft_worker = None
        self._engine_paused = False
        self._pause_started_at: float | None = None
        self.processed_tokens_counter = 0
        self.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
        self.grammar_manager = SimpleNamespace(grammar_queue=[], clear=_noop)
        self.tree_cache = SimpleNamespace(reset=_noop)
        self.req_to_token_pool = SimpleNamespace(clear=_noop, reset_aux_cache_allocator=_noop)
        self.token_to_kv_pool_allocator = SimpleNamespace(clear=_noop)
        self.metrics_reporter = SimpleNamespace(
            reset_metrics=_noop, is_stats_logging_rank=False, last_gen_throughput=0.0,
            current_scheduler_metrics_enabled=False)
        self.kv_events_publisher = SimpleNamespace(publish_kv_events=_noop)

    # what the view answers itself (module docstring)
    def _pp_microbatches_drained(self) -> bool:
        return True  # (one pipeline stage: get_parallel().pp_size == 1)

    def _set_or_validate_priority(self, req: ViewReq) -> bool:
        return True

    def _abort_on_queued_limit(self, req: ViewReq) -> bool:
        return False

    def _prefetch_kvcache(self, req: ViewReq) -> None:
        return None

    def _release_aborted_request(self, req: ViewReq) -> None:  # (never reached: see above)
        raise AssertionError("the view aborts no request")

    # SGLang's code
    def is_fully_idle(self, for_health_check: bool = False, ignore_waiting: bool = False
                      ) -> bool:
        if not self._retract_flushable:  # 0.5.20: is_fully_idle(for_health_check) only
            ignore_waiting = False
        return self._compiled["is_fully_idle"](self, for_health_check=for_health_check,
                                               ignore_waiting=ignore_waiting)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        return self._compiled["flush_cache"](self, empty_cache)

    def pause_generation(self, recv_req: Any) -> None:
        return self._compiled["pause_generation"](self, recv_req)

    def _add_request_to_queue(self, req: ViewReq, is_retracted: bool = False) -> None:
        return self._compiled["_add_request_to_queue"](self, req, is_retracted)

    # the simulator's counts
    def load(self, state: SglangState) -> None:
        """Take the simulator's running and waiting requests and the pause flag."""
        self.running_batch.reqs = [ViewReq() for _ in range(state.requests.running)]
        self.waiting_queue = [ViewReq() for _ in range(state.requests.waiting)]
        self._engine_paused = state.engine_paused

    def store(self, state: SglangState) -> None:
        """Give the simulator back what SGLang's code left."""
        state.requests.running = len(self.running_batch.reqs)
        state.requests.waiting = len(self.waiting_queue)
        state.engine_paused = self._engine_paused


def installed_root() -> Path | None:
    """The installed ``sglang`` package's folder (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _functions(path: Path, names: tuple[str, ...], cls: str | None,
               namespace: dict[str, Any]) -> dict[str, Any]:
    """``names`` (methods of class ``cls``, or top-level classes when ``cls`` is None) of the
    file at ``path``, compiled into ``namespace``; line numbers kept.

    Raises:
        SglangCodeMissing: a name is not there, or carries a decorator.
    """
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body
    if cls is not None:
        found = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls]
        if not found:
            raise SglangCodeMissing(f"{path}: no class {cls}")
        body = found[0].body
    nodes = {n.name: n for n in body
             if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names}
    for name in names:
        if name not in nodes:
            raise SglangCodeMissing(f"{path}: no {cls + '.' if cls else ''}{name} (an SGLang "
                                    "release whose scheduler was not read)")
        if isinstance(nodes[name], ast.FunctionDef) and nodes[name].decorator_list:
            raise SglangCodeMissing(f"{path}: {name} is decorated (not read)")
    module = ast.Module(body=[nodes[n] for n in names], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - SGLang's own source
    return {n: namespace[n] for n in names}


def load(root: Path | None = None) -> Callable[[SglangState], SglangSchedulerCode] | None:
    """Compile SGLang's scheduler rules from the installed SGLang (``root``: its package
    folder, default :func:`installed_root`); returns a factory of
    :class:`SglangSchedulerCode` per engine state, or None where the two source files are not
    there (the shim).

    Raises:
        SglangCodeMissing: the files are there without the functions (module docstring).
    """
    root = root or installed_root()
    if root is None or not (root / SCHEDULER_FILE).is_file() or not (
            root / WRAPPER_FILE).is_file():
        return None
    log = logging.getLogger("sglang.srt.managers.scheduler")
    namespace: dict[str, Any] = {
        "__name__": "sglang.srt.managers.scheduler", "logging": logging, "logger": log,
        "time": time, "DisaggregationMode": DisaggregationMode, "retract_all": _retract_all,
        "current_platform": SimpleNamespace(empty_cache=_noop), "Optional": typing.Optional,
        "Tuple": tuple, "Callable": Callable, "Any": Any,
        "FlushCacheReqInput": FlushCacheReqInput, "FlushCacheReqOutput": FlushCacheReqOutput,
        "__builtins__": __builtins__}
    methods = _functions(root / SCHEDULER_FILE, METHODS, "Scheduler", dict(namespace))
    wrapper = _functions(root / WRAPPER_FILE, ("SchedulerFlushWrapper",), None,
                         dict(namespace))["SchedulerFlushWrapper"]
    source = str(root / SCHEDULER_FILE)

    def make(state: SglangState) -> SglangSchedulerCode:
        return SglangSchedulerCode(state, methods, wrapper, source)

    return make


class SglangSchedulerCode:
    """One engine's SGLang scheduler rules (module docstring): the pause, the idle rule, the
    flush and the flush wrapper, over ``state``'s simulator. Made by :func:`load`."""

    origin = "sglang"

    def __init__(self, state: SglangState, methods: dict[str, Callable[..., Any]],
                 wrapper_cls: type, source: str) -> None:
        self.state = state
        self.source = source
        self.view = SchedulerView(methods, state.version.retract_flushable)
        self._answer: Callable[[bool, str], None] | None = None
        kw: dict[str, Any] = {"flush_cache": self._flush_cache,
                              "is_fully_idle": self._is_fully_idle}
        params = inspect.signature(wrapper_cls.__init__).parameters
        if "send_output" in params:  # 0.5.23
            kw["send_output"] = self._send_output
        else:  # 0.5.20 / 0.5.21: ipc_channels.send_to_tokenizer.send_output
            kw["ipc_channels"] = SimpleNamespace(send_to_tokenizer=SimpleNamespace(
                send_output=self._send_output))
        self.wrapper = wrapper_cls(**kw)

    def _is_fully_idle(self) -> bool:
        self.view.load(self.state)
        return self.view.is_fully_idle()

    def _flush_cache(self) -> bool:
        self.view.load(self.state)
        ok = bool(self.view.flush_cache())
        self.state.counts["flush_count" if ok else "flush_refused"] += 1
        return ok

    def _send_output(self, output: Any, _req: Any) -> None:
        answer, self._answer = self._answer, None
        if answer is not None:
            answer(bool(output.success), output.message or "")

    def pause(self, mode: str) -> None:
        """``Scheduler.pause_generation`` for ``mode`` (``in_place`` or ``retract``)."""
        self.view.load(self.state)
        self.view.pause_generation(SimpleNamespace(mode=mode))
        self.view.store(self.state)

    def flush(self, timeout: float, answer: Callable[[bool, str], None]
              ) -> tuple[bool, str] | None:
        """``SchedulerFlushWrapper.handle``: ``(success, message)`` now, or None when the
        flush waits (then ``answer`` is called by a later :meth:`check_pending`)."""
        out = self.wrapper.handle(FlushCacheReqInput(timeout_s=timeout))
        if out is None:
            self._answer = answer
            return None
        return bool(out.success), out.message or ""

    def pending(self) -> bool:
        """A deferred flush waits."""
        return self.wrapper._pending is not None

    def check_pending(self) -> None:
        """``SchedulerFlushWrapper.check_pending`` (the scheduler calls it every loop turn,
        scheduler.py L2261)."""
        self.wrapper.check_pending()

"""The SGLang engines' engine-level state, I/O-free: the per-version rules, the tokenizer's
and the scheduler's state, and a generation simulator (fake requests) for pause and flush.

Shared by both SGLang engines (``python -m slotsync.engine --impl sglang`` and
``--impl sglang-reference``); the HTTP front (``slotsync.engine.sglang.server``) asks these
methods what to do and does it. Paths are inside the SGLang wheel (``srt/...`` =
``sglang/srt/...``); line numbers "0.5.23 / 0.5.21 / 0.5.20" as in docs/sglang-contract.md.

Tokenizer side (``TokenizerManager``, one per server): ``is_pause`` (``pause_generation``
L2267 / L2140 / L2119 sets it; ``continue_generation`` L2282 / L2155 / L2134 clears it), the
weight version ``/model_info`` reports (``config_value("weight_version")``, set by
``_update_weight_version_if_provided``, tokenizer_control_mixin.py L1072 / L1047 / L938), and
``model_update_lock``: every generate request holds its reader side while it runs
(tokenizer_manager.py L939-941, 0.5.23); a weight call made while not paused takes the
writer side, i.e. waits for every running request (tokenizer_control_mixin.py L581-583).

Scheduler side (replicated on every TP rank in SGLang; kept once here): ``_engine_paused``,
the running batch and the waiting queue, the weight-update session
(``SchedulerWeightUpdaterManager._session``, scheduler_components/weight_updater.py L99 /
L100, 0.5.21+) and the weight version it records (``record_weight_version_change``,
scheduler.py L5636).

The generation simulator: requests are counts, not tokens. A request that arrives while the
tokenizer is paused waits there (``held``: ``is_pause_cond.wait_for``, holding no lock);
one that reaches a paused scheduler waits in its queue (the loop only ingests while paused,
scheduler.py L2034 / L2079); else it runs. Requests finish only when a test says so (and only
while the scheduler runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slotsync.engine.faults import FaultTable


@dataclass(frozen=True)
class SglangVersion:
    """What one SGLang version does differently (docs/sglang-contract.md section 1).

    Attributes:
        name: ``"0.5.20"``, ``"0.5.21"`` or ``"0.5.23"`` (``/server_info``'s ``version``).
        sessions: ``/begin_weight_update`` and ``/end_weight_update`` exist and
            ``/update_weights_from_tensor`` needs an open session (0.5.21+; absent in
            0.5.20, a 404).
        selector_field: the update's draft routing field is ``selector`` (0.5.21+), else
            ``disable_draft_model`` (io_struct.py L2045 / L1942 / L1859).
        flush_fails_softly: a refused flush after an update is a 400 (0.5.23,
            scheduler_components/weight_updater.py L120-133); else an ``assert`` in the
            scheduler, which kills the server (0.5.20 L104-109, 0.5.21 L117-122).
        retract_flushable: the flush ignores the waiting queue while the scheduler is
            paused (``is_fully_idle(ignore_waiting=self._engine_paused)``, scheduler.py
            L5518 / L5187; 0.5.20 ``is_fully_idle()`` L4983 counts it).
        frees_before_barrier: the received tensors die before the TP barrier (0.5.20:
            argument temporary of ``tp_worker.update_weights_from_tensor``, tp_worker.py
            L221-226); else after it (a local of the scheduler handler, weight_updater.py
            L241 / L226, barrier L262 / L245).
        dp_attention_resolves: the route's DP check is ``dp_size == 1`` and
            ``--dp-size N --enable-dp-attention`` resolves to ``attn_dp_size = N``,
            ``dp_size = 1`` (0.5.23: tokenizer_control_mixin.py L569-571,
            ``srt/arg_groups/fields/parallel.py`` L192-194); else the check is
            ``dp_size == 1 or enable_dp_attention`` (0.5.21 L565-567, 0.5.20 L513-515).
        frontend_field: ``/server_info`` has ``"frontend": "python"`` (0.5.21+,
            http_server.py L868).
        route_lines: the line of each route's decorator in ``srt/entrypoints/http_server.py``
            (named in validation errors, as FastAPI names the endpoint).
    """

    name: str
    sessions: bool
    selector_field: bool
    flush_fails_softly: bool
    retract_flushable: bool
    frees_before_barrier: bool
    dp_attention_resolves: bool
    frontend_field: bool
    route_lines: dict[str, int] = field(default_factory=dict)

    @property
    def dp_message(self) -> str:
        """The DP assertion's text (never sent: the route answers a bare 500)."""
        if self.dp_attention_resolves:
            return "data-parallel replicas are not supported for update weights from tensor"
        return ("dp_size must be 1 or dp attention must be enabled for update weights from "
                "tensor")


VERSIONS: dict[str, SglangVersion] = {
    "0.5.20": SglangVersion(
        "0.5.20", sessions=False, selector_field=False, flush_fails_softly=False,
        retract_flushable=False, frees_before_barrier=True, dp_attention_resolves=False,
        frontend_field=False,
        route_lines={"update_weights_from_tensor": 1395, "update_weight_version": 1456,
                     "pause_generation": 1710, "continue_generation": 1723,
                     "flush_cache": 990}),
    "0.5.21": SglangVersion(
        "0.5.21", sessions=True, selector_field=True, flush_fails_softly=False,
        retract_flushable=True, frees_before_barrier=False, dp_attention_resolves=False,
        frontend_field=True,
        route_lines={"update_weights_from_tensor": 1378, "begin_weight_update": 1400,
                     "end_weight_update": 1415, "update_weight_version": 1469,
                     "pause_generation": 1740, "continue_generation": 1753,
                     "flush_cache": 987}),
    "0.5.23": SglangVersion(
        "0.5.23", sessions=True, selector_field=True, flush_fails_softly=True,
        retract_flushable=True, frees_before_barrier=False, dp_attention_resolves=True,
        frontend_field=True,
        route_lines={"update_weights_from_tensor": 1436, "begin_weight_update": 1458,
                     "end_weight_update": 1473, "update_weight_version": 1527,
                     "pause_generation": 1831, "continue_generation": 1844,
                     "flush_cache": 1025}),
}
"""The versions the SGLang engines pose as (``--sglang-version``)."""

ADMIN_OPTIONAL_ROUTES = frozenset({
    "/pause_generation", "/continue_generation", "/begin_weight_update",
    "/end_weight_update", "/update_weights_from_tensor", "/update_weight_version",
    "/flush_cache", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
    "/weights_checker"})
"""Routes marked ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` in http_server.py (the admin key
when one is set, else the API key); every other route is ``NORMAL`` (the API key, when set)
and ``/health*`` is always open (``srt/utils/auth.py`` ``decide_request_auth``)."""

PAUSE_MODES = ("abort", "retract", "in_place")
"""``PauseGenerationReqInput.mode`` (io_struct.py L1946 / L1845 / L1762)."""

SESSION_REQUIRED = ("update_weights_from_tensor must run between begin_weight_update() and "
                    "end_weight_update()")
"""0.5.21+ scheduler_components/weight_updater.py L232-239 / L219-224."""
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
"""0.5.21+ weight_updater.py L309-315 / L290-296."""
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
"""0.5.21+ weight_updater.py L323-329 / L304-310."""
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are "
                 "still running or queued. Retract or finish them, then call /flush_cache.")
"""0.5.23 weight_updater.py L128-132 (400 of the update)."""
FLUSH_ASSERT = "Cache flush failed after updating weights"
"""0.5.20 / 0.5.21 weight_updater.py L109 / L122: an ``AssertionError`` in the scheduler."""
FLUSH_OK_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                 "running or waiting requests, the operation will not be performed.)\n")
"""``/flush_cache``'s 200 text (http_server.py L1025-1040, identical in all three)."""
FLUSH_FAILED_TEXT = "Flush cache failed.\n"
"""``/flush_cache``'s 400 text when the scheduler gives no message."""
FLUSH_BUSY = "Another flush_cache is already in progress."
"""``SchedulerFlushWrapper.handle`` (scheduler_components/flush_wrapper.py L22-27)."""
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
"""``SchedulerFlushWrapper.check_pending`` (flush_wrapper.py L52-61)."""


@dataclass
class Requests:
    """The generation simulator's requests, by where they are (counts)."""

    held: int = 0
    """Arrived while the tokenizer was paused: waiting at ``is_pause_cond`` (no lock held)."""
    waiting: int = 0
    """In the scheduler's waiting queue (holding the tokenizer's reader lock)."""
    running: int = 0
    """In the scheduler's running batch (holding the reader lock)."""
    finished: int = 0
    aborted: int = 0

    @property
    def inflight(self) -> int:
        """Requests holding ``model_update_lock``'s reader side (running or waiting)."""
        return self.running + self.waiting


@dataclass
class Session:
    """``_WeightUpdateSession`` (weight_updater.py L81-84): the selector recorded at begin,
    and whether a tensor was loaded since (then ``end`` skips ``post_load_weights``)."""

    selector: str
    loaded_weights: bool = False


@dataclass
class SglangState:
    """Engine-level state of one SGLang engine (see the module docstring)."""

    version: SglangVersion
    weight_version: str = "default"
    """The tokenizer's (``/model_info``): ``--weight-version`` at start."""
    scheduler_weight_version: str = "default"
    """The scheduler's (``record_weight_version_change``; ``/server_info``'s
    ``internal_states``)."""
    is_pause: bool = False
    """The tokenizer's pause flag."""
    engine_paused: bool = False
    """The scheduler's ``_engine_paused``."""
    pause_mode: str | None = None
    session: Session | None = None
    requests: Requests = field(default_factory=Requests)
    counts: dict[str, int] = field(default_factory=lambda: {
        "pause_count": 0, "continue_count": 0, "begin_count": 0, "end_count": 0,
        "update_count": 0, "flush_count": 0, "flush_refused": 0, "abort_all_count": 0,
        "version_updates": 0})
    fault_table: FaultTable = field(default_factory=FaultTable)
    flush_pending: bool = False

    def __post_init__(self) -> None:
        self.scheduler_weight_version = self.weight_version

    # -- the generation simulator ----------------------------------------------------------

    def start_requests(self, n: int) -> None:
        """``n`` generate requests arrive: held by a paused tokenizer, queued by a paused
        scheduler, else running."""
        if self.is_pause:
            self.requests.held += n
        elif self.engine_paused:
            self.requests.waiting += n
        else:
            self.requests.running += n

    def finish_requests(self, n: int | None) -> int:
        """Up to ``n`` (None: all) running requests finish; returns how many. Requests make
        progress only while the scheduler runs: none finish while it is paused.

        Raises:
            RuntimeError: the scheduler is paused.
        """
        if self.engine_paused:
            raise RuntimeError("the scheduler is paused: no request makes progress")
        k = self.requests.running if n is None else min(n, self.requests.running)
        self.requests.running -= k
        self.requests.finished += k
        return k

    def abort_all(self) -> int:
        """``abort_request(abort_all=True)`` (tokenizer_manager.py L2241-2265): the scheduler
        aborts every request it has (running and waiting); held ones are not there yet.
        Returns how many."""
        k = self.requests.inflight
        self.requests.aborted += k
        self.requests.running = self.requests.waiting = 0
        self.counts["abort_all_count"] += 1
        return k

    # -- pause / continue -----------------------------------------------------------------

    def tokenizer_pause(self, mode: str) -> None:
        """The tokenizer's part of ``/pause_generation``: ``is_pause``; ``abort`` aborts
        every request (and never tells the scheduler); the other modes then go to the
        scheduler (:meth:`scheduler_pause`)."""
        self.is_pause = True
        self.pause_mode = mode
        self.counts["pause_count"] += 1
        if mode == "abort":
            self.abort_all()

    def scheduler_pause(self, mode: str) -> None:
        """``Scheduler.pause_generation`` (scheduler.py L5817-5932): ``retract`` moves every
        running request back to the waiting queue (KV freed); ``in_place`` leaves them."""
        assert mode in ("in_place", "retract")
        self.engine_paused = True
        if mode == "retract":
            self.requests.waiting += self.requests.running
            self.requests.running = 0

    def tokenizer_continue(self) -> None:
        """The tokenizer's part of ``/continue_generation``: ``is_pause = False``."""
        self.is_pause = False
        self.counts["continue_count"] += 1

    def scheduler_continue(self) -> None:
        """``Scheduler.continue_generation`` (L5934-): ``_engine_paused = False``; the loop
        then admits the waiting queue; the requests the tokenizer held come in after it."""
        self.engine_paused = False
        r = self.requests
        r.running += r.waiting + r.held
        r.waiting = r.held = 0

    # -- flush ----------------------------------------------------------------------------

    def is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        """``Scheduler.is_fully_idle`` (scheduler.py L5337 / L5011; 0.5.20 L4808 has no
        ``ignore_waiting``): nothing running, and nothing waiting unless ignored."""
        idle = self.requests.running == 0
        if not (ignore_waiting and self.version.retract_flushable):
            idle = idle and self.requests.waiting == 0
        return idle

    def flush(self) -> bool:
        """``Scheduler.flush_cache`` (scheduler.py L5518 / L5187 / L4981): flushes when
        ``is_fully_idle(ignore_waiting=self._engine_paused)`` (0.5.20: ``is_fully_idle()``);
        returns whether it did."""
        ok = self.is_fully_idle(ignore_waiting=self.engine_paused)
        self.counts["flush_count" if ok else "flush_refused"] += 1
        return ok

    # -- weight-update session (0.5.21+) --------------------------------------------------

    def begin(self, selector: str) -> str | None:
        """``begin_weight_update``'s session rule: the 400 text, or None (then the runners
        begin and :meth:`opened` records the session)."""
        return SESSION_OPEN if self.session is not None else None

    def opened(self, selector: str) -> None:
        self.session = Session(selector)
        self.counts["begin_count"] += 1

    def end(self) -> str | None:
        """``end_weight_update``'s session rule: the 400 text, or None (then the runners end
        and :meth:`closed` clears the session)."""
        return NO_SESSION if self.session is None else None

    def closed(self) -> None:
        self.session = None
        self.counts["end_count"] += 1

    def update_refusal(self) -> str | None:
        """The scheduler's refusal of an update before it touches anything (0.5.21+: no open
        session), or None."""
        if self.version.sessions and self.session is None:
            return SESSION_REQUIRED
        return None

    def after_load(self, weight_version: str | None, flush_cache: bool
                   ) -> tuple[bool, str]:
        """Every rank loaded: the scheduler's steps before the barrier, per version
        (weight_updater.py L248-258 / L237-242 / L168-171). Returns ``(success, message)``.

        Raises:
            AssertionError: 0.5.20 / 0.5.21 and the flush was refused (a scheduler
                exception: the server dies).
        """
        v = self.version
        if self.session is not None:
            self.session.loaded_weights = True
        if v.flush_fails_softly:  # 0.5.23: the version is recorded, then the flush
            self._record_version(weight_version)
            if flush_cache and not self.flush():
                return False, FLUSH_REFUSED
        else:
            if flush_cache:
                assert self.flush(), FLUSH_ASSERT
            self._record_version(weight_version)
        self.counts["update_count"] += 1
        return True, "Success"

    def _record_version(self, weight_version: str | None) -> None:
        """``record_weight_version_change``: no-op for None or an equal version."""
        if weight_version is not None:
            self.scheduler_weight_version = weight_version

    def set_weight_version(self, new_version: str) -> None:
        """The tokenizer records ``new_version`` (what ``/model_info`` reports)."""
        self.weight_version = new_version
        self.counts["version_updates"] += 1

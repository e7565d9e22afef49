"""What the daemon knows of one slot's engine and its session (design.md I4, I9): I/O-free.

The coordinator (``coordinator.py``) owns one ``EngineSession`` per slot and updates it from
engine call outcomes; ``/status`` reports it (``status_documents.py``); a released slot's is
taken over by the next slot that registers the same engine (``SlotCoordinator.adopt_engine``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slotsync.daemon.core.adapters.ledger import AdapterLedger

EXECUTOR_ROUTES = frozenset({
    "init_weight_transfer_engine", "pause", "finish_recover", "start_weight_update",
    "update_weights", "finish_weight_update", "check_replies",
    "start_draft_weight_update", "finish_draft_weight_update", "draft_support",
})
"""Engine calls that reach the workers through vLLM's executor."""

CANNOT_REACH = "cannot reach "
"""How ``VllmClient`` words an engine call that got no connection (refused, reset, no route):
the engine process is not there to answer (``EngineSession.note_call``)."""


def key_refused(error: str) -> bool:
    """An engine call's ``error`` (``str(EngineError)``) is a refusal of the daemon's
    credentials: HTTP 401 or 403, which the engine clients word as such (the daemon sent no
    API key, or a wrong one: ``daemon/engine_http.py`` ``key_refusal``; issue 35). Its text
    says what to set, and no other cause is guessed from it."""
    return "HTTP 401:" in error or "HTTP 403:" in error


def key_refusal_words(error: str) -> str:
    """A refused key's ``error`` (``key_refused``) without its step and status prefix
    (``"version: HTTP 401: "``): the client's own words, which name the status."""
    return error.split(": HTTP ", 1)[-1].split(": ", 1)[-1]


WORKER_FAILED = "Worker failed with error"
"""vLLM's MultiprocExecutor (engines of several workers) wraps a worker's error in this text
(vLLM 0.32 ``v1/executor/multiproc_executor.py`` ``collective_rpc``)."""


@dataclass
class DraftTarget:
    """What the daemon knows of the engine's speculative-decoding draft model (issue 18),
    tracked apart from the main model: ``needs_full_update`` (its session failed, or the
    engine restarted or slept after the daemon had loaded it; ``why`` says which),
    ``last_ok_names`` (the draft tensor names of the last successful draft session) and
    ``version`` (the weight version of the round whose draft part last landed; vLLM itself
    keeps one version per engine, the main one). ``supported``: this engine process's
    workers answered ``supports_draft_weight_updates()`` true (asked once per process)."""

    needs_full_update: bool = False
    last_ok_names: frozenset[str] = field(default_factory=frozenset)
    version: str | None = None
    why: str = ""
    supported: bool | None = None  # every worker said it can load a draft (None: not asked)

    def stale(self, why: str) -> None:
        """The engine's draft model no longer holds what the daemon loaded (``why``): if it
        ever loaded one, the next round must carry the draft in full."""
        if self.last_ok_names:
            self.needs_full_update, self.why = True, why


@dataclass
class EngineSession:
    """Facts about the engine behind a slot.

    ``initialized``: ``/init_weight_transfer_engine`` ran on this engine process. ``paused``:
    generation is paused (or may be). ``needs_full_update``: the next update must load every
    name of ``last_ok_names`` (after a failed update, a restarted or sleeping engine, I4).
    ``last_ok_names``: the tensor names of the slot's last successful update (a later update
    that leaves some out is reported or refused); ``last_ok_layout`` each one's dtype name
    and shape (a begin's manifest is checked against it, ``Update.names_refusal``).
    ``mid_update``: a ``/start_weight_update`` may be active on some workers (the record
    file's entries, ``"engine_may_be_mid_update"`` in ``/status``).

    Its session (I9): ``version`` the weight version it should report (seen at the last probe,
    or finished by the daemon since); ``session_suspect`` a refused or reset connection was
    seen since (a possible restart); ``asleep`` it was sleeping or paused by someone else at
    the last begin. ``restored``: the record state a previous daemon left, until probed.

    vLLM's MultiprocExecutor reads the workers' replies in rank order and raises at the first
    failure, leaving later workers' replies queued: the next call then reads them as its own
    (vLLM gh-58242, PR 57846 open). After a worker's failure the next executor call is a
    harmless check (``replies_suspect``, ``CHECK_REPLIES``): a stale reply answering it means
    the replies are out of step until the engine restarts (``out_of_step``: why).

    ``recover_first``: end a half-open session before the start (finish first), or start first
    and end the session only where a worker says it is already active: after a failed finish
    the workers that succeeded hold no session, so a finish would fail on worker 0 first.

    GPU UUIDs of the engine's workers where they can be known: ``declared_gpu_uuids`` (the
    engine table's) or ``gpu_uuids`` (the engine's own report, the reference engine's
    ``/get_world_size``); ``world_size`` as ``/get_world_size`` reported it.

    ``draft``: the draft model's own target (``DraftTarget``, issue 18); the fields above
    are the main model's.
    Its kind (issue 26, ``daemon/families.py``): ``kind`` ``"vllm"`` / ``"sglang"`` (None: not
    known yet), ``declared_kind`` the engine table's, ``sglang_version`` SGLang's release
    as its ``/server_info`` gave it, ``pause_mode`` the table's SGLang pause mode.
    ``former_kind``: the kind it had when the daemon began to ask it again (``forget_kind``:
    an operator's drop, or answers unlike its kind), until the answers tell it (issue 35).
    Its vLLM version (``daemon/vllm/versions.py``): ``vllm_version`` the ``"version"`` text its
    ``GET /version`` gave (None: not asked yet, or no version came back), asked when the
    daemon first meets the engine and after a restart is suspected; ``version_refused`` why
    that version is refused ('' when supported), asked again at every begin while refused.
    ``dp_layout_refused``: why its data-parallel layout is refused (``daemon/vllm/dp_layout.py``:
    one API
    server of a hybrid or external load-balanced deployment; '' when not, or not known),
    read from ``/server_info`` with the version and, like it, asked at every begin while
    refused.

    Its reachability (issue 24: a dead engine was shown as paused): ``unreachable`` the last
    engine call's connection error while no call got an answer since ('' once one does),
    ``unreachable_since`` when that began and ``last_answer_at`` when the engine last
    answered (any HTTP status); monotonic seconds. The fields above stay what the daemon saw
    at that last answer.
    """

    initialized: bool = False
    paused: bool = False
    needs_full_update: bool = False
    last_ok_names: frozenset[str] = field(default_factory=frozenset)
    last_ok_layout: Mapping[str, tuple[str, Sequence[int]]] = field(default_factory=dict)
    mid_update: bool = False
    version: str | None = None
    session_suspect: bool = False
    asleep: bool = False
    replies_suspect: bool = False
    out_of_step: str | None = None
    recover_first: bool = True
    restored: str | None = None
    declared_gpu_uuids: tuple[str, ...] | None = None
    gpu_uuids: tuple[str, ...] | None = None
    world_size: int | None = None
    draft: DraftTarget = field(default_factory=DraftTarget)
    vllm_version: str | None = None
    version_refused: str = ""
    dp_layout_refused: str = ""
    unreachable: str = ""
    unreachable_since: float | None = None
    last_answer_at: float | None = None
    # issue 26: which engine this is (daemon/families.py)
    kind: str | None = None
    declared_kind: str | None = None
    sglang_version: str | None = None
    pause_mode: str = "in_place"
    # issue 35: the kind it had before the daemon began to ask it again (forget_kind)
    former_kind: str | None = None
    # issue 36: the LoRA adapters it holds and should hold (core/adapters/ledger.py)
    adapters: AdapterLedger = field(default_factory=AdapterLedger)

    @property
    def known_kind(self) -> str | None:
        """``"vllm"`` or ``"sglang"`` once declared or told by the engine's answers; None
        before (complete chunks wait for it: ``core/family.py``'s ``MergeFacts.family``)."""
        return self.kind or ("vllm" if self.vllm_version is not None else None)

    @property
    def engine_version(self) -> str | None:
        """The version of the engine's own software the daemon knows (vLLM's or SGLang's)."""
        return self.sglang_version if self.kind == "sglang" else self.vllm_version

    def declare_kind(self, kind: str | None, pause_mode: str = "in_place") -> None:
        """The engine table's ``kind`` (None: not declared) and SGLang pause mode."""
        self.declared_kind, self.pause_mode = kind, pause_mode
        self.kind = kind
        self.sglang_version = None

    def take_over(self, old: EngineSession) -> None:
        """Take what a released slot knew of the same engine (paused, mid-update, out of step,
        the last update's names); the engine is initialised again before its next update. The
        engine table's declared UUIDs and the world size stay this slot's own."""
        for name in ("paused", "needs_full_update", "last_ok_names", "last_ok_layout",
                     "mid_update", "version", "session_suspect", "asleep", "replies_suspect",
                     "out_of_step", "recover_first", "restored", "gpu_uuids", "adapters"):
            setattr(self, name, getattr(old, name))
        self.draft = dataclasses.replace(old.draft)
        self.initialized = False
        self.former_kind = old.former_kind or old.known_kind  # (this slot asks its kind)

    def forget(self) -> None:
        """Another engine from now on (engine table reload): nothing is known of it, and it
        is initialised before its first update."""
        self.initialized = self.mid_update = self.paused = self.asleep = False
        self.version, self.gpu_uuids, self.last_ok_names = None, None, frozenset()
        self.last_ok_layout = {}
        self.draft = DraftTarget()
        self.vllm_version, self.version_refused, self.dp_layout_refused = None, "", ""
        self.kind, self.sglang_version = self.declared_kind, None
        self.adapters = AdapterLedger()  # (the service removes unused folders at its stop)

    def forget_kind(self) -> None:
        """The engine at the URL may be another one, of another kind (issue 35: a vLLM
        engine replaced by an SGLang one at the same port): its kind, version and layout are
        asked again at the next version stage (the engine table's declared kind stays).
        ``former_kind`` keeps the kind it had, so that an answer of another kind is taken as
        a new engine session (``outcomes``)."""
        if self.known_kind is not None:
            self.former_kind = self.known_kind
        self.kind = self.declared_kind
        self.vllm_version = self.sglang_version = None
        self.version_refused = self.dp_layout_refused = ""

    def new_process(self) -> None:
        """The engine is a process this daemon did not initialise (restarted at its URL): no
        half-open session, its replies line up, and it is initialised again."""
        self.initialized = self.mid_update = self.replies_suspect = False
        self.out_of_step, self.recover_first = None, True
        self.draft.supported = None

    def note_call(self, ok: bool, error: str, now: float) -> None:
        """An engine call returned at ``now`` (monotonic seconds): ``ok``, or not with
        ``error`` (``str(EngineError)``, ``daemon/vllm/client.py``). Any HTTP answer, a
        failure included, shows the engine there; an error with ``CANNOT_REACH`` shows no
        process answering at its URL; a timeout or the daemon's own failure to send says
        neither."""
        if ok or "HTTP " in error:
            self.unreachable, self.unreachable_since, self.last_answer_at = "", None, now
        elif CANNOT_REACH in error:
            self.unreachable = error
            if self.unreachable_since is None:
                self.unreachable_since = now

    def note_reply_trouble(self, route: str, error: str, size: int) -> None:
        """A failed call that may have left a later worker's reply queued (vLLM's
        MultiprocExecutor, gh-58242): a worker's failure, or an executor call that timed out
        (it runs on, and may fail on worker 0 after the daemon stopped waiting, e.g. mapping
        memory its trainer already gave back). The next executor call checks first.
        ``size``: the engine's workers."""
        if size > 1 and (WORKER_FAILED in error or (
                "no answer within" in error and route in EXECUTOR_ROUTES)):
            self.replies_suspect = True


def start_reached_none(error: str, size: int) -> bool:
    """A failed start whose error shows that no worker began a session: vLLM's own answer
    (status 4xx/5xx, not a timeout or a lost connection) without the executor's per-worker
    wrapping on an engine of several workers (it failed before the call reached them), or
    the one worker's own failure on a single-worker engine (``size``: its workers)."""
    if "HTTP " not in error or "already active" in error:
        return False  # timeout, connection lost: the workers may have started
    return size == 1 or WORKER_FAILED not in error


CHECK_REPLIES: dict[str, Any] = {"method": "__getattribute__", "args": ["rpc_rank"]}
"""The ``check_replies`` call's body (vLLM's dev-mode ``POST /collective_rpc``): each worker
answers its rank in the executor, ``WorkerWrapperBase.rpc_rank`` (vLLM 0.32
``v1/worker/worker_base.py``; ``WorkerProc`` runs ``getattr(self.worker, method)(*args)`` on
that wrapper, ``v1/serial_utils.py`` ``run_method``; the router answers ``str()`` of an int).
A reply no other call gets: a stale one shows. ``check_health`` could not tell: vLLM's
``Worker.check_health`` returns None, as do start / update_weights / finish, so a success
left queued behind an earlier worker's failure passed for its answer (the round then read
every reply one call late)."""


def replies_in_step(result: Any, size: int) -> bool:
    """The ``check_replies`` call (``CHECK_REPLIES``) got each worker's own answer, its rank
    (``size``: the engine's workers): ``{"results": ["0", "1", ..., str(size - 1)]}``, or,
    from an engine of D data-parallel replicas, the ranks of replica 0's ``size // D``
    workers: vLLM 0.32's ``DPLBAsyncMPClient`` runs the call on every replica and answers
    replica 0's results only (``core_client.py`` ``call_utility_async``)."""
    results = result.get("results") if isinstance(result, dict) else None
    return (isinstance(results, list) and len(results) > 0 and size % len(results) == 0
            and results == [str(i) for i in range(len(results))])


def out_of_step_found(engine_url: str, answer: str) -> str:
    """Why ``EngineSession.out_of_step`` is set when the check did not get each worker's own
    answer (``answer``: what it got, cut to 300 characters): a worker's reply to an
    earlier call is still queued, so every later call would read another call's reply (vLLM
    gh-58242). Nothing but a restart puts it right."""
    return (
        f"engine {engine_url}'s executor replies are out of step: after a worker's "
        f"failure, the check (each worker's rpc_rank) read a reply to an earlier call "
        f"({answer[:300]}); vLLM 0.32's MultiprocExecutor leaves later workers' replies "
        "queued when one fails (vLLM gh-58242, fixed by PR 57846), and every later call "
        "would take another call's reply for its own. Restart the engine: the daemon then "
        "initialises it and sends a full update")

"""One update of one engine slot: its phase, its begin plan and its chunk window (I/O-free).

Rules (design.md "Flow of one round"; h11 ``_state.py`` style, the transitions are data below):

* An update's begin runs the stages of ``BEGIN_STAGES`` in order, one stage at a time (a
  stage's calls go out together); a stage runs when the one before it returned and its
  condition holds (``begin_step``, which the coordinator's ``_advance`` asks what to send).
* Its phase only moves forward, along ``TRANSITIONS``::

      beginning --pause sent--> pausing --start sent--> starting --start returned--> loading
        --finish sent--> finishing --finish returned--> finished

  ``starting --start sent--> starting``: a start that met a session nobody recorded ends it
  (``finish_recover``) and is sent once more (``start_retried``). An event a phase has no row
  for is a bug in the coordinator: ``Update.on`` raises ``PhaseError``.

  A round with a draft-model part (``wire.Begin.draft``, issue 18) moves along
  ``DRAFT_TRANSITIONS``: the main session's finish (with the weight version) ends in
  ``main_finished``; then vLLM's ``/start_draft_weight_update``, the draft chunks, and a
  second ``/finish_weight_update`` (no version: vLLM's engine has one weight version, set by
  the main finish) lead to ``finishing`` / ``finished`` and the resume::

      loading --finish sent--> main_finishing --finish returned--> main_finished
        --draft start sent--> draft_starting --draft start returned--> draft_loading
        --draft finish sent--> finishing --draft finish returned--> finished
* What a failure leaves behind follows from the phase (``recovery.after_failure``): from
  ``starting`` on the engine may be mid-update (I4); in ``pausing`` it is paused, or may be.
* Chunks: chunk k is merged once every rank sent it (possibly ahead of its turn, ``merged``),
  handed to the engine in index order (``next_send``), and acknowledged in index order once
  it and every chunk before it returned (``loaded`` -> ``next_index``, I3); the functions
  that move them are in ``chunk_window.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from slotsync.daemon.core import rank_local
from slotsync.daemon.core.aggregation import SAME_CHUNKS_RULE, ChunkMismatch, MergedChunk
from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.family import ChunkFence, EngineFamily
from slotsync.daemon.core.registration import RankInfo, uuid_mismatch
from slotsync.protocol.manifest import DIGEST_BYTES, manifest_of
from slotsync.protocol.wire import DTYPE_SIZES, Chunk


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines in seconds for each wait on ranks (design.md I5). Engine calls are bounded by
    the HTTP client's own timeout, reported back as a failed ``on_engine_result``."""

    begin_s: float = 120.0  # from the first Begin until every rank of the slot has begun
    chunk_s: float = 120.0  # from the first copy of chunk k until every rank sent chunk k
    commit_s: float = 600.0  # from the last progress until the next chunk or every Commit
    # a rank gone (connection closed, process exited) when an update begins: how long a new
    # process of it may take to register before the update fails naming it (liveness_s)
    gone_s: float = 10.0
    # issue 36: an adapter round's files and load call, each (adapter_load_timeout_s); its
    # waits on ranks are begin_s (every AdapterBegin) and chunk_s (every AdapterData)
    adapter_load_s: float = 120.0
    # issue 36: the idle watch of an engine's adapters, one look every this many seconds
    # (adapter_watch_s; 0: off): adapters/watch.py
    adapter_watch_s: float = 5.0


def some_names(names: list[str], n: int = 5) -> str:
    """The first ``n`` of ``names`` and how many more, for an error message."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


@dataclass(frozen=True, slots=True)
class Stage:
    """One begin stage: ``routes`` are issued together; ``touches_generation``: only once every
    rank has begun and a chunk arrived; ``needs_record``: the durable record must be written
    before its calls are sent (they may leave the engine mid-update)."""

    name: str
    routes: tuple[str, ...]
    touches_generation: bool
    needs_record: bool = False


BEGIN_STAGES: tuple[Stage, ...] = (
    # GET /version and GET /server_info (what they mean: the engine families,
    # slotsync.daemon.families; vLLM's version and DP layout, SGLang's version and layout):
    # when the daemon first meets the engine, while its version or layout is refused, or
    # after a refused / reset connection (a restart suspected) ...
    Stage("version", ("version", "server_info"), False),
    Stage("probe", ("get_world_size", "weight_info", "is_sleeping"), False),
    # ... and once more when the probe found a new engine session it had not asked
    Stage("version_again", ("version", "server_info"), False),
    Stage("init", ("init_weight_transfer_engine",), False),
    # issue 18: a round with a draft part asks, while the engine still serves, whether its
    # workers can load a draft model (vLLM 0.32 Worker.supports_draft_weight_updates)
    Stage("draft", ("draft_support",), False),
    Stage("pause", ("pause",), True),
    Stage("recover", ("finish_recover",), True),
    Stage("start", ("start_weight_update",), True, needs_record=True),
)
STAGE_INDEX = {st.name: i for i, st in enumerate(BEGIN_STAGES)}
EXECUTOR_STAGES = frozenset({"init", "draft", "pause", "recover", "start"})
"""Begin stages whose calls reach every worker through vLLM's executor (the probes are answered
by the API server or the engine core; vLLM 0.32's ``EngineCoreProc.pause_scheduler`` calls
``collective_rpc("synchronize_device")`` and resets the workers' caches)."""


class Phase(IntEnum):
    """Where an update stands with its engine (ordered: each phase follows the one above)."""

    BEGINNING = 0  # probe / init: the engine still serves
    PAUSING = 1  # /pause sent: the engine is paused, or may be
    STARTING = 2  # /start_weight_update sent: the engine may be mid-update
    LOADING = 3  # start returned: chunks go to the engine
    # (a round with a draft part, issue 18:)
    MAIN_FINISHING = 4  # the main session's /finish_weight_update sent
    MAIN_FINISHED = 5  # it returned: the main weights and version are recorded
    DRAFT_STARTING = 6  # /start_draft_weight_update sent: the engine may be mid-update
    DRAFT_LOADING = 7  # it returned: draft chunks go to the engine
    FINISHING = 8  # the last /finish_weight_update sent
    FINISHED = 9  # it returned: resume (unless the engine was found asleep)


class PhaseEvent(IntEnum):
    """What moves an update's phase."""

    PAUSE_SENT = 0
    START_SENT = 1
    STARTED = 2
    FINISH_SENT = 3
    FINISHED = 4
    DRAFT_START_SENT = 5
    DRAFT_STARTED = 6
    DRAFT_FINISH_SENT = 7
    DRAFT_FINISHED = 8


TRANSITIONS: dict[Phase, dict[PhaseEvent, Phase]] = {
    Phase.BEGINNING: {PhaseEvent.PAUSE_SENT: Phase.PAUSING},
    Phase.PAUSING: {PhaseEvent.START_SENT: Phase.STARTING},
    Phase.STARTING: {PhaseEvent.START_SENT: Phase.STARTING, PhaseEvent.STARTED: Phase.LOADING},
    Phase.LOADING: {PhaseEvent.FINISH_SENT: Phase.FINISHING},
    Phase.FINISHING: {PhaseEvent.FINISHED: Phase.FINISHED},
    Phase.FINISHED: {},
}

DRAFT_TRANSITIONS: dict[Phase, dict[PhaseEvent, Phase]] = {
    **{p: TRANSITIONS[p] for p in (Phase.BEGINNING, Phase.PAUSING, Phase.STARTING)},
    Phase.LOADING: {PhaseEvent.FINISH_SENT: Phase.MAIN_FINISHING},
    Phase.MAIN_FINISHING: {PhaseEvent.FINISHED: Phase.MAIN_FINISHED},
    Phase.MAIN_FINISHED: {PhaseEvent.DRAFT_START_SENT: Phase.DRAFT_STARTING},
    Phase.DRAFT_STARTING: {PhaseEvent.DRAFT_STARTED: Phase.DRAFT_LOADING},
    Phase.DRAFT_LOADING: {PhaseEvent.DRAFT_FINISH_SENT: Phase.FINISHING},
    Phase.FINISHING: {PhaseEvent.DRAFT_FINISHED: Phase.FINISHED},
    Phase.FINISHED: {},
}
"""The phases of a round with a draft-model part (issue 18; the rules at the top)."""

SENT_EVENTS: dict[str, PhaseEvent] = {
    "pause": PhaseEvent.PAUSE_SENT,
    "start_weight_update": PhaseEvent.START_SENT,
    "finish_weight_update": PhaseEvent.FINISH_SENT,
    "start_draft_weight_update": PhaseEvent.DRAFT_START_SENT,
    "finish_draft_weight_update": PhaseEvent.DRAFT_FINISH_SENT,
}
"""Engine calls whose sending moves the phase."""


class PhaseError(RuntimeError):
    """An event the update's phase has no transition for (a coordinator bug)."""


@dataclass
class Update:
    """The state of one update in flight, keyed by ``update_id`` (I7). Times are monotonic
    seconds; ``consumed_bytes`` tensor bytes per rank the engine loaded."""

    update_id: int
    weight_version: str
    started_at: float
    begun: set[int] = field(default_factory=set)
    first_begin_at: float = 0.0
    phase: Phase = Phase.BEGINNING
    engine_started_at: float = 0.0  # start returned then (chunks sent before it wait from here)
    stage: int = 0  # next begin stage (index into BEGIN_STAGES)
    weights_intact: bool = True  # at begin: the engine did not need a full update
    pending: dict[int, dict[int, Chunk]] = field(default_factory=dict)  # index -> rank -> chunk
    # complete chunks merged ahead of their turn (while the engine loads an earlier one)
    merged: dict[int, MergedChunk | ChunkMismatch] = field(default_factory=dict)
    first_arrival: dict[int, float] = field(default_factory=dict)
    sent_count: dict[int, int] = field(default_factory=dict)  # rank -> chunks received
    next_index: int = 0  # next chunk to acknowledge (every chunk before it was consumed)
    next_send: int = 0  # next chunk to hand to the engine
    loaded: set[int] = field(default_factory=set)  # returned, waiting for an earlier chunk
    consumed_bytes: int = 0
    names: set[str] = field(default_factory=set)  # loaded in this update
    # each main name's (dtype name, shape) as loaded (EngineSession.last_ok_layout after a
    # success: the begin of a later update checks its manifest against it, names_refusal)
    layout: dict[str, tuple[str, Sequence[int]]] = field(default_factory=dict)
    omitted: list[str] = field(default_factory=list)  # the last successful update's, not here
    committed: dict[int, int] = field(default_factory=dict)  # rank -> num_chunks
    last_progress: float = 0.0
    start_retried: bool = False  # start met an unrecorded session once and was retried
    # the engine was sleeping, or paused by someone else, at the begin: leave it paused
    found_asleep: bool = False
    # this begin found a new engine session (probe.new_session: a restarted engine)
    new_session: bool = False
    # the first tensor manifest a rank began with (empty: none yet; wire.Begin.manifest)
    manifest: bytes = b""
    manifest_rank: int = -1
    # issue 18: the round has a draft-model part (every rank's Begin.draft); the index of its
    # first draft chunk once a rank sent one; the draft names loaded in this update
    draft: bool = False
    draft_from: int | None = None
    draft_names: set[str] = field(default_factory=set)
    # rank-local mode (daemon/core/rank_local.py): each begun rank's mode, declared tensors,
    # worker index, tensors sent so far and last chunk's handle (an empty packed entry's)
    mode_of: dict[int, bool] = field(default_factory=dict)
    declared: dict[int, tuple] = field(default_factory=dict)
    worker_of: dict[int, int] = field(default_factory=dict)
    tensors_sent: dict[int, int] = field(default_factory=dict)
    fill_handles: dict = field(default_factory=dict)

    @property
    def rank_local(self) -> bool:
        """Every rank begun so far began in rank-local mode (``rank_local.take_begin``)."""
        return bool(self.mode_of) and all(self.mode_of.values())
    # GET /version went out in this begin (the version stage, or version_again)
    version_asked: bool = False
    # the first disagreement between the ranks' begins (text, tensor index or -1): the
    # update fails with it once every rank has begun, so that every rank is told the cause
    # (a rank that began later would otherwise begin the next update and fail there)
    begin_refusal: tuple[str, int] | None = None
    # the publisher settings each begun rank declared (begin_agreement.SETTINGS):
    # setting -> rank -> value
    settings: dict[str, dict[int, int]] = field(default_factory=dict)
    # issue 26 (slotsync.daemon.families): the version stage went out before the engine's
    # kind was known; GET /version's 404 while /server_info was still out; the family's
    # chunk fence (SGLang's buffer fence, core/family.py ChunkFence)
    kind_asked: bool = False
    version_404: str = ""
    fence: ChunkFence | None = None
    # issue 35: why the engine's answers suggest another kind than the one the daemon took it
    # for (Families.kind_in_doubt, VersionVerdict.recheck): once the stage's calls returned,
    # the kind is asked again from the version stage on, once per begin (kind_rechecked)
    kind_doubt: str = ""
    kind_rechecked: bool = False

    def on(self, event: PhaseEvent) -> None:
        """Move the phase along ``TRANSITIONS`` (``DRAFT_TRANSITIONS`` for a round with a
        draft part).

        Raises:
            PhaseError: the phase has no transition for ``event``.
        """
        nxt = (DRAFT_TRANSITIONS if self.draft else TRANSITIONS)[self.phase].get(event)
        if nxt is None:
            raise PhaseError(f"update {self.update_id}: {event.name} in phase {self.phase.name}")
        self.phase = nxt

    @property
    def pause_sent(self) -> bool:
        return self.phase >= Phase.PAUSING

    @property
    def start_sent(self) -> bool:
        return self.phase >= Phase.STARTING

    @property
    def engine_started(self) -> bool:
        """``/start_weight_update`` returned 200."""
        return self.phase >= Phase.LOADING

    @property
    def finishing(self) -> bool:
        """The update's last ``/finish_weight_update`` was sent (the draft one, in a round
        with a draft part)."""
        return self.phase >= Phase.FINISHING

    @property
    def main_finished(self) -> bool:
        """The main session's finish returned: its weights and version are recorded."""
        return self.phase >= (Phase.MAIN_FINISHED if self.draft else Phase.FINISHED)

    @property
    def draft_start_sent(self) -> bool:
        """``/start_draft_weight_update`` was sent: the draft may be half-loaded."""
        return self.draft and self.phase >= Phase.DRAFT_STARTING

    def sendable_until(self) -> int | None:
        """The first chunk index that must not go to the engine yet (None: no bound): in a
        round with a draft part, the draft chunks wait for the draft session, and nothing
        goes out between the main finish and the draft start's return."""
        if not self.draft or self.phase is Phase.DRAFT_LOADING:
            return None
        if self.phase > Phase.LOADING:
            return self.next_send
        return self.draft_from

    @property
    def finished(self) -> bool:
        """``/finish_weight_update`` returned 200."""
        return self.phase is Phase.FINISHED

    def consume_next(self) -> Chunk:
        """Account for chunk ``next_index``, which the engine loaded: its names and bytes
        count, and the next chunk becomes the one to acknowledge. Returns one rank's copy."""
        idx = self.next_index
        self.loaded.discard(idx)
        loaded = next(iter(self.pending[idx].values()))
        # against last_ok_names (the draft's: EngineSession.draft) before the finish
        target = self.draft_names if loaded.draft else self.names
        target.update(loaded.names)
        if self.rank_local:  # (each rank its own names)
            for c in self.pending[idx].values():
                target.update(c.names)
        if not loaded.draft:
            for c in self.pending[idx].values() if self.rank_local else (loaded,):
                self.layout.update(zip(c.names, zip(c.dtype_names, c.shapes, strict=True),
                                       strict=True))
        del self.pending[idx]
        self.first_arrival.pop(idx, None)
        self.next_index += 1
        self.consumed_bytes += sum(loaded.tensor_sizes)
        return loaded

    def all_consumed(self, size: int) -> bool:
        """Every one of ``size`` ranks committed and every committed chunk was consumed."""
        return (len(self.committed) == size and not self.pending
                and self.next_index == max(self.committed.values()))

    def chunk_out_of_order(self, rank: int, index: int) -> str:
        """Why chunk ``index`` from ``rank`` breaks the round's order (design.md "Flow of one
        round": after the rank's begin, before its commit, indices 0, 1, ... and no further
        than another rank's commit, ``aggregation.SAME_CHUNKS_RULE``); '' if it is the next."""
        if rank not in self.begun:
            return f"rank {rank} sent chunk {index} before its begin"
        if rank in self.committed:
            return f"rank {rank} sent chunk {index} after commit"
        expect = self.sent_count.get(rank, 0)
        done = [(r, n) for r, n in sorted(self.committed.items()) if n <= index]
        if done and not self.rank_local:  # (rank-local: ranks send their own chunk counts)
            r0, n0 = done[0]
            return (f"rank {rank} sent chunk {index} but rank {r0} committed {n0} chunks: "
                    f"{SAME_CHUNKS_RULE}")
        if index != expect:
            return f"rank {rank} sent chunk {index}, expected chunk {expect}"
        return ""

    def wait_in_force(self, ranks: range, gone: Sequence[RankInfo],
                      timeouts: Timeouts) -> tuple[float, str, str, list[int]]:
        """``(deadline, phase, what, missing ranks)`` of the wait on ranks in force (design.md
        I5), for a slot of ``ranks`` whose ``gone`` ranks' processes ended (deadline:
        monotonic seconds). The caller knows when no wait on ranks is in force (engine calls
        out, the finish sent)."""
        all_ranks = set(ranks)
        not_begun = sorted(all_ranks - self.begun)
        if not_begun:
            gone = [i for i in gone if i.rank in not_begun]
            if gone:  # (a new process of the rank may be on its way: a restarted job)
                t = max(self.first_begin_at, *(i.gone_at or 0.0 for i in gone))
                return (min(t + timeouts.gone_s, self.first_begin_at + timeouts.begin_s),
                        "rank_gone", "", [i.rank for i in gone])
            return (self.first_begin_at + timeouts.begin_s, "begin", "begin", not_begun)
        if self.pending:
            idx = min(self.pending)
            missing = sorted(all_ranks - set(self.pending[idx])
                             - {r for r, n in self.committed.items() if n <= idx})
            if missing:
                return (
                    # (a chunk sent during the begin waits from the engine's start on)
                    max(self.first_arrival[idx], self.engine_started_at) + timeouts.chunk_s,
                    "chunk",
                    f"chunk {idx}",
                    missing,
                )
        missing = sorted(all_ranks - set(self.committed))
        return (
            self.last_progress + timeouts.commit_s,
            "commit",
            "the next chunk or commit",
            missing,
        )

    def names_refusal(self, last_layout: Mapping[str, tuple[str, Sequence[int]]],
                      needs_full_update: bool) -> str:
        """Why this update must fail at its begin, before the pause (issue 35 item 13), or
        '': the engine needs a full update (I4) and the ranks' begins already say that a name
        of the last successful update (``last_layout``: name -> its dtype name and shape
        then, ``EngineSession.last_ok_layout``) will not be sent. The commit's
        ``omitted_refusal`` would refuse the same update only after the pause and every
        chunk, leaving a restarted engine paused on torn weights.

        What the begins say: in rank-local mode the names each rank declares in clear; else
        the manifest (``wire.Begin.manifest``, the same on every rank: a digest of each
        tensor's name, dtype and shape, ``protocol/manifest.py``), where a name counts as
        sent when its digest with its last shape and any dtype of ``wire.DTYPE_SIZES`` is
        there (a dtype may change between rounds; a shape may not, the engine's parameter
        has it). Without a manifest nothing is known before the chunks (the commit decides);
        a new engine session sent none of the last names is left to the commit too (another
        model, ``engine_model_changed``). Family-independent: vLLM and SGLang alike.
        """
        if not (needs_full_update and last_layout):
            return ""
        if self.rank_local:
            sent = {n for names, _, _ in self.declared.values() for n in names}
            missing = [n for n in last_layout if n not in sent]
            how = "the tensors the ranks declare"
        elif self.manifest:
            m = self.manifest
            digests = {m[i:i + DIGEST_BYTES] for i in range(0, len(m), DIGEST_BYTES)}
            missing = [n for n, (dt, shape) in last_layout.items()
                       if manifest_of([(n, dt, shape)]) not in digests]
            missing = [n for n in missing if not any(  # (another dtype, the same shape)
                manifest_of([(n, dt, last_layout[n][1])]) in digests for dt in DTYPE_SIZES)]
            how = ("the ranks' manifests; a name sent with another shape counts as left "
                   "out")
        else:
            return ""
        if not missing or (self.new_session and len(missing) == len(last_layout)):
            return ""
        names = sorted(missing)
        return (f"the slot needs a full update (after a failed one, a restarted or sleeping "
                f"engine), but the ranks' begins of update {self.update_id} leave out "
                f"{len(names)} of the {len(last_layout)} tensor names the last successful "
                f"update loaded: {some_names(names, 20)}; publish every tensor (found at the "
                f"begin, from {how})")

    def omitted_refusal(self, last_ok_names: frozenset[str], needs_full_update: bool,
                        policy: str, draft: bool = False) -> str:
        """Why this update, all loaded and committed, must not finish for what it leaves out
        of ``last_ok_names`` (the slot's last successful update's tensor names): the engine
        needs a full update (I4: finishing would resume half-loaded weights), or ``policy``
        (``Config.omitted_names``) is ``"refuse"``; '' if it may finish. ``draft``: the
        same for the draft session (``draft_names`` against the draft's last names)."""
        missing = last_ok_names - (self.draft_names if draft else self.names)
        names = sorted(missing)
        who, kind = ("the slot's draft model", "draft ") if draft else ("the slot", "")
        if missing and needs_full_update:
            return (
                f"{who} needs a full update (after a failed one, a restarted or sleeping "
                f"engine), but update {self.update_id} misses {len(names)} of the "
                f"{len(last_ok_names)} {kind}tensor names the last successful update loaded: "
                f"{some_names(names)}; publish every tensor")
        if missing and policy == "refuse":
            return (
                f"update {self.update_id} leaves out {len(names)} {kind}tensor names the "
                "slot's last "
                f"successful update loaded: {some_names(names)} (vLLM would keep their old "
                "values; omitted_names = \"refuse\")")
        return ""


@dataclass(frozen=True, slots=True)
class BeginStep:
    """What the begin does next (``begin_step``): send ``stage``'s calls together; or one
    ``check_replies`` call (``check``); or fail the update with ``fail`` (phase ``begin``); or,
    with none of them, wait (a stage in flight, a rank to begin or register, no chunk yet)."""

    stage: Stage | None = None
    check: bool = False
    fail: str = ""


WAIT = BeginStep()


def begin_step(u: Update, engine: EngineSession, ranks: dict[int, RankInfo], size: int,
               calls_out: bool, engine_url: str | None,
               family: EngineFamily | None = None) -> BeginStep:
    """The next begin stage of update ``u`` whose condition holds (the rules at the top and
    ``BEGIN_STAGES``), for a slot of ``size`` ranks of which ``ranks`` registered, on the
    engine at ``engine_url`` that ``engine`` describes, of engine ``family`` (None: no
    family's refusals are asked); ``calls_out``: a call of ``u`` is in flight. Moves
    ``u.stage`` past the stages skipped and the one returned.

    * a stage after the probe fails while the engine's replies are out of step (the probe
      found no new session, which would have cleared it);
    * ``version`` (``GET /version`` and ``GET /server_info``) runs when the engine's vLLM
      version is not known, is refused, its data-parallel layout is refused, or a restart is
      suspected (``session_suspect``); ``version_again`` when the probe found a new session
      and this begin had not asked (the cached version was the old process's) or the engine
      is about to be initialised (not ``initialized``: maybe another process than the one
      asked); the answers are checked before the pause (``Families.version_answer``);
    * ``init`` is skipped for an initialised engine; ``recover`` unless the engine may be
      mid-update and must finish first (``recover_first``) or a start met a session;
    * the first executor stage after a worker's failure (``replies_suspect``) first checks
      the replies line up (``engine_session.CHECK_REPLIES``);
    * stages that touch generation wait for every rank's begin (a rank that never comes fails
      the begin with the engine still serving) and a first chunk (an update of no chunk is
      refused); the pause fails on ranks' GPU UUIDs unlike the engine's (I2).
    """
    if calls_out or len(ranks) < size:
        return WAIT  # a stage in flight; or the slot's last registrations (begin deadline)
    while u.stage < len(BEGIN_STAGES):
        st = BEGIN_STAGES[u.stage]
        if u.stage > STAGE_INDEX["probe"] and engine.out_of_step:
            return BeginStep(fail=engine.out_of_step)
        if st.name in ("version", "version_again"):
            # (version_again also before an init: the daemon initialises an engine process
            # it does not know, e.g. one restarted while idle that the probe cannot tell
            # from the old one, both still at their checkpoint's weight version)
            if u.version_asked or not (
                    (u.new_session or not engine.initialized) if st.name == "version_again"
                    else engine.engine_version is None or engine.version_refused
                    or engine.dp_layout_refused or engine.session_suspect):
                u.stage += 1
                continue
            u.version_asked = True
        if st.name == "init" and engine.initialized:
            u.stage += 1
            continue
        if st.name == "draft" and (not u.draft or engine.draft.supported or (
                family is not None and not family.asks_draft_support)):  # (refused at pause)
            u.stage += 1
            continue
        if st.name == "recover" and not (
                engine.mid_update and (engine.recover_first or u.start_retried)):
            u.stage += 1  # (start first: a start that finds a session ends it)
            continue
        if st.name in EXECUTOR_STAGES and engine.replies_suspect:
            return BeginStep(check=True)
        if st.touches_generation:
            if len(u.begun) < size or not u.sent_count:
                return WAIT
            if st.name == "pause":
                wrong = ((family.rank_local_refusal(u, engine, engine_url)
                          if family is not None and u.rank_local else "")
                         or rank_local.begin_refusal(u, ranks, engine, engine_url)
                         or uuid_mismatch(ranks, engine.declared_gpu_uuids, engine.gpu_uuids,
                                          engine_url))
                if wrong:
                    return BeginStep(fail=wrong)
                wrong = ((family.pause_refusal(u, engine, engine_url) if family is not None
                          else "") or stale_draft_refusal(u, engine)
                         or u.names_refusal(engine.last_ok_layout, engine.needs_full_update))
                if wrong:
                    return BeginStep(fail=wrong)
        u.stage += 1
        return BeginStep(stage=st)
    return WAIT  # start in flight


def stale_draft_refusal(u: Update, engine: EngineSession) -> str:
    """Why update ``u`` must not pause the engine (issue 18), or '': a round without a draft
    part while the engine's draft model needs a full update (a failed draft session, a
    restarted or sleeping engine whose draft the daemon had loaded): the engine would resume
    on a draft model that is half-loaded or stale, so the round must carry the draft model in
    full. (Whether the engine can load a draft at all is its family's: ``pause_refusal``.)"""
    if engine.draft.needs_full_update and not u.draft:
        why = engine.draft.why or "a failed draft session"
        return (f"the engine's draft model needs a full update ({why}), but update "
                f"{u.update_id} has no draft part: "
                "publish the draft model's tensors in full with this round "
                "(Publisher.publish(..., draft=...))")
    return ""

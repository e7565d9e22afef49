"""The per-slot update coordinator: an I/O-free state machine (h11 style).

One ``SlotCoordinator`` per engine slot. The adapter (``slotsync.daemon.service.server``, which runs
actions through ``executor.py``) feeds it events -- rank messages (``on_register``,
``on_message``), engine call results (``on_engine_result``), connection trouble seen by the
engine's HTTP client (``on_connection_lost``) and the clock (``poll``) -- and executes the
actions it returns (``actions.py``):

* ``Reply(identity, msg)``: send a wire message to a rank's socket identity;
* ``EngineCall(call_id, update_id, route, body, slot, index, needs_record)``: one engine
  step (its family's client turns it into HTTP requests); its outcome must come back through
  ``on_engine_result(call_id, ...)``. One begin
  stage at a time per slot (a stage's probes go out together), then up to ``chunks_in_flight``
  ``/update_weights`` calls, so that the engine finds the next chunk's request waiting when it
  finishes one (results may come back in any order; chunks are acknowledged in index order);
* ``UpdateEnded(...)``: an update finished or failed (for metrics and logs);
* ``SlotEvent(slot, event, fields)``: something an operator should read in the log (an engine
  restarted, found asleep, resumed after a failed update, names an update left out).

Its parts live beside it: the engine steps it sends next (``engine_steps.py``: the driver
``_advance``, begin stages, chunk window, finish and resume) and what the engine's answers do
and how an update ends (``outcomes.py``: ``on_engine_result``, ``_fail``, ``_complete``), both
mixed into ``SlotCoordinator``; the update in flight, its phase table, begin stages and which
one goes out next (``update.begin_step``), deadlines (``Timeouts``, ``Update.wait_in_force``)
and omitted-names refusals (``update.py``); chunk intake, merge-ahead, the in-flight window,
ordered acks and the commit's counts (``chunk_window.py``); what is known of the engine
(``engine_session.py``); what the begin's probe answers mean (``probe.py``); what a failure
leaves behind, the engine check after it (``recovery.engine_check``) and a previous daemon's
durable record (``recovery.py``); registration checks (``registration.py``); the ``/status``
entry (``slot_status.py``). Every engine family's rule -- the version stage's answers, what is
refused before the pause, the chunk payload, when a chunk's memory may go back -- it asks the
families it was given (``family.py``: ``Families``, ``EngineFamily``; the daemon's are
``slotsync.daemon.families``): it holds no family's name or rule.

One update's engine calls, stage by stage, are in ``engine_steps.py``'s docstring (design.md
"Flow of one round").

The probe decides what the daemon knows of the engine (design.md I9): a weight version other
than the one it last saw, or a refused/reset connection since (``on_connection_lost``) with no
version of its own to recognise, is a new engine session (restarted at the same URL): it is
initialised again and the update must be a full one (it serves its checkpoint's weights). An
engine found sleeping, or paused by someone else (``/is_sleeping``; in vLLM 0.32 a paused
scheduler counts as sleeping), needs a full update too -- a level-2 sleep discards the
weights -- and is left paused at the end: vLLM resumes it at its full ``/wake_up``.

After a failed update the daemon's view must equal the engine's: if the update had sent
``/start_weight_update`` the engine stays paused and needs a full update (I4); if it had only
paused the engine (or the pause was in flight, its outcome unknown) and the weights were
intact, the coordinator asks ``/is_paused`` once the failed update's calls have returned and
resumes a paused engine (``recovering`` meanwhile).

Invariants held here by construction (design.md): I1 one update per slot and exactly one start
and finish per successful update; I2 a chunk is merged only when complete and consistent
(``aggregation.merge_chunk``) and the ranks' GPU UUIDs equal the engine's where those are known;
I3 chunk acks only after ``update_weights`` returned, commit acks only after finish returned;
I4 resume only after a successful finish, a failed update that started leaves the engine
paused and ``needs_full_update``; I5 every wait has a deadline; I7 all state keyed by update
id, stale ids refused; I8 the version is recorded only with a successful finish; I9 above.
"""

from __future__ import annotations

from enum import StrEnum

from slotsync.daemon.core import begin_agreement, chunk_window, malformed, recovery
from slotsync.daemon.core.actions import Action, EngineCall, Reply, SlotEvent, UpdateEnded
from slotsync.daemon.core.adapters.rounds import AdapterRounds
from slotsync.daemon.core.claim_check import ClaimCheck
from slotsync.daemon.core.engine_session import (
    EngineSession,
)
from slotsync.daemon.core.engine_steps import EngineSteps
from slotsync.daemon.core.family import EngineFamily, Families, HeldErrors, MergeFacts
from slotsync.daemon.core.outcomes import Outcomes
from slotsync.daemon.core.registration import (
    RankInfo,
    rank_held,
    unlike_the_slot,
    wrong_protocol_or_slot,
)
from slotsync.daemon.core.slot_status import slot_status
from slotsync.daemon.core.update import (
    Timeouts,
    Update,
)
from slotsync.protocol import wire
from slotsync.protocol.wire import Abort, Ack, Begin, Chunk, Commit, Error, Register, Registered

__all__ = ["OMITTED_NAMES_POLICIES", "Action", "EngineCall", "Reply", "SlotCoordinator",
           "SlotEvent", "SlotState", "Timeouts", "UpdateEnded"]  # (the actions: actions.py)

OMITTED_NAMES_POLICIES = ("warn", "refuse")
"""What a successful update that leaves out names the slot's last successful update loaded
does (``Config.omitted_names``): ``warn`` (log, metric, ``PublishStats``) or ``refuse``
(fail it before the finish; the engine then needs a full update)."""


class SlotState(StrEnum):
    """What a slot is doing, as ``/status`` reports it."""

    REGISTERING = "registering"  # not every rank of the slot has registered yet
    IDLE = "idle"
    UPDATING = "updating"
    RECOVERING = "recovering"  # after a failed update: checking / restoring the engine's pause
    FAILED = "failed"  # last update failed: engine paused, needs a full update


class SlotCoordinator(AdapterRounds, Outcomes, EngineSteps):
    """State machine of one engine slot ``[start, start + size)`` and its engine.

    Args:
        start: first global rank of the slot.
        size: number of ranks (= GPUs = the engine's world size).
        timeouts: deadlines for waits on ranks.
        daemon_version: reported to ranks at registration.
        chunks_in_flight: most ``/update_weights`` calls in flight at once (>= 1). vLLM runs
            them one after the other in arrival order (its engine core's utility calls), so a
            second one only waits there -- and is ready the moment the first returns, instead
            of after its answer, the acks and this daemon's next turn. 1 keeps vLLM's own
            examples' order (each call after the previous one returned).
        omitted_names: ``"warn"`` or ``"refuse"`` (see ``OMITTED_NAMES_POLICIES``).
        max_message_bytes: the daemon's frame cap in bytes, told to each rank in
            ``Registered`` (0: unknown).
        families: the engine families it may meet (``core/family.py``; the daemon's are
            ``slotsync.daemon.families.FAMILIES``), asked every family's rule.

    Raises:
        ValueError: ``chunks_in_flight`` < 1, or an unknown ``omitted_names`` policy.
    """

    def __init__(
        self, start: int, size: int, timeouts: Timeouts | None = None, daemon_version: str = "",
        chunks_in_flight: int = 3, omitted_names: str = "warn", max_message_bytes: int = 0,
        families: Families | None = None,
    ) -> None:
        if chunks_in_flight < 1:
            raise ValueError(f"chunks_in_flight must be >= 1, got {chunks_in_flight}")
        if omitted_names not in OMITTED_NAMES_POLICIES:
            raise ValueError(f"omitted_names must be one of {OMITTED_NAMES_POLICIES}, got "
                             f"{omitted_names!r}")
        self.chunks_in_flight = chunks_in_flight
        self.omitted_names = omitted_names
        self.max_message_bytes = max_message_bytes
        self._families = families
        self.start = start
        self.size = size
        self.timeouts = timeouts or Timeouts()
        self.daemon_version = daemon_version
        self.ranks: dict[int, RankInfo] = {}
        self.engine_url: str | None = None
        self.packed: bool | None = None
        self.transport: str | None = None
        self.engine = EngineSession()  # what the daemon knows of the engine (I4, I9)
        self._failed_call: tuple[str, str] | None = None  # (route, error) of the last failure
        self.next_update_id = 0
        self.current: Update | None = None
        self.last_version: str | None = None
        self.last_error: str | None = None
        self.last_duration_s: float | None = None
        self.last_outcome: str | None = None
        self.last_success: tuple[float, float] | None = None  # (ended at, seconds) of the last ok
        self._failed: tuple[int, str] | None = None  # (update id, message) of the last failure
        self.updates_ok = 0
        self.updates_failed = 0
        self.engine_calls: dict[str, int] = {}  # route -> calls issued (for status and tests)
        self._call_id = 0
        self._calls: dict[int, EngineCall] = {}  # call id -> call in flight for `current`
        # Calls of an update that failed while they were in flight: the next update's engine
        # calls wait for them (vLLM queues calls in arrival order, but two HTTP requests may
        # overtake each other before they reach its engine core).
        self._orphans: dict[int, str] = {}  # call id -> route
        # A failed update's errors to its ranks, held until no call of it that may still read
        # their memory is at the engine (SGLang's chunk calls: _fail, family.HeldErrors)
        self._held_errors = HeldErrors()
        # After a failed update that paused (or may have paused) an engine whose weights are
        # intact: once the orphans returned, ask /is_paused and resume it (_maintain).
        self._reconcile = False
        self._maintenance: dict[int, EngineCall] = {}  # its calls in flight
        self._pending_url: str | None = None  # engine table reload during an update
        # an undeclared slot's claim, checked against its engine (SlotTable sets it)
        self.claims: ClaimCheck | None = None
        self._init_adapters()  # (its adapter rounds, issue 36: adapters/rounds.py)

    # ------------------------------------------------------------------ properties

    @property
    def families(self) -> Families:
        """The engine families (``Families``) this slot asks."""
        if self._families is None:
            raise RuntimeError("a SlotCoordinator needs its engine families (families=)")
        return self._families

    @property
    def family(self) -> EngineFamily:
        """The engine's family (an engine of unknown kind: the default one)."""
        return self.families.of(self.engine)

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def slot(self) -> tuple[int, int]:
        return (self.start, self.end)

    @property
    def state(self) -> SlotState:
        if self.current is not None or self.adapter_round is not None:
            return SlotState.UPDATING
        if self.claims is not None and self.claims.held:  # (its engine asked: claim_check.py)
            return SlotState.REGISTERING
        if self._reconcile or self._maintenance:
            return SlotState.RECOVERING
        if self.engine.needs_full_update or self.engine.draft.needs_full_update:
            # (before "registering": the engine is paused anyway)
            return SlotState.FAILED
        if len(self.ranks) < self.size:
            return SlotState.REGISTERING
        return SlotState.IDLE

    def wait_in_force(self) -> tuple[float, str, str, list[int]] | None:
        """``(deadline, phase, what, missing ranks)`` of the wait on ranks in force (none
        while engine calls are out: the HTTP client bounds them); ``wait_report.py``."""
        return self._deadline()

    def next_deadline(self) -> float | None:
        """Monotonic time at which ``poll`` must next be called, or None."""
        d = self._deadline()
        return d[0] if d else None

    # ------------------------------------------------------------------ events

    def on_register(self, identity: bytes, msg: Register, now: float,
                    peer_pid: int = 0) -> list[Action]:
        """A rank registers (or re-registers after a reconnect). ``peer_pid``: the kernel's pid
        of the connection's process (SO_PEERCRED), 0 if unknown.

        Refused (``Error(phase="register")`` to that identity only) when: the protocol version
        differs, the slot differs from this coordinator's, another live process holds the rank
        (both named: two processes with one rank), the engine URL / packed mode /
        transport differs from ranks already registered, or another rank holds its GPU UUID.
        A re-registration of a rank that already took part in the update in flight fails that
        update (the rank restarted mid-round); one that had not yet begun just replaces its
        connection. A re-registration with another engine / mode / transport while no update
        is in flight is a new trainer job: the slot starts afresh (the other ranks' old
        registrations are dropped; their publishers register again at their next begin).
        An undeclared slot's first registrations wait for the engine's worker count
        (``claims``, ``claim_check.py``; refused when the engine has fewer workers).
        """

        if self.claims is not None and self.claims.needed(msg, bool(self.ranks)):
            # (claim_check.py: an undeclared slot's first registrations wait for the engine)
            if not self.claims.hold(identity, msg, peer_pid):
                return []
            self.claims.url_before, self.engine_url = self.engine_url, msg.engine_url
            return [self._maintenance_call("get_world_size")]

        def refuse(text: str) -> list[Action]:
            out: list[Action] = [Reply(identity, Error("register", text, list(self.slot), None,
                                                       []))]
            if self.current is not None and not self.current.start_sent:
                # A begin is waiting for this slot's registrations: tell every rank now
                # rather than let them sit until the begin deadline.
                out += self._fail(now, "register", text, [msg.rank])
            return out

        why = wrong_protocol_or_slot(msg, self.slot)
        if why:
            return refuse(why)
        why = rank_held(self.ranks.get(msg.rank), identity, msg, peer_pid)
        if why:
            # (not refuse(): the update in flight belongs to the live holder, not to this one)
            return [Reply(identity, Error("register", why, list(self.slot), code=wire.RANK_HELD))]
        if (
            msg.rank in self.ranks
            and self.current is None
            and (msg.engine_url, msg.packed, msg.transport)
            != (self.engine_url, self.packed, self.transport)
        ):
            dropped = sorted(r for r in self.ranks if r != msg.rank)
            self.ranks.clear()
            if msg.engine_url != self.engine_url:
                self.set_engine_url(msg.engine_url)  # a new engine: unknown state, new init
            self.engine.initialized = False
            prev = f"; before that: {self.last_error}" if self.last_error else ""
            again = f", ranks {dropped} must register again" if dropped else ""
            self.last_error = (f"rank {msg.rank} re-registered with engine {msg.engine_url!r} "
                               f"(packed={msg.packed}, {msg.transport}): slot reset"
                               f"{again}{prev}")[:4000]
        others = {r: i for r, i in self.ranks.items() if r != msg.rank}
        if others:
            why = unlike_the_slot(msg, self.slot, others, self.engine_url, self.packed,
                                  self.transport)
            if why:
                return refuse(why)
        elif msg.engine_url != self.engine_url or msg.packed != self.packed:
            # First (or only) rank sets the slot's engine; a new engine means a new init.
            self.engine.initialized = False
        actions: list[Action] = []
        u = self.current
        if msg.rank in self.ranks and u is not None and (
            msg.rank in u.begun or msg.rank in u.sent_count
        ):
            actions += self._fail(
                now, "register", f"{self.ranks[msg.rank].who} re-registered during update "
                f"{u.update_id} (now pid {peer_pid or msg.pid}): its process restarted or "
                "reconnected mid-round", [msg.rank]
            )
        self.engine_url, self.packed, self.transport = msg.engine_url, msg.packed, msg.transport
        self.ranks[msg.rank] = RankInfo(msg.rank, identity, msg.gpu_uuid, msg.hostname, msg.pid,
                                        peer_pid, last_seen=now)
        actions.append(
            Reply(
                identity,
                Registered(
                    msg.rank,
                    self.start,
                    self.size,
                    self.next_update_id,
                    wire.PROTOCOL_VERSION,
                    self.daemon_version,
                    self.max_message_bytes,
                    self.timeouts.begin_s,
                    self.timeouts.chunk_s,
                    list(begin_agreement.SETTINGS),
                ),
            )
        )
        return actions + self._advance(now)  # a begin may have waited for this rank

    def on_message(self, rank: int, msg: Begin | Chunk | Commit | Abort, now: float) -> list:
        """A registered rank of this slot sent ``msg``. Returns actions."""
        if isinstance(msg, Begin):
            return self._on_begin(rank, msg, now)
        if isinstance(msg, Chunk):
            return self._on_chunk(rank, msg, now)
        if isinstance(msg, Commit):
            return self._on_commit(rank, msg, now)
        if isinstance(msg, Abort):
            u = self.current
            if u is None or msg.update_id != u.update_id:
                return self._not_current(rank, "abort", "abort", msg.update_id)
            why = f": {msg.reason}" if msg.reason else ""
            return self._fail(now, "abort", f"rank {rank} aborted update {u.update_id}{why}", [])
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def on_bad_message(self, rank: int, err: wire.ProtocolError, now: float) -> list[Action]:
        """Registered rank ``rank`` sent a frame that failed validation (``err``): the update
        in flight fails at once naming the rank, the message kind and the field, every rank
        told; else only the rank is told (``malformed.py``)."""
        text = malformed.describe(rank, err)
        if malformed.fails_update(err, self.current and self.current.update_id):
            return self._fail(now, malformed.phase_of(err), text, [])
        return self._rank_error(rank, malformed.phase_of(err), text, err.update_id)

    def on_connection_lost(self, now: float) -> list[Action]:
        """The engine's HTTP client saw a refused or reset connection (counted by
        ``VllmClient.connection_errors``): the engine may have restarted at the same URL. The
        next begin's probe then treats a weight version it cannot recognise as a new session
        (design.md I9). Returns no actions."""
        self.engine.session_suspect = True
        return []

    def on_rank_gone(self, rank: int, identity: bytes, now: float, why: str,
                     released: bool = False) -> list[Action]:
        """Rank ``rank``'s connection ``identity`` closed or its process exited (``why``, e.g.
        "its process (pid 12) exited"): ``on_ranks_gone`` for one rank."""
        return self.on_ranks_gone([(rank, identity)], now, why, released)

    def on_ranks_gone(self, gone: list[tuple[int, bytes]], now: float, why: str,
                      released: bool = False) -> list[Action]:
        """Ranks' connections (``(rank, identity)``) closed, for one reason ``why``. An update
        in flight that still needs any of them fails at once, naming every one it needs
        (issue 35: a relaying node's link lost names all its ranks, not the first); one they
        committed to goes on (it needs nothing more of them), unless ``released``: they live
        on and were told the update failed, so they free their staging memory while the
        engine may still load from it (a relayed rank whose node's link went down, issue 25).
        A connection a rank no longer uses is ignored."""
        u, out, needed = self.current, [], []
        for rank, identity in gone:
            info = self.ranks.get(rank)
            if info is None or info.identity != identity or info.gone_at is not None:
                continue
            info.gone_at, info.gone_why = now, why
            need = u is not None and (rank not in u.committed or released)
            out.append(SlotEvent(self.slot, "rank_gone", {
                "rank": rank, "pid": info.peer_pid or info.pid, "host": info.hostname,
                "why": why, "update_id": u.update_id if u is not None else None}, warning=need))
            needed += [info] if need else []
        if needed:
            who = needed[0].who + " is" if len(needed) == 1 else "ranks " + ", ".join(
                f"{i.rank} ({i.process})" for i in needed) + " are"
            out += self._fail(now, "rank_gone", f"{who} gone: {why}", [i.rank for i in needed])
        return out

    def on_rank_seen(self, rank: int, identity: bytes, now: float) -> None:
        """A message from ``rank`` on ``identity``: it lives (a connection seen closed that
        reconnected under the same identity, e.g. after a heartbeat timeout, counts again)."""
        info = self.ranks.get(rank)
        if info is not None and info.identity == identity:
            info.last_seen = now
            info.gone_at, info.gone_why = None, ""

    def gone_ranks(self) -> list[RankInfo]:
        """Registered ranks whose connection or process is gone."""
        return [i for i in self._by_rank() if i.gone_at is not None]

    def vacant_since(self) -> float | None:
        """Monotonic time since which every registered rank is gone and nothing runs for the
        slot (no update, engine check or orphaned call): the slot may be released then. None
        while a rank lives, something runs, or no rank is registered."""
        if not self.ranks or self.busy():
            return None
        times = [i.gone_at for i in self.ranks.values()]
        return None if any(t is None for t in times) else max(t for t in times if t is not None)

    def busy(self) -> bool:
        """Whether an update, an engine check or a late call of a failed update runs."""
        return bool(self.current is not None or self._reconcile or self._maintenance
                    or self._orphans or self.adapter_busy())

    def release(self) -> list[RankInfo]:
        """Forget every registered rank (the job is gone; the slot is free for another
        topology). What the daemon knows of the engine stays (paused, needs a full update, the
        last update's names): see ``adopt_engine``. Returns the ranks forgotten.

        Raises:
            RuntimeError: something runs for the slot (``busy``).
        """
        if self.busy():
            raise RuntimeError(f"slot [{self.start}, {self.end}) is busy; cannot release it")
        gone = self._by_rank()
        self.ranks.clear()
        self.packed = self.transport = None  # the next job chooses
        self.engine.initialized = False
        return gone

    def adopt_engine(self, old: SlotCoordinator) -> None:
        """Take over what released slot ``old`` knew of the same engine: the next job's first
        update is a full one if the engine was left paused, mid-update or out of step."""
        self.engine_url = old.engine_url
        self.engine.take_over(old.engine)
        for name in ("last_version", "last_error", "last_outcome", "last_success", "_failed"):
            setattr(self, name, getattr(old, name))
        self.next_update_id = max(self.next_update_id, old.next_update_id)

    def restore_mid_update(self, engine_url: str, update_id: int, weight_version: str,
                      state: str) -> None:
        """A previous daemon left this slot's engine mid-update (durable record): keep it
        paused and marked as needing a full update; the next round first ends any half-open
        session (finish, tolerating the 500), then sends everything (design.md I4;
        ``recovery.restore``)."""
        self.engine_url = engine_url
        recovery.restore(self.engine, engine_url, state)
        self.next_update_id = max(self.next_update_id, update_id + 1)
        self.last_outcome = "failed"
        self._failed = (update_id, recovery.RESTARTED_DURING_UPDATE)
        self.last_error = recovery.restored_error(self.slot, update_id, weight_version, state)

    def mid_update_state(self) -> tuple[str, int, str] | None:
        """``(state, update_id, weight_version)`` if the engine may hold half-loaded weights,
        else None (``recovery.mid_update_state``)."""
        return recovery.mid_update_state(self.current, self._failed, self.next_update_id,
                                         self.engine)

    def set_engine_url(self, url: str) -> None:
        """Point the slot at another engine (engine table reload): at once when idle, else
        when the update in flight ends. The new engine is initialized before its first
        update."""
        if self.current is None and not self.adapter_busy():
            self.engine_url = url
            self.engine.forget()  # another engine: nothing known about its weights
            self._pending_url = None
        else:
            self._pending_url = url

    # ------------------------------------------------------------------ status

    def status(self, now: float | None = None) -> dict:
        """A JSON-able snapshot for ``/status`` (``slot_status.slot_status``); ``now``:
        monotonic seconds (rank ages)."""
        return slot_status(self, now)

    def by_rank(self) -> list[RankInfo]:
        """The registered ranks in rank order."""
        return self._by_rank()

    def calls_in_flight(self) -> list[EngineCall]:
        """The current update's engine calls in flight, oldest first."""
        return list(self._calls.values())

    # ------------------------------------------------------------------ internals

    def _by_rank(self) -> list[RankInfo]:
        return [self.ranks[r] for r in sorted(self.ranks)]

    def _rank_error(self, rank: int, phase: str, text: str, update_id: int | None) -> list[Action]:
        """An error for one rank's message that does not touch the update in flight."""
        info = self.ranks[rank]
        return [Reply(info.identity, Error(phase, text, list(self.slot), update_id, [], False))]

    def _not_current(self, rank: int, phase: str, what: str, update_id: int) -> list[Action]:
        u = self.current
        if self._failed is not None and self._failed[0] == update_id:
            text = f"{what}: update {update_id} already failed: {self._failed[1]}"
        else:
            cur = "none" if u is None else str(u.update_id)
            text = f"{what} for update {update_id}, but the update in flight is {cur}"
        failed = self._failed is not None and self._failed[0] == update_id
        return self._held_errors.late(self._rank_error(rank, phase, text, update_id), failed)

    def _on_begin(self, rank: int, msg: Begin, now: float) -> list[Action]:
        u = self.current
        if u is not None and msg.update_id == u.update_id:
            if msg.weight_version != u.weight_version:
                return self._fail(
                    now,
                    "begin",
                    f"rank {rank} begins update {u.update_id} with version "
                    f"{msg.weight_version!r}, other ranks with {u.weight_version!r}",
                    [],
                )
            if rank in u.begun:
                return self._rank_error(
                    rank, "begin", f"rank {rank} began update {u.update_id} twice", u.update_id
                )
            # Begins that disagree are refused before the pause, once every rank has begun
            # (begin_agreement.py): each rank learns the cause
            why, at = begin_agreement.disagreement(u, rank, msg)
            if why and u.begin_refusal is None:
                u.begin_refusal = (why, at)
            u.begun.add(rank)
            u.last_progress = now
            if u.begin_refusal is not None and len(u.begun) == self.size:
                out = self._fail(now, "begin", u.begin_refusal[0], [])
                for a in out:
                    if isinstance(a, Reply) and isinstance(a.msg, Error):
                        a.msg.tensor_index = u.begin_refusal[1]
                return out
            if u.engine_started:
                return [Reply(self.ranks[rank].identity, Ack(u.update_id, "begin"))]
            return self._advance(now)  # the last rank's begin lets the pause go out
        if u is not None:
            return self._rank_error(
                rank,
                "begin",
                f"update {u.update_id} is in flight for slot [{self.start}, {self.end}); "
                f"refusing a second update {msg.update_id}",
                msg.update_id,
            )
        if msg.update_id < self.next_update_id:
            return self._rank_error(
                rank,
                "begin",
                f"stale update id {msg.update_id}: this slot's next update id is "
                f"{self.next_update_id}",
                msg.update_id,
            )
        u = Update(msg.update_id, msg.weight_version, now, {rank}, now, last_progress=now,
                    weights_intact=not (self.engine.needs_full_update
                                        or self.engine.draft.needs_full_update),
                    manifest=msg.manifest, manifest_rank=rank, draft=msg.draft)
        begin_agreement.take_first(u, rank, msg)
        self.current = u  # its begin stages (the table at the top) run from _advance
        return self._advance(now)  # (a gone rank gets gone_s to come back: _deadline)

    def _on_chunk(self, rank: int, msg: Chunk, now: float) -> list[Action]:
        u = self.current
        if u is None or msg.update_id != u.update_id:
            return self._not_current(rank, "chunk", f"chunk {msg.index}", msg.update_id)
        # A rank sends chunks right after its begin, without waiting for the begin's ack: they
        # are merged while the engine is paused and started, and go out once it has started.
        why = chunk_window.receive(u, rank, msg, now, self.size, self._merge_facts())
        if why:
            return self._fail(now, "chunk", why, [])
        return self._advance(now)

    def _merge_facts(self) -> MergeFacts:
        return MergeFacts(
            {r: i.gpu_uuid for r, i in self.ranks.items()}, bool(self.packed),
            self.transport or "cuda", self.engine.world_size or self.size,
            self.families.known(self.engine),
            self.engine.declared_gpu_uuids or self.engine.gpu_uuids)

    def _on_commit(self, rank: int, msg: Commit, now: float) -> list[Action]:
        u = self.current
        if u is None or msg.update_id != u.update_id:
            return self._not_current(rank, "commit", "commit", msg.update_id)
        refused = chunk_window.commit(u, rank, msg.num_chunks, self.size, now)
        if refused is not None and not refused.fails:
            return self._rank_error(rank, "commit", refused.text, u.update_id)
        if refused is not None:
            return self._fail(now, "commit", refused.text, list(refused.missing))
        chunk_window.merge_completed(u, self.size, self._merge_facts())  # (rank-local)
        return self._advance(now)

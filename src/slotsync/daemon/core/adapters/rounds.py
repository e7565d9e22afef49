"""A slot's adapter rounds (issue 36 D): the adapter half of ``coordinator.SlotCoordinator``
(a mixin, as ``outcomes.py`` and ``engine_steps.py`` are; I/O-free, its attributes are the
coordinator's), and the engine's ``AdapterLedger`` (``EngineSession.adapters``) it keeps.

One round (``round.py`` has its phases), every engine step an ``EngineCall`` whose answer
comes back through ``on_engine_result`` (``_on_adapter_result``), the folder an
``AdapterFiles`` whose outcome comes back through ``on_adapter_files``::

    every rank's AdapterBegin ─► gather (agreement, tiling: gather.py); refused before any
      engine call: a slot over several nodes (not yet), an engine paused or mid-update, a
      family without adapters, a version not above the one served
    ─► version, server_info (the base round's version stage: the engine's kind, version and
       layout, through the families) ─► the engine's list of adapters (its restarts: the
       ledger's versions it no longer lists are loaded again from their folders, or lost)
    ─► refused before any change: LoRA off, r above max_lora_rank, too many adapters for
       max_loras, the version again (with what the engine lists)
    ─► Ack(adapter_begin, transport) to every rank; strays unloaded, lost versions reloaded
    ─► every rank's AdapterData (its handle checked: round.handle_refusal)
    ─► "host": AdapterFiles (the daemon writes the folder) ─► load (``adapter_load_s``)
    ─► "device" over several TP ranks: a call that proves every copy done (SGLang's)
    ─► Ack(adapter_data, served_name) to every rank; log adapter_loaded; the round ends
    ─► unload of the previous version (its folder kept one more round: ledger.retire)

Rules held here: an adapter round and a base-weight round never overlap on a slot (a base
``Begin`` during an adapter round before its ``Ack(adapter_data)`` is refused, and an
``AdapterBegin`` during a base round; their engine calls never interleave: each waits for the
other's calls, ``engine_steps._advance``, e.g. for the previous version's unload that follows
a round's ``Ack(adapter_data)``); they share the update id sequence. A failure
(a rank gone or silent past its deadline, a malformed message, an engine error) fails the
round with one ``Error`` to every rank naming the version that stays served, once every call
of the round returned, and a load that was sent is undone first (its name unloaded, or kept
as a stray the next round unloads). After a successful base round the engine's list is read
and the versions it lost (a restart) are loaded again before that round's ``Ack(commit)``
(those the daemon has no folder of are marked lost). Between rounds the idle watch looks
(``watch.py``).
"""

from __future__ import annotations

from typing import Any

from slotsync.daemon.core import malformed
from slotsync.daemon.core.actions import (
    Action,
    AdapterFiles,
    EngineCall,
    RemoveAdapterFiles,
    Reply,
    SlotEvent,
)
from slotsync.daemon.core.adapters.answers import AdapterAnswers
from slotsync.daemon.core.adapters.gather import (
    AdapterRefused,
    gather,
    limits_refusal,
    version_refusal,
)
from slotsync.daemon.core.adapters.ledger import (
    LOADING,
    LOST,
    SERVED,
    AdapterEntry,
    AdapterLedger,
    Reconciled,
)
from slotsync.daemon.core.adapters.rank_waits import AdapterRankWaits
from slotsync.daemon.core.adapters.round import AdapterPhase, AdapterRound, handle_refusal
from slotsync.daemon.core.adapters.watch import AdapterWatch, found_plan
from slotsync.daemon.core.engine_session import CHECK_REPLIES
from slotsync.daemon.core.registration import split_relayed
from slotsync.daemon.core.update import Update
from slotsync.protocol.errors import (
    ADAPTER_FAILED,
    ADAPTER_FILES_FAILED,
    ADAPTER_REFUSED,
    BAD_MESSAGE,
    DAEMON_STOPPING,
    ENGINE_FAILED,
    ENGINE_UNFIT,
    ROUND_IN_FLIGHT,
    VERSION_REFUSED,
)
from slotsync.protocol.wire import (
    Ack,
    AdapterBegin,
    AdapterData,
    Begin,
    Error,
    ProtocolError,
)

INFO_ROUTES = ("version", "server_info")
"""The info stage's first steps: the base round's version stage (``update.BEGIN_STAGES``),
read by the families (the engine's kind, version and layout, and its limits)."""

SPANNING_REFUSAL = (
    "adapter rounds on an engine whose ranks are on several nodes are not built yet (issue "
    "36): this slot has rank(s) {ranks} relayed from another node's daemon; publish adapters "
    "to engines of one node")


class AdapterRounds(AdapterWatch, AdapterAnswers, AdapterRankWaits):
    """The adapter half of ``SlotCoordinator`` (the module docstring; the idle watch of the
    engine's adapters: ``watch.py``; the rounds' ranks and deadlines: ``rank_waits.py``)."""

    # ------------------------------------------------------------------ set-up, questions

    def _init_adapters(self) -> None:
        self.adapter_round: AdapterRound | None = None
        self._adapter_calls: dict[int, tuple[str, str, float]] = {}  # id -> purpose, name, t
        self._adapter_held: list[Action] = []  # a base round's acks while adapters reload
        self.adapter_last_error: str | None = None
        self.adapter_last_failed = (-1, "")  # (update id, code) of the last failed round
        self.adapter_aborted: tuple[int, set[int]] | None = None  # adapter_abort: id, told
        self.adapter_left: dict[int, Any] = {}  # rank -> RankInfo of a gone job (rank_waits)
        self.adapter_rounds_ok = self.adapter_rounds_failed = 0
        self._init_watch()  # (the idle watch: watch.py)

    @property
    def adapters(self) -> AdapterLedger:
        """The slot's engine's ledger (``EngineSession.adapters``)."""
        return self.engine.adapters

    def adapter_busy(self) -> bool:
        """An adapter round, an adapter call, a reload after a restart or a look of the
        idle watch is under way."""
        return bool(self.adapter_round is not None or self._adapter_calls or self._adapter_held
                    or self.watch_busy())

    def _adapter_support(self) -> Any:
        """The engine's family's ``AdapterSupport`` (None: kind not known, or no adapters)."""
        family = self.families.known(self.engine)
        return getattr(family, "adapters", None) if family is not None else None

    def adapter_refuses_begin(self, rank: int, msg: Begin) -> list[Action]:
        """The refusal of a base ``Begin`` while an adapter round has not yet answered its
        ranks (``[]``: none; once it did, the base round's calls wait for its unload)."""
        a = self.adapter_round
        if a is None:
            return []
        return self._adapter_rank_error(
            rank, "begin", f"adapter round {a.update_id} ({a.lora}) is in flight for slot "
            f"[{self.start}, {self.end}): a base-weight update never overlaps an adapter "
            "round on one engine; publish the weights once the adapter's round returned",
            msg.update_id, ROUND_IN_FLIGHT)

    # ------------------------------------------------------------------ rank events

    def on_adapter_message(self, rank: int, msg: AdapterBegin | AdapterData,
                           now: float) -> list[Action]:
        """A registered rank of this slot sent ``msg``. Returns actions."""
        if isinstance(msg, AdapterBegin):
            return self._on_adapter_begin(rank, msg, now)
        return self._on_adapter_data(rank, msg, now)

    def _on_adapter_begin(self, rank: int, msg: AdapterBegin, now: float) -> list[Action]:
        a = self.adapter_round
        if self.current is not None:
            return self._adapter_rank_error(
                rank, "adapter_begin", f"base-weight update {self.current.update_id} is in "
                f"flight for slot [{self.start}, {self.end}): an adapter round never overlaps "
                "it on one engine; publish the adapter once the weights' publish returned",
                msg.update_id, ROUND_IN_FLIGHT)
        uid, code = self.adapter_last_failed
        if msg.update_id == uid and self.adapter_last_error and (a is None or a.update_id != uid):
            return self._adapter_told_failed(rank)  # (a begin late for a round that failed)
        if a is not None and a.update_id != msg.update_id:
            return self._adapter_rank_error(
                rank, "adapter_begin", f"adapter round {a.update_id} ({a.lora}) is in flight "
                f"for slot [{self.start}, {self.end}); refusing a second round {msg.update_id}",
                msg.update_id, ROUND_IN_FLIGHT)
        if a is None:
            if msg.update_id < self.next_update_id:
                return self._adapter_rank_error(
                    rank, "adapter_begin", f"stale update id {msg.update_id}: this slot's "
                    f"next update id is {self.next_update_id}", msg.update_id, BAD_MESSAGE)
            # (the id is shared with base rounds; the slot's next id moves on when the round
            # ends, as a base update's does: a rank registering while the round waits for
            # its begin is told this round's id, and joins it)
            a = self.adapter_round = AdapterRound(msg.update_id, now)
        if rank in a.begins:
            return self._adapter_rank_error(rank, "adapter_begin", f"rank {rank} began adapter "
                                            f"round {a.update_id} twice", a.update_id,
                                            BAD_MESSAGE)
        a.begins[rank] = msg
        if len(a.begins) < self.size or a.phase is not AdapterPhase.BEGIN:
            return []
        return self._adapter_begun(a, now)

    def _adapter_begun(self, a: AdapterRound, now: float) -> list[Action]:
        """Every rank began: gather the plan and refuse what can be told without the engine."""
        try:
            a.plan = plan = gather(a.begins)
        except AdapterRefused as e:
            return self._adapter_fail(now, "adapter_begin", str(e), code=ADAPTER_REFUSED)
        relayed = [i.rank for i in self._by_rank() if split_relayed(i.identity)]
        why = SPANNING_REFUSAL.format(ranks=", ".join(map(str, relayed))) if relayed else ""
        code = ENGINE_UNFIT
        if not why and (self.engine.paused or self.engine.mid_update):
            why = (f"engine {self.engine_url} is paused or may be mid-update (a base-weight "
                   "update failed, or it was found asleep): the next base-weight round, a full "
                   "one, resumes it; adapter rounds wait for that")
        support = self._adapter_support()
        family = self.families.known(self.engine)
        if not why and family is not None and support is None:
            why = self._no_adapters(family)
        if not why and support is not None:
            why, code = support.refusal(plan), ADAPTER_REFUSED
        if not why:  # (the same version may be one the engine lost: told by its list)
            cur = self.adapters.current(plan.lora_name)
            why = version_refusal(plan, cur and cur.version, True, self.engine_url)
            code = VERSION_REFUSED
        if why:
            return self._adapter_fail(now, "adapter_begin", why, code=code)
        a.phase = AdapterPhase.INFO
        a.stub = Update(a.update_id, "", now)  # (what the families read the answers into)
        a.stub.kind_asked = self.engine.kind is None
        return self._advance(now)

    def _no_adapters(self, family: Any) -> str:
        return (f"engine {self.engine_url} is {family.display}, into which slotsyncd loads no "
                "LoRA adapters")

    def _adapter_rank_error(self, rank: int, phase: str, text: str, update_id: int | None,
                            code: str) -> list[Action]:
        """An error (with its ``code``) for one rank's message, the round in flight untouched
        (``_rank_error`` with a code)."""
        info = self.ranks[rank]
        return [Reply(info.identity, Error(phase, text, list(self.slot), update_id, [], False,
                                           code))]

    def _on_adapter_data(self, rank: int, msg: AdapterData, now: float) -> list[Action]:
        a = self.adapter_round
        if a is not None and msg.update_id == a.update_id and a.failure is not None:
            return self._adapter_rank_error(rank, "adapter_data", f"adapter data for round "
                                            f"{a.update_id}, which failed: {a.failure[1]}",
                                            a.update_id, a.failure_code or ADAPTER_FAILED)
        if a is None or msg.update_id != a.update_id:
            cur = "none" if a is None else str(a.update_id)
            if self.adapter_last_error and f"adapter round {msg.update_id} " in \
                    self.adapter_last_error:
                cur += f"; round {msg.update_id} failed: {self.adapter_last_error}"
            code = (self.adapter_last_failed[1] if msg.update_id == self.adapter_last_failed[0]
                    else BAD_MESSAGE)
            return self._adapter_rank_error(rank, "adapter_data", f"adapter data for update "
                                            f"{msg.update_id}, but the adapter round in flight "
                                            f"is {cur}", msg.update_id, code)
        if a.phase is not AdapterPhase.DATA:
            return self._adapter_fail(now, "adapter_data", f"rank {rank} sent its adapter data "
                                      "before the daemon acknowledged every begin (its "
                                      "Ack(adapter_begin) names the transport)", [rank],
                                      BAD_MESSAGE)
        if rank in a.data:
            return self._adapter_fail(now, "adapter_data", f"rank {rank} sent its adapter "
                                      "data twice", [rank], BAD_MESSAGE)
        why = handle_refusal(rank, msg.handle, a.part_nbytes(rank), a.transport,
                             self.transport)
        if why:
            return self._adapter_fail(now, "adapter_data", why, [rank], BAD_MESSAGE)
        a.data[rank] = msg.handle
        return self._advance(now) if len(a.data) == self.size else []

    def adapter_bad_message(self, rank: int, err: ProtocolError, now: float
                            ) -> list[Action] | None:
        """Registered rank ``rank`` sent a frame that failed validation: the adapter round in
        flight fails naming it (``malformed.py``), else None (the base rules apply)."""
        a = self.adapter_round
        if a is None or self.current is not None or a.acked or a.failure is not None or (
                not malformed.fails_update(err, a.update_id)):
            return None
        # (its own phase: malformed.phase_of stays "decode" for the adapter kinds, as a daemon
        # before issue 36 answers them, which the publisher tells apart: rank/adapters/round.py)
        phase = err.kind if err.kind in ("adapter_begin", "adapter_data") else \
            malformed.phase_of(err)
        return self._adapter_fail(now, phase, malformed.describe(rank, err), [], BAD_MESSAGE)

    def _adapter_stop(self, now: float, reason: str) -> list[Action]:
        """The daemon stops (or the slot is dropped): the round fails, ranks told, no engine
        call goes out (a load out may still register its name: the next daemon finds it in
        the engine's list and unloads it after the next version, ``reconcile``)."""
        a = self.adapter_round
        if a is None:
            return []
        a.failure = (self._adapter_phase(a), self._adapter_message(a, reason), [])
        a.failure_code = DAEMON_STOPPING
        return self._adapter_end_failed(a, now)

    # ------------------------------------------------------------------ engine steps

    def _adapter_call(self, purpose: str, served: str, route: str, body: Any, now: float,
                      timeout_s: float = 0.0) -> EngineCall:
        self._call_id += 1
        a = self.adapter_round
        call = EngineCall(self._call_id, a.update_id if a else self.next_update_id - 1, route,
                          body, self.slot, -1, False, timeout_s)
        self._adapter_calls[call.call_id] = (purpose, served, now)
        self.engine_calls[route] = self.engine_calls.get(route, 0) + 1
        return call

    def _advance_adapters(self, now: float) -> list[Action]:
        """The next adapter step when nothing else is out (``engine_steps._advance`` asks it
        once no base round runs and no base call is out)."""
        if self._adapter_calls:
            return []
        if self._adapter_held:  # (a base round's acks: every lost version loaded again)
            out, self._adapter_held = self._adapter_held, []
            return out + self._advance_adapters(now)
        a = self.adapter_round
        if a is None:
            return []
        if a.failure is not None:
            return self._adapter_failed_next(a, now)
        if a.phase is AdapterPhase.INFO:
            return self._adapter_info(a, now)
        if a.phase is AdapterPhase.DATA and len(a.data) == self.size:
            if a.transport == "host":
                a.phase = AdapterPhase.FILES
                self._call_id += 1
                self._adapter_calls[self._call_id] = ("files", a.plan.served_name, now)
                return [AdapterFiles(self._call_id, self.slot, a.update_id, a.plan,
                                     dict(a.data), self.timeouts.adapter_load_s)]
            return self._adapter_load(a, now)
        if a.phase is AdapterPhase.FILES and a.folder:  # (written: on_adapter_files)
            return self._adapter_load(a, now)
        return []

    def _adapter_info(self, a: AdapterRound, now: float) -> list[Action]:
        """The info stage: version and server_info, then the engine's list of adapters, then
        the checks against them (``_adapter_checked``)."""
        if not a.info_sent:  # (and, on an engine out of step, the probe: a new session?)
            a.info_sent = True
            return [self._adapter_call("info", r, r, None, now) for r in INFO_ROUTES + (
                ("weight_info",) if self.engine.out_of_step else ())]
        if a.info_errors:
            return self._adapter_fail(now, "adapter_begin", "; ".join(a.info_errors.values()),
                                      code=ENGINE_FAILED)
        support = self._adapter_support()
        family = self.families.known(self.engine)
        if support is None:
            return self._adapter_fail(now, "adapter_begin", self._no_adapters(family) if family
                                      else f"engine {self.engine_url}'s kind could not be told "
                                      "from its /version and /server_info", code=ENGINE_UNFIT)
        if "list" not in a.answers:
            why = support.refusal(a.plan, a.answers)
            if why:
                return self._adapter_fail(now, "adapter_begin", why, code=ENGINE_UNFIT)
            a.answers["list"] = None
            return [self._adapter_call("info", "list", support.list_route, None, now)]
        if self.engine.out_of_step:  # (the probe found no new session: restart the engine)
            return self._adapter_fail(now, "adapter_begin", self.engine.out_of_step)
        if self.engine.replies_suspect:  # (a worker's failure: check before the first change)
            return [self._adapter_call("check", "replies", "check_replies", CHECK_REPLIES, now)]
        return self._adapter_checked(a, support, now)

    def _adapter_checked(self, a: AdapterRound, support: Any, now: float) -> list[Action]:
        """The engine answered: reconcile the ledger with its list (restarts), check the
        version, limits and room, then ack every begin (and unload strays, reload what the
        engine lost) -- or refuse, after those repairs returned."""
        plan, ledger = a.plan, self.adapters
        listed = support.served(a.answers["list"])
        rec = ledger.reconcile(listed, support.reloadable, self.engine_url)
        out = self._reconciled(rec, support, now, a.answers["list"])
        cur = ledger.current(plan.lora_name)
        why = version_refusal(plan, cur and cur.version, bool(cur and cur.state == LOST),
                              self.engine_url)
        code = VERSION_REFUSED if why else ENGINE_UNFIT
        held = (listed | {e.served_name for e in rec.reload}) - set(ledger.stray)
        why = why or limits_refusal(plan, support.limits(a.answers), held, self.engine_url,
                                    self.family.display)
        out += [self._adapter_call("cleanup", name, support.unload_route,
                                   support.unload_body(name), now) for name in ledger.stray]
        if why:
            return out + self._adapter_fail(now, "adapter_begin", why, code=code)
        a.previous = cur if cur is not None and cur.state != LOST else None
        a.transport, a.phase, a.acked_at = support.transport, AdapterPhase.DATA, now
        ack = Ack(a.update_id, "adapter_begin", transport=support.transport)
        return [Reply(i.identity, ack) for i in self._by_rank()] + out

    def _reconciled(self, rec: Reconciled, support: Any, now: float,
                    listing: Any = None, reload: bool = True) -> list[Action]:
        """Events and calls for what the engine's list (``listing``, None: a restart without
        a look) showed (``AdapterLedger.reconcile``): lost versions logged, adopted ones
        logged (with this daemon's folder of theirs: ``watch.py``), lost versions with a
        folder loaded again (``reload``; the idle watch reads the engine's limits first:
        ``watch._watch_reload``), folders of strays the engine no longer holds removed."""
        if listing is not None:
            self._adopt_folders(rec.adopted, support, listing)
        out: list[Action] = [RemoveAdapterFiles(self.slot, f) for f in rec.gone]
        for e in rec.lost:
            out.append(SlotEvent(self.slot, "adapter_lost", {
                "engine": self.engine_url, "served_name": e.served_name, "why": e.error}))
        for e in rec.adopted:
            out.append(SlotEvent(self.slot, "adapter_found", {
                "engine": self.engine_url, "served_name": e.served_name,
                "why": e.error or f"loaded from this daemon's folder {e.folder}: adopted"},
                warning=False))
        for e in rec.reload if reload else ():  # (one found on the engine: found_plan)
            out.append(self._adapter_call("reload", e.served_name, support.load_route,
                                          support.load_body(e.plan or found_plan(e), e.folder,
                                                            {}, {}, 0), now,
                                          self.timeouts.adapter_load_s))
        return out

    def _adapter_load(self, a: AdapterRound, now: float) -> list[Action]:
        """Every rank's data is in (and the folder written): the load call."""
        support, plan = self._adapter_support(), a.plan
        try:
            body = support.load_body(plan, a.folder, dict(a.data),
                                     {r: i.gpu_uuid for r, i in self.ranks.items()},
                                     self.engine.world_size or self.size,
                                     self.engine.declared_gpu_uuids)
        except ValueError as e:
            return self._adapter_fail(now, "adapter_data", str(e), code=ENGINE_UNFIT)
        self.adapters.entries[plan.served_name] = AdapterEntry(
            plan.lora_name, plan.version, plan.served_name, LOADING, plan.nbytes,
            folder=a.folder, plan=plan)
        a.phase, a.load_sent_at = AdapterPhase.LOAD, now
        return [self._adapter_call("load", plan.served_name, support.load_route, body, now,
                                   self.timeouts.adapter_load_s)]

    def on_adapter_files(self, call_id: int, ok: bool, folder: str, error: str,
                         now: float) -> list[Action]:
        """``AdapterFiles`` ``call_id`` ended: the folder written (``folder``), or not
        (``error``: a part's sha256 that does not match names the tensor and rank)."""
        if self._adapter_calls.pop(call_id, None) is None:
            return []
        a = self.adapter_round
        if a is None:  # (stopped meanwhile)
            return [RemoveAdapterFiles(self.slot, folder)] if ok and folder else []
        if ok:
            a.folder, a.ranks_needed = folder, False  # (the ranks' memory is read)
        elif a.failure is None:
            a.failure = ("adapter_data", self._adapter_message(
                a, f"the daemon could not write its folder: {error}"), [])
            a.failure_code = ADAPTER_FILES_FAILED
        return self._advance(now)

    # ------------------------------------------------------------------ the end of a round

    def _adapter_phase(self, a: AdapterRound) -> str:
        return ("adapter_begin" if a.phase in (AdapterPhase.BEGIN, AdapterPhase.INFO)
                else "adapter_data")

    def _adapter_message(self, a: AdapterRound, text: str, answered: bool = True) -> str:
        """A failure's words: the slot, round, adapter, cause, and what stays served; when
        the engine did not answer (``answered`` False: refused, reset, timed out -- it may
        have died), not what stays but that its next answer tells (the idle watch's list,
        or the next round's)."""
        name = a.plan.lora_name if a.plan else next(
            (b.lora_name for b in a.begins.values()), "")
        cur = self.adapters.current(name) if name else None
        served = cur is not None and cur.state != LOST
        stays = (f"{cur.served_name} stays served" if served
                 else f"no version of {name!r} is served" if name else "nothing changed")
        if not answered:
            stays = "what it serves is checked at its next answer" + (
                f"; it served {cur.served_name} before this round" if served else "")
        return (f"slot [{self.start}, {self.end}) adapter round {a.update_id} ({a.lora}) "
                f"failed: {text} ({stays})")

    def _adapter_fail(self, now: float, phase: str, text: str,
                      missing: list[int] | None = None, code: str = ADAPTER_FAILED
                      ) -> list[Action]:
        """Fail the round in flight: its errors go out once every call of it returned (a
        load sent is undone first); ``code``: their ``Error.code`` (``protocol/errors.py``,
        ``ADAPTER_CODES``)."""
        a = self.adapter_round
        if a is None or a.failure is not None:
            return []
        a.failure = (phase, self._adapter_message(a, text), list(missing or []))
        a.failure_code = code
        return self._advance(now) if not self._adapter_calls else []

    def _adapter_failed_next(self, a: AdapterRound, now: float) -> list[Action]:
        """A failed round with no call out: undo its load (``drop``), else end it."""
        if a.phase is AdapterPhase.LOAD and not a.dropping:
            a.dropping = True
            support, name = self._adapter_support(), a.plan.served_name
            return [self._adapter_call("drop", name, support.unload_route,
                                       support.unload_body(name), now)]
        return self._adapter_end_failed(a, now)

    def _adapter_end_failed(self, a: AdapterRound, now: float) -> list[Action]:
        phase, message, missing = a.failure
        code = a.failure_code or ADAPTER_FAILED
        err = Error(phase, message, list(self.slot), a.update_id, missing, code=code)
        out: list[Action] = [Reply(i.identity, err) for i in self._by_rank()]
        out.append(SlotEvent(self.slot, "adapter_failed", {
            "engine": self.engine_url, "update_id": a.update_id, "adapter": a.lora,
            "seconds": round(now - a.started_at, 4), "error": message}))
        if a.folder and a.folder not in self.adapters.folders_in_use():
            out.append(RemoveAdapterFiles(self.slot, a.folder))
        self.adapter_last_error = message
        self.adapter_last_failed = (a.update_id, code)
        self.adapter_rounds_failed += 1
        self.adapter_round = None
        told = {i.rank for i in self._by_rank()}  # (a round no rank began: adapter_abort)
        if a.begins or told >= set(range(self.start, self.end)):
            self.next_update_id = max(self.next_update_id, a.update_id + 1)
        else:  # (its id stays the next until the ranks not registered now were told)
            self.adapter_aborted = (a.update_id, told)
        return out

    # ------------------------------------------------------------------ base rounds

    def _adapters_after_base(self, u: Update, acks: list[Action], failed: bool,
                             now: float) -> list[Action]:
        """A base round ended (``failed`` or not; ``acks``: its last replies). After a
        successful one, while the ledger says the engine serves adapters, the engine's list
        is read before its ``Ack(commit)`` goes out, and a version it lost is loaded again
        (``reloading``; those without a folder are lost): a restarted engine serves them
        once it is reported ready. The list, not the probe's new session, says what the
        engine lost (a version loaded since a restart that the watch or an adapter round saw
        first is listed, and stays served); the probe may not tell a restart anyway (after
        adapter rounds only the daemon knows no weight version of the engine)."""
        support = self._adapter_support()
        if failed or support is None or not any(
                e.state == SERVED for e in self.adapters.entries.values()):
            return acks
        self._adapter_held = [x for x in acks if isinstance(x, Reply)]  # (the ranks' acks)
        return [x for x in acks if not isinstance(x, Reply)] + [
            self._adapter_call("relist", "list", support.list_route, None, now)]

"""The idle watch of a slot's engine's LoRA adapters (issue 36; I/O-free): the third part of
``rounds.AdapterRounds`` (a mixin; its attributes are the coordinator's).

Without it a restarted engine was found only at the next round's begin, and ``/status``
said ``served`` until then. The service's timer (``service/adapter_watch.py``) hands every
slot a tick every ``adapter_watch_s`` seconds (``Timeouts.adapter_watch_s``; 0: off,
``on_adapter_watch`` does nothing); on each tick a slot whose engine is idle looks::

    tick ─► nothing, when: the watch is off; no engine URL; a round, an engine check or any
            call of the slot is out (``busy``); the ledger holds no adapter and the
            engine's list was read once already
         ─► the engine paused or maybe mid-update (a failed base round left it so: the next
            base round, a full one, checks it) or its executor replies out of step: its list
            is asked, and the answer only tells whether it answers (a refused connection
            meanwhile is what lets the next round's probe see its restart: I9)
         ─► the executor's replies in doubt (a worker's failure, ``note_reply_trouble``): the
            check first (``check_replies``; in step: the next tick looks; not: out of step)
         ─► else the engine's list of adapters (the family's ``list_route``: vLLM's and
            SGLang's ``GET /v1/models``) and, where the engine's weight version is known
            (a base round saw one), the session probe (``weight_info``)
    answers ─► the probe's rule is the begin's (``probe.check_session``): a weight version
            other than the one the daemon last saw is a restart, and the ledger is reconciled
            as after one (``AdapterLedger.restarted``; once per restart: the next base
            round's own probe takes the engine's facts from it); else with the list
            (``AdapterLedger.reconcile``) -- exactly as a round's begin does: vLLM loads a
            version it lost again from its kept folder (``reloading``, then ``served`` when
            the load answered: ``adapter_reloaded``), once the engine's LoRA limits
            (``server_info``, the family's ``limits``) say it can take it, else ``lost``
            saying what to start it with (``_watch_reload``; a lost version with a folder
            is tried again: ``RETRY_LOOKS``), SGLang marks it ``lost``
            (``adapter_lost``); an engine that does not answer changes nothing (it shows as
            unreachable, ``EngineSession.note_call``)

The first list a slot's engine answers (at the daemon's start: the first tick) also adopts
what the engine holds: every served name of the form ``name@vN`` the ledger lacks becomes
an entry, ``served``, and the one whose ``root`` (the path the engine read it from, the
family's ``roots``) is the daemon's own folder of that version under ``adapter_dir`` gets
that folder, in use from then on (reloaded from it after a restart); then
``SweepAdapterFolders`` removes the folders of that slot a daemon before this one left that
no entry needs (its engine listed no such version).

**A round's begin while a watch call is out.** The watch's list and probe are not the
round's calls: a round that begins while they are out does not wait for them, and their
answers are dropped when they come (``_watch_token``: the slot's next update id and engine
URL when they went out, and no round in flight; the round's own begin lists and probes).
The calls the watch makes that change or may change the engine or the folders -- a reload,
the replies' check, the sweep -- are adapter calls (``_adapter_calls``): a round's engine
calls wait for them, as for any adapter call (``engine_steps._advance``). Calls of the watch
count in ``busy``: a slot is not released or dropped while one is out, so no answer finds
another slot's coordinator.
"""

from __future__ import annotations

import posixpath
from typing import Any

from slotsync.daemon.core.actions import Action, EngineCall, SlotEvent, SweepAdapterFolders
from slotsync.daemon.core.adapters.ledger import LOST, RELOADING, AdapterEntry
from slotsync.daemon.core.adapters.plan import AdapterPlan
from slotsync.daemon.core.engine_session import (
    CHECK_REPLIES,
    out_of_step_found,
    replies_in_step,
)

WATCH_LIST, WATCH_PROBE = "list", "probe"
"""The watch's two looks (their answers: ``_watch_answers``)."""

RETRY_LOOKS = 10
"""Looks of the watch between two tries to load again a lost version whose folder the
daemon keeps, after a try failed (the engine could not take it, or its load failed): an
engine that keeps failing is not asked at every look. A new engine session (a refused
connection meanwhile, or the probe's new weight version) tries again at its first look."""


def slot_folder(root: str, slot: tuple[int, int]) -> str:
    """The folder of ``slot``'s adapter versions under ``adapter_dir`` ``root``
    (``slot-<start>-<end>``; each version's folder in it is its served name, written by the
    family: ``vllm/adapters.py`` ``write_adapter_folder``)."""
    return posixpath.join(posixpath.normpath(root), f"slot-{slot[0]}-{slot[1]}")


def found_plan(e: AdapterEntry) -> AdapterPlan:
    """A plan for a version found on the engine (no plan of its own): its name, version and
    served name, no tensors -- what a ``"host"`` family's load body reads (the served name
    and the folder: ``vllm/adapters.py`` ``load_body``)."""
    return AdapterPlan(e.lora_name, e.version, e.served_name, "{}", 0, (), ())


class AdapterWatch:
    """The idle watch's half of ``rounds.AdapterRounds`` (the module docstring)."""

    def _init_watch(self) -> None:
        self.adapter_root = ""  # adapter_dir (the SlotTable sets it); '' none: no adoption
        self._watch_calls: dict[int, str] = {}  # call id -> WATCH_LIST | WATCH_PROBE
        self._watch_token: tuple[int, str | None] | None = None
        self._watch_answers: dict[str, tuple[bool, Any, str]] = {}
        self._watch_listed = False  # the engine's list answered once (adopted, swept)
        # (the version the daemon had seen, the one the engine reported) of the restart the
        # watch took last: not taken again before a round's probe takes it
        self._watch_restart: tuple[str, str | None] | None = None
        self.adapter_watch_calls: dict[str, int] = {}  # route -> the watch's looks
        self._watch_looks = 0  # looks sent so far (RETRY_LOOKS counts them)
        self._reload_after: dict[str, int] = {}  # served name -> no try before this look
        self._watch_reloads: list[str] = []  # served names waiting for the limits' answer
        self._watch_engine_gone = False  # a look found no engine (the next one: new session?)

    def watch_busy(self) -> bool:
        """A look of the watch is out (``busy`` counts it)."""
        return bool(self._watch_calls)

    def on_adapter_watch(self, now: float) -> list[Action]:
        """The watch's tick (``now``: monotonic seconds). Returns the calls of one look, or
        none (the module docstring says when)."""
        if self.timeouts.adapter_watch_s <= 0 or not self.engine_url:
            return []
        if self._pending_url is not None and not self.busy():  # (an engine table reload
            self.set_engine_url(self._pending_url)  # that came while a call was out)
        engine, ledger = self.engine, self.adapters
        watched = bool(ledger.entries or ledger.stray)
        if (self.busy() or (self.claims is not None and self.claims.held)
                or (self._watch_listed and not watched)):
            return []
        family = self.families.known(engine)  # (unknown kind: listed as the default's)
        support = getattr(family or self.family, "adapters", None)
        if support is None:
            self._watch_listed = True  # (a family without adapters holds none)
            return []
        observe = self._watch_observes()
        if watched and engine.replies_suspect and not observe:
            return [self._adapter_call("watch_check", "replies", "check_replies",
                                       CHECK_REPLIES, now)]
        self._watch_token = (self.next_update_id, self.engine_url)
        self._watch_looks += 1
        out = [self._watch_call(WATCH_LIST, support.list_route)]
        if watched and family is not None and engine.version is not None and not observe:
            out.append(self._watch_call(WATCH_PROBE, "weight_info"))
        return out

    def _watch_observes(self) -> bool:
        """The engine is one the watch only sees answer or not (the module docstring)."""
        e = self.engine
        return bool(e.paused or e.mid_update or e.out_of_step)

    def _watch_call(self, look: str, route: str) -> EngineCall:
        self._call_id += 1
        self._watch_calls[self._call_id] = look
        self.adapter_watch_calls[route] = self.adapter_watch_calls.get(route, 0) + 1
        return EngineCall(self._call_id, self.next_update_id - 1, route, None, self.slot)

    def _on_watch_result(self, call_id: int, ok: bool, result: Any, error: str,
                         now: float) -> list[Action]:
        """A look of the watch returned (``outcomes.on_engine_result`` hands it here); once
        every look of the tick did, what they say (dropped when a round began meanwhile)."""
        self._watch_answers[self._watch_calls.pop(call_id)] = (ok, result, error)
        if self._watch_calls:
            return []
        answers, self._watch_answers = self._watch_answers, {}
        if (self._watch_token != (self.next_update_id, self.engine_url)
                or self.current is not None or self.adapter_round is not None
                or self._adapter_calls or self._watch_observes()):
            return []  # stale: a round began (and may have ended) meanwhile; or observed only
        family = self.families.known(self.engine)
        support = getattr(family or self.family, "adapters", None)
        if support is None:
            return []
        listed_ok, listing, error = answers[WATCH_LIST]
        ledger, reloadable = self.adapters, bool(support.reloadable)
        out: list[Action] = []
        rec = None
        probe = answers.get(WATCH_PROBE)
        if probe is not None and probe[0]:
            v = probe[1].get("weight_version") if isinstance(probe[1], dict) else None
            v = v if isinstance(v, str) else None
            seen = self.engine.version
            if seen is not None and v != seen and (seen, v) != self._watch_restart:
                # (the begin's rule, probe.check_session; the engine's facts stay the next
                # base round's to take, from its own probe)
                self._watch_restart = (seen, v)
                self._reload_after.clear()  # (a new session: lost versions tried again)
                rec = ledger.restarted(reloadable, self.engine_url)
                out.append(SlotEvent(self.slot, "adapter_watch_restart", {
                    "engine": self.engine_url, "weight_version": v, "last_seen": seen,
                    "why": "its weight version is not the one the daemon last saw: "
                           "restarted"}))
        if not listed_ok and "HTTP " not in error:
            self._watch_engine_gone = True  # (not answering: maybe restarting)
        elif listed_ok and self._watch_engine_gone:
            self._watch_engine_gone = False
            self._reload_after.clear()  # (it answers again: maybe a new session)
        if rec is not None:
            out += self._reconciled(rec, support, now, reload=False)
        elif listed_ok:
            rec = ledger.reconcile(support.served(listing), reloadable, self.engine_url)
            out += self._reconciled(rec, support, now, listing, reload=False)
        if rec is not None and (listed_ok or rec.reload):
            listed = support.served(listing) if listed_ok else set()
            out += self._watch_reload(rec.reload, listed, reloadable, now)
        if listed_ok and not self._watch_listed:
            self._watch_listed = True
            if self.adapter_root:
                self._call_id += 1
                self._adapter_calls[self._call_id] = ("sweep", "", now)
                out.append(SweepAdapterFolders(self._call_id, self.slot,
                                               frozenset(ledger.folders_in_use())))
        elif not listed_ok and "HTTP " in error and not (ledger.entries or ledger.stray):
            self._watch_listed = True  # (it answered without a list: nothing to adopt)
        return out

    def _watch_reload(self, reload: list[AdapterEntry], listed: set[str], reloadable: bool,
                      now: float) -> list[Action]:
        """Versions to load again from their kept folders: those the engine just lost
        (``reload``) and those lost before whose try is due (``RETRY_LOOKS``; a version's
        first look after a new session). The engine's LoRA limits are read first, as a
        round's begin reads them (``server_info``; ``_watch_limits`` answers): an engine that
        cannot take an adapter gets no load (vLLM started without ``--enable-lora``: every
        worker would fail, and the executor's replies be in doubt)."""
        again = list(reload)
        if reloadable:
            again += [e for e in self.adapters.entries.values()
                      if e.state == LOST and e.folder and e.served_name not in listed
                      and self._reload_after.get(e.served_name, 0) <= self._watch_looks]
        if not again:
            return []
        for e in again:
            e.state = RELOADING
        self._watch_reloads = [e.served_name for e in again]
        return [self._adapter_call("watch_limits", "", "server_info", None, now)]

    def _watch_limits(self, ok: bool, result: Any, error: str, support: Any,
                      now: float) -> list[Action]:
        """The engine's ``server_info`` answered the watch (``_watch_reload``): the versions
        waiting for it are loaded again when the engine can take them (the family's
        ``limits``, as a round's begin; and its ``refusal`` of a version's own plan), else
        they are lost saying what to do (e.g. vLLM's ``--enable-lora``), tried again
        ``RETRY_LOOKS`` looks later. No answer: lost as they were, tried at the next look."""
        names, self._watch_reloads = self._watch_reloads, []
        waiting = [e for e in (self.adapters.entries.get(n) for n in names)
                   if e is not None and e.state == RELOADING]
        if support is None or not waiting:
            return []
        if not ok and "HTTP " not in error:
            for e in waiting:
                e.state = LOST
            return []
        answers = {"server_info": result if ok else None}
        limits = support.limits(answers)
        why = "" if limits.enabled else limits.flag("enabled")
        out: list[Action] = []
        for e in waiting:
            refused = why or (support.refusal(e.plan, answers) if e.plan is not None else "")
            if refused:
                out += self._reload_refused(e, f"engine {self.engine_url} cannot take it: "
                                               f"{refused}")
                continue
            out.append(self._adapter_call("reload", e.served_name, support.load_route,
                                          support.load_body(e.plan or found_plan(e),
                                                            e.folder, {}, {}, 0), now,
                                          self.timeouts.adapter_load_s))
        return out

    def _reload_refused(self, e: AdapterEntry, why: str) -> list[Action]:
        """Version ``e`` could not be loaded again from its folder (``why``): lost, tried
        again ``RETRY_LOOKS`` looks later; said when what is wrong changed."""
        error = f"loading it again from {e.folder} failed: {why}"
        self._reload_after[e.served_name] = self._watch_looks + RETRY_LOOKS
        e.state, said, e.error = LOST, e.error, error
        if said == error:
            return []
        return [SlotEvent(self.slot, "adapter_lost", {
            "engine": self.engine_url, "served_name": e.served_name, "why": error})]

    def _adopt_folders(self, adopted: list[AdapterEntry], support: Any, listing: Any) -> None:
        """Versions found on the engine whose ``root`` is this slot's own folder of that
        version take it (in use; reloaded from it after a restart); others stay without."""
        roots = getattr(support, "roots", None)
        if not adopted or not self.adapter_root or roots is None:
            return
        mine = slot_folder(self.adapter_root, self.slot)
        paths = roots(listing)
        for e in adopted:
            path = paths.get(e.served_name)
            if path and posixpath.normpath(path) == posixpath.join(mine, e.served_name):
                e.folder = posixpath.join(mine, e.served_name)
                e.error = ""  # (the daemon's own folder: served as if it had loaded it)

    def _replies_checked(self, ok: bool, result: Any, error: str) -> str:
        """A check of the executor's replies (``check_replies``, ``CHECK_REPLIES``) returned:
        '' when each worker gave its own answer (the doubt cleared); else why the round
        cannot go on: a reply to an earlier call (``EngineSession.out_of_step`` set, as a
        base round's check sets it: nothing but a restart puts it right) or no answer."""
        if ok and replies_in_step(result, self.size):
            self.engine.replies_suspect = False
            return ""
        if not ok and "HTTP " not in error:
            return f"engine {self.engine_url} {error}"
        self.engine.out_of_step = out_of_step_found(
            self.engine_url or "", f"it answered {result!r}" if ok else error)
        return self.engine.out_of_step

    def _watch_checked(self, ok: bool, result: Any, error: str) -> list[Action]:
        """The watch's check of the replies returned: in step, the next tick looks; no
        answer, it checks again then; out of step, said once (the watch then leaves the
        engine to the next round, whose probe sees its restart)."""
        why = self._replies_checked(ok, result, error)
        if not self.engine.out_of_step:
            return []
        return [SlotEvent(self.slot, "engine_replies_out_of_step", {
            "engine": self.engine_url, "why": why})]

    def on_adapter_swept(self, call_id: int, now: float) -> list[Action]:
        """``SweepAdapterFolders`` ``call_id`` ended: a round that waited for it goes on."""
        if self._adapter_calls.pop(call_id, None) is None:
            return []
        return self._advance(now)

"""What the engine's answers to an adapter round's calls do (I/O-free; issue 36): the half of
``rounds.AdapterRounds`` that ``on_engine_result`` hands an adapter call's outcome to
(``_on_adapter_result``): the version stage's answers read by the engine families, the new
version served and acknowledged (``Ack(adapter_data, served_name)``) or its failure noted, a
failed load's undoing, the previous version's and strays' unloads, and the loads again after
an engine restart. Its attributes are the coordinator's.
"""

from __future__ import annotations

from typing import Any

from slotsync.daemon.core import probe
from slotsync.daemon.core.actions import Action, RemoveAdapterFiles, Reply, SlotEvent
from slotsync.daemon.core.adapters.ledger import LOST, SERVED, UNLOADING
from slotsync.daemon.core.adapters.round import AdapterRound
from slotsync.protocol.errors import ENGINE_FAILED
from slotsync.protocol.wire import Ack


class AdapterAnswers:
    """The engine answers' half of ``rounds.AdapterRounds``."""

    def _on_adapter_result(self, call_id: int, ok: bool, result: Any, error: str,
                           now: float) -> list[Action]:
        """An adapter call returned (``outcomes.on_engine_result`` hands it here)."""
        purpose, name, sent = self._adapter_calls.pop(call_id)
        if not ok:  # (a worker's failure may leave the others' replies queued: gh-58242)
            self.engine.note_reply_trouble(purpose, error, self.size)
        a, support = self.adapter_round, self._adapter_support()
        if a is None and purpose in ("load", "drop"):  # (its round was stopped meanwhile)
            entry = self.adapters.entries.pop(name, None)  # (may be registered: a stray)
            self.adapters.stray[name] = entry.folder if entry is not None else ""
            return self._advance(now)
        out: list[Action] = []
        if purpose == "info" and a is not None:
            out += self._adapter_info_answer(a, name, ok, result, error)
        elif purpose == "relist" and support is not None:  # (a base round's end)
            if ok:
                rec = self.adapters.reconcile(support.served(result),
                                              bool(support.reloadable), self.engine_url)
                out += self._reconciled(rec, support, now, result)
            else:  # (the acks go out: the next round's list tells again)
                out.append(SlotEvent(self.slot, "adapter_list_failed", {
                    "engine": self.engine_url, "error": error}))
        elif purpose == "check" and a is not None:  # (the replies, before the first change)
            why = self._replies_checked(ok, result, error)
            if why:
                a.info_errors["replies"] = why
        elif purpose == "watch_check":  # (the idle watch's: watch.py)
            out += self._watch_checked(ok, result, error)
        elif purpose == "watch_limits":  # (the idle watch's, before its reloads; an engine of
            # no known kind yet, as after a daemon restart, is the default family's, as the
            # watch's own looks take it)
            out += self._watch_limits(ok, result, error, support or getattr(
                self.family, "adapters", None), now)
        elif purpose == "reload":
            out += self._adapter_reloaded(name, ok, error, now - sent,
                                          support or getattr(self.family, "adapters", None))
        elif purpose in ("cleanup", "unload"):
            out += self._adapter_unloaded(name, ok, error, support, stray=purpose == "cleanup")
        elif purpose in ("load", "prove") and a is not None:
            out += self._adapter_loaded(a, ok, error, now, support, purpose == "prove")
        elif purpose == "drop" and a is not None:
            out += self._adapter_dropped(a, ok, error, support)
        return out + self._advance(now)

    def _adapter_info_answer(self, a: AdapterRound, which: str, ok: bool, result: Any,
                             error: str) -> list[Action]:
        if which == "list":
            if ok:
                a.answers["list"] = result
            else:
                a.info_errors["list"] = f"engine {self.engine_url}'s list of adapters: {error}"
            return []
        if which == "weight_info":  # (an engine out of step: a new session clears it)
            if ok:
                return probe.check_session(self.engine, self.slot, self.engine_url or "",
                                           a.stub, result)
            a.info_errors[which] = f"engine {self.engine_url} {error}"
            return []
        route = which  # (the version stage's two steps, answered in either order)
        if ok:
            verdict = self.families.version_answer(self.engine, a.stub, route, result,
                                                   self.slot, self.size, self.engine_url)
        elif route == "version" and "HTTP " in error:
            verdict = self.families.version_failure(
                self.engine, a.stub, error, self.engine_url,
                any(n == "server_info" for _, n, _ in self._adapter_calls.values()))
        else:
            a.info_errors[route] = f"engine {self.engine_url} {error}"
            return []
        if verdict.fail or verdict.recheck:
            a.info_errors[route] = verdict.recheck or verdict.fail
        else:
            a.answers[route] = result
        return list(verdict.events)

    def _adapter_loaded(self, a: AdapterRound, ok: bool, error: str, now: float,
                        support: Any, proved: bool) -> list[Action]:
        """The load returned (or, ``proved``, the call after it that proves every copy out
        of the ranks' memory finished: ``AdapterSupport.proof``)."""
        plan = a.plan
        entry = self.adapters.entries.get(plan.served_name)
        if a.failure is not None:  # (failed meanwhile: undone by _adapter_failed_next)
            return []
        if not (ok or (not proved and support.already_loaded(error))):
            what = "prove its copies done" if proved else "load it"
            if "HTTP " not in error:  # (no answer: refused, reset, timed out; dead?)
                a.failure = ("adapter_data", self._adapter_message(
                    a, f"engine {self.engine_url} did not answer (asked to {what}): {error}",
                    answered=False), [])
                return []
            why = error if proved else support.explain(error)
            a.failure = ("adapter_data", self._adapter_message(
                a, f"engine {self.engine_url} could not {what}: {why}"), [])
            a.failure_code = ENGINE_FAILED
            return []
        proof = None if proved else support.proof(self.engine.world_size or self.size,
                                                  self.engine)
        if proof is not None:  # (SGLang over several TP ranks: rank 0's reply only)
            return [self._adapter_call("prove", plan.served_name, proof[0], proof[1], now,
                                       self.timeouts.adapter_load_s)]
        entry.state, entry.loaded_at, entry.error = SERVED, now, ""
        for name, e in list(self.adapters.entries.items()):  # (a lost older version)
            if e.lora_name == plan.lora_name and e.state == LOST and name != plan.served_name:
                del self.adapters.entries[name]
        a.acked, a.ranks_needed = True, False
        ack = Ack(a.update_id, "adapter_data", seconds=now - a.started_at,
                  served_name=plan.served_name)
        out: list[Action] = [Reply(i.identity, ack) for i in self._by_rank()]
        out.append(SlotEvent(self.slot, "adapter_loaded", {
            "engine": self.engine_url, "update_id": a.update_id,
            "served_name": plan.served_name, "bytes": plan.nbytes,
            "seconds": round(now - a.started_at, 4),
            "load_s": round(now - a.load_sent_at, 4),
            "replaces": a.previous.served_name if a.previous else None}, warning=False))
        prev = a.previous
        if prev is not None and prev.served_name in self.adapters.entries:
            # (after the round: the next round collects its begins meanwhile, and its calls,
            # as a base round's, wait for this one)
            prev.state = UNLOADING
            out.append(self._adapter_call("unload", prev.served_name, support.unload_route,
                                          support.unload_body(prev.served_name), now))
        self.adapter_round = None
        self.next_update_id = max(self.next_update_id, a.update_id + 1)
        self.adapter_rounds_ok += 1
        return out

    def _adapter_dropped(self, a: AdapterRound, ok: bool, error: str,
                         support: Any) -> list[Action]:
        """The failed round's unload of its new name returned."""
        name = a.plan.served_name
        entry = self.adapters.entries.pop(name, None)
        folder = entry.folder if entry is not None else a.folder
        if ok or support.absent(error):
            a.folder = folder  # (removed at the end: no engine reads it)
            return []
        self.adapters.stray[name] = folder
        a.folder = ""  # (kept: the engine may read it until the stray is unloaded)
        phase, message, missing = a.failure
        a.failure = (phase, f"{message}; its unload failed too ({error}): the daemon unloads "
                     f"{name} before the next adapter round", missing)
        return []

    def _adapter_unloaded(self, name: str, ok: bool, error: str, support: Any,
                          stray: bool) -> list[Action]:
        """An unload returned: the previous version's (``stray`` False) or a stray's."""
        ledger = self.adapters
        if ok or (support is not None and support.absent(error)):
            if stray:
                folder = ledger.stray.pop(name, "")
                gone = [folder] if folder and folder not in ledger.folders_in_use() else []
            else:
                gone = ledger.retire(name)
            return [RemoveAdapterFiles(self.slot, f) for f in gone]
        if not stray:
            entry = ledger.entries.pop(name, None)
            ledger.stray[name] = entry.folder if entry is not None else ""
        return [SlotEvent(self.slot, "adapter_unload_failed", {
            "engine": self.engine_url, "served_name": name, "error": error,
            "then": "unloaded before the next adapter round"})]

    def _adapter_reloaded(self, name: str, ok: bool, error: str, seconds: float,
                          support: Any) -> list[Action]:
        e = self.adapters.entries.get(name)
        if e is None:
            return []
        if ok or (support is not None and support.already_loaded(error)):
            e.state, e.error = SERVED, ""
            self._reload_after.pop(name, None)
            return [SlotEvent(self.slot, "adapter_reloaded", {
                "engine": self.engine_url, "served_name": name, "folder": e.folder,
                "seconds": round(seconds, 4)}, warning=False)]
        explain = getattr(support, "explain", None)  # (a 404 without the route: the flag)
        return self._reload_refused(e, explain(error) if explain else error)

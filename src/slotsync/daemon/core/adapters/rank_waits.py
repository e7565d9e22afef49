"""A slot's adapter round and its ranks (I/O-free; issue 36): a rank's abort (also of a
round no rank began: ``adapter_abort``), a rank gone or registered again, a begin late for a
round that failed, and the round's waits on ranks and their deadlines (a rank gone at the
begin gets ``liveness_s`` for a new process of it, as a base round's: ``update.wait_in_force``).
The half of ``rounds.AdapterRounds`` about ranks; its attributes are the coordinator's.
"""

from __future__ import annotations

from slotsync.daemon.core.actions import Action
from slotsync.daemon.core.adapters.round import AdapterPhase, AdapterRound
from slotsync.protocol.errors import RANK_ABORTED, RANK_GONE, RANK_TIMEOUT
from slotsync.protocol.wire import Abort


class AdapterRankWaits:
    """The ranks' half of ``rounds.AdapterRounds`` (the module docstring)."""

    def adapter_abort(self, rank: int, msg: Abort, now: float) -> list[Action] | None:
        """Rank ``rank`` aborts (its publisher gave up: an error of its own, an interrupt,
        its timeout): the adapter round it names fails, every rank told, naming the rank and
        its reason. An abort of the slot's next update id while no round is in flight is a
        rank whose ``publish_adapter`` failed before its begin (a bad argument: the
        publisher opens the round to abort it, ``rank/adapters/round.py``): that round
        fails at once, every registered rank told, and a rank that begins it later is told
        why; while a rank of the slot had not registered, the slot's next id stays that
        round's until it was told too (a rank that starts later is told that id, and its
        begin fails at once naming the abort, not at its begin deadline:
        ``_adapter_told_failed``). None when it names no such round (the base rules)."""
        a = self.adapter_round
        if a is None and self.current is None and msg.update_id >= self.next_update_id \
                and msg.update_id != self.adapter_last_failed[0]:
            a = self.adapter_round = AdapterRound(msg.update_id, now)
            why = f": {msg.reason}" if msg.reason else ""
            return self._adapter_fail(now, "adapter_begin", f"rank {rank} aborted adapter round "
                                      f"{a.update_id} before its begin{why}", [], RANK_ABORTED)
        if a is None or self.current is not None or msg.update_id != a.update_id:
            return None
        why = (" before its begin" if rank not in a.begins else "") + (
            f": {msg.reason}" if msg.reason else "")
        return self._adapter_fail(now, self._adapter_phase(a), f"rank {rank} aborted adapter "
                                  f"round {a.update_id}{why}", [], RANK_ABORTED)

    def adapter_ranks_gone(self, now: float) -> list[Action]:
        """Ranks' connections went (``on_rank_gone`` marked them): a round that still needs
        their messages or their memory fails at once, naming each (a rank gone before the
        round began, seen again, gets its liveness_s instead, as in a base round)."""
        a = self.adapter_round
        if a is None or not a.ranks_needed or a.failure is not None:
            return []
        gone = [i for i in self._by_rank() if i.gone_at is not None  # (gone before the
                and i.gone_at >= a.started_at]  # round: liveness_s, _adapter_deadline)
        if not gone:
            return []
        return self._adapter_fail(now, self._adapter_phase(a), "; ".join(
            f"{i.who} is gone: {i.gone_why}" for i in gone), [i.rank for i in gone], RANK_GONE)

    def adapter_rank_registered(self, rank: int, now: float) -> list[Action]:
        """Rank ``rank`` registered again: a round it took part in fails (its process
        restarted or reconnected mid-round)."""
        a = self.adapter_round
        if (a is None or not a.ranks_needed or a.failure is not None
                or (rank not in a.begins and rank not in a.data)):
            return []
        return self._adapter_fail(now, self._adapter_phase(a), f"rank {rank} re-registered "
                                  f"during adapter round {a.update_id}: its process restarted "
                                  "or reconnected mid-round", [rank], RANK_GONE)

    # ------------------------------------------------------------------ the clock

    def _adapter_deadline(self) -> tuple[float, str, str, list[int]] | None:
        """``(deadline, phase, what, missing ranks)`` of the round's wait on ranks, or None
        (none in force: engine calls and the folder are bounded by their own timeouts)."""
        a = self.adapter_round
        if a is None or self._adapter_calls or a.failure is not None:
            return None
        ranks = range(self.start, self.end)
        if a.phase is AdapterPhase.BEGIN:  # (a rank gone gets liveness_s: wait_in_force)
            missing = a.missing(ranks)  # (and the ranks of a gone job a new one replaced)
            gone = [i for i in self.gone_ranks() if i.rank in missing] + [
                i for r, i in sorted(self.adapter_left.items())
                if r in missing and r not in self.ranks]
            if gone:
                t = max(a.started_at, *(i.gone_at or 0.0 for i in gone))
                return (min(t + self.timeouts.gone_s, a.started_at + self.timeouts.begin_s),
                        "rank_gone", "", [i.rank for i in gone])
            return (a.started_at + self.timeouts.begin_s, "adapter_begin",
                    "adapter begin (begin_timeout_s)", missing)
        if a.phase is AdapterPhase.DATA and len(a.data) < self.size:
            return (a.acked_at + self.timeouts.chunk_s, "adapter_data",
                    "adapter data (chunk_timeout_s)", a.missing(ranks))
        return None

    def _adapter_poll(self, now: float) -> list[Action]:
        """Fail the round whose wait on ranks expired, naming the missing ranks (I5)."""
        d = self._adapter_deadline()
        if d is None or now < d[0]:
            return []
        _, phase, what, missing = d
        if phase == "rank_gone":
            info = {**self.adapter_left, **self.ranks}
            return self._adapter_fail(now, "adapter_begin", "; ".join(
                f"{info[r].who} is gone: {info[r].gone_why}" for r in missing)
                + f" (no new process of it registered within {self.timeouts.gone_s:g} s, "
                "liveness_s)", missing, RANK_GONE)
        return self._adapter_fail(now, phase, f"deadline expired waiting for the {what} of "
                                  f"rank(s) {missing}", missing, RANK_TIMEOUT)

    def _adapter_told_failed(self, rank: int) -> list[Action]:
        """The error of the round ``rank`` began late, which failed; once every rank was told
        of a round a rank aborted before any begin (``adapter_abort``), the slot's next id
        moves on past it."""
        uid, code = self.adapter_last_failed
        if self.adapter_aborted is not None and self.adapter_aborted[0] == uid:
            told = self.adapter_aborted[1]
            told.add(rank)
            if told >= set(range(self.start, self.end)):
                self.adapter_aborted = None
                self.next_update_id = max(self.next_update_id, uid + 1)
        return self._adapter_rank_error(rank, "adapter_begin", self.adapter_last_error or "",
                                        uid, code)


"""The daemon's table of engine slots: routes each rank's messages to its slot's coordinator.

I/O-free, like the coordinators it owns. Slots come into being when their first rank
registers (ranks carry the engine's real layout, design.md "Topology rules"); a slot that
overlaps an existing different slot, or names an engine another slot feeds, is refused while
a rank of that slot lives.

Lifecycle of a slot (one daemon outlives many training jobs)::

    registering ─► idle ⇄ updating ─► (every rank gone: connection closed or process exited,
                                       reported by the adapter through on_connection_gone)
        ─► released, slot_release_s after its last rank went (or at once when a new job's
           registration conflicts with it), unless an update or engine check runs

A released slot's ranks are forgotten. What the daemon knows of its engine is kept: a slot
from the engine table keeps it in place; an undeclared one moves to ``released`` (keyed by
engine URL) and the next slot that registers the same engine adopts it, so an engine that a
dead job left paused or mid-update needs a full update from the next job too (design.md I4).
"""

from __future__ import annotations

from slotsync.daemon.core import wait_report
from slotsync.daemon.core.claim_check import ClaimCheck
from slotsync.daemon.core.coordinator import Action, Reply, SlotCoordinator, SlotEvent, Timeouts
from slotsync.daemon.core.family import Families
from slotsync.protocol.errors import DAEMON_STOPPING
from slotsync.protocol.wire import (
    NOT_REGISTERED,
    Abort,
    AdapterBegin,
    AdapterData,
    Begin,
    Close,
    Error,
    ProtocolError,
    Query,
    Register,
    ToDaemon,
)


class SlotTable:
    """All slots of one node daemon, keyed by ``(start, end)``.

    Args:
        timeouts: deadlines handed to every slot coordinator.
        daemon_version: reported to ranks at registration.
        chunks_in_flight: ``/update_weights`` calls each slot may have in flight (see
            ``SlotCoordinator``).
        omitted_names: each slot's policy for updates that leave out names (see
            ``coordinator.OMITTED_NAMES_POLICIES``).
        slot_release_s: seconds after a slot's last rank went until the slot is released.
        max_message_bytes: the daemon's frame cap in bytes, told to each rank at registration
            (0: unknown).
        check_claims: an undeclared slot's first registrations wait for its engine's
            ``/get_world_size``, and an engine with fewer workers than the slot is refused
            (``claim_check.py``; the daemon sets it, the unit tests' scripted engines mostly
            do not).
        families: the engine families its slots may meet (``core/family.py``), handed to every
            coordinator; the daemon's are ``slotsync.daemon.families.FAMILIES``, whose
            ``SlotTable`` sets them.
        adapter_root: the daemon's ``adapter_dir`` (issue 36; '' none), handed to every
            coordinator: a version an engine lists from its slot's folder there is adopted
            with that folder (``adapters/watch.py``).

    Shutting down, the adapter calls ``on_drain``: from then on registrations and begins
    are refused (``draining``).
    """

    def __init__(self, timeouts: Timeouts | None = None, daemon_version: str = "",
                 chunks_in_flight: int = 3, omitted_names: str = "warn",
                 slot_release_s: float = 60.0, max_message_bytes: int = 0,
                 check_claims: bool = False, families: Families | None = None,
                 adapter_root: str = "") -> None:
        self.families = families
        self.adapter_root = adapter_root
        self.timeouts = timeouts or Timeouts()
        self.daemon_version = daemon_version
        self.chunks_in_flight = chunks_in_flight
        self.omitted_names = omitted_names
        self.slot_release_s = slot_release_s
        self.max_message_bytes = max_message_bytes
        self.check_claims = check_claims
        self.slots: dict[tuple[int, int], SlotCoordinator] = {}
        # undeclared slots released with something to remember about their engine, by URL
        self.released: dict[str, SlotCoordinator] = {}
        self.declared: dict[tuple[int, int], str] = {}  # engine table: slot -> URL (optional)
        self.elsewhere: dict[tuple[int, int], str] = {}  # declared, driven by another node
        self.draining = False  # shutting down: no new registrations or updates
        self._rank_of: dict[bytes, int] = {}  # socket identity -> rank
        self._slot_of_rank: dict[int, SlotCoordinator] = {}

    def _coordinator(self, start: int, size: int) -> SlotCoordinator:
        c = SlotCoordinator(start, size, self.timeouts, self.daemon_version,
                            self.chunks_in_flight, self.omitted_names,
                            self.max_message_bytes, self.families)
        c.adapter_root = self.adapter_root  # (issue 36: adapters/watch.py)
        return c

    def _pause_modes(self, kind: str) -> bool:
        """Whether the engine family ``kind`` has a pause mode the table may set."""
        family = self.families.by_kind.get(kind) if self.families is not None else None
        return family is not None and family.pause_modes

    def on_drain(self) -> list[Action]:
        """The daemon is shutting down gracefully: refuse new registrations and updates (the
        updates in flight go on). Returns no actions."""
        self.draining = True
        return []

    def set_engine_table(
        self, table: dict[tuple[int, int], str],
        gpu_uuids: dict[tuple[int, int], tuple[str, ...]] | None = None,
        kinds: dict[tuple[int, int], tuple[str, str]] | None = None,
        elsewhere: dict[tuple[int, int], str] | None = None,
    ) -> list[str]:
        """Declare (or re-declare, on SIGHUP) the engine slots, their URLs and, where known,
        their workers' GPU UUIDs in worker order (checked as a set against the ranks' before
        each pause; an SGLang engine's payload is placed by them: ``MergeFacts``) and
        their kinds with SGLang's pause mode (``kinds``: slot -> (kind, pause_mode); a slot
        not in it is detected at its first begin, ``slotsync.daemon.families``).

        New slots are created empty; a changed URL applies to an idle slot at once and to a
        slot with an update in flight when that update ends; a slot no longer declared is
        dropped if no rank is registered in it (else kept, and reported). Returns one line per
        change, for the log.

        ``elsewhere``: slots the engine table declares that another node's daemon drives
        (slot -> how, e.g. "http://... (driven by node node0)"; issue 35). They get no
        coordinator here, but a table holding only them is a table all the same: a
        registration for any other slot is refused, naming them, as on the owner.
        """
        changes: list[str] = []
        gpu_uuids = gpu_uuids or {}
        for key, url in sorted(table.items()):
            c = self.slots.get(key)
            if c is None:
                self.slots[key] = c = self._coordinator(key[0], key[1] - key[0])
                c.engine_url = url
                changes.append(f"slot [{key[0]}, {key[1]}) declared for {url}")
            elif c.engine_url != url:
                changes.append(f"slot [{key[0]}, {key[1]}) engine {c.engine_url} -> {url}"
                               + (" (after the update in flight)" if c.current else ""))
                c.set_engine_url(url)
            uuids = gpu_uuids.get(key) or None
            if uuids != c.engine.declared_gpu_uuids:
                if c.engine.declared_gpu_uuids is not None or uuids is not None:
                    changes.append(f"slot [{key[0]}, {key[1]}) GPU UUIDs "
                                   f"{list(uuids) if uuids else 'not declared'}")
                c.engine.declared_gpu_uuids = uuids
            kind, pause_mode = (kinds or {}).get(key, ("", "in_place"))
            if (kind or None, pause_mode) != (c.engine.declared_kind, c.engine.pause_mode):
                if c.engine.declared_kind is not None or kind:
                    changes.append(f"slot [{key[0]}, {key[1]}) engine kind "
                                   f"{kind or 'not declared'}"
                                   + (f", pause mode {pause_mode}" if self._pause_modes(kind)
                                      else ""))
                c.engine.declare_kind(kind or None, pause_mode)
        for key in sorted(set(self.declared) - set(table)):
            c = self.slots.get(key)
            if c is not None and not c.ranks and c.mid_update_state() is None:
                del self.slots[key]
                changes.append(f"slot [{key[0]}, {key[1]}) removed")
            else:
                changes.append(f"slot [{key[0]}, {key[1]}) no longer declared but has ranks; kept")
        self.declared = dict(table)
        self.elsewhere = dict(elsewhere or {})
        return changes

    def on_message(self, identity: bytes, msg: ToDaemon, now: float,
                   peer_pid: int = 0) -> list[Action]:
        """Dispatch one decoded message from socket ``identity``; ``peer_pid``: the kernel's
        pid of the connection's process (SO_PEERCRED), 0 if unknown."""
        if isinstance(msg, Register):
            return self._register(identity, msg, now, peer_pid)
        rank = self._rank_of.get(identity)
        if isinstance(msg, Query):  # (issue 24: a publisher's wait expired; changes nothing)
            c = self._slot_of_rank[rank] if rank is not None else None
            return [Reply(identity, wait_report.waiting(c, msg.update_id, now))]
        if isinstance(msg, Close):  # (issue 24: a clean close is not a guess)
            why = "its publisher closed the connection" + (
                f" ({msg.reason})" if msg.reason else "")
            return self.on_connection_gone(identity, now, why)
        if rank is not None:
            self._slot_of_rank[rank].on_rank_seen(rank, identity, now)
        if self.draining and isinstance(msg, Begin | AdapterBegin):
            slot = self._slot_of_rank[rank].slot if rank is not None else (0, 0)
            phase = "begin" if isinstance(msg, Begin) else "adapter_begin"
            return [Reply(identity, Error(phase, "the daemon is shutting down; no new update "
                                          "starts", list(slot), msg.update_id, [], False,
                                          DAEMON_STOPPING))]
        if rank is None:
            return [
                Reply(
                    identity,
                    Error(
                        "register",
                        f"{type(msg).__name__.lower()} from a connection that has not "
                        "registered (did the daemon restart? an update in flight then is lost; "
                        "the publisher registers again at its next begin)",
                        # (the message's update id: a publisher that sent chunks after a
                        # refused begin knows these answers as stale once registered again)
                        update_id=getattr(msg, "update_id", None),
                        code=NOT_REGISTERED,
                    ),
                )
            ]
        c = self._slot_of_rank[rank]
        if isinstance(msg, AdapterBegin | AdapterData):  # (issue 36: adapters/rounds.py)
            return c.on_adapter_message(rank, msg, now)
        if isinstance(msg, Begin) and (refused := c.adapter_refuses_begin(rank, msg)):
            return refused  # (an adapter round and a base round never overlap)
        if isinstance(msg, Abort) and (aborted := c.adapter_abort(rank, msg, now)) is not None:
            return aborted
        return c.on_message(rank, msg, now)

    def on_bad_message(self, identity: bytes, err: ProtocolError, now: float) -> list[Action]:
        """Socket ``identity`` sent a frame that failed validation (``err``). A registered
        rank's slot fails its update at once with that cause (``SlotCoordinator.on_bad_message``,
        issue 24); any other peer gets a non-fatal ``Error(phase="decode")``."""
        rank = self._rank_of.get(identity)
        if rank is None:
            return [Reply(identity, Error("decode", str(err), fatal=False))]
        c = self._slot_of_rank[rank]
        c.on_rank_seen(rank, identity, now)
        adapter = c.adapter_bad_message(rank, err, now)  # (an adapter round's: issue 36)
        return adapter if adapter is not None else c.on_bad_message(rank, err, now)

    def on_connection_gone(self, identity: bytes, now: float, why: str,
                           released: bool = False) -> list[Action]:
        """The connection ``identity`` closed, or its process exited (``why``): if a rank
        registered on it, tell its slot (an update that needs the rank fails at once;
        ``released``: see ``SlotCoordinator.on_rank_gone``)."""
        rank = self._rank_of.get(identity)
        if rank is None:
            return []
        c = self._slot_of_rank[rank]
        return c.on_rank_gone(rank, identity, now, why, released) + c.adapter_ranks_gone(now)

    def on_connections_gone(self, identities: list[bytes], now: float, why: str,
                            released: bool = False) -> list[Action]:
        """Several connections gone for one reason (a relaying node's peer link lost): each
        slot fails its update once, naming every rank of them it needs
        (``SlotCoordinator.on_ranks_gone``)."""
        by_slot: dict[int, tuple[SlotCoordinator, list[tuple[int, bytes]]]] = {}
        for identity in identities:
            rank = self._rank_of.get(identity)
            if rank is not None:
                c = self._slot_of_rank[rank]
                by_slot.setdefault(id(c), (c, []))[1].append((rank, identity))
        return [a for c, gone in by_slot.values()
                for a in c.on_ranks_gone(gone, now, why, released) + c.adapter_ranks_gone(now)]

    def poll(self, now: float) -> list[Action]:
        """Check every slot's deadlines, and release slots whose ranks are all gone."""
        out: list[Action] = []
        for c in list(self.slots.values()):
            out += c.poll(now)
        for key, c in list(self.slots.items()):
            since = c.vacant_since()
            if since is not None and now >= since + self.slot_release_s:
                out += self._release(key, f"every rank gone for {self.slot_release_s:g} s "
                                     "(slot_release_s)")
        return out

    def next_deadline(self) -> float | None:
        """Earliest deadline (or slot release) over all slots, or None."""
        ds = [d for c in self.slots.values() if (d := c.next_deadline()) is not None]
        ds += [t + self.slot_release_s for c in self.slots.values()
               if (t := c.vacant_since()) is not None]
        return min(ds) if ds else None

    def drop(self, slot: tuple[int, int], now: float, *, force: bool = False,
             reason: str = "dropped by the operator") -> list[Action]:
        """An operator drops ``slot``: its ranks are forgotten (their publishers register
        again at their next begin) and the slot is released; what the daemon knows of its
        engine stays (see the module docstring), but its kind is asked again at the next
        begin (``EngineSession.forget_kind``: an operator drops a slot when the engine
        changed; issue 35). With ``force`` an update in flight fails first (ranks told,
        engine left paused and marked, I4).

        Raises:
            KeyError: no such slot.
            RuntimeError: an update or engine check runs and ``force`` is not set, or an
                engine call of the slot is still in flight (even forced: its outcome decides
                the engine's state; retry in a moment).
        """
        c = self.slots.get(slot)
        if c is None:
            known = ", ".join(f"[{s}, {e})" for s, e in sorted(self.slots)) or "none"
            raise KeyError(f"no slot [{slot[0]}, {slot[1]}) (slots: {known})")
        out: list[Action] = []
        running = c.current or c.adapter_round  # (a base update, or an adapter round)
        if running is not None:
            if not force:
                raise RuntimeError(
                    f"slot [{slot[0]}, {slot[1]}) has update {running.update_id} in flight; "
                    "drop it with force (`slotsync slots drop --force`) to fail that update "
                    "first")
            out += c.on_daemon_stop(now, reason, phase="dropped")  # (no engine call goes out)
        if c.busy():
            raise RuntimeError(f"slot [{slot[0]}, {slot[1]}) still waits for an engine call "
                               "or check; retry in a few seconds")
        out += self._release(slot, reason)
        c.engine.forget_kind()  # (another engine may serve there now: asked again, issue 35)
        return out

    def _release(self, key: tuple[int, int], reason: str,
                 keep_slot: bool = False) -> list[Action]:
        """Release slot ``key`` (nothing runs for it): forget its ranks; keep what is known of
        its engine (in place if declared or ``keep_slot``, else in ``released`` when worth
        remembering)."""
        c = self.slots[key]
        gone = c.release()  # (a new job's adapter round gives those ranks liveness_s)
        c.adapter_left = {g.rank: g for g in gone} if keep_slot else {}
        ranks = {g.rank for g in gone}
        for r in ranks:
            self._slot_of_rank.pop(r, None)
        for ident, r in list(self._rank_of.items()):
            if r in ranks:
                del self._rank_of[ident]
        if key not in self.declared and not keep_slot:
            del self.slots[key]
            if c.engine_url and (c.mid_update_state() is not None or c.engine.paused
                                 or c.engine.needs_full_update or c.engine.last_ok_names
                                 or c.adapters.entries or c.adapters.stray):  # (issue 36)
                self.released[c.engine_url.rstrip("/")] = c
        return [SlotEvent(key, "slot_released", {
            "engine": c.engine_url, "reason": reason,
            "ranks": [f"{g.rank} (pid {g.peer_pid or g.pid}: {g.gone_why or 'registered'})"
                      for g in gone],
            "needs_full_update": c.engine.needs_full_update}, warning=False)]

    def coordinator(self, slot: tuple[int, int]) -> SlotCoordinator:
        return self.slots[slot]

    def on_connection_lost(self, engine_url: str, now: float) -> list[Action]:
        """The HTTP client of ``engine_url`` saw a refused or reset connection: tell the slot
        that drives it (a possible engine restart, see ``SlotCoordinator.on_connection_lost``)."""
        out: list[Action] = []
        for c in self.slots.values():
            if c.engine_url == engine_url:
                out += c.on_connection_lost(now)
        return out

    def connected_ranks(self) -> int:
        return len(self._rank_of)

    def updates_in_flight(self) -> int:
        """Slots with a base-weight update or an adapter round in flight."""
        return sum(c.current is not None or c.adapter_round is not None
                   for c in self.slots.values())

    def adapter_folders_in_use(self) -> set[str]:
        """The adapter folders an engine may still read (issue 36): every slot's and every
        released engine's (``AdapterLedger.folders_in_use``); the service keeps them at its
        stop and removes the others it wrote."""
        return {f for c in [*self.slots.values(), *self.released.values()]
                for f in c.adapters.folders_in_use()}

    def on_adapter_files(self, slot: tuple[int, int], call_id: int, ok: bool, folder: str,
                         error: str, now: float) -> list[Action]:
        """``AdapterFiles`` ``call_id`` of ``slot`` ended (``SlotCoordinator.on_adapter_files``)."""
        c = self.slots.get(slot)
        return c.on_adapter_files(call_id, ok, folder, error, now) if c is not None else []

    def adapter_watch(self, now: float) -> list[Action]:
        """The idle watch's tick (issue 36; ``SlotCoordinator.on_adapter_watch``): every
        slot's engine whose ledger holds adapters, or whose list was never read, is looked
        at; none while the daemon drains."""
        if self.draining:
            return []
        return [a for c in list(self.slots.values()) for a in c.on_adapter_watch(now)]

    def on_adapter_swept(self, slot: tuple[int, int], call_id: int, now: float
                         ) -> list[Action]:
        """``SweepAdapterFolders`` ``call_id`` of ``slot`` ended
        (``SlotCoordinator.on_adapter_swept``)."""
        c = self.slots.get(slot)
        return c.on_adapter_swept(call_id, now) if c is not None else []

    def shutdown(self, now: float, reason: str) -> list[Action]:
        """Fail every update in flight (daemon stopping)."""
        out: list[Action] = []
        for c in self.slots.values():
            out += c.on_daemon_stop(now, reason)
        return out

    def restore(self, slot: tuple[int, int], engine_url: str, update_id: int,
                weight_version: str, state: str) -> None:
        """Recreate a slot that a previous daemon left mid-update (see mid_update_record)."""
        c = self.slots.get(slot)
        if c is None:
            c = self.slots[slot] = self._coordinator(slot[0], slot[1] - slot[0])
        c.restore_mid_update(engine_url, update_id, weight_version, state)

    def mid_update_engines(self) -> list[tuple[tuple[int, int], str, int, str, str]]:
        """``(slot, engine_url, update_id, weight_version, state)`` of every engine that may
        hold half-loaded weights."""
        out = []
        for key, c in sorted(self.slots.items(), key=lambda kc: kc[0]) + sorted(
                ((c.slot, c) for c in self.released.values()), key=lambda kc: kc[0]):
            d = c.mid_update_state()
            if d is not None:
                out.append((key, c.engine_url or "", d[1], d[2], d[0]))
        return out

    def _live(self, c: SlotCoordinator) -> str:
        """Why slot ``c`` cannot be released for a conflicting registration ("" if it can):
        its live ranks, named with their pids, or what runs for it."""
        live = [i for i in c.ranks.values() if i.gone_at is None]
        if live:
            return "its live ranks: " + ", ".join(
                f"{i.rank} ({i.process})" for i in sorted(live, key=lambda i: i.rank))
        if c.busy():
            return "an update or engine check of it is still running"
        return ""

    def _register(self, identity: bytes, msg: Register, now: float,
                  peer_pid: int = 0) -> list[Action]:
        key = (msg.slot_start, msg.slot_start + msg.slot_size)
        if self.draining:
            return [Reply(identity, Error("register", "the daemon is shutting down", list(key),
                                          fatal=False))]
        if self.declared or self.elsewhere:
            want = self.declared.get(key)
            if want is None:
                table = ", ".join(f"[{s}, {e}) {u}" for (s, e), u in
                                  sorted({**self.declared, **self.elsewhere}.items()))
                return [Reply(identity, Error(
                    "register", f"rank {msg.rank} claims slot [{key[0]}, {key[1]}), which the "
                    f"daemon's engine table does not declare (declared: {table})", list(key)))]
            if msg.engine_url != want:
                return [Reply(identity, Error(
                    "register", f"rank {msg.rank} names engine {msg.engine_url!r} but the "
                    f"engine table declares {want!r} for slot [{key[0]}, {key[1]})", list(key)))]
        url = msg.engine_url.rstrip("/")
        actions: list[Action] = []
        for (s, e), c in list(self.slots.items()):
            same_engine = (c.engine_url or "").rstrip("/") == url and (
                c.ranks or c.current is not None or c.mid_update_state() is not None)
            overlaps = (s, e) != key and s < key[1] and key[0] < e
            if (s, e) == key:
                if c.ranks and not self._live(c):  # a new job in the slot of a gone one
                    actions += self._release(key, f"its ranks are gone and rank {msg.rank} "
                                             "registers", keep_slot=True)
                continue
            if not (same_engine or overlaps):
                continue
            live = self._live(c)
            if not live and (s, e) not in self.declared:
                # every rank of that job is gone: the new job's registration releases it now
                actions += self._release((s, e), f"its ranks are gone and rank {msg.rank} "
                                         f"registers slot [{key[0]}, {key[1]})")
                continue
            hint = (f" ({live}; it is released slot_release_s={self.slot_release_s:g} s after "
                    "its last rank is gone, or with `slotsync slots drop`)")
            if same_engine:
                # I1: two slots driving one engine would interleave their updates on it
                return actions + [Reply(identity, Error(
                    "register", f"rank {msg.rank} of slot [{key[0]}, {key[1]}) names engine "
                    f"{msg.engine_url!r}, which slot [{s}, {e}) already feeds: one engine per "
                    f"slot (each engine's GPUs form one slot){hint}", list(key)))]
            return actions + [Reply(identity, Error(
                "register", f"rank {msg.rank} claims slot [{key[0]}, {key[1]}) which overlaps "
                f"slot [{s}, {e}) of engine {c.engine_url!r}{hint}", list(key)))]
        coord = self.slots.get(key)
        if coord is None:
            coord = self._coordinator(key[0], msg.slot_size)
            self.slots[key] = coord
            if self.check_claims and key not in self.declared:
                coord.claims = ClaimCheck()
        left = self.released.pop(url, None)
        if left is not None and coord.engine_url in (None, msg.engine_url) and not coord.ranks:
            coord.adopt_engine(left)  # an engine a gone job left: what we know of it holds
        elif left is not None:
            self.released[url] = left
            left = None
        actions += coord.on_register(identity, msg, now, peer_pid)
        actions += coord.adapter_rank_registered(msg.rank, now)  # (mid adapter round: fails)
        if coord.ranks.get(msg.rank) is not None and coord.ranks[msg.rank].identity == identity:
            self._registered(coord)
        elif not coord.ranks and not coord.busy() and key not in self.declared:
            del self.slots[key]  # refused first registration: leave no empty slot behind
            if left is not None:
                self.released[url] = left  # (still remembered for the next registration)
        return actions

    def _registered(self, coord: SlotCoordinator) -> None:
        """Ranks of ``coord`` were accepted: route their connections to it, and forget any
        connection the slot no longer knows (an older connection of a rank, or every other
        rank's when the slot was reset for a new job)."""
        for ident, r in list(self._rank_of.items()):
            if self._slot_of_rank.get(r) is coord and (
                r not in coord.ranks or coord.ranks[r].identity != ident
            ):
                del self._rank_of[ident]
        for r, info in coord.ranks.items():
            self._rank_of[info.identity] = r
            self._slot_of_rank[r] = coord

    def on_engine_result(self, slot: tuple[int, int], call_id: int, ok: bool, result: object,
                         error: str, now: float) -> list[Action]:
        """Engine call ``call_id`` of ``slot`` returned (``SlotCoordinator.on_engine_result``).
        A claim check's answer (``claim_check.py``) may accept held registrations (their
        connections are routed to the slot) or refuse them (an undeclared slot left without
        ranks is dropped, so that another claim can register)."""
        c = self.slots[slot]
        out = c.on_engine_result(call_id, ok, result, error, now)
        if c.ranks:
            self._registered(c)
        elif (c.claims is not None and not c.busy() and slot not in self.declared
              and c.mid_update_state() is None):
            out += self._release(slot, "its claim was refused")
        return out

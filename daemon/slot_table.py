"""The daemon's table of engine slots: routes each rank's messages to its slot's coordinator.

I/O-free, like the coordinators it owns. Slots come into being when their first rank
registers (ranks carry the engine's real layout, design.md "Topology rules"); a slot that
overlaps an existing different slot is refused.
"""

from __future__ import annotations

from slotsync.daemon.coordinator import Action, Reply, SlotCoordinator, Timeouts
from slotsync.protocol.wire import NOT_REGISTERED, Begin, Error, Register, ToDaemon


class SlotTable:
    """All slots of one node daemon, keyed by ``(start, end)``.

    Args:
        timeouts: deadlines handed to every slot coordinator.
        daemon_version: reported to ranks at registration.
        chunks_in_flight: ``/update_weights`` calls each slot may have in flight (see
            ``SlotCoordinator``).
        omitted_names: each slot's policy for updates that leave out names (see
            ``coordinator.OMITTED_NAMES_POLICIES``).
    """

    def __init__(self, timeouts: Timeouts | None = None, daemon_version: str = "",
                 chunks_in_flight: int = 3, omitted_names: str = "warn") -> None:
        self.timeouts = timeouts or Timeouts()
        self.daemon_version = daemon_version
        self.chunks_in_flight = chunks_in_flight
        self.omitted_names = omitted_names
        self.slots: dict[tuple[int, int], SlotCoordinator] = {}
        self.declared: dict[tuple[int, int], str] = {}  # engine table: slot -> URL (optional)
        self.draining = False  # shutting down: no new registrations or updates
        self._rank_of: dict[bytes, int] = {}  # socket identity -> rank
        self._slot_of_rank: dict[int, SlotCoordinator] = {}

    def _coordinator(self, start: int, size: int) -> SlotCoordinator:
        return SlotCoordinator(start, size, self.timeouts, self.daemon_version,
                               self.chunks_in_flight, self.omitted_names)

    def set_engine_table(
        self, table: dict[tuple[int, int], str],
        gpu_uuids: dict[tuple[int, int], tuple[str, ...]] | None = None,
    ) -> list[str]:
        """Declare (or re-declare, on SIGHUP) the engine slots, their URLs and, where known,
        their workers' GPU UUIDs (checked as a set against the ranks' before each pause).

        New slots are created empty; a changed URL applies to an idle slot at once and to a
        slot with an update in flight when that update ends; a slot no longer declared is
        dropped if no rank is registered in it (else kept, and reported). Returns one line per
        change, for the log.
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
            if uuids != c.declared_gpu_uuids:
                if c.declared_gpu_uuids is not None or uuids is not None:
                    changes.append(f"slot [{key[0]}, {key[1]}) GPU UUIDs "
                                   f"{list(uuids) if uuids else 'not declared'}")
                c.declared_gpu_uuids = uuids
        for key in sorted(set(self.declared) - set(table)):
            c = self.slots.get(key)
            if c is not None and not c.ranks and c.dirty_state() is None:
                del self.slots[key]
                changes.append(f"slot [{key[0]}, {key[1]}) removed")
            else:
                changes.append(f"slot [{key[0]}, {key[1]}) no longer declared but has ranks; kept")
        self.declared = dict(table)
        return changes

    def on_message(self, identity: bytes, msg: ToDaemon, now: float) -> list[Action]:
        """Dispatch one decoded message from socket ``identity``."""
        if isinstance(msg, Register):
            return self._register(identity, msg, now)
        rank = self._rank_of.get(identity)
        if self.draining and isinstance(msg, Begin):
            slot = self._slot_of_rank[rank].slot if rank is not None else (0, 0)
            return [Reply(identity, Error("begin", "the daemon is shutting down; no new update "
                                          "starts", list(slot), msg.update_id, [], False))]
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
        return self._slot_of_rank[rank].on_message(rank, msg, now)

    def poll(self, now: float) -> list[Action]:
        """Check every slot's deadlines."""
        out: list[Action] = []
        for c in self.slots.values():
            out += c.poll(now)
        return out

    def next_deadline(self) -> float | None:
        """Earliest deadline over all slots, or None."""
        ds = [d for c in self.slots.values() if (d := c.next_deadline()) is not None]
        return min(ds) if ds else None

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
        return sum(c.current is not None for c in self.slots.values())

    def shutdown(self, now: float, reason: str) -> list[Action]:
        """Fail every update in flight (daemon stopping)."""
        out: list[Action] = []
        for c in self.slots.values():
            out += c.on_daemon_stop(now, reason)
        return out

    def restore(self, slot: tuple[int, int], engine_url: str, update_id: int,
                weight_version: str, state: str) -> None:
        """Recreate a slot that a previous daemon left mid-update (see inflight_record)."""
        c = self.slots.get(slot)
        if c is None:
            c = self.slots[slot] = self._coordinator(slot[0], slot[1] - slot[0])
        c.restore_dirty(engine_url, update_id, weight_version, state)

    def dirty_engines(self) -> list[tuple[tuple[int, int], str, int, str, str]]:
        """``(slot, engine_url, update_id, weight_version, state)`` of every engine that may
        hold half-loaded weights."""
        out = []
        for key, c in sorted(self.slots.items()):
            d = c.dirty_state()
            if d is not None:
                out.append((key, c.engine_url or "", d[1], d[2], d[0]))
        return out

    def _register(self, identity: bytes, msg: Register, now: float) -> list[Action]:
        key = (msg.slot_start, msg.slot_start + msg.slot_size)
        if self.draining:
            return [Reply(identity, Error("register", "the daemon is shutting down", list(key),
                                          fatal=False))]
        if self.declared:
            want = self.declared.get(key)
            if want is None:
                table = ", ".join(f"[{s}, {e}) {u}" for (s, e), u in sorted(self.declared.items()))
                return [Reply(identity, Error(
                    "register", f"rank {msg.rank} claims slot [{key[0]}, {key[1]}), which the "
                    f"daemon's engine table does not declare (declared: {table})", list(key)))]
            if msg.engine_url != want:
                return [Reply(identity, Error(
                    "register", f"rank {msg.rank} names engine {msg.engine_url!r} but the "
                    f"engine table declares {want!r} for slot [{key[0]}, {key[1]})", list(key)))]
        url = msg.engine_url.rstrip("/")
        for (s, e), c in self.slots.items():
            if (s, e) != key and (c.engine_url or "").rstrip("/") == url and (
                c.ranks or c.current is not None or c.dirty_state() is not None
            ):
                # I1: two slots driving one engine would interleave their updates on it
                return [Reply(identity, Error(
                    "register", f"rank {msg.rank} of slot [{key[0]}, {key[1]}) names engine "
                    f"{msg.engine_url!r}, which slot [{s}, {e}) already feeds: one engine per "
                    "slot (each engine's GPUs form one slot)", list(key)))]
        coord = self.slots.get(key)
        if coord is None:
            for (s, e), c in self.slots.items():
                if s < key[1] and key[0] < e:
                    return [
                        Reply(
                            identity,
                            Error(
                                "register",
                                f"rank {msg.rank} claims slot [{key[0]}, {key[1]}) which overlaps "
                                f"slot [{s}, {e}) of engine {c.engine_url!r}",
                                list(key),
                            ),
                        )
                    ]
            coord = self._coordinator(key[0], msg.slot_size)
            self.slots[key] = coord
        actions = coord.on_register(identity, msg, now)
        if coord.ranks.get(msg.rank) is not None and coord.ranks[msg.rank].identity == identity:
            # accepted: forget any connection the slot no longer knows (an older connection of
            # this rank, or every other rank's when the slot was reset for a new job)
            for ident, r in list(self._rank_of.items()):
                if self._slot_of_rank.get(r) is coord and (
                    r not in coord.ranks or coord.ranks[r].identity != ident
                ):
                    del self._rank_of[ident]
            self._rank_of[identity] = msg.rank
            self._slot_of_rank[msg.rank] = coord
        elif not coord.ranks and key not in self.declared:
            del self.slots[key]  # refused first registration: leave no empty slot behind
        return actions

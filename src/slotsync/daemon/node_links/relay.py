"""A relaying node's side of the peer links: its ranks that feed engines another node drives.

I/O-free (``peer_state.py`` has the actions). The daemon hands every decoded rank message
here first (``on_rank_message``, with the frame as the rank sent it); what is not for an
engine over several nodes that another node owns (``None``) goes to the slot table as
before. The adapter (``peer_io.PeerConnector``) hands in the links' messages and connection
events.

Rules:

* A rank is **relayed** from its ``Register`` for a slot that the engine table declares
  owned by another node, until its connection is gone, it registers for another slot, or
  the owner's link goes down. A ``Register`` of a rank that the table's ``nodes`` put on
  another node is refused here, naming that node (``spans.misplaced_rank``): its GPU is not
  on this node (issue 35). Each of its frames goes to the owner unchanged (``Relay``);
  the owner's replies come back unchanged (``Deliver`` → ``ToRank``).
* A link is **up** from the owner's ``Welcome`` until it is silent for
  ``peer_state.silence_limit(liveness_s)``, its connection closes, or the owner refuses it.
  Frames of a rank that arrive while the link is coming up wait for it, up to
  ``liveness_s``; then, and for any frame while the link is down or refused, the rank gets an
  ``Error`` naming the owner node, its address and why (a ``SlotsyncError`` in the trainer):
  a refusal as one (the owner was reached and said no: its ``Refuse``, its ``zmq.auth``
  refusing this node's key, a CURVE handshake that failed, likely a key mismatch), a link
  down with what the last connect attempt met (``on_connect_failed``: nothing listens there,
  no host answers, no answer at all; ``link_monitor.connect_failure``).
* A refused handshake is tried again every ``peer_state.ping_interval(liveness_s)``
  (``Reconnect``: libzmq itself never retries after a refused key), so the link comes back
  by itself within ``liveness_s`` of the refusal's cause being fixed (issue 35).
* Going down, every relayed rank of that owner gets that ``Error`` and is forgotten: its next
  message is answered "not registered" by the slot table, and its publisher registers again
  (relayed anew once the link is back). The owner, seeing the link go down too, fails the
  update in flight; the next round is a full update, as after any failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slotsync.daemon.node_links.link_monitor import connect_failure
from slotsync.daemon.node_links.peer_state import (
    LinkEvent,
    LinkState,
    PeerAction,
    Reconnect,
    ReplyRank,
    SendPeer,
    ToRank,
    ping_interval,
    silence_limit,
)
from slotsync.daemon.node_links.peer_wire import (
    PEER_PROTOCOL_VERSION,
    Deliver,
    Gone,
    Hello,
    PeerMessage,
    Ping,
    Pong,
    Refuse,
    Relay,
    Welcome,
)
from slotsync.daemon.node_links.spans import Roles, misplaced_rank
from slotsync.protocol.wire import (
    Abort,
    Begin,
    Chunk,
    Commit,
    Error,
    ProtocolError,
    Register,
    Registered,
    ToDaemon,
    decode_from_daemon,
)

_PHASE = {Register: "register", Begin: "begin", Chunk: "chunk", Commit: "commit",
          Abort: "abort"}


@dataclass
class _Rank:
    owner: str
    slot: tuple[int, int]
    phase: str = "register"
    update_id: int | None = None
    rank: int = -1
    pid: int = 0
    host: str = ""
    registered: bool = False  # the owner answered its Register with Registered


def _is_registered(frame: bytes) -> bool:
    """Whether the owner's reply ``frame`` to a rank's ``Register`` accepted it."""
    try:
        return isinstance(decode_from_daemon(frame), Registered)
    except ProtocolError:
        return False


@dataclass
class _Owner:
    link: LinkState
    pending: list[tuple[bytes, Relay]] = field(default_factory=list)  # (identity, frame)
    pending_since: float | None = None
    warned: bool = False  # the link's outage was logged (peer_not_connected)
    attempt: str = ""  # what the last connect attempt met (link_monitor.connect_failure)
    retry_at: float | None = None  # when to connect again after a refused handshake


class RelayLinks:
    """The links of one relaying daemon to the owners of its engines over several nodes.

    Args:
        roles: this daemon's ``spans.Roles`` (``relayed``: the slots another node drives).
        liveness_s: the daemon's ``liveness_s`` (seconds).
        daemon_version: told to the owners in ``Hello``.
    """

    def __init__(self, roles: Roles, liveness_s: float, daemon_version: str) -> None:
        self.roles = roles
        self.liveness_s = liveness_s
        self.daemon_version = daemon_version
        self.owners: dict[str, _Owner] = {
            owner: _Owner(LinkState(owner, "drives for us", address))
            for owner, (address, _) in sorted(roles.owners().items())
        }
        self._ranks: dict[bytes, _Rank] = {}
        self._first_poll: float | None = None

    def _started(self, now: float) -> float:
        if self._first_poll is None:
            self._first_poll = now
        return self._first_poll

    # ------------------------------------------------------------------ ranks

    def on_rank_message(self, identity: bytes, msg: ToDaemon, frame: bytes, pid: int,
                        now: float) -> list[PeerAction] | None:
        """A local rank's valid message and its frame; None when it is not relayed (the slot
        table takes it)."""
        if isinstance(msg, Register):
            slot = (msg.slot_start, msg.slot_start + msg.slot_size)
            relayed = self.roles.relayed.get(slot)
            if relayed is None:
                self._ranks.pop(identity, None)  # (re-registered for a slot of this node)
                return None
            misplaced = misplaced_rank(relayed.engine, self.roles.node, msg.rank)
            if misplaced:
                self._ranks.pop(identity, None)
                return [ReplyRank(identity, Error("register", misplaced, list(slot)))]
            self._ranks[identity] = _Rank(relayed.owner, slot, rank=msg.rank, pid=pid,
                                          host=msg.hostname)
        rank = self._ranks.get(identity)
        if rank is None:
            return None
        rank.phase = _PHASE.get(type(msg), rank.phase)
        if isinstance(msg, Begin | Chunk | Commit):
            rank.update_id = msg.update_id
        owner = self.owners[rank.owner]
        relay = Relay(identity, pid, frame)
        # (a Close is relayed and the rank kept: when its connection ends, Gone tells the
        # owner to forget it; forgetting it here left it in the owner's link for good)
        if owner.link.up:
            return [self._send(owner.link, relay)]
        if owner.link.state.startswith(("refused", "down")):
            return self._refuse_rank(identity, rank, owner.link)
        if owner.pending_since is None:
            owner.pending_since = now
        owner.pending.append((identity, relay))  # (the link is coming up)
        return []

    def on_bad_frame(self, identity: bytes, frame: bytes, pid: int) -> list[PeerAction] | None:
        """A local rank's frame that failed validation here: a relayed rank's goes to the
        owner all the same, whose table fails the update at once naming the rank and the field
        (issue 24 D); None for a rank that is not relayed."""
        rank = self._ranks.get(identity)
        if rank is None:
            return None
        owner = self.owners[rank.owner]
        if owner.link.up:
            return [self._send(owner.link, Relay(identity, pid, frame))]
        return self._refuse_rank(identity, rank, owner.link)

    def on_ranks_gone(self, identities: list[bytes], why: str
                      ) -> tuple[list[PeerAction], list[bytes]]:
        """Connections of local ranks ended: ``(actions for the relayed ones, the others)``,
        the others for the slot table."""
        by_owner: dict[str, list[bytes]] = {}
        rest = []
        for ident in identities:
            rank = self._ranks.pop(ident, None)
            if rank is None:
                rest.append(ident)
            else:
                by_owner.setdefault(rank.owner, []).append(ident)
        out: list[PeerAction] = []
        for owner, gone in by_owner.items():
            o = self.owners[owner]
            if o.link.up:
                out.append(self._send(o.link, Gone(gone, why)))
            o.pending = [(i, r) for i, r in o.pending if i not in gone]
        return out, rest

    # ------------------------------------------------------------------ links

    def on_connected(self, owner: str, now: float) -> list[PeerAction]:
        """The link to ``owner`` connected (CURVE handshake done): say ``Hello``."""
        o = self.owners[owner]
        if o.link.up:  # (a new connection under an up link: the old one is gone)
            out = self._down(o, now, "the connection was made again")
        else:
            out = []
        o.attempt, o.retry_at = "", None
        o.link.state, o.link.since = "hello sent", now
        engines = self.roles.owners()[owner][1]
        return out + [self._send(o.link, Hello(self.roles.node, PEER_PROTOCOL_VERSION,
                                               self.daemon_version, engines))]

    def on_disconnected(self, owner: str, now: float, why: str) -> list[PeerAction]:
        """The connection to ``owner`` closed (``why``)."""
        o = self.owners[owner]
        return self._down(o, now, why) if o.link.up else []

    def on_connect_failed(self, owner: str, now: float, why: str) -> list[PeerAction]:
        """A connect attempt to ``owner`` failed before any connection (``why``:
        ``link_monitor.connect_failure``; '' when the adapter's own connect then got through):
        told with the link's state from now on, and in ``peer_not_connected``."""
        self.owners[owner].attempt = why
        return []

    def on_handshake_failed(self, owner: str, now: float, why: str) -> list[PeerAction]:
        """The CURVE handshake with ``owner`` failed (``why``: e.g. the owner does not accept
        this node's key): the link is refused until a handshake succeeds; waiting ranks are
        told; a ``Reconnect`` is due in ``ping_interval``. Logged once per change of state."""
        o = self.owners[owner]
        o.retry_at = now + ping_interval(self.liveness_s)
        out = self._down(o, now, "") if o.link.up else []
        state = f"refused: {why}"
        if o.link.state != state:
            o.link.state, o.link.since = state, now
            out.append(LinkEvent("error", "peer_handshake_failed", {"node": owner,
                                                                    "reason": why}))
        return out + self._flush_pending(o)

    def on_message(self, owner: str, msg: PeerMessage, now: float) -> list[PeerAction]:
        """A decoded message from ``owner``'s daemon."""
        o = self.owners[owner]
        link = o.link
        link.last_heard = now
        link.messages_in += 1
        if isinstance(msg, Welcome):
            link.up, link.state, link.since, link.last_ping = True, "up", now, now
            o.warned = False
            out: list[PeerAction] = [LinkEvent("info", "peer_link_up", {"node": owner})]
            out += [self._send(link, relay) for _, relay in o.pending]
            o.pending, o.pending_since = [], None
            return out
        if isinstance(msg, Refuse):
            out = self._down(o, now, "") if link.up else []
            link.state = f"refused: {msg.reason}"
            return out + [LinkEvent("error", "peer_refused_us", {"node": owner,
                                                                 "reason": msg.reason})] \
                + self._flush_pending(o)
        if isinstance(msg, Deliver):
            rank = self._ranks.get(msg.origin)
            if rank is None:
                return []
            if rank.phase == "register" and not rank.registered:
                rank.registered = _is_registered(msg.frame)
            return [ToRank(msg.origin, msg.frame)]
        if isinstance(msg, Ping):
            return [self._send(link, Pong(msg.sent_s))]
        if isinstance(msg, Pong):
            link.rtt_s = max(0.0, now - msg.sent_s)
        return []

    def poll(self, now: float) -> list[PeerAction]:
        """Pings due, links silent too long, ranks waiting too long for a link to come up."""
        out: list[PeerAction] = []
        for o in self.owners.values():
            link = o.link
            if link.up:
                assert link.last_heard is not None
                if now - link.last_heard > silence_limit(self.liveness_s):
                    out += self._down(o, now, f"nothing on the peer link for "
                                      f"{now - link.last_heard:.1f} s (liveness_s "
                                      f"{self.liveness_s:g}): the daemon is gone or cut off")
                elif now - link.last_ping >= ping_interval(self.liveness_s):
                    link.last_ping = now
                    out.append(self._send(link, Ping(now)))
            elif o.pending_since is not None and now - o.pending_since > self.liveness_s:
                if not link.state.startswith("down: not connected"):
                    link.state = f"down: not connected within {self.liveness_s:g} s"
                out += self._flush_pending(o)
            if o.retry_at is not None and now >= o.retry_at and not link.up:
                o.retry_at = None  # (set again if this attempt is refused too)
                out.append(Reconnect(link.node))
            if not link.up and not o.warned and now - (link.since or self._started(now)) \
                    > self.liveness_s and not link.state.startswith("refused"):
                o.warned = True  # (once per outage: a wrong owner_address, a dead owner)
                out.append(LinkEvent("warning", "peer_not_connected", {
                    "node": link.node, "address": link.address, "state": link.state,
                    "cause": self._attempt(o),
                    "for_s": round(now - (link.since or self._started(now)), 1)}))
        return out

    def next_deadline(self) -> float | None:
        """When ``poll`` next has something to do (monotonic seconds), None if never."""
        ds = []
        for o in self.owners.values():
            if o.link.up:
                ds.append(min(o.link.last_ping + ping_interval(self.liveness_s),
                              (o.link.last_heard or 0.0) + silence_limit(self.liveness_s)))
            else:
                if o.pending_since is not None:
                    ds.append(o.pending_since + self.liveness_s)
                if not o.warned:
                    ds.append((o.link.since or (self._first_poll or 0.0)) + self.liveness_s
                              + 0.01)
                if o.retry_at is not None:
                    ds.append(o.retry_at)
        return min(ds) if ds else None

    def status(self, now: float) -> list[dict]:
        """The links, for ``/status``: with each, the engines it drives for this node."""
        out = []
        for owner, (_, engines) in sorted(self.roles.owners().items()):
            d = self.owners[owner].link.to_status(now)
            d["engines"] = [e.url for e in engines]
            d["relayed_ranks"] = sum(r.owner == owner for r in self._ranks.values())
            d["cause"] = "" if d["up"] else self._attempt(self.owners[owner])  # (issue 35)
            out.append(d)
        return out

    def relayed_ranks(self) -> dict[tuple[int, int], list[dict]]:
        """This node's relayed ranks by slot, for ``/status``: rank, pid, host, the phase of
        its last message, and whether the owner accepted its registration."""
        out: dict[tuple[int, int], list[dict]] = {slot: [] for slot in self.roles.relayed}
        for r in sorted(self._ranks.values(), key=lambda r: (r.slot, r.rank)):
            out.setdefault(r.slot, []).append({"rank": r.rank, "pid": r.pid, "host": r.host,
                                               "phase": r.phase, "registered": r.registered})
        return out

    def registered_ranks(self) -> int:
        """This node's relayed ranks whose registration the owner accepted (they count in
        ``slotsync_ranks_connected`` on this node)."""
        return sum(r.registered for r in self._ranks.values())

    def expected_ranks(self) -> int:
        """The ranks this node's part of each relayed slot holds (``nodes``), for
        ``slotsync_ranks_expected`` on this node."""
        return sum(p.end - p.start for r in self.roles.relayed.values()
                   for p in r.engine.parts if p.node == self.roles.node)

    def relayed_slot_owner(self, slot: tuple[int, int]) -> str | None:
        """The owner node of a relayed slot, None for a slot of this node."""
        r = self.roles.relayed.get(slot)
        return r.owner if r else None

    # ------------------------------------------------------------------ internals

    def _send(self, link: LinkState, msg: PeerMessage) -> SendPeer:
        link.messages_out += 1
        return SendPeer(link.node, msg)

    def _attempt(self, o: _Owner) -> str:
        """What the connect attempts met; once a link never up waited ``liveness_s`` with
        nothing met at all, no answer."""
        link = o.link
        if o.attempt or link.last_heard is not None or link.state.startswith("refused") \
                or not (o.warned or link.state.startswith("down: not connected")):
            return o.attempt
        return connect_failure(link.node, link.address, "no answer")

    def _why_unreachable(self, link: LinkState) -> str:
        if link.state.startswith("refused: "):  # (reached, and it said no: issue 35)
            return (f"node {link.node}'s daemon, which drives this engine, refused this "
                    f"node's peer link at {link.address}: {link.state[len('refused: '):]}")
        attempt = self._attempt(self.owners[link.node])
        return (f"node {link.node}'s daemon, which drives this engine, cannot be reached at "
                f"{link.address} ({link.state}{': ' + attempt if attempt else ''})")

    def _refuse_rank(self, identity: bytes, rank: _Rank, link: LinkState) -> list[PeerAction]:
        self._ranks.pop(identity, None)
        return [ReplyRank(identity, Error(
            rank.phase, f"slot [{rank.slot[0]}, {rank.slot[1]}): "
            + self._why_unreachable(link), list(rank.slot), rank.update_id, fatal=True))]

    def _flush_pending(self, o: _Owner) -> list[PeerAction]:
        out: list[PeerAction] = []
        for ident in dict.fromkeys(i for i, _ in o.pending):
            rank = self._ranks.get(ident)
            if rank is not None:
                out += self._refuse_rank(ident, rank, o.link)
        o.pending, o.pending_since = [], None
        return out

    def _down(self, o: _Owner, now: float, why: str) -> list[PeerAction]:
        link = o.link
        link.up, link.since = False, now
        if why:
            link.state = f"down: {why}"
            link.downs += 1
        out: list[PeerAction] = [LinkEvent("warning", "peer_link_down", {
            "node": link.node, "why": why or link.state})] if why else []
        for ident, rank in list(self._ranks.items()):
            if rank.owner == link.node:
                out += self._refuse_rank(ident, rank, link)
        return out + self._flush_pending(o)

"""The owner's side of the peer links: the nodes whose ranks feed engines this daemon drives.

I/O-free (``peer_state.py`` has the actions). The adapter (``peer_io.PeerListener``) hands
in each decoded link message with the node its CURVE key speaks for, and the time; the slot
table's replies to relayed ranks come in through ``deliver``.

Rules:

* A link is **up** from an accepted ``Hello`` until it is silent for
  ``peer_state.silence_limit(liveness_s)`` (pings go every ``ping_interval``), the connection
  that said the ``Hello`` closes (``on_connection_closed``: told at once by the listener's
  socket monitor when the other daemon is killed, issue 35), or a new ``Hello`` replaces it.
  Going down, every rank relayed over it is gone, all in one ``RanksGone`` naming the node
  and why: an update that needs them fails as it would for ranks of this node whose
  processes died, naming every one of them, and the next one is a full update.
* A ``Hello`` is refused (``Refuse``, and a log line) when the key's node and the node it
  names differ, the link protocol differs, or the node's engine table declares the engines
  this node owns over it differently (``spans.difference`` names the first difference).
* Before a link is up, nothing a peer sends but ``Hello`` (and ``Ping``) is used.
"""

from __future__ import annotations

from slotsync.daemon.node_links import spans
from slotsync.daemon.node_links.peer_state import (
    LinkEvent,
    LinkState,
    PeerAction,
    RanksGone,
    SendPeer,
    ToTable,
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
    SpanEngine,
    Welcome,
    relayed_identity,
    split_relayed,
)


class OwnerLinks:
    """The links of one owner daemon.

    Args:
        node: this daemon's node name.
        owned: the engines over several nodes this node drives (``spans.Roles.owned``).
        liveness_s: the daemon's ``liveness_s`` (seconds): a link silent for 0.8 of it is down.
    """

    def __init__(self, node: str, owned: dict[tuple[int, int], SpanEngine],
                 liveness_s: float) -> None:
        self.node = node
        self.owned = list(owned.values())
        self.liveness_s = liveness_s
        self.links: dict[str, LinkState] = {
            peer: LinkState(peer, "relays to us")
            for peer in sorted({p.node for e in self.owned for p in e.parts} - {node})
        }
        self._origins: dict[str, set[bytes]] = {peer: set() for peer in self.links}

    def on_message(self, peer: str, msg: PeerMessage, now: float,
                   conn: int | None = None) -> list[PeerAction]:
        """A decoded message on the link of the daemon whose key speaks for node ``peer``,
        from connection ``conn`` (the adapter's id of it: its file descriptor)."""
        link = self.links.get(peer)
        if link is None:  # (its key is allowed, but it takes part in no engine of ours)
            return [LinkEvent("warning", "peer_refused", {
                "node": peer, "reason": f"node {peer} takes part in no engine that node "
                f"{self.node} drives"}), SendPeer(peer, Refuse(
                    f"node {self.node} drives no engine over node {peer}"))]
        link.last_heard = now
        link.messages_in += 1
        if isinstance(msg, Hello):
            return self._hello(link, msg, now, conn)
        if isinstance(msg, Ping):
            return [self._send(link, Pong(msg.sent_s))]
        if isinstance(msg, Pong):
            link.rtt_s = max(0.0, now - msg.sent_s)
            return []
        if not link.up:  # (nothing but a Hello opens the link)
            return []
        if isinstance(msg, Relay):
            self._origins[peer].add(msg.origin)
            return [ToTable(relayed_identity(peer, msg.origin), msg.frame, msg.pid)]
        if isinstance(msg, Gone):
            gone = [o for o in msg.origins if o in self._origins[peer]]
            self._origins[peer].difference_update(gone)
            return [RanksGone([relayed_identity(peer, o) for o in gone],
                              f"{msg.why}, on node {peer}")] if gone else []
        return []  # (Welcome, Refuse, Deliver: not for an owner)

    def deliver(self, identity: bytes, frame: bytes) -> list[PeerAction]:
        """The slot table's reply ``frame`` for relayed ``identity``; dropped when its link
        is down (its node's daemon has told the rank already)."""
        where = split_relayed(identity)
        if where is None:
            return []
        link = self.links.get(where[0])
        if link is None or not link.up:
            return []
        return [self._send(link, Deliver(where[1], frame))]

    def on_connection_closed(self, conn: int, now: float) -> list[PeerAction]:
        """Connection ``conn`` closed. The link it carried goes down at once (its daemon was
        killed or stopped, or its host closed it): no waiting for the silence limit. A
        connection no link uses now (one a reconnect replaced) changes nothing."""
        for link in self.links.values():
            if link.up and link.conn == conn:
                return self._down(link, now, "its peer-link connection closed (the daemon "
                                  "stopped or was killed, or its host closed the connection)")
        return []

    def poll(self, now: float) -> list[PeerAction]:
        """Pings due, and links silent too long (down)."""
        out: list[PeerAction] = []
        for link in self.links.values():
            if not link.up:
                continue
            assert link.last_heard is not None
            if now - link.last_heard > silence_limit(self.liveness_s):
                out += self._down(link, now, f"nothing on the peer link for "
                                  f"{now - link.last_heard:.1f} s (liveness_s "
                                  f"{self.liveness_s:g}): the daemon is gone or cut off")
            elif now - link.last_ping >= ping_interval(self.liveness_s):
                link.last_ping = now
                out.append(self._send(link, Ping(now)))
        return out

    def next_deadline(self) -> float | None:
        """When ``poll`` next has something to do (monotonic seconds), None if never."""
        ds = [min(link.last_ping + ping_interval(self.liveness_s),
                  (link.last_heard or 0.0) + silence_limit(self.liveness_s))
              for link in self.links.values() if link.up]
        return min(ds) if ds else None

    def status(self, now: float) -> list[dict]:
        """The links, for ``/status``: with each, the engines it feeds."""
        out = []
        for link in self.links.values():
            d = link.to_status(now)
            d["engines"] = [e.url for e in self.owned if any(p.node == link.node
                                                             for p in e.parts)]
            d["relayed_ranks"] = len(self._origins[link.node])
            out.append(d)
        return out

    # ------------------------------------------------------------------ internals

    def _send(self, link: LinkState, msg: PeerMessage) -> SendPeer:
        link.messages_out += 1
        return SendPeer(link.node, msg)

    def _hello(self, link: LinkState, msg: Hello, now: float,
               conn: int | None) -> list[PeerAction]:
        reason = ""
        if msg.node != link.node:
            reason = (f"the key of node {link.node} speaks as node {msg.node} (each node's "
                      "public key file is named after its node)")
        elif msg.protocol_version != PEER_PROTOCOL_VERSION:
            reason = (f"node {msg.node} speaks peer protocol {msg.protocol_version} (daemon "
                      f"{msg.daemon_version}), node {self.node} {PEER_PROTOCOL_VERSION}: run "
                      "the same slotsync version on every node")
        else:
            reason = spans.difference(self.owned, msg.engines, self.node, msg.node)
        out: list[PeerAction] = []
        if link.up:  # a reconnect: what was relayed over the old connection is gone
            out += self._down(link, now, "its daemon connected again")
        if reason:
            link.state = f"refused: {reason}"
            return out + [LinkEvent("error", "peer_refused", {"node": link.node,
                                                              "reason": reason}),
                          self._send(link, Refuse(reason))]
        link.up, link.state, link.since, link.last_ping = True, "up", now, now
        link.conn = conn
        return out + [LinkEvent("info", "peer_link_up", {"node": link.node,
                                                         "daemon_version": msg.daemon_version}),
                      self._send(link, Welcome(self.node))]

    def _down(self, link: LinkState, now: float, why: str) -> list[PeerAction]:
        link.up, link.state, link.since, link.conn = False, f"down: {why}", now, None
        link.downs += 1
        gone = sorted(self._origins[link.node])
        self._origins[link.node].clear()
        out: list[PeerAction] = [LinkEvent("warning", "peer_link_down", {
            "node": link.node, "why": why, "relayed_ranks": len(gone)})]
        if gone:
            out.append(RanksGone([relayed_identity(link.node, o) for o in gone],
                                 f"node {link.node}'s daemon is unreachable: {why}",
                                 link_lost=True))
        return out

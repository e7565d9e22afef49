"""What the peer-link state machines return, and what they know of each link.

``owner_links.OwnerLinks`` (the owner's side) and ``relay.RelayLinks`` (a relaying node's
side) are I/O-free: they take events (a decoded link message, a rank's frame, a connection
made or lost, the time) and return the actions below, which ``peer_io.py`` carries out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slotsync.daemon.node_links.peer_wire import PeerMessage
from slotsync.protocol.wire import FromDaemon


@dataclass(frozen=True)
class SendPeer:
    """Send ``msg`` on the link to ``node``'s daemon."""

    node: str
    msg: PeerMessage


@dataclass(frozen=True)
class ToTable:
    """Owner: a relayed rank's frame for the slot table, as from socket ``identity`` (a
    ``peer_wire.relayed_identity``) and process ``pid`` on its node."""

    identity: bytes
    frame: bytes
    pid: int


@dataclass(frozen=True)
class RanksGone:
    """Owner: the relayed ranks on these identities are gone, for reason ``why`` (it names
    their node). ``link_lost``: their node's link went down, and their node's daemon has told
    them the update failed, so they release their staging memory: an update in flight fails
    even where they had committed (the engine may still be loading their chunks)."""

    identities: list[bytes]
    why: str
    link_lost: bool = False


@dataclass(frozen=True)
class ToRank:
    """Relaying node: the owner's reply ``frame`` (``wire.FromDaemon`` bytes) for the local
    rank on socket ``identity``."""

    identity: bytes
    frame: bytes


@dataclass(frozen=True)
class ReplyRank:
    """Relaying node: answer the local rank on socket ``identity`` with ``msg`` itself (the
    owner cannot be reached)."""

    identity: bytes
    msg: FromDaemon


@dataclass(frozen=True)
class Reconnect:
    """Relaying node: connect to ``node``'s daemon again (a refused handshake ends libzmq's
    own retries; the owner's key file is read again first: it may have been fixed)."""

    node: str


@dataclass(frozen=True)
class LinkEvent:
    """A change of a link worth a log line: ``event`` (``peer_link_up``, ``peer_link_down``,
    ``peer_refused``, ...) and its fields."""

    level: str  # "info" | "warning" | "error"
    event: str
    fields: dict = field(default_factory=dict)


PeerAction = SendPeer | ToTable | RanksGone | ToRank | ReplyRank | Reconnect | LinkEvent


@dataclass
class LinkState:
    """One peer link as ``/status`` and the metrics show it. Times are monotonic seconds.

    ``role``: ``"relays to us"`` (owner side: the peer's ranks feed engines this node drives)
    or ``"drives for us"`` (relaying side: the peer owns engines this node's ranks feed).
    """

    node: str
    role: str
    address: str = ""
    up: bool = False
    state: str = "not connected yet"
    since: float = 0.0
    last_heard: float | None = None
    messages_in: int = 0
    messages_out: int = 0
    rtt_s: float | None = None
    last_ping: float = 0.0
    downs: int = 0  # times the link went down
    conn: int | None = None  # owner side: the connection (its fd) that said the accepted Hello

    def to_status(self, now: float) -> dict:
        """The ``/status`` entry of this link."""
        return {
            "node": self.node, "role": self.role, "address": self.address, "up": self.up,
            "state": self.state,
            "last_heard_s_ago": None if self.last_heard is None
            else round(now - self.last_heard, 3),
            "messages_in": self.messages_in, "messages_out": self.messages_out,
            "rtt_ms": None if self.rtt_s is None else round(self.rtt_s * 1e3, 3),
            "downs": self.downs,
        }


def ping_interval(liveness_s: float) -> float:
    """Seconds between pings on an idle link: a fifth of ``liveness_s``."""
    return liveness_s / 5


def silence_limit(liveness_s: float) -> float:
    """Seconds of silence after which a link counts as down: 0.8 of ``liveness_s``, so that
    the fault is told within ``liveness_s`` (four pings missed)."""
    return 0.8 * liveness_s

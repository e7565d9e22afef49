"""The peer link's ZeroMQ side: CURVE sockets between the daemons of different nodes.

Thin adapters around the I/O-free ``owner_links.OwnerLinks`` and ``relay.RelayLinks``:

* ``PeerListener`` (a node that owns an engine over several nodes): a ROUTER bound to
  ``peer_listen``, a CURVE server; pyzmq's ``zmq.auth`` authenticator, on the listener's own
  context, accepts only the public keys of ``peer_public_keys`` and names each connection by
  its key's node (the frame's ``User-Id``). A refused key is logged (rate-limited) and
  counted; libzmq drops the handshake, so nothing it sent reaches the daemon.
* ``PeerConnector`` (a node whose ranks feed an engine another node drives): one DEALER per
  owner, a CURVE client that knows the owner's public key (``<owner>.key``), reconnecting by
  itself; its monitor says when the handshake succeeded (``Hello``) or the connection closed.
* ``PeerLinks``: what the ``Daemon`` holds: both of the above as its table needs them, the
  timers, and the routing of replies to relayed ranks.

Both sockets use ZMTP heartbeats at ``liveness_s`` (a silent TCP connection is closed and
made again), on top of the links' own pings, which measure the round-trip time and bound
each fault to ``liveness_s`` (``peer_state.silence_limit``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth.asyncio
import zmq.utils.monitor
import zmq.utils.z85

from slotsync.daemon.logs import RateLimiter, log_event
from slotsync.daemon.node_links.owner_links import OwnerLinks
from slotsync.daemon.node_links.peer_keys import PeerKeys
from slotsync.daemon.node_links.peer_state import (
    LinkEvent,
    PeerAction,
    RanksGone,
    ReplyRank,
    SendPeer,
    ToRank,
    ToTable,
)
from slotsync.daemon.node_links.peer_wire import (
    MAX_PEER_FRAME_BYTES,
    PeerProtocolError,
    decode_peer,
    encode_peer,
    split_relayed,
)
from slotsync.daemon.node_links.relay import RelayLinks
from slotsync.protocol.liveness import heartbeat_options
from slotsync.protocol.wire import FromDaemon, ToDaemon, encode

log = logging.getLogger("slotsync.daemon")
PEER_ZAP_DOMAIN = "slotsync-peers"
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _KeyAllowList:
    """``zmq.auth`` credentials provider: a key of ``peer_public_keys``, or refused (logged
    at most a few times a minute per key, and counted)."""

    def __init__(self, keys: PeerKeys, rejects: RateLimiter, on_refused: Callable[[], None]):
        self.keys, self.rejects, self.on_refused = keys, rejects, on_refused

    def callback(self, _domain: str, key: bytes) -> bool:
        if key in self.keys.peers:
            return True
        self.on_refused()
        if self.rejects.allow(f"key {key!r}", time.monotonic()):
            log_event(log, logging.WARNING, "peer_key_refused", key=key.decode(errors="replace"),
                      hint="a daemon whose public key is not in peer_public_keys tried the "
                      "peer link; nothing it sent is used")
        return False


def _tune(sock: zmq.Socket, liveness_s: float) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_FRAME_BYTES)
    for name, value in heartbeat_options(liveness_s).items():
        sock.setsockopt(getattr(zmq, name), value)


class PeerLinks:
    """The peer links of one daemon: a listener if it owns engines over several nodes, a
    connection per owner if its ranks feed engines others drive.

    Args:
        node: this daemon's node name.
        roles: ``spans.roles`` of its engine table.
        keys: its CURVE keys (``peer_keys.load_keys``); None when it has no link.
        peer_listen: the ``tcp://`` address to bind ('' for none).
        liveness_s: the daemon's ``liveness_s``.
        daemon_version: told in ``Hello``.
        to_table: ``(identity, frame, pid)`` of a relayed rank, for the slot table (owner).
        gone: ``(identities, why, link_lost)`` of relayed ranks gone, for the slot table
            (owner; ``peer_state.RanksGone``).
        send_rank: sends bytes to a local rank's socket identity (relaying node).
        wake: called after actions (deadlines may have moved).
        metrics: ``daemon.service.metrics.Metrics`` (``peer_*`` series).
    """

    def __init__(self, node: str, roles: Any, keys: PeerKeys | None, peer_listen: str,
                 liveness_s: float, daemon_version: str,
                 to_table: Callable[[bytes, bytes, int], Awaitable[None]],
                 gone: Callable[[list[bytes], str, bool], Awaitable[None]],
                 send_rank: Callable[[bytes, bytes], Awaitable[None]],
                 wake: Callable[[], None], metrics: Any) -> None:
        self.node, self.keys, self.peer_listen = node, keys, peer_listen
        self.liveness_s = liveness_s
        self.owner = OwnerLinks(node, roles.owned, liveness_s) if roles.owned else None
        self.relay = RelayLinks(roles, liveness_s, daemon_version) if roles.relayed else None
        self._to_table, self._gone, self._send_rank = to_table, gone, send_rank
        self._wake, self.metrics = wake, metrics
        self._rejects = RateLimiter(burst=3, interval_s=60.0)
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._router_routing: dict[str, bytes] = {}  # node -> its DEALER's routing id
        self._dealers: dict[str, zmq.asyncio.Socket] = {}
        self._monitors: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task] = []
        self.bound_address = ""

    @property
    def active(self) -> bool:
        """Whether this daemon has any peer link."""
        return self.owner is not None or self.relay is not None or bool(self.peer_listen)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the authenticator, bind the listener, connect to the owners.

        Raises:
            zmq.ZMQError: ``peer_listen`` cannot be bound.
        """
        if not self.active:
            return
        assert self.keys is not None
        self._ctx = zmq.asyncio.Context()
        self._auth = zmq.auth.asyncio.AsyncioAuthenticator(self._ctx)
        self._auth.start()  # before any socket that authenticates binds (RFC 27)
        self._auth.configure_curve_callback(PEER_ZAP_DOMAIN, _KeyAllowList(
            self.keys, self._rejects, lambda: self.metrics.bad_messages.inc()))
        keys = self.keys  # (the User-Id of a connection: the node its key speaks for)
        self._auth.curve_user_id = (  # type: ignore[method-assign]
            lambda key: keys.peers.get(zmq.utils.z85.encode(key), ""))
        if self.peer_listen:
            sock = self._ctx.socket(zmq.ROUTER)
            _tune(sock, self.liveness_s)
            sock.curve_server = True
            sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
            sock.zap_domain = PEER_ZAP_DOMAIN.encode()
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting node takes its id back
            try:
                sock.bind(self.peer_listen)
            except zmq.ZMQError as e:
                sock.close(linger=0)
                await self.close()
                raise zmq.ZMQError(e.errno, f"peer_listen {self.peer_listen}: {e}") from None
            self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router = sock
            self._tasks.append(asyncio.create_task(self._listen(), name="slotsync-peers-in"))
        if self.relay is not None:
            for owner, o in self.relay.owners.items():
                key = self.keys.key_of(owner)
                sock = self._ctx.socket(zmq.DEALER)
                _tune(sock, self.liveness_s)
                sock.curve_serverkey = key or b"0" * 40  # (checked at config load)
                sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
                sock.routing_id = self.node.encode()
                sock.setsockopt(zmq.IMMEDIATE, 1)  # (nothing queued for a connection not made)
                sock.setsockopt(zmq.RECONNECT_IVL, 200)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(200, int(self.liveness_s * 250)))
                self._monitors[owner] = sock.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
                sock.connect(o.link.address)
                self._dealers[owner] = sock
                self._tasks.append(asyncio.create_task(self._connection(owner),
                                                       name=f"slotsync-peer-{owner}"))

    async def close(self) -> None:
        """Stop the loops, close the sockets and the authenticator, end the context."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for owner, sock in self._dealers.items():
            sock.disable_monitor()
            self._monitors[owner].close(linger=0)
            sock.close(linger=0)
        self._dealers.clear()
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ the daemon's calls

    async def rank_message(self, identity: bytes, msg: ToDaemon, frame: bytes,
                           pid: int) -> bool:
        """A local rank's message: True when it was relayed (or answered) here."""
        if self.relay is None:
            return False
        actions = self.relay.on_rank_message(identity, msg, frame, pid, time.monotonic())
        if actions is None:
            return False
        await self._execute(actions)
        self._wake()  # (a frame held for a link coming up sets a deadline, with no action)
        return True

    async def bad_rank_frame(self, identity: bytes, frame: bytes, pid: int) -> bool:
        """A local rank's frame failed validation: True when the rank is relayed (the owner
        answers it)."""
        if self.relay is None:
            return False
        actions = self.relay.on_bad_frame(identity, frame, pid)
        if actions is None:
            return False
        await self._execute(actions)
        return True

    async def ranks_gone(self, identities: list[bytes], why: str) -> list[bytes]:
        """Local ranks' connections ended: tells the owners of relayed ones; returns the
        others (for the slot table)."""
        if self.relay is None:
            return identities
        actions, rest = self.relay.on_ranks_gone(identities, why)
        await self._execute(actions)
        return rest

    def is_relayed(self, identity: bytes) -> bool:
        """Whether ``identity`` is a rank of another node, relayed to this owner."""
        return split_relayed(identity) is not None

    async def send_relayed(self, identity: bytes, msg: FromDaemon) -> None:
        """The slot table's reply to a relayed rank: over its node's link."""
        if self.owner is not None:
            await self._execute(self.owner.deliver(identity, encode(msg)))

    def next_deadline(self) -> float | None:
        """When ``poll`` has something to do next (monotonic seconds)."""
        ds = [d for d in (self.owner.next_deadline() if self.owner else None,
                          self.relay.next_deadline() if self.relay else None) if d is not None]
        return min(ds) if ds else None

    async def poll(self, now: float) -> None:
        """Pings due, silent links, ranks waiting too long for a link."""
        if self.owner is not None:
            await self._execute(self.owner.poll(now))
        if self.relay is not None:
            await self._execute(self.relay.poll(now))

    def status(self, now: float) -> dict:
        """``/status``'s ``peers``: this node, the listener and each link."""
        return {
            "node": self.node,
            "listen": self.bound_address or self.peer_listen,
            "links": (self.owner.status(now) if self.owner else [])
            + (self.relay.status(now) if self.relay else []),
        }

    def links(self) -> list:
        """Every ``peer_state.LinkState`` (for the metrics)."""
        out = list(self.owner.links.values()) if self.owner else []
        if self.relay:
            out += [o.link for o in self.relay.owners.values()]
        return out

    # ------------------------------------------------------------------ loops

    async def _listen(self) -> None:
        assert self._router is not None and self.owner is not None
        while True:
            frames = await self._router.recv_multipart(copy=False)
            if len(frames) != 2:
                continue
            node = frames[1].get("User-Id") or ""
            if not node:
                continue
            self._router_routing[node] = frames[0].bytes
            try:
                msg = decode_peer(frames[1].bytes)
            except PeerProtocolError as e:
                self._bad(node, str(e))
                continue
            await self._execute(self.owner.on_message(node, msg, time.monotonic()))

    async def _connection(self, owner: str) -> None:
        assert self.relay is not None
        sock, monitor = self._dealers[owner], self._monitors[owner]
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if monitor in ready:
                event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())
                now = time.monotonic()
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    await self._execute(self.relay.on_connected(owner, now))
                elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    await self._execute(self.relay.on_handshake_failed(
                        owner, now, f"node {owner}'s daemon does not accept this node's key "
                        f"(is {self.node}.key in its peer_public_keys?)"))
                elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                    await self._execute(self.relay.on_handshake_failed(
                        owner, now, f"the CURVE handshake with node {owner} failed (does "
                        f"{owner}.key here hold node {owner}'s public key?)"))
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    await self._execute(self.relay.on_disconnected(
                        owner, now, "its connection closed"))
            if sock in ready:
                frame = await sock.recv()
                try:
                    msg = decode_peer(frame)
                except PeerProtocolError as e:
                    self._bad(owner, str(e))
                    continue
                await self._execute(self.relay.on_message(owner, msg, time.monotonic()))

    def _bad(self, node: str, error: str) -> None:
        self.metrics.bad_messages.inc()
        if self._rejects.allow(f"node {node}", time.monotonic()):
            log_event(log, logging.WARNING, "peer_bad_message", node=node, error=error)

    # ------------------------------------------------------------------ actions

    async def _execute(self, actions: list[PeerAction]) -> None:
        for a in actions:
            if isinstance(a, SendPeer):
                await self._send_peer(a.node, encode_peer(a.msg))
            elif isinstance(a, ToTable):
                await self._to_table(a.identity, a.frame, a.pid)
            elif isinstance(a, RanksGone):
                await self._gone(a.identities, a.why, a.link_lost)
            elif isinstance(a, ToRank):
                await self._send_rank(a.identity, a.frame)
            elif isinstance(a, ReplyRank):
                await self._send_rank(a.identity, encode(a.msg))
            elif isinstance(a, LinkEvent):
                log_event(log, _LEVELS[a.level], a.event, **a.fields)
        if actions:
            self._wake()

    async def _send_peer(self, node: str, frame: bytes) -> None:
        try:
            if node in self._dealers:
                await self._dealers[node].send(frame, zmq.NOBLOCK)
            elif self._router is not None and node in self._router_routing:
                await self._router.send_multipart([self._router_routing[node], frame],
                                                  zmq.NOBLOCK)
        except zmq.ZMQError as e:  # (no connection now: the link's silence will tell)
            log.debug("cannot send to node %s: %s", node, e)

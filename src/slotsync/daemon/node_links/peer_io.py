"""The peer link's ZeroMQ side: CURVE sockets between the daemons of different nodes.

Thin adapters around the I/O-free ``owner_links.OwnerLinks`` and ``relay.RelayLinks``:

* The listener (a node that owns an engine over several nodes): a ROUTER bound to
  ``peer_listen``, a CURVE server; pyzmq's ``zmq.auth`` authenticator, on the listener's own
  context, accepts only the public keys of ``peer_public_keys`` and names each connection by
  its key's node (the frame's ``User-Id``). A refused key is logged (rate-limited) and
  counted; libzmq drops the handshake, so nothing it sent reaches the daemon. Its socket
  monitor (``link_monitor.RouterWatch``) tells when a link's connection closes (the link is
  down at once: a killed daemon's kernel closes it) and when a connection fails its CURVE
  handshake (logged and counted, with where it came from: a stale key of this node there).
  Each frame's connection is its file descriptor (``zmq.SRCFD``); the monitor's events are
  taken before each frame, so a close is told before what came after it (issue 35).
* The connections (a node whose ranks feed an engine another node drives): one DEALER per
  owner, a CURVE client that knows the owner's public key (``<owner>.key``), reconnecting by
  itself; its monitor (``link_monitor.DealerWatch``) says when the handshake succeeded
  (``Hello``), failed (after which the state machine's ``Reconnect`` connects again, with the
  owner's key file read again), or the connection closed; when a connect attempt fails, a
  plain TCP connect asks the OS why (refused, unreachable, no answer).
* ``PeerLinks``: what the ``Daemon`` holds: both of the above as its table needs them, the
  timers, and the routing of replies to relayed ranks.

Both sockets use ZMTP heartbeats at ``liveness_s`` (a silent TCP connection is closed and
made again), on top of the links' own pings, which measure the round-trip time and bound
each fault to ``liveness_s`` (``peer_state.silence_limit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth.asyncio
import zmq.utils.monitor
import zmq.utils.z85

from slotsync.daemon.logs import RateLimiter, log_event
from slotsync.daemon.node_links import link_monitor
from slotsync.daemon.node_links.link_monitor import (
    Closed,
    ConnectFailed,
    DealerWatch,
    HandshakeFailed,
    Handshaken,
    RouterWatch,
)
from slotsync.daemon.node_links.owner_links import OwnerLinks
from slotsync.daemon.node_links.peer_keys import PeerKeys
from slotsync.daemon.node_links.peer_state import (
    LinkEvent,
    PeerAction,
    RanksGone,
    Reconnect,
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


def _remote_address(fd: int) -> str:
    """``"host:port"`` of the TCP connection on ``fd`` (a duplicate is asked, the original
    left alone), '' when it cannot be told (closed already)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return ""
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except (OSError, ValueError):
        return ""
    finally:
        sock.close()


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
        self._router_monitor: zmq.asyncio.Socket | None = None
        self._router_watch = RouterWatch()
        self._router_routing: dict[str, bytes] = {}  # node -> its DEALER's routing id
        self._dealers: dict[str, zmq.asyncio.Socket] = {}
        self._monitors: dict[str, zmq.asyncio.Socket] = {}
        self._watches: dict[str, DealerWatch] = {}
        self._server_keys: dict[str, bytes] = {}  # owner -> the public key its DEALER uses
        self._probes: dict[str, asyncio.Task] = {}  # owner -> the connect probe running
        self._tasks: list[asyncio.Task] = []
        self.bound_address = ""
        self.handshakes_refused = 0  # keys refused and CURVE handshakes failed (listener)

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
            self.keys, self._rejects, self._handshake_refused))
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
            self._router_monitor = sock.get_monitor_socket(link_monitor.ROUTER_EVENTS)
            self._tasks.append(asyncio.create_task(self._listen(), name="slotsync-peers-in"))
        if self.relay is not None:
            for owner, o in self.relay.owners.items():
                key = self.keys.key_of(owner)
                sock = self._ctx.socket(zmq.DEALER)
                _tune(sock, self.liveness_s)
                sock.curve_serverkey = self._server_keys[owner] = key or b"0" * 40  # (checked)
                sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
                sock.routing_id = self.node.encode()
                sock.setsockopt(zmq.IMMEDIATE, 1)  # (nothing queued for a connection not made)
                sock.setsockopt(zmq.RECONNECT_IVL, 200)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(200, int(self.liveness_s * 250)))
                self._monitors[owner] = sock.get_monitor_socket(link_monitor.DEALER_EVENTS)
                self._watches[owner] = DealerWatch()
                sock.connect(o.link.address)
                self._dealers[owner] = sock
                self._tasks.append(asyncio.create_task(self._connection(owner),
                                                       name=f"slotsync-peer-{owner}"))

    async def close(self) -> None:
        """Stop the loops, close the sockets and the authenticator, end the context."""
        tasks = [*self._tasks, *self._probes.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._probes = [], {}
        for owner, sock in self._dealers.items():
            sock.disable_monitor()
            self._monitors[owner].close(linger=0)
            sock.close(linger=0)
        self._dealers.clear()
        if self._router is not None:
            self._router.disable_monitor()
            if self._router_monitor is not None:
                self._router_monitor.close(linger=0)
                self._router_monitor = None
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

    async def settle(self) -> None:
        """Take what the listener's monitor holds now, and the links' silence: called before
        an engine call's failure reaches the slot table (``ActionExecutor``'s ``settle``), so
        that a link lost first is the update's cause, not the engine's error that followed
        it (issue 35: node1's daemon killed mid-update, its ranks free the memory that the
        engine then fails to read, "No such file or directory: '/dev/shm/...'")."""
        if self.owner is None:
            return
        await self._router_events()
        await self._execute(self.owner.poll(time.monotonic()))

    def status(self, now: float) -> dict:
        """``/status``'s ``peers``: this node, the listener and each link; with a listener,
        ``handshakes_refused`` (keys refused and CURVE handshakes failed there)."""
        return {
            "node": self.node,
            "listen": self.bound_address or self.peer_listen,
            **({"handshakes_refused": self.handshakes_refused} if self._router else {}),
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
        poller = zmq.asyncio.Poller()
        poller.register(self._router, zmq.POLLIN)
        if self._router_monitor is not None:
            poller.register(self._router_monitor, zmq.POLLIN)
        while True:
            await poller.poll()
            await self._router_events()
            while True:  # (the monitor's events first, before each frame: see the docstring)
                try:
                    frames = await self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                await self._router_frame(frames)
                await self._router_events()
                await asyncio.sleep(0)  # (a burst of frames: let an engine's answer in)

    async def _router_frame(self, frames: list) -> None:
        assert self.owner is not None
        if len(frames) != 2:
            return
        node = frames[1].get("User-Id") or ""
        if not node:
            return
        self._router_routing[node] = frames[0].bytes
        try:
            msg = decode_peer(frames[1].bytes)
        except PeerProtocolError as e:
            self._bad(node, str(e))
            return
        await self._execute(self.owner.on_message(node, msg, time.monotonic(),
                                                  frames[1].get(zmq.SRCFD)))

    async def _router_events(self) -> None:
        """Every event the listener's monitor holds now, in order (never waits)."""
        while self._router_monitor is not None and self.owner is not None:
            try:
                raw = await self._router_monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = zmq.utils.monitor.parse_monitor_message(raw)
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._router_watch.accepted(ev["value"], _remote_address(ev["value"]))
                continue
            fact = self._router_watch.on_event(ev["event"], ev["value"])
            if isinstance(fact, Closed):
                self._router_watch.forget(fact.fd)
                await self._execute(self.owner.on_connection_closed(fact.fd, time.monotonic()))
            elif isinstance(fact, HandshakeFailed):
                where = self._router_watch.forget(fact.fd or 0)
                text = link_monitor.handshake_from(where, self.node, fact.kind, fact.code)
                if fact.kind == "closed":  # (a TCP check, a connect probe: no key involved)
                    log.debug("peer connection closed during its handshake: %s", text)
                    continue
                self._handshake_refused()
                if self._rejects.allow(f"handshake {where.rpartition(':')[0]}",
                                       time.monotonic()):
                    log_event(log, logging.WARNING, "peer_handshake_failed", reason=text)

    def _handshake_refused(self) -> None:
        self.handshakes_refused += 1
        self.metrics.bad_messages.inc()

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
                await self._dealer_event(owner, event["event"], event["value"])
            if sock in ready:
                frame = await sock.recv()
                try:
                    msg = decode_peer(frame)
                except PeerProtocolError as e:
                    self._bad(owner, str(e))
                    continue
                await self._execute(self.relay.on_message(owner, msg, time.monotonic()))

    async def _dealer_event(self, owner: str, event: int, value: int) -> None:
        assert self.relay is not None and self.keys is not None
        fact = self._watches[owner].on_event(event, value)
        now = time.monotonic()
        if isinstance(fact, Handshaken):
            await self._execute(self.relay.on_connected(owner, now))
        elif isinstance(fact, HandshakeFailed):
            self._stop_connecting(owner)  # (the state machine's Reconnect connects again)
            why = link_monitor.key_refused(owner, self.node, fact.code) if fact.kind == "auth" \
                else link_monitor.handshake_failed(owner, fact.kind, fact.code,
                                                   self.keys.key_file(owner))
            await self._execute(self.relay.on_handshake_failed(owner, now, why))
            # (a refusal like the last one returns no action but sets the next try's time:
            # the timer must see it, or, with nothing else due, node1 never tries again)
            self._wake()
        elif isinstance(fact, Closed):
            await self._execute(self.relay.on_disconnected(owner, now, "its connection closed"))
        elif isinstance(fact, ConnectFailed) and owner not in self._probes:
            self._probes[owner] = asyncio.create_task(self._probe(owner),
                                                      name=f"slotsync-peer-probe-{owner}")

    async def _probe(self, owner: str) -> None:
        """libzmq's connect to ``owner`` failed and says not why: a plain TCP connect asks the
        OS (refused: nothing listens; unreachable; no answer within ``liveness_s``)."""
        assert self.relay is not None
        address = self.relay.owners[owner].link.address
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        why = ""
        try:
            async with asyncio.timeout(self.liveness_s):
                _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            writer.close()  # (something accepts now: libzmq's next attempt gets through)
        except ConnectionRefusedError:
            why = link_monitor.connect_failure(owner, address, "refused")
        except TimeoutError:
            why = link_monitor.connect_failure(owner, address, "no answer")
        except (OSError, ValueError) as e:
            why = link_monitor.connect_failure(owner, address, "unreachable",
                                               getattr(e, "strerror", None) or str(e))
        finally:
            self._probes.pop(owner, None)
        await self._execute(self.relay.on_connect_failed(owner, time.monotonic(), why))

    def _stop_connecting(self, owner: str) -> None:
        """End libzmq's own connecting to ``owner`` (after a failed handshake it would try
        every ``RECONNECT_IVL`` with the same key, or, after a refused key, never again)."""
        assert self.relay is not None
        with contextlib.suppress(zmq.ZMQError):
            self._dealers[owner].disconnect(self.relay.owners[owner].link.address)

    def _reconnect(self, owner: str) -> None:
        """``Reconnect``: connect to ``owner`` again, with its key file read again (a fixed
        ``<owner>.key`` is used without a restart)."""
        assert self.relay is not None and self.keys is not None
        sock = self._dealers.get(owner)
        if sock is None:
            return
        self._stop_connecting(owner)
        path = self.keys.key_file(owner)
        try:
            key, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            log.debug("cannot read %s again: %s", path, e)
        else:
            if key != self._server_keys.get(owner):
                sock.curve_serverkey = self._server_keys[owner] = key
                log_event(log, logging.INFO, "peer_key_reloaded", node=owner, path=path)
        sock.connect(self.relay.owners[owner].link.address)

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
            elif isinstance(a, Reconnect):
                self._reconnect(a.node)
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

"""The daemon's ZeroMQ side: the ROUTER socket's traffic turned into core events.

``Intake`` owns the ZeroMQ context and everything on it:

* the ZAP handler (``peer_auth.py``), bound before the ROUTER so no peer gets in unchecked;
* the ROUTER socket on the ``ipc://`` endpoint (frame cap, handover, ZMTP heartbeats);
* the ROUTER's monitor socket: accepted / handshake / disconnected events, which
  ``liveness.ConnectionBook`` maps to socket identities, with ``liveness.PeerWatch`` for
  process exits;
* frame decode and validation (``wire.decode_to_daemon``); a bad frame is counted, logged at
  most a few times per peer and minute, and handed to the core (``refused``), which answers
  it: a non-fatal ``Error`` to an unregistered peer, a failed update for a registered rank.

It hands the core two kinds of event through callbacks the ``Daemon`` gives it: a decoded
message (``deliver(identity, msg, pid)``) and connections gone (``gone(identities, why)``).
It never touches the core itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio
import zmq.utils.monitor

from slotsync.daemon.logs import RateLimiter, log_event
from slotsync.daemon.service import runtime_dir
from slotsync.daemon.service.config import Config
from slotsync.daemon.service.executor import peer_name
from slotsync.daemon.service.liveness import (
    ConnectionBook,
    PeerWatch,
    closed_why,
    heartbeat_options,
    peer_pid,
    process_state,
)
from slotsync.daemon.service.metrics import Metrics
from slotsync.daemon.service.peer_auth import ZAP_DOMAIN, ZapHandler
from slotsync.protocol.wire import (
    ChunkMetaCache,
    Error,
    FromDaemon,
    ProtocolError,
    ToDaemon,
    decode_to_daemon,
    encode,
)

log = logging.getLogger("slotsync.daemon")
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_FAILED_MASK = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Intake:
    """The ROUTER socket, its ZAP handler and monitor, and frame decode, for one daemon.

    Args:
        config: the daemon's configuration (endpoint, ``max_message_bytes``, ``liveness_s``,
            allowed uids / gids).
        metrics: ``bad_messages`` counts refused peers and rejected frames.
        rejects: rate limit of warnings per peer (shared with the executor's registration
            refusals).
        deliver: called with (socket identity, decoded message, peer pid or 0, the frame as
            received) for each valid message.
        gone: called with (socket identities, why) when connections or their process ended.
        spawn: runs a coroutine as a task the daemon cancels at its close.
        refused: called with (socket identity, ``wire.ProtocolError``, the frame, peer pid or
            0) for each frame that fails validation; the core answers it (a registered rank's
            update fails at once).

    ``bind`` then ``run`` (the receive loop, a task); ``send`` replies; ``close`` at the end.
    """

    def __init__(self, config: Config, metrics: Metrics, rejects: RateLimiter,
                 deliver: Callable[[bytes, ToDaemon, int, bytes], Awaitable[None]],
                 gone: Callable[[list[bytes], str], Awaitable[None]],
                 spawn: Callable[[Coroutine[Any, Any, None]], None],
                 refused: Callable[[bytes, ProtocolError, bytes, int], Awaitable[None]]
                 ) -> None:
        self.config, self.metrics, self._rejects = config, metrics, rejects
        self._deliver, self._gone, self._spawn = deliver, gone, spawn
        self._refused = refused
        self.endpoint = config.endpoint()
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # the ROUTER's connection events
        self._zap: ZapHandler | None = None
        self._book = ConnectionBook()  # identity -> connection fd and pid (liveness)
        self._pids = PeerWatch(self._process_exited, poll_s=config.liveness_s / 2)
        # connections that never sent a message: fds accepted (handshake pending), and fds
        # whose ZMTP handshake succeeded (libzmq's handshake event carries no fd: the oldest
        # pending accept is taken, good enough for one log line)
        self._accepted: list[int] = []
        self._handshaken: set[int] = set()
        self._chunk_meta = ChunkMetaCache()  # each round re-sends the same chunk lists

    def bind(self) -> None:
        """Start the ZAP handler, then bind the ROUTER (and its monitor) to the endpoint and
        open the socket file to the group.

        Raises:
            zmq.ZMQError / OSError: the endpoint cannot be bound.
        """
        uids, gids = self.config.allowed_ids()
        # The ZAP handler must be bound before the ROUTER, or peers get in unchecked.
        self._zap = ZapHandler(self._ctx, uids, gids,
                               on_refused=lambda _r: self.metrics.bad_messages.inc())
        self._zap.start()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops (silently) a peer whose frame exceeds MAXMSGSIZE; keep that as the guard
        # against memory exhaustion at twice the cap, so that frames a little over the cap are
        # still read and answered with a clear error naming the cap.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting rank may reuse its identity
        # A rank whose connection goes silent (hung, stopped, host gone) is cut off within
        # liveness_s; a closed connection or an exited process is seen at once (liveness.py).
        for name, value in heartbeat_options(self.config.liveness_s).items():
            sock.setsockopt(getattr(zmq, name), value)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | _HANDSHAKE_FAILED_MASK)
        sock.bind(self.endpoint)
        runtime_dir.open_to_group(self.endpoint)
        self._sock = sock

    async def close(self) -> None:
        """Stop watching processes, stop the ZAP handler, close the sockets, remove the socket
        file (if this intake bound it) and end the context."""
        await self._pids.close()
        if self._zap is not None:
            await self._zap.stop()
        if self._sock is not None:
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
            self._sock.close(linger=0)
            runtime_dir.release(self.endpoint)
        self._ctx.term()

    async def send(self, identity: bytes, msg: FromDaemon) -> None:
        """Send ``msg`` to the peer with socket ``identity``; a gone peer is logged at debug."""
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, encode(msg)])
        except zmq.ZMQError as e:  # peer gone: nothing to tell it
            log.debug("cannot reply to %s: %s", identity.hex(), e)

    async def send_frame(self, identity: bytes, frame: bytes) -> None:
        """Send an encoded ``wire.FromDaemon`` frame (relayed from an owner) to ``identity``."""
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, frame])
        except zmq.ZMQError as e:  # peer gone: nothing to tell it
            log.debug("cannot reply to %s: %s", identity.hex(), e)

    def log_suppressed(self, now: float) -> None:
        """Log the count of rejected-message warnings held back per peer whose interval ended
        (``now``: monotonic seconds)."""
        for peer, n in self._rejects.due(now):
            log_event(log, logging.WARNING, "rejected_messages_not_logged", peer=peer, count=n,
                      interval_s=self._rejects.interval_s)

    async def run(self) -> None:
        """The receive loop: connection events, then each frame, until cancelled."""
        assert self._sock is not None and self._monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            await poller.poll()
            await self._read_monitor()
            if not await self._sock.poll(0):
                continue
            frames = await self._sock.recv_multipart(copy=False)
            # (connection events first: a disconnect is seen before a message of a new
            # connection that got the closed one's fd)
            await self._read_monitor()
            await self._on_frames(frames)
            # A burst of queued frames (every rank's copy of the next chunk) would otherwise be
            # decoded back to back, since awaiting a frame that is already there does not
            # yield: let an engine's answer in between, so the next call starts sooner.
            await asyncio.sleep(0)

    async def _on_frames(self, frames: list[zmq.Frame]) -> None:
        identity, last = frames[0].bytes, frames[-1]
        fd = last.get(zmq.SRCFD)
        pid = peer_pid(last.get("Peer-Address"))
        self._handshaken.discard(fd)
        if fd in self._accepted:
            self._accepted.remove(fd)
        gone = self._book.seen(identity, fd, pid)
        if gone:  # (a new connection on a closed one's fd: that one is gone)
            await self._connections_gone(gone, "its connection closed")
        self._pids.watch(pid)
        peer = f"pid {pid}" if pid else peer_name(identity)
        if len(frames) != 2:
            self._reject(peer, f"{len(frames) - 1} frames")
            await self.send(
                identity,
                Error("decode", f"expected 1 frame, got {len(frames) - 1}", fatal=False),
            )
            return
        data = last.bytes
        try:
            msg = decode_to_daemon(data, self.config.max_message_bytes, self._chunk_meta)
        except ProtocolError as e:
            self._reject(peer, str(e))
            await self._refused(identity, e, data, pid)  # (answered by the core: it knows
            # the rank; a rank relayed to another node's daemon, by that daemon)
            return
        await self._deliver(identity, msg, pid, data)

    def _reject(self, peer: str, error: str) -> None:
        """A frame that is not a valid message: counted, answered, and logged at most a few
        times per peer and minute (a peer sending junk must not flood the journal)."""
        self.metrics.bad_messages.inc()
        now = time.monotonic()
        if self._rejects.allow(peer, now):
            log_event(log, logging.WARNING, "rejected_message", peer=peer, error=error)
        self.log_suppressed(now)

    async def _read_monitor(self) -> None:
        """Handle the ROUTER's pending connection events (never waits)."""
        assert self._monitor is not None
        while await self._monitor.poll(0):
            event = zmq.utils.monitor.parse_monitor_message(
                await self._monitor.recv_multipart())
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted.append(fd)
                del self._accepted[:-1024]  # (bounded)
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._accepted:
                    self._handshaken.add(self._accepted.pop(0))
            elif event["event"] in _HANDSHAKE_FAILED:
                if self._accepted:  # (a publisher's socket check: connect, close, no ZMTP)
                    self._accepted.pop(0)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                if fd in self._accepted:
                    self._accepted.remove(fd)  # (no handshake: a probe's connect, not a peer)
                pid = self._book.pid_of_fd(fd)
                gone = self._book.disconnected(fd)
                if gone:
                    self._spawn(self._closed(gone, pid))
                elif fd in self._handshaken:
                    self._handshaken.discard(fd)
                    # libzmq drops a peer whose frame is over MAXMSGSIZE without a word: say so
                    if self._rejects.allow("silent", time.monotonic()):
                        log_event(log, logging.INFO, "connection_closed_without_message",
                                  fd=fd, hint="a peer that connected and left, or sent a frame "
                                  f"over the socket's limit of {2 * self.config.max_message_bytes}"
                                  " bytes, which libzmq drops with the connection")

    async def _closed(self, identities: list[bytes], pid: int) -> None:
        """Connections of process ``pid`` closed: say whether the process died (a SIGKILLed
        rank's socket closes a moment before its exit is visible) or closed them."""
        if pid and await self._pids.exits_within(pid, 0.25):
            why = f"its process (pid {pid}) exited"
        else:  # (a rank whose publisher sent wire.Close is gone already: this says nothing)
            why = closed_why(pid, process_state(pid) if pid else "", self.config.liveness_s,
                             2 * self.config.max_message_bytes)
        await self._connections_gone(identities, why)

    async def _connections_gone(self, identities: list[bytes], why: str) -> None:
        self._pids.keep_only(self._book.pids())
        await self._gone(identities, why)

    def _process_exited(self, pid: int) -> None:
        """``PeerWatch``: process ``pid`` ended; its ranks are gone."""
        gone = self._book.exited(pid)
        if gone:
            self._spawn(self._connections_gone(gone, f"its process (pid {pid}) exited"))

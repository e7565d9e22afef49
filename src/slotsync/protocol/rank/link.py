"""The trainer side's one ZeroMQ client of the daemon: a DEALER socket (one frame per message,
no empty delimiter frame), optionally with ZMTP heartbeats and a monitor of its connection.

Used by ``Publisher``, the control-plane benchmark's ranks (``bench/control.py``) and the
fault tests' raw ranks (``tests/faults_lib.WireRank``). It only moves frames and reports
connection events; what a message means is ``session.py``'s business.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Literal

import zmq
import zmq.utils.monitor

from slotsync.protocol import wire
from slotsync.protocol.liveness import heartbeat_options, peer_pid

__all__ = ["DaemonLink"]

_MONITORED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED
              | zmq.EVENT_DISCONNECTED)


class DaemonLink:
    """A DEALER socket connected to the daemon's ROUTER endpoint.

    Args:
        endpoint: the daemon's ZeroMQ endpoint, e.g. ``ipc:///run/slotsync/d.sock``.
        routing_id: a fixed ZeroMQ routing id (bytes): after a reconnect the daemon
            (ROUTER_HANDOVER) still knows which registered rank is talking.
        liveness_s: ZMTP heartbeats (``liveness.heartbeat_options``): a silent daemon's
            connection closes within this many seconds. None: no heartbeats.
        monitor: watch the connection (handshake refused by ZAP, succeeded, disconnected):
            ``events`` reads them.
        send_timeout_s: a blocking ``send`` raises ``zmq.Again`` after this many seconds
            (None: never).
        linger_ms: how long ``close`` lets unsent messages try to get out (milliseconds).

    Raises:
        ValueError: the endpoint cannot be connected to (names it).
    """

    def __init__(self, endpoint: str, *, routing_id: bytes | None = None,
                 liveness_s: float | None = None, monitor: bool = False,
                 send_timeout_s: float | None = None, linger_ms: int = 0) -> None:
        self.endpoint = endpoint
        self.linger_ms = linger_ms
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.monitor: zmq.Socket | None = None
        self.peer_pid = 0  # the daemon's pid, from its replies' Peer-Address (SO_PEERCRED)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if liveness_s is not None:
            # answered by libzmq's I/O thread: a rank busy in a forward pass still answers
            for name, value in heartbeat_options(liveness_s).items():
                self.sock.setsockopt(getattr(zmq, name), value)
        if monitor:
            self.monitor = self.sock.get_monitor_socket(_MONITORED)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        if self.monitor is not None:
            self._poller.register(self.monitor, zmq.POLLIN)
        try:
            if send_timeout_s is not None:
                self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
            self.sock.connect(endpoint)
        except zmq.ZMQError as e:
            self.close(linger_ms=0)
            raise ValueError(f"cannot connect to daemon endpoint {endpoint!r}: {e}") from e

    def send(self, msg: wire.ToDaemon | wire.OutgoingChunk | bytes, *,
             block: bool = True) -> None:
        """Send one message (or an already encoded frame).

        Raises:
            zmq.Again: no room within ``send_timeout_s`` (or at once, ``block=False``).
        """
        frame = msg if isinstance(msg, bytes) else wire.encode(msg)
        self.sock.send(frame, 0 if block else zmq.NOBLOCK)

    def send_frames(self, frames: list[bytes]) -> None:
        """Send one multipart message as given (tests of the daemon's framing rules)."""
        self.sock.send_multipart(frames)

    def poll(self, timeout_s: float) -> Literal["event", "message"] | None:
        """Wait up to ``timeout_s`` seconds for a connection event (checked first) or a
        reply; None when neither came."""
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if self.monitor is not None and self.monitor in ready:
            return "event"
        return "message" if self.sock in ready else None

    def has_message(self) -> bool:
        """Whether a reply is waiting (never waits)."""
        return bool(self.sock.poll(0))

    def recv_frame(self) -> bytes:
        """The waiting reply's frame (``has_message`` or ``poll`` said there is one); notes
        the daemon's pid."""
        frame = self.sock.recv(zmq.NOBLOCK, copy=False)
        if not self.peer_pid:
            with contextlib.suppress(zmq.ZMQError):
                self.peer_pid = peer_pid(frame.get("Peer-Address"))
        return frame.bytes

    def recv(self, timeout_s: float) -> wire.FromDaemon | None:
        """The next reply within ``timeout_s`` seconds, decoded; None if none came.

        Raises:
            wire.ProtocolError: the reply does not decode.
        """
        deadline = time.monotonic() + timeout_s
        while (kind := self.poll(max(0.0, deadline - time.monotonic()))) is not None:
            if kind == "message":
                return wire.decode_from_daemon(self.recv_frame())
            list(self.events())  # (a connection event: not what this caller waits for)
        return None

    def events(self) -> Iterator[int]:
        """The connection's pending monitor events (``zmq.EVENT_*``), never waiting."""
        if self.monitor is None:
            return
        while self.monitor.poll(0):
            yield zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran."""
        return self.ctx.closed

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket (letting unsent messages out for ``linger_ms``, default the
        constructor's) and the context. Idempotent."""
        if self.ctx.closed:
            return
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=self.linger_ms if linger_ms is None else linger_ms)
        self.ctx.term()

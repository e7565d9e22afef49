"""What both ends of the daemon's ZeroMQ connection use to tell that the other is gone.

ZMTP heartbeats (``ZMQ_HEARTBEAT_IVL`` / ``_TIMEOUT`` / ``_TTL``, ZeroMQ RFC 37) run in
libzmq's I/O thread: a trainer busy in a forward pass, holding the GIL, still answers them,
while a hung or stopped process or a dead host does not, and libzmq then closes the connection
(which each side's socket monitor reports as ``EVENT_DISCONNECTED``). Application pings would
need a thread in every trainer process; heartbeats need none. A process that exits closes its
connection at once, with no heartbeat involved.

Both the daemon and the publisher must use ``heartbeat_options`` with their own
``liveness_s``: each side detects the other's silence alone.
"""

from __future__ import annotations

__all__ = ["heartbeat_options", "parse_peer", "peer_pid"]


def heartbeat_options(liveness_s: float) -> dict[str, int]:
    """ZeroMQ socket options (names of ``zmq`` constants -> milliseconds) under which a
    silent peer's connection is closed within ``liveness_s`` seconds: a ping every quarter of
    it, the connection closed when no traffic came for three quarters after a ping; ``TTL``
    tells the peer to close its own side if it hears nothing for ``liveness_s``."""
    ms = max(100, int(liveness_s * 1000))
    return {"HEARTBEAT_IVL": max(25, ms // 4), "HEARTBEAT_TIMEOUT": max(75, ms * 3 // 4),
            "HEARTBEAT_TTL": ms}


def parse_peer(peer_address: str | None) -> tuple[int, int, int] | None:
    """``(uid, gid, pid)`` from a ZeroMQ ``Peer-Address`` (or a ZAP request's address),
    which libzmq (built with SO_PEERCRED, as pyzmq's bundled one is) sets to
    ``localhost:uid:gid:pid`` on ``ipc://`` connections: the kernel's view, in the receiver's
    pid namespace. None when it carries no credentials (TCP, a libzmq without SO_PEERCRED)."""
    parts = (peer_address or "").split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1]), int(parts[2]), int(parts[3])


def peer_pid(peer_address: str | None) -> int:
    """The pid in a ``Peer-Address`` (see ``parse_peer``), 0 when there is none (or the
    kernel cannot name the process in this pid namespace)."""
    peer = parse_peer(peer_address)
    return peer[2] if peer else 0

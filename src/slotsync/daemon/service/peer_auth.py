"""Peer credential check for the ZeroMQ socket: a ZAP handler (ZeroMQ RFC 27) that accepts
an ``ipc://`` peer only if its uid or gid is on the allow-list.

libzmq (4.3, built with SO_PEERCRED, as pyzmq's bundled one is) puts the connecting
process's credentials into the ZAP request's address as ``localhost:<uid>:<gid>:<pid>``. The
handler answers 200 (with ``User-Id = uid:gid:pid``) or 400, and logs every refusal. This is
the second fence: the socket's directory is already reachable only by the service user and its
group (``RuntimeDirectoryMode=0770``).

I/O-free part: ``decide(address, allow_uids, allow_gids)``; the asyncio REP loop around it is
``ZapHandler``.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from slotsync.daemon.logs import log_event
from slotsync.protocol.liveness import parse_peer

__all__ = ["ZAP_DOMAIN", "ZAP_ENDPOINT", "ZapHandler", "decide", "parse_peer"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27
ZAP_DOMAIN = b"slotsync"
log = logging.getLogger("slotsync.daemon")


def decide(address: str, allow_uids: set[int], allow_gids: set[int]) -> tuple[bool, str]:
    """Whether to accept the peer, and a reason for the log. Peers without credentials are
    refused: the daemon only listens on ipc:// where credentials are always known."""
    peer = parse_peer(address)
    if peer is None:
        return False, f"no peer credentials in ZAP address {address!r}"
    uid, gid, pid = peer
    if uid in allow_uids or gid in allow_gids:
        return True, f"uid {uid} gid {gid} pid {pid}"
    return False, (f"uid {uid} gid {gid} pid {pid} is not allowed (allowed uids "
                   f"{sorted(allow_uids)}, gids {sorted(allow_gids)})")


class ZapHandler:
    """Serves ZAP requests on ``ctx`` until ``stop``. Bind it before any socket that sets
    ``zap_domain`` binds, or libzmq lets connections through unauthenticated.

    Args:
        ctx: the daemon's context (inproc is per context).
        allow_uids, allow_gids: accepted peer user and group ids.
        on_refused: called with the reason after each refusal (metrics).
    """

    def __init__(self, ctx: zmq.asyncio.Context, allow_uids: set[int], allow_gids: set[int],
                 on_refused=None) -> None:
        self.allow_uids, self.allow_gids = allow_uids, allow_gids
        self._on_refused = on_refused
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve(), name="slotsync-zap")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)

    async def _serve(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            version, request_id = frames[0], frames[1]
            address = frames[3].decode(errors="replace") if len(frames) > 3 else ""
            ok, reason = decide(address, self.allow_uids, self.allow_gids)
            if ok:
                peer = parse_peer(address)
                user = ":".join(str(x) for x in peer).encode() if peer else b""
                await self._sock.send_multipart([version, request_id, b"200", b"OK", user, b""])
            else:
                log_event(log, logging.WARNING, "peer_refused", reason=reason)
                if self._on_refused is not None:
                    self._on_refused(reason)
                await self._sock.send_multipart([version, request_id, b"400",
                                                 b"peer not allowed", b"", b""])

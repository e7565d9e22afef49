"""The daemon's asyncio service: thin adapters around the I/O-free ``SlotTable``.

* ZeroMQ intake: a ROUTER socket on an ``ipc://`` path; each frame is decoded and validated
  (``wire.decode_to_daemon``) and handed to the table with the sender's identity.
* Timers: one task sleeps until the earliest deadline and calls ``SlotTable.poll``.
* Actions: ``executor.ActionExecutor`` runs what the table returns (replies, engine calls on
  its client pool, the durable record, update-end logs); the socket folder and socket file are
  ``runtime_dir.py``'s.
* Status server: ``/healthz``, ``/status``, ``/metrics`` (``status_documents.py``).

Everything runs on one event loop, so the core is never entered concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.utils.monitor

from slotsync import __version__
from slotsync.daemon import runtime_dir
from slotsync.daemon.config import Config, ConfigError, read_config_file
from slotsync.daemon.coordinator import (
    Action,
    Timeouts,
)
from slotsync.daemon.executor import ActionExecutor, peer_name, slot_text
from slotsync.daemon.liveness import ConnectionBook, PeerWatch, heartbeat_options, peer_pid
from slotsync.daemon.logs import RateLimiter, log_event
from slotsync.daemon.metrics import Metrics
from slotsync.daemon.mid_update_record import MidUpdateEngine, MidUpdateRecord
from slotsync.daemon.peer_auth import ZAP_DOMAIN, ZapHandler
from slotsync.daemon.runtime_dir import DaemonAlreadyRunning as DaemonAlreadyRunning
from slotsync.daemon.slot_table import SlotTable
from slotsync.daemon.status_documents import daemon_status, status_line
from slotsync.daemon.status_server import StatusServer
from slotsync.daemon.systemd import Notifier
from slotsync.protocol.wire import (
    ChunkMetaCache,
    Error,
    ProtocolError,
    decode_to_daemon,
    encode,
)

log = logging.getLogger("slotsync.daemon")
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_FAILED_MASK = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)



def _engine_table(engines) -> tuple[dict, dict]:
    """``config.engines`` as ``SlotTable.set_engine_table`` takes it: URLs and GPU UUIDs."""
    return ({e.slot: e.url for e in engines},
            {e.slot: tuple(e.gpu_uuids) for e in engines if e.gpu_uuids})


class Daemon:
    """One node daemon.

    Args:
        config: validated configuration.

    Use ``await start()``, then ``await wait_stopped()``; ``stop()`` fails any update in
    flight (ranks told, engine left paused, design.md I4) and closes everything.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics(__version__)
        self.table = SlotTable(
            Timeouts(config.begin_timeout_s, config.chunk_timeout_s, config.commit_timeout_s,
                     config.liveness_s),
            __version__,
            config.chunks_in_flight,
            config.omitted_names,
            config.slot_release_s,
            config.max_message_bytes,
        )
        self.metrics.watch(self.table)  # slot/rank/in-flight gauges read the table per scrape
        self.endpoint = config.endpoint()
        self.started_at = time.time()
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # the ROUTER's connection events
        self._book = ConnectionBook()  # identity -> connection fd and pid (liveness)
        self._pids = PeerWatch(self._process_exited, poll_s=config.liveness_s / 2)
        # connections that never sent a message: fds accepted (handshake pending), and fds
        # whose ZMTP handshake succeeded (libzmq's handshake event carries no fd: the oldest
        # pending accept is taken, good enough for one log line)
        self._accepted: list[int] = []
        self._handshaken: set[int] = set()
        # rejected-message warnings per peer: the first few, then a count per minute
        self._rejects = RateLimiter(burst=5, interval_s=60.0)
        self._zap: ZapHandler | None = None
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._status: StatusServer | None = None
        self._loops: list[asyncio.Task] = []
        self.notifier = Notifier()
        if config.engines:
            self.table.set_engine_table(*_engine_table(config.engines))
        self.record = MidUpdateRecord(config.state_path())
        self._chunk_meta = ChunkMetaCache()  # each round re-sends the same chunk lists
        self.executor = ActionExecutor(self.table, self.record, self.metrics, self._send,
                                       self._rejects, config.engine_timeout_s,
                                       self._after_actions, time.monotonic)
        self.restored: list[MidUpdateEngine] = []

    @property
    def status_port(self) -> int:
        """The status server's bound port, -1 when it is off."""
        return self._status.port if self._status else -1

    async def start(self) -> None:
        """Bind the ZeroMQ socket and the status server, then start serving.

        Raises:
            DaemonAlreadyRunning: a live daemon owns the socket path.
            OSError / zmq.ZMQError: the socket or port cannot be bound.
        """
        runtime_dir.prepare(self.endpoint)
        # Engines a killed predecessor left mid-update stay paused and need a full update.
        self.restored = self.record.load()
        for d in self.restored:
            self.table.restore(d.slot, d.engine_url, d.update_id, d.weight_version, d.state)
            log_event(log, logging.WARNING, "engine_left_mid_update", slot=slot_text(d.slot),
                      engine=d.engine_url, update_id=d.update_id, version=d.weight_version,
                      state=d.state)
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
        if self.config.status_port >= 0:
            self._status = StatusServer(
                self.config.status_host, self.config.status_port, self.status, self.metrics,
                drop=self.drop_slot,
            )
            try:
                await self._status.start()
            except OSError as e:
                self._status = None
                await self.stop("status server failed")  # leave no socket file behind
                raise OSError(
                    f"cannot serve status on {self.config.status_host}:"
                    f"{self.config.status_port} (--status-port / --status-host): {e.strerror}"
                ) from None
        self._loops = [
            asyncio.create_task(self._recv_loop(), name="slotsync-intake"),
            asyncio.create_task(self._timer_loop(), name="slotsync-timers"),
        ]
        if self.notifier.watchdog_s:
            self._loops.append(asyncio.create_task(self._watchdog_loop(), name="slotsync-wd"))
        log_event(
            log, logging.INFO, "listening", endpoint=self.endpoint,
            status=f"http://{self.config.status_host}:{self.status_port}" if self._status
            else "off", engines=len(self.config.engines),
        )
        # Only now, with both sockets bound, may systemd start the units that need us.
        self.notifier.notify(READY=1, STATUS=self.status_line())

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def shutdown(self, reason: str, grace_s: float | None = None) -> None:
        """Graceful stop: refuse new registrations and updates, give updates in flight up to
        ``grace_s`` (default ``config.shutdown_grace_s``) to finish, then fail the rest (ranks
        told, engines left paused and marked, design.md I4) and close."""
        if self.table.draining:
            await self.stop(reason)  # a second signal: stop now
            return
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.table.on_drain()
        self.notifier.notify(STOPPING=1, STATUS=f"stopping ({reason})")
        n = self.table.updates_in_flight()
        log_event(log, logging.INFO, "shutdown", reason=reason, updates_in_flight=n,
                  grace_s=grace)
        deadline = time.monotonic() + grace
        while self.table.updates_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # (the timer loop owns _wake)
        left = self.table.updates_in_flight()
        await self.stop(f"{reason}; shutdown grace of {grace:g} s expired" if left else reason)

    def reload(self) -> None:
        """SIGHUP: re-read the engine table from the config file (other options need a
        restart). A bad file is logged and the running table kept."""
        if not self.config.config_file:
            log_event(log, logging.WARNING, "reload_skipped", reason="no config file")
            return
        try:
            fresh = read_config_file(Path(self.config.config_file))
            from slotsync.daemon.config import check_engine_table

            check_engine_table(fresh.engines)
        except (ConfigError, ValueError) as e:
            log_event(log, logging.ERROR, "reload_failed", error=str(e))
            return
        changes = self.table.set_engine_table(*_engine_table(fresh.engines))
        self.config.engines = fresh.engines
        log_event(log, logging.INFO, "reload", changes=changes or ["none"])
        self._after_actions()

    async def drop_slot(self, slot: tuple[int, int], force: bool = False) -> dict:
        """The operator drops ``slot`` (``SlotTable.drop``): its ranks are forgotten and it is
        released; with ``force`` an update in flight fails first. Returns what was dropped.

        Raises:
            KeyError: no such slot.
            RuntimeError: an update runs and ``force`` is not set (or an engine call is still
                out).
        """
        c = self.table.slots.get(slot)
        ranks = sorted(c.ranks) if c is not None else []
        actions = self.table.drop(slot, time.monotonic(), force=force)
        log_event(log, logging.WARNING, "slot_dropped", slot=slot_text(slot), force=force,
                  ranks=ranks)
        await self.executor.execute(actions)
        left = self.table.released.get((c.engine_url or "").rstrip("/")) if c else None
        return {"dropped": list(slot), "ranks": ranks, "engine_url": c.engine_url if c else None,
                "needs_full_update": bool(c and c.engine.needs_full_update),
                "engine_remembered": left is not None or slot in self.table.slots}

    def status_line(self) -> str:
        """One line for systemd's STATUS= (``status_documents.status_line``)."""
        return status_line(self.table, self.executor.last_update)

    async def stop(self, reason: str = "daemon stopping") -> None:
        """Fail updates in flight, tell their ranks, close sockets and sessions."""
        if self._stopped.is_set():
            return
        await self.executor.execute(self.table.shutdown(time.monotonic(), reason))
        await self.executor.close(*self._loops)
        self.notifier.close()
        if self._status is not None:
            await self._status.stop()
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
        self._stopped.set()

    def status(self) -> dict:
        """The ``/status`` document (``status_documents.daemon_status``)."""
        return daemon_status(self.table, __version__, self.endpoint, self.started_at,
                             time.monotonic())

    # ------------------------------------------------------------------ adapters

    async def _recv_loop(self) -> None:
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
            await self._send(
                identity,
                Error("decode", f"expected 1 frame, got {len(frames) - 1}", fatal=False),
            )
            return
        try:
            msg = decode_to_daemon(last.bytes, self.config.max_message_bytes, self._chunk_meta)
        except ProtocolError as e:
            self._reject(peer, str(e))
            await self._send(identity, Error("decode", str(e), fatal=False))
            return
        await self.executor.execute(self.table.on_message(identity, msg, time.monotonic(), pid))

    def _reject(self, peer: str, error: str) -> None:
        """A frame that is not a valid message: counted, answered, and logged at most a few
        times per peer and minute (a peer sending junk must not flood the journal)."""
        self.metrics.bad_messages.inc()
        now = time.monotonic()
        if self._rejects.allow(peer, now):
            log_event(log, logging.WARNING, "rejected_message", peer=peer, error=error)
        self._log_suppressed(now)

    def _log_suppressed(self, now: float) -> None:
        for peer, n in self._rejects.due(now):
            log_event(log, logging.WARNING, "rejected_messages_not_logged", peer=peer, count=n,
                      interval_s=self._rejects.interval_s)

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
                    self.executor.spawn(self._closed(gone, pid))
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
        else:
            why = ("its connection closed (the process closed it, it answered no heartbeat "
                   f"within liveness_s={self.config.liveness_s:g} s, or it sent a frame over "
                   f"the socket's limit of {2 * self.config.max_message_bytes} bytes)")
        await self._connections_gone(identities, why)

    async def _connections_gone(self, identities: list[bytes], why: str) -> None:
        now = time.monotonic()
        actions: list[Action] = []
        for ident in identities:
            actions += self.table.on_connection_gone(ident, now, why)
        self._pids.keep_only(self._book.pids())
        if actions:
            await self.executor.execute(actions)

    def _process_exited(self, pid: int) -> None:
        """``PeerWatch``: process ``pid`` ended; its ranks are gone."""
        gone = self._book.exited(pid)
        if gone:
            self.executor.spawn(self._connections_gone(gone, f"its process (pid {pid}) exited"))

    async def _wait_wake(self, timeout: float | None) -> None:
        """Sleep until ``_wake`` is set or ``timeout`` passes. ``asyncio.timeout`` rather than
        ``wait_for``: on 3.11 ``wait_for`` can swallow a cancellation that races with the
        inner wait completing, and the daemon then never stops."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()

    async def _timer_loop(self) -> None:
        while True:
            ds = [d for d in (self.table.next_deadline(), self._rejects.next_due())
                  if d is not None]
            await self._wait_wake(max(0.0, min(ds) - time.monotonic()) if ds else None)
            now = time.monotonic()
            self._log_suppressed(now)
            await self.executor.execute(self.table.poll(now))

    async def _watchdog_loop(self) -> None:
        # WATCHDOG=1 from the event loop itself, at half the interval: a stuck loop stops it.
        assert self.notifier.watchdog_s
        while True:
            self.notifier.notify(WATCHDOG=1)
            await asyncio.sleep(self.notifier.watchdog_s / 2)

    async def _send(self, identity: bytes, msg) -> None:
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, encode(msg)])
        except zmq.ZMQError as e:  # peer gone: nothing to tell it
            log.debug("cannot reply to %s: %s", identity.hex(), e)

    def _after_actions(self) -> None:
        self.notifier.status(self.status_line())
        self._wake.set()  # deadlines may have moved

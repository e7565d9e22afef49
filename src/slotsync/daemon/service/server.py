"""The daemon's asyncio service: thin adapters around the I/O-free ``SlotTable``, and the
daemon's lifecycle.

* ZeroMQ intake: ``intake.Intake`` (the ROUTER socket, ZAP, the socket monitor, frame decode)
  hands the table messages and connections gone.
* Timers: one task sleeps until the earliest deadline and calls ``SlotTable.poll``.
* Actions: ``executor.ActionExecutor`` runs what the table returns (replies, engine calls on
  its client pool, the durable record, update-end logs); the socket folder and socket file are
  ``runtime_dir.py``'s.
* Status server: ``/healthz``, ``/status``, ``/metrics`` (``status_documents.py``).
* Peer links (engines over several nodes, ``peer_io.PeerLinks``): a relaying node's ranks'
  frames go to the owner's daemon instead of the table; an owner's table gets the relayed
  ranks' frames and connections gone, and its replies to them go back over the link.
* Lifecycle, as uvicorn's ``Server`` (uvicorn/server.py: ``startup``, ``main_loop``,
  ``shutdown``): ``serve`` runs ``start``, ``main_loop`` and ``shutdown``. The signal handlers
  only set flags (``should_exit``, ``force_exit``, ``reload_requested``) and wake the main
  loop, which acts on them; the graceful shutdown is bounded by ``shutdown_grace_s``.

Everything runs on one event loop, so the core is never entered concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path

import zmq

from slotsync import __version__
from slotsync.daemon.core.coordinator import (
    Action,
    Timeouts,
)
from slotsync.daemon.core.slot_table import SlotTable
from slotsync.daemon.families import FAMILIES
from slotsync.daemon.logs import RateLimiter, log_event
from slotsync.daemon.node_links import spans
from slotsync.daemon.node_links.peer_io import PeerLinks
from slotsync.daemon.node_links.peer_keys import PeerKeyError, load_keys
from slotsync.daemon.node_links.peer_wire import split_relayed
from slotsync.daemon.service import runtime_dir
from slotsync.daemon.service.adapter_io import AdapterIO
from slotsync.daemon.service.adapter_root import AdapterDirError
from slotsync.daemon.service.config import Config, ConfigError, read_config_file
from slotsync.daemon.service.engine_keys import read_engine_keys
from slotsync.daemon.service.executor import ActionExecutor, slot_text
from slotsync.daemon.service.intake import Intake
from slotsync.daemon.service.metrics import Metrics
from slotsync.daemon.service.mid_update_record import MidUpdateEngine, MidUpdateRecord
from slotsync.daemon.service.runtime_dir import DaemonAlreadyRunning as DaemonAlreadyRunning
from slotsync.daemon.service.status_documents import daemon_status, status_line
from slotsync.daemon.service.status_server import StatusServer
from slotsync.daemon.service.systemd import Notifier
from slotsync.protocol.wire import (
    ChunkMetaCache,
    Error,
    FromDaemon,
    ProtocolError,
    Register,
    Registered,
    ToDaemon,
    decode_to_daemon,
)

log = logging.getLogger("slotsync.daemon")
_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _engine_table(engines, roles: spans.Roles | None = None) -> tuple[dict, dict, dict, dict]:
    """``config.engines`` as ``SlotTable.set_engine_table`` takes it: URLs, GPU UUIDs and
    kinds (with SGLang's pause mode), without the engines another node drives
    (``roles.relayed``), which come last as ``elsewhere`` (named in the table's refusals)."""
    relayed = roles.relayed if roles is not None else {}
    elsewhere = {slot: f"{r.engine.url} (driven by node {r.owner})"
                 for slot, r in relayed.items()}
    engines = [e for e in engines if e.slot not in relayed]
    return ({e.slot: e.url for e in engines},
            {e.slot: tuple(e.gpu_uuids) for e in engines if e.gpu_uuids},
            {e.slot: (e.kind, e.pause_mode) for e in engines if e.kind}, elsewhere)


class Daemon:
    """One node daemon.

    Args:
        config: validated configuration.

    ``await serve()`` runs it as ``slotsyncd`` does (start, signals, main loop, shutdown) and
    returns the exit status. Embedded (tests): ``await start()``, then ``await stop()``, which
    fails any update in flight (ranks told, engine left paused, design.md I4) and closes
    everything.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics(__version__)
        self.table = SlotTable(
            Timeouts(config.begin_timeout_s, config.chunk_timeout_s, config.commit_timeout_s,
                     config.liveness_s, config.adapter_load_timeout_s),
            __version__,
            config.chunks_in_flight,
            config.omitted_names,
            config.slot_release_s,
            config.max_message_bytes,
            check_claims=True,  # (claim_check.py)
            families=FAMILIES,
        )
        self.metrics.watch(self.table)  # slot/rank/in-flight gauges read the table per scrape
        self.endpoint = config.endpoint()
        self.started_at = time.time()
        # rejected-message warnings per peer: the first few, then a count per minute
        self._rejects = RateLimiter(burst=5, interval_s=60.0)
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._status: StatusServer | None = None
        self._loops: list[asyncio.Task] = []
        self.notifier = Notifier()
        self.roles = spans.roles(config.engines, config.node_name())
        if config.engines:
            self.table.set_engine_table(*_engine_table(config.engines, self.roles))
        self.record = MidUpdateRecord(config.state_path())
        self.executor = ActionExecutor(self.table, self.record, self.metrics, self._send,
                                       self._rejects, config.engine_timeout_s,
                                       self._after_actions, time.monotonic)
        # the engines' API keys, from the files the table names (issue 35; engine_keys.py)
        self.executor.set_keys(read_engine_keys(config.engines, self.roles.relayed))
        self.intake = Intake(config, self.metrics, self._rejects, self._deliver,
                             self._connections_gone, self.executor.spawn, self._refused)
        self.peers = PeerLinks(config.node_name(), self.roles, None, config.peer_listen,
                               config.liveness_s, __version__, self._relayed_frame,
                               self._relayed_gone, self._send_raw, self._after_actions,
                               self.metrics)
        self.metrics.watch_peers(self.peers)
        self.executor.settle = self.peers.settle  # (a link lost is told before the engine's
        # error that followed it: issue 35)
        root = config.adapter_root()  # (issue 36: the default on /dev/shm, adapter_root.py)
        self.executor.adapter_io = self.adapter_io = AdapterIO(root.path, private=root.private)
        self._adapter_fallback = root.fallback  # (why the default is not on /dev/shm: logged)
        self._relayed_meta = ChunkMetaCache()
        self.restored: list[MidUpdateEngine] = []
        # Set by the signal handlers only (uvicorn's Server.handle_exit); the main loop and
        # the shutdown act on them. exit_signals: the names of the stop signals received.
        self.should_exit = False
        self.force_exit = False
        self.reload_requested = False
        self.exit_signals: list[str] = []
        self._signalled = asyncio.Event()

    @property
    def status_port(self) -> int:
        """The status server's bound port, -1 when it is off."""
        return self._status.port if self._status else -1

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> int:
        """Run until a stop signal, as ``slotsyncd``; returns the exit status (0, or 1 when
        the daemon cannot start: the reason is logged).

        SIGTERM / SIGINT: graceful shutdown (updates in flight get ``shutdown_grace_s``); a
        second one stops at once. SIGHUP: re-read the engine table from the config file.
        """
        try:
            await self.start()
        except (DaemonAlreadyRunning, AdapterDirError) as e:
            log_event(log, logging.ERROR, "refusing_to_start", reason=str(e))
            return 1
        except OSError as e:
            log_event(log, logging.ERROR, "cannot_bind", error=str(e))
            return 1
        loop = asyncio.get_running_loop()
        for sig in _EXIT_SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig)
        loop.add_signal_handler(signal.SIGHUP, self.handle_reload)
        try:
            # One line on stdout that wrappers (the demo, tests) can parse.
            print(f"slotsyncd ready endpoint={self.endpoint} status_port={self.status_port}",
                  flush=True)
            await self.main_loop()
            await self.shutdown(self.exit_signals[0])
        finally:
            for sig in (*_EXIT_SIGNALS, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        return 0

    def handle_exit(self, sig: signal.Signals) -> None:
        """SIGTERM / SIGINT: ask for a graceful shutdown; a second one forces the stop.
        Sets flags only."""
        self.exit_signals.append(f"received {sig.name}")
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        self._signalled.set()

    def handle_reload(self) -> None:
        """SIGHUP: ask for a reload of the engine table. Sets a flag only."""
        self.reload_requested = True
        self._signalled.set()

    def _take_reload(self) -> None:
        """Reload if SIGHUP asked for it. An unexpected error is reported as asyncio reports
        one raised by a signal handler, and the daemon goes on serving."""
        if self.reload_requested:
            self.reload_requested = False
            try:
                self.reload()
            except Exception as e:  # (a bug: the daemon must keep serving)
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "Exception in SIGHUP reload", "exception": e})

    async def main_loop(self) -> None:
        """Serve (the intake and timer tasks do the work) until ``should_exit``; reloads when
        asked."""
        while True:
            self._take_reload()
            if self.should_exit:
                return
            await self._signalled.wait()
            self._signalled.clear()

    async def start(self) -> None:
        """Bind the ZeroMQ socket and the status server, then start serving.

        Raises:
            DaemonAlreadyRunning: a live daemon owns the socket path.
            OSError / zmq.ZMQError: the socket or port cannot be bound.
        """
        runtime_dir.prepare(self.endpoint)
        self.adapter_io.prepare()  # (issue 36: adapter_dir, mode 0700)
        links = self.adapter_io.links()
        said = {} if links else {"note": f"not on {self.adapter_io.shm_dir}'s filesystem: an "
                                 "adapter one rank holds whole is copied, not linked"}
        if self._adapter_fallback:
            said["default_not_on_shm"] = (f"{self._adapter_fallback}: the default adapter_dir "
                                          "is in the runtime dir instead")
        log_event(log, logging.INFO, "adapter_dir", folder=str(self.adapter_io.root), link=links,
                  **said)
        if self.adapter_io.found:
            log_event(log, logging.INFO, "adapter_folders_found", folder=str(self.adapter_io.root),
                      count=len(self.adapter_io.found), kept="an engine may still read them")
        # Engines a killed predecessor left mid-update stay paused and need a full update.
        self.restored = self.record.load()
        for d in self.restored:
            self.table.restore(d.slot, d.engine_url, d.update_id, d.weight_version, d.state)
            log_event(log, logging.WARNING, "engine_left_mid_update", slot=slot_text(d.slot),
                      engine=d.engine_url, update_id=d.update_id, version=d.weight_version,
                      state=d.state)
        self.intake.bind()
        if self.peers.active:
            try:
                self.peers.keys = load_keys(self.config.curve_secret_key,
                                            self.config.peer_public_keys)
                missing = [o for o in sorted(self.roles.owners())
                           if self.peers.keys.key_of(o) is None]
                if missing:
                    raise PeerKeyError(f"peer_public_keys {self.config.peer_public_keys!r} has "
                                       f"no key of owner node(s) {', '.join(missing)} "
                                       f"({missing[0]}.key)")
                await self.peers.start()
            except (PeerKeyError, OSError) as e:
                await self.stop("peer link failed")
                raise OSError(str(e)) from None
            except zmq.ZMQError as e:
                await self.stop("peer link failed")
                raise OSError(f"cannot listen for peers: {e}") from None
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
            asyncio.create_task(self.intake.run(), name="slotsync-intake"),
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
        """Return once ``stop`` has closed everything."""
        await self._stopped.wait()

    async def shutdown(self, reason: str, grace_s: float | None = None) -> None:
        """Graceful stop: refuse new registrations and updates, give updates in flight up to
        ``grace_s`` (default ``config.shutdown_grace_s``) to finish, then fail the rest (ranks
        told, engines left paused and marked, design.md I4) and close. ``force_exit`` (a
        second stop signal) ends the wait at once; SIGHUP still reloads meanwhile."""
        if self.table.draining:
            await self.stop(reason)  # a second call: stop now
            return
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.table.on_drain()
        self.notifier.notify(STOPPING=1, STATUS=f"stopping ({reason})")
        n = self.table.updates_in_flight()
        log_event(log, logging.INFO, "shutdown", reason=reason, updates_in_flight=n,
                  grace_s=grace)
        deadline = time.monotonic() + grace
        while self.table.updates_in_flight() and time.monotonic() < deadline:
            if self.force_exit:
                await self.stop(self.exit_signals[-1])  # a second signal: stop now
                return
            self._take_reload()
            await asyncio.sleep(0.05)  # (the timer loop owns _wake)
        left = self.table.updates_in_flight()
        await self.stop(f"{reason}; shutdown grace of {grace:g} s expired" if left else reason)

    def reload(self) -> None:
        """SIGHUP: re-read the engine table from the config file, and the API key files it
        names (other options need a restart). A bad file is logged and the running table
        and keys kept."""
        if not self.config.config_file:
            log_event(log, logging.WARNING, "reload_skipped", reason="no config file")
            return
        try:
            fresh = read_config_file(Path(self.config.config_file))
            from slotsync.daemon.service.config import check_engine_table

            check_engine_table(fresh.engines)
            fresh_roles = spans.roles(fresh.engines, self.roles.node)
            if (fresh_roles.owned, fresh_roles.relayed) != (self.roles.owned,
                                                            self.roles.relayed):
                raise ValueError("engines over several nodes (owner, owner_address, nodes) "
                                 "change only at a restart: the peer links are made at start; "
                                 "the running table is kept")
            keys = read_engine_keys(fresh.engines, self.roles.relayed)  # (read again)
        except (ConfigError, ValueError) as e:
            log_event(log, logging.ERROR, "reload_failed", error=str(e))
            return
        changes = self.table.set_engine_table(*_engine_table(fresh.engines, self.roles))
        changes += self.executor.set_keys(keys)
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
        gone = self.adapter_io.close(self.table.adapter_folders_in_use())  # (issue 36)
        if gone:
            log_event(log, logging.INFO, "adapter_folders_removed", count=len(gone))
        await self.peers.close()
        self.notifier.close()
        if self._status is not None:
            await self._status.stop()
        await self.intake.close()
        self._stopped.set()

    def status(self) -> dict:
        """The ``/status`` document (``status_documents.daemon_status``), with ``peers``
        where this daemon has peer links."""
        now = time.monotonic()
        doc = daemon_status(self.table, __version__, self.endpoint, self.started_at, now)
        if self.peers.active:
            doc["peers"] = self.peers.status(now)
            for s in doc["slots"]:  # (where each slot is driven)
                owner = self.roles.owned.get(tuple(s["slot"]))
                s["driven_by"] = self.roles.node
                for r in s["ranks"]:
                    r["node"] = r["node"] or self.roles.node
                if owner is not None:
                    s["nodes"] = [{"node": p.node, "ranks": [p.start, p.end]}
                                  for p in owner.parts]
            ranks = self.peers.relay.relayed_ranks() if self.peers.relay else {}
            doc["relayed_slots"] = [
                {"slot": list(slot), "driven_by": r.owner, "owner_address": r.owner_address,
                 "engine_url": r.engine.url,
                 "nodes": [{"node": p.node, "ranks": [p.start, p.end]} for p in r.engine.parts],
                 # this node's ranks of it (issue 35: visible on their own node)
                 "ranks_expected": sum(p.end - p.start for p in r.engine.parts
                                       if p.node == self.roles.node),
                 "ranks_registered": [x["rank"] for x in ranks.get(slot, []) if x["registered"]],
                 "ranks": ranks.get(slot, [])}
                for slot, r in sorted(self.roles.relayed.items())]
            doc["ranks_connected"] += sum(len(s["ranks_registered"])
                                          for s in doc["relayed_slots"])
        return doc

    def _misplaced(self, identity: bytes, msg: ToDaemon) -> Error | None:
        """The refusal of a ``Register`` for an engine this node drives over several nodes
        from a rank that the engine table's ``nodes`` put on another node than the one it
        registers at (issue 35; a relaying node refuses its own such ranks itself)."""
        if not isinstance(msg, Register):
            return None
        engine = self.roles.owned.get((msg.slot_start, msg.slot_start + msg.slot_size))
        if engine is None:
            return None
        where = split_relayed(identity)
        why = spans.misplaced_rank(engine, where[0] if where else self.roles.node, msg.rank)
        return Error("register", why, [engine.slot_start, engine.slot_start + engine.slot_size]
                     ) if why else None

    # ------------------------------------------------------------------ adapters

    async def _deliver(self, identity: bytes, msg: ToDaemon, pid: int, frame: bytes = b""
                       ) -> None:
        """``Intake``: a valid message from ``identity`` (peer process ``pid``, 0 unknown;
        ``frame``: as received), unless it is for an engine another node drives."""
        if await self.peers.rank_message(identity, msg, frame, pid):
            return
        refusal = self._misplaced(identity, msg)
        if refusal is not None:
            await self._send(identity, refusal)
            return
        await self.executor.execute(self.table.on_message(identity, msg, time.monotonic(), pid))

    async def _relayed_frame(self, identity: bytes, frame: bytes, pid: int) -> None:
        """``PeerLinks`` (owner): a frame of a rank of another node, decoded and validated as
        a local rank's."""
        try:
            msg = decode_to_daemon(frame, self.config.max_message_bytes, self._relayed_meta)
        except ProtocolError as e:
            self.metrics.bad_messages.inc()
            await self._refused(identity, e)
            return
        refusal = self._misplaced(identity, msg)
        if refusal is not None:
            await self._send(identity, refusal)
            return
        await self.executor.execute(self.table.on_message(identity, msg, time.monotonic(), pid))

    async def _relayed_gone(self, identities: list[bytes], why: str,
                            link_lost: bool = False) -> None:
        """``PeerLinks`` (owner): ranks of another node are gone. Their link lost, their node's
        daemon has told them the update failed and they release their staging memory: the
        update in flight fails even where they had committed, since
        the engine may still be loading their chunks (a cut after the commit)."""
        actions = self.table.on_connections_gone(identities, time.monotonic(), why,
                                                 released=link_lost)  # (all named: issue 35)
        if actions:
            await self.executor.execute(actions)

    async def _refused(self, identity: bytes, err: ProtocolError, frame: bytes = b"",
                       pid: int = 0) -> None:
        """``Intake``: a frame from ``identity`` failed validation (``err``); a relayed rank's
        goes to the owner, whose table knows the rank."""
        if frame and await self.peers.bad_rank_frame(identity, frame, pid):
            return
        await self.executor.execute(self.table.on_bad_message(identity, err, time.monotonic()))

    async def _connections_gone(self, identities: list[bytes], why: str) -> None:
        """``Intake``: the ranks on these socket identities are gone, for reason ``why``."""
        identities = await self.peers.ranks_gone(identities, why)
        now = time.monotonic()
        actions: list[Action] = []
        for ident in identities:
            actions += self.table.on_connection_gone(ident, now, why)
        if actions:
            await self.executor.execute(actions)

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
            ds = [d for d in (self.table.next_deadline(), self._rejects.next_due(),
                              self.peers.next_deadline()) if d is not None]
            await self._wait_wake(max(0.0, min(ds) - time.monotonic()) if ds else None)
            now = time.monotonic()
            self.intake.log_suppressed(now)
            await self.peers.poll(now)
            await self.executor.execute(self.table.poll(now))

    async def _watchdog_loop(self) -> None:
        # WATCHDOG=1 from the event loop itself, at half the interval: a stuck loop stops it.
        assert self.notifier.watchdog_s
        while True:
            self.notifier.notify(WATCHDOG=1)
            await asyncio.sleep(self.notifier.watchdog_s / 2)

    async def _send(self, identity: bytes, msg: FromDaemon) -> None:
        if isinstance(msg, Registered) and self.peers.active:  # (issue 25: which node drives)
            msg.node = self.roles.node
        if self.peers.is_relayed(identity):
            await self.peers.send_relayed(identity, msg)
        else:
            await self.intake.send(identity, msg)

    async def _send_raw(self, identity: bytes, frame: bytes) -> None:
        await self.intake.send_frame(identity, frame)

    def _after_actions(self) -> None:
        self.notifier.status(self.status_line())
        self._wake.set()  # deadlines may have moved

"""Runs what the I/O-free core returns (``actions.py``), on the daemon's event loop.

* ``Reply``: sent to the rank's socket identity (the ``send`` callback, the ROUTER's);
* ``EngineCall``: a task on that engine's ``VllmClient`` (one client per engine URL, kept for
  the daemon's life); its outcome goes back to the slot's coordinator. A call with
  ``needs_record`` waits until the durable record naming its slot is on disk;
* ``UpdateEnded``: metrics, the ``update_end`` log line, the last update for ``STATUS=``;
* ``SlotEvent``: one log line;
* ``AdapterFiles`` / ``RemoveAdapterFiles`` (issue 36): an adapter's folder written from the
  ranks' shared memory, or removed, through ``adapter_io.AdapterIO`` off the event loop; the
  outcome of a write goes back to the slot (``SlotTable.on_adapter_files``);
  ``SweepAdapterFolders``: a previous daemon's folders of a slot that no entry needs, removed
  (``AdapterIO.sweep``), its end told to the slot (``SlotTable.on_adapter_swept``).

An ``EngineCall`` with ``timeout_s`` (an adapter load) fails as timed out after that long.

The durable record (``mid_update_record.py``) is rewritten off the event loop, in order, on
one thread, whenever the set of engines that may be mid-update changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from slotsync.daemon.core.actions import (
    Action,
    AdapterFiles,
    EngineCall,
    RemoveAdapterFiles,
    Reply,
    SlotEvent,
    SweepAdapterFolders,
    UpdateEnded,
)
from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.slot_table import SlotTable
from slotsync.daemon.engine_http import NO_KEYS, EngineError, EngineHttp, EngineKeys
from slotsync.daemon.families import FAMILIES, Families
from slotsync.daemon.logs import RateLimiter, log_event
from slotsync.daemon.service.adapter_io import AdapterIO
from slotsync.daemon.service.metrics import Metrics
from slotsync.daemon.service.mid_update_record import MidUpdateEngine, MidUpdateRecord
from slotsync.protocol.wire import Error, FromDaemon, Registered

log = logging.getLogger("slotsync.daemon")


def slot_text(slot: tuple[int, int] | list[int]) -> str:
    """A slot in log lines, as everywhere else: ``[start,end)``."""
    return f"[{slot[0]},{slot[1]})"


def peer_name(identity: bytes) -> str:
    """A socket identity for the log: the publisher's own (``slotsync-r3-p1234-…``, ASCII),
    else hex."""
    text = identity.decode("ascii", "replace")
    return text if text.isprintable() and "\ufffd" not in text else identity.hex()


class ActionExecutor:
    """Executes actions for one daemon.

    Args:
        table: the core; engine call outcomes go to its coordinators.
        record: the durable record of engines that may be mid-update.
        metrics: counters for ended updates and engine requests.
        send: sends one message to a socket identity (never raises for a gone peer).
        rejects: rate limit of warnings per peer (registration refusals share it).
        engine_timeout_s: each engine call's HTTP timeout, seconds.
        after: called after each batch of actions (deadlines may have moved).
        now: the monotonic clock.
        families: the engine families (their clients: ``Families.client_for``).

    Attributes:
        settle: awaited before an engine call's failure reaches the table (the peer links'
            ``PeerLinks.settle``: a link lost first is the cause, not the engine's error).
        adapter_io: the adapter folders (``AdapterIO``; None: ``AdapterFiles`` fail).
    """

    def __init__(self, table: SlotTable, record: MidUpdateRecord, metrics: Metrics,
                 send: Callable[[bytes, FromDaemon], Awaitable[None]], rejects: RateLimiter,
                 engine_timeout_s: float, after: Callable[[], None],
                 now: Callable[[], float], families: Families = FAMILIES) -> None:
        self.families = families
        self.table, self.record, self.metrics = table, record, metrics
        self._send, self._after, self._now = send, after, now
        self._rejects, self._engine_timeout_s = rejects, engine_timeout_s
        self.clients: dict[str, EngineHttp] = {}
        self.keys: dict[str, EngineKeys] = {}  # engine URL -> its API keys (set_keys)
        self.settle: Callable[[], Awaitable[None]] | None = None
        self.adapter_io: AdapterIO | None = None
        self.tasks: set[asyncio.Task] = set()
        self.last_update = ""  # the last update's outcome, for STATUS=
        # Record writes run in order on one thread, off the event loop (a slow state disk
        # delays nothing else); only a call with needs_record waits for them.
        self._record_io = ThreadPoolExecutor(1, thread_name_prefix="slotsync-record")
        self._record_key: tuple | None = None
        self._record_written: asyncio.Future[bool] | None = None

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task that ``close`` cancels."""
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def execute(self, actions: list[Action]) -> None:
        """Run ``actions`` in order (engine calls start as tasks)."""
        self._persist(before_actions=True)
        for a in actions:
            if isinstance(a, Reply):
                msg = a.msg
                if isinstance(msg, Registered):
                    log_event(log, logging.INFO, "registered", rank=msg.rank,
                              slot=slot_text((msg.slot_start, msg.slot_start + msg.slot_size)))
                elif isinstance(msg, Error) and msg.phase == "register":
                    # (a publisher retries a held rank every 0.2 s: log a few per peer)
                    peer = peer_name(a.identity)
                    if self._rejects.allow(f"register {peer}", self._now()):
                        log_event(log, logging.WARNING, "registration_refused", peer=peer,
                                  error=msg.message)
                await self._send(a.identity, msg)
            elif isinstance(a, EngineCall):
                self.spawn(self._engine_call(a))
            elif isinstance(a, UpdateEnded):
                self._update_ended(a)
            elif isinstance(a, SlotEvent):
                log_event(log, logging.WARNING if a.warning else logging.INFO, a.event,
                          slot=slot_text(a.slot), **a.fields)
                self.metrics.slot_event(a.event, a.fields)  # (adapter rounds' ends, issue 36)
            elif isinstance(a, AdapterFiles):
                self.spawn(self._adapter_files(a))
            elif isinstance(a, RemoveAdapterFiles) and self.adapter_io is not None:
                self.spawn(self.adapter_io.remove(a.folder))
            elif isinstance(a, SweepAdapterFolders):
                self.spawn(self._sweep(a))
        self._persist(before_actions=False)
        self._after()

    async def record_on_disk(self) -> str:
        """Wait for every queued record write (they run in order); returns '' or why the
        record could not be written (the call that needed it is then not sent, and fails)."""
        fut = self._record_written
        if fut is None:
            return ""
        try:
            await asyncio.shield(fut)
        except Exception as e:  # noqa: BLE001 - any failure means: do not start
            return f"not sent: the in-flight record {self.record.path} cannot be written: {e}"
        return ""

    async def close(self, *others: asyncio.Task) -> None:
        """After the last actions: wait for the record, stop its thread, cancel the tasks (and
        ``others``) and close the engine clients."""
        await self.record_on_disk()  # the failed updates' record is written before we exit
        self._record_io.shutdown(wait=True)
        for t in [*others, *self.tasks]:
            t.cancel()
        await asyncio.gather(*others, *self.tasks, return_exceptions=True)
        for c in self.clients.values():
            await c.close()

    def _persist(self, *, before_actions: bool) -> None:
        """Queue a rewrite of the durable record if the set of possibly mid-update engines
        changed. A slot is recorded from its update's begin (``mid_update_state``), so the write
        runs while the begin's other calls run; its start waits until it is written
        (``record_on_disk``). A rewrite that only drops entries is queued after the actions
        went out (``before_actions=False``): the record thread then does not compete with
        sending the commit's acks, and a daemon killed before the write only recovers an
        engine it need not have."""
        if self.record.path is None:
            return
        engines = [MidUpdateEngine(*d) for d in self.table.mid_update_engines()]
        key = MidUpdateRecord.key_of(engines)
        if key == self._record_key:
            return
        if before_actions and set(key) <= set(self._record_key or ()):
            return  # only drops entries: after the actions
        self._record_key = key
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._record_io, self.record.save,
                                                             engines)
        except RuntimeError:  # stopped: nothing runs after this, write it here
            self.record.save(engines)
            return
        fut.add_done_callback(self._record_done)
        self._record_written = fut

    def _record_done(self, fut: asyncio.Future[bool]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log_event(log, logging.ERROR, "record_write_failed", path=str(self.record.path),
                      error=str(fut.exception()))

    def set_keys(self, keys: dict[str, EngineKeys]) -> list[str]:
        """The engines' API keys by URL (``engine_keys.read_engine_keys``): each client
        sends its engine's from its next request on. Returns one line per engine whose keys
        changed (its URL and files: never a key)."""
        changes = []
        for url in sorted(set(keys) | set(self.keys)):
            k = keys.get(url, NO_KEYS)
            if k != self.keys.get(url, NO_KEYS):
                files = ", ".join(f for f in (k.api_key_file, k.admin_api_key_file) if f)
                changes.append(f"engine {url} API keys read again from {files or 'no file'}")
        self.keys = dict(keys)
        for c in self.clients.values():
            c.keys = self.keys.get(c.url.rstrip("/"), NO_KEYS)
        return changes

    def _client(self, url: str, engine: EngineSession) -> EngineHttp:
        """The engine's client, kept for the daemon's life: ``SglangClient`` for an SGLang
        engine (issue 26), else ``VllmClient`` (an engine of unknown kind is asked as vLLM
        is: ``Families.client_for``)."""
        key, cls = self.families.client_for(engine, url)
        client = self.clients.get(key)
        if client is None:
            client = cls(url, self._engine_timeout_s, self.metrics.observe_request,
                         self.keys.get(url.rstrip("/"), NO_KEYS))
            self.clients[key] = client
        return client

    async def _engine_call(self, call: EngineCall) -> None:
        coord = self.table.coordinator(call.slot)
        url = coord.engine_url or ""
        engine = coord.engine
        client = self._client(url, engine)
        log_event(log, logging.DEBUG, "engine_call", slot=slot_text(call.slot),
                  update_id=call.update_id, route=call.route)
        err = await self.record_on_disk() if call.needs_record else ""
        if err:
            result, ok = None, False
        else:
            lost = client.connection_errors
            try:
                async with asyncio.timeout(call.timeout_s or None):
                    result = await self.families.call(client, call.route, call.body, engine)
                ok, err = True, ""
            except EngineError as e:
                result, ok, err = None, False, str(e)
            except TimeoutError:  # (the call's own deadline: an adapter load, issue 36)
                result, ok = None, False
                err = (f"{call.route}: no answer within {call.timeout_s:g} s "
                       "(adapter_load_timeout_s)")
            except Exception as e:  # noqa: BLE001 - a step the client cannot send (a bug):
                # the slot must still hear of it, else it waits for the call forever
                result, ok = None, False
                err = f"{call.route}: the daemon could not send it: {type(e).__name__}: {e}"
            if client.connection_errors != lost:  # refused / reset: a restarted engine?
                await self.execute(self.table.on_connection_lost(url, self._now()))
        if not ok and self.settle is not None:
            await self.settle()
        try:
            same = self.table.coordinator(call.slot) == coord
        except KeyError:
            same = False
        if not same:
            return  # (the slot was removed meanwhile, e.g. by a reload: the answer is no one's)
        await self.execute(self.table.on_engine_result(call.slot, call.call_id, ok, result, err,
                                                       self._now()))

    async def _adapter_files(self, a: AdapterFiles) -> None:
        """Write an adapter's folder (``AdapterFiles``) with the slot's engine family's
        ``write_files``; its outcome goes back to the slot."""
        coord = self.table.slots.get(a.slot)
        support = (getattr(self.families.of(coord.engine), "adapters", None)
                   if coord is not None else None)
        if self.adapter_io is None or support is None:
            ok, folder, err = False, "", "this daemon writes no adapter folders"
        else:
            ok, folder, err = await self.adapter_io.write(a.slot, a.plan, a.handles,
                                                          support.write_files, a.timeout_s)
        await self.execute(self.table.on_adapter_files(a.slot, a.call_id, ok, folder, err,
                                                       self._now()))

    async def _sweep(self, a: SweepAdapterFolders) -> None:
        """Remove a previous daemon's folders of ``a.slot`` not in ``a.keep``
        (``AdapterIO.sweep``); its end goes back to the slot."""
        if self.adapter_io is not None:
            try:
                gone = await self.adapter_io.sweep(a.slot, a.keep)
            except OSError as e:  # (logged; the folders stay, the slot goes on)
                log_event(log, logging.WARNING, "adapter_folders_sweep_failed",
                          slot=slot_text(a.slot), error=str(e))
            else:
                if gone:
                    log_event(log, logging.INFO, "adapter_folders_removed",
                              slot=slot_text(a.slot), count=len(gone),
                              folders=",".join(gone),
                              why="left by a daemon before this one; its engine lists none "
                                  "of them")
        await self.execute(self.table.on_adapter_swept(a.slot, a.call_id, self._now()))

    def _update_ended(self, e: UpdateEnded) -> None:
        self.metrics.update_ended(e)
        level = logging.INFO if e.outcome == "success" else logging.ERROR
        fields = dict(slot=slot_text(e.slot), engine=e.engine_url, update_id=e.update_id,
                      version=e.weight_version, outcome=e.outcome,
                      duration_s=round(e.seconds, 4), chunks=e.chunks, bytes=e.nbytes)
        if e.error:
            fields["error"] = e.error
        log_event(log, level, "update_end", **fields)
        self.last_update = (f"slot {slot_text(e.slot)} update {e.update_id} {e.weight_version} "
                            f"{e.outcome} in {e.seconds:.2f} s")

"""A publisher's connection to its node's daemon: what a ``Publisher`` does around an
update's chunks.

``PublisherConnection`` builds the parts a publisher is made of from the settings
``Publisher.__init__`` checked (``_build_parts``: the session, the exporter, the ``DaemonLink``,
its ``DaemonWaits`` and the ``ChunkPipeline``), registers the rank (retrying a rank another live
process still holds), opens an update (``_send_begin``) and settles its begin's ack
(``_await_begin``: registering again and resending after a daemon restart), turns the daemon's
``Error`` into the exception a caller sees, aborts, and closes. ``Publisher``
(``publisher.py``) is this plus the update's public steps: ``begin``, ``send_chunk``,
``commit`` and ``publish``. Its log lines stay the publisher's (logger
``slotsync.protocol.rank.publisher``, as in ``waits.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Self, TypeVar

import msgspec
import torch
import zmq

from slotsync.protocol import wire
from slotsync.protocol.errors import SlotsyncError
from slotsync.protocol.rank import inputs
from slotsync.protocol.rank.chunk_export import ChunkExporter
from slotsync.protocol.rank.connect_check import check_endpoint
from slotsync.protocol.rank.inputs import Manifest
from slotsync.protocol.rank.link import DaemonLink
from slotsync.protocol.rank.manifest_cache import DigestCache
from slotsync.protocol.rank.pipeline import ChunkPipeline
from slotsync.protocol.rank.session import Awaited, ErrorAction, PublisherSession, to_exception
from slotsync.protocol.rank.waits import DaemonWaits
from slotsync.protocol.topology import EngineSlot

__all__ = ["PublisherConnection"]

log = logging.getLogger("slotsync.protocol.rank.publisher")  # (the log lines stay the publisher's)
_T = TypeVar("_T")

_LINGER_MS = 500  # how long close() lets an unsent Abort try to get out


def _release(link: DaemonLink, exporter: ChunkExporter) -> None:
    """Finalizer: free everything a publisher owns (runs from close(), GC or atexit)."""
    exporter.close()
    link.close()


def _weak(method: Callable[..., _T]) -> Callable[..., _T]:
    """``method`` (bound) without a strong reference to its object: the publisher's parts
    call back into it without keeping it alive, so garbage collection still runs its
    finalizer at once."""
    ref = weakref.WeakMethod(method)

    def call(*args: object, **kwargs: object) -> _T:
        bound = ref()
        if bound is None:
            raise RuntimeError("publisher is closed")
        return bound(*args, **kwargs)

    return call


class PublisherConnection:
    """The part of ``Publisher`` outside an update's chunks: its parts, registration, an
    update's begin and its settling, the daemon's errors, abort and close (see the module's
    docstring). Not used alone: ``Publisher.__init__`` sets the settings below, then calls
    ``_build_parts``."""

    endpoint: str
    rank: int
    slot: EngineSlot
    engine_url: str
    packed: bool
    transport: str
    device: torch.device
    gpu_uuid: str
    staging_bytes: int
    staging_buffers: int
    timeout_s: float
    liveness_s: float
    rank_local: bool
    worker_rank: int

    def _build_parts(self) -> None:
        """Build the session, exporter, link, waits and pipeline from the settings."""
        self._session = PublisherSession(self.rank, self.slot,
                                         {"staging_bytes": self.staging_bytes})
        # held by the thread inside publish / begin / send_chunk / commit (see _one_thread)
        self._busy = threading.RLock()
        # the open update's (name, dtype, shape) list, if its begin sent a manifest
        self._begin_manifest: Manifest | None = None
        # each tensor's manifest digest, kept across rounds
        self._digests = DigestCache(lambda e: inputs.manifest_entries((e,))[0])
        self._last_commit: wire.Ack | None = None  # the last update's Ack(commit)
        self._exporter = ChunkExporter(  # staging memory, exports
            self.transport, self.device, self.rank, self.staging_bytes, self.staging_buffers)
        self._exports = self._exporter.ledger  # what the open update exported
        # Liveness: a daemon that exits closes the connection at once; heartbeats close one
        # whose daemon went silent within liveness_s (see daemon/service/liveness.py). The monitor
        # sees a daemon that refuses our credentials (ZAP): it answers nothing, so without it
        # the rank would only see a timeout.
        routing_id = f"slotsync-r{self.rank}-p{os.getpid()}-{os.urandom(4).hex()}".encode()
        self._link = DaemonLink(
            self.endpoint, routing_id=routing_id, liveness_s=self.liveness_s, monitor=True,
            send_timeout_s=self.timeout_s, linger_ms=_LINGER_MS)
        self._waits = DaemonWaits(  # sends, and waits for replies, on the link
            self._link, self._session, endpoint=self.endpoint, rank=self.rank,
            slot_range=self._slot_range(), timeout_s=self.timeout_s, liveness_s=self.liveness_s,
            on_error=_weak(self._error), end_update=_weak(self._end_update))
        self._pipeline = ChunkPipeline(  # chunks between copy and ack
            self._session, self._exporter, self.packed, self._waits, _weak(self._await_begin),
            self.rank)
        self._finalizer = weakref.finalize(self, _release, self._link, self._exporter)

    @property
    def registered(self) -> wire.Registered | None:
        """The daemon's last ``Registered`` reply, or ``None`` before (or after losing) it."""
        return self._session.registered

    @property
    def update_id(self) -> int | None:
        """The open update's id, or ``None`` between updates."""
        return self._session.update_id

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran."""
        return not self._finalizer.alive

    def register(self) -> wire.Registered:
        """Register this rank with the daemon (protocol version, rank, GPU UUID, slot, engine
        URL, mode, transport, hostname, pid) and wait for ``Registered``. A packed rank on
        CUDA first compiles its copy kernel (``ChunkExporter.warm_up``), which its first
        publish would otherwise pay inside the engine's pause.

        Raises:
            SlotsyncError: the daemon refused (``Error(phase="register")``; a rank another
                live process holds is retried for ``liveness_s`` first) or answered for
                another rank/slot or protocol version; no daemon listens (the socket is
                missing, stale or unreadable: ``connect_check``).
            SlotsyncTimeout: no answer within ``timeout_s``.
            RuntimeError: an update is open.
        """
        self._check_usable()
        if self.update_id is not None:
            raise RuntimeError(f"cannot register while update {self.update_id} is open")
        held_until = time.monotonic() + self.liveness_s
        self._exporter.warm_up(self.packed)  # (before the first publish's pause: issue 27 C)
        while True:
            try:
                return self._register_once()
            except SlotsyncError as e:
                # Another live process holds this rank: a restarted rank's old process may
                # still be closing its connection. Retry until liveness_s, then raise.
                if e.code != wire.RANK_HELD or time.monotonic() >= held_until:
                    raise
                time.sleep(0.2)

    def _register_once(self) -> wire.Registered:
        self._read_monitor(during_update=False)
        if self._waits.connected is not True:
            check_endpoint(self.endpoint)  # no daemon to talk to: say why now, not at timeout
        self._send(
            wire.Register(
                protocol_version=wire.PROTOCOL_VERSION,
                rank=self.rank,
                gpu_uuid=self.gpu_uuid,
                slot_start=self.slot.start,
                slot_size=self.slot.count,
                engine_url=self.engine_url,
                packed=self.packed,
                transport=self.transport,  # type: ignore[arg-type]
                hostname=socket.gethostname()[:1024],
                pid=os.getpid(),
            )
        )
        # (an Error with an update id answers an earlier message, e.g. a chunk sent after a
        # begin the restarted daemon refused: stale once we register again)
        reply = self._wait(Awaited("register"))
        if isinstance(reply, wire.Error):
            raise self._error(reply)
        assert isinstance(reply, wire.Registered)
        self._session.registration(reply)
        log.debug(
            "rank %d registered with %s: slot %s, next update id %d",
            self.rank, self.endpoint, self.slot, self._session.next_id,
        )
        return reply

    def _send_begin(self, weight_version: str, manifest: Manifest | None = None,
                    draft: bool = False) -> int:
        """Open the next update and send its ``Begin``, without waiting for the ack
        (``_await_begin``, called before any wait for a chunk's ack, and by ``commit``)."""
        self._check_usable()
        if self.update_id is not None:
            raise RuntimeError(f"update {self.update_id} is still open; commit or abort it first")
        self._read_monitor(during_update=False)
        if self.registered is None or self._waits.connected is False:
            # (never registered, or the daemon went away since: register with the one that
            # listens now, or say why none does)
            self.register()
        if manifest is not None and not isinstance(manifest, Sequence):
            manifest = list(manifest)
        extra = None
        if self.rank_local and draft:
            # (a draft part's names are not in the rank-local begin's declared tensors; the
            # two were built apart and no test covers them together: refuse, not guess)
            raise ValueError(f"rank {self.rank}: a draft part (draft=) is not supported in "
                             "rank-local mode yet (docs/rank-local.md)")
        if self.rank_local:
            extra = inputs.rank_local_begin(self.rank, self.worker_rank, manifest)
        self._begin_manifest = manifest
        begin = self._session.begin(
            weight_version, self._digests.manifest(manifest) if manifest and not extra else b"",
            extra, draft=draft)
        self._send(begin)
        return begin.update_id

    def _await_begin(self) -> None:
        """Settle the open update's ``Ack(begin)`` if it is still due. Chunks may have gone
        out before it (the daemon holds them until the engine has started): if the begin
        fails, their exports are given back with the update's others (``_end_update``); if a
        restarted daemon refused it, they are sent again after the new ``Begin``."""
        s = self._session
        if not s.begin_due():
            return
        weight_version = s.begin_version
        try:
            refused, s.begin_refused = s.begin_refused, None
            if refused is not None:
                raise self._error(refused)
            if not s.begin_acked:
                self._wait(Awaited("begin", s.update_id))
        except SlotsyncError as e:
            if e.code != wire.NOT_REGISTERED:
                raise
            # The daemon restarted and forgot us: register again (learning its next update
            # id) and begin once more.
            log.info("rank %d: daemon does not know this rank; registering again", self.rank)
            s.update_id = None
            try:
                self.register()
                begin, chunks = s.rebegin()  # (a second refusal ends the update)
                self._send(begin)
                # the chunks the daemon refused with the begin: same exports (never mapped),
                # the new update id
                for chunk in chunks:
                    self._send(chunk)
                if not s.begin_acked:
                    self._wait(Awaited("begin", s.update_id))
            except BaseException:
                self._end_update()  # the chunk copied for the first begin goes too
                raise
        s.begin_settled()
        log.debug("rank %d: update %d begun (weight version %s)", self.rank, s.update_id,
                  weight_version)

    def abort(self, reason: str = "") -> None:
        """Give up on the open update (best effort: the ``Abort`` is sent without waiting) and
        release its exports. The slot's update fails and the engine stays paused (I4). No-op
        when no update is open."""
        uid = self.update_id
        if uid is None:
            return
        log.debug("rank %d: aborting update %d: %s", self.rank, uid, reason)
        try:
            if not self.closed:
                self._link.send(wire.Abort(update_id=uid, reason=reason[:1024]), block=False)
        except zmq.ZMQError as e:
            log.warning("rank %d: could not send Abort for update %d: %s", self.rank, uid, e)
        finally:
            self._end_update()

    def close(self) -> None:
        """Abort an open update, tell the daemon this rank closes (``wire.Close``), close the
        socket and unlink every shared-memory segment this publisher owns. Idempotent; also
        runs at garbage collection and interpreter exit (without the ``Close``)."""
        if self.closed:
            return
        if self.update_id is not None:
            self.abort("publisher closed")
        self._waits.goodbye("Publisher.close()")  # (the daemon logs a clean close as one)
        self._exports.pinned.clear()
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Publisher(rank={self.rank}, slot={self.slot}, endpoint={self.endpoint!r}, "
            f"transport={self.transport!r}, packed={self.packed})"
        )

    # ---------------------------------------------------------------- internals

    def _check_usable(self) -> None:
        if self.closed:
            raise RuntimeError("publisher is closed")

    def _slot_range(self) -> tuple[int, int]:
        return (self.slot.start, self.slot.end)

    def _end_update(self, succeeded: bool = False) -> None:
        """Forget the open update: release exports (``ExportLedger.end``: after an update that
        did not succeed, the CUDA exports never acknowledged are given back), move to the
        next update id (I7)."""
        self._pipeline.pending = None
        self._exporter.end_update(succeeded, self._session.end())

    def _error(self, err: wire.Error) -> SlotsyncError:
        """Turn a daemon Error into a SlotsyncError; end or abort the open update as
        ``PublisherSession.error_action`` says."""
        action = self._session.error_action(err)
        if action is ErrorAction.ABORT:
            self.abort(f"the daemon refused a message: {err.phase}: {err.message}")
        elif action is ErrorAction.END:
            self._end_update()
        manifest = self._begin_manifest
        if err.tensor_index >= 0 and manifest is not None:  # the begins' manifests part there
            i = err.tensor_index
            if i < len(manifest):
                name, dt, shape = inputs.manifest_entries((manifest[i],))[0]
                mine = f"this rank's tensor #{i} is {name!r} ({dt}, shape {list(shape)})"
            else:
                mine = f"this rank sends only {len(manifest)} tensors"
            err = msgspec.structs.replace(err, message=f"{err.message}; {mine}")
        return to_exception(err)

    def _send(self, msg: wire.ToDaemon | wire.OutgoingChunk) -> None:
        self._waits.send(msg)

    def _wait(self, awaited: Awaited) -> wire.FromDaemon:
        return self._waits.wait(awaited)

    def _read_monitor(self, *, during_update: bool) -> None:
        self._waits.read_monitor(during_update=during_update)

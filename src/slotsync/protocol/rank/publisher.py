"""The trainer rank's side of slotsync: a synchronous publisher for a training loop.

One ``Publisher`` per trainer rank. It speaks the conversation of ``slotsync.protocol.wire``
over a ZeroMQ DEALER socket connected to the node daemon's ROUTER endpoint (one frame per
message, no empty delimiter frame)::

    pub = Publisher("ipc:///run/slotsync/slotsyncd.sock", rank, topology.slot_of(rank),
                    "http://127.0.0.1:8000")
    pub.register()                            # once
    for step in ...:
        optimizer.step()
        pub.publish(hf_named_tensors(model), weight_version=str(step))

``publish`` = ``begin`` (without waiting for its ack: the daemon holds chunks that arrive
before the engine's update started) + one chunk at a time + ``commit``; on any failure it
aborts the update (best effort) and re-raises. Every wait for the daemon is bounded by
``timeout_s`` (design.md I5).

``publish`` pipelines: after sending chunk k it goes back to the caller's iterator (whatever
produces the tensors: gathers, format conversion) while the daemon and the engine load chunk k.
Packed with n > 1 ``staging_buffers`` (default 4), it fills chunk k+1 into another region of
the staging memory and sends it before chunk k's ack -- up to n - 1 chunks run ahead of their
acks -- so the next chunks are merged (and, with the daemon's ``chunks_in_flight``, already
queued at the engine) when the engine returns from chunk k; a region is refilled only after
the ack of the chunk that used it
(see ``CudaStagingBuffer`` for how this keeps vLLM's packed importer to one mapping per update).
``staging_buffers=1`` is vLLM's own producer: one region, exported once per update, chunk k+1
copied in after chunk k's ack. Unpacked, up to ``MAX_UNACKED_CHUNKS`` chunks are in flight
(their exports live until commit anyway). Every rank of a slot must publish the same names in
the same order with the same ``staging_bytes``, so that all ranks cut identical chunks (I2).

Memory lifetime (design.md I3): a packed chunk's staging region is refilled only after that
chunk's ack, and the staging memory is freed when the update ends; unpacked exports (and their
shared-memory segments) are kept until the commit's ack, then released and, on CUDA,
``torch.cuda.ipc_collect()`` is called.

This module holds the ``Publisher`` facade: its public methods, registration and the begin's
settling. The rest lives beside it, each part testable alone: ``pipeline.py`` (the copy
pipeline: which copy is launched, which chunk sent and which ack awaited, in what order),
``waits.py`` (sends and deadline waits on the link and its monitor, replies turned into
session inputs, a daemon gone), ``session.py`` (the update state machine, acks, regions; sans
I/O), ``chunking.py`` (the chunking rule, message-size bound), ``inputs.py`` (argument and
tensor checks), ``link.py`` (the socket), ``chunk_export.py`` and ``export_ledger.py``
(staging memory, exports and their lifetime). Over 500 lines because it holds one thing,
``Publisher``, whose public methods carry their full contracts (Args, Raises); see also
docs/publisher.md.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import msgspec
import torch
import zmq

from slotsync.protocol import wire
from slotsync.protocol.chunking import MessageBound, cut
from slotsync.protocol.errors import SlotsyncError
from slotsync.protocol.rank import inputs
from slotsync.protocol.rank.chunk_export import ChunkExporter
from slotsync.protocol.rank.connect_check import check_endpoint
from slotsync.protocol.rank.export import dtype_name, gpu_uuid_of
from slotsync.protocol.rank.gc_hold import held_during
from slotsync.protocol.rank.inputs import MAX_STAGING_BUFFERS, check_version
from slotsync.protocol.rank.link import DaemonLink
from slotsync.protocol.rank.manifest_cache import DigestCache
from slotsync.protocol.rank.pipeline import ChunkPipeline
from slotsync.protocol.rank.session import (
    MAX_UNACKED_CHUNKS,
    Awaited,
    ErrorAction,
    PublisherSession,
    to_exception,
)
from slotsync.protocol.rank.waits import DaemonWaits
from slotsync.protocol.topology import EngineSlot

__all__ = ["DEFAULT_STAGING_BUFFERS", "DEFAULT_STAGING_BYTES", "MAX_STAGING_BUFFERS",
           "MAX_UNACKED_CHUNKS",
           "PublishStats", "Publisher"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_STAGING_BYTES = 512 * 1024 * 1024
"""Default staging buffer (packed) / chunk limit (unpacked): 512 MiB."""

DEFAULT_STAGING_BUFFERS = 4
"""Packed: staging regions per rank (GPU memory: 4 x 512 MiB by default, vLLM's packed
default is 2 x 1 GiB)."""

_LINGER_MS = 500  # how long close() lets an unsent Abort try to get out


@dataclass(frozen=True)
class PublishStats:
    """What one ``publish`` did: ``chunks`` sent, tensor ``bytes`` described, wall ``seconds``
    from begin to the commit's ack; of those, ``export_seconds`` laying out, copying into the
    staging buffer (and waiting for the copies) and exporting, and ``wait_seconds`` blocked on
    the daemon's acks (begin, chunks, commit).

    ``omitted_count`` tensor names that the slot's previous successful update loaded were not
    in this one (vLLM keeps their old values: a tied ``lm_head.weight`` that
    ``named_parameters()`` skips, say); ``omitted_names`` lists the first 64, sorted (the
    daemon also logs them, and refuses such an update with ``omitted_names = "refuse"``).
    ``engine_resumed`` is False when the daemon left the engine paused because it found it
    sleeping or paused by someone else at the begin."""

    chunks: int
    bytes: int
    seconds: float
    export_seconds: float = 0.0
    wait_seconds: float = 0.0
    omitted_names: tuple[str, ...] = ()
    omitted_count: int = 0
    engine_resumed: bool = True


def _release(link: DaemonLink, exporter: ChunkExporter) -> None:
    """Finalizer: free everything a publisher owns (runs from close(), GC or atexit)."""
    exporter.close()
    link.close()


Manifest = Sequence[tuple[str, "torch.dtype | str", Sequence[int]]]
"""An update's tensors, ``(name, dtype, shape)`` in send order (``Publisher.publish``)."""


def _entries(manifest: Manifest) -> list[tuple[str, str, tuple[int, ...]]]:
    """``manifest`` with vLLM's dtype names and int shapes (``manifest.manifest_of``'s input).

    Raises:
        ValueError: an unsupported dtype.
    """
    return [(name, dt if isinstance(dt, str) else dtype_name(dt), tuple(int(d) for d in shape))
            for name, dt, shape in manifest]


def _rank_local_args(rank: int, slot: EngineSlot, rank_local: bool,
                     worker_rank: int | None) -> tuple[bool, int]:
    """``(rank_local, worker_rank)`` checked; ``worker_rank`` defaults to ``rank - slot.start``
    in rank-local mode and is -1 outside it (``wire.Begin``).

    Raises:
        ValueError: ``worker_rank`` without ``rank_local``, or outside ``[0, slot.count)``.
    """
    if not rank_local:
        if worker_rank is not None:
            raise ValueError(f"worker_rank={worker_rank} needs rank_local=True")
        return False, -1
    w = rank - slot.start if worker_rank is None else worker_rank
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < slot.count:
        raise ValueError(f"rank {rank}: worker_rank must be an int in [0, {slot.count}) (the "
                         f"engine's workers), got {worker_rank!r}")
    return True, w


def _size_of(item: tuple[str, torch.Tensor, int]) -> int:
    return item[2]


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


def _one_thread(method: Callable[..., _T]) -> Callable[..., _T]:
    """A ``Publisher`` is used by one thread at a time: a call made while another thread is
    inside ``publish``, ``begin``, ``send_chunk`` or ``commit`` raises RuntimeError at once,
    instead of both threads' updates failing halfway (and leaving the engine paused until the
    daemon's commit deadline)."""
    @functools.wraps(method)
    def guarded(self: Publisher, *args: object, **kwargs: object) -> _T:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"Publisher.{method.__name__} called while another thread is using this "
                "Publisher (it is not thread-safe: use it from one thread, or one Publisher "
                "per thread)")
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy.release()

    return guarded


class Publisher:
    """Publishes one trainer rank's weights to its engine through the node's slotsync daemon.
    Not thread-safe: use it from one thread (a second thread's call while one runs raises
    RuntimeError).

    Args:
        endpoint: the daemon's ZeroMQ ROUTER endpoint, e.g. ``ipc:///run/slotsync/d.sock``.
        rank: this process's global trainer rank.
        slot: the engine slot of ``rank`` (``EngineSlot`` or ``(start, count)``), e.g. from
            ``SlotTopology.slot_of(rank)``.
        engine_url: base URL of the engine this slot feeds; every rank of the slot must agree.
        packed: vLLM packed transfer (one staging region per chunk) or unpacked (one handle per
            tensor); must match the engine's ``init_weight_transfer_engine``.
        transport: ``"cuda"`` (CUDA IPC), ``"shm"`` (POSIX shared memory, CPU stand-in for the
            reference engine) or ``"auto"``: ``cuda`` if ``device`` is a CUDA device, or if
            ``device`` is None and CUDA is available (current device); else ``shm``.
        device: the rank's GPU (cuda transport); default the current CUDA device.
        gpu_uuid: override of the GPU UUID sent at registration (several logical GPUs on one
            physical GPU, tests). Default: the device's real UUID on cuda,
            ``wire.logical_gpu_uuid(rank - slot.start)`` on shm.
        staging_bytes: packed: the size of each staging region; unpacked: the most bytes per
            chunk. ``publish`` cuts chunks of at most this many bytes; a larger tensor is a
            chunk of its own (packed: its own memory is exported, no staging copy). Allocated
            per update.
        staging_buffers: packed: staging regions, 1 to ``MAX_STAGING_BUFFERS`` (GPU memory
            used: ``staging_buffers * staging_bytes`` during an update). With n > 1, up to
            n - 1 chunks wait at the daemon and engine while the next one is filled. Small
            chunks need more: each chunk's ack comes back through the engine's HTTP answer,
            the daemon and ZeroMQ before its region is filled again (``BENCHMARKS.md``
            has the figures). 1 is vLLM's own producer: one chunk at a time.
        timeout_s: deadline of every wait for the daemon, in seconds. The default (360 s) is
            longer than the daemon's default ``engine_timeout_s`` (300 s), so that when an
            engine hangs, the daemon's error naming it reaches the rank before the rank's own
            timeout.
        liveness_s: a daemon that exits is noticed at once; one that stops answering ZeroMQ
            heartbeats within this many seconds counts as gone too: a wait then raises
            ``SlotsyncError(code="daemon_gone")`` naming the daemon and why, instead of
            waiting ``timeout_s``. Registration checks the socket first and names a missing,
            stale or unreadable one within a second (``connect_check``).
        rank_local: rank-local mode (expert parallelism, docs/rank-local.md): this rank
            publishes only the tensors its engine worker holds (its experts and the shared
            tensors); other ranks of the slot send other names. Every update's tensor list
            must be known at its begin (a list or mapping, or ``manifest=``): the begin
            declares it, and the daemon checks it against the other ranks' before the pause.
            Every rank of the slot must use the same mode. The daemon sends vLLM the list
            form of ``update_info`` (vLLM 0.29+), one entry per worker, in the order of the
            engine table's ``gpu_uuids`` (required in this mode).
        worker_rank: rank-local mode: the global engine worker index this rank's payload is
            for (vLLM 0.32 ``gpu_worker.py`` ``update_weights``: ``data_parallel_index *
            world_size + rank``); default ``rank - slot.start``.

    Raises:
        ValueError: ``rank`` is not in ``slot``, ``transport``/``device`` disagree, or
            ``worker_rank`` is given outside rank-local mode or is outside ``[0, slot.count)``.
    """

    def __init__(
        self,
        endpoint: str,
        rank: int,
        slot: EngineSlot | tuple[int, int],
        engine_url: str,
        *,
        packed: bool = True,
        transport: Literal["auto", "cuda", "shm"] = "auto",
        device: torch.device | int | str | None = None,
        gpu_uuid: str | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_buffers: int = DEFAULT_STAGING_BUFFERS,
        timeout_s: float = 360.0,
        liveness_s: float = 10.0,
        rank_local: bool = False,
        worker_rank: int | None = None,
    ) -> None:
        self.slot = slot if isinstance(slot, EngineSlot) else EngineSlot(*slot)
        self.rank_local, self.worker_rank = _rank_local_args(rank, self.slot, rank_local,
                                                             worker_rank)
        inputs.check_publisher_args(endpoint, engine_url, rank, self.slot, gpu_uuid, packed,
                                    staging_bytes, staging_buffers, timeout_s, liveness_s)
        self.endpoint = endpoint
        self.rank = rank
        self.engine_url = engine_url
        self.packed = packed
        self.staging_bytes = staging_bytes
        self.staging_buffers = staging_buffers
        self.timeout_s = timeout_s
        self.liveness_s = float(liveness_s)
        self.transport, self.device = inputs.resolve_transport(transport, device)
        if gpu_uuid is not None:
            self.gpu_uuid = wire.normalize_gpu_uuid(gpu_uuid)
        elif self.transport == "cuda":
            self.gpu_uuid = gpu_uuid_of(self.device)
        else:
            self.gpu_uuid = wire.logical_gpu_uuid(rank - self.slot.start)

        self._session = PublisherSession(rank, self.slot, {"staging_bytes": staging_bytes})
        # held by the thread inside publish / begin / send_chunk / commit (see _one_thread)
        self._busy = threading.RLock()
        # the open update's (name, dtype, shape) list, if its begin sent a manifest
        self._begin_manifest: Manifest | None = None
        self._digests = DigestCache(lambda e: _entries((e,))[0])  # kept across rounds
        self._last_commit: wire.Ack | None = None  # the last update's Ack(commit)
        self._exporter = ChunkExporter(self.transport, self.device, rank, staging_bytes,
                                       staging_buffers)  # staging memory, exports
        self._exports = self._exporter.ledger  # what the open update exported
        # Liveness: a daemon that exits closes the connection at once; heartbeats close one
        # whose daemon went silent within liveness_s (see daemon/service/liveness.py). The monitor
        # sees a daemon that refuses our credentials (ZAP): it answers nothing, so without it
        # the rank would only see a timeout.
        self._link = DaemonLink(
            endpoint, routing_id=f"slotsync-r{rank}-p{os.getpid()}-{os.urandom(4).hex()}"
            .encode(), liveness_s=self.liveness_s, monitor=True, send_timeout_s=timeout_s,
            linger_ms=_LINGER_MS)
        self._waits = DaemonWaits(  # sends, and waits for replies, on the link
            self._link, self._session, endpoint=endpoint, rank=rank,
            slot_range=self._slot_range(), timeout_s=timeout_s, liveness_s=self.liveness_s,
            on_error=_weak(self._error), end_update=_weak(self._end_update))
        self._pipeline = ChunkPipeline(  # chunks between copy and ack
            self._session, self._exporter, packed, self._waits, _weak(self._await_begin), rank)
        self._finalizer = weakref.finalize(self, _release, self._link, self._exporter)

    # ---------------------------------------------------------------- public API

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

    @_one_thread
    def begin(self, weight_version: str, manifest: Manifest | None = None, *,
              draft: bool = False) -> int:
        """Open the next update: send its ``Begin`` (registering first if ``register`` was not
        called) and return. The daemon pauses and starts the engine once every rank of the
        slot has begun and the first chunk arrived (an update with no chunk never touches the
        engine); the begin's ``Ack`` is awaited by the first ``send_chunk`` or by ``commit``,
        which raise if the begin failed.

        Args:
            weight_version: given to ``/finish_weight_update`` on success (I8).
            manifest: the ``(name, dtype, shape)`` of every tensor this update will send, in
                order, if known (dtype: a ``torch.dtype`` or vLLM's name): sent as the begin's
                manifest, so that the daemon refuses the slot's ranks whose lists differ
                before the pause, naming the first tensor where they part.
            draft: the update has a speculative-decoding draft-model part (issue 18): after
                the main chunks, ``send_chunk(..., draft=True)`` sends the draft model's; the
                daemon loads them in a second session (vLLM's ``/start_draft_weight_update``)
                once the main one finished, and resumes the engine after both. Every rank of
                the slot must pass the same value.

        Returns:
            The update id.

        Raises:
            RuntimeError: an update is already open.
            ValueError, TypeError: a bad ``weight_version``.
            SlotsyncError, SlotsyncTimeout: as ``register``.
        """
        check_version(weight_version)
        return self._send_begin(weight_version, manifest, draft)

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
            entries = _entries(manifest) if manifest is not None else None
            if not entries:
                raise ValueError(
                    f"rank {self.rank}: rank-local mode declares the update's tensors in its "
                    "begin: publish a list or mapping, or pass manifest= (name, dtype, shape) "
                    "for an iterator")
            extra = {"rank_local": True, "worker_rank": self.worker_rank,
                     "names": [e[0] for e in entries], "dtype_names": [e[1] for e in entries],
                     "shapes": [list(e[2]) for e in entries]}
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

    @_one_thread
    def send_chunk(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                   draft: bool = False) -> None:
        """Export one chunk and wait until the engine consumed it (``Ack(chunk, index)``).

        Packed: the tensors are copied into a staging region (vLLM packed layout) and sent
        as one handle; the region is free again when this returns. Unpacked: one handle per
        tensor (CUDA: a contiguous copy on ``device`` where needed, else the tensor's own
        memory; shm: a per-chunk segment); the exports stay alive until the commit's ack, and
        the caller must not modify the tensors (optimizer step) before ``commit`` returns.

        Args:
            named_tensors: ``(name, tensor)`` pairs in checkpoint (Hugging Face) names; any
                shape, dtypes of ``wire.DTYPE_SIZES``.
            draft: the chunk belongs to the draft-model part (``begin(..., draft=True)``);
                draft chunks come after every main chunk.

        Raises:
            RuntimeError: no update is open.
            ValueError: no tensors, duplicate names, unsupported dtype, (packed) more bytes
                than the staging buffer holds, or a draft / main chunk out of the rule above
                (``PublisherSession.next_chunk_part``; nothing is sent).
            SlotsyncError, SlotsyncTimeout: the chunk failed or was not acknowledged in time.
        """
        self._check_usable()
        self._session.require_open()
        self._session.next_chunk_part(draft)
        self._pipeline.send_chunk(list(named_tensors), max_unacked=0)
        self._pipeline.wait_unacked(0)

    @_one_thread
    def commit(self) -> None:
        """Close the update: send ``Commit(num_chunks)`` and wait for ``Ack(commit)`` (finish
        and resume returned). Then release unpacked exports, call ``torch.cuda.ipc_collect()``
        on CUDA and unlink the update's shared-memory segments.

        Raises:
            RuntimeError: no update is open.
            SlotsyncError, SlotsyncTimeout: the commit failed or was not acknowledged in time
                (after a timeout the update stays open: call ``abort``).
        """
        self._check_usable()
        s = self._session
        s.require_open()
        if s.has_draft and s.draft_from is None:
            uid = s.update_id
            self.abort("the update declared a draft part but sent no draft chunk")
            raise ValueError(f"update {uid} declared a draft part (begin(..., draft=True)) "
                             "but sent no draft chunk: aborted (send_chunk(..., draft=True))")
        self._pipeline.send_pending()
        if s.num_chunks:
            self._await_begin()  # (the begin's ack comes once a chunk arrived: none did here,
            # and the daemon refuses an update of no chunk, in answer to this commit)
        # The commit goes out before the last chunks' acks: the daemon finishes as soon as
        # the engine has loaded every chunk, without waiting for this rank to hear of it.
        # (a re-registration may have renumbered the update)
        commit = s.commit()
        uid = commit.update_id
        self._send(commit)
        self._pipeline.wait_unacked(0)
        ack = self._wait(Awaited("commit", uid))
        assert isinstance(ack, wire.Ack)
        self._last_commit = ack
        if ack.omitted_count:
            log.warning("rank %d: update %d left out %d tensor name(s) the slot's previous "
                        "update loaded (the engine keeps their old values): %s", self.rank, uid,
                        ack.omitted_count, ", ".join(ack.omitted_names[:5]))
        log.debug(
            "rank %d: update %d committed: %d chunks, %d bytes",
            self.rank, uid, s.num_chunks, s.bytes,
        )
        self._end_update(succeeded=True)

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

    @_one_thread
    @held_during  # no full collection while the engine waits (gc_hold.py)
    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        weight_version: str,
        *,
        manifest: Manifest | None = None,
        draft: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | None = None,
    ) -> PublishStats:
        """One whole update: begin, chunks of at most ``staging_bytes`` in iteration order,
        commit. Chunking is deterministic (``chunking.cut``), so ranks that iterate the same
        names and sizes cut identical chunks. On any exception the update is aborted (best
        effort) and the exception re-raised. Python's cyclic garbage collector is held off
        while it runs (``gc_hold.py``, docs/publisher.md).

        Args:
            named_tensors: ``(name, tensor)`` pairs, consumed lazily (a generator is fine), or
                a mapping such as ``model.state_dict()``.
            weight_version: recorded by the engine on success.
            manifest: the ``(name, dtype, shape)`` of every tensor an iterator will yield, in
                order, if known (a list or mapping gets its own): the daemon refuses the
                slot's ranks whose lists differ before the engine is paused, and the error
                names this rank's tensor where they part.
            draft: the speculative-decoding draft model's tensors, in the forms
                ``named_tensors`` takes (issue 18), or None for a round without a draft
                part. They are cut into chunks of their own, sent after every main chunk,
                and loaded in a second session (vLLM's ``/start_draft_weight_update``) once
                the main one finished with ``weight_version``; the engine resumes after
                both. A list or mapping is checked whole before the pause, like
                ``named_tensors``; its entries extend the begin's manifest.

        Raises:
            ValueError: no tensors at all, or an empty ``draft`` (any size goes: a tensor
                larger than ``staging_bytes`` is a chunk of its own), a name that repeats, is
                empty or over 1,024 characters, an unsupported dtype, a meta or sparse tensor,
                a chunk whose message would exceed the daemon's ``max_message_bytes``, or a
                ``weight_version`` of 0 or over 256 characters. A list or mapping is checked
                whole before the engine is paused; an iterator as it is consumed.
            TypeError: an item is not a ``(str, torch.Tensor)`` pair, or ``weight_version``
                is not a str.
            MemoryError: the staging regions cannot be allocated (before the pause).
            SlotsyncError, SlotsyncTimeout: the update failed.
            RuntimeError: an update is already open.
        """
        self._check_usable()
        if self.update_id is not None:
            raise RuntimeError(f"update {self.update_id} is still open; commit or abort it first")
        check_version(weight_version)
        whole = isinstance(named_tensors, Sequence | Mapping)
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        checked = inputs.checked(named_tensors)
        if whole:
            # A list or mapping is checked whole before begin, so that bad input never
            # pauses the engine: each tensor, then each chunk's message size.
            items = list(checked)
            if items:
                if self.registered is None:
                    self.register()  # (to learn the daemon's max_message_bytes)
                self._check_message_sizes(items)
                if manifest is None:
                    manifest = [(n, t.dtype, t.shape) for n, t, _ in items]
            checked = iter(items)
        if self.rank_local and manifest is None:
            raise ValueError(
                f"rank {self.rank}: rank-local mode declares the update's tensors in its "
                "begin: publish a list or mapping, or pass manifest= (name, dtype, shape) "
                "for an iterator")
        draft_checked, manifest = self._draft_input(draft, manifest)
        # Nothing to send must not pause the engine (e.g. a generator already consumed).
        first = next(checked, None)
        if first is None:
            raise ValueError(
                "publish got no tensors: nothing to send (was the iterator already consumed?)"
            )
        if self.packed:
            self._exporter.allocate()
        t0 = time.perf_counter()
        self._pipeline.export_s = self._waits.wait_s = 0.0
        ahead = self.staging_buffers - 1 if self.packed else MAX_UNACKED_CHUNKS - 1
        try:
            # The first chunks are copied, exported and sent while the daemon pauses and
            # starts the engine: it holds them until the start returned (no wait for the
            # begin's ack here; the first wait for a chunk's ack awaits it first).
            self._send_begin(weight_version, manifest, draft_checked is not None)
            for chunk in cut(itertools.chain((first,), checked), _size_of, self.staging_bytes):
                self._pipeline.send_chunk([(name, t) for name, t, _ in chunk], ahead,
                                          [n for *_, n in chunk], pipelined=True)
            if draft_checked is not None:
                self._send_draft_part(draft_checked, ahead)
            chunks, nbytes = self._session.num_chunks, self._session.bytes
            self.commit()
        except BaseException as e:
            if self.update_id is not None:
                self.abort(f"{type(e).__name__}: {e}")
            raise
        ack = self._last_commit
        return PublishStats(
            chunks=chunks,
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
            export_seconds=self._pipeline.export_s,
            wait_seconds=self._waits.wait_s,
            omitted_names=tuple(ack.omitted_names) if ack else (),
            omitted_count=ack.omitted_count if ack else 0,
            engine_resumed=ack.resumed if ack else True,
        )

    def _draft_input(
        self,
        draft: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | None,
        manifest: Manifest | None,
    ) -> tuple[Iterator[tuple[str, torch.Tensor, int]] | None, Manifest | None]:
        """``publish``'s draft part, checked like ``named_tensors`` (a list or mapping whole,
        before the begin), and the begin's manifest extended by its entries (where both are
        known in advance; else the manifest covers the main part only). None: no draft.

        Raises:
            ValueError, TypeError: as ``publish`` for ``named_tensors`` (an empty list or
                mapping: no draft tensors).
        """
        if draft is None:
            return None, manifest
        whole = isinstance(draft, Sequence | Mapping)
        if isinstance(draft, Mapping):
            draft = draft.items()
        checked = inputs.checked(draft)
        if not whole:
            return checked, manifest
        items = list(checked)
        if not items:
            raise ValueError("publish got an empty draft: pass None for a round without a "
                             "draft part")
        if self.registered is None:
            self.register()
        self._check_message_sizes(items)
        if manifest is not None:
            manifest = [*_entries(manifest), *_entries(
                [(n, t.dtype, t.shape) for n, t, _ in items])]
        return iter(items), manifest

    def _send_draft_part(self, checked: Iterator[tuple[str, torch.Tensor, int]],
                         ahead: int) -> None:
        """Cut and send the draft part's chunks after every main chunk (``publish``).

        Raises:
            ValueError: no draft tensors (an iterator already consumed).
        """
        first = next(checked, None)
        if first is None:
            raise ValueError("publish got no draft tensors (was the iterator already "
                             "consumed?)")
        self._session.next_chunk_part(True)
        for chunk in cut(itertools.chain((first,), checked), _size_of, self.staging_bytes):
            self._pipeline.send_chunk([(name, t) for name, t, _ in chunk], ahead,
                                      [n for *_, n in chunk], pipelined=True)

    def _check_message_sizes(self, items: list[tuple[str, torch.Tensor, int]]) -> None:
        """Refuse, before the begin, a chunk whose message would exceed the daemon's
        ``max_message_bytes`` (learnt at registration): ``chunking.MessageBound``.

        Raises:
            ValueError: names the chunk, its tensor count and both sizes.
        """
        cap = self.registered.max_message_bytes if self.registered else 0
        if not cap:
            return
        bound = MessageBound(self.transport, self.packed)
        if bound.worst(len(items)) <= cap:
            return  # even the whole update in one message would fit (the usual case: free)
        bound.check(((name, t.dim(), n) for name, t, n in items), self.staging_bytes, cap)

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

    def __enter__(self) -> Publisher:
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
                name, dt, shape = _entries((manifest[i],))[0]
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

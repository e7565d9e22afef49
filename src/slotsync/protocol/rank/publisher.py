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

This module holds ``Publisher``: its arguments and the update's public steps (``begin``,
``send_chunk``, ``commit``, ``publish``), each with its full contract (Args, Raises). The rest
lives beside it, each part testable alone: ``connection.py`` (``PublisherConnection``, which
``Publisher`` extends: its parts, registration, the begin's sending and settling, the daemon's
errors, abort, close), ``pipeline.py`` (the copy pipeline: which copy is launched, which chunk
sent and which ack awaited, in what order), ``waits.py`` (sends and deadline waits on the link
and its monitor, replies turned into session inputs, a daemon gone), ``session.py`` (the update
state machine, acks, regions; sans I/O), ``chunking.py`` (the chunking rule, message-size
bound), ``inputs.py`` (argument, tensor and manifest checks), ``link.py`` (the socket),
``chunk_export.py`` and ``export_ledger.py`` (staging memory, exports and their lifetime); see
also docs/publisher.md.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from slotsync.protocol import wire
from slotsync.protocol.chunking import cut
from slotsync.protocol.rank import inputs
from slotsync.protocol.rank.adapters import round as adapter_round
from slotsync.protocol.rank.adapters.inputs import Rows
from slotsync.protocol.rank.adapters.round import AdapterStats
from slotsync.protocol.rank.connection import PublisherConnection
from slotsync.protocol.rank.export import gpu_uuid_of
from slotsync.protocol.rank.gc_hold import held_during
from slotsync.protocol.rank.inputs import MAX_STAGING_BUFFERS, Manifest, check_version
from slotsync.protocol.rank.session import MAX_UNACKED_CHUNKS, Awaited
from slotsync.protocol.topology import EngineSlot

__all__ = ["DEFAULT_STAGING_BUFFERS", "DEFAULT_STAGING_BYTES", "MAX_STAGING_BUFFERS",
           "MAX_UNACKED_CHUNKS",
           "AdapterStats", "PublishStats", "Publisher"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_STAGING_BYTES = 512 * 1024 * 1024
"""Default staging buffer (packed) / chunk limit (unpacked): 512 MiB."""

DEFAULT_STAGING_BUFFERS = 4
"""Packed: staging regions per rank (GPU memory: 4 x 512 MiB by default, vLLM's packed
default is 2 x 1 GiB)."""


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


def _size_of(item: tuple[str, torch.Tensor, int]) -> int:
    return item[2]


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


class Publisher(PublisherConnection):
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
        self.rank_local, self.worker_rank = inputs.rank_local_args(rank, self.slot, rank_local,
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

        self._build_parts()

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

    @_one_thread
    def publish_adapter(
        self,
        lora_name: str,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        config: Mapping[str, object] | str,
        version: int,
        *,
        rows: Rows | None = None,
    ) -> AdapterStats:
        """Publish version ``version`` of LoRA adapter ``lora_name`` to every engine of the
        slot (issue 36; docs/publisher.md "LoRA adapters"): returns once each engine serves
        it as ``wire.served_name(lora_name, version)`` (``"math@v3"``), the previous version
        staying served until then. Every rank of the slot calls it with the same
        ``lora_name``, ``version`` and ``config``, each with its part; no collective. The
        engine is not paused. The rank's part is copied (a shared-memory segment; on a GPU
        also one packed device buffer) before anything is sent, so the tensors may change
        once this returns; the copy is freed before it returns or raises.

        Args:
            lora_name: 1-64 of ``A-Z a-z 0-9 _ . -``, starting with a letter or digit.
            tensors: this rank's part under PEFT names, as
                ``peft.get_peft_model_state_dict(model)`` gives them (its output as it is:
                ``...q_proj.lora_A.weight``, the names ``save_pretrained`` writes; a name that
                still holds the adapter's name, ``lora_A.default.weight``, is refused), in a
                mapping or ``(name, tensor)`` pairs; empty when other ranks of the slot hold
                everything. Each tensor is whole unless ``rows`` says otherwise; an FSDP2
                DTensor sharded ``(Shard(0),)`` on a 1-D mesh is this rank's local rows (the
                mesh must be the slot's ranks). Across the slot's ranks the parts must tile
                each tensor's rows exactly: a whole tensor is sent by one rank only.
            config: the PEFT adapter config, ``peft_model.peft_config["default"].to_dict()``
                or the text of ``adapter_config.json``; needs ``r`` and ``target_modules``.
            version: an int >= 0, above the version the slot serves.
            rows: ``name -> (row_start, whole_shape)`` for a plain tensor that holds rows
                ``[row_start, row_start + len)`` of dim 0 of a tensor of ``whole_shape``.

        Returns:
            ``AdapterStats`` (the served name, this rank's bytes, time per phase).

        Raises:
            TypeError, ValueError: a bad argument, before the begin is sent: names that
                repeat, hold an adapter name or are not LoRA tensors' (a base weight), a
                dtype outside ``wire.DTYPE_SIZES``, tensors on different devices, a DTensor
                of another layout, ``rows`` that do not fit, a config without ``r`` or
                ``target_modules``, a negative version, a part over
                ``adapters.inputs.MAX_PART_BYTES``. The round is opened and aborted all the
                same, so that the slot's other ranks fail at once (``code "rank_aborted"``).
            MemoryError: the part cannot be allocated (``/dev/shm`` or the GPU); aborted
                likewise.
            SlotsyncError: the daemon refused the round (a version not above the served
                one, an engine without LoRA, ranks that disagree or do not tile, another
                rank's abort; the previous version stays served) or the load failed;
                ``code``: which (``errors.ADAPTER_CODES``), ``"adapters_unsupported"``: the
                daemon is older than adapter rounds; ``"daemon_gone"``: it went away.
            KeyboardInterrupt, SystemExit: an interrupt while waiting, with a note (PEP 678)
                naming what this rank and the daemon waited for (the phase, the ranks).
            SlotsyncTimeout: no reply within ``timeout_s``.
            RuntimeError: an update is open.
        """
        return adapter_round.publish_adapter(self, lora_name, tensors, config, version, rows)

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
            manifest = [*inputs.manifest_entries(manifest), *inputs.manifest_entries(
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
        """``inputs.check_message_sizes`` against the daemon's ``max_message_bytes`` (learnt
        at registration).

        Raises:
            ValueError: names the chunk, its tensor count and both sizes.
        """
        cap = self.registered.max_message_bytes if self.registered else 0
        inputs.check_message_sizes(items, cap, self.transport, self.packed, self.staging_bytes)

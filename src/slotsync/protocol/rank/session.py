"""A publisher's conversation with its daemon, sans I/O: decoded ``wire.FromDaemon`` messages
in, ``wire`` messages and decisions out. No socket, clock, GPU or torch here: ``Publisher``
does the I/O and asks this what a message means and what to send (the h11 pattern).

Rules (each one a test in tests/unit/test_publisher_session.py):

* One update at a time; update ids come from the daemon's ``Registered.next_update_id`` and
  grow by one per update, failed or not (design.md I7).
* ``Begin`` is sent without waiting for its ack; chunks may follow at once. The begin's ack
  (or its refusal) is settled before any chunk's ack is awaited.
* Chunk acks are taken in order (oldest first). An ack that arrives before it is awaited
  (``receive`` while sending or waiting for something else) is kept, not dropped.
* A ``not_registered`` Error while the begin is unacknowledged means the daemon restarted:
  the begin is refused, the publisher registers again, and the begin and the chunks sent
  before its ack go out again under the new update id (same exports: never mapped). A
  second refusal ends the update; the resent begin's ack is kept like the first one's.
* An Error of another update id, or an Ack of another update, is stale: ignored.
* Packed, chunk ``k`` uses staging region ``k % regions``; the region is refilled only after
  the ack of chunk ``k - regions`` (at most ``regions - 1`` chunks unacknowledged when the
  next copy starts). Unpacked: at most ``MAX_UNACKED_CHUNKS`` chunks in flight.

``receive`` outcomes, from the rules above (``awaited``: what the publisher waits for):

=================================  ===========
message                            outcome
=================================  ===========
matches ``awaited``                ``MATCH``
Ack(chunk) of a chunk in flight    ``KEPT``
Ack(begin) of the unacked begin    ``KEPT``
Error not_registered, begin due    ``REFUSED`` (not waiting) / ``ERROR`` (waiting)
Error of this update or of none    ``ERROR``
anything else                      ``STALE``
=================================  ===========
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Literal, NamedTuple

from slotsync.protocol import wire
from slotsync.protocol.errors import SlotsyncError
from slotsync.protocol.topology import EngineSlot

__all__ = ["MAX_UNACKED_CHUNKS", "Awaited", "ErrorAction", "Outcome", "PublisherSession",
           "SentChunk", "region_of", "unacked_before_copy"]

MAX_UNACKED_CHUNKS = 2
"""Unpacked ``publish``: chunks in flight (packed: ``staging_buffers``)."""


class Outcome(Enum):
    """What a received message is to the session (see the module's table)."""

    MATCH = "match"
    KEPT = "kept"
    REFUSED = "refused"
    ERROR = "error"
    STALE = "stale"


class ErrorAction(Enum):
    """What an Error does to the open update (``PublisherSession.error_action``)."""

    NONE = "none"  # not about the open update (or none is open)
    KEEP = "keep"  # a restarted daemon refused the begin: register again, begin once more
    ABORT = "abort"  # a message was refused: abort the update (the daemon's is still open)
    END = "end"  # the update failed at the daemon: forget it


@dataclass(frozen=True)
class Awaited:
    """What the publisher is waiting for: ``Registered`` (phase ``register``; an Error without
    update id answers it too), or the ``Ack`` of ``phase`` for ``update_id`` (chunk:
    ``index``; ``adapter_begin`` / ``adapter_data``: the steps of an adapter round, issue 36)."""

    phase: Literal["register", "begin", "chunk", "commit", "adapter_begin", "adapter_data"]
    update_id: int | None = None
    index: int = -1

    def matches(self, m: wire.FromDaemon) -> bool:
        """Whether ``m`` is the awaited reply."""
        if self.phase == "register":
            return isinstance(m, wire.Registered) or (
                isinstance(m, wire.Error) and m.update_id is None)
        return (isinstance(m, wire.Ack) and m.update_id == self.update_id
                and m.phase == self.phase and (self.phase != "chunk" or m.index == self.index))

    def describe(self) -> str:
        """The awaited reply in words, for timeouts and errors."""
        if self.phase == "register":
            return "Registered"
        what = (f"Ack({self.phase}, index={self.index})" if self.phase == "chunk"
                else f"Ack({self.phase})")
        return f"{what} for update {self.update_id}"


class SentChunk(NamedTuple):
    """A chunk sent before the begin's ack: sent again if a restarted daemon refused it."""

    index: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    tensor_sizes: list[int]
    handles: list[wire.Handle]
    draft: bool = False  # a chunk of the round's draft-model part (issue 18)


def region_of(index: int, regions: int) -> int:
    """The staging region of packed chunk ``index`` (0-based) with ``regions`` regions."""
    return index % regions


def unacked_before_copy(max_unacked: int, regions: int) -> int:
    """How many earlier chunks may be unacknowledged when the next packed chunk's copy starts:
    its region's previous chunk must be acknowledged (at most ``regions - 1`` others), and at
    most ``max_unacked`` are wanted in flight."""
    return min(max_unacked, regions - 1)


def chunk_message(uid: int, c: SentChunk) -> wire.OutgoingChunk:
    """The wire message of chunk ``c`` in update ``uid`` (our own layout: the daemon checks
    it on decode)."""
    return wire.OutgoingChunk(update_id=uid, index=c.index, names=c.names,
                              dtype_names=c.dtype_names, shapes=c.shapes,
                              tensor_sizes=c.tensor_sizes, handles=c.handles, draft=c.draft)


class PublisherSession:
    """One rank's update state machine (see the module's rules).

    Args:
        rank: the rank's global trainer rank.
        slot: its engine slot.
        settings: the publisher settings every rank of the slot must share, by
            ``wire.Begin`` field name (e.g. ``{"staging_bytes": 536870912}``); each begin
            declares those the daemon lists in ``Registered.begin_settings`` (issue 24).
    """

    def __init__(self, rank: int, slot: EngineSlot, settings: dict[str, int] | None = None
                 ) -> None:
        self.rank = rank
        self.slot = slot
        self.settings = dict(settings or {})
        self.registered: wire.Registered | None = None
        self.next_id = 0
        self.update_id: int | None = None  # the open update, if any
        self.num_chunks = 0
        self.bytes = 0
        self.unacked: deque[int] = deque()  # chunk indices sent, ack not yet taken
        self.early_acks: set[int] = set()  # chunk acks read while sending or waiting
        self.begin_version: str | None = None  # weight version of a Begin not yet acked
        self.begin_manifest = b""  # its tensor manifest (empty: none)
        self.has_draft = False  # the open update declared a draft-model part (issue 18)
        self.draft_from: int | None = None  # index of its first draft chunk, once sent
        self.begin_rank_local: dict = {}  # its rank-local fields (wire.Begin; empty: none)
        self.begin_acked = False  # its Ack(begin) was read while doing something else
        self.begin_refused: wire.Error | None = None  # ... or a "not registered" for it
        self.begin_resent = False  # the begin went out again (a second refusal ends it)
        self.sent_before_ack: list[SentChunk] = []

    # ------------------------------------------------------------ registration

    def registration(self, reply: wire.Registered) -> None:
        """Accept the daemon's ``Registered``: learn its next update id.

        Raises:
            SlotsyncError: another protocol version, or another rank or slot.
        """
        slot = (self.slot.start, self.slot.end)
        if reply.protocol_version != wire.PROTOCOL_VERSION:
            raise SlotsyncError(
                "register",
                f"daemon speaks protocol version {reply.protocol_version}, "
                f"this publisher {wire.PROTOCOL_VERSION}", slot=slot)
        if (reply.rank, reply.slot_start, reply.slot_size) != (
                self.rank, self.slot.start, self.slot.count):
            raise SlotsyncError(
                "register",
                f"daemon registered rank {reply.rank} in slot [{reply.slot_start}, "
                f"{reply.slot_start + reply.slot_size}), but this is rank {self.rank} of "
                f"slot {self.slot}", slot=slot)
        self.registered = reply
        self.next_id = reply.next_update_id

    # ------------------------------------------------------------ the update

    def require_open(self) -> int:
        """The open update's id.

        Raises:
            RuntimeError: no update is open.
        """
        if self.update_id is None:
            raise RuntimeError("no update is open; call begin() first")
        return self.update_id

    def begin(self, weight_version: str, manifest: bytes = b"",
              rank_local: dict | None = None, draft: bool = False) -> wire.Begin:
        """Open the next update; returns its ``Begin`` to send (``manifest``: see
        ``manifest.manifest_of``; empty for none; ``rank_local``: the ``wire.Begin`` fields
        of rank-local mode, ``rank_local``, ``worker_rank``, ``names``, ``dtype_names`` and
        ``shapes``, or None outside it; ``draft``: the update has a draft-model part,
        ``wire.Begin.draft``).

        Raises:
            RuntimeError: an update is open.
        """
        uid = self._open(weight_version, manifest, draft, rank_local or {})
        return wire.Begin(update_id=uid, weight_version=weight_version, manifest=manifest,
                          draft=draft, **self.begin_rank_local, **self.declared_settings())

    def adapter_round(self) -> int:
        """Open the next update id for an adapter round (issue 36, ``rank/adapters/``): no
        ``Begin`` and no chunks (the caller builds its ``wire.AdapterBegin`` and
        ``wire.AdapterData``); ``end`` closes it, as any update. An Error of it ends it
        (``error_action``: nothing to begin again here; the adapter round sends its begin
        again itself after a daemon restart).

        Raises:
            RuntimeError: an update is open.
        """
        return self._open(None, b"", False, {})

    def _open(self, version: str | None, manifest: bytes, draft: bool,
              rank_local: dict) -> int:
        """Open the next update id, a base round's (``begin``) or an adapter round's."""
        if self.update_id is not None:
            raise RuntimeError(f"update {self.update_id} is still open; commit or abort it first")
        uid = self.update_id = self.next_id
        self.num_chunks = self.bytes = 0
        self.unacked.clear()
        self.early_acks.clear()
        self.begin_version = version
        self.begin_manifest = manifest
        self.has_draft, self.draft_from = draft, None
        self.begin_rank_local = rank_local
        return uid

    def declared_settings(self) -> dict[str, int]:
        """The settings a ``Begin`` declares: those of ``settings`` the daemon compares
        (``Registered.begin_settings``; none before registration or with an older daemon)."""
        known = self.registered.begin_settings if self.registered else ()
        return {k: v for k, v in self.settings.items() if k in known}

    def next_chunk_part(self, draft: bool) -> None:
        """The next chunk belongs to the draft-model part (``draft``) or the main one; call
        before it is counted (``add_chunk``). Rule (issue 18): draft chunks come after every
        main chunk, and only in an update whose begin declared a draft part.

        Raises:
            RuntimeError: no update is open.
            ValueError: a draft chunk in an update that declared no draft part, a draft
                part before any main chunk, or a main chunk after a draft chunk.
        """
        uid = self.require_open()
        if draft and not self.has_draft:
            raise ValueError(f"update {uid} declared no draft part (begin(..., draft=True)): "
                             "a draft chunk cannot be sent in it")
        if draft and self.draft_from is None:
            if self.num_chunks == 0:
                raise ValueError(f"update {uid}: the draft part needs at least one main chunk "
                                 "before it (draft chunks come after every main chunk)")
            self.draft_from = self.num_chunks
        elif not draft and self.draft_from is not None:
            raise ValueError(
                f"update {uid}: a main chunk after the draft part began (chunk "
                f"{self.draft_from}): draft chunks come after every main chunk")

    def chunk_is_draft(self, index: int) -> bool:
        """Whether chunk ``index`` of the open update belongs to its draft-model part."""
        return self.draft_from is not None and index >= self.draft_from

    def add_chunk(self, nbytes: int) -> int:
        """Count the next chunk (``nbytes`` of tensors); returns its index."""
        index = self.num_chunks
        self.num_chunks += 1
        self.bytes += nbytes
        return index

    def chunk_message(self, c: SentChunk) -> wire.OutgoingChunk:
        """The message of chunk ``c`` in the open update (send it, then ``chunk_sent``).

        Raises:
            RuntimeError: no update is open.
        """
        return chunk_message(self.require_open(), c)

    def chunk_sent(self, c: SentChunk) -> None:
        """Chunk ``c`` went out: its ack is due from now on."""
        if self._may_rebegin() and not self.begin_acked:
            self.sent_before_ack.append(c)
        self.unacked.append(c.index)

    def commit(self) -> wire.Commit:
        """The ``Commit`` of the open update.

        Raises:
            RuntimeError: no update is open.
        """
        return wire.Commit(update_id=self.require_open(), num_chunks=self.num_chunks)

    def take_acked(self, keep: int) -> tuple[list[int], int | None]:
        """Take the acks already read, oldest first, while more than ``keep`` chunks are
        unacknowledged. Returns the chunks acknowledged now and the chunk whose ack must be
        awaited next (None: at most ``keep`` are unacknowledged)."""
        taken: list[int] = []
        while len(self.unacked) > keep:
            index = self.unacked[0]
            if index not in self.early_acks:
                return taken, index
            self.early_acks.discard(index)
            self.unacked.popleft()
            taken.append(index)
        return taken, None

    def begin_due(self) -> bool:
        """Whether the begin's ack is still to be settled."""
        return self.begin_version is not None

    def begin_settled(self) -> None:
        """The begin was acknowledged: chunks are no longer sent "before the ack"."""
        self.begin_version = None
        self.begin_acked = False
        self.begin_resent = False
        self.sent_before_ack.clear()

    def rebegin(self) -> tuple[wire.Begin, list[wire.OutgoingChunk]]:
        """After registering again with a restarted daemon (``registration``): the begin
        under the new update id and the chunks it refused, to send again. A second refusal
        ends the update.

        Raises:
            RuntimeError: no begin was refused (no weight version due).
        """
        version = self.begin_version
        if version is None:
            raise RuntimeError("no begin to send again")
        uid = self.update_id = self.next_id
        self.begin_resent = True
        self.begin_refused = None
        return (wire.Begin(update_id=uid, weight_version=version,
                           manifest=self.begin_manifest, draft=self.has_draft,
                           **self.begin_rank_local, **self.declared_settings()),
                [chunk_message(uid, c) for c in self.sent_before_ack])

    def end(self) -> set[int]:
        """Forget the open update (I7): the next one takes the next id. Returns the chunks
        whose ack was read but not taken (their exports were mapped)."""
        uid, early = self.update_id, set(self.early_acks)
        self.update_id = None
        if uid is not None:
            self.next_id = max(self.next_id, uid + 1)
        self.unacked.clear()
        self.early_acks.clear()
        self.begin_version = None
        self.begin_acked = False
        self.begin_refused = None
        self.begin_resent = False
        self.sent_before_ack.clear()
        return early

    def forget_registration(self) -> None:
        """The daemon went away: the next begin registers again."""
        self.registered = None

    # ------------------------------------------------------------ messages in

    def concerns_us(self, err: wire.Error) -> bool:
        """Whether ``err`` is about the open update or about no update in particular."""
        return err.update_id is None or err.update_id == self.update_id

    def receive(self, msg: wire.FromDaemon, awaited: Awaited | None = None) -> Outcome:
        """Classify one reply (``awaited``: what the publisher waits for, None while it
        sends) and keep the acks that came early (see the module's table)."""
        if awaited is not None and awaited.matches(msg):
            return Outcome.MATCH
        if isinstance(msg, wire.Ack) and self.update_id is not None \
                and msg.update_id == self.update_id:
            if msg.phase == "chunk" and msg.index in self.unacked:
                self.early_acks.add(msg.index)
                return Outcome.KEPT
            if msg.phase == "begin" and self.begin_version is not None:
                self.begin_acked = True
                return Outcome.KEPT
        if isinstance(msg, wire.Error) and self.concerns_us(msg):
            if awaited is None and msg.code == wire.NOT_REGISTERED and self._may_rebegin():
                self.begin_refused = msg
                return Outcome.REFUSED
            return Outcome.ERROR
        return Outcome.STALE

    def _may_rebegin(self) -> bool:
        """A "not registered" now refuses a begin that may go out again (once)."""
        return self.begin_version is not None and not self.begin_resent

    def chunk_acked(self, index: int) -> None:
        """The awaited ack of chunk ``index`` arrived (``take_acked`` takes it)."""
        self.early_acks.add(index)

    def error_action(self, err: wire.Error) -> ErrorAction:
        """What ``err`` does to the open update. An Error without an update id refused one
        message (e.g. a frame the daemon could not decode) and left the slot's update open:
        abort, so that it fails at once rather than at the daemon's next deadline. Not when
        the daemon does not know this connection (it restarted): it holds no update of ours
        and, while the begin is unacknowledged, the publisher registers and begins again."""
        if self.update_id is None or err.update_id not in (None, self.update_id):
            return ErrorAction.NONE
        if err.code == wire.NOT_REGISTERED and self._may_rebegin():
            return ErrorAction.KEEP
        if err.update_id is None and err.code != wire.NOT_REGISTERED:
            return ErrorAction.ABORT
        return ErrorAction.END


def to_exception(err: wire.Error) -> SlotsyncError:
    """The ``SlotsyncError`` of a daemon ``Error`` (its phase, message, slot, code ...)."""
    return SlotsyncError(err.phase, err.message, slot=err.slot or None,
                         update_id=err.update_id, missing_ranks=err.missing_ranks,
                         fatal=err.fatal, code=err.code)

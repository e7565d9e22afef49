"""The messages the daemon sends a rank: ``Registered``, ``Ack``, ``Error`` (with its
``code`` values) and ``Waiting``.

Pure Python, no torch (the daemon imports it, design.md I6); imports ``fields`` only.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from slotsync.protocol.wire.fields import PROTOCOL_VERSION

Phase = Literal["register", "begin", "chunk", "commit", "abort", "engine", "adapter_begin",
                "adapter_data"]


class Registered(msgspec.Struct, tag="registered"):
    """Registration accepted. ``next_update_id`` is the lowest update id the daemon will take
    for this slot (ids of earlier rounds are stale, I7)."""

    rank: int
    slot_start: int
    slot_size: int
    next_update_id: int
    protocol_version: int = PROTOCOL_VERSION
    daemon_version: str = ""
    max_message_bytes: int = 0  # the daemon's frame cap (0: unknown); publishers check it
    # the daemon's deadlines on the slot's ranks, seconds (0: not told): a publisher whose
    # timeout_s is shorter would give up before the daemon says what is missing (issue 24)
    begin_deadline_s: float = 0.0
    chunk_deadline_s: float = 0.0
    # the Begin settings this daemon compares across a slot's ranks (issue 24,
    # daemon/core/begin_agreement.py SETTINGS): a publisher declares only these in its Begin, so
    # that a daemon older than it never sees a field it does not know
    begin_settings: list[str] = []
    # the node whose daemon drives the slot's engine (issue 25: for an engine over several
    # nodes, another node's than the rank's own; '' from an older daemon)
    node: str = ""


MAX_OMITTED_NAMES = 64
"""Most names an ``Ack(commit)`` lists in ``omitted_names`` (``omitted_count`` has them all)."""


class Ack(msgspec.Struct, tag="ack"):
    """A step of ``update_id`` is done. ``phase="chunk"``: chunk ``index`` was consumed by the
    engine and the rank may reuse its packed buffer (I3). ``phase="commit"``: finish and
    resume returned; the rank may free every exported tensor and call ``ipc_collect``.

    Commit acks also say what the update left out: ``omitted_count`` tensor names that the
    slot's previous successful update loaded and this one did not (the engine keeps their old
    values; the first ``MAX_OMITTED_NAMES`` of them, sorted, in ``omitted_names``), and
    ``resumed``: False when the daemon left the engine paused because it found it sleeping or
    paused by someone else at the begin (vLLM resumes it at its full ``/wake_up``)."""

    update_id: int
    phase: Literal["begin", "chunk", "commit", "adapter_begin", "adapter_data"]
    index: int = -1
    seconds: float = 0.0
    omitted_names: list[str] = []
    omitted_count: int = 0
    resumed: bool = True
    # adapter rounds (issue 36, wire/adapter.py): at "adapter_begin", how the rank hands over
    # its part ("host": a shared-memory segment the daemon reads; "device": the registered
    # transport's handle); at "adapter_data", the name every engine of the slot now serves
    transport: str = ""
    served_name: str = ""


class Error(msgspec.Struct, tag="error"):
    """The daemon refused a message or the slot's update failed.

    ``slot`` is ``[start, end)`` (empty before the rank's slot is known); ``missing_ranks``
    names the ranks the daemon was still waiting for when a deadline expired (I5).
    """

    phase: str
    message: str
    slot: list[int] = []
    update_id: int | None = None
    missing_ranks: list[int] = []
    fatal: bool = True
    code: str = ""  # machine-readable reason where a peer acts on it: "not_registered"
    # ranks' begin manifests part at this tensor position (send order; -1: not that error)
    tensor_index: int = -1


NOT_REGISTERED = "not_registered"
"""``Error.code`` for a message from a connection the daemon does not know (e.g. after a
daemon restart): the publisher registers again."""

RANK_HELD = "rank_held"
"""``Error.code`` for a registration of a rank that another live process holds: the publisher
retries for up to its ``liveness_s`` (a restarted rank's old process may still be closing
its connection), then raises naming both processes."""

class Waiting(msgspec.Struct, tag="waiting"):
    """The answer to ``Query``: what the daemon is waiting for in the slot's update
    ``update_id`` (None: none in flight), in words (``text``, e.g. "slotsyncd is waiting for
    the begin of rank(s) 2, 3 of slot [0, 4) (update 5); its begin deadline is 60 s, 41 s
    left"), and as data: ``phase`` (``begin``, ``chunk``, ``commit``, ``rank_gone``,
    ``engine``, or '' for no wait), ``missing_ranks`` and the deadline ``deadline_s`` with
    ``left_s`` of it left (seconds; 0: none)."""

    update_id: int | None
    text: str
    phase: str = ""
    missing_ranks: list[int] = []
    deadline_s: float = 0.0
    left_s: float = 0.0


FromDaemon = Registered | Ack | Error | Waiting

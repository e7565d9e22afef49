"""Exceptions a trainer rank sees from the slotsync publisher (no torch import)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["ADAPTER_CODES", "ADAPTER_FAILED", "ADAPTER_FILES_FAILED", "ADAPTER_REFUSED",
           "ADAPTERS_UNSUPPORTED", "BAD_MESSAGE", "DAEMON_GONE", "DAEMON_STOPPING",
           "ENGINE_FAILED", "ENGINE_UNFIT", "RANK_ABORTED", "RANK_GONE", "RANK_TIMEOUT",
           "ROUND_IN_FLIGHT", "SlotsyncError", "SlotsyncTimeout", "VERSION_REFUSED"]

DAEMON_GONE = "daemon_gone"
"""``SlotsyncError.code`` when the connection to the daemon closed while waiting for a reply
(the daemon exited, was killed, or answered no heartbeat within the publisher's
``liveness_s``)."""

ADAPTERS_UNSUPPORTED = "adapters_unsupported"
"""``SlotsyncError.code`` when ``Publisher.publish_adapter`` finds a daemon that does not know
adapter rounds (a slotsyncd older than issue 36 cannot decode ``wire.AdapterBegin``)."""

# ``SlotsyncError.code`` of the daemon's errors in an adapter round (issue 36; every ``Error``
# the daemon sends about an adapter round carries one, ``daemon/core/adapters/rounds.py``;
# docs/lora.md's failure table lists them per row). Base-weight rounds set no code except
# ``not_registered`` and ``rank_held`` (``wire.from_daemon``).

ADAPTER_REFUSED = "adapter_refused"
"""The slot's ranks publish an adapter no engine can take as sent: they disagree (name,
version, config), their parts do not tile a tensor, a tensor name is not a LoRA tensor's, a
config the engine family cannot read, a tensor split over ranks for SGLang. Fix the trainer's
call; nothing was sent to the engine."""

VERSION_REFUSED = "version_refused"
"""The version is not above the one the engine serves (the message names it): publish a
higher one. Nothing was sent to the engine."""

ENGINE_UNFIT = "engine_unfit"
"""The engine cannot hold the adapter as it runs: LoRA off, ``r`` above its max LoRA rank, no
room for one more adapter, a family without adapters, paused or mid-update, a slot over
several nodes. The message names the flag to set; nothing was sent that changes the engine."""

ENGINE_FAILED = "engine_failed"
"""An engine call of the round failed or passed its deadline (a load refused with the
engine's text, the engine died or restarted mid-load, its info routes did not answer). The
previous version stays served."""

ADAPTER_FILES_FAILED = "adapter_files_failed"
"""The daemon could not write the adapter's folder (vLLM engines): a part's sha256 that does
not match the rank's digest (named: tensor and rank), or the file system."""

RANK_TIMEOUT = "rank_timeout"
"""The daemon's deadline on the slot's ranks expired (``begin_timeout_s`` for the begins,
``chunk_timeout_s`` for the data); ``SlotsyncError.missing_ranks`` names the late ones."""

RANK_GONE = "rank_gone"
"""A rank of the slot died, closed its connection, or registered again mid-round (named with
its pid)."""

RANK_ABORTED = "rank_aborted"
"""A rank of the slot gave up on the round and said why (``wire.Abort``): an error raised in
its own ``publish_adapter`` (a bad argument, its memory, an interrupt, its own timeout). The
message names the rank and its reason."""

BAD_MESSAGE = "bad_message"
"""A message outside the round's conversation: malformed, of another or a stale update id,
sent twice or before its ack, a handle that cannot carry the part."""

ROUND_IN_FLIGHT = "round_in_flight"
"""Another round of the slot is in flight (a base-weight update, or another adapter round):
the two never overlap on one engine. Publish once that one returned."""

DAEMON_STOPPING = "daemon_stopping"
"""The daemon is shutting down: the round in flight ends, no new one starts."""

ADAPTER_FAILED = "adapter_failed"
"""Any other failure of an adapter round (the daemon's fallback: none is known to use it)."""

ADAPTER_CODES = (ADAPTER_REFUSED, VERSION_REFUSED, ENGINE_UNFIT, ENGINE_FAILED,
                 ADAPTER_FILES_FAILED, RANK_TIMEOUT, RANK_GONE, RANK_ABORTED, BAD_MESSAGE,
                 ROUND_IN_FLIGHT, DAEMON_STOPPING, ADAPTER_FAILED)
"""Every code an adapter round's ``Error`` carries."""


class SlotsyncError(Exception):
    """The slot's update (or this rank's registration) failed.

    Raised for a daemon ``Error`` reply (wire.Error) and for a reply that is not a valid
    daemon message. The update it names is over: the engine stays paused and needs a full
    update (design.md I4); the publisher moves on to the next update id.

    Attributes:
        phase: the step that failed: ``register``, ``begin``, ``chunk``, ``commit``,
            ``abort``, ``engine``, ``draft`` (a failure after the main session of a round
            with a draft part finished: only the draft needs a full update; issue 18),
            ``adapter_begin``, ``adapter_data`` (an adapter round, issue 36: the previous
            version stays served) (from the daemon) or ``protocol`` (bad reply).
        message: the daemon's own text.
        slot: the engine slot ``(start, end)``, or ``None`` if the daemon did not know it.
        update_id: the failed update's id, or ``None`` (e.g. registration).
        missing_ranks: ranks the daemon was still waiting for when a deadline expired (I5).
        fatal: the daemon's ``fatal`` flag.
        code: the daemon's machine-readable reason (``wire.Error.code``), or "". Every
            error of an adapter round has one (``ADAPTER_CODES``: ``rank_aborted``,
            ``version_refused``, ``engine_failed`` ...); of base-weight rounds only a
            registration's (``not_registered``, ``rank_held``) and ``daemon_gone``.
    """

    def __init__(
        self,
        phase: str,
        message: str,
        *,
        slot: Sequence[int] | None = None,
        update_id: int | None = None,
        missing_ranks: Sequence[int] = (),
        fatal: bool = True,
        code: str = "",
    ) -> None:
        self.phase = phase
        self.code = code
        self.message = message
        self.slot: tuple[int, int] | None = (
            (int(slot[0]), int(slot[1])) if slot is not None and len(slot) == 2 else None
        )
        self.update_id = update_id
        self.missing_ranks: tuple[int, ...] = tuple(missing_ranks)
        self.fatal = fatal
        super().__init__(self._describe())

    def _describe(self) -> str:
        parts = [f"slotsync {self.phase} failed"]
        if self.slot is not None:
            parts.append(f"slot [{self.slot[0]}, {self.slot[1]})")
        if self.update_id is not None:
            parts.append(f"update {self.update_id}")
        if self.missing_ranks:
            parts.append(f"missing ranks {list(self.missing_ranks)}")
        return ", ".join(parts) + f": {self.message}"


class SlotsyncTimeout(SlotsyncError, TimeoutError):
    """No reply from the daemon within the publisher's ``timeout_s`` (design.md I5).

    Attributes (besides ``SlotsyncError``'s):
        waited_for: what the publisher was waiting for, e.g. ``"Ack(chunk, index=3)"``.
        timeout_s: the deadline that expired, in seconds.
        daemon_says: the daemon's answer when the publisher asked it what it was waiting for
            (``wire.Waiting.text``), '' when it did not answer: then the message asks whether
            slotsyncd still runs.
    """

    def __init__(
        self,
        phase: str,
        waited_for: str,
        timeout_s: float,
        *,
        endpoint: str = "",
        slot: Sequence[int] | None = None,
        update_id: int | None = None,
        daemon_says: str = "",
    ) -> None:
        self.waited_for = waited_for
        self.timeout_s = timeout_s
        self.daemon_says = daemon_says
        where = f" from the daemon at {endpoint}" if endpoint else " from the daemon"
        if daemon_says:  # (it answered the publisher's Query: the true cause, issue 24)
            hint = f": {daemon_says}"
        elif endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://"):]):
            hint = (f" (there is no socket at {endpoint[len('ipc://'):]}: is slotsyncd running, "
                    "and is this its --socket?)")
        else:  # (a daemon killed with SIGKILL leaves its socket file behind)
            hint = (" (is slotsyncd still running? `slotsync status` says; a daemon that "
                    "stopped or restarted meanwhile has forgotten this update)")
        super().__init__(
            phase,
            f"no {waited_for}{where} within {timeout_s:g} s{hint}",
            slot=slot,
            update_id=update_id,
        )

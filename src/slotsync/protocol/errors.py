"""Exceptions a trainer rank sees from the slotsync publisher (no torch import)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["ADAPTERS_UNSUPPORTED", "DAEMON_GONE", "SlotsyncError", "SlotsyncTimeout"]

DAEMON_GONE = "daemon_gone"
"""``SlotsyncError.code`` when the connection to the daemon closed while waiting for a reply
(the daemon exited, was killed, or answered no heartbeat within the publisher's
``liveness_s``)."""

ADAPTERS_UNSUPPORTED = "adapters_unsupported"
"""``SlotsyncError.code`` when ``Publisher.publish_adapter`` finds a daemon that does not know
adapter rounds (a slotsyncd older than issue 36 cannot decode ``wire.AdapterBegin``)."""


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
        code: the daemon's machine-readable reason (``wire.Error.code``), or "".
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

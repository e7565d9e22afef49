"""A registered rank's frame that fails validation: what the daemon tells, and whether the
rank's update fails (pure, no I/O; issue 24).

Intake decodes each frame with ``wire.decode_to_daemon``; a frame it refuses raises
``wire.ProtocolError``, which names, as far as the frame tells, the message kind, the field at
fault and the update id. From a connection that has not registered, the daemon answers a
non-fatal ``Error(phase="decode")`` and nothing else (it knows no slot). From a registered
rank, the message was part of its conversation: dropping it would leave the slot's update to
fail later with an unrelated cause ("rank 4 sent chunk 3, expected chunk 2") or at a deadline
naming ranks as missing what they did send. So the update in flight fails at once with this
cause, every rank of the slot told (``refusal``); with no update in flight, or for another
update, only the rank is told.
"""

from __future__ import annotations

from slotsync.protocol.wire import ProtocolError

PHASES = ("register", "begin", "chunk", "commit", "abort", "adapter_begin", "adapter_data")
"""Message kinds that name the phase of the failure; any other (unknown) kind: ``decode``."""


def describe(rank: int, err: ProtocolError) -> str:
    """``err`` in words naming the rank, the message kind and the field, e.g. ``rank 3 sent a
    chunk message the daemon cannot accept (field 'names'): bad message: ...``."""
    kind = f"{err.kind} message" if err.kind else "message"
    field = f" (field {err.field!r})" if err.field else ""
    return f"rank {rank} sent a {kind} the daemon cannot accept{field}: {err}"


def phase_of(err: ProtocolError) -> str:
    """The phase an Error about ``err`` names: its message kind where known, else ``decode``."""
    return err.kind if err.kind in PHASES else "decode"


def fails_update(err: ProtocolError, update_id: int | None) -> bool:
    """Whether ``err`` fails the update in flight ``update_id`` (None: none in flight): the
    frame names that update, or names none (a frame too broken to tell)."""
    return update_id is not None and err.update_id in (None, update_id)

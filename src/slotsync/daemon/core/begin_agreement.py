"""What the begins of one slot's ranks must agree on, checked before the pause (pure, no I/O).

Every rank of a slot sends its own ``wire.Begin``; the pause waits for all of them
(``update.begin_step``), so anything the ranks disagree on is found while the engine still
serves. The coordinator (``SlotCoordinator._on_begin``) asks ``disagreement`` at each begin
after the first; the first disagreement is kept and the update fails once every rank has
begun, so that every rank is told the cause (a rank that began later would otherwise begin the
next update and be told something else there). Rules, in the order they are checked:

* the draft part (``Begin.draft``, issue 18): all ranks with one, or all without;
* rank-local mode (``rank_local.take_begin``);
* the tensor manifest (``Begin.manifest``): the same tensors in the same order (design.md I2);
  the error carries the first position where they part (``Error.tensor_index``);
* the publisher settings that decide how tensors are cut into chunks (``SETTINGS``): outside
  rank-local mode every rank must cut identical chunks (``aggregation.SAME_CHUNKS_RULE``), so
  a rank whose ``staging_bytes`` differs would otherwise be found only at chunk 0, after the
  pause, leaving the engine paused and in need of a full update (issue 24). A begin that does
  not declare a setting (0: a publisher older than the daemon) is not compared.

``packed`` and ``transport`` are in ``wire.Register`` and checked there, before any begin
(``registration.unlike_the_slot``).
"""

from __future__ import annotations

from slotsync.daemon.core import rank_local
from slotsync.daemon.core.aggregation import SAME_CHUNKS_RULE
from slotsync.daemon.core.update import Update
from slotsync.protocol.manifest import DIGEST_BYTES, first_difference
from slotsync.protocol.wire import Begin

SETTINGS: tuple[str, ...] = ("staging_bytes",)
"""Publisher settings a ``Begin`` declares and every rank of a slot must share (outside
rank-local mode), told to each rank in ``Registered.begin_settings`` so that a publisher
declares only what its daemon knows. ``staging_bytes``: the chunk limit in bytes
(``Publisher(staging_bytes=...)``, ``chunking.cut``)."""


def take_first(u: Update, rank: int, msg: Begin) -> None:
    """Record the first begin ``msg`` (of ``rank``) of update ``u``: its mode and declared
    tensors, and the settings it declares."""
    rank_local.take_begin(u.mode_of, u.declared, u.worker_of, rank, msg)  # (first: agrees)
    _take_settings(u, rank, msg)


def disagreement(u: Update, rank: int, msg: Begin) -> tuple[str, int]:
    """Record ``rank``'s begin ``msg`` of update ``u`` (not its first) and say why it
    disagrees with the begins before it (the rules at the top): ``(text, tensor_index)``,
    ``("", -1)`` when it agrees. ``tensor_index`` is the manifest position where the tensors
    part, -1 for any other disagreement."""
    why, at = "", -1
    if msg.draft != u.draft:
        has = ("with", "without") if msg.draft else ("without", "with")
        why = (f"rank {rank} begins update {u.update_id} {has[0]} a draft part, ranks "
               f"{sorted(u.begun)} {has[1]} one: every rank of the slot must declare "
               "the same draft part (Publisher.publish(..., draft=...))")
    why = why or rank_local.take_begin(u.mode_of, u.declared, u.worker_of, rank, msg)
    if not why and msg.manifest and u.manifest and msg.manifest != u.manifest:
        why, at = _manifest_mismatch(u, rank, msg.manifest)  # I2
    if msg.manifest and not u.manifest:
        u.manifest, u.manifest_rank = msg.manifest, rank
    setting = _take_settings(u, rank, msg)
    return (why, at) if why else (setting, -1)


def _take_settings(u: Update, rank: int, msg: Begin) -> str:
    """Record the settings ``rank`` declares; why one differs from the ranks' before it."""
    why = ""
    for name in SETTINGS:
        value = getattr(msg, name)
        if not value:
            continue  # (not declared: an older publisher)
        seen = u.settings.setdefault(name, {})
        others = {r: v for r, v in seen.items() if v != value}
        seen[rank] = value
        if others and not why and not msg.rank_local:
            by_value: dict[int, list[int]] = {}
            for r, v in sorted(others.items()):
                by_value.setdefault(v, []).append(r)
            them = "; ".join(f"rank(s) {rs} with {name}={v}" for v, rs in by_value.items())
            why = (f"the ranks of the slot disagree on {name}: rank {rank} begins update "
                   f"{u.update_id} with {name}={value}, {them} (Publisher({name}=...)): "
                   f"{SAME_CHUNKS_RULE}")
    return why


def _manifest_mismatch(u: Update, rank: int, manifest: bytes) -> tuple[str, int]:
    """Why ``rank``'s begin manifest differs from the first one, and the first tensor
    position where they part (``Error.tensor_index``: each publisher names its own tensor
    there)."""
    at = first_difference(manifest, u.manifest)
    n, n0 = len(manifest) // DIGEST_BYTES, len(u.manifest) // DIGEST_BYTES
    return (f"rank {rank} begins update {u.update_id} with tensors that differ from rank "
            f"{u.manifest_rank}'s from tensor #{at} on, in send order (rank {rank} sends {n} "
            f"tensors, rank {u.manifest_rank} {n0}): {SAME_CHUNKS_RULE}", at)

"""The chunk window of one update: intake, merge-ahead, what goes to the engine, which acks are
due, and the commit's chunk counts (I/O-free functions over ``update.Update``).

Rules (design.md "Flow of one round", I2, I3):

* Intake: a rank sends chunks 0, 1, ... after its begin and before its commit, and no further
  than another rank's commit (``Update.chunk_out_of_order``, ``aggregation.SAME_CHUNKS_RULE``);
  chunks may arrive while the begin still runs.
* Merge-ahead: chunk k is merged the moment every rank of the slot sent it (the engine
  family's ``merge``: ``aggregation.check_chunk``, then its payload), not when its turn
  comes, so that the engine never waits for the daemon while it loads an earlier chunk. A
  mismatch is kept in ``Update.merged`` and fails the update when the chunk's turn comes.
* Window: chunks go to the engine in index order (``Update.next_send``), at most
  ``chunks_in_flight`` ``/update_weights`` calls at once. A mismatched chunk fails the update
  only once no call is left at the engine (I2: the engine never sees an inconsistent chunk).
* Acks: a chunk is acknowledged once it and every chunk before it returned (I3), in index
  order (``Update.loaded`` -> ``Update.next_index``).
* Commit: every rank commits the number of chunks it sent, once, no rank sent more, all
  counts agree, and not all of them are 0 (an update of no chunk never touches the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from slotsync.daemon.core.aggregation import (
    SAME_CHUNKS_RULE,
    ChunkMismatch,
    MergedChunk,
)
from slotsync.daemon.core.family import MergeFacts
from slotsync.daemon.core.rank_local import chunk_refusal
from slotsync.daemon.core.update import Update
from slotsync.protocol.wire import Chunk


def merge(idx: int, got: dict[int, Chunk], facts: MergeFacts,
          u: Update | None = None) -> MergedChunk | ChunkMismatch:
    """Check and merge chunk ``idx`` that every rank sent (``got``: rank -> chunk) into the
    payload of the engine's family (``facts.family``, ``EngineFamily.merge``: rank-local
    update ``u`` gets vLLM's list form); a mismatch is returned, not raised, and kept until
    the chunk's turn comes."""
    assert facts.family is not None  # (the callers wait for the kind: receive, merge_waiting)
    try:
        return facts.family.merge(idx, got, facts, u)
    except ChunkMismatch as e:
        return e


def receive(u: Update, rank: int, msg: Chunk, now: float, size: int,
            facts: MergeFacts) -> str:
    """Take chunk ``msg`` from ``rank`` into update ``u`` of a slot of ``size`` ranks (``now``:
    monotonic seconds); merge it once every rank sent it. Returns why the chunk breaks the
    round's order (the update must fail, phase ``chunk``), or '' if it was taken."""
    why = u.chunk_out_of_order(rank, msg.index) or draft_out_of_order(u, rank, msg)
    if why:
        return why
    if u.mode_of.get(rank):  # rank-local: the rank's next declared tensors
        at = u.tensors_sent.get(rank, 0)
        why = chunk_refusal(u.declared[rank], at, rank, msg)
        if why:
            return why
        u.tensors_sent[rank] = at + len(msg.names)
        if facts.packed:
            u.fill_handles[rank] = msg.handles[0]
    u.sent_count[rank] = msg.index + 1
    got = u.pending.setdefault(msg.index, {})
    got[rank] = msg
    u.first_arrival.setdefault(msg.index, now)
    u.last_progress = now
    if _complete(u, msg.index, size) and facts.family is not None:
        u.merged[msg.index] = merge(msg.index, got, facts, u)
    return ""


def merge_waiting(u: Update, size: int, facts: MergeFacts) -> None:
    """Merge the complete chunks that arrived before the engine's kind was known (``facts``
    now tells it): the first begin against an engine the table does not declare."""
    if facts.family is None:
        return
    for idx in sorted(u.pending):
        if idx >= u.next_send and idx not in u.merged and _complete(u, idx, size):
            u.merged[idx] = merge(idx, u.pending[idx], facts, u)


def draft_out_of_order(u: Update, rank: int, msg: Chunk) -> str:
    """Why chunk ``msg`` from ``rank`` breaks the draft rule (issue 18): draft chunks only in
    a round whose begin declared a draft part, after at least one main chunk, and after every
    main chunk, at the same index on every rank; '' if it keeps it. Sets ``u.draft_from`` at
    the first draft chunk."""
    idx = msg.index
    if msg.draft and not u.draft:
        return (f"rank {rank} sent chunk {idx} as a draft chunk, but update {u.update_id} "
                "declared no draft part (Begin.draft)")
    if u.draft_from is None:
        if not msg.draft:
            return ""
        if idx == 0:
            return (f"rank {rank} sent chunk 0 as a draft chunk: the draft part comes after "
                    "at least one main chunk")
        main_after = sorted((i, r) for i, got in u.pending.items() if i >= idx
                            for r, c in got.items() if not c.draft)
        if main_after:
            i, r = main_after[0]
            return (f"rank {rank} began the draft part at chunk {idx}, but rank {r} sent "
                    f"chunk {i} as a main chunk: {SAME_CHUNKS_RULE} (draft chunks come after "
                    "every main chunk)")
        u.draft_from = idx
        return ""
    if msg.draft != (idx >= u.draft_from):
        what = "a draft" if msg.draft else "a main"
        return (f"rank {rank} sent chunk {idx} as {what} chunk, but the draft part begins "
                f"at chunk {u.draft_from}: {SAME_CHUNKS_RULE} (draft chunks come after every "
                "main chunk)")
    return ""


def _complete(u: Update, idx: int, size: int) -> bool:
    """Every rank sent chunk ``idx``; rank-local: or committed fewer chunks."""
    got = u.pending.get(idx, {})
    if not u.rank_local:
        return len(got) == size
    short = sum(1 for r, n in u.committed.items() if n <= idx and r not in got)
    return len(got) + short == size


def merge_completed(u: Update, size: int, facts: MergeFacts) -> None:
    """Rank-local: after a commit, merge the chunks it completed (the committing rank sent
    fewer chunks than others: they get its empty entry)."""
    if not u.rank_local or facts.family is None:  # (merge_waiting merges them then)
        return
    for idx in sorted(u.pending):
        if idx >= u.next_send and idx not in u.merged and _complete(u, idx, size):
            u.merged[idx] = merge(idx, u.pending[idx], facts, u)


def to_send(u: Update, in_flight: int, limit: int, until: int | None = None,
            ) -> tuple[list[tuple[int, MergedChunk]], ChunkMismatch | None]:
    """The merged chunks to hand to the engine now, in index order, with ``in_flight``
    ``/update_weights`` calls out and at most ``limit`` at once, none from index ``until`` on
    (``Update.sendable_until``: a draft chunk waits for the draft session); they leave
    ``u.merged`` and ``u.next_send`` moves past them. Returns ``(chunks, mismatch)``:
    ``mismatch`` is the next chunk's ``ChunkMismatch`` when no call is out and none goes
    out (the update must fail, phase ``chunk``), else None."""
    out: list[tuple[int, MergedChunk]] = []
    while in_flight + len(out) < limit and (until is None or u.next_send < until):
        merged = u.merged.get(u.next_send)
        if merged is None:
            break
        if isinstance(merged, ChunkMismatch):
            if in_flight or out:
                break  # fail once the chunks before it returned: none is left at the engine
            return out, merged
        del u.merged[u.next_send]
        out.append((u.next_send, merged))
        u.next_send += 1
    return out, None


def returned(u: Update, index: int) -> list[int]:
    """The engine loaded chunk ``index``: the chunks now due for an ack, in index order (each
    consumed: ``Update.consume_next``). Empty while an earlier chunk is still at the engine."""
    u.loaded.add(index)
    acked: list[int] = []
    while u.next_index in u.loaded:
        acked.append(u.next_index)
        u.consume_next()
    return acked


@dataclass(frozen=True, slots=True)
class CommitRefusal:
    """Why a rank's commit is refused: ``fails`` the update (with ``missing`` ranks) or only
    answers that rank (``fails`` False); ``text`` is the error's text."""

    text: str
    fails: bool = True
    missing: tuple[int, ...] = ()


def commit(u: Update, rank: int, num_chunks: int, size: int,
           now: float) -> CommitRefusal | None:
    """Take ``rank``'s commit of ``num_chunks`` chunks into update ``u`` of a slot of ``size``
    ranks (``now``: monotonic seconds). Returns why it is refused (the rules at the top), or
    None if it was taken."""
    sent = u.sent_count.get(rank, 0)
    if num_chunks != sent:
        return CommitRefusal(f"rank {rank} committed {num_chunks} chunks but sent {sent}",
                             missing=(rank,))
    if rank in u.committed:
        return CommitRefusal(f"rank {rank} committed twice", fails=False)
    if u.rank_local:  # each rank its own chunk count, but all it declared
        declared, sent_t = len(u.declared[rank][0]), u.tensors_sent.get(rank, 0)
        if sent_t != declared:
            return CommitRefusal(f"rank {rank} committed after sending {sent_t} of the "
                                 f"{declared} tensors its begin declared", missing=(rank,))
    ahead = [(r, n) for r, n in sorted(u.sent_count.items()) if n > num_chunks]
    if ahead and not u.rank_local:
        r0, n0 = ahead[0]
        return CommitRefusal(f"rank {rank} committed {num_chunks} chunks but rank {r0} "
                             f"already sent {n0}: {SAME_CHUNKS_RULE}")
    u.committed[rank] = num_chunks
    u.last_progress = now
    counts = set(u.committed.values())
    if counts == {0} and len(u.committed) == size:
        # (the pause waits for a first chunk: the engine was not touched)
        return CommitRefusal(
            f"update {u.update_id} has no chunks: every rank of the slot (ranks "
            f"{sorted(u.committed)}) committed 0 chunks: there is nothing to load")
    if len(counts) > 1 and not u.rank_local:
        return CommitRefusal("ranks committed different chunk counts: " + ", ".join(
            f"rank {r}: {n}" for r, n in sorted(u.committed.items())))
    return None

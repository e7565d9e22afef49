"""Rank-local rounds (expert parallelism, issue 18): each rank of a slot sends its own
tensors for one engine worker, and the daemon sends vLLM the list form of ``update_info``
(pure functions, no I/O; docs/rank-local.md). Here: the intake rules, every family's; the
payload is the family's (vLLM's list form: ``daemon/vllm/merge.py``).

vLLM 0.32 ``v1/worker/gpu_worker.py`` ``Worker.update_weights(update_info: dict | list)``: a
list is indexed by the worker's global rank, ``parallel_config.data_parallel_index *
parallel_config.world_size + self.rank`` (world size = TP * PP); each worker hands its own
entry to the IPC engine's ``parse_update_info`` / ``receive_weights``. vLLM 0.32 and 0.33
offer no route that reports the workers' GPU UUIDs, so the worker order comes from the
daemon's engine table (``engines[].gpu_uuids``, in global worker order); where an engine
reports its own (the reference engine's ``gpu_uuids`` in ``/get_world_size``) the two must
agree. The daemon never guesses an order.

Rules, each checked before the pause (``begin_refusal``, from ``update.begin_step``, after the
engine family's ``rank_local_refusal``: vLLM 0.32+ takes the list form, SGLang none):

* every rank of the slot declares the same mode in its begin (``take_begin``);
* a tensor name that several ranks declare has the same dtype and shape on each (its bytes
  follow from both);
* the engine table exists, has one GPU UUID per worker (``/get_world_size``), matches the
  engine's own report where there is one, holds every rank's GPU UUID, and lists each rank's
  GPU UUID at the rank's ``worker_rank``; every worker has exactly one rank.

Chunks (``merge_rank_local``, ``daemon/vllm/merge.py``): chunk i of each rank holds that rank's
next tensors in its declared order (``chunk_refusal``); ranks may send different numbers of
chunks. Chunk i goes to the engine once every rank either sent it or committed fewer chunks; a
rank without a chunk i gets an empty entry (``names``/``dtype_names``/``shapes`` ``[]``): vLLM's
``IPCWeightTransferUpdateInfo`` accepts empty lists and ``model.load_weights([])`` loads
nothing. Unpacked, the empty entry's ``ipc_handles`` is ``[]``; packed, vLLM's
``packed_ipc_consumer`` looks up the worker's GPU UUID and maps the buffer even for no
tensors, so the empty entry carries the handle of the rank's last chunk (its staging memory
lives until the update ends, ``protocol/rank/publisher.py``) with ``tensor_sizes`` ``[]``: the
buffer is mapped and nothing read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from slotsync.protocol.wire import Begin, Chunk

Declared = tuple[list[str], list[str], list[list[int]]]
"""A rank's declared tensors: ``(names, dtype_names, shapes)`` in send order."""

TABLE_SETTING = "engines[].gpu_uuids"
"""The engine-table setting that gives the worker order (daemon/service/config.py
``EngineEntry``)."""


def take_begin(mode_of: dict[int, bool], declared: dict[int, Declared],
               worker_of: dict[int, int], rank: int, msg: Begin) -> str:
    """Record ``rank``'s begin ``msg`` (its mode, and in rank-local mode its tensors and
    worker index) into the update's maps. Returns why the update must fail (phase
    ``begin``): the ranks disagree on the mode, naming the ranks of each; else ''."""
    mode_of[rank] = msg.rank_local
    if msg.rank_local:
        declared[rank] = (msg.names, msg.dtype_names, msg.shapes)
        worker_of[rank] = msg.worker_rank
    if len(set(mode_of.values())) > 1:
        local = sorted(r for r, m in mode_of.items() if m)
        full = sorted(r for r, m in mode_of.items() if not m)
        return (f"the ranks of a slot must agree on rank-local mode: rank(s) {local} begin "
                f"in rank-local mode, rank(s) {full} do not")
    return ""


def begin_refusal(u, ranks: Mapping, engine, engine_url: str | None) -> str:
    """Why rank-local update ``u`` (a ``update.Update`` whose every rank began) must fail
    before the pause: its declared tensors (``shared_refusal``) or the worker table
    (``table_refusal``) of ``engine`` (``engine_session.EngineSession``); ``ranks``: rank ->
    ``registration.RankInfo``. '' for an update outside rank-local mode, or when it may go."""
    if not u.rank_local:
        return ""
    # (the engine family's own refusal, EngineFamily.rank_local_refusal, ran before this one)
    return shared_refusal(u.declared) or table_refusal(
        {r: i.gpu_uuid for r, i in ranks.items()}, u.worker_of, engine.declared_gpu_uuids,
        engine.gpu_uuids, engine.world_size, engine_url)


def shared_refusal(declared: Mapping[int, Declared]) -> str:
    """Why the ranks' declared tensors cannot go to one engine: a name that several ranks
    declare with another dtype or shape (naming the tensor and the ranks); else ''."""
    seen: dict[str, tuple[str, list[int], int]] = {}
    for r in sorted(declared):
        for name, dt, shape in zip(*declared[r], strict=True):
            first = seen.setdefault(name, (dt, shape, r))
            if (first[0], first[1]) != (dt, shape):
                return (f"shared tensor {name!r} differs across ranks: rank {first[2]} "
                        f"declares {first[0]} {first[1]}, rank {r} {dt} {shape} (a tensor "
                        "several ranks send must have the same dtype and shape on each)")
    return ""


def table_refusal(uuid_of_rank: Mapping[int, str], worker_of: Mapping[int, int],
                  table: Sequence[str] | None, reported: Sequence[str] | None,
                  world_size: int | None, engine_url: str | None) -> str:
    """Why the worker order cannot be trusted (the rules at the top), or ''.

    Args:
        uuid_of_rank: rank -> its registered GPU UUID.
        worker_of: rank -> the ``worker_rank`` of its begin.
        table: the engine table's ``gpu_uuids`` for this engine (global worker order), or
            None when the table gives none.
        reported: the GPU UUIDs the engine reports itself, in worker order, or None (vLLM).
        world_size: the engine's ``/get_world_size?include_dp=true``, or None if unknown.
        engine_url: for messages.
    """
    if not table:
        return (f"rank-local mode needs the worker order of engine {engine_url}: the daemon's "
                f"engine table gives no {TABLE_SETTING} for it (list its workers' GPU UUIDs "
                "in global worker order, dp_index * TP * PP + rank; vLLM reports none)")
    if world_size is not None and len(table) != world_size:
        return (f"engine {engine_url}: {TABLE_SETTING} lists {len(table)} GPU UUIDs but the "
                f"engine has {world_size} workers (/get_world_size)")
    if reported and list(reported) != list(table):
        return (f"engine {engine_url} reports its workers' GPU UUIDs as {list(reported)}, the "
                f"engine table's {TABLE_SETTING} says {list(table)}")
    index = {u: w for w, u in enumerate(table)}
    for r in sorted(uuid_of_rank):
        if uuid_of_rank[r] not in index:
            return (f"rank {r}'s GPU UUID {uuid_of_rank[r]} is not in engine {engine_url}'s "
                    f"{TABLE_SETTING} {list(table)}")
    claimed: dict[int, list[int]] = {}
    for r in sorted(worker_of):
        w = worker_of[r]
        if w >= len(table):
            return (f"rank {r} publishes for worker {w}, but engine {engine_url} has "
                    f"{len(table)} workers")
        claimed.setdefault(w, []).append(r)
    if len(claimed) < len(worker_of):
        lacking = sorted(set(range(len(table))) - set(claimed))
        twice = {w: rs for w, rs in claimed.items() if len(rs) > 1}
        return (f"worker(s) {lacking} of engine {engine_url} would get no entry: "
                + "; ".join(f"ranks {rs} all publish for worker {w}"
                            for w, rs in sorted(twice.items())))
    for r in sorted(worker_of):
        w = worker_of[r]
        if table[w] != uuid_of_rank[r]:
            return (f"misordered worker table: rank {r} publishes for worker {w}, whose GPU "
                    f"UUID in {TABLE_SETTING} is {table[w]}, but rank {r}'s GPU is "
                    f"{uuid_of_rank[r]} (worker {index[uuid_of_rank[r]]} in the table)")
    return ""


def chunk_refusal(declared: Declared, at: int, rank: int, msg: Chunk) -> str:
    """Why ``rank``'s chunk ``msg`` is not its next declared tensors (from position ``at``
    of its declared list), naming the first tensor that differs; else ''."""
    names, dts, shapes = declared
    n = len(msg.names)
    if at + n > len(names):
        return (f"rank {rank} sent chunk {msg.index} with {n} tensors past the {len(names)} "
                "it declared in its begin")
    if (names[at:at + n] != msg.names or dts[at:at + n] != msg.dtype_names
            or shapes[at:at + n] != msg.shapes):
        i = next(i for i in range(n) if (names[at + i], dts[at + i], shapes[at + i])
                 != (msg.names[i], msg.dtype_names[i], msg.shapes[i]))
        return (f"rank {rank} chunk {msg.index}: tensor {msg.names[i]!r} "
                f"({msg.dtype_names[i]} {msg.shapes[i]}) is not the one it declared at "
                f"#{at + i}: {names[at + i]!r} ({dts[at + i]} {shapes[at + i]})")
    return ""

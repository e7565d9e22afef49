"""One chunk, merged across a slot's ranks, as SGLang's ``/update_weights_from_tensor`` body
(I/O-free; issue 26 B).

The checks are the vLLM merge's (``aggregation.check_chunk``: every rank sent the same names,
dtypes, shapes and sizes, handles of the slot's transport, distinct GPU UUIDs, as many as the
engine's ranks); then one pickle per rank (``tensor_pickle.py``), in SGLang's TP-rank order
(entry i is read by TP rank i only: tp_worker.py ``deserialize_own_rank``, 0.5.23), built from
the rank on TP rank i's GPU (``tp_order``): where the engine table declares ``gpu_uuids`` (in
TP-rank order), entry i is the chunk of the rank whose GPU UUID is ``gpu_uuids[i]``; else the
slot's rank ``start + i`` is taken for TP rank i, as slime and miles assume
(docs/sglang-contract.md 6).

The body (io_struct ``UpdateWeightsFromTensorReqInput``, 0.5.20-0.5.23)::

    {"serialized_named_tensors": [<TP rank 0's pickle>, ...],   # bytes: base64 (msgspec JSON)
     "load_format": "flattened_bucket" | null,               # packed | unpacked
     "flush_cache": false,          # a flush fails while requests run (in_place pause), and on
                                    # 0.5.20/0.5.21 that kills the server; the pause flushes
     "abort_all_requests": false,   # keep the requests the pause kept
     "selector": "all"}             # 0.5.21+ (0.5.20 ignores unknown fields): SGLang's default

No ``weight_version``: the version is set once, after the session ended (``routes.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from slotsync.daemon.core.aggregation import ChunkMismatch, MergedChunk, check_chunk
from slotsync.daemon.sglang.tensor_pickle import SglangPayloadError, serialized_named_tensors
from slotsync.protocol.wire import Chunk


def tp_order(uuid_of_rank: Mapping[int, str], engine_gpu_uuids: Sequence[str] | None
             ) -> list[int]:
    """The slot's ranks (``uuid_of_rank``: rank -> its GPU UUID) in SGLang TP-rank order: the
    rank whose GPU is ``engine_gpu_uuids[i]`` (TP rank i's GPU: the engine table's
    ``gpu_uuids``, declared in TP-rank order) feeds TP rank i (issue 35 item 12).

    Why by GPU and not by rank number: SGLang rebuilds each tensor of entry i on the GPU its
    UUID names (``patch_torch._device_from_maybe_uuid``, 0.5.20-0.5.23), whichever TP rank
    reads it; an entry built from another rank's chunk is another GPU's memory, which TP rank
    i then copies peer to peer, and a rank-local payload would be another rank's weights.

    Without declared UUIDs (SGLang reports none), or when they are not exactly the ranks'
    (refused at the pause: ``registration.uuid_mismatch``), the ranks in ascending order (the
    slot's rank ``start + i`` feeds TP rank i, docs/sglang.md section 1).
    """
    ranks = sorted(uuid_of_rank)
    if not engine_gpu_uuids or len(engine_gpu_uuids) != len(ranks):
        return ranks
    rank_of = {u: r for r, u in uuid_of_rank.items()}
    if len(rank_of) != len(ranks) or set(rank_of) != set(engine_gpu_uuids):
        return ranks
    return [rank_of[u] for u in engine_gpu_uuids]


def merge_chunk(index: int, chunks: Mapping[int, Chunk], uuid_of_rank: Mapping[int, str], *,
                packed: bool, transport: str, world_size: int,
                engine_gpu_uuids: Sequence[str] | None = None) -> MergedChunk:
    """Check chunk ``index`` of every rank (``chunks``: rank -> chunk) and build SGLang's body,
    entry i from the rank on TP rank i's GPU (``tp_order`` over ``engine_gpu_uuids``).

    Raises:
        ChunkMismatch: the ranks disagree (``aggregation.check_chunk``), or a tensor SGLang
            could not load (``tensor_pickle.SglangPayloadError``: a misaligned tensor in a
            packed bucket, a GPU UUID SGLang would refuse), named, before SGLang sees it --
            any exception in SGLang's scheduler kills the whole server.
    """
    ref = check_chunk(index, chunks, uuid_of_rank, packed=packed, transport=transport,
                      world_size=world_size)
    try:
        entries = serialized_named_tensors(chunks, uuid_of_rank, packed=packed,
                                           order=tp_order(uuid_of_rank, engine_gpu_uuids))
    except SglangPayloadError as e:
        raise ChunkMismatch(f"chunk {index}: {e}", sorted(chunks)) from None
    body = {"serialized_named_tensors": entries,
            "load_format": "flattened_bucket" if packed else None,
            "flush_cache": False, "abort_all_requests": False, "selector": "all"}
    return MergedChunk(index, body, len(ref.names), sum(ref.tensor_sizes),
                       msgspec.json.encode(body))

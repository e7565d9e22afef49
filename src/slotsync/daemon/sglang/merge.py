"""One chunk, merged across a slot's ranks, as SGLang's ``/update_weights_from_tensor`` body
(I/O-free; issue 26 B).

The checks are the vLLM merge's (``aggregation.check_chunk``: every rank sent the same names,
dtypes, shapes and sizes, handles of the slot's transport, distinct GPU UUIDs, as many as the
engine's ranks); then one pickle per rank (``tensor_pickle.py``), in rank order, which is SGLang's
TP-rank order (entry r is read by TP rank r only: tp_worker.py ``deserialize_own_rank``, 0.5.23;
the slot's rank ``start + r`` is the engine's TP rank r, as slime and miles assume,
docs/sglang-contract.md 6).

The body (io_struct ``UpdateWeightsFromTensorReqInput``, 0.5.20-0.5.23)::

    {"serialized_named_tensors": [<rank 0's pickle>, ...],   # bytes: base64 by msgspec's JSON
     "load_format": "flattened_bucket" | null,               # packed | unpacked
     "flush_cache": false,          # a flush fails while requests run (in_place pause), and on
                                    # 0.5.20/0.5.21 that kills the server; the pause flushes
     "abort_all_requests": false,   # keep the requests the pause kept
     "selector": "all"}             # 0.5.21+ (0.5.20 ignores unknown fields): SGLang's default

No ``weight_version``: the version is set once, after the session ended (``routes.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from slotsync.daemon.core.aggregation import ChunkMismatch, MergedChunk, check_chunk
from slotsync.daemon.sglang.tensor_pickle import SglangPayloadError, serialized_named_tensors
from slotsync.protocol.wire import Chunk


def merge_chunk(index: int, chunks: Mapping[int, Chunk], uuid_of_rank: Mapping[int, str], *,
                packed: bool, transport: str, world_size: int) -> MergedChunk:
    """Check chunk ``index`` of every rank (``chunks``: rank -> chunk) and build SGLang's body.

    Raises:
        ChunkMismatch: the ranks disagree (``aggregation.check_chunk``), or a tensor SGLang
            could not load (``tensor_pickle.SglangPayloadError``: a misaligned tensor in a
            packed bucket, a GPU UUID SGLang would refuse), named, before SGLang sees it --
            any exception in SGLang's scheduler kills the whole server.
    """
    ref = check_chunk(index, chunks, uuid_of_rank, packed=packed, transport=transport,
                      world_size=world_size)
    try:
        entries = serialized_named_tensors(chunks, uuid_of_rank, packed=packed)
    except SglangPayloadError as e:
        raise ChunkMismatch(f"chunk {index}: {e}", sorted(chunks)) from None
    body = {"serialized_named_tensors": entries,
            "load_format": "flattened_bucket" if packed else None,
            "flush_cache": False, "abort_all_requests": False, "selector": "all"}
    return MergedChunk(index, body, len(ref.names), sum(ref.tensor_sizes),
                       msgspec.json.encode(body))

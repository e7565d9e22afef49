"""vLLM's payload of one chunk, merged across a slot's ranks (pure functions, no I/O): the
``update_info`` body of ``/update_weights`` for the IPC backend (vllm-contract.md "update_info
for the IPC backend"), and its list form for rank-local rounds (``merge_rank_local``,
``daemon/core/rank_local.py`` for the rules, docs/rank-local.md).

The checks are every family's (``aggregation.check_chunk``); the pickles are vLLM's IPC
handles' (``ipc_pickle.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from slotsync.daemon.core.aggregation import ChunkMismatch, MergedChunk, check_chunk
from slotsync.daemon.vllm.ipc_pickle import pickle_packed, pickle_unpacked
from slotsync.protocol.wire import Chunk, CudaIpcHandle, Handle, ShmHandle


def merge_chunk(
    index: int,
    chunks: Mapping[int, Chunk],
    uuid_of_rank: Mapping[int, str],
    *,
    packed: bool,
    transport: str,
    world_size: int,
) -> MergedChunk:
    """Validate one chunk across the ranks of a slot and build its ``update_info``.

    Args:
        index: the chunk index (for messages).
        chunks: rank -> that rank's ``Chunk`` message; must hold every rank of the slot.
        uuid_of_rank: rank -> GPU UUID (torch format) from registration.
        packed: vLLM packed transfer (one uint8 buffer handle per rank) or unpacked.
        transport: ``"cuda"`` or ``"shm"``: the handle kind every rank must send.
        world_size: the engine's ``/get_world_size``: the number of GPU UUIDs required.

    Raises:
        ChunkMismatch: a rank's names, dtypes, shapes or sizes differ from the lowest rank's,
            a handle of the wrong kind or count, duplicate UUIDs, or a UUID count other than
            ``world_size``. The message names the first differing tensor and the ranks.
    """
    ref = check_chunk(index, chunks, uuid_of_rank, packed=packed, transport=transport,
                      world_size=world_size)
    ranks = sorted(chunks)
    info: dict = {"names": ref.names, "dtype_names": ref.dtype_names, "shapes": ref.shapes}
    if packed:
        pickled = pickle_packed({uuid_of_rank[r]: chunks[r].handles[0] for r in ranks})
        info["tensor_sizes"] = ref.tensor_sizes
    else:
        pickled = pickle_unpacked(
            [uuid_of_rank[r] for r in ranks], [chunks[r].handles for r in ranks],
            dtype_names=ref.dtype_names, shapes=ref.shapes,  # (shm handles carry neither)
        )
    info["ipc_handles_pickled"] = pickled  # bytes: base64 by the JSON encoder (see MergedChunk)
    return MergedChunk(index, info, len(ref.names), sum(ref.tensor_sizes),
                       msgspec.json.encode(info))


def merge_rank_local(index: int, chunks: Mapping[int, Chunk], worker_of: Mapping[int, int],
                     uuid_of_rank: Mapping[int, str], fill_handles: Mapping[int, Handle], *,
                     packed: bool, transport: str, world_size: int) -> MergedChunk:
    """Build chunk ``index``'s list-form ``update_info``: entry ``w`` is the chunk of the rank
    publishing for worker ``w``, its handle dict ``{that rank's GPU UUID: args}``.

    Args:
        index: the chunk index.
        chunks: rank -> its chunk ``index``; ranks that committed fewer chunks are absent
            and get an empty entry.
        worker_of: every rank of the slot -> its worker index (checked by
            ``table_refusal`` before the pause).
        uuid_of_rank: rank -> GPU UUID.
        fill_handles: rank -> the handle of its last chunk (packed: an empty entry's buffer).
        packed, transport: as ``aggregation.merge_chunk``.
        world_size: entries to build (``/get_world_size``).

    Returns:
        ``MergedChunk`` whose ``update_info`` is the list; ``num_tensors`` the distinct names,
        ``nbytes`` the largest entry's tensor bytes.

    Raises:
        ChunkMismatch: a handle of the wrong kind or count, a worker without an entry (naming
            it), or a packed rank without a chunk to lend its buffer.
    """
    kind = CudaIpcHandle if transport == "cuda" else ShmHandle
    entries: list[dict | None] = [None] * world_size
    for r, w in sorted(worker_of.items()):
        uuid = uuid_of_rank[r]
        c = chunks.get(r)
        if c is None:
            info: dict = {"names": [], "dtype_names": [], "shapes": []}
            if packed:
                h = fill_handles.get(r)
                if h is None:
                    raise ChunkMismatch(f"chunk {index}: rank {r} (worker {w}) sent no chunk "
                                        "whose buffer an empty packed entry can name", [r])
                info["tensor_sizes"] = []
                info["ipc_handles_pickled"] = pickle_packed({uuid: h})
            else:
                info["ipc_handles_pickled"] = pickle_unpacked([uuid], [[]])
        else:
            want = 1 if packed else len(c.names)
            if len(c.handles) != want or not all(isinstance(h, kind) for h in c.handles):
                raise ChunkMismatch(f"chunk {index}: rank {r} sent {len(c.handles)} handles "
                                    f"(want {want} of transport {transport!r})", [r])
            info = {"names": c.names, "dtype_names": c.dtype_names, "shapes": c.shapes}
            if packed:
                info["tensor_sizes"] = c.tensor_sizes
                info["ipc_handles_pickled"] = pickle_packed({uuid: c.handles[0]})
            else:
                info["ipc_handles_pickled"] = pickle_unpacked(
                    [uuid], [c.handles], dtype_names=c.dtype_names, shapes=c.shapes)
        entries[w] = info
    missing = [w for w, e in enumerate(entries) if e is None]
    if missing:
        raise ChunkMismatch(f"chunk {index}: no entry for engine worker(s) {missing}: no rank "
                            "of the slot publishes for them", [])
    names = {n for c in chunks.values() for n in c.names}
    nbytes = max((sum(c.tensor_sizes) for c in chunks.values()), default=0)
    return MergedChunk(index, entries, len(names), nbytes,  # type: ignore[arg-type]
                       msgspec.json.encode(entries))

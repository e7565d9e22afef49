"""Per-slot chunk aggregation: checks that every rank sent the same chunk and merges handles.

Pure functions, no I/O. A chunk goes to the engine only when every rank of the slot has sent
it, its names / dtypes / shapes / sizes agree across ranks, and the GPU UUIDs are distinct and
as many as the engine's world size (design.md I2): ``check_chunk``, for every engine family.
The merged form is the family's (``EngineFamily.merge``: vLLM's ``update_info``,
``daemon/vllm/merge.py``; SGLang's ``/update_weights_from_tensor`` body,
``daemon/sglang/merge.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slotsync.protocol.wire import Chunk, CudaIpcHandle, ShmHandle

SAME_CHUNKS_RULE = (
    "the ranks of a slot must publish the same tensors (names, dtypes and shapes) in the "
    "same order with the same staging_bytes"
)
"""Why ranks' chunks can differ; appended to the errors that point at it (design.md I2)."""


class ChunkMismatch(ValueError):
    """Ranks of one slot disagree on a chunk, or a chunk cannot be merged.

    ``ranks`` names the ranks whose copy differs from the slot coordinator's (or is bad).
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


@dataclass(frozen=True, slots=True)
class MergedChunk:
    """One chunk ready for vLLM's ``/update_weights``: ``update_info`` is the JSON body's value
    (``names``, ``dtype_names``, ``shapes``, packed: ``tensor_sizes``, and
    ``ipc_handles_pickled``); ``nbytes`` is the tensor bytes of one rank's copy.

    ``ipc_handles_pickled`` holds the pickle's raw ``bytes``, not yet base64 text: msgspec's
    JSON encoder (``VllmClient``) writes ``bytes`` as standard base64 with padding, exactly
    the string vLLM base64-decodes, in one C pass instead of ``base64`` + a copy into the JSON
    (see BENCHMARKS.md). Encode it with ``msgspec.json``
    (or apply ``vllm/ipc_pickle.py``'s ``b64`` first) anywhere else.

    ``update_info_json`` is that JSON text, made when the chunk is merged -- while the engine
    still loads the chunk before -- so that sending it costs no encoding (the coordinator
    sends it as ``msgspec.Raw``)."""

    index: int
    update_info: dict | list  # a list: rank-local mode, one entry per worker (rank_local.py)
    num_tensors: int
    nbytes: int
    update_info_json: bytes = b""


def check_chunk(
    index: int,
    chunks: Mapping[int, Chunk],
    uuid_of_rank: Mapping[int, str],
    *,
    packed: bool,
    transport: str,
    world_size: int,
) -> Chunk:
    """Validate one chunk across the ranks of a slot, for any engine family; returns the
    lowest rank's chunk, which every other rank's agrees with.

    Args:
        index: the chunk index (for messages).
        chunks: rank -> that rank's ``Chunk`` message; must hold every rank of the slot.
        uuid_of_rank: rank -> GPU UUID (torch format) from registration.
        packed: packed transfer (one uint8 buffer handle per rank) or unpacked.
        transport: ``"cuda"`` or ``"shm"``: the handle kind every rank must send.
        world_size: the engine's ``/get_world_size``: the number of GPU UUIDs required.

    Raises:
        ChunkMismatch: a rank's names, dtypes, shapes or sizes differ from the lowest rank's,
            a handle of the wrong kind or count, duplicate UUIDs, or a UUID count other than
            ``world_size``. The message names the first differing tensor and the ranks.
    """
    ranks = sorted(chunks)
    ref_rank = ranks[0]
    ref = chunks[ref_rank]
    for field in ("names", "dtype_names", "shapes", "tensor_sizes"):
        want = getattr(ref, field)
        bad = [r for r in ranks[1:] if getattr(chunks[r], field) != want]
        if bad:
            got = getattr(chunks[bad[0]], field)
            detail = _first_difference(ref.names, want, got)
            hint = f" ({SAME_CHUNKS_RULE})" if field == "names" else ""
            raise ChunkMismatch(
                f"chunk {index}: {field} of rank(s) {bad} differ from rank {ref_rank}'s: "
                f"{detail}{hint}",
                bad,
            )
    kind = CudaIpcHandle if transport == "cuda" else ShmHandle
    want_handles = 1 if packed else len(ref.names)
    for r in ranks:
        hs = chunks[r].handles
        if len(hs) != want_handles:
            mode = "packed" if packed else "unpacked"
            raise ChunkMismatch(
                f"chunk {index}: rank {r} sent {len(hs)} handles, {mode} mode needs {want_handles}",
                [r],
            )
        if not all(isinstance(h, kind) for h in hs):
            raise ChunkMismatch(
                f"chunk {index}: rank {r} sent a handle that is not of transport {transport!r}",
                [r],
            )
    uuids = [uuid_of_rank[r] for r in ranks]
    if len(set(uuids)) != len(uuids):
        dup = sorted({u for u in uuids if uuids.count(u) > 1})
        raise ChunkMismatch(f"chunk {index}: GPU UUIDs repeat across ranks: {dup}", ranks)
    if len(uuids) != world_size:
        raise ChunkMismatch(
            f"chunk {index}: {len(uuids)} GPU UUIDs but the engine's world size is {world_size}",
            ranks,
        )
    return ref


def _first_difference(names: Sequence[str], want: Sequence, got: Sequence) -> str:
    if len(want) != len(got):
        out = f"{len(got)} entries instead of {len(want)}"
        if want is names:  # the names themselves: say which one is missing or extra
            missing = [n for n in want if n not in set(got)]
            extra = [n for n in got if n not in set(want)]
            if missing:
                out += f" (without {missing[0]!r}" + (
                    f" and {len(missing) - 1} more)" if len(missing) > 1 else ")")
            elif extra:
                out += f" (with {extra[0]!r}, which the lowest rank's chunk lacks)"
        return out
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:
            name = names[i] if i < len(names) else f"#{i}"
            return f"tensor {name!r}: {b!r} instead of {a!r}"
    return "differs"

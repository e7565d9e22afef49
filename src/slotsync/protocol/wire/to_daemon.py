"""The messages a rank sends the daemon: ``Register``, ``Begin``, ``Chunk`` (and
``OutgoingChunk``, the publisher's unchecked build of one), ``Commit``, ``Abort``, ``Query`` and
``Close``, each with the rules across its fields (``__post_init__``, run while decoding).

Pure Python, no torch (the daemon imports it, design.md I6); imports ``fields`` and ``handles``.
"""

from __future__ import annotations

import math
import operator
from typing import Annotated, Literal

import msgspec

from slotsync.protocol.wire.adapter import AdapterBegin, AdapterData
from slotsync.protocol.wire.fields import (
    DTYPE_SIZES,
    MAX_VERSION_CHARS,
    Dims,
    DtypeName,
    FieldError,
    Name,
    NonNeg,
    Pos,
    ShortStr,
    check_engine_url,
    normalize_gpu_uuid,
)
from slotsync.protocol.wire.handles import Handle


class Register(msgspec.Struct, tag="register", forbid_unknown_fields=True):
    """First message of a rank's connection: who it is and which engine slot it feeds.

    ``slot_start``/``slot_size`` give the engine slot ``[start, start + size)`` in global-rank
    space; every rank of the slot must name the same slot, engine URL, mode and transport.
    """

    protocol_version: int
    rank: NonNeg
    gpu_uuid: str  # normalized to torch's format on decode
    slot_start: NonNeg
    slot_size: Pos
    engine_url: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    packed: bool
    transport: Literal["cuda", "shm"]
    hostname: ShortStr = ""
    pid: NonNeg = 0

    def __post_init__(self) -> None:
        try:
            self.gpu_uuid = normalize_gpu_uuid(self.gpu_uuid)
        except ValueError as e:
            raise FieldError("gpu_uuid", str(e)) from None
        try:
            check_engine_url(self.engine_url)
        except ValueError as e:
            raise FieldError("engine_url", f"engine_url {e}") from None
        if not (self.slot_start <= self.rank < self.slot_start + self.slot_size):
            raise FieldError(
                "rank", f"rank {self.rank} is outside its own slot "
                f"[{self.slot_start}, {self.slot_start + self.slot_size})"
            )
        if self.slot_size > 4096:
            raise FieldError("slot_size", f"slot_size {self.slot_size} is implausibly large")


class Begin(msgspec.Struct, tag="begin", forbid_unknown_fields=True, omit_defaults=True):
    """Start of one update (one round) for the rank's slot. ``weight_version`` is the string
    given to vLLM's ``/finish_weight_update`` on success (recorded only then, I8).

    ``manifest`` (optional, empty for none; ``manifest.manifest_of``): a digest of each
    tensor's name, dtype and shape the rank will send, in order, ``manifest.DIGEST_BYTES``
    each. The daemon compares the manifests of a slot's ranks as their begins arrive -- all
    of them before the pause -- so ranks that would send different tensors are refused before
    the engine is paused (design.md I2), naming the first position where they part
    (``Error.tensor_index``). Omitted from the message when empty.

    ``draft`` (issue 18): the round has a draft-model part -- chunks with ``Chunk.draft``
    after every main chunk, loaded in a second session (vLLM's
    ``/start_draft_weight_update``) once the main one finished. Every rank of a slot must
    agree on it (else the update is refused before the pause, naming the ranks). Omitted
    from the message when False, so a round without a draft part is encoded as before.

    ``staging_bytes`` (issue 24): the publisher's chunk limit in bytes
    (``Publisher(staging_bytes=...)``), which decides where its chunks are cut. Outside
    rank-local mode every rank of a slot must declare the same one, or the update is refused
    before the pause naming the setting, both values and the ranks
    (``daemon/core/begin_agreement.py``). A publisher declares it only to a daemon that lists it
    in ``Registered.begin_settings``; 0 (omitted): not declared, not compared."""

    update_id: NonNeg
    weight_version: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_VERSION_CHARS)]
    manifest: bytes = b""
    draft: bool = False
    staging_bytes: NonNeg = 0
    # Rank-local mode (issue 18, docs/rank-local.md): this rank sends its own tensors (its
    # experts and the shared ones) for engine worker ``worker_rank`` (global worker index,
    # vLLM's ``dp_index * TP * PP + rank``) and declares them here in clear, in send order,
    # so that the daemon checks, before the pause, that a name several ranks send agrees in
    # dtype and shape. All omitted (and the wire unchanged) outside rank-local mode.
    rank_local: bool = False
    worker_rank: int = -1
    names: Annotated[list[Name], msgspec.Meta(max_length=1_000_000)] = []
    dtype_names: list[DtypeName] = []
    shapes: list[Dims] = []

    def __post_init__(self) -> None:
        if len(self.manifest) % 4:
            raise FieldError("manifest", f"manifest has {len(self.manifest)} bytes, not a "
                             "multiple of 4")
        if not self.rank_local:
            if self.worker_rank != -1 or self.names or self.dtype_names or self.shapes:
                raise FieldError("worker_rank", "worker_rank and the tensor list (names, "
                                 "dtype_names, shapes) belong to rank-local mode (rank_local=true)")
            return
        if self.manifest:
            raise FieldError("manifest", "a rank-local begin declares its tensors in names, "
                             "dtype_names and shapes: its manifest must be empty")
        if self.worker_rank < 0:
            raise FieldError("worker_rank", f"rank-local begin: worker_rank must be >= 0, got "
                             f"{self.worker_rank}")
        n = len(self.names)
        if not n:
            raise FieldError("names", "rank-local begin declares no tensor (names is empty)")
        for field in ("dtype_names", "shapes"):
            if len(getattr(self, field)) != n:
                raise FieldError(field, f"rank-local begin: {field} has "
                                 f"{len(getattr(self, field))} entries, names has {n}")
        if len(set(self.names)) != n:
            raise FieldError("names", "rank-local begin: a tensor name repeats in names")


class Chunk(msgspec.Struct, tag="chunk", forbid_unknown_fields=True, omit_defaults=True):
    """One chunk of one rank: metadata for ``names`` and the handle(s) to the rank's copy.

    Packed: ``handles`` holds one handle to a uint8 buffer with the tensors back to back from
    the handle's start; ``tensor_sizes[i]`` is tensor i's bytes (vLLM packed layout).
    Unpacked: ``handles[i]`` is tensor i's own handle. ``tensor_sizes`` is sent in both modes
    so that the daemon can check that ranks agree.

    ``draft`` (issue 18): the chunk belongs to the round's draft-model part (its ``Begin``
    declared one); draft chunks come after every main chunk. Omitted when False.
    """

    update_id: NonNeg
    index: NonNeg
    names: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=1_000_000)]
    dtype_names: list[DtypeName]
    shapes: list[Dims]
    tensor_sizes: list[NonNeg]
    handles: list[Handle]
    draft: bool = False

    def __post_init__(self) -> None:
        n = len(self.names)
        for field in ("dtype_names", "shapes", "tensor_sizes"):
            if len(getattr(self, field)) != n:
                raise FieldError(field, f"{field} has {len(getattr(self, field))} entries, "
                                 f"names has {n}")
        # Every tensor's bytes from its shape and dtype, in C loops (``map``): this runs for
        # every rank's copy of every chunk on the daemon's one event loop. Decoding has
        # checked the dtype names already; a Chunk built in Python has not, hence KeyError.
        try:
            elem = list(map(DTYPE_SIZES.__getitem__, self.dtype_names))
        except KeyError as e:
            bad = self.dtype_names.index(e.args[0])
            raise FieldError(
                "dtype_names", f"tensor {self.names[bad]!r}: unsupported dtype {e.args[0]!r}"
            ) from None
        want = list(map(operator.mul, map(math.prod, self.shapes), elem))
        if want != self.tensor_sizes:
            i = next(i for i, (a, b) in enumerate(zip(want, self.tensor_sizes, strict=True))
                     if a != b)
            raise FieldError(
                "tensor_sizes", f"tensor {self.names[i]!r}: tensor_sizes says "
                f"{self.tensor_sizes[i]} bytes but shape {self.shapes[i]} of "
                f"{self.dtype_names[i]} is {want[i]} bytes"
            )
        if len(set(self.names)) != n:
            raise FieldError("names", "duplicate tensor names in one chunk")
        problem = handles_problem(self.handles, n, sum(self.tensor_sizes))
        if problem:
            raise FieldError("handles", problem)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this chunk describes."""
        return sum(self.tensor_sizes)


def handles_problem(handles: list[Handle], n: int, total: int) -> str:
    """What is wrong with a chunk's handles for ``n`` tensors of ``total`` bytes, or ''."""
    if not handles:
        return "chunk carries no handle"
    if len(handles) == 1 and n > 1:  # packed: one buffer must hold every tensor
        have = handles[0].nbytes
        if have < total:
            return f"packed buffer handle covers {have} bytes, chunk needs {total}"
    elif len(handles) != n:
        return f"{len(handles)} handles for {n} tensors"
    return ""


class OutgoingChunk(msgspec.Struct, tag="chunk", omit_defaults=True):
    """A ``Chunk`` as a publisher builds it from a layout it made itself: the same fields,
    encoded to the same bytes, without ``Chunk.__post_init__``'s checks (their cost: BENCHMARKS.md).
    The daemon decodes it as a ``Chunk``, checks
    included."""

    update_id: int
    index: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    tensor_sizes: list[int]
    handles: list[Handle]
    draft: bool = False


class Commit(msgspec.Struct, tag="commit", forbid_unknown_fields=True):
    """End of the rank's chunks for ``update_id``: ``num_chunks`` chunks were sent (0..n-1)."""

    update_id: NonNeg
    num_chunks: NonNeg


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    """The rank gives up on ``update_id``; the slot's update fails (engine stays paused, I4)."""

    update_id: NonNeg
    reason: ShortStr = ""


class Query(msgspec.Struct, tag="query", forbid_unknown_fields=True):
    """The rank asks what the daemon is waiting for (a publisher whose own wait for
    ``update_id`` expired, issue 24); answered with ``Waiting``. It changes nothing. An older
    daemon answers it with a non-fatal ``Error(phase="decode")``."""

    update_id: NonNeg | None = None


class Close(msgspec.Struct, tag="close", forbid_unknown_fields=True):
    """The rank's publisher closes its connection on purpose (``Publisher.close()``, or its
    finalizer): the daemon counts the rank gone at once and says so, instead of guessing why
    the connection closed (issue 24). ``reason``: why, for the log."""

    reason: ShortStr = ""


ToDaemon = (Register | Begin | Chunk | Commit | Abort | Query | Close | AdapterBegin
            | AdapterData)

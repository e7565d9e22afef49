"""The slotsync wire protocol: typed, versioned messages between trainer ranks and the daemon.

Transport: one ZeroMQ DEALER socket per rank, connected to the daemon's ROUTER socket (an
``ipc://`` path on the node). Each ZeroMQ message carries exactly one frame: a msgpack map
encoded from one of the message structs below, tagged by its ``type`` field. Handle records
(``CudaIpcHandle``, ``ShmHandle``) inside a ``Chunk`` are msgpack *arrays* instead: the tag
(``"cuda"`` / ``"shm"``) first, then the fields in declaration order (protocol version 2: an
unpacked chunk carries one record per tensor per rank, and without the 15 keys an unpacked
Qwen3-30B-A3B chunk's frame shrinks from 86 to 51 kB per rank and decodes faster). Nothing
on the wire is pickled (design.md I6); the daemon builds vLLM's pickled handle list itself
from the typed handle records.

Conversation of one rank (design.md "Flow of one round")::

    rank -> daemon                          daemon -> rank
    Register(protocol_version, rank, ...)   Registered | Error(phase="register")
    Begin(update_id, weight_version, ...)   Ack(phase="begin")  once the engine's update started
    Chunk(update_id, index, ...) x N        Ack(phase="chunk", index) once the engine consumed it
    Commit(update_id, num_chunks)           Ack(phase="commit") once finish + resume returned
    Abort(update_id, reason)                (the slot's update fails; every rank gets an Error)

Any failure of the slot's update reaches every rank of the slot as one ``Error`` naming the
phase, the slot, the update id and what was missing.

All validation of decoded input happens here, so the daemon's core only ever sees well-formed
messages: types, ranges, lengths and allow-lists (``Literal``) are checked by msgspec itself
while decoding, in C; rules across fields run in ``__post_init__`` (msgspec turns a raised
``ValueError`` into ``msgspec.ValidationError``). Either way the error names the field, e.g.
``Invalid enum value 'object' - at `$.handles[0][6]``` (array fields are named by position,
the tag counting as element 0; ``decode_to_daemon`` appends the record kind and the field's
name: ``(CudaIpcHandle field 'dtype')``).

This file is longer than our ~500-line rule on purpose: it holds one thing, the wire schema,
and keeping every message and every check in one place is what makes "validated in one
place" true (vLLM ``distributed/weight_transfer/`` keeps its messages the same way).
"""

from __future__ import annotations

import copy
import math
import operator
import re
import uuid as uuidlib
from typing import Annotated, Literal, get_args

import msgspec

PROTOCOL_VERSION = 2
"""Bumped on any incompatible change of the messages below; checked at registration (whose
message keeps its layout across versions, so a rank of another version is told so plainly).
History: 1, handle records as maps; 2, handle records as arrays (``array_like``)."""

MAX_MESSAGE_BYTES_DEFAULT = 64 * 1024 * 1024
"""Default cap on one decoded frame, in bytes (the daemon's ``max_message_bytes`` option)."""

DtypeName = Literal[
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "int64",
    "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
]
"""Torch dtype names as vLLM's ``dtype_names`` spells them (``str(t.dtype).split(".")[-1]``);
as a ``Literal``, msgspec checks the allow-list while decoding."""

# The same names with their element sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,  # MX block scales (DeepSeek-V4 refits send them: verl)
    "float4_e2m1fn_x2": 1,  # two fp4 values per byte (NVFP4/MXFP4 weights)
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}
assert set(get_args(DtypeName)) == set(DTYPE_SIZES)

# Classes that may appear in a CUDA IPC handle record. The daemon writes these as pickle
# globals; restricting them to an allow-list keeps producer strings from naming arbitrary code.
TENSOR_CLASSES = ("torch.Tensor", "torch.nn.parameter.Parameter")
STORAGE_CLASSES = ("torch.storage.TypedStorage", "torch.storage.UntypedStorage")

_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_LOGICAL_NS = uuidlib.UUID("6f1c2a52-8d1e-4c8b-9a59-1d3f2f4b7a10")
_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(gt=0)]
MAX_VERSION_CHARS = 256
"""Longest weight version a Begin carries (characters)."""
HandleBytes = Annotated[bytes, msgspec.Meta(min_length=1, max_length=256)]
ShortStr = Annotated[str, msgspec.Meta(max_length=1024)]
MAX_NAME_CHARS = 1024
"""Longest tensor name the wire carries, in characters."""

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
MAX_DIMS = 64
"""Most dimensions of a tensor's shape on the wire."""
Dims = Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_DIMS)]
TupleDims = Annotated[tuple[NonNeg, ...], msgspec.Meta(max_length=MAX_DIMS)]  # hashable records


class ProtocolError(ValueError):
    """A frame that is not a valid message: over the size cap, not msgpack, not one of the
    messages, wrong types, or a broken rule. Where the frame tells, ``kind`` is the message's
    ``type`` tag (``"chunk"``), ``field`` the field at fault (msgspec's path without ``$.``:
    ``"names"``, ``"handles[0]"``; '' unknown) and ``update_id`` the update it names (None
    unknown): the daemon names them when it fails a registered rank's update (issue 24)."""

    def __init__(self, message: str, kind: str = "", field: str = "",
                 update_id: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.field, self.update_id = kind, field, update_id


class FieldError(ValueError):
    """A rule across fields that ``field`` breaks, raised in a message's ``__post_init__``
    (msgspec turns it into its ``ValidationError``, this as the cause): ``decode_to_daemon``
    names the field in its ``ProtocolError``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def normalize_gpu_uuid(uuid: str) -> str:
    """Return a GPU UUID in torch's format: 36 lowercase hex-and-dash chars, no ``GPU-``.

    ``nvidia-smi -L`` and NVML print ``GPU-xxxxxxxx-...``; torch's
    ``str(torch.cuda.get_device_properties(i).uuid)`` and vLLM's handle dict keys omit the
    prefix (vllm-contract.md "update_info for the IPC backend").

    Raises:
        ValueError: the string is not a GPU UUID in either spelling.
    """
    u = uuid.strip()
    if u[:4].upper() == "GPU-":
        u = u[4:]
    u = u.lower()
    if not _UUID_RE.match(u):
        raise ValueError(f"not a GPU UUID: {uuid!r} (want 8-4-4-4-12 hex digits, 'GPU-' optional)")
    return u


def logical_gpu_uuid(index: int) -> str:
    """A stable, made-up GPU UUID for logical GPU ``index`` (torch format).

    Used where no real GPU UUID exists (CPU shared-memory transport) and, by explicit
    override, where several logical GPUs share one physical GPU in tests: the publisher
    (``gpu_uuid=``) and the reference engine (``--gpu-uuids``) must then name the same ones.
    Default pairing: publisher rank ``r`` of slot ``[s, e)`` ↔ engine worker ``r - s``.
    """
    return str(uuidlib.uuid5(_LOGICAL_NS, f"slotsync-logical-gpu-{index}"))


def check_engine_url(url: str) -> None:
    """Raises ValueError unless ``url`` is ``http://host:port``, ``https://...`` or
    ``unix:///path`` (``vllm serve --uds``), without whitespace."""
    if not url.startswith(("http://", "https://", "unix:///")) or any(c.isspace() for c in url):
        raise ValueError(f"{url!r} must be http://host:port, https://... or unix:///path/to.sock")


# --------------------------------------------------------------------------------------------
# Handle records
# --------------------------------------------------------------------------------------------


class CudaIpcHandle(
    msgspec.Struct, tag="cuda", frozen=True, forbid_unknown_fields=True, array_like=True,
    gc=False,
):
    """The 15 fields of ``torch.multiprocessing.reductions.reduce_tensor(t)[1]`` for a CUDA
    tensor, as typed data (no pickle). The daemon re-creates vLLM's argument tuple from them.

    Field order and meaning follow ``rebuild_cuda_tensor`` (torch 2.x); vLLM overwrites
    ``device`` with the receiving worker's own device index (vllm-contract.md).

    On the wire: a 16-element msgpack array, ``["cuda", tensor_class, size, ...,
    event_sync_required]`` (``array_like``). Classes and ``dtype`` are checked against the
    allow-lists by msgspec while decoding; ``__post_init__`` checks that ``size`` and
    ``stride`` have as many dims. ``gc=False``: the fields are atoms and tuples of ints, so a
    record can never be part of a reference cycle, and the garbage collector need not track
    the thousands an unpacked round decodes.
    """

    tensor_class: Literal["torch.Tensor", "torch.nn.parameter.Parameter"]
    size: TupleDims
    stride: TupleDims
    storage_offset: NonNeg  # in elements
    storage_class: Literal["torch.storage.TypedStorage", "torch.storage.UntypedStorage"]
    dtype: DtypeName
    device: NonNeg
    ipc_handle: HandleBytes  # cudaIpcMemHandle (+ torch's framing)
    storage_size_bytes: NonNeg
    storage_offset_bytes: NonNeg
    requires_grad: bool
    ref_counter_handle: HandleBytes
    ref_counter_offset: NonNeg
    event_handle: HandleBytes | None
    event_sync_required: bool

    def __post_init__(self) -> None:
        if len(self.size) != len(self.stride):
            raise FieldError(
                "stride", f"size has {len(self.size)} dims but stride has {len(self.stride)}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's own elements (contiguous view)."""
        n = 1
        for d in self.size:
            n *= d
        return n * DTYPE_SIZES[self.dtype]


class ShmHandle(
    msgspec.Struct, tag="shm", frozen=True, forbid_unknown_fields=True, array_like=True,
    gc=False,
):
    """A CPU stand-in for a CUDA IPC handle: bytes ``[offset, offset + nbytes)`` of the POSIX
    shared-memory segment ``/dev/shm/<segment>``. Lets the whole path run without a GPU; only
    the reference engine understands it (vLLM does not).

    On the wire: ``["shm", segment, offset, nbytes]`` (``array_like``, as ``CudaIpcHandle``).
    """

    segment: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    offset: NonNeg  # bytes
    nbytes: NonNeg  # bytes

    def __post_init__(self) -> None:
        if not _SHM_NAME_RE.match(self.segment):
            raise FieldError("segment", f"bad shared-memory segment name {self.segment!r}")


Handle = CudaIpcHandle | ShmHandle

# --------------------------------------------------------------------------------------------
# rank -> daemon
# --------------------------------------------------------------------------------------------


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
        problem = _handles_problem(self.handles, n, sum(self.tensor_sizes))
        if problem:
            raise FieldError("handles", problem)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this chunk describes."""
        return sum(self.tensor_sizes)


def _handles_problem(handles: list[Handle], n: int, total: int) -> str:
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


class _ChunkWithRawLists(msgspec.Struct, tag="chunk", forbid_unknown_fields=True):
    """A ``Chunk`` whose four lists stay encoded (``msgspec.Raw`` only finds where each ends):
    see ``ChunkMetaCache``."""

    update_id: NonNeg
    index: NonNeg
    names: msgspec.Raw
    dtype_names: msgspec.Raw
    shapes: msgspec.Raw
    tensor_sizes: msgspec.Raw
    handles: list[Handle]
    draft: bool = False

    def key(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (bytes(self.names), bytes(self.dtype_names), bytes(self.shapes),
                bytes(self.tensor_sizes))


class ChunkMetaCache:
    """Chunk lists already decoded and checked, keyed by their encoded bytes.

    Every round, every rank of a slot sends the same chunks: the same names, dtypes, shapes and
    sizes, byte for byte; only the update id, index and handles change. A frame whose four
    lists are bytes already seen is decoded with those lists left encoded, and gets the
    checked lists of the earlier ``Chunk`` (shared, never modified; the saving is in
    BENCHMARKS.md). Anything else is decoded and checked in full.

    Args:
        max_entries: distinct chunks kept (a round of Qwen3-30B-A3B in 512 MiB chunks has 114);
            over it, the cache starts afresh.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._chunks: dict[tuple[bytes, bytes, bytes, bytes], tuple[Chunk, int]] = {}
        self.hits = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def lookup(self, msg: _ChunkWithRawLists) -> Chunk | None:
        """The ``Chunk`` of ``msg``, from the checked lists of an earlier one, or None when
        its lists are new or its handles do not fit them (the caller decodes in full)."""
        seen = self._chunks.get(msg.key())
        if seen is None or _handles_problem(msg.handles, len(seen[0].names), seen[1]):
            return None
        self.hits += 1
        chunk = copy.copy(seen[0])  # (no __post_init__: its lists passed it already)
        chunk.update_id, chunk.index, chunk.handles = msg.update_id, msg.index, msg.handles
        chunk.draft = msg.draft
        return chunk

    def remember(self, msg: _ChunkWithRawLists, chunk: Chunk) -> None:
        """Keep the lists of ``chunk``, decoded and checked in full from ``msg``'s frame."""
        if len(self._chunks) >= self.max_entries:
            self._chunks.clear()
        self._chunks[msg.key()] = (copy.copy(chunk), sum(chunk.tensor_sizes))


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


ToDaemon = Register | Begin | Chunk | Commit | Abort | Query | Close

# --------------------------------------------------------------------------------------------
# daemon -> rank
# --------------------------------------------------------------------------------------------

Phase = Literal["register", "begin", "chunk", "commit", "abort", "engine"]


class Registered(msgspec.Struct, tag="registered"):
    """Registration accepted. ``next_update_id`` is the lowest update id the daemon will take
    for this slot (ids of earlier rounds are stale, I7)."""

    rank: int
    slot_start: int
    slot_size: int
    next_update_id: int
    protocol_version: int = PROTOCOL_VERSION
    daemon_version: str = ""
    max_message_bytes: int = 0  # the daemon's frame cap (0: unknown); publishers check it
    # the daemon's deadlines on the slot's ranks, seconds (0: not told): a publisher whose
    # timeout_s is shorter would give up before the daemon says what is missing (issue 24)
    begin_deadline_s: float = 0.0
    chunk_deadline_s: float = 0.0
    # the Begin settings this daemon compares across a slot's ranks (issue 24,
    # daemon/core/begin_agreement.py SETTINGS): a publisher declares only these in its Begin, so
    # that a daemon older than it never sees a field it does not know
    begin_settings: list[str] = []
    # the node whose daemon drives the slot's engine (issue 25: for an engine over several
    # nodes, another node's than the rank's own; '' from an older daemon)
    node: str = ""


MAX_OMITTED_NAMES = 64
"""Most names an ``Ack(commit)`` lists in ``omitted_names`` (``omitted_count`` has them all)."""


class Ack(msgspec.Struct, tag="ack"):
    """A step of ``update_id`` is done. ``phase="chunk"``: chunk ``index`` was consumed by the
    engine and the rank may reuse its packed buffer (I3). ``phase="commit"``: finish and
    resume returned; the rank may free every exported tensor and call ``ipc_collect``.

    Commit acks also say what the update left out: ``omitted_count`` tensor names that the
    slot's previous successful update loaded and this one did not (the engine keeps their old
    values; the first ``MAX_OMITTED_NAMES`` of them, sorted, in ``omitted_names``), and
    ``resumed``: False when the daemon left the engine paused because it found it sleeping or
    paused by someone else at the begin (vLLM resumes it at its full ``/wake_up``)."""

    update_id: int
    phase: Literal["begin", "chunk", "commit"]
    index: int = -1
    seconds: float = 0.0
    omitted_names: list[str] = []
    omitted_count: int = 0
    resumed: bool = True


class Error(msgspec.Struct, tag="error"):
    """The daemon refused a message or the slot's update failed.

    ``slot`` is ``[start, end)`` (empty before the rank's slot is known); ``missing_ranks``
    names the ranks the daemon was still waiting for when a deadline expired (I5).
    """

    phase: str
    message: str
    slot: list[int] = []
    update_id: int | None = None
    missing_ranks: list[int] = []
    fatal: bool = True
    code: str = ""  # machine-readable reason where a peer acts on it: "not_registered"
    # ranks' begin manifests part at this tensor position (send order; -1: not that error)
    tensor_index: int = -1


NOT_REGISTERED = "not_registered"
"""``Error.code`` for a message from a connection the daemon does not know (e.g. after a
daemon restart): the publisher registers again."""

RANK_HELD = "rank_held"
"""``Error.code`` for a registration of a rank that another live process holds: the publisher
retries for up to its ``liveness_s`` (a restarted rank's old process may still be closing
its connection), then raises naming both processes."""

class Waiting(msgspec.Struct, tag="waiting"):
    """The answer to ``Query``: what the daemon is waiting for in the slot's update
    ``update_id`` (None: none in flight), in words (``text``, e.g. "slotsyncd is waiting for
    the begin of rank(s) 2, 3 of slot [0, 4) (update 5); its begin deadline is 60 s, 41 s
    left"), and as data: ``phase`` (``begin``, ``chunk``, ``commit``, ``rank_gone``,
    ``engine``, or '' for no wait), ``missing_ranks`` and the deadline ``deadline_s`` with
    ``left_s`` of it left (seconds; 0: none)."""

    update_id: int | None
    text: str
    phase: str = ""
    missing_ranks: list[int] = []
    deadline_s: float = 0.0
    left_s: float = 0.0


FromDaemon = Registered | Ack | Error | Waiting

# --------------------------------------------------------------------------------------------
# codec
# --------------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_to_daemon = msgspec.msgpack.Decoder(ToDaemon)
_to_daemon_raw_lists = msgspec.msgpack.Decoder(
    Register | Begin | _ChunkWithRawLists | Commit | Abort | Query | Close)
_from_daemon = msgspec.msgpack.Decoder(FromDaemon)


def encode(msg: ToDaemon | OutgoingChunk | FromDaemon) -> bytes:
    """Encode one message as one msgpack frame."""
    return _encoder.encode(msg)


def decode_to_daemon(frame: bytes, max_bytes: int = MAX_MESSAGE_BYTES_DEFAULT,
                     cache: ChunkMetaCache | None = None) -> ToDaemon:
    """Decode and validate one frame a rank sent. With ``cache``, a ``Chunk`` whose lists
    were seen before reuses their decoded, checked form (``ChunkMetaCache``); the result and
    the errors are the same.

    Raises:
        ProtocolError: the frame is over ``max_bytes``, not msgpack, not one of the
            messages, has wrong types or breaks a rule checked in ``__post_init__``; the text
            names the field.
    """
    if len(frame) > max_bytes:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the {max_bytes}-byte cap")
    raw = None
    if cache is not None:
        try:
            msg = _to_daemon_raw_lists.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            msg = None  # the full decode below reports what is wrong
        if isinstance(msg, _ChunkWithRawLists):
            chunk = cache.lookup(msg)
            if chunk is not None:
                return chunk
            raw = msg
        elif msg is not None:
            return msg  # the same message types as the full decode, checked alike
    try:
        decoded = _to_daemon.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
        # UnicodeDecodeError: msgspec lets invalid UTF-8 in a tag through (found by fuzzing)
        raise ProtocolError(f"bad message: {e}{_handle_field_hint(str(e), frame)}",
                            *_where(e, frame)) from None
    if raw is not None and cache is not None and isinstance(decoded, Chunk):
        cache.remember(raw, decoded)
    return decoded


_FIELD_PATH = re.compile(r" - at `\$\.([^`]*)`")


def _where(error: Exception, frame: bytes) -> tuple[str, str, int | None]:
    """``(kind, field, update_id)`` of a frame that failed to decode (``ProtocolError``), as
    far as the frame tells (msgpack read without a schema). Only runs on the error path."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except Exception:  # noqa: BLE001 -- not msgpack: nothing to tell
        raw = None
    kind = raw.get("type") if isinstance(raw, dict) else None
    uid = raw.get("update_id") if isinstance(raw, dict) else None
    m = _FIELD_PATH.search(str(error))
    field = m[1] if m else ""
    cause = error.__cause__
    if isinstance(cause, FieldError):
        field = f"{field}.{cause.field}" if field else cause.field
    return (kind if isinstance(kind, str) and kind.isidentifier() else "", field,
            uid if isinstance(uid, int) and not isinstance(uid, bool) and uid >= 0 else None)


_HANDLE_PATH = re.compile(r"`\$\.handles\[(\d+)\]\[(\d+)\]")
_HANDLE_FIELDS = {
    cls.__struct_config__.tag: (cls.__name__, cls.__struct_fields__)
    for cls in (CudaIpcHandle, ShmHandle)
}


def _handle_field_hint(error: str, frame: bytes) -> str:
    """A hint for an error inside a handle record, else ``""``. Records are arrays on the
    wire, so msgspec names a position (``$.handles[3][6]``); the hint adds the record kind
    and the field's name, e.g. `` (CudaIpcHandle field 'dtype')``. A record sent as a map
    (protocol version 1) gets a hint saying so. Only runs on the error path."""
    if "got `object` - at `$.handles[" in error:
        return f" (handle records are arrays since protocol version {PROTOCOL_VERSION})"
    m = _HANDLE_PATH.search(error)
    if m is None:
        return ""
    i, k = int(m[1]), int(m[2])
    if k == 0:
        return f" (the record's tag: one of {sorted(_HANDLE_FIELDS)})"
    try:
        name, fields = _HANDLE_FIELDS[msgspec.msgpack.decode(frame)["handles"][i][0]]
    except Exception:  # noqa: BLE001 -- a hint only: the frame is bad in another way too
        return ""
    return f" ({name} field {fields[k - 1]!r})" if k - 1 < len(fields) else ""


def decode_from_daemon(frame: bytes) -> FromDaemon:
    """Decode one frame the daemon sent (publisher side).

    Raises:
        ProtocolError: the frame is not a daemon reply.
    """
    try:
        return _from_daemon.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
        raise ProtocolError(f"bad reply from daemon: {e}") from None

"""The slotsync wire protocol: typed, versioned messages between trainer ranks and the daemon.

Transport: one ZeroMQ DEALER socket per rank, connected to the daemon's ROUTER socket (an
``ipc://`` path on the node). Each ZeroMQ message carries exactly one frame: a msgpack map
encoded from one of the message structs, tagged by its ``type`` field. Handle records
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

All validation of decoded input happens in this package, so the daemon's core only ever sees
well-formed messages: types, ranges, lengths and allow-lists (``Literal``) are checked by
msgspec itself while decoding, in C; rules across fields run in ``__post_init__`` (msgspec
turns a raised ``ValueError`` into ``msgspec.ValidationError``). Either way the error names the
field, e.g. ``Invalid enum value 'object' - at `$.handles[0][6]``` (array fields are named by
position, the tag counting as element 0; ``decode_to_daemon`` appends the record kind and the
field's name: ``(CudaIpcHandle field 'dtype')``).

The schema is a package, one module per part (``from slotsync.protocol.wire import X`` and
``wire.X`` name every one of their names, as when it was one module):

* ``fields``: protocol version, limits, dtype and class allow-lists, the constrained field
  types, ``ProtocolError`` / ``FieldError``, GPU UUIDs;
* ``handles``: the handle records ``CudaIpcHandle`` and ``ShmHandle``;
* ``to_daemon``: ``Register``, ``Begin``, ``Chunk``, ``OutgoingChunk``, ``Commit``, ``Abort``,
  ``Query``, ``Close``;
* ``from_daemon``: ``Registered``, ``Ack``, ``Error``, ``Waiting``;
* ``adapter``: ``AdapterBegin``, ``AdapterData``, ``AdapterTensor`` (adapter rounds, issue 36);
* ``codec``: ``encode``, ``decode_to_daemon`` (with ``ChunkMetaCache``), ``decode_from_daemon``.

Each imports only the ones listed before it. Pure Python: msgspec, no torch, nothing of
``slotsync.protocol.rank`` (the daemon imports it; design.md I6).
"""

from __future__ import annotations

from slotsync.protocol.wire.adapter import (
    ADAPTER_ALIGN,
    AdapterBegin,
    AdapterData,
    AdapterTensor,
    part_offsets,
    served_name,
)
from slotsync.protocol.wire.codec import (
    ChunkMetaCache,
    decode_from_daemon,
    decode_to_daemon,
    encode,
)
from slotsync.protocol.wire.fields import (
    DTYPE_SIZES,
    MAX_DIMS,
    MAX_MESSAGE_BYTES_DEFAULT,
    MAX_NAME_CHARS,
    MAX_VERSION_CHARS,
    PROTOCOL_VERSION,
    STORAGE_CLASSES,
    TENSOR_CLASSES,
    Dims,
    DtypeName,
    FieldError,
    HandleBytes,
    Name,
    NonNeg,
    Pos,
    ProtocolError,
    ShortStr,
    TupleDims,
    check_engine_url,
    logical_gpu_uuid,
    normalize_gpu_uuid,
)
from slotsync.protocol.wire.from_daemon import (
    MAX_OMITTED_NAMES,
    NOT_REGISTERED,
    RANK_HELD,
    Ack,
    Error,
    FromDaemon,
    Phase,
    Registered,
    Waiting,
)
from slotsync.protocol.wire.handles import (
    CudaIpcHandle,
    Handle,
    ShmHandle,
)
from slotsync.protocol.wire.to_daemon import (
    Abort,
    Begin,
    Chunk,
    Close,
    Commit,
    OutgoingChunk,
    Query,
    Register,
    ToDaemon,
)

__all__ = [
    "ADAPTER_ALIGN",
    "AdapterBegin",
    "AdapterData",
    "AdapterTensor",
    "part_offsets",
    "served_name",
    "Abort",
    "Ack",
    "Begin",
    "Chunk",
    "ChunkMetaCache",
    "Close",
    "Commit",
    "CudaIpcHandle",
    "DTYPE_SIZES",
    "Dims",
    "DtypeName",
    "Error",
    "FieldError",
    "FromDaemon",
    "Handle",
    "HandleBytes",
    "MAX_DIMS",
    "MAX_MESSAGE_BYTES_DEFAULT",
    "MAX_NAME_CHARS",
    "MAX_OMITTED_NAMES",
    "MAX_VERSION_CHARS",
    "NOT_REGISTERED",
    "Name",
    "NonNeg",
    "OutgoingChunk",
    "PROTOCOL_VERSION",
    "Phase",
    "Pos",
    "ProtocolError",
    "Query",
    "RANK_HELD",
    "Register",
    "Registered",
    "STORAGE_CLASSES",
    "ShmHandle",
    "ShortStr",
    "TENSOR_CLASSES",
    "ToDaemon",
    "TupleDims",
    "Waiting",
    "check_engine_url",
    "decode_from_daemon",
    "decode_to_daemon",
    "encode",
    "logical_gpu_uuid",
    "normalize_gpu_uuid",
]

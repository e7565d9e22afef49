"""Frames in and out: ``encode`` one message as one msgpack frame, ``decode_to_daemon`` (with
the size cap, ``ChunkMetaCache`` and errors that name the field) and ``decode_from_daemon``.

Pure Python, no torch (the daemon imports it, design.md I6); imports the other wire modules.
"""

from __future__ import annotations

import copy
import re

import msgspec

from slotsync.protocol.wire.adapter import AdapterBegin, AdapterData
from slotsync.protocol.wire.fields import (
    MAX_MESSAGE_BYTES_DEFAULT,
    PROTOCOL_VERSION,
    FieldError,
    NonNeg,
    ProtocolError,
)
from slotsync.protocol.wire.from_daemon import FromDaemon
from slotsync.protocol.wire.handles import CudaIpcHandle, Handle, ShmHandle
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
    handles_problem,
)


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
        if seen is None or handles_problem(msg.handles, len(seen[0].names), seen[1]):
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


_encoder = msgspec.msgpack.Encoder()
_to_daemon = msgspec.msgpack.Decoder(ToDaemon)
_to_daemon_raw_lists = msgspec.msgpack.Decoder(
    Register | Begin | _ChunkWithRawLists | Commit | Abort | Query | Close | AdapterBegin
    | AdapterData)
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

"""The wire's vocabulary: protocol version, limits, the dtype and class allow-lists, the
constrained field types every message uses, the errors a bad frame raises, and GPU UUIDs.

Pure Python, no torch (the daemon imports it, design.md I6); imports nothing of slotsync.
"""

from __future__ import annotations

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

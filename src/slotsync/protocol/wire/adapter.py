"""The messages of an adapter round (issue 36): ``AdapterBegin`` and ``AdapterData``, a rank's
part of one LoRA adapter, and ``AdapterTensor``, one tensor's part in it.

An adapter round takes the slot's next update id, as a base-weight round does (the two never
overlap on one engine). Each rank of the slot sends:

1. ``AdapterBegin``: the adapter's name, version and PEFT config, and the tensors of its part
   (names, dtypes, whole shapes, the rows of dim 0 it holds, a sha256 of the part's bytes).
   The daemon waits for every rank of the slot, checks that their parts tile each tensor
   exactly and that every engine of the slot can hold the adapter, and answers
   ``Ack(phase="adapter_begin", transport=...)`` -- or an ``Error`` before any engine call.
2. ``AdapterData``: one handle to the part's bytes, the tensors back to back in
   ``AdapterBegin.tensors`` order, each at the next multiple of :data:`ADAPTER_ALIGN` bytes
   (:func:`part_offsets`). ``transport="host"``: a ``ShmHandle`` (the rank copied its part
   into a POSIX shared-memory segment it owns: the daemon reads the bytes, vLLM's path);
   ``"device"``: the handle of the rank's registered transport (CUDA IPC on a GPU; the
   engine maps the rank's memory, SGLang's path).

A part of whole tensors may also be laid out as a complete ``adapter_model.safetensors``
file (:func:`file_header`): the segment starts with the safetensors header and the handle
covers the bytes after it, so the tensors are still at :func:`part_offsets` from the
handle's start (an older daemon reads them as any part) while a daemon that knows the header
can hard-link the segment as the file vLLM loads instead of copying it
(``daemon/vllm/adapters.py``). Nothing on the wire changes.

The daemon answers ``Ack(phase="adapter_data", served_name=...)`` once the adapter is
servable on every engine of the slot under ``served_name`` (:func:`served_name`); the rank
may then free its part. On an ``Error`` the previous version stays served.

Pure Python, no torch (the daemon imports it, design.md I6); imports ``fields`` and
``handles``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated

import msgspec

from slotsync.protocol.wire.fields import (
    DTYPE_SIZES,
    Dims,
    DtypeName,
    FieldError,
    Name,
    NonNeg,
)
from slotsync.protocol.wire.handles import Handle

ADAPTER_ALIGN = 256
"""Each tensor of a rank's part starts at a multiple of this many bytes from the handle's
start (a multiple of every dtype's itemsize, as SGLang's ``FlattenedTensorBucket`` views
need, and of CUDA's allocation granule for reads)."""

SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}
"""Wire dtype names -> the names a safetensors header spells them (safetensors 0.8
``torch.py`` ``_TYPES``); ``float8_e8m0fnu`` and ``float4_e2m1fn_x2`` have none that
``safe_open`` reads back."""

MAX_CONFIG_BYTES = 64 * 1024
"""Largest ``config_json`` (bytes of UTF-8): a PEFT ``adapter_config.json`` is ~1 KiB."""

MAX_ADAPTER_TENSORS = 100_000

_LORA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def served_name(lora_name: str, version: int) -> str:
    """The name an engine serves version ``version`` of adapter ``lora_name`` under, e.g.
    ``"math@v3"``: each version is a distinct adapter on the engine (a new LoRA id), so the
    new one loads beside the old one and requests name the version they want."""
    return f"{lora_name}@v{version}"


def part_offsets(tensors: list[AdapterTensor]) -> tuple[list[int], int]:
    """Byte offset of each tensor of a rank's part from its handle's start, and the part's
    total bytes (the last tensor's end): tensors back to back in order, each rounded up to
    :data:`ADAPTER_ALIGN`."""
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // ADAPTER_ALIGN) * ADAPTER_ALIGN
        offsets.append(start)
        end = start + t.nbytes
    return offsets, end


def file_header(tensors: Sequence[tuple[str, str, Sequence[int]]]) -> bytes | None:
    """The header of a part of whole tensors laid out as a complete safetensors file, or None
    when the part cannot be laid out so.

    ``tensors``: ``(name, wire dtype name, whole shape)`` of each tensor, in the part's order.
    The file is this header, then the tensors back to back in that order with no gap (the
    safetensors format allows none: ``data_offsets`` of each tensor start where the previous
    one ends, and the last ends at the end of the file). The header is an 8-byte
    little-endian length N, then N bytes of JSON ``{"__metadata__": {"format": "pt"}, name:
    {"dtype", "shape", "data_offsets"}, ...}`` padded with spaces so that ``8 + N`` is a
    multiple of :data:`ADAPTER_ALIGN` (JSON allows trailing spaces; the safetensors writer
    itself pads to 8): the data then starts aligned, and each tensor lies at its
    :func:`part_offsets` offset from the end of the header.

    None: no tensor; a dtype without a safetensors name (:data:`SAFETENSORS_DTYPES`); a
    tensor named ``__metadata__``; a tensor but the last whose bytes are not a multiple of
    :data:`ADAPTER_ALIGN` (its next tensor would be padded, and the file has no holes).

    Both ends call this: the rank to lay its segment out, the daemon to check that the
    segment's first bytes are exactly the header of the round's plan.
    """
    if not tensors:
        return None
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for i, (name, dtype, shape) in enumerate(tensors):
        spelled = SAFETENSORS_DTYPES.get(dtype)
        if spelled is None or name == "__metadata__" or name in header:
            return None
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= d
        if i < len(tensors) - 1 and n % ADAPTER_ALIGN:
            return None
        header[name] = {"dtype": spelled, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ADAPTER_ALIGN)
    return len(text).to_bytes(8, "little") + text


def check_config(config_json: str) -> int:
    """Check a PEFT ``adapter_config.json`` text; return its LoRA rank ``r``.

    Raises:
        ValueError: not a JSON object, or ``r`` is not a positive integer, or
            ``target_modules`` is missing (PEFT ``LoraConfig``'s fields).
    """
    try:
        config = json.loads(config_json)
    except ValueError as e:
        raise ValueError(f"config_json is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError("config_json must be a JSON object (PEFT's adapter_config.json)")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"config_json's LoRA rank 'r' must be a positive integer, not {r!r}")
    if not config.get("target_modules"):
        raise ValueError("config_json has no 'target_modules' (PEFT's LoraConfig needs them)")
    return r


_LORA_TENSOR_RE = re.compile(
    r"^[^.].*\.(?:(?:lora_A|lora_B)\.weight|lora_embedding_A|lora_embedding_B)$")
_BASE_SUFFIXES = (".weight", ".bias")


def lora_tensor_problem(name: str) -> str:
    """Why ``name`` is not a LoRA tensor in PEFT's naming, '' when it is one: ``<module>.lora_A
    .weight`` / ``<module>.lora_B.weight``, or ``<module>.lora_embedding_A`` /
    ``<module>.lora_embedding_B`` for an embedding layer, as PEFT's
    ``get_peft_model_state_dict`` gives them and ``save_pretrained`` writes them
    (``peft/utils/save_and_load.py``; the adapter's own name taken out).

    Those four are what both engines load as an adapter's tensors. vLLM 0.32
    (``vllm/lora/utils.py`` ``parse_fine_tuned_lora_name``, called for every name of the
    file by ``LoRAModel.from_local_checkpoint``, ``vllm/lora/lora_model.py``) takes
    ``lora_A`` / ``lora_B`` followed by ``weight``, ``lora_embedding_A`` / ``_B`` last, and
    otherwise only the full ``score`` / ``classifier`` modules of a classification adapter
    (``modules_to_save``, which SGLang has not); it raises "... is unsupported LoRA weight"
    for any other name, which the server answers with an HTTP 500 after the round began.
    SGLang 0.5.23 (``srt/lora/lora.py`` ``LoRAAdapter._process_weight``) keeps every name
    with a layer id, and ``LoRAMemoryPool.load_lora_weight_to_buffer``
    (``srt/lora/mem_pool.py``) takes a weight as ``lora_A`` when its name holds "lora_A" and
    as ``lora_B`` otherwise: a base weight would be copied in as a ``lora_B``. So both ends
    refuse every other name before any engine call: the rank
    (``rank/adapters/inputs.py``) and the daemon (``daemon/core/adapters/gather.py``).

    The text starts with the name (``'...q_proj.weight' is not ...``): callers put the
    tensor's owner before it.
    """
    if _LORA_TENSOR_RE.match(name):
        return ""
    peft = ("an adapter holds only PEFT's LoRA tensors, '<module>.lora_A.weight' and "
            "'<module>.lora_B.weight' (or '<module>.lora_embedding_A' / 'lora_embedding_B' "
            "of an embedding), as peft.get_peft_model_state_dict(model) gives them, e.g. "
            "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'")
    if "lora_magnitude_vector" in name:
        why = "a DoRA magnitude vector, which neither vLLM nor SGLang serves"
    elif ".modules_to_save." in name or "trainable_tokens" in name:
        why = ("a full module PEFT trains beside the adapter (modules_to_save, trainable "
               "tokens), which the engines do not load with an adapter")
    elif name.endswith(_BASE_SUFFIXES) and "lora_" not in name:
        why = ("a base-model weight (was the model's state_dict() or named_parameters() "
               "passed?): the engine serves its own base model, an adapter round carries "
               "only the LoRA tensors")
    else:
        why = "not a LoRA tensor"
    return (f"{name!r} is {why}; {peft} (vLLM refuses any other name: vllm/lora/utils.py "
            "parse_fine_tuned_lora_name)")


class AdapterTensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One tensor of a rank's adapter part: its PEFT ``name`` (e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), ``dtype``, the
    whole tensor's ``shape``, the rows ``[row_start, row_stop)`` of dim 0 this rank holds
    (the whole tensor: ``0, shape[0]``) and ``sha256``, the hex digest of those rows' bytes
    in C order."""

    name: Name
    dtype: DtypeName
    shape: Dims
    row_start: NonNeg
    row_stop: NonNeg
    sha256: str

    def __post_init__(self) -> None:
        if not self.shape:
            raise FieldError("shape", f"adapter tensor {self.name!r} has no dims")
        if not (self.row_start < self.row_stop <= self.shape[0]):
            raise FieldError("row_start", f"adapter tensor {self.name!r}: rows "
                             f"[{self.row_start}, {self.row_stop}) are not within its "
                             f"{self.shape[0]} rows")
        if not _SHA256_RE.match(self.sha256):
            raise FieldError("sha256", f"adapter tensor {self.name!r}: sha256 must be 64 "
                             "lower-case hex digits")

    @property
    def whole(self) -> bool:
        """This part is the whole tensor."""
        return self.row_start == 0 and self.row_stop == self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of this part (its rows)."""
        n = (self.row_stop - self.row_start) * DTYPE_SIZES[self.dtype]
        for d in self.shape[1:]:
            n *= d
        return n


class AdapterBegin(msgspec.Struct, tag="adapter_begin", forbid_unknown_fields=True):
    """A rank's part of version ``version`` of LoRA adapter ``lora_name`` (round
    ``update_id``). ``config_json``: the PEFT ``adapter_config.json`` text, the same on every
    rank; ``tensors``: this rank's part, possibly empty (another rank holds everything)."""

    update_id: NonNeg
    lora_name: str
    version: NonNeg
    config_json: Annotated[str, msgspec.Meta(min_length=2, max_length=MAX_CONFIG_BYTES)]
    tensors: Annotated[list[AdapterTensor], msgspec.Meta(max_length=MAX_ADAPTER_TENSORS)]

    def __post_init__(self) -> None:
        if not _LORA_NAME_RE.match(self.lora_name):
            raise FieldError("lora_name", f"lora_name {self.lora_name!r} must be 1-64 of "
                             "A-Z a-z 0-9 _ . - (starting with a letter or digit)")
        try:
            check_config(self.config_json)
        except ValueError as e:
            raise FieldError("config_json", str(e)) from None
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise FieldError("tensors", f"adapter tensor {t.name!r} is listed twice")
            seen.add(t.name)

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's part as laid out behind its handle (:func:`part_offsets`)."""
        return part_offsets(self.tensors)[1]


class AdapterData(msgspec.Struct, tag="adapter_data", forbid_unknown_fields=True):
    """The bytes of the rank's part of round ``update_id``: ``handle`` covers them, laid out
    as :func:`part_offsets` says (None: the rank's part is empty)."""

    update_id: NonNeg
    handle: Handle | None = None

"""What ``Publisher.publish_adapter`` accepts, checked before anything is allocated or sent: the
PEFT config (as the one text every rank of the slot sends), the version, and this rank's part
of each tensor (its rows of dim 0, their dtype and the whole tensor's shape). No I/O here.

Names are PEFT's, as ``save_pretrained`` writes them into ``adapter_model.safetensors``: PEFT
``get_peft_model_state_dict`` (``peft/utils/save_and_load.py``) removes the adapter's own name
("REMOVE ADAPTER NAME": ``...q_proj.lora_A.default.weight`` becomes ``...q_proj.lora_A.weight``,
``...embed_tokens.lora_embedding_A.default`` becomes ``...embed_tokens.lora_embedding_A``), and
``PeftModel.save_pretrained`` writes that dict. Its output is taken as it is. vLLM 0.32 refuses
the other form when it reads the folder (``vllm/lora/utils.py`` ``parse_fine_tuned_lora_name``:
``lora_A`` / ``lora_B`` must be the next-to-last part, before ``weight``), so a name that still
holds an adapter name (``PeftModel.named_parameters()`` or ``state_dict()``) is refused here,
naming the call to make instead (:func:`peft_name_problem`); so is any name that is not a LoRA
tensor's (``lora_A`` / ``lora_B`` + ``weight``, ``lora_embedding_A`` / ``_B``:
``wire.adapter.lora_tensor_problem``, the rule the daemon's gather applies too), e.g. a base
weight ``...q_proj.weight`` that vLLM would refuse with an HTTP 500 after the round began.

Rows: each tensor is whole by default; ``rows[name] = (row_start, whole_shape)`` declares a
row shard of dim 0; an FSDP2 DTensor sharded ``(Shard(0),)`` on a 1-D mesh is this rank's local
rows (``torch.chunk``'s split, as ``sharded.gather_shard`` reads it). The daemon puts each
tensor together from the parts of the slot's ranks (they must tile its rows: no gap, no
overlap), with no collective in the trainer.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePath

import torch

from slotsync.protocol import wire
from slotsync.protocol.rank.export import dtype_name
from slotsync.protocol.rank.sharded import is_dtensor
from slotsync.protocol.topology import EngineSlot
from slotsync.protocol.wire import adapter as wire_adapter

__all__ = ["MAX_PART_BYTES", "PartTensor", "Rows", "chunk_rows", "config_text", "part_tensors",
           "peft_name_problem", "version_of"]

MAX_PART_BYTES = 8 << 30
"""Most bytes of one rank's part (8 GiB): a LoRA adapter of rank 256 on every linear layer of a
70B model is about 3.3 GB bf16 in all; a part above this is more likely a base model's
``state_dict()`` passed by mistake than an adapter."""

Rows = Mapping[str, tuple[int, tuple[int, ...]]]
"""``publish_adapter``'s ``rows``: tensor name -> ``(row_start, whole_shape)``."""

_ADAPTER_NAME_IN = (
    # (PeftModel.named_parameters() / state_dict() names: the adapter's name still in them)
    re.compile(r"\.(lora_A|lora_B)\.([^.]+)\.weight$"),
    re.compile(r"\.(lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)$"),
)


@dataclass(frozen=True)
class PartTensor:
    """One tensor of this rank's part: its PEFT ``name``, ``local`` (this rank's rows, a plain
    tensor, not necessarily contiguous), ``dtype`` (the wire's name), the whole tensor's
    ``shape`` and the rows ``[row_start, row_stop)`` of dim 0 that ``local`` holds."""

    name: str
    local: torch.Tensor
    dtype: str
    shape: tuple[int, ...]
    row_start: int
    row_stop: int

    @property
    def nbytes(self) -> int:
        """Bytes of this part (its rows)."""
        return self.local.numel() * self.local.element_size()


def version_of(version: object) -> int:
    """An adapter version the wire carries: an int >= 0 (not a bool), below 2**63.

    Raises:
        TypeError: not an int. ValueError: negative or too large.
    """
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(f"version must be an int >= 0 (each round's version above the last), "
                        f"got {type(version).__name__} {version!r}"[:200])
    if not 0 <= version < 1 << 63:
        raise ValueError(f"version must be >= 0 and below 2**63 (a msgpack int), got "
                         f"{version}")
    return version


def _json_default(key: str) -> object:
    def default(value: object) -> object:
        if isinstance(value, set | frozenset):
            return sorted(value, key=str)
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, PurePath):
            return str(value)
        raise TypeError(f"config[{key!r}] holds a {type(value).__name__}, which JSON cannot "
                        "hold: pass peft_config.to_dict() (PEFT's fields) or the text of "
                        "adapter_config.json")
    return default


def config_text(config: Mapping[str, object] | str) -> str:
    """The PEFT ``adapter_config.json`` text this rank sends (every rank of the slot must send
    the same one): a mapping such as ``peft_model.peft_config["default"].to_dict()`` is
    written as PEFT's ``PeftConfigMixin.save_pretrained`` writes it (``json.dumps(...,
    indent=2, sort_keys=True)``, ``peft/config.py``), with sets (``target_modules``) as
    *sorted* lists (PEFT writes them in set order, which differs between processes) and enums
    as their values; a str is parsed and written the same way (its ``target_modules`` list
    sorted: PEFT's ``LoraConfig`` holds them as a set).

    Raises:
        TypeError: not a mapping or str, or a value JSON cannot hold (names the key).
        ValueError: not a JSON object, ``r`` not a positive int, no ``target_modules``
            (``wire.adapter.check_config``), or over ``wire.adapter.MAX_CONFIG_BYTES``.
    """
    if isinstance(config, str):
        try:
            parsed = json.loads(config)
        except ValueError as e:
            raise ValueError(f"config is not JSON (PEFT's adapter_config.json): {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError("config must be a JSON object (PEFT's adapter_config.json)")
        if isinstance(parsed.get("target_modules"), list):
            parsed["target_modules"] = sorted(parsed["target_modules"], key=str)
        config = parsed
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be PEFT's adapter config, a mapping "
                        f"(peft_config.to_dict()) or its JSON text, got "
                        f"{type(config).__name__}")
    out: dict[str, object] = {}
    for key, value in config.items():
        if not isinstance(key, str):
            raise TypeError(f"config keys must be str, got {key!r}")
        out[key] = value
    try:
        text = json.dumps({k: json.loads(json.dumps(v, default=_json_default(k)))
                           for k, v in out.items()}, indent=2, sort_keys=True)
    except ValueError as e:  # (a value that holds itself)
        raise ValueError(f"config cannot be written as JSON: {e}") from None
    wire_adapter.check_config(text)
    if len(text.encode()) > wire_adapter.MAX_CONFIG_BYTES:
        raise ValueError(f"config's JSON is {len(text.encode())} bytes, over the wire's "
                         f"{wire_adapter.MAX_CONFIG_BYTES}: a PEFT adapter_config.json is ~1 KiB")
    return text


def peft_name_problem(name: str) -> str:
    """Why ``name`` is not a tensor name of PEFT's ``adapter_model.safetensors`` ('' when
    nothing is wrong that this can tell): a name that still holds the adapter's name between
    ``lora_A`` / ``lora_B`` and ``weight`` (see the module's docstring)."""
    for pattern in _ADAPTER_NAME_IN:
        m = pattern.search(name)
        if m:
            return (f"tensor {name!r} still holds the adapter name {m.group(2)!r} after "
                    f"{m.group(1)!r} (a PeftModel.named_parameters() or state_dict() name): "
                    "pass peft.get_peft_model_state_dict(model), whose names are those "
                    "save_pretrained writes to adapter_model.safetensors and the engines read "
                    "(vLLM refuses the other form)")
    return ""


def chunk_rows(dim0: int, world: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that shard ``index`` of ``world`` holds under
    ``torch.chunk``'s split, as FSDP2's ``fully_shard`` and DTensor's ``Shard(0)`` cut: each
    holds ``ceil(dim0 / world)`` rows, the last ones fewer or none (``start == stop``)."""
    per = -(-dim0 // world) if world else 0
    start = min(dim0, index * per)
    return start, min(dim0, start + per)


def _dtensor_part(name: str, t: torch.Tensor, rank: int,
                  slot: EngineSlot) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """A DTensor's local rows, their first row, and its global shape.

    Raises:
        ValueError: not ``(Shard(0),)`` on a 1-D mesh, a local shard that is not
            ``torch.chunk``'s, or a mesh that is not the slot's ranks (checked when this
            process's ``torch.distributed`` rank is the publisher's ``rank``).
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    if not (mesh.ndim == 1 and len(placements) == 1 and type(placements[0]) is Shard
            and placements[0].dim == 0 and t.dim() >= 1):
        if mesh.ndim == 1 and len(placements) == 1 and type(placements[0]) is Replicate:
            why = ("every rank holds it whole, and the slot's parts must not overlap: pass "
                   "t.to_local() on one rank of the slot and leave it out on the others")
        else:
            why = ("gather it (t.full_tensor()) and pass it whole on one rank of the slot, or "
                   "pass this rank's rows as a plain tensor with rows=")
        raise ValueError(f"adapter tensor {name!r} is a DTensor with placements "
                         f"{tuple(placements)} on a {mesh.ndim}-D mesh: publish_adapter takes "
                         f"FSDP2's (Shard(0),) on a 1-D mesh (its local rows); {why}")
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == rank:
        mesh_ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
        if mesh_ranks != list(range(slot.start, slot.end)):
            raise ValueError(
                f"adapter tensor {name!r} is sharded over ranks {mesh_ranks}, but this rank's "
                f"engine slot is {slot}: the daemon puts a tensor together from its slot's "
                "ranks only (no collective in the trainer), so its shards must lie on exactly "
                "the slot's ranks; gather it first (t.full_tensor()) and pass it whole on one "
                "rank of the slot")
    local = t.to_local().detach()  # type: ignore[attr-defined]
    shape = tuple(int(d) for d in t.shape)
    start, stop = chunk_rows(shape[0], mesh.size(), mesh.get_local_rank())
    if tuple(local.shape) != (stop - start, *shape[1:]):
        raise ValueError(
            f"adapter tensor {name!r}: DTensor of global shape {shape} has local shape "
            f"{tuple(local.shape)} on mesh rank {mesh.get_local_rank()} of {mesh.size()}, but "
            f"torch.chunk gives it rows [{start}, {stop}): not an FSDP2 Shard(0) layout")
    return local, start, shape


def _declared_part(name: str, t: torch.Tensor, declared: object) -> tuple[int, tuple[int, ...]]:
    """``rows[name]`` checked against the local tensor: ``(row_start, whole_shape)``.

    Raises:
        TypeError, ValueError: not ``(int, tuple of ints)``, or rows outside the whole shape.
    """
    if not (isinstance(declared, tuple | list) and len(declared) == 2):
        raise TypeError(f"rows[{name!r}] must be (row_start, whole_shape), got {declared!r}")
    start, whole = declared
    if (not isinstance(start, int) or isinstance(start, bool)
            or not isinstance(whole, tuple | list | torch.Size)
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in whole)):
        raise TypeError(f"rows[{name!r}] must be (row_start: int, whole_shape: tuple of ints), "
                        f"got {declared!r}")
    shape = tuple(int(d) for d in whole)
    local_shape = tuple(t.shape)
    if (len(shape) != len(local_shape) or not local_shape or shape[1:] != local_shape[1:]
            or start < 0 or start + local_shape[0] > shape[0]):
        raise ValueError(
            f"rows[{name!r}] = ({start}, {shape}) does not fit the tensor of shape "
            f"{local_shape}: its rows [{start}, {start + (local_shape[0] if local_shape else 0)})"
            f" must lie within the whole tensor's {shape[0] if shape else 0} rows, with the "
            "same other dims")
    return start, shape


def _same_device(name: str, t: torch.Tensor, first: tuple[str, torch.device] | None,
                 transport: str, device: torch.device) -> None:
    """Every tensor on one device: the CPU or this rank's GPU (cuda transport).

    Raises:
        ValueError: names the tensor, its device and the other one.
    """
    if transport == "cuda" and t.device.type == "cuda" and t.device != device:
        raise ValueError(f"adapter tensor {name!r} is on {t.device}, but this publisher's "
                         f"device is {device}: pass this rank's tensors")
    if first is not None and t.device != first[1]:
        raise ValueError(f"adapter tensor {name!r} is on {t.device} but {first[0]!r} on "
                         f"{first[1]}: pass every tensor of the part on one device")


def _items(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
           ) -> list[tuple[object, object]]:
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    if isinstance(tensors, str | bytes) or not isinstance(tensors, Iterable):
        raise TypeError(f"tensors must be a mapping of PEFT names to tensors (e.g. "
                        f"get_peft_model_state_dict(model)), got {type(tensors).__name__}")
    items = []
    for item in tensors:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise TypeError(f"tensors must be (name, tensor) pairs, got "
                            f"{type(item).__name__} {str(item)[:80]!r}")
        items.append((item[0], item[1]))
    return items


def part_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 rows: Rows | None, *, rank: int, slot: EngineSlot, transport: str,
                 device: torch.device) -> list[PartTensor]:
    """This rank's part, in the order given, each tensor checked (every error names it).

    A tensor of which this rank holds no rows (a DTensor shard that ``torch.chunk`` leaves
    empty) is left out of the part.

    Args:
        tensors: PEFT name -> tensor (a mapping, or ``(name, tensor)`` pairs).
        rows: name -> ``(row_start, whole_shape)`` for the plain tensors that are a row shard.
        rank, slot: the publisher's (a DTensor's mesh must be the slot's ranks).
        transport, device: the publisher's (a CUDA tensor must be on ``device``).

    Raises:
        TypeError: an item is not a (str, Tensor) pair, or ``rows`` is malformed.
        ValueError: a name that repeats, is empty or too long, holds an adapter name
            (:func:`peft_name_problem`) or is not a LoRA tensor's
            (``wire.adapter.lora_tensor_problem``: a base-model weight, say); a dtype
            outside ``wire.DTYPE_SIZES``; a sparse, meta or 0-dim tensor; tensors on
            different devices (or on another GPU than the publisher's); ``rows`` for a
            DTensor or for a name not in ``tensors``; a DTensor layout other than
            ``(Shard(0),)`` on a 1-D mesh of the slot's ranks; more than
            ``wire.adapter.MAX_ADAPTER_TENSORS`` tensors or ``MAX_PART_BYTES`` bytes.
    """
    rows = dict(rows or {})
    out: list[PartTensor] = []
    seen: set[str] = set()
    first: tuple[str, torch.device] | None = None
    total = 0
    for name, t in _items(tensors):
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors must map str names to torch.Tensor, got "
                            f"{type(name).__name__} {str(name)[:80]!r} -> {type(t).__name__}")
        if name in seen:
            raise ValueError(f"adapter tensor {name!r} appears twice")
        seen.add(name)
        if not 0 < len(name) <= wire.MAX_NAME_CHARS:
            raise ValueError(f"adapter tensor name {name[:80]!r} must have 1 to "
                             f"{wire.MAX_NAME_CHARS} characters (it has {len(name)})")
        problem = peft_name_problem(name)
        if problem:
            raise ValueError(problem)
        problem = wire_adapter.lora_tensor_problem(name)
        if problem:
            raise ValueError(f"adapter tensor {problem}")
        if t.layout is not torch.strided or t.is_meta:
            what = "on the meta device" if t.is_meta else f"of layout {t.layout}"
            raise ValueError(f"adapter tensor {name!r} is {what}: only dense tensors with data "
                             "can be published")
        try:
            dt = dtype_name(t.dtype)
        except ValueError as e:
            raise ValueError(f"adapter tensor {name!r}: {e}") from None
        if t.dim() == 0:
            raise ValueError(f"adapter tensor {name!r} has no dims (a scalar): an adapter "
                             "tensor has rows")
        if is_dtensor(t):
            if name in rows:
                raise ValueError(f"adapter tensor {name!r} is a DTensor, which says its own "
                                 "rows: leave it out of rows=")
            local, start, shape = _dtensor_part(name, t, rank, slot)
        else:
            local = t.detach()
            start, shape = (_declared_part(name, t, rows.pop(name)) if name in rows
                            else (0, tuple(int(d) for d in t.shape)))
        _same_device(name, local, first, transport, device)
        first = first or (name, local.device)
        if local.shape[0] == 0:
            if not is_dtensor(t):
                raise ValueError(f"adapter tensor {name!r} has no rows: leave it out of this "
                                 "rank's part")
            continue  # (this rank's shard of it is empty: the other ranks hold its rows)
        part = PartTensor(name, local, dt, shape, start, start + int(local.shape[0]))
        total += part.nbytes
        out.append(part)
    if rows:
        raise ValueError(f"rows= names tensor(s) not in tensors: {sorted(rows)[:5]}")
    if len(out) > wire_adapter.MAX_ADAPTER_TENSORS:
        raise ValueError(f"{len(out)} adapter tensors, over the wire's "
                         f"{wire_adapter.MAX_ADAPTER_TENSORS}")
    if total > MAX_PART_BYTES:
        raise ValueError(f"this rank's adapter part is {total} bytes, over {MAX_PART_BYTES} "
                         "(MAX_PART_BYTES): is it a base model's state_dict()? pass "
                         "peft.get_peft_model_state_dict(model)")
    return out

"""What an adapter round loads, once every rank of the slot began it: the adapter's name,
version and config, and each tensor with the rank parts that make it up
(:class:`AdapterPlan`); and what an engine can hold (:class:`LoraLimits`).

The engine families (``daemon/vllm/adapters.py``, ``daemon/sglang/adapters.py``) build their
payloads from a plan and the ranks' handles; the core builds the plan from the ranks'
``wire.AdapterBegin`` messages. Pure data, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterPart:
    """Rows ``[row_start, row_stop)`` of dim 0 of one tensor, held by rank ``rank``: its
    ``nbytes`` bytes start ``offset`` bytes after the start of that rank's
    ``AdapterData.handle`` (``wire.part_offsets``). ``sha256``: the rank's hex digest of
    those bytes."""

    rank: int
    offset: int
    nbytes: int
    row_start: int
    row_stop: int
    sha256: str


@dataclass(frozen=True, slots=True)
class AdapterTensorPlan:
    """One tensor of the adapter: its PEFT ``name``, ``dtype`` (a ``wire`` dtype name),
    whole ``shape``, and its ``parts`` in row order, tiling ``[0, shape[0])`` exactly."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[AdapterPart, ...]

    @property
    def whole(self) -> AdapterPart | None:
        """The one part when one rank holds the whole tensor, else None."""
        return self.parts[0] if len(self.parts) == 1 else None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    """Version ``version`` of adapter ``lora_name``, served as ``served_name``
    (``wire.served_name``), with PEFT config ``config_json`` (text, as the ranks sent it)
    whose LoRA rank is ``lora_rank``; ``tensors`` in the order of the first rank that holds
    each. ``ranks``: the slot's ranks in order (a rank with an empty part included)."""

    lora_name: str
    version: int
    served_name: str
    config_json: str
    lora_rank: int
    tensors: tuple[AdapterTensorPlan, ...]
    ranks: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor of the adapter."""
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True, slots=True)
class LoraLimits:
    """What an engine can hold, read from its server info by its family: ``enabled`` (the
    server runs with LoRA), ``max_loras`` (adapters at once: vLLM ``--max-loras``, SGLang
    ``--max-loras-per-batch``; 0: unknown), ``max_lora_rank`` (0: unknown), and the flags
    that set each, in the family's words (``flags``: ``{"enabled": "--enable-lora", ...}``)
    for the refusal texts. ``flags["enabled"]`` is a flag (SGLang: ``--enable-lora``) or,
    where more than a flag is missing, the family's whole instruction (vLLM: "start the vLLM
    server with the flag --enable-lora ..."): ``limits_refusal`` puts "start it with" before
    a flag and quotes an instruction as it is."""

    enabled: bool
    max_loras: int = 0
    max_lora_rank: int = 0
    flags: tuple[tuple[str, str], ...] = ()

    def flag(self, what: str) -> str:
        """The flag that sets ``what`` (``"enabled"``, ``"max_loras"``, ``"max_lora_rank"``)."""
        return dict(self.flags).get(what, what)

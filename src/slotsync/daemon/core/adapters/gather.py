"""A slot's ranks' ``wire.AdapterBegin`` parts gathered into one ``AdapterPlan``, and what
refuses a round before any engine call (I/O-free; issue 36 D).

``gather`` checks, once every rank of the slot began (each rank's message was already
checked alone by the wire schema, ``wire/adapter.py``):

* every rank names the same adapter, version and PEFT config (``config_json``, compared as
  text: the engine reads one config);
* the parts tile each tensor's rows exactly: every part of a tensor has the same dtype and
  whole shape, the rows ``[row_start, row_stop)`` of dim 0 follow each other from 0 to
  ``shape[0]`` with no gap and no overlap (a rank's part of a TP- or FSDP-sharded tensor is a
  run of rows; a whole tensor is one part);
* at least one tensor is sent;
* every tensor is a LoRA tensor in PEFT's naming (``lora_A`` / ``lora_B`` + ``weight``,
  ``lora_embedding_A`` / ``_B``: ``wire.adapter.lora_tensor_problem``, where vLLM's and
  SGLang's rules are cited): a base weight reached vLLM, which answered an HTTP 500 after the
  round began (issue 36's trial); refused here naming the tensor and the rank.

``version_refusal`` (the version is above the one served for that name: an older one, or the
same one, is refused naming both) and ``limits_refusal`` (the engine runs with LoRA, the
adapter's rank fits ``max_lora_rank``, the names held at once fit ``max_loras``, each with the
family's flag to set) are asked after it; every text names what is wrong and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from slotsync.daemon.core.adapters.plan import (
    AdapterPart,
    AdapterPlan,
    AdapterTensorPlan,
    LoraLimits,
)
from slotsync.protocol.wire import AdapterBegin, part_offsets, served_name
from slotsync.protocol.wire.adapter import check_config, lora_tensor_problem


class AdapterRefused(ValueError):
    """Why a slot's adapter round cannot go to its engine (raised before any engine call)."""


def _rows(a: int, b: int) -> str:
    return f"rows [{a}, {b})"


def gather(begins: Mapping[int, AdapterBegin]) -> AdapterPlan:
    """The plan of the round every rank of ``begins`` (rank -> its ``AdapterBegin``) began.

    Returns:
        ``AdapterPlan``: tensors in the order of the first rank (in rank order) that holds
        each, each tensor's parts in row order, each part's ``offset`` from the start of its
        rank's ``AdapterData.handle`` (``wire.part_offsets``).

    Raises:
        AdapterRefused: the ranks disagree on the name, version or config; a tensor that is
            not a LoRA tensor (names it and the rank); a tensor's parts differ in dtype or
            shape, overlap, or leave rows of it to no rank; no tensor.
    """
    ranks = sorted(begins)
    if not ranks:
        raise AdapterRefused("no rank began the adapter round")
    r0, first = ranks[0], begins[ranks[0]]
    for r in ranks[1:]:
        b = begins[r]
        for field, what in (("lora_name", "adapter"), ("version", "version"),
                            ("config_json", "PEFT config (config_json)")):
            mine, theirs = getattr(b, field), getattr(first, field)
            if mine != theirs:
                shown = ((repr(mine[:200]), repr(theirs[:200])) if field == "config_json"
                         else (repr(mine), repr(theirs)))
                raise AdapterRefused(
                    f"the ranks disagree on the {what}: rank {r} sends {shown[0]}, rank {r0} "
                    f"{shown[1]}: every rank of the slot publishes the same adapter, version "
                    "and config in one round")
    for r in ranks:  # (names: wire.adapter.lora_tensor_problem says whose rules)
        for t in begins[r].tensors:
            problem = lora_tensor_problem(t.name)
            if problem:
                raise AdapterRefused(f"rank {r}'s adapter tensor {problem}")
    held: dict[str, list[tuple[int, object, int]]] = {}
    for r in ranks:
        offsets, _ = part_offsets(begins[r].tensors)
        for t, off in zip(begins[r].tensors, offsets, strict=True):
            held.setdefault(t.name, []).append((r, t, off))
    if not held:
        raise AdapterRefused(f"adapter {first.lora_name!r} version {first.version}: no rank "
                             "sends any tensor")
    tensors = [_tensor_plan(name, parts) for name, parts in held.items()]
    return AdapterPlan(first.lora_name, first.version,
                       served_name(first.lora_name, first.version), first.config_json,
                       check_config(first.config_json), tuple(tensors), tuple(ranks))


def _tensor_plan(name: str, parts: list) -> AdapterTensorPlan:
    """One tensor from its ranks' parts ``(rank, wire.AdapterTensor, offset)``.

    Raises:
        AdapterRefused: as ``gather``.
    """
    r0, t0, _ = parts[0]
    for r, t, _ in parts[1:]:
        if (t.dtype, tuple(t.shape)) != (t0.dtype, tuple(t0.shape)):
            raise AdapterRefused(
                f"adapter tensor {name!r}: rank {r} sends dtype {t.dtype} shape "
                f"{list(t.shape)}, rank {r0} dtype {t0.dtype} shape {list(t0.shape)}: the "
                "parts of one tensor share its dtype and whole shape")
    ordered = sorted(parts, key=lambda p: (p[1].row_start, p[0]))
    at, by = 0, None
    out = []
    for r, t, off in ordered:
        if t.row_start > at:
            raise AdapterRefused(
                f"adapter tensor {name!r}: {_rows(at, t.row_start)} of its {t0.shape[0]} are "
                "held by no rank: the ranks' parts must cover every row of dim 0")
        if t.row_start < at:
            raise AdapterRefused(
                f"adapter tensor {name!r}: {_rows(t.row_start, min(at, t.row_stop))} are held "
                f"by rank {by} and rank {r}: the ranks' parts must not overlap (send each row "
                "of dim 0 from one rank). A plain tensor is taken as the whole tensor: ranks "
                "that split its rows each pass rows={" + repr(name) + ": (row_start, "
                "whole_shape)} for the rows they hold (docs/publisher.md); ranks that each "
                "hold the whole tensor publish it from one rank")
        out.append(AdapterPart(r, off, t.nbytes, t.row_start, t.row_stop, t.sha256))
        at, by = t.row_stop, r
    if at != t0.shape[0]:
        raise AdapterRefused(
            f"adapter tensor {name!r}: {_rows(at, t0.shape[0])} of its {t0.shape[0]} are held "
            "by no rank: the ranks' parts must cover every row of dim 0")
    return AdapterTensorPlan(name, t0.dtype, tuple(t0.shape), tuple(out))


def version_refusal(plan: AdapterPlan, served_version: int | None, lost: bool,
                    engine_url: str | None) -> str:
    """Why ``plan``'s version cannot replace the version of its adapter the engine serves
    (``served_version``; None: none), or '': it must be above it. ``lost``: that version is
    recorded as lost (the engine restarted and the daemon holds no copy of it): the same
    version may then be published again."""
    if served_version is None or plan.version > served_version:
        return ""
    if lost and plan.version == served_version:
        return ""
    older = "the same version as" if plan.version == served_version else \
        "a version older than"
    return (f"adapter {plan.lora_name!r} version {plan.version} is {older} version "
            f"{served_version}, which engine {engine_url} serves as "
            f"{served_name(plan.lora_name, served_version)}: publish a version above "
            f"{served_version}")


def limits_refusal(plan: AdapterPlan, limits: LoraLimits, held: Iterable[str],
                   engine_url: str | None, display: str) -> str:
    """Why an engine with ``limits`` (``display``: its family's name) cannot hold ``plan``
    beside the adapters it holds (``held``: their served names, the ones this round replaces
    included: the new version is loaded before the old one goes), or ''. A limit of 0 is
    unknown and not checked."""
    if not limits.enabled:
        flag = limits.flag("enabled")  # (a flag, or the family's sentence of what is missing)
        how = f"start it with {flag}" if flag.startswith("-") else flag
        return f"engine {engine_url} ({display}) does not serve LoRA adapters: {how}"
    if limits.max_lora_rank and plan.lora_rank > limits.max_lora_rank:
        return (f"adapter {plan.served_name} has LoRA rank r={plan.lora_rank}, above engine "
                f"{engine_url}'s max_lora_rank {limits.max_lora_rank}: set "
                f"{limits.flag('max_lora_rank')} to {plan.lora_rank} or more")
    names = sorted(set(held) | {plan.served_name})
    if limits.max_loras and len(names) > limits.max_loras:
        return (f"engine {engine_url} would hold {len(names)} adapters at once "
                f"({', '.join(names)}: a new version is loaded beside the one it replaces), "
                f"above its max_loras {limits.max_loras}: set {limits.flag('max_loras')} to "
                f"{len(names)} or more")
    return ""

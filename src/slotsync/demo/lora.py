"""``slotsync demo --lora``: LoRA adapter rounds (issue 36 E) instead of base-weight rounds.

The engine serves a small random Llama (:func:`make_llama`, written into the demo's folder;
or ``--model``, a safetensors file whose attention projections have Hugging Face Llama names)
with LoRA enabled (:func:`engine_options`: vLLM's ``--enable-lora --max-lora-rank 8
--max-loras 2 --max-cpu-loras 2`` on the reference and vLLM-code engines, SGLang's
``--enable-lora --max-lora-rank 8 --lora-target-modules all`` on the SGLang-code engine).
Round ``k`` publishes version ``k`` of adapter ``demo`` -- PEFT-named tensors for ``q_proj``,
``k_proj``, ``v_proj`` and ``o_proj`` of every layer at rank 8 (``base_model.model.model.
layers.N.self_attn.q_proj.lora_A.weight`` ...), the same random values on every rank
(:func:`adapter_tensors`) -- with ``Publisher.publish_adapter`` from every rank of the slot,
each holding its part as :func:`round_layout` says:

* ``"rows"``: every tensor split by rows over the slot's ranks (a tensor of fewer rows than
  ranks whole on the first): the daemon joins the rows into the folder vLLM reads;
* ``"one"``: the slot's first rank holds every tensor, the others nothing;
* ``"spread"``: each tensor whole on one rank, in turn (SGLang refuses a tensor split over
  ranks: ``daemon/sglang/adapters.py`` ``refusal``).

The vLLM-style engines alternate ``rows`` and ``one``, the SGLang engine ``one`` and
``spread``. After each round the demo reads the engine's test-only ``GET /_slotsync/lora``
(each worker's adapters with the sha256 of every tensor as it read them) and checks
(:func:`verify_adapter`) that every worker holds exactly the trainer's tensors under the
served name (``demo@v<k>``) and that the previous version is no longer served.

Standard library only at import; torch and safetensors are imported by the functions that
need them (in the demo process or the rank processes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from slotsync.demo.config import plural

LORA_NAME = "demo"
LORA_RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
"""The demo's Llama: head size 64 (vLLM 0.32's CPU attention takes 32, 64, ... 512), two KV
heads (grouped-query attention, so that ``k_proj`` / ``v_proj`` differ from ``q_proj``)."""


def llama_bytes(cfg: dict[str, int] = LLAMA) -> int:
    """Bytes of :func:`make_llama`'s float32 tensors (what the header and the memory estimate
    count before the file exists)."""
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    layer = 2 * h + 2 * h * h + 2 * kv * h + 3 * h * i
    return 4 * (2 * v * h + h + cfg["num_hidden_layers"] * layer)


def make_llama(path: Path, seed: int = 0, cfg: dict[str, int] = LLAMA) -> Path:
    """Write random float32 weights of a Llama (``cfg``) under Hugging Face
    ``LlamaForCausalLM`` names (``model.embed_tokens.weight``, each layer's norms and
    ``self_attn.{q,k,v,o}_proj`` / ``mlp.{gate,up,down}_proj`` ``.weight`` as
    ``(out_features, in_features)``, ``model.norm.weight``, ``lm_head.weight``) to the
    safetensors file ``path``; returns it."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = {"model.embed_tokens.weight": torch.randn(v, h, generator=g)}
    for n in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{n}"
        out[f"{pre}.input_layernorm.weight"] = torch.ones(h)
        out[f"{pre}.post_attention_layernorm.weight"] = torch.ones(h)
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, h)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            out[f"{pre}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
    out["model.norm.weight"] = torch.ones(h)
    out["lm_head.weight"] = torch.randn(v, h, generator=g)
    save_file(out, str(path))
    return path


def attention_shapes(model: Path) -> dict[str, tuple[int, int]]:
    """``{"model.layers.N.self_attn.<proj>": (out_features, in_features)}`` of the model
    file's 2-D ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` weights (read from the
    safetensors header only), in file order. Empty when it has none (not a Llama-named
    model)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, int]] = {}
    with safe_open(str(model), framework="pt") as f:
        for name in f.keys():
            module = name.removesuffix(".weight")
            if (name.endswith(".weight") and ".self_attn." in name
                    and module.rsplit(".", 1)[-1] in TARGETS):
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2:
                    shapes[module] = (int(shape[0]), int(shape[1]))
    return shapes


def model_problem(model: Path) -> str | None:
    """Why ``--lora`` cannot use ``--model`` ``model`` (its attention projections are the
    adapter's modules), or None."""
    if not attention_shapes(model):
        return (f"--lora --model {model}: the file has no Llama-named attention projections "
                "(model.layers.N.self_attn.q_proj.weight ...), the modules of the demo's "
                "adapter; leave out --model for the demo's own small random Llama")
    return None


def peft_config(r: int = LORA_RANK) -> dict[str, Any]:
    """The adapter's PEFT ``LoraConfig`` as ``adapter_config.json`` holds it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
            "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
            "base_model_name_or_path": "slotsync-demo-llama", "inference_mode": True}


def adapter_tensors(shapes: dict[str, tuple[int, int]], version: int, r: int = LORA_RANK,
                    dtype: Any = None) -> dict[str, Any]:
    """Version ``version`` of the adapter for ``shapes``' modules: PEFT names
    (``base_model.model.<module>.lora_A.weight`` ``(r, in)``, ``.lora_B.weight``
    ``(out, r)``), random from seed ``version`` (equal on every rank), float32 unless
    ``dtype``; ``lora_B`` nonzero, so that each version changes the model's output."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 + version)
    out = {}
    for module, (o, i) in shapes.items():
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, i, generator=g) * 0.01
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(o, r, generator=g) * 0.01
    return out if dtype is None else {n: t.to(dtype) for n, t in out.items()}


def round_layout(engine: str, k: int, ranks: int) -> str:
    """How the slot's ``ranks`` ranks hold round ``k``'s adapter (module docstring):
    ``"rows"`` / ``"one"`` alternating on the vLLM-style engines, ``"one"`` / ``"spread"`` on
    SGLang's; ``"one"`` whenever the slot has one rank."""
    if ranks == 1:
        return "one"
    if engine == "sglang":
        return "one" if k % 2 else "spread"
    return "rows" if k % 2 else "one"


def rank_part(tensors: dict[str, Any], layout: str, index: int, ranks: int
              ) -> tuple[dict[str, Any], dict[str, tuple[int, tuple[int, ...]]]]:
    """The part of the slot's rank ``index`` (of ``ranks``) under ``layout``: its tensors
    (row slices for ``"rows"``) and ``publish_adapter``'s ``rows`` for them."""
    part: dict[str, Any] = {}
    rows: dict[str, tuple[int, tuple[int, ...]]] = {}
    for j, (name, t) in enumerate(tensors.items()):
        n = t.shape[0]
        if layout == "rows" and n >= ranks:
            a, b = index * n // ranks, (index + 1) * n // ranks
            part[name], rows[name] = t[a:b], (a, tuple(t.shape))
        elif (layout == "spread" and j % ranks == index) or (layout != "spread" and index == 0):
            part[name] = t
    return part, rows


def describe(layout: str, ranks: int) -> str:
    """``layout`` in words, for the round's line."""
    return {"rows": f"rows split over {ranks} ranks", "one": "all on one rank",
            "spread": f"whole tensors spread over {ranks} ranks"}[layout]


def engine_options(engine: str) -> dict[str, dict[str, Any]]:
    """``ReferenceEngine`` keyword arguments that start ``engine`` with LoRA enabled for the
    demo's adapter (module docstring)."""
    if engine == "sglang":
        return {"sglang": {"enable_lora": True, "max_lora_rank": LORA_RANK,
                           "lora_target_modules": "all"}}
    return {"lora": {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras": 2,
                     "max_cpu_loras": 2}}


def rank_rounds(cfg: Any, rank: int, slot: Any, pub: Any, group: Any, coordinator: bool,
                results: Any) -> None:
    """The adapter rounds of one trainer rank (``ranks.rank_main`` with ``--lora``):
    ``cfg.rounds`` versions through ``pub.publish_adapter``; the slot's coordinator sends the
    demo ``("adapter", k, served_name, layout, adapter bytes, its publish seconds, the
    tensors' checksums, the slot's first rank)`` after every rank's call returned."""
    import torch.distributed as dist

    from slotsync.engine.checksum import tensor_checksum

    shapes = attention_shapes(cfg.model)
    config = json.dumps(peft_config(), sort_keys=True)
    for k in range(1, cfg.rounds + 1):
        tensors = adapter_tensors(shapes, k)
        layout = round_layout(cfg.engine, k, slot.count)
        part, rows = rank_part(tensors, layout, rank - slot.start, slot.count)
        stats = pub.publish_adapter(LORA_NAME, part, config, k, rows=rows)
        dist.barrier(group=group)
        if coordinator:
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            want = {n: tensor_checksum(t) for n, t in tensors.items()}
            results.send(("adapter", k, stats.served_name, layout, nbytes, stats.seconds,
                          want, slot.start))
        dist.barrier(group=group)


def lora_state(engine: Any) -> dict[str, dict[str, dict[str, str]]]:
    """What ``engine`` serves: ``{served name: {worker: {tensor: sha256 as read}}}`` from its
    test-only ``GET /_slotsync/lora`` (the reference and vLLM-code engines: the adapters
    vLLM's server lists, each worker's cache by LoRA int id; the SGLang engine: the
    registered names, each TP rank's adapters). A worker that does not hold a listed adapter
    has no entry under it.

    Raises:
        RuntimeError: the route answered other than 200.
    """
    status, body = engine.request("GET", "/_slotsync/lora")
    if status != 200:
        raise RuntimeError(f"GET /_slotsync/lora answered {status}: {body}")
    out: dict[str, dict[str, dict[str, str]]] = {}
    if "ranks" in body:  # SGLang's shape
        for name in body["adapters"]:
            out[name] = {tp: sums[name] for tp, sums in body["ranks"].items() if name in sums}
        return out
    for a in body["adapters"]:
        ident = str(a["lora_int_id"])
        out[a["lora_name"]] = {f"worker {w['index']}": w["loaded"][ident]["checksums"]
                               for w in body["workers"] if ident in w.get("loaded", {})}
    return out


def verify_adapter(engine: Any, served: str, want: dict[str, str], previous: str | None,
                   workers: int, timeout_s: float) -> tuple[bool, str]:
    """Whether every one of ``engine``'s ``workers`` workers holds exactly ``want`` (tensor
    -> sha256) under ``served`` and ``previous`` (the version served before, or None) is no
    longer served -- waiting up to ``timeout_s`` seconds for that unload, which the daemon
    makes after the round's acks; and the round's line."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = lora_state(engine)
        if previous not in state or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    bad = []
    held = state.get(served)
    if held is None:
        bad.append(f"{served} is not served (the engine serves {sorted(state) or 'nothing'})")
    else:
        if len(held) != workers:
            bad.append(f"{len(held)} of {workers} workers hold {served}")
        for worker, sums in held.items():
            diff = sorted(n for n in want.keys() | sums.keys() if sums.get(n) != want.get(n))
            if diff:
                bad.append(f"{worker}: {len(diff)} tensors differ (e.g. {diff[0]})")
    if previous in state:
        bad.append(f"{previous} still served {timeout_s:.0f} s after the round")
    if bad:
        return False, "MISMATCH: " + "; ".join(bad)
    gone = f", {previous} unloaded" if previous else ""
    return True, (f"checksums equal on {plural(workers, 'worker')} ({len(want)} tensors as "
                  f"read there){gone}")

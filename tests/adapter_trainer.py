"""A scripted trainer rank that publishes LoRA adapters (issue 36) through a real ``Publisher``
(``publish_adapter``, ``protocol/rank/adapters/round.py``), and base weights between them, in
a pooled rank process (``rank_pool.RankPool``: ``trainer_script.run_rank`` hands a script with
an ``"adapter"`` key here) or a spawned one (``spawned_ranks.run_ranks(target=...)``).

``script["adapter"]`` is a list of rounds, each a dict:

* ``kind``: ``"adapter"`` (default) or ``"base"`` (``publish`` of the family's base weights,
  version ``v<version>``: ``lora_plans.llama_weights(version)`` for ``family`` ``"vllm"``,
  ``make_tensors(version)`` for ``"sglang"``);
* ``version``: the adapter's version (its tensors are :func:`adapter_tensors` of it);
* ``lora``: the adapter's name (default ``"math"``); ``r``: its LoRA rank (default
  :data:`R`); ``seed``: the tensors' seed (default: the version);
* ``layout``: ``"rows"`` (each tensor split in rows over the slot's ranks: :func:`my_part`)
  or ``"one"`` (rank ``holder``, default 0, holds every tensor; the others ``{}``);
* ``delay_s``: sleep that long before the call;
* faults, on this rank: ``stall_before_data`` (after ``Ack(adapter_begin)``, report
  ``{"event": "stalling", "round": k, "at": "before_data"}`` and sleep that many seconds
  before sending ``AdapterData``), ``stall_after_data`` (the same after sending it,
  ``"at": "after_data"``), ``hold_data_until`` (a file: ``AdapterData`` waits for it, at most
  30 s), ``wait_for_file`` (the call itself waits for that file, at most 60 s), ``bad``:
  ``"base_weight"`` (the part also holds a base-model weight, :data:`BASE_WEIGHT`) or
  ``"dtype"`` (a complex64 tensor, :data:`BAD_DTYPE`): the call raises ``ValueError`` before
  its begin.

``script["family"]``: ``"vllm"`` (the default: float32 tensors of ``lora_plans``' tiny Llama,
what the vLLM-code and reference engines load) or ``"sglang"`` (bf16 ``lora_adapters``).
``script["register_delay_s"]``: sleep that long before registering; ``script[
"register_after_file"]``: register only once that file exists (at most 60 s: a rank that
starts after the others acted); ``script["close_after_file"]``:
the publisher is closed (its connection too) only once that file exists (at most 60 s), as
in a trainer that goes on after a round's error. ``script["sigterm_exits"]``:
SIGTERM raises ``SystemExit(143)`` (a trainer's handler, as the demo's ranks have); each wait
of the publisher on the daemon is reported first (``{"event": "waiting", "phase"}``).

Reports (``trainer_script``'s events): ``registered``; per round ``{"event": "round",
"round": k, "status": "ok", "served_name", "transport", "nbytes", "update_id"}`` or
``trainer_script.error_round``'s error (with ``code``, the ``SlotsyncError``'s; a ``ValueError``
or ``TypeError`` of the call, or an interrupt, reported with its type and, for an interrupt,
its whole traceback with its notes as ``message``: the interrupt is raised again, and ends
the process); ``exit``.
"""

from __future__ import annotations

import time
from typing import Any

R = 8  # the adapters' LoRA rank: under the engines' --max-lora-rank (vLLM 16, SGLang 8)
BASE_WEIGHT = "base_model.model.model.layers.0.self_attn.q_proj.weight"
"""A base-model weight's name (``bad="base_weight"``): not a LoRA tensor."""
BAD_DTYPE = "base_model.model.model.layers.0.self_attn.q_proj.lora_X.lora_A.weight"
"""``bad="dtype"``: a LoRA tensor of a dtype the wire has not (complex64)."""


def adapter_tensors(family: str, version: int, r: int = R, seed: int | None = None
                    ) -> dict[str, Any]:
    """The trainer's whole adapter of version ``version`` (PEFT names -> tensors): float32
    for the vLLM family (the tiny Llama's dtype: vLLM's ``lora_dtype="auto"`` keeps the
    bytes), bf16 for SGLang's."""
    seed = version if seed is None else seed
    if family == "sglang":
        from lora_adapters import make_adapter

        return make_adapter(seed, r=r)
    import torch
    from lora_plans import lora_tensors

    return lora_tensors(r=r, seed=seed, dtype=torch.float32)


def adapter_config(family: str, r: int = R) -> dict[str, Any]:
    """The PEFT config every rank sends with those tensors."""
    if family == "sglang":
        from lora_adapters import config

        return config(r=r)
    from lora_plans import peft_config

    return peft_config(r=r)


def my_part(tensors: dict[str, Any], rank: int, size: int, layout: str, holder: int = 0
            ) -> tuple[dict[str, Any], dict[str, tuple[int, tuple[int, ...]]] | None]:
    """Rank ``rank``'s part of ``tensors`` (slot ranks ``0..size-1``) and its ``rows``:
    ``"rows"``: rows ``[k n / size, (k+1) n / size)`` of each tensor of ``n`` >= ``size`` rows
    (a smaller one whole on rank 0), as ``lora_plans.split_plan`` cuts; ``"one"``: all on
    ``holder``."""
    if layout == "one":
        return (dict(tensors) if rank == holder else {}), None
    part, rows = {}, {}
    for name, t in tensors.items():
        n = t.shape[0]
        if n < size:
            if rank == 0:
                part[name] = t
            continue
        a, b = rank * n // size, (rank + 1) * n // size
        part[name] = t[a:b]
        rows[name] = (a, tuple(t.shape))
    return part, rows


def run_adapter_rank(rank, endpoint, slot, engine_url, packed, script, results):
    """Body of one adapter rank (module docstring); ``slot`` is ``(start, count)``."""
    from trainer_script import (
        error_round,
        event,
        hold_on,
        register_or_report,
        slotsync_error_round,
    )

    from slotsync.protocol import wire
    from slotsync.protocol.errors import SlotsyncError
    from slotsync.testing.ranks import rank_publisher

    family = script.get("family", "vllm")
    pub = rank_publisher(endpoint, rank, slot, engine_url, packed=packed,
                         staging_bytes=1 << 20, timeout_s=script.get("timeout_s", 30.0),
                         liveness_s=script.get("liveness_s", 10.0))
    current: dict[str, Any] = {}
    send = pub._send

    def traced_send(msg: Any) -> None:  # (the faults' points, around AdapterData)
        k = current.get("round")
        step = current.get("step", {})
        if isinstance(msg, wire.AdapterData):
            if step.get("hold_data_until"):
                hold_on(30, step["hold_data_until"])
            if step.get("stall_before_data"):
                results.put(event("stalling", rank, round=k, at="before_data"))
                time.sleep(step["stall_before_data"])
        send(msg)
        if isinstance(msg, wire.AdapterData) and step.get("stall_after_data"):
            results.put(event("stalling", rank, round=k, at="after_data"))
            time.sleep(step["stall_after_data"])

    pub._send = traced_send
    if script.get("sigterm_exits"):
        import signal

        def _term(_sig: int, _frame: object) -> None:
            raise SystemExit(143)

        signal.signal(signal.SIGTERM, _term)
        real_wait = pub._waits.wait

        def reported_wait(awaited: Any) -> Any:
            results.put(event("waiting", rank, round=current.get("round"),
                              phase=awaited.phase))
            return real_wait(awaited)

        pub._waits.wait = reported_wait
    time.sleep(script.get("register_delay_s", 0))
    if script.get("register_after_file"):
        hold_on(60, script["register_after_file"])
    try:
        if not register_or_report(pub, rank, results):
            return
        for k, step in enumerate(script["adapter"], 1):
            current.update(round=k, step=step)
            time.sleep(step.get("delay_s", 0))
            if step.get("wait_for_file"):
                hold_on(60, step["wait_for_file"])
            version = step["version"]
            try:
                if step.get("kind", "adapter") == "base":
                    if family == "sglang":
                        from slotsync.testing.tensors import make_tensors

                        named = make_tensors(version)
                    else:
                        from lora_plans import llama_weights

                        named = llama_weights(version)
                    st = pub.publish(named, f"v{version}")
                    results.put(event("round", rank, round=k, status="ok", what="base",
                                      chunks=st.chunks, nbytes=st.bytes))
                    continue
                r = step.get("r", R)
                tensors = adapter_tensors(family, version, r, step.get("seed"))
                part, rows = my_part(tensors, rank - slot[0], slot[1],
                                     step.get("layout", "rows"), step.get("holder", 0))
                if step.get("bad") in ("base_weight", "dtype"):
                    import torch

                    part[BASE_WEIGHT if step["bad"] == "base_weight" else BAD_DTYPE] = (
                        torch.zeros(4, 4, dtype=torch.complex64 if step["bad"] == "dtype"
                                    else torch.float32))
                st = pub.publish_adapter(step.get("lora", "math"), part,
                                         adapter_config(family, r), version, rows=rows)
                results.put(event("round", rank, round=k, status="ok", what="adapter",
                                  served_name=st.served_name, transport=st.transport,
                                  nbytes=st.nbytes, update_id=st.update_id))
            except SlotsyncError as e:
                results.put({**slotsync_error_round(rank, k, e), "code": e.code})
            except (ValueError, TypeError) as e:
                results.put(error_round(rank, k, phase="arguments", message=str(e),
                                        error_type=type(e).__name__))
            except BaseException as e:
                import traceback

                results.put(error_round(rank, k, phase="interrupted", message="".join(
                    traceback.format_exception(e)), error_type=type(e).__name__))
                raise
    finally:
        if script.get("close_after_file"):  # (a trainer that goes on after an error)
            hold_on(60, script["close_after_file"])
        pub.close()
        results.put(event("exit", rank))

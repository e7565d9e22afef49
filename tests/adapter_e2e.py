"""What the end-to-end adapter suites share (issue 36: ``tests/integration/
test_adapter_rounds_e2e.py``, ``tests/faults/test_adapter_faults.py``): the engines with LoRA
on (the vLLM family -- the reference engine and the vLLM-code engine, vLLM 0.32's own LoRA
routers and worker LoRA manager over a tiny Llama -- and the SGLang-code engine, SGLang
0.5.23's own LoRA code on 2 TP ranks), adapter rounds run by pooled rank processes calling
``Publisher.publish_adapter`` (``tests/adapter_trainer.py``), and the checks: what each
engine holds, as the sha256 of each tensor it read (its test-only ``/_slotsync/lora``),
against the trainer's tensors; what it lists; what the daemon's ``/status`` and adapter folder
hold; that nothing is left in ``/dev/shm`` or mapped by the daemon.

The engines and the readers of what they hold serve the tests whose ranks speak the wire by
hand too (``tests/integration/test_adapter_daemon_engines.py``,
``test_adapter_daemon_sglang.py``, ``test_sglang_lora.py``), which had copies of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from adapter_trainer import R, adapter_tensors
from engines import EngineBox, model_file
from rank_pool import RankPool, RankRun, job
from state_readers import slot_status, wait_for

from slotsync.protocol.wire import logical_gpu_uuid
from slotsync.testing.procfs import shm_segments

SLOT = (0, 2)  # (start, count): two ranks, one engine of two workers / TP ranks
KEY = (0, 2)  # the slot's /status key (start, end)
VLLM_LORA = {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2, "max_cpu_loras": 4}
SGLANG_LORA = {"sglang_version": "0.5.23", "enable_lora": True, "max_lora_rank": R,
               "lora_target_modules": "all"}
SGLANG_UUIDS = [logical_gpu_uuid(0), logical_gpu_uuid(1)]
VLLM_FAMILY = [pytest.param("reference", id="reference"),
               pytest.param("vllm", id="vllm-code", marks=pytest.mark.vllm)]
"""The vLLM family's engines as a fixture's params: the reference engine, and the vLLM-code
engine where vLLM is importable (marked ``vllm``)."""
FAST = ["--begin-timeout-s", "4", "--chunk-timeout-s", "4", "--commit-timeout-s", "4",
        "--engine-timeout-s", "10"]
"""Daemon deadlines for rounds that wait on a rank that never comes (seconds)."""


def vllm_family_box(impl: str, lora: dict | None = None) -> EngineBox:
    """An engine of the vLLM family (``impl`` ``"reference"`` or ``"vllm"``) serving the tiny
    Llama of ``lora_plans`` with 2 workers, LoRA on (``lora`` None: :data:`VLLM_LORA`; ``{}``:
    off)."""
    from lora_plans import llama_weights

    return EngineBox(2, impl_name=impl, model=model_file(llama_weights()),
                     lora=VLLM_LORA if lora is None else lora, startup_timeout_s=300.0)


def sglang_box(lora: dict | None = None) -> EngineBox:
    """The SGLang-code engine, TP 2, LoRA on (``lora`` None: :data:`SGLANG_LORA`)."""
    return EngineBox(2, impl_name="sglang", gpu_uuids=SGLANG_UUIDS,
                     sglang=SGLANG_LORA if lora is None else lora)


def family_of(box: EngineBox) -> str:
    return "sglang" if box.is_sglang else "vllm"


# ------------------------------------------------------------------------------ rounds


def start(pool: RankPool, d: Any, box: EngineBox, scripts: list[list[dict]],
          extra: list[dict] | None = None) -> RankRun:
    """Rank ``i`` of :data:`SLOT` runs ``scripts[i]`` (``adapter_trainer``'s rounds), with
    ``extra[i]``'s script keys (``register_delay_s``)."""
    return pool.start(d.endpoint, [
        job(i, SLOT, box.url, True, adapter=steps, family=family_of(box),
            **(extra[i] if extra else {}))
        for i, steps in enumerate(scripts)])


def run_rounds(pool: RankPool, d: Any, box: EngineBox, *steps: dict,
               timeout_s: float = 90.0) -> RankRun:
    """Both ranks run the same ``steps``; returns the finished run."""
    run = start(pool, d, box, [list(steps), list(steps)])
    run.wait(timeout_s)
    return run


def results(run: RankRun, rank: int) -> list[dict]:
    return run.rounds(rank)


def assert_ok(run: RankRun, d: Any, n: int) -> list[dict]:
    """Both ranks' ``n`` rounds succeeded; returns rank 0's results."""
    for r in (0, 1):
        got = run.rounds(r)
        assert [e["status"] for e in got] == ["ok"] * n, (
            [e.get("message") for e in got], d.log_tail(3000))
    return run.rounds(0)


def error_of(run: RankRun, rank: int, k: int = 1) -> dict:
    """Rank ``rank``'s result of round ``k``, which must be the daemon's error (not the
    rank's own timeout)."""
    (e,) = [x for x in run.rounds(rank) if x["round"] == k]
    assert e["status"] == "error" and e["error_type"] == "SlotsyncError", e
    return e


# ------------------------------------------------------------------------------ engines


def trainer_sums(family: str, version: int, r: int = R) -> dict[str, str]:
    """sha256 of each tensor of the trainer's adapter of ``version`` (whole tensors)."""
    from lora_plans import sha

    return {n: sha(t) for n, t in adapter_tensors(family, version, r).items()}


def lora_state(box: EngineBox) -> dict:
    status, body = box.request("GET", "/_slotsync/lora")
    assert status == 200, body
    return body


def served(box: EngineBox) -> set[str]:
    """The adapters the engine lists in ``GET /v1/models`` (the family's own reader)."""
    if box.is_sglang:
        from slotsync.daemon.sglang.adapters import served_adapters
    else:
        from slotsync.daemon.vllm.adapters import served_adapters
    status, body = box.request("GET", "/v1/models")
    assert status == 200, body
    return served_adapters(body)


def held_sums(box: EngineBox, name: str) -> list[dict[str, str]]:
    """Each worker's (TP rank's) sha256 of each tensor of adapter ``name`` as it read them:
    vLLM's ``LoRAModel`` in each worker's cache (by the name's int id), SGLang's host copy
    on each TP rank. A worker without it gives ``{}``."""
    state = lora_state(box)
    if box.is_sglang:
        return [state["ranks"].get(f"tp{r}", {}).get(name, {}) for r in range(2)]
    ids = {a["lora_name"]: a["lora_int_id"] for a in state["adapters"]}
    key = str(ids.get(name))
    return [w["loaded"].get(key, {}).get("checksums", {}) for w in state["workers"]]


def assert_holds(box: EngineBox, name: str, family: str, version: int) -> None:
    """Every worker of the engine holds exactly the trainer's tensors of ``version``."""
    want = trainer_sums(family, version)
    for i, sums in enumerate(held_sums(box, name)):
        assert sums == want, f"worker {i}: {name} differs from the trainer's v{version}"


def lora_route_calls(box: EngineBox) -> dict[str, int]:
    """How often the engine's load / unload routes were called (``route_counts``)."""
    counts = box.stats().get("route_counts", {})
    return {k: v for k, v in counts.items() if "lora_adapter" in k}


def unload_all(box: EngineBox) -> None:
    """Unload every adapter the engine lists (between tests sharing it); clear faults."""
    if not box.alive():
        box.start_again()
        return
    box.request("POST", "/_slotsync/fault", {"clear": True})
    route = "/unload_lora_adapter" if box.is_sglang else "/v1/unload_lora_adapter"
    for name in served(box):
        box.request("POST", route, {"lora_name": name})
    box.reset()


# ------------------------------------------------------------------------------ daemon


def adapters_of(d: Any) -> list[tuple[str, str]]:
    """``[(served_name, state)]`` of the slot's ``/status`` ``adapters``."""
    return [(a["served_name"], a["state"]) for a in slot_status(d, KEY)["adapters"]]


def slot_folder(d: Any) -> Path:
    """The daemon's adapter folder of :data:`SLOT` (``<runtime_dir>/adapters/slot-0-2``)."""
    return Path(d.runtime_dir) / "adapters" / f"slot-{KEY[0]}-{KEY[1]}"


def folders(d: Any) -> list[str]:
    """The entries of the slot's adapter folder (temp folders included), sorted."""
    p = slot_folder(d)
    return sorted(os.listdir(p)) if p.exists() else []


def mapped_segments(pid: int) -> list[str]:
    """The ``/dev/shm/slotsync-*`` segments process ``pid`` maps or holds open."""
    out = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            out |= {line.split()[-1] for line in f if "/dev/shm/slotsync-" in line}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/slotsync-"):
                out.add(target)
    except OSError:
        return []
    return sorted(out)


def assert_nothing_left(d: Any, run: RankRun) -> None:
    """No segment of the run's ranks is left in ``/dev/shm`` (the killed ones' too, which
    their resource trackers unlink) and the daemon maps or holds none."""
    pids = [run.pid(r) for r in run.procs]
    assert wait_for(lambda: not shm_segments(pids), 10), shm_segments(pids)
    assert mapped_segments(d.proc.pid) == []

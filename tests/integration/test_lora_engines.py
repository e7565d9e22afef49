"""The LoRA routes of the engines the daemon is tested against (issue 36): the reference
engine (``engine/reference/lora.py``) and the vLLM-code engine (``engine/vllm/lora.py``:
vLLM's own LoRA router, ``OpenAIServingModels``, and on every worker vLLM's own
``LRUCacheWorkerLoRAManager`` -> ``PEFTHelper`` / ``LoRAModel.from_local_checkpoint``), each
loading folders written by the daemon's ``write_adapter_folder`` from two ranks' parts.

Each test runs against both engines and checks what ``docs/lora-vllm-notes.md`` says vLLM
does: a load is listed in ``/v1/models`` and every worker holds the trainer's exact bytes; the
same name twice, a missing folder, a rank above ``--max-lora-rank`` and a module the model
lacks are refused with vLLM's statuses and texts; unload leaves the workers' caches alone;
``--max-cpu-loras`` evicts, a base-weight finish empties the caches, and the next request of
an adapter reads its folder again -- and, with the folder gone, kills the engine; the faults
(a 400, a worker failing, the engine dying mid-load); the route missing without
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, and a load without ``--enable-lora``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from engines import model_file, start_engine  # noqa: E402
from lora_plans import (  # noqa: E402
    TARGETS,
    llama_weights,
    lora_tensors,
    peft_config,
    reader,
    sha,
    split_plan,
)

from slotsync.daemon.vllm.adapters import (  # noqa: E402
    START_WITH_ENABLE_LORA,
    load_body,
    load_error_text,
    lora_limits,
    served_adapters,
    unload_body,
    write_adapter_folder,
)

pytestmark = pytest.mark.slow

IMPLS = [pytest.param("reference", id="reference"),
         pytest.param("vllm", id="vllm-code", marks=pytest.mark.vllm)]
LORA = {"enable_lora": True, "max_lora_rank": 16, "max_loras": 1, "max_cpu_loras": 2}


def _engine(impl: str, lora: dict | None = LORA, env: dict | None = None, **kw):
    named = llama_weights()
    return start_engine(2, impl_name=impl, model=model_file(named), lora=lora, env=env,
                        startup_timeout_s=300.0, **kw)


@pytest.fixture(scope="module", params=IMPLS)
def shared(request: pytest.FixtureRequest) -> Iterator:
    eng = _engine(request.param)
    try:
        yield eng
    finally:
        eng.stop()


@pytest.fixture
def eng(shared) -> Iterator:
    """The module's engine of this impl, with no adapter listed and no fault once done
    (and, on vLLM's code, no worker reply left unread: see ``test_a_failed_load_...``)."""
    yield shared
    assert not any(shared.request("GET", "/_slotsync/stats")[1].get("unread_replies") or ())
    shared.request("POST", "/_slotsync/fault", {"clear": True})
    for name in served_adapters(shared.request("GET", "/v1/models")[1]):
        shared.request("POST", "/v1/unload_lora_adapter", unload_body(name))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path


def _write(root: Path, version: int, *, r: int = 8, seed: int | None = None,
           targets=TARGETS, config: dict | None = None) -> tuple[str, Path, dict]:
    """Version ``version`` of adapter ``math`` from two ranks' parts: (served name, folder,
    the trainer's tensors)."""
    tensors = lora_tensors(r=r, seed=version if seed is None else seed, dtype=torch.float32,
                           targets=targets)
    plan, buffers, _ = split_plan(tensors, config or peft_config(r=r, targets=targets),
                                  lora_name="math", version=version, ranks=2)
    return plan.served_name, write_adapter_folder(root, plan, reader(buffers)), tensors


def _state(eng) -> dict:
    status, body = eng.request("GET", "/_slotsync/lora")
    assert status == 200, body
    return body


def _held(eng) -> list[set[int]]:
    """Each worker's cached adapters (int ids)."""
    return [{int(k) for k in w["loaded"]} for w in _state(eng)["workers"]]


def _id(eng, name: str) -> int:
    return next(a["lora_int_id"] for a in _state(eng)["adapters"] if a["lora_name"] == name)


def _base_round(eng) -> None:
    """An empty base-weight round: init, start, finish (vLLM's finish resets LoRA state)."""
    for route, body in [("/init_weight_transfer_engine", {"init_info": {"packed": False}}),
                        ("/start_weight_update", {}), ("/finish_weight_update", {})]:
        status, got = eng.request("POST", route, body)
        assert status == 200, (route, got)


def _wait_exit(eng, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while eng.proc.poll() is None:
        assert time.monotonic() < deadline, "the engine did not exit"
        time.sleep(0.1)
    return eng.proc.returncode


def test_load_is_listed_and_every_worker_holds_the_trainers_bytes(eng, root) -> None:
    """v1 and v2 loaded side by side (new int ids), both listed; every worker's checksums
    of each are the trainer's; ``/server_info`` says LoRA with rank 16; unloading v1 takes it
    off the list but leaves it in the workers' caches (vLLM's unload calls no worker)."""
    limits = lora_limits(eng.request("GET", "/server_info?config_format=json")[1])
    assert limits.enabled and limits.max_lora_rank == 16, limits
    v1, f1, t1 = _write(root, 1)
    v2, f2, t2 = _write(root, 2)
    for name, folder in ((v1, f1), (v2, f2)):
        status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(name, folder))
        assert (status, body) == (200, f"Success: LoRA adapter '{name}' added successfully.")
    assert served_adapters(eng.request("GET", "/v1/models")[1]) == {v1, v2}
    id1, id2 = _id(eng, v1), _id(eng, v2)
    assert id2 == id1 + 1
    for w in _state(eng)["workers"]:
        assert w["loaded"][str(id1)]["checksums"] == {k: sha(v) for k, v in t1.items()}
        assert w["loaded"][str(id2)]["checksums"] == {k: sha(v) for k, v in t2.items()}
    status, body = eng.request("POST", "/v1/unload_lora_adapter", unload_body(v1))
    assert (status, body) == (200, f"Success: LoRA adapter '{v1}' removed successfully.")
    assert served_adapters(eng.request("GET", "/v1/models")[1]) == {v2}
    assert _held(eng) == [{id1, id2}] * 2


@pytest.mark.parametrize("impl", IMPLS)
def test_refusals_have_vllms_statuses_and_texts(impl, root) -> None:
    """The same name twice: 400; no folder: 404 (vLLM's handler, not the missing route);
    rank 32 above --max-lora-rank 16 and a module the model lacks: 500 with vLLM's texts;
    an unknown name to unload: 404. Nothing is listed or cached after. (vLLM's code with
    ``--executor-replies all``: each of these fails on every worker, which with vLLM's own
    reply handling leaves replies unread, ``test_a_failed_load_leaves_...``.)"""
    eng = _engine(impl, **({"executor_replies": "all"} if impl == "vllm" else {}))
    try:
        _refusals(eng, root)
    finally:
        eng.stop()


def _refusals(eng, root: Path) -> None:
    v1, f1, _ = _write(root, 1)
    assert eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1))[0] == 200
    status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1))
    assert status == 400 and "has already been loaded" in body["error"]["message"], body
    held = _held(eng)
    status, body = eng.request("POST", "/v1/load_lora_adapter",
                               load_body("math@v9", root / "math@v9"))
    assert status == 404 and body["error"]["type"] == "NotFoundError", body
    assert "VLLM_ALLOW" not in load_error_text(status, body["error"]["message"])
    big, fbig, _ = _write(root, 3, r=32)
    status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(big, fbig))
    assert status == 500, body
    assert "LoRA rank 32 is greater than max_lora_rank 16" in body["error"]["message"], body
    odd_root = root / "odd"
    odd_root.mkdir()
    odd, fodd, _ = _write(odd_root, 4, targets=("q_proj",))
    named = shutil.copytree(fodd, root / "rename")
    text = (named / "adapter_model.safetensors").read_bytes().replace(b"q_proj", b"x_proj")
    (named / "adapter_model.safetensors").write_bytes(text)
    status, body = eng.request("POST", "/v1/load_lora_adapter", load_body("odd@v1", named))
    assert status == 500 and "expected target modules" in body["error"]["message"], body
    status, body = eng.request("POST", "/v1/unload_lora_adapter", unload_body("nope@v1"))
    assert status == 404 and "cannot be found" in body["error"]["message"], body
    assert served_adapters(eng.request("GET", "/v1/models")[1]) == {v1}
    assert _held(eng) == held


def test_eviction_and_a_base_finish_make_the_next_request_read_the_folder(eng, root) -> None:
    """--max-cpu-loras 2: a third load evicts the least recently used adapter, which stays
    listed; a request of it reads its folder again. A base-weight finish empties every
    cache (reset_lora_state); the next request of an adapter reads its folder again."""
    names = [_write(root, v) for v in (1, 2, 3)]
    for name, folder, _ in names:
        status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(name, folder))
        assert status == 200, body
    ids = [_id(eng, n) for n, _, _ in names]
    assert _held(eng) == [{ids[1], ids[2]}] * 2  # (v1 evicted)
    assert served_adapters(eng.request("GET", "/v1/models")[1]) == {n for n, _, _ in names}
    loads = [w["loads"] for w in _state(eng)["workers"]]
    status, body = eng.request("POST", "/_slotsync/lora/use", {"lora_name": names[0][0]})
    assert status == 200, body
    state = _state(eng)
    assert [w["loads"] for w in state["workers"]] == [n + 1 for n in loads]
    assert _held(eng) == [{ids[0], ids[2]}] * 2  # (v1 read again, v2 evicted)
    assert all(w["loaded"][str(ids[0])]["checksums"] == {k: sha(v) for k, v in
                                                         names[0][2].items()}
               for w in state["workers"])
    resets = [w["resets"] for w in state["workers"]]
    _base_round(eng)
    state = _state(eng)
    assert [w["resets"] for w in state["workers"]] == [n + 1 for n in resets]
    assert _held(eng) == [set()] * 2
    assert served_adapters(eng.request("GET", "/v1/models")[1]) == {n for n, _, _ in names}
    assert eng.request("POST", "/_slotsync/lora/use", {"lora_name": names[2][0]})[0] == 200
    assert _held(eng) == [{ids[2]}] * 2
    status, body = eng.request("POST", "/_slotsync/lora/use", {"lora_name": "nope@v1"})
    assert status == 404, body


@pytest.mark.parametrize("impl", IMPLS)
def test_a_removed_folder_kills_the_engine_at_the_next_request(impl, root) -> None:
    """After a base-weight finish dropped it from the workers, a request of an adapter
    whose folder is gone makes its worker fail inside the step: the engine dies (vLLM's
    engine core does; what the daemon's folder lifetime must prevent)."""
    eng = _engine(impl)
    try:
        v1, f1, _ = _write(root, 1)
        assert eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1))[0] == 200
        _base_round(eng)
        shutil.rmtree(f1)
        status, body = eng.request("POST", "/_slotsync/lora/use", {"lora_name": v1})
        assert status == 500 and "EngineCore encountered an issue" in str(body), body
        assert _wait_exit(eng) != 0
        assert "No adapter found for" in eng.log_tail(20000)
    finally:
        eng.stop()


@pytest.mark.parametrize("impl", IMPLS)
def test_faults_a_400_a_worker_failing_and_death_mid_load(impl, root) -> None:
    """A ``workers: null`` 400 answers vLLM's error shape before any worker; a worker
    failing inside ``add_lora`` is a 500 naming its message; neither lists nor caches the
    adapter. ``exit: true``: the engine dies once the workers got the load, unanswered."""
    eng = _engine(impl)
    try:
        v1, f1, _ = _write(root, 1)
        eng.request("POST", "/_slotsync/fault", {"route": "load_lora_adapter", "status": 400,
                                                 "message": "refused by the test"})
        status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1))
        assert status == 400 and body["error"]["message"] == "refused by the test", body
        assert [w["loads"] for w in _state(eng)["workers"]] == [0, 0]
        eng.request("POST", "/_slotsync/fault", {"route": "load_lora_adapter", "workers": [1],
                                                 "message": "worker 1 broke"})
        status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1))
        assert status == 500 and "worker 1 broke" in body["error"]["message"], body
        assert served_adapters(eng.request("GET", "/v1/models")[1]) == set()
        assert _held(eng)[1] == set()
        eng.request("POST", "/_slotsync/fault", {"route": "load_lora_adapter", "exit": True,
                                                 "hang_s": 0.5})
        with pytest.raises(OSError):
            eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1), timeout=60)
        assert _wait_exit(eng) != 0
    finally:
        eng.stop()


@pytest.mark.parametrize("impl", IMPLS)
def test_without_runtime_updating_or_without_lora(impl, root) -> None:
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING=0``: no load route (FastAPI's 404), which the
    daemon's texts and ``lora_limits`` name; without ``--enable-lora``: ``lora_limits``
    says so and a load fails on the workers with vLLM's "LoRA is not enabled"."""
    v1, f1, _ = _write(root, 1)
    eng = _engine(impl, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    try:
        status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1))
        assert (status, body) == (404, {"detail": "Not Found"})
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in load_error_text(status, body["detail"])
        limits = lora_limits(eng.request("GET", "/server_info?config_format=json")[1])
        assert not limits.enabled and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in limits.flag(
            "enabled")
    finally:
        eng.stop()
    eng = _engine(impl, lora=None)
    try:
        limits = lora_limits(eng.request("GET", "/server_info?config_format=json")[1])
        # (the family's instruction, as limits_refusal quotes it: "start the vLLM server
        # with the flag --enable-lora")
        assert not limits.enabled and limits.flag("enabled") == START_WITH_ENABLE_LORA
        status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1))
        assert status == 500, body
        assert "LoRA is not enabled. Use --enable-lora" in body["error"]["message"], body
        assert "--enable-lora" in load_error_text(status, body["error"]["message"])
    finally:
        eng.stop()


@pytest.mark.vllm
def test_a_failed_load_leaves_vllms_replies_out_of_step(root) -> None:
    """vLLM's ``MultiprocExecutor`` reads the workers' replies in rank order and raises at
    the first failure (vLLM gh-58242): a load that fails on both workers (no folder) leaves
    worker 1's reply queued, and the next call reads it as its own: the daemon's reply
    check (``CHECK_REPLIES``, the call it makes after a worker's failure) gets the stale
    failure, and the replies stay one call behind on worker 1 -- so a later load's 200 is
    the check's reply, not the load's. An adapter round must treat a failed load on a
    multi-worker vLLM as a failed weight call (check the replies, out of step until a
    restart)."""
    from slotsync.daemon.core.engine_session import CHECK_REPLIES, replies_in_step

    eng = _engine("vllm")
    try:
        v1, f1, _ = _write(root, 1)
        status, _ = eng.request("POST", "/v1/load_lora_adapter",
                                load_body("math@v9", root / "math@v9"))
        assert status == 404
        assert eng.request("GET", "/_slotsync/stats")[1]["unread_replies"] == [0, 1]
        status, body = eng.request("POST", "/collective_rpc", CHECK_REPLIES)
        assert status == 500 and "math@v9" in str(body), body
        assert not replies_in_step(body, 2)
        assert eng.request("GET", "/_slotsync/stats")[1]["unread_replies"] == [0, 1]
        status, body = eng.request("POST", "/v1/load_lora_adapter", load_body(v1, f1))
        assert status == 200, body  # (worker 1's answer read here is the check's)
        assert eng.request("GET", "/_slotsync/stats")[1]["unread_replies"] == [0, 1]
    finally:
        eng.stop()

"""Issue 14 on one GPU: 8 trainer ranks into one 8-GPU engine slot (8 logical GPU UUIDs on
cuda:0) whose workers load every update through **vLLM's own receive path**
(``--receive vllm``: ``IPCWeightTransferEngine.update_weights`` -- its
``parse_update_info``, ``receive_weights`` and ``PackedBufferImporter`` mapping our CUDA IPC
handles), from the installed vllm or from the shim ``python tools/vllm_shim.py
build/vllm-shim`` writes (carried to a GPU machine without the vllm wheel).

* packed with 1 staging region (vLLM's own producer's layout), packed with 4, and unpacked:
  8 rounds each; every worker's checksums equal the trainers' tensors; the trainers' CUDA
  memory is flat (nothing left allocated after any round but the first's small gather-table
  cache);
* an engine restarted at the same URL between two rounds is initialised again by the daemon
  and the next round succeeds.

Skips without CUDA, or when neither vllm nor the shim imports."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engines import port_free  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from trainer_script import make_tensors  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import checksums_by_worker, tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402
from slotsync.protocol.wire import logical_gpu_uuid  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
RANKS = 8
ROUNDS = 8
MODES = {  # name: (packed, staging regions)
    "packed, 1 region": (True, 1),
    "packed, 4 regions": (True, 4),
    "unpacked": (False, 4),
}


@pytest.fixture(scope="module")
def vllm_env() -> dict[str, str]:
    from slotsync.engine.reference.vllm_receive import receive_env

    env = receive_env(ROOT / "build" / "vllm-shim")
    if env is None:
        pytest.skip("vllm.distributed.weight_transfer.ipc_engine is not importable (no vllm; "
                    "run python tools/vllm_shim.py build/vllm-shim where vllm is installed)")
    return env


def _engine(env: dict[str, str], port: int | None = None) -> ReferenceEngine:
    return ReferenceEngine(workers=RANKS, device="cuda",
                           gpu_uuids=[logical_gpu_uuid(i) for i in range(RANKS)],
                           cuda_devices=[0] * RANKS, receive="vllm", env=env, port=port,
                           startup_timeout_s=300.0)


def _assert_checksums(eng: ReferenceEngine, k: int) -> None:
    want = {n: tensor_checksum(t) for n, t in make_tensors(k)}
    status, body = eng.request("POST", "/weight_checker", {"action": "checksum"})
    assert status == 200, body
    by_worker = checksums_by_worker(body)
    assert sorted(by_worker) == sorted(logical_gpu_uuid(i) for i in range(RANKS))
    for worker, sums in by_worker.items():
        assert {n: sums.get(n) for n in want} == want, f"worker {worker} differs"
    assert eng.request("GET", "/weight_info")[1]["weight_version"] == f"v{k}"


def test_eight_ranks_eight_rounds_through_vllms_receive_path(vllm_env):
    with _engine(vllm_env) as eng, DaemonProcess() as d:
        for i, (name, (packed, regions)) in enumerate(MODES.items()):
            first = 1 + i * ROUNDS
            script = {"rounds": ROUNDS, "cuda": True, "first_round": first,
                      "staging_buffers": regions}
            t0 = time.monotonic()
            ev = run_ranks(d, eng.url, packed, [script] * RANKS, timeout_s=400)
            for r in range(RANKS):
                assert [e["status"] for e in rounds(ev, r)] == ["ok"] * ROUNDS, (name, ev[r])
            _assert_checksums(eng, first + ROUNDS - 1)
            left = [e for r in ev for e in ev[r] if e["event"] == "cuda_left"]
            assert len(left) == RANKS * ROUNDS, (name, left)
            # flat: no round after the first leaves anything allocated; the first may keep
            # the gather kernel's small table cache (packed), found again later
            assert all(e["bytes"] == 0 for e in left if e["round"] > first), (name, left)
            assert all(e["bytes"] < (1 << 20) for e in left), (name, left)
            stats = eng.request("GET", "/_slotsync/stats")[1]
            assert all(w["receive"] == "vllm" for w in stats["workers"]), stats["workers"]
            print(f"{name}: {ROUNDS} rounds x {RANKS} ranks through vLLM's receive path in "
                  f"{time.monotonic() - t0:.1f} s; checksums equal on {RANKS} workers; "
                  f"CUDA memory left per round (rank 0): "
                  f"{[e['bytes'] for e in left if e['rank'] == 0]}")
        slot = d.status()["slots"][0]
        assert slot["updates_succeeded"] == ROUNDS * len(MODES) and slot["state"] == "idle"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_engine_restarted_at_the_same_url_is_initialised_again(vllm_env, packed):
    eng = _engine(vllm_env)
    try:
        with DaemonProcess() as d:
            ev = run_ranks(d, eng.url, packed, [{"rounds": 1, "cuda": True}] * RANKS,
                           timeout_s=300)
            assert all([e["status"] for e in rounds(ev, r)] == ["ok"] for r in range(RANKS)), ev
            port = eng.port
            eng.stop()
            deadline = time.monotonic() + 20
            while not port_free(port) and time.monotonic() < deadline:
                time.sleep(0.1)
            eng = _engine(vllm_env, port=port)  # default weights, version, never initialised
            ev = run_ranks(d, eng.url, packed,
                           [{"rounds": 1, "cuda": True, "first_round": 2}] * RANKS,
                           timeout_s=300)
            for r in range(RANKS):
                assert [e["status"] for e in rounds(ev, r)] == ["ok"], (r, ev[r], d.log_tail(3000))
            _assert_checksums(eng, 2)
            slot = d.status()["slots"][0]
            assert slot["engine_calls"]["init_weight_transfer_engine"] == 2, slot
            assert "engine_session_new" in d.log_tail(20000)
            print(f"restart between rounds ({'packed' if packed else 'unpacked'}): new "
                  "session seen, initialised again, round 2 ok, checksums equal")
    finally:
        eng.stop()

"""Issue 26 E, and the GPU proof of issue 26 C: slotsyncd drives an SGLang-code engine on one
GPU through SGLang's own receive code, and no staging memory goes back to a trainer before
SGLang's copies out of it finished.

The engine is ``python -m slotsync.engine --impl sglang --device cuda``: each TP rank a worker
process on ``cuda:0`` that reads its payload entry with SGLang 0.5.23's
``normalize_serialized_named_tensor_payloads``, ``MultiprocessingSerializer.deserialize``
(``SafeUnpickler``) and ``FlattenedTensorBucket``, rebuilds each CUDA tensor through SGLang's
``_rebuild_cuda_tensor_modified`` and torch's ``rebuild_cuda_tensor`` (a real CUDA IPC
mapping of the trainer rank's memory), copies into its parameters on a non-default stream
that is current for the worker's life (SGLang's scheduler runs its whole event loop inside
``StreamContext(schedule_stream)``, ``srt/managers/scheduler.py`` L1159 / L2008, 0.5.23), and
frees the received tensors where the engine's SGLang version does (0.5.20: before the TP
barrier; 0.5.21+: after it, docs/sglang-contract.md 5.2). SGLang's code comes from the
installed sglang or from the shim ``python tools/sglang_shim.py build/sglang-shim`` writes
(``SLOTSYNC_SGLANG_SHIM``; the GPU machine has no sglang); the module skips when neither
imports. Several TP ranks on one GPU answer to logical GPU UUIDs
(``wire.logical_gpu_uuid``): each worker's ``torch.cuda.get_device_properties(0).uuid`` is
its own logical UUID (``slotsync.engine.cuda_standin``, the one stand-in), so SGLang's
``_device_from_maybe_uuid`` maps it to ``cuda:0``; the TP=1 test uses the GPU's real UUID
and nothing is patched.

* (a) several rounds, packed and unpacked, SGLang 0.5.23 (sessions) and 0.5.20: after each
  round every TP rank's checksums equal the trainers' tensors and the version is set;
  TP=1 under the GPU's real UUID;
* (b) the garbage test: every trainer rank overwrites each chunk's memory with ``0xFF``
  bytes the instant it reads that chunk's ``Ack`` (``tests/garbage_on_ack.py``), while the
  engine's copies are slowed (``torch.cuda._sleep`` queued on the copy stream before each
  copy: :data:`SLOW_CYCLES` on TP ranks >= 1, a quarter of it on rank 0), so that an ack
  that came before the copies finished would load garbage; 1, 2 and 3 staging regions
  (1 region: every chunk waits for the previous one's ack, i.e. for the daemon's proving
  call on 0.5.21+); checksums equal after every round;
* (c) the negative control: the same, with an engine that reports 0.5.20 (so the daemon
  acknowledges each chunk on its own reply) but frees after the barrier as 0.5.21+ does
  (``--free-received after-barrier``), TP ranks >= 1 slowed: the checksums of a slowed rank
  must differ (rank 0, which frees before it replies, stays right) -- the garbage test
  detects a premature ack;
* (d) the torch property the fence rests on (docs/sglang-contract.md 5.2): freeing the last
  reference to a received CUDA-IPC storage synchronizes the consumer's current stream
  (``tests/ipc_free_probe.py``), so a torch that drops it fails here loudly.

Each test prints its figures (round seconds, ack lag: seconds from a chunk's send to its ack
as the trainer rank saw them, proving calls); docs/gpu/h200-runs.txt holds a run's output.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import ipc_free_probe  # noqa: E402
from engines import model_file  # noqa: E402
from garbage_on_ack import garbage_rank  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from trainer_script import make_tensors, run_rank  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402
from slotsync.protocol.wire import logical_gpu_uuid  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "build" / "sglang-shim"
SHIM_ENV = "SLOTSYNC_SGLANG_SHIM"
TP = 4
ROUNDS = 3
SLOW_CYCLES = 400_000_000
"""GPU clock cycles of ``torch.cuda._sleep`` queued before each copy on a slowed TP rank:
about 0.2 s at the H200's 1.98 GHz, far more than a reply, an ack and a garbage fill take
(milliseconds), so an early ack is caught."""
SGLANG_MODULES = ("sglang.srt.utils.common", "sglang.srt.utils.patch_torch",
                  "sglang.srt.weight_sync.tensor_bucket", "sglang.srt.utils.msgspec_utils",
                  "sglang.srt.utils.auth")


@pytest.fixture(scope="module")
def shim_env() -> dict[str, str]:
    """``{SHIM_ENV: build/sglang-shim}`` when the shim imports, ``{}`` when this
    interpreter's own sglang does (no shim built); else the module skips."""
    code = "import " + ", ".join(SGLANG_MODULES)
    tries = ([{SHIM_ENV: str(SHIM)}] if SHIM.is_dir() else []) + [{}]
    for extra in tries:
        env = {**os.environ, **extra}
        if extra:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             timeout=300)
        if out.returncode == 0:
            return extra
    pytest.skip("SGLang's receive code is not importable (no sglang; run python "
                "tools/sglang_shim.py build/sglang-shim where sglang is installed)")


def _engine(env: dict[str, str], version: str, *, tp: int = TP, real_uuid: bool = False,
            sleep: list[int] | None = None, free_received: str | None = None
            ) -> ReferenceEngine:
    uuids = ([str(torch.cuda.get_device_properties(0).uuid)] if real_uuid
             else [logical_gpu_uuid(i) for i in range(tp)])
    opts: dict = {"sglang_version": version}
    if sleep is not None:
        opts["copy_sleep_cycles"] = ",".join(str(c) for c in sleep)
    if free_received is not None:
        opts["free_received"] = free_received
    return ReferenceEngine(workers=tp, impl="sglang", model=str(model_file()), device="cuda",
                           gpu_uuids=uuids, cuda_devices=[0] * tp, env=env,
                           startup_timeout_s=300.0, sglang=opts)


def _checksums(eng: ReferenceEngine) -> dict[int, dict[str, str]]:
    """Every TP rank's ``{name: checksum}`` (the engine's ``POST /_slotsync/checksums``,
    ``{"tp<r>": {...}}``)."""
    status, body = eng.request("POST", "/_slotsync/checksums")
    assert status == 200, body
    return {int(r.removeprefix("tp")): sums for r, sums in body.items()}


def _wrong_ranks(eng: ReferenceEngine, k: int, tp: int = TP) -> list[int]:
    """The TP ranks whose checksums differ from round ``k``'s tensors."""
    want = {n: tensor_checksum(t) for n, t in make_tensors(k)}
    by_rank = _checksums(eng)
    assert sorted(by_rank) == list(range(tp)), by_rank
    return [r for r, sums in sorted(by_rank.items()) if {n: sums.get(n) for n in want} != want]


def _round(d: DaemonProcess, eng: ReferenceEngine, k: int, packed: bool, *, tp: int = TP,
           garbage: bool = False, regions: int = 4, real_uuid: bool = False
           ) -> dict[int, list[dict]]:
    """One round ``k`` from ``tp`` fresh trainer ranks; asserts every rank's round is ok."""
    script = {"rounds": 1, "cuda": True, "first_round": k, "staging_buffers": regions,
              "timeout_s": 120.0}
    if real_uuid:
        script["gpu_uuid"] = "real"
    ev = run_ranks(d, eng.url, packed, [script] * tp, timeout_s=300,
                   target=garbage_rank if garbage else run_rank)
    for r in range(tp):
        assert [e["status"] for e in rounds(ev, r)] == ["ok"], (r, ev[r], d.log_tail(3000))
    return ev


def _acks(ev: dict[int, list[dict]]) -> list[dict]:
    return [e for r in ev for e in ev[r] if e["event"] == "garbage"]


def _calls(d: DaemonProcess) -> dict[str, int]:
    return dict(d.status()["slots"][0]["engine_calls"])


# -- (d) ---------------------------------------------------------------------------------------


def test_freeing_a_received_cuda_ipc_tensor_waits_for_the_current_stream():
    """docs/sglang-contract.md 5.2, in two processes: the consumer's ``del`` of the last
    reference to a received tensor waits for its current stream -- also while the mapping of
    the producer's allocation stays open, and then only for the current stream; see
    ``ipc_free_probe``."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    tensors, results = ctx.Queue(), ctx.Queue()
    sources = []
    for case in ipc_free_probe.CASES:
        if case in ipc_free_probe.PAIRED:  # two 4 MiB tensors: one 20 MiB allocator segment
            pair = [torch.ones(1 << 20, device="cuda") for _ in range(2)]
            segments = [(s["address"], s["address"] + s["total_size"])
                        for s in torch.cuda.memory_snapshot()]
            assert any(lo <= pair[0].data_ptr() < hi and lo <= pair[1].data_ptr() < hi
                       for lo, hi in segments), "the pair is not in one allocation"
            sources += pair
        else:
            sources.append(torch.ones(1 << 26, device="cuda"))  # 256 MiB, its own segment
    p = ctx.Process(target=ipc_free_probe.consumer, args=(tensors, results, 2 * SLOW_CYCLES))
    p.start()
    try:
        for t in sources:
            tensors.put(t)
        out = results.get(timeout=120)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    del sources
    torch.cuda.ipc_collect()
    print(f"torch {torch.__version__}: was the copy (queued behind {2 * SLOW_CYCLES} cycles "
          f"of _sleep) done right after it was issued / after the del, and how long the del "
          f"took: {out}")
    assert not any(c["issued"] for c in out.values()), out  # where SGLang's reply would be
    for case in ("freed", "mapping_shared"):
        assert out[case]["after"], f"{case}: freeing the tensor did not wait: {out}"
        assert out[case]["del_s"] > 0.1, out  # it waited for the queued sleep
    assert not out["view_kept"]["after"], out  # a surviving view: no free, no wait
    # the deleter's sync is of the current stream only (the mapping's close aside)
    assert not out["mapping_shared_other_stream"]["after"], out


# -- (a) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.23", "0.5.20"])
def test_rounds_land_on_every_tp_rank(shim_env, version):
    with _engine(shim_env, version) as eng, DaemonProcess() as d:
        k = 0
        for packed in (True, False):
            t0 = time.monotonic()
            for _ in range(ROUNDS):
                k += 1
                _round(d, eng, k, packed)
                assert _wrong_ranks(eng, k) == [], f"round {k}"
                assert eng.request("GET", "/model_info")[1]["weight_version"] == f"v{k}"
            print(f"SGLang {version}, {'packed' if packed else 'unpacked'}: {ROUNDS} rounds x "
                  f"{TP} TP ranks on cuda:0 in {time.monotonic() - t0:.1f} s; checksums equal "
                  f"on every TP rank after each round; engine calls {_calls(d)}")
        stats = eng.request("GET", "/_slotsync/stats")[1]
        assert all(w["device"] == "cuda:0" and w["parser"] == "sglang" and w["uuid_standin"]
                   and w["copy_stream"] for w in stats["workers"]), stats["workers"]
        if shim_env:
            assert all(w["sglang_file"].startswith(str(SHIM)) for w in stats["workers"])
        slot = d.status()["slots"][0]
        assert slot["updates_succeeded"] == 2 * ROUNDS and slot["state"] == "idle"


def test_one_tp_rank_under_the_gpus_real_uuid(shim_env):
    """SGLang's UUID lookup unmodified: the GPU's own UUID, no stand-in in the worker."""
    with _engine(shim_env, "0.5.23", tp=1, real_uuid=True) as eng, DaemonProcess() as d:
        for k, packed in ((1, True), (2, False)):
            _round(d, eng, k, packed, tp=1, real_uuid=True)
            assert _wrong_ranks(eng, k, tp=1) == [], f"round {k}"
        w = eng.request("GET", "/_slotsync/stats")[1]["workers"][0]
        assert w["uuid_standin"] is False, w
        print(f"TP=1 under the real UUID {w['gpu_uuid']}: 2 rounds, checksums equal")


# -- (b) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.23", "0.5.20"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_garbage_on_every_ack_never_reaches_the_engine(shim_env, version, packed):
    sleep = [SLOW_CYCLES // 4] + [SLOW_CYCLES] * (TP - 1)
    with _engine(shim_env, version, sleep=sleep) as eng, DaemonProcess() as d:
        lags, t0 = [], time.monotonic()
        for k, regions in enumerate((1, 2, 3), start=1):
            ev = _round(d, eng, k, packed, garbage=True, regions=regions)
            acks = _acks(ev)
            chunks = {r: next(e["chunks"] for e in rounds(ev, r)) for r in range(TP)}
            assert len(acks) == sum(chunks.values()), (acks, chunks)  # every ack spoiled
            assert all(a["bytes"] > 0 for a in acks), acks
            lags += [a["lag_s"] for a in acks]
            assert _wrong_ranks(eng, k) == [], f"round {k} ({regions} regions): garbage landed"
        calls = _calls(d)
        print(f"garbage test, SGLang {version}, {'packed' if packed else 'unpacked'}: 3 rounds "
              f"(1, 2, 3 staging regions) x {TP} TP ranks, copies slowed {sleep} cycles, in "
              f"{time.monotonic() - t0:.1f} s; every chunk's memory overwritten at its ack "
              f"({len(lags)} acks); checksums equal on every TP rank after each round; ack lag "
              f"(chunk sent -> its ack) median {statistics.median(lags):.3f} s, max "
              f"{max(lags):.3f} s; engine calls {calls}")
        if version != "0.5.20":
            assert calls.get("prove_copies", 0) > 0, calls  # 1 region needs the proving call


# -- (c) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_garbage_test_catches_an_ack_before_the_copies(shim_env, packed):
    sleep = [0] + [SLOW_CYCLES] * (TP - 1)
    with _engine(shim_env, "0.5.20", sleep=sleep, free_received="after-barrier") as eng, \
            DaemonProcess() as d:
        wrong = {}
        for k, regions in enumerate((1, 2), start=1):
            _round(d, eng, k, packed, garbage=True, regions=regions)
            wrong[k] = _wrong_ranks(eng, k)
        print(f"negative control ({'packed' if packed else 'unpacked'}): engine reports "
              f"0.5.20 but frees after the barrier, TP ranks >= 1 slowed {SLOW_CYCLES} cycles: "
              f"TP ranks whose checksums differ, per round: {wrong}")
        assert all(0 not in w for w in wrong.values()), wrong  # rank 0 frees, then replies
        assert all(w for w in wrong.values()), f"a premature ack went unnoticed: {wrong}"

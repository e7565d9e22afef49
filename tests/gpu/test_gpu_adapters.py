"""Issue 36 A on the GPU: trainer ranks on CUDA call the real ``Publisher.publish_adapter``
(``protocol/rank/adapters/``) with CUDA tensors of a LoRA adapter of Qwen3-8B's shapes at rank
32 (q/k/v/o/gate/up/down of 36 layers, bf16: 174.6 MB), through a real slotsyncd, into

* (a) the SGLang-code engine (``--impl sglang --enable-lora``; one TP rank per GPU, up to 4,
  each under its GPU's own UUID, trainer rank ``r`` on ``cuda:<r>``): the daemon's
  ``Ack(adapter_begin)`` names transport ``"device"``, the rank exports its packed device
  buffer (CUDA IPC), the daemon writes the ``/load_lora_adapter_from_tensors`` body and every
  TP rank runs SGLang's own ``TpModelWorker.load_lora_adapter_from_tensors`` on it
  (``SafeUnpickler``, SGLang's CUDA rebuild over torch's ``rebuild_cuda_tensor``,
  ``FlattenedTensorBucket``, the ``expected_checksums`` check; its code from
  ``build/sglang-shim``, which carries the engine's LoRA code: ``tools/sglang_shim.py``). TP
  ranks >= 1 are slowed (``--copy-sleep-cycles``: ``torch.cuda._sleep`` queued before
  SGLang's method reads the trainer's memory), so an ``Ack(adapter_data)`` that came when TP
  rank 0 alone answered would hand the memory back too early.
  Why not 4 TP ranks on one GPU under logical UUIDs, as ``test_gpu_sglang.py`` runs base
  weights: an adapter's tensors go from one trainer rank to every TP rank, and SGLang's
  ``_device_from_maybe_uuid`` (``srt/utils/patch_torch.py``) in TP rank ``r`` finds only the
  UUID its one device answers (the stand-in's logical UUID ``r``), so another rank's tensors
  are an "Invalid device_uuid" there and the engine dies (the H200's second call: the engine
  went away mid-load; the cause read from the code, its log was not kept). On one GPU the
  test so runs TP=1 under the real UUID (nothing patched); ``test_gpu_sglang_lora.py`` shows
  4 TP ranks of SGLang's receive code taking one trainer's memory under the real UUID;
* (b) the reference engine with vLLM's LoRA routes (``--enable-lora``, 2 workers on
  ``cuda:0``): transport ``"host"``: the rank's one device-to-host copy into a /dev/shm
  segment, which the daemon reads into the adapter folder it owns
  (``<runtime dir>/adapters/slot-0-2/qwen3@v<k>``), and every worker reads the folder as
  vLLM's ``LRUCacheWorkerLoRAManager`` does (its shapes checked against the model's layer-0
  modules, which have Qwen3-8B's shapes; the other layers' modules are not in the model file,
  whose size would otherwise be 16 GB).

Each engine gets version 1, then version 2 replacing it (loaded beside v1, then v1
unloaded). After each round: every TP rank's / worker's checksums of the served version equal
the trainer's (sha256 of the tensors' bytes as the trainer holds them); every rank's part was
overwritten with ``0xFF`` the moment it read the Ack (``adapter_gpu_rank``: the garbage test of
the base-weight fence applied to adapter memory) and the engine's copies are unchanged; each
rank's GPU holds no byte beyond its tensors once ``publish_adapter`` returned (the device
buffer freed, and with CUDA IPC the export's reference count back at zero, else torch's IPC
limbo would keep it). After the test: nothing of slotsync's left in /dev/shm.

The layouts: SGLang takes each tensor whole from one rank (``daemon/sglang/adapters.py``
``refusal``): v1 from rank 0 alone (one holder: a flattened bucket), v2 spread over the
ranks (with several: a dict of views); the vLLM path takes any layout: v1 with every tensor
split in rows over both ranks, v2 spread. Each test prints its figures (per rank: bytes,
seconds, and of them copy, digest, waits for the two Acks); docs/gpu/h200-runs.txt holds a
run's output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import adapter_gpu_rank as ranks  # noqa: E402
from engines import model_file  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402
from slotsync.protocol.wire import logical_gpu_uuid  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "build" / "sglang-shim"
SHIM_ENV = "SLOTSYNC_SGLANG_SHIM"
DEVICE = "cuda"
LAYERS = 36
TP = max(1, min(4, torch.cuda.device_count()))
SLOW_CYCLES = 400_000_000
"""About 0.2 s of ``torch.cuda._sleep`` at the H200's 1.98 GHz before a slowed TP rank reads
the trainer's memory: far more than an Ack and a 0xFF fill of 175 MB take."""
TIMEOUT_S = 240
NAME = ranks.LORA_NAME


@pytest.fixture(scope="module")
def shim_env() -> dict[str, str]:
    """``{SHIM_ENV: build/sglang-shim}`` when the shim's SGLang LoRA code compiles, ``{}``
    when this interpreter's own sglang does; else the SGLang test skips."""
    code = ("from slotsync.engine.sglang.payload import use_shim_path; use_shim_path(); "
            "import types; from slotsync.engine.sglang import lora_code; "
            "lora_code.rank(lambda: types.SimpleNamespace(tp_rank=0, dp_size=1)); "
            "lora_code.tokenizer(lambda: None, lambda: None); "
            "from sglang.srt.lora.lora_registry import LoRARegistry")
    tries = ([{SHIM_ENV: str(SHIM)}] if SHIM.is_dir() else []) + [{}]
    why = []
    for extra in tries:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **extra},
                             capture_output=True, text=True, timeout=300)
        if out.returncode == 0:
            return extra
        why.append(out.stderr.strip().splitlines()[-1:])
    pytest.skip(f"SGLang's LoRA code is not available ({why}; no sglang? run python "
                "tools/sglang_shim.py build/sglang-shim where sglang is installed)")


@pytest.fixture
def shm_clean() -> Iterator[None]:
    """Nothing of slotsync's left in /dev/shm after the test (ranks, daemon and engine
    gone)."""
    before = set(os.listdir("/dev/shm"))
    yield
    left = sorted(n for n in set(os.listdir("/dev/shm")) - before if "slotsync" in n)
    assert not left, f"left in /dev/shm: {left}"


class Trainers:
    """``n`` trainer ranks (``adapter_gpu_rank.adapter_rank``), one round per :meth:`round`."""

    def __init__(self, n: int, d: DaemonProcess, url: str, devices: list[str],
                 gpu_uuid: str | None = "logical") -> None:
        import torch.multiprocessing as mp

        self.n = n
        ctx = mp.get_context("spawn")
        self.answers = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=ranks.adapter_rank, args=(
            r, n, d.endpoint, url, devices[r], LAYERS, self.commands[r], self.answers,
            gpu_uuid)) for r in range(n)]
        for p in self.procs:
            p.start()

    def round(self, version: int, layout: str) -> tuple[dict[int, dict], float]:
        """Every rank publishes its part of ``version``; their reports, and the wall time
        from the commands to the last report."""
        t0 = time.monotonic()
        for q in self.commands:
            q.put((version, layout))
        got: dict[int, dict] = {}
        while len(got) < self.n:
            msg = self.answers.get(timeout=TIMEOUT_S)
            assert msg[0] != "crash", msg[2]
            assert msg[0] == "round" and msg[2] == version, msg
            got[msg[1]] = msg[3]
        return got, time.monotonic() - t0

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
        assert [p.exitcode for p in self.procs] == [0] * self.n


def _check_ranks(reports: dict[int, dict], version: int, transport: str) -> dict[str, str]:
    """Each rank's report of round ``version`` (module docstring); the trainer's sums."""
    for r, rep in reports.items():
        assert rep["served_name"] == f"{NAME}@v{version}", (r, rep["served_name"])
        assert rep["transport"] == transport, (r, rep["transport"])
        assert rep["left"] == 0, f"rank {r} still holds {rep['left']} B after the round"
        if rep["part_tensors"]:
            # Every byte the transport used was spoiled, or sealed (host: the daemon may
            # have linked the segment; the rank holds no mapping of it any more).
            assert rep["nbytes"] > 0 and rep["garbage"] + rep["sealed"] >= rep["nbytes"], (r, rep)
        else:
            assert rep["garbage"] == rep["sealed"] == 0, (r, rep)
    assert sum(rep["part_tensors"] for rep in reports.values()) > 0
    return reports[0]["sums"]


def _figures(what: str, reports: dict[int, dict], wall: float) -> str:
    per = "; ".join(
        f"rank {r}: {rep['tensors']} tensors {rep['nbytes'] / 1e6:.1f} MB over "
        f"{rep['transport']} in {rep['seconds']:.3f} s (copy {rep['copy_seconds']:.3f}, "
        f"digest {rep['digest_seconds']:.3f}, begin wait {rep['begin_wait_seconds']:.3f}, "
        f"data wait {rep['data_wait_seconds']:.3f}), held after {rep['left_now']} B"
        for r, rep in sorted(reports.items()))
    return f"{what}: round {wall:.2f} s wall; {per}"


def _until(check: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return got


def _adapters(d: DaemonProcess) -> list[tuple[str, str]]:
    return [(a["served_name"], a["state"]) for a in d.status()["slots"][0]["adapters"]]


# -- (a) SGLang: CUDA IPC ------------------------------------------------------------------


def test_sglang_engine_gets_the_adapter_by_cuda_ipc_on_every_tp_rank(shim_env, shm_clean):
    opts: dict[str, Any] = {"sglang_version": "0.5.23", "enable_lora": True,
                            "max_lora_rank": ranks.R, "lora_target_modules": "all"}
    if DEVICE == "cuda":
        opts["copy_sleep_cycles"] = ",".join(str(c) for c in [0] + [SLOW_CYCLES] * (TP - 1))
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(TP)]
        devices, rank_uuid = [f"cuda:{i}" for i in range(TP)], None
    else:
        uuids = [logical_gpu_uuid(i) for i in range(TP)]
        devices, rank_uuid = [DEVICE] * TP, "logical"
    with ReferenceEngine(workers=TP, impl="sglang", model=str(model_file()), device=DEVICE,
                         gpu_uuids=uuids, cuda_devices=list(range(TP)) if DEVICE == "cuda"
                         else None, env=shim_env, startup_timeout_s=300.0, sglang=opts) as eng, \
            DaemonProcess() as d:
        def state() -> dict[str, Any]:
            status, body = eng.request("GET", "/_slotsync/lora")
            assert status == 200, body
            return body

        trainers = Trainers(TP, d, eng.url, devices, rank_uuid)
        try:
            lines = []
            for version, layout in ((1, "one"), (2, "spread")):
                reports, wall = trainers.round(version, layout)
                sums = _check_ranks(reports, version, "device")
                served = f"{NAME}@v{version}"
                _until(lambda s=served: state()["adapters"] == [s], f"only {served} listed")
                _until(lambda s=served: all(list(v) == [s] for v in state()["ranks"].values()),
                       f"every TP rank holding {served} alone")
                # the Ack came after every TP rank's copies: the 0xFF fill missed them all
                assert state()["ranks"] == {f"tp{r}": {served: sums} for r in range(TP)}
                _until(lambda s=served: _adapters(d) == [(s, "served")], "the daemon's status")
                lines.append(_figures(f"SGLang v{version} ({layout})", reports, wall))
            calls = dict(d.status()["slots"][0]["engine_calls"])
            # (TP=1: SGLang's reply proves the copies; else one proving call a round)
            assert calls.get("prove_adapter_copies") == (2 if TP > 1 else None), calls
            stats = eng.request("GET", "/_slotsync/stats")[1]
            if shim_env:
                assert all(w["sglang_file"].startswith(str(SHIM)) for w in stats["workers"])
        except BaseException:
            print(f"engine log tail:\n{eng.log_tail(6000)}\ndaemon log tail:\n{d.log_tail()}")
            raise
        finally:
            trainers.close()
        mb = sum(r["nbytes"] for r in reports.values()) / 1e6
        print(f"adapter {NAME} r={ranks.R}, {LAYERS} layers, ~{mb:.1f} MB bf16 -> SGLang-code "
              f"engine, {TP} TP ranks on {DEVICE} (ranks >= 1 slowed {SLOW_CYCLES} cycles); "
              f"checksums equal on every TP rank after each round and after the 0xFF fill; "
              f"engine calls {calls}")
        for line in lines:
            print(line)


# -- (b) vLLM's routes: the host path ------------------------------------------------------


def _layer0_model() -> Path:
    """A model file holding Qwen3-8B's layer-0 linear modules (zeros, bf16: 386 MB)."""
    from sglang_lora_gpu import QWEN3_8B

    h, inter, q, kv = QWEN3_8B["hidden"], QWEN3_8B["inter"], QWEN3_8B["q"], QWEN3_8B["kv"]
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    return model_file([(f"model.layers.0.{k}.weight", torch.zeros(s, dtype=torch.bfloat16))
                       for k, s in shapes.items()])


def test_reference_engine_gets_the_adapter_through_the_daemons_folder(shm_clean):
    lora = {"enable_lora": True, "max_lora_rank": ranks.R, "max_loras": 1, "max_cpu_loras": 2}
    uuids = [logical_gpu_uuid(i) for i in range(2)]
    with ReferenceEngine(workers=2, model=str(_layer0_model()), device=DEVICE,
                         gpu_uuids=uuids, cuda_devices=[0, 0] if DEVICE == "cuda" else None,
                         lora=lora, startup_timeout_s=300.0) as eng, \
            DaemonProcess() as d:
        def served() -> set[str]:
            status, body = eng.request("GET", "/v1/models")
            assert status == 200, body
            return {c["id"] for c in body["data"] if c.get("parent")}

        def workers_hold(name: str) -> list[dict[str, str]]:
            status, st = eng.request("GET", "/_slotsync/lora")
            assert status == 200, st
            ids = [a["lora_int_id"] for a in st["adapters"] if a["lora_name"] == name]
            return [w["loaded"].get(str(ids[0]), {}).get("checksums", {}) if ids else {}
                    for w in st["workers"]]

        trainers = Trainers(2, d, eng.url, [f"{DEVICE}:0" if DEVICE == "cuda" else DEVICE] * 2)
        slot = Path(d.runtime_dir) / "adapters" / "slot-0-2"
        try:
            lines = []
            for version, layout in ((1, "rows"), (2, "spread")):
                reports, wall = trainers.round(version, layout)
                sums = _check_ranks(reports, version, "host")
                name = f"{NAME}@v{version}"
                _until(lambda n=name: served() == {n}, f"only {name} served")
                # the workers read the daemon's folder: the trainer's bytes, after the fill
                assert workers_hold(name) == [sums, sums]
                folder = slot / name
                assert sorted(p.name for p in folder.iterdir()) == [
                    "adapter_config.json", "adapter_model.safetensors"]
                size = (folder / "adapter_model.safetensors").stat().st_size
                _until(lambda n=name: _adapters(d) == [(n, "served")], "the daemon's status")
                lines.append(_figures(f"reference v{version} ({layout})", reports, wall)
                             + f"; folder {size / 1e6:.1f} MB")
        finally:
            trainers.close()
        print(f"adapter {NAME} r={ranks.R}, {LAYERS} layers -> reference engine (vLLM's LoRA "
              f"routes), 2 workers on {DEVICE}, transport host; every worker's checksums "
              f"equal the trainer's after each round and after the 0xFF fill")
        for line in lines:
            print(line)

"""Issue 36 B on the GPU: a LoRA adapter of Qwen3-8B's shapes at rank 32 (q/k/v/o/gate/up/down,
``lora_A`` and ``lora_B``, 36 layers, bf16: 174.6 MB) goes from trainer ranks' GPU memory, by
CUDA IPC, through the daemon's ``/load_lora_adapter_from_tensors`` body
(``daemon/sglang/adapters.py``) into SGLang's own receive code on every TP rank, and no
rank's memory goes back before every TP rank has copied it.

Processes (``tests/sglang_lora_gpu.py``): one or two trainer ranks on ``cuda:0`` (each its part
in one buffer, exported once with ``reduce_tensor``), four SGLang TP ranks on ``cuda:0``, each
running SGLang's ``TpModelWorker.load_lora_adapter_from_tensors`` (``lora_code.receive``: from
the installed sglang, or ``tools/sglang_shim.py``'s copy of ``tp_worker.py`` in
``build/sglang-shim``) -- ``SafeUnpickler``, ``_rebuild_cuda_tensor_modified`` over torch's
real ``rebuild_cuda_tensor`` (the trainer's GPU UUID, unpatched lookup), the bucket, the
``expected_checksums`` check -- with a model runner that keeps ``.cpu()`` of every tensor
(``LoRAAdapter._process_weight``). This test is the daemon: it writes the body, JSON and
base64 as the client sends it, normalized as SGLang's tokenizer does, and acknowledges as the
daemon's rule says (``adapters.py``): once every TP rank is done (the proving call's
collective; the reply alone proves TP rank 0 only).

* ``test_adapter_lands_on_every_tp_rank_and_the_garbage_misses_it`` (one holder: a flattened
  bucket; two holders: a dict of views): every TP rank's copies have the trainers' sha256
  (SGLang's own check passed on each); the trainers overwrite their buffers with ``0xFF``
  the moment they read the Ack, and every rank's copies are unchanged; after the trainers
  drop their buffers and ``ipc_collect()``, they hold no byte more than before (the IPC
  reference count came back to zero: ``adapter_pickle.py``'s one real counter per handle).
  TP ranks >= 1 are slowed (:data:`SLOW_CYCLES` of ``torch.cuda._sleep`` before their
  copies) so that an early Ack would be caught.
* ``test_an_ack_after_rank_0_only_loads_garbage`` (negative control): the Ack sent when TP
  rank 0 is done: the slowed ranks read the garbage, and SGLang's own check refuses it
  (``[LORA-CHECK] rank<r> adapter sync MISMATCH``) -- the proving call is needed, and the
  garbage test sees its absence.
* ``test_the_real_counter_in_every_entry_keeps_the_block`` (negative control): entries
  written with the rank's counter in every TP rank's rebuild: the count ends below zero and
  the trainer's buffer stays in torch's limbo after it dropped it -- the memory check above
  can fail.

Each test prints its figures (bytes, per-rank load seconds, the garbage fill).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import msgspec  # noqa: E402
import sglang_lora_gpu as procs  # noqa: E402

from slotsync.daemon.core.adapters.plan import (  # noqa: E402
    AdapterPart,
    AdapterPlan,
    AdapterTensorPlan,
)
from slotsync.daemon.sglang.adapter_pickle import TensorAt, bucket_entry  # noqa: E402
from slotsync.daemon.sglang.adapters import load_body, proving_body  # noqa: E402
from slotsync.protocol.wire import AdapterTensor, CudaIpcHandle, part_offsets  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "build" / "sglang-shim"
SHIM_ENV = "SLOTSYNC_SGLANG_SHIM"
TP = 4
R = 32
SLOW_CYCLES = 400_000_000
"""About 0.2 s of ``torch.cuda._sleep`` at the H200's 1.98 GHz before a slowed rank's copies:
far more than an Ack and a 175 MB fill take."""
EARLY_SLOW_CYCLES = 10 * SLOW_CYCLES
"""About 2 s: the negative control's slowed ranks must still wait to copy when TP rank 0 --
which hashes and copies 175 MB first -- is done."""
TIMEOUT_S = 300
CONFIG = {"peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "lora_dropout": 0.0,
          "target_modules": list(procs.MODULES), "bias": "none", "task_type": "CAUSAL_LM"}


@pytest.fixture(scope="module")
def receive_env() -> None:
    """SGLang's receive code for this process and its children: the shim when it imports
    (``SLOTSYNC_SGLANG_SHIM``), else the installed sglang; else the module skips."""
    code = ("from slotsync.engine.sglang.payload import use_shim_path; use_shim_path(); "
            "from slotsync.engine.sglang import lora_code; import types; "
            "lora_code.receive(lambda: types.SimpleNamespace(tp_rank=0))")
    tries = ([{SHIM_ENV: str(SHIM)}] if SHIM.is_dir() else []) + [{}]
    why = []
    for extra in tries:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **extra},
                             capture_output=True, text=True, timeout=300)
        if out.returncode == 0:
            if extra:
                os.environ.update(extra)
                sys.path.insert(0, str(SHIM))
            return
        why.append(out.stderr.strip().splitlines()[-1:])
    pytest.skip(f"SGLang's tp_worker.py is not available ({why}; no sglang? run python "
                "tools/sglang_shim.py build/sglang-shim where sglang is installed)")


def _get(q: Any, kind: str, n: int) -> list[tuple]:
    """``n`` answers of ``kind`` (a ``crash`` fails the test with its traceback)."""
    out = []
    while len(out) < n:
        msg = q.get(timeout=TIMEOUT_S)
        assert msg[0] != "crash", msg[2]
        assert msg[0] in (kind, "error") or kind == "*", msg
        out.append(msg)
    return out


class Rig:
    """Four TP ranks and the trainers of one test (all stopped by :meth:`close`)."""

    def __init__(self, sleeps: list[int]) -> None:
        import torch.multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.answers = self.ctx.Queue()
        self.tp_in = [self.ctx.Queue() for _ in range(TP)]
        self.procs = [self.ctx.Process(target=procs.receiver,
                                       args=(r, sleeps[r], self.tp_in[r], self.answers))
                      for r in range(TP)]
        for p in self.procs:
            p.start()
        ups = _get(self.answers, "up", TP)
        print(f"SGLang's receive code from {ups[0][2]}")
        self.t_in: list[Any] = []

    def trainers(self, holders: list[list[str]], seed: int) -> tuple[AdapterPlan, dict, dict,
                                                                     dict]:
        """Start one trainer per list of ``holders``; the plan of their parts, their handles,
        GPU UUIDs and part sizes."""
        self.t_in = [self.ctx.Queue() for _ in holders]
        for rank, names in enumerate(holders):
            p = self.ctx.Process(target=procs.trainer,
                                 args=(rank, names, seed, R, self.t_in[rank], self.answers))
            p.start()
            self.procs.append(p)
        ready = _get(self.answers, "ready", len(holders))
        handles, uuids, totals, parts = {}, {}, {}, {}
        for _, rank, h, begin, uuid, total in ready:
            handles[rank] = msgspec.msgpack.decode(h, type=CudaIpcHandle)
            begin = msgspec.msgpack.decode(begin, type=list[AdapterTensor])
            uuids[rank], totals[rank] = uuid, total
            for t, off in zip(begin, part_offsets(begin)[0], strict=True):
                parts[t.name] = (t, AdapterPart(rank, off, t.nbytes, 0, t.shape[0], t.sha256))
        layout = procs.qwen3_layout(R)
        plan = AdapterPlan("qwen3", 1, "qwen3@v1", json.dumps(CONFIG), R, tuple(
            AdapterTensorPlan(n, "bfloat16", shape, (parts[n][1],)) for n, shape in layout),
            tuple(range(len(holders))))
        return plan, handles, uuids, totals

    def load(self, body: dict[str, Any]) -> None:
        """Send the body to every TP rank as SGLang's route hands it on: JSON with base64
        bytes (the daemon's client), decoded (``Base64Bytes``) and normalized (the
        tokenizer)."""
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        wire = json.loads(msgspec.json.encode(body))
        entries = [base64.b64decode(e, validate=True) for e in wire["serialized_named_tensors"]]
        wire["serialized_named_tensors"] = normalize_serialized_named_tensor_payloads(entries)
        fields = {k: wire[k] for k in ("lora_name", "config_dict", "serialized_named_tensors",
                                       "load_format", "expected_checksums")}
        fields["added_tokens_config"] = None
        for q in self.tp_in:
            q.put(("load", fields))

    def to_trainers(self, cmd: str) -> None:
        for q in self.t_in:
            q.put(cmd)

    def sums(self) -> dict[int, dict[str, str]]:
        for q in self.tp_in:
            q.put(("recheck", None))
        return {m[1]: m[2] for m in _get(self.answers, "sums", TP)}

    def close(self) -> None:
        for q in self.tp_in:
            q.put(("exit", None))
        for q in self.t_in:
            q.put("exit")
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()


def _holders(n: int) -> list[list[str]]:
    names = [n_ for n_, _ in procs.qwen3_layout(R)]
    return [names[i::n] for i in range(n)]


@pytest.mark.parametrize("holders", [1, 2], ids=["bucket", "dict"])
def test_adapter_lands_on_every_tp_rank_and_the_garbage_misses_it(receive_env, holders):
    rig = Rig([0] + [SLOW_CYCLES] * (TP - 1))
    try:
        plan, handles, uuids, totals = rig.trainers(_holders(holders), seed=holders)
        body = load_body(plan, handles, uuids, TP)
        assert body["load_format"] == ("flattened_bucket" if holders == 1 else None)
        assert proving_body(TP, "0.5.23") is not None  # the daemon's Ack waits for every rank
        rig.load(body)
        done = _get(rig.answers, "done", TP)
        errors = [m for m in done if m[0] == "error"]
        assert not errors, errors
        want = {t.name: t.parts[0].sha256 for t in plan.tensors}
        assert {m[1]: m[2] for m in done} == {r: want for r in range(TP)}
        rig.to_trainers("ack")  # every TP rank is done: the proving call's answer
        fills = _get(rig.answers, "overwritten", holders)
        assert rig.sums() == {r: want for r in range(TP)}  # the garbage missed every copy
        rig.to_trainers("free")
        freed = {m[1]: m[2] for m in _get(rig.answers, "freed", holders)}
        assert freed == {r: 0 for r in range(holders)}, freed  # the count came back to 0
        print(f"adapter {plan.nbytes / 1e6:.1f} MB ({len(plan.tensors)} tensors, rank {R}), "
              f"{holders} holder(s), parts {sorted(totals.values())} B, "
              f"{body['load_format'] or 'dict'}; TP ranks' load s "
              f"{[round(m[3], 3) for m in sorted(done, key=lambda m: m[1])]} (ranks >= 1 "
              f"slowed {SLOW_CYCLES} cycles); 0xFF fill s {[round(f[2], 4) for f in fills]}; "
              "checksums equal on every TP rank before and after the fill; trainers' memory "
              "back to its start after ipc_collect")
    finally:
        rig.close()


def test_an_ack_after_rank_0_only_loads_garbage(receive_env):
    rig = Rig([0] + [EARLY_SLOW_CYCLES] * (TP - 1))
    try:
        plan, handles, uuids, _ = rig.trainers(_holders(1), seed=3)
        rig.load(load_body(plan, handles, uuids, TP))
        first = rig.answers.get(timeout=TIMEOUT_S)
        assert first[:2] == ("done", 0), first  # the unslowed rank 0 answers first
        rig.to_trainers("ack")  # too early: ranks >= 1 still wait to copy
        rest = _get(rig.answers, "*", TP)  # the fill, and ranks 1..3
        results = {m[1]: m for m in rest if m[0] in ("done", "error")}
        assert len(results) == TP - 1, rest
        wrong = sorted(r for r, m in results.items() if m[0] == "error")
        print(f"negative control: Ack after TP rank 0 only; SGLang's check refused the "
              f"garbage on TP ranks {wrong}: {[results[r][2][:90] for r in wrong]}")
        assert wrong, "an early Ack went unnoticed"
        assert all(f"[LORA-CHECK] rank{r} adapter sync MISMATCH" in results[r][2]
                   for r in wrong), results
        rig.to_trainers("free")
        _get(rig.answers, "freed", 1)
    finally:
        rig.close()


def test_the_real_counter_in_every_entry_keeps_the_block(receive_env):
    rig = Rig([0] * TP)
    try:
        plan, handles, uuids, totals = rig.trainers(_holders(1), seed=4)
        body = load_body(plan, handles, uuids, TP)
        tensors = [TensorAt(t.name, t.dtype, t.shape, 0, t.parts[0].offset, t.parts[0].nbytes)
                   for t in plan.tensors]
        body["serialized_named_tensors"] = [
            bucket_entry(handles[0], uuids[0], tensors, counted=True) for _ in range(TP)]
        rig.load(body)
        assert all(m[0] == "done" for m in _get(rig.answers, "done", TP))
        rig.to_trainers("ack")
        _get(rig.answers, "overwritten", 1)
        rig.to_trainers("free")
        [(_, _, kept)] = _get(rig.answers, "freed", 1)
        print(f"negative control: the rank's counter in all {TP} entries: the trainer still "
              f"holds {kept} B after dropping its {totals[0]} B part and ipc_collect()")
        assert kept >= totals[0], kept
    finally:
        rig.close()

"""Processes of the adapter GPU test (``tests/gpu/test_gpu_sglang_lora.py``; issue 36): trainer
ranks that hand over their part of a LoRA adapter by CUDA IPC, and SGLang TP ranks that
receive it with SGLang's own ``TpModelWorker.load_lora_adapter_from_tensors`` (spawned: each
function runs in a process of its own, commands and answers over queues).

* :func:`trainer`: builds its tensors of a Qwen3-8B-shaped adapter (:func:`qwen3_adapter`) on
  ``cuda:0``, copies them into one uint8 buffer at ``wire.part_offsets``, digests each
  (sha256 of its bytes), frees the sources, exports the buffer (``cuda_ipc_handle``:
  ``reduce_tensor``, one export) and says ``ready``; at ``ack`` it overwrites the whole
  buffer with ``0xFF`` at once (the garbage test of the base-weight fence, issue 26 E); at
  ``free`` it drops the buffer, calls ``torch.cuda.ipc_collect()`` and says how many bytes it
  still holds beyond its start (0 once every consumer released its reference count: a
  count left above or below zero keeps the block in torch's IPC limbo).
* :func:`receiver`: one TP rank on ``cuda:0``, a non-default stream current for its life (as
  SGLang's scheduler runs in ``StreamContext(schedule_stream)``); at ``load`` it queues
  ``torch.cuda._sleep(sleep_cycles)`` on that stream (its copies then finish late) and runs
  SGLang's method (``lora_code.receive``: ``deserialize_own_rank``, the bucket, the
  ``expected_checksums`` check), its model runner keeping ``.cpu()`` of every tensor as
  ``LoRAAdapter._process_weight`` does; answers ``done`` with the sha256 of its host copies,
  or ``error`` with SGLang's exception; at ``recheck`` the copies' sha256 again.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch

QWEN3_8B = {"layers": 36, "hidden": 4096, "inter": 12288, "q": 4096, "kv": 1024}
"""Qwen3-8B's shapes (config.json: hidden_size 4096, intermediate_size 12288, 32 heads and 8
KV heads of head_dim 128, 36 layers)."""
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def qwen3_layout(r: int = 32, layers: int = QWEN3_8B["layers"]) -> list[tuple[str, tuple]]:
    """``[(PEFT name, shape)]`` of a rank-``r`` adapter of every linear module of Qwen3-8B:
    ``lora_A`` ``(r, in)``, ``lora_B`` ``(out, r)``."""
    h, inter, q, kv = QWEN3_8B["hidden"], QWEN3_8B["inter"], QWEN3_8B["q"], QWEN3_8B["kv"]
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    out = []
    for i in range(layers):
        for m in MODULES:
            where = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            base = f"base_model.model.model.layers.{i}.{where}.{m}"
            d_in, d_out = dims[m]
            out += [(f"{base}.lora_A.weight", (r, d_in)), (f"{base}.lora_B.weight", (d_out, r))]
    return out


def sha256_of(t: torch.Tensor) -> str:
    """SGLang's digest (tp_worker.py: ``.detach().cpu().contiguous().flatten().view(uint8)``)."""
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy()
                          .tobytes()).hexdigest()


def trainer(rank: int, names: list[str], seed: int, r: int, commands: Any, answers: Any
            ) -> None:
    """One trainer rank (module docstring); ``names``: the adapter tensors it holds."""
    try:
        import msgspec

        from slotsync.protocol.rank.export import cuda_ipc_handle, gpu_uuid_of
        from slotsync.protocol.wire import AdapterTensor, part_offsets

        torch.cuda.set_device(0)
        base = torch.cuda.memory_allocated()
        shapes = dict(qwen3_layout(r))
        g = torch.Generator(device="cuda").manual_seed(seed)
        tensors = {n: torch.randn(shapes[n], generator=g, device="cuda").to(torch.bfloat16)
                   for n in names}
        begin = [AdapterTensor(n, "bfloat16", shapes[n], 0, shapes[n][0], sha256_of(t))
                 for n, t in tensors.items()]
        offsets, total = part_offsets(begin)
        buf = torch.empty(total, dtype=torch.uint8, device="cuda")
        for t, off in zip(tensors.values(), offsets, strict=True):
            raw = t.reshape(-1).view(torch.uint8)
            buf[off:off + raw.numel()].copy_(raw)
        del tensors, t, raw
        torch.cuda.synchronize()
        handle = cuda_ipc_handle(buf)
        answers.put(("ready", rank, msgspec.msgpack.encode(handle),
                     msgspec.msgpack.encode(begin), gpu_uuid_of(0), total))
        assert commands.get() == "ack"
        t0 = time.monotonic()
        buf.fill_(0xFF)  # garbage the moment the Ack is read
        torch.cuda.synchronize()
        answers.put(("overwritten", rank, time.monotonic() - t0))
        assert commands.get() == "free"
        del buf, handle
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        answers.put(("freed", rank, torch.cuda.memory_allocated() - base))
        assert commands.get() == "exit"
    except Exception:  # noqa: BLE001 - reported to the test
        answers.put(("crash", rank, traceback.format_exc()))


def receiver(tp_rank: int, sleep_cycles: int, commands: Any, answers: Any) -> None:
    """One SGLang TP rank (module docstring)."""
    try:
        from slotsync.engine.sglang.payload import use_shim_path

        use_shim_path()
        torch.cuda.set_device(0)
        stream = torch.cuda.Stream(0, priority=0)  # SGLang's schedule_stream
        torch.cuda.set_stream(stream)
        from slotsync.engine.sglang import lora_code

        code = lora_code.receive(lambda: SimpleNamespace(tp_rank=tp_rank))
        copies: dict[str, torch.Tensor] = {}

        def runner_load(ref: Any, tensors: dict, config_dict: dict, added: Any) -> str:
            copies.clear()
            copies.update({n: t.cpu() for n, t in tensors.items()})  # _process_weight
            return "loaded"

        worker = SimpleNamespace(model_runner=SimpleNamespace(
            load_lora_adapter_from_tensors=runner_load))
        for name in lora_code.TP_WORKER_METHODS:
            setattr(worker, name, getattr(code, name).__get__(worker))
        answers.put(("up", tp_rank, code.__file__))
        while True:
            cmd, fields = commands.get()
            if cmd == "exit":
                return
            if cmd == "recheck":
                answers.put(("sums", tp_rank, {n: sha256_of(t) for n, t in copies.items()}))
                continue
            ref = SimpleNamespace(lora_id="id", lora_name=fields["lora_name"])
            req = SimpleNamespace(**fields, lora_id="id", to_ref=lambda ref=ref: ref)
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)  # on the current stream: the copies wait
            t0 = time.monotonic()
            try:
                worker.load_lora_adapter_from_tensors(req)
            except Exception as e:  # noqa: BLE001 - SGLang's scheduler exception
                answers.put(("error", tp_rank, f"{type(e).__name__}: {e}"))
                continue
            answers.put(("done", tp_rank, {n: sha256_of(t) for n, t in copies.items()},
                         time.monotonic() - t0))
    except Exception:  # noqa: BLE001 - reported to the test
        answers.put(("crash", tp_rank, traceback.format_exc()))

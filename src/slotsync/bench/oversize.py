"""``python -m slotsync.bench.oversize``: a packed round with a tensor larger than the staging
region (issue 17 C) against today's way (staging raised so that the tensor fits), in one run.

A Qwen3-1.7B-shaped state dict (Hugging Face names and shapes: vocabulary 151,936, hidden
2,048, 28 layers, 16 query / 8 key-value heads of 128, MLP 6,144, bf16; the embedding of
151,936 x 2,048 is 622 MB, and tied, so it is also the output layer) lives on ``cuda:0`` in
this process, which publishes it with one ``Publisher`` (one rank, one engine slot of one
GPU) through a real ``slotsyncd`` into a reference engine worker that loads every chunk through
**vLLM's own receive path** (``--receive vllm``: ``IPCWeightTransferEngine`` with
``packed_ipc_consumer`` and ``PackedBufferImporter``; the shim where vllm is not installed).

Configurations, same process, same tensors, measured one after the other:

* ``oversize``: ``--staging-mb`` (default 512 MiB) staging: the embedding goes as a chunk of its
  own exporting its own memory;
* ``today``: ``--baseline-staging-mb`` (default 1,024 MiB) staging, so that the embedding fits
  a region (what a user had to do before issue 17).

Per configuration: seconds per round (median of ``--rounds`` after ``--warmup`` rounds,
begin to the commit's ack) and the trainer side's peak GPU memory beyond the model
(``torch.cuda.max_memory_allocated`` minus the model's bytes, over the measured rounds). The
last round's checksums of every tensor on the engine are compared with the trainer's.
``--device cpu`` runs the same path over shared memory with a smaller model (a dry run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from slotsync.bench.report import refuse_without_cuda

MiB = 1 << 20


@dataclass(frozen=True)
class DenseConfig:
    """A Qwen3 dense model's shapes (Qwen3-1.7B's defaults)."""

    vocab: int = 151936
    hidden: int = 2048
    layers: int = 28
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 6144


def qwen3_dense_shapes(c: DenseConfig) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of a Qwen3 dense checkpoint in HF names, tied embeddings (no
    ``lm_head.weight``: Qwen3-1.7B ties it to the embedding)."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c.vocab, c.hidden))]
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    for i in range(c.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (c.hidden,)),
            (p + "self_attn.q_proj.weight", (q, c.hidden)),
            (p + "self_attn.k_proj.weight", (kv, c.hidden)),
            (p + "self_attn.v_proj.weight", (kv, c.hidden)),
            (p + "self_attn.o_proj.weight", (c.hidden, q)),
            (p + "self_attn.q_norm.weight", (c.head_dim,)),
            (p + "self_attn.k_norm.weight", (c.head_dim,)),
            (p + "post_attention_layernorm.weight", (c.hidden,)),
            (p + "mlp.gate_proj.weight", (c.intermediate, c.hidden)),
            (p + "mlp.up_proj.weight", (c.intermediate, c.hidden)),
            (p + "mlp.down_proj.weight", (c.hidden, c.intermediate)),
        ]
    out.append(("model.norm.weight", (c.hidden,)))
    return out


def run(args: argparse.Namespace) -> int:
    """Run both configurations and print one line each and their ratio. Returns the exit
    status (1: a checksum differs or a round failed)."""
    import torch

    from slotsync.daemon.launcher import DaemonProcess
    from slotsync.engine.checksum import checksums_by_worker, tensor_checksum
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.engine.reference.vllm_receive import receive_env
    from slotsync.protocol import Publisher
    from slotsync.protocol.wire import logical_gpu_uuid

    cuda = args.device == "cuda"
    model = DenseConfig() if cuda else DenseConfig(vocab=4096, hidden=256, layers=2,
                                                   heads=2, kv_heads=1, intermediate=512)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    named = []
    for name, shape in qwen3_dense_shapes(model):
        t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        t.uniform_(-0.1, 0.1, generator=g)
        named.append((name, t))
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    emb = named[0][1].numel() * 2
    env = receive_env(args.shim)
    if env is None:
        print("vLLM's receive path does not import (no vllm, no shim at "
              f"{args.shim}): run python tools/vllm_shim.py build/vllm-shim", file=sys.stderr)
        return 2
    scale = 1 if cuda else 512  # (cpu: the staging sizes scaled down with the model)
    configs = [("oversize", args.staging_mb * MiB // scale),
               ("today", args.baseline_staging_mb * MiB // scale)]
    print(f"model: Qwen3 dense {model.layers} layers, {len(named)} tensors, "
          f"{model_bytes / 1e9:.2f} GB bf16, embedding {emb / 1e6:.0f} MB; device {dev}; "
          f"{args.regions} staging region(s); vLLM's receive path; {args.rounds} rounds "
          f"after {args.warmup} warm-up")
    uuid = logical_gpu_uuid(0)
    failed = False
    results: dict[str, tuple[float, int]] = {}
    eng_kw = (dict(device="cuda", gpu_uuids=[uuid], cuda_devices=[0]) if cuda else {})
    with ReferenceEngine(workers=1, receive="vllm", env=env, startup_timeout_s=300.0,
                         **eng_kw) as eng, DaemonProcess() as d:
        k = 0
        for label, staging in configs:
            if staging < emb and label == "today":
                print(f"today: staging {staging} bytes is smaller than the embedding",
                      file=sys.stderr)
                return 2
            with Publisher(d.endpoint, 0, (0, 1), eng.url, packed=True,
                           transport="cuda" if cuda else "shm", device=dev, gpu_uuid=uuid,
                           staging_bytes=staging, staging_buffers=args.regions,
                           timeout_s=300) as pub:
                pub.register()
                times = []
                peak = 0
                for r in range(args.warmup + args.rounds):
                    k += 1
                    with torch.no_grad():
                        named[0][1].add_(1.0 / 1024)  # new weights every round
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    stats = pub.publish(named, f"v{k}")
                    dt = time.perf_counter() - t0
                    if r >= args.warmup:
                        times.append(dt)
                        if cuda:
                            peak = max(peak, torch.cuda.max_memory_allocated() - model_bytes)
                chunks = stats.chunks
            sec = statistics.median(times)
            results[label] = (sec, peak)
            print(f"{label}: staging {staging / MiB:.0f} MiB x {args.regions}, {chunks} chunks "
                  f"per round, {sec:.3f} s per round (median of {len(times)}; "
                  f"{model_bytes / sec / 1e9:.1f} GB/s), trainer peak GPU memory beyond the "
                  f"model {peak / MiB:.0f} MiB")
        status, body = eng.request("POST", "/weight_checker", {"action": "checksum"})
        got = checksums_by_worker(body)[uuid] if status == 200 else {}
        want = {n: tensor_checksum(t) for n, t in named}
        bad = [n for n in want if got.get(n) != want[n]]
        failed = bool(bad)
        print(f"checksums after round {k}: {len(want) - len(bad)}/{len(want)} equal"
              + (f"; differ: {bad[:3]}" if bad else ""))
    (s_o, p_o), (s_t, p_t) = results["oversize"], results["today"]
    print(f"ratio oversize/today: time {s_o / s_t:.2f}x, trainer peak GPU memory beyond the "
          f"model {p_o / MiB:.0f} / {p_t / MiB:.0f} MiB")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m slotsync.bench.oversize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--staging-mb", type=int, default=512, help="oversize run's staging (MiB)")
    p.add_argument("--baseline-staging-mb", type=int, default=1024,
                   help="today's run: staging large enough for the embedding (MiB)")
    p.add_argument("--regions", type=int, default=4, choices=range(1, 9))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--shim", default=os.fspath(Path.cwd() / "build" / "vllm-shim"),
                   help="the vLLM shim folder (tools/vllm_shim.py) if vllm is not installed")
    args = p.parse_args(argv)
    refuse_without_cuda(p, args.device, "--device cpu")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())

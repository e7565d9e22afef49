"""``python -m slotsync.bench.ep`` (``slotsync bench ep``): an expert-parallel round in
rank-local mode (issue 18 A/F) against today's every-expert-to-every-worker mode, same run.

A Qwen3-30B-A3B-shaped model (``bench.model.qwen3_moe_specs``, from its ``config.json``: 48
layers, hidden 2048, 128 experts of gate/up/down with moe_intermediate 768, q/k/v/o for 32
query / 4 key-value heads of head_dim 128 with q_norm/k_norm, the router gate, two RMSNorms
per layer, embeddings and lm_head of vocabulary 151,936, bf16); ``--layers`` keeps fewer
layers (the output says what was scaled). ``--ranks`` N trainer ranks (default 8) feed one
engine of N workers in EP N: worker w holds experts ``[w * E/N, (w + 1) * E/N)`` and every
shared tensor (attention, norms, router, embeddings, lm_head).

Modes, one after the other through one ``slotsyncd`` (whose engine table gives the workers'
GPU UUIDs in worker order) into one engine:

* ``today``: every rank publishes the whole model (every expert to every worker);
* ``rank-local``: every rank publishes only its worker's experts and the shared tensors
  (``Publisher(rank_local=True)``; the daemon sends vLLM's list-form ``update_info``).

Per mode: bytes copied into staging per rank (``PublishStats.bytes``), bytes received per
worker (the engine's ``bytes_loaded`` counter where it keeps one, else what that worker's
rank sent), seconds per round (the slowest rank's, median of ``--rounds`` after ``--warmup``),
and the ratios rank-local / today. After the last (rank-local) round each worker's checksums
of its own names are compared with its rank's tensors (not with ``--engine-store discard``).

Devices: ``--device cpu`` (shared memory; the CPU dry run with a scaled-down model, see
``--tiny``) or ``--device cuda``: every rank and every reference-engine worker on ``cuda:0``
with logical GPU UUIDs. GPU memory: every rank holds the whole model (today's mode needs it),
each worker what it received (``--engine-store keep``) or nothing (``discard``: the engine
checks each chunk and copies nothing), plus each rank's staging (``--staging-mb`` x
``--regions``); the output prints the estimate.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from slotsync.bench.gpu import collect_replies
from slotsync.bench.model import Qwen3MoeConfig, TensorSpec, qwen3_moe_specs
from slotsync.bench.report import refuse_without_cuda

MiB = 1 << 20
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")

TINY = Qwen3MoeConfig(hidden=64, layers=1, experts=16, moe_intermediate=32, q_heads=4,
                      kv_heads=2, head_dim=16, vocab=512)
"""The CPU dry run's model (``--tiny``): Qwen3-MoE's tensor layout at toy sizes."""


def worker_specs(specs: list[TensorSpec], experts: int, workers: int,
                 worker: int) -> list[TensorSpec]:
    """The tensors worker ``worker`` of ``workers`` holds in EP: every tensor that is not an
    expert's, and the experts ``[worker * experts / workers, (worker + 1) * ...)``, in the
    checkpoint's order.

    Raises:
        ValueError: ``experts`` is not a multiple of ``workers``.
    """
    if experts % workers:
        raise ValueError(f"{experts} experts do not split evenly over {workers} workers")
    per = experts // workers
    lo, hi = worker * per, (worker + 1) * per
    out = []
    for s in specs:
        m = _EXPERT.search(s.name)
        if m is None or lo <= int(m.group(1)) < hi:
            out.append(s)
    return out


def _rank_main(rank: int, ranks: int, device: str, cfg: Qwen3MoeConfig, cmds: Any,
               results: Any) -> None:
    """One trainer rank: builds the whole model (every rank the same values), then publishes
    it per ``("run", endpoint, url, mode, rounds, staging_bytes, regions)`` command; answers
    ``("ready"|"done"|"error", rank, data)``."""
    try:
        import torch

        from slotsync.engine.checksum import tensor_checksum
        from slotsync.protocol.rank.publisher import Publisher
        from slotsync.protocol.wire import logical_gpu_uuid

        dev = torch.device(device)
        specs = qwen3_moe_specs(cfg)
        mine = {s.name for s in worker_specs(specs, cfg.experts, ranks, rank)}
        g = torch.Generator(device=dev).manual_seed(0)
        named = []
        for s in specs:
            t = torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=dev)
            t.uniform_(-0.1, 0.1, generator=g)
            named.append((s.name, t))
        local = [(n, t) for n, t in named if n in mine]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        results.put(("ready", rank, None))
        while True:
            cmd = cmds.get()
            if cmd[0] == "stop":
                return
            _, endpoint, url, mode, rounds, staging_bytes, regions = cmd
            rank_local = mode == "rank-local"
            secs, stats = [], None
            with Publisher(endpoint, rank, (0, ranks), url, packed=True,
                           transport="cuda" if dev.type == "cuda" else "shm", device=dev,
                           gpu_uuid=logical_gpu_uuid(rank), staging_bytes=staging_bytes,
                           staging_buffers=regions, timeout_s=600,
                           rank_local=rank_local) as pub:
                pub.register()
                for r in range(rounds):
                    stats = pub.publish(local if rank_local else named, f"{mode}-{r}")
                    secs.append(stats.seconds)
            assert stats is not None
            sums = ({n: tensor_checksum(t) for n, t in local} if rank_local else {})
            results.put(("done", rank, {"secs": secs, "bytes": stats.bytes,
                                        "chunks": stats.chunks, "sums": sums}))
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        results.put(("error", rank, traceback.format_exc()))


def _bytes_loaded(engine: Any) -> list[int] | None:
    _, stats = engine.request("GET", "/_slotsync/stats")
    vals = [w.get("bytes_loaded") for w in stats.get("workers", [])]
    return vals if vals and all(isinstance(v, int) for v in vals) else None


def run(args: argparse.Namespace) -> int:
    """Run both modes and print their figures and ratios (and ``--json``). Returns the exit
    status: 0, 1 when a worker's checksums differ from its rank's tensors, 2 on bad
    arguments."""
    from slotsync.engine.checksum import checksums_by_worker
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.protocol.wire import logical_gpu_uuid
    from slotsync.testing.processes import DaemonProcess

    cuda = args.device == "cuda"
    base = TINY if args.tiny else Qwen3MoeConfig()
    layers = args.layers if args.layers is not None else (2 if cuda else base.layers)
    cfg = replace(base, layers=layers)
    n = args.ranks
    if cfg.experts % n:
        print(f"--ranks {n}: {cfg.experts} experts do not split evenly", file=sys.stderr)
        return 2
    if args.engine == "vllm" and cuda:
        print("--engine vllm runs on --device cpu only here", file=sys.stderr)
        return 2
    specs = qwen3_moe_specs(cfg)
    full = sum(s.nbytes for s in specs)
    per_worker = [sum(s.nbytes for s in worker_specs(specs, cfg.experts, n, w))
                  for w in range(n)]
    scaled = [] if args.tiny else [f"layers {layers} of 48"] if layers != 48 else []
    staging = args.staging_mb * MiB
    keep = args.engine_store == "keep"
    est = n * full + n * args.regions * staging + (n * full if keep else 0)
    what = "tiny Qwen3-MoE layout (--tiny)" if args.tiny else "Qwen3-30B-A3B shapes"
    print(f"model: {what}, {layers} layers ({', '.join(scaled) or 'not scaled'}), "
          f"{len(specs)} tensors, {_size(full)} bf16; EP{n}: {n} ranks -> {n} engine "
          f"workers, worker w holds experts [{cfg.experts // n}w, {cfg.experts // n}w+"
          f"{cfg.experts // n}) + every shared tensor ({_size(per_worker[0])}); device "
          f"{args.device}; {args.engine} engine ({args.engine_store}); staging "
          f"{args.staging_mb} MiB x {args.regions}; {args.rounds} rounds after "
          f"{args.warmup} warm-up; memory estimate {_size(est)}")
    uuids = [logical_gpu_uuid(w) for w in range(n)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cmds = [ctx.Queue() for _ in range(n)]
    rank_dev = "cuda:0" if cuda else "cpu"
    procs = [ctx.Process(target=_rank_main, args=(r, n, rank_dev, cfg, cmds[r], results),
                         daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    tmp = tempfile.TemporaryDirectory(prefix="slotsync-bench-ep-")
    out: dict[str, Any] = {"layers": layers, "ranks": n, "tensors": len(specs),
                           "model_bytes": full, "scaled": scaled, "modes": {}}
    status = 0
    try:
        collect_replies(results, procs, "ready", n)
        eng_kw: dict[str, Any] = {}
        if args.engine == "vllm":
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            eng_kw["model"] = _model_file(Path(tmp.name), specs)
            eng_kw["impl"] = "vllm"
        else:
            eng_kw["discard"] = not keep
            if cuda:
                eng_kw.update(device="cuda", gpu_uuids=uuids, cuda_devices=[0] * n)
        table = Path(tmp.name) / "slotsyncd.toml"
        with ReferenceEngine(workers=n, startup_timeout_s=600, **eng_kw) as eng:
            table.write_text(f'[[engines]]\nurl = "{eng.url}"\nslot_start = 0\nslot_size = '
                             f'{n}\ngpu_uuids = [{", ".join(repr(u) for u in uuids)}]\n'
                             .replace("'", '"'))
            with DaemonProcess(args=["--config", str(table), "--log-level", "warning"]) as d:
                for mode in ("today", "rank-local"):
                    loaded0 = _bytes_loaded(eng)
                    rounds = args.warmup + args.rounds
                    for c in cmds:
                        c.put(("run", d.endpoint, eng.url, mode, rounds, staging, args.regions))
                    done = collect_replies(results, procs, "done", n)
                    loaded1 = _bytes_loaded(eng)
                    per_round = [max(done[r]["secs"][i] for r in range(n))
                                 for i in range(rounds)]
                    sec = statistics.median(per_round[args.warmup:])
                    recv = ([(b - a) // rounds for a, b in zip(loaded0, loaded1, strict=True)]
                            if loaded0 and loaded1 and keep else
                            [done[w]["bytes"] for w in range(n)])
                    row = {"seconds": sec, "staging_bytes_per_rank": max(
                        done[r]["bytes"] for r in range(n)), "bytes_per_worker": max(recv),
                        "chunks": max(done[r]["chunks"] for r in range(n)),
                        "received_from": "engine" if loaded0 and keep else "ranks"}
                    out["modes"][mode] = row
                    print(f"{mode}: {row['chunks']} chunks per rank, staging copy "
                          f"{_size(row['staging_bytes_per_rank'])} per rank, received "
                          f"{_size(row['bytes_per_worker'])} per worker (from the "
                          f"{row['received_from']}), {sec:.3f} s per round (slowest rank, "
                          f"median of {args.rounds})")
                if keep:
                    status = _check_sums(eng, done, uuids, checksums_by_worker)
        t, loc = out["modes"]["today"], out["modes"]["rank-local"]
        ratios = {k: loc[k] / t[k] for k in ("seconds", "staging_bytes_per_rank",
                                              "bytes_per_worker")}
        out["ratios_rank_local_over_today"] = ratios
        print(f"ratio rank-local/today: seconds {ratios['seconds']:.2f}x, staging bytes per "
              f"rank {ratios['staging_bytes_per_rank']:.3f}x, bytes per worker "
              f"{ratios['bytes_per_worker']:.3f}x")
        if args.json:
            print(json.dumps(out))
    finally:
        for c in cmds:
            c.put(("stop",))
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        tmp.cleanup()
    return status


def _check_sums(eng: Any, done: dict[int, Any], uuids: list[str], by_worker: Any) -> int:
    """Compare each worker's checksums of its rank's names with the rank's; print one line."""
    code, body = eng.request("POST", "/weight_checker", {"action": "checksum"})
    if code != 200:
        print(f"checksums: /weight_checker answered {code}: {body}")
        return 1
    sums = by_worker(body)
    bad = []
    for w, uuid in enumerate(uuids):
        got = sums.get(uuid) or sums.get(f"tp{w}") or {}
        bad += [(w, name) for name, want in done[w]["sums"].items() if got.get(name) != want]
    total = sum(len(done[w]["sums"]) for w in range(len(uuids)))
    print(f"checksums after the rank-local rounds: {total - len(bad)}/{total} (every "
          "worker's own names) equal its rank's tensors" + (f"; differ: {bad[:3]}" if bad else ""))
    return 1 if bad else 0


def _size(b: float) -> str:
    """``b`` bytes as GB, MB or kB (decimal units)."""
    for unit, k in (("GB", 1e9), ("MB", 1e6)):
        if b >= k:
            return f"{b / k:.3f} {unit}"
    return f"{b / 1e3:.1f} kB"


def _model_file(folder: Path, specs: list[TensorSpec]) -> Path:
    """A safetensors file of every tensor (zeros) for the vLLM-code engine's model."""
    import torch
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    save_file({s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in specs},
              str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m slotsync.bench.ep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--ranks", type=int, default=8, help="ranks = engine workers (EP size)")
    p.add_argument("--layers", type=int, default=None,
                   help="layers kept (default: 2 on cuda, to bound memory; 48 on cpu)")
    p.add_argument("--tiny", action="store_true",
                   help="toy sizes of the same layout (CPU dry run; 16 experts)")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="reference engine, or the vLLM-code engine (cpu only)")
    p.add_argument("--engine-store", choices=("keep", "discard"), default="keep",
                   help="reference engine: workers keep what they receive, or check and "
                        "drop it (bounded memory; no engine-side copy, no checksums)")
    p.add_argument("--staging-mb", type=int, default=512)
    p.add_argument("--regions", type=int, default=4, choices=range(1, 9))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.rounds < 1 or args.warmup < 0 or (args.layers or 1) < 1:
        p.error("--ranks, --rounds and --layers must be >= 1, --warmup >= 0")
    refuse_without_cuda(p, args.device, "--device cpu --tiny")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())

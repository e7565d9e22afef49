"""Load and soak: many consecutive rounds through one daemon, watching for leaks.

    python -m slotsync.bench.soak --rounds 1000 --ranks 8 [--every 100] [--unpacked]

Starts ``slotsyncd``, a reference engine with one worker per rank (one engine slot of
``--ranks`` ranks) and ``--ranks`` trainer processes that publish small tensors every round
(shared-memory transport on CPU, CUDA IPC with ``--device cuda``). Every ``--every`` rounds, at
a quiet point (rank 0 waits while the others are blocked in the next begin), it prints:

* the daemon's VmRSS and open fd count (``/proc/<pid>/status``, ``/proc/<pid>/fd``);
* the engine's, summed over its server process and its worker processes;
* the publishers' exported memory: count and bytes of ``/dev/shm/slotsync-*`` segments of the
  rank processes, and on CUDA rank 0's ``torch.cuda.memory_allocated()``.

and at the end one verdict line over the samples: ``flat`` when nothing grew, else ``GROWTH``
naming what grew (exit status 1). RSS grew when its least-squares slope over the samples is
at least 0.5 % of the first sample per 100 rounds *and* the last sample is more than 1 MiB
above the first (allocator noise in a short run). Shared-memory segments may not grow at
all; fds grew when every sample of the second half is above every sample of the first (a
socket of the daemon's engine connection pool, opened and closed as calls come and go, is not
a leak; a leak lifts them all). So a leak of 1 % per 100 rounds is flagged (issue 14: the
daemon grew from 50.7 to 65.0 MB between rounds 200 and 1,000 of a CUDA soak, 3.5 % per 100
rounds, which the old verdict, 8 MiB or 5 % between first and last, let pass as flat). The
first sample is taken after ``--every`` rounds, not at round 0, so that one-time allocations
(buffers, HTTP sessions, the engine's weights) are not mistaken for a leak.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any

from slotsync.testing.procfs import children, proc_status, shm_usage

SEG_PREFIX = "slotsync-"
RSS_FLOOR_KB = 1024  # growth below this, first to last sample, is noise
RSS_GROWTH_PER_100 = 0.005  # slope threshold: fraction of the first sample per 100 rounds


def _tensors(k: int, device: str):
    """Small weights for round ``k`` (~20 KB per rank): a round costs engine round trips,
    not copies, which is what a leak hunt wants to repeat many times."""
    import torch

    g = torch.Generator().manual_seed(k)
    named = [
        ("layers.0.attn.qkv.weight", torch.randn(32, 48, generator=g).to(torch.bfloat16)),
        ("layers.0.mlp.up.weight", torch.randn(64, 32, generator=g)),
        ("layers.0.norm.weight", torch.randn(32, generator=g).to(torch.float16)),
        ("lm_head.weight", torch.randn(50, 32, generator=g)),
    ]
    return [(n, t.to(device)) for n, t in named] if device != "cpu" else named


def _rank_main(rank: int, n: int, endpoint: str, url: str, packed: bool, rounds: int,
               every: int, device: str, q: Any, go: Any) -> None:
    """One trainer rank: ``rounds`` publishes; rank 0 pauses at each sample point."""
    import torch

    from slotsync.protocol.errors import SlotsyncError
    from slotsync.testing.ranks import rank_publisher

    torch.set_num_threads(1)
    cuda = device != "cpu"
    pub = rank_publisher(endpoint, rank, (0, n), url, device=device, packed=packed,
                         staging_bytes=16_384, timeout_s=120)
    ok = 0
    err = ""
    try:
        pub.register()
        for k in range(1, rounds + 1):
            try:
                pub.publish(_tensors(k, device), f"soak-{k}")
                ok += 1
            except SlotsyncError as e:
                err = str(e)
                break
            if rank == 0 and k % every == 0:
                cuda_bytes = torch.cuda.memory_allocated() if cuda else None
                q.put(("sample", k, cuda_bytes))
                go.wait()  # the parent samples while every other rank waits in begin
                go.clear()
    finally:
        pub.close()
        q.put(("done", rank, ok, err, os.getpid()))


def _proc(pid: int) -> tuple[int, int]:
    """(VmRSS kB, open fds) of one process; (0, 0) if it is gone."""
    try:
        st = proc_status(pid)
    except OSError:
        return 0, 0
    return st["rss_kb"], st["fds"]


def sample(daemon_pid: int, engine_pid: int, rank_pids: list[int], k: int,
           cuda_bytes: int | None) -> dict[str, Any]:
    """One row of figures at round ``k``."""
    d_rss, d_fds = _proc(daemon_pid)
    e_rss = e_fds = 0
    for p in [engine_pid, *children(engine_pid)]:
        r, f = _proc(p)
        e_rss, e_fds = e_rss + r, e_fds + f
    segs, seg_bytes = shm_usage(rank_pids)
    return {"round": k, "daemon_rss_kb": d_rss, "daemon_fds": d_fds, "engine_rss_kb": e_rss,
            "engine_fds": e_fds, "shm_segments": segs, "shm_bytes": seg_bytes,
            "cuda_allocated": cuda_bytes}


def rss_growth_per_100(samples: list[dict[str, Any]], key: str) -> float:
    """Least-squares slope of ``samples[i][key]`` (kB) over ``samples[i]["round"]``, in kB per
    100 rounds (0.0 with fewer than two distinct rounds)."""
    xs = [float(s["round"]) for s in samples]
    ys = [float(s[key]) for s in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def verdict(samples: list[dict[str, Any]]) -> tuple[bool, str]:
    """``(flat, line)``: whether nothing grew over ``samples`` (at least two; see the module
    docstring for the rule)."""
    first, last = samples[0], samples[-1]
    grew = []
    for key in ("daemon_rss_kb", "engine_rss_kb"):
        slope = rss_growth_per_100(samples, key)
        if (slope >= RSS_GROWTH_PER_100 * first[key]
                and last[key] - first[key] > RSS_FLOOR_KB):
            grew.append(f"{key} {first[key]} -> {last[key]} "
                        f"({100 * slope / max(1, first[key]):.2f} % per 100 rounds)")
    for key in ("daemon_fds", "engine_fds"):
        half = len(samples) // 2
        if min(x[key] for x in samples[half:]) > max(x[key] for x in samples[:half or 1]):
            grew.append(f"{key} {first[key]} -> {last[key]}")
    for key in ("shm_segments", "shm_bytes"):
        if last[key] > first[key]:
            grew.append(f"{key} {first[key]} -> {last[key]}")
    if first["cuda_allocated"] is not None and last["cuda_allocated"] > first["cuda_allocated"]:
        grew.append(f"cuda_allocated {first['cuda_allocated']} -> {last['cuda_allocated']}")
    span = f"rounds {first['round']} -> {last['round']}"
    if grew:
        return False, f"verdict: GROWTH over {span}: " + "; ".join(grew)
    d_pct = 100 * rss_growth_per_100(samples, "daemon_rss_kb") / max(1, first["daemon_rss_kb"])
    return True, (f"verdict: flat over {span} (daemon RSS {first['daemon_rss_kb']} -> "
                  f"{last['daemon_rss_kb']} kB, {d_pct:+.2f} % per 100 rounds, fds "
                  f"{first['daemon_fds']} -> {last['daemon_fds']}; engine RSS "
                  f"{first['engine_rss_kb']} -> {last['engine_rss_kb']} kB, fds "
                  f"{first['engine_fds']} -> {last['engine_fds']}; shm segments "
                  f"{first['shm_segments']} -> {last['shm_segments']})")


def _fmt(s: dict[str, Any]) -> str:
    cuda = "" if s["cuda_allocated"] is None else f" cuda_alloc={s['cuda_allocated']}"
    return (f"round {s['round']:>6}: daemon rss={s['daemon_rss_kb']} kB fds={s['daemon_fds']}"
            f" | engine rss={s['engine_rss_kb']} kB fds={s['engine_fds']}"
            f" | publishers shm={s['shm_segments']} segs {s['shm_bytes']} B{cuda}")


def run_soak(rounds: int = 1000, ranks: int = 8, every: int = 100, packed: bool = True,
             device: str = "cpu", engine: Any = None, quiet: bool = False,
             impl: str = "reference") -> dict[str, Any]:
    """Run the soak; returns ``{"samples", "rounds_ok", "errors", "leftover_segments",
    "flat", "verdict", "seconds"}``.

    Args:
        engine: a running ``ReferenceEngine`` with ``ranks`` workers to reuse (tests); default:
            start one for the run.
        impl: the engine to start (``reference`` or ``vllm``: vLLM's own router and worker
            code, ``python -m slotsync.engine --impl vllm``, with a model of the soak's
            tensors).
    """
    # At least a handful of samples, whatever --every says: a short run still gets a verdict.
    every = max(1, min(every, rounds // 5))
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.testing.processes import DaemonProcess

    say = (lambda *_: None) if quiet else (lambda *a: print(*a, flush=True))
    own_engine = engine is None
    model_dir: str | None = None  # the vLLM-code engine's model file's folder, if made here
    if own_engine:
        kw: dict[str, Any] = {"workers": ranks, "device": "cuda" if device != "cpu" else "cpu"}
        if device != "cpu":
            from slotsync.protocol.wire import logical_gpu_uuid

            kw["gpu_uuids"] = [logical_gpu_uuid(r) for r in range(ranks)]
            kw["cuda_devices"] = [0] * ranks
        if impl == "vllm":
            import tempfile

            from safetensors.torch import save_file

            model_dir = tempfile.mkdtemp(prefix="slotsync-soak-")  # removed at the end
            model = os.path.join(model_dir, "model.safetensors")
            save_file(dict(_tensors(0, "cpu")), model)
            kw.update(impl="vllm", model=model, startup_timeout_s=300.0)
        engine = ReferenceEngine(**kw)
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    samples: list[dict[str, Any]] = []
    done: dict[int, tuple] = {}
    t0 = time.monotonic()
    try:
        with DaemonProcess() as d:
            say(f"soak: {rounds} rounds x {ranks} ranks, {'packed' if packed else 'unpacked'}, "
                f"{device}; daemon pid {d.proc.pid}, engine pid {engine.proc.pid}")
            procs = [ctx.Process(target=_rank_main, args=(r, ranks, d.endpoint, engine.url,
                                                          packed, rounds, every, device, q, go))
                     for r in range(ranks)]
            for p in procs:
                p.start()
            pids = [p.pid for p in procs]
            while len(done) < ranks:
                try:
                    msg = q.get(timeout=300)
                except queue.Empty:
                    raise RuntimeError(f"no progress for 300 s; done={done}") from None
                if msg[0] == "sample":
                    s = sample(d.proc.pid, engine.proc.pid, pids, msg[1], msg[2])
                    samples.append(s)
                    say(_fmt(s))
                    go.set()
                else:
                    done[msg[1]] = msg[2:]
            for p in procs:
                p.join(30)
            leftover = [n for n in os.listdir("/dev/shm")
                        if n.startswith(tuple(f"{SEG_PREFIX}{p}-" for p in pids))]
    finally:
        if own_engine:
            engine.stop()
        if model_dir is not None:
            import shutil

            shutil.rmtree(model_dir, ignore_errors=True)
    errors = {r: v[1] for r, v in done.items() if v[1]}
    flat, line = verdict(samples) if len(samples) >= 2 else (
        False, "verdict: too few samples (raise --rounds or lower --every)")
    seconds = time.monotonic() - t0
    say(line)
    say(f"rounds ok: {min(v[0] for v in done.values())}/{rounds} in {seconds:.1f} s; "
        f"errors: {errors or 'none'}; leftover /dev/shm segments after exit: {len(leftover)}")
    return {"samples": samples, "rounds_ok": min(v[0] for v in done.values()),
            "errors": errors, "leftover_segments": leftover, "flat": flat, "verdict": line,
            "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slotsync.bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--every", type=int, default=100, help="sample every N rounds")
    ap.add_argument("--unpacked", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu (shared memory) or cuda (CUDA IPC)")
    ap.add_argument("--impl", choices=("reference", "vllm"), default="reference",
                    help="engine: the reference engine, or vLLM's own router and worker code "
                    "(needs vllm importable)")
    ap.add_argument("--json", help="also write the result to this file")
    a = ap.parse_args(argv)
    res = run_soak(a.rounds, a.ranks, a.every, not a.unpacked, a.device, impl=a.impl)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["flat"] and not res["errors"] and not res["leftover_segments"] else 1


if __name__ == "__main__":
    sys.exit(main())

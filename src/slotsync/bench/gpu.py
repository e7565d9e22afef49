"""``slotsync bench gpu``: the data plane, publisher -> slotsyncd -> reference engine by CUDA IPC.

A Qwen3-30B-A3B-shaped state dict (HF names and shapes; the layer count reduced so that the
trainer's and the engine's copies fit on one GPU -- the output says how many) lives on
``cuda:0`` in each of ``ranks`` trainer processes (logical GPU UUIDs on one physical GPU). Each
configuration runs ``rounds`` whole updates through real ``Publisher``\\ s, a real ``slotsyncd``
and the reference engine (which loads every chunk as vLLM does: packed, it clones each tensor
out of the mapped buffer and copies it into the weight; unpacked, it copies from the mapped
tensor). In the same run, rank 0 times one plain device-to-device copy of the same bytes
(``dst.copy_(src)`` of one flat buffer, synchronized, best of 5), the floor any transfer has.

Every figure is wall-clock seconds of whole rounds (begin to the commit's ack, slowest rank),
excluding each configuration's first round (staging allocation, first IPC opens).

``--device cpu`` runs the same path over POSIX shared memory (no GPU): for tests and dry runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any

from slotsync.bench.control import engine_call_seconds
from slotsync.bench.model import Qwen3MoeConfig, TensorSpec, qwen3_moe_specs

MiB = 1 << 20


def collect_replies(results: Any, procs: list, kind: str, n: int) -> dict[int, Any]:
    """Read ``(kind, rank, data)`` replies of bench rank processes ``procs`` from the queue
    ``results`` until ``n`` ranks sent ``kind``; returns ``{rank: data}`` (replies of other
    kinds are dropped).

    Raises:
        RuntimeError: a rank sent ``("error", rank, traceback)``, or a rank process died.
    """
    got: dict[int, Any] = {}
    while len(got) < n:
        try:
            k, rank, data = results.get(timeout=5)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a bench rank died") from None
            continue
        if k == "error":
            raise RuntimeError(f"rank {rank} failed:\n{data}")
        if k == kind:
            got[rank] = data
    return got


@dataclass(frozen=True)
class GpuConfig:
    """One measured configuration: packed with a staging buffer of ``staging_bytes``, or
    unpacked with chunks of at most ``staging_bytes``."""

    label: str
    packed: bool
    staging_bytes: int
    staging_buffers: int = 4  # packed: the publisher's staging regions


def _rank_main(rank: int, ranks: int, device: str, model: Qwen3MoeConfig, cmds: Any,
               results: Any, profile_dir: str | None = None) -> None:
    """One trainer rank: builds the state dict, answers ("ready"|"copy"|"done"|"error")."""
    try:
        import torch

        from slotsync.testing.ranks import rank_publisher

        specs = qwen3_moe_specs(model)
        dev = torch.device(device)
        g = torch.Generator(device=dev).manual_seed(rank)
        named = []
        for s in specs:
            t = torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=dev)
            t.uniform_(-0.1, 0.1, generator=g)
            named.append((s.name, t))
        nbytes = sum(s.nbytes for s in specs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        results.put(("ready", rank, nbytes))
        while True:
            cmd = cmds.get()
            if cmd[0] == "stop":
                return
            if cmd[0] == "copy":
                results.put(("copy", rank, _time_copy(torch, dev, nbytes * ranks)))
                continue
            _, endpoint, engine_url, cfg, rounds = cmd
            pub = rank_publisher(
                endpoint, rank, (0, ranks), engine_url, device=dev, packed=cfg.packed,
                staging_bytes=cfg.staging_bytes, staging_buffers=cfg.staging_buffers,
                timeout_s=300,
            )  # fmt: skip
            secs, exports, chunks = [], [], 0
            prof = None
            if profile_dir:
                import cProfile

                prof = cProfile.Profile()
            try:
                pub.register()
                for r in range(rounds):
                    if r == 1:  # let the parent read the engine's counters after the warm-up
                        results.put(("warm", rank, None))
                        if cmds.get()[0] != "continue":
                            return
                    if prof is not None and r >= 1:  # counted rounds only
                        st = prof.runcall(pub.publish, named, weight_version=f"{cfg.label}-{r}")
                    else:
                        st = pub.publish(named, weight_version=f"{cfg.label}-{r}")
                    secs.append(st.seconds)
                    exports.append(st.export_seconds)
                    chunks = st.chunks
            finally:
                pub.close()
            if prof is not None and profile_dir:
                import os

                tag = cfg.label.replace(" ", "_")
                prof.dump_stats(os.path.join(profile_dir, f"rank{rank}-{tag}.prof"))
            results.put(("done", rank, (secs, chunks, exports)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put(("error", rank, traceback.format_exc()))


def _time_copy(torch: Any, dev: Any, nbytes: int, repeat: int = 5) -> float:
    """Best of ``repeat`` synchronized ``dst.copy_(src)`` of ``nbytes`` on ``dev``, seconds."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return best


@dataclass
class GpuRow:
    """One configuration's figures, seconds per round: ``rounds`` (counted rounds, slowest
    rank), ``export_s`` (rank 0's publisher: lay out, copy into staging, synchronize, export;
    median), ``engine_load_s`` (mean per worker and round inside the engine's
    ``update_weights``: parse, map, copy, synchronize), ``engine_sync_s`` (of that, waiting
    for the device's copies), ``engine_call_s`` (the daemon's
    ``/update_weights`` HTTP calls per round, from its ``/metrics``: the load plus HTTP, the
    engine's front and its hand-off to the workers)."""

    config: GpuConfig
    rounds: list[float]
    chunks: int
    export_s: float
    engine_load_s: float
    engine_call_s: float = 0.0  # the daemon's update_weights HTTP calls, per round
    engine_sync_s: float = 0.0  # of engine_load_s, the workers' wait for the device
    first_s: float = 0.0  # the configuration's first round (a fresh daemon and publisher)


@dataclass
class GpuResult:
    """What ``run_gpu`` measured: per-rank bytes, the copy floor (seconds, for all ranks'
    bytes) and one ``GpuRow`` per configuration."""

    layers: int
    tensors: int
    nbytes_per_rank: int
    ranks: int
    copy_s: float
    rows: list[GpuRow]


def _fitted(cfg: GpuConfig, biggest: int, log: Any) -> GpuConfig:
    """``cfg`` with its staging raised to the largest tensor, rounded up to MiB (saying so;
    kept from before any tensor went as a chunk of its own, so that the figures compare)."""
    if cfg.staging_bytes >= biggest:
        return cfg
    new = -(-biggest // MiB) * MiB
    log(f"  {cfg.label}: largest tensor is {biggest / MiB:.1f} MiB, staging raised "
        f"from {cfg.staging_bytes / MiB:.0f} to {new / MiB:.0f} MiB")
    return GpuConfig(cfg.label, cfg.packed, new, cfg.staging_buffers)


def _engine_seconds(engine: Any) -> tuple[float, float]:
    """Seconds the engine's workers spent in ``update_weights`` so far, and of those waiting
    for the device (means per worker)."""
    _, stats = engine.request("GET", "/_slotsync/stats")
    ws = stats["workers"]
    return (sum(w["load_seconds"] for w in ws) / len(ws),
            sum(w.get("sync_seconds", 0.0) for w in ws) / len(ws))


def run_gpu(
    configs: list[GpuConfig],
    *,
    ranks: int = 1,
    model: Qwen3MoeConfig | None = None,
    rounds: int = 3,
    device: str = "cuda",
    log: Any = print,
    profile_dir: str | None = None,
    chunks_in_flight: int = 3,
    preload: bool = True,
) -> GpuResult:
    """Run every configuration (a fresh daemon each, run with ``--chunks-in-flight
    chunks_in_flight``; one engine for all) and the copy floor. With ``preload``, two updates
    of the first configuration go to the engine first, through a daemon of its own, and are not
    counted: a served engine holds its checkpoint's weights and has run its kernels, while the
    reference engine creates each weight at the first update that carries it and builds its
    copy plans at the second. Each configuration's first round then is slotsync's own cold
    start (a fresh daemon and publisher: the version, probe and init calls, the first
    exports). With ``profile_dir``, each
    rank writes ``rank<r>-<label>.prof`` (cProfile of the counted ``publish`` calls) and each
    engine worker ``engine-worker-<i>.prof`` (every ``update_weights`` of the run, so profile
    one configuration at a time).

    Raises:
        RuntimeError: a rank failed (traceback in the message).
    """
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.protocol.wire import logical_gpu_uuid
    from slotsync.testing.processes import DaemonProcess

    model = model or Qwen3MoeConfig(layers=16)
    specs: list[TensorSpec] = qwen3_moe_specs(model)
    biggest = max(s.nbytes for s in specs)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cmds = [ctx.Queue() for _ in range(ranks)]
    rank_dev = "cuda:0" if device == "cuda" else "cpu"
    procs = [ctx.Process(target=_rank_main,
                         args=(r, ranks, rank_dev, model, cmds[r], results, profile_dir),
                         daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()

    def collect(kind: str) -> dict[int, Any]:
        return collect_replies(results, procs, kind, 1 if kind == "copy" else ranks)

    engine = None
    try:
        nbytes = collect("ready")[0]
        cmds[0].put(("copy",))
        copy_s = collect("copy")[0]
        log(f"  D2D copy of {ranks * nbytes / 1e9:.2f} GB: {copy_s * 1e3:.1f} ms "
            f"({ranks * nbytes / copy_s / 1e9:.0f} GB/s)")
        if profile_dir:  # the engine's workers read it (they inherit the environment)
            os.environ["SLOTSYNC_PROFILE_DIR"] = profile_dir
        engine = ReferenceEngine(
            workers=ranks, device=device, startup_timeout_s=300,
            gpu_uuids=[logical_gpu_uuid(i) for i in range(ranks)],
            cuda_devices=[0] * ranks if device == "cuda" else None,
        )  # fmt: skip
        rows = []
        configs = [_fitted(cfg, biggest, log) for cfg in configs]
        if preload and configs:
            with DaemonProcess(args=["--log-level", "warning"]) as d:
                for c in cmds:
                    c.put(("run", d.endpoint, engine.url, configs[0], 2))
                collect("warm")
                for c in cmds:
                    c.put(("continue",))
                collect("done")
            log("  engine preloaded: two updates of the first configuration, not counted")
        for cfg in configs:
            load0 = _engine_seconds(engine)
            with DaemonProcess(args=["--log-level", "warning", "--chunks-in-flight",
                                     str(chunks_in_flight)]) as d:
                for c in cmds:
                    c.put(("run", d.endpoint, engine.url, cfg, rounds))
                call0 = 0.0
                if rounds > 1:  # count the engine's time of the counted rounds only
                    collect("warm")
                    load0 = _engine_seconds(engine)
                    call0 = engine_call_seconds(d.status_url)[0]
                    for c in cmds:
                        c.put(("continue",))
                done = collect("done")
                call_s = (engine_call_seconds(d.status_url)[0] - call0) / max(rounds - 1, 1)
            load1 = _engine_seconds(engine)
            load_s, sync_s = ((b - a) / max(rounds - 1, 1) for a, b in zip(load0, load1,
                                                                            strict=True))
            per_round = [max(done[r][0][i] for r in range(ranks)) for i in range(rounds)]
            counted = per_round[1:] if rounds > 1 else per_round
            exports = done[0][2][1:] if rounds > 1 else done[0][2]
            row = GpuRow(cfg, counted, done[0][1], statistics.median(exports), load_s, call_s,
                         sync_s, per_round[0])
            rows.append(row)
            med = statistics.median(counted)
            log(f"  {cfg.label}: {row.chunks} chunks, round {med:.3f} s "
                f"({ranks * nbytes / med / 1e9:.1f} GB/s), {med / copy_s:.1f}x the copy "
                f"[all rounds: {', '.join(f'{x:.3f}' for x in per_round)}]; publisher export "
                f"{row.export_s:.3f} s, engine load {row.engine_load_s:.3f} s (device wait "
                f"{row.engine_sync_s:.3f} s), engine calls "
                f"{row.engine_call_s:.3f} s per round")
        return GpuResult(model.layers, len(specs), nbytes, ranks, copy_s, rows)
    finally:
        for c in cmds:
            c.put(("stop",))
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if engine is not None:
            engine.stop()

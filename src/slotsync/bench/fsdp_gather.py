"""``python -m slotsync.bench.fsdp_gather``: FSDP2 shards gathered straight into staging against
``full_tensor()`` + a copy into the same staging, on CPU with Gloo (issue 17 G).

``--ranks`` spawned ranks each hold the same synthetic model as DTensors sharded
``(Shard(0),)`` over one 1-D mesh of all ranks (``torch.chunk`` rows, as ``fully_shard``
shards; an odd row count, so the shards are uneven). A round packs every tensor, chunk by chunk
(``chunking.cut`` over ``--staging-mb``), into one shared-memory staging region:

* ``gather``: ``export.plan_pack`` / ``run_pack`` of the DTensors (each one all-gathered into
  the region: ``export.gather_shard``);
* ``full_tensor``: what frameworks do today, ``t.full_tensor()`` per tensor (a temporary of
  the whole tensor) and then ``plan_pack`` / ``run_pack`` of those full tensors.

The two alternate round by round in the same run (ABAB...), after one warm-up round each. Per
round: its seconds (the slowest rank's, from a barrier to that rank's last copy) and its peak
resident memory above the round's start, per rank process (``VmHWM`` after a reset of the peak
through ``/proc/self/clear_refs``, minus ``VmRSS`` at the start; the largest over the ranks).
The staging region is touched before any round, so it is in every baseline, and the ranks run
with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc: every large block is its own mapping, returned
when freed; otherwise the heap keeps an earlier round's freed temporaries resident and the
next round's peak reads low). The first round of each mode also checks that both leave the
same bytes in the region.

Prints one line per mode (median and best seconds, median peak MB) and the ratios
``full_tensor / gather``. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from typing import Any

import torch

__all__ = ["main", "run"]

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(world: int, rank: int, mesh: Any, total_mb: float, tensor_mb: float,
           dtype: torch.dtype) -> list[tuple[str, Any]]:
    """Synthetic DTensors of ~``tensor_mb`` MB each, ~``total_mb`` MB in all, an odd number of
    rows each (uneven shards); this rank's shard only is ever allocated."""
    from torch.distributed.tensor import DTensor, Shard

    elem = torch.empty((), dtype=dtype).element_size()
    cols = 1024
    rows = max(1, int(tensor_mb * 2**20 / (cols * elem))) | 1
    count = max(1, round(total_mb / tensor_mb))
    per = -(-rows // world)
    mine = max(0, min(per, rows - rank * per))
    items = []
    g = torch.Generator().manual_seed(rank)
    for i in range(count):
        local = torch.randint(0, 100, (mine, cols), generator=g).to(dtype)
        items.append((f"layers.{i}.weight", DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(rows, cols),
            stride=(cols, 1))))
    return items


def _round(mode: str, items: list[tuple[str, Any]], region: torch.Tensor,
           limit: int) -> tuple[float, int, str]:
    """One round of ``mode``: (seconds, peak kB above the start, sha256 of the last chunk)."""
    from slotsync.protocol.chunking import cut
    from slotsync.protocol.rank.export import nbytes_of, plan_pack, run_pack

    def source() -> Any:
        for name, t in items:
            yield (name, t) if mode == "gather" else (name, t.full_tensor())

    import torch.distributed as dist

    dist.barrier()
    _reset_peak()
    base = _status_kb("VmRSS")
    t0 = time.perf_counter()
    used = 0
    for chunk in cut(source(), lambda item: nbytes_of(item[1]), limit):
        plan = plan_pack(region, chunk)
        run_pack(plan)
        used = plan.total
        del plan, chunk  # (the full tensors of a chunk live until its copy, as in publish)
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM") - base
    digest = hashlib.sha256(region[:used].numpy().tobytes()).hexdigest()
    return seconds, peak, digest


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import init_device_mesh

    from slotsync.protocol.rank.export import ShmSegment

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        dtype = getattr(torch, args.dtype)
        items = _model(world, rank, mesh, args.total_mb, args.tensor_mb, dtype)
        limit = int(args.staging_mb * 2**20)
        seg = ShmSegment(limit, rank=rank)
        try:
            assert seg.tensor is not None
            region = seg.tensor
            region.fill_(1)  # touched: in every round's baseline
            found: dict[str, list[tuple[float, int]]] = {"gather": [], "full_tensor": []}
            digests: dict[str, str] = {}
            modes = ["gather", "full_tensor"]
            for k in range(args.rounds + 1):
                for mode in modes if k % 2 == 0 else modes[::-1]:
                    s, peak, digest = _round(mode, items, region, limit)
                    digests.setdefault(mode, digest)
                    out = torch.tensor([s, float(peak)], dtype=torch.float64)
                    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest / largest rank
                    if k:  # round 0 warms both up
                        found[mode].append((float(out[0]), int(out[1])))
            if rank == 0:
                q.put({"found": found, "same_bytes": digests["gather"] == digests["full_tensor"],
                       "total": sum(t.nbytes for _, t in items), "tensors": len(items),
                       "shape": tuple(items[0][1].shape)})
        finally:
            seg.close_and_unlink()
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn ``args.ranks`` Gloo ranks and return rank 0's findings: ``found`` (per mode, per
    round ``(seconds, peak kB)``), ``same_bytes``, ``total`` bytes, ``tensors``, ``shape``."""
    import multiprocessing as mp

    from slotsync.testing.ports import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, port, args, q))
             for r in range(args.ranks)]
    saved = os.environ.get(MMAP_ENV)
    os.environ[MMAP_ENV] = "65536"  # (read by each spawned interpreter's malloc at start)
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            del os.environ[MMAP_ENV]
        else:
            os.environ[MMAP_ENV] = saved
    try:
        result = q.get(timeout=args.timeout_s)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return result


def main(argv: list[str] | None = None) -> int:
    """The command: prints the figures of both modes and their ratios; exit 1 if the two
    modes left different bytes in the staging region."""
    ap = argparse.ArgumentParser(prog="python -m slotsync.bench.fsdp_gather",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="Gloo ranks (one FSDP mesh)")
    ap.add_argument("--total-mb", type=float, default=256.0, help="model size, MB (global)")
    ap.add_argument("--tensor-mb", type=float, default=8.0, help="each tensor's size, MB")
    ap.add_argument("--staging-mb", type=float, default=64.0, help="staging region, MB")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per mode")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    if args.ranks < 1 or args.rounds < 1:
        ap.error("--ranks and --rounds must be at least 1")
    if args.tensor_mb > args.staging_mb:
        ap.error("--tensor-mb must not exceed --staging-mb (every tensor fits the region)")
    r = run(args)
    print(f"fsdp_gather: {args.ranks} ranks (Gloo, CPU), {r['tensors']} tensors of "
          f"{r['shape']} {args.dtype}, {r['total'] / 1e6:.1f} MB per round, staging region "
          f"{args.staging_mb:g} MB, {args.rounds} rounds per mode (alternating)")
    stats = {}
    for mode, rounds in r["found"].items():
        secs = [s for s, _ in rounds]
        peaks = [p / 1024 for _, p in rounds]
        stats[mode] = (statistics.median(secs), min(secs), statistics.median(peaks))
        med, best, peak = stats[mode]
        print(f"  {mode:<12} median {med:.3f} s  best {best:.3f} s  "
              f"({r['total'] / med / 1e6:.0f} MB/s)  peak RSS above start {peak:.1f} MB "
              "(largest rank)")
    g, f = stats["gather"], stats["full_tensor"]
    mem = f"{f[2] / g[2]:.2f}x" if g[2] >= 0.1 else "n/a (gather's peak under 0.1 MB)"
    print(f"  ratio full_tensor/gather: time {f[0] / g[0]:.2f}x (median)  peak memory {mem}"
          f"  (full_tensor peaks {f[2] - g[2]:+.1f} MB higher)")
    print(f"  same bytes in staging: {'yes' if r['same_bytes'] else 'NO'}")
    return 0 if r["same_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())

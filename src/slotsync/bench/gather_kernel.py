"""``python -m slotsync.bench.gather_kernel`` (``slotsync bench gather``): the copy kernels of a
packed round against one plain device-to-device copy of the same bytes (issue 27 B).

A Qwen3-30B-A3B-shaped state dict (``--layers`` of 48, bf16, each tensor its own allocation
as a trainer holds them) is cut into chunks as ``Publisher.publish`` cuts them
(``--chunk-mib``; a tensor larger than a chunk goes by an export of its own and is not copied,
so it is left out here). Per chunk size, on one CUDA device:

* **gather**: every chunk packed into a staging region (4 regions, in turn) by
  ``export.plan_pack`` / ``run_pack`` -- the publisher's copy-in (``gather.gather_into``);
* **scatter**: every chunk copied from a region back into the tensors by
  ``gather.scatter_from`` -- the reference engine's copy-out;
* **one copy**: ``dst.copy_(src)`` of one flat buffer of the same total bytes (the floor of
  any transfer, as ``bench gpu`` measures it).

Each is timed with CUDA events over the whole pass, best of ``--repeat``; printed: milliseconds,
GB/s (bytes read plus bytes written) and the ratio to one copy. The last chunks' gathered bytes
are checked against their tensors, and the last chunk's tensors, zeroed and scattered again,
against its region, so a kernel that skipped a piece fails the run (exit 1). The timed scatter
passes overwrite the earlier chunks' tensors with whatever their region holds by then.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from slotsync.bench.report import int_arg

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
REGIONS = 4


def _best_ms(fn: Callable[[], None], repeat: int) -> float:
    """Best of ``repeat`` CUDA-event timings of ``fn`` (after one untimed call), ms."""
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def run(layers: int, chunk_mibs: list[int], repeat: int, log: Callable[[str], None] = print
        ) -> bool:
    """Measure and print; True when every check passed.

    Raises:
        NoGpu: no CUDA device, or Triton missing (the kernels need both).
        RuntimeError: a chunk the kernel cannot take (unaligned tensors), or the GPU's own
            errors (out of memory, a failed compile).
    """
    import torch

    from slotsync.bench.model import Qwen3MoeConfig, qwen3_moe_specs
    from slotsync.protocol.rank import gather

    if not torch.cuda.is_available() or not gather.available():
        raise NoGpu("needs a CUDA device and Triton (the copy kernels run on the GPU only)")
    dev = torch.device("cuda", torch.cuda.current_device())
    specs = qwen3_moe_specs(Qwen3MoeConfig(layers=layers))
    gen = torch.Generator(device=dev).manual_seed(0)
    tensors = {}
    for s in specs:
        t = torch.empty(s.shape, dtype=torch.bfloat16, device=dev)
        t.view(torch.int16).random_(generator=gen)
        tensors[s.name] = t
    total_all = sum(s.nbytes for s in specs)
    log(f"slotsync bench gather: Qwen3-30B-A3B shapes, {layers} of 48 layers, {len(specs)} "
        f"tensors, {total_all / 1e9:.2f} GB bf16 on {torch.cuda.get_device_name(dev)}; "
        f"best of {repeat}")
    ok = True
    for mib in chunk_mibs:
        ok = _one_size(tensors, specs, mib * MiB, repeat, dev, log) and ok
        torch.cuda.empty_cache()
    return ok


def _one_size(tensors: dict, specs: list, cap: int, repeat: int, dev: torch.device,
              log: Callable[[str], None]) -> bool:
    """``run`` for chunks of ``cap`` bytes; True when both checks passed."""
    import torch

    from slotsync.bench.model import chunk_specs
    from slotsync.protocol.rank import gather
    from slotsync.protocol.rank.export import plan_pack, run_pack

    mib = cap // MiB
    ok = True
    chunks = [c for c in chunk_specs(specs, cap) if sum(s.nbytes for s in c) <= cap]
    nbytes = sum(s.nbytes for c in chunks for s in c)
    staging = torch.empty(REGIONS * cap, dtype=torch.uint8, device=dev)
    plans = [plan_pack(staging[(i % REGIONS) * cap:(i % REGIONS + 1) * cap],
                       [(s.name, tensors[s.name]) for s in c]) for i, c in enumerate(chunks)]
    if any(p.table is None for p in plans):
        raise RuntimeError("a chunk was not gathered by the kernel (unaligned tensors?)")
    scatters = [gather.build_table([tensors[s.name].data_ptr() for s in c],
                                   [s.nbytes for s in c], dev) for c in chunks]

    def gather_all() -> None:
        for p in plans:
            run_pack(p)

    def scatter_all() -> None:
        for i, (p, t) in enumerate(zip(plans, scatters, strict=True)):
            gather.scatter_from(staging[(i % REGIONS) * cap:].view(torch.int64)[
                : p.total // 8], t)

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = _best_ms(lambda: dst.copy_(src), repeat)
    gather_ms = _best_ms(gather_all, repeat)
    # check: the last pass left each region with its last chunk's bytes
    for i, (c, p) in enumerate(zip(chunks, plans, strict=True)):
        if i + REGIONS < len(chunks):
            continue
        region = staging[(i % REGIONS) * cap:][: p.total]
        want = torch.cat([tensors[s.name].view(-1).view(torch.uint8) for s in c])
        if not torch.equal(region, want):
            log(f"  MISMATCH: chunk {i} of {mib} MiB gathered wrongly")
            ok = False
    scatter_ms = _best_ms(scatter_all, repeat)
    # check: the last chunk's tensors zeroed, scattered again from its region
    # (the timed passes wrote earlier chunks' tensors from regions refilled since)
    last, k = plans[-1], len(chunks) - 1
    region = staging[(k % REGIONS) * cap:][: last.total]
    for s in chunks[-1]:
        tensors[s.name].zero_()
    gather.scatter_from(region.view(torch.int64), scatters[-1])
    got = torch.cat([tensors[s.name].view(-1).view(torch.uint8) for s in chunks[-1]])
    if not torch.equal(region, got):
        log(f"  MISMATCH: chunk {k} of {mib} MiB scattered wrongly")
        ok = False
    pieces = sum(p.table.shape[0] for p in plans)
    log(f"  {mib} MiB chunks: {len(chunks)} chunks, {nbytes / 1e9:.2f} GB, {pieces} pieces "
        f"of <= {gather.PIECE_BYTES >> 10} KiB; one copy {copy_ms:.2f} ms "
        f"({2 * nbytes / copy_ms / 1e6:.0f} GB/s read+write)")
    for name, ms in (("gather", gather_ms), ("scatter", scatter_ms)):
        log(f"    {name:8s} {ms:7.2f} ms  {2 * nbytes / ms / 1e6:5.0f} GB/s  "
            f"{ms / copy_ms:.2f}x one copy")
    return ok


def _mib_list(text: str) -> list[int]:
    """``--chunk-mib``: comma-separated positive integers, none empty."""
    parts = text.split(",")
    if any(not x.strip() for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty entry")
    return [int_arg(1)(x.strip()) for x in parts]


class NoGpu(RuntimeError):
    """No CUDA device or no Triton: the kernels cannot run here."""


def main(argv: list[str] | None = None) -> int:
    """Command line: 0 when every check passed, 1 on a mismatch, 2 for options it refuses or
    without a GPU (a failure on the GPU itself raises)."""
    p = argparse.ArgumentParser(prog="slotsync bench gather", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int_arg(1, 48), default=16,
                   help="Qwen3-30B-A3B layers, 1..48 (default 16: 21.2 GB)")
    p.add_argument("--chunk-mib", type=_mib_list, default=[512, 1024],
                   help="comma-separated chunk sizes in MiB (default 512,1024)")
    p.add_argument("--repeat", type=int_arg(1), default=5,
                   help="timed passes, best kept (default 5)")
    args = p.parse_args(argv)
    try:
        return 0 if run(args.layers, args.chunk_mib, args.repeat) else 1
    except NoGpu as e:
        print(f"slotsync bench gather: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

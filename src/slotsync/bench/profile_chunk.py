"""Where the daemon's time goes for one chunk: ``python -m slotsync.bench.profile_chunk``.

Profiles the daemon's per-chunk work on one Qwen3-30B-A3B chunk (512 MiB, 8 ranks, synthetic
CUDA handle records as ``slotsync bench control`` makes them): decoding each rank's ``Chunk``
frame (``wire.decode_to_daemon``, which validates every handle record: in full the first time
a chunk's lists are seen, from the daemon's ``ChunkMetaCache`` in later rounds) and
``merge_chunk`` (consistency checks, vLLM's ``ipc_handles_pickled``, the JSON text of
``/update_weights``). Each repetition starts with cold handle caches, as a new round's exports
would (fresh ref-counter offsets). Prints the mean milliseconds per step and a pyinstrument
call tree (cProfile when pyinstrument is not installed).
"""

from __future__ import annotations

import argparse
import time

from slotsync.bench.fake_exports import FakeExports
from slotsync.bench.model import Qwen3MoeConfig, chunk_specs, qwen3_moe_specs
from slotsync.bench.report import int_arg
from slotsync.daemon import torch_pickle
from slotsync.daemon.vllm.merge import merge_chunk
from slotsync.protocol import wire
from slotsync.protocol.rank.export import handle_from_reduce_args

positive_int = int_arg(1)
nonneg_int = int_arg(0)


def _frames(ranks: int, packed: bool, staging_bytes: int, index: int) -> list[bytes]:
    specs = qwen3_moe_specs(Qwen3MoeConfig(layers=48))
    chunks = chunk_specs(specs, staging_bytes)
    if index >= len(chunks):
        raise SystemExit(f"--index {index}: the round has {len(chunks)} chunks "
                         f"(0..{len(chunks) - 1})")
    c = chunks[index]
    out = []
    for r in range(ranks):
        args = FakeExports(r).round([c], packed, staging_bytes)[0]
        out.append(wire.encode(wire.Chunk(
            update_id=1, index=0, names=[s.name for s in c], dtype_names=[s.dtype for s in c],
            shapes=[list(s.shape) for s in c], tensor_sizes=[s.nbytes for s in c],
            handles=[handle_from_reduce_args(a) for a in args],
        )))  # fmt: skip
    return out


def _one_chunk(frames: list[bytes], packed: bool, times: dict[str, float]) -> None:
    torch_pickle._fragment.cache_clear()
    torch_pickle._bytes.cache_clear()
    t0 = time.perf_counter()
    for f in frames:
        wire.decode_to_daemon(f)
    t1 = time.perf_counter()
    cache = _WARM
    msgs = {r: wire.decode_to_daemon(f, cache=cache) for r, f in enumerate(frames)}
    t2 = time.perf_counter()
    uuids = {r: wire.logical_gpu_uuid(r) for r in msgs}
    merge_chunk(0, msgs, uuids, packed=packed, transport="cuda",  # type: ignore[arg-type]
                world_size=len(msgs))
    t3 = time.perf_counter()
    for k, dt in (("decode, first round", t1 - t0), ("decode, later rounds", t2 - t1),
                  ("merge", t3 - t2)):  # (checks, pickle, JSON text)
        times[k] = times.get(k, 0.0) + dt


_WARM = wire.ChunkMetaCache()  # the daemon's, after the first round


def main(argv: list[str] | None = None) -> None:
    """Print per-step times and a call tree of the daemon's work on one chunk."""
    p = argparse.ArgumentParser(prog="python -m slotsync.bench.profile_chunk",
                                description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=positive_int, default=8)
    p.add_argument("--packed", action="store_true", help="packed chunk (default unpacked)")
    p.add_argument("--staging-mb", type=positive_int, default=512)
    p.add_argument("--index", type=nonneg_int, default=5,
                   help="which chunk of the round (default 5)")
    p.add_argument("--repeat", type=positive_int, default=20)
    args = p.parse_args(argv)
    frames = _frames(args.ranks, args.packed, args.staging_mb << 20, args.index)
    n = len(wire.decode_to_daemon(frames[0]).names)  # type: ignore[union-attr]
    times: dict[str, float] = {}
    _one_chunk(frames, args.packed, {})  # warm imports and layout caches
    for _ in range(args.repeat):
        _one_chunk(frames, args.packed, times)
    mode = "packed" if args.packed else "unpacked"
    print(f"one {mode} chunk: {n} tensors x {args.ranks} ranks, mean of {args.repeat}:")
    for k, v in times.items():
        print(f"  {k}: {v / args.repeat * 1e3:.2f} ms")
    print("call tree (profiler on, so slower):")
    try:
        from pyinstrument import Profiler
    except ImportError:
        Profiler = None  # noqa: N806
    if Profiler is not None:
        prof = Profiler(interval=0.0002)
        prof.start()
    else:
        import cProfile

        cprof = cProfile.Profile()
        cprof.enable()
    for _ in range(args.repeat):
        _one_chunk(frames, args.packed, {})
    if Profiler is not None:
        prof.stop()
        print(prof.output_text(unicode=False, color=False))
    else:
        import pstats

        cprof.disable()
        pstats.Stats(cprof).sort_stats("cumulative").print_stats(15)


if __name__ == "__main__":
    main()

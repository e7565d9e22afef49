"""``slotsync bench``: control-plane (CPU) and data-plane (GPU) benchmarks.

``slotsync bench control`` runs N trainer-rank processes against a real ``slotsyncd`` and a
discarding reference engine, side by side with the in-trainer baseline (Gloo
``all_gather_object`` + coordinator pickle + POST) in the same processes, and prints per-chunk
and per-round medians, p99 and the ratio slotsync / baseline; ``--sweep`` adds the scaling runs
(ranks, slots, tensors per round, rounds served) and a PNG plot. ``slotsync bench gpu`` pushes a
Qwen3-30B-A3B-shaped state dict through publisher, daemon and engine by CUDA IPC and compares
with a plain device-to-device copy. Both print their figures; with ``--report FILE`` (e.g.
BENCHMARKS.md) they also rewrite their section of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, NoReturn

from slotsync.bench.control import (
    SYSTEMS,
    Phase,
    SystemTimes,
    median,
    ms,
    p99,
    run_session,
)
from slotsync.bench.control_memory import memory_problem_of
from slotsync.bench.model import Qwen3MoeConfig, chunk_specs, qwen3_moe_specs, uniform_specs
from slotsync.bench.report import (
    command_line,
    int_arg,
    machine_line,
    plot_scaling,
    table,
    update_section,
)

MiB = 1 << 20


positive_int = int_arg(1)
nonneg_int = int_arg(0)


def _ints(text: str) -> list[int]:
    vals = [positive_int(x.strip()) for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("needs at least one integer")
    return vals


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``control``, ``gpu``, ``hop``, ``vs-vllm``, ``lora``, ``oversize``,
    ``fsdp-gather``, ``gather`` and ``ep`` subcommands to ``p`` (``slotsync bench``); the last
    four forward their options to their module's ``main``."""
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    c = sub.add_parser("control", help="control plane on CPU: slotsync vs in-trainer baseline",
                       description=__doc__)
    c.add_argument("--ranks", type=positive_int, default=8,
                   help="trainer ranks per slot (default 8)")
    c.add_argument("--slots", type=positive_int, default=1,
                   help="engine slots on the daemon (default 1)")
    c.add_argument("--rounds", type=positive_int, default=4,
                   help="rounds per system, warm-up included")
    c.add_argument("--warmup", type=nonneg_int, default=1,
                   help="first rounds not counted (default 1)")
    c.add_argument("--tensors", type=positive_int, default=None,
                   help="N uniform 3 MiB tensors per round instead of Qwen3-30B-A3B")
    c.add_argument("--layers", type=positive_int, default=48,
                   help="Qwen3-30B-A3B layers (default 48)")
    c.add_argument("--modes", default="packed,unpacked", help="packed,unpacked (default both)")
    c.add_argument("--systems", default="slotsync,baseline", help="slotsync,baseline")
    c.add_argument("--staging-mb", type=positive_int, default=512,
                   help="chunk size in MiB (default 512)")
    c.add_argument("--staging-buffers", type=int, default=4, choices=range(1, 9),
                   metavar="{1..8}", help="packed: the publisher's staging regions (default 4)")
    c.add_argument("--engine-url", action="append", default=None,
                   help="use this engine (one per slot) instead of a discarding reference one")
    c.add_argument("--sweep", action="store_true",
                   help="also run the scaling sweep (ranks x tensors, slots, rounds served)")
    c.add_argument("--sweep-ranks", type=_ints, default=[1, 2, 4, 8])
    c.add_argument("--sweep-tensors", type=_ints, default=[100, 1000, 10000, 100000])
    c.add_argument("--sweep-slots", type=_ints, default=[1, 2, 4, 8])
    c.add_argument("--sweep-rounds", type=positive_int, default=3, help="rounds per sweep point")
    c.add_argument("--growth-rounds", type=positive_int, default=100,
                   help="rounds of the rounds-served check (sweep only; default 100)")
    c.add_argument("--plot", default="docs/bench/scaling.png", help="PNG of the sweep")
    c.add_argument("--report", default="", metavar="FILE",
                   help="also rewrite this command's section of FILE (e.g. BENCHMARKS.md); "
                        "default: print only")
    c.add_argument("--section", default="control",
                   help="section of --report to rewrite (default control; e.g. control-h200 "
                        "for a run on the GPU host's CPUs)")
    c.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the memory estimate of the biggest session exceeds "
                        "80%% of MemAvailable")
    g = sub.add_parser("gpu", help="data plane by CUDA IPC vs a plain device-to-device copy",
                       description=__doc__)
    g.add_argument("--ranks", type=positive_int, default=1, help="ranks (logical GPUs on cuda:0)")
    g.add_argument("--layers", type=positive_int, default=16,
                   help="Qwen3-30B-A3B layers kept (default 16 of 48, to fit on one GPU)")
    g.add_argument("--experts", type=positive_int, default=128)
    g.add_argument("--vocab", type=positive_int, default=151936)
    g.add_argument("--hidden", type=positive_int, default=2048)
    g.add_argument("--rounds", type=positive_int, default=3, help="rounds per configuration (first "
                   "not counted)")
    g.add_argument("--staging-mb", type=_ints, default=[512, 1024, 4096],
                   help="packed staging sizes in MiB (default 512,1024,4096)")
    g.add_argument("--no-unpacked", action="store_true", help="skip the unpacked run")
    g.add_argument("--regions", type=int, default=4, choices=range(2, 9), metavar="{2..8}",
                   help="staging regions per rank of the packed runs (default 4, the "
                        "publisher's)")
    g.add_argument("--chunks-in-flight", type=int, default=3, choices=range(1, 65),
                   metavar="{1..64}", help="the daemon's chunks_in_flight (default 3, the "
                                         "daemon's)")
    g.add_argument("--single-buffer", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the smallest staging size with one region (default on)")
    g.add_argument("--profile", metavar="DIR", default=None,
                   help="cProfile the ranks' publish and the engine workers' update_weights "
                        "into DIR and print the top functions (use with one configuration)")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the same path over shared memory (dry run)")
    g.add_argument("--report", default="", metavar="FILE",
                   help="also rewrite this command's section of FILE (e.g. BENCHMARKS.md); "
                        "default: print only")
    from slotsync.bench import hop

    h = sub.add_parser("hop", help="the peer link's cost: one round through one daemon vs "
                       "over two nodes' daemons (issue 25 I; CPU)", description=hop.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    hop.add_arguments(h, positive_int, nonneg_int)
    from slotsync.bench import vs_vllm

    v = sub.add_parser("vs-vllm", help="slotsync vs vLLM's own IPCTrainerWeightTransferEngine "
                       "into vLLM's receive path, packed and unpacked (GPU; --device cpu: dry "
                       "run)", description=vs_vllm.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_vllm.add_arguments(v, positive_int)
    from slotsync.bench.lora import run as lora_run

    lo = sub.add_parser("lora", help="a LoRA adapter through slotsync (publish_adapter) vs "
                        "through the disk (save_pretrained + /v1/load_lora_adapter), same "
                        "engine (issue 36; CPU)", description=lora_run.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    lora_run.add_arguments(lo, positive_int, nonneg_int)
    for name, module, text in _FORWARDED:
        f = sub.add_parser(name, help=text, add_help=False, prefix_chars="\0")
        f.add_argument("forwarded", nargs=argparse.REMAINDER,
                       help=f"the options of python -m {module} (see its --help)")
    return p


_FORWARDED = (
    ("oversize", "slotsync.bench.oversize",
     "a packed round with a tensor over staging_bytes as its own chunk vs a staging that fits "
     "it (GPU; --device cpu: dry run)"),
    ("fsdp-gather", "slotsync.bench.fsdp_gather",
     "FSDP2 shards gathered straight into staging vs full_tensor() + copy (CPU, Gloo)"),
    ("gather", "slotsync.bench.gather_kernel",
     "the packed copy kernels (publisher's gather, engine's scatter) vs one plain copy of the "
     "same bytes (GPU)"),
    ("ep", "slotsync.bench.ep",
     "an EP round in rank-local mode vs every expert to every worker (GPU; --device cpu "
     "--tiny: dry run)"),
)
"""Benchmarks whose own command line ``slotsync bench NAME ...`` forwards to."""


def main_from_args(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; 0 on success, 2 without a subcommand or with a ``--report``
    file or ``--engine-url`` that cannot be used (checked before any run)."""
    report = getattr(args, "report", "")
    if report:
        folder = os.path.dirname(os.path.abspath(report))
        if os.path.isdir(report):
            print(f"slotsync bench: --report {report} is a folder: name a Markdown file",
                  file=sys.stderr)
            return 2
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            print(f"slotsync bench: cannot write --report {report}: folder {folder} does not "
                  "exist or is not writable", file=sys.stderr)
            return 2
    for url in getattr(args, "engine_url", None) or []:
        problem = _engine_unreachable(url)
        if problem:
            print(f"slotsync bench: --engine-url {url}: {problem}", file=sys.stderr)
            return 2
    if args.bench_command == "control":
        return control_main(args)
    if args.bench_command == "gpu":
        return gpu_main(args)
    if args.bench_command == "hop":
        from slotsync.bench.hop import main_from_args as hop_main

        return hop_main(args)
    if args.bench_command == "vs-vllm":
        from slotsync.bench.vs_vllm import main_from_args as vs_vllm_main

        return vs_vllm_main(args)
    if args.bench_command == "lora":
        from slotsync.bench.lora.run import main_from_args as lora_main

        return lora_main(args)
    for name, module, _ in _FORWARDED:
        if args.bench_command == name:
            import importlib

            return importlib.import_module(module).main(args.forwarded)
    print("usage: slotsync bench {control,gpu,hop,vs-vllm,lora,oversize,fsdp-gather,gather,ep} "
          "...  (see --help)",
          file=sys.stderr)
    return 2


def _engine_unreachable(url: str) -> str:
    """Why ``url`` cannot serve the bench (no answer to ``GET /get_world_size``), or ""."""
    import urllib.error
    import urllib.request

    if url.startswith("unix://"):
        return "" if os.path.exists(url[7:]) else f"no socket at {url[7:]}"
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/get_world_size", timeout=10) as r:
            r.read()
    except urllib.error.HTTPError as e:
        return f"GET /get_world_size answered HTTP {e.code} (is it a vLLM server with "\
            "VLLM_SERVER_DEV_MODE=1?)"
    except (OSError, ValueError) as e:
        return f"cannot reach it ({e})"
    return ""


# ------------------------------------------------------------------------------- control


def _say(out: list[str], line: str = "") -> None:
    print(line, flush=True)
    out.append(line)


def _rows_for(times: dict[str, SystemTimes]) -> list[list[str]]:
    rows = []
    for s, t in times.items():
        rows.append([s, ms(median(t.chunk_s)), ms(p99(t.chunk_s)), ms(median(t.engine_s)),
                     ms(median(t.round_s)), ms(p99(t.round_s)), str(len(t.round_s))])
    if "slotsync" in times and "baseline" in times:
        a, b = times["slotsync"], times["baseline"]
        rows.append(["**ratio** slotsync / baseline",
                     f"**{median(a.chunk_s) / median(b.chunk_s):.2f}**",
                     f"{p99(a.chunk_s) / p99(b.chunk_s):.2f}", "",
                     f"**{median(a.round_s) / median(b.round_s):.2f}**",
                     f"{p99(a.round_s) / p99(b.round_s):.2f}", ""])
    return rows


HEAD = ["system", "chunk median ms", "chunk p99 ms", "engine call ms/chunk",
        "round median ms", "round p99 ms", "rounds"]


BENCH_FOLDER_PREFIX = "slotsync-bench-"
"""``slotsync bench control`` keeps every file of its run, and of the processes it starts, in
one folder ``<tmp>/slotsync-bench-*`` (``testing.owned_folders.owned_folder``)."""


def control_main(args: argparse.Namespace) -> int:
    """``slotsync bench control``: side by side, then (``--sweep``) scaling. Refuses (2)
    options it cannot run and a run whose memory estimate exceeds 80% of MemAvailable (unless
    ``--skip-memory-check``); Ctrl-C stops it with one line and 130, SIGTERM unwinds it
    (143). Every temporary file, of this process and of the ranks, engines and daemon it
    starts, is in one folder removed at the end; a SIGKILLed run's is removed at the next
    run's start."""
    import signal

    from slotsync.testing.owned_folders import owned_folder

    problem = memory_problem_of(args)
    if problem:
        print(f"slotsync bench control: {problem}", file=sys.stderr)
        return 2

    def _term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # (unwinds: ranks, engines, daemon stopped, folder gone)

    previous = signal.signal(signal.SIGTERM, _term)
    stale: list[str] = []
    try:
        with owned_folder(BENCH_FOLDER_PREFIX, stale) as folder:
            if stale:
                print(f"(removed {len(stale)} folder(s) of killed runs: {', '.join(stale)})",
                      flush=True)
            return _control_run(args, folder)
    except KeyboardInterrupt:
        print("slotsync bench control: interrupted; its ranks, engines and daemon are stopped "
              "and its folder removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _control_run(args: argparse.Namespace, folder: str) -> int:
    out: list[str] = []
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if any(m not in ("packed", "unpacked") for m in modes) or any(
        s not in SYSTEMS for s in systems
    ):
        print("--modes takes packed,unpacked; --systems slotsync,baseline", file=sys.stderr)
        return 2
    if args.rounds <= args.warmup:
        print(f"--rounds {args.rounds} leaves no counted round after --warmup {args.warmup}",
              file=sys.stderr)
        return 2
    if args.sweep and (args.sweep_rounds < 2 or args.growth_rounds < 20):
        print("--sweep needs --sweep-rounds >= 2 (one is warm-up) and --growth-rounds >= 20 "
              "(first and last 10 are compared)", file=sys.stderr)
        return 2
    if args.tensors is None:
        specs = qwen3_moe_specs(Qwen3MoeConfig(layers=args.layers))
        what = (f"Qwen3-30B-A3B ({args.layers} layers): {len(specs)} tensors, "
                f"{sum(s.nbytes for s in specs) / 1e9:.1f} GB bf16 per rank")
    else:
        specs = uniform_specs(args.tensors)
        what = f"{args.tensors} uniform tensors of 768x2048 bf16 (3 MiB)"
    staging = args.staging_mb * MiB
    nchunks = len(chunk_specs(specs, staging))
    title = "" if args.section == "control" else f" (section {args.section})"
    _say(out, f"## Control plane (CPU): `slotsync bench control`{title}")
    _say(out)
    _say(out, f"- command: `{command_line()}`")
    _say(out, f"- machine: {machine_line()}")
    _say(out, f"- round: {what}, {args.staging_mb} MiB chunks -> {nchunks} chunks per round; "
              f"{args.ranks} ranks x {args.slots} slot(s); {args.rounds} rounds per system "
              f"({args.warmup} warm-up not counted), systems interleaved A/B/B/A")
    engine = ("`" + " ".join(args.engine_url) + "`" if args.engine_url else
              "reference engine, `--discard` (parses every update_info, maps nothing)")
    _say(out, f"- engine: {engine}, {args.ranks} workers per slot")
    _say(out, "- per chunk: on the slot coordinator, the time from one chunk's ack to the next "
              "(slotsync: ranks pipeline as `Publisher.publish` does, so this is the chunk rate, "
              "not one chunk's latency) / from the gather to the barrier after the POST "
              "(baseline, one chunk at a time); per round: slowest "
              "rank, begin to commit ack (slotsync) / pause+start to finish+resume (baseline); "
              "engine call: the `/update_weights` HTTP time per chunk (daemon's metric / "
              "coordinator's clock)")
    _say(out, f"- slotsync ranks: packed with {args.staging_buffers} staging region(s) per rank "
              "(a fresh export per chunk with 2 or more, one export per update with 1), "
              "unpacked up to 2 chunks in flight; baseline: one buffer exported once per "
              "update, one chunk at a time")
    contended = args.ranks * args.slots + args.slots * (args.ranks + 1) + 1

    _say(out, f"- **CPU contention**: {contended} busy processes (ranks, engine workers and "
              f"front, daemon) share {os.cpu_count()} cores; every figure includes that")
    _say(out)
    t_all = time.perf_counter()
    for mode in modes:
        t0 = time.perf_counter()
        res = run_session(args.ranks, args.slots, mode == "packed",
                          [Phase("main", args.tensors, args.rounds, args.warmup, args.layers)],
                          systems=systems, staging_bytes=staging,
                          staging_buffers=args.staging_buffers, engine_urls=args.engine_url,
                          folder=folder)
        _say(out, f"### {mode} ({time.perf_counter() - t0:.0f} s wall)")
        _say(out)
        _say(out, table(HEAD, _rows_for(res["main"])))
        _say(out)
    if args.sweep:
        _sweep(args, out, staging, folder)
    _say(out, f"_total {time.perf_counter() - t_all:.0f} s_")
    if args.report:
        update_section(args.report, args.section, "\n".join(out))
        print(f"wrote section {args.section!r} of {args.report}")
    return 0


def _sweep(args: argparse.Namespace, out: list[str], staging: int, folder: str) -> None:
    """Scaling: ranks x tensors per round (packed), slots per daemon, rounds served."""
    _say(out, "### Scaling (packed, uniform 3 MiB tensors)")
    _say(out)
    by_ranks: dict[int, dict[int, dict[str, float]]] = {}
    rows = []
    for n in args.sweep_ranks:
        phases = [Phase(f"t{k}", k, args.sweep_rounds, 1) for k in args.sweep_tensors]
        res = run_session(n, 1, True, phases, staging_bytes=staging, folder=folder)
        by_ranks[n] = {}
        for k in args.sweep_tensors:
            r = res[f"t{k}"]
            a, b = median(r["slotsync"].round_s), median(r["baseline"].round_s)
            by_ranks[n][k] = {"slotsync": a, "baseline": b}
            rows.append([str(n), str(k), str(len(chunk_specs(uniform_specs(k), staging))),
                         ms(median(r["slotsync"].chunk_s)), ms(median(r["baseline"].chunk_s)),
                         ms(a), ms(b), f"{a / b:.2f}"])
            print(f"  ranks {n} tensors {k}: round {ms(a)} vs {ms(b)} ms", flush=True)
    _say(out, "Ranks per slot x tensors per round (1 slot):")
    _say(out)
    _say(out, table(["ranks", "tensors", "chunks", "slotsync chunk ms", "baseline chunk ms",
                     "slotsync round ms", "baseline round ms", "ratio"], rows))
    _say(out)
    k_slots = 1000
    rows = []
    by_slots: dict[int, dict[str, float]] = {}
    for s in args.sweep_slots:
        res = run_session(1, s, True, [Phase("s", k_slots, args.sweep_rounds, 1)],
                          staging_bytes=staging, folder=folder)
        r = res["s"]
        a, b = median(r["slotsync"].round_s), median(r["baseline"].round_s)
        by_slots[s] = {"slotsync": a, "baseline": b}
        rows.append([str(s), ms(median(r["slotsync"].chunk_s)), ms(median(r["baseline"].chunk_s)),
                     ms(a), ms(b), f"{a / b:.2f}"])
        print(f"  slots {s}: round {ms(a)} vs {ms(b)} ms", flush=True)
    _say(out, f"Slots per daemon (1 rank and one 1-worker engine per slot, {k_slots} tensors):")
    _say(out)
    _say(out, table(["slots", "slotsync chunk ms", "baseline chunk ms", "slotsync round ms",
                     "baseline round ms", "ratio"], rows))
    _say(out)
    g = args.growth_rounds
    res = run_session(2, 1, True, [Phase("g", 1000, g, 0)], systems=("slotsync",),
                      staging_bytes=staging, folder=folder)
    t = res["g"]["slotsync"]
    first = [x for x, r in zip(t.chunk_s, t.chunk_round, strict=True) if r < 10]
    last = [x for x, r in zip(t.chunk_s, t.chunk_round, strict=True) if r >= g - 10]
    eng_first, eng_last = t.engine_s[:10], t.engine_s[-10:]
    _say(out, f"Rounds served ({g} rounds of 1000 tensors, 2 ranks, slotsync only, one daemon):")
    _say(out)
    _say(out, table(["rounds", "chunk median ms", "chunk p99 ms", "engine call ms/chunk",
                     "daemon+wire ms/chunk (chunk - engine)"], [
        ["first 10", ms(median(first)), ms(p99(first)), ms(median(eng_first)),
         ms(median(first) - median(eng_first))],
        [f"last 10 (of {g})", ms(median(last)), ms(p99(last)), ms(median(eng_last)),
         ms(median(last) - median(eng_last))],
    ]))
    _say(out)
    if args.plot:
        plot_scaling(args.plot, by_ranks, by_slots)
        _say(out, f"Plot: `{args.plot}` (time per round against tensors per round, per ranks; "
                  "and against slots).")
        _say(out)


# ------------------------------------------------------------------------------- gpu


def _check_gpu_bench_fits(device: str, ranks: int, nbytes: int, staging: int,
                          regions: int = 2) -> None:
    """Refuse, before starting anything, a ``bench gpu`` that cannot run here: no CUDA device
    for ``--device cuda``, or trainer + engine copies of the state dict (``nbytes`` per
    rank, plus ``regions`` staging regions of ``staging`` bytes) beyond the device's or this
    machine's memory (bytes). Raises SystemExit(2) after a line naming the options to
    change."""
    need = ranks * (2 * nbytes + regions * staging)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            _refuse("no CUDA device is visible (use --device cpu for the same path over "
                    "shared memory, with a small --layers)")
        have = torch.cuda.mem_get_info(0)[0]
        where = "free on cuda:0"
    else:
        have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = "of free memory"
    if need > have:
        _refuse(f"{ranks} rank(s) x (trainer + engine copy of {nbytes / 1e9:.1f} GB + "
                f"staging) need ~{need / 1e9:.1f} GB, this machine has {have / 1e9:.1f} GB "
                f"{where}: lower --layers (or --experts, --vocab, --ranks, --staging-mb, "
                "--regions)")


def _refuse(text: str) -> NoReturn:
    """Exit 2 (bad input, as argparse does) with one line on stderr."""
    print(f"slotsync bench gpu: {text}", file=sys.stderr)
    raise SystemExit(2)


def gpu_main(args: argparse.Namespace) -> int:
    """``slotsync bench gpu``."""
    from slotsync.bench.gpu import GpuConfig, run_gpu

    out: list[str] = []
    model = Qwen3MoeConfig(layers=args.layers, experts=args.experts, vocab=args.vocab,
                           hidden=args.hidden)
    specs = qwen3_moe_specs(model)
    configs = [GpuConfig(f"packed {mb} MiB x {args.regions} regions", True, mb * MiB,
                         args.regions) for mb in args.staging_mb]
    if args.single_buffer:  # vLLM's own producer: one region, one chunk at a time
        mb = min(args.staging_mb)
        configs.append(GpuConfig(f"packed {mb} MiB x 1 region", True, mb * MiB, 1))
    if not args.no_unpacked:
        configs.append(GpuConfig(f"unpacked ({min(args.staging_mb)} MiB chunks)", False,
                                 min(args.staging_mb) * MiB))
    dev = args.device
    _check_gpu_bench_fits(dev, args.ranks, sum(s.nbytes for s in specs),
                          max(args.staging_mb) * MiB, args.regions)
    _say(out, "## Data plane (GPU): `slotsync bench gpu`")
    _say(out)
    _say(out, f"- command: `{command_line()}`")
    gpu = ""
    if dev == "cuda":
        import torch

        gpu = f", GPU {torch.cuda.get_device_name(0)}, torch CUDA {torch.version.cuda}"
    _say(out, f"- machine: {machine_line()}{gpu}")
    _say(out, f"- state dict: Qwen3-30B-A3B shapes **with {args.layers} of 48 layers** "
              f"(so that trainer and engine copies fit on one GPU): {len(specs)} tensors, "
              f"{sum(s.nbytes for s in specs) / 1e9:.2f} GB bf16 per rank; {args.ranks} rank(s) "
              f"on {'cuda:0 with logical GPU UUIDs' if dev == 'cuda' else 'CPU (shared memory)'}")
    _say(out, "- engine: reference engine loading every chunk like vLLM 0.33 (packed: the "
              "buffer mapped as `PackedBufferImporter` does, each tensor copied from it into "
              "its weight in one batched copy, a chunk answered once its copy is done; "
              "unpacked: each tensor mapped and copied). Unlike vLLM, it prepares a chunk "
              "already waiting while the previous chunk's copy runs, and does not run "
              "`load_weights`: a faster engine than vLLM, so that slotsync's own cost shows; "
              "preloaded by two uncounted updates before the configurations, as a served "
              "engine holds its checkpoint's weights")
    counted = (f"median of rounds 2..{args.rounds}" if args.rounds > 1
               else "one round, warm-up included (use --rounds 2 or more)")
    _say(out, f"- round = begin .. commit ack, slowest rank; {counted}")
    _say(out, f"- daemon: `chunks_in_flight = {args.chunks_in_flight}` (`/update_weights` calls "
              "sent before the first returned)")
    _say(out)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    res = run_gpu(configs, ranks=args.ranks, model=model, rounds=args.rounds, device=dev,
                  chunks_in_flight=args.chunks_in_flight,
                  log=lambda s: _say(out, "- " + s.strip()), profile_dir=args.profile)
    _say(out)
    total = res.ranks * res.nbytes_per_rank
    rows = [["plain D2D copy (`dst.copy_(src)`, best of 5)", "1", f"{res.copy_s:.4f}",
             f"{total / res.copy_s / 1e9:.0f}", "1.0", "", ""]]
    for row in res.rows:
        cfg, m = row.config, statistics.median(row.rounds)
        n = cfg.staging_bytes // MiB
        name = f"{cfg.label} ({n} MiB each)" if cfg.packed else f"unpacked (chunks <= {n} MiB)"
        rows.append([name, str(row.chunks),
                     f"{m:.4f}", f"{total / m / 1e9:.1f}", f"**{m / res.copy_s:.1f}**",
                     f"{row.first_s / m:.2f}" if args.rounds > 1 else "",
                     f"{max(row.rounds) / m:.2f}" if args.rounds > 1 else "",
                     f"{row.export_s:.4f}", f"{row.engine_load_s:.4f}",
                     f"{row.engine_sync_s:.4f}", f"{row.engine_call_s:.4f}"])
    _say(out, table(["path", "chunks/round", "seconds/round", "GB/s", "x copy",
                     "first round / median", "slowest later round / median",
                     "publisher export s", "engine load s", "of which device wait s",
                     "engine calls s"], rows))
    _say(out)
    _say(out, "first round: each configuration's first, with a fresh daemon and publisher "
              "(the engine was preloaded, see above); slowest later round: the slowest of "
              "the counted rounds. publisher export: rank 0's time laying chunks out, "
              "copying into the staging buffer (or exporting each tensor), synchronizing "
              "and exporting, per round; "
              "engine load: mean per worker and round inside `update_weights` (parse, map, "
              "copy, synchronize), and of that the wait for the device's copies; engine calls: "
              "the daemon's `/update_weights` calls per round, end to end (the load plus HTTP, "
              "the engine's front and its hand-off to the workers; with `chunks_in_flight` > 1 "
              "a call also counts its wait behind the one before, so the sum exceeds the "
              "round). Engine figures are means over the counted rounds. The rest of a round "
              "is ZeroMQ, the daemon and the acks; packed, the publisher fills the next chunks "
              "while the engine loads chunk k.")
    _say(out)
    if args.profile:
        _print_profiles(args.profile)
    if args.report:
        update_section(args.report, "gpu", "\n".join(out))
        print(f"wrote section 'gpu' of {args.report}")
    return 0


def _print_profiles(directory: str, top: int = 14) -> None:
    """Print the ``top`` functions by own time of every ``.prof`` file in ``directory``."""
    import glob
    import pstats

    for path in sorted(glob.glob(os.path.join(directory, "*.prof"))):
        print(f"\n### {os.path.basename(path)} (cProfile, sorted by own time)")
        pstats.Stats(path).strip_dirs().sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    """``python -m slotsync.bench``; Ctrl-C: one line, exit status 130."""
    p = argparse.ArgumentParser(prog="python -m slotsync.bench", description=__doc__)
    build_parser(p)
    a: Any = p.parse_args(argv)
    import signal

    # (Ctrl-C raises KeyboardInterrupt even if started with SIGINT ignored: `slotsync.cli`'s
    # take_ctrl_c says why; this module may not import the CLI package)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.exit(main_from_args(a))
    except KeyboardInterrupt:
        print("slotsync bench: interrupted", file=sys.stderr)
        sys.exit(130)

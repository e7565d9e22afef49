"""One run of ``slotsync bench hop`` (``run_hop``): both setups started (three daemons, node1
relaying to node0 over a CURVE link; two discarding reference engines), the rank processes'
interleaved rounds, the figures gathered (``HopResult``), everything stopped. What a round
measures: ``slotsync.bench.hop``'s docstring; the command line and the report are there too.

Standard library and ``slotsync.bench`` at import; the daemon's key maker, the engine launcher
and the test processes are imported by ``run_hop``, torch by the ranks' forkserver.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slotsync.bench.control import _DaemonLink, engine_call_seconds, next_rank_report
from slotsync.bench.model import (
    Qwen3MoeConfig,
    TensorSpec,
    chunk_specs,
    qwen3_moe_specs,
    uniform_specs,
)

MiB = 1 << 20
SETUPS = ("one", "two")
LABELS = {"one": "one daemon", "two": "two nodes"}


@dataclass(frozen=True)
class HopPlan:
    """What every rank process needs (picklable for the forkserver)."""

    ranks: int
    packed: bool
    staging_bytes: int
    staging_buffers: int
    endpoints: dict[str, tuple[str, ...]]  # setup -> each rank's daemon endpoint
    engine_urls: dict[str, str]  # setup -> its engine
    status_urls: dict[str, str]  # setup -> the driving daemon's status server
    tensors: int | None  # None: Qwen3-30B-A3B with ``layers`` layers; else N uniform tensors
    layers: int
    rounds: int
    warmup: int
    timeout_s: float = 300.0


@dataclass
class SetupTimes:
    """One setup's counted rounds (seconds)."""

    chunk_s: list[float] = field(default_factory=list)  # the slot's chunk intervals
    round_s: list[float] = field(default_factory=list)  # slowest rank, per round
    engine_s: list[float] = field(default_factory=list)  # /update_weights per chunk, per round
    cpu_s: dict[str, float] = field(default_factory=dict)  # process group -> CPU s, counted


@dataclass
class HopResult:
    """Both setups' figures and what the run was."""

    times: dict[str, SetupTimes]
    chunks: int
    tensors: int
    nbytes: int
    peer_link: dict = field(default_factory=dict)  # node1's link to node0, from its /status

    def ratio(self, stat: Callable[[Sequence[float]], float] | None = None,
              what: str = "chunk_s") -> float:
        """two nodes / one daemon of ``stat`` (default: the median) of ``what``."""
        stat = stat or statistics.median
        one, two = getattr(self.times["one"], what), getattr(self.times["two"], what)
        return stat(two) / stat(one) if one and two else float("nan")


def _specs(plan: HopPlan) -> list[TensorSpec]:
    if plan.tensors is None:
        return qwen3_moe_specs(Qwen3MoeConfig(layers=plan.layers))
    return uniform_specs(plan.tensors)


# ------------------------------------------------------------------------------- rank side


def _rank_main(rank: int, plan: HopPlan, barrier: Any, results: Any) -> None:
    """Entry point of one rank process; puts ("result"|"error"|"progress", rank, data) on
    ``results``. Ignores Ctrl-C, which reaches the whole process group: the bench stops its
    ranks."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        results.put(("result", rank, _rank_session(rank, plan, barrier, results)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        with_barrier_broken(barrier)
        results.put(("error", rank, traceback.format_exc()))


def with_barrier_broken(barrier: Any) -> None:
    """Break ``barrier`` so that the other ranks stop waiting at it (they then fail too)."""
    try:
        barrier.abort()
    except Exception:  # noqa: BLE001, S110 - best effort
        pass


def _rank_session(rank: int, plan: HopPlan, barrier: Any, results: Any) -> dict[str, Any]:
    from slotsync.bench.fake_exports import FakeExports
    from slotsync.protocol import wire
    from slotsync.protocol.rank.export import handle_from_reduce_args
    from slotsync.protocol.rank.publisher import MAX_UNACKED_CHUNKS

    chunks = chunk_specs(_specs(plan), plan.staging_bytes)
    fake = FakeExports(rank)
    links: dict[str, _DaemonLink] = {}
    next_id: dict[str, int] = {}
    out: dict[str, Any] = {s: {"acks": [], "round_s": [], "engine_s": []} for s in SETUPS}
    ahead = plan.staging_buffers - 1 if plan.packed else MAX_UNACKED_CHUNKS - 1

    def one_round(setup: str, uid: int) -> tuple[list[float], float]:
        """The slotsync round of ``bench control`` on ``setup``'s link: (the time of each
        chunk's ack, begin to commit ack in seconds)."""
        link = links[setup]
        exports = fake.round(chunks, plan.packed, plan.staging_bytes, plan.staging_buffers)
        acks: list[float] = []
        unacked: list[int] = []
        t_round = time.monotonic()
        link.send(wire.Begin(update_id=uid, weight_version=f"hop-{setup}-{uid}"))
        for k, (c, args) in enumerate(zip(chunks, exports, strict=True)):
            frame = wire.encode(wire.Chunk(
                update_id=uid, index=k, names=[s.name for s in c],
                dtype_names=[s.dtype for s in c], shapes=[list(s.shape) for s in c],
                tensor_sizes=[s.nbytes for s in c],
                handles=[handle_from_reduce_args(a) for a in args],
            ))  # fmt: skip
            while len(unacked) > ahead:
                link.wait("chunk", unacked.pop(0))
                acks.append(time.monotonic())
            link.send(frame)
            unacked.append(k)
        link.send(wire.Commit(update_id=uid, num_chunks=len(chunks)))
        while unacked:
            link.wait("chunk", unacked.pop(0))
            acks.append(time.monotonic())
        link.wait("commit")
        return acks, time.monotonic() - t_round

    try:
        for s in SETUPS:
            links[s] = _DaemonLink(plan.endpoints[s][rank], plan.timeout_s)
            links[s].send(wire.Register(
                protocol_version=wire.PROTOCOL_VERSION, rank=rank,
                gpu_uuid=wire.logical_gpu_uuid(rank), slot_start=0, slot_size=plan.ranks,
                engine_url=plan.engine_urls[s], packed=plan.packed, transport="cuda",
                pid=os.getpid(),
            ))  # fmt: skip
            next_id[s] = links[s].wait("register").next_update_id
        for r in range(plan.rounds):
            for s in SETUPS if r % 2 == 0 else SETUPS[::-1]:
                barrier.wait(plan.timeout_s)  # one setup at a time, every rank together
                counted = r >= plan.warmup
                e0 = engine_call_seconds(plan.status_urls[s]) if rank == 0 and counted else None
                acks, dt = one_round(s, next_id[s])
                next_id[s] += 1
                if e0 is not None:
                    e1 = engine_call_seconds(plan.status_urls[s])
                    if e1[1] > e0[1]:
                        out[s]["engine_s"].append((e1[0] - e0[0]) / (e1[1] - e0[1]))
                if counted:
                    out[s]["acks"].append(acks)
                    out[s]["round_s"].append(dt)
                if rank == 0:
                    results.put(("progress", rank, (r, s, dt, counted)))
        barrier.wait(plan.timeout_s)
    finally:
        for link in links.values():
            link.close()
    return out


# ------------------------------------------------------------------------------- parent side


def _configs(folder: str, ranks: int, urls: dict[str, str], port: int) -> dict[str, str]:
    """Write the three daemons' TOML files into ``folder``; returns name -> path."""
    keys = os.path.join(folder, "keys")
    half = ranks // 2
    paths = {}
    paths["one"] = os.path.join(folder, "one.toml")
    with open(paths["one"], "w") as f:
        f.write(f'[[engines]]\nurl = "{urls["one"]}"\nslot_start = 0\nslot_size = {ranks}\n')
    for node in ("node0", "node1"):
        listen = f'peer_listen = "tcp://127.0.0.1:{port}"\n' if node == "node0" else ""
        paths[node] = os.path.join(folder, f"{node}.toml")
        with open(paths[node], "w") as f:
            f.write(
                f'node = "{node}"\n{listen}'
                f'curve_secret_key = "{keys}/{node}.key_secret"\n'
                f'peer_public_keys = "{keys}"\n\n'
                f'[[engines]]\nurl = "{urls["two"]}"\nslot_start = 0\nslot_size = {ranks}\n'
                f'owner = "node0"\nowner_address = "tcp://127.0.0.1:{port}"\n'
                f'nodes = [{{node = "node0", ranks = [0, {half}]}}, '
                f'{{node = "node1", ranks = [{half}, {ranks}]}}]\n')
    return paths


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _wait_link_up(daemons: dict[str, Any], timeout_s: float) -> dict:
    """node1's link to node0, once up (its ``/status`` entry).

    Raises:
        RuntimeError: not up within ``timeout_s``, or a daemon exited (with its log's end).
    """
    deadline = time.monotonic() + timeout_s
    link: dict = {}
    while time.monotonic() < deadline:
        for name, d in daemons.items():
            if d.proc.poll() is not None:
                raise RuntimeError(f"daemon {name} exited with {d.proc.returncode}: "
                                   f"{d.log_tail()}")
        try:
            links = _get_json(daemons["node1"].status_url + "/status").get(
                "peers", {}).get("links", [])
        except OSError as e:
            link = {"status": str(e)}
        else:
            link = links[0] if links else {}
            if link.get("up"):
                return link
        time.sleep(0.05)
    raise RuntimeError(f"node1's peer link to node0 did not come up within {timeout_s:g} s: "
                       f"{link}; node1's log: {daemons['node1'].log_tail()}")


def run_hop(ranks: int = 16, *, packed: bool = True, staging_bytes: int = 512 * MiB,
            staging_buffers: int = 4, tensors: int | None = None, layers: int = 48,
            rounds: int = 4, warmup: int = 1, timeout_s: float = 300.0,
            log: Callable[[str], None] = print,
            profile: Callable[[dict[str, int]], Any] | None = None) -> HopResult:
    """Start both setups (three daemons, two engines, ``ranks`` rank processes), run the
    interleaved rounds, stop everything and remove the temporary folder; returns the
    figures. ``profile``, if given, is called with the daemons' pids (``one``, ``node0``,
    ``node1``) once the warm-up rounds are done; what it returns is called (with no argument)
    after the rounds.

    Raises:
        ValueError: an odd ``ranks`` (the two nodes take half each) or below 2.
        RuntimeError: a rank failed (its traceback in the message), timed out, or the peer
            link did not come up.
    """
    from slotsync.daemon.node_links.peer_keys import make_keys
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.testing.ports import free_port
    from slotsync.testing.processes import DaemonProcess

    if ranks < 2 or ranks % 2:
        raise ValueError(f"--ranks must be even and >= 2 (half on each node), got {ranks}")
    folder = tempfile.mkdtemp(prefix="slotsync-hop-")
    engines: list[ReferenceEngine] = []
    daemons: dict[str, DaemonProcess] = {}
    try:
        for node in ("node0", "node1"):
            make_keys(node, os.path.join(folder, "keys"))
        t0 = time.monotonic()
        _forkserver()  # (its import of torch runs while the engines and daemons start)
        # (one after the other, from this thread: a helper's PR_SET_PDEATHSIG fires when the
        # thread that started it ends, so a thread pool here would stop them at once)
        engines = [ReferenceEngine(workers=ranks, discard=True, start=False) for _ in SETUPS]
        urls = {s: e.url for s, e in zip(SETUPS, engines, strict=True)}
        paths = _configs(folder, ranks, urls, free_port())
        for e in engines:
            e.start()
        t1 = time.monotonic()
        for name in ("one", "node0", "node1"):
            daemons[name] = DaemonProcess(runtime_dir=os.path.join(folder, name),
                                          args=["--config", paths[name], "--log-level",
                                                "warning"])
        _wait_link_up(daemons, 30)
        log(f"started: 2 engines of {ranks} workers ({t1 - t0:.1f} s), 3 daemons and node1's "
            f"peer link to node0 ({time.monotonic() - t1:.1f} s)")
        half = ranks // 2
        plan = HopPlan(
            ranks, packed, staging_bytes, staging_buffers,
            {"one": (daemons["one"].endpoint,) * ranks,
             "two": (daemons["node0"].endpoint,) * half + (daemons["node1"].endpoint,) * half},
            urls, {"one": daemons["one"].status_url, "two": daemons["node0"].status_url},
            tensors, layers, rounds, warmup, timeout_s,
        )  # fmt: skip
        pids = {n: d.proc.pid for n, d in daemons.items()}
        groups = {f"daemon {n}": [p] for n, p in pids.items()}
        for s, e in zip(SETUPS, engines, strict=True):
            pid = getattr(e.proc, "pid", None)
            groups[f"engine {s}"] = _with_descendants(pid) if pid else []
        times = _run_ranks(plan, log, (lambda: profile(pids)) if profile else None, groups)
        link = _get_json(daemons["node1"].status_url + "/status")["peers"]["links"][0]
        for name, d in daemons.items():
            if d.proc.poll() is not None:
                raise RuntimeError(f"daemon {name} exited: {d.log_tail()}")
        specs = _specs(plan)
        return HopResult(times, len(chunk_specs(specs, staging_bytes)), len(specs),
                         sum(s.nbytes for s in specs), link)
    finally:
        for d in daemons.values():
            d.stop()
        for e in engines:
            e.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds this machine's processes used so far, every core (``/proc/stat``: user,
    nice, system, irq, softirq; not idle, iowait or the hypervisor's steal; guest time is in
    user already)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / _TICKS


def _with_descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (an engine's front and its workers)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def _forkserver() -> Any:
    """The ranks' multiprocessing context: they fork from a forkserver that imported torch
    once (as ``bench control``'s do), started now if it is not running yet."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "slotsync.bench.hop_run"])
    from slotsync.bench.control import _start_forkserver_deaf_to_ctrl_c

    _start_forkserver_deaf_to_ctrl_c()  # (not interrupted while importing torch)
    return ctx


def _run_ranks(plan: HopPlan, log: Callable[[str], None], profile: Callable[[], Any] | None,
               groups: dict[str, list[int]]) -> dict[str, SetupTimes]:
    """Run the rank processes; returns each setup's figures. ``groups``: process group name
    -> pids, whose CPU time is read after each round (the ranks are added as ``ranks``) and
    counted to that round's setup."""
    ctx = _forkserver()
    q = ctx.Queue()
    barrier = ctx.Barrier(plan.ranks)
    procs = [ctx.Process(target=_rank_main, args=(r, plan, barrier, q), daemon=True)
             for r in range(plan.ranks)]
    for p in procs:
        p.start()
    groups = {**groups, "ranks": [p.pid for p in procs if p.pid]}

    def cpu_now() -> dict[str, float]:
        now = {g: sum(_cpu_s(p) for p in ps) for g, ps in groups.items()}
        now["machine"] = _machine_busy_s()
        return now

    cpu: dict[str, dict[str, float]] = {s: {} for s in SETUPS}
    cpu_last = cpu_now()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + plan.timeout_s * 2
    stop_profile = None
    rounds_done = 0  # (setup rounds, as rank 0 reports them)
    if profile is not None and plan.warmup == 0:
        stop_profile = profile()
    try:
        while len(got) < plan.ranks:
            item = next_rank_report(q, procs, deadline, "bench hop ranks")
            if item is None:
                continue
            kind, rank, data = item
            if kind == "progress":
                r, setup, dt, counted = data
                now = cpu_now()  # (this round's CPU: since the last round's end)
                if counted:
                    for g, v in now.items():
                        cpu[setup][g] = cpu[setup].get(g, 0.0) + v - cpu_last[g]
                cpu_last = now
                rounds_done += 1
                if profile is not None and stop_profile is None \
                        and rounds_done == 2 * plan.warmup:
                    stop_profile = profile()  # (every warm-up round of both setups done)
                log(f"  round {r + 1}/{plan.rounds} {LABELS[setup]}: {dt:.3f} s (rank 0)"
                    + ("" if counted else " (warm-up)"))
                continue
            got[rank] = data
    finally:
        if stop_profile is not None:
            stop_profile()
        if len(got) < plan.ranks:
            with_barrier_broken(barrier)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
        q.join_thread()
    out: dict[str, SetupTimes] = {}
    for s in SETUPS:
        t = SetupTimes(engine_s=got[0][s]["engine_s"], cpu_s=cpu[s])
        counted = len(got[0][s]["acks"])
        for i in range(counted):
            last = [max(got[r][s]["acks"][i][k] for r in range(plan.ranks))
                    for k in range(len(got[0][s]["acks"][i]))]
            t.chunk_s += [b - a for a, b in zip(last, last[1:], strict=False)]
            t.round_s.append(max(got[r][s]["round_s"][i] for r in range(plan.ranks)))
        machine = t.cpu_s.pop("machine", 0.0)
        t.cpu_s["other processes"] = max(0.0, machine - sum(t.cpu_s.values()))
        out[s] = t
    return out

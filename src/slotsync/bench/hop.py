"""``slotsync bench hop``: what the peer link's hop costs (issue 25 I).

The same round -- ``--ranks`` trainer ranks (default 16) in one engine slot, Qwen3-30B-A3B
shapes, the control plane on CPU as ``slotsync bench control`` measures it -- through two
setups, side by side in one run:

* **one daemon**: every rank publishes to one ``slotsyncd``, which drives the engine;
* **two nodes**: ranks ``[0, N/2)`` publish to node0's daemon, which owns the engine (an engine
  over several nodes, ``owner = "node0"``), ranks ``[N/2, N)`` to node1's daemon, which relays
  their frames to node0's over a ZeroMQ TCP link on loopback with CURVE (keys made by
  ``peer_keys.make_keys`` in a temporary folder) and hands node0's replies back.

Each setup has its own discarding reference engine of N workers (``--discard``: it parses
every ``update_info`` and maps nothing), identical, so that neither daemon sees the other's
weight versions. The ranks are the same processes for both setups (forked from a forkserver
that imported torch once), each holding a link to its daemon of each setup; every round, all
ranks run one setup, then the other, in the order A/B/B/A, so that drift hits both.

A rank's round is ``bench control``'s slotsync round: Begin, the chunks pipelined as
``Publisher.publish`` sends them (packed: up to ``--staging-buffers`` chunks unacknowledged;
synthetic ``reduce_tensor`` tuples turned into handle records by the publisher's own
``handle_from_reduce_args``), Commit. Per chunk: the time between two consecutive chunks'
acknowledgements as the **last** rank got them (every rank stamps each ack with
``time.monotonic``, one clock for every process of this machine), from chunk 0's ack on (the
begin's engine calls not counted) -- the slot's chunk rate, including the relayed ranks' acks'
way back over the link. Per round: the slowest rank's begin to commit ack.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
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
TARGET = 1.2
"""Issue 25 I: the hop may cost at most this factor per chunk."""


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
    ``results``."""
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
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "slotsync.bench.hop"])
    forkserver.ensure_running()
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


# ------------------------------------------------------------------------------- statistics


def p90(xs: Sequence[float]) -> float:
    """90th percentile (nearest rank), or NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.9 * len(s) + 0.5) - 1))]


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _ms(x: float) -> str:
    return "n/a" if x != x else f"{x * 1e3:.2f}"


# ------------------------------------------------------------------------------- command


def add_arguments(h: argparse.ArgumentParser, positive_int: Any, nonneg_int: Any) -> None:
    """The options of ``slotsync bench hop``."""
    h.add_argument("--ranks", type=positive_int, default=16,
                   help="trainer ranks in the slot, half on each node (default 16)")
    h.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds per setup, warm-up included (default 3; more for steadier "
                        "figures)")
    h.add_argument("--warmup", type=nonneg_int, default=1,
                   help="first rounds not counted (default 1)")
    h.add_argument("--layers", type=positive_int, default=48,
                   help="Qwen3-30B-A3B layers (default 48)")
    h.add_argument("--tensors", type=positive_int, default=None,
                   help="N uniform 3 MiB tensors per round instead of Qwen3-30B-A3B")
    h.add_argument("--mode", choices=("packed", "unpacked"), default="packed",
                   help="the publisher's mode (default packed)")
    h.add_argument("--staging-mb", type=positive_int, default=512,
                   help="chunk size in MiB (default 512)")
    h.add_argument("--staging-buffers", type=int, default=4, choices=range(1, 9),
                   metavar="{1..8}", help="packed: the publisher's staging regions (default 4)")
    h.add_argument("--py-spy", default="", metavar="DIR",
                   help="record the three daemons with py-spy (next to this Python) during "
                        "the counted rounds into DIR: one.txt, node0.txt, node1.txt (collapsed "
                        "stacks with sample counts, on-CPU samples only, 250 Hz; the samplers' "
                        "own CPU weighs on the figures of that run)")
    h.add_argument("--report", default="", metavar="FILE",
                   help="also rewrite this command's section of FILE (e.g. BENCHMARKS.md); "
                        "default: print only")
    h.add_argument("--section", default="hop", help="section of --report (default hop)")


def _py_spy(folder: str) -> Callable[[dict[str, int]], Callable[[], None]]:
    """A ``run_hop`` profile hook: ``py-spy record`` of each daemon into ``folder``."""
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        exe = shutil.which("py-spy") or "py-spy"
    os.makedirs(folder, exist_ok=True)

    def start(pids: dict[str, int]) -> Callable[[], None]:
        procs = []
        for name, pid in pids.items():
            procs.append(subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                 "--output", os.path.join(folder, f"{name}.txt"), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def stop() -> None:
            import signal

            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)  # py-spy writes its output at SIGINT
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

        return stop

    return start


def main_from_args(args: argparse.Namespace) -> int:
    """``slotsync bench hop``: prints the figures (and with ``--report`` writes them)."""
    from slotsync.bench.report import command_line, machine_line, table, update_section

    if args.rounds <= args.warmup:
        print(f"--rounds {args.rounds} leaves no counted round after --warmup {args.warmup}",
              file=sys.stderr)
        return 2
    if args.ranks < 2 or args.ranks % 2:
        print(f"--ranks must be even and >= 2 (half on each node), got {args.ranks}",
              file=sys.stderr)
        return 2
    out: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        out.append(line)

    def progress(line: str) -> None:
        print(line, flush=True)

    packed = args.mode == "packed"
    if args.tensors is None:
        what = f"Qwen3-30B-A3B ({args.layers} layers)"
    else:
        what = f"{args.tensors} uniform tensors of 768x2048 bf16 (3 MiB)"
    load0 = os.getloadavg()
    t_all = time.monotonic()
    progress(f"slotsync bench hop: {args.ranks} ranks, {what}, {args.mode}, {args.rounds} "
             f"rounds per setup ({args.warmup} warm-up), load average {load0[0]:.2f}")
    res = run_hop(args.ranks, packed=packed, staging_bytes=args.staging_mb * MiB,
                  staging_buffers=args.staging_buffers, tensors=args.tensors,
                  layers=args.layers, rounds=args.rounds, warmup=args.warmup, log=progress,
                  profile=_py_spy(args.py_spy) if args.py_spy else None)
    wall = time.monotonic() - t_all
    load1 = os.getloadavg()
    half = args.ranks // 2
    title = "" if args.section == "hop" else f" (section {args.section})"
    say(f"## Cost of the hop (CPU): `slotsync bench hop`{title}")
    say()
    say(f"- command: `{command_line()}`")
    say(f"- machine: {machine_line()}")
    say(f"- round: {what}: {res.tensors} tensors, {res.nbytes / 1e9:.1f} GB bf16 per rank, "
        f"{args.staging_mb} MiB chunks -> {res.chunks} chunks per round, {args.mode}"
        + (f" with {args.staging_buffers} staging region(s) per rank" if packed else "")
        + f"; {args.ranks} ranks in one slot; {args.rounds} rounds per setup ({args.warmup} "
        "warm-up not counted), setups interleaved A/B/B/A")
    say(f"- **one daemon**: every rank on one `slotsyncd`; **two nodes**: ranks [0, {half}) "
        f"on node0's daemon (the owner, which drives the engine), ranks [{half}, "
        f"{args.ranks}) on node1's, which relays their frames to node0's over ZeroMQ TCP on "
        "loopback with CURVE and hands the replies back")
    say(f"- engine: one reference engine per setup, `--discard` (parses every update_info, "
        f"maps nothing), {args.ranks} workers each")
    say("- per chunk: the time between two consecutive chunks' acks as the last rank got "
        "them (the slot's chunk rate, ranks pipelining as `Publisher.publish` does; from chunk "
        "0's ack on; acks come in bursts, up to `chunks_in_flight` engine calls at once, so the "
        "mean -- the round's chunk span over its chunks -- is the steadier rate); per round: "
        "the slowest rank's begin to commit ack; engine call: the driving daemon's "
        "`/update_weights` time per chunk (its metric)")
    say(f"- **CPU contention**: {2 * args.ranks + 3} busy processes in a round (ranks, engine "
        f"workers and front, one or two daemons) share {os.cpu_count()} cores; load average "
        f"(1 min) {load0[0]:.2f} before the run, {load1[0]:.2f} at its end (the bench's own "
        "processes included; what else ran: the CPU table's last column)")
    rtt = res.peer_link.get("rtt_ms")
    say(f"- peer link at the end (node1's side): {res.peer_link.get('messages_out')} messages "
        f"out, {res.peer_link.get('messages_in')} in, last ping round trip "
        + ("n/a (no ping yet)" if rtt is None else f"{rtt} ms"))
    say()
    rows = []
    for s in SETUPS:
        t = res.times[s]
        rows.append([LABELS[s], _ms(_median(t.chunk_s)), _ms(p90(t.chunk_s)),
                     _ms(_mean(t.chunk_s)), _ms(_median(t.engine_s)), _ms(_median(t.round_s)),
                     _ms(p90(t.round_s)), str(len(t.round_s))])
    r_med, r_p90, r_mean = res.ratio(), res.ratio(p90), res.ratio(_mean)
    rows.append(["**ratio** two nodes / one daemon", f"**{r_med:.2f}**", f"{r_p90:.2f}",
                 f"{r_mean:.2f}", f"{res.ratio(what='engine_s'):.2f}",
                 f"**{res.ratio(what='round_s'):.2f}**", f"{res.ratio(p90, 'round_s'):.2f}",
                 ""])
    say(table(["setup", "chunk median ms", "chunk p90 ms", "chunk mean ms",
               "engine call ms/chunk", "round median ms", "round p90 ms", "rounds"], rows))
    say()
    say("CPU per chunk (ms; all processes of a group, user + system, over the counted "
        "rounds, from /proc; other processes: the machine's busy time less the bench's, i.e. "
        "what else ran on this shared machine meanwhile):")
    say()
    cols = ["ranks", "engine", "daemon one", "daemon node0", "daemon node1"]
    crow = []
    for s in SETUPS:
        t = res.times[s]
        n = max(1, len(t.round_s) * res.chunks)
        by = {"ranks": t.cpu_s.get("ranks", 0.0), "engine": t.cpu_s.get(f"engine {s}", 0.0)}
        for d in ("one", "node0", "node1"):
            by[f"daemon {d}"] = t.cpu_s.get(f"daemon {d}", 0.0)
        others = t.cpu_s.get("other processes", 0.0)
        total = sum(t.cpu_s.values()) - others
        crow.append([LABELS[s], *(f"{by[c] / n * 1e3:.2f}" for c in cols),
                     f"{total / n * 1e3:.2f}", f"{others / n * 1e3:.2f}"])
    say(table(["setup", *cols, "all of the bench (the idle setup's too)",
               "other processes"], crow))
    say()
    def verdict(r: float) -> str:
        return "within" if r <= TARGET else "over"

    say(f"hop ratio per chunk (two nodes / one daemon): median {r_med:.2f}x, p90 "
        f"{r_p90:.2f}x, mean {r_mean:.2f}x; target <= {TARGET}x: median {verdict(r_med)}, "
        f"mean {verdict(r_mean)}")
    say()
    say(f"_total {wall:.0f} s_")
    if args.report:
        update_section(args.report, args.section, "\n".join(out))
        print(f"wrote section {args.section!r} of {args.report}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from slotsync.bench.cli import main

    main(["hop", *sys.argv[1:]])

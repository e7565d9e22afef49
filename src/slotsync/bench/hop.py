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
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from slotsync.bench.hop_run import LABELS, SETUPS, MiB, run_hop

TARGET = 1.2
"""Issue 25 I: the hop may cost at most this factor per chunk."""


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

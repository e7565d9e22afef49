"""Helpers for the fault-injection suite (``tests/test_faults.py``) and the soak test.

* :class:`RankPool`: warm trainer-rank processes. Each one imports torch once (~1.5 s on this
  machine) and then runs ``trainer_script.run_rank`` jobs one after another, so a scenario pays
  for a round, not for an interpreter start. A rank can be SIGKILLed mid-round
  (:meth:`RankRun.kill`); the pool replaces the dead process in the background.
* :class:`WireRank`: a raw ZeroMQ DEALER speaking ``slotsync.protocol.wire`` directly, for
  protocol abuse (two begins, commit before chunks, chunk after commit, stale ids, fuzz).
* :class:`Recorder`: collects one row per scenario and mode for ``docs/reliability.md``
  (written as JSON when ``SLOTSYNC_RELIABILITY_OUT`` names a file).
* small readers: engine state, daemon slot state, ``/proc`` RSS and fd counts, ``/dev/shm``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from slotsync.protocol import wire
from slotsync.protocol.link import DaemonLink

TESTS_DIR = str(Path(__file__).resolve().parent)
RELIABILITY_ENV = "SLOTSYNC_RELIABILITY_OUT"


# ------------------------------------------------------------------------------ rank processes


class _PipeQueue:
    """The ``results.put`` interface ``run_rank`` expects, over one process's own pipe.

    A pipe per process (not one shared ``mp.Queue``): a rank SIGKILLed while writing could
    leave a shared queue's lock held and wedge every other rank's reports."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put(self, item: Any) -> None:
        self.conn.send(item)


def _rank_server(conn: Connection, tests_dir: str) -> None:
    """Body of one pooled rank process: import torch once, then run jobs until ``None``."""
    import sys

    sys.path.insert(0, tests_dir)
    # Like a rank started by torchrun, this process gets its own resource tracker, so a
    # SIGKILL leaves the tracker to unlink the dead rank's /dev/shm segments (under a shared
    # multiprocessing tracker they would stay until the whole test session exits).
    from multiprocessing import resource_tracker

    own = resource_tracker.ResourceTracker()
    resource_tracker._resource_tracker = own
    # the module binds these at import time to the inherited tracker
    for name in ("ensure_running", "register", "unregister", "getfd"):
        setattr(resource_tracker, name, getattr(own, name))
    import torch  # noqa: F401 - the warm-up this pool exists for
    import trainer_script

    torch.set_num_threads(1)
    conn.send(("ready", -1, os.getpid()))
    q = _PipeQueue(conn)
    while True:
        job = conn.recv()
        if job is None:
            return
        trainer_script.run_rank(*job, q)


@dataclass
class _Proc:
    process: Any
    conn: Connection
    ready: bool = False
    pid: int = 0


class RankPool:
    """``size`` warm rank processes (spawn context).

    Args:
        size: processes kept warm; a run needing more starts them on demand.
    """

    def __init__(self, size: int = 4) -> None:
        self._ctx = mp.get_context("spawn")
        self._idle: list[_Proc] = [self._spawn() for _ in range(size)]
        self.size = size

    def _spawn(self) -> _Proc:
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=_rank_server, args=(child, TESTS_DIR), daemon=True)
        p.start()
        child.close()
        return _Proc(p, parent)

    def _take(self, timeout_s: float = 60.0) -> _Proc:
        proc = self._idle.pop(0) if self._idle else self._spawn()
        if not proc.ready:
            if not proc.conn.poll(timeout_s):
                raise RuntimeError("rank process did not start")
            kind, _, pid = proc.conn.recv()
            assert kind == "ready"
            proc.ready, proc.pid = True, pid
        return proc

    def _give_back(self, proc: _Proc) -> None:
        if proc.process.is_alive():
            self._idle.append(proc)
        else:
            self._replace()

    def _replace(self) -> None:
        while len(self._idle) < self.size:
            self._idle.append(self._spawn())

    def start(self, endpoint: str, jobs: list[dict]) -> RankRun:
        """Start one job per entry: ``{"rank", "slot": (start, count), "engine_url", "packed",
        "script"}``. Returns the run (call :meth:`RankRun.wait`)."""
        run = RankRun(self)
        for j in jobs:
            proc = self._take()
            proc.conn.send((j["rank"], endpoint, tuple(j["slot"]), j["engine_url"],
                            j["packed"], j.get("script", {})))
            run.procs[j["rank"]] = proc
            run.events[j["rank"]] = []
        run.t0 = time.monotonic()
        return run

    def close(self) -> None:
        for proc in self._idle:
            try:
                proc.conn.send(None)
            except OSError:
                pass
        for proc in self._idle:
            proc.process.join(3)
            if proc.process.is_alive():
                proc.process.kill()
        self._idle.clear()


class RankRun:
    """Jobs running in pooled processes: their events, arrival times, and kills."""

    def __init__(self, pool: RankPool) -> None:
        self.pool = pool
        self.procs: dict[int, _Proc] = {}
        self.events: dict[int, list[tuple]] = {}
        self.times: dict[int, list[float]] = {}
        self.killed: dict[int, float] = {}  # rank -> monotonic time of the SIGKILL
        self.t0 = 0.0

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def kill(self, rank: int) -> float:
        """SIGKILL the process running ``rank`` (no cleanup at all); returns the time."""
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.killed[rank] = time.monotonic()
        return self.killed[rank]

    def wait(self, timeout_s: float = 60.0, on_event=None, watch=None) -> dict[int, list]:
        """Collect events until every job that was not killed reported ``exit``.

        ``on_event(rank, event)`` runs for each event; ``watch()`` about every 0.1 s (to act
        on the daemon's or engine's state). Returns ``{rank: [events]}``.
        """
        done: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            live = {r: p for r, p in self.procs.items() if r not in done and r not in self.killed}
            if not live or time.monotonic() > deadline:
                break
            by_conn = {p.conn: r for r, p in live.items()}
            for conn in wait(list(by_conn), timeout=0.1):
                r = by_conn[conn]
                try:
                    ev = conn.recv()
                except (EOFError, OSError):
                    if r not in self.killed:
                        self.killed[r] = time.monotonic()  # died on its own: reported below
                    continue
                self.events[r].append(ev)
                self.times.setdefault(r, []).append(time.monotonic())
                if ev[0] == "exit":
                    done.add(r)
                if on_event is not None:
                    on_event(r, ev)
            if watch is not None:
                watch()
        missing = [r for r in self.procs if r not in done and r not in self.killed]
        for r, proc in self.procs.items():
            if r in missing:
                proc.process.kill()
            proc.process.join(0.1) if r in self.killed else None
            self.pool._give_back(proc)
        self.pool._replace()
        assert not missing, f"rank(s) {missing} did not exit in {timeout_s} s: {self.events}"
        return self.events

    def rounds(self, rank: int) -> list[tuple]:
        return [e for e in self.events[rank] if e[0] == "round"]

    def round_time(self, rank: int, k: int) -> float | None:
        """Monotonic arrival time of ``rank``'s result for round ``k``."""
        for ev, t in zip(self.events[rank], self.times.get(rank, []), strict=False):
            if ev[0] == "round" and ev[2] == k:
                return t
        return None


def job(rank: int, slot: tuple[int, int], engine_url: str, packed: bool, **script) -> dict:
    """One pool job: rank ``rank`` of slot ``(start, count)``; ``script`` as trainer_script."""
    return {"rank": rank, "slot": slot, "engine_url": engine_url, "packed": packed,
            "script": script}


# ------------------------------------------------------------------------------ raw wire


class WireRank(DaemonLink):
    """A raw DEALER socket to the daemon (no Publisher; ``protocol.link``): sends any frame
    (``send``, ``send_frames``), reads replies."""

    def recv(self, timeout_s: float = 5.0) -> Any:
        """The next reply, decoded, or None after ``timeout_s``."""
        return super().recv(timeout_s)

    def recv_until(self, pred, timeout_s: float = 10.0) -> Any:
        """Replies until one satisfies ``pred`` (returned) or the time is up (None)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            m = self.recv(left)
            if m is not None and pred(m):
                return m
        return None

    def register(self, rank: int, slot: tuple[int, int], engine_url: str, packed: bool,
                 version: int = wire.PROTOCOL_VERSION) -> Any:
        # Like the publisher: a rank still held by the previous job's process (closing its
        # connection right now) is retried for a few seconds.
        deadline = time.monotonic() + 10.0
        while True:
            self.send(wire.Register(version, rank, wire.logical_gpu_uuid(rank - slot[0]),
                                    slot[0], slot[1], engine_url, packed, "shm"))
            reply = self.recv()
            if not (isinstance(reply, wire.Error) and reply.code == wire.RANK_HELD
                    and time.monotonic() < deadline):
                return reply
            time.sleep(0.2)


def shm_chunks(names_tensors, packed: bool, rank: int):
    """Export ``[(name, tensor)]`` into one shared-memory segment; returns ``(segment,
    Chunk field dict without update_id/index)`` for hand-built wire messages."""
    from slotsync.protocol.export import ShmSegment, pack_into

    total = sum(t.numel() * t.element_size() for _, t in names_tensors)
    seg = ShmSegment(total, rank=rank)
    layout = pack_into(seg.tensor, names_tensors)
    if packed:
        handles = [seg.handle(0, total)]
    else:
        handles, off = [], 0
        for n in layout.tensor_sizes:
            handles.append(seg.handle(off, n))
            off += n
    return seg, dict(names=layout.names, dtype_names=layout.dtype_names, shapes=layout.shapes,
                     tensor_sizes=layout.tensor_sizes, handles=handles)


# ------------------------------------------------------------------------------ state readers


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` (kB) and open fd count of ``pid`` from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def shm_segments(pids: list[int] | None = None) -> list[str]:
    """``/dev/shm/slotsync-*`` segment names (of the given publisher pids only, if any)."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith("slotsync-")]
    except FileNotFoundError:
        return []
    if pids is not None:
        want = {f"slotsync-{p}-" for p in pids}
        names = [n for n in names if any(n.startswith(w) for w in want)]
    return sorted(names)


def engine_stats(engine) -> dict:
    return engine.request("GET", "/_slotsync/stats")[1]


def engine_checksums(engine) -> dict[str, dict[str, str]]:
    """``{worker: {name: sha256}}`` from the engine's ``/weight_checker`` (either engine)."""
    from slotsync.engine.checksum import checksums_by_worker

    status, body = engine.request("POST", "/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return checksums_by_worker(body)


def engine_summary(engine) -> str:
    """One line: paused flag, weight version, per-worker active flags (engine split?)."""
    try:
        s = engine_stats(engine)
    except OSError as e:
        return f"unreachable ({type(e).__name__})"
    act = "".join("A" if w["active"] else "-" for w in s["workers"])
    return (f"{'paused' if s['paused'] else 'serving'}, version={s['weight_version']}, "
            f"workers active=[{act}]")


def slot_status(daemon, slot: tuple[int, int] = (0, 2)) -> dict:
    for s in daemon.status()["slots"]:
        if tuple(s["slot"]) == slot:
            return s
    raise KeyError(slot)


def wait_for(pred, timeout_s: float = 10.0, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return bool(pred())


def in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


# ------------------------------------------------------------------------------ results table


def _engine_impl() -> str:
    from engines import impl

    return impl()


@dataclass
class Row:
    """One scenario x mode x engine for docs/reliability.md."""

    scenario: str
    mode: str
    fault: str
    engine: str = field(default_factory=_engine_impl)  # "reference" or "vllm" (tests/engines.py)
    happened: str = ""
    engine_after_fault: str = ""
    engine_final: str = ""
    rank_errors: list[str] = field(default_factory=list)
    detect_s: float | None = None
    other_slot: str = ""
    outcome: str = "fail"  # set to "pass" at the end of a scenario; "xfail (bug)"


class Recorder:
    """Collects rows; :meth:`dump` writes them as JSON to ``$SLOTSYNC_RELIABILITY_OUT``."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def row(self, scenario: str, mode: str, fault: str) -> Row:
        r = Row(scenario, mode, fault)
        self.rows.append(r)
        return r

    def dump(self) -> None:
        path = os.environ.get(RELIABILITY_ENV)
        if not path:
            return
        old: list[dict] = []
        if os.path.exists(path):
            try:
                old = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError):
                old = []
        Path(path).write_text(json.dumps(old + [r.__dict__ for r in self.rows], indent=1))


def describe_errors(run: RankRun, k: int, ranks: list[int]) -> list[str]:
    """``rank r: phase: first 80 chars`` for each rank's round-k result."""
    out = []
    for r in ranks:
        if r in run.killed and not run.rounds(r):
            out.append(f"rank {r}: (killed)")
            continue
        res = [e for e in run.rounds(r) if e[2] == k]
        if not res:
            out.append(f"rank {r}: no result")
        elif res[0][3] == "ok":
            out.append(f"rank {r}: ok")
        else:
            e = res[0]
            kind = f" [{e[10]}]" if len(e) > 10 and e[10] != "SlotsyncError" else ""
            out.append(f"rank {r}: {e[4]}{kind}: {e[5][:80]}")
    return out

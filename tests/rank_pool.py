"""Warm trainer-rank processes for the fault suite (``tests/faults/test_faults.py``) and the soak
test (moved from ``tests/faults_lib.py``, issue 16).

:class:`RankPool` keeps processes that each import torch once and then run
``trainer_script.run_rank`` jobs one after another, so a scenario pays for a round, not for an
interpreter start. A rank can be SIGKILLed mid-round (:meth:`RankRun.kill`); the pool replaces
the dead process in the background. :func:`job` builds one job.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

TESTS_DIR = str(Path(__file__).resolve().parent)


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
    conn.send({"event": "ready", "pid": os.getpid()})
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
    """``size`` warm rank processes (``spawned_ranks.rank_context``).

    Args:
        size: processes kept warm; a run needing more starts them on demand.
    """

    def __init__(self, size: int = 4) -> None:
        from spawned_ranks import rank_context

        self._ctx = rank_context()  # forked from a warm forkserver: torch imported once
        self._idle: list[_Proc] = [self._spawn() for _ in range(size)]
        self.size = size

    def _spawn(self) -> _Proc:
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=_rank_server, args=(child, TESTS_DIR), daemon=True)
        p.start()
        child.close()
        return _Proc(p, parent)

    def _take(self, timeout_s: float = 60.0) -> _Proc:
        while self._idle and not self._idle[0].process.is_alive():  # (a job that ended its
            dead = self._idle.pop(0)  # process, e.g. a SIGTERM raising SystemExit, was still
            dead.conn.close()  # exiting when it was given back: _give_back)
            dead.process.join(1)
        proc = self._idle.pop(0) if self._idle else self._spawn()
        if not proc.ready:
            if not proc.conn.poll(timeout_s):
                raise RuntimeError("rank process did not start")
            hello = proc.conn.recv()
            assert hello["event"] == "ready", hello
            proc.ready, proc.pid = True, hello["pid"]
        return proc

    def _give_back(self, proc: _Proc) -> None:
        if proc.process.is_alive():
            self._idle.append(proc)
        else:
            self._replace()

    def _replace(self) -> None:
        while len(self._idle) < self.size:
            self._idle.append(self._spawn())

    def start(self, endpoint: str | None, jobs: list[dict]) -> RankRun:
        """Start one job per entry: ``{"rank", "slot": (start, count), "engine_url", "packed",
        "script"}``, and optionally ``"endpoint"``: that rank's own daemon instead of
        ``endpoint`` (engines over several nodes: each rank publishes to its node's daemon).
        Returns the run (call :meth:`RankRun.wait`)."""
        run = RankRun(self)
        for j in jobs:
            proc = self._take()
            proc.conn.send((j["rank"], j.get("endpoint") or endpoint, tuple(j["slot"]),
                            j["engine_url"], j["packed"], j.get("script", {})))
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
        self.events: dict[int, list[dict]] = {}  # trainer_script's reports, by rank
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
                if ev["event"] == "exit":
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

    def rounds(self, rank: int) -> list[dict]:
        """``rank``'s round results (``{"event": "round", ...}``, see trainer_script)."""
        return [e for e in self.events[rank] if e["event"] == "round"]

    def round_time(self, rank: int, k: int) -> float | None:
        """Monotonic arrival time of ``rank``'s result for round ``k``."""
        for ev, t in zip(self.events[rank], self.times.get(rank, []), strict=False):
            if ev["event"] == "round" and ev["round"] == k:
                return t
        return None


def job(rank: int, slot: tuple[int, int], engine_url: str, packed: bool, **script) -> dict:
    """One pool job: rank ``rank`` of slot ``(start, count)``; ``script`` as trainer_script."""
    return {"rank": rank, "slot": slot, "engine_url": engine_url, "packed": packed,
            "script": script}

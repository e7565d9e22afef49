"""Trainer ranks as freshly spawned processes, each running ``trainer_script.run_rank`` once
(moved from ``test_integration.py``, issue 16; several test modules use it). The fault
suite's warm pool is ``rank_pool.RankPool``."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

from trainer_script import run_rank


def rank_context() -> mp.context.BaseContext:
    """The context rank processes start from: a forkserver that has imported torch and
    ``trainer_script`` once, so that a rank starts in a fraction of a second instead of
    importing torch (~1 s of CPU) anew (issue 24).

    Where vLLM is installed, the forkserver has imported vLLM's trainer side too (its weight
    transfer factory and RL router, which the vLLM-backend and SkyRL test modules import): a
    rank of those tests imported it anew, ~12 s of CPU each, a dozen ranks a run. (A module
    that fails to import is skipped by the forkserver; the rank then imports it itself.)"""
    ctx = mp.get_context("forkserver")
    preload = ["torch", "trainer_script", "slotsync.protocol.rank.publisher"]
    if importlib.util.find_spec("vllm") is not None:
        preload += VLLM_TRAINER_MODULES
    ctx.set_forkserver_preload(preload)
    return ctx


VLLM_TRAINER_MODULES = ["vllm.distributed.weight_transfer.factory",
                        "vllm.entrypoints.rl.online.api_router", "slotsync.integrations.vllm"]
"""vLLM's modules that the vLLM-backend and SkyRL tests' ranks import (``rank_context``)."""


def run_ranks(daemon: Any, engine_url: str, packed: bool, scripts: list[dict],
              timeout_s: float = 90.0,
              on_event: Callable[[dict], None] | None = None,
              daemon_of: Callable[[int], Any] | None = None,
              target: Callable[..., None] = run_rank) -> dict[int, list[dict]]:
    """Run one process per script (rank = index, one engine slot ``(0, len(scripts))``) against
    ``daemon`` (a ``DaemonProcess``); returns ``{rank: [reports]}`` (trainer_script's dicts).
    ``on_event(report)`` is called for each report as it arrives (to act mid-round).
    ``daemon_of(rank)``: each rank's own node's daemon (engines over several nodes), instead
    of ``daemon`` for all. ``target``: the rank's function, ``run_rank``'s arguments (a
    wrapper of it in a module of ``tests/``, e.g. ``garbage_on_ack.garbage_rank``).

    Raises:
        AssertionError: a rank did not report ``exit`` within ``timeout_s`` seconds.
    """
    ctx = rank_context()
    q = ctx.Queue()
    n = len(scripts)
    procs = [ctx.Process(target=target, args=(
        r, (daemon_of(r) if daemon_of else daemon).endpoint, (0, n), engine_url, packed,
        scripts[r], q)) for r in range(n)]
    for p in procs:
        p.start()
    events: dict[int, list] = {r: [] for r in range(n)}
    exited = 0
    deadline = time.monotonic() + timeout_s
    while exited < n and time.monotonic() < deadline:
        try:
            ev = q.get(timeout=0.5)
        except queue.Empty:
            continue
        events[ev["rank"]].append(ev)
        exited += ev["event"] == "exit"
        if on_event is not None:
            on_event(ev)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert exited == n, f"not every rank exited: {events}\n{daemon.log_tail()}"
    return events


def rounds(events: dict[int, list[dict]], rank: int) -> list[dict]:
    """``rank``'s round results (``{"event": "round", ...}``, see trainer_script)."""
    return [e for e in events[rank] if e["event"] == "round"]

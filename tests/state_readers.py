"""What fault scenarios read from the engine and the daemon while they run, and a poll loop
(moved from ``tests/faults_lib.py``, issue 16; ``/proc`` and ``/dev/shm`` readers are in
``slotsync.testing.procfs``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def engine_stats(engine: Any) -> dict:
    """The engine's test-only ``GET /_slotsync/stats`` body (either engine; ``engine`` is a
    ``ReferenceEngine`` or an ``EngineBox``)."""
    return engine.request("GET", "/_slotsync/stats")[1]


def engine_checksums(engine: Any) -> dict[str, dict[str, str]]:
    """``{worker: {name: sha256}}`` from the engine's ``/weight_checker`` (either engine)."""
    from slotsync.engine.checksum import checksums_by_worker

    status, body = engine.request("POST", "/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return checksums_by_worker(body)


def checksums_in_worker_order(engine: Any) -> list[dict[str, str]]:
    """Each worker's ``{name: sha256}`` in global worker order (``dp_index * TP + tp_rank``,
    the order of ``--gpu-uuids`` and of a list-form ``update_info``), from either engine,
    with or without DP: the reference engine keys ``/weight_checker`` by GPU UUID, vLLM by
    ``dp<d>:pp0:pcp0:tp<t>`` (``checksums_by_worker``: ``tp<t>`` for replica 0).

    Raises:
        AssertionError: the checksum keys are not exactly the engine's workers.
    """
    by = engine_checksums(engine)
    keys = []
    for w in engine_stats(engine)["workers"]:
        d, t = w.get("dp_index", 0), w.get("tp_rank", w["index"])
        keys.append(w["gpu_uuid"] if w["gpu_uuid"] in by
                    else f"tp{t}" if d == 0 else f"dp{d}:pp0:pcp0:tp{t}")
    assert set(by) == set(keys), (sorted(by), keys)
    return [by[k] for k in keys]


def engine_summary(engine: Any) -> str:
    """One line: paused flag, weight version, per-worker active flags (engine split?);
    ``unreachable (<error>)`` when the engine does not answer."""
    try:
        s = engine_stats(engine)
    except OSError as e:
        return f"unreachable ({type(e).__name__})"
    act = "".join("A" if w["active"] else "-" for w in s["workers"])
    return (f"{'paused' if s['paused'] else 'serving'}, version={s['weight_version']}, "
            f"workers active=[{act}]")


def slot_status(daemon: Any, slot: tuple[int, int] = (0, 2)) -> dict:
    """The daemon's ``/status`` entry of engine slot ``(start, count)``.

    Raises:
        KeyError: the daemon has no such slot.
    """
    for s in daemon.status()["slots"]:
        if tuple(s["slot"]) == slot:
            return s
    raise KeyError(slot)


def wait_for(pred: Callable[[], object], timeout_s: float = 10.0, step_s: float = 0.05) -> bool:
    """Poll ``pred()`` every ``step_s`` seconds until it is true (True) or ``timeout_s``
    seconds passed (then one last call decides)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return bool(pred())

"""Daemon + engine + trainer processes over real sockets (CPU, shared memory).

Each test starts ``slotsyncd`` and an engine as subprocesses -- the reference engine, or with
``SLOTSYNC_TEST_ENGINE=vllm`` (``pytest --engine vllm``) vLLM's own router and worker code
(``tests/engines.py``) -- and trainer ranks as spawned processes running
``tests/trainer_script.py``, then checks what each rank saw and the engine's final state (its
``/_slotsync/stats``, checksums, version, paused flag).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest

pytest.importorskip("torch")

from trainer_script import make_tensors, run_rank  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import checksums_by_worker, tensor_checksum  # noqa: E402

pytestmark = pytest.mark.slow


def run_ranks(daemon, engine_url, packed, scripts, timeout_s=90.0, on_event=None):
    """Run one process per script (rank = index); returns {rank: [events]}.
    ``on_event(event)`` is called for each event as it arrives (to act mid-round)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    n = len(scripts)
    procs = [ctx.Process(target=run_rank, args=(r, daemon.endpoint, (0, n), engine_url, packed,
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
        events[ev[1]].append(ev)
        exited += ev[0] == "exit"
        if on_event is not None:
            on_event(ev)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert exited == n, f"not every rank exited: {events}\n{daemon.log_tail()}"
    return events


def rounds(events, rank):
    return [e for e in events[rank] if e[0] == "round"]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_rounds_land_in_every_worker(fresh_engine, packed):
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_engine.url, packed, [{"rounds": 2}, {"rounds": 2}])
        for r in range(2):
            assert [e[3] for e in rounds(ev, r)] == ["ok", "ok"], ev
            assert rounds(ev, r)[0][4] >= 2  # several chunks per round
        want = {n: tensor_checksum(t) for n, t in make_tensors(2)}
        _, body = fresh_engine.request("POST", "/weight_checker", {"action": "checksum"})
        sums_by_worker = checksums_by_worker(body)
        assert len(sums_by_worker) == 2
        for sums in sums_by_worker.values():
            assert {n: sums[n] for n in want} == want
        assert fresh_engine.request("GET", "/weight_info")[1]["weight_version"] == "v2"
        assert fresh_engine.request("GET", "/is_paused")[1]["is_paused"] is False
        slot = d.status()["slots"][0]
        assert slot["state"] == "idle" and slot["updates_succeeded"] == 2
        metrics = d.metrics()
        assert 'slotsync_updates_total{outcome="success"} 2.0' in metrics


def test_two_ranks_claim_one_slot_with_different_engine_urls(fresh_engine):
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_engine.url, True,
                       [{"rounds": 0, "hold_s": 3.0},
                        {"rounds": 0, "engine_url": "http://127.0.0.1:1",
                         "register_delay_s": 1.0}])
        err = [e for e in ev[1] if e[0] == "register_error"]
        assert err and err[0][2] == "register"
        assert "http://127.0.0.1:1" in err[0][3] and fresh_engine.url in err[0][3]
        assert ("registered", 0) in ev[0]


def test_rank_that_never_sends_chunk_k_gets_deadline_error_naming_it(fresh_engine):
    before = fresh_engine.request("GET", "/_slotsync/stats")[1]
    with DaemonProcess(args=["--chunk-timeout-s", "2"]) as d:
        ev = run_ranks(d, fresh_engine.url, True,
                       [{"rounds": 1}, {"rounds": 1, "stop_before_chunk": (1, 1),
                                        "stall_s": 6}])
        for r in range(2):
            (e,) = rounds(ev, r)
            assert e[3] == "error" and e[4] == "chunk", e
            assert e[6] == [1] and "chunk 1" in e[5] and "rank(s) [1]" in e[5]
        stats = fresh_engine.request("GET", "/_slotsync/stats")[1]
        assert stats["paused"] is True  # I4: not resumed on half-loaded weights
        assert [w["finish_count"] for w in stats["workers"]] == [
            w["finish_count"] for w in before["workers"]]
        assert d.status()["slots"][0]["state"] == "failed"


def test_dtype_differs_on_one_rank_rejected_before_engine_sees_it(fresh_engine):
    before = fresh_engine.request("GET", "/_slotsync/stats")[1]
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_engine.url, False,
                       [{"rounds": 1}, {"rounds": 1,
                                        "dtype_of": {"layers.0.mlp.up.weight": "float16"}}])
        for r in range(2):
            (e,) = rounds(ev, r)
            assert e[3] == "error" and e[4] == "chunk" and "dtype_names" in e[5], e
            assert "layers.0.mlp.up.weight" in e[5]
        stats = fresh_engine.request("GET", "/_slotsync/stats")[1]
        # the mismatching chunk never reached the engine
        assert stats["route_counts"].get("update_weights", 0) == before["route_counts"].get(
            "update_weights", 0)
        assert stats["paused"] is True


def test_engine_500_on_chunk_k_reaches_every_rank_and_next_round_recovers(fresh_engine):
    fresh_engine.request("POST", "/_slotsync/fault",
                         {"route": "update_weights", "after": 1, "workers": [1]})
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_engine.url, True, [{"rounds": 2}, {"rounds": 2}])
        for r in range(2):
            first, second = rounds(ev, r)
            assert first[3] == "error" and first[4] == "engine", first
            assert "update_weights" in first[5] and "500" in first[5]
            assert second[3] == "ok", second  # recovered: finish, then a full update
        want = {n: tensor_checksum(t) for n, t in make_tensors(2)}
        _, body = fresh_engine.request("POST", "/weight_checker", {"action": "checksum"})
        for sums in checksums_by_worker(body).values():
            assert {n: sums[n] for n in want} == want
        assert fresh_engine.request("GET", "/weight_info")[1]["weight_version"] == "v2"
        slot = d.status()["slots"][0]
        assert slot["updates_failed"] == 1 and slot["updates_succeeded"] == 1
        assert slot["state"] == "idle"

"""Daemon + engine + trainer processes over real sockets (CPU, shared memory).

Each test starts ``slotsyncd`` and an engine as subprocesses -- the reference engine, or with
``SLOTSYNC_TEST_ENGINE=vllm`` (``pytest --engine vllm``) vLLM's own router and worker code
(``tests/engines.py``) -- and trainer ranks as spawned processes running
``tests/trainer_script.py``, then checks what each rank saw and the engine's final state (its
``/_slotsync/stats``, checksums, version, paused flag).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from spawned_ranks import rounds, run_ranks  # noqa: E402
from trainer_script import make_tensors  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import checksums_by_worker, tensor_checksum  # noqa: E402

pytestmark = pytest.mark.slow
# Daemon behaviour: against vLLM's own code where it is importable (engines.impl, issue 24).
ENGINE_UNDER_TEST = "vllm"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_rounds_land_in_every_worker(fresh_engine, packed):
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_engine.url, packed, [{"rounds": 2}, {"rounds": 2}])
        for r in range(2):
            assert [e["status"] for e in rounds(ev, r)] == ["ok", "ok"], ev
            assert rounds(ev, r)[0]["chunks"] >= 2  # several chunks per round
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
        err = [e for e in ev[1] if e["event"] == "register_error"]
        assert err and err[0]["phase"] == "register"
        assert "http://127.0.0.1:1" in err[0]["message"] and fresh_engine.url in err[0]["message"]
        assert {"event": "registered", "rank": 0} in ev[0]


def test_rank_that_never_sends_chunk_k_gets_deadline_error_naming_it(fresh_engine):
    before = fresh_engine.request("GET", "/_slotsync/stats")[1]
    with DaemonProcess(args=["--chunk-timeout-s", "2"]) as d:
        ev = run_ranks(d, fresh_engine.url, True,
                       [{"rounds": 1}, {"rounds": 1, "stop_before_chunk": (1, 1),
                                        "stall_s": 6}])
        for r in range(2):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and e["phase"] == "chunk", e
            assert e["missing_ranks"] == [1] and "chunk 1" in e["message"]
            assert "rank(s) [1]" in e["message"], e
        stats = fresh_engine.request("GET", "/_slotsync/stats")[1]
        assert stats["paused"] is True  # I4: not resumed on half-loaded weights
        assert [w["finish_count"] for w in stats["workers"]] == [
            w["finish_count"] for w in before["workers"]]
        assert d.status()["slots"][0]["state"] == "failed"


def test_dtype_differs_on_one_rank_rejected_before_engine_sees_it(fresh_engine):
    """The ranks' begin manifests differ (issue 17): refused before the pause, every rank's
    error naming the first tensor where the lists part -- its own name, dtype and shape --
    and the engine never paused (before: found at the chunk, the engine left paused)."""
    before = fresh_engine.request("GET", "/_slotsync/stats")[1]
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_engine.url, False,
                       [{"rounds": 1}, {"rounds": 1,
                                        "dtype_of": {"layers.0.mlp.up.weight": "float16"}}])
        for r, dtype in ((0, "float32"), (1, "float16")):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and e["phase"] == "begin", e
            assert "from tensor #1 on" in e["message"], e["message"]
            assert f"this rank's tensor #1 is 'layers.0.mlp.up.weight' ({dtype}, shape " \
                "[128, 64])" in e["message"], e["message"]
        stats = fresh_engine.request("GET", "/_slotsync/stats")[1]
        for route in ("pause", "start_weight_update", "update_weights"):
            assert stats["route_counts"].get(route, 0) == before["route_counts"].get(route, 0)
        assert stats["paused"] is False


def test_engine_500_on_chunk_k_reaches_every_rank_and_next_round_recovers(fresh_engine):
    fresh_engine.request("POST", "/_slotsync/fault",
                         {"route": "update_weights", "after": 1, "workers": [1]})
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_engine.url, True, [{"rounds": 2}, {"rounds": 2}])
        for r in range(2):
            first, second = rounds(ev, r)
            assert first["status"] == "error" and first["phase"] == "engine", first
            assert "update_weights" in first["message"] and "500" in first["message"]
            assert second["status"] == "ok", second  # recovered: finish, then a full update
        want = {n: tensor_checksum(t) for n, t in make_tensors(2)}
        _, body = fresh_engine.request("POST", "/weight_checker", {"action": "checksum"})
        for sums in checksums_by_worker(body).values():
            assert {n: sums[n] for n in want} == want
        assert fresh_engine.request("GET", "/weight_info")[1]["weight_version"] == "v2"
        slot = d.status()["slots"][0]
        assert slot["updates_failed"] == 1 and slot["updates_succeeded"] == 1
        assert slot["state"] == "idle"

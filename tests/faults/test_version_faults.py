"""Fault rows for vLLM version detection (issue 18 D), in the fault suite's table
(``reliability_rows.Recorder``, rendered by ``tests/gen_reliability.py`` into
docs/reliability.md next to ``test_faults.py``'s rows).

Each scenario runs a real ``slotsyncd``, a real engine and two pooled trainer ranks, packed
and unpacked. The policy (as ``test_faults.py``'s): every rank gets one fatal error from the
daemon naming the phase (``begin``), the slot, the update id -- and here the engine URL, what
its ``/version`` said and the supported range; the engine is never paused (no ``/pause``, no
``/start_weight_update`` reached it) and ``/status`` says idle; once the engine speaks a
supported version, the next round succeeds and every worker holds its weights.

The engines that pose as another vLLM are the reference engine's ``--vllm-version``: vLLM's
own code reports the installed vllm's version, so those rows run against the reference
engine only (skipped, saying so, under ``--engine vllm``). The failing ``/version`` row runs
against both.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from engines import EngineBox, impl  # noqa: E402
from rank_pool import RankPool, job  # noqa: E402
from reliability_rows import Recorder, describe_errors  # noqa: E402
from state_readers import engine_checksums, engine_stats, engine_summary, slot_status  # noqa: E402
from trainer_script import make_tensors  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402

pytestmark = pytest.mark.slow

SLOT = (0, 2)
MODES = pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
POSING = pytest.mark.skipif(
    impl() == "vllm", reason="vLLM's own code reports the installed vllm's version; posing as "
    "another one needs the reference engine's --vllm-version")
FAST = ["--begin-timeout-s", "3", "--chunk-timeout-s", "3", "--commit-timeout-s", "3",
        "--engine-timeout-s", "2.5"]


@pytest.fixture(scope="module")
def rec():
    r = Recorder()
    yield r
    r.dump()


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2)
    yield p
    p.close()


@pytest.fixture
def daemon():
    with DaemonProcess(args=FAST) as d:
        yield d


def _run(pool, daemon, box, packed: bool, k: int):
    run = pool.start(daemon.endpoint, [job(r, SLOT, box.url, packed, first_round=k)
                                       for r in (0, 1)])
    run.wait(60)
    return run


def _refused(run, k: int, box, *says: str) -> float:
    """Every rank got one fatal daemon error in the begin naming the engine and ``says``;
    returns the slowest time from the jobs' start to the error (seconds)."""
    slowest = 0.0
    for r in (0, 1):
        (e,) = [x for x in run.rounds(r) if x["round"] == k]
        assert e["status"] == "error" and e["error_type"] == "SlotsyncError", e
        assert e["phase"] == "begin" and e["fatal"] is True, e
        assert f"update {e['update_id']}" in e["message"] and "[0, 2)" in e["message"], e
        assert box.url in e["message"] and "0.27-0.33" in e["message"], e
        for text in says:
            assert text in e["message"], e
        slowest = max(slowest, (run.round_time(r, k) or run.t0) - run.t0)
    return round(slowest, 2)


def _untouched(daemon, box, before: dict | None = None, state: str = "idle") -> str:
    """No pause and no weight call went out since ``before`` (the slot's ``engine_calls``
    then), the engine serves, and ``/status`` says ``state``."""
    stats = engine_stats(box)
    assert stats["paused"] is False and stats.get("pause_count", 0) == 0, stats
    s = slot_status(daemon)
    for r in ("pause", "start_weight_update", "update_weights"):
        assert s["engine_calls"].get(r, 0) == (before or {}).get(r, 0), s["engine_calls"]
    assert s["state"] == state and s["engine_paused"] is False, s
    return engine_summary(box) + f"; never paused; /status {state}"


def _round_lands(pool, daemon, box, packed: bool, k: int) -> str:
    run = _run(pool, daemon, box, packed, k)
    for r in (0, 1):
        (e,) = [x for x in run.rounds(r) if x["round"] == k]
        assert e["status"] == "ok", (r, run.events[r], daemon.log_tail())
    want = {n: tensor_checksum(t) for n, t in make_tensors(k)}
    for sums in engine_checksums(box).values():
        assert {n: sums[n] for n in want} == want
    return engine_summary(box) + f"; checksums match v{k}"


@POSING
@MODES
@pytest.mark.parametrize(("version", "says"), [
    ("0.25.0", "0.25 takes `packed` in each update_info"),
    ("0.34.0", "newer than slotsyncd knows"),
    ("garbage", "vLLM version 'garbage'"),
])
def test_engine_of_an_unsupported_vllm(rec, pool, daemon, packed, version, says):
    row = rec.row(f"engine says vLLM {version}", "packed" if packed else "unpacked",
                  f"GET /version answers {{\"version\": \"{version}\"}}")
    row.engine = "reference"
    box = EngineBox(2, impl_name="reference", vllm_version=version)
    try:
        run = _run(pool, daemon, box, packed, 1)
        row.detect_s = _refused(run, 1, box, f"{version}", says)
        row.rank_errors = describe_errors(run, 1, [0, 1])
        row.engine_after_fault = _untouched(daemon, box)
        assert slot_status(daemon)["engine_vllm_version"] == version
        box.kw["vllm_version"] = "0.32.0"  # the operator runs a supported vLLM
        box.start_again()
        row.engine_final = _round_lands(pool, daemon, box, packed, 2)
        assert slot_status(daemon)["engine_vllm_version"] == "0.32.0"
        row.happened = ("refused in the begin, before the pause, naming the engine, the "
                        "version and 0.27-0.33; re-asked at the next begin: 0.32.0, round ok")
        row.outcome = "pass"
    finally:
        box.close()


@POSING
@MODES
def test_engine_restarted_as_an_unsupported_vllm_between_rounds(rec, pool, daemon, packed):
    """The daemon cached 0.32.0; the engine restarts at the same URL as 0.25.0. The probe
    sees the new session and the version is asked again before anything touches it."""
    row = rec.row("engine restarted as vLLM 0.25.0", "packed" if packed else "unpacked",
                  "round 1 ok on 0.32.0; the engine restarts on the same port as 0.25.0")
    row.engine = "reference"
    box = EngineBox(2, impl_name="reference")
    try:
        _round_lands(pool, daemon, box, packed, 1)
        before = dict(slot_status(daemon)["engine_calls"])
        box.kw["vllm_version"] = "0.25.0"
        box.start_again()
        t0 = time.monotonic()
        run = _run(pool, daemon, box, packed, 2)
        _refused(run, 2, box, "vLLM 0.25.0 at")
        row.detect_s = round(time.monotonic() - t0, 2)
        row.rank_errors = describe_errors(run, 2, [0, 1])
        # (the new process serves its checkpoint's weights: the slot needs a full update)
        row.engine_after_fault = _untouched(daemon, box, before, state="failed")
        assert slot_status(daemon)["needs_full_update"] is True
        assert engine_stats(box)["route_counts"]["version"] == 1
        row.engine_final = row.engine_after_fault
        row.happened = ("the probe saw a new session; /version asked again (0.25.0): refused "
                        "before the pause; the old 0.32.0 was not used")
        row.outcome = "pass"
    finally:
        box.close()


@MODES
def test_version_route_fails(rec, pool, daemon, packed):
    row = rec.row("GET /version fails", "packed" if packed else "unpacked",
                  "fault: /version answers HTTP 500 once")
    box = EngineBox(2)
    try:
        box.request("POST", "/_slotsync/fault", {"route": "version", "status": 500,
                                                 "message": "no version here"})
        run = _run(pool, daemon, box, packed, 1)
        row.detect_s = _refused(run, 1, box, "did not say its vLLM version",
                                "GET /version gave HTTP 500", "no version here")
        row.rank_errors = describe_errors(run, 1, [0, 1])
        row.engine_after_fault = _untouched(daemon, box)
        assert slot_status(daemon)["engine_vllm_version"] is None
        row.engine_final = _round_lands(pool, daemon, box, packed, 2)
        row.happened = ("refused in the begin, before the pause, naming what came back; the "
                        "next begin asks again and the round is ok")
        row.outcome = "pass"
    finally:
        box.close()

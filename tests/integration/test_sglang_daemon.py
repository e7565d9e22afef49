"""slotsyncd driving an SGLang engine, over real sockets (issue 26 A, D): the daemon, the
SGLang-code engine (``python -m slotsync.engine --impl sglang``: SGLang's own payload parsing,
``SafeUnpickler``, ``patch_torch`` and ``FlattenedTensorBucket`` in each TP rank, SGLang's
route rules per version; ``--impl sglang-reference`` where marked: the same routes with
slotsync's parser) and trainer ranks in spawned processes (``tests/trainer_script.py``).

The integration part: rounds land in every TP rank, packed and unpacked, on 0.5.20 (no
session), 0.5.21 and 0.5.23 (sessions), with the engine's kind told by its answers or declared
in the engine table. The fault part: a 400 on a chunk, the engine dying mid-chunk (a scheduler
exception), a restarted engine, a failed pause, a session left open by someone else, a
version or layout the daemon refuses -- each leaves the engine as the guarantees say (paused
after a failure past the pause, resumed after one before it) and the next round lands.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from engines import EngineBox  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from trainer_script import make_tensors  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
TP = 2


def _box(version: str, impl: str = "sglang", **sglang: Any) -> EngineBox:
    return EngineBox(TP, impl_name=impl, sglang={"sglang_version": version, **sglang})


@pytest.fixture(scope="module")
def sgl() -> Iterator[EngineBox]:
    """SGLang 0.5.23's engine, TP=2, for the module (faults cleared around each test)."""
    box = _box("0.5.23")
    yield box
    box.close()


@pytest.fixture
def fresh_sgl(sgl: EngineBox) -> Iterator[EngineBox]:
    sgl.reset()
    yield sgl
    sgl.reset()


def assert_landed(box: EngineBox, k: int) -> None:
    """Every TP rank holds round ``k``'s tensors; the version is ``v<k>``; generation runs
    and no session is left open."""
    want = {n: tensor_checksum(t) for n, t in make_tensors(k)}
    by_rank = box.checksums()
    assert sorted(by_rank) == [f"tp{r}" for r in range(TP)], by_rank.keys()
    for rank, sums in by_rank.items():
        assert {n: sums.get(n) for n in want} == want, f"{rank} differs"
    assert box.weight_version() == f"v{k}"
    stats = box.stats()
    assert stats["paused"] is False and stats["session_open"] is False, stats


def ok_rounds(ev: dict, n: int) -> None:
    for r in range(TP):
        got = rounds(ev, r)
        assert [e["status"] for e in got] == ["ok"] * n, [e.get("message") for e in got]


def table(tmp_path: Path, url: str, **keys: str) -> list[str]:
    """``slotsyncd`` flags for an engine table declaring the engine (``keys``: more TOML)."""
    path = tmp_path / "slotsyncd.toml"
    extra = "".join(f'{k} = "{v}"\n' for k, v in keys.items())
    path.write_text(f'[[engines]]\nurl = "{url}"\nslot_start = 0\nslot_size = {TP}\n{extra}')
    return ["--config", str(path)]


# ---------------------------------------------------------------- rounds


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_rounds_land_in_every_tp_rank_of_an_engine_the_daemon_recognises(fresh_sgl, packed):
    """No engine table: the first begin's answers tell SGLang (no /version, its /server_info)
    and every step after speaks SGLang's routes; two rounds, one session each, the version
    set after the session, generation resumed."""
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_sgl.url, packed, [{"rounds": 2}] * TP)
        ok_rounds(ev, 2)
        assert_landed(fresh_sgl, 2)
        s = d.status()["slots"][0]
        assert (s["engine_kind"], s["engine_sglang_version"]) == ("sglang", "0.5.23"), s
        assert s["state"] == "idle" and s["updates_succeeded"] == 2
    c = fresh_sgl.stats()["counts"]
    assert c["begin_count"] == c["end_count"] >= 2 and c["version_updates"] >= 2, c


@pytest.mark.parametrize("version", ["0.5.20", "0.5.21"])
def test_older_releases_are_spoken_with_and_without_a_session(tmp_path, version):
    """0.5.20 has no session (each chunk loads straight in); 0.5.21 has them. Declared in the
    engine table with a pause mode; SGLang's own parser on both."""
    box = _box(version)
    try:
        with DaemonProcess(args=table(tmp_path, box.url, kind="sglang",
                                      pause_mode="retract")) as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 2}] * TP)
            ok_rounds(ev, 2)
            assert_landed(box, 2)
        stats = box.stats()
        assert stats["pause_mode"] == "retract"
        c = stats["counts"]
        assert (c["begin_count"] > 0) is (version != "0.5.20"), c
    finally:
        box.close()


def test_the_reference_engines_sglang_routes_take_the_same_rounds():
    """The reference engine's SGLang routes (slotsync's own parser): where the daemon cannot
    tell the two apart, it drives both alike."""
    box = _box("0.5.23", impl="sglang-reference")
    try:
        with DaemonProcess() as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * TP)
            ok_rounds(ev, 1)
            assert_landed(box, 1)
    finally:
        box.close()


# ---------------------------------------------------------------- faults


def test_a_400_on_a_chunk_leaves_the_engine_paused_and_the_next_round_loads_everything(
        fresh_sgl):
    fresh_sgl.request("POST", "/_slotsync/fault", {"route": "update_weights_from_tensor",
                                                   "after": 1, "times": 1, "status": 400,
                                                   "message": "injected refusal"})
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP)
        for r in range(TP):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and "injected refusal" in e["message"], e
        assert fresh_sgl.stats()["paused"] is True  # I4: never resumed on torn weights
        assert d.status()["slots"][0]["needs_full_update"] is True
        ev = run_ranks(d, fresh_sgl.url, True, [{"rounds": 1, "first_round": 2}] * TP)
        ok_rounds(ev, 1)
        assert_landed(fresh_sgl, 2)


def test_an_engine_that_dies_mid_chunk_is_restarted_and_taken_as_a_new_session(fresh_sgl):
    """A scheduler exception kills SGLang (the connection is reset): the round fails; the
    engine restarted at the same URL serves its checkpoint, and the next round, a full one,
    lands."""
    fresh_sgl.request("POST", "/_slotsync/fault", {"route": "update_weights_from_tensor",
                                                   "after": 1, "exit": True})
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_sgl.url, False, [{"rounds": 1}] * TP)
        for r in range(TP):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and e["phase"] == "engine", e
        assert "Connection reset" in e["message"], e  # (SGLang kills itself: no answer)
        deadline = time.monotonic() + 30
        while fresh_sgl.alive() and time.monotonic() < deadline:
            time.sleep(0.1)  # (it SIGKILLs itself once its ranks are reaped)
        assert not fresh_sgl.alive()
        fresh_sgl.start_again()
        ev = run_ranks(d, fresh_sgl.url, False, [{"rounds": 1, "first_round": 2}] * TP)
        ok_rounds(ev, 1)
        assert_landed(fresh_sgl, 2)


def test_a_restart_between_rounds_is_seen_and_the_round_is_full(fresh_sgl):
    with DaemonProcess() as d:
        ok_rounds(run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP), 1)
        fresh_sgl.kill()
        fresh_sgl.start_again()
        ok_rounds(run_ranks(d, fresh_sgl.url, True, [{"rounds": 1, "first_round": 2}] * TP), 1)
        assert_landed(fresh_sgl, 2)
        assert "engine_session_new" in d.log_tail() or d.status()["slots"][0][
            "updates_succeeded"] == 2


def test_a_failed_pause_fails_the_round_before_any_weight_and_generation_goes_on(fresh_sgl):
    before = fresh_sgl.stats()["counts"]
    fresh_sgl.request("POST", "/_slotsync/fault", {"route": "pause_generation", "times": 1,
                                                   "status": 500})
    with DaemonProcess() as d:
        ev = run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP)
        for r in range(TP):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and "pause" in e["message"], e
        stats = fresh_sgl.stats()
        c = {k: stats["counts"][k] - before[k] for k in before}
        assert c["update_count"] == 0 and c["begin_count"] == 0, c
        # the daemon resumes what it may have paused (SGLang reports no pause state)
        assert stats["paused"] is False and c["continue_count"] >= 1, (stats, c)
        assert d.status()["slots"][0]["needs_full_update"] is False


def test_a_flush_refused_while_requests_run_fails_the_round_with_no_weight_touched(tmp_path):
    """``pause_mode = "abort"`` flushes after the pause; a flush SGLang refuses (requests
    still running in the simulator: 400) fails the round before the session."""
    box = _box("0.5.23")
    try:
        box.request("POST", "/_slotsync/fault", {"route": "flush_cache", "times": 1,
                                                 "status": 400, "message": "not idle"})
        with DaemonProcess(args=table(tmp_path, box.url, kind="sglang",
                                      pause_mode="abort")) as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * TP)
            (e,) = rounds(ev, 0)
            assert e["status"] == "error" and "not idle" in e["message"], e
            assert box.stats()["counts"]["update_count"] == 0
            assert box.stats()["paused"] is False
            ok_rounds(run_ranks(d, box.url, True, [{"rounds": 1, "first_round": 2}] * TP), 1)
            assert_landed(box, 2)
    finally:
        box.close()


def test_a_session_someone_left_open_is_ended_and_the_round_lands(fresh_sgl):
    """A daemon killed between begin and end leaves SGLang's session open; the next begin
    answers 400 'already open': the daemon ends it and begins once more."""
    assert fresh_sgl.request("POST", "/begin_weight_update", {})[0] == 200
    with DaemonProcess() as d:
        ok_rounds(run_ranks(d, fresh_sgl.url, True, [{"rounds": 1}] * TP), 1)
        assert_landed(fresh_sgl, 1)


@pytest.mark.parametrize(("sglang", "words"), [
    ({"reported_version": "0.5.22"}, "0.5.22"),
    ({"dp_size": 2}, "dp_size 2"),
    ({"pp_size": 2}, "pp_size 2"),
], ids=["version", "dp", "pp"])
def test_what_the_daemon_cannot_drive_is_refused_before_the_pause(sglang, words):
    box = EngineBox(TP, impl_name="sglang", sglang={"sglang_version": "0.5.23", **sglang})
    try:
        with DaemonProcess() as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * TP)
            for r in range(TP):
                (e,) = rounds(ev, r)
                assert e["status"] == "error" and e["phase"] == "begin", e
                assert words in e["message"], e["message"]
        stats = box.stats()
        assert stats["counts"]["pause_count"] == 0 and stats["paused"] is False, stats
    finally:
        box.close()


def test_a_declared_sglang_url_that_serves_vllm_is_refused_naming_both(tmp_path, engine_box):
    """The engine table says SGLang; the URL serves vLLM's code (or the reference engine):
    refused before the pause."""
    with DaemonProcess(args=table(tmp_path, engine_box.url, kind="sglang")) as d:
        ev = run_ranks(d, engine_box.url, True, [{"rounds": 1}] * TP)
        (e,) = rounds(ev, 0)
        assert e["status"] == "error" and 'declared kind = "sglang"' in e["message"], e

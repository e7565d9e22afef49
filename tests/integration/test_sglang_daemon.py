"""slotsyncd driving an SGLang engine, over real sockets (issue 26 A, D): rounds. The daemon,
the SGLang-code engine (``python -m slotsync.engine --impl sglang``: SGLang's own payload
parsing, ``SafeUnpickler``, ``patch_torch`` and ``FlattenedTensorBucket`` in each TP rank,
SGLang's route rules per version; ``--impl sglang-reference`` where marked: the same routes
with slotsync's parser) and trainer ranks in spawned processes (``tests/trainer_script.py``):
rounds land in every TP rank, packed and unpacked, on 0.5.20 (no session), 0.5.21 and 0.5.23
(sessions), with the engine's kind told by its answers or declared in the engine table. The
faults: ``tests/faults/test_sglang_faults.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from sglang_rounds import (  # noqa: E402
    TP,
    assert_landed,
    ok_rounds,
    sglang_box,
    table,
)
from spawned_ranks import run_ranks  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


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
    box = sglang_box(version)
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
    box = sglang_box("0.5.23", impl="sglang-reference")
    try:
        with DaemonProcess() as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * TP)
            ok_rounds(ev, 1)
            assert_landed(box, 1)
    finally:
        box.close()



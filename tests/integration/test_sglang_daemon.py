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
from trainer_script import make_tensors  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.protocol.wire import logical_gpu_uuid  # noqa: E402

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




@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_ranks_on_each_others_gpus_feed_the_tp_rank_on_their_gpu(tmp_path, packed):
    """Issue 35 item 12: trainer ranks 0 and 1 sit on each other's GPU (rank r registers TP
    rank 1 - r's GPU UUID), the engine table declares ``gpu_uuids`` in TP-rank order, and each
    rank publishes values of its own. SGLang's own receive code (the SGLang-code engine's
    ``_rebuild_cuda_tensor_modified``) rebuilds entry i's tensors on the GPU its UUID names:
    entry i must be the chunk of the rank on TP rank i's GPU, so that TP rank i reads its
    own GPU's memory (no peer copy) and loads the values of the rank beside it. (Before: the
    UUIDs were compared as a set and entry i was slot rank i's, another GPU's.)"""
    uuids = [logical_gpu_uuid(i) for i in range(TP)]
    box = sglang_box("0.5.23")
    try:
        scripts = [{"rounds": 1, "gpu_uuid": uuids[TP - 1 - r], "seed_offset": 100 * r}
                   for r in range(TP)]
        with DaemonProcess(args=table(tmp_path, box.url, kind="sglang",
                                      gpu_uuids=uuids)) as d:
            ok_rounds(run_ranks(d, box.url, packed, scripts), 1, box)
        by_rank = box.checksums()
        for i in range(TP):
            beside = TP - 1 - i  # the trainer rank on TP rank i's GPU
            want = {n: tensor_checksum(t) for n, t in make_tensors(1 + 100 * beside)}
            assert {n: by_rank[f"tp{i}"].get(n) for n in want} == want, (
                f"TP rank {i} did not load trainer rank {beside}'s values")
        for w in box.stats()["workers"]:
            assert w["gpu_uuid"] == uuids[w["tp_rank"]], w
            # SGLang's UUID lookup put every tensor TP rank i received on its own device i
            assert list(w["rebuilt_on"]) == [str(w["tp_rank"])], w
    finally:
        box.close()

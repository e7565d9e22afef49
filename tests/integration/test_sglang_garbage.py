"""The CPU half of issue 26 E's GPU test (tests/gpu/test_gpu_sglang.py): its pieces on the
shared-memory transport, where they can run in CI.

* ``tests/garbage_on_ack.py``'s ranks publish through slotsyncd into the SGLang-code engine
  (``--impl sglang``, TP=2, SGLang 0.5.23 and 0.5.20) and overwrite each chunk's memory at its
  ack: every ack is caught and every chunk's bytes are spoiled, yet the checksums are the
  trainers' (on the CPU the engine's copies are done when it answers, so this checks the
  hook and the daemon-to-engine path, not the fence: that is the GPU's part);
* ``--free-received after-barrier`` makes a 0.5.20 engine hold the received tensors until
  the release after the TP barrier (the negative control's engine);
* the CUDA-only options are refused on the CPU, and CUDA with the reference parser.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pydantic")

from engines import model_file  # noqa: E402
from garbage_on_ack import garbage_rank  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from trainer_script import make_tensors  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402

TP = 2


def _engine(version: str, **opts: object) -> ReferenceEngine:
    return ReferenceEngine(workers=TP, impl="sglang", model=str(model_file()),
                           sglang={"sglang_version": version, **opts})


def _assert_checksums(eng: ReferenceEngine, k: int) -> None:
    want = {n: tensor_checksum(t) for n, t in make_tensors(k)}
    status, body = eng.request("POST", "/_slotsync/checksums")
    assert status == 200, body
    assert sorted(body) == [f"tp{r}" for r in range(TP)]
    for rank, sums in body.items():
        assert {n: sums.get(n) for n in want} == want, f"round {k}: {rank} differs"


@pytest.mark.sglang
@pytest.mark.parametrize("version", ["0.5.23", "0.5.20"])
def test_garbage_ranks_through_the_daemon_into_sglangs_code(version: str) -> None:
    with _engine(version) as eng, DaemonProcess() as d:
        k = 0
        for packed in (True, False):
            for regions in (1, 2):
                k += 1
                script = {"rounds": 1, "first_round": k, "staging_buffers": regions}
                ev = run_ranks(d, eng.url, packed, [script] * TP, timeout_s=120,
                               target=garbage_rank)
                for r in range(TP):
                    assert [e["status"] for e in rounds(ev, r)] == ["ok"], (r, ev[r])
                acks = [e for r in ev for e in ev[r] if e["event"] == "garbage"]
                chunks = sum(rounds(ev, r)[0]["chunks"] for r in range(TP))
                assert len(acks) == chunks > TP, (acks, chunks)  # every chunk's ack caught
                assert all(a["bytes"] > 0 and a["lag_s"] >= 0 for a in acks), acks
                _assert_checksums(eng, k)
                assert eng.request("GET", "/model_info")[1]["weight_version"] == f"v{k}"
        calls = d.status()["slots"][0]["engine_calls"]
        if version == "0.5.20":
            assert "prove_copies" not in calls and "begin_weight_update" not in calls, calls
        else:  # one region: the next chunk waits for the ack, which waits for a proof
            assert calls.get("prove_copies", 0) > 0, calls


@pytest.mark.sglang
def test_free_received_after_the_barrier_on_0_5_20() -> None:
    with _engine("0.5.20", free_received="after-barrier") as eng, DaemonProcess() as d:
        stats = eng.request("GET", "/_slotsync/stats")[1]
        assert (stats["free_received"], stats["frees_before_barrier"]) == ("after-barrier",
                                                                          False)
        script = {"rounds": 1, "staging_buffers": 2}
        ev = run_ranks(d, eng.url, True, [script] * TP, timeout_s=120)
        assert all([e["status"] for e in rounds(ev, r)] == ["ok"] for r in range(TP)), ev
        _assert_checksums(eng, 1)
        workers = eng.request("GET", "/_slotsync/stats")[1]["workers"]
        # every update call was followed by a release on every rank (0.5.21+'s order)
        assert all(w["release_count"] == w["update_count"] > 0 for w in workers), workers
    with _engine("0.5.20") as eng:
        stats = eng.request("GET", "/_slotsync/stats")[1]
        assert (stats["free_received"], stats["frees_before_barrier"]) == ("version", True)


def test_cuda_options_refused_where_they_cannot_work() -> None:
    from slotsync.engine.__main__ import main

    m = str(model_file())
    for argv in (["--impl", "sglang-reference", "--model", m, "--device", "cuda"],
                 ["--impl", "sglang", "--model", m, "--copy-sleep-cycles", "100"],
                 ["--impl", "sglang", "--model", m, "--cuda-devices", "0"],
                 ["--impl", "sglang", "--model", m, "--workers", "2", "--device", "cuda",
                  "--copy-sleep-cycles", "1,2,3"],
                 ["--impl", "reference", "--free-received", "after-barrier"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv

"""FSDP2 trainers through slotsyncd into the reference engine (issue 17 B): ranks that run
``torch.distributed.fsdp.fully_shard`` (CPU, Gloo) publish ``FSDP2Source(model).iter_sharded()``,
so each parameter is all-gathered straight into the rank's staging region; the engine's
per-worker checksums must equal those of the unsharded model, built here from the same seed.

Cases: 2 ranks in one engine slot, packed with 1 and with 4 staging regions, and unpacked; 4
ranks (one FSDP group of 4) split over two engine slots of 2 ranks with an engine each (the
group's gathers span both slots: no deadlock, see ``export.plan_sharded``), two rounds; 4
ranks in one slot with 1 staging region.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

from gloo_ranks import spawn_ranks  # noqa: E402
from state_readers import engine_checksums  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402

pytestmark = pytest.mark.slow

STAGING_BYTES = 2304  # several chunks per round (3,612 bytes); every tensor fits one region


def make_model() -> Any:
    """A small model every rank (and the test) builds alike: odd dim-0 sizes so that FSDP2
    shards unevenly over 2 and 4 ranks (a 1-row tensor gives 0-row shards), a bf16 embedding."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Embedding(37, 16).to(torch.bfloat16),  # 37 rows: 19 + 18, 10 + 10 + 10 + 7
        torch.nn.Linear(16, 33),                       # 33 rows, and a bias of 33
        torch.nn.Linear(33, 1),                        # 1 row: 1 + 0 (+ 0 + 0)
        torch.nn.LayerNorm(1),
        torch.nn.Linear(1, 5),
    )


def expected(rounds: int) -> dict[str, str]:
    """The checksums of the unsharded model's parameters after ``rounds`` rounds (each round
    the ranks double every parameter before they publish)."""
    with torch.no_grad():
        return {n: tensor_checksum(p.detach() * (2 ** rounds))
                for n, p in make_model().named_parameters()}


def fsdp_rank(rank: int, endpoint: str, slots: list[tuple[tuple[int, int], str]],
              packed: bool, staging_buffers: int, rounds: int) -> dict[str, Any]:
    """One trainer rank of the Gloo group (``gloo_ranks.spawn_ranks``): ``fully_shard`` per
    layer and the root, then per round double every parameter (on the shards) and publish
    ``FSDP2Source(model).iter_sharded()`` into ``slots[rank]`` (engine slot, engine URL)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from slotsync.integrations.fsdp import FSDP2Source
    from slotsync.testing.ranks import rank_publisher

    slot, url = slots[rank]
    report: dict[str, Any] = {"rank": rank, "rounds": []}
    model = make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    source = FSDP2Source(model)
    report["all_dtensors"] = all(isinstance(t, DTensor) for _, t in source.iter_sharded())
    with rank_publisher(endpoint, rank, slot, url, packed=packed,
                        staging_bytes=STAGING_BYTES, staging_buffers=staging_buffers,
                        timeout_s=120.0) as pub:
        pub.register()
        for k in range(1, rounds + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().mul_(2)
            st = pub.publish(source.iter_sharded(), f"fsdp-{k}")
            report["rounds"].append({"chunks": st.chunks, "bytes": st.bytes})
    return report


def run_fsdp_ranks(daemon: DaemonProcess, slots: list[tuple[tuple[int, int], str]],
                   packed: bool, staging_buffers: int, rounds: int,
                   timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """Spawn one FSDP rank per entry of ``slots`` (``(engine slot, engine URL)``, by rank);
    return their reports by rank."""
    return spawn_ranks(functools.partial(fsdp_rank, endpoint=daemon.endpoint, slots=slots,
                                         packed=packed, staging_buffers=staging_buffers,
                                         rounds=rounds),
                       world=len(slots), timeout_s=timeout_s, why=daemon.log_tail)


def check_engine(engine: ReferenceEngine, rounds: int) -> None:
    want = expected(rounds)
    sums = engine_checksums(engine)
    assert len(sums) == engine.workers
    for worker, got in sums.items():
        assert {n: got.get(n) for n in want} == want, worker
    assert engine.request("GET", "/weight_info")[1]["weight_version"] == f"fsdp-{rounds}"


@pytest.mark.parametrize(("packed", "staging_buffers"), [(True, 1), (True, 4), (False, 1)],
                         ids=["packed-1-region", "packed-4-regions", "unpacked"])
def test_two_fsdp_ranks_land_the_full_tensors(packed, staging_buffers):
    with ReferenceEngine(workers=2) as eng, DaemonProcess() as d:
        reports = run_fsdp_ranks(d, [((0, 2), eng.url)] * 2, packed, staging_buffers, 1)
        assert all(rep["all_dtensors"] for rep in reports)
        total = sum(p.nbytes for p in make_model().parameters())
        for rep in reports:
            (st,) = rep["rounds"]
            assert st["bytes"] == total  # global bytes, on every rank
            assert st["chunks"] >= 2, st
        check_engine(eng, 1)


def test_fsdp_group_across_two_engine_slots():
    with ReferenceEngine(workers=2) as e0, ReferenceEngine(workers=2) as e1, \
            DaemonProcess() as d:
        slots = [((0, 2), e0.url)] * 2 + [((2, 2), e1.url)] * 2
        reports = run_fsdp_ranks(d, slots, True, 4, 2)
        assert [len(rep["rounds"]) for rep in reports] == [2] * 4
        check_engine(e0, 2)
        check_engine(e1, 2)


def test_four_fsdp_ranks_one_slot_one_region():
    with ReferenceEngine(workers=4) as eng, DaemonProcess() as d:
        run_fsdp_ranks(d, [((0, 4), eng.url)] * 4, True, 1, 1)
        check_engine(eng, 1)


def test_fsdp_gather_bench_prints_both_modes_and_same_bytes():
    """``slotsync bench fsdp-gather`` (``python -m slotsync.bench.fsdp_gather``; tiny sizes):
    both modes' figures, the ratio line, and the check that both left the same bytes in
    staging."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "slotsync", "bench", "fsdp-gather", "--ranks", "2",
         "--total-mb", "2", "--tensor-mb", "0.5", "--staging-mb", "1", "--rounds", "1"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "gather       median" in out and "full_tensor  median" in out, out
    assert "ratio full_tensor/gather: time" in out, out
    assert "same bytes in staging: yes" in out, out

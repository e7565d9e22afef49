"""Rank-local payloads end to end (issue 18 A/E): four ranks, each publishing its own experts
plus the shared tensors (``Publisher(rank_local=True)``), through slotsyncd into a four-worker
engine. On the vLLM-code engine (vLLM 0.32's router and ``Worker``) each worker's
``Worker.update_weights`` indexes the list-form ``update_info`` itself and vLLM's own
``parse_update_info`` / ``receive_weights`` parse its entry, empty ones included; the
engine's per-worker checksums prove the routing: a worker's own experts and every shared
tensor changed, the other experts kept the checkpoint's values.

Uneven expert placement (worker 0 holds three experts, worker 3 one) with chunks of 64 bytes
makes the ranks send different numbers of chunks: the short ranks' entries of the later chunk
are empty.

Fault rows, each refused before the pause (the engine's own route counts show no pause and no
start, and it still serves its old weights), with a message naming what is wrong: a misordered
worker table, a rank's GPU UUID not in the table, a worker without an entry, a shared tensor
that disagrees, no worker table at all, a rank that never begins.

Every test runs on both engines (the reference engine already takes the list form,
``engine/reference/server.py`` ``update_weights``, empty entries included; both start from the
checkpoint, so a worker keeps what it is not sent). The reference engine reports its workers'
GPU UUIDs itself, so its misordered table is refused as unlike that report.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engines import model_file, start_engine, vllm_importable  # noqa: E402
from state_readers import checksums_in_worker_order, engine_checksums, engine_stats  # noqa: E402,E501

from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.protocol.errors import SlotsyncError  # noqa: E402
from slotsync.protocol.rank.publisher import Publisher  # noqa: E402
from slotsync.protocol.wire import logical_gpu_uuid  # noqa: E402
from slotsync.testing.processes import DaemonProcess  # noqa: E402

pytestmark = pytest.mark.slow

WORKERS = 4
UUIDS = [logical_gpu_uuid(w) for w in range(WORKERS)]
EXPERTS_OF = [[0, 1, 2], [3, 4], [5, 6], [7]]  # worker -> its experts (uneven on purpose)
SHARED = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
          "model.norm.weight"]


def expert(e: int) -> str:
    return f"model.layers.0.mlp.experts.{e}.down_proj.weight"


def full_model(seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the model (what each worker's checkpoint holds), values from
    ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = {
        SHARED[0]: torch.randn(6, 4, generator=g).to(torch.bfloat16),
        SHARED[1]: torch.randn(4, 4, generator=g),
        SHARED[2]: torch.randn(4, generator=g),
    }
    for e in range(8):
        out[expert(e)] = torch.randn(3, 2, generator=g)
    return out


def rank_tensors(worker: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """What the rank feeding ``worker`` publishes: the shared tensors and its experts."""
    m = full_model(seed)
    return [(n, m[n]) for n in SHARED] + [(expert(e), m[expert(e)]) for e in EXPERTS_OF[worker]]


IMPLS = [pytest.param("vllm", marks=pytest.mark.vllm), "reference"]


@pytest.fixture(scope="module", params=IMPLS)
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "vllm":
        why = vllm_importable()
        if why:
            pytest.skip(f"vLLM's code cannot be imported: {why}")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # (both engines start from the checkpoint: a worker keeps what it is not sent)
    eng = start_engine(WORKERS, impl_name=request.param,
                       model=model_file(list(full_model(0).items())))
    with eng:
        yield eng


CHUNKS: dict[int, int] = {}  # rank -> chunks of its last publish_all


def daemon_with(tmp_path: Path, table: list[str] | None, url: str,
                args: list[str] | None = None) -> DaemonProcess:
    """A daemon whose engine table declares the engine (with ``table`` as its
    ``gpu_uuids`` unless None)."""
    path = tmp_path / "slotsyncd.toml"
    text = f'[[engines]]\nurl = "{url}"\nslot_start = 0\nslot_size = {WORKERS}\n'
    if table is not None:
        text += "gpu_uuids = [" + ", ".join(f'"{u}"' for u in table) + "]\n"
    path.write_text(text)
    return DaemonProcess(args=["--config", str(path), *(args or [])])


def publish_all(daemon: DaemonProcess, url: str, seed: int, version: str, *,
                ranks: range = range(WORKERS), tensors: Any = rank_tensors,
                overrides: dict[int, dict] | None = None) -> dict[int, BaseException | None]:
    """Every rank in ``ranks``, in threads, publishes ``tensors(worker, seed)`` in rank-local
    mode, chunks of 64 bytes; ``overrides``: Publisher keyword arguments by rank. Returns
    each rank's error (None: success; its chunk count in ``CHUNKS``). Every rank registers
    before any begins."""
    errors: dict[int, BaseException | None] = {}
    CHUNKS.clear()
    registered = threading.Barrier(len(ranks), timeout=120)

    def rank(r: int) -> None:
        kw = {"transport": "shm", "packed": True, "staging_bytes": 64, "timeout_s": 60.0,
              "rank_local": True, **(overrides or {}).get(r, {})}
        try:
            with Publisher(daemon.endpoint, r, (0, WORKERS), url, **kw) as pub:
                pub.register()
                registered.wait()
                CHUNKS[r] = pub.publish(tensors(r, seed), version).chunks
            errors[r] = None
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(errors) == len(ranks), (errors, daemon.log_tail())
    return errors


@pytest.mark.parametrize("packed", [True, False])
def test_each_worker_gets_its_own_experts_and_every_shared_tensor(engine, tmp_path, packed):
    """Acceptance: per-worker checksums equal exactly what each worker should hold; one start
    and one finish; ranks sent different chunk counts (4, 3, 3, 3), so the short ranks' last
    entry is empty (packed: their last buffer's handle, unpacked: ``ipc_handles`` [])."""
    before = engine_stats(engine)["route_counts"]
    seed = 5 if packed else 6
    with daemon_with(tmp_path, UUIDS, engine.url) as d:
        errors = publish_all(d, engine.url, seed=seed, version="ep-1",
                             overrides=dict.fromkeys(range(WORKERS), {"packed": packed}))
        assert all(e is None for e in errors.values()), (errors, d.log_tail())
    assert CHUNKS == {0: 4, 1: 3, 2: 3, 3: 3}  # rank 0 longer: the others send empty entries
    after = engine_stats(engine)["route_counts"]
    assert after.get("start_weight_update", 0) - before.get("start_weight_update", 0) == 1
    assert after.get("finish_weight_update", 0) - before.get("finish_weight_update", 0) == 1
    old = {n: tensor_checksum(t) for n, t in full_model(0).items()}
    new = {n: tensor_checksum(t) for n, t in full_model(seed).items()}
    sums = engine_checksums(engine)
    assert len(sums) == WORKERS
    # (vLLM keys a worker by its TP rank, the reference engine by its GPU UUID)
    by_index = [f"tp{w}" for w in range(WORKERS)] if "tp0" in sums else UUIDS
    for w, key in enumerate(by_index):
        want = {n: new[n] for n in SHARED}
        for e in range(8):
            want[expert(e)] = new[expert(e)] if e in EXPERTS_OF[w] else old[expert(e)]
        assert {n: sums[key][n] for n in want} == want, (w, key)
    stats = engine_stats(engine)
    assert stats["weight_version"] == "ep-1" and not stats["paused"]


def _refused_before_the_pause(engine: Any, errors: dict[int, BaseException | None],
                              before: dict, version: str) -> list[str]:
    """Every rank failed, the engine was neither paused nor started and still serves its
    last version. Returns the error texts."""
    texts = []
    for r, e in sorted(errors.items()):
        assert isinstance(e, SlotsyncError), (r, e)
        texts.append(str(e))
    counts = engine_stats(engine)["route_counts"]
    for route in ("pause", "start_weight_update"):
        assert counts.get(route, 0) == before.get(route, 0), (route, counts, texts)
    stats = engine_stats(engine)
    assert not stats["paused"] and stats["weight_version"] == version, (stats, texts)
    return texts


def _fault(engine: Any, tmp_path: Path, table: list[str] | None, **kw: Any) -> list[str]:
    before = engine_stats(engine)
    with daemon_with(tmp_path, table, engine.url, kw.pop("args", None)) as d:
        errors = publish_all(d, engine.url, seed=9, version="ep-bad", **kw)
        return _refused_before_the_pause(engine, errors, before["route_counts"],
                                         before["weight_version"]) + [d.log_tail()]


def test_misordered_worker_table_is_refused_before_the_pause(engine, tmp_path):
    texts = _fault(engine, tmp_path, [UUIDS[1], UUIDS[0], UUIDS[2], UUIDS[3]])
    if engine.impl == "reference":  # it reports its workers' UUIDs: checked against the table
        assert all(f"engine {engine.url} reports its workers' GPU UUIDs as {UUIDS}" in t
                   for t in texts[:-1]), texts
        return
    assert all("misordered worker table" in t for t in texts[:-1]), texts
    assert UUIDS[0] in texts[0] and UUIDS[1] in texts[0], texts[0]


def test_rank_whose_gpu_uuid_is_not_in_the_table_is_refused(engine, tmp_path):
    stranger = logical_gpu_uuid(41)
    texts = _fault(engine, tmp_path, UUIDS, overrides={3: {"gpu_uuid": stranger}})
    assert all(f"rank 3's GPU UUID {stranger} is not in engine" in t for t in texts[:-1]), texts


def test_worker_without_an_entry_is_refused(engine, tmp_path):
    texts = _fault(engine, tmp_path, UUIDS, overrides={3: {"worker_rank": 2}})
    assert all("worker(s) [3]" in t and "ranks [2, 3] all publish for worker 2" in t
               for t in texts[:-1]), texts


def test_shared_tensor_that_disagrees_is_refused_naming_it_and_the_ranks(engine, tmp_path):
    def tensors(w: int, seed: int) -> list:
        out = rank_tensors(w, seed)
        if w == 2:
            out[2] = (SHARED[2], torch.zeros(5))
        return out

    texts = _fault(engine, tmp_path, UUIDS, tensors=tensors)
    assert all(f"shared tensor {SHARED[2]!r} differs across ranks" in t
               and "rank 0 declares float32 [4], rank 2 float32 [5]" in t
               for t in texts[:-1]), texts


def test_rank_local_without_a_worker_table_is_refused_naming_the_setting(engine, tmp_path):
    texts = _fault(engine, tmp_path, None)
    assert all(engine.url in t and "engines[].gpu_uuids" in t for t in texts[:-1]), texts


def test_rank_that_never_begins_is_named_before_the_pause(engine, tmp_path):
    texts = _fault(engine, tmp_path, UUIDS, ranks=range(3), args=["--begin-timeout-s", "3"])
    assert all("failed in begin" in t and "missing ranks [3]" in t for t in texts[:-1]), texts


@pytest.mark.vllm
def test_a_source_holding_part_of_the_model_publishes_rank_locally_through_vllms_factory(
        engine, tmp_path):
    """vLLM 0.32's ``held_names()`` through vLLM's own ``WeightTransferTrainerFactory``:
    every rank's ``ModuleSource`` holds the whole model, ``held_names`` says which names are
    its own (shared + its experts); ``send_weights`` publishes only those, rank-locally
    (before issue 18 such a source was refused at ``trainer_init``). vLLM's trainer side
    runs on either engine (the daemon drives the engine); a vllm-marked test must not skip
    (SLOTSYNC_REQUIRE_VLLM=1 in CI fails a skip)."""
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from slotsync.engine.vllm.model import SafetensorsModel
    from slotsync.integrations.vllm import SlotsyncTrainerInitInfo

    class EpSource(ModuleSource):
        def __init__(self, worker: int) -> None:
            super().__init__(SafetensorsModel(full_model(11)))
            self.worker = worker

        def held_names(self) -> list[str]:
            return [n for n, _ in rank_tensors(self.worker, 11)]

    errors: dict[int, BaseException | None] = {}
    sent: dict[int, int] = {}
    with daemon_with(tmp_path, UUIDS, engine.url) as d:
        barrier = threading.Barrier(WORKERS, timeout=120)

        def rank(r: int) -> None:
            try:
                eng = WeightTransferTrainerFactory.trainer_init(
                    SlotsyncTrainerInitInfo(rank=r, packed=True, endpoint=d.endpoint,
                                            slot=(0, WORKERS), timeout_s=60.0),
                    client=HTTPVLLMWeightSyncClient(engine.url), source=EpSource(r))
                try:
                    barrier.wait()
                    sent[r] = eng.send_weights(weight_version="ep-factory").bytes
                finally:
                    eng.shutdown()
                errors[r] = None
            except BaseException as e:  # noqa: BLE001 - checked below
                errors[r] = e

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert errors == dict.fromkeys(range(WORKERS)), (errors, d.log_tail())
    m = full_model(11)
    assert sent == {w: sum(t.nbytes for _, t in rank_tensors(w, 11)) for w in range(WORKERS)}
    sums = checksums_in_worker_order(engine)
    for w in range(WORKERS):
        for e in EXPERTS_OF[w]:
            assert sums[w][expert(e)] == tensor_checksum(m[expert(e)])
        assert sums[w][SHARED[0]] == tensor_checksum(m[SHARED[0]])
    assert engine_stats(engine)["weight_version"] == "ep-factory"


@pytest.fixture(scope="module", params=IMPLS)
def dp_engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Issue 18 B: one API server over DP=2 x TP=2 workers (``--data-parallel-size 2``),
    every worker starting from the checkpoint."""
    if request.param == "vllm":
        why = vllm_importable()
        if why:
            pytest.skip(f"vLLM's code cannot be imported: {why}")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    eng = start_engine(WORKERS, impl_name=request.param, data_parallel_size=2,
                       model=model_file(list(full_model(0).items())))
    with eng:
        yield eng


def test_rank_local_round_reaches_each_worker_of_a_dp_engine(dp_engine, tmp_path):
    """A rank-local round through slotsyncd into a DP=2 x TP=2 engine: the list is indexed by
    global worker rank (``dp_index * TP + rank``; on the vLLM-code engine vLLM's own
    ``Worker.update_weights`` does the indexing), so worker w of replica w // 2 holds rank w's
    experts and every shared tensor; the other experts keep the checkpoint's values."""
    seed = 7
    with daemon_with(tmp_path, UUIDS, dp_engine.url) as d:
        errors = publish_all(d, dp_engine.url, seed=seed, version="ep-dp")
        assert all(e is None for e in errors.values()), (errors, d.log_tail())
    old = {n: tensor_checksum(t) for n, t in full_model(0).items()}
    new = {n: tensor_checksum(t) for n, t in full_model(seed).items()}
    got = checksums_in_worker_order(dp_engine)
    workers = engine_stats(dp_engine)["workers"]
    assert [(w.get("dp_index"), w.get("tp_rank")) for w in workers] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    for w in range(WORKERS):
        want = {n: new[n] for n in SHARED}
        for e in range(8):
            want[expert(e)] = new[expert(e)] if e in EXPERTS_OF[w] else old[expert(e)]
        assert {n: got[w][n] for n in want} == want, f"worker {w}"
    stats = engine_stats(dp_engine)
    assert stats["weight_version"] == "ep-dp" and not stats["paused"]

"""slotsync as a vLLM weight-transfer backend (issue 17): vLLM's own
``WeightTransferTrainerFactory``, ``ModuleSource`` and ``HTTPVLLMWeightSyncClient`` drive
``SlotsyncTrainerInitInfo`` on CPU ranks through slotsyncd into the vLLM-code engine (vLLM
0.32's router, ``Worker`` and IPC receive path; ``python -m slotsync.engine --impl vllm``).

The main test runs a layout vLLM's own ``IPCTrainerWeightTransferEngine`` gets wrong: four
ranks in one Gloo world, the trainer split into groups of two, one engine over all four
workers. vLLM's engine all-gathers each chunk's handles over the *default* group and lets rank
0 drive the engine -- correct only when that group is exactly one engine's ranks; built per
trainer group (``rank`` = the group rank, as its docstring invites for FSDP groups) it makes two
senders with two handles each for a four-worker engine. Through slotsync each rank publishes
its own copy; the daemon merges the four by engine slot.

The other tests are the issue's bad inputs, each refused before the engine is paused.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.weight_transfer.factory")
pytest.importorskip("vllm.entrypoints.rl.online.api_router")
torch = pytest.importorskip("torch")

from engines import start_engine  # noqa: E402
from state_readers import engine_checksums, engine_stats, slot_status  # noqa: E402
from vllm.distributed.weight_transfer import (  # noqa: E402
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.engine.vllm.model import SafetensorsModel  # noqa: E402
from slotsync.integrations.vllm import SlotsyncTrainerInitInfo  # noqa: E402
from slotsync.protocol.errors import SlotsyncError  # noqa: E402
from slotsync.protocol.topology import SlotTopology, TopologyError  # noqa: E402
from slotsync.testing.ports import free_port  # noqa: E402
from slotsync.testing.processes import DaemonProcess  # noqa: E402
from slotsync.testing.tensors import make_tensors  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORKERS = 4
TOPOLOGY = SlotTopology(WORKERS, WORKERS, engines=[(0, WORKERS)])  # one 4-GPU engine


def model(seed: int, extra: bool = False) -> torch.nn.Module:
    """A module whose parameters are ``make_tensors(seed)`` (the engine's names), plus one
    name the engine does not have with ``extra``."""
    named = dict(make_tensors(seed))
    if extra:
        named["layers.1.extra.weight"] = torch.ones(4)
    return SafetensorsModel(named)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A four-worker vLLM-code engine holding ``make_tensors(0)``."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    eng = start_engine(WORKERS, impl_name="vllm")
    with eng:
        yield eng


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


def _rank(rank: int, endpoint: str, url: str, port: int, source_kind: str, q: Any) -> None:
    """One trainer process: a Gloo world of four, trainer groups of two (with ``fsdp2``: the
    model ``fully_shard``-ed over its group, an FSDP2Source), then vLLM's factory with the
    slotsync init info; two rounds (one with a version, one without)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORKERS)
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
        m = model(7)
        if source_kind == "fsdp2":
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            from slotsync.integrations.fsdp import FSDP2Source

            fully_shard(m, mesh=DeviceMesh.from_group(groups[rank // 2], "cpu"))
            assert any(type(p).__name__ == "DTensor" for p in m.parameters())
            source: Any = FSDP2Source(m)
        else:
            source = ModuleSource(m)
        engine = WeightTransferTrainerFactory.trainer_init(
            SlotsyncTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=16384,
                                    staging_buffers=2, endpoint=endpoint, topology=TOPOLOGY),
            client=HTTPVLLMWeightSyncClient(url), source=source)
        stats = engine.send_weights(weight_version="step-7")
        unversioned = engine.send_weights()  # default version: "1"
        engine.shutdown()
        q.put((rank, "ok", stats.chunks, unversioned.chunks))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", f"{type(e).__name__}: {e}", 0))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("source_kind", ["module", "fsdp2"])
def test_one_line_change_through_vllms_factory_lands_in_every_worker(engine, daemon,
                                                                    source_kind):
    """Acceptance: SlotsyncTrainerInitInfo through vLLM's own trainer_init and send_weights;
    the engine's checksums (every worker) and weight version match. ``fsdp2``: each trainer
    group of two is an FSDP2 mesh, whose shards the publisher gathers into staging."""
    from spawned_ranks import rank_context

    ctx = rank_context()  # (warm: torch imported once)
    q = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, daemon.endpoint, engine.url, port, source_kind, q))
             for r in range(WORKERS)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(WORKERS):
            rank, status, a, b = q.get(timeout=240)
            results[rank] = (status, a, b)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(s == "ok" for s, _, _ in results.values()), (results, daemon.log_tail())
    assert {a for _, a, _ in results.values()} == {results[0][1]} and results[0][1] >= 2
    want = {n: tensor_checksum(t) for n, t in make_tensors(7)}
    sums = engine_checksums(engine)
    assert len(sums) == WORKERS
    for worker, got in sums.items():
        assert {n: got[n] for n in want} == want, worker
    assert engine_stats(engine)["weight_version"] == "1"  # the second, unversioned round
    calls = slot_status(daemon, (0, WORKERS))["engine_calls"]
    assert calls.get("finish_weight_update") == 2 and calls.get("resume") == 2, calls


def _init(rank: int, source: Any, endpoint: str = "ipc:///nonexistent/slotsyncd.sock",
          url: str = "http://127.0.0.1:1", **kw: Any):
    kw.setdefault("topology", TOPOLOGY)
    return WeightTransferTrainerFactory.trainer_init(
        SlotsyncTrainerInitInfo(rank=rank, packed=True, endpoint=endpoint, **kw),
        client=HTTPVLLMWeightSyncClient(url), source=source)


class _NoIteration:
    """A WeightSource with metadata() but nothing to iterate."""

    def metadata(self) -> list:
        return []


class _PartOfTheModel(ModuleSource):
    """A source whose rank holds only some parameters (vLLM's held_names)."""

    def held_names(self) -> list[str]:
        return ["lm_head.weight"]


def test_sources_that_cannot_be_published_are_refused_at_init():
    """Acceptance (bad input): no source, a source without iter_full/__iter__, one without
    metadata, one that holds nothing on its rank -- each a clear error at trainer_init, before
    the daemon is even contacted."""
    with pytest.raises(ValueError, match="requires a WeightSource"):
        _init(0, None)
    with pytest.raises(TypeError, match=r"_NoIteration has no iter_full\(\)"):
        _init(0, _NoIteration())
    with pytest.raises(TypeError, match=r"has no metadata\(\)"):
        _init(0, object())
    with pytest.raises(TypeError, match=r"a module \(SafetensorsModel\).*ModuleSource\(model\)"):
        _init(0, model(1))
    # A source that holds part of the model runs in rank-local mode (issue 18); one that
    # holds nothing on this rank has nothing to send.
    from slotsync.integrations.vllm import _check_ownership, _held_names

    assert _held_names(_PartOfTheModel(model(1)), 0) == {"lm_head.weight"}

    class _Owns(ModuleSource):  # vLLM 0.33's form: owned_names(rank)
        def owned_names(self, rank: int) -> list[str]:
            return [m.name for m in self.metadata()][rank:]

    names = [m.name for m in _Owns(model(1)).metadata()]
    assert _held_names(_Owns(model(1)), 2) == set(names[2:])
    assert not _check_ownership(_Owns(model(1)), 0)  # owns every name: the whole model

    class _Nothing(ModuleSource):
        def held_names(self) -> list[str]:
            return []

    with pytest.raises(ValueError, match="holds no parameter on rank 0"):
        _init(0, _Nothing(model(1)))


def test_rank_outside_every_slot_and_missing_daemon_are_named(tmp_path):
    """Acceptance (bad input): a rank that no engine slot holds is named with the slots; a
    daemon that is not there is named by its socket, at trainer_init."""
    two = SlotTopology(4, 4, engines=[(0, 2)])
    with pytest.raises(TopologyError, match=r"rank 3"):
        _init(3, ModuleSource(model(1)), topology=two)
    sock = tmp_path / "slotsyncd.sock"
    with pytest.raises(SlotsyncError, match=str(sock)):
        _init(0, ModuleSource(model(1)), endpoint=f"ipc://{sock}", slot=(0, 1))


def test_ranks_that_disagree_on_names_are_refused_before_the_pause(engine, daemon):
    """Acceptance (bad input): one rank's model has a tensor the others lack; every rank gets
    an error naming the begin, and the engine was never paused (it still serves)."""
    errors: dict[int, BaseException | None] = {}
    before = engine_stats(engine)["weight_version"]
    # Every rank registers before any begins: the daemon fails the update at the first begin
    # that differs, and a rank that registered only after that would begin the next update,
    # then fail there when the first ranks leave ("rank 0 is gone"; seen once in CI).
    registered = threading.Barrier(WORKERS, timeout=120)

    def rank(r: int) -> None:
        try:
            eng = _init(r, ModuleSource(model(3, extra=r == 3)), endpoint=daemon.endpoint,
                        url=engine.url, timeout_s=60.0)
            try:
                registered.wait()
                eng.send_weights(weight_version="v-disagree")
            finally:
                eng.shutdown()
            errors[r] = None
        except BaseException as e:  # noqa: BLE001 - checked below
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(errors) == WORKERS, errors
    for r, e in errors.items():
        assert isinstance(e, SlotsyncError), (r, e, daemon.log_tail())
        assert "failed in begin" in str(e) and "same tensors" in str(e), (r, errors,
                                                                           daemon.log_tail())
        assert "this rank's tensor #" in str(e) or "this rank sends only 6" in str(e), str(e)
    assert "layers.1.extra.weight" in str(errors[3]), str(errors[3])  # names its own tensor
    calls = slot_status(daemon, (0, WORKERS))["engine_calls"]
    assert "pause" not in calls and "start_weight_update" not in calls, calls
    stats = engine_stats(engine)
    assert not stats["paused"] and stats["weight_version"] == before


def test_iteration_is_checked_against_metadata_element_for_element():
    """vLLM's WeightSource rule (metadata() "must agree with iteration element for
    element"): an extra, missing, reordered or reshaped tensor stops the round, naming it."""
    from slotsync.integrations.vllm import _Meta

    src = ModuleSource(model(1))
    meta = _Meta(src.metadata())
    items = list(src)
    assert [n for n, _ in meta.checked(iter(items))] == [n for n, _ in items]
    for bad, match in [(items[:-1], r"yielded 5 tensors .* lists 6 \(next: 'lm_head.weight'\)"),
                       (items + [("x", torch.ones(1))], r"more than the 6 .*'x' is extra"),
                       (items[1:2] + items[:1] + items[2:], r"at position 0"),
                       ([(items[0][0], items[0][1].reshape(-1))] + items[1:], r"at position 0")]:
        with pytest.raises(RuntimeError, match=match):
            list(meta.checked(iter(bad)))


def test_slot_defaults_follow_torchruns_environment():
    """Without slot or topology: one engine per node over LOCAL_WORLD_SIZE ranks; rank 0 of a
    job without torchrun's environment is a one-GPU slot; any other rank is told what to give."""
    from slotsync.integrations.vllm import resolve_slot
    from slotsync.protocol.topology import EngineSlot

    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert resolve_slot(SlotsyncTrainerInitInfo(rank=11), env) == EngineSlot(8, 8)
    assert resolve_slot(SlotsyncTrainerInitInfo(rank=0), {}) == EngineSlot(0, 1)
    assert resolve_slot(SlotsyncTrainerInitInfo(rank=3, slot=(2, 2)), env) == EngineSlot(2, 2)
    with pytest.raises(ValueError, match=r"rank=3\) needs the rank's engine slot"):
        resolve_slot(SlotsyncTrainerInitInfo(rank=3), {})
    with pytest.raises(ValueError, match="not integers"):
        resolve_slot(SlotsyncTrainerInitInfo(rank=3), {"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "8"})


def test_importing_the_backend_again_is_harmless():
    """Registering twice (the module imported again, or reloaded) keeps one registration."""
    import importlib

    import slotsync.integrations.vllm as backend

    importlib.reload(backend)
    backend.register()
    cls = WeightTransferTrainerFactory._registry["slotsync"]()
    assert cls.__name__ == "SlotsyncTrainerWeightTransferEngine"


def test_the_source_is_read_the_way_its_vllm_version_offers():
    """iter_sharded() (FSDP2Source) before iter_full() (vLLM 0.33's WeightSource) before
    __iter__ (vLLM 0.32's): each source publishes through the first it has."""
    from slotsync.integrations.vllm import _stream_of

    pairs = [("a", torch.ones(2))]

    class V033:  # vLLM 0.33 style: iter_full, no __iter__
        def metadata(self) -> list:
            return []

        def iter_full(self):
            return iter(pairs)

    class Sharded(V033):
        def iter_sharded(self):
            return iter(pairs[:0])

        def __iter__(self):
            raise AssertionError("not this one")

    assert list(_stream_of(V033())()) == pairs
    assert list(_stream_of(Sharded())()) == []
    src = ModuleSource(model(1))
    assert [n for n, _ in _stream_of(src)()] == [m.name for m in src.metadata()]
    assert sorted(m.name for m in src.metadata()) == sorted(n for n, _ in make_tensors(1))


def _publish_by_two_ranks(daemon: DaemonProcess, url: str, named: list, version: str) -> None:
    """Ranks 0 and 1 of slot (0, 2), in threads, publish ``named`` once; raises the first
    rank's error."""
    from slotsync.testing.ranks import rank_publisher

    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with rank_publisher(daemon.endpoint, r, (0, 2), url, packed=True,
                                timeout_s=120.0) as pub:
                pub.register()
                pub.publish(named, version)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    if errors:
        raise errors[0]


def test_engine_restarted_with_another_model_takes_the_next_update(daemon):
    """An engine restarted at the same URL with another model (fresh-user trial of issue 17):
    vLLM's own load_weights took every tensor of the new model's first update, so the daemon
    counts it as the full update the restart needs (engine_model_changed) instead of failing
    it at commit against the old model's names and leaving the engine paused for good."""
    import time

    from engines import port_free

    old = make_tensors(0)
    new = [(f"other.{n}", t) for n, t in make_tensors(6)]
    eng = start_engine(2, impl_name="vllm", named=old)
    port = eng.port
    with eng:
        _publish_by_two_ranks(daemon, eng.url, make_tensors(1), "old-1")
        assert engine_stats(eng)["weight_version"] == "old-1"
    deadline = time.monotonic() + 10
    while not port_free(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    with start_engine(2, impl_name="vllm", named=new, port=port) as eng2:
        _publish_by_two_ranks(daemon, eng2.url, new, "new-1")
        stats = engine_stats(eng2)
        assert stats["weight_version"] == "new-1" and not stats["paused"], stats
        want = {n: tensor_checksum(t) for n, t in new}
        for worker, got in engine_checksums(eng2).items():
            assert {n: got.get(n) for n in want} == want, worker
        assert "engine_model_changed" in daemon.log_tail(), daemon.log_tail()

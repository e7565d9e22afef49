"""vLLM's trainer API driven the way SkyRL 0.4.0 calls it (after its PR 2142), with the
slotsync backend in place of vLLM's IPC engine (docs/integrations/skyrl.md).

SkyRL's own package cannot run here: ``skyrl`` 0.4.0 declares ``Requires-Python >=3.12`` and
importing any ``skyrl.backends`` module on Python 3.11 fails in pydantic ("use
``typing_extensions.TypedDict`` ... on Python < 3.12"); 0.3.0, the last 3.11 release, predates
PR 2142. So this test rebuilds SkyRL's call path from its 0.4.0 source, piece by piece, in our
own code:

- ``weight_sync/sources.py::FsdpWeightSource``: ``metadata()`` from ``state_dict()`` shapes in
  the inference dtype, ``__iter__`` gathering each FSDP2 ``DTensor`` with vLLM's
  ``materialize_full_tensor`` (``full_tensor()``, a collective every rank joins);
- ``weight_sync/control_plane.py::SkyrlWeightSyncClient``: a blocking fan-out client over a
  list of server URLs, with the four ``VLLMWeightSyncClient`` methods and **no** ``base_url``
  (so ``engine_url=`` is required);
- ``weight_sync/weight_senders.py``: an init-info subclass under a backend name of its own
  (SkyRL's ``skyrl_ipc`` pattern), an engine subclass carrying the capability attributes
  SkyRL's ``Worker._sync_weights_to_inference_engines`` reads, registered once;
- ``workers/worker.py``: ``trainer_init`` and ``send_weights`` each run through
  ``asyncio.to_thread`` (``Worker._weight_sync_thread``), so on different threads.

Two CPU ranks (Gloo) shard a model with ``fully_shard`` and sync twice into a two-worker
vLLM-code engine (``python -m slotsync.engine --impl vllm``) through slotsyncd; every worker's
checksums must equal the trainer's full tensors, the weight version must be the one sent, and
SkyRL's client must never have been called (the daemon owns the engine session).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

pytest.importorskip("vllm.distributed.weight_transfer.factory")
pytest.importorskip("vllm.entrypoints.rl.online.api_router")
torch = pytest.importorskip("torch")

from engines import start_engine  # noqa: E402
from state_readers import engine_checksums, engine_stats, slot_status  # noqa: E402

from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.testing.ports import free_port  # noqa: E402
from slotsync.testing.processes import DaemonProcess  # noqa: E402
from slotsync.testing.tensors import make_tensors  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RANKS = 2
BACKEND = "skyrl_slotsync"


class FanOutClient:
    """SkyRL's ``SkyrlWeightSyncClient`` shape: one URL list, the four client methods, no
    ``base_url``. Records every call; with slotsync there must be none."""

    def __init__(self, server_urls: list[str]) -> None:
        self._urls = list(server_urls)
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


def _rank(rank: int, endpoint: str, url: str, port: int, q: Any) -> None:
    """One SkyRL policy worker: Gloo world of RANKS, FSDP2 model, SkyRL's engine build and two
    syncs, each call on an ``asyncio.to_thread`` thread."""
    import threading

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        WeightSource,
        materialize_full_tensor,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from slotsync.engine.vllm.model import SafetensorsModel
    from slotsync.integrations.vllm import (
        SlotsyncTrainerInitInfo,
        SlotsyncTrainerWeightTransferEngine,
    )

    class FsdpShapedSource(WeightSource):
        """SkyRL's ``FsdpWeightSource``: state_dict metadata, full_tensor() per parameter."""

        def __init__(self, model: torch.nn.Module) -> None:
            self._model = model

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(k, p.dtype, tuple(p.shape))
                    for k, p in self._model.state_dict().items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for k, p in self._model.state_dict().items():
                yield k, materialize_full_tensor(p).detach().contiguous()

    @dataclass
    class SkyrlSlotsyncInitInfo(SlotsyncTrainerInitInfo):
        backend: ClassVar[str] = BACKEND

    class SkyrlSlotsyncEngine(SlotsyncTrainerWeightTransferEngine):
        init_info_cls = SkyrlSlotsyncInitInfo
        # the attributes SkyRL's worker reads off every trainer engine
        skyrl_handles_prefix_cache_reset = False
        skyrl_force_disable_expandable_segments = False
        skyrl_empty_cache_after_send = False
        skyrl_draft_source = None

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    try:
        if BACKEND not in WeightTransferTrainerFactory._registry:  # as SkyRL's register.py
            WeightTransferTrainerFactory.register_engine(BACKEND, SkyrlSlotsyncEngine)
        model = SafetensorsModel(dict(make_tensors(0)))  # what the engine holds; steps move it
        mesh = init_device_mesh("cpu", (RANKS,))
        for mod in list(model.modules()):  # each module owning float parameters: FSDP2 units
            own = list(mod.parameters(recurse=False))
            if own and all(p.is_floating_point() for p in own):
                fully_shard(mod, mesh=mesh)
        sharded = [k for k, p in model.state_dict().items() if hasattr(p, "full_tensor")]
        client = FanOutClient([url])
        on_main: list[bool] = []
        read: list[bool] = []

        def build() -> Any:
            on_main.append(threading.current_thread() is threading.main_thread())
            return WeightTransferTrainerFactory.trainer_init(
                SkyrlSlotsyncInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=16384,
                                      staging_buffers=2, endpoint=endpoint,
                                      engine_url=client._urls[0], slot=(0, RANKS)),
                client=client, source=FsdpShapedSource(model))

        def sync(version: str) -> Any:
            on_main.append(threading.current_thread() is threading.main_thread())
            read.extend([engine.skyrl_handles_prefix_cache_reset,  # what SkyRL's worker reads
                         engine.skyrl_force_disable_expandable_segments,
                         engine.skyrl_empty_cache_after_send])
            return engine.send_weights(weight_version=version)

        async def worker() -> list[Any]:
            nonlocal engine
            engine = await asyncio.to_thread(build)
            out = []
            for step in (1, 2):
                with torch.no_grad():
                    for p in model.parameters():
                        if p.is_floating_point():
                            p.add_(1.0)  # an optimizer step: every shard moves by +1
                out.append(await asyncio.to_thread(sync, f"global_step_{step}"))
            engine.shutdown()
            return out

        engine = None
        stats = asyncio.run(worker())
        q.put((rank, "ok", [s.chunks for s in stats], client.calls, sorted(sharded),
               on_main))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", f"{type(e).__name__}: {e}", [], [], 0))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A two-worker vLLM-code engine holding ``make_tensors(0)``."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    eng = start_engine(RANKS, impl_name="vllm")
    with eng:
        yield eng


def test_skyrl_call_path_through_slotsync_lands_in_every_worker(engine):
    """SkyRL 0.4.0's call shape with SlotsyncTrainerInitInfo: FSDP2 shards gathered by the
    source, a client without base_url that is never called, trainer_init and send_weights on
    worker threads; the engine ends with the trainer's second-step weights and version."""
    from spawned_ranks import rank_context

    ctx = rank_context()  # (warm: torch imported once)
    q = ctx.Queue()
    port = free_port("127.0.0.1")
    with DaemonProcess() as daemon:
        procs = [ctx.Process(target=_rank, args=(r, daemon.endpoint, engine.url, port, q))
                 for r in range(RANKS)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(RANKS):
                rank, status, chunks, calls, sharded, on_main = q.get(timeout=300)
                results[rank] = (status, chunks, calls, sharded, on_main)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        assert all(r[0] == "ok" for r in results.values()), (results, daemon.log_tail())
        engine_calls = slot_status(daemon, (0, RANKS))["engine_calls"]
    for _status, chunks, calls, sharded, on_main in results.values():
        assert calls == [], calls          # the daemon, not SkyRL's client, drove the engine
        assert sharded, "fully_shard left no DTensor: the source's gather went untested"
        assert len(chunks) == 2 and all(c >= 2 for c in chunks), chunks
        assert on_main == [False, False, False], on_main  # every call off the main thread
    want = {n: tensor_checksum(t.add(1.0).add(1.0) if t.is_floating_point() else t)
            for n, t in make_tensors(0)}  # two steps of +1, rounded as the trainer rounds
    sums = engine_checksums(engine)
    assert len(sums) == RANKS
    for worker, got in sums.items():
        assert {n: got[n] for n in want} == want, worker
    assert engine_stats(engine)["weight_version"] == "global_step_2"
    assert engine_calls.get("finish_weight_update") == 2, engine_calls

"""Speculative-decoding draft-model sessions end to end (issue 18 C, E): two publisher ranks
through slotsyncd into a two-worker engine that has a draft model, against both engines.

On the vLLM-code engine (``--impl vllm``) the draft session runs vLLM 0.32's own code: its
router's ``POST /start_draft_weight_update`` -> ``AsyncLLM``-shaped client ->
``Worker.start_draft_weight_update`` (``_set_draft_weight_update_target``: the IPC engine
retargeted at ``model_runner.get_draft_model()``), ``Worker.update_weights`` into the draft
model and ``Worker.finish_weight_update``. The draft model shares two tensor names with the
main one (other values), so per-worker checksums show which model each chunk landed in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engines import model_file, start_engine  # noqa: E402
from state_readers import engine_checksums, engine_stats, slot_status  # noqa: E402

from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.protocol.errors import SlotsyncError  # noqa: E402
from slotsync.protocol.rank.publisher import Publisher  # noqa: E402
from slotsync.testing.processes import DaemonProcess  # noqa: E402
from slotsync.testing.tensors import make_draft_tensors, make_tensors  # noqa: E402

pytestmark = pytest.mark.slow
IMPLS = [pytest.param("reference"), pytest.param("vllm", marks=pytest.mark.vllm)]
SLOT = (0, 2)


@pytest.fixture(scope="module", params=IMPLS)
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A two-worker engine (``request.param``) holding ``make_tensors(0)`` and the draft
    model ``make_draft_tensors(0)``."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    eng = start_engine(2, impl_name=request.param, model=model_file(make_tensors(0)),
                       draft_model=model_file(make_draft_tensors(0)))
    with eng:
        yield eng


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


def publish_on_every_rank(daemon: DaemonProcess, url: str, rounds: list[dict[str, Any]],
                          per_rank: dict[int, dict[str, Any]] | None = None,
                          ) -> dict[int, list[Any]]:
    """Each rank of ``SLOT`` in its own thread publishes ``rounds`` (``Publisher.publish``
    keyword arguments; ``per_rank[r]`` overrides rank r's). Returns each rank's results, one
    per round: ``PublishStats`` or the exception raised."""
    out: dict[int, list[Any]] = {r: [] for r in range(SLOT[1])}

    def rank(r: int) -> None:
        with Publisher(daemon.endpoint, r, SLOT, url, packed=True, transport="shm",
                       staging_bytes=40_000, timeout_s=60) as pub:
            for kw in rounds:
                kw = {**kw, **(per_rank or {}).get(r, {})}
                try:
                    out[r].append(pub.publish(**kw))
                except (SlotsyncError, ValueError) as e:
                    out[r].append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(SLOT[1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return out


def draft_sums_by_worker(eng: Any) -> list[dict[str, str]]:
    """Each worker's draft-model checksums from ``/_slotsync/stats`` (``{name: sha256}``;
    the vLLM-code engine's keys carry vLLM's ``dp0:pp0:pcp0:tp<i>:`` prefix, cut here)."""
    workers = engine_stats(eng)["workers"]
    assert all(w["has_draft"] for w in workers), workers
    return [{k.split(":")[-1]: v for k, v in w["draft_checksums"].items()} for w in workers]


def want(named: list[tuple[str, Any]]) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in named}


def test_a_round_with_a_draft_part_lands_in_both_models_of_every_worker(engine, daemon):
    res = publish_on_every_rank(daemon, engine.url, [
        {"named_tensors": make_tensors(3), "weight_version": "step-3",
         "draft": make_draft_tensors(3)}])
    assert all(not isinstance(x, Exception) for rs in res.values() for x in rs), res
    assert res[0][0].chunks == 6  # 3 main + 3 draft chunks
    main = engine_checksums(engine)  # vLLM's /weight_checker: the main model only
    assert len(main) == 2 and all(sums == want(make_tensors(3)) for sums in main.values())
    assert draft_sums_by_worker(engine) == [want(make_draft_tensors(3))] * 2
    stats = engine_stats(engine)
    assert stats["weight_version"] == "step-3" and stats["paused"] is False
    assert all(not w["active"] for w in stats["workers"])
    assert [w["draft_start_count"] for w in stats["workers"]] == [1, 1]
    s = slot_status(daemon)
    assert (s["last_version"], s["draft_weight_version"]) == ("step-3", "step-3")
    assert s["needs_full_update_targets"] == [] and s["state"] == "idle"
    assert s["engine_calls"]["start_draft_weight_update"] == 1
    assert s["engine_calls"]["finish_draft_weight_update"] == 1
    if stats["impl"] == "vllm":  # the route is vLLM's own router's
        assert stats["route_counts"].get("start_draft_weight_update") == 1


def test_ranks_that_disagree_on_the_draft_part_are_refused_before_the_pause(engine, daemon):
    pauses = engine_stats(engine).get("pause_count")
    res = publish_on_every_rank(
        daemon, engine.url,
        [{"named_tensors": make_tensors(4), "weight_version": "step-4",
          "draft": make_draft_tensors(4)}],
        per_rank={1: {"draft": None}})
    for r in range(2):
        e = res[r][0]
        assert isinstance(e, SlotsyncError) and e.phase == "begin", e
        assert "a draft part" in e.message and "every rank of the slot must declare" in (
            e.message), e
    stats = engine_stats(engine)
    assert stats["paused"] is False and stats.get("pause_count") == pauses
    assert "pause" not in slot_status(daemon)["engine_calls"]


def test_a_main_chunk_after_a_draft_chunk_is_refused_by_the_publisher(engine, daemon):
    with Publisher(daemon.endpoint, 0, (0, 1), engine.url, packed=True,
                   transport="shm", timeout_s=30) as pub:
        pub.begin("v", draft=True)
        with pytest.raises(ValueError, match="needs at least one main chunk"):
            pub.send_chunk(make_draft_tensors(0), draft=True)
        pub.abort("test")
        pub.begin("v2")
        with pytest.raises(ValueError, match="declared no draft part"):
            pub.send_chunk(make_draft_tensors(0), draft=True)
        pub.abort("test")
    # (the session rule alone: the engine is never touched)
    assert engine_stats(engine)["paused"] is False


@pytest.mark.parametrize("impl_name", IMPLS)
def test_engine_without_a_draft_model_is_refused_before_the_pause(impl_name, daemon):
    """The daemon asks the workers' ``supports_draft_weight_updates()`` (vLLM's own method on
    the vLLM-code engine, through its dev-mode ``/collective_rpc``) before the pause."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with start_engine(2, impl_name=impl_name, model=model_file(make_tensors(0))) as eng:
        res = publish_on_every_rank(daemon, eng.url, [
            {"named_tensors": make_tensors(5), "weight_version": "step-5",
             "draft": make_draft_tensors(5)},
            {"named_tensors": make_tensors(6), "weight_version": "step-6"}])
        for r in range(2):
            e = res[r][0]
            assert isinstance(e, SlotsyncError) and e.phase == "begin", e
            assert "cannot load a draft model" in e.message, e
            assert "answered ['False', 'False']" in e.message, e
            assert not isinstance(res[r][1], Exception), res[r][1]  # the next round lands
        s = slot_status(daemon)
        assert s["engine_calls"]["pause"] == 1 and "start_draft_weight_update" not in (
            s["engine_calls"])
        assert all(sums == want(make_tensors(6)) for sums in engine_checksums(eng).values())

"""Data-parallel layouts end to end (issue 25 D, ``daemon/vllm/dp_layout.py``): a real slotsyncd,
trainer ranks in spawned processes, and the vLLM-code engine serving vLLM 0.32's own
``GET /server_info`` handler (``vllm.entrypoints.serve.dev.server_info.api_router``) and
``/get_world_size``, over a ``VllmConfig`` whose parallel config has the fields ``vllm serve``'s
data-parallel flags set on one node of a larger deployment (``--parallel-config``).

* One node of a hybrid load-balanced deployment (``--data-parallel-size 4
  --data-parallel-size-local 2 --data-parallel-start-rank 2``; its API server reaches DP ranks
  2-3, its ``/get_world_size`` counts all 4) and one rank of an external load-balanced one
  are refused in the begin: each rank's error says why and what to do, and the engine saw no
  ``/pause`` (the daemon before this check paused it, updated this node's workers alone and
  resumed it, leaving the other node's stale).
* The first node of an internal load-balanced deployment (the others ``--headless``; its API
  server reaches all 4 ranks although ``data_parallel_size_local`` is 2) is updated, and its
  layout is read once for two rounds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from engines import start_engine  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from state_readers import engine_stats  # noqa: E402

from slotsync.testing.processes import DaemonProcess  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

HYBRID_NODE_1 = {"data_parallel_size": 4, "data_parallel_size_local": 2,
                 "data_parallel_rank": 2, "data_parallel_hybrid_lb": True}
EXTERNAL_RANK_1 = {"data_parallel_size": 2, "data_parallel_size_local": 1,
                   "data_parallel_rank": 1, "data_parallel_external_lb": True}
INTERNAL_NODE_0 = {"data_parallel_size": 4, "data_parallel_size_local": 2,
                   "data_parallel_rank": 0}


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


def _engine(workers: int, replicas: int, fields: dict):
    """This server's ``replicas`` DP replicas over ``workers`` workers, and ``fields`` on the
    parallel config its vLLM routers read."""
    return start_engine(workers, impl_name="vllm", data_parallel_size=replicas,
                        parallel_config=fields)


@pytest.mark.parametrize(("workers", "replicas", "fields", "ranks", "says"), [
    (2, 2, HYBRID_NODE_1, 4,
     "data_parallel_size=4 served with hybrid load balancing (--data-parallel-hybrid-lb, "
     "or --data-parallel-start-rank): one API server per node, so this server reaches only "
     "DP ranks [2, 4) of the 4"),
    (1, 1, EXTERNAL_RANK_1, 2,
     "data_parallel_size=2 served with external load balancing (--data-parallel-external-lb, "
     "or --data-parallel-rank): one API server per DP rank, so this server reaches only DP "
     "ranks [1, 2) of the 2"),
], ids=["hybrid-node", "external-rank"])
def test_one_server_of_a_hybrid_or_external_deployment_is_refused_before_the_pause(
        daemon, workers, replicas, fields, ranks, says):
    with _engine(workers, replicas, fields) as eng:
        # what vLLM's own handlers answer for such a server
        status, info = eng.request("GET", "/server_info?config_format=json")
        assert status == 200, info
        pc = info["vllm_config"]["parallel_config"]
        assert {k: pc[k] for k in fields} == fields, pc
        assert eng.request("GET", "/get_world_size")[1] == {"world_size": ranks}
        ev = run_ranks(daemon, eng.url, True, [{"rounds": 1}] * ranks)
        for r in range(ranks):
            (e,) = rounds(ev, r)
            assert e["status"] == "error" and e["phase"] == "begin", e
            msg = e["message"]
            assert f"engine {eng.url} is one API server of a data-parallel deployment" in msg
            assert says in msg, msg
            assert "/pause on one server does not return until every DP rank" in msg, msg
            assert "--headless" in msg and "give slotsync only the first node's" in msg, msg
            assert msg.endswith("(the engine was not paused)"), msg
        stats = engine_stats(eng)
        assert stats["pause_count"] == 0 and stats["paused"] is False, stats
        assert stats["weight_version"] == "default" and stats["init_count"] == 0, stats
        s = daemon.status()["slots"][0]
        assert s["engine_calls"].get("server_info") == 1, s["engine_calls"]
        for route in ("weight_info", "init_weight_transfer_engine", "pause",
                      "start_weight_update"):  # (refused in the first stage)
            assert s["engine_calls"].get(route, 0) == 0, s["engine_calls"]


def test_first_node_of_an_internal_deployment_is_updated_reading_its_layout_once(daemon):
    """``data_parallel_size_local`` 2 < ``data_parallel_size`` 4, no hybrid or external LB:
    the first node's API server manages all 4 ranks (the others ``--headless``), so one
    endpoint reaches every rank and the daemon drives it."""
    with _engine(2, 2, INTERNAL_NODE_0) as eng:
        ev = run_ranks(daemon, eng.url, True, [{"rounds": 2}] * 4)
        for r in range(4):
            assert [e["status"] for e in rounds(ev, r)] == ["ok", "ok"], ev[r]
        stats = engine_stats(eng)
        assert stats["pause_count"] == 2 and stats["paused"] is False, stats
        calls = daemon.status()["slots"][0]["engine_calls"]
        assert calls.get("server_info") == 1 and calls.get("pause") == 2, calls

"""Data-parallel layouts one API server cannot drive (issue 25 D, ``daemon/vllm/dp_layout.py``).

The rule on ``/server_info?config_format=json`` answers shaped exactly as vLLM 0.32 writes
them (``HYBRID_NODE_1``: vLLM's own dump, see below), and the coordinator's use of it: a
hybrid or external load-balanced engine with more than one DP rank is refused in the begin,
before the pause, every rank told why and what to do; an internal-LB engine, an engine
without data parallelism and an engine whose answer says nothing (a 404, the reference
engine) go on; the layout is read once per engine process, and again after a restart and
while refused. ``test_vllm_server_info_handler_answers_what_the_rule_reads`` runs vLLM's own
handler (where vLLM is importable); tests/integration/test_dp_layouts.py the daemon against
vLLM's router on the vLLM-code engine.
"""

from __future__ import annotations

import copy
import json

import pytest
from test_coordinator import URL, Harness

from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.update import BEGIN_STAGES
from slotsync.daemon.vllm import dp_layout
from slotsync.daemon.vllm.client import ABSENT_IS_NONE, ROUTES
from slotsync.daemon.vllm.dp_layout import DpLayout
from slotsync.protocol.wire import Error

# vLLM 0.32's parallel_config of node 1 of a 2-node hybrid-LB deployment (`vllm serve
# --tensor-parallel-size 2 --data-parallel-size 4 --data-parallel-size-local 2
# --data-parallel-start-rank 2`), as its /server_info?config_format=json writes it:
# pydantic.TypeAdapter(VllmConfig).dump_python(config, mode="json", fallback=str) of a
# VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, data_parallel_size=4,
# data_parallel_size_local=2, data_parallel_rank=2, data_parallel_hybrid_lb=True)), printed
# by vLLM 0.32.0 on CPU (the other sections of vllm_config left out here).
HYBRID_NODE_1 = json.loads("""{"pipeline_parallel_size": 1, "tensor_parallel_size": 2,
"prefill_context_parallel_size": 1, "data_parallel_size": 4, "data_parallel_size_local": 2,
"data_parallel_rank": 2, "data_parallel_rank_local": null, "data_parallel_master_ip":
"127.0.0.1", "data_parallel_rpc_port": 29550, "dp_sync_interval": 16,
"data_parallel_master_port": 41051, "data_parallel_backend": "mp",
"data_parallel_external_lb": false, "data_parallel_hybrid_lb": true, "is_moe_model": null,
"enable_hc_sp": false, "enable_expert_parallel": false, "enable_batch_sharded_sampling": false,
"enable_ep_weight_filter": false, "enable_eplb": false, "eplb_config": {"window_size": 1000,
"step_interval": 3000, "num_redundant_experts": 0, "log_balancedness": false,
"log_balancedness_interval": 1, "use_async": true, "policy": "default", "communicator": null,
"enable_migration_batching": false}, "expert_placement_strategy": "linear",
"all2all_backend": "allgather_reducescatter", "max_parallel_loading_workers": null,
"disable_custom_all_reduce": true, "enable_shm_tensor_arena": false, "enable_elastic_ep":
false, "elastic_ep_max_dp_size": 4, "enable_dbo": false, "ubatch_size": 0,
"dbo_decode_token_threshold": 32, "dbo_prefill_token_threshold": 512,
"disable_nccl_for_dp_synchronization": true, "ray_workers_use_nsight": false,
"ray_runtime_env": null, "placement_group": null, "distributed_executor_backend": "mp",
"worker_cls": "vllm.v1.worker.cpu_worker.CPUWorker", "worker_extension_cls": "",
"master_addr": "127.0.0.1", "master_port": 29501, "node_rank": 0, "nnodes": 1, "numa_bind":
false, "numa_bind_nodes": null, "numa_bind_cpus": null, "assigned_physical_gpu_ids": null,
"distributed_timeout_seconds": null, "cpu_distributed_timeout_seconds": null, "world_size": 2,
"rank": 0, "_data_parallel_master_port_list": [36161, 45243, 59473, 44537],
"_coord_store_port": 0, "decode_context_parallel_size": 1, "dcp_kv_cache_interleave_size": 1,
"dcp_comm_backend": "ag_rs", "dcp_q_replicate": false, "cp_kv_cache_interleave_size": 1,
"_allow_auto_resolve_cp_interleave_size": true, "data_parallel_index": 2,
"_api_process_count": 1, "_api_process_rank": 0, "enable_fault_tolerance": false,
"fault_tolerance_config": {"engine_recovery_timeout_sec": 120}}""")


def answer(**fields: object) -> dict:
    """A /server_info answer: HYBRID_NODE_1 with ``fields`` of its parallel_config replaced
    (``data_parallel_rank`` moves ``data_parallel_index`` along, as vLLM's
    ``ParallelConfig.__post_init__`` sets it), in vLLM's top-level shape."""
    pc = copy.deepcopy(HYBRID_NODE_1)
    pc.update(fields)
    if "data_parallel_rank" in fields and "data_parallel_index" not in fields:
        pc["data_parallel_index"] = fields["data_parallel_rank"]
    return {"vllm_config": {"model_config": None, "parallel_config": pc},
            "vllm_env": {"VLLM_SERVER_DEV_MODE": True}, "system_env": {"os": "Linux"}}


# What vLLM's arg_utils.py sets for each deployment (hybrid / external / internal LB).
HYBRID_NODE_0 = answer(data_parallel_rank=0)
EXTERNAL_RANK_3 = answer(data_parallel_rank=3, data_parallel_size_local=1,
                         data_parallel_hybrid_lb=False, data_parallel_external_lb=True)
INTERNAL_NODE_0 = answer(data_parallel_rank=0, data_parallel_hybrid_lb=False)  # others headless
ONE_NODE = answer(data_parallel_rank=0, data_parallel_size_local=4, data_parallel_hybrid_lb=False)
NO_DP = answer(data_parallel_size=1, data_parallel_size_local=1, data_parallel_rank=0,
               data_parallel_hybrid_lb=False)


# -- the rule ----------------------------------------------------------------------------

def test_read_takes_vllms_parallel_config_fields() -> None:
    assert dp_layout.read(answer()) == DpLayout(4, 2, 2, True, False)
    assert dp_layout.read(EXTERNAL_RANK_3) == DpLayout(4, 1, 3, False, True)
    assert dp_layout.read(INTERNAL_NODE_0) == DpLayout(4, 2, 0, False, False)


@pytest.mark.parametrize(("body", "reached"), [
    (answer(), range(2, 4)),            # hybrid: this node's ranks
    (HYBRID_NODE_0, range(0, 2)),
    (EXTERNAL_RANK_3, range(3, 4)),     # external: its own rank
    (INTERNAL_NODE_0, range(0, 4)),     # internal: every rank, the other nodes headless
    (ONE_NODE, range(0, 4)),
])
def test_the_ranks_one_call_reaches_are_vllms_managed_engines(body, reached) -> None:
    """vLLM 0.32 core_client.py MPClient.__init__: [index, index + (local if hybrid or
    external else size)); DPAsyncMPClient (external) calls its first engine only."""
    layout = dp_layout.read(body)
    assert layout is not None and layout.reached() == reached


@pytest.mark.parametrize(("body", "mode", "ranks"), [
    (answer(), "hybrid load balancing", "[2, 4) of the 4"),
    (HYBRID_NODE_0, "hybrid load balancing", "[0, 2) of the 4"),
    (EXTERNAL_RANK_3, "external load balancing", "[3, 4) of the 4"),
    # (not from vLLM's CLI: an offline-mode rank; reaches one engine all the same)
    (answer(data_parallel_rank=0, data_parallel_hybrid_lb=False, data_parallel_rank_local=0),
     "an API server that reaches only some of the DP ranks", "[0, 1) of the 4"),
])
def test_a_server_that_reaches_some_dp_ranks_is_refused_saying_why_and_what_to_do(
        body, mode, ranks) -> None:
    why = dp_layout.refusal(dp_layout.read(body), URL)
    assert why.startswith(f"engine {URL} is one API server of a data-parallel deployment")
    assert f"data_parallel_size=4 served with {mode}" in why, why
    assert f"this server reaches only DP ranks {ranks}" in why, why
    # why: vLLM's pause and resume are collective across every DP rank
    assert "/pause on one server does not return until every DP rank" in why
    assert "a pending pause cannot be cancelled" in why
    assert "/resume blocks until every rank resumes" in why
    # what to do: internal LB, the other nodes headless, one endpoint
    assert "vLLM's internal load balancer" in why
    assert "`vllm serve ... --data-parallel-size 4 --data-parallel-size-local" in why
    assert "--headless --data-parallel-size 4" in why and "--data-parallel-start-rank" in why
    assert "give slotsync only the first node's endpoint" in why
    assert "docs/dp-layouts.md" in why


@pytest.mark.parametrize("body", [INTERNAL_NODE_0, ONE_NODE, NO_DP], ids=[
    "internal-lb-first-node", "one-node", "no-dp"])
def test_a_server_that_reaches_every_dp_rank_is_accepted(body) -> None:
    assert dp_layout.read(body) is not None
    assert dp_layout.refusal(dp_layout.read(body), URL) == ""


@pytest.mark.parametrize("body", [
    None,  # a 404 (ABSENT_IS_NONE), or a 2xx body that is not JSON
    {"detail": "Not Found"},
    "text",
    {"vllm_config": "ModelConfig(...) parallel_config=..."},  # the text format (no json)
    {"vllm_config": {"parallel_config": None}},
    {"vllm_config": {"parallel_config": {"data_parallel_size": 4}}},  # fields missing
    answer(data_parallel_size="4"),
    answer(data_parallel_size=True),
    answer(data_parallel_hybrid_lb=1),
])
def test_an_answer_that_says_nothing_is_no_information_and_refuses_nothing(body) -> None:
    assert dp_layout.read(body) is None
    assert dp_layout.refusal(None, URL) == ""


def test_the_layout_is_asked_with_the_version_and_a_404_is_no_answer() -> None:
    assert ROUTES["server_info"] == ("GET", "/server_info?config_format=json")
    assert "server_info" in ABSENT_IS_NONE
    stages = {st.name: st.routes for st in BEGIN_STAGES}
    assert stages["version"] == stages["version_again"] == ("version", "server_info")
    names = [st.name for st in BEGIN_STAGES]
    assert names.index("version_again") < names.index("pause")  # (both before the pause)


# -- the coordinator: refused before the pause, read once per engine process --------------

def _errors(h: Harness) -> list[Error]:
    return [next(m for m in h.replies[r] if isinstance(m, Error)) for r in range(h.size)]


def _harness(body: object) -> Harness:
    h = Harness()
    h.engine.server_info = body
    h.register_all()
    return h


@pytest.mark.parametrize("body", [answer(), EXTERNAL_RANK_3], ids=["hybrid", "external"])
def test_hybrid_or_external_engine_fails_the_begin_before_the_pause(body) -> None:
    h = _harness(body)
    h.round(0, n_chunks=1)
    assert h.engine.calls == ["version", "server_info"], h.engine.calls  # nothing after it
    assert not h.engine.paused
    for e in _errors(h):  # every rank is told why, and that the engine was not paused
        assert e.phase == "begin" and e.update_id == 0, e
        assert "is one API server of a data-parallel deployment" in e.message, e
        assert "give slotsync only the first node's endpoint" in e.message, e
        assert e.message.endswith("(the engine was not paused)"), e
    assert h.ended[-1].outcome == "failed"
    assert h.coord.engine.dp_layout_refused


@pytest.mark.parametrize("body", [None, INTERNAL_NODE_0, NO_DP],
                         ids=["no-information", "internal-lb", "no-dp"])
def test_other_engines_are_updated_and_the_layout_is_read_once(body) -> None:
    h = _harness(body)
    h.round(0)
    h.round(1)
    assert [e.outcome for e in h.ended] == ["success", "success"]
    assert h.engine.calls.count("server_info") == 1  # (cached with the version)
    assert h.coord.engine.dp_layout_refused == ""


def test_a_restarted_engine_is_read_again() -> None:
    """The layout is a fact of the engine process: a new session (the probe saw another
    weight version) asks it again, before the init, and a new process that now serves as
    one hybrid node is refused before its pause."""
    h = _harness(INTERNAL_NODE_0)
    h.round(0)
    h.engine.restart()
    h.engine.server_info = answer()
    h.round(1, n_chunks=1)
    assert h.engine.calls.count("server_info") == 2
    assert h.engine.calls.count("pause") == 1  # round 0's only
    assert "is one API server of a data-parallel deployment" in h.ended[-1].error


def test_a_refused_layout_is_asked_again_before_the_probe_of_each_begin() -> None:
    """An engine restarted at the same URL with the internal load balancer is taken at the
    next begin; a hybrid node whose world size is not the slot's is told its layout, not a
    world-size mismatch (the layout is read in the first stage)."""
    h = _harness(answer())
    h.engine.world_size = 8  # (what vLLM's /get_world_size says: every DP rank's workers)
    h.round(0, n_chunks=1)
    assert h.engine.calls == ["version", "server_info"]
    h.engine.world_size = 2
    h.engine.server_info = INTERNAL_NODE_0
    h.round(1, n_chunks=1)
    assert h.ended[-1].outcome == "success", h.ended[-1]
    assert h.engine.calls[2:4] == ["version", "server_info"]
    assert h.coord.engine.dp_layout_refused == ""


def test_an_engine_table_reload_forgets_the_refusal() -> None:
    engine = EngineSession(dp_layout_refused="refused")
    engine.forget()
    assert engine.dp_layout_refused == ""


def test_a_failed_server_info_call_fails_the_begin_before_the_pause() -> None:
    """Not a 404 (no route: no information) but a 500 or no answer: the begin fails as for
    any other probe, naming the route, and nothing touched generation."""
    h = _harness(None)
    h.engine.fail[("server_info", 0)] = "HTTP 500: Internal Server Error"
    h.round(0, n_chunks=1)
    assert h.engine.calls == ["version", "server_info"]
    for e in _errors(h):
        assert "vLLM server_info failed: HTTP 500" in e.message, e
        assert e.message.endswith("(the engine was not paused)"), e


# -- vLLM's own handler and the daemon's client ------------------------------------------

@pytest.mark.vllm
async def test_vllm_server_info_handler_answers_what_the_rule_reads(monkeypatch) -> None:
    """vLLM 0.32's show_server_info (config_format=json), run on VllmConfigs with the fields
    its arg_utils.py sets for each deployment: the rule reads each as above."""
    api = pytest.importorskip("vllm.entrypoints.serve.dev.server_info.api_router")
    from types import SimpleNamespace

    from vllm.config import ParallelConfig, VllmConfig

    monkeypatch.setattr(api, "_get_system_env_info_cached", dict)  # (collect_env: seconds)
    cases = [
        (dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_rank=2,
              data_parallel_hybrid_lb=True), DpLayout(4, 2, 2, True, False), True),
        (dict(data_parallel_size=4, data_parallel_size_local=1, data_parallel_rank=3,
              data_parallel_external_lb=True), DpLayout(4, 1, 3, False, True), True),
        (dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_rank=0),
         DpLayout(4, 2, 0, False, False), False),
        # (no DP: ParallelConfig.__post_init__ takes data_parallel_rank_local from
        # VLLM_DP_RANK_LOCAL, 0 by default; one rank is every rank)
        (dict(), DpLayout(1, 1, 0, False, False, offline=True), False),
    ]
    for fields, layout, refused in cases:
        config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, **fields))
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(vllm_config=config)))
        response = await api.show_server_info(request, config_format="json")
        body = json.loads(response.body)
        assert dp_layout.read(body) == layout, fields
        assert bool(dp_layout.refusal(dp_layout.read(body), URL)) is refused, fields


async def test_client_answers_none_for_a_server_without_server_info() -> None:
    """A 404 on /server_info (the reference engine, a server without the route) is no
    information, not an error; a 500 is an error; a 2xx body that is not JSON is None."""
    from aiohttp import web

    from slotsync.daemon.vllm.client import EngineError, VllmClient

    answers = iter([(404, '{"detail":"Not Found"}'), (500, "boom"), (200, "<html>")])
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.path_qs)
        status, text = next(answers)
        return web.Response(status=status, text=text)

    app = web.Application()
    app.router.add_get("/server_info", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    c = VllmClient(f"http://127.0.0.1:{runner.addresses[0][1]}", timeout_s=5)
    try:
        assert await c.call("server_info") is None
        with pytest.raises(EngineError) as ei:
            await c.call("server_info")
        assert ei.value.status == 500
        assert await c.call("server_info") is None
        assert seen == ["/server_info?config_format=json"] * 3
    finally:
        await c.close()
        await runner.cleanup()

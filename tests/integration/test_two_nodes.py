"""Engines over several nodes, the layouts beyond one TP engine (issue 25 D), with two nodes'
daemons on loopback (``two_nodes.TwoNodes``; the network-namespace suite, with real hosts and
partitions, is ``test_multi_node.py``): a DP=2 x TP=2 engine whose two replicas sit on
different nodes (list-form ``update_info`` indexed by global worker rank, on both engines), and
a round with a draft part (speculative decoding) into vLLM's own code."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engines import model_file, start_engine  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from state_readers import checksums_in_worker_order, engine_checksums, engine_stats  # noqa: E402
from test_draft_sessions import draft_sums_by_worker, want  # noqa: E402
from two_nodes import TwoNodes  # noqa: E402

from slotsync.protocol.rank.publisher import Publisher  # noqa: E402
from slotsync.testing.tensors import make_draft_tensors, make_tensors  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("impl", ["reference", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_dp_replicas_on_two_nodes_each_load_every_round(impl):
    """Replica 0 (workers 0-1) on node0, replica 1 (workers 2-3) on node1: ranks 2-3 publish
    to node1's daemon, which relays them; every worker holds every round's tensors."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    kw: dict[str, Any] = {"model": model_file(make_tensors(0))}
    if impl == "vllm":
        kw["executor_replies"] = "all"
    with start_engine(4, impl_name=impl, data_parallel_size=2, **kw) as eng, \
            TwoNodes(eng.url, 2) as nodes:
        for packed, first in ((True, 1), (False, 3)):
            ev = run_ranks(nodes.daemons[0], eng.url, packed,
                           [{"rounds": 2, "first_round": first}] * 4, daemon_of=nodes.daemon_of)
            assert all([e["status"] for e in rounds(ev, r)] == ["ok", "ok"] for r in range(4)), ev
            assert checksums_in_worker_order(eng) == [want(make_tensors(first + 1))] * 4
        slot = nodes.daemons[0].status()["slots"][0]
        assert slot["updates_succeeded"] == 4
        assert [r["node"] for r in slot["ranks"]] == ["node0", "node0", "node1", "node1"]


@pytest.mark.vllm
def test_a_draft_part_crosses_nodes_into_vllms_own_code():
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with start_engine(2, impl_name="vllm", model=model_file(make_tensors(0)),
                      draft_model=model_file(make_draft_tensors(0))) as eng, \
            TwoNodes(eng.url, 1) as nodes:
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                with Publisher(nodes.daemon_of(r).endpoint, r, (0, 2), eng.url, packed=True,
                               transport="shm", staging_bytes=40_000, timeout_s=60) as pub:
                    pub.publish(make_tensors(3), "step-3", draft=make_draft_tensors(3))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert list(engine_checksums(eng).values()) == [want(make_tensors(3))] * 2
        assert draft_sums_by_worker(eng) == [want(make_draft_tensors(3))] * 2
        assert engine_stats(eng)["weight_version"] == "step-3"

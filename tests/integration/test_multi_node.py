"""One engine over two nodes, each node a Linux network namespace with its own daemon
(issue 25 G, acceptance: "2 nodes x 4 ranks, one 8-worker engine, both engines,
packed/unpacked/rank-local, every round's checksums equal on all 8 workers").

``multi_node.Cluster`` makes the nodes (``netns.Nodes``), their CURVE keys and a daemon
inside each: node0's owns the engine (listening for peers on its veth address), node1's
relays its four ranks' frames over the peer link. The engine serves on a Unix socket; ranks
run in the root namespace, ranks 0-3 publishing to node0's daemon and 4-7 to node1's, with
the same ``Publisher`` arguments as on one node. One set of nodes and daemons serves the
whole module; the engine is started once per implementation (the reference engine, vLLM's
own code), on the same socket, so the daemons also meet an engine restarted under them.

Needs root and ``ip netns`` (CI runs as root); skips otherwise, saying why.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from engines import model_file, start_engine  # noqa: E402
from multi_node import (  # noqa: E402
    NODES,
    PER_NODE,
    SLOT,
    WORKERS,
    Cluster,
    assert_ep_round_landed,
    assert_round_landed,
    engine_model,
    ep_experts_of,
    impl_params,
    prepare_impl,
    publish_rank_local,
)
from spawned_ranks import rounds, run_ranks  # noqa: E402
from state_readers import slot_status  # noqa: E402

pytestmark = pytest.mark.slow

IMPLS = impl_params()  # both engines, unless --engine chose one
MODES = pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("mn"))
    yield c
    c.close()


@pytest.fixture(scope="module", params=IMPLS)
def engine(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[Any]:
    prepare_impl(request.param)
    eng = start_engine(WORKERS, impl_name=request.param, uds=cluster.engine_sock,
                       model=model_file(engine_model()))
    yield eng
    eng.stop()


@MODES
def test_rounds_over_two_nodes_land_on_all_eight_workers(cluster, engine, packed):
    """Two rounds, each by 8 fresh rank processes (4 per node): every rank's round succeeds
    and, after each, all 8 workers hold exactly that round's tensors. The owner's
    ``/status`` shows one slot of 8 ranks, ranks 4-7 on node1; node1's shows the slot as
    driven by node0; both ends of the peer link are up."""
    cluster.wait_links_up()
    for k in (1, 2):
        ev = run_ranks(cluster.daemon(0), engine.url, packed,
                       [{"first_round": k, "liveness_s": 3.0}] * WORKERS,
                       timeout_s=60, daemon_of=cluster.daemon_of)
        for r in range(WORKERS):
            assert [e["status"] for e in rounds(ev, r)] == ["ok"], (r, ev[r], cluster.logs())
        assert_round_landed(engine, k)
    owner = slot_status(cluster.daemon(0), SLOT)
    assert owner["state"] == "idle" and not owner["needs_full_update"], owner
    nodes = {r["rank"]: r["node"] for r in owner["ranks"]}
    assert nodes == {r: NODES[r // PER_NODE] for r in range(WORKERS)}, owner["ranks"]
    relay = cluster.daemon(1).status()
    assert relay["slots"] == [], relay["slots"]  # (node1 drives nothing itself)
    (relayed,) = relay["relayed_slots"]
    assert relayed["slot"] == list(SLOT) and relayed["driven_by"] == NODES[0], relayed
    assert relayed["owner_address"] == cluster.owner_address
    for k, peer in ((0, NODES[1]), (1, NODES[0])):
        link = cluster.link(k, peer)
        assert link["up"] and link["rtt_ms"] is not None, link
    for k, peer in ((0, NODES[1]), (1, NODES[0])):
        assert re.search(rf'^slotsync_peer_link_up{{node="{peer}",[^}}]*}} 1\.0$',
                         cluster.daemon(k).metrics(), re.M), f"node{k}: link to {peer} not up"


@MODES
def test_rank_local_rounds_over_two_nodes(cluster, engine, packed):
    """Rank-local (list form, expert parallelism): each of the 8 ranks publishes the shared
    tensors and its own experts (uneven: 3, 2, ..., 2, 1) to its own node's daemon; the
    owner merges one list entry per worker. Each worker ends with its own experts and the
    shared tensors new, every other expert as in the checkpoint."""
    cluster.wait_links_up()
    seed = 3 if packed else 4
    out = publish_rank_local(cluster, seed, f"ep-{seed}", packed)
    errors = {r: e for r, e in out.items() if isinstance(e, BaseException)}
    assert not errors, (errors, cluster.logs())
    # (uneven experts: the ranks sent different chunk counts, short ones empty entries)
    assert out[0] > out[WORKERS - 1], out
    assert len(ep_experts_of(0)) > len(ep_experts_of(WORKERS - 1))
    assert_ep_round_landed(engine, seed, f"ep-{seed}")

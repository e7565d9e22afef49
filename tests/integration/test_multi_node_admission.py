"""What a node's daemon accepts and shows for an engine over several nodes (issue 35, items 6
and 8), on two nodes made of network namespaces (``multi_node.Cluster``: node0's daemon owns
the 8-worker engine, ranks [0, 4) on node0, [4, 8) on node1).

* A relaying node (node1) refuses, at the registration, a slot its engine table does not
  declare, as the owner does, naming the slots it declares (it used to take it as a slot of
  its own and try to drive the engine); and a rank that the table's ``nodes`` put on another
  node, naming that node, on either side of the link.
* Its own ranks are visible on their node: ``/status`` (``ranks_connected``, the relayed
  slot's ``ranks_registered``), ``slotsync_ranks_connected`` / ``_expected`` (so that
  ``SlotsyncRanksMissing`` fires on their node), and ``slotsync status``, which exits 1 while a
  peer link is down.

No engine is needed: registrations of a declared slot never call it. Needs root and
``ip netns``; skips otherwise, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from multi_node import NODES, PER_NODE, SLOT, WORKERS, Cluster  # noqa: E402
from state_readers import wait_for  # noqa: E402

from slotsync.protocol import Publisher, SlotsyncError  # noqa: E402

pytestmark = pytest.mark.slow

LIVE_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("adm"), ["--liveness-s", str(LIVE_S)])
    yield c
    c.close()


@pytest.fixture
def linked(cluster: Cluster) -> Cluster:
    cluster.wait_links_up()
    return cluster


def _publisher(cluster: Cluster, node: int, rank: int,
               slot: tuple[int, int] = SLOT) -> Publisher:
    return Publisher(cluster.daemon(node).endpoint, rank, slot, cluster.engine_url,
                     transport="shm", timeout_s=30, liveness_s=LIVE_S)


def _refusal(cluster: Cluster, node: int, rank: int, slot: tuple[int, int] = SLOT) -> str:
    """The error text of rank ``rank``'s registration for ``slot`` at node ``node``'s
    daemon (the test fails if it is accepted)."""
    with _publisher(cluster, node, rank, slot) as pub, pytest.raises(SlotsyncError) as e:
        pub.register()
    return str(e.value)


def _status_cli(cluster: Cluster, node: int) -> subprocess.CompletedProcess:
    return cluster.net.run(node, [sys.executable, "-m", "slotsync", "status", "--url",
                                  cluster.daemon(node).status_url],
                           capture_output=True, text=True, timeout=60)


def _sample(metrics: str, name: str) -> float:
    (line,) = [ln for ln in metrics.splitlines() if ln.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_a_relaying_nodes_own_ranks_show_on_their_node(linked):
    """Three of node1's four ranks registered: node1's /status counts them, its metrics
    expect four and see three (SlotsyncRanksMissing's expression is 1 there), and
    ``slotsync status`` names them and the missing one, exiting 0 with the link up."""
    assert wait_for(lambda: linked.daemon(1).status()["ranks_connected"] == 0, 15), \
        linked.daemon(1).status()  # (an earlier test's rank gone)
    pubs = [_publisher(linked, 1, r) for r in range(PER_NODE, WORKERS - 1)]
    try:
        for p in pubs:
            p.register()
        doc = linked.daemon(1).status()
        assert doc["ranks_connected"] == len(pubs), doc
        (relayed,) = doc["relayed_slots"]
        assert relayed["ranks_registered"] == list(range(PER_NODE, WORKERS - 1)), relayed
        assert relayed["ranks_expected"] == WORKERS - PER_NODE, relayed
        assert [(r["rank"], r["pid"], r["registered"]) for r in relayed["ranks"]] == [
            (r, os.getpid(), True) for r in range(PER_NODE, WORKERS - 1)], relayed
        metrics = linked.daemon(1).metrics()
        assert _sample(metrics, "slotsync_ranks_expected") == WORKERS - PER_NODE, metrics
        assert _sample(metrics, "slotsync_ranks_connected") == len(pubs), metrics
        r = _status_cli(linked, 1)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"{len(pubs)} rank(s) registered" in r.stdout, r.stdout
        assert f"{len(pubs)}/{WORKERS - PER_NODE} registered (4, 5, 6; missing 7)" in r.stdout, \
            r.stdout
    finally:
        for p in pubs:
            p.close()
    assert wait_for(lambda: linked.daemon(1).status()["ranks_connected"] == 0, 15)


def test_slotsync_status_exits_1_while_a_peer_link_is_down(linked):
    """node1 cut off: ``slotsync status`` on either node exits 1 naming the link that is not
    up; plugged back in, 0 again."""
    linked.net.link_down(1)
    try:
        assert wait_for(lambda: not (linked.link(1, NODES[0]) or {"up": True})["up"], 20), \
            linked.logs()
        for node, peer in ((1, NODES[0]), (0, NODES[1])):
            assert wait_for(lambda n=node: _status_cli(linked, n).returncode == 1, 20)
            r = _status_cli(linked, node)
            assert "peer link(s) not up: " + peer in r.stderr, r.stderr
    finally:
        linked.net.link_up(1)
    linked.wait_links_up(30)
    r = _status_cli(linked, 1)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_relaying_node_refuses_a_slot_its_table_does_not_declare_as_the_owner_does(linked):
    """Half of the engine's slot ([4, 8): node1's ranks) and a slot inside it ([2, 4)):
    refused at node1 naming the declared slot and the node that drives it, and nothing
    is driven there; node0 refuses the same claim."""
    for rank, slot in ((PER_NODE, (PER_NODE, WORKERS - PER_NODE)), (2, (2, 2))):
        text = _refusal(linked, 1, rank, slot)
        end = slot[0] + slot[1]
        assert f"claims slot [{slot[0]}, {end}), which the daemon's engine table does not " \
               "declare" in text, text
        assert f"[0, {WORKERS}) {linked.engine_url} (driven by node {NODES[0]})" in text, text
        assert "does not declare" in _refusal(linked, 0, rank, slot)
    doc = linked.daemon(1).status()
    assert doc["slots"] == [], doc["slots"]  # (node1 drives nothing, claims no engine)
    assert "vLLM" not in linked.daemon(1).log_tail(20000)


def test_a_rank_registering_at_another_node_than_the_tables_is_refused_naming_it(linked):
    """Rank 0 at node1 (the table puts it on node0) is refused by node1 itself; rank 4 at
    node0 (the table puts it on node1) by node0; rank 4 at node1 registers."""
    text = _refusal(linked, 1, 0)
    assert f"rank 0 registers at node {NODES[1]}'s daemon, but the engine table puts rank 0 " \
           f"of slot [0, {WORKERS})" in text and f"on node {NODES[0]}" in text, text
    assert f"this node's ranks: [{PER_NODE}, {WORKERS})" in text, text
    text = _refusal(linked, 0, PER_NODE)
    assert f"rank {PER_NODE} registers at node {NODES[0]}'s daemon" in text, text
    assert f"on node {NODES[1]}" in text, text
    with _publisher(linked, 1, PER_NODE) as pub:
        pub.register()
        ranks = linked.daemon(0).status()["slots"][0]["ranks"]
        assert [(r["rank"], r["node"]) for r in ranks] == [(PER_NODE, NODES[1])], ranks

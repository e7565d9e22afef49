"""One SGLang engine over two nodes (issue 26 with issue 25's nodes): 8 TP ranks, the
SGLang-code engine (SGLang's own payload code in each TP rank), node0's daemon owning it and
node1's relaying its four ranks over the peer link, each node a Linux network namespace
(``multi_node.Cluster``, ``netns.Nodes``). The engine's kind is not declared: the owner tells
it from its answers. Every round's checksums equal on all 8 TP ranks, packed and unpacked;
a 400 on a chunk leaves the engine paused, and the next round over both nodes lands.

Needs root and ``ip netns`` (CI runs as root); skips otherwise, saying why.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from engines import model_file, start_engine  # noqa: E402
from multi_node import SLOT, WORKERS, Cluster, engine_model  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from state_readers import engine_stats, slot_status  # noqa: E402
from trainer_script import make_tensors  # noqa: E402

from slotsync.engine.checksum import tensor_checksum  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("mn-sglang"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def sglang(cluster: Cluster) -> Iterator[Any]:
    eng = start_engine(WORKERS, impl_name="sglang", uds=cluster.engine_sock,
                       model=model_file(engine_model()))
    yield eng
    eng.stop()


def publish(cluster: Cluster, eng: Any, packed: bool, k: int) -> dict:
    """Round ``k`` by 8 fresh rank processes, 0-3 at node0's daemon, 4-7 at node1's."""
    return run_ranks(cluster.daemon(0), eng.url, packed,
                     [{"first_round": k, "liveness_s": 3.0}] * WORKERS,
                     timeout_s=60, daemon_of=cluster.daemon_of)


def assert_landed(eng: Any, k: int) -> None:
    want = {n: tensor_checksum(t) for n, t in make_tensors(k)}
    status, by_rank = eng.request("POST", "/_slotsync/checksums")
    assert status == 200 and sorted(by_rank) == sorted(f"tp{r}" for r in range(WORKERS))
    for rank, sums in by_rank.items():
        assert {n: sums.get(n) for n in want} == want, f"{rank} differs after round {k}"
    stats = engine_stats(eng)
    assert stats["weight_version"] == f"v{k}" and stats["paused"] is False, stats
    assert stats["session_open"] is False, stats


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_rounds_over_two_nodes_land_on_all_eight_tp_ranks(cluster, sglang, packed):
    cluster.wait_links_up()
    for k in (1, 2):
        ev = publish(cluster, sglang, packed, k)
        for r in range(WORKERS):
            assert [e["status"] for e in rounds(ev, r)] == ["ok"], (r, ev[r], cluster.logs())
        assert_landed(sglang, k)
    owner = slot_status(cluster.daemon(0), SLOT)
    assert (owner["engine_kind"], owner["engine_sglang_version"]) == ("sglang", "0.5.23")
    assert owner["state"] == "idle", owner


def test_a_failed_chunk_over_two_nodes_tells_every_rank_and_the_next_round_lands(
        cluster, sglang):
    """A 400 on the second chunk: the ranks of both nodes are told (the relayed ones through
    the peer link), the engine stays paused and alive, and the next round -- a full one --
    lands on all 8 TP ranks."""
    cluster.wait_links_up()
    sglang.request("POST", "/_slotsync/fault", {"route": "update_weights_from_tensor",
                                                "after": 1, "times": 1, "status": 400,
                                                "message": "injected refusal"})
    ev = publish(cluster, sglang, True, 3)
    for r in range(WORKERS):
        (e,) = rounds(ev, r)
        assert e["status"] == "error" and "HTTP 400" in e["message"], (r, e)
    assert engine_stats(sglang)["paused"] is True
    ev = publish(cluster, sglang, True, 4)
    for r in range(WORKERS):
        assert [e["status"] for e in rounds(ev, r)] == ["ok"], (r, ev[r], cluster.logs())
    assert_landed(sglang, 4)

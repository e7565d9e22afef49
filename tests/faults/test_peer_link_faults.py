"""The peer link's refusals between real nodes (issue 35 items 3, 4 and 5): each told truly on
both sides, and the link back by itself once the cause is fixed on the other side.

Two nodes (``multi_node.Cluster``: network namespaces, a daemon in each, node0 owning the
8-worker engine, node1 relaying ranks 4-7), every daemon with ``liveness_s`` = :data:`LIVE_S`.
No engine runs: nothing here gets past a registration. A rank registering at node1 is a
``Publisher`` in a thread of this process (the ranks reach their node's daemon over its
``ipc://`` socket, a file).

* item 3: node1's key refused by node0, node0 then restarted with it allowed: node1 connects
  again by itself within ``liveness_s`` (libzmq alone never retries after a refused key);
* item 4: node1 holds a stale ``node0.key``: node0 logs and counts the failed handshake with
  node1's address; node1 and its ranks say it is likely a key mismatch, naming the file; the
  file fixed on node1, the link comes back without a restart;
* item 5: a refused link is told to ranks as refused (not "cannot be reached"); an
  ``owner_address`` where nothing listens says so, and to check ``owner_address``.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from multi_node import NODES, PER_NODE, SLOT, WORKERS, Cluster  # noqa: E402
from state_readers import wait_for  # noqa: E402

from slotsync.protocol.errors import SlotsyncError  # noqa: E402
from slotsync.protocol.rank.publisher import Publisher  # noqa: E402

pytestmark = pytest.mark.slow

LIVE_S = 3.0  # every daemon's liveness_s
SLACK_S = 3.0  # scheduling slack on a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("plf"), ["--liveness-s", str(LIVE_S)])
    yield c
    c.close()


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[Cluster]:
    """Both daemons up with their own configurations and linked, before and after."""
    cluster.wait_links_up()
    yield cluster
    print(cluster.logs(12000))  # (pytest shows it for a failed test)
    for k in range(len(NODES)):
        cluster.restart(k)
    cluster.wait_links_up()


def register_error(cluster: Cluster, rank: int = PER_NODE) -> str:
    """Rank ``rank`` registers at its node's daemon; the error it is told (it must be one)."""
    try:
        with Publisher(cluster.endpoint_of(rank), rank, SLOT, cluster.engine_url,
                       transport="shm", timeout_s=30, liveness_s=LIVE_S) as pub:
            pub.register()
    except SlotsyncError as e:
        return e.message
    raise AssertionError(f"rank {rank} registered\n{cluster.logs()}")


def restart_with(cluster: Cluster, k: int, config: str) -> None:
    """Node ``k``'s daemon stopped and started again with ``config``."""
    cluster.daemon(k).stop()
    cluster.start(k, config)


def link_state(cluster: Cluster, k: int) -> str:
    return (cluster.link(k, NODES[1 - k]) or {}).get("state", "")


def allow_list_without_node1(cluster: Cluster, tmp_path: Path) -> Path:
    """An allow-list for node0 holding its own key only (node1's is refused)."""
    folder = tmp_path / "node0-allows"
    folder.mkdir()
    shutil.copy(cluster.public / f"{NODES[0]}.key", folder)
    return folder


def refuse_node1_key(cluster: Cluster, tmp_path: Path) -> None:
    restart_with(cluster, 0, cluster.config_text(0, public=allow_list_without_node1(
        cluster, tmp_path)))
    assert wait_for(lambda: link_state(cluster, 1).startswith("refused"), 10 + LIVE_S), \
        (link_state(cluster, 1), cluster.logs())


def restart_owner_allowing_node1_and_wait_link_back(cluster: Cluster) -> None:
    """node0 restarted with its own configuration (node1's key allowed again); the link must
    be up within ``liveness_s`` (plus scheduling slack), node1 untouched."""
    cluster.restart(0)
    fixed = time.monotonic()
    assert wait_for(cluster.links_up, 30), (cluster.link(1, NODES[0]), cluster.logs())
    took = time.monotonic() - fixed
    print(f"link up {took:.2f} s after node0 came back")
    assert took <= LIVE_S + SLACK_S, took


def test_a_refused_key_is_told_to_ranks_as_a_refusal(nodes, tmp_path):
    """Item 5: node0's allow-list lacks node1's key. node1's rank is told that node0's daemon
    refused this node's peer link, and why (its key; node1.key to add), not that it "cannot
    be reached": it was reached, and it said no."""
    refuse_node1_key(nodes, tmp_path)
    message = register_error(nodes)
    assert f"node {NODES[0]}'s daemon, which drives this engine, refused this node's peer " \
        f"link at {nodes.owner_address}: node {NODES[0]}'s daemon does not accept this " \
        "node's key" in message, message
    assert f"{NODES[1]}.key" in message and "cannot be reached" not in message, message
    assert "peer_key_refused" in nodes.daemon(0).log_tail(20000)


def test_the_link_comes_back_by_itself_after_a_refused_key_is_fixed(nodes, tmp_path):
    """Item 3: node1's key refused, then node0 restarted with it allowed: node1, untouched,
    connects again by itself within liveness_s (it never did: libzmq ends a connection whose
    key was refused for good)."""
    refuse_node1_key(nodes, tmp_path)
    time.sleep(LIVE_S)  # (refused for a while: several tries)
    restart_owner_allowing_node1_and_wait_link_back(nodes)


def test_the_link_comes_back_after_repeated_refusals_once_nothing_else_is_due(nodes, tmp_path):
    """Item 3, as the fresh-clone run met it: node0 gone long enough for node1 to warn that
    nothing listens (its last timer deadline spent), then back refusing node1's key several
    times, then fixed. Each refusal after the first changes nothing that is logged, yet sets
    the next try's time: the adapter must wake its timer for it, or node1 never tries again
    (it did not, and the link stayed down for good)."""
    nodes.daemon(0).stop()
    assert wait_for(lambda: "peer_not_connected" in nodes.daemon(1).log_tail(20000),
                    10 + 2 * LIVE_S), nodes.logs()
    nodes.start(0, nodes.config_text(0, public=allow_list_without_node1(nodes, tmp_path)))
    assert wait_for(lambda: nodes.daemon(0).status()["peers"]["handshakes_refused"] >= 3,
                    10 + 4 * LIVE_S), nodes.logs()
    restart_owner_allowing_node1_and_wait_link_back(nodes)


def test_the_link_comes_back_by_itself_after_a_refused_hello_is_fixed_on_the_owner(nodes):
    """The acceptance "the link comes back by itself after any refusal is fixed on the other
    side, within liveness_s", for the owner's own refusal: node0 restarted with the nodes
    listed in the other order refuses node1's Hello; node0 restarted with the right table,
    node1 (untouched) is linked again within liveness_s."""
    wrong = [(NODES[1], 0, PER_NODE), (NODES[0], PER_NODE, WORKERS)]
    restart_with(nodes, 0, nodes.config_text(0, parts=wrong))
    assert wait_for(lambda: link_state(nodes, 1).startswith("refused"), 10 + LIVE_S), \
        (link_state(nodes, 1), nodes.logs())
    nodes.restart(0)
    fixed = time.monotonic()
    assert wait_for(nodes.links_up, 30), (nodes.link(1, NODES[0]), nodes.logs())
    took = time.monotonic() - fixed
    print(f"link up {took:.2f} s after node0 came back with the right table")
    assert took <= LIVE_S + SLACK_S, took


def test_a_stale_owner_key_is_named_on_both_nodes_and_its_fix_brings_the_link_back(
        nodes, tmp_path):
    """Item 4: node1's allow-list holds a stale node0.key (another key pair's). node0 logs the
    failed CURVE handshake with node1's address and counts it; node1 logs it and its rank is
    told it is likely a key mismatch, naming the file to check (it said only "down: not
    connected within 10 s", node0 nothing). The right node0.key copied there, node1 connects
    again by itself (the file is read again at each try), within liveness_s."""
    folder = tmp_path / "node1-allows"
    Cluster.make_node_keys(NODES[0], tmp_path / "stale", folder)  # (another node0 pair)
    shutil.copy(nodes.public / f"{NODES[1]}.key", folder)
    before = rejected(nodes)
    restart_with(nodes, 1, nodes.config_text(1, public=folder))
    key_file = str(folder / f"{NODES[0]}.key")
    assert wait_for(lambda: "key mismatch" in link_state(nodes, 1), 10), \
        (link_state(nodes, 1), nodes.logs())
    assert key_file in link_state(nodes, 1)
    message = register_error(nodes)
    assert f"refused this node's peer link at {nodes.owner_address}" in message, message
    assert f"likely a key mismatch: {key_file} must hold node {NODES[0]}'s current public " \
        "key" in message, message
    assert "peer_handshake_failed" in nodes.daemon(1).log_tail(20000)
    # node1 tries again every liveness_s / 5. A try whose connection libzmq closed before the
    # owner read its accept event is logged "from an unknown address" (nothing left to ask
    # the address of: CI saw it once under load); the next tries are read in time.
    def owner_lines() -> list[str]:
        return [ln for ln in nodes.daemon(0).log_tail(20000).splitlines()
                if "peer_handshake_failed" in ln]
    assert wait_for(lambda: any(f"from {nodes.net.address(1)}:" in ln
                                for ln in owner_lines()), 10 + LIVE_S), nodes.logs()
    assert all(f"{NODES[0]}.key" in ln for ln in owner_lines()), owner_lines()
    assert rejected(nodes) > before
    assert nodes.daemon(0).status()["peers"]["handshakes_refused"] >= 1
    shutil.copy(nodes.public / f"{NODES[0]}.key", folder / f"{NODES[0]}.key")
    fixed = time.monotonic()
    assert wait_for(nodes.links_up, 30), (nodes.link(1, NODES[0]), nodes.logs())
    took = time.monotonic() - fixed
    print(f"link up {took:.2f} s after node0.key was fixed on node1")
    assert took <= LIVE_S + SLACK_S, took


def rejected(cluster: Cluster) -> float:
    m = re.search(r"^slotsync_rejected_messages_total (\S+)$", cluster.daemon(0).metrics(),
                  re.M)
    return float(m.group(1)) if m else 0.0


def test_an_owner_address_where_nothing_listens_says_so(nodes):
    """Item 5: node1's owner_address names a port where nothing listens. Its rank is told,
    after liveness_s, that nothing listens there (connection refused) and to check
    owner_address (it said only "down: not connected within 10 s")."""
    wrong = nodes.owner_address.rsplit(":", 1)[0] + ":9"
    restart_with(nodes, 1, nodes.config_text(1).replace(
        f'owner_address = "{nodes.owner_address}"', f'owner_address = "{wrong}"'))
    message = register_error(nodes)
    assert f"cannot be reached at {wrong} (down: not connected within {LIVE_S:g} s: nothing " \
        f"listens at {wrong} (connection refused): check owner_address" in message, message

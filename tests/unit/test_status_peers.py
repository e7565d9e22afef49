"""``slotsync status`` shows each rank's node and each peer link (issue 25 E), from the
documents the link state machines write (``OwnerLinks.status``, ``RelayLinks.status``)."""

from __future__ import annotations

from test_peer_links import ENTRY, _hello, _owner, _register, _relay

from slotsync.cli.status import render_table
from slotsync.daemon.node_links.peer_wire import Ping, Pong, Relay, Welcome


def _doc(peers: dict, **kw) -> dict:
    return {"version": "t", "endpoint": "ipc:///x", "slots": [], "ranks_connected": 0,
            "peers": peers, **kw}


def test_owner_status_shows_links_with_rtt_messages_and_ranks_nodes():
    o = _owner()
    o.on_message("node1", _hello(), 0.0)
    o.on_message("node1", Relay(b"r4", 11, b"f"), 0.5)
    o.on_message("node1", Pong(0.5), 0.502)
    links = o.status(1.0)
    assert links[0]["up"] and links[0]["rtt_ms"] == 2.0 and links[0]["relayed_ranks"] == 1
    slot = {"slot": [0, 8], "state": "idle", "ranks_expected": 8, "ranks_registered": [0, 4],
            "ranks": [{"rank": 0, "pid": 5, "host": "a", "node": "node0", "alive": True,
                       "last_seen_s": 1.0},
                      {"rank": 4, "pid": 11, "host": "b", "node": "node1", "alive": True,
                       "last_seen_s": 1.0}]}
    text = render_table({**_doc({"node": "node0", "listen": "tcp://0.0.0.0:9461",
                                 "links": links}), "slots": [slot]})
    assert "node node0, listening for peers on tcp://0.0.0.0:9461" in text
    ranks = text.split("\nRANK ")[1].splitlines()
    assert "NODE" in ranks[0] and " node1 " in ranks[2]
    line = next(row for row in text.splitlines() if row.startswith("node1 "))
    assert "relays to us" in line and " up " in line and "3/1" in line and "2.00 ms" in line
    assert ENTRY.url in line


def test_relaying_node_status_says_who_drives_its_slot():
    r = _relay()
    r.on_connected("node0", 0.0)
    r.on_message("node0", Welcome("node0"), 0.1)
    r.on_rank_message(b"r4", _register(), b"reg", 11, 0.2)
    r.on_message("node0", Ping(0.3), 0.3)
    text = render_table(_doc({"node": "node1", "listen": "", "links": r.status(1.0)},
                             relayed_slots=[{"slot": [0, 8], "driven_by": "node0",
                                             "owner_address": ENTRY.owner_address,
                                             "engine_url": ENTRY.url,
                                             "nodes": [{"node": "node0", "ranks": [0, 4]},
                                                       {"node": "node1", "ranks": [4, 8]}]}]))
    assert "drives for us" in text and "tcp://10.0.0.1:9461" in text
    assert ("slot [0,8) http://10.0.0.1:8000: driven by node node0 (tcp://10.0.0.1:9461); "
            "nodes node0 [0, 4), node1 [4, 8)") in text


def test_a_daemon_without_links_shows_no_peer_part():
    text = render_table({"version": "t", "endpoint": "ipc:///x", "slots": []})
    assert "PEER" not in text and "node" not in text


def test_status_says_what_a_down_links_connect_attempts_met_and_the_refused_handshakes():
    """Issue 35 items 4 and 5: the LINK column said only "down: not connected within 10 s";
    the owner's listener showed nothing of the handshakes it refused."""
    from slotsync.daemon.node_links.link_monitor import connect_failure

    r = _relay()
    r.on_connect_failed("node0", 0.1, connect_failure("node0", ENTRY.owner_address, "refused"))
    r.poll(11.0)
    text = render_table(_doc({"node": "node1", "listen": "", "links": r.status(11.0)}))
    assert f"link to node0: nothing listens at {ENTRY.owner_address} (connection refused): " \
        "check owner_address" in text
    text = render_table(_doc({"node": "node0", "listen": "tcp://0.0.0.0:9461", "links": [],
                              "handshakes_refused": 2}))
    assert "2 handshake(s) refused on the listener" in text

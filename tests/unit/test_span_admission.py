"""Engines over several nodes, issue 35 items 6-8 without sockets: what a relaying node's
daemon admits (``relay.py``, ``spans.misplaced_rank``, the slot table's ``elsewhere``), what
``--check-config`` refuses on the owner as node1 would (``spans.check_spanning``,
``config.py``, ``peer_keys.too_open``, ``spans.difference``), and the relaying node's own
ranks in its status, metrics and ``slotsync status`` (``cli/status*.py``, ``metrics.py``)."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from test_peer_links import ENTRY, _register, _relay

from slotsync.cli import status as status_cli
from slotsync.daemon.core.slot_table import SlotTable
from slotsync.daemon.node_links import spans
from slotsync.daemon.node_links.peer_keys import make_keys
from slotsync.daemon.node_links.peer_state import ReplyRank, SendPeer, ToRank
from slotsync.daemon.node_links.peer_wire import Deliver, Welcome
from slotsync.daemon.service.config import load_config
from slotsync.daemon.service.metrics import Metrics
from slotsync.daemon.service.server import _engine_table
from slotsync.protocol.wire import Error, Registered, encode

# ------------------------------------------------------------------ item 6: admission


def test_relay_refuses_a_rank_the_table_puts_on_another_node_naming_it():
    r = _relay()  # node1, ranks [4, 8)
    r.on_connected("node0", 0.0)
    r.on_message("node0", Welcome("node0"), 0.1)
    out = r.on_rank_message(b"r0", _register(rank=0), b"reg", 11, 0.2)
    (reply,) = out
    assert isinstance(reply, ReplyRank) and isinstance(reply.msg, Error), out
    assert reply.msg.phase == "register" and reply.msg.slot == [0, 8]
    text = reply.msg.message
    assert "rank 0 registers at node node1's daemon, but the engine table puts rank 0 of slot " \
        "[0, 8) (engine http://10.0.0.1:8000) on node node0 (this node's ranks: [4, 8))" in text
    assert not any(isinstance(a, SendPeer) for a in out)  # (nothing relayed)
    (relayed,) = r.on_rank_message(b"r4", _register(rank=4), b"reg", 12, 0.3)
    assert isinstance(relayed, SendPeer)  # node1's own rank goes to the owner


def test_misplaced_rank_names_nothing_for_a_rank_of_this_node_or_of_no_node():
    e = spans.span_engine(ENTRY)
    assert spans.misplaced_rank(e, "node1", 5) == ""
    assert spans.misplaced_rank(e, "node1", 9) == ""  # (outside the slot: the owner says so)
    assert "on node node1" in spans.misplaced_rank(e, "node0", 7)


def test_a_table_of_only_relayed_engines_still_refuses_undeclared_slots():
    """node1's table declares only the engine node0 drives: a registration for half of it,
    or any other slot, is refused naming what is declared (it used to make a slot of its own
    here and drive the engine)."""
    table = SlotTable(check_claims=True)
    table.set_engine_table(*_engine_table([ENTRY], spans.roles([ENTRY], "node1")))
    assert table.declared == {}
    for slot in ((4, 8), (2, 4), (8, 12)):
        (reply,) = table.on_message(b"x", _register(rank=slot[0], slot=slot), 1.0)
        assert isinstance(reply.msg, Error), reply
        assert (f"claims slot [{slot[0]}, {slot[1]}), which the daemon's engine table does not "
                "declare (declared: [0, 8) http://10.0.0.1:8000 (driven by node node0))"
                ) in reply.msg.message
    assert table.slots == {}


# ------------------------------------------------------------------ item 7: --check-config


def _config(tmp_path: Path, engine: str, node: str = "node0", mode: int = 0o600) -> Path:
    keys = tmp_path / "keys"
    if not keys.exists():
        make_keys("node0", keys)
        make_keys("node1", keys)
    os.chmod(keys / f"{node}.key_secret", mode)
    f = tmp_path / f"{node}.toml"
    f.write_text(f'node = "{node}"\nruntime_dir = "{tmp_path}/run"\nstatus_port = -1\n'
                 f'curve_secret_key = "{keys}/{node}.key_secret"\n'
                 f'peer_public_keys = "{keys}"\n'
                 + ('peer_listen = "tcp://127.0.0.1:9461"\n' if node == "node0" else "")
                 + '[[engines]]\nurl = "http://127.0.0.1:8000"\nslot_start = 0\nslot_size = 8\n'
                 'owner = "node0"\nnodes = [{node = "node0", ranks = [0, 4]}, '
                 '{node = "node1", ranks = [4, 8]}]\n' + engine)
    return f


def _check(path: Path, capsys) -> str:
    """``slotsyncd --config path --check-config``'s refusal (status 2)."""
    with pytest.raises(SystemExit) as e:
        load_config(["--config", str(path), "--check-config"], environ={})
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("engine,text", [
    ("", "owner_address is not set: the daemons of the other nodes connect there"),
    ('owner_address = "10.0.0.1:9461"\n', "must be tcp://HOST:PORT"),
    ('owner_address = "tcp://10.0.0.1:99999"\n', "port 99999 is outside 1..65535"),
])
def test_check_config_refuses_a_bad_owner_address_on_the_owner_as_on_the_others(
        tmp_path, capsys, engine, text):
    for node in ("node0", "node1"):
        assert text in _check(_config(tmp_path, engine, node), capsys), node


def test_check_config_names_an_unknown_engine_key_and_the_close_one(tmp_path, capsys):
    err = _check(_config(tmp_path, 'owner_adress = "tcp://10.0.0.1:9461"\n'), capsys)
    assert "engines[0]: unknown key(s) 'owner_adress' (did you mean 'owner_address'?)" in err
    assert "must have url" not in err


def test_check_config_prints_nodes_as_nodes(tmp_path):
    cfg, check = load_config(["--config", str(_config(
        tmp_path, 'owner_address = "tcp://127.0.0.1:9461"\n')), "--check-config"], environ={})
    (e,) = cfg.describe()["engines"]
    assert check and "parts" not in e
    assert e["nodes"] == [{"node": "node0", "ranks": [0, 4]}, {"node": "node1", "ranks": [4, 8]}]


def test_a_secret_key_readable_by_others_is_refused_saying_chmod_600(tmp_path, capsys):
    """As ssh refuses such a private key: readable by others, or by the group of a file of
    the daemon's own user. A Kubernetes Secret volume (deploy/kubernetes/daemonset.yaml:
    another owner, mode 0440, read through the daemon's group) passes."""
    secret = tmp_path / "keys" / "node0.key_secret"
    for mode in (0o644, 0o604, 0o640):
        err = _check(_config(tmp_path, 'owner_address = "tcp://127.0.0.1:9461"\n', mode=mode),
                     capsys)
        assert f"curve_secret_key '{secret}' is accessible by " in err
        assert f"(mode {mode:04o})" in err and f"chmod 600 {secret}" in err
    if os.getuid() == 0:  # (chown needs root)
        path = _config(tmp_path, 'owner_address = "tcp://127.0.0.1:9461"\n', mode=0o440)
        os.chown(secret, 65534, os.getgid())
        cfg, _ = load_config(["--config", str(path), "--check-config"], environ={})
        assert cfg.curve_secret_key == str(secret)


def test_an_owner_address_differing_between_the_tables_is_refused_at_hello():
    mine = [spans.span_engine(ENTRY)]
    theirs = [spans.span_engine(ENTRY.__class__(**{**vars(ENTRY),
                                                   "owner_address": "tcp://10.0.0.9:9461"}))]
    text = spans.difference(mine, theirs, "node0", "node1")
    assert "owner_address tcp://10.0.0.9:9461" in text and "owner_address tcp://10.0.0.1:9461" \
        in text, text
    assert "(they differ in owner_address: the engine tables must declare it identically)" \
        in text


# ------------------------------------------------------------------ item 8: visible at home


def _relay_with_ranks(registered: list[int], waiting: list[int]):
    r = _relay()
    r.on_connected("node0", 0.0)
    r.on_message("node0", Welcome("node0"), 0.1)
    for k in registered + waiting:
        r.on_rank_message(f"r{k}".encode(), _register(rank=k), b"reg", 100 + k, 0.2)
    for k in registered:
        out = r.on_message("node0", Deliver(f"r{k}".encode(), encode(
            Registered(k, 0, 8, 0, node="node0"))), 0.3)
        assert isinstance(out[0], ToRank)
    return r


def test_relayed_ranks_count_in_the_relaying_nodes_metrics():
    r = _relay_with_ranks([4, 5, 6], [7])
    assert r.registered_ranks() == 3 and r.expected_ranks() == 4
    m = Metrics("t")
    m.watch(SlotTable())
    m.watch_peers(types.SimpleNamespace(relay=r, links=lambda: [o.link for o in
                                                                r.owners.values()]))
    text = generate_latest(m.registry).decode()
    assert "\nslotsync_ranks_expected 4.0\n" in text
    assert "\nslotsync_ranks_connected 3.0\n" in text
    assert 'slotsync_peer_link_up{node="node0",role="drives for us"} 1.0' in text
    assert [(x["rank"], x["pid"], x["registered"]) for x in r.relayed_ranks()[(0, 8)]] == [
        (4, 104, True), (5, 105, True), (6, 106, True), (7, 107, False)]


def _doc(links: list[dict], registered: list[int]) -> dict:
    return {"version": "t", "endpoint": "ipc:///x", "slots": [], "ranks_connected":
            len(registered), "peers": {"node": "node1", "listen": "", "links": links},
            "relayed_slots": [{"slot": [0, 8], "driven_by": "node0",
                               "owner_address": "tcp://10.0.0.1:9461", "engine_url": ENTRY.url,
                               "nodes": [{"node": "node0", "ranks": [0, 4]},
                                         {"node": "node1", "ranks": [4, 8]}],
                               "ranks_expected": 4, "ranks_registered": registered,
                               "ranks": []}]}


def test_slotsync_status_shows_the_relayed_ranks_and_exits_1_while_a_link_is_down(
        monkeypatch, capsys):
    r = _relay_with_ranks([4, 5, 6], [])
    docs = [_doc(r.status(1.0), [4, 5, 6])]
    monkeypatch.setattr(status_cli, "fetch_status", lambda url, t: docs[-1])
    args = status_cli.build_parser().parse_args(["--url", "http://x"])
    assert status_cli.main_from_args(args) == 0
    out = capsys.readouterr().out
    assert "3 rank(s) registered (3 of them relayed to the node that drives their slot)" in out
    assert "this node's ranks are relayed there: 3/4 registered (4, 5, 6; missing 7)" in out
    r.on_disconnected("node0", 2.0, "its connection closed")
    docs.append(_doc(r.status(2.0), []))
    assert status_cli.main_from_args(args) == 1
    cap = capsys.readouterr()
    assert "0/4 registered (missing 4, 5, 6, 7)" in cap.out
    assert "1 peer link(s) not up: node0 (down: its connection closed)" in cap.err

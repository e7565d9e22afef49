"""Engines over several nodes in the engine table (issue 25 A; ``daemon/node_links/spans.py``):
parsing,
the checks that name what is wrong, each daemon's role, and the difference two nodes'
declarations make at connection."""

from __future__ import annotations

import pytest

from slotsync.daemon.node_links import spans
from slotsync.daemon.node_links.peer_keys import make_keys
from slotsync.daemon.node_links.peer_wire import SpanPart
from slotsync.daemon.service.config import EngineEntry, read_config_file

URL = "http://10.0.0.1:8000"


def _entry(**kw) -> EngineEntry:
    base = dict(url=URL, slot_start=0, slot_size=8, owner="node0",
                owner_address="tcp://10.0.0.1:9461",
                parts=(SpanPart("node0", 0, 4), SpanPart("node1", 4, 8)))
    base.update(kw)
    return EngineEntry(**base)


@pytest.fixture
def keys(tmp_path):
    make_keys("node0", tmp_path / "pub")
    make_keys("node1", tmp_path / "pub")
    return str(tmp_path / "pub" / "node0.key_secret"), str(tmp_path / "pub")


def test_toml_engine_over_two_nodes_parses(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('node = "node1"\n[[engines]]\nurl = "http://10.0.0.1:8000"\nslot_start = 0\n'
                 'slot_size = 8\nowner = "node0"\nowner_address = "tcp://10.0.0.1:9461"\n'
                 'nodes = [{node = "node0", ranks = [0, 4]}, {node = "node1", ranks = [4, 8]}]\n')
    cfg = read_config_file(f)
    (e,) = cfg.engines
    assert e.owner == "node0" and e.spans_nodes
    assert e.parts == (SpanPart("node0", 0, 4), SpanPart("node1", 4, 8))
    assert cfg.node == "node1"


@pytest.mark.parametrize("entry,text", [
    ({"nodes": [{"node": "a", "ranks": [0]}]}, "nodes[0] must be {node = NAME"),
    ({"nodes": [{"node": "a", "ranks": [0, 4]}]}, "needs its owner"),
    ({"owner": "a"}, "list its nodes too"),
    ({"nodes": "a"}, "nodes must be an array"),
])
def test_toml_mistakes_are_named(entry, text):
    with pytest.raises(ValueError, match=text.replace("[", r"\[").replace("{", r"\{")):
        spans.parse_toml(entry)


@pytest.mark.parametrize("kw,node,text", [
    ({"parts": (SpanPart("node0", 0, 4), SpanPart("node1", 5, 8))}, "node0",
     "must cover the slot"),
    ({"parts": (SpanPart("node0", 0, 4), SpanPart("node1", 4, 7))}, "node0",
     "end at 7, the slot at 8"),
    ({"parts": (SpanPart("node0", 0, 4), SpanPart("node0", 4, 8))}, "node0", "listed twice"),
    ({"owner": "node9"}, "node0", "owner 'node9' is not one of its nodes"),
    ({}, "node7", "this daemon's node 'node7'"),
    ({"owner_address": "http://x:1"}, "node1", "must be tcp://HOST:PORT"),
])
def test_engine_table_mistakes_are_named(kw, node, text, keys):
    with pytest.raises(ValueError, match=text):
        spans.check_spanning([_entry(**kw)], node, "tcp://127.0.0.1:9461", *keys)


def test_owner_needs_a_listener_and_both_need_keys(keys):
    with pytest.raises(ValueError, match="peer_listen is not set"):
        spans.check_spanning([_entry()], "node0", "", *keys)
    with pytest.raises(ValueError, match="curve_secret_key is not set"):
        spans.check_spanning([_entry()], "node1", "", "", keys[1])
    with pytest.raises(ValueError, match="peer_public_keys '/nope' is not a folder"):
        spans.check_spanning([_entry()], "node1", "", keys[0], "/nope")
    spans.check_spanning([_entry()], "node0", "tcp://127.0.0.1:9461", *keys)
    spans.check_spanning([_entry()], "node1", "", *keys)


def test_roles_of_owner_and_relaying_node():
    table = [_entry(), EngineEntry("http://127.0.0.1:9000", 8, 4)]
    owner = spans.roles(table, "node0")
    assert set(owner.owned) == {(0, 8)} and not owner.relayed
    assert owner.peers_of_owned() == {"node1"}
    relaying = spans.roles(table, "node1")
    assert set(relaying.relayed) == {(0, 8)} and not relaying.owned
    assert relaying.owners() == {"node0": ("tcp://10.0.0.1:9461",
                                           [spans.span_engine(_entry())])}


def test_difference_names_what_differs():
    mine = [spans.span_engine(_entry())]
    assert spans.difference(mine, mine, "node0", "node1") == ""
    other = [spans.span_engine(_entry(parts=(SpanPart("node0", 0, 2), SpanPart("node1", 2, 8))))]
    text = spans.difference(mine, other, "node0", "node1")
    assert "node node1 declares engine http://10.0.0.1:8000 as slot [0, 8) owned by node0 " \
        "over node0 [0, 2), node1 [2, 8)" in text and "node node0, its owner, as" in text
    assert "does not declare" in spans.difference(mine, [], "node0", "node1")
    extra = [spans.span_engine(_entry(url="http://10.0.0.1:8001"))]
    assert "has no such engine" in spans.difference([], extra, "node0", "node1")


def test_key_files_are_checked_with_the_configuration(tmp_path):
    """--check-config refuses what the daemon would refuse at start (fresh-user trial: the
    public half, another node's pair, a missing owner key all passed the check)."""
    from slotsync.daemon.service.config import Config

    make_keys("node0", tmp_path / "pub")
    make_keys("node1", tmp_path / "pub")
    pub = str(tmp_path / "pub")

    def check(node: str, secret: str, folder: str = pub) -> None:
        Config(runtime_dir=str(tmp_path / "run"), status_port=-1, node=node,
               peer_listen="tcp://127.0.0.1:9461" if node == "node0" else "",
               curve_secret_key=secret, peer_public_keys=folder, engines=[_entry()]).validate()

    check("node1", f"{pub}/node1.key_secret")
    with pytest.raises(ValueError, match="holds no secret key"):
        check("node1", f"{pub}/node1.key")
    with pytest.raises(ValueError, match="holds node node0's key pair"):
        check("node1", f"{pub}/node0.key_secret")
    only_own = tmp_path / "own"
    make_keys("node1", only_own)
    with pytest.raises(ValueError, match="no key of owner node"):
        check("node1", f"{only_own}/node1.key_secret", str(only_own))
    (tmp_path / "junk.key_secret").write_text("junk\n")
    with pytest.raises(ValueError, match="curve_secret_key"):
        check("node1", str(tmp_path / "junk.key_secret"))


def test_compared_keys_are_the_ones_the_docs_list():
    """Issue 35 (fresh-user trial): the docs said a table differing "in any key" is refused,
    but kind, pause_mode and the API key files are the owner's alone. The docs now list the
    compared keys and the owner's own; both lists must be what ``difference`` does."""
    import re
    from pathlib import Path

    assert tuple(k for k, _ in spans._KEYS) == spans.COMPARED_KEYS
    docs = Path(__file__).resolve().parents[2] / "docs"
    text = " ".join((docs / "configuration.md").read_text().split())
    listed = re.search(r"Compared keys: ((?:`\w+`(?:, )?)+)\.", text).group(1)
    assert tuple(re.findall(r"`(\w+)`", listed)) == spans.COMPARED_KEYS
    own = re.search(r"ignored on the other nodes\): ((?:`\w+`(?:, )?)+)\.", text).group(1)
    owners_alone = re.findall(r"`(\w+)`", own)
    assert set(owners_alone) == {"kind", "pause_mode", "api_key_file", "admin_api_key_file"}
    mine = [spans.span_engine(_entry())]
    for kw in ({"kind": "vllm"}, {"kind": "sglang", "pause_mode": "abort"},
               {"api_key_file": "/k"}, {"admin_api_key_file": "/a"}):
        assert spans.difference(mine, [spans.span_engine(_entry(**kw))], "node0", "node1") == ""
    for key, kw in (("url", {"url": "http://10.0.0.2:8000"}),
                    ("gpu_uuids", {"gpu_uuids": ("GPU-1",) * 8}),
                    ("nodes", {"parts": (SpanPart("node1", 0, 4), SpanPart("node0", 4, 8))}),
                    ("owner_address", {"owner_address": "tcp://10.0.0.9:9461"})):
        theirs = [spans.span_engine(_entry(**kw))]
        if key == "url":
            assert "does not declare" in spans.difference(mine, theirs, "node0", "node1")
            continue
        assert f"they differ in {key}" in spans.difference(mine, theirs, "node0", "node1")


def test_unequal_ranks_per_node_are_refused(keys):
    """README and multi-node.md §4: a slot over several nodes has the same number of ranks on
    each (vLLM --nnodes: world_size / nnodes workers per node)."""
    e = _entry(slot_size=5, parts=(SpanPart("node0", 0, 1), SpanPart("node1", 1, 5)))
    with pytest.raises(ValueError, match=r"unequal numbers of ranks \(node0 \[0, 1\), node1 "
                       r"\[1, 5\)\)"):
        spans.check_spanning([e], "node1", "", *keys)


def test_owner_address_port_must_be_peer_listens(keys):
    """--check-config on the owner checks owner_address as node1 will: a port where the owner
    does not listen is refused naming both; another host (0.0.0.0, NAT) is not."""
    with pytest.raises(ValueError, match="owner_address 'tcp://10.0.0.1:9461' is not this "
                       "owner's peer_listen 'tcp://10.0.0.1:9462'"):
        spans.check_spanning([_entry()], "node0", "tcp://10.0.0.1:9462", *keys)
    spans.check_spanning([_entry()], "node0", "tcp://0.0.0.0:9461", *keys)
    spans.check_spanning([_entry()], "node1", "tcp://10.0.0.2:9462", *keys)  # (not its owner)


def test_check_config_refuses_an_owner_without_a_peers_key(tmp_path, capsys):
    """The owner's peer_public_keys must hold each of its engines' nodes' <node>.key:
    --check-config names the missing file and `slotsync keys` (the daemon itself starts and
    refuses that node's link)."""
    from slotsync.daemon.service.config import load_config

    make_keys("node0", tmp_path / "own")
    f = tmp_path / "c.toml"
    f.write_text(f'node = "node0"\nruntime_dir = "{tmp_path}/run"\nstatus_port = -1\n'
                 'peer_listen = "tcp://127.0.0.1:9461"\n'
                 f'curve_secret_key = "{tmp_path}/own/node0.key_secret"\n'
                 f'peer_public_keys = "{tmp_path}/own"\n[[engines]]\n'
                 'url = "http://10.0.0.1:8000"\nslot_start = 0\nslot_size = 8\n'
                 'owner = "node0"\nowner_address = "tcp://10.0.0.1:9461"\n'
                 'nodes = [{node = "node0", ranks = [0, 4]}, {node = "node1", ranks = [4, 8]}]\n')
    cfg, check = load_config(["--config", str(f)])
    assert not check and cfg.missing_peer_keys()
    with pytest.raises(SystemExit) as exit_:
        load_config(["--config", str(f), "--check-config"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "node1.key missing" in err and "slotsync keys node1" in err
    make_keys("node1", tmp_path / "n1")
    (tmp_path / "own" / "node1.key").write_text((tmp_path / "n1" / "node1.key").read_text())
    load_config(["--config", str(f), "--check-config"])


def test_engine_key_types_and_garbage_key_files_are_named(tmp_path):
    """A wrong-typed key of [[engines]] is named with its type; a garbage key file points to
    `slotsync keys NODE`."""
    from slotsync.daemon.node_links.peer_keys import PeerKeyError, load_keys
    from slotsync.daemon.service.config import ConfigError

    f = tmp_path / "c.toml"
    f.write_text('[[engines]]\nurl = "http://10.0.0.1:8000"\nslot_start = 0\nslot_size = "4"\n')
    with pytest.raises(ConfigError, match=r"engines\[0\]: slot_size must be an integer, got "
                       r"'4' \(str\)"):
        read_config_file(f)
    make_keys("node0", tmp_path / "k")
    (tmp_path / "k" / "node1.key").write_text("garbage\n")
    with pytest.raises(PeerKeyError, match="node1.key: .*slotsync keys node1"):
        load_keys(str(tmp_path / "k" / "node0.key_secret"), str(tmp_path / "k"))
    (tmp_path / "bad.key_secret").write_text("garbage\n")
    with pytest.raises(PeerKeyError, match="slotsync keys NODE"):
        load_keys(str(tmp_path / "bad.key_secret"), str(tmp_path / "k"))

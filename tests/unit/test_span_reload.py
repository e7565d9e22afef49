"""A relaying node's daemon never drives the engine another node owns, at start or after a
SIGHUP, and engines over several nodes change only at a restart (issue 25 A;
``daemon/service/server.py``)."""

from __future__ import annotations

import logging

from two_nodes import node_config

from slotsync.daemon.node_links.peer_keys import make_keys
from slotsync.daemon.service.config import read_config_file
from slotsync.daemon.service.server import Daemon


def _daemon(tmp_path, node: str) -> Daemon:
    make_keys("node0", tmp_path / "keys")
    make_keys("node1", tmp_path / "keys")
    path = node_config(str(tmp_path), node, "http://127.0.0.1:8000", 4, 9461)
    cfg = read_config_file(__import__("pathlib").Path(path))
    cfg.runtime_dir = str(tmp_path / "run")
    cfg.status_port = -1
    cfg.validate()
    return Daemon(cfg)


def test_relaying_node_declares_no_slot_of_its_own_even_after_sighup(tmp_path, caplog):
    d = _daemon(tmp_path, "node1")
    assert d.table.declared == {} and set(d.roles.relayed) == {(0, 8)}
    d.reload()
    assert d.table.declared == {}
    owner = _daemon(tmp_path / "o", "node0")
    assert owner.table.declared == {(0, 8): "http://127.0.0.1:8000"}


def test_sighup_keeps_the_running_table_when_a_spanning_engine_changed(tmp_path, caplog):
    d = _daemon(tmp_path, "node0")
    path = d.config.config_file
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:  # node1 now [0, 4), node0 [4, 8)
        f.write(text.replace('node = "node0", ranks', 'node = "X", ranks')
                .replace('node = "node1", ranks', 'node = "node0", ranks')
                .replace('node = "X", ranks', 'node = "node1", ranks'))
    with caplog.at_level(logging.ERROR, logger="slotsync.daemon"):
        d.reload()
    (record,) = [r for r in caplog.records if r.getMessage() == "reload_failed"]
    assert "change only at a restart" in record.slotsync_fields["error"]
    assert [(p.node, p.end) for p in d.roles.owned[(0, 8)].parts] == [("node0", 4),
                                                                       ("node1", 8)]

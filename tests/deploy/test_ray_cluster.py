"""``deploy/ray/start_node_daemons.py`` for real (issue 25 F): a local two-node Ray cluster
(``ray.cluster_utils.Cluster``, CPU) whose two nodes' daemons, started by the module with the
keys it made and the engine tables it wrote, carry one round after another from trainer
ranks on both nodes into one reference engine; then every daemon is stopped.

The cluster runs in ``tests/deploy/ray_cluster_round.py``, inside a fresh network, PID and
mount namespace (``unshare -n -p -f -m --mount-proc``, loopback up): Ray, the daemons, the
peer link and the engine bind loopback only (Ray's probe for its own address finds no route
out of the namespace and falls back), and whatever is left running ends with the namespace.
It needs root (CI runs as root).

Skipped with the reason when Ray is not installed or no namespace can be made, except under
``SLOTSYNC_REQUIRE_RAY=1``, where that is a failure."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BODY = ROOT / "tests" / "deploy" / "ray_cluster_round.py"
RAY_DIR = ROOT / "deploy" / "ray"
NAMESPACES = ["unshare", "-n", "-p", "-f", "-m", "--mount-proc"]

pytestmark = pytest.mark.slow


def _cannot(why: str) -> None:
    if os.environ.get("SLOTSYNC_REQUIRE_RAY") == "1":
        pytest.fail(f"SLOTSYNC_REQUIRE_RAY=1, but {why}")
    pytest.skip(why)


def _need_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        _cannot("ray is not installed (pip install ray; not a slotsync dependency)")


def _need_namespaces() -> None:
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            _cannot(f"{tool} is not installed (Debian: util-linux, iproute2)")
    r = subprocess.run([*NAMESPACES, "sh", "-c", "ip link set lo up"], capture_output=True,
                       text=True, timeout=30)
    if r.returncode != 0:
        _cannot(f"cannot make a network namespace (needs root): {r.stderr.strip()}")


def _snd():
    """``deploy/ray/start_node_daemons.py`` as a module."""
    _need_ray()
    sys.path.insert(0, str(RAY_DIR))
    try:
        import start_node_daemons
    finally:
        sys.path.remove(str(RAY_DIR))
    return start_node_daemons


def test_engine_tables_name_ray_nodes_and_fill_in_the_owners_address():
    snd = _snd()
    a, b = "a" * 56, "b" * 56
    tables = snd.engine_tables(
        [{"url": "http://127.0.0.1:8000", "slot_start": 0, "slot_size": 4, "owner": a,
          "nodes": [{"node": a, "ranks": [0, 2]}, {"node": b, "ranks": [2, 4]}]},
         {"url": "http://127.0.0.1:8001", "slot_start": 4, "slot_size": 2, "node": b}],
        {a: "tcp://10.0.0.1:9461"})
    assert set(tables) == {a, b}
    spanning = ('owner = "ray-aaaaaaaaaaaaaaaa"\nowner_address = "tcp://10.0.0.1:9461"\n'
                'nodes = [{node = "ray-aaaaaaaaaaaaaaaa", ranks = [0, 2]}, '
                '{node = "ray-bbbbbbbbbbbbbbbb", ranks = [2, 4]}]\n')
    assert spanning in tables[a] and spanning in tables[b]
    assert "8001" not in tables[a] and "8001" in tables[b]  # one node's engine: its table only
    assert snd.spanning_nodes([{"owner": a, "nodes": [{"node": a}, {"node": b}]}]) == (
        {a, b}, {a})
    with pytest.raises(ValueError, match="owner 'c' is not one of its nodes"):
        snd.engine_tables([{"url": "u", "slot_start": 0, "slot_size": 2, "owner": "c",
                            "nodes": [{"node": a, "ranks": [0, 1]}]}], {"c": "tcp://x:1"})
    with pytest.raises(ValueError, match="give its node"):
        snd.engine_tables([{"url": "u", "slot_start": 0, "slot_size": 2}], {})


def test_ray_cluster_round_through_both_nodes_daemons(tmp_path):
    snd = _snd()
    _need_namespaces()
    report_path = tmp_path / "report.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(RAY_DIR), *filter(None, [env.get("PYTHONPATH")])])
    env["RAY_DEDUP_LOGS"] = "0"
    proc = subprocess.run(
        [*NAMESPACES, "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
         str(BODY), str(report_path)],
        env=env, capture_output=True, text=True, timeout=420)
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    where = (f"exit {proc.returncode}; steps {report.get('steps')}\n{report.get('error', '')}"
             f"\n{json.dumps(report.get('daemon_logs', {}), indent=1)}\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0 and "error" not in report, where
    assert report["steps"] == ["cluster", "daemons", "link", "ranks", "checksums", "stopped"]

    # Two Ray nodes, on loopback only.
    head, nodes = report["head"], report["nodes"]
    (other,) = set(nodes) - {head}
    assert report["addresses"] == ["127.0.0.1"]
    names = {n: snd.node_name(n) for n in nodes}

    # One daemon per node, each with its own key pair and the engine table naming the owner's
    # address; the owner listens there.
    infos, configs = report["infos"], report["configs"]
    assert set(infos) == set(nodes)
    for n in nodes:
        assert infos[n]["node"] == names[n] and infos[n]["endpoint"] == snd.endpoint_for_node(n)
        assert f'curve_secret_key = "{snd.runtime_dir_for_node(n)}/keys/{names[n]}.key_secret"' \
            in configs[n]
    listen = configs[head].split('peer_listen = "', 1)[1].split('"', 1)[0]
    assert listen.startswith("tcp://127.0.0.1:") and "peer_listen" not in configs[other]
    for n in nodes:
        assert f'owner = "{names[head]}"\nowner_address = "{listen}"' in configs[n]

    # Ranks 0, 1 on the head node, 2, 3 on the other, each publishing to its own node's
    # daemon, found from its Ray node id; every round ok.
    for r in report["ranks"]:
        assert r["node_id"] == (head if r["rank"] < 2 else other), r
        assert r["endpoint"] == snd.endpoint_for_node(r["node_id"])
        assert [x.get("round") for x in r["rounds"]] == [1, 2], r
        assert all(x["chunks"] >= 2 for x in r["rounds"]), r

    # Every worker of the one engine holds the last round's tensors; it serves again.
    assert report["checksum_status"] == 200
    assert report["workers"] == 4 and report["workers_equal"] == [True] * 4
    assert report["weight_version"] == "v2" and report["engine_paused"] is False

    # The owner drove both rounds, with the other node's ranks relayed over the link.
    (slot,) = report["owner_status"]["slots"]
    assert slot["slot"] == [0, 4] and slot["state"] == "idle"
    assert slot["updates_succeeded"] == 2 and slot["driven_by"] == names[head]
    assert sorted((x["rank"], x["node"]) for x in slot["ranks"]) == [
        (0, names[head]), (1, names[head]), (2, names[other]), (3, names[other])]
    (link,) = report["owner_status"]["peers"]["links"]
    assert link["node"] == names[other] and link["up"] and link["messages_in"] > 0
    (relayed,) = report["relay_status"]["relayed_slots"]
    assert relayed["slot"] == [0, 4] and relayed["driven_by"] == names[head]
    assert relayed["owner_address"] == listen
    (link,) = report["relay_status"]["peers"]["links"]
    assert link["node"] == names[head] and link["up"] and link["rtt_ms"] is not None

    # stop_node_daemons: every daemon exited 0 (SIGTERM, graceful), its keys removed.
    assert report["exit_codes"] == {n: 0 for n in nodes}
    assert report["daemons_gone"] is True and report["keys_left"] == []

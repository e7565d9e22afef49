"""``deploy/kubernetes/daemonset.yaml`` (issue 25 F): slotsyncd on every node as two
DaemonSets (the owner node's, and every other node's), the engine table in a ConfigMap, the
keys in a Secret, the owner's address through a headless Service.

Parsed with PyYAML (a dev dependency; skipped without it). The ConfigMap's configuration is
loaded by the daemon's own ``load_config`` with each pod's environment, as the pods would
start it, with the key folder pointed at keys ``make_keys`` made."""

from __future__ import annotations

import copy
import os
import re
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"


def _docs() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def _daemonsets() -> tuple[dict, dict]:
    docs = _docs()
    return docs["DaemonSet", "slotsyncd-owner"], docs["DaemonSet", "slotsyncd"]


def _container(ds: dict) -> dict:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


def _env(ds: dict) -> dict[str, dict]:
    return {e["name"]: e for e in _container(ds)["env"]}


def _pod_env(ds: dict, node: str, pod_ip: str) -> dict[str, str]:
    """The container's environment as the kubelet sets it on ``node``: fieldRefs filled in,
    ``$(VAR)`` expanded from the variables listed before it (Kubernetes' rule)."""
    fields = {"spec.nodeName": node, "status.podIP": pod_ip}
    out: dict[str, str] = {}
    for e in _container(ds)["env"]:
        if "valueFrom" in e:
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out[m.group(1)], e["value"])
    return out


def test_the_manifest_holds_a_configmap_a_headless_service_and_two_daemonsets():
    assert set(_docs()) == {("ConfigMap", "slotsyncd-config"), ("Service", "slotsync-owner"),
                            ("DaemonSet", "slotsyncd-owner"), ("DaemonSet", "slotsyncd")}
    assert {d["metadata"]["namespace"] for d in _docs().values()} == {"slotsync"}


def test_both_daemonsets_run_the_same_pod_but_for_the_owners_listener_and_placement():
    owner, relay = (copy.deepcopy(ds["spec"]["template"]) for ds in _daemonsets())
    # What differs: the component label, the placement, and the owner's peer listener.
    assert owner["metadata"]["labels"].pop("app.kubernetes.io/component") == "owner"
    assert relay["metadata"]["labels"].pop("app.kubernetes.io/component") == "relay"
    assert owner["spec"].pop("nodeSelector") == {"slotsync.io/owner": "true"}
    (term,) = relay["spec"].pop("affinity")["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "slotsync.io/owner", "operator": "DoesNotExist"} in term["matchExpressions"]
    assert {"key": "slotsync.io/node", "operator": "In", "values": ["true"]} in \
        term["matchExpressions"]
    oc = owner["spec"]["containers"][0]
    assert [e["name"] for e in oc["env"]] == [
        "SLOTSYNC_NODE", "SLOTSYNC_CURVE_SECRET_KEY", "POD_IP", "SLOTSYNC_PEER_LISTEN"]
    oc["env"] = oc["env"][:2]
    assert {"name": "peer", "containerPort": 9461} in oc["ports"]
    oc["ports"] = [p for p in oc["ports"] if p["name"] != "peer"]
    assert owner == relay
    for ds in _daemonsets():  # each DaemonSet selects its own pods
        assert ds["spec"]["selector"]["matchLabels"] == ds["spec"]["template"]["metadata"][
            "labels"]


def test_the_pod_shares_the_socket_folder_and_mounts_config_and_keys_read_only():
    for ds in _daemonsets():
        spec = ds["spec"]["template"]["spec"]
        c = _container(ds)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        # The socket folder is the host's, for the trainer pods to mount too.
        assert volumes["socket-folder"]["hostPath"]["path"] == "/run/slotsync"
        assert mounts["socket-folder"]["mountPath"] == "/run/slotsync"
        assert volumes["state-folder"]["hostPath"]["path"] == "/var/lib/slotsync"
        # Keys: the Secret, read-only, not world-readable; config: the ConfigMap as a folder
        # (a subPath mount would never see an edited ConfigMap).
        assert volumes["keys"]["secret"]["secretName"] == "slotsync-keys"
        assert volumes["keys"]["secret"]["defaultMode"] & 0o007 == 0
        assert mounts["keys"] == {"name": "keys", "mountPath": "/etc/slotsync/keys",
                                  "readOnly": True}
        assert volumes["config"]["configMap"]["name"] == "slotsyncd-config"
        assert mounts["config"]["readOnly"] is True and "subPath" not in mounts["config"]
        assert c["command"] == ["slotsyncd", "--config",
                                mounts["config"]["mountPath"] + "/slotsyncd.toml"]
        # Node-level networking and pids; a daemon with no privileges of its own.
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert spec["hostPID"] is True
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
        uid = spec["securityContext"]["runAsUser"]
        (init,) = spec["initContainers"]
        assert f"chown {uid}:{spec['securityContext']['runAsGroup']} /run/slotsync" in \
            init["command"][-1]
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                           "add": ["CHOWN", "FOWNER"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": "status"}
        assert {"name": "status", "containerPort": 9460} in c["ports"]
        assert spec["terminationGracePeriodSeconds"] > 60  # > shutdown_grace_s
        assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"


def test_the_service_resolves_to_the_owner_pod_at_the_engine_tables_owner_address():
    from slotsync.daemon.node_links import spans

    docs = _docs()
    svc = docs["Service", "slotsync-owner"]
    owner, relay = _daemonsets()
    assert svc["spec"]["clusterIP"] == "None"  # headless: the name is the pod's (node's) IP
    selector = svc["spec"]["selector"].items()
    assert selector <= owner["spec"]["template"]["metadata"]["labels"].items()
    assert not selector <= relay["spec"]["template"]["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    listen = _pod_env(owner, "gpu-node-0", "10.0.0.1")["SLOTSYNC_PEER_LISTEN"]
    assert listen == f"tcp://10.0.0.1:{port['targetPort']}"
    table = docs["ConfigMap", "slotsyncd-config"]["data"]["slotsyncd.toml"]
    (engine,) = tomllib.loads(table)["engines"]
    host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert engine["owner_address"] == f"tcp://{host}:{port['port']}"
    spans.check_tcp_address(engine["owner_address"], "owner_address")


def test_each_pods_daemon_accepts_the_configmap_as_the_pod_would_start(tmp_path, monkeypatch):
    """The ConfigMap's file with each pod's environment (the node name from the downward
    API, its key pair's path, the owner's listener): ``load_config`` accepts it on the owner
    node and on the other node, which own and relay the engine."""
    from slotsync.daemon.node_links import spans
    from slotsync.daemon.node_links.peer_keys import load_keys, make_keys
    from slotsync.daemon.service.config import load_config

    for k in list(os.environ):
        if k.startswith("SLOTSYNC_"):
            monkeypatch.delenv(k)
    docs = _docs()
    text = docs["ConfigMap", "slotsyncd-config"]["data"]["slotsyncd.toml"]
    keys = tmp_path / "keys"  # as `kubectl create secret generic --from-file=keys/` mounts it
    (engine,) = tomllib.loads(text)["engines"]
    nodes = [n["node"] for n in engine["nodes"]]
    assert engine["owner"] == nodes[0]
    for n in nodes:
        make_keys(n, keys)
    for folder in ("/run/slotsync", "/var/lib/slotsync", "/etc/slotsync/keys"):
        assert f'"{folder}"' in text
    (tmp_path / "run").mkdir()
    (tmp_path / "state").mkdir()
    local = (text.replace('"/run/slotsync"', f'"{tmp_path}/run"')
             .replace('"/var/lib/slotsync"', f'"{tmp_path}/state"')
             .replace('"/etc/slotsync/keys"', f'"{keys}"'))
    config = tmp_path / "slotsyncd.toml"
    config.write_text(local)
    owner, relay = _daemonsets()
    for node, ds in ((nodes[0], owner), (nodes[1], relay)):
        env = {k: v.replace("/etc/slotsync/keys", str(keys))
               for k, v in _pod_env(ds, node, "127.0.0.1").items()}
        cfg, _ = load_config(["--config", str(config)], environ=env)
        assert cfg.node_name() == node
        assert cfg.curve_secret_key == f"{keys}/{node}.key_secret"
        assert set(load_keys(cfg.curve_secret_key, cfg.peer_public_keys).peers.values()) == \
            set(nodes)
        roles = spans.roles(cfg.engines, node)
        if ds is owner:
            assert cfg.peer_listen == "tcp://127.0.0.1:9461"
            assert set(roles.owned) == {(0, 16)} and roles.peers_of_owned() == set(nodes[1:])
        else:
            assert cfg.peer_listen == ""
            assert set(roles.relayed) == {(0, 16)}
            assert roles.relayed[0, 16].owner == nodes[0]
    # The trainer pods' uid must be allowed; status reachable by the kubelet's probes.
    assert re.search(r'^allow_uids = "\d+"$', text, re.M)
    assert re.search(r'^status_host = "0.0.0.0"$', text, re.M)

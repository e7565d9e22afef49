"""The deployment files in ``deploy/``: systemd unit, sysusers entry, example config,
Kubernetes pod, Ray example.

``systemd-analyze verify`` and ``systemd-sysusers`` skip with a reason when missing (CI installs
the Debian package ``systemd``); the pod test needs PyYAML.

How the unit is verified unchanged: ``systemd-analyze verify --root=DIR`` resolves every path
under DIR, so the test builds a small root holding the unit byte-for-byte at
``/etc/systemd/system/slotsyncd.service``, a copy of the host's ``/usr/lib/systemd/system``
(for ``multi-user.target``, ``sysinit.target``, ... that the unit's dependencies name) and an
executable stub at each absolute ``Exec*=`` path (``/opt/slotsync/bin/slotsyncd``,
``/bin/kill``). Nothing in the unit is substituted. ``User=`` is not checked by ``verify``;
the sysusers test creates that account in a root of its own.
"""

from __future__ import annotations

import os
import py_compile
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "slotsyncd.service"
UNIT_LIB = Path("/usr/lib/systemd/system")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian: apt-get install systemd)")
    return path


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}``; systemd keys may repeat, so no configparser."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def _unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def _one(section: str, key: str) -> str:
    values = _unit()[section].get(key)
    assert values is not None, f"[{section}] {key}= missing"
    return values[-1]


def _verify_root(tmp_path: Path, unit_text: str) -> Path:
    if not UNIT_LIB.is_dir():
        pytest.skip(f"{UNIT_LIB} missing: no systemd unit library to verify against")
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/slotsyncd.service").write_text(unit_text)
    shutil.copytree(UNIT_LIB, root / UNIT_LIB.relative_to("/"), symlinks=True)
    for key, values in parse_unit(unit_text)["Service"].items():
        if key.startswith("Exec"):
            for v in values:
                exe = Path(v.lstrip("-@:+!").split()[0])
                stub = root / exe.relative_to("/")
                stub.parent.mkdir(parents=True, exist_ok=True)
                stub.write_text("#!/bin/sh\nexit 0\n")
                stub.chmod(0o755)
    return root


def _verify(tmp_path: Path, unit_text: str) -> subprocess.CompletedProcess:
    root = _verify_root(tmp_path, unit_text)
    return subprocess.run(
        [_tool("systemd-analyze"), "verify", f"--root={root}", "slotsyncd.service"],
        capture_output=True, text=True, timeout=60,
    )


# ---------------------------------------------------------------------------- systemd unit


def test_unit_passes_systemd_analyze_verify(tmp_path):
    r = _verify(tmp_path, UNIT.read_text())
    # verify exits 0 even for unknown keys or unparsable values (it logs and ignores them):
    # clean means no output at all.
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_verify_would_catch_a_broken_line(tmp_path):
    """The check above is meaningful: a misspelt key and a bad value do produce output."""
    broken = UNIT.read_text().replace("WatchdogSec=30", "WatchdogSecs=30").replace(
        "ProtectSystem=strict", "ProtectSystem=very")
    r = _verify(tmp_path, broken)
    out = r.stdout + r.stderr
    assert "WatchdogSecs" in out and "protect system" in out.lower(), out


def test_unit_settings():
    """What the daemon relies on (docs/operations.md explains each)."""
    want = {
        "Type": "notify",
        "NotifyAccess": "main",
        "WatchdogSec": "30",
        "RuntimeDirectory": "slotsync",
        "RuntimeDirectoryMode": "0770",
        "UMask": "0007",
        "User": "slotsync",
        "Group": "slotsync",
        "DynamicUser": "no",
        "ExecStart": "/opt/slotsync/bin/slotsyncd --config /etc/slotsync/slotsyncd.toml",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "KillSignal": "SIGTERM",
        "Restart": "on-failure",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "SystemCallFilter": "@system-service",
        "CapabilityBoundingSet": "",
    }
    got = {k: _one("Service", k) for k in want}
    assert got == want
    assert _unit()["Install"]["WantedBy"] == ["multi-user.target"]


def test_stop_timeout_exceeds_the_daemons_shutdown_grace():
    from slotsync.daemon.service.config import Config

    grace = getattr(Config(), "shutdown_grace_s", 60.0)
    example = tomllib.loads((DEPLOY / "slotsyncd.toml").read_text()).get("shutdown_grace_s", 0)
    stop = float(_one("Service", "TimeoutStopSec"))
    # Room for the grace plus closing sockets and sessions, else systemd SIGKILLs mid-update.
    assert stop >= max(grace, example) + 10, (stop, grace, example)
    # The watchdog is pinged every WatchdogSec/2 from the event loop; a ping interval under
    # a second would be busy work.
    assert float(_one("Service", "WatchdogSec")) >= 2


def test_sysusers_entry_creates_the_service_account(tmp_path):
    tool = _tool("systemd-sysusers")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "usr/lib/sysusers.d").mkdir(parents=True)
    shutil.copy(DEPLOY / "slotsync.sysusers", root / "usr/lib/sysusers.d/slotsync.conf")
    r = subprocess.run([tool, f"--root={root}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    def table(name: str) -> dict[str, list[str]]:
        rows = (root / "etc" / name).read_text().splitlines()
        return {row.split(":")[0]: row.split(":") for row in rows}

    users, groups = table("passwd"), table("group")
    assert users["slotsync"][3] == groups["slotsync"][2]  # primary group slotsync
    assert users["slotsync"][6] == "/usr/sbin/nologin"


def test_daemon_runs_under_memory_deny_write_execute(tmp_path):
    """``MemoryDenyWriteExecute=yes`` cannot be tried without a running systemd, so apply the
    kernel's equivalent (``prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN)``, Linux >= 6.3,
    inherited across exec) to a daemon process and check that it starts and serves, and that
    it keeps no writable+executable or anonymous executable mapping (JIT or libffi closures)."""
    import json
    import urllib.request

    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    wrapper = (
        "import ctypes, os, sys\n"
        "if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:\n"
        "    sys.exit(77)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'slotsync.daemon', *sys.argv[1:]])\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper, "--runtime-dir", str(tmp_path), "--status-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        if proc.poll() == 77:
            pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3)")
        assert line.startswith("slotsyncd ready"), line + proc.stderr.read()
        port = int(dict(kv.split("=", 1) for kv in line.split()[2:])["status_port"])
        base = f"http://127.0.0.1:{port}"
        for path in ("/healthz", "/status"):
            with urllib.request.urlopen(base + path, timeout=10) as r:
                json.loads(r.read())
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            assert b"slotsync_build_info" in r.read()
        with open(f"/proc/{proc.pid}/status") as f:
            # Kernels >= 6.3 do not show MDWE here; the exec'd process still has it.
            assert "State" in f.read()
        for row in Path(f"/proc/{proc.pid}/maps").read_text().splitlines():
            cols = row.split()
            perms = cols[1]
            assert not ("w" in perms and "x" in perms), row
            assert not ("x" in perms and len(cols) < 6), row  # anonymous executable memory
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0, proc.returncode


# ---------------------------------------------------------------------------- example config


def _load(path: Path):
    from slotsync.daemon.service.config import load_config

    res = load_config(["--config", str(path)])
    return res[0] if isinstance(res, tuple) else res  # (config, check_only) or config


def test_example_config_loads_and_matches_the_unit(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SLOTSYNC_"):
            monkeypatch.delenv(k)
    cfg = _load(DEPLOY / "slotsyncd.toml")
    assert cfg.runtime_dir == "/run/" + _one("Service", "RuntimeDirectory")
    if hasattr(cfg, "state_dir"):  # must survive restarts: the StateDirectory, not /run
        assert cfg.state_dir == "/var/lib/" + _one("Service", "StateDirectory")
    assert cfg.endpoint() == "ipc:///run/slotsync/slotsyncd.sock"
    assert "/etc/slotsync/slotsyncd.toml" in _one("Service", "ExecStart")


def test_example_config_lists_every_option():
    """Every option of ``Config`` appears in the example, set or commented out."""
    from dataclasses import fields

    from slotsync.daemon.service.config import Config

    text = (DEPLOY / "slotsyncd.toml").read_text()
    internal = {"config_file", "sources"}  # set by the loader, not options
    missing = [
        f.name for f in fields(Config)
        if f.name not in internal
        and not re.search(rf"^#?\s*(\[\[)?{f.name}(\]\])?\s*(=|$)", text, re.M)
    ]
    assert not missing, f"deploy/slotsyncd.toml does not mention {missing}"


def _commented_block(text: str, first_line: str) -> tuple[int, int]:
    """``(start, end)`` of the commented-out lines from ``first_line`` to the next line that
    is not a comment (the end of the file or a blank line)."""
    start = text.index(first_line)
    end = text.find("\n\n", start)
    return start, len(text) if end < 0 else end + 1


def _uncomment(text: str, *blocks: tuple[int, int]) -> str:
    """``text`` with the lines of ``blocks`` uncommented where they are ``# key = value`` or
    ``# [[engines]]`` lines (prose comments stay comments)."""
    out, at = [], 0
    for start, end in sorted(blocks):
        out.append(text[at:start])
        out.append("\n".join(
            ln.removeprefix("# ") if re.match(r"^# (\[\[engines\]\]$|\w+ = |  |\])", ln) else ln
            for ln in text[start:end].split("\n")))
        at = end
    return "".join(out) + text[at:]


def _clean_env(monkeypatch) -> None:
    for k in list(os.environ):
        if k.startswith("SLOTSYNC_"):
            monkeypatch.delenv(k)


def test_example_engine_table_parses_when_uncommented(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    text = (DEPLOY / "slotsyncd.toml").read_text()
    p = tmp_path / "with-engines.toml"
    p.write_text(_uncomment(text, _commented_block(text, "# [[engines]]")))
    cfg = _load(p)
    if not hasattr(cfg, "engines"):
        pytest.skip("this daemon has no engine table")
    assert [(e.url, e.slot_start, e.slot_size) for e in cfg.engines] == [
        ("http://127.0.0.1:8000", 0, 8)]
    uuids = getattr(cfg.engines[0], "gpu_uuids", None)
    if uuids is not None:  # normalised to torch's format (no GPU- prefix)
        assert len(uuids) == 8 and not any(u.startswith("GPU-") for u in uuids)


def test_example_engine_over_two_nodes_parses_on_both_nodes_when_uncommented(tmp_path,
                                                                             monkeypatch,
                                                                             capsys):
    """The example's engine over several nodes, with its four peer-link options uncommented
    (key paths pointed at keys made by ``slotsync keys``' ``make_keys``): both nodes' daemons
    accept it, node0 owns the engine and node1 relays to node0's peer_listen, and the two
    declarations have no difference (the owner would refuse one that has)."""
    from slotsync.daemon.node_links import spans
    from slotsync.daemon.node_links.peer_keys import load_keys, make_keys

    _clean_env(monkeypatch)
    text = (DEPLOY / "slotsyncd.toml").read_text()
    peer = _commented_block(text, '# node = "node0"')
    engines = [m.start() for m in re.finditer(r"^# \[\[engines\]\]$", text, re.M)]
    assert len(engines) == 2, "the example has a one-node and a multi-node engine table"
    spanning = _commented_block(text[engines[1]:], "# [[engines]]")
    spanning = (engines[1] + spanning[0], engines[1] + spanning[1])
    keys = tmp_path / "keys"
    for node in ("node0", "node1"):
        make_keys(node, keys)
    (keys / "public").mkdir()
    for node in ("node0", "node1"):
        (keys / f"{node}.key").rename(keys / "public" / f"{node}.key")
    configured = _uncomment(text, peer, spanning).replace("/etc/slotsync/keys", str(keys))
    cfgs = {}
    for node in ("node0", "node1"):
        mine = re.sub(r'^node = "node0"$', f'node = "{node}"', configured, flags=re.M).replace(
            "node0.key_secret", f"{node}.key_secret")
        if node != "node0":  # peer_listen is the owner's
            mine = re.sub(r"^peer_listen = .*$", "", mine, flags=re.M)
        p = tmp_path / f"{node}.toml"
        p.write_text(mine)
        cfgs[node] = _load(p)
        assert cfgs[node].node_name() == node
        load_keys(cfgs[node].curve_secret_key, cfgs[node].peer_public_keys)  # as at start
    (e0,), (e1,) = cfgs["node0"].engines, cfgs["node1"].engines
    assert e0 == e1
    assert (e0.url, e0.slot_start, e0.slot_size) == ("http://127.0.0.1:8000", 0, 16)
    assert e0.owner == "node0" and e0.owner_address == cfgs["node0"].peer_listen
    assert [(p.node, p.start, p.end) for p in e0.parts] == [("node0", 0, 8), ("node1", 8, 16)]
    assert cfgs["node1"].peer_listen == ""
    owner = spans.roles(cfgs["node0"].engines, "node0")
    relay = spans.roles(cfgs["node1"].engines, "node1")
    assert set(owner.owned) == {(0, 16)} and not owner.relayed
    assert owner.peers_of_owned() == {"node1"}
    assert relay.owners() == {"node0": (e0.owner_address, [spans.span_engine(e1)])}
    assert spans.difference(list(owner.owned.values()), [spans.span_engine(e1)], "node0",
                            "node1") == ""
    # Both examples are alternatives: each alone is a valid table, the two overlap.
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _load_text(tmp_path, _uncomment(configured, _commented_block(configured,
                                                                       "# [[engines]]")))
    assert "overlaps slot [0, 8)" in capsys.readouterr().err


def _load_text(tmp_path: Path, text: str):
    p = tmp_path / "both.toml"
    p.write_text(text)
    return _load(p)


# ---------------------------------------------------------------------------- sidecar, Ray


def test_kubernetes_pod_sidecar_layout():
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "pod.yaml").read_text()))
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    spec = pod["spec"]
    sidecars = {c["name"]: c for c in spec.get("initContainers", [])}
    main = {c["name"]: c for c in spec["containers"]}
    assert set(main) == {"trainer", "vllm"} and set(sidecars) == {"slotsyncd"}
    daemon = sidecars["slotsyncd"]
    assert daemon["restartPolicy"] == "Always"  # a native sidecar
    (vol,) = [v for v in spec["volumes"] if v["name"] == "slotsync-run"]
    assert vol["emptyDir"]["medium"] == "Memory"
    for c in (daemon, main["trainer"]):
        assert {"name": "slotsync-run", "mountPath": "/run/slotsync"} in c["volumeMounts"]
    assert "slotsync-run" not in str(main["vllm"].get("volumeMounts", []))
    assert spec["hostIPC"] is True and spec["shareProcessNamespace"] is True
    # Probes on the daemon's status port, which it binds on the pod's address.
    (port,) = daemon["ports"]
    assert "--status-port=9460" in daemon["args"] and port["containerPort"] == 9460
    assert "--status-host=0.0.0.0" in daemon["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert daemon[probe]["httpGet"]["path"] == "/healthz"
        assert daemon[probe]["httpGet"]["port"] in (9460, port["name"])
    # vLLM with the three switches; both GPU containers share one GPU claim, the daemon none.
    env = {e["name"]: e["value"] for e in main["vllm"]["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert '--weight-transfer-config={"backend":"ipc"}' in main["vllm"]["args"]
    claims = [c["resources"]["claims"] for c in (main["trainer"], main["vllm"])]
    assert claims[0] == claims[1] == [{"name": "gpus"}]
    assert "claims" not in daemon.get("resources", {})
    assert spec["terminationGracePeriodSeconds"] > 60  # > the daemon's shutdown grace


def test_ray_example_is_valid_python(tmp_path):
    src = DEPLOY / "ray" / "start_node_daemons.py"
    py_compile.compile(str(src), cfile=str(tmp_path / "x.pyc"), doraise=True)
    text = src.read_text()
    for needle in ("NodeAffinitySchedulingStrategy(node_id, soft=False)", "get_if_exists=True",
                   'f"slotsyncd-{node_id}"', "get_runtime_context().get_node_id()"):
        assert needle in text, needle

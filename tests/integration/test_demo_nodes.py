"""``slotsync demo --nodes 2`` (issue 35, beyond the list): the two-node walkthrough on CPU in
one command -- a daemon per node (network namespaces joined by a veth pair as root, else
loopback), CURVE keys made in the demo's folder, one engine whose workers span both nodes,
driven by node0's daemon while node1's relays its ranks; every round's engine checksums
equal the trainers', and nothing is left behind: no namespace, folder, process or
shared-memory segment, also after SIGTERM mid-run."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from marked_runs import MarkedRun  # noqa: E402

from slotsync.demo import find_default_model  # noqa: E402

pytestmark = pytest.mark.slow
NETNS_DIR = "/run/netns"


def _netns_problem() -> str:
    """Why this test process cannot make network namespaces ('' when it can)."""
    import shutil

    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()})"
    return "" if shutil.which("ip") else "no ip command"


def _needs_netns() -> None:
    why = _netns_problem()
    if why:
        pytest.skip(f"network namespaces cannot be made here: {why}")


def _demo_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "slotsync", "demo", "--nodes", "2", "--ranks", "2",
            "--device", "cpu", *args]


def _folder_and_namespaces(out: str) -> tuple[str, list[str]]:
    """The demo's folder and its namespaces, as its progress lines name them."""
    folder = re.search(r"keys: a CURVE key pair per node in (\S+)/keys/", out)
    assert folder, out
    names = re.search(r"nodes: network namespaces (\S+) \(10\.0\.0\.1\) and (\S+) "
                      r"\(10\.0\.0\.2\), joined by a veth pair", out)
    return folder.group(1), list(names.groups()) if names else []


def _check_rounds(out: str, rounds: int) -> None:
    """Every round verified on both workers, node1's rank relayed over an up link."""
    for k in range(1, rounds + 1):
        assert re.search(rf"^  round {k}/{rounds}: .*; checksums match on 2 workers "
                         rf"\(\d+ tensors\), version 'demo-round-{k}'$", out, re.M), out
    assert "one engine slot over 2 nodes (node0: ranks [0, 1), node1: [1, 2))" in out
    assert "daemon node1 (relays its ranks to node0 at tcp://" in out
    assert "peer link node1 -> node0 up (CURVE)" in out
    assert (f"node0's daemon: slot [0, 2) state idle, updates ok {rounds}, failed 0; ranks by "
            "node: node0 [0], node1 [1]") in out, out
    assert re.search(r"node1's daemon: peer link to node0 \(drives for us\) up, messages "
                     r"in/out [1-9]\d*/[1-9]\d*", out), out
    assert f"'default' -> 'demo-round-{rounds}'" in out
    assert out.rstrip().endswith("slotsync demo OK: every round's engine checksums equal the "
                                 "trainers'"), out[-2000:]


def _check_nothing_left(run: MarkedRun, folder: str, namespaces: list[str]) -> None:
    assert run.wait_gone(30) == [], "processes of the demo still run"
    assert not os.path.exists(folder), f"the demo left its folder {folder}"
    for name in namespaces:
        assert not os.path.exists(os.path.join(NETNS_DIR, name)), f"namespace {name} left"
    left = [p for pid in run.seen for p in glob.glob(f"/dev/shm/slotsync-{pid}-*")]
    assert not left, f"shared memory left: {left}"


@pytest.mark.parametrize("net", ["netns", "loopback"])
def test_demo_over_two_nodes_verifies_every_round_and_leaves_nothing(net):
    """``slotsync demo --nodes 2`` from the command line, both forms: exit 0, each round's
    checksums equal on both workers, node1's rank relayed; no namespace, folder, process or
    segment left."""
    find_default_model()
    if net == "netns":
        _needs_netns()
    run = MarkedRun(_demo_argv("--rounds", "2", "--nodes-net", net))
    try:
        rc, out, err = run.finish(600)
        assert rc == 0, out[-4000:] + err[-3000:]
        assert "Traceback" not in out + err, err[-3000:]
        _check_rounds(out, 2)
        folder, namespaces = _folder_and_namespaces(out)
        assert len(namespaces) == (2 if net == "netns" else 0), out
        if net == "loopback":
            assert "nodes: two daemons on this machine's loopback (127.0.0.1)" in out
        _check_nothing_left(run, folder, namespaces)
    finally:
        run.kill_all()


def test_demo_over_two_nodes_cleans_up_after_sigterm_mid_run():
    """``timeout``/``kill`` (SIGTERM) while the rounds run: the demo unwinds -- ranks,
    engine, both daemons stopped, the namespaces (as root) and the folder removed, no
    segment of its ranks left -- and exits 143 without a traceback."""
    find_default_model()
    net = "loopback" if _netns_problem() else "netns"
    run = MarkedRun(_demo_argv("--rounds", "500", "--nodes-net", net))
    try:
        out = run.wait_for(lambda o: "round 1/500" in o, 300)
        folder, namespaces = _folder_and_namespaces(out)
        assert os.path.isdir(folder)
        assert all(os.path.exists(os.path.join(NETNS_DIR, n)) for n in namespaces)
        run.signal(signal.SIGTERM)
        rc, out, err = run.finish(120)
        assert rc == 143, out[-3000:] + err[-3000:]
        assert "Traceback" not in out + err, err[-3000:]
        _check_nothing_left(run, folder, namespaces)
    finally:
        run.kill_all()


def test_a_killed_demos_namespaces_go_with_its_folder(tmp_path):
    """A SIGKILLed ``--nodes 2`` demo cannot remove its namespaces: the next demo's start
    removes them with its folder (their names are in the folder before they are made)."""
    _needs_netns()
    from slotsync.demo import leftovers
    from slotsync.demo.nodes import make_namespaces

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / f"{leftovers.DEMO_FOLDER_PREFIX}killed"
    folder.mkdir()
    (folder / leftovers.OWNER_FILE).write_text(f"{dead.pid} -\n")
    names = make_namespaces(str(folder), pid=dead.pid)
    try:
        assert all(os.path.exists(os.path.join(NETNS_DIR, n)) for n in names)
        assert leftovers.remove_stale_demo_folders(str(tmp_path), str(tmp_path)) == [
            str(folder)]
        assert not folder.exists()
        assert not any(os.path.exists(os.path.join(NETNS_DIR, n)) for n in names)
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, check=False)


@pytest.mark.parametrize("args,text", [
    (["--ranks", "3"], "--ranks must be even, got 3"),
    (["--gpus-per-engine", "1"], "leave out --gpus-per-engine (got 1)"),
    (["--backend", "vllm-api"], "--backend vllm-api runs on one node"),
])
def test_demo_over_two_nodes_refuses_what_it_cannot_run(args, text, capsys, monkeypatch):
    from slotsync import demo

    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started"))
    parsed = demo.build_parser().parse_args(["--nodes", "2", "--device", "cpu", *args])
    assert demo.main_from_args(parsed) == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root: netns refused, named
    parsed = demo.build_parser().parse_args(["--nodes", "2", "--nodes-net", "netns"])
    assert demo.main_from_args(parsed) == 2
    assert "run as root or use --nodes-net loopback" in capsys.readouterr().err

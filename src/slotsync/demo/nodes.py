"""``slotsync demo --nodes 2``: two nodes on this machine, each with its own daemon, and one
engine whose workers span both (the walkthrough of docs/multi-node.md on CPU).

Two forms (``--nodes-net``):

* ``netns`` (as root, where ``ip netns add`` works): two Linux network namespaces,
  ``slotsync-demo-<pid>-node0`` and ``-node1``, joined by a veth pair (``eth0`` in each, at
  10.0.0.1 and 10.0.0.2, docs/multi-node.md's addresses). Each daemon runs inside its node
  (``ip netns exec``); node0's listens for peers on ``tcp://10.0.0.1:9461``, and the peer link
  crosses the veth. The trainer ranks and the engine stay in this machine's namespace: a rank
  reaches its node's daemon over its ``ipc://`` socket and the engine serves on a Unix
  socket, files every namespace reaches (as the multi-node tests do, ``tests/multi_node.py``).
* ``loopback`` (anyone): the two daemons on 127.0.0.1, each with its own runtime folder,
  node0 listening for peers on a free port.

Either way: a CURVE key pair per node (``slotsync keys``' ``make_keys``) in the demo's
folder, both public keys in one allow-list folder; each daemon its TOML table declaring the
one engine over all ranks, owner ``node0``, ranks ``[0, n/2)`` on node0 and ``[n/2, n)`` on
node1. Node0's daemon drives the engine; node1's relays its ranks' frames over the link.

The namespaces' names are written into the demo's folder (``netns``) before they are made,
so that the next demo removes those of a demo that was SIGKILLed
(``slotsync.demo.leftovers``); a demo stopped by Ctrl-C or SIGTERM removes them itself.

Standard library only at import; the daemon's key maker is imported where keys are made.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from types import TracebackType

NETNS_FILE = "netns"
"""In a demo's folder: the names of its network namespaces, one a line."""
NETNS_DIR = "/run/netns"  # where `ip netns add NAME` keeps a namespace
NAMES = ("node0", "node1")
NETNS_ADDRESSES = ("10.0.0.1", "10.0.0.2")
PEER_PORT = 9461  # (inside namespaces of the demo's own: nothing else listens there)
NETS = ("auto", "netns", "loopback")


def netns_problem() -> str:
    """Why network namespaces cannot be made here ('' when they may): not root, or no
    ``ip`` command. (Whether the kernel lets this process make them shows when it tries.)"""
    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()}): ip netns add needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return ""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")


def make_namespaces(folder: str, pid: int | None = None) -> list[str]:
    """Make the two nodes' namespaces joined by a veth pair; their names are recorded in
    ``folder`` first. Returns the names.

    Raises:
        OSError: an ``ip`` command failed (what was made is removed).
    """
    names = [f"slotsync-demo-{os.getpid() if pid is None else pid}-{n}" for n in NAMES]
    tmp = os.path.join(folder, f".{NETNS_FILE}.tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.writelines(f"{n}\n" for n in names)
    os.replace(tmp, os.path.join(folder, NETNS_FILE))
    try:
        for name in names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", names[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
            "netns", names[1])
        for name, address in zip(names, NETNS_ADDRESSES, strict=True):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
    except BaseException:
        for name in names:
            remove_namespace(name)
        raise
    return names


def _pids_in(name: str) -> list[int]:
    try:
        r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                           check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def remove_namespace(name: str, grace_s: float = 5.0) -> None:
    """Stop what still runs in namespace ``name`` (SIGTERM, SIGKILL after ``grace_s``
    seconds) and delete it (its end of the veth pair goes with it, and so the other end).
    Errors are ignored: this runs at cleanup."""
    if not os.path.exists(os.path.join(NETNS_DIR, name)):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_in(name)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and _pids_in(name) and time.monotonic() < deadline:
            time.sleep(0.05)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False, timeout=30)


def remove_recorded_namespaces(folder: str) -> list[str]:
    """Remove the namespaces listed in ``folder``'s ``netns`` file that still exist (a killed
    demo's); returns their names."""
    try:
        with open(os.path.join(folder, NETNS_FILE), encoding="ascii") as f:
            names = [line.strip() for line in f if line.strip().startswith("slotsync-demo-")]
    except OSError:
        return []
    found = [n for n in names if os.path.exists(os.path.join(NETNS_DIR, n))]
    for name in found:
        remove_namespace(name)
    return found


def config_text(folder: str, k: int, ranks: int, engine_url: str, owner_address: str,
                listen: str) -> str:
    """Node ``k``'s daemon table: its node name and keys, node0's peer listener, and the one
    engine over ``ranks`` ranks owned by node0, half the ranks on each node."""
    name, half = NAMES[k], ranks // 2
    text = (f'node = "{name}"\n'
            f'curve_secret_key = "{folder}/keys/{name}/{name}.key_secret"\n'
            f'peer_public_keys = "{folder}/keys/public"\n')
    if k == 0:
        text += f'peer_listen = "{listen}"\n'
    return text + ("\n[[engines]]\n"
                   f'url = "{engine_url}"\n'
                   f"slot_start = 0\nslot_size = {ranks}\n"
                   f'owner = "{NAMES[0]}"\n'
                   f'owner_address = "{owner_address}"\n'
                   f'nodes = [{{node = "{NAMES[0]}", ranks = [0, {half}]}}, '
                   f'{{node = "{NAMES[1]}", ranks = [{half}, {ranks}]}}]\n')


class DemoNodes:
    """The two nodes of ``slotsync demo --nodes 2`` (see the module docstring), started in the
    constructor: keys, tables, namespaces (``net="netns"``), both daemons, and the peer link
    up. ``close`` (also the context manager's exit, and any failure while starting) stops the
    daemons and removes the namespaces.

    Args:
        folder: the demo's folder (keys, tables, runtime folders, the ``netns`` list).
        ranks: trainer ranks (even), half on each node.
        engine_url: the engine's URL (a ``unix://`` socket every namespace reaches).
        net: ``"netns"``, ``"loopback"``, or ``"auto"`` (namespaces where ``netns_problem``
            finds no reason against them and they can be made, else loopback, saying why).
        say: prints one progress line.
        timeout_s: bound on each daemon's start and on the peer link coming up, seconds.

    Attributes:
        daemons: node0's and node1's ``DaemonProcess``.
        endpoints: their ``ipc://`` endpoints (a rank's is its node's).
        owner_address: where node0's daemon listens for node1's.
        net: the form in use, ``"netns"`` or ``"loopback"``.

    Raises:
        OSError: a namespace could not be made. TimeoutError: the link did not come up.
        slotsync.testing.processes.DaemonStartError: a daemon did not start.
    """

    def __init__(self, folder: str, ranks: int, engine_url: str, net: str,
                 say: Callable[[str], None], timeout_s: float = 60.0) -> None:
        from slotsync.daemon.node_links.peer_keys import make_keys
        from slotsync.testing.ports import free_port
        from slotsync.testing.processes import DaemonProcess

        self.namespaces: list[str] = []
        self.daemons: list = []
        self.net = net
        try:
            public = os.path.join(folder, "keys", "public")
            os.makedirs(public)
            for name in NAMES:
                pub, _ = make_keys(name, os.path.join(folder, "keys", name))
                shutil.copy(pub, os.path.join(public, pub.name))
            say(f"  keys: a CURVE key pair per node in {folder}/keys/<node>/, both public keys "
                f"in {public}/ (the allow-list of both daemons)")
            if net == "auto":  # namespaces where this process may make them, else loopback
                why = netns_problem()
                if not why:
                    try:
                        self.namespaces = make_namespaces(folder)
                    except OSError as e:
                        why = str(e)
                net = "loopback" if why else "netns"
                if why:
                    say(f"  (no network namespaces: {why}; the nodes share the loopback "
                        "instead; --nodes-net netns insists)")
            elif net == "netns":
                self.namespaces = make_namespaces(folder)
            self.net = net
            if net == "netns":
                host = NETNS_ADDRESSES[0]
                self.owner_address = f"tcp://{host}:{PEER_PORT}"
                say(f"  nodes: network namespaces {self.namespaces[0]} ({NETNS_ADDRESSES[0]}) "
                    f"and {self.namespaces[1]} ({NETNS_ADDRESSES[1]}), joined by a veth pair")
            else:
                self.owner_address = f"tcp://127.0.0.1:{free_port()}"
                say("  nodes: two daemons on this machine's loopback (127.0.0.1), each with its "
                    "own runtime folder")
            half = ranks // 2
            for k, name in enumerate(NAMES):
                table = os.path.join(folder, f"{name}.toml")
                with open(table, "w", encoding="utf-8") as f:
                    f.write(config_text(folder, k, ranks, engine_url, self.owner_address,
                                        self.owner_address))
                self.daemons.append(DaemonProcess(
                    runtime_dir=os.path.join(folder, name), startup_timeout_s=timeout_s,
                    netns=self.namespaces[k] if self.namespaces else None,
                    args=["--config", table]))
                role = (f"owner of the engine, listening for peers on {self.owner_address}"
                        if k == 0 else f"relays its ranks to node0 at {self.owner_address}")
                say(f"  daemon {name} ({role}): ranks [{k * half}, {(k + 1) * half}) publish "
                    f"to {self.daemons[k].endpoint}")
            t0 = time.monotonic()
            self._wait_link(timeout_s)
            say(f"  peer link node1 -> node0 up (CURVE) after {time.monotonic() - t0:.1f} s")
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [d.endpoint for d in self.daemons]

    def link(self, k: int) -> dict:
        """Node ``k``'s daemon's ``/status`` entry of its link to the other node ({} when it
        has none yet)."""
        other = NAMES[1 - k]
        links = self.daemons[k].status().get("peers", {}).get("links", [])
        return next((lk for lk in links if lk.get("node") == other), {})

    def _wait_link(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.link(0).get("up") and self.link(1).get("up")):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the peer link between node0 and node1 did not come up within "
                    f"{timeout_s:.0f} s: node0 says {self.link(0)}, node1 {self.link(1)}; "
                    f"node1's daemon log:\n{self.daemons[1].log_tail(2000)}")
            time.sleep(0.1)

    def close(self) -> None:
        """Stop both daemons and remove the namespaces (idempotent)."""
        for d in self.daemons:
            d.stop()
        for name in self.namespaces:
            remove_namespace(name)
        self.namespaces = []

    def __enter__(self) -> DemoNodes:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

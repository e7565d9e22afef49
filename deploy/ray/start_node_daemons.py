"""One ``slotsyncd`` per Ray node, engines over several nodes, and how a rank finds its daemon.

CUDA IPC handles are node-local: every rank talks to the daemon on its own node. This module
starts the daemons as detached Ray actors pinned to their node
(``NodeAffinitySchedulingStrategy(soft=False)``) and named ``slotsyncd-<node_id>``, each
owning one ``slotsyncd`` subprocess, so that:

* a rank needs no configuration: ``ray.get_runtime_context().get_node_id()`` gives its node,
  and the socket path is derived from it (``endpoint_for_node``);
* engines over several nodes (vLLM ``--nnodes N``, issue 25) get what their daemons need,
  from one call on the driver: the driver makes every node's CURVE key pair
  (``slotsync keys``' ``make_keys``), hands each daemon its own secret key and every public
  key, and writes each daemon's engine table, with the owner's address (the owner node's IP
  and its ``peer_listen`` port) filled in;
* ``stop_node_daemons()`` stops every daemon (SIGTERM: an update in flight may finish within
  ``shutdown_grace_s``) and its actor, and removes the keys from the nodes.

Engines are given as in the TOML engine table, with Ray node ids for node names::

    start_node_daemons(engines=[{
        "url": "http://127.0.0.1:8000", "slot_start": 0, "slot_size": 16,
        "owner": head_id,                      # the node of the engine's API server
        "nodes": [{"node": head_id, "ranks": [0, 8]}, {"node": worker_id, "ranks": [8, 16]}],
    }])

An engine on one node may be declared too: ``{"url", "slot_start", "slot_size", "node":
node_id}`` (optionally ``gpu_uuids``). Each daemon's table holds the engines of its own node
only. Daemon node names are ``node_name(node_id)`` (``ray-`` and the id's first 16 hex
digits).

Files per node, in ``/tmp/slotsync-<node id prefix>/`` (the actor's and the ranks' ``/tmp``
are the node's under Ray): ``slotsyncd.sock``, ``slotsyncd.toml``, ``slotsyncd.log``,
``keys/`` (mode 0700). The daemon runs as the Ray workers' user, so its default peer check
accepts the ranks.

Run on the Ray head after the cluster is up (every node a daemon, no engine table)::

    python deploy/ray/start_node_daemons.py          # prints node id -> endpoint
    python deploy/ray/start_node_daemons.py --stop

and in each trainer rank (a Ray actor or task on a GPU node)::

    from start_node_daemons import endpoint_for_node
    endpoint = endpoint_for_node(ray.get_runtime_context().get_node_id())
    pub = Publisher(endpoint, rank, topo.slot_of(rank), engine_url)

The secret keys travel to the actors through Ray (as the arguments of an actor method): on a
cluster whose Ray traffic crosses an untrusted network, turn on Ray's TLS
(``RAY_USE_TLS``). Requires ``ray`` (not a slotsync dependency) and slotsync on every node.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "slotsync"  # detached named actors are looked up per namespace
STATUS_PORT = 9460  # per node: every daemon on the same port of its own host (0: any free)
PEER_PORT = 9461  # the owner's peer_listen port (0: any free one, e.g. nodes on one host)


def node_name(node_id: str) -> str:
    """The daemon's ``node`` name of Ray node ``node_id`` (as the engine tables name it)."""
    return f"ray-{node_id[:16]}"


def runtime_dir_for_node(node_id: str) -> str:
    """The daemon's folder on node ``node_id`` (a Ray node id is 56 hex characters, so the
    socket path stays below the 107-byte Unix socket limit)."""
    return f"/tmp/slotsync-{node_id[:16]}"


def endpoint_for_node(node_id: str) -> str:
    """What a rank on ``node_id`` passes to ``Publisher``."""
    return f"ipc://{runtime_dir_for_node(node_id)}/slotsyncd.sock"


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a TOML basic string


def engine_tables(engines: list[dict], peer_addresses: dict[str, str]) -> dict[str, str]:
    """Each node's ``[[engines]]`` TOML text (node id -> text; nodes without an engine
    absent), from ``engines`` named by Ray node ids; ``peer_addresses``: each owner node's
    ``tcp://IP:PORT``. Pure: no Ray.

    Raises:
        ValueError: an engine without ``node`` or ``nodes``, an owner that is not one of its
            nodes, or an owner without an address.
    """
    out: dict[str, list[str]] = {}
    for i, e in enumerate(engines):
        head = [f"url = {_toml_str(e['url'])}", f"slot_start = {int(e['slot_start'])}",
                f"slot_size = {int(e['slot_size'])}"]
        if e.get("gpu_uuids"):
            head.append(f"gpu_uuids = {json.dumps(list(e['gpu_uuids']))}")
        if "nodes" in e:
            ids = [n["node"] for n in e["nodes"]]
            owner = e.get("owner")
            if owner not in ids:
                raise ValueError(f"engines[{i}] {e['url']}: owner {owner!r} is not one of its "
                                 f"nodes {ids}")
            if owner not in peer_addresses:
                raise ValueError(f"engines[{i}] {e['url']}: no peer address for its owner "
                                 f"{owner}")
            parts = ", ".join(f"{{node = {_toml_str(node_name(n['node']))}, ranks = "
                              f"[{int(n['ranks'][0])}, {int(n['ranks'][1])}]}}"
                              for n in e["nodes"])
            head += [f"owner = {_toml_str(node_name(owner))}",
                     f"owner_address = {_toml_str(peer_addresses[owner])}",
                     f"nodes = [{parts}]"]
        elif "node" in e:
            ids = [e["node"]]
        else:
            raise ValueError(f"engines[{i}] {e.get('url')}: give its node (one node) or its "
                             "nodes and owner (several)")
        for n in ids:
            out.setdefault(n, []).append("[[engines]]\n" + "\n".join(head) + "\n")
    return {n: "\n".join(blocks) for n, blocks in out.items()}


def spanning_nodes(engines: list[dict]) -> tuple[set[str], set[str]]:
    """``(nodes of engines over several nodes, their owners)``, as Ray node ids."""
    nodes = {n["node"] for e in engines if "nodes" in e for n in e["nodes"]}
    return nodes, {e.get("owner", "") for e in engines if "nodes" in e} - {""}


def _die_with_parent() -> None:
    """``preexec_fn``: SIGTERM to the daemon when its actor's process dies (even by
    SIGKILL), so that a killed actor leaves no daemon holding the socket."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@ray.remote(num_cpus=0, max_restarts=-1)  # restarted by Ray if the actor process dies
class SlotsyncDaemon:
    """Owns one ``slotsyncd`` subprocess on the node it is pinned to."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.folder = Path(runtime_dir_for_node(node_id))
        self.config_path = self.folder / "slotsyncd.toml"
        self.proc: subprocess.Popen | None = None
        self.status_port = -1
        self.config_text = ""
        self.folder.mkdir(mode=0o770, parents=True, exist_ok=True)
        # A restarted actor (its process died, and its daemon with it) starts the daemon
        # again from the files its first incarnation wrote.
        with warnings.catch_warnings():  # (Ray 2.60 warns from inside the property)
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted and self.config_path.exists():
            self.config_text = self.config_path.read_text()
            self._launch(60.0)

    def peer_address(self, port: int) -> str:
        """``tcp://<this node's IP>:<port>`` for ``peer_listen`` (``port`` 0: a free one);
        a running daemon's own ``peer_listen``, if it has one."""
        for line in self.config_text.splitlines() if self.alive() else ():
            if line.startswith("peer_listen = "):
                return json.loads(line.split("=", 1)[1])
        ip = ray.util.get_node_ip_address()
        if port == 0:
            with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
                s.bind((ip, 0))
                port = s.getsockname()[1]
        return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"

    def start(self, config_text: str, secret: tuple[str, bytes] | None,
              public: dict[str, bytes], timeout_s: float = 60.0) -> dict:
        """Write the keys and the configuration, start ``slotsyncd``, wait for its ready
        line. A daemon already running with the same configuration is kept.

        Raises:
            RuntimeError: a daemon runs with another configuration, or the new one exited
                or printed no ready line within ``timeout_s`` (the end of its log).
        """
        if self.alive():
            if config_text == self.config_text:
                return self.info()
            raise RuntimeError(f"slotsyncd on node {self.node_id} runs with another "
                               "configuration: stop_node_daemons() first")
        keys = self.folder / "keys"
        if keys.exists():
            shutil.rmtree(keys)
        if secret is not None:
            (keys / "public").mkdir(mode=0o700, parents=True)
            keys.chmod(0o700)
            name, data = secret
            fd = os.open(keys / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            for name, data in public.items():
                (keys / "public" / name).write_bytes(data)
        self.config_path.write_text(config_text)
        self.config_text = config_text
        self._launch(timeout_s)
        return self.info()

    def _launch(self, timeout_s: float) -> None:
        with open(self.folder / "slotsyncd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "slotsync.daemon", "--config", str(self.config_path)],
                stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=_die_with_parent)
        # The daemon prints one line once its sockets are bound.
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(max(0.0, deadline - time.monotonic()))
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("slotsyncd ready"):
            self.stop(5.0)
            raise RuntimeError(f"slotsyncd did not start on node {self.node_id}: "
                               f"{line!r}\n{self.log_tail()}")
        self.status_port = int(dict(kv.split("=", 1) for kv in line.split()[2:])["status_port"])

    def info(self) -> dict:
        return {"node_id": self.node_id, "node": node_name(self.node_id),
                "endpoint": endpoint_for_node(self.node_id), "status_port": self.status_port,
                "pid": self.proc.pid if self.proc else None, "alive": self.alive()}

    def endpoint(self) -> str:
        return endpoint_for_node(self.node_id)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.folder / "slotsyncd.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM (graceful: updates in flight may finish within shutdown_grace_s), then
        SIGKILL after ``timeout_s``; the keys are removed from the node. Returns the daemon's
        exit status (None: none was running)."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            code = self.proc.returncode
            if self.proc.stdout:
                self.proc.stdout.close()
        shutil.rmtree(self.folder / "keys", ignore_errors=True)
        self.config_path.unlink(missing_ok=True)  # a restarted actor must not start it again
        return code


def _alive_nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def _actor(node_id: str):
    return SlotsyncDaemon.options(
        name=f"slotsyncd-{node_id}",
        namespace=NAMESPACE,
        lifetime="detached",  # outlives this driver; one per node for the cluster's life
        get_if_exists=True,  # a second call finds the running actor
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id)


def _key_pairs(nodes: list[str]) -> dict[str, tuple[bytes, bytes]]:
    """node id -> (public key file, secret key file) bytes, made by ``slotsync keys``'
    ``make_keys`` in a folder removed before returning."""
    from slotsync.daemon.node_links.peer_keys import make_keys

    out = {}
    with tempfile.TemporaryDirectory(prefix="slotsync-keys-") as d:
        for n in nodes:
            public, secret = make_keys(node_name(n), d)
            out[n] = (public.read_bytes(), secret.read_bytes())
    return out


def start_node_daemons(engines: list[dict] = (), *, status_port: int = STATUS_PORT,
                       peer_port: int = PEER_PORT, log_format: str = "text",
                       timeout_s: float = 60.0) -> dict[str, dict]:
    """Ensure one daemon per alive node, configured for ``engines`` (see the module's
    docstring); returns ``{node_id: info}`` (``node``, ``endpoint``, ``status_port``,
    ``pid``, ``alive``).

    Raises:
        ValueError: an engine names a node that is not alive, or is malformed.
        RuntimeError: a daemon did not start (its log's end), or runs with another
            configuration.
    """
    engines = list(engines)
    nodes = _alive_nodes()
    span_nodes, owners = spanning_nodes(engines)
    named = span_nodes | {e["node"] for e in engines if "node" in e}
    if named - set(nodes):
        raise ValueError(f"engines name nodes that are not alive: {sorted(named - set(nodes))}")
    actors = {n: _actor(n) for n in nodes}
    addresses = dict(zip(sorted(owners), ray.get(
        [actors[n].peer_address.remote(peer_port) for n in sorted(owners)]), strict=True))
    tables = engine_tables(engines, addresses)
    keys = _key_pairs(sorted(span_nodes))
    public = {f"{node_name(n)}.key": pair[0] for n, pair in keys.items()}
    calls = {}
    for n in nodes:
        folder = runtime_dir_for_node(n)
        lines = [f"node = {_toml_str(node_name(n))}", f"runtime_dir = {_toml_str(folder)}",
                 f"status_port = {int(status_port)}", f"log_format = {_toml_str(log_format)}"]
        secret = None
        if n in span_nodes:
            secret = (f"{node_name(n)}.key_secret", keys[n][1])
            lines += [f"curve_secret_key = {_toml_str(f'{folder}/keys/{secret[0]}')}",
                      f"peer_public_keys = {_toml_str(f'{folder}/keys/public')}"]
        if n in owners:
            lines.append(f"peer_listen = {_toml_str(addresses[n])}")
        text = "\n".join(lines) + "\n" + ("\n" + tables[n] if n in tables else "")
        calls[n] = actors[n].start.remote(text, secret, public if secret else {}, timeout_s)
    return dict(zip(calls, ray.get(list(calls.values())), strict=True))


def stop_node_daemons(timeout_s: float = 90.0) -> dict[str, int | None]:
    """Stop every node's daemon (SIGTERM, graceful) and its actor; returns ``{node_id: exit
    status}`` for the daemons found (None: its actor ran no daemon)."""
    out = {}
    for n in _alive_nodes():
        try:
            actor = ray.get_actor(f"slotsyncd-{n}", namespace=NAMESPACE)
        except ValueError:  # none on this node
            continue
        out[n] = ray.get(actor.stop.remote(timeout_s))
        ray.kill(actor, no_restart=True)
    return out


def node_daemon(node_id: str | None = None):
    """The daemon actor of ``node_id`` (default: the caller's node), e.g. to check
    ``alive()`` from a rank."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return ray.get_actor(f"slotsyncd-{node_id}", namespace=NAMESPACE)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="one slotsyncd per node of the Ray cluster")
    p.add_argument("--engines", help="JSON file: the engines (see this module's docstring)")
    p.add_argument("--stop", action="store_true", help="stop every node's daemon")
    args = p.parse_args(argv)
    ray.init(address="auto", namespace=NAMESPACE)
    if args.stop:
        for nid, code in stop_node_daemons().items():
            print(nid, "exit", code)
        return 0
    engines = json.loads(Path(args.engines).read_text()) if args.engines else []
    for nid, info in start_node_daemons(engines).items():
        print(nid, info["node"], info["endpoint"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two "nodes" on one machine for engines over several nodes (issue 25): a daemon per node,
node0 owning one engine of ``2 * per_node`` workers, node1 relaying its ranks over a CURVE
link on loopback. The network-namespace version, with real hosts and partitions, is in
``netns.py``; this one needs no root (the GPU run and the benchmark use it)."""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack

from slotsync.daemon.node_links.peer_keys import make_keys
from slotsync.testing.ports import free_port
from slotsync.testing.processes import DaemonProcess


def node_config(folder: str, node: str, engine_url: str, per_node: int, port: int,
                extra: str = "") -> str:
    """Write node ``node``'s TOML (engine slot ``[0, 2 * per_node)`` owned by node0 at
    ``tcp://127.0.0.1:port``; node1 holds the upper half of the ranks); returns its path.
    The keys of both nodes must be in ``folder/keys`` (``make_keys``)."""
    path = os.path.join(folder, f"{node}.toml")
    listen = f'peer_listen = "tcp://127.0.0.1:{port}"\n' if node == "node0" else ""
    with open(path, "w") as f:
        f.write(f'node = "{node}"\ncurve_secret_key = "{folder}/keys/{node}.key_secret"\n'
                f'peer_public_keys = "{folder}/keys"\n{listen}{extra}\n'
                f'[[engines]]\nurl = "{engine_url}"\nslot_start = 0\n'
                f'slot_size = {2 * per_node}\nowner = "node0"\n'
                f'owner_address = "tcp://127.0.0.1:{port}"\n'
                f'nodes = [{{node = "node0", ranks = [0, {per_node}]}}, '
                f'{{node = "node1", ranks = [{per_node}, {2 * per_node}]}}]\n')
    return path


class TwoNodes:
    """``with TwoNodes(url, per_node) as nodes``: ``nodes.daemons[0]`` (owner) and
    ``[1]`` (relaying) running; ``nodes.daemon_of(rank)`` the daemon of a rank's node.
    Everything (daemons, keys, configs) is removed on exit."""

    def __init__(self, engine_url: str, per_node: int, daemon_args: list[str] | None = None
                 ) -> None:
        self.per_node = per_node
        self._stack = ExitStack()
        self._tmp = tempfile.TemporaryDirectory(prefix="slotsync-two-nodes-")
        folder = self._tmp.name
        try:
            make_keys("node0", f"{folder}/keys")
            make_keys("node1", f"{folder}/keys")
            port = free_port()
            self.daemons = [
                self._stack.enter_context(DaemonProcess(
                    runtime_dir=f"{folder}/{node}",
                    args=["--config", node_config(folder, node, engine_url, per_node, port),
                          *(daemon_args or [])]))
                for node in ("node0", "node1")]
        except BaseException:
            self.close()
            raise

    def daemon_of(self, rank: int) -> DaemonProcess:
        return self.daemons[rank // self.per_node]

    def close(self) -> None:
        self._stack.close()
        self._tmp.cleanup()

    def __enter__(self) -> TwoNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""One ``slotsyncd`` per Ray node, and how a trainer rank finds its own node's daemon.

CUDA IPC handles are node-local: every rank must talk to the daemon on its own node, and an
engine slot never spans nodes. This example starts the daemons once, as detached Ray actors
pinned to their node (``NodeAffinitySchedulingStrategy(soft=False)``) and named
``slotsyncd-<node_id>``, so that:

* starting them again (a driver restart, a second job) finds the running ones
  (``get_if_exists=True``) instead of starting a second daemon on the same socket (which
  ``slotsyncd`` would refuse anyway);
* a rank needs no configuration: ``ray.get_runtime_context().get_node_id()`` gives its node,
  and the socket path is derived from it (``endpoint_for_node``).

The socket lives in ``/tmp/slotsync-<node_id>/`` (the actor's and the ranks' ``/tmp`` are the
node's ``/tmp`` under Ray). A fixed folder such as ``/run/slotsync`` works too if it exists and
is writable by the Ray workers' user.

Run on the Ray head after the cluster is up::

    python deploy/ray/start_node_daemons.py          # prints node id -> endpoint

and in each trainer rank (a Ray actor or task on a GPU node)::

    from start_node_daemons import endpoint_for_node
    endpoint = endpoint_for_node(ray.get_runtime_context().get_node_id())
    pub = Publisher(endpoint, rank, topo.slot_of(rank), engine_url)

Requires ``ray`` (not a slotsync dependency) and slotsync installed on every node.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "slotsync"  # detached named actors are looked up per namespace
STATUS_PORT = 9460  # per node: every daemon uses the same port on its own host


def runtime_dir_for_node(node_id: str) -> str:
    """The daemon's socket folder on node ``node_id`` (a Ray node id is 56 hex characters, so
    the socket path stays below the 107-byte Unix socket limit)."""
    return f"/tmp/slotsync-{node_id[:16]}"


def endpoint_for_node(node_id: str) -> str:
    """What a rank on ``node_id`` passes to ``Publisher``."""
    return f"ipc://{runtime_dir_for_node(node_id)}/slotsyncd.sock"


@ray.remote(num_cpus=0.5, max_restarts=-1)  # restarted by Ray if the actor process dies
class SlotsyncDaemon:
    """Owns one ``slotsyncd`` subprocess on the node it is pinned to."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.runtime_dir = runtime_dir_for_node(node_id)
        os.makedirs(self.runtime_dir, mode=0o770, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slotsync.daemon", "--runtime-dir", self.runtime_dir,
             "--status-port", str(STATUS_PORT)],
            stdout=subprocess.PIPE, text=True,
        )
        # The daemon prints one line once its sockets are bound.
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("slotsyncd ready"):
            raise RuntimeError(f"slotsyncd did not start on node {node_id}: {line!r}")

    def endpoint(self) -> str:
        return endpoint_for_node(self.node_id)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        """SIGTERM (graceful: updates in flight may finish within shutdown_grace_s)."""
        self.proc.terminate()
        return self.proc.wait(90)


def start_node_daemons() -> dict[str, str]:
    """Ensure one daemon per alive node; returns ``{node_id: endpoint}``."""
    handles = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        node_id = node["NodeID"]
        handles[node_id] = SlotsyncDaemon.options(
            name=f"slotsyncd-{node_id}",
            namespace=NAMESPACE,
            lifetime="detached",  # outlives this driver; one per node for the cluster's life
            get_if_exists=True,  # a second call finds the running actor
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id)
    return dict(zip(handles, ray.get([h.endpoint.remote() for h in handles.values()]),
                    strict=True))


def node_daemon(node_id: str | None = None):
    """The daemon actor of ``node_id`` (default: the caller's node), e.g. to check
    ``alive()`` from a rank."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return ray.get_actor(f"slotsyncd-{node_id}", namespace=NAMESPACE)


if __name__ == "__main__":
    ray.init(address="auto", namespace=NAMESPACE)
    for nid, ep in start_node_daemons().items():
        print(nid, ep)

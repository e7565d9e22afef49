"""Two nodes, one engine over both (issue 25 G): what the multi-node integration tests
(``tests/integration/test_multi_node.py``) and fault rows (``tests/faults/
test_multi_node_faults.py``) share.

* :class:`Cluster`: two "nodes" (``netns.Nodes``: network namespaces on one switch), a
  CURVE key pair per node (``slotsync.daemon.node_links.peer_keys.make_keys``), one ``slotsyncd``
  inside
  each node (``DaemonProcess(netns=...)``), each with its own TOML engine table declaring the
  one 8-worker engine: owner ``node0`` (its daemon listens for peers on
  ``tcp://<node 0's address>:9461``), ranks ``[0, 4)`` on node0 and ``[4, 8)`` on node1.
* The engine (either implementation) serves on a Unix socket (``--uds``, ``unix:///...``), a
  file every namespace reaches: the owner's daemon drives it from inside node 0, the test
  reads its state from the root namespace. Trainer ranks run in the root namespace too and
  reach their own node's daemon over its ``ipc://`` socket (also a file): what crosses
  between the nodes is only the daemons' peer link, over the veths.
* The engine's model holds the dict-form tensors (``make_tensors``) and a small
  expert-parallel model (:func:`ep_model`) side by side, so that one engine serves the
  packed, unpacked and rank-local rounds; each round's check compares only what it sent.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from engines import ENGINE_ENV
from netns import Nodes
from state_readers import checksums_in_worker_order, engine_stats, wait_for
from trainer_script import make_tensors

from slotsync.daemon.node_links.peer_keys import make_keys
from slotsync.engine.checksum import tensor_checksum
from slotsync.protocol.rank.publisher import Publisher
from slotsync.protocol.wire import logical_gpu_uuid
from slotsync.testing.processes import DaemonProcess

WORKERS = 8
PER_NODE = 4
NODES = ("node0", "node1")
OWNER = 0  # node 0's daemon drives the engine
PEER_PORT = 9461  # (inside a namespace of our own: no other listener can hold it)
UUIDS = [logical_gpu_uuid(w) for w in range(WORKERS)]
SLOT = (0, WORKERS)


def prepare_impl(impl: str) -> None:
    """Before an engine of ``impl`` starts: skip when vLLM's code cannot be imported, and let
    vLLM's server take our pickled handles (``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""
    import pytest
    from engines import vllm_importable

    if impl == "vllm":
        why = vllm_importable()
        if why:
            pytest.skip(f"vLLM's code cannot be imported: {why}")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def impl_params() -> list[str]:
    """The engines a module runs against: both, or only the one ``--engine`` /
    ``$SLOTSYNC_TEST_ENGINE`` names (``tests/gen_reliability.py`` runs the fault suite once
    per engine that way).

    Not marked ``vllm``: these tests skip where no network namespace can be made (not
    root), and under ``SLOTSYNC_REQUIRE_VLLM=1`` (scripts/test) a skipped ``vllm`` test is a
    failure, which would fail a non-root run for want of root, not of vLLM. Where vLLM's
    code cannot be imported the ``vllm`` engine fixture skips, saying so."""
    chosen = os.environ.get(ENGINE_ENV)
    return [p for p in ("vllm", "reference") if chosen in (None, "", p)]


def node_of(rank: int) -> int:
    """The node (index) whose daemon rank ``rank`` publishes to."""
    return rank // PER_NODE


# ------------------------------------------------------------------------------ models

EP_SHARED = ["model.embed_tokens.weight", "model.norm.weight"]


def ep_expert(e: int) -> str:
    return f"model.layers.0.mlp.experts.{e}.down_proj.weight"


def ep_experts_of(worker: int) -> list[int]:
    """Worker ``w``'s experts: two each, except worker 0 with three and worker 7 with one
    (uneven, so ranks send different chunk counts)."""
    return {0: [0, 1, 2], 7: [15]}.get(worker, [2 * worker + 1, 2 * worker + 2])


def ep_model(seed: int) -> dict[str, torch.Tensor]:
    """The expert-parallel model: shared tensors and 16 experts, values from ``seed``."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {EP_SHARED[0]: torch.randn(6, 4, generator=g).to(torch.bfloat16),
           EP_SHARED[1]: torch.randn(4, generator=g)}
    for e in range(16):
        out[ep_expert(e)] = torch.randn(3, 2, generator=g)
    return out


def ep_rank_tensors(worker: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """What the rank feeding ``worker`` publishes rank-locally: the shared tensors and its
    experts."""
    m = ep_model(seed)
    return [(n, m[n]) for n in EP_SHARED] + [(ep_expert(e), m[ep_expert(e)])
                                              for e in ep_experts_of(worker)]


def engine_model() -> list[tuple[str, Any]]:
    """The engine's checkpoint: ``make_tensors(0)`` and ``ep_model(0)``."""
    return list(make_tensors(0)) + list(ep_model(0).items())


# ------------------------------------------------------------------------------ checks


def assert_round_landed(engine: Any, k: int) -> None:
    """Every one of the 8 workers holds ``make_tensors(k)`` exactly, version ``v{k}``, and
    the engine serves (not paused, no worker mid-session)."""
    want = {n: tensor_checksum(t) for n, t in make_tensors(k)}
    per_worker = checksums_in_worker_order(engine)
    assert len(per_worker) == WORKERS
    for w, sums in enumerate(per_worker):
        assert {n: sums.get(n) for n in want} == want, f"worker {w} differs after round {k}"
    stats = engine_stats(engine)
    assert stats["weight_version"] == f"v{k}", stats["weight_version"]
    assert stats["paused"] is False and not any(w["active"] for w in stats["workers"]), stats


def assert_ep_round_landed(engine: Any, seed: int, version: str, old_seed: int = 0) -> None:
    """Each worker holds the shared tensors and its own experts of ``ep_model(seed)``, and
    every other expert still as before (``ep_model(old_seed)``: it was not sent them)."""
    new = {n: tensor_checksum(t) for n, t in ep_model(seed).items()}
    old = {n: tensor_checksum(t) for n, t in ep_model(old_seed).items()}
    per_worker = checksums_in_worker_order(engine)
    for w, sums in enumerate(per_worker):
        want = {n: new[n] for n in EP_SHARED}
        for e in range(16):
            want[ep_expert(e)] = new[ep_expert(e)] if e in ep_experts_of(w) else \
                old[ep_expert(e)]
        assert {n: sums.get(n) for n in want} == want, f"worker {w} differs"
    stats = engine_stats(engine)
    assert stats["weight_version"] == version and stats["paused"] is False, stats


# ------------------------------------------------------------------------------ the nodes


class Cluster:
    """Two nodes, their keys, configurations and daemons (see the module docstring).

    Args:
        folder: where keys, configurations, runtime folders and the engine's socket go.
        daemon_args: extra ``slotsyncd`` flags for every daemon (deadlines, ``liveness_s``).
        nodes: how many namespaces to make (a third one holds a stranger's daemon).
    """

    def __init__(self, folder: Path, daemon_args: list[str] | None = None,
                 nodes: int = 2) -> None:
        self.folder = folder
        self.daemon_args = list(daemon_args or [])
        self.engine_sock = folder / "engine.sock"
        self.engine_url = f"unix://{self.engine_sock}"
        self.public = folder / "public"  # every node's allow-list: <node>.key of both
        self.net = Nodes(nodes)
        self.daemons: list[DaemonProcess | None] = [None] * nodes
        try:
            for name in NODES:
                self.make_node_keys(name, folder / "keys" / name, self.public)
            for k in range(len(NODES)):
                self.start(k)
        except BaseException:
            self.close()
            raise

    @property
    def owner_address(self) -> str:
        return f"tcp://{self.net.address(OWNER)}:{PEER_PORT}"

    @staticmethod
    def make_node_keys(name: str, folder: Path, public: Path) -> Path:
        """A key pair for node ``name`` in ``folder``, its public half copied into
        ``public``; returns the secret file."""
        pub, secret = make_keys(name, folder)
        public.mkdir(parents=True, exist_ok=True)
        shutil.copy(pub, public / pub.name)
        return secret

    def config_text(self, k: int, *, node: str | None = None, secret: Path | None = None,
                    public: Path | None = None,
                    parts: list[tuple[str, int, int]] | None = None) -> str:
        """The TOML of node ``k``'s daemon; the keyword arguments bend it (another node
        name, key pair, allow-list, or split of the ranks)."""
        name = node or NODES[k]
        secret = secret or self.folder / "keys" / name / f"{name}.key_secret"
        parts = parts or [(NODES[0], 0, PER_NODE), (NODES[1], PER_NODE, WORKERS)]
        text = (f'node = "{name}"\n'
                f'curve_secret_key = "{secret}"\n'
                f'peer_public_keys = "{public or self.public}"\n')
        if k == OWNER:
            text += f'peer_listen = "{self.owner_address}"\n'
        nodes = ", ".join(f'{{node = "{n}", ranks = [{a}, {b}]}}' for n, a, b in parts)
        text += ("\n[[engines]]\n"
                 f'url = "{self.engine_url}"\n'
                 f"slot_start = {SLOT[0]}\nslot_size = {SLOT[1]}\n"
                 "gpu_uuids = [" + ", ".join(f'"{u}"' for u in UUIDS) + "]\n"
                 f'owner = "{NODES[OWNER]}"\n'
                 f'owner_address = "{self.owner_address}"\n'
                 f"nodes = [{nodes}]\n")
        return text

    def start(self, k: int, config: str | None = None, tag: str = "") -> DaemonProcess:
        """Start a daemon inside node ``k`` (with ``config``, default its own TOML), in
        runtime folder ``n<k><tag>``; a daemon already there for ``k`` must be stopped."""
        path = self.folder / f"node{k}{tag}.toml"
        path.write_text(config if config is not None else self.config_text(k))
        d = DaemonProcess(runtime_dir=str(self.folder / f"n{k}{tag}"), netns=self.net.names[k],
                          args=["--config", str(path), *self.daemon_args])
        if not tag:
            self.daemons[k] = d
        return d

    def daemon(self, k: int) -> DaemonProcess:
        d = self.daemons[k]
        assert d is not None, f"node {k} has no daemon now"
        return d

    def daemon_of(self, rank: int) -> DaemonProcess:
        """The daemon rank ``rank`` publishes to (its node's)."""
        return self.daemon(node_of(rank))

    def endpoint_of(self, rank: int) -> str:
        return self.daemon_of(rank).endpoint

    def kill(self, k: int) -> None:
        """SIGKILL node ``k``'s daemon (no cleanup at all)."""
        d = self.daemon(k)
        d.proc.kill()
        d.proc.wait()
        d.stop()
        self.daemons[k] = None

    def restart(self, k: int) -> DaemonProcess:
        """Stop node ``k``'s daemon (if running) and start it again, same configuration and
        runtime folder."""
        if self.daemons[k] is not None:
            self.daemon(k).stop()
        return self.start(k)

    def link(self, k: int, peer: str) -> dict | None:
        """Node ``k``'s daemon's ``/status`` entry of its link to ``peer`` (None: no
        daemon or no such link)."""
        d = self.daemons[k]
        if d is None or d.proc.poll() is not None:
            return None
        try:
            links = d.status().get("peers", {}).get("links", [])
        except OSError:
            return None
        return next((lk for lk in links if lk["node"] == peer), None)

    def links_up(self) -> bool:
        """Both ends of the owner's link to node1 say up."""
        a, b = self.link(0, NODES[1]), self.link(1, NODES[0])
        return bool(a and a["up"] and b and b["up"])

    def wait_links_up(self, timeout_s: float = 15.0) -> None:
        assert wait_for(self.links_up, timeout_s, 0.1), (
            f"peer link not up within {timeout_s} s: node0 {self.link(0, NODES[1])}, "
            f"node1 {self.link(1, NODES[0])}\n{self.logs()}")

    def logs(self, n: int = 3000) -> str:
        return "\n".join(f"--- node{k} daemon log:\n{d.log_tail(n)}"
                         for k, d in enumerate(self.daemons) if d is not None)

    def close(self) -> None:
        for d in self.daemons:
            if d is not None:
                d.stop()
        self.net.close()


# ------------------------------------------------------------------------------ rank-local


def publish_rank_local(cluster: Cluster, seed: int, version: str, packed: bool,
                       timeout_s: float = 60.0) -> dict[int, BaseException | int]:
    """Every rank, in a thread of this process, publishes ``ep_rank_tensors(rank, seed)``
    rank-locally (list form) to its own node's daemon, chunks of 64 bytes; every rank
    registers before any begins. Returns each rank's chunk count, or its error."""
    out: dict[int, BaseException | int] = {}
    registered = threading.Barrier(WORKERS, timeout=timeout_s)

    def rank(r: int) -> None:
        try:
            with Publisher(cluster.endpoint_of(r), r, SLOT, cluster.engine_url,
                           transport="shm", packed=packed, staging_bytes=64,
                           timeout_s=timeout_s, rank_local=True) as pub:
                pub.register()
                registered.wait()
                out[r] = pub.publish(ep_rank_tensors(r, seed), version).chunks
        except BaseException as e:  # noqa: BLE001 - the caller checks
            out[r] = e
            registered.abort()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(WORKERS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, timeout_s * 2 - (time.monotonic() - t0)))
    assert len(out) == WORKERS, (out, cluster.logs())
    return out

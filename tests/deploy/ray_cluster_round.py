"""The body of ``tests/deploy/test_ray_cluster.py``: a local two-node Ray cluster
(``ray.cluster_utils.Cluster``, CPU), ``deploy/ray/start_node_daemons.py`` starting one
``slotsyncd`` per node for one engine over both nodes, trainer ranks as Ray actors on both
nodes publishing into one reference engine, then the daemons stopped.

Run by the test inside a fresh network, PID and mount namespace (``unshare -n -p -f -m
--mount-proc``, loopback up), so that Ray binds loopback only and whatever this leaves
running ends with the namespace. Writes a JSON report to ``argv[1]`` (what the test
asserts on), step by step, so that a failure still says how far it got.

    python tests/deploy/ray_cluster_round.py REPORT.json
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

LOOPBACK = "127.0.0.1"
ROUNDS = 2
RANKS_PER_NODE = 2


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s")
        time.sleep(0.1)


def namespace_cpu_seconds() -> float:
    """CPU seconds (user + system) of every process of this PID namespace, live or zombie,
    with the children they reaped: what the run cost (``/proc`` is the namespace's own)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / tick


def main(report_path: str) -> int:
    report: dict = {"steps": [], "started": time.time()}

    def step(name: str, **fields) -> None:
        report["steps"].append(name)
        report.update(fields)
        report.setdefault("times", {})[name] = round(time.time() - report["started"], 1)
        Path(report_path).write_text(json.dumps(report, indent=1, default=str))

    # Ray's session folders under this run's temp folder (the leak check watches it).
    ray_tmp = tempfile.mkdtemp(prefix="ray-")
    os.environ["RAY_TMPDIR"] = ray_tmp
    import ray
    import start_node_daemons as snd
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from slotsync.engine.checksum import checksums_by_worker, tensor_checksum
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.testing.tensors import make_tensors

    @ray.remote(num_cpus=0)
    class Rank:
        """A trainer rank: finds its node's daemon from its own Ray node id, as a trainer
        would, and publishes ``ROUNDS`` rounds of the test tensors."""

        def run(self, rank: int, slot: tuple[int, int], url: str) -> dict:
            import ray as ray_

            from slotsync.testing.ranks import rank_publisher
            from slotsync.testing.tensors import make_tensors as tensors

            node_id = ray_.get_runtime_context().get_node_id()
            endpoint = snd.endpoint_for_node(node_id)
            pub = rank_publisher(endpoint, rank, slot, url, packed=True,
                                 staging_bytes=40_000, timeout_s=150.0)
            rounds = []
            try:
                pub.register()
                for k in range(1, ROUNDS + 1):
                    stats = pub.publish(tensors(k), weight_version=f"v{k}")
                    rounds.append({"round": k, "chunks": stats.chunks})
            except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
                rounds.append({"error": f"{type(e).__name__}: {e}"})
            finally:
                pub.close()
            return {"rank": rank, "node_id": node_id, "endpoint": endpoint,
                    "pid": os.getpid(), "rounds": rounds}

    cluster = engine = None
    infos: dict = {}
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False})
        cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address=LOOPBACK, namespace=snd.NAMESPACE)
        head = cluster.head_node.node_id
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        other = next(n for n in nodes if n != head)
        step("cluster", nodes=nodes, head=head,
             addresses=sorted({n["NodeManagerAddress"] for n in ray.nodes()}))

        n = 2 * RANKS_PER_NODE
        engine = ReferenceEngine(workers=n)
        table = [{"url": engine.url, "slot_start": 0, "slot_size": n, "owner": head,
                  "nodes": [{"node": head, "ranks": [0, RANKS_PER_NODE]},
                            {"node": other, "ranks": [RANKS_PER_NODE, n]}]}]
        # peer_port / status_port 0: both "nodes" share this host's loopback.
        infos = snd.start_node_daemons(table, status_port=0, peer_port=0)
        status = {nid: f"http://{LOOPBACK}:{i['status_port']}/status" for nid, i in infos.items()}
        step("daemons", infos=infos, configs={
            nid: Path(snd.runtime_dir_for_node(nid), "slotsyncd.toml").read_text()
            for nid in infos})
        # The relay's link to the owner (a CURVE handshake) before the ranks begin.
        _wait(lambda: any(link["up"] for link in
                          _get(status[other]).get("peers", {}).get("links", [])),
              30, "the relay's peer link up")
        step("link")

        ranks = [Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            head if r < RANKS_PER_NODE else other, soft=False)).remote() for r in range(n)]
        results = ray.get([a.run.remote(r, (0, n), engine.url) for r, a in enumerate(ranks)],
                          timeout=180)
        step("ranks", ranks=results)

        status_, body = engine.request("POST", "/weight_checker", {"action": "checksum"})
        want = {k: tensor_checksum(t) for k, t in make_tensors(ROUNDS)}
        by_worker = checksums_by_worker(body)
        step("checksums", checksum_status=status_, workers=len(by_worker),
             workers_equal=[{k: sums.get(k) for k in want} == want
                            for sums in by_worker.values()],
             weight_version=engine.request("GET", "/weight_info")[1]["weight_version"],
             engine_paused=engine.request("GET", "/is_paused")[1]["is_paused"],
             owner_status=_get(status[head]), relay_status=_get(status[other]))
        for a in ranks:
            ray.kill(a)

        pids = [i["pid"] for i in infos.values()]
        codes = snd.stop_node_daemons(timeout_s=30)

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        step("stopped", exit_codes=codes,
             daemons_gone=_wait(lambda: all(gone(p) for p in pids), 10, "daemons exited"),
             keys_left=[str(p) for nid in infos
                        for p in Path(snd.runtime_dir_for_node(nid)).glob("keys*")])
        return 0
    except Exception:  # noqa: BLE001 - the report says where, the test fails on it
        report["error"] = traceback.format_exc()
        for nid in infos:
            try:
                report.setdefault("daemon_logs", {})[nid] = Path(
                    snd.runtime_dir_for_node(nid), "slotsyncd.log").read_text()[-4000:]
            except OSError:
                pass
        step("failed")
        return 1
    finally:
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
            if engine is not None:
                engine.stop()
            for nid in infos:
                shutil.rmtree(snd.runtime_dir_for_node(nid), ignore_errors=True)
            shutil.rmtree(ray_tmp, ignore_errors=True)
            report["total_seconds"] = round(time.time() - report["started"], 1)
            report["cpu_seconds"] = round(namespace_cpu_seconds(), 1)
            Path(report_path).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

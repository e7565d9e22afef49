"""Issue 25 H on one GPU: one 8-worker engine fed by the daemons of two "nodes" (8 logical
GPU UUIDs on cuda:0; ranks 0-3 publish to node0's daemon, which drives the engine, ranks 4-7
to node1's, which relays their frames over the CURVE peer link on loopback), the workers
loading every update through **vLLM's own receive path** (``--receive vllm``, from vllm or
the shim of ``tools/vllm_shim.py``): several rounds packed and unpacked, every worker's
checksums equal the trainers' tensors.

Skips without CUDA, or when neither vllm nor the shim imports."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from spawned_ranks import rounds, run_ranks  # noqa: E402
from test_gpu_vllm_receive import RANKS, _assert_checksums, _engine, vllm_env  # noqa: E402,F401
from two_nodes import TwoNodes  # noqa: E402

pytestmark = pytest.mark.gpu
ROUNDS = 6


def test_two_nodes_daemons_feed_one_engine_through_vllms_receive_path(vllm_env):  # noqa: F811
    with _engine(vllm_env) as eng, TwoNodes(eng.url, RANKS // 2) as nodes:
        for i, (name, packed) in enumerate([("packed", True), ("unpacked", False)]):
            first = 1 + i * ROUNDS
            script = {"rounds": ROUNDS, "cuda": True, "first_round": first}
            t0 = time.monotonic()
            ev = run_ranks(nodes.daemons[0], eng.url, packed, [script] * RANKS, timeout_s=400,
                           daemon_of=nodes.daemon_of)
            for r in range(RANKS):
                assert [e["status"] for e in rounds(ev, r)] == ["ok"] * ROUNDS, (name, ev[r])
            _assert_checksums(eng, first + ROUNDS - 1)
            stats = eng.request("GET", "/_slotsync/stats")[1]
            assert all(w["receive"] == "vllm" for w in stats["workers"]), stats["workers"]
            print(f"{name}: {ROUNDS} rounds x {RANKS} ranks over two nodes' daemons through "
                  f"vLLM's receive path in {time.monotonic() - t0:.1f} s; checksums equal on "
                  f"{RANKS} workers")
        owner, relaying = (d.status() for d in nodes.daemons)
        slot = owner["slots"][0]
        assert slot["updates_succeeded"] == 2 * ROUNDS and slot["state"] == "idle"
        assert sorted(r["node"] for r in slot["ranks"]) == ["node0"] * 4 + ["node1"] * 4
        (link,) = relaying["peers"]["links"]
        assert link["up"] and link["node"] == "node0" and link["messages_out"] > 0
        print(f"owner's ranks by node: {[(r['rank'], r['node']) for r in slot['ranks']]}; "
              f"node1's link to node0: up, {link['messages_out']} messages out, "
              f"{link['messages_in']} in, rtt {link['rtt_ms']} ms")

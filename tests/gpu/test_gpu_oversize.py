"""Issue 17 C on one GPU: tensors larger than the staging region, published over CUDA IPC
into a reference engine worker that loads every chunk through **vLLM's own receive path**
(``--receive vllm``: ``IPCWeightTransferEngine.receive_weights`` -> ``packed_ipc_consumer``
with its ``PackedBufferImporter``; from the installed vllm or the shim
``python tools/vllm_shim.py build/vllm-shim`` writes).

1 MiB staging, with 1 and with 4 regions; each round: small tensors, a 3 MiB contiguous bf16
tensor (exported in place), a transposed 2 MiB float32 one (a contiguous copy first), a
CPU-resident 1.5 MiB one (copied to the GPU first) and small ones between them, 3 rounds.
Checksums on the engine equal the trainer's after every round, the trainer's CUDA memory is
flat (nothing left allocated after a round), and the staging buffer handed out a fresh
export after every oversize chunk.

Skips without CUDA, or when neither vllm nor the shim imports."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import checksums_by_worker, tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402
from slotsync.protocol import Publisher  # noqa: E402
from slotsync.protocol.wire import logical_gpu_uuid  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
ROUNDS = 3


@pytest.fixture(scope="module")
def vllm_env() -> dict[str, str]:
    from slotsync.engine.reference.vllm_receive import receive_env

    env = receive_env(ROOT / "build" / "vllm-shim")
    if env is None:
        pytest.skip("vllm.distributed.weight_transfer.ipc_engine is not importable (no vllm; "
                    "run python tools/vllm_shim.py build/vllm-shim where vllm is installed)")
    return env


def _tensors(k: int) -> list[tuple[str, torch.Tensor]]:
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(k)

    def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    return [
        ("a.small", rnd(64, 64)),
        ("embed.big", rnd(1536, 1024)),  # 3 MiB bf16: its own memory
        ("b.small", rnd(128, dtype=torch.float32)),
        ("c.small", rnd(256, 256)),
        ("t.big", rnd(1024, 512, dtype=torch.float32).t()),  # 2 MiB, not contiguous
        ("cpu.big", rnd(768, 1024).cpu()),  # 1.5 MiB on the CPU: copied to the GPU
        ("d.small", rnd(16, dtype=torch.float32)),
    ]


@pytest.mark.parametrize("regions", [1, 4])
def test_oversize_tensors_through_vllms_packed_consumer(vllm_env, regions):
    uuid = logical_gpu_uuid(0)
    with ReferenceEngine(workers=1, device="cuda", gpu_uuids=[uuid], cuda_devices=[0],
                         receive="vllm", env=vllm_env, startup_timeout_s=300.0) as eng, \
            DaemonProcess() as d, \
            Publisher(d.endpoint, 0, (0, 1), eng.url, packed=True, transport="cuda",
                      device=0, gpu_uuid=uuid, staging_bytes=1 * MiB,
                      staging_buffers=regions, timeout_s=120) as pub:
        pub.register()
        left = []
        for k in range(1, ROUNDS + 1):
            named = _tensors(k)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            stats = pub.publish(named, f"v{k}")
            torch.cuda.synchronize()
            left.append(torch.cuda.memory_allocated() - base)
            # a | embed | b, c | t | cpu | d: each big one alone
            assert stats.chunks == 6, stats
            status, body = eng.request("POST", "/weight_checker", {"action": "checksum"})
            assert status == 200, body
            got = checksums_by_worker(body)[uuid]
            want = {n: tensor_checksum(t) for n, t in named}
            assert {n: got.get(n) for n in want} == want, f"round {k} differs"
            assert eng.request("GET", "/weight_info")[1]["weight_version"] == f"v{k}"
            staging = pub._exporter._staging
            if regions == 1:
                # vLLM's producer: one export per update, and a fresh one for the first
                # staging chunk after oversize chunks: chunks 0, 2 and 5 -> 3 per round
                assert staging is not None and staging.exports == 3 * k, staging.exports
        stats = eng.request("GET", "/_slotsync/stats")[1]
        assert all(w["receive"] == "vllm" for w in stats["workers"]), stats["workers"]
        # flat: the copies made for t.big and cpu.big and the staging block are freed
        assert all(n < MiB for n in left), left
        print(f"oversize, {regions} region(s): {ROUNDS} rounds through vLLM's packed consumer, "
              f"checksums equal; CUDA memory left per round: {left}")

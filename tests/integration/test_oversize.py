"""A tensor larger than ``staging_bytes`` through slotsyncd into an engine (issue 17 C), CPU,
shared memory: Qwen3's embedding (151,936 x 2,048 bf16 = 622 MB) with the default 512 MiB
staging into the reference engine, packed with 1 and with 4 staging regions and unpacked; a
smaller case (1 MiB staging, a few MiB tensors among small ones) against the vLLM-code engine
(vLLM's own router, ``Worker`` and payload parser). Checksums on every worker equal the
trainer's, and no shared-memory segment is left after the round.

Memory: the 622 MB case holds the tensor, its segment and the engine's copy (about 2 GB); one
round per mode, one engine for the module.
"""

from __future__ import annotations

import glob
import os

import pytest

torch = pytest.importorskip("torch")

from engines import start_engine  # noqa: E402
from state_readers import engine_checksums  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402
from slotsync.protocol import Publisher  # noqa: E402

pytestmark = pytest.mark.slow
MiB = 1 << 20


def _segments() -> list[str]:
    return glob.glob(f"/dev/shm/slotsync-{os.getpid()}-*")


@pytest.fixture(scope="module")
def embedding() -> torch.Tensor:
    g = torch.Generator().manual_seed(17)
    t = torch.empty(151936, 2048, dtype=torch.bfloat16)
    return t.uniform_(-0.1, 0.1, generator=g)


@pytest.fixture(scope="module")
def reference_engine():
    with ReferenceEngine(workers=1) as eng:
        yield eng


def _publish(eng, named, *, packed: bool, staging_bytes: int, regions: int,
             version: str) -> int:
    with DaemonProcess() as d, Publisher(d.endpoint, 0, (0, 1), eng.url, packed=packed,
                                         transport="shm", staging_bytes=staging_bytes,
                                         staging_buffers=regions, timeout_s=300) as pub:
        stats = pub.publish(named, version)
    return stats.chunks


@pytest.mark.parametrize(("packed", "regions"), [(True, 1), (True, 4), (False, 4)],
                         ids=["packed-1-region", "packed-4-regions", "unpacked"])
def test_qwen3_embedding_with_512_mib_staging(reference_engine, embedding, packed, regions):
    version = f"emb-{'p' if packed else 'u'}{regions}"
    with torch.no_grad():
        embedding[0, 0] = float(len(version) + regions + packed)  # differs between modes
    named = [("model.norm.weight", torch.ones(2048, dtype=torch.bfloat16)),
             ("model.embed_tokens.weight", embedding),
             ("model.layers.0.mlp.up_proj.weight", torch.full((64, 32), 0.5))]
    before = set(_segments())
    chunks = _publish(reference_engine, named, packed=packed, staging_bytes=512 * MiB,
                      regions=regions, version=version)
    assert chunks == 3  # the embedding alone, between the two small ones
    assert set(_segments()) == before
    want = {n: tensor_checksum(t) for n, t in named}
    for worker, sums in engine_checksums(reference_engine).items():
        assert {n: sums.get(n) for n in want} == want, worker
    assert reference_engine.request("GET", "/weight_info")[1]["weight_version"] == version


def _few_mib() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        ("a.weight", torch.randn(64, 64, generator=g)),
        ("big.weight", torch.randn(1024, 768, generator=g).to(torch.bfloat16)),  # 1.5 MiB
        ("b.weight", torch.randn(128, generator=g)),
        ("wide.weight", torch.randn(512, 1024, generator=g).t()),  # 2 MiB, not contiguous
        ("c.weight", torch.randn(32, 32, generator=g).to(torch.float16)),
    ]


@pytest.mark.vllm
@pytest.mark.parametrize(("packed", "regions"), [(True, 1), (True, 4), (False, 4)],
                         ids=["packed-1-region", "packed-4-regions", "unpacked"])
def test_oversize_tensors_into_the_vllm_code_engine(packed, regions):
    named = _few_mib()
    with start_engine(workers=1, named=[(n, t.contiguous()) for n, t in named],
                      impl_name="vllm") as eng:
        before = set(_segments())
        for k in (1, 2):  # the second round: vLLM's engine already holds the weights
            round_named = [(n, t * k) for n, t in named]
            round_named[3] = ("wide.weight", (named[3][1].t() * k).t())  # still transposed
            chunks = _publish(eng, round_named, packed=packed, staging_bytes=1 * MiB,
                              regions=regions, version=f"v{k}")
            assert chunks == 5  # a | big | b | wide | c: each big one alone
            want = {n: tensor_checksum(t) for n, t in round_named}
            sums_by_worker = engine_checksums(eng)
            assert len(sums_by_worker) == 1
            for worker, sums in sums_by_worker.items():
                assert {n: sums.get(n) for n in want} == want, (k, worker)
        assert set(_segments()) == before

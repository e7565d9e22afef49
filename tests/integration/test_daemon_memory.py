"""The daemon's memory stays flat over many rounds (issue 14 defect 8).

On CUDA every update exports its staging block anew, so the handle caches of
``daemon/torch_pickle.py`` (keyed by the handles' values) never hit across updates: with room
for 65,536 entries they grew the daemon from 50.7 to 65.0 MB over a 1,000-round soak. These
tests merge the packed chunks of many updates with fresh CUDA handles and check that what the
caches keep is bounded; and that the soak's verdict flags a growth of 1 % per 100 rounds."""

from __future__ import annotations

import os

import pytest

from slotsync.bench.soak import verdict
from slotsync.daemon import torch_pickle as vllm_pickle  # (the caches live there)
from slotsync.daemon.vllm.merge import merge_chunk
from slotsync.protocol.wire import Chunk, CudaIpcHandle, logical_gpu_uuid


def _export(nbytes: int, rank: int) -> CudaIpcHandle:
    """A fresh CUDA export of a uint8 staging region: new IPC and event handles, as every
    update's staging block has."""
    return CudaIpcHandle("torch.Tensor", (nbytes,), (1,), 0, "torch.storage.TypedStorage",
                         "uint8", rank, os.urandom(66), nbytes, 0, False,
                         b"/torch_%d_1" % rank, 0, os.urandom(64), True)


def test_handle_caches_stay_bounded_over_many_cuda_updates():
    ranks, regions, updates = 8, 4, 400
    uuids = {r: logical_gpu_uuid(r) for r in range(ranks)}
    vllm_pickle._fragment.cache_clear()
    vllm_pickle._bytes.cache_clear()
    for _ in range(updates):
        exports = {r: [_export(1 << 20, r) for _ in range(regions)] for r in range(ranks)}
        for k in range(2 * regions):  # each region serves two chunks of the update
            got = {r: Chunk(0, k, ["w"], ["float32"], [[4]], [16], [exports[r][k % regions]])
                   for r in range(ranks)}
            merge_chunk(k, got, uuids, packed=True, transport="cuda", world_size=ranks)
    # 400 updates x 8 ranks x 4 regions = 12,800 distinct exports
    assert vllm_pickle._fragment.cache_info().currsize <= vllm_pickle.FRAGMENT_CACHE_SIZE
    assert vllm_pickle.FRAGMENT_CACHE_SIZE <= 2048
    assert vllm_pickle._bytes.cache_info().currsize < 64  # nothing per export
    # ... while within one update a region's export is still encoded once
    assert vllm_pickle._fragment.cache_info().hits >= updates * ranks * regions


def _samples(daemon_kb: list[int], every: int = 100) -> list[dict]:
    return [{"round": every * (i + 1), "daemon_rss_kb": kb, "daemon_fds": 20,
             "engine_rss_kb": 400_000, "engine_fds": 40, "shm_segments": 0, "shm_bytes": 0,
             "cuda_allocated": None} for i, kb in enumerate(daemon_kb)]


@pytest.mark.parametrize("per_100", [0.01, 0.035])
def test_soak_verdict_flags_one_percent_growth_per_100_rounds(per_100):
    """1 % per 100 rounds (and the 3.5 % of issue 14's CUDA soak) is growth, even though the
    last sample is within the old verdict's 8 MiB / 5 % slack for 1 %."""
    base = 50_000
    flat, line = verdict(_samples([round(base * (1 + per_100 * i)) for i in range(9)]))
    assert not flat and "GROWTH" in line and "daemon_rss_kb" in line


def test_soak_verdict_lets_noise_and_one_time_steps_pass():
    noisy = [50_000, 50_400, 49_900, 50_300, 50_100, 50_200, 49_800, 50_300, 50_100]
    flat, line = verdict(_samples(noisy))
    assert flat, line
    short = verdict(_samples([50_000, 50_600, 50_700], every=10))  # a short test soak
    assert short[0], short[1]
    pool = _samples([50_000] * 10)  # one more pooled engine connection at the last sample
    pool[-1]["daemon_fds"] = 21
    assert verdict(pool)[0]
    leak = _samples([50_000] * 10)  # one fd more every round: every late sample is higher
    for i, x in enumerate(leak):
        x["daemon_fds"] = 20 + i
    assert not verdict(leak)[0] and "daemon_fds" in verdict(leak)[1]

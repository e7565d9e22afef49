"""Every dtype the wire allows (``wire.DTYPE_SIZES``: the floats, the five float8 kinds,
``float4_e2m1fn_x2``, signed and unsigned integers, bool; issue 17 D) through slotsyncd into
an engine, packed and unpacked, in one update carrying one tensor of each dtype, its checksum
checked by name: against the reference engine and against the vLLM-code engine (vLLM's own
router, ``Worker`` and payload parser, which views each packed piece as its dtype:
``packed_tensor.unpack_tensor``; its model is a safetensors file of the same tensors). The
tensors are random bytes viewed as each dtype (bool: 0 or 1), so every bit pattern travels.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engines import start_engine, vllm_importable  # noqa: E402
from state_readers import engine_checksums  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.protocol import Publisher  # noqa: E402
from slotsync.protocol.wire import DTYPE_SIZES  # noqa: E402

pytestmark = pytest.mark.slow


# The vLLM-code engine's worker turns on torch's deterministic fill of uninitialized memory
# (slotsync/engine/vllm/worker.py, so that what layerwise reload leaves unset shows in a
# checksum); torch 2.13 has no fill for this dtype ("fill_empty_deterministic_" not
# implemented for 'Float4_e2m1fn_x2'), raised in materialize_meta_tensor's empty_strided.
# That is our test engine's setting, not vLLM's code: left out there until the worker fills
# it another way (issue 17 D, reported).
NOT_ON_VLLM_CODE_ENGINE = {"float4_e2m1fn_x2"}


def every_dtype(seed: int, leave_out: set[str] = frozenset()) -> list[tuple[str, torch.Tensor]]:
    """One (12, 8) tensor per dtype of ``wire.DTYPE_SIZES`` (but ``leave_out``), named
    ``w_<dtype>.weight``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, size in sorted(DTYPE_SIZES.items()):
        if name in leave_out:
            continue
        dtype = getattr(torch, name)
        if dtype == torch.bool:
            t = torch.randint(0, 2, (12, 8), generator=g, dtype=torch.uint8).bool()
        else:
            raw = torch.randint(0, 256, (12, 8 * size), generator=g, dtype=torch.uint8)
            t = raw.view(dtype)
        assert t.shape == (12, 8) and t.dtype == dtype
        out.append((f"w_{name}.weight", t))
    return out


@pytest.fixture(scope="module", params=["reference", "vllm"])
def engine(request: pytest.FixtureRequest):
    if request.param == "vllm":
        request.applymarker(pytest.mark.vllm)
        why = vllm_importable()
        if why:
            pytest.skip(f"vllm cannot be imported: {why}")
    leave_out = NOT_ON_VLLM_CODE_ENGINE if request.param == "vllm" else set()
    with start_engine(workers=1, named=every_dtype(0, leave_out),
                      impl_name=request.param) as eng:
        yield eng, leave_out


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_every_dtype_round(engine, packed):
    engine, leave_out = engine
    named = every_dtype(1 + packed, leave_out)
    # small staging: several chunks, dtypes of different sizes side by side in one region
    with DaemonProcess() as d, Publisher(d.endpoint, 0, (0, 1), engine.url, packed=packed,
                                         transport="shm", staging_bytes=1024,
                                         timeout_s=120) as pub:
        stats = pub.publish(named, f"dtypes-{packed}")
    assert stats.chunks > 1
    want = {n: tensor_checksum(t) for n, t in named}
    (sums,) = engine_checksums(engine).values()
    differ = {n: (sums.get(n), w) for n, w in want.items() if sums.get(n) != w}
    assert not differ, sorted(differ)

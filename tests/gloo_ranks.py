"""Gloo ranks for the FSDP2 tests on the CPU: ``WORLD`` spawned processes in one process
group, each running the test's function and sending back what it found, and the tensors they
build alike -- a full tensor of any dtype, and its DTensor cut as FSDP2 cuts it. Used by
``tests/unit/test_fsdp_pack.py`` (where these lived), ``test_publish_adapter_fsdp.py``
(issue 36), which imported them from that test module, and
``tests/integration/test_fsdp_source.py``, which had its own copy of the spawn.

3 ranks, so that dim 0 shards unevenly: 5 rows are 2 + 2 + 1, 4 rows are 2 + 2 + 0, 1 row is
1 + 0 + 0. Import this module after the caller's checks that torch.distributed with Gloo
is there (it imports torch)."""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch

WORLD = 3


def spawn_ranks(target: Callable[[int], dict[str, Any]], world: int = WORLD,
                timeout_s: float = 240.0, why: Callable[[], str] = str
                ) -> list[dict[str, Any]]:
    """Run ``target(rank)`` in ``world`` spawned processes of one Gloo group (a free loopback
    port); each returns a dict of findings (or ``{"error": traceback}``, which fails the
    test here, with ``why()``: e.g. a daemon's log tail). Returns them by rank; ``target``
    must pickle (a module-level function, or a ``functools.partial`` of one).

    The group is made again once, on another port, when its first making failed in Gloo's
    connect (the free port taken meanwhile by a test running beside it: a fresh-clone run
    saw "connectFullMesh failed ... Connection closed by peer" once); ``target``'s own
    failures are never retried."""
    for attempt in (1, 2):
        try:
            return _spawn_once(target, world, timeout_s, why)
        except AssertionError as e:
            if attempt == 2 or "connectFullMesh" not in str(e):
                raise
    raise AssertionError("unreachable")


def _spawn_once(target: Callable[[int], dict[str, Any]], world: int, timeout_s: float,
                why: Callable[[], str]) -> list[dict[str, Any]]:
    from spawned_ranks import rank_context

    from slotsync.testing.ports import free_port

    ctx = rank_context()  # (warm: torch imported once)
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, target, q))
             for r in range(world)]
    for p in procs:
        p.start()
    found: dict[int, dict[str, Any]] = {}
    try:
        while len(found) < world:
            try:
                rank, result = q.get(timeout=timeout_s)
            except queue.Empty:
                break
            found[rank] = result
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert len(found) == world, f"only ranks {sorted(found)} reported\n{why()}"
    for r in range(world):
        assert "error" not in found[r], f"rank {r}:\n{found[r]['error']}\n{why()}"
    return [found[r] for r in range(world)]


def _rank_main(rank: int, world: int, port: int, target: Callable[[int], dict[str, Any]],
               q: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            result = target(rank)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        result = {"error": traceback.format_exc()}
    q.put((rank, result))


def full_alike(shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    """A full tensor every rank builds alike (any dtype: random bytes viewed as it)."""
    g = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * elem,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    elif dtype == torch.float8_e8m0fnu:
        raw = raw % 255  # 0xff is its NaN
    return raw.view(dtype).view(shape)


def sharded(full: Any, mesh: Any, placement: Any) -> Any:
    """A DTensor of ``full`` with ``placement`` on 1-D ``mesh``, cut as FSDP2 cuts (Shard(0):
    ``torch.chunk`` rows; Shard(1) likewise on dim 1)."""
    from torch.distributed.tensor import DTensor, Shard

    me, world = mesh.get_local_rank(), mesh.size()
    local = full
    if isinstance(placement, Shard):
        dim = placement.dim
        rows = -(-full.shape[dim] // world)
        local = full.narrow(dim, min(me * rows, full.shape[dim]),
                            max(0, min(rows, full.shape[dim] - me * rows))).contiguous()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=full.shape,
                              stride=full.stride())

"""The ``Publisher`` of a trainer rank that a test, benchmark or the demo starts (issue 16:
this set-up was written out four times, in ``tests/trainer_script.py``, ``bench/gpu.py``,
``bench/soak.py`` and ``demo/ranks.py``)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from slotsync.protocol.rank.publisher import Publisher
from slotsync.protocol.topology import EngineSlot
from slotsync.protocol.wire import logical_gpu_uuid


def rank_publisher(
    endpoint: str,
    rank: int,
    slot: EngineSlot | tuple[int, int],
    engine_url: str,
    *,
    device: torch.device | str | None = None,
    gpu_uuid: str | Literal["logical"] | None = "logical",
    **kw: Any,
) -> Publisher:
    """A (not yet registered) ``Publisher`` for ``rank``: CUDA IPC from ``device`` when it is a
    CUDA device, else shared memory (``transport="shm"``, whatever CUDA is visible).

    Args:
        endpoint: the daemon's ZeroMQ endpoint (``DaemonProcess.endpoint``).
        rank: the rank's global rank; must lie in ``slot``.
        slot: its engine slot, ``(start, count)`` or an ``EngineSlot``.
        engine_url: the engine's base URL (``http://127.0.0.1:<port>``).
        device: the rank's device (``"cuda:0"``, ``torch.device("cuda", 1)``, ``"cpu"``);
            None: CPU.
        gpu_uuid: on CUDA only (ignored on CPU): ``"logical"`` (default) gives the rank the
            logical UUID ``logical_gpu_uuid(rank - slot start)`` so that several ranks can
            share one physical GPU (the engine's workers get the same ones); a string is used
            as is; None means the device's real UUID.
        **kw: the other ``Publisher`` keyword arguments (``packed``, ``staging_bytes``,
            ``staging_buffers``, ``timeout_s``, ``liveness_s``).

    Raises:
        ValueError, TypeError: as ``Publisher`` (rank outside its slot, bad arguments, no CUDA
            for a CUDA device).
    """
    slot = slot if isinstance(slot, EngineSlot) else EngineSlot(*slot)
    cuda = device is not None and torch.device(device).type == "cuda"
    if not cuda:
        return Publisher(endpoint, rank, slot, engine_url, transport="shm", **kw)
    uuid = logical_gpu_uuid(rank - slot.start) if gpu_uuid == "logical" else gpu_uuid
    return Publisher(endpoint, rank, slot, engine_url, transport="cuda", device=device,
                     gpu_uuid=uuid, **kw)

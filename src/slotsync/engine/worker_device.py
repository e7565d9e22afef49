"""A worker process's device and the GPU UUID it answers to (the reference and the vLLM-code
engines' workers alike).

Shared by the engine families (``slotsync.engine.reference.worker_state``,
``slotsync.engine.vllm.worker``); imports torch only.
"""

from __future__ import annotations

import torch


def worker_device(device: str, gpu_uuid: str | None) -> tuple[torch.device, str]:
    """A worker process's device (made current on CUDA) and the GPU UUID it answers to: the
    given (logical) one, else on CUDA the device's real one
    (``str(torch.cuda.get_device_properties(i).uuid)``, vLLM's lookup).

    Raises:
        ValueError: a CPU worker without a GPU UUID.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        return dev, gpu_uuid or str(torch.cuda.get_device_properties(dev).uuid)
    if gpu_uuid is None:
        raise ValueError("a CPU worker needs an explicit (logical) GPU UUID")
    return dev, gpu_uuid

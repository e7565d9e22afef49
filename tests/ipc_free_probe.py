"""The torch property SGLang's buffer fence rests on, measured in two processes on one GPU
(docs/sglang-contract.md 5.2 and its appendix script; tests/gpu/test_gpu_sglang.py runs it).

torch's consumer-side storage of a received CUDA-IPC tensor (``THPStorage_newSharedCuda``,
``torch/csrc/StorageSharing.cpp``) has a deleter that, when the last reference dies, runs
``stream_synchronize(getCurrentCUDAStream(device))`` before it lets the producer's memory go.
So a consumer whose copies out of the tensor were queued on its *current* stream has finished
them once it freed the tensor -- which is what SGLang's scheduler does: its whole event loop
runs inside ``StreamContext(schedule_stream)`` (``srt/managers/scheduler.py`` L2008, 0.5.23),
so the weight copies and the free both see ``schedule_stream``.

Two things in that deleter wait, in this order: dropping the consumer's mapping of the
producer's allocation (``cudaIpcCloseMemHandle``, when no other received storage of the same
allocation keeps it open: torch opens each allocation once per process and shares the
mapping) -- measured on an H200 with torch 2.11 / CUDA 13 to wait for the device's work like
a ``cudaFree`` -- and ``stream_synchronize`` of the current stream, which is all that waits
when the mapping stays open (another tensor of the same producer block, e.g. the next staging
region, or the other tensors of an unpacked chunk, still received).

:func:`consumer` runs in a spawned process with a non-default stream current for its life (as
SGLang's scheduler); per case it queues ``torch.cuda._sleep(cycles)`` (GPU work, no host
sleep) and then a copy out of a received tensor, drops the tensor, and reports whether the
copy was done right after it was queued (``issued``: where SGLang's reply would go out) and
after the drop (``after``), and how long the drop took (``del_s``, seconds):

* ``freed``: the last reference, the copy stream current: done (it waited);
* ``view_kept``: a view of the tensor survives: not done (no free, no wait -- why a model's
  ``load_weights`` that kept a view would break the fence);
* ``other_stream``: the last reference while another (idle) stream is current: reported
  only (torch 2.11 / CUDA 13: done, the mapping's close waited);
* ``mapping_shared``: the last reference to this tensor while another received tensor of
  the same producer allocation keeps the mapping open, the copy stream current: done (the
  current-stream sync alone);
* ``mapping_shared_other_stream``: the same with another stream current: not done -- so the
  free must happen where the copies' stream is current, as in SGLang's scheduler.

The producer sends one tensor per case, the ``mapping_shared`` cases two (the one kept first:
both of one caching-allocator segment, :data:`PAIRED`).
"""

from __future__ import annotations

import time
from typing import Any

CASES = ("freed", "view_kept", "other_stream", "mapping_shared", "mapping_shared_other_stream")
"""The cases, in the order the consumer runs them."""
PAIRED = ("mapping_shared", "mapping_shared_other_stream")
"""Cases whose tensor comes after a kept tensor of the same producer allocation."""
IDLE_STREAM = ("other_stream", "mapping_shared_other_stream")
"""Cases that drop the tensor with another stream current."""


def consumer(tensors: Any, results: Any, cycles: int) -> None:
    """The consumer process (see the module docstring): reads the producer's tensors from
    ``tensors``, puts ``{case: {"issued": bool, "after": bool, "del_s": float}}`` on
    ``results``, then waits for everything it queued before it returns."""
    import torch

    torch.cuda.set_device(0)
    copy_stream = torch.cuda.Stream()
    idle_stream = torch.cuda.Stream()
    torch.cuda.set_stream(copy_stream)  # current for the process's life, as schedule_stream
    out: dict[str, dict[str, Any]] = {}
    for case in CASES:
        mapping = tensors.get() if case in PAIRED else None  # keeps the mapping open
        t = tensors.get()
        dst = torch.empty_like(t)
        torch.cuda._sleep(cycles)
        dst.copy_(t)
        done = torch.cuda.Event()
        done.record()
        issued = done.query()
        view = t[:1] if case == "view_kept" else None
        t0 = time.perf_counter()
        if case in IDLE_STREAM:
            with torch.cuda.stream(idle_stream):
                del t
        else:
            del t
        del_s = time.perf_counter() - t0
        out[case] = {"issued": issued, "after": done.query(), "del_s": round(del_s, 3)}
        copy_stream.synchronize()  # (the next case starts from an idle stream)
        del view, mapping
    results.put(out)
    torch.cuda.synchronize()

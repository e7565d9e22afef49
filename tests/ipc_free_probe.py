"""The torch property SGLang's buffer fence rests on, measured in two processes on one GPU
(docs/sglang-contract.md 5.2 and its appendix script; tests/gpu/test_gpu_sglang.py runs it).

torch's consumer-side storage of a received CUDA-IPC tensor (``THPStorage_newSharedCuda``,
``torch/csrc/StorageSharing.cpp``) has a deleter that, when the last reference dies, runs
``stream_synchronize(getCurrentCUDAStream(device))`` before it lets the producer's memory go.
So a consumer whose copies out of the tensor were queued on its *current* stream has finished
them once it freed the tensor -- which is what SGLang's scheduler does: its whole event loop
runs inside ``StreamContext(schedule_stream)`` (``srt/managers/scheduler.py`` L2008, 0.5.23),
so the weight copies and the free both see ``schedule_stream``.

:func:`consumer` runs in a spawned process with a non-default stream current for its life (as
SGLang's scheduler); per tensor the producer sends, it queues ``torch.cuda._sleep(cycles)``
(GPU work, no host sleep) and then the copy, and reports whether the copy is done:

* ``issued``: right after queuing it (where SGLang's reply would go out): not done;
* ``freed``: after ``del`` of the last reference: done, and how long the ``del`` took
  (seconds: it waited for the stream);
* ``view_kept``: after ``del`` while a view of the tensor survives: not done (no free, no
  sync -- why a model's ``load_weights`` that kept a view would break the fence);
* ``other_stream``: after ``del`` of the last reference while another stream (one with no
  work) is current: not done -- the deleter synchronizes the current stream only, so the
  free must happen where the copies' stream is current.
"""

from __future__ import annotations

import time
from typing import Any

CASES = ("freed", "view_kept", "other_stream")
"""The tensors the producer sends, in this order, one per case."""


def consumer(tensors: Any, results: Any, cycles: int) -> None:
    """The consumer process (see the module docstring): reads ``len(CASES)`` CUDA tensors
    from ``tensors``, puts ``{case: {"issued": bool, "after": bool, "del_s": float}}`` on
    ``results``, then waits for everything it queued before it returns."""
    import torch

    torch.cuda.set_device(0)
    copy_stream = torch.cuda.Stream()
    idle_stream = torch.cuda.Stream()
    torch.cuda.set_stream(copy_stream)  # current for the process's life, as schedule_stream
    out: dict[str, dict[str, Any]] = {}
    keep = []
    for case in CASES:
        t = tensors.get()
        dst = torch.empty_like(t)
        torch.cuda._sleep(cycles)
        dst.copy_(t)
        done = torch.cuda.Event()
        done.record()
        issued = done.query()
        if case == "view_kept":
            keep.append(t[:1])
        t0 = time.perf_counter()
        if case == "other_stream":
            with torch.cuda.stream(idle_stream):
                del t
        else:
            del t
        del_s = time.perf_counter() - t0
        out[case] = {"issued": issued, "after": done.query(), "del_s": round(del_s, 3)}
        copy_stream.synchronize()  # (the next case starts from an idle stream)
    results.put(out)
    torch.cuda.synchronize()
    keep.clear()
